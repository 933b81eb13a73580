"""packaging/select_runtime.py's choice of onnxruntime build and the Makefile around it: no network, no GPU (the
driver and the Python version are given; make runs with -n, printing what it would do)."""

from __future__ import annotations

import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "packaging"))
from select_runtime import choose  # noqa: E402


def test_runtime_selection():
    assert choose(None) == "cpu"
    assert choose(580) == "cuda13" and choose(550) == "cuda12"
    assert choose(None, "cuda13") == "cuda13"
