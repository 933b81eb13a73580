"""benchmarks/common.py: where a benchmark writes its model."""
import subprocess
import sys
from pathlib import Path

from benchmarks.common import model_folder
from tests.conftest import REPO


def test_a_given_model_folder_is_kept_and_a_temporary_one_is_removed_at_exit(tmp_path):
    assert model_folder(str(tmp_path / "kept"), "bench-test-") == tmp_path / "kept"
    script = ("from benchmarks.common import model_folder; folder = model_folder(None, 'bench-test-'); "
              "(folder / 'model.onnx').write_bytes(b'x' * 1024); print(folder)")
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    folder = run.stdout.strip()
    assert "bench-test-" in folder
    assert not Path(folder).exists()  # a full-size model is gigabytes: none left in /tmp
