"""`pytorch_model.bin` (what the original EAGLE-3 release ships) read without torch: `torch.save`'s zip archive
(`<name>/data.pkl` + one raw little-endian file per storage, `<name>/data/<key>`) through a restricted unpickler.

The pickle may only name what a saved state dict holds: an OrderedDict, `torch._utils._rebuild_tensor_v2` /
`_rebuild_parameter`, and the typed storage classes (mapped to numpy dtypes); anything else is refused by name
before it can run, so a hostile file cannot execute code. Tensors come back as numpy arrays (bfloat16 as
`ml_dtypes.bfloat16`), each behind the same `.read()` / `.shape` entry the safetensors reader gives.
"""

from __future__ import annotations

import collections
import pickle
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np

from parse_jax.errors import CheckpointError

BIN_FILE = "pytorch_model.bin"

STORAGE_DTYPES = {
    "FloatStorage": np.float32, "HalfStorage": np.float16, "BFloat16Storage": ml_dtypes.bfloat16,
    "DoubleStorage": np.float64, "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
    "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}


class _StorageType:
    def __init__(self, name: str) -> None:
        self.name, self.dtype = name, np.dtype(STORAGE_DTYPES[name])


class _Entry:
    """One tensor of the file, already read (the safetensors entry's interface)."""

    def __init__(self, value: np.ndarray) -> None:
        self.value, self.shape = value, list(value.shape)

    def read(self) -> np.ndarray:
        return self.value


def _rebuild_tensor(storage: np.ndarray, offset: int, size, stride, *_):
    """torch._utils._rebuild_tensor_v2: a strided view of the storage, copied out."""
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    if not size:
        return np.array(storage[offset])
    need = offset + 1 + sum((n - 1) * s for n, s in zip(size, stride) if n > 0)
    if any(n == 0 for n in size):
        return np.zeros(size, storage.dtype)
    if need > storage.size:
        raise CheckpointError(f"a tensor of shape {list(size)} reads past its storage of {storage.size} elements")
    view = np.lib.stride_tricks.as_strided(storage[offset:], size, [s * storage.itemsize for s in stride])
    return np.array(view)


def _rebuild_parameter(data, *_):
    return data


ALLOWED = {("collections", "OrderedDict"): collections.OrderedDict,
           ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
           ("torch._utils", "_rebuild_parameter"): _rebuild_parameter}


def read_torch_bin(path: str | Path) -> dict[str, _Entry]:
    """The tensors of a `torch.save`d state dict (zip format, torch >= 1.6), by name."""
    path = Path(path)
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{path} is not a torch zip checkpoint (torch.save's format since torch 1.6): "
                              f"{e}") from None
    with archive:
        pkl = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise CheckpointError(f"{path}: expected one data.pkl in the archive, found {len(pkl)}")
        prefix = pkl[0][: -len("data.pkl")]
        byteorder = prefix + "byteorder"
        if byteorder in archive.namelist() and archive.read(byteorder).strip() != b"little":
            raise CheckpointError(f"{path}: big-endian storages are not supported")
        storages: dict[str, np.ndarray] = {}

        class Restricted(pickle.Unpickler):
            def find_class(self, module: str, name: str):
                if (module, name) in ALLOWED:
                    return ALLOWED[(module, name)]
                if module == "torch" and name in STORAGE_DTYPES:
                    return _StorageType(name)
                raise CheckpointError(f"{path}: refusing to unpickle {module}.{name}: a weights file may only hold "
                                      "tensors (OrderedDict, torch rebuild functions, typed storages)")

            def persistent_load(self, pid):
                if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                        and isinstance(pid[1], _StorageType)):
                    raise CheckpointError(f"{path}: unexpected persistent id {pid!r} (only typed storages)")
                _, kind, key, _location, numel = pid
                if key not in storages:
                    try:
                        raw = archive.read(f"{prefix}data/{key}")
                    except KeyError:
                        raise CheckpointError(f"{path}: storage data/{key} is missing from the archive") from None
                    if len(raw) < int(numel) * kind.dtype.itemsize:
                        raise CheckpointError(f"{path}: storage data/{key} holds {len(raw)} bytes, "
                                              f"{numel} x {kind.dtype} needs more")
                    storages[key] = np.frombuffer(raw, kind.dtype, int(numel))
                return storages[key]

        try:
            state = Restricted(archive.open(pkl[0])).load()
        except CheckpointError:
            raise
        except Exception as e:  # a damaged pickle raises many types
            raise CheckpointError(f"{path}: cannot read data.pkl: {type(e).__name__}: {e}") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, np.ndarray)
                                              for k, v in state.items()):
        raise CheckpointError(f"{path} does not hold a state dict of tensors")
    return {k: _Entry(v) for k, v in state.items()}
