"""Run records, SQLite history, scenarios, budget sweeps, side-by-side and the contention runner."""

from __future__ import annotations

import csv
import html
import io
import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.generation import GenerationParams, LoadedModel
from engine.offload.planner import all_resident_bytes
from engine.offload import OffloadConfig, SimulatedDevice
from engine.records.contention import make_corpus, run_contention
from engine.records.history import History
from engine.records.scenarios import run_scenario, scenario_turns
from engine.records.schema import SCHEMA_VERSION, RecordError, RunRecord
from engine.records.side_by_side import Side, compare, first_divergence
from engine.records.sweep import (SweepCancelled, SweepPoint, device_parts_line, recommend, recommendation, run_sweep,
                                  stopped_at)
from tests.conftest import fixture_folder

PARAMS = GenerationParams(max_new_tokens=6)


@pytest.fixture(scope="module")
def simulated_model():
    device = SimulatedDevice(1 << 30)
    return LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(device_expert_bytes=200_000),
                            device=device), device


@pytest.fixture(scope="module")
def short_record(simulated_model):
    model, device = simulated_model
    return run_scenario(model, "short", PARAMS, device, label="unit")


def test_a_models_first_record_follows_an_unrecorded_warm_up_answer(monkeypatch):
    """A record made on a model loaded a moment ago timed its first answer since the load (onnxruntime's first runs,
    its arena's growth): its completion took ~1.3x the next records', which a user comparing configurations read as
    the configuration's. The sweep and the contention test answered once unrecorded before timing; a record did not."""
    from engine.records import scenarios

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(device_expert_bytes=200_000), device=device)
    timed, steps = [False], []  # (tokens fed, whether the clock ran) per forward pass of the model
    forward, enter = model.decoder.forward, scenarios.PeakSampler.__enter__
    monkeypatch.setattr(model.decoder, "forward", lambda state, ids: steps.append((len(ids), timed[0]))
                        or forward(state, ids))
    monkeypatch.setattr(scenarios.PeakSampler, "__enter__", lambda self: timed.__setitem__(0, True) or enter(self))
    first = run_scenario(model, "short", GenerationParams(max_new_tokens=3), device)
    before = [tokens for tokens, on_clock in steps if not on_clock]
    # a prefill of the short question and a decode step per token after the first, off the clock and its statistics
    assert before[0] > 1 and before[1:] == [1] * (scenarios.WARM_UP_TOKENS - 1)
    assert first.timings["warm_up_s"] > 0 and first.generated_tokens == 3
    prompt_tokens = first.turns[0]["prompt_tokens"]
    assert sum(layer["hits"] + layer["misses"] for layer in first.layers) == 2 * 2 * (prompt_tokens + 2)  # top-2, 2 layers
    steps.clear()
    timed[0] = False
    second = run_scenario(model, "short", GenerationParams(max_new_tokens=3), device)
    assert second.timings["warm_up_s"] == 0 and all(on_clock for _tokens, on_clock in steps)


def test_side_by_side_at_once_gives_both_warm_ups_before_either_clock_starts(monkeypatch):
    """Given in each side's thread, the warm-up answer of the side that took longer ran beside the other side's timed
    answer, which an answer "at once" measures as the other's load."""
    import time

    from engine.records import scenarios, side_by_side

    events, enter, warm_up = [], scenarios.PeakSampler.__enter__, scenarios.warm_up_answer

    def slow_warm_up(model, cancel=None):
        seconds = warm_up(model, cancel)
        time.sleep(0.3 if model is right else 0)  # B's warm-up the longer
        events.append(("warm-up", "A" if model is left else "B"))
        return seconds

    monkeypatch.setattr(scenarios, "warm_up_answer", slow_warm_up)
    monkeypatch.setattr(side_by_side, "warm_up_answer", slow_warm_up, raising=False)
    monkeypatch.setattr(scenarios.PeakSampler, "__enter__", lambda self: events.append(("clock", "")) or enter(self))
    left, right = (LoadedModel.open(fixture_folder("gptoss")) for _side in "AB")
    comparison = compare(Side(left, None, "A"), Side(right, None, "B"), "Compare us", PARAMS, concurrent=True)
    assert sorted(events[:2]) == [("warm-up", "A"), ("warm-up", "B")] and events[2:] == [("clock", "")] * 2
    assert [record.timings["warm_up_s"] > 0 for record in comparison.records] == [True, True]  # each says its own


def test_a_records_resident_experts_are_placements_not_the_copies_in_the_slots_left_to_copied_misses(monkeypatch):
    """A sweep point's "resident" share counted every expert in a device slot as its runs ended: on the CPU path the
    slots adaptive placement leaves to copied misses hold whatever miss was copied last (by this run, an earlier one,
    the unrecorded warm-up or the settling steps, as the miss policy's timings chose), so rows whose budgets keep the
    same residents read apart, and a copy no later step routed to read as resident. It counts the residents placement
    keeps, as the landed statement does (here one of each layer's two slots is left to copies)."""
    import numpy as np

    from engine.records.scenarios import run_turns

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(device_expert_bytes=4 * 35328),
                             device=device)
    offload = model.offload
    monkeypatch.setattr(offload, "_weigh_miss_slots", lambda: None)  # (the miss policy's cost model would weigh them)
    offload.policy.miss_slots = [1, 1]
    record = run_turns(model, ["Hi"], GenerationParams(max_new_tokens=2), device)
    assert [int(np.count_nonzero(layer.expert_in >= 0)) for layer in offload.slots] == [2, 2]
    assert record.offload["resident_experts"] == 2 and offload.slots_left_to_copies() == [1, 1]


def test_record_has_what_a_user_decides_with(short_record):
    r = short_record
    assert r.schema_version == SCHEMA_VERSION and r.scenario == "short"
    assert r.versions["onnxruntime"]["version"] and r.versions["python"]
    assert r.machine["cores"] >= 1 and r.machine["ram_bytes"] > 0
    assert len(r.model["onnx_sha256"]) == 64 and r.model["expert_nodes"][0]["bits"] == 4
    assert r.model["expert_nodes"][0]["block_size"] == 32
    assert r.offload["entries"]["session.moe.offload.device_expert_bytes"] == "200000"
    assert r.timings["load_s"] > 0 and r.timings["time_to_first_token_s"] > 0
    assert r.timings["completion_s"] >= r.timings["time_to_first_token_s"] and r.timings["settle_s"] >= 0
    assert r.peaks["rss_bytes"] > 10 << 20 and r.peaks["device_bytes"] > 0
    assert 10 << 20 < r.peaks["rss_start_bytes"] <= r.peaks["rss_bytes"]  # the loaded model was there before the run
    assert len(r.layers) == 2 and {"hits", "misses", "hit_rate"} <= set(r.layers[0])
    assert r.turns[0]["prompt"].startswith("In two sentences") and isinstance(r.turns[0]["answer"], str)
    assert r.turns[0]["generated_tokens"] == len(r.turns[0]["tokens"]) >= 1
    # what else used the CPUs meanwhile: shares of all CPUs' time
    assert set(r.host_load) == {"host_steal_share", "host_others_share"}
    assert all(0.0 <= share <= 1.0 for share in r.host_load.values())
    # the CPU kernels' threads at the end of the run: automatic, at most every core
    threads = r.offload["cpu_threads"]
    assert threads["cpu_threads_automatic"] and 1 <= threads["cpu_threads_in_force"] <= threads["cores"]


def test_a_records_device_peak_is_its_runs_not_an_earlier_budgets():
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)  # every expert resident
    resident = run_scenario(model, "short", PARAMS, device)
    model.offload.reconfigure(model.offload.config.updated(device_expert_bytes=0))  # the Budgets panel's Apply
    held = device.memory.used
    none_resident = run_scenario(model, "short", PARAMS, device)
    assert held <= none_resident.peaks["device_bytes"] < resident.peaks["device_bytes"]
    # (it read the peak of the budget before the re-plan); the device keeps its high-water mark for the views
    assert device.memory.high_water >= resident.peaks["device_bytes"]


def test_a_record_counts_its_own_runs_statistics_and_the_models_running_totals_go_on(simulated_model):
    """A record (side by side's, a scenario's) measures its run's hits and misses alone; the model's totals, which the
    placement view shows for the chat, keep what came before the run and add the run's (they read the run's alone)."""
    from engine.generation import Conversation
    from engine.records.scenarios import run_turns

    model, device = simulated_model
    Conversation(model).send("Hello there", PARAMS)
    stats = model.offload.stats
    before = [(layer.hits, layer.misses) for layer in stats.layers]
    experts_before, steps_before = [counts.copy() for counts in stats.expert_hits], stats.steps
    assert sum(hits + misses for hits, misses in before) > 0
    record = run_turns(model, ["Compare us"], PARAMS, device)
    run = [(layer["hits"], layer["misses"]) for layer in record.layers]
    assert sum(hits + misses for hits, misses in run) > 0
    assert [(layer.hits, layer.misses) for layer in stats.layers] == [
        (hits + run_hits, misses + run_misses) for (hits, misses), (run_hits, run_misses) in zip(before, run)]
    assert [counts.tolist() for counts in stats.expert_hits] == [
        (earlier + layer["expert_hits"]).tolist() for earlier, layer in zip(experts_before, record.layers)]
    assert stats.steps > steps_before


def test_a_run_waits_for_the_models_background_work(simulated_model):
    """A model still mapping its experts in the background (as right after load: side-by-side's B, a sweep's first
    point): the run starts once that is done and its record says how long it waited; a cancel ends the wait."""
    model, device = simulated_model
    kept = model.prefault
    population = SimpleNamespace(done=threading.Event())  # a population that finishes 0.5 s from now
    model.prefault = population
    timer = threading.Timer(0.5, population.done.set)
    timer.start()
    try:
        record = run_scenario(model, "short", PARAMS, device)
        # a margin below the timer's 0.5 s: a loaded runner may start the run late
        assert record.timings["settle_s"] >= 0.2 and record.turns and population.done.is_set()
        population.done.clear()  # never finishes now: only the cancel ends the wait
        cancel = threading.Event()
        threading.Timer(0.5, cancel.set).start()
        record = run_scenario(model, "short", PARAMS, device, cancel=cancel)
        assert 0.2 <= record.timings["settle_s"] < 5 and record.timings["cancelled"] and not record.turns
    finally:
        timer.cancel()
        model.prefault = kept


def test_a_run_compiles_the_cpu_kernels_before_its_clock_starts(simulated_model, monkeypatch):
    """A machine's first run compiles the CPU expert kernels (47 s to the first token on the dev VM's demo model):
    before the timed part, each distinct kernel runs once for a decode step and once through the prefill's GEMM path
    (engine/kernel_warmup.py), and the record counts that time as settling, not as its first token's."""
    from engine.generation import Conversation
    from kernels.cpu import CpuQMoE

    model, device = simulated_model
    calls, gemm, at_send = [], [], []
    forward, gemm_batched, send = CpuQMoE.forward, CpuQMoE._gemm_batched, Conversation.send

    def counted_forward(self, x, *args, **kwargs):
        calls.append((id(self), x.shape[0]))
        return forward(self, x, *args, **kwargs)

    def counted_gemm(self, *args):
        gemm.append(id(self))
        return gemm_batched(self, *args)

    def counted_send(self, *args, **kwargs):
        at_send.append((len(calls), len(gemm)))
        return send(self, *args, **kwargs)

    monkeypatch.setattr(CpuQMoE, "forward", counted_forward)
    monkeypatch.setattr(CpuQMoE, "_gemm_batched", counted_gemm)
    monkeypatch.setattr(Conversation, "send", counted_send)
    record = run_scenario(model, "short", PARAMS, device)
    # the fixture's two expert layers share one layout: the first layer's kernel run, for 1 token and for
    # gemv_max_rows + 1 (its GEMM path once), all before the conversation's first turn
    first = next(id(step.kernel) for step in model.decoder.steps if hasattr(step, "kernel"))
    assert calls[:2] == [(first, 1), (first, CpuQMoE.gemv_max_rows + 1)] and at_send[0] == (2, 1)
    assert record.turns and record.timings["settle_s"] > 0


TRUNCATED = """
import sys
from pathlib import Path
from engine.errors import ModelFileError
from engine.generation import GenerationParams, LoadedModel
from engine.offload import OffloadConfig, SimulatedDevice
from engine.records.scenarios import run_scenario
from engine.records.side_by_side import preference
from engine.records.sweep import settle
folder = Path(sys.argv[1])
device = SimulatedDevice(1 << 30)
model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=200_000, placement="static"), device=device)
data = folder / "model.onnx.data"
data.write_bytes(data.read_bytes()[:4096])
try:
    {call}
except ModelFileError as exc:
    print(exc)
"""


def truncated_after_the_load(folder: Path, call: str) -> list[str]:
    """The lines `call` prints, in a process of its own with the fixture `folder` loaded on the simulated device and
    its data file cut short after the load (a crash fails the test rather than ending pytest)."""
    result = subprocess.run([sys.executable, "-c", TRUNCATED.replace("{call}", call), str(folder)],
                            cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    return result.stdout.splitlines()


def truncated_since_the_load(folder: Path, whole: int) -> str:
    return (f"{folder / 'model.onnx.data'}: truncated since the model was loaded: it has 4096 bytes of the {whole} its "
            "initializers take; load the model again")


def test_a_run_on_a_model_whose_data_file_was_truncated_since_the_load_is_refused_by_name_not_a_crash(copy_fixture):
    """A record's run (a benchmark, a side-by-side's side, a sweep's point) first runs the CPU kernels on the model's
    experts, read from the mapped file, outside any answer: past the end of a file cut short since the load, that
    killed the process (SIGBUS; the GUI closed with no message). The run is refused by name."""
    folder = copy_fixture("gptoss")
    whole = (folder / "model.onnx.data").stat().st_size
    run = 'run_scenario(model, "short", GenerationParams(max_new_tokens=6), device)'
    assert truncated_after_the_load(folder, run) == [truncated_since_the_load(folder, whole)]


def test_a_sweeps_settling_on_a_model_whose_data_file_was_truncated_is_refused_by_name_not_a_crash(copy_fixture):
    """A sweep's point settles the trials (static placement's opening here) with decode steps of its own, after waiting
    for the re-plan's background work: past the end of a data file cut short meanwhile, a step killed the process
    (SIGBUS). The point is refused by name."""
    folder = copy_fixture("gptoss")
    whole = (folder / "model.onnx.data").stat().st_size
    assert truncated_after_the_load(folder, "assert model.offload.trials_pending; settle(model)") == [
        truncated_since_the_load(folder, whole)]


def test_a_comparisons_margins_on_a_model_whose_data_file_was_truncated_are_refused_by_name_not_a_crash(copy_fixture):
    """A side-by-side's margins are forward passes of their own after both answers: past the end of a data file cut
    short meanwhile, one killed the process (SIGBUS). The margins fail by name (compare keeps the answers without
    them)."""
    folder = copy_fixture("gptoss")
    whole = (folder / "model.onnx.data").stat().st_size
    assert truncated_after_the_load(folder, 'preference(model, "Hello", [], 1, 2)') == [
        truncated_since_the_load(folder, whole)]


def test_a_records_agreement_is_over_the_runs_tokens(simulated_model, monkeypatch):
    """Approximate routing's agreement over a run counts every answer's tokens: a one-token turn that parted from exact
    routing weighed as much as a nine-token one that never did (the mean of the turns' figures, 50% for 90%)."""
    from engine.generation import Conversation, GenerationResult, Timings
    from engine.records.scenarios import run_turns

    model, device = simulated_model
    answers = iter([([5], 0.0), ([5] * 9, 1.0)])

    def scripted_send(self, *args, **kwargs):
        tokens, agreement = next(answers)
        return GenerationResult([1], tokens, "", "length", Timings(generated_tokens=len(tokens)),
                                routing_agreement=agreement)

    monkeypatch.setattr(Conversation, "send", scripted_send)
    record = run_turns(model, ["one", "two"], PARAMS, device)
    assert record.routing_agreement == pytest.approx(0.9)


def test_a_runs_detail_says_the_unrecorded_warm_up_answer_it_followed(short_record):
    """The run's detail in the window showed neither warm_up_s nor point_warm_up_s (only the JSON and exports did), so
    a run timed right after a warm-up answer and one after none read alike. The detail says it in words, below the
    completion, where the record has them."""
    from app.gui.record_report import detail_html

    def said(**timings):
        data = short_record.to_dict()
        for key in ("warm_up_s", "point_warm_up_s"):
            data["timings"].pop(key, None)
        data["timings"].update(timings)
        text = html.unescape(detail_html(RunRecord.from_dict(data)))
        return re.search(r"<td>completion</td><td>[^<]*</td></tr>(<tr><td>unrecorded warm-up answer</td><td>"
                         r"([^<]*)</td></tr>)?", text).group(2)

    assert said() is None  # an older record
    assert said(warm_up_s=0.0451) == "45.1 ms: the model's first answer since its load, right before this run"
    assert said(warm_up_s=0.0) == "none right before this run: the model gave it before an earlier run"
    assert said(warm_up_s=0.012, point_warm_up_s=0.012) == (
        "12.0 ms: the sweep point's, at its budget, which every run of the point follows (this run, the point's "
        "first, right after it)")
    assert said(warm_up_s=0.0, point_warm_up_s=0.012) == (
        "12.0 ms: the sweep point's, at its budget, which every run of the point follows (an earlier run of the "
        "point right after it)")


def test_a_record_of_approximate_routing_counts_the_experts_it_dropped_during_the_run(short_record):
    """Beside the agreement, how much approximate routing did in the run: the experts it dropped and substituted (the
    engine's counts run from load; a record takes the run's share). A record of exact routing has none."""
    from app.gui.record_report import detail_html

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), device=device,
                             offload=OffloadConfig(device_expert_bytes=0, min_expert_weight=0.5))
    run_scenario(model, "short", PARAMS, device)  # counted by the engine, not by the next record
    before = model.offload.approximation.dropped
    record = run_scenario(model, "short", PARAMS, device)
    dropped = model.offload.approximation.dropped - before
    assert dropped > 0 and record.approximation == {"dropped": dropped, "substituted": 0}
    # of how many: each token fed routed k experts in each layer (the report said "experts", read as distinct ones)
    (turn,) = record.turns
    routed = 2 * 2 * (turn["prompt_tokens"] + turn["generated_tokens"] - 1)  # gpt-oss fixture: 2 layers, top-2
    assert (f"routed experts dropped / substituted</td><td>{dropped} / 0 of {routed} (k per token in each "
            "layer)") in detail_html(record)
    assert RunRecord.from_dict(record.to_dict()).approximation == record.approximation
    assert short_record.approximation == {} and "dropped" not in detail_html(short_record)


def test_a_records_device_peak_keeps_what_it_was_made_of_and_the_windows_detail_says_it():
    """A record's device peak (32.5 MiB on the gptoss fixture with the host tier and no expert on the device) came
    without what it was: the record keeps the parts held at the peak, which add up to it, and the window's run detail
    says them beside it."""
    from app.gui.record_report import detail_html
    from engine.units import human_bytes

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), device=device, offload=OffloadConfig(device_expert_bytes=0),
                             decode_path="tier")
    record = run_scenario(model, "short", PARAMS, device)
    parts = record.peaks["device_parts"]
    assert list(parts) == ["host tier mappings", "prefill staging ring"]
    assert parts["host tier mappings"] == 16 * (2 << 20) and sum(parts.values()) == record.peaks["device_bytes"]
    assert (f"<td>device peak made of</td><td>host tier mappings 32.0 MiB + prefill staging ring "
            f"{human_bytes(parts['prefill staging ring'])}</td>") in detail_html(record)
    older = RunRecord.from_dict({**record.to_dict(), "peaks": {k: v for k, v in record.peaks.items()
                                                                 if k != "device_parts"}})
    assert "made of" not in detail_html(older)


def test_a_record_s_detail_says_the_cpu_kernels_threads_the_other_processes_left_it(short_record):
    """A run beside a build ran its CPU experts on 1 of 2 threads (the automatic count giving way): the record kept it,
    but the history's detail and comparison said only the other processes' share of the CPUs' time."""
    import html

    from app.gui.record_report import compare_rows, detail_html

    data = short_record.to_dict()
    beside = RunRecord.from_dict(dict(data, offload=dict(data["offload"], cpu_threads={
        "cpu_threads_in_force": 1, "cpu_threads_automatic": True, "cores": 2, "others_busy_cores": 1.1,
        "cpu_threads_changes": 2})))
    assert "CPU expert kernels</td><td>" + html.escape(
        "1 of 2 threads at the end of the run (cpu_threads automatic: it moved 2 times as other processes' load "
        "changed)") in detail_html(beside)
    fixed = RunRecord.from_dict(dict(data, offload=dict(data["offload"], cpu_threads={
        "cpu_threads_in_force": 2, "cpu_threads_automatic": False, "cores": 2, "others_busy_cores": 0.0,
        "cpu_threads_changes": 0})))
    assert "CPU expert kernels</td><td>2 of 2 threads (cpu_threads=2)" in detail_html(fixed)
    rows = {row[0]: row for row in compare_rows(fixed, beside)}
    assert rows["CPU expert threads at the end"][1:] == ("2", "1", "−1", "0.50×")
    older = RunRecord.from_dict(dict(data, offload={k: v for k, v in data["offload"].items() if k != "cpu_threads"}))
    assert "CPU expert kernels</td><td>not recorded" in detail_html(older)
    assert "CPU expert threads at the end" not in detail_html(beside)  # said once, with its cores


def test_a_job_says_so_while_a_model_settles(simulated_model):
    """The window's records jobs name the wait for a model's background work after load, and only when there is
    one: run_turns would wait silently (app/gui/records_jobs.settle)."""
    from app.gui.records_jobs import JobContext, settle

    model, device = simulated_model
    kept = model.prefault
    said = []
    ctx = JobContext(model, device, {}, threading.Event(), lambda fraction, text: said.append((fraction, text)),
                     lambda batch: None, lambda choice, config, notes: None)
    try:
        model.prefault = SimpleNamespace(done=threading.Event())
        model.prefault.done.set()
        settle(ctx, model, 0.5, "the right side")
        assert said == [] and model.settled
        model.prefault = SimpleNamespace(done=threading.Event())
        threading.Timer(0.2, model.prefault.done.set).start()
        settle(ctx, model, 0.5, "the right side")
        assert said == [(0.5, "the right side: mapping its experts after load, before the timed run")]
        assert model.settled
    finally:
        model.prefault = kept


def test_schema_round_trip(short_record):
    data = json.loads(json.dumps(short_record.to_dict()))
    assert RunRecord.from_dict(data) == short_record
    with pytest.raises(RecordError, match="schema version"):
        RunRecord.from_dict(dict(data, schema_version=99))
    del data["timings"]
    with pytest.raises(RecordError, match="timings"):
        RunRecord.from_dict(data)


def test_simulated_record_carries_the_projection(short_record, simulated_model):
    _model, device = simulated_model
    projected = short_record.timings["projected"]
    assert set(projected) >= {"decode_tokens_per_s", "prefill_s", "completion_s", "bandwidths"}
    assert projected["bandwidths"] == {"pcie_bytes_per_s": device.bandwidths.pcie,
                                       "hbm_bytes_per_s": device.bandwidths.hbm}
    assert 0 < projected["completion_s"] <= short_record.timings["completion_s"] * 1.01
    assert all("standin_s" in layer and "critical_s" in layer for layer in short_record.layers)
    data = json.loads(json.dumps(short_record.to_dict()))
    assert RunRecord.from_dict(data).timings["projected"] == projected
    # a record written before the projection existed still reads
    old = dict(data, timings={k: v for k, v in data["timings"].items() if k != "projected"})
    assert "projected" not in RunRecord.from_dict(old).timings
    # the history view's detail and comparison show it where a record has it
    from app.gui.record_report import compare_rows, detail_html, fmt

    detail = detail_html(short_record)
    assert "projected completion" in detail and fmt(projected["completion_s"], "s") in detail
    assert "projected" not in detail_html(RunRecord.from_dict(old))
    rows = {row[0]: row for row in compare_rows(RunRecord.from_dict(old), short_record)}
    assert rows["projected completion"][1] == "—" and rows["projected completion"][2] == fmt(projected["completion_s"], "s")
    # a record written before the host load was measured reads with none, and compares as "—"
    older = {k: v for k, v in old.items() if k != "host_load"}
    assert RunRecord.from_dict(older).host_load == {}
    steal = fmt(short_record.host_load["host_steal_share"], "%")
    rows = {row[0]: row for row in compare_rows(RunRecord.from_dict(older), short_record)}
    assert rows["CPU time the VM's host took (steal)"][1:3] == ("—", steal)


def test_a_comparison_says_what_besides_the_offload_entries_makes_two_runs_unlike(short_record):
    import re

    from app.gui.record_report import compare_html

    def compared(a: RunRecord, b: RunRecord) -> str:
        return re.sub(r"\s+", " ", re.sub("<[^>]+>", " ", compare_html(a, b)))

    data = short_record.to_dict()
    on_the_cpu = RunRecord.from_dict(dict(data, scenario="multiturn", turns=[dict(t, prompt="Why?") for t in data["turns"]],
                                          offload={"device": "cpu", "entries": data["offload"]["entries"]}))
    text = compared(short_record, on_the_cpu)
    # the same offload entries, and it said no more than that: a short run on the device against a multiturn one on
    # the CPU compared metric by metric as if only the configuration differed
    assert "Same offload entries." in text
    assert "Not like for like: besides their offload entries these runs differ in scenario, prompts, device," in text
    assert f" device {short_record.offload['device']} cpu " in text and " scenario short multiturn " in text
    whole = RunRecord.from_dict(dict(data, offload=dict(data["offload"], layer_split=dict(
        data["offload"]["layer_split"], whole_layers=True))))
    assert "differ in layer split," in compared(short_record, whole)
    assert " layer split spread over every layer whole layers " in compared(short_record, whole)
    assert "Not like for like" not in compared(short_record, short_record)


def test_history_write_read_filter_export(short_record, tmp_path):
    history = History(tmp_path / "h.sqlite3")
    first = history.add(short_record)
    other = RunRecord.from_dict(dict(short_record.to_dict(), scenario="long", label="other"))
    second = history.add(other)
    assert history.get(first) == short_record
    assert [row["id"] for row in history.rows()] == [second, first]
    assert [row["id"] for row in history.rows(scenario="long")] == [second]
    assert [row["id"] for row in history.rows(model="gptoss", scenario="short")] == [first]
    assert history.rows(model="no-such-model") == []
    exported = json.loads(history.export("json"))
    assert [d.pop("id") for d in exported] == [second, first]  # the id the list, CSV and Markdown show
    assert [RunRecord.from_dict(d) for d in exported] == [other, short_record]
    rows = list(csv.DictReader(io.StringIO(history.export("csv", scenario="short"))))
    assert len(rows) == 1 and float(rows[0]["completion_s"]) == pytest.approx(short_record.timings["completion_s"])
    markdown = history.export("markdown").splitlines()
    assert markdown[0].startswith("| id |") and len(markdown) == 4


def test_history_filters_by_label_and_id_takes_folder_names_literally_and_leaves_unreadable_runs_out(
        short_record, tmp_path):
    import sqlite3

    history = History(tmp_path / "h.sqlite3")
    first = history.add(short_record)
    swept = history.add(RunRecord.from_dict(dict(short_record.to_dict(), label="sweep 25%")))
    damaged = history.add(short_record)
    assert [row["id"] for row in history.rows(label="SWEEP 25")] == [swept]
    assert [row["id"] for row in history.rows(ids=[first, damaged])] == [damaged, first]
    assert history.rows(model="%") == [] and history.rows(model="gpt_ss") == []  # no LIKE wildcards
    with sqlite3.connect(history.path) as db:
        db.execute("UPDATE runs SET record = ? WHERE id = ?", ('{"schema_version": 2', damaged))
    with pytest.raises(RecordError, match=f"run {damaged} in .*h.sqlite3: unreadable"):
        history.get(damaged)
    unreadable = []
    exported = json.loads(history.export("json", unreadable))
    assert [d["id"] for d in exported] == [swept, first] and len(unreadable) == 1
    assert unreadable[0].startswith(f"run {damaged} in ")
    with pytest.raises(RecordError):
        history.export("json")  # without the list to say it in, an unreadable run is an error


def test_a_record_written_by_a_newer_moe_workbench_says_so_and_names_its_version(short_record, tmp_path):
    """A record of a newer schema version read "run 2 in h.sqlite3: unreadable (run record schema version 2 is not
    1)", as if it were damaged."""
    import sqlite3

    history = History(tmp_path / "h.sqlite3")
    newer = dict(short_record.to_dict(), schema_version=2, versions=dict(short_record.versions, app="0.9.0"))
    run_id = history.add(short_record)
    with sqlite3.connect(history.path) as db:
        db.execute("UPDATE runs SET record = ? WHERE id = ?", (json.dumps(newer), run_id))
    with pytest.raises(RecordError) as caught:
        history.get(run_id)
    assert str(caught.value) == (f"run {run_id} in {history.path}: written by a newer moe-workbench (0.9.0, run "
                                 "record schema version 2; this one reads version 1)")
    with pytest.raises(RecordError, match=r"^written by a newer moe-workbench \(run record schema version 3; this "):
        RunRecord.from_dict(dict(newer, schema_version=3, versions={"app": "source"}))  # a source checkout's own


def test_the_list_and_the_exports_carry_every_run_of_a_long_history(short_record, tmp_path):
    import sqlite3

    from engine.records.history import COLUMNS

    history = History(tmp_path / "h.sqlite3")
    history.add(short_record)
    columns = ", ".join((*COLUMNS[1:], "record"))
    with sqlite3.connect(history.path) as db:
        for _ in range(10):  # 1,024 runs: more than the 1,000 the list and the exports stopped at, unsaid
            db.execute(f"INSERT INTO runs ({columns}) SELECT {columns} FROM runs")
    assert len(history.rows()) == 1024
    assert len(list(csv.DictReader(io.StringIO(history.export("csv"))))) == 1024
    assert len(json.loads(history.export("json"))) == 1024
    assert min(row["id"] for row in history.rows()) == 1  # the oldest run too


def test_a_damaged_or_locked_history_is_one_line_naming_the_file(short_record, tmp_path, monkeypatch, capsys):
    import sqlite3

    from app.cli import main
    from engine.errors import WorkbenchError

    damaged = History(tmp_path / "damaged.sqlite3")
    for _ in range(20):  # more than the table's first page holds: its pages below it are damaged
        damaged.add(short_record)
    data = bytearray(damaged.path.read_bytes())
    data[2 * 4096:] = b"\xab" * (len(data) - 2 * 4096)  # the runs' pages; the schema's (the first) stays whole
    damaged.path.write_bytes(bytes(data))
    with pytest.raises(WorkbenchError, match="damaged.sqlite3: the runs could not be read .*malformed"):
        History(damaged.path).rows()
    assert main(["history", "--history", str(damaged.path), "--export", "csv"]) == 2  # not an internal error (3)
    assert capsys.readouterr().err == (f"moe-workbench: error: {damaged.path}: the runs could not be read "
                                       "(database disk image is malformed)\n")

    history = History(tmp_path / "h.sqlite3")
    monkeypatch.setattr(History, "_connect", lambda self: sqlite3.connect(self.path, timeout=0.1))
    other = sqlite3.connect(history.path, isolation_level=None)  # another process's write under way
    other.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(WorkbenchError, match="h.sqlite3: the run was not saved .another process holds it locked"):
            history.add(short_record)
        with pytest.raises(WorkbenchError, match="h.sqlite3: not opened .another process holds it locked"):
            History(history.path)  # it is a run history: said as such, not 'not a run history'
    finally:
        other.close()
    assert history.add(short_record) == 1


def test_reading_a_history_that_is_not_there_is_an_error_and_makes_nothing(tmp_path):
    from engine.errors import WorkbenchError

    missing = tmp_path / "typo" / "h.sqlite3"
    with pytest.raises(WorkbenchError, match="typo/h.sqlite3: no run history there"):
        History(missing, create=False)
    assert not missing.parent.exists()


def test_long_and_multiturn_scenarios_are_what_they_claim(simulated_model):
    model, _ = simulated_model
    long_prompt = scenario_turns("long", model.tokenizer, model.config, 8)[0]
    rendered = model.tokenizer.render_chat([{"role": "user", "content": long_prompt}])
    assert 2000 <= len(model.tokenizer.encode(rendered)) <= 2040
    assert len(scenario_turns("multiturn", model.tokenizer, model.config, 8)) >= 5


class _WordPiecesTokenizer:
    """A stand-in tokenizer that splits each word into 7 tokens: the word that takes the long input past 2,000 tokens
    ends it 2 past."""

    def render_chat(self, messages, add_generation_prompt=True, variables=None):
        return " ".join(message["content"] for message in messages) + " <answer>"

    def encode(self, text):
        return [0] * (7 * len(text.split()))


def test_the_long_inputs_room_is_counted_with_the_models_tokens_not_2000():
    """The long input's check and its answer length counted 2,000 tokens for the prompt, which ends just past that
    on the model's tokenizer (here 2,002): a 2,064-token context passed the check for 64-token answers, which the
    context then cut 2 tokens short. Both count the prompt's own tokens."""
    from engine.errors import PromptError
    from engine.records.scenarios import scenario_answer_tokens

    tokenizer = _WordPiecesTokenizer()
    prompt = scenario_turns("long", tokenizer, SimpleNamespace(context_length=2066, search=SimpleNamespace(
        max_length=2066)), 64)[0]
    assert len(tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": prompt}]))) == 2002
    with pytest.raises(PromptError, match="^the long-input scenario needs a context of at least 2066 tokens; the "
                                          "model has 2064$"):
        scenario_turns("long", tokenizer, SimpleNamespace(context_length=2064, search=SimpleNamespace(
            max_length=2064)), 64)
    with pytest.raises(PromptError, match="^the long-input scenario needs sequences of at least 2066 tokens; the "
                                          "model's genai_config.json search.max_length is 2064$"):
        scenario_turns("long", tokenizer, SimpleNamespace(context_length=4096, search=SimpleNamespace(
            max_length=2064)), 64)
    model = SimpleNamespace(answer_tokens=lambda plain: 4096, tokenizer=tokenizer,
                            config=SimpleNamespace(longest_sequence=4096))
    assert scenario_answer_tokens(model, "long") == 4096 - 2002


def test_the_long_input_is_made_once_for_each_tokenizer_and_chat_template_and_does_not_keep_the_tokenizer():
    """The long input, made once a tokenizer (its ~100 renders took 0.05-0.2 s at every check), stayed the one made
    with the first chat template the tokenizer had: with another, the prompt's tokens counted for the check were not
    those the run rendered. It is made again for a new template, and goes with its tokenizer."""
    import gc
    import weakref

    from engine.records import scenarios
    from engine.tokenizer import ChatTemplate, ModelTokenizer

    config = SimpleNamespace(context_length=8192, search=SimpleNamespace(max_length=8192))
    made = len(scenarios._LONG_PROMPTS)
    tokenizer = ModelTokenizer(fixture_folder("gptoss"))

    first = scenario_turns("long", tokenizer, config, 8)[0]
    renders, render = [], tokenizer.chat_template.render
    tokenizer.chat_template.render = lambda *args: renders.append(args) or render(*args)
    assert scenario_turns("long", tokenizer, config, 8)[0] == first and renders == []
    # a template that puts 100 words before every message
    template = tokenizer.chat_template
    tokenizer.chat_template = ChatTemplate("preamble " * 100 + template.source, "test", template._special)
    prompt = scenario_turns("long", tokenizer, config, 8)[0]
    rendered = tokenizer.render_chat([{"role": "user", "content": prompt}])
    assert len(prompt) < len(first) and 2000 <= len(tokenizer.encode(rendered)) <= 2040
    kept = weakref.ref(tokenizer)
    del tokenizer
    gc.collect()
    assert kept() is None and len(scenarios._LONG_PROMPTS) == made


def test_multiturn_record_reuses_the_cache(simulated_model):
    model, device = simulated_model
    record = run_scenario(model, "multiturn", GenerationParams(max_new_tokens=4), device)
    assert record.timings["turns"] >= 5
    assert all(turn["reused_cache_tokens"] > 0 for turn in record.turns[1:])


def test_a_scenario_past_the_context_says_what_leaves_its_turns_more_room(copy_fixture):
    """A multiturn run whose answers filled the model's context ended in the conversation's ConversationFullError,
    "...: start a new conversation", which no scenario run can take: each caller (record, contention, the window's
    Record and contention test) changed it into its own words, and a sweep said it as it was. run_scenario says what
    leaves the turns more room, once for all of them."""
    from engine.errors import ConversationFullError, PromptError

    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["context_length"] = 80
    (folder / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(PromptError) as raised:
        run_scenario(LoadedModel.open(folder), "multiturn", GenerationParams(max_new_tokens=30))
    assert not isinstance(raised.value, ConversationFullError)
    assert re.fullmatch(r"the conversation so far \(\d+ tokens\) and this message \(\d+\) come to \d+ tokens, past the "
                        r"model's context of 80 \(a smaller answer length leaves the scenario's turns more room\)",
                        str(raised.value)), raised.value


def test_recommendation_follows_the_numbers():
    def point(budget, completion):
        p = SweepPoint(budget, 0.0)
        p.records = [RunRecord("short", "", {}, {}, {}, {}, {"completion_s": completion, "decode_tokens_per_s": 1},
                               {"device_bytes": budget, "rss_bytes": 1})]
        return p

    points = [point(0, 10.0), point(100, 5.4), point(200, 5.0), point(300, 4.95)]
    assert recommend(points, margin=0.10).budget_bytes == 100   # 5.4 <= 4.95 * 1.1
    assert recommend(points, margin=0.05).budget_bytes == 200
    assert recommend(points, margin=0.0).budget_bytes == 300


def test_recommendation_follows_the_projection_on_a_simulated_device():
    def point(budget, completion, projected):
        p = SweepPoint(budget, 0.0)
        p.records = [RunRecord("short", "", {}, {}, {}, {},
                               {"completion_s": completion, "decode_tokens_per_s": 1,
                                "projected": {"completion_s": projected, "decode_tokens_per_s": 2,
                                              "prefill_s": 0.1, "bandwidths": {}}},
                               {"device_bytes": budget, "rss_bytes": 1},
                               turns=[{"generated_tokens": 3, "timings": {"decode_s": 2.0}}])]  # 2 decoded: 1 tok/s
        return p

    # measured: slower with more resident (the CPU stands in for the card); projected: the card's way
    points = [point(0, 4.0, 10.0), point(100, 5.0, 5.4), point(200, 6.0, 5.0), point(300, 7.0, 4.95)]
    assert recommend(points, margin=0.10).budget_bytes == 100
    assert recommend(points, margin=0.0).budget_bytes == 300
    assert points[0].projected_completion_s == 10.0 and points[0].projected_decode_tokens_per_s == 2
    # one point without a projection (a CUDA run mixed in): the measured times decide
    points[0].records[0].timings.pop("projected")
    assert recommend(points, margin=0.0).budget_bytes == 0


def _repeated_point(budget: int, projected_seconds: list[float]) -> SweepPoint:
    """A simulated-device point whose repeats (one short run each) took these projected completion times."""
    point = SweepPoint(budget, budget / 300, repeats=len(projected_seconds))
    point.records = [RunRecord("short", "", {}, {}, {}, {},
                               {"completion_s": 1.0, "decode_tokens_per_s": 1,
                                "projected": {"completion_s": seconds, "decode_tokens_per_s": 2, "bandwidths": {}}},
                               {"device_bytes": budget, "rss_bytes": 1}) for seconds in projected_seconds]
    return point


def test_a_sweep_recommendation_names_a_tie_within_the_repeats_spread_and_takes_the_smaller_budget():
    """Two budgets whose medians differ by less than their repeats' spreads are a tie: the repeats cannot tell them
    apart, and the smaller budget (less on the device) is recommended, the line saying so. A difference beyond the
    spreads and the margin still decides for the faster."""
    none, all_resident = _repeated_point(0, [1.2, 1.25, 1.3]), _repeated_point(300, [0.95, 1.1, 1.25])
    chosen = recommendation([none, all_resident], margin=0.10)  # 1.25 against 1.1: 14% slower, spreads ±0.05, ±0.15
    assert chosen.point is none and chosen.fastest is all_resident and chosen.tie
    assert none.projected_completion_s == 1.25 and none.spread_s(projected=True) == pytest.approx(0.05)
    assert chosen.line() == ("recommended: 0 bytes (budget share 0%), the least device peak (0 B) of the points whose "
                             "projected completion time is within 10% of the fastest or ties with it: 1.25 s, tied "
                             "with the fastest (1.10 s, at budget share 100%): they differ by less than their spreads "
                             "between repeats (±50.0 ms and ±150 ms), and it holds less on the device (device peak "
                             "0 B against 300 B); each time the median of 3 repeats")
    assert chosen.note == ("sweep recommendation tied with the fastest (at budget share 100%) within the spread "
                           "between repeats")
    slower = _repeated_point(0, [1.5, 1.55, 1.6])
    chosen = recommendation([slower, all_resident], margin=0.10)
    assert chosen.point is all_resident and not chosen.tie
    assert chosen.line().endswith("ties with it: itself the fastest (1.10 s); each time the median of 3 repeats")


def test_a_sweep_recommendations_times_read_as_the_windows_do():
    """The line kept its own format, four figures in seconds and spreads in two ("0.0455 s", "±0.0015 s"), where the
    window gives a time as units.duration_text does: a small model's times and spreads read in ms as there."""
    none, all_resident = _repeated_point(0, [0.044, 0.0455, 0.047]), _repeated_point(300, [0.037, 0.041, 0.045])
    chosen = recommendation([none, all_resident], margin=0.10)  # 11% slower, spreads ±1.5 ms and ±4 ms: a tie
    assert chosen.point is none and chosen.tie
    assert chosen.line().split("ties with it: ")[1] == (
        "45.5 ms, tied with the fastest (41.0 ms, at budget share 100%): they differ by less than their spreads "
        "between repeats (±1.50 ms and ±4.00 ms), and it holds less on the device (device peak 0 B against 300 B); "
        "each time the median of 3 repeats")


def test_a_sweeps_device_parts_line_says_each_percentage_is_a_budget_share():
    """The line named each point by a bare percentage ("device peak by part: 50% whole: expert slots …"), a share of
    nothing said; it names each by its budget share, as the table's column and the recommendation do."""
    half = SweepPoint(150, 0.5, device_parts={"expert slots": 150, "prefill staging ring": 300}, split_run="whole")
    every = SweepPoint(300, 1.0, device_parts={"expert slots": 300, "prefill staging ring": 300})
    assert device_parts_line([SweepPoint(0, 0.0), half, every]) == (
        "device peak by part: budget share 50% whole: expert slots 150 B + prefill staging ring 300 B; "
        "budget share 100%: expert slots 300 B + prefill staging ring 300 B")


def test_a_sweep_recommends_the_least_device_peak_within_the_margin_where_a_smaller_budget_holds_more():
    """With the host tier each layer maps a 2 MiB granule per slot array, slots or none: on the lfm2moe fixture 67%
    peaked at 48.5 MiB on the device and 100% at 1.4 MiB, within 6% of each other, and the smallest budget within the
    margin, 67%, was recommended "as it holds less on the device". The point with the least device peak within the
    margin is recommended (of equal peaks the smaller budget), and the line says its peak and that rule."""
    def point(budget, seconds, peak):
        p = _repeated_point(budget, [seconds])
        for record in p.records:
            record.peaks["device_bytes"] = peak
        return p

    slow, mapped, resident = point(0, 3.0, 50 << 20), point(200, 1.05, 48 << 20), point(300, 1.0, 3 << 19)
    chosen = recommendation([slow, mapped, resident], margin=0.10)
    assert chosen.point is resident and not chosen.tie
    assert chosen.line() == ("recommended: 300 bytes (budget share 100%), the least device peak (1.5 MiB) of the "
                             "points whose projected completion time is within 10% of the fastest or ties with it: "
                             "itself the fastest (1.00 s); smaller budgets among them hold more on the device (budget "
                             "share 67%: 48.0 MiB)")
    chosen = recommendation([slow, mapped, point(300, 1.0, 48 << 20)], margin=0.10)  # equal peaks: the smaller budget
    assert chosen.point is mapped and not chosen.tie
    assert chosen.line().startswith("recommended: 200 bytes (budget share 67%), the least device peak (48.0 MiB) of ")
    assert chosen.line().endswith(": 1.05 s, within 10% of the fastest (1.00 s, at budget share 100%)")
    tied = [_repeated_point(0, [1.2, 1.25, 1.3]), _repeated_point(300, [0.95, 1.1, 1.25])]  # 14% apart, spreads overlap
    for record in tied[0].records:
        record.peaks["device_bytes"] = 600  # the smaller budget holding more: the tie goes to the fastest
    assert recommendation(tied, margin=0.10).point is tied[1]


def _sweep_with_slowed_runs(monkeypatch, model, device, slowed: dict[str, list[float]], repeats: int = 3):
    """A 2-point sweep in which each recorded run at a point (by its label) is slowed inside its timed part: every
    forward of the point's nth run sleeps slowed[label][n] seconds (none beyond the list)."""
    import time

    import engine.records.sweep as sweep

    delay, runs = [0.0], {}
    real_run, real_forward = sweep.run_scenario, model.decoder.forward

    def forward(*args, **kwargs):
        time.sleep(delay[0])
        return real_forward(*args, **kwargs)

    def run(model, name, params, device, label="", **kwargs):
        index = runs[label] = runs.get(label, -1) + 1
        own = slowed.get(label, [])
        delay[0] = own[index] if index < len(own) else 0.0
        try:
            return real_run(model, name, params, device, label=label, **kwargs)
        finally:
            delay[0] = 0.0

    monkeypatch.setattr(model.decoder, "forward", forward)
    monkeypatch.setattr(sweep, "run_scenario", run)
    try:
        return run_sweep(model, device, 2, ["short"], GenerationParams(max_new_tokens=2), repeats=repeats)
    finally:
        monkeypatch.undo()


def test_one_slow_repeat_does_not_change_a_sweeps_recommendation_and_a_real_difference_does(monkeypatch):
    """A reviewer's 2-point sweep of the demo model recommended 0% by one run a point (0.04 s projected against 0.08 s
    all resident), where a generate projected the opposite: one run slowed by anything else on the machine decided a
    CPU/GPU split. Each point now runs its scenarios 3 times, after the same unrecorded warm-up answer at its
    budget, and compares the medians: on the simulated device, the 0% point made slower at every repeat is passed
    over, and a first run at 100% slowed ten times over does not change that."""
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    # every 0% run: ~0.1 s more than the fixture's few milliseconds
    genuine = {"sweep budget share 0%": [0.05] * 3}
    points = _sweep_with_slowed_runs(monkeypatch, model, device, genuine)
    assert [p.repeats for p in points] == [3, 3] and [len(p.records) for p in points] == [3, 3]
    assert recommend(points).fraction == 1.0
    # the first all-resident run, ~1 s: slower than every 0% run
    outlier = {**genuine, "sweep budget share 100%": [0.5]}
    points = _sweep_with_slowed_runs(monkeypatch, model, device, outlier)
    assert max(points[1].repeat_seconds(projected=True)) > max(points[0].repeat_seconds(projected=True))
    assert recommend(points).fraction == 1.0
    # the other way round
    points = _sweep_with_slowed_runs(monkeypatch, model, device, {"sweep budget share 100%": [0.05] * 3})
    assert recommend(points).fraction == 0.0


def test_sweep_on_the_simulated_device(tmp_path):
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    points = run_sweep(model, device, 3, ["short"], GenerationParams(max_new_tokens=4))
    assert [p.fraction for p in points] == [0.0, 0.5, 1.0]
    assert points[0].budget_bytes == 0 and points[-1].budget_bytes == all_resident_bytes(model.offload.infos)
    assert points[0].peak_device_bytes < points[-1].peak_device_bytes  # resident experts cost device memory
    assert points[-1].records[0].layers[0]["misses"] == 0 and points[0].records[0].layers[0]["hits"] == 0
    # a simulated device: the recommendation compares the completion times projected for the simulated card
    assert all(p.projected and p.as_dict()["projected_completion_s"] == p.projected_completion_s for p in points)
    chosen = recommendation(points, 0.10)
    best, fastest = chosen.point, min(p.projected_completion_s for p in points)
    assert chosen.fastest.projected_completion_s == fastest
    assert best.projected_completion_s <= fastest * 1.10 or chosen.tie  # a tie: within the repeats' spreads
    assert all(p.budget_bytes >= best.budget_bytes for p in points if p.projected_completion_s <= fastest * 1.10)


def _sweep_of_two_points(monkeypatch):
    """A sweep of two points, two repeats each, on the gpt-oss fixture, and the seconds of each point's unrecorded
    answer at its budget (the answers run_scenario gives without a label)."""
    from engine.records import sweep

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    unrecorded, real_run = [], sweep.run_scenario

    def run(*args, **kwargs):
        record = real_run(*args, **kwargs)
        if not kwargs.get("label"):  # the point's answer before its runs
            unrecorded.append(record.timings["completion_s"])
        return record

    monkeypatch.setattr(sweep, "run_scenario", run)
    points = run_sweep(model, device, 2, ["short"], GenerationParams(max_new_tokens=2), repeats=2)
    assert len(unrecorded) == 2 and all(seconds > 0 for seconds in unrecorded)
    return points, unrecorded


def test_each_sweep_points_first_record_says_the_seconds_of_its_unrecorded_answer(monkeypatch):
    """Every record of a sweep said warm_up_s 0, which reads as "a record before it said the warm-up": each point's
    unrecorded answer at its budget took the model's warm-up for its own record, which was thrown away, and the
    seconds that answer paid (the first answer on the re-planned slots) were nowhere. Each point's first record says
    them, its records after it 0, as a model's first record after its load does."""
    points, unrecorded = _sweep_of_two_points(monkeypatch)
    assert [[record.timings["warm_up_s"] for record in point.records] for point in points] == [
        [unrecorded[0], 0.0], [unrecorded[1], 0.0]]


def test_every_record_of_a_sweep_point_says_the_warm_up_it_follows(monkeypatch):
    """Only a point's first record said its unrecorded answer at the budget (warm_up_s); the others said 0, though
    every run of the point follows that answer, so one compared with another point's first read as timed without a
    warm-up. Each record says it (point_warm_up_s), as do the point's row and a line of the points'."""
    from engine.records import sweep
    from engine.units import duration_text

    points, unrecorded = _sweep_of_two_points(monkeypatch)
    assert [[record.timings["point_warm_up_s"] for record in point.records] for point in points] == [
        [unrecorded[0]] * 2, [unrecorded[1]] * 2]
    assert [point.as_dict()["warm_up_s"] for point in points] == unrecorded
    assert sweep.point_warm_ups_line(points) == (
        "every run of a point follows its unrecorded warm-up answer at the point's budget (its records' "
        f"point_warm_up_s), which took: budget share 0%: {duration_text(unrecorded[0])}, budget share 100%: "
        f"{duration_text(unrecorded[1])}")
    assert sweep.point_warm_ups_line([SweepPoint(0, 0.0)]) == ""  # a point that gave none


def test_a_sweep_says_what_its_warm_up_before_the_first_point_took(monkeypatch):
    """A sweep answers once, unrecorded, at the model's loaded budget before its first point: no point's record said
    that answer's seconds (the first point's thrown-away answer took them), so nothing told what it cost. The sweep
    gives them, with the budget it ran at, before the first point starts."""
    from engine.records import sweep

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(device_expert_bytes=200_000),
                             device=device)
    loaded, events, real_warm_up = model.offload.plan.budget_bytes, [], sweep.warm_up_answer

    def warm_up(model, cancel=None):
        events.append(("answered", real_warm_up(model, cancel)))
        return events[-1][1]

    monkeypatch.setattr(sweep, "warm_up_answer", warm_up)
    points = run_sweep(model, device, 2, ["short"], GenerationParams(max_new_tokens=2), repeats=1,
                       on_warm_up=lambda budget, fraction, seconds: events.append(("said", budget, fraction, seconds)),
                       on_settle=lambda fraction, split: events.append(("point", fraction)))
    seconds = events[0][1]
    share = loaded / all_resident_bytes(model.offload.infos)
    assert seconds > 0 and events == [("answered", seconds), ("said", loaded, share, seconds), ("point", 0.0),
                                      ("point", 1.0)]
    assert 0 < loaded <= 200_000 and 0 < share < 1 and len(points) == 2
    assert sweep.warm_up_line(282624, 0.5, 0.0451) == (
        "warm-up before the first point, not recorded: an answer of up to 4 tokens at the model's loaded budget, "
        "budget share 50% (device_expert_bytes=282624), took 45.1 ms")


def test_a_sweep_stopped_in_its_first_warm_up_says_so_and_leaves_no_warm_up_time(monkeypatch):
    """A sweep cancelled during its warm-up answer before the first point left that cut-short answer's seconds in
    model.warm_up_s: the next record said them as its warm-up, and gave none of its own. The stopped answer's seconds
    are no warm-up's: the sweep says it stopped in that answer, and the next record warms the model up itself."""
    from engine.records import scenarios

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    cancel, warmed, real_warm_up = threading.Event(), [], scenarios.warm_up_answer
    cancel.set()  # the answer stops at its first token
    with pytest.raises(SweepCancelled) as cancelled:
        run_sweep(model, device, 2, ["short"], GenerationParams(max_new_tokens=2), cancel=cancel, repeats=1)
    assert stopped_at(cancelled.value) == "before the first point, in its unrecorded warm-up answer"
    assert model.warm_up_s is None  # as loaded: the warm-up is still to give
    monkeypatch.setattr(scenarios, "warm_up_answer", lambda model, cancel=None: warmed.append(
        real_warm_up(model, cancel)) or warmed[-1])
    record = run_scenario(model, "short", GenerationParams(max_new_tokens=2))
    assert len(warmed) == 1 and warmed[0] > 0 and record.timings["warm_up_s"] == warmed[0]


def test_a_sweep_stopped_after_a_points_warm_up_leaves_no_warm_up_time(monkeypatch):
    """A cancel after a point's unrecorded answer but before its first run left that answer's seconds in
    model.warm_up_s, so the next record (the model back at its own budgets) said them as its warm-up. They are the
    point's alone: the next record says none."""
    from engine.records import sweep

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    cancel, real_held = threading.Event(), sweep.whole_layers_held

    def held(*args):  # between the point's answer and its first run
        cancel.set()
        return real_held(*args)

    monkeypatch.setattr(sweep, "whole_layers_held", held)
    with pytest.raises(SweepCancelled) as cancelled:
        run_sweep(model, device, 2, ["short"], GenerationParams(max_new_tokens=2), cancel=cancel, repeats=1)
    assert stopped_at(cancelled.value) == "at budget share 0% (device_expert_bytes=0), point 1 of 2"
    assert model.warm_up_s == 0.0
    record = run_scenario(model, "short", GenerationParams(max_new_tokens=2))
    assert record.timings["warm_up_s"] == 0.0


def test_a_sweeps_failure_names_the_run_of_its_point_that_failed(monkeypatch):
    """A failed sweep said at which point it stopped ("point 1 of 2") but not which of the point's runs failed: its
    unrecorded warm-up answer, or which scenario, in which repeat. The point's note names it."""
    from engine.records import sweep

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    real_run = sweep.run_scenario

    def failing(at: int):
        runs = []

        def run(model, name, *args, **kwargs):
            runs.append(name)
            if len(runs) == at:
                raise RuntimeError("failed")
            return real_run(model, name, *args, **kwargs)
        return run

    said = {}
    for at in (1, 5):  # the warm-up answer; the second repeat's multiturn (after short, multiturn, short)
        monkeypatch.setattr(sweep, "run_scenario", failing(at))
        with pytest.raises(RuntimeError) as failed:
            run_sweep(model, device, 2, ["short", "multiturn"], GenerationParams(max_new_tokens=2), repeats=2)
        said[at] = stopped_at(failed.value)
    assert said == {1: "at budget share 0% (device_expert_bytes=0), point 1 of 2, in its unrecorded warm-up answer",
                    5: "at budget share 0% (device_expert_bytes=0), point 1 of 2, in its multiturn run (repeat 2 of 2)"}


def test_a_sweep_point_is_the_budget_the_device_held_where_it_holds_less_than_asked():
    device = SimulatedDevice(1 << 20)  # 1 MiB: not every expert of gptoss beside its staging ring
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    total = all_resident_bytes(model.offload.infos)
    said = []
    points = run_sweep(model, device, 3, ["short"], GenerationParams(max_new_tokens=2),
                       on_left_out=lambda note, count: said.append((note, count)))
    held = model.offload.plan.budget_bytes  # the last point's plan: the device's free memory, not the budget asked
    assert held < total and not said  # the last point asked more: nothing above it to leave out
    # it said 100% of the experts and the budget asked, and recommended and saved a budget that never ran
    assert (points[-1].budget_bytes, points[-1].fraction) == (held, held / total)
    assert points[-1].records[0].label == f"sweep budget share {held / total:.0%}"
    assert [p.budget_bytes for p in points[:2]] == [0, round(total / 2)]  # those the device held are as asked


def test_a_sweep_ends_at_what_the_device_holds_rather_than_run_that_budget_again_for_each_point_above_it():
    """On a card that holds 42% of the experts, a five-point sweep ran 50%, 75% and 100% each at the same held budget:
    three identical points (times, plot, records). It runs the held budget once, in place of 50%, and says which points
    it left out and why."""
    device = SimulatedDevice(800_000)  # holds 229 KiB of gptoss's 552 KiB of experts beside its staging ring
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    total = all_resident_bytes(model.offload.infos)
    said = []
    points = run_sweep(model, device, 5, ["short"], GenerationParams(max_new_tokens=2),
                       on_left_out=lambda note, count: said.append((note, count)))
    held = model.offload.plan.budget_bytes
    assert [p.budget_bytes for p in points] == [0, round(total / 4), held] and held < round(total / 2)
    assert said == [("a budget above the 229.2 KiB of experts the device holds (budget share 42%) runs at that budget "
                     "again: the sweep ends there, in place of the point at budget share 50%, and leaves out the "
                     "points at budget shares 75%, 100%", 2)]


def test_a_sweep_under_mode_required_starts_from_the_smallest_budget_it_admits_and_hands_each_point_on():
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(mode="required"), device=device)
    handed = []
    points = run_sweep(model, device, 3, ["short"], GenerationParams(max_new_tokens=2), on_point=handed.append)
    smallest = min(info.device_bytes_per_expert for info in model.offload.infos)
    assert [p.budget_bytes for p in points][0] == smallest and points[0].fraction == pytest.approx(
        smallest / all_resident_bytes(model.offload.infos))
    assert handed == points and points[0].records[0].layers[0]["hits"] > 0


def test_a_sweep_under_mode_required_of_many_points_runs_none_below_one_expert():
    """gptoss holds 16 experts of 35,328 bytes: a 30-point sweep's second point, 19,491 bytes, holds none, and mode
    required refuses it, so the sweep failed at its second point with no recommendation. The points below one expert
    run once at the smallest budget that holds one; the others as asked, each budget once."""
    from engine.records.sweep import sweep_plan

    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(mode="required"),
                             device=SimulatedDevice(1 << 30))
    total = all_resident_bytes(model.offload.infos)
    budgets = [budget for _fraction, budget, _split in sweep_plan(model, 30)]
    assert budgets == [35328] + [round(total * i / 29) for i in range(2, 30)]
    for budget in budgets[:2]:  # the planner takes every one
        model.offload.reconfigure(model.offload.config.updated(device_expert_bytes=budget))
    # many points on few bytes: each budget once
    auto = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=SimulatedDevice(1 << 30))
    budgets = [budget for _fraction, budget, _split in sweep_plan(auto, 30)]
    assert len(budgets) == len(set(budgets)) == 30 and budgets == sorted(budgets)


def test_a_sweep_point_times_its_answers_once_the_engines_trials_are_over(monkeypatch):
    """After each re-plan the engine tries its decode paths for ~76 decode steps (and "both"'s share after them),
    more than a sweep's answers give: each point decodes, unrecorded, until no trial is under way or due, so its
    answers run on the path the trials keep, which each record and the point's row say. The sweep used to hold the
    path in force when it started: the CPU path for a model loaded with every expert resident, at every point."""
    import engine.records.sweep as sweep
    from engine.offload.planner import all_resident_bytes

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device, decode_path="auto")
    assert model.offload.plan.placement_mode == "all_resident" and model.offload.decode_path_in_force == "cpu"
    seen = []
    real = sweep.run_scenario

    def spy(model, *args, **kwargs):
        seen.append((model.offload.trials_pending, model.offload.path_trials.trials, model.offload.decode_path_mode))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(sweep, "run_scenario", spy)
    points = run_sweep(model, device, 3, ["short"], GenerationParams(max_new_tokens=2))
    half = points[1]
    assert 0 < half.budget_bytes < all_resident_bytes(model.offload.infos)
    # each point's warm-up answer and three repeats (the sweep's own warm-up answer is no scenario run)
    assert [pending for pending, _trials, _mode in seen] == [False] * (3 * 4)
    assert seen[4][1] == 1  # the half-resident point: its first path trial over before its warm-up answer
    assert 76 <= half.settle_steps <= sweep.SETTLE_STEPS_MAX  # the trial's steps, and "both"'s share trial if kept
    assert points[2].settle_steps == 0  # every expert resident: no tier, no trial
    in_force = half.records[0].offload["decode_path"]["in_force"]
    assert in_force in ("tier", "both", "cpu") and half.as_dict()["decode_path"] == in_force
    assert half.as_dict()["settle_steps"] == half.settle_steps
    assert all(mode == "auto" for _pending, _trials, mode in seen) and model.offload.decode_path_mode == "auto"


def test_the_pinned_peak_counts_the_host_tier():
    from engine.records.scenarios import pinned_bytes

    def model(info):
        return SimpleNamespace(offload=SimpleNamespace(pinned_info=lambda: info))

    assert pinned_bytes(model({"kind": "pinned", "bytes": 64 << 20, "host_tier_bytes": 16 << 30})) == \
        (64 << 20) + (16 << 30)
    assert pinned_bytes(model({"kind": "pinned", "bytes": 64 << 20})) == 64 << 20
    assert pinned_bytes(model({"kind": "accounted", "bytes": 64 << 20})) is None
    assert pinned_bytes(SimpleNamespace(offload=None)) is None


def test_side_by_side_gives_two_records_and_the_divergence(simulated_model):
    model, device = simulated_model
    other = LoadedModel.open(fixture_folder("gptoss"))
    streamed = {0: [], 1: []}
    comparison = compare(Side(model, device, "offload"), Side(other, None, "cpu"), "Compare us", PARAMS,
                         on_text=lambda side, token, delta: streamed[side].append(token))
    a, b = comparison.records
    assert (a.label, b.label) == ("offload", "cpu") and a.scenario == b.scenario == "side-by-side"
    assert comparison.divergence is None  # exact offload: same greedy answer as the all-CPU run
    assert streamed[0] == a.turns[0]["tokens"][:len(streamed[0])] and streamed[1]
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2 and first_divergence([1, 2], [1, 2, 5]) == 2


@pytest.mark.parametrize("concurrent", [False, True])
def test_side_by_side_says_as_each_side_ends_how_its_answer_ended(simulated_model, concurrent):
    """One after the other, A's answer ends before B's first token; at once, each side's end follows its last token.
    Each end comes with the side's finish reason and length, as its record has them."""
    model, device = simulated_model
    other = SimulatedDevice(1 << 30)  # B a model of its own: one model answers one prompt at a time
    b = Side(LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(device_expert_bytes=200_000),
                              device=other), other, "b")
    events = []
    comparison = compare(Side(model, device, "a"), b, "Compare us", PARAMS,
                         concurrent=concurrent, on_text=lambda side, token, delta: events.append((side, "token")),
                         on_done=lambda side, reason, tokens: events.append((side, reason, tokens)))
    assert comparison.records[1].scenario == ("side-by-side, at once" if concurrent else "side-by-side")
    ends = [(record.turns[0]["finish_reason"], record.turns[0]["generated_tokens"]) for record in comparison.records]
    assert ends == [("length", PARAMS.max_new_tokens)] * 2
    for side in (0, 1):
        assert [event for event in events if event[0] == side][-1] == (side, *ends[side])  # its end, after its tokens
    if not concurrent:
        assert events.index((0, *ends[0])) < events.index((1, "token"))
    cancel = threading.Event()
    cancel.set()  # neither side begins
    events.clear()
    compare(Side(model, device, "a"), b, "Compare us", PARAMS, concurrent=concurrent,
            cancel=cancel, on_done=lambda side, reason, tokens: events.append((side, reason, tokens)))
    assert sorted(events) == [(0, "cancelled", 0), (1, "cancelled", 0)]


def test_side_by_side_runs_one_model_on_both_sides_one_after_the_other(simulated_model):
    """Asked to answer at once with one model on both sides, the comparison answers one after the other: the model's
    decoder state and offload engine serve one answer at a time (from two threads, one side's answer came out
    different now and then, ending at 'eos' where the other ran to its length)."""
    model, device = simulated_model
    comparison = compare(Side(model, device, "a"), Side(model, device, "b"), "Compare us", PARAMS, concurrent=True)
    a, b = comparison.records
    assert a.scenario == b.scenario == "side-by-side" and a.turns[0]["tokens"] == b.turns[0]["tokens"]


@pytest.mark.parametrize("concurrent", [False, True])
def test_side_by_side_answers_with_one_side_when_the_other_fails(simulated_model, monkeypatch, concurrent):
    """A side that could not load (a budget its device cannot hold) or fails while answering has its one-line error;
    the other side answers all the same, as it would alone."""
    model, device = simulated_model
    alone = compare(Side(model, device, "a"), Side(model, device, "b"), "Compare us", PARAMS).records[0].turns[0]
    cannot_load = Side(None, label="b", failure="B's model: device_expert_bytes=1000 exceeds the 10 bytes free")
    comparison = compare(Side(model, device, "a"), cannot_load, "Compare us", PARAMS, concurrent=concurrent)
    a, b = comparison.records
    assert b is None and a.turns[0]["tokens"] == alone["tokens"] and comparison.divergence is None
    assert comparison.failures == (None, "B's model: device_expert_bytes=1000 exceeds the 10 bytes free")
    assert comparison.as_dict()["records"][1] is None and a.scenario == "side-by-side"  # A answered alone
    other = LoadedModel.open(fixture_folder("gptoss"))

    def fails(state, token_ids):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore detail")

    monkeypatch.setattr(other.decoder, "forward", fails)
    ends = []
    comparison = compare(Side(other, None, "a"), Side(model, device, "b"), "Compare us", PARAMS, concurrent=concurrent,
                         on_done=lambda side, reason, tokens: ends.append((side, reason, tokens)))
    assert sorted(ends) == [(0, "error", None), (1, "length", PARAMS.max_new_tokens)]
    assert comparison.records[0] is None and comparison.records[1].turns[0]["tokens"] == alone["tokens"]
    assert comparison.failures[0].startswith("RuntimeError: CUDA error: an illegal memory access was encountered")
    assert comparison.failures[1] is None and comparison.margins is None


def test_a_side_out_of_gpu_memory_is_said_as_its_own_offload_mode_says_it(monkeypatch):
    """A side's answer or margin that ran out of the card's memory was said without the side's offload mode, so a side
    under mode=disabled (every expert beside the dense part, the expert budgets not applied) was told to lower
    device_expert_bytes. Each side's failure is said as its own configuration says it."""
    import engine.records.side_by_side as side_by_side
    from engine.errors import GPU_OUT_OF_MEMORY, GPU_OUT_OF_MEMORY_DISABLED

    OutOfMemoryError = type("OutOfMemoryError", (MemoryError,), {})  # CuPy's name
    ran_out = "OutOfMemoryError: Out of memory allocating 512 bytes (allocated so far: 0 bytes).; "

    def out_of_memory(*args, **kwargs):
        raise OutOfMemoryError("Out of memory allocating 512 bytes (allocated so far: 0 bytes).")

    sides = []
    for mode in ("auto", "disabled"):
        device = SimulatedDevice(1 << 30)
        sides.append(Side(LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(mode=mode), device=device),
                          device, mode))
    # B's margin runs out of memory where the answers part (A's is computed)
    monkeypatch.setattr(side_by_side, "first_divergence", lambda a, b: 0)
    monkeypatch.setattr(side_by_side, "preference", lambda model, *args: 1.0 if model is sides[0].model
                        else out_of_memory())
    comparison = compare(*sides, "Compare us", PARAMS)
    assert comparison.margins is None and comparison.margins_failure == ran_out + GPU_OUT_OF_MEMORY_DISABLED
    for side in sides:  # each side's answer runs out of memory
        monkeypatch.setattr(side.model.decoder, "forward", out_of_memory)
    comparison = compare(*sides, "Compare us", PARAMS)
    assert comparison.failures == (ran_out + GPU_OUT_OF_MEMORY, ran_out + GPU_OUT_OF_MEMORY_DISABLED)


def test_side_by_side_says_how_firmly_each_side_chose_where_they_part():
    """Approximate routing on B parts the answers at the first token; each side's margin there is its logits' preference
    for its own token over the other's, as onnxruntime's run of the whole model gives it for the exact side."""
    from engine.decoder import OrtReferenceDecoder

    exact = LoadedModel.open(fixture_folder("gptoss"))
    device = SimulatedDevice(1 << 30)
    approximate = LoadedModel.open(fixture_folder("gptoss"), device=device,
                                   offload=OffloadConfig(device_expert_bytes=0, min_expert_weight=0.5))
    comparison = compare(Side(exact, None, "exact"), Side(approximate, device, "approximate"), "Compare us", PARAMS)
    a, b = (record.turns[0]["tokens"][0] for record in comparison.records)
    assert comparison.divergence == 0 and a != b
    reference = OrtReferenceDecoder(exact.folder.onnx, exact.folder.logits_name)
    prompt = exact.tokenizer.encode(exact.tokenizer.render_chat([{"role": "user", "content": "Compare us"}]))
    logits = reference.forward(exact.new_state(), prompt)[-1]
    assert comparison.margins[0] == pytest.approx(logits[a] - logits[b], abs=1e-3)
    assert comparison.margins[0] > 0.1 and comparison.margins[1] > 0.1  # clear choices, not near ties
    assert comparison.as_dict()["margins"] == comparison.margins
    # two different models: no margins (each has its own vocabulary and template)
    other = LoadedModel.open(fixture_folder("qwen35moe"))
    models = compare(Side(exact, None, "a"), Side(other, None, "b"), "Compare us", PARAMS)
    assert models.divergence is not None and models.margins is None


def test_side_by_side_stopped_after_both_sides_answered_in_part_runs_no_more_forward_passes(monkeypatch):
    """Stop once A has answered and B has begun: the answers part at their first token, and the margins there (two
    forward passes of the prompt and the answer) are not computed: Stop means no more engine work."""
    import engine.records.side_by_side as side_by_side

    asked = []
    monkeypatch.setattr(side_by_side, "preference", lambda *args: asked.append(args) or 1.0)
    exact = LoadedModel.open(fixture_folder("gptoss"))
    device = SimulatedDevice(1 << 30)
    approximate = LoadedModel.open(fixture_folder("gptoss"), device=device,
                                   offload=OffloadConfig(device_expert_bytes=0, min_expert_weight=0.5))
    cancel = threading.Event()
    streamed = {0: 0, 1: 0}

    def on_text(side, _token, _delta):
        streamed[side] += 1
        if side == 1 and streamed[1] == 2:
            cancel.set()

    comparison = compare(Side(exact, None, "exact"), Side(approximate, device, "approximate"), "Compare us", PARAMS,
                         on_text=on_text, cancel=cancel)
    a, b = (record.turns[0] for record in comparison.records)
    assert (a["finish_reason"], b["finish_reason"]) == ("length", "cancelled") and len(b["tokens"]) == 2
    assert comparison.divergence == 0 and asked == [] and comparison.margins is None


def test_contention_runner_produces_three_timings(tmp_path, simulated_model):
    model, device = simulated_model
    corpus = make_corpus(tmp_path / "corpus", files=40, words_per_file=300)
    report = run_contention(lambda: run_scenario(model, "short", PARAMS, device).timings["completion_s"],
                            corpus, workers=2, threads=model.decoder.kernel_threads.state)
    assert report.documents == 40
    assert report.indexing_alone_s > 0 and report.inference_alone_s > 0
    assert report.indexing_with_inference_s > 0 and report.inference_with_indexing_s > 0
    assert report.inference_slowdown == pytest.approx(report.inference_with_indexing_s / report.inference_alone_s)
    assert "| inference |" in report.markdown()
    # what other processes took meanwhile: an "alone" phase beside other work is not alone
    shares = report.others_share
    assert set(shares) == {"indexing_alone", "inference_alone", "together"}
    assert all(0.0 <= share <= 1.0 for share in shares.values())
    assert (f"Other processes used {shares['indexing_alone']:.0%} of the CPUs' time while the indexing ran alone, "
            f"{shares['inference_alone']:.0%} while the inference ran alone and {shares['together']:.0%} while both "
            "ran.") in report.markdown()
    # the kernels' thread count after each timed inference (automatic: it may have left the indexing cores)
    alone, together = report.threads_alone, report.threads_together
    assert together["cpu_threads_automatic"] and 1 <= together["cpu_threads_in_force"] <= together["cores"]
    moved = together["cpu_threads_changes"] - alone["cpu_threads_changes"]
    assert (f"CPU expert kernels: {alone['cpu_threads_in_force']} of {alone['cores']} threads at the end of inference "
            f"alone, {together['cpu_threads_in_force']} at the end of inference beside the indexing (cpu_threads "
            f"automatic: it moved {moved} time{'' if moved == 1 else 's'} meanwhile).") in report.markdown()


def test_a_contention_report_of_one_worker_says_one_worker():
    """The report's row read "indexing 1 files, 1 workers", and its threads' line "it moved 1 times"."""
    from engine.records.contention import ContentionReport

    report = ContentionReport(1, 1, 2.0, 1.0, 2.2, 1.1, threads_alone={"cpu_threads_in_force": 2, "cores": 2,
                                                                         "cpu_threads_changes": 3},
                              threads_together={"cpu_threads_in_force": 1, "cpu_threads_automatic": True,
                                                "cpu_threads_changes": 4})
    assert report.markdown().splitlines()[2] == "| indexing 1 file, 1 worker | 2.00 s | 2.20 s | 1.10x (slower) |"
    assert report.markdown().splitlines()[-1].endswith("(cpu_threads automatic: it moved 1 time meanwhile).")


def test_a_sweep_of_both_layer_splits_runs_whole_layers_where_the_budget_holds_some(tmp_path):
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device, layer_split="auto")
    points = run_sweep(model, device, 3, ["short"], GenerationParams(max_new_tokens=3), splits=("spread", "whole"))
    # 2 layers: half the budget holds one whole, none and all hold 0 and 2: one run there
    assert [(p.fraction, p.split) for p in points] == [(0.0, "spread"), (0.5, "spread"), (0.5, "whole"),
                                                       (1.0, "spread")]
    spread, whole = points[1].records[0], points[2].records[0]
    assert spread.offload["layer_split"]["mode"] == "spread" and whole.offload["layer_split"]["mode"] == "whole"
    assert sorted(whole.offload["slots"].values()) == [0, 8] and sorted(spread.offload["slots"].values()) == [4, 4]
    assert points[2].as_dict()["split"] == "whole" and "whole" in whole.label
    assert model.offload.layer_split_mode == "auto"  # the model's own split, put back
    # of one budget's splits, the recommendation takes the faster
    fast = SweepPoint(100, 0.5, split="whole")
    slow = SweepPoint(100, 0.5, split="spread")
    for point, seconds in ((fast, 1.0), (slow, 2.0)):
        point.records.append(RunRecord(scenario="s", created="", versions={}, machine={}, model={}, offload={},
                                       timings={"completion_s": seconds, "decode_tokens_per_s": 1.0},
                                       peaks={"device_bytes": 0, "rss_bytes": 0}))
    assert recommend([slow, fast], margin=0.5) is fast


def test_a_sweep_whose_layer_split_the_device_cannot_take_back_returns_its_points(monkeypatch):
    """Putting the model's own layer split back (whole layers here, after a last point spread) re-plans: the device
    short of memory then (another process took some) raised from run_sweep's finally in place of the points, as a
    failure with no point named ("before the first point"). The points are returned; the model stays at the last
    point's plan, which the window's restore of the budgets says."""
    from engine.offload.device_memory import DeviceMemoryError

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device, layer_split="whole")

    def short(_mode):
        raise DeviceMemoryError("device allocation of 282624 bytes for expert slots would exceed the device's memory "
                                "(1073700000 of 1073741824 bytes in use)")

    monkeypatch.setattr(model.offload, "set_layer_split", short)
    points = run_sweep(model, device, 3, ["short"], GenerationParams(max_new_tokens=2), splits=("spread", "whole"),
                       repeats=1)
    assert [(p.fraction, p.split) for p in points] == [(0.0, "spread"), (0.5, "spread"), (0.5, "whole"),
                                                       (1.0, "spread")]
    assert model.offload.plan.budget_bytes == points[-1].budget_bytes


@pytest.mark.parametrize("refusal", ["required", "card"])
def test_a_sweep_whose_layer_split_the_device_refuses_back_under_required_or_runs_out_returns_its_points(
        monkeypatch, refusal):
    """As with the device short, a layer split put back that mode=required refuses as above what the device has free
    now (BudgetAboveFree), or that runs the card out of memory (CuPy's OutOfMemoryError), raised from run_sweep's
    finally in place of the points. The points are returned; the model stays at the last point's plan."""
    from engine.offload.planner import BudgetAboveFree

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device, layer_split="whole")
    cupy_oom = type("OutOfMemoryError", (MemoryError,), {"__module__": "cupy.cuda.memory"})  # where CuPy is absent

    def refused(_mode):
        if refusal == "required":
            raise BudgetAboveFree("offload mode 'required': device_expert_bytes=565248 exceeds the 276.0 KiB (282624 "
                                  "bytes) the device has free", 282624)
        raise cupy_oom("Out of memory allocating 512 bytes (allocated so far: 0 bytes).")

    monkeypatch.setattr(model.offload, "set_layer_split", refused)
    points = run_sweep(model, device, 3, ["short"], GenerationParams(max_new_tokens=2), splits=("spread", "whole"),
                       repeats=1)
    assert [(p.fraction, p.split) for p in points] == [(0.0, "spread"), (0.5, "spread"), (0.5, "whole"),
                                                       (1.0, "spread")]
    assert model.offload.plan.budget_bytes == points[-1].budget_bytes


def test_cli_record_sweep_history_contention(tmp_path, cli):
    """The sweeps in a process of their own: pyqtgraph's widgets that --plot makes crash a test process at exit."""
    from tests.test_bad_input import run_cli

    model, history = str(fixture_folder("gptoss")), str(tmp_path / "h.sqlite3")
    record = cli("record", model, "--scenario", "short", "--max-new-tokens", "3", "--json", "--history", history)
    assert record.returncode == 0, record.stderr
    assert json.loads(record.stdout)[0]["scenario"] == "short"
    plot = tmp_path / "sweep.png"
    sweep = run_cli("sweep", model, "--device", "simulated", "--points", "2", "--max-new-tokens", "3",
                    "--plot", str(plot), "--json", "--history", history)
    assert sweep.returncode == 0, sweep.stderr
    result = json.loads(sweep.stdout)
    assert len(result["points"]) == 2 and result["recommended_budget_bytes"] in [p["budget_bytes"] for p in result["points"]]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    both = run_cli("sweep", model, "--device", "simulated", "--points", "3", "--max-new-tokens", "2", "--both-splits",
                   "--plot", str(plot), "--json", "--history", str(tmp_path / "other.sqlite3"))
    assert both.returncode == 0, both.stderr
    result = json.loads(both.stdout)
    assert [p["split"] for p in result["points"]] == ["spread", "spread", "whole", "spread"]
    assert result["recommended_split"] in ("spread", "whole")
    listed = cli("history", "--history", history, "--export", "csv")
    assert len(listed.stdout.strip().splitlines()) == 1 + 1 + 2 * 3  # header, record, two sweep points' 3 repeats
    corpus = make_corpus(tmp_path / "corpus", files=10, words_per_file=100)
    contention = cli("contention", model, "--workers", "1", "--corpus", str(corpus), "--max-new-tokens", "3", "--json")
    assert contention.returncode == 0, contention.stderr
    assert set(json.loads(contention.stdout)) >= {"indexing_alone_s", "inference_alone_s",
                                                  "indexing_with_inference_s", "inference_with_indexing_s"}
    # progress on standard error: not a terminal here, so one line at the end rather than redrawn percentages
    assert "progress" not in contention.stdout and contention.stderr.splitlines()[-1] == "contention: done"


def test_sweep_and_contention_stop_when_cancelled(tmp_path, monkeypatch):
    import threading

    import engine.records.contention as contention
    from engine.records.contention import ContentionCancelled

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("lfm2moe"), offload=OffloadConfig(), device=device)
    cancel = threading.Event()
    streamed = []

    def on_text(_token, _delta):  # cancel during the second point's first answer, after the first point's three
        streamed.append(1)
        if len(streamed) == 3 * 5 + 3:
            cancel.set()

    points = []
    with pytest.raises(SweepCancelled) as cancelled:
        run_sweep(model, device, 3, ["short"], GenerationParams(max_new_tokens=5), cancel=cancel, on_text=on_text,
                  on_point=points.append)
    assert len(points) == 1 and len(streamed) == 18  # only complete points; the cut answer stopped at once
    assert stopped_at(cancelled.value).startswith("at budget share 50% (device_expert_bytes=")
    assert "point 2 of 3" in stopped_at(cancelled.value)
    corpus = make_corpus(tmp_path / "corpus", files=4, words_per_file=50)
    calls, indexed, stop = [], [], threading.Event()
    monkeypatch.setattr(contention, "index_folder", lambda folder, workers: indexed.append(folder) or (4, 0.1))
    with pytest.raises(ContentionCancelled):  # cancelled during the first phase (the inference's warm-up)
        run_contention(lambda: calls.append(1) or 0.1, corpus, workers=1, progress=lambda fraction: stop.set(),
                       cancel=stop)
    assert calls == [1] and indexed == []  # stopped before any indexing


def test_configurations_saved_from_two_threads_at_once_are_all_kept(tmp_path):
    import threading

    from engine.records.configurations import load_configuration, save_configuration

    path = tmp_path / "configurations.json"

    def save(side: str) -> None:
        for i in range(40):
            save_configuration(f"{side}{i}", str(tmp_path), OffloadConfig(device_expert_bytes=i), path=path)

    threads = [threading.Thread(target=save, args=(side,)) for side in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    saved = json.loads(path.read_text())
    assert len(saved) == 80 and load_configuration("b39", path)[1].device_expert_bytes == 39
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configurations.json", "configurations.json.lock"]


def test_a_configuration_name_saved_for_another_model_is_not_written_over(tmp_path):
    """Names are one list for every model: a sweep of another model saved under the same name (the window's default,
    'sweep 1.0 GiB', comes round easily) replaced the first model's configuration without a word."""
    from engine.errors import WorkbenchError
    from engine.records.configurations import check_saved, load_configuration, save_configuration

    path = tmp_path / "configurations.json"
    gptoss, lfm2 = fixture_folder("gptoss"), fixture_folder("lfm2moe")
    save_configuration("sweep 1.0 GiB", gptoss, OffloadConfig(device_expert_bytes=1 << 30), path=path)
    message = (f"{path}: a configuration 'sweep 1.0 GiB' is saved there already, for {gptoss.resolve()}: give this one "
               "another name")
    with pytest.raises(WorkbenchError) as error:
        save_configuration("sweep 1.0 GiB", lfm2, OffloadConfig(device_expert_bytes=5), path=path)
    assert str(error.value) == message
    with pytest.raises(WorkbenchError) as error:  # a sweep that is to save under it says so before it runs
        check_saved(path, "sweep 1.0 GiB", lfm2)
    assert str(error.value) == message
    assert load_configuration("sweep 1.0 GiB", path)[1].device_expert_bytes == 1 << 30
    check_saved(path, "sweep 1.0 GiB", gptoss)  # the same model's: a newer sweep replaces it
    save_configuration("sweep 1.0 GiB", gptoss, OffloadConfig(device_expert_bytes=7), path=path)
    assert load_configuration("sweep 1.0 GiB", path)[1].device_expert_bytes == 7


def test_a_configuration_save_that_fails_leaves_no_half_written_file_beside_the_configurations(tmp_path):
    """The save writes a file beside the configurations and renames it over them: where that failed (a folder in the
    file's place here; a full disk), the file written beside them stayed, one more at each try."""
    from engine.errors import WorkbenchError
    from engine.records.configurations import save_configuration

    path = tmp_path / "configurations.json"
    path.mkdir()
    for _try in range(2):
        with pytest.raises(WorkbenchError) as error:
            save_configuration("close", str(tmp_path), OffloadConfig(device_expert_bytes=5), path=path)
        assert str(error.value) == f"{path}: not saved (Is a directory)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configurations.json", "configurations.json.lock"]

def test_the_contention_job_names_the_phase_that_runs(tmp_path, monkeypatch):
    """The window's progress text while each of the contention test's five phases runs: it said 'inference alone'
    while indexing ran alone and 'indexing and inference at once' while inference ran alone (three names mapped
    onto five phases)."""
    import app.gui.records_jobs as jobs
    import engine.records.contention as contention

    shown, ran = [""], []
    monkeypatch.setattr(contention, "index_folder", lambda folder, workers: ran.append(("indexing", shown[0])) or (1, 0.1))
    monkeypatch.setattr(jobs, "run_scenario", lambda *args, **kwargs: ran.append(("inference", shown[0]))
                        or SimpleNamespace(timings={"completion_s": 0.1}))
    corpus = make_corpus(tmp_path / "corpus", files=2, words_per_file=10)
    model = SimpleNamespace(decoder=SimpleNamespace(kernel_threads=SimpleNamespace(state=lambda: None)),
                            folder=SimpleNamespace(folder=tmp_path / "model"), tokenizer=None, config=None)
    ctx = jobs.JobContext(model, None, {}, threading.Event(), lambda fraction, text: shown.__setitem__(0, text),
                          lambda batch: None, None)
    jobs.ContentionJob(str(corpus), workers=1, max_new_tokens=4)(ctx)
    assert ran[:4] == [("inference", "warming up: inference"), ("indexing", "warming up: indexing"),
                       ("indexing", "indexing alone"), ("inference", "inference alone")]
    assert sorted(ran[4:]) == [("indexing", "indexing and inference at once"),
                               ("inference", "indexing and inference at once")]
    assert shown[0] == "done"


def test_the_contention_job_refuses_the_long_input_on_a_short_context_before_any_indexing(tmp_path, monkeypatch):
    """The long scenario on a 2,048-token context with 60-token answers was refused only at the first inference,
    after the warm-up had indexed the whole corpus (minutes on the default one); it is refused first, in Record's
    words."""
    import app.gui.records_jobs as jobs
    import engine.records.contention as contention
    from engine.errors import PromptError
    from engine.records.scenarios import scenario_turns
    from engine.tokenizer import ModelTokenizer

    indexed, shown = [], []
    monkeypatch.setattr(contention, "index_folder", lambda folder, workers: indexed.append(folder) or (1, 0.1))
    # a run refuses its turns first, as run_scenario does
    monkeypatch.setattr(jobs, "run_scenario", lambda model, name, params, *args, **kwargs: scenario_turns(
        name, model.tokenizer, model.config, params.max_new_tokens))
    corpus = make_corpus(tmp_path / "corpus", files=2, words_per_file=10)
    model = SimpleNamespace(decoder=SimpleNamespace(kernel_threads=SimpleNamespace(state=lambda: None)),
                            folder=SimpleNamespace(folder=tmp_path / "model"),
                            tokenizer=ModelTokenizer(fixture_folder("gptoss")),  # the input's 2,000 tokens counted
                            config=SimpleNamespace(context_length=2048, search=SimpleNamespace(max_length=2048)))
    ctx = jobs.JobContext(model, None, {}, threading.Event(), lambda fraction, text: shown.append(text),
                          lambda batch: None, None)
    with pytest.raises(PromptError) as refused:
        jobs.ContentionJob(str(corpus), workers=1, scenario="long", max_new_tokens=60)(ctx)
    assert str(refused.value) == ("long: the long-input scenario needs a context of at least 2060 tokens; the model "
                                  "has 2048")
    assert indexed == [] and shown == []


def test_the_contention_job_says_a_missing_corpus_folder_is_missing(tmp_path):
    """A corpus folder typed wrong was 'no .txt files to index', as if it were there and empty (the command line says
    'no such folder')."""
    import app.gui.records_jobs as jobs
    from engine.errors import WorkbenchError

    model = SimpleNamespace(decoder=SimpleNamespace(kernel_threads=SimpleNamespace(state=lambda: None)), tokenizer=None,
                            config=None)
    ctx = jobs.JobContext(model, None, {}, threading.Event(), lambda fraction, text: None, lambda batch: None, None)
    with pytest.raises(WorkbenchError) as missing:
        jobs.ContentionJob(str(tmp_path / "typo"), workers=1, max_new_tokens=4)(ctx)
    assert str(missing.value) == f"{tmp_path / 'typo'}: no such folder"
    with pytest.raises(WorkbenchError) as empty:
        jobs.ContentionJob(str(tmp_path), workers=1, max_new_tokens=4)(ctx)
    assert str(empty.value) == f"{tmp_path}: no .txt files to index"


def test_a_contention_corpus_given_as_a_file_is_called_a_file_not_a_missing_folder(tmp_path, cli):
    """A .txt file picked as the corpus (the folder meant) read "/x/notes.txt: no such folder", though it is there."""
    import app.gui.records_jobs as jobs
    from engine.errors import WorkbenchError

    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    model = SimpleNamespace(decoder=SimpleNamespace(kernel_threads=SimpleNamespace(state=lambda: None)), tokenizer=None,
                            config=None)
    ctx = jobs.JobContext(model, None, {}, threading.Event(), lambda fraction, text: None, lambda batch: None, None)
    with pytest.raises(WorkbenchError) as refused:
        jobs.ContentionJob(str(notes), workers=1, max_new_tokens=4)(ctx)
    assert str(refused.value) == f"{notes}: a file, not a folder of .txt files"
    result = cli("contention", str(fixture_folder("gptoss")), "--corpus", str(notes))
    assert result.returncode == 2
    assert result.stderr.strip() == f"moe-workbench: error: --corpus {notes}: a file, not a folder of .txt files"

def test_the_contention_corpus_indexes_text_that_is_not_utf8_and_names_a_file_it_cannot_read(tmp_path):
    """A corpus of the user's own documents holding one Latin-1 file failed the whole test with "UnicodeDecodeError:
    'utf-8' codec can't decode byte 0xe9 in position 3: invalid continuation byte", naming no file. The indexing is the
    load the test times: such a file is indexed as it reads (its bad bytes replaced); a .txt that cannot be read at
    all is named, with the reason."""
    from engine.errors import WorkbenchError
    from engine.records.contention import index_folder

    (tmp_path / "a.txt").write_bytes("café au lait\n".encode("latin-1"))
    (tmp_path / "b.txt").write_text("hello\n")
    assert index_folder(tmp_path, 1)[0] == 2
    (tmp_path / "c.txt").symlink_to(tmp_path / "gone")
    with pytest.raises(WorkbenchError) as unreadable:
        index_folder(tmp_path, 1)
    assert str(unreadable.value) == f"{tmp_path / 'c.txt'}: not readable (No such file or directory)"


def test_a_sweep_points_trials_wait_for_the_experts_mapping_its_re_plan_started(monkeypatch):
    """A re-plan from every expert resident to fewer maps the experts' pages in again, in the background (and on a
    GPU page-locks their mapping: seconds for a large model). The point's unrecorded decode ran its trials beside
    that work, so the decode path kept for the point's answers was chosen from steps slowed by it, and the answers
    (which wait for it, run_turns) ran on that choice. The trials' steps start once it is done; a cancel ends the
    wait."""
    import engine.records.sweep as sweep
    from engine.onnx_file import OnnxFile

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device, decode_path="auto")
    assert model.offload.plan.placement_mode == "all_resident" and model.prefault is None
    gate, populate = threading.Event(), OnnxFile.populate_pages
    monkeypatch.setattr(OnnxFile, "populate_pages", lambda self, *args: gate.wait() and populate(self, *args))
    model.offload.reconfigure(model.offload.config.updated(
        device_expert_bytes=all_resident_bytes(model.offload.infos) // 2))
    assert model.prefault is not None and not model.settled  # mapping the experts again, held at the gate
    settled_at_steps, forward = [], model.decoder.forward

    def spy(state, tokens):
        settled_at_steps.append(model.settled)
        return forward(state, tokens)

    monkeypatch.setattr(model.decoder, "forward", spy)
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    assert sweep.settle(model, cancel) == 0 and settled_at_steps == []  # cancelled while waiting
    threading.Timer(0.3, gate.set).start()
    steps = sweep.settle(model)
    assert steps >= 76 and len(settled_at_steps) == steps + 1 and all(settled_at_steps)


@pytest.mark.parametrize("empty_encoding", [False, True])
def test_a_sweep_points_trials_end_on_a_model_whose_context_is_shorter_than_they_take(monkeypatch, empty_encoding):
    """The unrecorded decode goes on in a new conversation where the context is full, until the trials are over: a
    model with a 24-token context used to leave them under way for the point's answers. A tokenizer that encodes
    settle's text to nothing gets a token of the model's own."""
    import dataclasses

    import engine.records.sweep as sweep

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device, decode_path="auto")
    model.offload.reconfigure(model.offload.config.updated(
        device_expert_bytes=all_resident_bytes(model.offload.infos) // 2))
    model.config = dataclasses.replace(model.config, context_length=24)
    if empty_encoding:
        monkeypatch.setattr(model.tokenizer, "encode", lambda text, **kwargs: [])
    lengths, forward = [], model.decoder.forward

    def spy(state, tokens):
        lengths.append(state.past_length + len(tokens))
        return forward(state, tokens)

    monkeypatch.setattr(model.decoder, "forward", spy)
    assert model.offload.trials_pending
    steps = sweep.settle(model)
    assert not model.offload.trials_pending and steps > 2 * 24  # (a first decode path trial ends by its 76th step)
    assert max(lengths) == 24 and lengths.count(lengths[0]) >= 3  # new conversations, each from the prompt


def test_a_sweep_points_settle_waits_for_static_placement_to_place_its_residents():
    """Static placement without a popularity file leaves its slots to copied misses until its opening has counted
    routing, then copies its choice in: a sweep point's settle (and a side-by-side's, bench_offload's warm-up) did not
    wait for it, so on a model loaded afresh the point's recorded answers timed the opening's copies, not static
    placement. trials_pending holds until every layer has chosen and its residents are in."""
    import engine.records.sweep as sweep

    model = LoadedModel.open(fixture_folder("gptoss"), device=SimulatedDevice(1 << 30), decode_path="cpu",
                             offload=OffloadConfig(placement="static"))
    model.offload.reconfigure(model.offload.config.updated(
        device_expert_bytes=all_resident_bytes(model.offload.infos) // 2))
    policy = model.offload.policy
    assert policy.opening and model.offload.trials_pending
    steps = sweep.settle(model)
    assert steps > 0 and not policy.opening and policy.to_place() == 0 and not model.offload.trials_pending


def test_a_sweep_points_settle_on_a_one_token_context_ends(monkeypatch):
    """Every forward is a new conversation's prompt there: no decode step, and the forwards bounded all the same."""
    import dataclasses

    import engine.records.sweep as sweep

    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=SimulatedDevice(1 << 30),
                             decode_path="auto")
    model.offload.reconfigure(model.offload.config.updated(
        device_expert_bytes=all_resident_bytes(model.offload.infos) // 2))
    model.config = dataclasses.replace(model.config, context_length=1)
    monkeypatch.setattr(type(model.offload), "trials_pending", property(lambda engine: True))  # never over
    forwards, forward = [], model.decoder.forward
    monkeypatch.setattr(model.decoder, "forward", lambda state, tokens: forwards.append(len(tokens)) or
                        forward(state, tokens))
    assert sweep.settle(model) == 0 and forwards == [1] * 2 * sweep.SETTLE_STEPS_MAX


def test_side_by_side_whose_margins_cannot_be_computed_keeps_both_answers(monkeypatch):
    """The margins at the divergence fail (a forward pass after both answered): the two answers and their records
    stand, the failure said on one line where the margins would be."""
    import engine.records.side_by_side as side_by_side

    def fails(*args):
        raise MemoryError("std::bad_alloc")

    monkeypatch.setattr(side_by_side, "preference", fails)
    exact = LoadedModel.open(fixture_folder("gptoss"))
    device = SimulatedDevice(1 << 30)
    approximate = LoadedModel.open(fixture_folder("gptoss"), device=device,
                                   offload=OffloadConfig(device_expert_bytes=0, min_expert_weight=0.5))
    comparison = compare(Side(exact, None, "exact"), Side(approximate, device, "approximate"), "Compare us", PARAMS)
    assert comparison.divergence == 0 and all(record.turns for record in comparison.records)
    assert comparison.margins is None and comparison.margins_failure == "MemoryError: std::bad_alloc"


def test_a_sweep_under_mode_required_ends_at_what_the_device_holds_and_says_which_points_it_left_out():
    device = SimulatedDevice(800_000)  # holds 229 KiB of gptoss's 552 KiB of experts beside its staging ring
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(mode="required", device_expert_bytes=70656),
                             device=device)
    total = all_resident_bytes(model.offload.infos)
    said = []
    points = run_sweep(model, device, 5, ["short"], GenerationParams(max_new_tokens=2),
                       on_left_out=lambda note, count: said.append((note, count)))
    held = model.offload.plan.budget_bytes
    assert held == 234752 and round(total / 4) < held < round(total / 2)
    assert [p.budget_bytes for p in points[1:]] == [round(total / 4), held] and points[-1].fraction == held / total
    assert said == [("offload mode 'required' refuses a budget above the 229.2 KiB of experts the device holds (budget "
                     "share 42%): the sweep ends there, in place of the point at budget share 50%, and leaves out the "
                     "points at budget shares 75%, 100%", 2)]


def test_a_sweep_points_decode_rate_is_its_decoded_tokens_over_their_decode_time():
    """A short run (10 tokens decoded in 0.1 s) and a multiturn one (600 in 12 s) at one point: the point decodes
    610 tokens in 12.1 s, 50.4 tok/s, where the mean of the two runs' rates said 75 (the short one weighed as much as
    six answers); the projected rate likewise (the runs' projected decode times: their tokens over their rates)."""
    def run(answers: int, tokens: int, seconds: float, projected: float) -> SimpleNamespace:
        turns = [{"generated_tokens": tokens + 1, "timings": {"decode_s": seconds}}] * answers
        return SimpleNamespace(turns=turns, timings={"decode_tokens_per_s": tokens / seconds if seconds else None, "completion_s": 1.0,
                                                     "projected": {"decode_tokens_per_s": projected,
                                                                   "completion_s": 1.0}},
                               peaks={"device_bytes": 0, "rss_bytes": 0}, offload={}, routing_agreement=None)

    point = SweepPoint(0, 0.0, records=[run(1, 10, 0.1, 200.0), run(6, 100, 2.0, 100.0)])
    assert point.decode_tokens_per_s == pytest.approx(610 / 12.1)
    assert point.as_dict()["decode_tokens_per_s"] == point.decode_tokens_per_s
    assert point.projected_decode_tokens_per_s == pytest.approx(610 / (10 / 200 + 600 / 100))
    # no decode step at all (one-token answers): no rate (None, as a record's; 0.0 read as decoding stalled)
    one_token = SweepPoint(0, 0.0, records=[run(1, 0, 0.0, None)])
    assert one_token.decode_tokens_per_s is None and one_token.projected_decode_tokens_per_s is None


def test_a_sweep_refuses_a_scenario_its_context_cannot_hold_before_its_first_run(monkeypatch):
    import engine.records.sweep as sweep
    from engine.errors import PromptError

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    ran = []
    monkeypatch.setattr(sweep, "run_scenario", lambda *args, **kwargs: ran.append(args[1]))
    with pytest.raises(PromptError, match="^the long-input scenario needs a context of at least 2060 tokens; the "
                                          "model has 2048$"):
        run_sweep(model, device, 2, ["short", "long"], GenerationParams(max_new_tokens=60))
    assert ran == []  # it was refused at the first point, after the warm-up and the short run
    assert sweep.fitting_scenarios(model, ["short", "long", "multiturn"], 60) == (
        ["short", "multiturn"], "skipped long: the long-input scenario needs a context of at least 2060 tokens; the "
                                "model has 2048")
    assert sweep.fitting_scenarios(model, ["short", "long"], 48) == (["short", "long"], "")  # 2,000 + 48 fit


def test_a_saved_configurations_relative_paths_are_saved_from_where_it_was_tuned(tmp_path, monkeypatch):
    """popularity_file=pop.json given to `sweep --save-as` in one folder was saved as 'pop.json', which the window
    (started from the desktop: the home folder) or a later --config in another folder read as another file, or
    none. The paths (popularity_file, source_root, derived_cache_dir) are saved absolute, naming what was meant."""
    from engine.records.configurations import load_configuration, save_configuration

    monkeypatch.chdir(tmp_path)
    config = OffloadConfig.from_entries({"popularity_file": "pop.json", "source_root": "weights",
                                         "derived_cache_dir": str(tmp_path / "cache"), "budget_group": "group"})
    path = save_configuration("tuned", str(tmp_path), config, path=tmp_path / "configurations.json")
    monkeypatch.chdir("/")
    _model, saved, _own = load_configuration("tuned", path)
    assert (saved.popularity_file, saved.source_root, saved.derived_cache_dir, saved.budget_group) == (
        str(tmp_path / "pop.json"), str(tmp_path / "weights"), str(tmp_path / "cache"), "group")


def test_side_by_side_of_two_tokenizers_compares_the_answers_text_not_their_token_ids(monkeypatch, copy_fixture):
    """Two models with different tokenizers: token ids mean different text, so comparing them said "diverge at
    generated token 1" for the same answer. Their answers' text (reasoning, then answer) is compared instead, and
    the comparison says so; one tokenizer keeps the token comparison."""
    import engine.records.side_by_side as side_by_side
    from app.gui.side_by_side_view import divergence_text

    folder = copy_fixture("gptoss")
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({"id": 512, "content": "<|other|>", "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True})
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    left, right = LoadedModel.open(fixture_folder("gptoss")), LoadedModel.open(folder)
    answers = {}

    def run_turns(model, *_args, **_kwargs):
        tokens, reasoning, answer = answers[id(model)]
        return SimpleNamespace(turns=[{"tokens": tokens, "reasoning": reasoning, "answer": answer,
                                       "finish_reason": "eos", "generated_tokens": len(tokens)}], peaks={})

    monkeypatch.setattr(side_by_side, "run_turns", run_turns)
    answers.update({id(left): ([5, 6, 7], "", "Hello there"), id(right): ([91, 92], "", "Hello there")})
    same = compare(Side(left), Side(right), "Hi", PARAMS)
    assert (same.by_text, same.divergence, same.text_divergence) == (True, None, None)
    assert divergence_text(same.divergence, same.margins, None, same.by_text, same.text_divergence) == (
        "The two answers are identical as text (the two models' tokenizers differ, so the answers are compared as "
        "text, not token by token).")
    answers.update({id(left): ([5, 6, 7], "Think.", "Hello there"), id(right): ([91, 93], "Think.", "Hello world")})
    parted = compare(Side(left), Side(right), "Hi", PARAMS)
    assert (parted.by_text, parted.divergence, parted.text_divergence) == (True, None, len("Think.Hello "))
    assert divergence_text(None, None, None, True, parted.text_divergence).startswith(
        "The answers' text diverges at character 13, highlighted in both columns")
    again = LoadedModel.open(fixture_folder("gptoss"))  # one tokenizer (one folder): token by token, as before
    answers.update({id(left): ([5, 6, 7], "", "Hello there"), id(again): ([5, 6, 8], "", "Hello there")})
    tokens = compare(Side(left), Side(again), "Hi", PARAMS)
    assert (tokens.by_text, tokens.divergence) == (False, 2)
    # each column highlights the token of its own stream that holds that character (past its end: the end)
    from app.gui.side_by_side_view import token_at
    assert token_at(len("Think.Hel"), ["Th", "ink.", "", ""], ["", "", "Hel", "lo"]) == 3
    assert token_at(20, ["Th"], ["", "x"][:1]) == 1 and token_at(None, [], []) is None


def test_a_sweep_points_runs_all_follow_the_trials_it_settled_for_and_none_after(monkeypatch):
    """A point settled until the engine's first trials at its budget were over, then ran its scenarios; but a trial
    measures again `recheck` decode steps after the last (512 by default, fewer than a point's three repeats of every
    scenario decode), so a later trial's windows of the other ways, and any switch it made, fell in some of the point's
    runs and not others: its times mixed ways, and the table said the first run's. The trials are held while the point
    answers: every run of a point follows the same finished trials."""
    import engine.offload.engine as offload_engine
    from engine.offload.layer_split import LayerSplitTrials

    monkeypatch.setattr(offload_engine, "LayerSplitTrials",
                        lambda: LayerSplitTrials(first=1, settle=1, window=2, recheck=4))  # a recheck in 4 steps
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    model.offload.set_layer_split("auto")  # (the suite fixes the spread: MOE_LAYER_SPLIT)
    points = run_sweep(model, device, 3, ["short"], GenerationParams(max_new_tokens=6), repeats=3)
    middle = points[1]  # half the budget: some layers whole, the split to choose
    assert middle.settle_steps > 0
    splits = [record.offload["layer_split"] for record in middle.records]
    assert [(split["trials"], split["measuring"]) for split in splits] == [(1, None)] * 3


def test_a_sweep_of_more_than_101_points_labels_each_budgets_runs_apart(monkeypatch):
    """A point's runs were labelled with its budget share to a whole percent: past 101 points several budgets read
    as one ("sweep budget share 0%" for 0% and 0.5% of 201 points), and history's --label could not tell them
    apart. The share is given to as many places as tell the sweep's points apart; none up to 101 points, as before."""
    import engine.records.sweep as sweep

    assert sweep.share_decimals(f for f, _budget in sweep.budget_points(1000, 101)) == 0
    assert sweep.share_decimals(f for f, _budget in sweep.budget_points(1000, 201)) == 1
    assert sweep.share_decimals(f for f, _budget in sweep.budget_points(10**6, 3001)) == 2
    assert sweep.share_decimals([0.25, 0.25]) == 0  # a budget run on both splits: one share
    every_point = sweep.budget_points
    # the first 3 of 201 points (0%, 0.5%, 1.0%): the sweep's plan, from the real budgets, runs those alone
    monkeypatch.setattr(sweep, "budget_points", lambda total, count: every_point(total, count)[:3])
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(device_expert_bytes=200_000),
                             device=device)
    points = run_sweep(model, device, 201, ["short"], GenerationParams(max_new_tokens=1), repeats=1)
    total = all_resident_bytes(model.offload.infos)
    assert [(p.budget_bytes, p.records[0].label) for p in points] == [
        (0, "sweep budget share 0.0%"), (round(total / 200), "sweep budget share 0.5%"),
        (round(total / 100), "sweep budget share 1.0%")]
