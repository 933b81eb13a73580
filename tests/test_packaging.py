"""The wheel `pip install .` builds holds what the app loads from its own folder at run time (pyproject.toml's
package-data): a file left out works in the checkout and is missing once installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

from tests.conftest import REPO

PACKAGES = ("app", "engine", "kernels")  # pyproject.toml's packages.find


def built_wheel(source) -> zipfile.ZipFile:
    """This checkout's wheel, built offline from a copy of its sources at `source` (no build/ or .egg-info left in the
    checkout; the kernels' prebuilt cubins, kernels/gpu/_build, are this machine's, never shipped)."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source)
    for package in PACKAGES:
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__", "_build"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index",
                            "--no-build-isolation", "--wheel-dir", str(source / "dist"), str(source)],
                           capture_output=True, text=True)
    assert built.returncode == 0, "pip wheel failed: " + built.stderr.strip().rsplit("\n", 1)[-1]
    return zipfile.ZipFile(next((source / "dist").glob("moe_workbench-*.whl")))


def test_the_wheel_holds_the_window_icon_where_the_app_loads_it_and_every_file_of_its_packages(tmp_path):
    from app.gui.main_window import ICON

    with built_wheel(tmp_path) as wheel:
        names = set(wheel.namelist())
    assert ICON.relative_to(REPO).as_posix() in names
    files = {path.relative_to(tmp_path).as_posix() for package in PACKAGES for path in (tmp_path / package).rglob("*")
             if path.is_file()}
    assert files - names == set()
