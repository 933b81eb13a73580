"""``python -m kernels.gpu.build`` with an nvcc that is missing or fails, and --arch spellings no load asks for
(CPU only: a fake nvcc in tmp_path)."""

import pytest

from kernels.gpu import build
from kernels.gpu._module import cubin_path


@pytest.fixture
def cubin_dir(tmp_path, monkeypatch):
    folder = tmp_path / "cubins"
    monkeypatch.setenv("QMOE_GPU_CUBIN_DIR", str(folder))
    return folder


def fake_nvcc(tmp_path, body: str):
    path = tmp_path / "nvcc"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def test_a_missing_nvcc_is_one_error_line_naming_it(tmp_path, cubin_dir, capsys):
    missing = tmp_path / "no" / "nvcc"
    with pytest.raises(SystemExit) as stop:
        build.main(["--nvcc", str(missing)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert str(missing) in line
    assert "--nvcc PATH names another; without a cubin the kernels are compiled by NVRTC at the first load" in line
    assert list(cubin_dir.glob("*.cu")) == []


def test_a_failing_nvcc_is_one_line_with_its_exit_status_and_leaves_no_source(tmp_path, cubin_dir, capfd):
    nvcc = fake_nvcc(tmp_path, 'echo "fake nvcc: syntax error" >&2\nexit 3')
    with pytest.raises(SystemExit) as stop:
        build.main(["--nvcc", str(nvcc), "--arch", "90"])
    assert stop.value.code == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[0] == "fake nvcc: syntax error"  # nvcc's own messages come first
    line = err.strip().splitlines()[-1]
    assert "status 3" in line and "sm_90a" in line
    assert list(cubin_dir.iterdir()) == []


def test_a_working_nvcc_prints_the_cubin_and_leaves_no_source(tmp_path, cubin_dir, capsys):
    # writes the file named after -o, as nvcc does
    nvcc = fake_nvcc(tmp_path, 'while [ "$1" != "-o" ]; do shift; done\necho cubin > "$2"')
    build.main(["--nvcc", str(nvcc), "--arch", "89"])
    out = cubin_path("89")
    assert capsys.readouterr().out.strip() == str(out)
    assert [p.name for p in cubin_dir.iterdir()] == [out.name]


@pytest.mark.parametrize("arch", ["90a", "sm_90", "9.0"])
def test_an_arch_not_given_as_the_loader_names_it_is_refused_before_nvcc_runs(tmp_path, cubin_dir, capsys, arch):
    """--arch 90a went to nvcc as sm_90a and wrote qmoe-sm90a-<hash>.cubin, a cubin no load asks for (the kernels ask
    for CuPy's compute capability, "90"): it printed its path and was never used."""
    nvcc = fake_nvcc(tmp_path, 'while [ "$1" != "-o" ]; do shift; done\necho cubin > "$2"')
    with pytest.raises(SystemExit) as stop:
        build.main(["--nvcc", str(nvcc), "--arch", arch])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"argument --arch: {arch!r} is not a compute capability as digits, e.g. 90 for 9.0 (sm_90a), 89 for 8.9")
    assert not cubin_dir.exists()


def test_a_cubin_folder_that_cannot_be_written_is_one_error_line_naming_it(tmp_path, monkeypatch, capsys):
    """The cubin folder is inside the package (a read-only site-packages for a user's install) unless
    QMOE_GPU_CUBIN_DIR names another: one that cannot be made or written ended in a raw OSError traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("QMOE_GPU_CUBIN_DIR", str(blocker / "cubins"))
    nvcc = fake_nvcc(tmp_path, "exit 0")
    with pytest.raises(SystemExit) as stop:
        build.main(["--nvcc", str(nvcc)])
    assert stop.value.code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"python -m kernels.gpu.build: error: cannot write the cubin to {blocker / 'cubins'}: Not a directory "
        "(QMOE_GPU_CUBIN_DIR names another folder, which the kernels' loads then look in)")
