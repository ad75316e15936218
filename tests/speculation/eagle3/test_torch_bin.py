"""The original release's `pytorch_model.bin`, written here by `torch.save` itself, is read without torch: the
head equals the safetensors one; strided, bfloat16 and shared storages come back as torch laid them out; a pickle
naming anything but tensors is refused with one line."""

import io
import pickle
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from parse_jax.errors import CheckpointError
from parse_jax.speculation.eagle3 import head_layout, load_eagle3
from parse_jax.speculation.eagle3.torch_bin import read_torch_bin
from tests.speculation.eagle3.test_formats import FIXTURES, fixture_target

torch = pytest.importorskip("torch")  # the test extra's; never imported by parse-jax at run time


def release_as_bin(tmp_path: Path) -> Path:
    out = tmp_path / "release_bin"
    shutil.copytree(FIXTURES / "original", out)
    weights = safetensors.numpy.load_file(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    torch.save({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in weights.items()}, out / "pytorch_model.bin")
    return out


def test_a_bin_head_equals_the_safetensors_head(tmp_path):
    target = fixture_target()
    folder = release_as_bin(tmp_path)
    assert head_layout(folder) == "eagle3-release"
    a, b = load_eagle3(FIXTURES / "original", target), load_eagle3(folder, target)
    assert a.config == b.config
    flat_a = {k: np.asarray(v) for k, v in _flat(a.params).items()}
    flat_b = {k: np.asarray(v) for k, v in _flat(b.params).items()}
    assert flat_a.keys() == flat_b.keys() and len(flat_a) > 5
    for k in flat_a:
        np.testing.assert_array_equal(flat_a[k], flat_b[k], err_msg=k)
    code = ("import sys; from parse_jax.speculation.eagle3.torch_bin import read_torch_bin; "
            f"read_torch_bin({str(folder / 'pytorch_model.bin')!r}); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def test_strided_shared_and_bfloat16_storages(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {"t": base.t(), "row": base[2], "same": base, "bf": torch.linspace(-2, 2, 7).to(torch.bfloat16),
             "ids": torch.tensor([3, -1, 7], dtype=torch.int64), "mask": torch.tensor([True, False, True]),
             "param": torch.nn.Parameter(torch.ones(2, 2) * 3)}
    torch.save(state, tmp_path / "w.bin")
    got = read_torch_bin(tmp_path / "w.bin")
    for k, v in state.items():
        ref = v.detach().float().numpy() if k == "bf" else v.detach().numpy()
        arr = got[k].read()
        if k == "bf":
            assert arr.dtype == ml_dtypes.bfloat16
            arr = arr.astype(np.float32)
        np.testing.assert_array_equal(arr, ref, err_msg=k)
        assert got[k].shape == list(v.shape)


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_anything_but_tensors_is_refused(tmp_path):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"w": _Evil()}, protocol=4))
    (tmp_path / "evil.bin").write_bytes(buf.getvalue())
    with pytest.raises(CheckpointError, match=r"refusing to unpickle builtins\.print"):
        read_torch_bin(tmp_path / "evil.bin")
    (tmp_path / "legacy.bin").write_bytes(pickle.dumps({"w": 1}))
    with pytest.raises(CheckpointError, match="not a torch zip checkpoint"):
        read_torch_bin(tmp_path / "legacy.bin")
