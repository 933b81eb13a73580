"""Shared test set-up: fixture model folders, the offscreen Qt platform, the gpu marker, the Haswell check started
early."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# The offload engine's layer-split trials decide from wall-clock step times (engine/offload/layer_split.py): tests must
# not depend on how fast the machine runs, so the budget stays spread unless a test drives the trials itself
# (tests/test_layer_split.py).
os.environ.setdefault("MOE_LAYER_SPLIT", "spread")
# The same for the decode path's trials (engine/offload/decode_path.py): cold experts on the CPU unless a test asks
# for the host tier or drives the trials itself.
os.environ.setdefault("MOE_DECODE_PATH", "cpu")
# The suite's run history and saved configurations in a folder of its own (platformdirs' user data folder follows
# XDG_DATA_HOME): a window test that runs a scenario saved into the developer's own history, and failed where a newer
# moe-workbench had written that file.
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="moe-workbench-tests-")

REPO = Path(__file__).resolve().parents[1]
# The fixture folders beside the checkout; MOE_WORKBENCH_FIXTURES points elsewhere (a machine where the
# checkout travels without them).
FIXTURES = Path(os.environ.get("MOE_WORKBENCH_FIXTURES") or REPO.parent / "shared" / "fixtures" / "genai")
FIXTURE_NAMES = ("gptoss", "lfm2moe", "qwen35moe")


def _have_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _have_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _gpu_state_released(request):
    """After each gpu test, the CUDA devices it opened closed (tests/gpu_state.py): the next test starts without
    them."""
    yield
    if request.node.get_closest_marker("gpu") is not None:
        from tests.gpu_state import release_gpu_state

        release_gpu_state()


_DESELECTED = pytest.StashKey[bool]()


def pytest_deselected(items):
    if items:  # -k, -m, --lf, --sw, --deselect
        items[0].config.stash[_DESELECTED] = True


def pytest_collection_finish(session):
    _start_haswell_check(session.config, session.items)


def _start_haswell_check(config, items) -> None:
    """test_cpu_kernels_without_avx512's subprocess compiles every kernel again for a CPU without AVX-512: 4-5
    minutes with a cold Numba cache (a third of the suite on the 2-core dev VM), one core busy while this process
    waited. Started once collection shows the test will run (`items`: what is left once -k, -m, --lf or --deselect
    have deselected theirs), it compiles beside the other tests.

    A run of the whole suite (no paths given, no test deselected, no --lf) has the same process compile the native
    kernels that its later tests would compile first (tests/warm_kernels.py), before the Haswell check, which comes
    near the end: on an empty Numba cache those tests then load them. A run of a few tests does not: they reach
    their kernels at once, and the two would compile the same ones."""
    if any(item.nodeid.endswith("test_cpu_kernels_without_avx512") for item in items):
        from tests import haswell_check, warm_kernels

        whole = (config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.stash.get(_DESELECTED, False)
                 and not config.getoption("lf", False))
        haswell_check.running = haswell_check.Check(warm=tuple(warm_kernels.PARTS) if whole else ())


def pytest_sessionfinish(session, exitstatus):
    from tests import haswell_check

    if haswell_check.running is not None:  # started, never read (a run stopped early): not left behind
        haswell_check.running.stop()
        haswell_check.running = None


def dist_info(folder: Path, name: str, version: str) -> None:
    """An installed distribution's metadata in `folder`, as pip writes it (what importlib.metadata reads)."""
    info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def gpu_build_beside_a_shadowed_cpu_build(tmp_path: Path, monkeypatch) -> Path:
    """The GPU machine's path: onnxruntime-gpu 1.31.1 imported from one folder, a system onnxruntime 1.30.0 in a later
    one (shadowed); returns the imported one's folder."""
    from types import SimpleNamespace

    import engine.ort_env as ort_env

    imported, shadowed = tmp_path / "imported", tmp_path / "shadowed"
    dist_info(imported, "onnxruntime-gpu", "1.31.1")
    dist_info(shadowed, "onnxruntime", "1.30.0")
    monkeypatch.setattr(sys, "path", [str(imported), str(shadowed)])
    monkeypatch.setattr(ort_env, "ort", SimpleNamespace(__file__=str(imported / "onnxruntime" / "__init__.py")))
    return imported


def fixture_folder(name: str) -> Path:
    path = FIXTURES / name
    if not path.is_dir():
        pytest.skip(f"fixture model folder {path} is not present")
    return path


def timed_sweep_warm_up(monkeypatch, seconds: float = 0.0451) -> list:
    """A sweep's unrecorded warm-up answer (engine.records.sweep.warm_up_answer) made as it is, said to take `seconds`;
    returns the list of the budgets it ran at, filled as it runs."""
    import engine.records.sweep as sweep

    real_warm_up, budgets = sweep.warm_up_answer, []

    def warm_up(model, cancel=None):
        budgets.append(model.offload.plan.budget_bytes)
        real_warm_up(model, cancel)
        return seconds

    monkeypatch.setattr(sweep, "warm_up_answer", warm_up)
    return budgets


@pytest.fixture
def copy_fixture(tmp_path):
    """A writable copy of a fixture folder, for tests that damage it."""
    def make(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(fixture_folder(name), target)
        for file in target.iterdir():
            file.chmod(0o644)
        return target
    return make


# what Python shows on standard error by default, outside __main__ (warnings' default filters ignore the rest)
_HIDDEN_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


@pytest.fixture
def cli(capfd, monkeypatch):
    """`moe-workbench ARGS` run in this process (app.cli.main, which `python -m app` calls): a CompletedProcess with
    its exit status and what it wrote to standard output and error, the file descriptors' included (onnxruntime's
    logger) and the warnings Python would have printed. A process each costs seconds of imports and kernel loads;
    what only a process shows (the exit of `python -m app`, an import that fails, a hang) keeps a test of its own."""
    from app.cli import main

    def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        capfd.readouterr()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            try:
                status = main(list(args))
            except SystemExit as exc:  # argparse's own refusals
                status = exc.code
        out, err = capfd.readouterr()
        err += "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno)
                       for w in caught if not issubclass(w.category, _HIDDEN_WARNINGS))
        return subprocess.CompletedProcess(["moe-workbench", *args], status, out, err)
    return run
