"""The CPU kernels' Numba cache folder follows their source (kernels/cpu/numba_cache.py)."""
from __future__ import annotations

import shutil

import numba

from kernels.cpu import numba_cache


def test_cache_folder_changes_with_any_kernel_source(tmp_path, monkeypatch):
    copy = tmp_path / "cpu"
    shutil.copytree(numba_cache.HERE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(numba_cache, "HERE", copy)
    before = numba_cache.source_digest()
    assert before == numba_cache.source_digest()
    simd = copy / "simd.py"
    simd.write_text(simd.read_text() + "\n# an edit to the intrinsics alone\n")
    assert numba_cache.source_digest() != before


def test_cache_goes_under_numba_cache_dir_when_set(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(numba.config, "CACHE_DIR", numba.config.CACHE_DIR)
    folder = numba_cache.configure()
    assert folder.parent == tmp_path and folder.name == f"cpu-kernels-{numba_cache.source_digest()}"
    assert numba.config.CACHE_DIR == str(folder)
