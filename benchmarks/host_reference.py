"""The host-side packer and verification pass that some benchmarks time or build inputs with: the tests' reference
(tests/verify/layout_reference.py; the library packs and scores on the device), importable when a benchmark runs as
a script from a source checkout (benchmarks/ is then on sys.path, the checkout is put there too)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.verify.layout_reference import pack, pad_blocks, sharded_verify_pass, verify_pass  # noqa: E402

__all__ = ["pack", "pad_blocks", "sharded_verify_pass", "verify_pass"]
