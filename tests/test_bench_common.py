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


def test_bench_overhead_writes_the_date_its_run_started(tmp_path, monkeypatch):
    """bench_overhead named its result file and dated it by the date at the end of its run, where every other
    benchmark takes the run's start (common.RUN_DATE): a run that crossed midnight was filed under the next day. Its
    file is now named and dated by RUN_DATE, as write_result's are."""
    import datetime
    import json

    import benchmarks.bench_overhead as bench
    import benchmarks.common as common
    from engine.writer import write_model
    from tests.test_offload import SPEC

    for module, name, _bucket in bench.wrapped_module_functions():  # wrapped for good by instrument(): put back
        monkeypatch.setattr(module, name, getattr(module, name))
    started = datetime.date.fromisoformat(common.RUN_DATE)

    class Clock(datetime.date):
        @classmethod
        def today(cls):
            return started + datetime.timedelta(days=1)  # the run ends after midnight

    monkeypatch.setattr(bench, "write_model_once", lambda folder, layers: write_model(folder / "m", SPEC))
    monkeypatch.setattr(bench, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(datetime, "date", Clock)
    monkeypatch.setattr(sys, "argv", ["bench_overhead.py", "--points", "cpu", "--steps", "2", "--rounds", "1",
                                      "--folder", str(tmp_path), "--label", "midnight"])
    bench.main()
    written = list((tmp_path / "results").iterdir())
    assert [path.name for path in written] == [
        f"overhead-{common.RUN_DATE}-{common.machine_tag(common.machine())}-midnight.json"]
    assert json.loads(written[0].read_text())["date"] == common.RUN_DATE
