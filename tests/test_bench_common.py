"""benchmarks/common.py: where a benchmark writes its model and its result file."""
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


def test_a_run_that_crosses_midnight_writes_one_result_file(tmp_path, monkeypatch):
    """write_result read the date at each write, so a benchmark that writes after every point (bench_offload_ab after
    each fraction) wrote a run crossing midnight into two files, the points before midnight in one. The date is the
    run's, read once as it starts: every write goes to one file, and the file's date is its name's."""
    import datetime
    import json
    from types import SimpleNamespace

    import benchmarks.common as common

    class Clock(datetime.date):
        days = iter([datetime.date(2026, 12, 7), datetime.date(2026, 12, 8)])

        @classmethod
        def today(cls):
            return next(cls.days)

    monkeypatch.setattr(common, "datetime", SimpleNamespace(date=Clock))
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    figure = {"name": "decode", "value": 1.0, "unit": "tokens/s", "reference": None, "reference_value": None,
              "ratio": None}
    first = common.write_result("midnight", [figure])
    second = common.write_result("midnight", [figure, figure])  # after midnight
    assert second == first and [path.name for path in tmp_path.iterdir()] == [first.name]
    written = json.loads(first.read_text())
    assert len(written["figures"]) == 2
    assert first.name.startswith(f"midnight-{written['date']}-")
