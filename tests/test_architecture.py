"""Project rules that are checked, not hoped for."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.conftest import REPO

QT_MODULES = ("PySide6", "pyqtgraph", "shiboken6", "PyQt5", "PyQt6")


def test_engine_and_kernels_never_import_qt():
    offenders = []
    for package in ("engine", "kernels"):
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in QT_MODULES]
    assert offenders == []


def test_engine_import_loads_no_qt_module():
    code = ("import sys, engine.generation, engine.writer, kernels.reference; "
            f"print([m for m in sys.modules if m.split('.')[0] in {QT_MODULES!r}])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_two_onnxruntime_builds_are_refused():
    import pytest

    from engine.errors import WorkbenchError
    from engine.ort_env import installed_onnxruntime_builds, require_single_build

    require_single_build(installed_onnxruntime_builds())  # this environment has exactly one
    with pytest.raises(WorkbenchError, match="onnxruntime 1.32.0, onnxruntime-gpu 1.31.1") as refused:
        require_single_build(["onnxruntime 1.32.0", "onnxruntime-gpu 1.31.1"])
    assert "make clean install" in str(refused.value)  # make install alone finds its stamp and does nothing


def test_a_load_beside_two_onnxruntime_builds_says_that_alone(monkeypatch):
    """The refusal is about the installation, not the model: no model file or dense part named before it."""
    import pytest

    import engine.ort_env as ort_env
    from engine.errors import WorkbenchError
    from engine.generation import LoadedModel
    from tests.conftest import fixture_folder

    monkeypatch.setattr(ort_env, "installed_onnxruntime_builds",
                        lambda: ["onnxruntime 1.32.0", "onnxruntime-gpu 1.31.1"])
    ort_env._require_single_build_once.cache_clear()
    try:
        with pytest.raises(WorkbenchError) as refused:
            LoadedModel.open(fixture_folder("gptoss"))
    finally:
        ort_env._require_single_build_once.cache_clear()
    assert str(refused.value).startswith("several onnxruntime builds are installed (onnxruntime 1.32.0, "
                                         "onnxruntime-gpu 1.31.1)"), refused.value


def test_inspect_beside_two_onnxruntime_builds_refuses_as_a_load_does(monkeypatch, capsys):
    """inspect called the model runnable ("runs: …") where every load was refused."""
    import engine.ort_env as ort_env
    from app.cli import main
    from tests.conftest import fixture_folder

    monkeypatch.setattr(ort_env, "installed_onnxruntime_builds",
                        lambda: ["onnxruntime 1.32.0", "onnxruntime-gpu 1.31.1"])
    ort_env._require_single_build_once.cache_clear()
    try:
        status = main(["inspect", str(fixture_folder("gptoss"))])
    finally:
        ort_env._require_single_build_once.cache_clear()
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert err.startswith("moe-workbench: error: several onnxruntime builds are installed (onnxruntime 1.32.0, "
                          "onnxruntime-gpu 1.31.1)"), err


def test_only_builds_beside_the_imported_module_conflict(tmp_path, monkeypatch):
    """Two builds installed in the folder onnxruntime is imported from overwrite each other's files; one in
    another folder of the path is shadowed (the GPU machine: its system onnxruntime beside a carried
    onnxruntime-gpu) and harmless."""
    import engine.ort_env as ort_env
    from tests.conftest import dist_info, gpu_build_beside_a_shadowed_cpu_build

    imported = gpu_build_beside_a_shadowed_cpu_build(tmp_path, monkeypatch)
    assert ort_env.installed_onnxruntime_builds() == ["onnxruntime-gpu 1.31.1"]
    dist_info(imported, "onnxruntime", "1.32.0")
    assert ort_env.installed_onnxruntime_builds() == ["onnxruntime 1.32.0", "onnxruntime-gpu 1.31.1"]


def test_the_qmoe_oracle_is_onnxruntime_1_32s(monkeypatch):
    """A GPU build (onnxruntime-gpu 1.31 on a CUDA 13 driver) refuses or computes differently some layouts the 1.32
    contract has: `make test` on a GPU workstation failed 15 oracle tests. Those tests are skipped there."""
    import onnxruntime
    import pytest

    from tests.qmoe_oracle import require_oracle

    require_oracle()  # this environment's CPU build is the oracle
    monkeypatch.setattr(onnxruntime, "__version__", "1.31.1")
    with pytest.raises(pytest.skip.Exception, match="onnxruntime 1.31.1 predates the 1.32 QMoE contract"):
        require_oracle()
