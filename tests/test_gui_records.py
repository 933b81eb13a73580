"""The window's record views against the real engine on the fixture models (offscreen Qt): history,
scenario runs, budget sweep, side-by-side chat and the contention test, all through the worker.

Waits are on what the window shows (qtbot.waitUntil), as in tests/test_gui.py."""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("pytestqt")

from PySide6.QtCore import QSettings, Qt, QTimer  # noqa: E402
from PySide6.QtWidgets import QFileDialog  # noqa: E402

from app.gui import theme  # noqa: E402
from app.gui.main_window import MainWindow  # noqa: E402
from engine.generation import GenerationParams, LoadedModel  # noqa: E402
from engine.offload import OffloadConfig, SimulatedDevice  # noqa: E402
from engine.records.configurations import load_configuration  # noqa: E402
from engine.records.contention import make_corpus  # noqa: E402
from engine.records.history import History  # noqa: E402
from engine.records.scenarios import run_scenario  # noqa: E402
from engine.records.side_by_side import first_divergence  # noqa: E402
from engine.records.sweep import recommend  # noqa: E402
from engine.units import counted, duration_text, human_bytes  # noqa: E402
from tests.conftest import fixture_folder, timed_sweep_warm_up  # noqa: E402

WAIT = 60_000
EXPERT = 35328  # bytes of one gpt-oss fixture expert in a device slot (the GPU kernels' layout)
SIMULATED = {"device": {"kind": "simulated", "capacity": 8 << 30}, "entries": {"device_expert_bytes": str(3 * EXPERT)}}


@pytest.fixture
def window(qtbot, tmp_path):
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    win = MainWindow(settings=settings, sample_interval_ms=1000, nvml=False, demo_dir=str(tmp_path / "demo"),
                     history_path=tmp_path / "history.sqlite3", configurations_path=tmp_path / "configurations.json")
    qtbot.addWidget(win)
    win.show()
    yield win
    win.close()


def load(qtbot, window, name, settings=None):
    path = fixture_folder(name)
    if settings is not None:
        window.save_model_settings(str(path), settings)
    window.load_model(str(path))
    qtbot.waitUntil(lambda: not window.busy and window.loaded_path is not None
                    and Path(window.loaded_path).resolve() == path.resolve(), timeout=WAIT)


def finish(qtbot, window, view):
    qtbot.waitUntil(lambda: not view.bar.running and not window.busy, timeout=WAIT)


def sweep_three_points(qtbot, window):
    """The window's sweep of the loaded model over 3 points, short scenario, 3-token answers, run to its end."""
    view = window.sweep
    view.points.setValue(3)
    view.scenario.setCurrentText("short")
    view.max_tokens.setValue(3)
    view.bar.run_button.click()
    finish(qtbot, window, view)
    return view


def test_a_record_cancelled_before_a_run_began_says_so(qtbot, tmp_path, monkeypatch):
    """Cancel while the model still mapped its experts (before the first run): the run line said only "Nothing saved.",
    not that the Record was cancelled, where one cut short in a run says "Cancelled during multiturn (not saved)".
    Cancelled between two runs, it said only "Saved run 1." as if every scenario had run."""
    import app.gui.records_jobs as jobs
    from app.gui.scenario_view import ScenarioView

    model = LoadedModel.open(fixture_folder("lfm2moe"))
    view = ScenarioView()
    qtbot.addWidget(view)
    ctx = _sweep_context(model, None, [])
    ctx.cancel.set()
    result = jobs.ScenarioJob(["short", "multiturn"], 2, str(tmp_path / "h.sqlite"))(ctx)
    view.on_finished(result)
    assert result.saved == [] and view.bar.status.text() == "Cancelled before the first run began; nothing saved."

    def cancelled_after_the_first(*args, **kwargs):
        record = run_scenario(*args, **kwargs)
        ctx.cancel.set()
        return record

    monkeypatch.setattr(jobs, "run_scenario", cancelled_after_the_first)
    ctx = _sweep_context(model, None, [])
    result = jobs.ScenarioJob(["short", "multiturn"], 2, str(tmp_path / "h.sqlite"))(ctx)
    view.on_finished(result)
    assert [record.scenario for _id, record in result.saved] == ["short"]
    assert view.bar.status.text() == f"Cancelled before multiturn began (not run). Saved run {result.saved[0][0]}."


def test_history_table_filters_opens_compares_and_exports(qtbot, tmp_path, monkeypatch):
    history = History(tmp_path / "history.sqlite3")
    params = GenerationParams(max_new_tokens=4)
    device = SimulatedDevice(1 << 30)
    gptoss = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(device_expert_bytes=2 * EXPERT),
                              device=device)
    lfm2 = LoadedModel.open(fixture_folder("lfm2moe"))
    records = [run_scenario(gptoss, "short", params, device, label="baseline"),
               run_scenario(gptoss, "multiturn", params, device, label="tuned"),
               run_scenario(lfm2, "short", params, label="baseline")]
    ids = [history.add(record) for record in records]
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    window = MainWindow(settings=settings, nvml=False, history_path=tmp_path / "history.sqlite3")
    qtbot.addWidget(window)
    view = window.history
    try:
        assert view.ids() == ids[::-1] and view.count.text() == "3 runs"
        assert view.table.item(0, 4).text() == "lfm2moe" and view.table.item(2, 3).text() == "baseline"
        view.model_filter.setText("gptoss")
        assert view.ids() == [ids[1], ids[0]]
        view.scenario_filter.setCurrentIndex(view.scenario_filter.findData("short"))
        assert view.ids() == [ids[0]]
        view.model_filter.setText("")
        view.label_filter.setText("base")
        assert view.ids() == [ids[2], ids[0]]
        view.scenario_filter.setCurrentIndex(0)
        view.label_filter.setText("tuned")
        assert view.ids() == [ids[1]]
        # one run opened: timings, peaks, configuration, per-layer hit rates, prompts and answers
        view.select_ids([ids[1]])
        assert view.open_button.isEnabled() and not view.compare_button.isEnabled()
        detail = view.open_selected().text()
        for turn in records[1].turns:
            assert turn["prompt"] in detail and turn["answer"].strip().splitlines()[0] in detail
        assert "session.moe.offload.device_expert_bytes" in detail and str(2 * EXPERT) in detail
        assert "hit rate" in detail and records[1].model["expert_nodes"][0]["node"] in detail
        assert f"{records[1].layers[0]['hit_rate']:.1%}" in detail
        assert "\nexperts\nhybrid: resident ones on the device, the others on the CPU\nplacement\nadaptive\n" in detail
        # two runs compared: both titles, the key metrics in two columns with difference and ratio
        view.label_filter.setText("")
        view.select_ids([ids[0], ids[2]])
        assert view.compare_button.isEnabled()
        compared = view.compare_selected().text()
        assert f"run {ids[0]}: short “baseline” · gptoss" in compared
        assert f"run {ids[2]}: short “baseline” · lfm2moe" in compared
        rss_a, rss_b = records[0].peaks["rss_bytes"], records[2].peaks["rss_bytes"]
        assert "process RSS peak" in compared and f"{rss_b / rss_a:.2f}×" in compared
        assert "session.moe.offload.device_expert_bytes" in compared  # the configurations differ there
        # export the filtered table: the file holds exactly what History.export gives
        view.model_filter.setText("gptoss")
        for fmt, filter_text, name in (("json", "JSON (*.json)", "runs"), ("csv", "CSV (*.csv)", "runs.csv"),
                                       ("markdown", "Markdown (*.md)", "runs.md")):
            target = tmp_path / name
            monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, t=target, f=filter_text, **k: (str(t), f))
            written = view.export()
            assert written.read_bytes() == history.export(fmt, model="gptoss").encode()
        assert [r["scenario"] for r in json.loads((tmp_path / "runs.json").read_text())] == ["multiturn", "short"]
        view.scenario_filter.setCurrentIndex(view.scenario_filter.findData("short"))
        view.export(str(tmp_path / "one.md"))
        assert view.count.text() == "1 run · exported to one.md"  # (it read "1 runs")
    finally:
        window.close()


def test_a_record_whose_second_run_fails_says_which_runs_it_saved(qtbot, tmp_path, monkeypatch):
    """A run that failed midway (the device out of memory at the long input) failed the whole job: the window said
    only the error, not that the run before it was saved, and its history did not show that run."""
    import app.gui.records_jobs as jobs
    from app.gui.scenario_view import ScenarioView
    from engine.errors import WorkbenchError

    def fails_at_the_second(model, name, *args, **kwargs):
        if name == "long":
            raise WorkbenchError("the device is out of memory")
        return run_scenario(model, name, *args, **kwargs)

    monkeypatch.setattr(jobs, "run_scenario", fails_at_the_second)
    view = ScenarioView()
    qtbot.addWidget(view)
    recorded, failed = [], []
    view.recorded.connect(recorded.append)
    view.failed.connect(failed.append)
    path = tmp_path / "h.sqlite"
    result = jobs.ScenarioJob(["short", "long", "multiturn"], 2, str(path))(
        _sweep_context(LoadedModel.open(fixture_folder("lfm2moe")), None, []))
    view.on_finished(result)
    assert [row["scenario"] for row in History(path).rows()] == ["short"]
    assert recorded == [[1]]
    assert view.bar.status.text() == "Failed during long: the device is out of memory (not saved). Saved run 1."
    assert failed == ["Failed during long: the device is out of memory"]


OutOfMemoryError = type("OutOfMemoryError", (MemoryError,), {})  # CuPy's name
RAN_OUT = "OutOfMemoryError: Out of memory allocating 512 bytes (allocated so far: 0 bytes).; "


def out_of_memory(*args, **kwargs):
    raise OutOfMemoryError("Out of memory allocating 512 bytes (allocated so far: 0 bytes).")


def test_a_record_out_of_gpu_memory_under_offload_disabled_names_no_expert_budget(tmp_path, monkeypatch):
    """A Record whose run ran out of the card's memory after runs were saved said it without the loaded model's offload
    mode: under mode=disabled (every expert beside the dense part, the expert budgets not applied) it advised lowering
    device_expert_bytes. It says what frees the memory under that mode. (A sweep is refused under that mode.)"""
    import app.gui.records_jobs as jobs
    from engine.errors import GPU_OUT_OF_MEMORY_DISABLED

    def fails_at_the_second(model, name, *args, **kwargs):
        return out_of_memory() if name == "long" else run_scenario(model, name, *args, **kwargs)

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(mode="disabled"), device=device)
    monkeypatch.setattr(jobs, "run_scenario", fails_at_the_second)
    result = jobs.ScenarioJob(["short", "long"], 2, str(tmp_path / "h.sqlite"))(_sweep_context(model, device, []))
    assert len(result.saved) == 1 and result.failure == "long: " + RAN_OUT + GPU_OUT_OF_MEMORY_DISABLED


def test_a_window_run_the_history_could_not_save_is_kept_in_a_file_it_names(qtbot, tmp_path, monkeypatch):
    """A run measured whose save failed (a full disk, here another process's write held past the timeout) was lost:
    the window said the error, and the run's numbers were nowhere. It is kept in a file the window names."""
    import sqlite3
    import tempfile

    import app.gui.records_jobs as jobs
    from app.gui.scenario_view import ScenarioView

    path = tmp_path / "h.sqlite"
    monkeypatch.setattr(History, "_connect", lambda self: sqlite3.connect(self.path, timeout=0.1))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    other = sqlite3.connect(path, isolation_level=None)

    def locked_at_the_second(model, name, *args, **kwargs):
        if name == "multiturn":  # another process begins a long write while the run is measured
            other.execute("BEGIN EXCLUSIVE")
        return run_scenario(model, name, *args, **kwargs)

    monkeypatch.setattr(jobs, "run_scenario", locked_at_the_second)
    view = ScenarioView()
    qtbot.addWidget(view)
    try:
        result = jobs.ScenarioJob(["short", "multiturn"], 2, str(path))(
            _sweep_context(LoadedModel.open(fixture_folder("lfm2moe")), None, []))
    finally:
        other.close()
    view.on_finished(result)
    (kept,) = tmp_path.glob("moe-workbench-unsaved-runs-*.json")
    (run,) = json.loads(kept.read_text())
    assert run["scenario"] == "multiturn" and len(run["turns"]) == 6 and run["timings"]["completion_s"] > 0
    assert view.bar.status.text() == (f"Failed during multiturn: {path}: the run was not saved (another process holds "
                                      f"it locked: database is locked); the run measured is kept in {kept} (not "
                                      "saved). Saved run 1.")
    assert [row["scenario"] for row in History(path).rows()] == ["short"]


def test_scenario_run_saves_a_record_and_cancel_saves_none(qtbot, window):
    load(qtbot, window, "lfm2moe")
    bar = window.scenarios
    bar.scenario.setCurrentText("short")
    bar.max_tokens.setValue(6)
    bar.label.setText("from the window")
    bar.bar.run_button.click()
    finish(qtbot, window, bar)
    assert [run_id for run_id, _ in bar.result.saved] == window.history.ids()
    run_id, record = bar.result.saved[0]
    assert record.scenario == "short" and record.label == "from the window"
    assert record.turns[0]["generated_tokens"] == 6 and record.turns[0]["finish_reason"] == "length"
    assert window.history.history.get(run_id).turns[0]["answer"] == record.turns[0]["answer"]
    assert f"Saved run {run_id}." in bar.bar.status.text()
    # Cancel ends the answer at the next token; a cancelled run is not saved
    bar.scenario.setCurrentText("multiturn")
    bar.max_tokens.setValue(300)
    bar.bar.run_button.click()
    # (a token of the answer, not the turn's start: its progress says "· 0 tokens", and a cancel then saves no turn)
    qtbot.waitUntil(lambda: window.busy == "recording"
                    and bool(re.search(r"· [1-9]\d* tokens?", bar.bar.status.text())), timeout=WAIT)
    bar.bar.cancel_button.click()
    finish(qtbot, window, bar)
    cancelled = bar.result.cancelled
    assert cancelled is not None and cancelled.timings["cancelled"]
    assert cancelled.turns[-1]["finish_reason"] == "cancelled" and cancelled.turns[-1]["generated_tokens"] < 300
    assert len(cancelled.turns) < 6 and bar.result.saved == []
    assert window.history.ids() == [run_id] and "Cancelled during multiturn (not saved)" in bar.bar.status.text()
    # a sweep on a CPU-only load is a message, and the window goes on
    window.sweep.points.setValue(2)
    window.sweep.bar.run_button.click()
    finish(qtbot, window, window.sweep)
    assert "needs a device for resident experts" in window.error_banner.text()
    assert window.sweep.bar.status.text().startswith("Failed:") and window.scenarios.bar.run_button.isEnabled()


def test_sweep_view_plots_recommends_and_saves_a_configuration(qtbot, window, tmp_path):
    load(qtbot, window, "gptoss", SIMULATED)
    view = window.sweep
    view.points.setValue(2)
    view.scenario.setCurrentText("short")
    view.max_tokens.setValue(4)
    view.margin.setValue(10.0)
    view.bar.run_button.click()
    finish(qtbot, window, view)
    points = view.result.points
    assert [p.budget_bytes for p in points] == [0, 16 * EXPERT] and not view.result.cancelled
    assert view.scales["budget"] == ("KiB", 1024)  # 16 experts of 31.5 KiB
    for key, curve in view.curves.items():
        x, y = curve.getData()
        assert list(x) == [0.0, 16 * EXPERT / 1024] and len(y) == 2
    assert list(view.curves["completion"].getData()[1]) == [p.completion_s for p in points]
    assert list(view.curves["tokens"].getData()[1]) == [p.decode_tokens_per_s for p in points]
    unit, scale = view.scales["device"]
    assert list(view.curves["device"].getData()[1]) == [p.peak_device_bytes / scale for p in points]
    assert list(view.curves["rss"].getData()[1]) == [p.peak_rss_bytes / view.scales["rss"][1] for p in points]
    assert view.plots["device"].titleLabel.text.endswith(f"({unit})")
    assert points[0].peak_device_bytes < points[1].peak_device_bytes
    best = recommend(points, 0.10)
    assert view.recommended is best and view.marks["completion"].value() == best.budget_bytes / 1024
    # a simulated device: the projected curves drawn next to the measured ones, the recommendation by the projection
    assert view.projected and all(p.projected_completion_s is not None for p in points)
    assert list(view.projected_curves["completion"].getData()[1]) == [p.projected_completion_s for p in points]
    assert list(view.projected_curves["tokens"].getData()[1]) == [p.projected_decode_tokens_per_s for p in points]
    assert "Dashed, triangles: projected for the simulated card." in view.legend.text()
    assert list(view.chosen["completion"].getData()[1]) == [best.projected_completion_s]
    assert "projected for the simulated card" in view.summary.text()
    view.margin.setValue(0.0)
    assert view.recommended is recommend(points, 0.0)
    assert len(window.history.ids()) == 2 * 3 and len(view.result.saved_ids) == 2 * 3  # 3 repeats a point
    # the loaded model keeps its own budget after the sweep
    assert window.worker._model.offload.config.device_expert_bytes == 3 * EXPERT
    view.name.setText("fast enough")
    view.save_button.click()
    folder, config, _own = load_configuration("fast enough", tmp_path / "configurations.json")
    assert Path(folder).resolve() == fixture_folder("gptoss").resolve()
    assert config.device_expert_bytes == view.recommended.budget_bytes
    # the chat's statistics line on the simulated device states the decode rate projected for the card
    window.chat.max_tokens.setValue(6)
    window.chat.prompt.setPlainText("Hello")
    window.chat.send()
    qtbot.waitUntil(lambda: bool(not window.busy and window.chat.entries and window.chat.entries[-1].get("stats")),
                    timeout=WAIT)
    entry = window.chat.entries[-1]
    if entry["result"]["timings"]["generated_tokens"] > 1:
        assert entry["result"]["timings"]["projected_decode_tokens_per_s"] > 0
        assert "projected on the simulated card: " in entry["stats"]


def test_side_by_side_streams_two_columns_records_both_and_marks_the_divergence(qtbot, window, monkeypatch, tmp_path):
    load(qtbot, window, "gptoss", SIMULATED)
    view = window.side_by_side
    waits = []  # the right side's device is waited for before its model goes (CudaDevice.quiesce)
    monkeypatch.setattr(SimulatedDevice, "quiesce", lambda device: waits.append(device), raising=True)
    window.tabs.setCurrentIndex(1)  # Side by side
    assert f"device_expert_bytes={3 * EXPERT}" in view.right_entries.toPlainText()  # B starts as a copy of A
    streamed = []
    window.worker.jobStreamed.connect(lambda kind, payload: streamed.append(payload["side"]))
    view.prompt.setPlainText("Compare the two sides")
    view.max_tokens.setValue(8)
    view.right_entries.setPlainText("device_expert_bytes=0\nplacement=static")
    view.bar.run_button.click()
    finish(qtbot, window, view)
    a, b = view.result.comparison.records
    assert view.result.comparison.divergence == first_divergence(a.turns[0]["tokens"], b.turns[0]["tokens"])
    assert view.result.comparison.divergence is None  # exact offload: the same greedy answer at any budget
    assert "identical" in view.divergence.text() and set(streamed) == {0, 1}
    assert b.offload["entries"]["session.moe.offload.device_expert_bytes"] == "0" and b.label.startswith("B: gptoss")
    assert a.offload["entries"]["session.moe.offload.device_expert_bytes"] == str(3 * EXPERT)
    for column, record in ((view.left, a), (view.right, b)):
        assert column.answer.toPlainText() == record.turns[0]["answer"]
        assert column.values["tokens"].text() == f"stopped at the length ({record.turns[0]['generated_tokens']} tokens)"
        assert column.values["decode"].text() == (f"{record.turns[0]['timings']['decode_tokens_per_s']:.1f} tok/s, "
                                                  f"projected {record.timings['projected']['decode_tokens_per_s']:.1f} "
                                                  "tok/s")
        assert column.values["device peak"].text() == human_bytes(record.peaks["device_bytes"])
        assert column.values["completion"].text() == duration_text(record.timings["completion_s"])
    assert sorted(window.history.ids()) == sorted(view.result.saved_ids) and len(view.result.saved_ids) == 2
    assert len(waits) == 1 and waits[0] is not window.worker._device  # the right side's own device, once
    # B with whole layers (this app's own setting beside onnxruntime's keys): the same answer, and its record says so
    view.right_entries.setPlainText(f"device_expert_bytes={3 * EXPERT}\nlayer_split=whole")
    view.bar.run_button.click()
    finish(qtbot, window, view)
    a, b = view.result.comparison.records
    assert view.result.comparison.divergence is None and "layer_split=whole" in b.label
    assert b.offload["layer_split"]["mode"] == "whole" and a.offload["layer_split"]["mode"] != "whole"
    assert "session.moe.offload.layer_split" not in b.offload["entries"]
    assert view.left.values["routing"].text() == view.right.values["routing"].text() == "exact"
    assert "B decoded at " in view.divergence.text() and " A's rate (" in view.divergence.text()
    # approximate routing on B: its agreement with exact routing, beside the tokens it answered
    view.right_entries.setPlainText(f"device_expert_bytes={3 * EXPERT}\nmin_expert_weight=0.5")
    view.bar.run_button.click()
    finish(qtbot, window, view)
    a, b = view.result.comparison.records
    assert b.approximate_routing and not a.approximate_routing and b.routing_agreement is not None
    assert (view.right.values["routing"].text()
            == f"approximate: {b.routing_agreement:.0%} token agreement with exact routing")
    assert view.left.values["routing"].text() == "exact"
    view.right_entries.setPlainText("layer_split=layers")
    view.bar.run_button.click()
    assert "layer_split=layers: one of auto, spread, whole" in window.last_error
    # B with the cold experts read from the host tier (the simulated GPU simulates it): the same answer
    view.right_entries.setPlainText(f"device_expert_bytes={3 * EXPERT}\ndecode_path=tier")
    view.bar.run_button.click()
    finish(qtbot, window, view)
    a, b = view.result.comparison.records
    assert view.result.comparison.divergence is None and "decode_path=tier" in b.label
    assert b.offload["decode_path"]["in_force"] == "tier" and a.offload["decode_path"]["in_force"] == "cpu"
    assert "session.moe.offload.decode_path" not in b.offload["entries"]
    view.right_entries.setPlainText("decode_path=gpu")
    view.bar.run_button.click()
    assert "decode_path=gpu: one of auto, cpu, tier" in window.last_error
    # errors say they are B's: a misspelt key (with the key it likely meant), a folder that holds no model
    view.right_entries.setPlainText("placment=static")
    view.bar.run_button.click()
    assert window.last_error == "B's settings: unknown offload key 'placment': did you mean 'placement'?"
    # a side that cannot load says so in one line in its column, and the other side answers (and is saved) alone
    answer = view.left.answer.toPlainText()
    view.right_entries.setPlainText("")
    view.right_folder.setText(str(tmp_path))
    view.bar.run_button.click()
    finish(qtbot, window, view)
    missing = (f"B's model: {tmp_path / 'genai_config.json'}: missing (a model folder from onnxruntime-genai's "
               "builder has one)")
    assert view.divergence.text() == f"B could not answer: {missing}"
    assert view.right.answer.toPlainText() == f"No answer: {missing}" and view.right.values["tokens"].text() == "—"
    assert view.left.answer.toPlainText() == answer
    assert view.left.values["tokens"].text() == "stopped at the length (8 tokens)"
    assert view.bar.status.text() == f"Saved run {view.result.saved_ids[0]} to the history."
    view.right_folder.setText("")
    view.right_entries.setPlainText("mode=required\ndevice_expert_bytes=100000000000")  # more than the card holds
    view.bar.run_button.click()
    finish(qtbot, window, view)
    assert view.divergence.text().startswith("B could not answer: B's model: offload mode 'required': "
                                             "device_expert_bytes=100000000000 exceeds the ")
    assert view.left.answer.toPlainText() == answer and len(view.result.saved_ids) == 1
    # another model folder, both at once: the first differing token is highlighted in both columns
    view.right_folder.setText(str(fixture_folder("qwen35moe")))
    view.right_entries.setPlainText("")
    view.concurrent.setChecked(True)
    view.bar.run_button.click()
    finish(qtbot, window, view)
    a, b = view.result.comparison.records
    divergence = view.result.comparison.divergence
    assert divergence == first_divergence(a.turns[0]["tokens"], b.turns[0]["tokens"]) and divergence is not None
    assert Path(b.model["folder"]).resolve() == fixture_folder("qwen35moe").resolve()
    assert f"at generated token {divergence + 1}" in view.divergence.text()
    assert a.scenario == b.scenario == "side-by-side, at once"  # their timings are not a lone run's
    for column, pieces in zip((view.left, view.right), view.result.pieces):
        marked = column.answer.toHtml()
        assert f"background-color:{theme.current().warn}" in marked  # the highlighted token
        assert marked.count("background-color:") == 1
        assert column.answer.toPlainText().startswith("".join(pieces[:divergence]))
    assert len(window.history.ids()) == 12  # five comparisons ran, two records each, and two A alone


def test_side_by_side_says_which_side_waits_answers_or_is_done_as_the_model_streams(qtbot, window, monkeypatch):
    """The run line and both columns at every token the fixture model streams (reported at each one here): one after
    the other, B waits until A is done; at once, both answer from the start, each done at its own end; each prepares
    until its first token."""
    import app.gui.records_jobs as jobs

    monkeypatch.setattr(jobs, "REPORT_INTERVAL_S", 0.0)
    load(qtbot, window, "gptoss")
    view = window.side_by_side
    shown, on_progress = [], view.on_progress

    def showing(fraction, text):  # what the window shows at each run line
        on_progress(fraction, text)
        if text.startswith("A "):
            tokens = (column.values["tokens"].text() for column in (view.left, view.right))
            shown.append((view.bar.status.text(), *tokens))

    monkeypatch.setattr(view, "on_progress", showing)
    view.prompt.setPlainText("Compare the two sides")
    view.max_tokens.setValue(4)
    view.bar.run_button.click()
    finish(qtbot, window, view)
    ends = [(r.turns[0]["finish_reason"], r.turns[0]["generated_tokens"]) for r in view.result.comparison.records]
    assert ends == [("length", 4)] * 2  # random weights: no end-of-answer token in 4
    a_answers = [("A preparing its first token · B waiting for A", "preparing its first token", "waiting for A")] + [
        (f"A answering: {n} (at most 4) · B waiting for A", f"answering: {n} (at most 4)", "waiting for A")
        for n in range(1, 5)]
    b_answers = [("A stopped at the length (4 tokens) · B preparing its first token",
                  "stopped at the length (4 tokens)", "preparing its first token")] + [
        (f"A stopped at the length (4 tokens) · B answering: {n} (at most 4)", "stopped at the length (4 tokens)",
         f"answering: {n} (at most 4)") for n in range(1, 5)]
    both_done = ("A stopped at the length (4 tokens) · B stopped at the length (4 tokens)",
                 "stopped at the length (4 tokens)", "stopped at the length (4 tokens)")
    assert shown == a_answers + b_answers + [both_done, both_done]  # the job's last flush says it again
    assert [column.values["tokens"].text() for column in (view.left, view.right)] == [both_done[1]] * 2  # the records'
    shown.clear()
    view.concurrent.setChecked(True)
    view.bar.run_button.click()
    finish(qtbot, window, view)
    assert shown[0] == ("A preparing its first token · B preparing its first token", "preparing its first token",
                        "preparing its first token")
    assert shown[-1] == both_done
    statuses = (["preparing its first token"] + [f"answering: {n} (at most 4)" for n in range(1, 5)]
                + ["stopped at the length (4 tokens)"])
    for line, left, right in shown:  # each side's status moves on, never back, and the line says both columns'
        assert line == f"A {left} · B {right}" and left in statuses and right in statuses
    for side in (1, 2):
        order = [statuses.index(texts[side]) for texts in shown]
        assert order == sorted(order)


def test_side_by_side_b_starts_with_as_layer_split_and_decode_path_and_follows_apply(qtbot, window):
    """B as a copy of A runs as A does: the Budgets panel's layer split and cold-expert path are A's too (B ran with
    the engine's defaults, spread and cpu here, under a label saying "same settings")."""
    load(qtbot, window, "gptoss", dict(SIMULATED, layer_split="whole", decode_path="tier"))
    view = window.side_by_side
    assert view.right_entries.toPlainText() == (f"decode_path=tier\nlayer_split=whole\n"
                                                f"session.moe.offload.device_expert_bytes={3 * EXPERT}")
    view.prompt.setPlainText("Compare the two sides")
    view.max_tokens.setValue(4)
    view.bar.run_button.click()
    finish(qtbot, window, view)
    a, b = view.result.comparison.records
    assert view.right.title() == "B: gptoss · same settings"
    assert a.offload["layer_split"]["mode"] == b.offload["layer_split"]["mode"] == "whole"
    assert a.offload["decode_path"]["in_force"] == b.offload["decode_path"]["in_force"] == "tier"
    view.right_entries.setPlainText(f"device_expert_bytes={3 * EXPERT}")  # B on the engine's defaults: said so
    view.bar.run_button.click()
    finish(qtbot, window, view)
    assert view.right.title() == "B: gptoss · layer_split=auto, decode_path=auto"
    view.reset_button.click()  # Same as A, after an Apply that spreads the budget again: B follows A
    window.apply_settings(dict(SIMULATED, layer_split="spread", decode_path="tier"), reload=False)
    qtbot.waitUntil(lambda: "layer_split=spread" in view.right_entries.toPlainText(), timeout=WAIT)


def test_side_by_side_columns_keep_the_titles_of_the_answers_they_show_after_a_load(qtbot, window):
    """A comparison on gpt-oss stays titled gpt-oss's once another model loads (A's column said 'A: lfm2moe, as
    loaded' above gpt-oss's answer, beside 'B: gptoss · ...'); an empty column takes the loaded model's name."""
    view = window.side_by_side
    load(qtbot, window, "gptoss", SIMULATED)
    assert view.left.title() == "A: gptoss as loaded"
    view.prompt.setPlainText("Compare the two sides")
    view.max_tokens.setValue(4)
    view.right_entries.setPlainText("device_expert_bytes=0")
    view.bar.run_button.click()
    finish(qtbot, window, view)
    answer = view.left.answer.toPlainText()
    load(qtbot, window, "lfm2moe", {"device": {"kind": "cpu"}, "entries": {}})
    assert view.left.answer.toPlainText() == answer
    assert (view.left.title(), view.right.title()) == ("A: gptoss as loaded", "B: gptoss · device_expert_bytes=0")
    window.unload()
    qtbot.waitUntil(lambda: window.loaded_path is None, timeout=WAIT)
    assert view.left.title() == "A: gptoss as loaded"


def test_side_by_side_times_each_side_once_the_engines_trials_of_its_ways_are_over(tmp_path):
    """B is loaded afresh, so its engine still tried its decode paths (tier, cpu, both: ~76 decode steps) while it
    answered: its timings were those of the ways tried, beside an A whose trials a chat had ended ("B: same settings"
    decoded slower). Each side now decodes, unrecorded, until its trials are over, as a sweep's points do."""
    import app.gui.records_jobs as jobs

    device = SimulatedDevice(8 << 30)
    budget = {"device_expert_bytes": str(3 * EXPERT)}
    left = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig.from_entries(budget), device=device,
                            decode_path="auto")
    said = []
    ctx = jobs.JobContext(left, device, {"kind": "simulated", "capacity": 8 << 30}, threading.Event(),
                          lambda _fraction, text="": said.append(text), lambda _batch: None,
                          lambda _choice, config, _notes: SimulatedDevice(8 << 30))
    result = jobs.SideBySideJob("Compare the two sides", 4, budget, history_path=str(tmp_path / "h.sqlite"),
                                right_decode_path="auto")(ctx)
    for record in result.comparison.records:
        trials = record.offload["decode_path"]
        assert trials["measuring"] is None and set(trials["measured_ms"]) == {"tier", "cpu", "both"}
    assert [text for text in said if "trials" in text] == [
        "A: decoding until the engine's trials of its ways are over, unrecorded",
        "B: decoding until the engine's trials of its ways are over, unrecorded"]
    assert result.comparison.divergence is None  # exact routing: the trials change the speed, not the answer


# A card on which A's automatic budget holds every gpt-oss fixture expert and B's, beside A, only 4: each side's
# prefill staging ring takes 16 experts' bytes first, the reserve 4 more
SHARED_CARD = {"device": {"kind": "simulated", "capacity": 56 * EXPERT},
               "entries": {"reserve_device_bytes": str(4 * EXPERT)}}


def shared_card_context(jobs, make_device=None):
    """A side-by-side job's context with A (gptoss, SHARED_CARD's entries) loaded on the simulated card; B's device
    shares the card (`make_device`: another way to make B's)."""
    card, entries = SHARED_CARD["device"]["capacity"], SHARED_CARD["entries"]
    device = SimulatedDevice(card)
    left = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig.from_entries(entries), device=device)
    if make_device is None:
        def make_device(_choice, config, _notes):
            return SimulatedDevice(card, mem_limit=config.gpu_device_mem_limit)
    return device, jobs.JobContext(left, device, SHARED_CARD["device"], threading.Event(), lambda *_: None,
                                   lambda _: None, make_device)


def test_side_by_side_loads_b_beside_a_on_the_simulated_card_and_gives_each_sides_budget(tmp_path):
    """B is loaded while A stays loaded. On a real card B's CudaDevice sees the driver's free memory, what A leaves,
    so an automatic budget of B's (that free memory less reserve_device_bytes) comes out smaller than A's; the
    simulated card instead gave B a whole card of its own, budgets the card could not hold at once, and so never
    showed it. B now shares the simulated card with A, and the comparison carries each side's budget as set."""
    import app.gui.records_jobs as jobs

    entries = SHARED_CARD["entries"]
    device, ctx = shared_card_context(jobs)
    result = jobs.SideBySideJob("Compare the two sides", 2, entries, history_path=str(tmp_path / "h.sqlite"))(ctx)
    assert result.comparison.records[1].offload["statements"][0] == (
        "4 expert slots for the 16 experts on the simulated GPU, 1.9 MiB (138.0 KiB of a 138.0 KiB expert budget).")
    a, b = result.comparison.budgets
    assert (a.budget_bytes, a.free_bytes, a.automatic, a.leaves_cold) == (36 * EXPERT, 40 * EXPERT, True, False)
    assert (b.budget_bytes, b.free_bytes, b.automatic, b.leaves_cold) == (4 * EXPERT, 8 * EXPERT, True, True)
    assert device.memory.used == 32 * EXPERT  # A's ring and slots, all it holds: B's are on its own accounts


def test_side_by_side_says_b_could_not_load_beside_a_where_the_device_had_too_little_free(tmp_path):
    """B's load refused for want of device memory said only "exceeds the 282624 bytes the device has free", with the
    same settings A had loaded with: the device A holds most of. It now says so; an error of another kind does not."""
    import app.gui.records_jobs as jobs

    entries = SHARED_CARD["entries"]
    device, ctx = shared_card_context(jobs)

    def b_failure(b_entries: dict) -> str:
        job = jobs.SideBySideJob("Hi", 1, {**entries, **b_entries}, history_path=str(tmp_path / "h.sqlite"))
        return job(ctx).comparison.failures[1]

    beside = " (beside A, which stays loaded and holds 1.1 MiB of the device)"
    assert b_failure({"mode": "required", "device_expert_bytes": str(16 * EXPERT)}) == (
        f"B's model: offload mode 'required': device_expert_bytes={16 * EXPERT} exceeds the 276.0 KiB ({8 * EXPERT} "
        f"bytes) the device has free" + beside)
    assert b_failure({"mode": "required", "reserve_device_bytes": str(8 * EXPERT)}).endswith(
        "of the 276.0 KiB the device has free it keeps 276.0 KiB for KV cache and workspace (reserve_device_bytes); "
        "set a smaller reserve or a device_expert_bytes" + beside)
    assert b_failure({"node_overrides": "nowhere:max_resident_slots=1"}).endswith(
        "(they are /model/layers.0/moe/QMoE, /model/layers.1/moe/QMoE)")


def test_the_history_gives_b_the_budget_it_had_beside_a_then_the_one_it_asked(qtbot, tmp_path, capsys):
    """B's device_expert_bytes, more than the device had free beside A, was cut to that free memory, yet the
    History's budget column (and `history`'s) gave the bytes asked, as if B had had them. Both now give the bytes B
    had, then those asked."""
    import app.gui.records_jobs as jobs
    from app.cli import main
    from app.gui.history_view import HEADERS, HistoryView

    entries = SHARED_CARD["entries"]
    device, ctx = shared_card_context(jobs)
    history = tmp_path / "h.sqlite"
    result = jobs.SideBySideJob("Hi", 1, {**entries, "device_expert_bytes": str(16 * EXPERT)},
                                history_path=str(history))(ctx)
    b = result.comparison.budgets[1]
    assert b.cut and (b.budget_bytes, b.asked_bytes) == (8 * EXPERT, 16 * EXPERT)
    view = HistoryView(history)
    qtbot.addWidget(view)
    assert [view.table.item(row, HEADERS.index("budget")).text() for row in (0, 1)] == [
        "276.0 KiB (asked 552.0 KiB)", f"auto ({human_bytes(result.comparison.budgets[0].budget_bytes)})"]  # B, then A
    assert main(["history", "--history", str(history)]) == 0
    assert "  budget 276.0 KiB (asked 552.0 KiB)  " in capsys.readouterr().out.splitlines()[0]


def test_the_history_says_a_sides_process_rss_peak_holds_both_sides_models(qtbot, tmp_path):
    """B is loaded beside A in one process, so each side's RSS and VRAM peaks are the process's and hold the other
    side's model too; History's "RSS peak" gave them as if each side's own. A side's record now says the other side's
    model was loaded, and History and the run's detail say so; a side that answered alone (B could not load) says
    nothing of the kind."""
    import app.gui.records_jobs as jobs
    from app.gui.history_view import HEADERS, RSS_TIP, HistoryView
    from app.gui.record_report import detail_html

    entries = SHARED_CARD["entries"]
    device, ctx = shared_card_context(jobs)
    history = tmp_path / "h.sqlite"
    both = jobs.SideBySideJob("Hi", 1, entries, history_path=str(history))(ctx).comparison.records
    assert [record.peaks["other_side_loaded"] for record in both] == [True, True]
    alone = jobs.SideBySideJob("Hi", 1, {**entries, "mode": "required", "device_expert_bytes": str(16 * EXPERT)},
                               history_path=str(history))(ctx).comparison.records[0]  # B could not load
    assert alone.peaks["other_side_loaded"] is False
    view = HistoryView(history)
    qtbot.addWidget(view)
    rss = HEADERS.index("process RSS peak")
    peaks = [record.peaks["rss_bytes"] for record in (alone, both[1], both[0])]  # newest first
    assert [view.table.item(row, rss).text() for row in range(3)] == [
        human_bytes(peaks[0]), f"{human_bytes(peaks[1])} (A and B loaded)", f"{human_bytes(peaks[2])} (A and B loaded)"]
    assert view.table.horizontalHeaderItem(rss).toolTip() == RSS_TIP
    said = "both sides' models: the other side's was loaded in this process too (side by side)"
    assert said in html.unescape(detail_html(both[1])) and "process peaks hold" in detail_html(both[1])
    assert "process peaks hold" not in detail_html(alone)


def test_side_by_side_does_not_blame_a_where_bs_own_gpu_device_mem_limit_left_it_too_little(tmp_path):
    """B refused under its own gpu_device_mem_limit, which bounds what B has free whatever A holds, was said to have
    failed "(beside A, which stays loaded and holds 1.1 MiB of the device)": the limit's sums alone say why."""
    import app.gui.records_jobs as jobs

    entries = SHARED_CARD["entries"]
    _, ctx = shared_card_context(jobs, make_device=lambda *_: None)
    job = jobs.SideBySideJob("Hi", 1, {**entries, "mode": "required", "gpu_device_mem_limit": "100000"},
                             history_path=str(tmp_path / "h.sqlite"))
    failure = job(ctx).comparison.failures[1]
    assert failure.startswith("B's model: offload mode 'required': the automatic expert budget of 0 bytes holds no "
                              "expert")
    assert failure.endswith("it keeps 28.7 KiB for KV cache and workspace (reserve_device_bytes); set a smaller "
                            "reserve, a device_expert_bytes or a larger gpu_device_mem_limit")


def test_side_by_side_says_bs_gpu_out_of_memory_as_bs_offload_mode_says_it(tmp_path, monkeypatch):
    """B under mode=disabled (every expert beside the dense part, the expert budgets not applied) beside an A under
    mode=auto: B's load that ran out of the card's memory failed the whole comparison, said as A's mode says it
    (lower device_expert_bytes); B's device that did once the sides answered was said without a mode, alike. B's load
    is B's failure, A answering alone, and both are said as B's own configuration says it."""
    import app.gui.records_jobs as jobs
    from engine.errors import GPU_OUT_OF_MEMORY_DISABLED

    device = SimulatedDevice(1 << 30)
    left = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    ctx = jobs.JobContext(left, device, {"kind": "simulated", "capacity": 1 << 30}, threading.Event(),
                          lambda *_: None, lambda _: None, lambda *_: None)
    with monkeypatch.context() as patch:
        patch.setattr(jobs.LoadedModel, "open", out_of_memory)  # B's load
        result = jobs.SideBySideJob("Hi", 1, {"mode": "disabled"}, history_path=str(tmp_path / "h.sqlite"))(ctx)
    a, b = result.comparison.records
    assert a.turns[0]["generated_tokens"] == 1 and b is None and len(result.saved_ids) == 1
    assert result.comparison.failures[1] == (f"B's model: {RAN_OUT}{GPU_OUT_OF_MEMORY_DISABLED} (beside A, which "
                                             f"stays loaded and holds {human_bytes(device.memory.used)} of the device)")
    monkeypatch.setattr(SimulatedDevice, "quiesce", out_of_memory)  # B's device, waited for before B goes
    with pytest.raises(jobs.AfterAnswersFailed) as failed:
        jobs.SideBySideJob("Hi", 1, {"mode": "disabled"}, history_path=str(tmp_path / "h.sqlite"))(ctx)
    assert str(failed.value) == (f"waiting for B's device: {RAN_OUT}{GPU_OUT_OF_MEMORY_DISABLED}; the answers above "
                                 "were not saved")


def test_side_by_side_states_each_sides_budget_and_why_bs_automatic_one_is_smaller(qtbot, window):
    load(qtbot, window, "gptoss", SHARED_CARD)
    view = window.side_by_side
    view.prompt.setPlainText("Compare the two sides")
    view.max_tokens.setValue(2)
    view.bar.run_button.click()  # B: "Same as A", its budget automatic as A's
    finish(qtbot, window, view)
    assert view.left.values["expert budget"].text() == "1.2 MiB, automatic: of 1.3 MiB free"
    assert view.right.values["expert budget"].text() == "138.0 KiB, automatic: of 276.0 KiB free"
    assert view.divergence.text().endswith(
        " B's automatic expert budget, 138.0 KiB, was computed from the 276.0 KiB the device had free beside A, which "
        "stays loaded and holds its part of it (A's plan saw 1.3 MiB free): B has less than its settings give it "
        "alone. For budgets on equal terms give both sides a device_expert_bytes the device holds together (A's in "
        "Budgets, then load).")
    view.right_entries.setPlainText(f"device_expert_bytes={3 * EXPERT}")  # a budget B sets: nothing to explain
    view.bar.run_button.click()
    finish(qtbot, window, view)
    assert view.right.values["expert budget"].text() == "103.5 KiB, device_expert_bytes"
    assert "beside A" not in view.divergence.text()


def test_side_by_side_says_where_bs_own_budget_was_cut_to_what_a_left_free(qtbot, window):
    """A device_expert_bytes of B's above what the device has free beside A is cut to that (mode=auto): B's column
    gave the cut budget as the one B set ("276.0 KiB, device_expert_bytes" for 552 KiB asked), and nothing said A's
    memory cut it."""
    load(qtbot, window, "gptoss", SHARED_CARD)  # A holds 32 experts' bytes of the card's 56
    view = window.side_by_side
    view.prompt.setPlainText("Compare the two sides")
    view.max_tokens.setValue(2)
    view.right_entries.setPlainText(f"device_expert_bytes={16 * EXPERT}")  # every expert, alone
    view.bar.run_button.click()
    finish(qtbot, window, view)
    assert view.result.comparison.budgets[1].budget_bytes == 8 * EXPERT
    assert view.right.values["expert budget"].text() == ("276.0 KiB, all the device had free "
                                                          "(device_expert_bytes=552.0 KiB)")
    assert view.divergence.text().endswith(
        " B's device_expert_bytes, 552.0 KiB, is more than the 276.0 KiB the device had free beside A, which stays "
        "loaded and holds its part of it (A's plan saw 1.3 MiB free): B's budget is 276.0 KiB. For budgets on equal "
        "terms give both sides a device_expert_bytes the device holds together (A's in Budgets, then load).")


def test_side_by_side_says_when_bs_budget_changes_nothing_on_the_cpu(qtbot, window):
    load(qtbot, window, "gptoss")  # no device: every expert on the CPU, for A and for B
    view = window.side_by_side
    view.prompt.setPlainText("Compare the two sides")
    view.max_tokens.setValue(4)
    view.right_entries.setPlainText(f"device_expert_bytes={3 * EXPERT}\nplacement=static")
    view.bar.run_button.click()
    finish(qtbot, window, view)
    assert view.result.comparison.records[1].offload["device"] == "cpu"
    assert view.right.values["device peak"].text() == "no device: every expert on the CPU"
    assert view.divergence.text().endswith(
        " B's device_expert_bytes, placement changed nothing: the model is loaded for the CPU, where every expert runs "
        "(choose a simulated or CUDA device in Budgets, then load, to compare budgets).")
    view.right_entries.setPlainText("cpu_threads=1")  # not a device setting: nothing to say
    view.bar.run_button.click()
    finish(qtbot, window, view)
    assert "changed nothing" not in view.divergence.text()


# what a CUDA GPU another process holds in exclusive-process mode says when it cannot be opened
CUDA_BUSY = ("CUDA device 0 cannot be opened (CUDARuntimeError: cudaErrorDevicesUnavailable: CUDA-capable device(s) "
             "is/are busy or unavailable)")


def load_where_cuda_cannot_be_used(qtbot, window, monkeypatch, note):
    """The fixture loaded with the CUDA GPU asked for, where the worker's stand-in cannot use it and says `note`: every
    expert on the CPU."""
    from app.gui import engine_worker

    monkeypatch.setattr(engine_worker, "cuda_device_or_cpu", lambda mem_limit, mode, report: (None, note))
    load(qtbot, window, "gptoss", {"device": {"kind": "cuda"}})


def test_side_by_side_says_why_b_runs_on_the_cpu_where_its_cuda_gpu_cannot_be_used(qtbot, window, monkeypatch,
                                                                                   tmp_path):
    """B asked for the CUDA GPU under mode=auto and could not have it: B ran every expert on the CPU, but its reason
    was thrown away, so the comparison said only "no device: every expert on the CPU" and told the user to choose the
    CUDA device they had chosen. B's column, the comparison and B's record now say why. A stand-in for the worker's
    CUDA GPU that cannot be opened (another process holds it in exclusive-process mode)."""
    busy = CUDA_BUSY
    note = f"The CUDA GPU was asked for but cannot be used ({busy}); every expert runs on the CPU instead."
    load_where_cuda_cannot_be_used(qtbot, window, monkeypatch, note)
    view = window.side_by_side
    view.prompt.setPlainText("Compare the two sides")
    view.max_tokens.setValue(2)
    view.right_entries.setPlainText(f"device_expert_bytes={3 * EXPERT}")
    view.bar.run_button.click()
    finish(qtbot, window, view)
    said = f"the CUDA GPU was asked for but cannot be used ({busy}); every expert runs on the CPU instead."
    assert view.right.values["device peak"].text() == f"no device: {said}"
    assert view.divergence.text().endswith(f" B's device_expert_bytes changed nothing: {said}")
    record = view.result.comparison.records[1]
    assert record.offload["device"] == "cpu" and record.offload["device_fallback"] == note
    assert History(tmp_path / "history.sqlite3").get(view.result.saved_ids[1]).offload["device_fallback"] == note


def test_side_by_side_says_why_a_runs_on_the_cpu_where_its_cuda_gpu_could_not_be_used(qtbot, window, monkeypatch,
                                                                                       tmp_path):
    """The loaded model (A) asked for the CUDA GPU under mode=auto and could not have it: the load said why, but the
    worker kept that only for the load's "where everything landed", so A's column said "no device: every expert on the
    CPU" and A's record said nothing, while B's, falling back the same way, said why. A's now say it as B's do. A
    stand-in for the worker's CUDA GPU whose kernels' compile failed."""
    note = ("The CUDA GPU was asked for but cannot be used (the GPU expert kernels failed to compile: NVRTC error); "
            "every expert runs on the CPU instead.")
    load_where_cuda_cannot_be_used(qtbot, window, monkeypatch, note)
    view = window.side_by_side
    view.prompt.setPlainText("Compare the two sides")
    view.max_tokens.setValue(2)
    view.bar.run_button.click()
    finish(qtbot, window, view)
    said = ("the CUDA GPU was asked for but cannot be used (the GPU expert kernels failed to compile: NVRTC error); "
            "every expert runs on the CPU instead.")
    assert view.left.values["device peak"].text() == f"no device: {said}"
    assert view.right.values["device peak"].text() == f"no device: {said}"
    record = view.result.comparison.records[0]
    assert record.offload["device"] == "cpu" and record.offload["device_fallback"] == note
    assert History(tmp_path / "history.sqlite3").get(view.result.saved_ids[0]).offload["device_fallback"] == note


def test_a_sweep_refused_for_want_of_a_device_says_why_the_cuda_gpu_chosen_could_not_be_used(qtbot, window,
                                                                                              monkeypatch):
    """A budget sweep needs a device: on a model loaded for the CUDA GPU that could not be used (mode=auto) the window
    told the user to load it "with a simulated GPU or the CUDA GPU", the GPU they had chosen, without saying why it is
    not there (the command line's sweep says why). It now says why, and what gives a device. A stand-in for the
    worker's CUDA GPU whose kernels' compile failed."""
    note = ("The CUDA GPU was asked for but cannot be used (the GPU expert kernels failed to compile: NVRTC error); "
            "every expert runs on the CPU instead.")
    load_where_cuda_cannot_be_used(qtbot, window, monkeypatch, note)
    window.sweep.points.setValue(2)
    window.sweep.bar.run_button.click()
    finish(qtbot, window, window.sweep)
    assert window.last_error == (
        "A budget sweep needs a device for resident experts, and the loaded model has none: the CUDA GPU was asked for "
        "but cannot be used (the GPU expert kernels failed to compile: NVRTC error); every expert runs on the CPU "
        "instead. A simulated GPU (Budgets panel) gives one.")


def test_a_window_sweep_under_mode_disabled_is_refused_in_the_command_lines_words(qtbot, window, tmp_path):
    """mode=disabled puts every expert where the dense part runs: the command line's sweep refuses it, but the window's
    ran every point on that one plan, "0%" each, and recommended one. It is refused before any run, in the command
    line's line, shown in the window."""
    load(qtbot, window, "gptoss", {**SIMULATED, "entries": {"mode": "disabled"}})
    view = window.sweep
    view.points.setValue(2)
    view.max_tokens.setValue(2)
    view.bar.run_button.click()
    finish(qtbot, window, view)
    said = ("a budget sweep compares expert budgets, and mode=disabled offloads no expert: sweep under mode=auto or "
            "required")
    assert window.last_error == said and view.bar.status.text() == f"Failed: {said}"
    assert view.result is None and History(tmp_path / "history.sqlite3").rows() == []


def test_the_window_sweeps_text_before_a_sweep_says_mode_disabled_is_refused_in_the_refusals_words(qtbot, tmp_path):
    """The text before a sweep said it needs a simulated or CUDA device, and not that a sweep under mode=disabled is
    refused (as the one above is): it ends with the refusal's line, whatever the repeats."""
    from app.gui.sweep_view import SweepView

    view = SweepView(tmp_path / "h.sqlite")
    qtbot.addWidget(view)
    said = (" A budget sweep compares expert budgets, and mode=disabled offloads no expert: sweep under mode=auto or "
            "required.")
    assert "(it needs a simulated or CUDA device)" in view.summary.text() and view.summary.text().endswith(said)
    view.repeats.setValue(1)
    assert view.summary.text().startswith("Runs the scenarios once") and view.summary.text().endswith(said)


def test_a_scenario_runs_record_says_why_it_ran_on_the_cpu_where_its_cuda_gpu_could_not_be_used(qtbot, window,
                                                                                               monkeypatch, tmp_path):
    """The loaded model asked for the CUDA GPU under mode=auto and could not have it: side by side's records said why
    every expert ran on the CPU, but a scenario run's record said only "cpu", as if the CPU had been chosen. It now
    says why in the same field, and the run's detail in the history shows it. A stand-in for the worker's CUDA GPU
    that another process holds."""
    from app.gui.record_report import detail_html

    busy = CUDA_BUSY
    note = f"The CUDA GPU was asked for but cannot be used ({busy}); every expert runs on the CPU instead."
    load_where_cuda_cannot_be_used(qtbot, window, monkeypatch, note)
    bar = window.scenarios
    bar.scenario.setCurrentText("short")
    bar.max_tokens.setValue(2)
    bar.bar.run_button.click()
    finish(qtbot, window, bar)
    run_id, record = bar.result.saved[0]
    assert record.offload["device"] == "cpu" and record.offload["device_fallback"] == note
    saved = History(tmp_path / "history.sqlite3").get(run_id)
    assert saved.offload["device_fallback"] == note
    assert f"<tr><td>device</td><td>cpu</td></tr><tr><td>why on the CPU</td><td>{note}</td></tr>" in detail_html(saved)


def test_the_chat_keys_on_the_side_by_side_tab_answer_both_and_leave_the_hidden_chat_alone(qtbot, window):
    """Ctrl+Return on the Side by side tab sent the hidden chat's draft as a message (the comparison did not run), and
    Ctrl+K put the focus in that hidden message box: Send and Regenerate answer both there now, and the chat's own keys
    bring the Chat tab forward first."""
    load(qtbot, window, "gptoss")
    view = window.side_by_side
    window.chat.prompt.setPlainText("a chat draft")
    window.tabs.setCurrentIndex(1)  # Side by side
    window.activateWindow()
    qtbot.waitUntil(window.isActiveWindow)
    view.prompt.setFocus()
    view.prompt.setPlainText("Compare the two sides")
    view.max_tokens.setValue(3)
    qtbot.keyClick(view.prompt, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)
    assert view.bar.running and view.prompt.toPlainText() == "Compare the two sides"
    finish(qtbot, window, view)
    first = view.result.saved_ids
    assert len(first) == 2 and window.chat.entries == [] and window.chat.prompt.toPlainText() == "a chat draft"
    qtbot.keyClick(view.prompt, Qt.Key.Key_R, Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.ShiftModifier)
    assert view.bar.running  # answered again
    finish(qtbot, window, view)
    assert len(view.result.saved_ids) == 2 and view.result.saved_ids != first and window.chat.entries == []
    qtbot.keyClick(view.prompt, Qt.Key.Key_K, Qt.KeyboardModifier.ControlModifier)
    assert window.tabs.currentWidget() is window.chat and window.chat.prompt.hasFocus()


def test_contention_view_times_three_phases_and_saves_the_report(qtbot, window, tmp_path):
    from engine.records.contention import ratio_words

    load(qtbot, window, "gptoss")
    view = window.contention_view
    view.corpus.setText(str(make_corpus(tmp_path / "corpus", files=12, words_per_file=200)))
    view.workers.setValue(1)
    view.max_tokens.setValue(4)
    view.bar.run_button.click()
    finish(qtbot, window, view)
    report = view.result.report
    assert report.documents == 12 and report.workers == 1
    assert report.indexing_alone_s > 0 and report.inference_alone_s > 0
    assert report.indexing_with_inference_s > 0 and report.inference_with_indexing_s > 0
    assert view.table.item(0, 1).text() == duration_text(report.indexing_alone_s)
    assert view.table.item(1, 2).text() == duration_text(report.inference_with_indexing_s)
    assert view.table.item(1, 3).text() == ratio_words(report.inference_slowdown)
    shares = report.others_share
    assert view.bar.status.text().endswith(f"Other processes took {shares['indexing_alone']:.0%} and "
                                           f"{shares['inference_alone']:.0%} of the CPUs' time while each ran alone.")
    saved = view.save(str(tmp_path / "contention.md"))
    assert saved.read_text() == report.markdown()


def test_the_contention_report_says_why_the_inference_ran_on_the_cpu_where_its_cuda_gpu_could_not_be_used(
        qtbot, window, monkeypatch, tmp_path):
    """The loaded model asked for the CUDA GPU under mode=auto and could not have it: the contention test timed its
    inference with every expert on the CPU, and neither the view nor the report it saves said so (side by side's
    records did). The report keeps why, as a run record does, and the view and the saved report say it. A stand-in
    for the worker's CUDA GPU whose kernels' compile failed."""
    note = ("The CUDA GPU was asked for but cannot be used (the GPU expert kernels failed to compile: NVRTC error); "
            "every expert runs on the CPU instead.")
    load_where_cuda_cannot_be_used(qtbot, window, monkeypatch, note)
    view = window.contention_view
    view.corpus.setText(str(make_corpus(tmp_path / "corpus", files=4, words_per_file=60)))
    view.workers.setValue(1)
    view.max_tokens.setValue(2)
    view.bar.run_button.click()
    finish(qtbot, window, view)
    report = view.result.report
    assert report.device_fallback == note and report.as_dict()["device_fallback"] == note
    assert view.bar.status.text().endswith(f" of the CPUs' time while each ran alone. {note}")
    assert f" at most 2 tokens each.\n\n{note}\n\n" in view.save(str(tmp_path / "contention.md")).read_text()


def test_the_contention_view_says_a_faster_run_together_and_the_thread_count_that_gave_way(qtbot):
    """'Done: indexing 0.93× slower together' for indexing that took less time beside the inference; and the CPU
    expert kernels' thread count, which the saved report gives (1 of 2 threads beside the indexing), was not in the
    window at all."""
    from app.gui.contention_view import ContentionView
    from app.gui.records_jobs import ContentionResult
    from engine.records.contention import ContentionReport

    view = ContentionView()
    qtbot.addWidget(view)
    threads = {"cpu_threads_automatic": True, "cores": 2, "others_busy_cores": 0.0}
    report = ContentionReport(1, 12, 1.0, 2.0, 0.93, 10.0, {**threads, "cpu_threads_in_force": 2,
                                                             "cpu_threads_changes": 0},
                              {**threads, "cpu_threads_in_force": 1, "cpu_threads_changes": 2},
                              {"indexing_alone": 0.05, "inference_alone": 0.02, "together": 0.6})
    view.on_finished(ContentionResult(report, "corpus"))
    assert view.bar.status.text() == (
        "Done: together, the indexing took 0.93× its time alone and the inference 5.00×. CPU expert kernels: 2 of 2 "
        "threads alone, 1 beside the indexing (cpu_threads automatic). Other processes took 5% and 2% of the CPUs' "
        "time while each ran alone.")


def test_the_contention_view_names_the_scenario_that_ran_not_the_one_chosen_since(qtbot):
    """The scenario box stays open while the test runs: one changed meanwhile named the result's row ("inference
    (long)" for a test that answered the short scenario)."""
    from app.gui.contention_view import ContentionView
    from app.gui.records_jobs import ContentionResult
    from engine.records.contention import ContentionReport

    view = ContentionView()
    qtbot.addWidget(view)
    jobs = []
    view.jobRequested.connect(lambda _kind, job: jobs.append(job))
    view.scenario.setCurrentText("short")
    view.run()
    view.scenario.setCurrentText("long")
    view.on_finished(ContentionResult(ContentionReport(1, 12, 1.0, 2.0, 1.5, 3.0, scenario=jobs[0].scenario), "corpus"))
    assert jobs[0].scenario == "short" and view.table.item(1, 0).text() == "inference (short)"


def test_the_contention_view_names_the_inference_warm_up_as_the_phase_that_runs_first(qtbot, tmp_path):
    """With a corpus given the test starts at its first warm-up, which is the inference's (a multiturn scenario past the
    context is refused there, before any indexing): the bar said "Warming up: indexing…" meanwhile."""
    from app.gui.contention_view import ContentionView

    view = ContentionView()
    qtbot.addWidget(view)
    view.corpus.setText(str(tmp_path))
    view.run()
    assert view.bar.status.text() == "Warming up: inference…"


def test_the_contention_views_cancel_counts_the_warm_ups_among_its_phases(qtbot):
    """Cancel's tooltip said "between the three phases", the timed ones, while the bar names the two warm-ups as phases
    too, and Cancel stops between those as well."""
    from app.gui.contention_view import ContentionView
    from engine.records.contention import PHASES

    view = ContentionView()
    qtbot.addWidget(view)
    assert len(PHASES) == 5 and view.bar.cancel_button.toolTip() == (
        "Cancel takes effect between the five phases, the two warm-ups among them (an answer stops at its next token)")


def test_the_contention_view_says_the_cpu_stands_in_for_a_simulated_card(qtbot):
    """On the simulated GPU the inference's times are the CPU's (it computes the card's experts too): the saved report
    said so, but the window's line did not, and its inference slowdown read as the card's."""
    from app.gui.contention_view import ContentionView
    from app.gui.records_jobs import ContentionResult
    from engine.records.contention import ContentionReport

    view = ContentionView()
    qtbot.addWidget(view)
    view.on_finished(ContentionResult(ContentionReport(1, 12, 1.0, 2.0, 1.5, 3.0, simulated=True), "corpus"))
    assert view.bar.status.text() == (
        "Done: together, the indexing took 1.50× its time alone and the inference 1.50×. The CPU computes the "
        "simulated card's experts too, standing in for it: the inference times are the CPU's, not the card's.")
    view.on_finished(ContentionResult(ContentionReport(1, 12, 1.0, 2.0, 1.5, 3.0), "corpus"))
    assert view.bar.status.text() == "Done: together, the indexing took 1.50× its time alone and the inference 1.50×."


def test_the_contention_tables_give_a_fast_answers_time_in_figures_that_tell_it(qtbot):
    """The report's table and the window's gave times with two decimals: a small model's inference in 4 ms read
    "0.00 s" alone and together, then "0.00412 s" in a format of their own. They give them as the window gives every
    time (units.duration_text)."""
    from app.gui.contention_view import ContentionView
    from app.gui.records_jobs import ContentionResult
    from engine.records.contention import ContentionReport

    report = ContentionReport(1, 12, 1.5, 0.00412, 2.25, 0.0087)
    assert report.markdown().splitlines()[2:4] == [
        "| indexing 12 files, 1 worker | 1.50 s | 2.25 s | 1.50x (slower) |",
        "| inference | 4.12 ms | 8.70 ms | 2.11x (slower) |"]
    view = ContentionView()
    qtbot.addWidget(view)
    view.on_finished(ContentionResult(report, "corpus"))
    assert [view.table.item(1, c).text() for c in range(1, 4)] == ["4.12 ms", "8.70 ms", "2.11× (slower)"]
    assert [view.table.item(0, c).text() for c in range(1, 4)] == ["1.50 s", "2.25 s", "1.50× (slower)"]


def test_the_contention_tables_last_column_is_time_together_over_alone_and_says_a_faster_run_is_faster(qtbot):
    """The column was headed "slowdown": an indexing that took 0.65 of its time alone beside the inference read
    "0.65×" under it, a slowdown that was a speed-up. The header says what the figure is, and the figure which way."""
    from app.gui.contention_view import ContentionView
    from app.gui.records_jobs import ContentionResult
    from engine.records.contention import ContentionReport

    report = ContentionReport(1, 12, 2.0, 1.0, 1.3, 1.002)
    assert report.markdown().splitlines()[:4] == [
        "| workload | alone | together | time together / alone |", "|---|---|---|---|",
        "| indexing 12 files, 1 worker | 2.00 s | 1.30 s | 0.65x (faster) |", "| inference | 1.00 s | 1.00 s | 1.00x |"]
    view = ContentionView()
    qtbot.addWidget(view)
    view.on_finished(ContentionResult(report, "corpus"))
    assert view.table.horizontalHeaderItem(3).text() == "time together / alone"
    assert [view.table.item(r, 3).text() for r in range(2)] == ["0.65× (faster)", "1.00×"]


def test_the_saved_h100_contention_report_says_it_is_in_an_older_format_than_a_report_made_now():
    """docs/h100/contention.md, the README's contention report, was saved on 2026-12-05 and its header and ratios
    brought to markdown()'s by hand, but it still read as a report made now where it is not one: its times are "0.79 s"
    where duration_text gives "790 ms", and it names no model, device or answers. Nothing kept the run's unrounded times
    or settings (docs/h100's JSON files are the record and the sweep), so it cannot be made again: it says so above its
    table, which has the header and the ratios' words markdown() gives."""
    from engine.records.contention import RATIO_HEADER, ratio_words
    from engine.units import duration_text

    text = (Path(__file__).parent.parent / "docs" / "h100" / "contention.md").read_text()
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| workload"))
    assert lines[head:head + 2] == [f"| workload | alone | together | {RATIO_HEADER} |", "|---|---|---|---|"]
    times = []
    for row in lines[head + 2:head + 4]:
        alone, together, ratio = (cell.strip() for cell in row.strip("| ").split(" | ")[1:])
        figure = float(ratio.split("x")[0])
        assert ratio == ratio_words(figure, "x"), row
        assert figure == pytest.approx(float(together[:-2]) / float(alone[:-2]), abs=0.05), row
        times += [alone, together]
    assert [duration_text(float(time[:-2])) for time in times] != times  # as no report made now gives them
    note = " ".join(lines[:head])
    assert note.startswith("A record of a report in the format of 2026-12-05, when `moe-workbench contention` made it")
    assert "so it is not made again" in note


def test_the_windows_record_and_contention_test_past_the_context_do_not_say_to_start_a_new_conversation(
        copy_fixture, tmp_path, monkeypatch):
    """A multiturn Record or contention test whose answers filled the model's context ended in the chat's "...: start a
    new conversation", which neither can do; they say what leaves the turns more room, as `record` does. The contention
    test said so only after its untimed indexing warm-up (minutes on the default corpus): no indexing runs before it
    now, the inference warming up first."""
    import engine.records.contention as contention
    from app.gui.records_jobs import ContentionJob, ScenarioJob
    from engine.errors import PromptError

    indexed = []
    monkeypatch.setattr(contention, "index_folder", lambda folder, workers: indexed.append(folder) or (2, 0.1))

    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["context_length"] = 80
    (folder / "genai_config.json").write_text(json.dumps(config))
    model = LoadedModel.open(folder)
    said = (r"multiturn: the conversation so far \(\d+ tokens\) and this message \(\d+\) come to \d+ tokens, past the "
            r"model's context of 80 \(a smaller answer length leaves the scenario's turns more room\)")
    result = ScenarioJob(["multiturn"], 30, str(tmp_path / "h.sqlite"))(_sweep_context(model, None, []))
    assert result.saved == [] and len(result.errors) == 1 and re.fullmatch(said, result.errors[0]), result.errors
    corpus = str(make_corpus(tmp_path / "corpus", files=2, words_per_file=30))
    with pytest.raises(PromptError) as raised:
        ContentionJob(corpus, 1, "multiturn", 30)(_sweep_context(model, None, []))
    assert re.fullmatch(said, str(raised.value)), raised.value
    assert indexed == []


def test_the_windows_sweep_past_the_context_does_not_say_to_start_a_new_conversation(copy_fixture, tmp_path):
    """As the window's Record (above): a sweep whose multiturn answers filled the model's context failed in the chat's
    "...: start a new conversation", which a sweep cannot do; it says what leaves the turns more room."""
    from app.gui.records_jobs import SweepJob

    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["context_length"] = 80
    (folder / "genai_config.json").write_text(json.dumps(config))
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(folder, offload=OffloadConfig(), device=device)
    result = SweepJob(2, ["multiturn"], 30, str(tmp_path / "h.sqlite"), repeats=1)(_sweep_context(model, device, []))
    assert result.points == [] and result.stopped_at == ("at budget share 0% (device_expert_bytes=0), point 1 of 2, "
                                                         "in its multiturn run")
    assert re.fullmatch(r"the conversation so far \(\d+ tokens\) and this message \(\d+\) come to \d+ tokens, past the "
                        r"model's context of 80 \(a smaller answer length leaves the scenario's turns more room\)",
                        result.failure), result.failure


def test_the_windows_contention_test_names_the_scenario_whose_prompt_the_context_cannot_hold(copy_fixture, tmp_path,
                                                                                             monkeypatch):
    """The contention test's inference refused for a prompt past the model's context said "the prompt has N tokens
    but the model's context is M", naming no scenario, where the window's Record names it; it names it as Record
    does."""
    import engine.records.contention as contention
    from app.gui.records_jobs import ContentionJob
    from engine.errors import PromptError

    monkeypatch.setattr(contention, "index_folder", lambda folder, workers: (2, 0.1))
    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["context_length"] = 24
    (folder / "genai_config.json").write_text(json.dumps(config))
    corpus = str(make_corpus(tmp_path / "corpus", files=2, words_per_file=30))
    with pytest.raises(PromptError) as raised:
        ContentionJob(corpus, 1, "short", 2)(_sweep_context(LoadedModel.open(folder), None, []))
    assert re.fullmatch(r"short: the prompt has \d+ tokens but the model's context is 24", str(raised.value)), \
        raised.value


def test_the_windows_contention_report_names_the_model_and_the_device(tmp_path):
    """The command line's report opens with the model and the device it measured (and says the CPU stands in for a
    simulated card); the one the window saves named neither, as its job did not pass them on. Its inference row read
    "inference" whichever scenario ran, where the window's table says "inference (short)"."""
    from app.gui.records_jobs import ContentionJob

    corpus = str(make_corpus(tmp_path / "corpus", files=4, words_per_file=60))
    device = SimulatedDevice(1 << 30)
    gptoss = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(device_expert_bytes=2 * EXPERT),
                              device=device)
    report = ContentionJob(corpus, 1, max_new_tokens=2)(_sweep_context(gptoss, device, [])).report
    assert report.markdown().startswith(
        f"Model {fixture_folder('gptoss').resolve()}, on the simulated GPU, 1.0 GiB. The CPU computes the simulated "
        "card's experts too, standing in for it: the inference times are the CPU's, not the card's.\n\n| workload |")
    assert (report.model, report.device, report.simulated) == (
        str(fixture_folder("gptoss").resolve()), "simulated GPU, 1.0 GiB", True)
    assert report.markdown().splitlines()[5].startswith("| inference (short) | ")
    lfm2 = LoadedModel.open(fixture_folder("lfm2moe"))
    report = ContentionJob(corpus, 1, max_new_tokens=2)(_sweep_context(lfm2, None, [])).report
    assert report.markdown().startswith(f"Model {fixture_folder('lfm2moe').resolve()}, on the CPU.\n\n| workload |")


def test_sweep_view_runs_both_layer_splits_and_draws_the_whole_layer_points_apart(qtbot, window):
    load(qtbot, window, "gptoss", SIMULATED)
    view = window.sweep
    view.points.setValue(3)
    view.scenario.setCurrentText("short")
    view.max_tokens.setValue(3)
    view.both_splits.setChecked(True)
    view.bar.run_button.click()
    finish(qtbot, window, view)
    points = view.result.points
    # 2 layers: half the budget holds one whole; none and all hold 0 and 2 (one run there)
    assert [(p.fraction, p.split) for p in points] == [(0.0, "spread"), (0.5, "spread"), (0.5, "whole"),
                                                       (1.0, "spread")]
    assert view.result.requested == 4 and not view.result.cancelled
    x, _y = view.curves["completion"].getData()
    assert list(x) == [view.x(p) for p in points if p.split == "spread"]  # the curve: every budget once
    whole_x, whole_y = view.whole["completion"].getData()
    assert list(whole_x) == [view.x(points[2])] and list(whole_y) == [points[2].completion_s]
    assert list(view.projected_whole["tokens"].getData()[1]) == [points[2].projected_decode_tokens_per_s]
    best = view.recommended
    assert best is recommend(points, view.margin.value() / 100)
    where = {"whole": "on whole layers", "spread": "spread over every layer"}[best.split]
    assert where in view.summary.text()
    assert window.worker._model.offload.layer_split_mode == "spread"  # the loaded model's split (the suite's), back


def test_record_and_the_contention_test_answer_the_command_lines_length_for_a_model_that_answers_at_once(
        qtbot, tmp_path, monkeypatch, capsys):
    """One default (engine/records/lengths.py): the window's Record and contention test answered 32 tokens where
    `record` and `contention` answered 64; a sweep's is the command's too."""
    import app.gui.records_jobs as jobs
    import engine.records.contention as contention
    import engine.records.scenarios as scenarios
    from app.cli import _build_parser, main
    from app.gui.contention_view import ContentionView
    from app.gui.scenario_view import ScenarioView
    from app.gui.sweep_view import SweepView
    from engine.errors import WorkbenchError
    from engine.records.lengths import SCENARIO_TOKENS, SWEEP_TOKENS

    lengths = []

    def run_scenario(_model, name, params, *_args, **_kwargs):
        lengths.append((name, params.max_new_tokens))
        raise WorkbenchError("measured")

    monkeypatch.setattr(scenarios, "run_scenario", run_scenario)
    monkeypatch.setattr(jobs, "run_scenario", run_scenario)
    for module in (contention, jobs):
        monkeypatch.setattr(module, "run_contention", lambda inference, *_args, **_kwargs: inference())
    folder = str(fixture_folder("lfm2moe"))
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("words")
    assert main(["record", folder, "--history", str(tmp_path / "h.sqlite")]) == 2
    assert main(["contention", folder, "--corpus", str(tmp_path / "corpus")]) == 2
    assert capsys.readouterr().err.count("measured") == 2
    ctx = jobs.JobContext(LoadedModel.open(folder), None, {}, threading.Event(), lambda _f, _t: None,
                          lambda _batch: None, None)
    with pytest.raises(WorkbenchError, match="measured"):
        jobs.ScenarioJob(["short"], None, str(tmp_path / "h.sqlite"))(ctx)
    with pytest.raises(WorkbenchError, match="measured"):
        jobs.ContentionJob(str(tmp_path / "corpus"), 1)(ctx)
    assert lengths == [("short", SCENARIO_TOKENS)] * 4 and SCENARIO_TOKENS == 64
    for view in (ScenarioView(), ContentionView()):  # the boxes show it for such a model
        qtbot.addWidget(view)
        view.max_tokens.set_model(None)
        assert view.max_tokens.value() == SCENARIO_TOKENS and view.max_tokens.chosen is None
    sweep = SweepView()  # and a sweep's, for every model
    qtbot.addWidget(sweep)
    assert sweep.max_tokens.value() == _build_parser().parse_args(["sweep", folder]).max_new_tokens == SWEEP_TOKENS


def _sweep_context(model, device, said: list):
    """A stand-in for the worker's JobContext of a sweep on `model`: its status lines appended to `said`."""
    return type("Ctx", (), {"device": device, "cancel": threading.Event(), "loaded": lambda self: model,
                            "device_fallback": "", "progress": lambda self, fraction, text: said.append(text),
                            "stream": lambda self, batch: said.append(batch)})()


def test_a_sweep_job_says_when_a_point_decodes_until_the_trials_are_over(tmp_path):
    """Before each point's runs the sweep decodes, unrecorded, until the engine's trials at that budget end (up to 200
    steps: seconds on a large model): the job's status line says so at each point, between the runs' own lines."""
    from app.gui.records_jobs import SweepJob

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device, decode_path="auto")
    said = []
    ctx = _sweep_context(model, device, said)
    result = SweepJob(3, ["short"], 2, history_path=str(tmp_path / "h.sqlite"))(ctx)
    assert len(result.points) == 3 and not result.cancelled
    settling = [text for text in said if "decoding until the engine's trials" in text]
    assert [text.split(":")[0] for text in settling] == [f"at budget share {share}" for share in ("0%", "50%", "100%")]
    assert said.index(settling[1]) > said.index("3 of 9 runs done") > said.index(settling[0])  # 3 repeats a point


def test_a_window_sweep_says_what_its_warm_up_before_the_first_point_took(qtbot, tmp_path, monkeypatch):
    """The window's sweep said nothing of its unrecorded answer at the loaded budget before the first point, which no
    point's runs time: the legend beside the points says what it took, a stopped sweep's too."""
    from dataclasses import replace

    from app.gui.records_jobs import SweepJob
    from app.gui.sweep_view import SweepView

    loaded = timed_sweep_warm_up(monkeypatch)
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(device_expert_bytes=282624), device=device)
    result = SweepJob(2, ["short"], 1, history_path=str(tmp_path / "h.sqlite"), repeats=1)(
        _sweep_context(model, device, []))
    said = ("Warm-up before the first point, not recorded: an answer of up to 4 tokens at the model's loaded budget, "
            f"budget share 50% (device_expert_bytes={loaded[0]}), took 45.1 ms.")
    view = SweepView(str(tmp_path / "h.sqlite"))
    qtbot.addWidget(view)
    view.on_finished(result)
    assert view.legend.text().endswith(f" {said}")
    # and each point's own, which every one of its runs follows
    warm_ups = [duration_text(point.warm_up_s) for point in result.points]
    assert (" Every run of a point follows its unrecorded warm-up answer at the point's budget (its records' "
            f"point_warm_up_s), which took: budget share 0%: {warm_ups[0]}, budget share 100%: {warm_ups[1]}.") in \
        view.legend.text()
    view.on_finished(replace(result, points=result.points[:1], stopped_at="at budget share 100%"))
    assert view.legend.text().endswith(f" {said}") and view.bar.status.text().startswith("Cancelled at budget")
    view.on_finished(replace(result, warm_up=""))  # a sweep stopped in its warm-up
    assert "Warm-up" not in view.legend.text()


def test_a_sweep_of_the_repeats_chosen_in_the_window_runs_each_point_that_many_times(qtbot, tmp_path):
    """The window's sweep ran every point 3 times (the command line's --repeats had no control there): the Repeats box
    goes to the job, which runs and counts that many repeats a point, and the text before a sweep says what it does."""
    from app.gui.records_jobs import SweepJob
    from app.gui.sweep_view import SweepView

    view = SweepView(tmp_path / "h.sqlite")
    qtbot.addWidget(view)
    assert "3 times at each budget" in view.summary.text() and "spread between their repeats" in view.summary.text()
    view.repeats.setValue(1)
    assert "Runs the scenarios once at each budget" in view.summary.text()
    assert "spread between their repeats" not in view.summary.text()  # one run a point has no spread to compare
    jobs = []
    view.jobRequested.connect(lambda kind, job: jobs.append(job))
    view.points.setValue(2)
    view.run()
    assert jobs[0].repeats == 1
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    said = []
    job = SweepJob(2, ["short"], 2, history_path=str(tmp_path / "h.sqlite"), repeats=jobs[0].repeats)
    result = job(_sweep_context(model, device, said))
    assert [point.repeats for point in result.points] == [1, 1]
    assert [len(point.records) for point in result.points] == [1, 1]
    assert "2 of 2 runs done" in said and not any("of 6 runs" in text for text in said)


def test_a_sweep_jobs_status_counts_the_tokens_of_the_run_it_names(tmp_path, monkeypatch):
    """The status line "run 7 of 12 · 49 tokens" counted every token since the sweep began, though a run's answers here
    take at most 3 tokens (and said "1 tokens"): it counts the run's own."""
    import app.gui.records_jobs as jobs
    from app.gui.records_jobs import SweepJob

    monkeypatch.setattr(jobs, "REPORT_INTERVAL_S", 0.0)  # every token reported
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    said = []
    SweepJob(2, ["short"], 3, history_path=str(tmp_path / "h.sqlite"))(_sweep_context(model, device, said))
    running = [text for text in said if " · " in text]
    assert running == [f"run {run} of 6 · {counted(tokens, 'token')}" for run in range(1, 7) for tokens in (1, 2, 3)]


def test_a_sweep_job_says_when_a_point_first_waits_for_its_experts_mapping(tmp_path, monkeypatch):
    """A point whose re-plan left every expert resident behind maps the experts' pages in again (and on a GPU page-locks
    their mapping) before its unrecorded decode: the status line says that wait, not only the decode after it."""
    from app.gui.records_jobs import SweepJob
    from engine.onnx_file import OnnxFile

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device, decode_path="auto")
    assert model.offload.plan.placement_mode == "all_resident"
    populate = OnnxFile.populate_pages
    monkeypatch.setattr(OnnxFile, "populate_pages",
                        lambda self, *args: threading.Event().wait(0.3) or populate(self, *args))
    said = []
    ctx = _sweep_context(model, device, said)
    result = SweepJob(2, ["short"], 2, history_path=str(tmp_path / "h.sqlite"))(ctx)
    assert len(result.points) == 2 and not result.cancelled
    settling = [text for text in said if "decoding until the engine's trials" in text]
    assert settling[0].startswith("at budget share 0%: mapping its experts again after the re-plan, then decoding "
                                "until")
    assert settling[1].startswith("at budget share 100%: decoding until")


def test_history_lists_the_run_a_side_by_side_saved_before_saving_b_failed(qtbot, window, tmp_path, monkeypatch):
    """Saving B's record fails once A's was saved: the run line says A's answer was saved as run N, and the History
    tab lists that run at once (not at its next refresh)."""
    import sqlite3
    from types import SimpleNamespace

    import app.gui.records_jobs as jobs
    from engine.records.schema import RunRecord
    from engine.records.side_by_side import Comparison

    def answered(left, right, prompt, params, on_done=None, **_):
        records = [RunRecord("side-by-side", "2026-12-05T16:00:00+00:00", {}, {}, {"folder": f"/models/{side}"},
                             {"device": "cpu"}, {}, {}, turns=[{"finish_reason": "eos"}]) for side in "ab"]
        for side in (0, 1):
            on_done(side, "eos", 3)
        return Comparison(tuple(records), None)

    history = History(tmp_path / "history.sqlite3")

    class SavesOnlyA:
        def __init__(self, path):
            self.added = 0

        def add(self, record):
            self.added += 1
            if self.added == 2:
                raise sqlite3.OperationalError("disk I/O error")
            return history.add(record)

    monkeypatch.setattr(jobs, "compare", answered)
    monkeypatch.setattr(jobs, "History", SavesOnlyA)
    monkeypatch.setattr(jobs.LoadedModel, "open", lambda *args, **kwargs: SimpleNamespace(settled=True, offload=None))
    worker = window.worker
    monkeypatch.setattr(worker, "_model", SimpleNamespace(folder=SimpleNamespace(folder="/models/a"), offload=None))
    monkeypatch.setattr(worker, "_make_device", lambda *args: None)
    window.history.refresh()
    assert window.history.ids() == []
    worker._job("comparing", jobs.SideBySideJob("Compare", 8, {}))  # as the worker runs it (here, in this thread)
    run = history.rows()[0]["id"]
    assert window.side_by_side.bar.status.text() == ("Failed: saving to the history: OperationalError: disk I/O "
                                                     f"error; only A's answer was saved, as run {run}")
    assert window.history.ids() == [run] and window.history.count.text() == "1 run"


def test_a_sweep_whose_point_fails_keeps_and_shows_the_points_before_it(qtbot, window, monkeypatch):
    """A re-plan refused at the third point: the window lost the two points before it (nothing saved, nothing plotted)
    where the command line saves each point as it finishes. They are saved and drawn, the run line says which point
    failed and why, and the model is back at the user's budget."""
    from engine.offload.engine import OffloadEngine
    from engine.offload.planner import OffloadPlanError

    load(qtbot, window, "gptoss", SIMULATED)
    reconfigure = OffloadEngine.reconfigure

    def refuse_all(self, config, *args, **kwargs):
        if config.device_expert_bytes == 16 * EXPERT:
            raise OffloadPlanError("device_expert_bytes=565248 exceeds the 400000 bytes the device has free")
        return reconfigure(self, config, *args, **kwargs)

    monkeypatch.setattr(OffloadEngine, "reconfigure", refuse_all)
    view = sweep_three_points(qtbot, window)
    result = view.result
    assert result is not None and [p.budget_bytes for p in result.points] == [0, 8 * EXPERT]
    assert len(result.saved_ids) == 2 * 3 and window.history.ids() == result.saved_ids[::-1]
    assert list(view.curves["completion"].getData()[0]) == [0.0, 8 * EXPERT / 1024]
    assert view.bar.status.text() == ("Failed at budget share 100% (device_expert_bytes=565248), point 3 of 3: "
                                      "device_expert_bytes=565248 exceeds the 400000 "
                                      "bytes the device has free; the 2 points before it are shown, 6 runs saved "
                                      "to the history; no recommendation; the model is back at its own budgets.")
    assert view.recommended is None and not view.save_button.isEnabled()
    assert "Failed at budget share 100% (device_expert_bytes=565248), point 3 of 3" in window.error_banner.text()
    assert window.worker._model.offload.config.device_expert_bytes == 3 * EXPERT  # the user's budget, back


def test_a_sweep_that_restarts_the_layer_split_trials_is_not_said_to_be_a_measured_change(qtbot, window):
    """The sweep puts the user's budgets back with a re-plan that starts the layer split's trials again, from the
    spread: where the trials had kept whole layers, the window then said "Measured faster: the expert budget now holds
    part of every layer" (and marked the graphs), which nothing had measured."""
    load(qtbot, window, "gptoss", SIMULATED)
    offload = window.worker._model.offload
    offload.layer_split_mode = "auto"  # the trials had measured whole layers faster (the worker is idle)
    offload.split_trials.measured = {"spread": 0.030, "whole": 0.020}
    offload._set_whole_layers(True)
    window.worker._emit_stats()
    qtbot.waitUntil(lambda: "Measured faster" in window.status_state.text(), timeout=WAIT)
    said = []
    window.worker.replanned.connect(lambda info: said.append(info.get("by_engine")))
    sweep_three_points(qtbot, window)
    assert not offload.whole_layers and offload.layer_split_mode == "auto"  # the trials start again, from the spread
    assert not any(said) and "Measured faster" not in window.status_state.text()
    assert "whole layers" not in window.model_panel.landed.text()  # where everything landed: as it is now


def test_a_cancelled_window_sweep_keeps_saves_and_shows_the_points_it_completed(qtbot, window, monkeypatch):
    """Cancel during the second of three points: the window threw the first point away ("Cancelled after 1 of 3
    points: nothing saved") where the command line keeps what an interrupted sweep finished. The completed point is
    saved to the history and drawn, and the run line says at which point the sweep was cancelled; no recommendation."""
    import engine.records.sweep as sweep

    load(qtbot, window, "gptoss", SIMULATED)
    run_scenario, calls = sweep.run_scenario, []

    def cancelled_at_the_second_point(*args, **kwargs):
        if kwargs.get("label"):  # a recorded run (the warm-ups have no label)
            calls.append(kwargs["label"])
        if len(calls) == 4:  # the first point's three, then Cancel as the second point's first run starts
            window.worker.cancel.set()
        return run_scenario(*args, **kwargs)

    monkeypatch.setattr(sweep, "run_scenario", cancelled_at_the_second_point)
    view = sweep_three_points(qtbot, window)
    result = view.result
    assert result.cancelled and [p.budget_bytes for p in result.points] == [0]
    assert len(result.saved_ids) == 3 and window.history.ids() == result.saved_ids[::-1]
    assert list(view.curves["completion"].getData()[0]) == [0.0]
    assert view.bar.status.text() == ("Cancelled at budget share 50% (device_expert_bytes=282624), point 2 of 3; the "
                                      "1 point before it is shown, 3 runs saved to the history; no recommendation; the "
                                      "model is back at its own budgets.")
    assert view.recommended is None and not view.save_button.isEnabled()
    assert window.worker._model.offload.config.device_expert_bytes == 3 * EXPERT  # the user's budget, back


def test_a_sweep_that_unload_stops_says_no_model_is_loaded_not_that_it_is_back_at_its_budgets(qtbot, window,
                                                                                                  monkeypatch):
    """Unload during a sweep: its run line said "the model is back at its own budgets" and the status bar "Idle",
    beside "No model loaded", the sweep's stop unsaid. Both say Unload stopped the sweep and that no model is
    loaded, as for a load Unload stops."""
    import engine.records.sweep as sweep

    load(qtbot, window, "gptoss", SIMULATED)
    run_scenario, calls = sweep.run_scenario, []

    def unloaded_at_the_second_point(*args, **kwargs):
        if kwargs.get("label"):
            calls.append(kwargs["label"])
        if len(calls) == 4:  # (on the window's thread: the user's Unload, as the second point's first run starts)
            QTimer.singleShot(0, window, window.unload_action.trigger)
            for _ in range(1000):  # (until the press reaches the worker: the run stops at its first token)
                if window.worker.cancel.is_set():
                    break
                threading.Event().wait(0.01)
        return run_scenario(*args, **kwargs)

    monkeypatch.setattr(sweep, "run_scenario", unloaded_at_the_second_point)
    view = window.sweep
    view.points.setValue(3)
    view.scenario.setCurrentText("short")
    view.max_tokens.setValue(3)
    view.bar.run_button.click()
    qtbot.waitUntil(lambda: view.result is not None and not (window.busy or window._waiting)
                    and window.loaded_path is None, timeout=WAIT)
    assert view.result.cancelled and len(view.result.points) == 1
    assert view.bar.status.text() == ("Cancelled at budget share 50% (device_expert_bytes=282624), point 2 of 3; the "
                                      "1 point before it is shown, 3 runs saved to the history; no recommendation; "
                                      "Unload stopped it: no model is loaded.")
    assert window.status_state.text() == "Stopped the budget sweep; no model is loaded."


def _view_of_a_complete_sweep(qtbot, tmp_path):
    """A sweep view showing a complete three-point sweep of gptoss on a simulated GPU, and that sweep's result."""
    from app.gui.records_jobs import SweepJob
    from app.gui.sweep_view import SweepView

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    complete = SweepJob(3, ["short"], 2, history_path=str(tmp_path / "h.sqlite"))(_sweep_context(model, device, []))
    view = SweepView(str(tmp_path / "h.sqlite"))
    qtbot.addWidget(view)
    view.on_finished(complete)
    return view, complete


def test_a_sweep_that_stops_early_leaves_no_recommendation_behind_even_when_the_margin_changes(qtbot, tmp_path):
    """A sweep that failed after a complete one: its summary still read the earlier sweep's "Recommended: 552.0 KiB of
    experts on the device (100%)…" beside a run line saying "no recommendation", and moving Margin then recommended
    0 B from the points before the failure (the budgets above it never timed) and offered to save it."""
    import dataclasses

    view, complete = _view_of_a_complete_sweep(qtbot, tmp_path)
    assert view.summary.text().startswith("Recommended: ")
    where = "at budget share 100% (device_expert_bytes=565248), point 3 of 3"
    for stopped in (dataclasses.replace(complete, points=complete.points[:2], stopped_at=where, failure="X"),
                    dataclasses.replace(complete, points=complete.points[:2], stopped_at=where)):
        view.on_finished(complete)
        view.on_finished(stopped)
        assert view.summary.text() == ("No recommendation: the sweep stopped at budget share 100% "
                                       "(device_expert_bytes=565248), point 3 of 3, and the budgets from there on "
                                       "were not timed.")
        view.margin.setValue(view.margin.value() + 5)
        assert view.recommended is None and not view.save_button.isEnabled()
        assert view.summary.text().startswith("No recommendation") and not view.marks["completion"].isVisible()


def test_a_sweep_that_fails_outright_takes_the_earlier_sweeps_recommendation_off_the_screen(qtbot, tmp_path):
    """A sweep that failed before any point (the job itself failed) left the earlier sweep's "Recommended: …", its red
    rings and an enabled Save beside "Failed: …", read as this sweep's result; a sweep cancelled or failed at a point
    says "No recommendation" and draws only its own points. Now a failed one does the same."""
    view, complete = _view_of_a_complete_sweep(qtbot, tmp_path)
    assert view.summary.text().startswith("Recommended: ") and view.save_button.isEnabled()
    view.run()
    view.on_failed("the model was unloaded")
    assert view.bar.status.text() == "Failed: the model was unloaded"
    assert view.summary.text() == "No recommendation: the sweep failed before any budget was timed."
    assert view.recommended is None and not view.save_button.isEnabled() and view.save() is None
    assert list(view.curves["completion"].getData()[0] or []) == [] and not view.marks["completion"].isVisible()
    view.margin.setValue(view.margin.value() + 5)
    assert view.summary.text().startswith("No recommendation") and not view.save_button.isEnabled()


def test_a_window_sweeps_saved_configuration_says_the_margin_it_was_recommended_within(qtbot, tmp_path):
    """Margin takes tenths of a percent; the saved configuration's note rounded it to whole ones: recommended within
    2.5%, it said "sweep recommendation within 2% of the fastest" (the command's says 2.5%)."""
    from app.gui.records_jobs import SweepJob
    from app.gui.sweep_view import SweepView

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    result = SweepJob(2, ["short"], 2, history_path=str(tmp_path / "h.sqlite"))(_sweep_context(model, device, []))
    view = SweepView(str(tmp_path / "h.sqlite"), tmp_path / "configurations.json")
    qtbot.addWidget(view)
    view.on_finished(result)
    view.margin.setValue(2.5)
    assert "margin 2.5%" in view.summary.text()
    view.save("close")
    saved = json.loads((tmp_path / "configurations.json").read_text())["close"]
    assert saved["note"].split(";")[0] == ("sweep recommendation within 2.5% of the fastest"
                                           if view.recommendation.within_margin else view.recommendation.note)


def test_a_window_sweeps_saved_configuration_names_the_layer_split_and_decode_path_it_ran_with(qtbot, tmp_path):
    """A configuration holds onnxruntime's keys only, and its note (the Saved menu's tooltip) named the Layer split
    only where both splits ran and whole layers won: a sweep of a model loaded on whole layers, its cold experts
    computed on the CPU, said neither, and chosen later it ran as the Budgets panel then said."""
    from app.gui.records_jobs import SweepJob
    from app.gui.sweep_view import SweepView

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device, layer_split="whole",
                             decode_path="cpu")
    result = SweepJob(2, ["short"], 2, history_path=str(tmp_path / "h.sqlite"))(_sweep_context(model, device, []))
    view = SweepView(str(tmp_path / "h.sqlite"), tmp_path / "configurations.json")
    qtbot.addWidget(view)
    view.on_finished(result)
    view.save("as swept")
    saved = json.loads((tmp_path / "configurations.json").read_text())["as swept"]
    assert saved["note"] == (f"{view.recommendation.note}; with the Layer split whole layers on the device and the "
                             "Cold experts computed on the CPU")
    assert (saved["layer_split"], saved["decode_path"]) == ("whole", "cpu")  # kept beside the entries too


def test_a_window_sweep_of_one_token_answers_recommends_without_a_decode_rate(qtbot, tmp_path):
    """Answers of one token decode nothing after the prefill's token: the summary said "0.0 tok/s projected; measured
    on this machine … 0.0 tok/s", as if decoding had stalled (the command's table says n/a)."""
    from app.gui.records_jobs import SweepJob
    from app.gui.sweep_view import SweepView

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    result = SweepJob(2, ["short"], 1, history_path=str(tmp_path / "h.sqlite"))(_sweep_context(model, device, []))
    view = SweepView(str(tmp_path / "h.sqlite"))
    qtbot.addWidget(view)
    view.on_finished(result)
    summary = view.summary.text()
    assert summary.startswith("Recommended: ") and "0.0 tok/s" not in summary
    assert "n/a (one token) projected; measured on this machine" in summary and summary.count("n/a (one token)") == 2


def test_a_window_sweep_says_its_percentages_are_the_budgets_share(qtbot, tmp_path):
    """The summary's "Recommended: … (100%)" and the runs' labels "sweep 100%" gave the budget's share of every
    expert's bytes without saying so, where the experts resident may be fewer (the command's table has a "budget share"
    and a "resident share" column): both now say "budget share"."""
    from app.gui.records_jobs import SweepJob
    from app.gui.sweep_view import SweepView

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    path = tmp_path / "h.sqlite"
    result = SweepJob(2, ["short"], 1, history_path=str(path))(_sweep_context(model, device, []))
    view = SweepView(str(path))
    qtbot.addWidget(view)
    view.on_finished(result)
    best = view.recommended
    assert view.summary.text().startswith(f"Recommended: {human_bytes(best.budget_bytes)} of experts on the device "
                                          f"(budget share {best.fraction:.0%}), by the completion time projected")
    assert sorted({row["label"] for row in History(path).rows()}) == ["sweep budget share 0%",
                                                                      "sweep budget share 100%"]


def test_the_sweeps_rate_curve_leaves_out_budgets_of_one_token_answers_and_says_so(qtbot, tmp_path):
    """A budget whose answers were one token each has no decode rate: the decode plot drew it at 0 tok/s, measured and
    projected (and marked the recommendation there), as if decoding had stalled at that budget."""
    import dataclasses

    from app.gui.records_jobs import SweepJob
    from app.gui.sweep_view import SweepView

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    one = SweepJob(2, ["short"], 1, history_path=str(tmp_path / "h.sqlite"))(_sweep_context(model, device, []))
    three = SweepJob(2, ["short"], 3, history_path=str(tmp_path / "h.sqlite"))(_sweep_context(model, device, []))
    view = SweepView(str(tmp_path / "h.sqlite"))
    qtbot.addWidget(view)
    mixed = dataclasses.replace(three, points=[one.points[0], three.points[1]])
    view.on_finished(mixed)
    kept = three.points[1]
    assert [list(a) for a in view.curves["tokens"].getData()] == [[view.x(kept)], [kept.decode_tokens_per_s]]
    assert [list(a) for a in view.projected_curves["tokens"].getData()] == [[view.x(kept)],
                                                                             [kept.projected_decode_tokens_per_s]]
    assert len(view.curves["completion"].getData()[0]) == 2  # the other panels keep every budget
    view.plot(mixed.points)  # (no recommendation's mark, which widens a plot's range to its budget)
    view.show()
    qtbot.wait(50)  # (drawn: the plots' ranges are set as they show)
    low, high = view.plots["tokens"].viewRange()[0]  # on the other plots' budget axis: from the budget left out on
    assert low <= view.x(one.points[0]) < view.x(kept) <= high
    left_out = ("Decode leaves out 0 B: the answers there were one token each, which the prefill gives, so there "
                "was no decode step to time.")
    assert view.plots["tokens"].titleLabel.text == "decode (tokens/s) · 1 budget left out"
    assert view.plots["tokens"].toolTip() == left_out and view.legend.text().endswith(" " + left_out)
    view.on_finished(one)  # no budget has a rate: no curve, no recommendation mark on it
    assert [len(a if a is not None else []) for a in view.curves["tokens"].getData()] == [0, 0]
    assert [len(a) for a in view.chosen["tokens"].getData()] == [0, 0] and view.recommended is not None
    assert view.plots["tokens"].titleLabel.text == "decode (tokens/s) · 2 budgets left out"
    view.on_finished(three)
    assert view.plots["tokens"].titleLabel.text == "decode (tokens/s)" and not view.plots["tokens"].toolTip()
    assert "leaves out" not in view.legend.text()


def test_the_sweeps_legend_says_what_each_budgets_device_peak_is_made_of(qtbot, tmp_path):
    """With the host tier the device plot fell from 32.5 MiB at a budget of none to 1.1 MiB with every expert resident,
    and nothing said why (the tier's device mappings, a 2 MiB granule a slot array even with no slot). The legend says
    each budget's parts, which add up to its peak."""
    from app.gui.records_jobs import SweepJob
    from app.gui.sweep_view import SweepView

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device, decode_path="tier")
    result = SweepJob(2, ["short"], 2, history_path=str(tmp_path / "h.sqlite"), repeats=1)(
        _sweep_context(model, device, []))
    view = SweepView(str(tmp_path / "h.sqlite"))
    qtbot.addWidget(view)
    view.on_finished(result)
    none, every = result.points
    assert sum(none.device_parts.values()) == none.peak_device_bytes > every.peak_device_bytes
    ring = human_bytes(none.device_parts["prefill staging ring"])
    mapped = human_bytes(none.device_parts["host tier mappings"])
    assert (f"Device peak by part: budget share 0%: host tier mappings {mapped} + prefill staging ring {ring}; budget "
            f"share 100%: expert slots {human_bytes(every.budget_bytes)} + prefill staging ring {ring} (the host tier "
            "maps each slot array's device rows rounded up to the 2.0 MiB mapping granule, a granule even with no "
            "slot; with every expert resident none is mapped).") in view.legend.text()


def test_the_sweeps_four_plots_show_whole_in_a_narrow_tab_with_their_legend_apart(qtbot, tmp_path):
    """On the simulated device the completion and decode plots were titled 'completion time (s): measured (solid),
    projected for the simulated card (dashed)': the titles set their column's width, and in a 700-pixel tab (1000 too)
    the right column, the RAM and decode plots, lay past the canvas's edge, out of sight. The titles are short; what
    the lines and marks are is said once, beside the plots."""
    from app.gui.records_jobs import SweepJob
    from app.gui.sweep_view import SweepView

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    result = SweepJob(2, ["short"], 2, history_path=str(tmp_path / "h.sqlite"))(_sweep_context(model, device, []))
    view = SweepView(str(tmp_path / "h.sqlite"))
    qtbot.addWidget(view)
    view.resize(700, 600)
    view.show()
    view.on_finished(result)
    qtbot.waitUntil(lambda: view.canvas.width() > 600)
    qtbot.wait(50)  # (the canvas lays its plots out in the event loop)
    for key, plot in view.plots.items():
        assert plot.sceneBoundingRect().right() <= view.canvas.width(), key
    assert view.plots["completion"].titleLabel.text == "completion time (s)"
    assert view.legend.text().startswith("Solid line, dots: measured on this machine. Dashed, triangles: projected "
                                         "for the simulated card. Red ring: the recommended budget. Device peak by "
                                         "part: budget share 0%: ")


def test_a_window_sweep_under_mode_required_on_a_small_card_ends_at_what_the_card_holds(qtbot, tmp_path):
    """Under mode=required the points above what the device holds are left out, not refused at the first: the sweep
    is complete (saved, recommended), and its run line says which points it left out and why."""
    from app.gui.records_jobs import SweepJob
    from app.gui.sweep_view import SweepView

    device = SimulatedDevice(800_000)  # holds 229 KiB of gptoss's 552 KiB of experts beside its staging ring
    model = LoadedModel.open(fixture_folder("gptoss"),
                             offload=OffloadConfig(mode="required", device_expert_bytes=2 * EXPERT), device=device)
    said = []
    result = SweepJob(5, ["short"], 2, history_path=str(tmp_path / "h.sqlite"))(_sweep_context(model, device, said))
    assert [p.budget_bytes for p in result.points][2:] == [234752] and result.requested == 3
    assert not result.cancelled and len(result.saved_ids) == 3 * 3 and said[-1] == "9 of 9 runs done"
    assert model.offload.config.device_expert_bytes == 2 * EXPERT  # the user's budget, back
    view = SweepView(str(tmp_path / "h.sqlite"))
    qtbot.addWidget(view)
    view.on_finished(result)
    assert view.recommended is not None and view.bar.status.text() == (
        "3 points; 9 runs saved to the history. Offload mode 'required' refuses a budget above the 229.2 KiB of "
        "experts the device holds (budget share 42%): the sweep ends there, in place of the point at budget share "
        "50%, and leaves out the points at budget shares 75%, 100%.")


def test_a_window_sweep_skips_a_scenario_its_context_cannot_hold_as_record_does(qtbot, tmp_path):
    """All scenarios with 60-token answers on gptoss's 2,048-token context: the long input does not fit beside them.
    The sweep skips it before its first point (it failed at that point, after the point's short run), as Record skips
    it, and its run line says so."""
    from app.gui.records_jobs import SweepJob
    from app.gui.sweep_view import SweepView

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(device_expert_bytes=3 * EXPERT),
                             device=device)
    said = []
    result = SweepJob(2, ["short", "long", "multiturn"], 60, history_path=str(tmp_path / "h.sqlite"))(
        _sweep_context(model, device, said))
    assert not result.failure and not result.cancelled and len(result.saved_ids) == 4 * 3
    assert [[r.scenario for r in p.records] for p in result.points] == [["short", "multiturn"] * 3] * 2  # 3 repeats
    assert said[0] == "run 1 of 12" and said[-1] == "12 of 12 runs done"
    view = SweepView(str(tmp_path / "h.sqlite"))
    qtbot.addWidget(view)
    errors = []
    view.failed.connect(errors.append)
    view.on_finished(result)
    assert view.bar.status.text() == (
        "2 points; 12 runs saved to the history. Skipped long: the long-input scenario needs a context of at least "
        "2060 tokens; the model has 2048.")
    assert errors == ["Skipped long: the long-input scenario needs a context of at least 2060 tokens; the model has "
                      "2048"]


def test_the_windows_record_answers_greedy_the_models_or_the_chats_sampling_seeded_and_says_which(
        qtbot, window, tmp_path):
    """The window's Record and sweep were always greedy while the command line's sample on request: they take the
    choice too, seeded (the chat's seed, else the model's, else RECORD_SEED) so a repeat run samples alike, and the
    saved record keeps what was used."""
    from engine.sampling import RECORD_SEED

    load(qtbot, window, "lfm2moe")
    chat, view = window.chat, window.scenarios
    chat.temperature.setValue(1.5)
    chat.top_k.setValue(5)
    chat.seed.setValue(-1)  # random in the chat: a record's run is seeded all the same
    view.scenario.setCurrentText("short")
    view.max_tokens.setValue(8)
    view.answers.setCurrentIndex(view.answers.findData("chat"))
    answers = []
    for _ in range(2):
        view.bar.run_button.click()
        finish(qtbot, window, view)
        run_id, _record = view.result.saved[0]
        saved = window.history.history.get(run_id)
        assert {key: saved.generation[key] for key in ("do_sample", "temperature", "top_k", "top_p", "seed")} == {
            "do_sample": True, "temperature": 1.5, "top_k": 5, "top_p": 1.0, "seed": RECORD_SEED}
        answers.append(saved.turns[0]["tokens"])
    assert answers[0] == answers[1]  # seeded: the repeat run sampled alike
    chat.seed.setValue(7)
    view.bar.run_button.click()
    finish(qtbot, window, view)
    assert window.history.history.get(view.result.saved[0][0]).generation["seed"] == 7
    view.answers.setCurrentIndex(view.answers.findData("greedy"))  # greedy, as before: no seed said
    view.bar.run_button.click()
    finish(qtbot, window, view)
    greedy = window.history.history.get(view.result.saved[0][0]).generation
    assert (greedy["do_sample"], greedy["seed"]) == (False, None)


def test_a_window_sweep_answers_as_the_models_genai_config_samples_where_asked(tmp_path, copy_fixture):
    """A sweep's "The model's sampling": genai_config.json's search, its random_seed seeding it, in every record."""
    from app.gui.records_jobs import SweepJob

    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["search"].update(do_sample=True, temperature=0.7, top_p=0.9, random_seed=11)
    (folder / "genai_config.json").write_text(json.dumps(config))
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(folder, offload=OffloadConfig(), device=device)
    result = SweepJob(2, ["short"], 2, history_path=str(tmp_path / "h.sqlite"), answers="model")(
        _sweep_context(model, device, []))
    history = History(str(tmp_path / "h.sqlite"))
    settings = [history.get(run_id).generation for run_id in result.saved_ids]
    assert len(settings) == 2 * 3 and all((s["do_sample"], s["temperature"], s["top_k"], s["top_p"], s["seed"])
                                      == (True, 0.7, 50, 0.9, 11) for s in settings)


def _spy_on_the_tokens_graph(window) -> tuple[list, list]:
    """The token counts the window hands the tokens/s graph, and its answering on / off, as they come."""
    counted_tokens, count_tokens = [], window.graphs.count_tokens
    window.graphs.count_tokens = lambda n=1: (counted_tokens.append(n), count_tokens(n))
    answering, set_answering = [], window.graphs.set_answering
    window.graphs.set_answering = lambda on, now=None: (answering.append(on), set_answering(on, now))
    return counted_tokens, answering


def test_the_tokens_per_second_graph_counts_a_side_by_side_comparisons_tokens(qtbot, window):
    """"Tokens/s while answering" counted the chat's answers only: during a comparison it read 0 beside the graph's
    marker. Both sides' streamed tokens count now, over the time the comparison answers."""
    load(qtbot, window, "gptoss")
    counted_tokens, answering = _spy_on_the_tokens_graph(window)
    view = window.side_by_side
    view.prompt.setPlainText("Compare the two sides")
    view.max_tokens.setValue(6)
    view.bar.run_button.click()
    finish(qtbot, window, view)
    pieces = view.result.pieces
    assert len(pieces[0]) > 0 and sum(counted_tokens) == len(pieces[0]) + len(pieces[1])
    said = [on for on, before in zip(answering, [None, *answering]) if on != before]
    assert said == [False, True, False]  # answering from the sides' first batch to their end: not while B loads


def test_the_tokens_per_second_graph_counts_the_record_bars_and_a_sweeps_answers(qtbot, window, tmp_path):
    """Record's scenario runs and a sweep answer as the chat does, yet the tokens/s graph read 0 while they ran: their
    tokens count now, over the time they run."""
    from app.gui.records_jobs import SweepJob

    load(qtbot, window, "lfm2moe")
    counted_tokens, answering = _spy_on_the_tokens_graph(window)
    view = window.scenarios
    view.scenario.setCurrentText("multiturn")
    view.max_tokens.setValue(5)
    view.bar.run_button.click()
    finish(qtbot, window, view)
    record = view.result.saved[0][1]
    assert sum(counted_tokens) == record.generated_tokens == 30 and answering == [True, False]
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    said = []
    result = SweepJob(2, ["short"], 3, history_path=str(tmp_path / "h.sqlite"))(_sweep_context(model, device, said))
    streamed = sum(batch["new_tokens"] for batch in said if isinstance(batch, dict))
    assert streamed == sum(r.generated_tokens for point in result.points for r in point.records) == 6 * 3


def test_the_sweeps_recommendation_says_its_token_agreement_under_approximate_routing(qtbot, tmp_path):
    """Under approximate routing a smaller budget within the margin drops more experts: the summary said its speed
    alone. It says the recommended point's token agreement with exact routing, over its answers' tokens."""
    import app.gui.records_jobs as jobs
    from app.gui.sweep_view import SweepView

    device = SimulatedDevice(1 << 30)
    config = OffloadConfig(device_expert_bytes=200_000, min_expert_weight=0.5, skip_tail_cold_only=True)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=config, device=device)
    view = SweepView(tmp_path / "history.sqlite3")
    qtbot.addWidget(view)
    requested = []
    view.jobRequested.connect(lambda _kind, job: requested.append(job))
    view.points.setValue(2)
    view.scenario.setCurrentText("short")
    view.max_tokens.setValue(6)
    view.run()
    ctx = jobs.JobContext(model, device, {}, threading.Event(), lambda _f, _t: None, lambda _batch: None, None)
    view.on_finished(requested[0](ctx))
    best = view.recommended
    agreement, tokens = best.routing_agreement, best.compared_tokens  # its 3 repeats' answers together
    assert len(best.records) == 3 and tokens == sum(r.generated_tokens for r in best.records)
    assert view.summary.text().endswith(f" Approximate routing: token agreement with exact routing {agreement:.0%} "
                                        f"({round(agreement * tokens)} of {tokens} tokens).")


def test_the_history_table_says_which_runs_routed_approximately_and_their_agreement(qtbot, tmp_path):
    """The History tab listed a run with approximate routing as it listed an exact one: faster, and nothing said what
    that cost. Its routing column says "exact", or "approximate" with the run's token agreement with exact routing."""
    from app.gui.history_view import HEADERS, HistoryView

    history = History(tmp_path / "history.sqlite3")
    device = SimulatedDevice(1 << 30)
    params = GenerationParams(max_new_tokens=6)
    exact = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(device_expert_bytes=0), device=device)
    approximate = LoadedModel.open(fixture_folder("gptoss"), device=device,
                                   offload=OffloadConfig(device_expert_bytes=0, min_expert_weight=0.5))
    records = [run_scenario(exact, "short", params, device), run_scenario(approximate, "short", params, device)]
    ids = [history.add(record) for record in records]
    view = HistoryView(tmp_path / "history.sqlite3")
    qtbot.addWidget(view)
    view.refresh()
    column = HEADERS.index("routing")
    agreement = records[1].routing_agreement
    assert 0 < agreement < 1
    assert {view.table.item(r, 0).data(Qt.ItemDataRole.UserRole): view.table.item(r, column).text()
            for r in range(2)} == {ids[0]: "exact", ids[1]: f"approximate, {agreement:.0%} agreement"}


def test_a_stopped_sweep_says_whether_the_device_still_holds_the_models_own_budget(qtbot, tmp_path):
    """A sweep stopped partway said where it stopped and what it kept, not what it left the model at: the user read
    "Cancelled at 50%" and could not tell whether the model ran at 50% now. The line says the model is back at its own
    budgets, and where the device holds less of them than before the sweep (memory taken meanwhile), how much less."""
    from app.gui.records_jobs import SweepResult
    from app.gui.sweep_view import SweepView

    view = SweepView(tmp_path / "h.sqlite")
    qtbot.addWidget(view)
    stopped = dict(points=[], requested=3, model_folder="m", base_entries={}, stopped_at="at budget share 50% "
                   "(device_expert_bytes=282624), point 2 of 3")
    view.on_finished(SweepResult(**stopped, held_before=3 * EXPERT, held_after=3 * EXPERT))
    assert view.bar.status.text().endswith("; no recommendation; the model is back at its own budgets.")
    view.on_finished(SweepResult(**stopped, held_before=3 * EXPERT, held_after=EXPERT))
    assert view.bar.status.text().endswith("; no recommendation; the model is back at its own budgets, but the device "
                                           "now holds 34.5 KiB of its experts where it held 103.5 KiB.")


SWEEP_TRUNCATED = """
import sys
import threading
from pathlib import Path
from app.gui.records_jobs import SweepJob
from engine.generation import LoadedModel
from engine.offload import OffloadConfig, SimulatedDevice
folder, history = Path(sys.argv[1]), sys.argv[2]
device = SimulatedDevice(1 << 30)
model = LoadedModel.open(folder, offload=OffloadConfig(), device=device)
data = folder / "model.onnx.data"


def progress(fraction, text):
    if text.startswith("at budget share 50%") and data.stat().st_size > 4096:  # the second point, re-planned
        data.write_bytes(data.read_bytes()[:4096])


ctx = type("Ctx", (), {"device": device, "cancel": threading.Event(), "loaded": lambda self: model,
                       "device_fallback": "", "progress": lambda self, fraction, text: progress(fraction, text),
                       "stream": lambda self, batch: None})()
result = SweepJob(3, ["short"], 2, history_path=history, repeats=1)(ctx)
print(len(result.points), len(result.saved_ids), result.stopped_at)
print(result.failure)
print(result.budgets_back)
print(model.offload.config.device_expert_bytes)
"""


def test_a_sweep_whose_data_file_was_truncated_keeps_its_points_and_says_to_load_the_model_again(copy_fixture,
                                                                                                   tmp_path):
    """After a point refused a data file cut short since the load, putting the user's budgets back refused it too,
    and that error replaced the job's result: the window said it alone, without the point saved before, and the model
    stayed at the sweep's last budget unsaid. The result keeps the points, says the truncation once, and that the
    model stays at the sweep's last budget (the line says to load it again). In a process of its own, so that a crash
    fails the test rather than ending pytest."""
    folder = copy_fixture("gptoss")
    whole = (folder / "model.onnx.data").stat().st_size
    result = subprocess.run([sys.executable, "-c", SWEEP_TRUNCATED, str(folder), str(tmp_path / "h.sqlite")],
                            cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.splitlines() == [
        "1 1 at budget share 50% (device_expert_bytes=282624), point 2 of 3",
        f"{folder / 'model.onnx.data'}: truncated since the model was loaded: it has 4096 bytes of the {whole} its "
        "initializers take; load the model again",
        "the model stays at the sweep's last budget", "282624"]


def test_a_sweep_whose_budgets_the_device_cannot_take_back_keeps_its_points_and_says_so(tmp_path, monkeypatch):
    """Putting the user's budgets back after the sweep can find the device short (another process took memory while
    the sweep ran): only a data file's refusal was kept, and the DeviceMemoryError replaced the job's result, its
    points and recommendation lost though their runs were saved. It is kept as the file's is: the model stays at the
    sweep's last budget, and the result says why."""
    from app.gui.records_jobs import SweepJob
    from engine.offload.device_memory import DeviceMemoryError

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    original, reconfigure = model.offload.config, model.offload.reconfigure
    short = ("device allocation of 565248 bytes for expert slots would exceed the device's memory (1073700000 of "
             "1073741824 bytes in use)")

    def refuse_the_restore(config, **kwargs):
        if config == original and not kwargs:
            raise DeviceMemoryError(short)
        reconfigure(config, **kwargs)

    monkeypatch.setattr(model.offload, "reconfigure", refuse_the_restore)
    result = SweepJob(2, ["short"], 1, history_path=str(tmp_path / "h.sqlite"), repeats=1)(
        _sweep_context(model, device, []))
    assert (len(result.points), result.saved_ids, result.failure) == (2, [1, 2], "")
    assert result.budgets_back == f"the model stays at the sweep's last budget: {short}"
    assert model.offload.plan.budget_bytes == result.points[-1].budget_bytes


def test_a_required_sweeps_budgets_the_device_no_longer_holds_keep_its_points_and_say_so(tmp_path):
    """Under mode=required, putting the user's budgets back after another process took device memory during the sweep
    is refused as above what the device has free (BudgetAboveFree): that replaced the job's result, its points lost
    though their runs were saved. It is kept as a data file's refusal is: the model stays at the sweep's last budget,
    and the result says why."""
    from app.gui.records_jobs import SweepJob

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(mode="required",
                                                                             device_expert_bytes=8 * EXPERT),
                             device=device)

    def progress(_fraction, text):
        if text == "1 of 2 runs done":  # after the first point (one expert): another process leaves 2 more free
            device.memory.reserve(device.memory.available - 2 * EXPERT, "another process")

    ctx = _sweep_context(model, device, [])
    ctx.progress = progress
    result = SweepJob(2, ["short"], 1, history_path=str(tmp_path / "h.sqlite"), repeats=1)(ctx)
    assert ([p.budget_bytes for p in result.points], result.saved_ids, result.failure) == ([EXPERT, 3 * EXPERT],
                                                                                           [1, 2], "")
    assert result.budgets_back == (
        f"the model stays at the sweep's last budget: offload mode 'required': device_expert_bytes={8 * EXPERT} "
        f"exceeds the 103.5 KiB ({3 * EXPERT} bytes) the device has free")
    assert model.offload.plan.budget_bytes == 3 * EXPERT


def test_a_sweeps_budgets_the_card_runs_out_of_memory_taking_back_keep_its_points_and_say_so(tmp_path, monkeypatch):
    """CuPy's OutOfMemoryError putting the user's budgets back (the card's memory taken while the sweep ran) replaced
    the job's result, its points lost though their runs were saved. It is kept as the device short is: the model stays
    at the sweep's last budget, and the result says why, with what to do."""
    from app.gui.records_jobs import SweepJob
    from engine.errors import GPU_OUT_OF_MEMORY

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    original, reconfigure = model.offload.config, model.offload.reconfigure
    cupy_oom = type("OutOfMemoryError", (MemoryError,), {"__module__": "cupy.cuda.memory"})  # where CuPy is absent

    def run_out(config, **kwargs):
        if config == original and not kwargs:
            raise cupy_oom("Out of memory allocating 512 bytes (allocated so far: 0 bytes).")
        reconfigure(config, **kwargs)

    monkeypatch.setattr(model.offload, "reconfigure", run_out)
    result = SweepJob(2, ["short"], 1, history_path=str(tmp_path / "h.sqlite"), repeats=1)(
        _sweep_context(model, device, []))
    assert (len(result.points), result.saved_ids, result.failure) == (2, [1, 2], "")
    assert result.budgets_back == f"the model stays at the sweep's last budget: {RAN_OUT}{GPU_OUT_OF_MEMORY}"
    assert model.offload.plan.budget_bytes == result.points[-1].budget_bytes


def test_the_window_says_a_sweep_left_the_model_at_its_last_budget_once(qtbot, tmp_path):
    """A sweep whose data file was cut short since the load could not put the user's budgets back: the run line says the
    model stays at the sweep's last budget, with the truncation once (said already as the point's failure), and
    a sweep that ran to its end says it too, in the banner as well."""
    from app.gui.records_jobs import SweepResult
    from app.gui.sweep_view import SweepView

    view = SweepView(tmp_path / "h.sqlite")
    qtbot.addWidget(view)
    banner = []
    view.failed.connect(banner.append)
    cut = "/m/model.onnx.data: truncated since the model was loaded: it has 4096 bytes of the 1149792 its " \
          "initializers take; load the model again"
    view.on_finished(SweepResult(points=[], requested=3, model_folder="m", base_entries={}, failure=cut,
                                 stopped_at="at budget share 50% (device_expert_bytes=282624), point 2 of 3",
                                 not_restored=cut))
    assert view.bar.status.text() == (f"Failed at budget share 50% (device_expert_bytes=282624), point 2 of 3: {cut}; "
                                      "no point completed before it; no recommendation; the model stays at the "
                                      "sweep's last budget.")
    view.on_finished(SweepResult(points=[], requested=3, model_folder="m", base_entries={}, not_restored=cut))
    assert view.bar.status.text() == f"0 points; 0 runs saved to the history. The model stays at the sweep's last " \
                                     f"budget: {cut}."
    assert banner[-1] == f"The model stays at the sweep's last budget: {cut}"


def test_the_window_names_a_sweeps_tie_within_the_spread_between_repeats(qtbot, tmp_path):
    """The window's recommendation, as the command line's, takes the one holding less on the device of two budgets whose
    median completion times differ by less than their repeats' spreads, and says it is a tie and why, not only the
    margin."""
    from app.gui.records_jobs import SweepResult
    from app.gui.sweep_view import SweepView
    from tests.test_records import _repeated_point

    view = SweepView(tmp_path / "h.sqlite")
    qtbot.addWidget(view)
    none, all_resident = _repeated_point(0, [1.2, 1.25, 1.3]), _repeated_point(300, [0.95, 1.1, 1.25])
    view.on_finished(SweepResult([none, all_resident], requested=2, model_folder="m", base_entries={}))
    assert view.recommended is none
    assert ("A tie with the fastest, at budget share 100%: they differ by less than their spreads between repeats "
            "(±50.0 ms and ±150 ms), and it holds less on the device (device peak 0 B against 300 B).") in (
        view.summary.text())
    # a configuration saved from it says so (it said "within 10% of the fastest": 1.25 s is 14% above 1.1 s)
    view.configurations_path = tmp_path / "configurations.json"
    view.save("tied")
    saved = json.loads((tmp_path / "configurations.json").read_text())["tied"]
    assert (saved["entries"]["session.moe.offload.device_expert_bytes"], saved["note"]) == (
        "0", "sweep recommendation tied with the fastest (at budget share 100%) within the spread between repeats")
    view.on_finished(SweepResult([_repeated_point(0, [1.5, 1.55, 1.6]), all_resident], requested=2, model_folder="m",
                                 base_entries={}))
    assert view.recommended.budget_bytes == 300 and "tie" not in view.summary.text()


def test_the_windows_sweep_summary_gives_a_small_models_times_in_figures_that_tell_them_apart(qtbot, tmp_path):
    """On the fixtures the summary read "0.00 s (fastest 0.00 s, margin 10%)": the times it recommended by, unread.
    They are given as every time in the window is (units.duration_text: "2.40 ms"), where they read "0.00240 s"."""
    from app.gui.records_jobs import SweepResult
    from app.gui.sweep_view import SweepView
    from tests.test_records import _repeated_point

    view = SweepView(tmp_path / "h.sqlite")
    qtbot.addWidget(view)
    points = [_repeated_point(0, [0.0024]), _repeated_point(300, [0.0022])]
    for point in points:
        point.records[0].timings["completion_s"] = 0.0041
    view.on_finished(SweepResult(points, requested=2, model_folder="m", base_entries={}))
    assert view.recommended is points[0]
    assert ": 2.40 ms (fastest 2.20 ms, margin 10%)" in view.summary.text()
    assert "measured on this machine 4.10 ms, " in view.summary.text()
    for point, seconds in zip(points, (0.0041, 0.0052)):  # measured on a CUDA card: no projection
        point.records[0].timings = {"completion_s": seconds, "decode_tokens_per_s": 1}
    view.on_finished(SweepResult(points, requested=2, model_folder="m", base_entries={}))
    assert "completion 4.10 ms (fastest 4.10 ms, margin 10%)" in view.summary.text()


def test_the_windows_sweep_summary_names_the_smaller_budgets_it_passed_over_for_holding_more(qtbot, tmp_path):
    """With the host tier a smaller budget can hold more on the device than all resident: the summary recommended
    100% and said nothing of why the smaller budgets within the margin were not taken. It says the rule and them."""
    from app.gui.records_jobs import SweepResult
    from app.gui.sweep_view import SweepView
    from tests.test_records import _repeated_point

    view = SweepView(tmp_path / "h.sqlite")
    qtbot.addWidget(view)
    points = [_repeated_point(0, [3.0]), _repeated_point(200, [1.05]), _repeated_point(300, [1.0])]
    for point, peak in zip(points, (50 << 20, 48 << 20, 3 << 19)):
        point.records[0].peaks["device_bytes"] = peak
    view.on_finished(SweepResult(points, requested=3, model_folder="m", base_entries={}))
    assert view.recommended is points[2]
    assert view.summary.text().endswith(
        " The least device peak of the budgets within the margin of the fastest: smaller budgets within it hold more "
        "on the device (budget share 67%: 48.0 MiB).")
    view.margin.setValue(1.0)  # 67% no longer within it: nothing passed over
    assert "smaller budgets" not in view.summary.text()


def test_a_configuration_that_cannot_be_written_names_the_configurations_file_and_why(qtbot, tmp_path):
    """The configurations' folder could not be made (a file stands where it is to be): Save said "Could not save the
    configuration 'close': [Errno 17] File exists: '/x/data'", as if the configuration existed, without naming the
    configurations file; `sweep --save-as` ended the same after the sweep as an "internal error"."""
    from app.gui.records_jobs import SweepJob
    from app.gui.sweep_view import SweepView

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    result = SweepJob(2, ["short"], 2, history_path=str(tmp_path / "h.sqlite"))(_sweep_context(model, device, []))
    (tmp_path / "data").write_text("")
    path = tmp_path / "data" / "configurations.json"
    view = SweepView(str(tmp_path / "h.sqlite"), path)
    qtbot.addWidget(view)
    said = []
    view.failed.connect(said.append)
    view.on_finished(result)
    assert view.save("close") is None
    assert said == [f"Could not save the configuration 'close': {path}: not saved: its folder {tmp_path / 'data'} "
                    "could not be made (File exists)"]


def test_the_windows_load_line_gives_the_load_time_as_every_other_time_in_the_window(qtbot, window):
    """The status bar's "lfm2moe loaded in 0.21 s" kept two decimals of its own where the window gives every other
    time as units.duration_text ("210 ms"): it gives the load's so too."""
    loads = []
    window.worker.loaded.connect(lambda info: loads.append(info["load_s"]))  # (direct: before the window's slot)
    load(qtbot, window, "lfm2moe")
    assert window.status_model.text() == f"lfm2moe loaded in {duration_text(loads[0])}"


def test_a_window_records_load_time_counts_opening_the_folder_as_the_command_lines_does(qtbot, window, monkeypatch):
    """The window opens the folder (the graph, the tokenizer) and then builds the model from it, and timed the second
    part only: its records' load time left out what `record`'s (LoadedModel.open) and side-by-side B's count."""
    import time

    import app.gui.engine_worker as engine_worker
    from engine.model_folder import ModelFolder

    opened = ModelFolder.open

    class SlowFolder:
        @staticmethod
        def open(path):
            time.sleep(0.5)
            return opened(path)

    monkeypatch.setattr(engine_worker, "ModelFolder", SlowFolder)
    load(qtbot, window, "lfm2moe")
    value, unit = re.search(r"loaded in ([\d.]+) (m?s)", window.status_model.text()).groups()
    assert float(value) * (1e-3 if unit == "ms" else 1) >= 0.5
    bar = window.scenarios
    bar.scenario.setCurrentText("short")
    bar.max_tokens.setValue(2)
    bar.bar.run_button.click()
    finish(qtbot, window, bar)
    assert bar.result.saved[0][1].timings["load_s"] >= 0.5
