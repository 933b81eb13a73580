"""packaging/select_runtime.py's choice of onnxruntime build and the Makefile around it: no network, no GPU (the
driver and the Python version are given; make runs with -n, printing what it would do)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "packaging"))
from select_runtime import choose  # noqa: E402

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def test_runtime_selection():
    assert choose(None) == "cpu"
    assert choose(580) == "cuda13" and choose(550) == "cuda12"
    assert choose(None, "cuda13") == "cuda13"


def make_dry_run(tmp_path, *goals, runtime: str | None = None) -> subprocess.CompletedProcess:
    """`make -n GOALS` for a .venv in tmp_path (so nothing is up to date), with MOE_WORKBENCH_RUNTIME=runtime."""
    env = {k: v for k, v in os.environ.items() if k != "MOE_WORKBENCH_RUNTIME" and not k.startswith("MAKE")}
    if runtime is not None:
        env["MOE_WORKBENCH_RUNTIME"] = runtime
    return subprocess.run(["make", "-n", *goals, f"PYTHON={sys.executable}", f"VENV={tmp_path / 'venv'}"],
                          cwd=REPO, env=env, capture_output=True, text=True)


@needs_make
def test_make_stops_on_a_runtime_it_cannot_install(tmp_path):
    # it went on with an empty choice: uninstalled the CPU build and installed ".[,test]", no onnxruntime at all
    done = make_dry_run(tmp_path, "install", runtime="gpu")
    assert done.returncode != 0
    assert "MOE_WORKBENCH_RUNTIME must be one of cpu, cuda12, cuda13, got 'gpu'" in done.stderr
    assert "pip" not in done.stdout
    assert make_dry_run(tmp_path, "clean", runtime="gpu").returncode == 0
