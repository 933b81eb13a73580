"""Run records as a user compares them: the answer settings and lengths they keep, the history file's own schema
version, and the columns its exports carry."""

from __future__ import annotations

import html
import json
import re

import pytest

from engine.generation import GenerationParams, LoadedModel
from engine.records.scenarios import run_scenario
from engine.records.schema import RunRecord
from engine.sampling import SamplingParams
from tests.conftest import fixture_folder

pytest.importorskip("PySide6")  # the record views are the window's (app.gui); the GPU machine has no Qt
from app.gui.record_report import compare_html, detail_html  # noqa: E402

SAMPLED = GenerationParams(max_new_tokens=5, stop_strings=("zzz",), sampling=SamplingParams(
    do_sample=True, temperature=0.7, top_k=5, top_p=0.9, seed=3))


@pytest.fixture(scope="module")
def model():
    return LoadedModel.open(fixture_folder("gptoss"))


@pytest.fixture(scope="module")
def sampled(model):
    return run_scenario(model, "short", SAMPLED, label="sampled")


@pytest.fixture(scope="module")
def greedy(model):
    return run_scenario(model, "short", GenerationParams(max_new_tokens=3), label="greedy")


def plain(html_text: str) -> str:
    return html.unescape(re.sub(r"\s+", " ", re.sub("<[^>]+>", " ", html_text)))


def older(record: RunRecord) -> RunRecord:
    """As a record written before the answer settings were kept reads."""
    return RunRecord.from_dict({k: v for k, v in record.to_dict().items() if k != "generation"})


def _view_saying(qtbot, history):
    """The history window's view of `history`, and the list its failure messages go to."""
    from app.gui.history_view import HistoryView

    view = HistoryView(history.path)
    qtbot.addWidget(view)
    said = []
    view.failed.connect(said.append)
    return view, said


def test_a_record_keeps_how_its_answers_were_asked_for_and_how_long_they_were(sampled, greedy):
    assert sampled.generation == {"max_new_tokens": 5, "do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9,
                                  "repetition_penalty": 1.0, "seed": 3, "stop_strings": ["zzz"], "reasoning": None}
    assert RunRecord.from_dict(json.loads(json.dumps(sampled.to_dict()))) == sampled
    assert 1 <= sampled.generated_tokens <= 5 and greedy.generated_tokens == 3
    detail = plain(detail_html(sampled))
    assert " answer length limit 5 tokens an answer " in detail
    assert " sampling temperature 0.7, top-k 5, top-p 0.9, seed 3 " in detail
    assert " stop texts zzz " in detail and " reasoning setting the template's default " in detail
    assert " sampling greedy " in plain(detail_html(greedy))


def test_an_answer_length_limit_of_one_token_is_said_in_the_singular(greedy):
    """A run recorded with Tokens 1 read "answer length limit 1 tokens an answer" in its detail."""
    one = RunRecord.from_dict(dict(greedy.to_dict(), generation=dict(greedy.generation, max_new_tokens=1)))
    assert " answer length limit 1 token an answer " in plain(detail_html(one))


def test_a_record_older_than_the_answer_settings_reads_and_says_they_are_not_recorded(sampled):
    old = older(sampled)
    assert old.generation == {}
    detail = plain(detail_html(old))
    assert " answer length limit not recorded " in detail and " sampling not recorded " in detail
    text = plain(compare_html(old, sampled))
    assert ("Not recorded in run A (a record older than them): answer length limit, sampling, stop texts, reasoning "
            "setting; whether the two runs asked for the same answers cannot be told.") in text
    assert "Not recorded in runs A and B" in plain(compare_html(old, old))
    assert "Not recorded" not in plain(compare_html(sampled, sampled))


def test_a_comparison_says_when_two_runs_asked_for_other_answers(sampled, greedy):
    text = plain(compare_html(greedy, sampled))
    assert "these runs differ in answer length limit, sampling, stop texts, tokens generated," in text
    assert " answer length limit 3 tokens an answer 5 tokens an answer " in text
    assert " sampling greedy temperature 0.7, top-k 5, top-p 0.9, seed 3 " in text
    assert f" tokens generated 3 {sampled.generated_tokens} " in text
    assert "Not like for like" not in plain(compare_html(sampled, sampled))


def test_record_says_how_many_tokens_its_answers_generated(tmp_path, capsys):
    from app.cli import main

    assert main(["record", str(fixture_folder("gptoss")), "--max-new-tokens", "4",
                 "--history", str(tmp_path / "h.sqlite3")]) == 0
    assert re.search(r"^short: run 1: 4 tokens generated \(at most 4 an answer\), load ", capsys.readouterr().out, re.M)
    assert main(["record", str(fixture_folder("gptoss")), "--max-new-tokens", "1",  # one token: not "1 tokens"
                 "--history", str(tmp_path / "h.sqlite3")]) == 0
    assert re.search(r"^short: run 2: 1 token generated \(at most 1 an answer\), load ", capsys.readouterr().out, re.M)


# the runs table as files written before the history kept a version of its own had it
LEGACY_TABLE = """CREATE TABLE runs (
    id INTEGER PRIMARY KEY, created TEXT, scenario TEXT, label TEXT, model TEXT, device TEXT,
    budget TEXT, load_s REAL, ttft_s REAL, decode_tokens_per_s REAL, completion_s REAL,
    peak_device_bytes INTEGER, peak_rss_bytes INTEGER, record TEXT NOT NULL)"""


def made_record(label: str = "made", answer: str = "an answer", folder: str = "/m/gptoss") -> RunRecord:
    """A record as a run writes one, without running a model (for the history's own behaviour)."""
    return RunRecord(scenario="short", created="2026-01-01T00:00:00+00:00", versions={"app": "source"}, machine={},
                     model={"folder": folder}, offload={"device": "cpu"},
                     timings={"load_s": 1.5, "time_to_first_token_s": 0.25, "decode_tokens_per_s": 12.0,
                              "completion_s": 2.0}, peaks={"device_bytes": None, "rss_bytes": 1 << 20, "rss_start_bytes": 1 << 19},
                     turns=[{"prompt": "p", "answer": answer, "generated_tokens": 3}], label=label,
                     host_load={"host_others_share": 0.0, "host_steal_share": 0.0})


def legacy_history(path, records: list[str]):
    import sqlite3

    from engine.records.history import SUMMARY

    with sqlite3.connect(path) as db:
        db.execute(LEGACY_TABLE)
        for index, text in enumerate(records):
            db.execute(f"INSERT INTO runs ({', '.join(SUMMARY[1:])}, record) VALUES ({', '.join('?' * len(SUMMARY))})",
                       (f"2026-01-0{index + 1}", "short", f"old {index}", "/m/gptoss", "cpu", "auto", 0.1, 0.01, 100.0,
                        0.5, None, 1 << 20, text))
    return path


def user_version(path) -> int:
    import sqlite3
    from contextlib import closing

    with closing(sqlite3.connect(path)) as db:
        return db.execute("PRAGMA user_version").fetchone()[0]


def test_a_history_file_keeps_its_own_schema_version(tmp_path, greedy):
    from engine.records.history import HISTORY_VERSION, History

    history = History(tmp_path / "h.sqlite3")
    history.add(greedy)
    assert HISTORY_VERSION == 5 and user_version(history.path) == 5
    assert History(history.path).get(1) == greedy and user_version(history.path) == 5


def test_an_older_history_is_brought_forward_with_every_run(tmp_path, greedy):
    from engine.records.history import SUMMARY, History

    path = legacy_history(tmp_path / "old.sqlite3", [json.dumps(older(greedy).to_dict()), '{"schema_version": 2'])
    assert user_version(path) == 0
    history = History(path, create=False)
    assert user_version(path) == 5
    rows = history.rows()
    assert [(row["id"], row["label"]) for row in rows] == [(2, "old 1"), (1, "old 0")]  # every run, damaged one too
    assert rows[1]["generated_tokens"] == 3 and rows[1]["turns"] == 1 and rows[1]["max_new_tokens"] is None
    assert rows[1]["model_sha256"] == greedy.model["onnx_sha256"] and rows[0]["generated_tokens"] is None
    assert history.get(1) == older(greedy)
    assert list(rows[1])[:len(SUMMARY)] == list(SUMMARY) and rows[1]["completion_s"] == 0.5  # as they were
    assert history.add(greedy) == 3 and history.rows(ids=[3])[0]["max_new_tokens"] == 3
    History(path)  # opened again: nothing more to do
    assert len(history.rows()) == 3


def test_a_newer_history_or_another_programs_database_is_refused_in_one_line_and_left_as_it_is(tmp_path, capsys):
    import sqlite3

    from app.cli import main
    from engine.errors import WorkbenchError
    from engine.records.history import History

    newer = legacy_history(tmp_path / "newer.sqlite3", [])
    with sqlite3.connect(newer) as db:
        db.execute("PRAGMA user_version = 6")
    before = newer.read_bytes()
    with pytest.raises(WorkbenchError, match=r"newer.sqlite3: a run history of version 6, newer than this app reads "
                                             r"\(5\): open it with a newer moe-workbench, or name another file$"):
        History(newer)
    assert main(["history", "--history", str(newer)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"moe-workbench: error: {newer}: a run history of version 6")
    assert newer.read_bytes() == before

    other = tmp_path / "notes.db"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE notes (text TEXT)")
    before = other.read_bytes()
    with pytest.raises(WorkbenchError, match="notes.db: not a run history .another program's database: no runs "
                                             "table, its tables notes.$"):
        History(other)
    assert other.read_bytes() == before


def test_the_exports_carry_what_a_spreadsheet_compares_runs_by(tmp_path, sampled, greedy):
    import csv
    import io

    from engine.records.history import SUMMARY, History

    history = History(tmp_path / "h.sqlite3")
    history.add(greedy)
    history.add(older(sampled))
    history.add(sampled)
    rows = list(csv.DictReader(io.StringIO(history.export("csv"))))
    header = list(rows[0])
    assert header[:len(SUMMARY)] == list(SUMMARY)  # the summary columns' names and order as they were
    new = rows[0]
    assert (new["generated_tokens"], new["max_new_tokens"], new["do_sample"], new["temperature"], new["top_k"],
            new["top_p"], new["seed"], new["stop_strings"]) == (str(sampled.generated_tokens), "5", "1", "0.7", "5",
                                                                 "0.9", "3", '["zzz"]')
    assert new["prompt_tokens"] == str(sampled.turns[0]["prompt_tokens"]) and new["turns"] == "1"
    assert float(new["prefill_s"]) == pytest.approx(sampled.timings["prefill_s"])
    assert new["rss_start_bytes"] == str(sampled.peaks["rss_start_bytes"]) and new["placement_mode"] == "cpu_only"
    assert float(new["host_others_share"]) == pytest.approx(sampled.host_load["host_others_share"])
    assert new["model_sha256"] == sampled.model["onnx_sha256"] and new["finish_reasons"]
    # an older record's settings: empty cells, its tokens all the same
    assert (rows[1]["max_new_tokens"], rows[1]["temperature"], rows[1]["generated_tokens"]) == (
        "", "", str(sampled.generated_tokens))
    assert rows[2]["do_sample"] == "0" and rows[2]["generated_tokens"] == "3"
    markdown = history.export("markdown").splitlines()
    assert markdown[0] == "| " + " | ".join(header) + " |" and len(markdown) == 5
    greedy_row = dict(zip(header, (cell.strip() for cell in markdown[4].strip("| ").split(" | "))))
    assert (greedy_row["generated_tokens"], greedy_row["max_new_tokens"], greedy_row["do_sample"]) == ("3", "3", "0")


NUMBER_VERSIONS = {"numpy": "2.2.6", "numba": "0.61.2", "cupy": "13.4.1", "cuda_runtime": 12080, "cuda_driver": 12090}


def test_the_exports_carry_the_versions_that_change_the_numbers(tmp_path):
    """A run's detail names NumPy, Numba, CuPy, the CUDA runtime and driver, and the GPU driver, yet the CSV and Markdown
    exports gave only the app's and onnxruntime's: two runs of other kernels' builds read alike in a spreadsheet."""
    import csv
    import io

    from engine.records.history import History

    record = made_record()
    record.versions = {"app": "source", "onnxruntime": {"version": "1.22.0"}, **NUMBER_VERSIONS}
    record.machine = {"gpus": [{"name": "NVIDIA H100", "driver": "570.86.15"}]}
    history = History(tmp_path / "h.sqlite3")
    history.add(record)
    history.add(made_record("older"))  # a record without them: empty cells
    rows = list(csv.DictReader(io.StringIO(history.export("csv"))))
    columns = ("numpy_version", "numba_version", "cupy_version", "cuda_runtime_version", "cuda_driver_version",
               "gpu_driver")
    assert [rows[1][column] for column in columns] == ["2.2.6", "0.61.2", "13.4.1", "12.8", "12.9", "570.86.15"]
    assert [rows[0][column] for column in columns] == [""] * len(columns)
    header = history.export("markdown").splitlines()[0]
    assert all(f" {column} " in header for column in columns)
    assert json.loads(history.export("json"))[1]["versions"]["numba"] == "0.61.2"


def test_a_version_2_history_is_brought_forward_with_the_versions_filled_from_its_records(tmp_path):
    import sqlite3

    from engine.records.history import History

    record = made_record()
    record.versions = {"app": "source", **NUMBER_VERSIONS}
    path = tmp_path / "h.sqlite3"
    History(path).add(record)
    with sqlite3.connect(path) as db:  # as version 2 wrote it: without the columns version 3 added
        for column in ("numpy_version", "numba_version", "cupy_version", "cuda_runtime_version", "cuda_driver_version",
                       "gpu_driver", "popularity_sha256"):
            db.execute(f"ALTER TABLE runs DROP COLUMN {column}")
        db.execute("PRAGMA user_version = 2")
    row = History(path, create=False).rows()[0]
    assert user_version(path) == 5
    assert (row["numba_version"], row["cuda_runtime_version"], row["gpu_driver"]) == ("0.61.2", "12.8", None)


def test_the_history_list_says_how_many_tokens_each_run_generated(tmp_path, capsys, greedy):
    from app.cli import main
    from engine.records.history import History

    History(tmp_path / "h.sqlite3").add(greedy)
    assert main(["history", "--history", str(tmp_path / "h.sqlite3")]) == 0
    assert "completion " in (out := capsys.readouterr().out) and "  3 tokens  " in out


def test_history_by_id_reads_the_runs_it_checks_and_prints_once(tmp_path, capsys, monkeypatch):
    """`history --id` read the history's rows three times: the ids checked against the runs, then against the other
    filters, then read again to print. It reads them once; a second read, of the ids not among them, says only which
    of those the history lacks."""
    from app.cli import main
    from engine.records.history import History

    path = tmp_path / "h.sqlite3"
    for label in ("first", "second"):
        History(path).add(made_record(label))
    reads, rows = [], History.rows
    monkeypatch.setattr(History, "rows", lambda self, **filters: reads.append(filters) or rows(self, **filters))
    assert main(["history", "--history", str(path), "--id", "2", "1", "--export", "csv"]) == 0
    assert [line.split(",")[:4] for line in capsys.readouterr().out.splitlines()[1:]] == [
        ["2", "2026-01-01T00:00:00+00:00", "short", "second"], ["1", "2026-01-01T00:00:00+00:00", "short", "first"]]
    assert reads == [{"model": None, "scenario": None, "label": None, "ids": [2, 1]}]
    reads.clear()
    assert main(["history", "--history", str(path), "--id", "1", "3", "2", "--label", "first"]) == 2
    assert capsys.readouterr().err == f"moe-workbench: error: {path}: no run 3\n"
    assert [read["ids"] for read in reads] == [[1, 3, 2], [2, 3]]
    assert main(["history", "--history", str(path), "--id", "1", "2", "--label", "first"]) == 2
    assert capsys.readouterr().err == f"moe-workbench: error: {path}: run 2 does not match --label 'first'\n"


def test_the_windows_history_shows_each_runs_tokens(qtbot, tmp_path, greedy):
    pytest.importorskip("pytestqt")
    from app.gui.history_view import HEADERS, HistoryView
    from engine.records.history import History

    History(tmp_path / "h.sqlite3").add(greedy)
    view = HistoryView(tmp_path / "h.sqlite3")
    qtbot.addWidget(view)
    assert view.table.item(0, HEADERS.index("tokens")).text() == "3"


def test_the_windows_history_names_a_file_it_cannot_read_once(qtbot, tmp_path):
    """It read "Could not read the history /x/h.sqlite3: /x/h.sqlite3: not a run history (…)": the file twice."""
    import sqlite3

    pytest.importorskip("pytestqt")
    from app.gui.history_view import HistoryView

    path = tmp_path / "h.sqlite3"
    view = HistoryView(path)  # no file yet: nothing read
    qtbot.addWidget(view)
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE notes (text TEXT)")
    said = []
    view.failed.connect(said.append)
    view.refresh()
    assert said == [f"Could not read the history: {path}: not a run history (another program's database: no runs "
                    "table, its tables notes)"]


def test_the_windows_history_names_a_run_it_cannot_open_once(qtbot, tmp_path, greedy):
    """It read "Could not read run 1: run 1 in /x/h.sqlite3: …": the run twice."""
    pytest.importorskip("pytestqt")
    import sqlite3

    from engine.records.history import History

    history = History(tmp_path / "h.sqlite3")
    run_id = history.add(greedy)
    newer = dict(greedy.to_dict(), schema_version=2, versions=dict(greedy.versions, app="0.9.0"))
    with sqlite3.connect(history.path) as db:
        db.execute("UPDATE runs SET record = ? WHERE id = ?", (json.dumps(newer), run_id))
    view, said = _view_saying(qtbot, history)
    view.select_ids([run_id])
    assert view.open_selected() is None
    assert said == [f"Could not read run {run_id} in {history.path}: written by a newer moe-workbench (0.9.0, run "
                    "record schema version 2; this one reads version 1)"]


def test_the_windows_history_gives_an_all_cpu_run_no_budget(qtbot, tmp_path, greedy):
    pytest.importorskip("pytestqt")
    from app.gui.history_view import HEADERS, HistoryView
    from engine.records.history import History

    history = History(tmp_path / "h.sqlite3")
    history.add(greedy)
    on_device = dict(greedy.to_dict(), offload=dict(greedy.offload, device="simulated GPU, 1.0 GiB", entries={
        "session.moe.offload.device_expert_bytes": "200000"}))
    history.add(RunRecord.from_dict(on_device))
    view = HistoryView(tmp_path / "h.sqlite3")
    qtbot.addWidget(view)
    budget = HEADERS.index("budget")
    # the all-CPU run's budget read "auto", as if the engine had chosen one on a device
    assert [view.table.item(row, budget).text() for row in (0, 1)] == ["195.3 KiB", "—"]


def test_an_automatic_budget_says_the_bytes_it_came_to_in_the_list_and_the_window(qtbot, tmp_path, capsys, greedy):
    """An automatic budget read "auto" in History and `history`, though the record keeps the bytes the plan came to
    (budget_bytes): two automatic runs of other budgets (side-by-side's B, beside A) read alike."""
    pytest.importorskip("pytestqt")
    from app.cli import main
    from app.gui.history_view import HEADERS, HistoryView
    from engine.records.history import History

    history = History(tmp_path / "h.sqlite3")
    for had in (None, 1288490188):  # a record older than budget_bytes, then one that keeps it
        offload = dict(greedy.offload, device="simulated GPU, 8.0 GiB", entries={}, budget_bytes=had)
        history.add(RunRecord.from_dict(dict(greedy.to_dict(), offload=offload)))
    view = HistoryView(tmp_path / "h.sqlite3")
    qtbot.addWidget(view)
    budget = HEADERS.index("budget")
    assert [view.table.item(row, budget).text() for row in (0, 1)] == ["auto (1.2 GiB)", "auto"]
    assert main(["history", "--history", str(history.path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "budget auto (1.2 GiB)  " in lines[0] and "budget auto  " in lines[1]


def test_a_run_under_mode_disabled_has_no_budget_in_the_list_or_the_export(tmp_path, capsys, greedy):
    """mode=disabled offloads no expert, so no expert budget applies (the record's budget_bytes is None): the list read
    "budget auto", or the device_expert_bytes given beside it ("budget 1000 B"), as if the run had had one."""
    from app.cli import main
    from engine.records.history import History

    history = History(tmp_path / "h.sqlite3")
    for entries in ({"session.moe.offload.mode": "disabled"},
                    {"session.moe.offload.mode": "disabled", "session.moe.offload.device_expert_bytes": "1000"}):
        offload = dict(greedy.offload, device="simulated GPU, 8.0 GiB", entries=entries, budget_bytes=None,
                       placement_mode="cpu_only")
        history.add(RunRecord.from_dict(dict(greedy.to_dict(), offload=offload)))
    assert main(["history", "--history", str(history.path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all("simulated GPU, 8.0 GiB        budget -  " in line for line in lines), lines
    assert [row["budget"] for row in history.rows()] == [None, None]


def test_a_time_under_a_millisecond_reads_as_such_not_as_none(sampled):
    from app.gui.record_report import fmt

    times = (fmt(3.2e-5, "s"), fmt(0.0, "s"), fmt(0.0123, "s"), fmt(1.5, "s"))
    assert times == ("32.0 µs", "0 ms", "12.3 ms", "1.50 s")
    layer = dict(sampled.layers[0] if sampled.layers else {}, hits=1, misses=2, cpu_s=3.2e-5, device_s=0.0)
    record = RunRecord.from_dict(dict(sampled.to_dict(), layers=[layer]))
    assert " 32.0 µs 0 ms " in plain(detail_html(record))  # the layer's CPU and device time


def test_a_simulated_cards_device_time_is_said_to_be_modelled(sampled):
    """A record on the simulated card showed a layer's 'device time' as 0.710 µs for 124 hits, read as a measured
    time: it is the card's model (each launch's experts read once at its HBM rate, summed over the run's launches;
    a fixture expert of 32 KiB is 32 ns at 1000 GB/s). The column and a line under the table say so."""
    layer = dict(sampled.layers[0] if sampled.layers else {}, hits=124, misses=2, cpu_s=3.2e-5, device_s=7.1e-7)
    projected = {"bandwidths": {"pcie_bytes_per_s": 25e9, "hbm_bytes_per_s": 1000e9}}
    record = RunRecord.from_dict(dict(sampled.to_dict(), layers=[layer],
                                      timings=dict(sampled.timings, projected=projected)))
    text = plain(detail_html(record))
    assert " CPU time device time (modelled) " in text and " 32.0 µs 0.710 µs " in text
    assert ("Device time on the simulated card is modelled, not measured: each launch reads its experts once at the "
            "card's 1000 GB/s, summed over the run's launches, with no launch overhead.") in text
    measured = plain(detail_html(RunRecord.from_dict(dict(sampled.to_dict(), layers=[layer]))))  # not simulated
    assert " CPU time device time " in measured and "modelled" not in measured


def test_a_label_of_two_lines_stays_in_its_markdown_row(tmp_path, greedy):
    from engine.records.history import History

    history = History(tmp_path / "h.sqlite3")
    history.add(RunRecord.from_dict(dict(greedy.to_dict(), label="tuned\nrun | b")))
    lines = history.export("markdown").splitlines()
    assert len(lines) == 3 and "| tuned run \\| b |" in lines[2]


def test_the_markdown_export_writes_numbers_plainly_with_each_columns_precision(tmp_path, greedy):
    """The Markdown export wrote every float with .4g: a completion of 12345.678 s read 1.235e+04 and a rate of
    23456.7 tok/s 2.346e+04, and a temperature of 0.00001 read 1e-05."""
    from engine.records.history import History

    history = History(tmp_path / "h.sqlite3")
    data = greedy.to_dict()
    timings = dict(data["timings"], completion_s=12345.678, decode_tokens_per_s=23456.74, load_s=0.5)
    generation = dict(data["generation"], temperature=0.00001, top_p=0.9)
    history.add(RunRecord.from_dict(dict(data, timings=timings, generation=generation,
                                         host_load=dict(data["host_load"], host_others_share=0.12345))))
    head, _rule, row = history.export("markdown").splitlines()
    cells = dict(zip(head.strip("| ").split(" | "), row.strip("| ").split(" | ")))
    assert (cells["completion_s"], cells["decode_tokens_per_s"], cells["load_s"]) == ("12345.678", "23456.7", "0.500")
    assert (cells["temperature"], cells["top_p"], cells["host_others_share"]) == ("0.00001", "0.9", "0.123")


def test_a_records_detail_names_the_gpu_and_the_onnxruntime_build(greedy):
    data = greedy.to_dict()
    gpu = dict(data, machine=dict(data["machine"], gpus=[{"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 85520809984,
                                                         "driver": "580.95.05"}]),
               versions=dict(data["versions"], onnxruntime={"version": "1.23.2", "build": "onnxruntime-gpu"},
                             cupy="13.6.0", cuda_runtime=12080, cuda_driver=13000))
    text = plain(detail_html(RunRecord.from_dict(gpu)))
    assert " GPU NVIDIA H100 80GB HBM3 (79.6 GiB, driver 580.95.05) " in text
    assert " onnxruntime 1.23.2 (onnxruntime-gpu) " in text and " CUDA runtime 12.8 CUDA driver 13.0 " in text
    none = dict(data, machine=dict(data["machine"], gpus=[]))
    assert " GPU none found (NVML) " in plain(detail_html(RunRecord.from_dict(none)))


def test_the_windows_history_gives_a_runs_time_on_the_users_clock(qtbot, tmp_path, greedy, monkeypatch):
    import time

    pytest.importorskip("pytestqt")
    from app.gui.history_view import HEADERS, HistoryView
    from engine.records.history import History

    monkeypatch.setenv("TZ", "Asia/Kolkata")  # UTC+5:30
    time.tzset()
    try:
        History(tmp_path / "h.sqlite3").add(RunRecord.from_dict(dict(greedy.to_dict(),
                                                                     created="2026-12-06T03:29:11+00:00")))
        view = HistoryView(tmp_path / "h.sqlite3")
        qtbot.addWidget(view)
        # it read 03:29:11, UTC's time, with nothing to say so
        assert view.table.item(0, HEADERS.index("created")).text() == "2026-12-06 08:59:11"
    finally:
        monkeypatch.undo()
        time.tzset()


def test_an_older_history_that_cannot_be_written_says_so_not_that_it_is_no_history(tmp_path, greedy, monkeypatch):
    import sqlite3

    from engine.errors import WorkbenchError
    from engine.records.history import History

    path = legacy_history(tmp_path / "old.sqlite3", [json.dumps(greedy.to_dict())])
    monkeypatch.setattr(History, "_connect", lambda self: sqlite3.connect(f"file:{self.path}?mode=ro", uri=True))
    with pytest.raises(WorkbenchError, match=r"old.sqlite3: not brought forward to version 5, which it needs to be "
                                             r"read \(attempt to write a readonly database\)$"):
        History(path, create=False)
    monkeypatch.undo()
    History(path)
    monkeypatch.setattr(History, "_connect", lambda self: sqlite3.connect(f"file:{self.path}?mode=ro", uri=True))
    assert History(path, create=False).rows()[0]["generated_tokens"] == 3  # once brought forward, read-only reads


def test_a_record_says_where_the_dense_part_ran(tmp_path, greedy):
    from engine.records.history import History

    assert greedy.offload["dense"] == {"device": "cpu", "reason": "no GPU device is in use"}
    assert " dense part on the CPU: no GPU device is in use " in plain(detail_html(greedy))
    data = greedy.to_dict()
    on_gpu = RunRecord.from_dict(dict(data, offload=dict(data["offload"], dense={"device": "cuda", "reason": "fits"})))
    text = plain(compare_html(greedy, on_gpu))
    assert "these runs differ in dense part," in text and " dense part cpu cuda " in text
    old = RunRecord.from_dict(dict(data, offload={k: v for k, v in data["offload"].items() if k != "dense"}))
    assert " dense part not recorded " in plain(detail_html(old))
    assert "dense part" not in plain(compare_html(old, on_gpu)).split("metric")[0]  # unknown: not said to differ
    history = History(tmp_path / "h.sqlite3")
    history.add(on_gpu)
    assert history.rows()[0]["dense_device"] == "cuda"


def test_a_run_with_every_expert_resident_says_so_not_that_it_decoded_on_the_cpu(tmp_path, capsys):
    """With every expert resident no expert is cold and no decode path runs: the record and the history said the
    path in force ("cpu"), which reads as decoding on the CPU; they say "all resident", older rows too (told by their
    placement mode)."""
    import csv
    import io
    import sqlite3
    from contextlib import closing

    from engine.offload import OffloadConfig, SimulatedDevice
    from engine.records.history import History

    device = SimulatedDevice(1 << 30)
    folder = fixture_folder("gptoss")
    resident = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=1 << 28), device=device)
    assert resident.offload.plan.placement_mode == "all_resident"
    record = run_scenario(resident, "short", GenerationParams(max_new_tokens=2), device)
    assert record.offload["decode_path"]["in_force"] == "all resident"
    data = record.to_dict()
    old = RunRecord.from_dict(dict(data, offload=dict(data["offload"], decode_path=dict(
        data["offload"]["decode_path"], in_force="cpu"))))  # as a record written before this said it
    path = tmp_path / "h.sqlite3"
    history = History(path)
    history.add(record)
    history.add(old)
    with closing(sqlite3.connect(path)) as db, db:  # an older row, its column filled from the path in force
        db.execute("UPDATE runs SET decode_path = 'cpu' WHERE id = 2")
    assert [row["decode_path"] for row in History(path).rows()] == ["all resident", "all resident"]
    rows = list(csv.DictReader(io.StringIO(history.export("csv"))))
    assert [row["decode_path"] for row in rows] == ["all resident", "all resident"]
    assert "| all resident |" in history.export("markdown").splitlines()[2]
    exported = json.loads(history.export("json"))  # whole records: the older one says it too
    assert [run["offload"]["decode_path"]["in_force"] for run in exported] == ["all resident", "all resident"]
    assert history.get(2).offload["decode_path"]["mode"] == record.offload["decode_path"]["mode"]


def test_a_folder_given_as_the_history_is_named_a_folder(tmp_path, capsys):
    """--history naming a folder read "not a run history (unable to open database file)": it says it is a folder and
    that a history file is wanted."""
    from app.cli import main
    from engine.errors import WorkbenchError
    from engine.records.history import History

    for create in (True, False):
        with pytest.raises(WorkbenchError) as caught:
            History(tmp_path, create=create)
        assert str(caught.value) == (f"{tmp_path}: a folder, not a run history file: name the history's SQLite file "
                                     f"(such as {tmp_path / 'history.sqlite3'})")
    assert main(["history", "--history", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"moe-workbench: error: {tmp_path}: a folder, not a run history file: name the " \
                                      f"history's SQLite file (such as {tmp_path / 'history.sqlite3'})\n"
    assert list(tmp_path.iterdir()) == []


def test_a_history_that_cannot_save_a_run_is_refused_before_the_run_is_measured(tmp_path, monkeypatch, capsys):
    import sqlite3
    from types import SimpleNamespace

    from app.cli import main
    from app.gui.records_jobs import ScenarioJob
    from engine.errors import WorkbenchError
    from engine.records.history import History

    path = tmp_path / "h.sqlite3"
    History(path).add(made_record())
    # as a read-only file (or one in a read-only folder) opens: tests run as root, whom file modes do not stop
    monkeypatch.setattr(History, "_connect", lambda self: sqlite3.connect(f"file:{self.path}?mode=ro", uri=True))
    assert len(History(path).rows()) == 1  # read as before

    def measured(*_args, **_kwargs):
        raise AssertionError("the model was loaded for runs that could not be saved")

    monkeypatch.setattr(LoadedModel, "open", measured)
    assert main(["record", str(fixture_folder("gptoss")), "--history", str(path)]) == 2
    assert capsys.readouterr().err == (f"moe-workbench: error: {path}: runs could not be saved there "
                                       "(attempt to write a readonly database)\n")
    with pytest.raises(WorkbenchError, match="h.sqlite3: runs could not be saved there"):
        ScenarioJob(["short"], 3, history_path=str(path))(SimpleNamespace(loaded=lambda: None))


def test_a_label_or_folder_given_in_bytes_that_are_not_utf8_is_saved(tmp_path):
    from engine.records.history import History

    history = History(tmp_path / "h.sqlite3")
    # `--label caf$'\xe9'` from a Latin-1 terminal, a folder named so: Python's lone surrogates for those bytes
    run_id = history.add(made_record(label="caf\udce9", folder="/models/m\udce9"))
    row = history.rows()[0]
    assert (row["label"], row["model"]) == ("caf\ufffd", "/models/m\ufffd")
    record = history.get(run_id)
    assert (record.label, record.model["folder"]) == ("caf\udce9", "/models/m\udce9")  # the record as it was given


def test_a_history_whose_folder_cannot_be_made_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    from app.cli import main
    from engine.generation import LoadedModel

    (tmp_path / "runs").write_text("a file where the history's folder is to be")
    path = tmp_path / "runs" / "h.sqlite3"
    monkeypatch.setattr(LoadedModel, "open", lambda *_a, **_k: pytest.fail("the model was loaded"))
    assert main(["record", str(fixture_folder("gptoss")), "--history", str(path)]) == 2  # not an internal error (3)
    assert capsys.readouterr().err == (f"moe-workbench: error: {path}: no history made there: its folder "
                                       f"{tmp_path / 'runs'} could not be made (File exists)\n")


def test_a_history_sqlite_cannot_open_is_not_called_another_kind_of_file(tmp_path):
    from engine.errors import WorkbenchError
    from engine.records.history import History

    path = tmp_path / "h.sqlite3"
    path.symlink_to(path)  # as a new file in a folder the user cannot write: SQLite cannot open it at all
    with pytest.raises(WorkbenchError) as refused:
        History(path)
    assert str(refused.value) == f"{path}: not opened (unable to open database file)"


def test_a_run_the_history_could_not_save_is_printed_not_lost(tmp_path, monkeypatch, capsys):
    import sqlite3

    from app.cli import main
    from engine.records import scenarios
    from engine.records.history import History

    path = tmp_path / "h.sqlite3"
    monkeypatch.setattr(History, "_connect", lambda self: sqlite3.connect(self.path, timeout=0.1))
    other = sqlite3.connect(path, isolation_level=None)

    def run_scenario(_model, name, *_args, **_kwargs):
        if name == "multiturn":  # another process begins a long write while the run is measured (as a full disk fails it)
            other.execute("BEGIN EXCLUSIVE")
        return made_record(label=name, answer=f"the {name} answer")

    monkeypatch.setattr(scenarios, "run_scenario", run_scenario)
    try:
        assert main(["record", str(fixture_folder("gptoss")), "--scenario", "all", "--history", str(path)]) == 2
    finally:
        other.close()
    out, err = capsys.readouterr()
    printed = json.loads(out[out.index("["):])
    assert [(run.get("id"), run["label"], run["turns"][0]["answer"]) for run in printed] == [
        (1, "short", "the short answer"), (None, "multiturn", "the multiturn answer")]
    assert err.splitlines()[-1] == (f"moe-workbench: error: {path}: the run was not saved (another process holds it "
                                    "locked: database is locked); the runs measured are printed on standard output "
                                    "as JSON, the last without an id")
    assert [row["label"] for row in History(path).rows()] == ["short"]


def test_the_history_list_keeps_a_run_whose_label_has_two_lines_on_one_line(tmp_path, capsys):
    from app.cli import main
    from engine.records.history import History

    path = tmp_path / "h.sqlite3"
    History(path).add(made_record(label="before\nafter"))  # `record --label $'before\nafter'`
    assert main(["history", "--history", str(path)]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("    1  2026-01-01T00:00:00+00:00  short      before after") and line.endswith("/m/gptoss")


def test_a_history_cut_short_is_called_damaged_not_another_kind_of_file(tmp_path):
    from engine.errors import WorkbenchError
    from engine.records.history import History

    path = tmp_path / "h.sqlite3"
    history = History(path)
    for _ in range(20):
        history.add(made_record(answer="words " * 500))
    path.write_bytes(path.read_bytes()[:8192])  # as a copy or a disk that stopped part way leaves it
    with pytest.raises(WorkbenchError) as refused:
        History(path, create=False)
    assert str(refused.value) == f"{path}: not opened: the file is damaged (database disk image is malformed)"


def test_a_run_whose_record_is_not_a_json_object_is_named_unreadable_not_an_attribute_error(qtbot, tmp_path, greedy):
    """A record damaged to `null` (or any JSON that is not an object) read "Could not read run 1: 'NoneType' object
    has no attribute 'get'", naming neither the run nor the file, and failed the whole JSON export the same way."""
    import sqlite3

    from engine.records.history import History

    history = History(tmp_path / "h.sqlite3")
    damaged, whole = history.add(greedy), history.add(greedy)
    with sqlite3.connect(history.path) as db:
        db.execute("UPDATE runs SET record = 'null' WHERE id = ?", (damaged,))
    view, said = _view_saying(qtbot, history)
    view.select_ids([damaged])
    assert view.open_selected() is None
    unreadable = f"run {damaged} in {history.path}: unreadable (the run record is null, not a JSON object)"
    assert said == [f"Could not read {unreadable}"]
    written = view.export(str(tmp_path / "runs.json"), "json")
    assert [run["id"] for run in json.loads(written.read_text())] == [whole]
    assert said[1:] == [f"Exported to runs.json without 1 unreadable run: {unreadable}"]


def test_a_run_removed_since_the_windows_list_was_read_is_said_once_without_quotes(qtbot, tmp_path, greedy):
    """A run deleted (by another window or a tool) after the table listed it read "Could not read run 1: 'no run 1 in
    /x/h.sqlite3'" on Open (the run twice, in a KeyError's quotes) and "Could not read the runs: 'no run 1 …'" on
    Compare."""
    import sqlite3

    from engine.records.history import History

    history = History(tmp_path / "h.sqlite3")
    gone, kept = history.add(greedy), history.add(greedy)
    view, said = _view_saying(qtbot, history)
    with sqlite3.connect(history.path) as db:
        db.execute("DELETE FROM runs WHERE id = ?", (gone,))
    removed = (f"Could not read run {gone} in {history.path}: no such run (removed since the list was read: Refresh "
               "lists what is there)")
    view.select_ids([gone])
    assert view.open_selected() is None and said == [removed]
    view.select_ids([gone, kept])
    assert view.compare_selected() is None and said == [removed, removed]


def test_an_export_or_report_to_a_folder_that_does_not_exist_names_the_file_once_with_the_reason(qtbot, tmp_path,
                                                                                                 greedy):
    """"Could not export to /x/gone/runs.md: [Errno 2] No such file or directory: '/x/gone/runs.md'": the file twice,
    the second in quotes after errno's number; the contention report's save read the same."""
    from app.gui.contention_view import ContentionView
    from app.gui.history_view import HistoryView
    from app.gui.records_jobs import ContentionResult
    from engine.records.contention import ContentionReport
    from engine.records.history import History

    history = History(tmp_path / "h.sqlite3")
    history.add(greedy)
    view = HistoryView(history.path)
    contention = ContentionView()
    qtbot.addWidget(view)
    qtbot.addWidget(contention)
    said = []
    view.failed.connect(said.append)
    contention.failed.connect(said.append)
    assert view.export(str(tmp_path / "gone" / "runs.md")) is None
    contention.on_finished(ContentionResult(ContentionReport(1, 12, 1.0, 2.0, 1.5, 3.0), "corpus"))
    assert contention.save(str(tmp_path / "gone" / "contention.md")) is None
    assert said == [f"Could not export to {tmp_path / 'gone' / 'runs.md'}: its folder does not exist",
                    f"Could not save the report to {tmp_path / 'gone' / 'contention.md'}: its folder does not exist"]


def test_a_run_of_one_token_answers_has_no_decode_rate_in_the_record_the_exports_or_the_window(qtbot, tmp_path,
                                                                                                model):
    """A one-token answer has no decode step (the prefill gives its token), yet the record kept a rate of 0.0 tok/s
    (the microseconds between sampling that token and the answer's end): the window and the exports read "0.0", a
    rate, where the command's line said n/a."""
    pytest.importorskip("pytestqt")
    from app.gui.history_view import HEADERS, HistoryView
    from engine.records.history import History

    record = run_scenario(model, "short", GenerationParams(max_new_tokens=1))
    assert record.generated_tokens == 1 and record.timings["decode_tokens_per_s"] is None
    history = History(tmp_path / "h.sqlite3")
    history.add(record)
    head, _rule, row = history.export("markdown").splitlines()
    assert dict(zip(head.strip("| ").split(" | "), row.strip("| ").split(" | ")))["decode_tokens_per_s"] == ""
    view = HistoryView(history.path)
    qtbot.addWidget(view)
    assert view.table.item(0, HEADERS.index("decode")).text() == "—"


def test_a_record_names_the_onnxruntime_build_it_imported_not_a_shadowed_one(tmp_path, monkeypatch):
    """On the GPU machine a system onnxruntime sits later on the path than the onnxruntime-gpu imported: the record
    (docs/h100/record.json) said build "onnxruntime", the CPU build, beside the CUDA EP it ran the dense part on."""
    from engine.records.environment import onnxruntime_build
    from tests.conftest import gpu_build_beside_a_shadowed_cpu_build

    gpu_build_beside_a_shadowed_cpu_build(tmp_path, monkeypatch)
    assert onnxruntime_build()["build"] == "onnxruntime-gpu"


def test_a_record_and_a_comparison_name_the_versions_that_change_its_numbers(greedy):
    """The CPU expert kernels are Numba's and the GPU's run on the driver and CuPy: a run's detail named neither Numba
    nor NumPy, and two runs that differed only in Numba, CuPy, the onnxruntime build or the GPU driver were compared
    as like for like."""
    data = greedy.to_dict()
    gpu = {"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 85520809984, "driver": "580.95.05"}
    a = RunRecord.from_dict(dict(data, machine=dict(data["machine"], gpus=[gpu]), versions=dict(
        data["versions"], numba="0.61.2", numpy="2.2.6", cupy="13.6.0", cuda_runtime=12080, cuda_driver=13000,
        onnxruntime={"version": "1.23.2", "build": "onnxruntime-gpu"})))
    assert " Numba 0.61.2 " in plain(detail_html(a)) and " NumPy 2.2.6 " in plain(detail_html(a))
    b = RunRecord.from_dict(dict(data, machine=dict(data["machine"], gpus=[dict(gpu, driver="590.10")]), versions=dict(
        a.versions, numba="0.68.1", cupy="14.0.0", cuda_driver=13010,
        onnxruntime={"version": "1.23.2", "build": "onnxruntime"})))
    text = plain(compare_html(a, b))
    assert "differ in GPU driver, onnxruntime build, Numba, CuPy, CUDA driver," in text, text
    assert " Numba 0.61.2 0.68.1 " in text and " GPU driver 580.95.05 590.10 " in text
    assert " CUDA driver 13.0 13.1 " in text  # as CUDA's versions are said, not 13000 13010
    assert "Not like for like" not in plain(compare_html(a, a))


def test_the_exports_give_an_all_cpu_run_no_budget_as_the_list_and_the_window_do(tmp_path, greedy):
    """An all-CPU run's budget read "auto" in the CSV and Markdown exports, as if the engine had chosen one on a device,
    where `history` and the window say it has none."""
    import csv
    import io

    from engine.records.history import History

    history = History(tmp_path / "h.sqlite3")
    history.add(greedy)
    on_device = dict(greedy.to_dict(), offload=dict(greedy.offload, device="simulated GPU, 1.0 GiB"))
    history.add(RunRecord.from_dict(on_device))
    rows = list(csv.DictReader(io.StringIO(history.export("csv"))))
    assert [(row["device"], row["budget"]) for row in rows] == [("simulated GPU, 1.0 GiB", "auto"), ("cpu", "")]
    head, _rule, *lines = history.export("markdown").splitlines()
    budgets = [dict(zip(head.strip("| ").split(" | "), line.strip("| ").split(" | ")))["budget"] for line in lines]
    assert budgets == ["auto", ""]


def test_a_runs_detail_and_a_comparison_give_the_process_vram_nvml_saw_and_the_pinned_memory(greedy):
    """The record keeps this process's VRAM peak as NVML saw it (onnxruntime's arena and the CUDA context besides the
    engine's own device memory) and the page-locked host memory, but the window's run and comparison views gave only
    the engine's device peak: on the H100 (docs/h100/record.json) 1.9 GiB where the process held 2.9 GiB."""
    from app.gui.record_report import compare_rows

    data = greedy.to_dict()
    cuda = RunRecord.from_dict(dict(data, peaks=dict(data["peaks"], device_bytes=2020515840,
                                                     process_device_bytes=3084910592, pinned_bytes=224501760)))
    text = plain(detail_html(cuda))
    assert " device memory peak 1.9 GiB " in text and " this process's VRAM peak (NVML) 2.9 GiB " in text
    assert " pinned host memory 214.1 MiB " in text
    rows = {row[0]: row[1:] for row in compare_rows(greedy, cuda)}
    assert rows["this process's VRAM peak (NVML)"] == ("—", "2.9 GiB", "—", "—")
    # a run NVML gave no figure for (the CPU, the simulated card) leaves the line out rather than read "—"
    assert "VRAM peak" not in plain(detail_html(greedy)) and "pinned" not in plain(detail_html(greedy))


def test_a_records_completion_time_leaves_out_starting_and_stopping_its_peak_sampler(model, monkeypatch):
    """The clock ran from before the peak sampler's thread started (milliseconds on a busy machine, an NVML query on a
    GPU) to after its last sample: a small model's completion time carried several percent of bookkeeping."""
    import time

    from engine.records.scenarios import PeakSampler

    enter, leave = PeakSampler.__enter__, PeakSampler.__exit__

    def slow_enter(self):
        time.sleep(0.4)
        return enter(self)

    def slow_exit(self, *exc):
        time.sleep(0.4)
        return leave(self, *exc)

    monkeypatch.setattr(PeakSampler, "__enter__", slow_enter)
    monkeypatch.setattr(PeakSampler, "__exit__", slow_exit)
    record = run_scenario(model, "short", GenerationParams(max_new_tokens=2))
    assert record.timings["completion_s"] < 0.4


def test_the_history_list_gives_budgets_in_the_unit_that_tells_them_apart_as_the_window_does(tmp_path, capsys, greedy):
    """`history` wrote every budget in MiB to a tenth: 100,000 and 120,000 bytes both read "budget 0.1 MiB", where the
    window's table says 97.7 KiB and 117.2 KiB."""
    from app.cli import main
    from engine.records.history import History

    history = History(tmp_path / "h.sqlite3")
    for budget in (100_000, 120_000):
        history.add(RunRecord.from_dict(dict(greedy.to_dict(), offload=dict(
            greedy.offload, device="simulated GPU, 1.0 GiB",
            entries={"session.moe.offload.device_expert_bytes": str(budget)}))))
    assert main(["history", "--history", str(history.path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "budget 117.2 KiB  " in lines[0] and "budget 97.7 KiB  " in lines[1]


def test_a_comparison_says_when_two_runs_of_the_same_settings_had_other_expert_slots_on_the_device(greedy):
    """Two runs of the automatic budget (side-by-side's B, loaded beside A, has less of the device free) can have other
    counts of expert slots on the device: their comparison said "Same offload entries" and nothing else, while their hit rates
    and copies differed for that reason."""
    data = greedy.to_dict()
    experts = sum(node["experts"] for node in data["model"]["expert_nodes"])
    nodes = [node["node"] for node in data["model"]["expert_nodes"]]

    def slots(per_layer: int) -> RunRecord:
        return RunRecord.from_dict(dict(data, offload=dict(data["offload"], device="simulated GPU, 1.0 GiB",
                                                           placement_mode="hybrid",
                                                           slots={node: per_layer for node in nodes})))

    text = plain(compare_html(slots(8), slots(4)))
    assert "Same offload entries." in text and "differ in expert slots on the device," in text
    assert (f" expert slots on the device {8 * len(nodes)} for the {experts} experts {4 * len(nodes)} for the {experts} "
            "experts ") in text
    assert "Not like for like" not in plain(compare_html(slots(8), slots(8)))


def test_a_comparison_of_two_budgets_does_not_count_the_slots_they_give_as_a_difference_of_its_own(greedy):
    """Two runs of other expert budgets hold other counts of slots, as their entries ask: their comparison said "Not
    like for like: besides their offload entries these runs differ in expert slots on the device", which follow from
    those entries. Their slots are a difference of their own only where their entries are the same."""
    data = greedy.to_dict()
    nodes = [node["node"] for node in data["model"]["expert_nodes"]]
    slot = 1 << 20

    def budget(per_layer: int) -> RunRecord:
        return RunRecord.from_dict(dict(data, offload=dict(
            data["offload"], device="simulated GPU, 1.0 GiB", placement_mode="hybrid",
            slots={node: per_layer for node in nodes},
            entries={"session.moe.offload.device_expert_bytes": str(per_layer * len(nodes) * slot)})))

    text = plain(compare_html(budget(8), budget(4)))
    assert "Not like for like" not in text and "expert slots on the device" not in text
    assert (f" session.moe.offload.device_expert_bytes {8 * len(nodes) * slot} {4 * len(nodes) * slot} ") in text
    # another device beside them is still said
    other = RunRecord.from_dict(dict(budget(4).to_dict(), offload=dict(budget(4).offload, device="test card")))
    assert "differ in device, so their numbers" in plain(compare_html(budget(8), other))


def test_a_comparison_gives_the_difference_of_two_shares_in_percentage_points(greedy):
    """Hit rates of 80% and 90% compared as "+10.0%" beside "1.12×": the difference read as a relative change of 10%
    where the ratio says 12.5%."""
    from app.gui.record_report import compare_rows

    def at(hit_rate: float) -> RunRecord:
        layer = {"hits": int(hit_rate * 100), "misses": 100 - int(hit_rate * 100)}
        return RunRecord.from_dict(dict(greedy.to_dict(), layers=[layer]))

    rows = {row[0]: row[1:] for row in compare_rows(at(0.8), at(0.9))}
    assert rows["expert hit rate"] == ("80.0%", "90.0%", "+10.0 points", "1.12×")


def test_a_comparison_gives_no_ratio_against_a_share_shown_as_zero(greedy):
    """A quiet run's share of the CPUs' time other processes took is a float's rounding (2e-10, the CPU times'
    difference): compared with a busy run's 73.9%, "0.0%" stood beside "3628062726.28×". A share shown as 0.0% gives
    no ratio, as one of exactly 0 gives none."""
    from app.gui.record_report import compare_rows

    def others(share: float) -> RunRecord:
        return RunRecord.from_dict(dict(greedy.to_dict(), host_load={"host_steal_share": 0.0,
                                                                      "host_others_share": share}))

    rows = {row[0]: row[1:] for row in compare_rows(others(2.037e-10), others(0.739))}
    assert rows["CPU time other processes took"] == ("0.0%", "73.9%", "+73.9 points", "—")
    rows = {row[0]: row[1:] for row in compare_rows(others(0.002), others(0.739))}
    assert rows["CPU time other processes took"] == ("0.2%", "73.9%", "+73.7 points", "369.50×")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/clear_refs"), reason="Linux's RSS high-water mark")
def test_a_records_rss_peak_holds_memory_taken_and_given_back_between_two_samples(model, monkeypatch):
    """The RSS peak was sampled every 50 ms: memory a layer took and gave back between two samples (a long prompt's
    activations) was no part of it. Linux keeps the high-water mark, which the record now reads too."""
    import numpy as np

    import engine.records.scenarios as scenarios

    monkeypatch.setattr(scenarios.PeakSampler.__init__, "__defaults__", (None, 3600.0))  # no sample during the run
    send = scenarios.Conversation.send

    def send_after_a_transient(self, *args, **kwargs):
        transient = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, touched, then given back
        del transient
        return send(self, *args, **kwargs)

    monkeypatch.setattr(scenarios.Conversation, "send", send_after_a_transient)
    record = run_scenario(model, "short", GenerationParams(max_new_tokens=2))
    assert record.peaks["rss_bytes"] - record.peaks["rss_start_bytes"] >= 48 << 20  # (less the pages it reused)


def test_a_runs_detail_and_a_comparison_give_the_decode_path_its_cold_experts_took(greedy):
    """Two runs that both asked for the automatic decode path can end on different ones (the trials chose the host tier
    for one, the CPU for the other): the comparison named only the path asked for, the same, and a run's detail named
    none, so the two compared as like for like while their cold experts ran on different paths."""
    data = greedy.to_dict()

    def took(path: str) -> RunRecord:
        return RunRecord.from_dict(dict(data, offload=dict(
            data["offload"], device="simulated GPU, 1.0 GiB", placement_mode="hybrid",
            decode_path={"mode": "auto", "in_force": path, "host_tier": path != "cpu", "trials": 2})))

    assert " decode path tier (asked: auto) " in plain(detail_html(took("tier")))
    text = plain(compare_html(took("cpu"), took("tier")))
    assert "differ in decode path in force," in text and " decode path in force cpu tier " in text
    assert "Not like for like" not in plain(compare_html(took("tier"), took("tier")))
    assert "decode path" not in plain(detail_html(greedy))  # all on the CPU: no cold experts' path


NO_CUPY = "the CUDA GPU needs CuPy (install with `make install` on a machine with an NVIDIA driver)"
CUDA_UNUSABLE = f"The CUDA GPU was asked for but cannot be used ({NO_CUPY}); every expert runs on the CPU instead."
BUSY = ("CUDA device 0 cannot be opened (CUDARuntimeError: cudaErrorDevicesUnavailable: CUDA-capable device(s) is/are "
        "busy or unavailable)")


def test_a_comparison_says_when_one_of_two_runs_on_the_cpu_asked_for_the_cuda_gpu(greedy):
    """A run whose CUDA GPU could not be used ran every expert on the CPU, and its record says why
    (offload["device_fallback"]): compared with a run that chose the CPU, both read "cpu" and the comparison said
    nothing of it, as like for like. It says why each ran on the CPU where they differ in it: the reason the note
    gives, which the note's 200 characters and more, cut to a cell's 160, would lose."""
    data = greedy.to_dict()
    fell_back = RunRecord.from_dict(dict(data, offload=dict(data["offload"], device_fallback=CUDA_UNUSABLE)))
    text = plain(compare_html(greedy, fell_back))
    assert "these runs differ in why on the CPU," in text
    assert f" why on the CPU none recorded {NO_CUPY} " in text
    assert "Not like for like" not in plain(compare_html(fell_back, fell_back))
    busy = CUDA_UNUSABLE.replace(NO_CUPY, BUSY)
    other = RunRecord.from_dict(dict(data, offload=dict(data["offload"], device_fallback=busy)))
    assert f" why on the CPU {NO_CUPY} {BUSY} " in plain(compare_html(fell_back, other))
    on_card = RunRecord.from_dict(dict(data, offload=dict(data["offload"], device="simulated GPU, 1.0 GiB")))
    text = plain(compare_html(fell_back, on_card))  # the device differs already: a run on the card has no reason
    assert " device cpu simulated GPU, 1.0 GiB " in text and "why on the CPU" not in text.split("metric")[0]


def test_the_history_list_and_the_windows_table_say_a_run_could_not_have_the_cuda_gpu_it_asked_for(qtbot, tmp_path,
                                                                                                     capsys, greedy):
    """A run that asked for the CUDA GPU and could not have it read "cpu" in `history`'s list and the window's table,
    as a run that chose the CPU, its reason only in its record. Both say "cpu (CUDA GPU unusable)"; the table's cell
    gives the reason whole in its tooltip, the exports in a column of their own."""
    import csv
    import io

    pytest.importorskip("pytestqt")
    from app.cli import main
    from app.gui.history_view import HEADERS, HistoryView
    from engine.records.history import History

    history = History(tmp_path / "h.sqlite3")
    history.add(greedy)
    fell_back = dict(greedy.to_dict(), offload=dict(greedy.offload, device_fallback=CUDA_UNUSABLE))
    history.add(RunRecord.from_dict(fell_back))
    assert main(["history", "--history", str(history.path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f" {'cpu (CUDA GPU unusable)':<28}  budget - " in lines[0] and f" {'cpu':<28}  budget - " in lines[1]
    view = HistoryView(history.path)
    qtbot.addWidget(view)
    cells = [view.table.item(row, HEADERS.index("device")) for row in (0, 1)]
    assert [cell.text() for cell in cells] == ["cpu (CUDA GPU unusable)", "cpu"]
    assert [cell.toolTip() for cell in cells] == [CUDA_UNUSABLE, ""]
    rows = list(csv.DictReader(io.StringIO(history.export("csv"))))
    assert [row["device_fallback"] for row in rows] == [CUDA_UNUSABLE, ""]


def test_a_version_3_history_is_brought_forward_with_why_its_runs_ran_on_the_cpu(tmp_path, greedy):
    import sqlite3

    from engine.records.history import History

    path = tmp_path / "h.sqlite3"
    History(path).add(RunRecord.from_dict(dict(greedy.to_dict(), offload=dict(greedy.offload,
                                                                               device_fallback=CUDA_UNUSABLE))))
    with sqlite3.connect(path) as db:  # as version 3 wrote it: without the column version 4 added
        db.execute("ALTER TABLE runs DROP COLUMN device_fallback")
        db.execute("PRAGMA user_version = 3")
    assert History(path, create=False).rows()[0]["device_fallback"] == CUDA_UNUSABLE
    assert user_version(path) == 5


def test_a_version_4_history_is_brought_forward_with_the_budgets_its_runs_had(tmp_path, greedy):
    import sqlite3

    from engine.records.history import History, budget_text

    path = tmp_path / "h.sqlite3"
    cut = dict(greedy.offload, device="simulated GPU, 1.0 GiB", budget_bytes=150000,
               entries={"session.moe.offload.device_expert_bytes": "200000"})
    History(path).add(RunRecord.from_dict(dict(greedy.to_dict(), offload=cut)))
    with sqlite3.connect(path) as db:  # as version 4 wrote it: without the column version 5 added
        db.execute("ALTER TABLE runs DROP COLUMN budget_bytes")
        db.execute("PRAGMA user_version = 4")
    row = History(path, create=False).rows()[0]
    assert user_version(path) == 5
    assert row["budget_bytes"] == 150000 and budget_text(row) == "146.5 KiB (asked 195.3 KiB)"


def test_a_record_keeps_which_popularity_file_placed_its_experts_and_a_comparison_tells_an_edited_one(tmp_path):
    """A record kept the popularity file's path alone: two static-placement runs of the same path, the file edited
    between them, read as like for like and exported alike, with nothing left to tell which counts placed the
    experts. The record keeps the file's SHA-256 as read; the comparison and the exports give it."""
    import csv
    import hashlib
    import io

    from engine.offload import OffloadConfig, SimulatedDevice
    from engine.records.history import History

    names = ("/model/layers.0/moe/QMoE", "/model/layers.1/moe/QMoE")
    path = tmp_path / "popularity.json"
    records = []
    for counts in ([100, 90] + [0] * 6, [0] * 6 + [90, 100]):
        path.write_text(json.dumps({name: counts for name in names}))
        config = OffloadConfig(placement="static", popularity_file=str(path), device_expert_bytes=200_000)
        model = LoadedModel.open(fixture_folder("gptoss"), offload=config, device=SimulatedDevice(8 << 30))
        records.append(run_scenario(model, "short", GenerationParams(max_new_tokens=2)))
        assert records[-1].offload["popularity_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    a, b = records
    text = plain(compare_html(a, b))
    assert "differ in popularity file (SHA-256)," in text
    assert f" popularity file (SHA-256) {a.offload['popularity_sha256']} {b.offload['popularity_sha256']} " in text
    history = History(tmp_path / "h.sqlite3")
    history.add(a)
    history.add(made_record())  # a run without a popularity file: an empty cell
    rows = list(csv.DictReader(io.StringIO(history.export("csv"))))
    assert (rows[1]["popularity_sha256"], rows[0]["popularity_sha256"]) == (a.offload["popularity_sha256"], "")
    assert f" popularity file SHA-256 {a.offload['popularity_sha256']} " in plain(detail_html(a))


def test_a_run_asked_for_by_id_that_the_filters_leave_out_is_named(tmp_path, capsys):
    """`history --id 1 --model other` printed an empty export, without a word, where run 1 exists: the runs the other
    filters leave out are named, as a missing id is, and nothing is printed."""
    from app.cli import main
    from engine.records.history import History

    path = tmp_path / "h.sqlite3"
    history = History(path)
    history.add(made_record(label="base"))
    history.add(made_record(label="tuned", folder="/m/qwen"))
    assert main(["history", "--history", str(path), "--id", "1", "--model", "qwen"]) == 2
    assert capsys.readouterr() == ("", f"moe-workbench: error: {path}: run 1 does not match --model 'qwen'\n")
    assert main(["history", "--history", str(path), "--id", "1", "2", "--label", "x", "--model", "m"]) == 2
    assert capsys.readouterr().err == f"moe-workbench: error: {path}: runs 1, 2 do not match --model 'm', --label 'x'\n"
    assert main(["history", "--history", str(path), "--id", "2", "--label", "TUNED", "--export", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("2,")
