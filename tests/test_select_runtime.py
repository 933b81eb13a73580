"""packaging/select_runtime.py's choice of onnxruntime build and the Makefile around it: no network, no GPU (the
driver and the Python version are given; make runs with -n, printing what it would do, or on a stand-in .venv)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "packaging"))
import select_runtime  # noqa: E402

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def choose(driver_major, override=None, python=(3, 12), machine="x86_64"):
    """The choice on a Python and a machine every build has wheels for, whichever runs the suite."""
    return select_runtime.choose(driver_major, override, python, machine)


def test_runtime_selection():
    assert choose(None) == "cpu"
    assert choose(580) == "cuda13" and choose(550) == "cuda12"
    assert choose(None, "cuda13") == "cuda13"


def test_a_driver_older_than_cuda_12_gets_the_cpu_build():
    # CUDA 11 drivers got the CUDA 12 build, whose CUDA execution provider and CuPy cannot run on them
    assert [choose(major) for major in (470, 520, 524, 525, 579)] == ["cpu", "cpu", "cpu", "cuda12", "cuda12"]
    assert "NVIDIA driver 470 is older than CUDA 12 needs (525)" in select_runtime.too_old_note(470, "cpu")
    assert select_runtime.too_old_note(None, "cpu") is None and select_runtime.too_old_note(550, "cuda12") is None


def test_a_python_the_wheels_do_not_exist_for_is_refused_before_install():
    # make went on to make .venv with it, pip refused the project there, and every later make used that .venv
    with pytest.raises(SystemExit, match="needs Python 3.11 or newer; this is 3.10"):
        choose(None, python=(3, 10))
    assert choose(None, python=(3, 14)) == "cpu" and choose(590, python=(3, 14)) == "cuda13"
    with pytest.raises(SystemExit, match="onnxruntime-gpu for CUDA 12 has no wheels for Python 3.14"):
        choose(550, python=(3, 14))
    with pytest.raises(SystemExit, match="no wheels for Python 3.14"):
        choose(None, "cuda12", python=(3, 14))
    assert choose(550, python=(3, 13)) == "cuda12"



def test_a_cuda_12_driver_on_arm_is_refused_before_install():
    # onnxruntime-gpu 1.22-1.23 has Linux wheels for x86-64 alone: a Grace Hopper with driver 550 got the cuda12 extra
    # and pip found no onnxruntime-gpu to install; the CUDA 13 build and the CPU build have aarch64 wheels
    with pytest.raises(SystemExit, match="onnxruntime-gpu for CUDA 12 has no wheels for aarch64: use a driver 580 or "
                                         "newer"):
        choose(550, machine="aarch64")
    with pytest.raises(SystemExit, match="no wheels for aarch64"):
        choose(None, "cuda12", machine="aarch64")
    assert choose(580, machine="aarch64") == "cuda13" and choose(None, machine="aarch64") == "cpu"
    assert choose(470, machine="aarch64") == "cpu"

PROPRIETARY = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024\n"
OPEN = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  "
        "(dvs-builder@U16-I3-B03-4-3)  Sun Jul 27 07:09:45 UTC 2025\nGCC version:  gcc version 12.3.0\n")


def test_driver_version_from_proc_or_nvidia_smi(tmp_path, monkeypatch):
    assert select_runtime.driver_major_in_proc(PROPRIETARY) == 535
    assert select_runtime.driver_major_in_proc(OPEN) == 580
    assert select_runtime.driver_major_in_smi("570.86.15\n570.86.15\n") == 570
    assert select_runtime.driver_major_in_smi("NVIDIA-SMI has failed because it couldn't communicate with the "
                                              "NVIDIA driver.\n") is None
    proc = tmp_path / "version"
    monkeypatch.setattr(select_runtime, "PROC_VERSION", proc)
    monkeypatch.setattr(select_runtime.shutil, "which", lambda name: None)
    assert select_runtime.nvidia_driver_version() is None  # neither /proc nor nvidia-smi
    proc.write_text(OPEN)
    assert select_runtime.nvidia_driver_version() == 580  # /proc alone (nvidia-smi not installed)



def test_driver_version_from_nvidia_smi_where_proc_says_none(tmp_path, monkeypatch):
    proc = tmp_path / "version"
    proc.write_text("NVRM version: a format no release wrote\n")
    monkeypatch.setattr(select_runtime, "PROC_VERSION", proc)
    monkeypatch.setattr(select_runtime.shutil, "which", lambda name: f"/usr/bin/{name}")
    answers = iter(["550.54.15\n", "No devices were found\n", subprocess.TimeoutExpired("nvidia-smi", 20)])
    asked = []

    def run(command, **kwargs):
        asked.append(command)
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return subprocess.CompletedProcess(command, 0, stdout=answer, stderr="")

    monkeypatch.setattr(select_runtime.subprocess, "run", run)
    assert [select_runtime.nvidia_driver_version() for _ in range(3)] == [550, None, None]
    assert asked == [["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]] * 3


@pytest.mark.skipif(select_runtime.PROC_VERSION.exists(), reason="an NVIDIA driver is loaded here: /proc names it")
@pytest.mark.parametrize("driver, chosen, note", [
    ("550.54.15", "cuda12", ""), ("580.65.06", "cuda13", ""), (None, "cpu", ""),
    ("470.256.02", "cpu", "NVIDIA driver 470 is older than CUDA 12 needs (525): installing the CPU build of "
                          "onnxruntime (a newer driver gets the GPU build)\n")])
def test_the_script_prints_the_build_for_the_driver_nvidia_smi_reports(tmp_path, driver, chosen, note):
    # what make's $(shell) reads: the choice alone on standard output, a note on standard error
    if chosen == "cuda12" and platform.machine() not in select_runtime.CUDA12_MACHINES:
        pytest.skip("the CUDA 12 build has no wheels for this machine (refused: tested above)")
    tools = tmp_path / "bin"
    tools.mkdir()
    if driver:
        smi = tools / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\necho {driver}\n")
        smi.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "MOE_WORKBENCH_RUNTIME"}
    env["PATH"] = str(tools)  # (no other nvidia-smi)
    done = subprocess.run([sys.executable, str(REPO / "packaging" / "select_runtime.py")], env=env, capture_output=True,
                          text=True)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{chosen}\n", note)

def make(tmp_path, *args, runtime: str | None = None) -> subprocess.CompletedProcess:
    """`make ARGS` for a .venv in tmp_path, with MOE_WORKBENCH_RUNTIME=runtime and the user's data folder there too."""
    env = {k: v for k, v in os.environ.items() if k != "MOE_WORKBENCH_RUNTIME" and not k.startswith("MAKE")}
    env["XDG_DATA_HOME"] = str(tmp_path / "data")
    if runtime is not None:
        env["MOE_WORKBENCH_RUNTIME"] = runtime
    return subprocess.run(["make", *args, f"PYTHON={sys.executable}", f"VENV={tmp_path / 'venv'}"],
                          cwd=REPO, env=env, capture_output=True, text=True)


@needs_make
def test_make_stops_on_a_runtime_it_cannot_install(tmp_path):
    # it went on with an empty choice: uninstalled the CPU build and installed ".[,test]", no onnxruntime at all
    done = make(tmp_path, "-n", "install", runtime="gpu")
    assert done.returncode != 0
    assert "MOE_WORKBENCH_RUNTIME must be one of cpu, cuda12, cuda13, got 'gpu'" in done.stderr
    assert "pip" not in done.stdout
    assert make(tmp_path, "-n", "clean", runtime="gpu").returncode == 0


@needs_make
def test_the_override_is_read_from_makes_command_line_too(tmp_path):
    # make install MOE_WORKBENCH_RUNTIME=cuda13 installed the CPU build: $(shell) saw the environment only
    env = {k: v for k, v in os.environ.items() if k != "MOE_WORKBENCH_RUNTIME" and not k.startswith("MAKE")}
    done = subprocess.run(["make", "-n", "install", f"PYTHON={sys.executable}", f"VENV={tmp_path / 'venv'}",
                           "MOE_WORKBENCH_RUNTIME=cuda13"], cwd=REPO, env=env, capture_output=True, text=True)
    assert '-e ".[cuda13,test]"' in done.stdout


def stand_in_venv(tmp_path, fail_install: bool = False):
    """A .venv whose python logs its arguments instead of running pip (and fails `pip install` if asked)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "pip.log"}\n'
                      + ('case "$*" in *"pip install --quiet -e"*) exit 1;; esac\n' if fail_install else ""))
    python.chmod(0o755)
    (venv / ".ready").touch()
    return venv


@needs_make
def test_a_switch_cut_short_is_redone_by_the_next_make(tmp_path):
    # the CPU build installed; a switch to CUDA 13 removes it and its install fails: the CPU stamp went only after a
    # successful install, so going back to the CPU build found it up to date and ran without onnxruntime
    venv = stand_in_venv(tmp_path, fail_install=True)
    (venv / ".installed-cpu").touch()
    assert make(tmp_path, "install", runtime="cuda13").returncode != 0
    assert not (venv / ".installed-cpu").exists()
    assert make(tmp_path, "install", runtime="cpu").returncode != 0  # tried again, not "nothing to be done"
    assert (tmp_path / "pip.log").read_text().count("pip install --quiet -e") == 2


@needs_make
def test_each_runtime_removes_the_builds_that_share_its_modules(tmp_path):
    # cuda12 -> cuda13 left cupy-cuda12x beside cupy-cuda13x, both installing the one `cupy` module
    removals = {runtime: [line for line in make(tmp_path, "-n", "install", runtime=runtime).stdout.splitlines()
                          if "pip uninstall" in line] for runtime in ("cpu", "cuda12", "cuda13")}
    assert [line.split("-y ")[1].split(" 2>")[0] for lines in removals.values() for line in lines] == [
        "onnxruntime-gpu", "onnxruntime cupy-cuda13x", "onnxruntime cupy-cuda12x"]


@needs_make
def test_a_venv_whose_creation_was_cut_short_is_made_afresh(tmp_path):
    # python was there and pip not: make skipped the venv and every install failed with "No module named pip"
    venv = stand_in_venv(tmp_path)
    assert "-m venv" not in make(tmp_path, "-n", "install", runtime="cpu").stdout
    (venv / ".ready").unlink()
    assert f"-m venv --clear {venv}" in make(tmp_path, "-n", "install", runtime="cpu").stdout



@needs_make
def test_a_venv_made_with_another_python_is_made_afresh(tmp_path):
    # make PYTHON=python3.13 after a .venv of 3.14 chose the CUDA 12 build for 3.13 and installed it into the 3.14
    # .venv, where onnxruntime-gpu 1.23 has no wheels (select_runtime's own refusal advised that command)
    venv = stand_in_venv(tmp_path)
    (venv / ".installed-cpu").touch()
    (venv / "pyvenv.cfg").write_text(f"home = /usr/bin\nversion = {sys.version_info[0]}.{sys.version_info[1]}.99\n")
    assert make(tmp_path, "-n", "install", runtime="cpu").stdout.count(str(venv)) == 0  # this Python's: up to date
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\nversion = 3.9.18\n")
    done = make(tmp_path, "-n", "install", runtime="cpu").stdout
    assert f"-m venv --clear {venv}" in done and '-m pip install --quiet -e ".[cpu,test]"' in done

def desktop_file_problems(path) -> str:
    validate = shutil.which("desktop-file-validate")
    return subprocess.run([validate, str(path)], capture_output=True, text=True).stdout if validate else ""


@needs_make
def test_make_desktop_installs_an_entry_that_runs_this_checkouts_venv(tmp_path):
    # the packaged entry runs moe-workbench from PATH, where make's .venv is not, and the README said no more than
    # that the file "installs it"; the entry's Version 1.5 is unknown to Debian 12's validator
    assert desktop_file_problems(REPO / "packaging" / "moe-workbench.desktop") == ""
    venv = stand_in_venv(tmp_path)
    (venv / ".installed-cpu").touch()
    done = make(tmp_path, "desktop", runtime="cpu")
    assert done.returncode == 0, done.stderr
    entry = tmp_path / "data" / "applications" / "moe-workbench.desktop"
    lines = entry.read_text().splitlines()
    assert f'Exec="{venv}/bin/moe-workbench" gui %f' in lines and f"TryExec={venv}/bin/moe-workbench" in lines
    assert (tmp_path / "data" / "icons" / "hicolor" / "scalable" / "apps" / "moe-workbench.svg").is_file()
    assert desktop_file_problems(entry) == ""


@needs_make
def test_make_desktop_in_a_checkout_whose_path_has_a_space(tmp_path):
    # Exec=/home/u/My Code/…/moe-workbench gui %f: the launcher ran "/home/u/My" with the rest as arguments; the
    # Desktop Entry specification quotes an argument with a space in double quotes (TryExec is a plain path)
    checkout = tmp_path / "My Code"
    checkout.mkdir()
    for name in ("Makefile", "pyproject.toml", "packaging", "resources"):
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, checkout / name)
    venv = stand_in_venv(checkout)
    (venv / ".installed-cpu").touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    env.update(XDG_DATA_HOME=str(tmp_path / "data"), MOE_WORKBENCH_RUNTIME="cpu")
    done = subprocess.run(["make", "desktop", f"PYTHON={sys.executable}", "VENV=venv"], cwd=checkout, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    entry = tmp_path / "data" / "applications" / "moe-workbench.desktop"
    lines = entry.read_text().splitlines()
    assert f'Exec="{venv}/bin/moe-workbench" gui %f' in lines and f"TryExec={venv}/bin/moe-workbench" in lines
    assert desktop_file_problems(entry) == ""
