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


def test_a_benchmarks_model_is_written_once_per_spec(tmp_path, monkeypatch):
    """written_model: another spec (fewer layers) gets a folder of its own, never the model written for another; the
    same spec is written once and reused."""
    import engine.writer
    from benchmarks.common import written_model
    from engine.writer import WriterSpec

    written = []
    monkeypatch.setattr(engine.writer, "write_model",
                        lambda path, spec: written.append(spec) or (path.mkdir(parents=True),
                                                                    (path / "genai_config.json").write_text("{}")))
    full, few = WriterSpec(layers=48, seed=7), WriterSpec(layers=16, seed=7)
    first = written_model(tmp_path, full)
    assert written_model(tmp_path, few) != first
    assert written_model(tmp_path, full) == first and written == [full, few]
