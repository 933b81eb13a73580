"""The expert budget spread over every layer or spent on whole layers (engine/offload/layer_split.py): the planner's
whole-layer plan, the trials that measure both and keep the faster, and the engine switching between them at safe
points with the same answers as the all-CPU run."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from engine.generation import LoadedModel
from engine.offload import OffloadConfig, SimulatedDevice
from engine.offload.config import NodeOverride
from engine.offload.layer_split import LayerSplitTrials
from engine.offload.planner import OffloadPlanError, plan_offload, whole_layers_held
from tests.test_offload import assert_same_as_cpu, device_expert_bytes, greedy_run, model_folder, cpu_run  # noqa: F401


def feed(trials: LayerSplitTrials, seconds: float, steps: int, tokens: int = 1) -> list[str]:
    """`steps` steps of `seconds`; the re-plans the trials asked for."""
    asked = []
    for _ in range(steps):
        wanted = trials.step(seconds, tokens)
        if wanted is not None:
            asked.append(wanted)
    return asked


def half_budget_engine(model_folder, mode: str = "auto", **trials):
    """The model with half its experts' budget on the simulated device, its engine in `mode`; under auto, trials
    with the given settings."""
    budget = int(0.5 * device_expert_bytes(model_folder))
    model = LoadedModel.open(model_folder, offload=OffloadConfig(device_expert_bytes=budget),
                             device=SimulatedDevice(1 << 30))
    model.offload.set_layer_split(mode)
    if trials:
        model.offload.split_trials = LayerSplitTrials(**trials)
    return model, model.offload


def test_trials_keep_whole_layers_where_they_decode_faster_and_measure_again_later():
    trials = LayerSplitTrials(first=3, settle=2, window=4, recheck=10, margin=0.05)
    assert feed(trials, 0.5, 5, tokens=7) == []   # prefill steps neither count nor interrupt
    assert feed(trials, 0.030, 3) == []           # the first decode steps: placement warms up
    assert feed(trials, 0.030, 4) == ["whole"]    # the spread measured: whole layers next
    assert trials.split == "whole" and trials.trials == 0
    assert feed(trials, 0.100, 2) == []           # settling after the re-plan: not counted
    assert feed(trials, 0.020, 4) == ["spread"]   # whole layers measured: the spread again (A-B-A)
    assert feed(trials, 0.100, 2) + feed(trials, 0.031, 4) == ["whole"]  # still slower: whole layers kept
    assert trials.split == "whole" and trials.trials == 1
    assert trials.state() == {"trials": 1, "measured_ms": {"spread": pytest.approx(30.0), "whole": pytest.approx(20.0)},
                              "measuring": None}
    assert feed(trials, 0.020, 10) == []          # until the recheck
    assert feed(trials, 0.020, 1) == [] and trials.state()["measuring"] == "whole"  # a trial runs: whole layers timed
    assert feed(trials, 0.020, 3) == ["spread"]   # the split in force measured first, then the other, then it again
    assert trials.state()["measuring"] == "spread"
    assert feed(trials, 0.020, 2) + feed(trials, 0.0195, 4) == ["whole"]
    assert feed(trials, 0.020, 2) + feed(trials, 0.021, 4) == ["spread"]  # whole layers not faster by the margin
    assert trials.split == "spread" and trials.trials == 2
    assert trials.state()["measured_ms"] == {"whole": pytest.approx(20.0), "spread": pytest.approx(19.5)}


def test_trials_go_back_to_the_spread_where_whole_layers_are_not_faster_by_the_margin():
    trials = LayerSplitTrials(first=0, settle=1, window=3, recheck=5, recheck_max=12, margin=0.05)
    assert feed(trials, 0.020, 3) == ["whole"]
    assert feed(trials, 0.0195, 4) == ["spread"]  # whole layers measured: the spread again
    assert feed(trials, 0.020, 4) == []           # 2.5% faster: not enough, the spread stays (no re-plan)
    assert trials.split == "spread" and trials.trials == 1
    # a trial that keeps the split in force doubles the wait for the next one, up to recheck_max
    assert trials.wait == 10
    assert feed(trials, 0.020, 10) == []
    assert feed(trials, 0.020, 3) == ["whole"] and feed(trials, 0.0195, 4) == ["spread"]
    assert feed(trials, 0.020, 4) == [] and trials.trials == 2 and trials.wait == 12


def test_the_split_in_force_counts_with_its_faster_window():
    """A-B-A: the spread's first window right after a budget change can catch placement still learning the routing
    (or the machine in a slow spell); its second, after whole layers', decides when faster."""
    trials = LayerSplitTrials(first=0, settle=1, window=3, recheck=100, margin=0.05)
    assert feed(trials, 0.040, 3) == ["whole"]    # the spread while placement moves: slow
    assert feed(trials, 0.030, 4) == ["spread"]   # whole layers: faster than that window
    assert feed(trials, 0.025, 4) == []           # the spread settled: faster than whole layers, kept
    assert trials.split == "spread" and trials.state()["measured_ms"] == {"spread": pytest.approx(25.0),
                                                                         "whole": pytest.approx(30.0)}
    # and where whole layers are faster than both of the spread's windows they are kept
    trials = LayerSplitTrials(first=0, settle=1, window=3, recheck=100, margin=0.05)
    assert feed(trials, 0.040, 3) + feed(trials, 0.030, 4) + feed(trials, 0.035, 4) == ["whole", "spread", "whole"]
    assert trials.split == "whole" and trials.state()["measured_ms"]["spread"] == pytest.approx(35.0)


def _info(name: str, layer: int, experts: int = 4, slot: int = 10):
    spec = type("Spec", (), {"num_experts": experts})()
    return type("Info", (), {"name": name, "layer": layer, "spec": spec, "device_bytes_per_expert": slot,
                             "bytes_per_expert": slot, "gpu": type("Gpu", (), {"conversion": ""})(),
                             "gpu_unsupported": "", "unsupported": ""})()


def test_the_whole_layer_plan_fills_layers_in_order_and_leaves_the_rest_unspent():
    infos = [_info("b", 1), _info("a", 0), _info("c", 2)]  # 40 bytes a layer
    device = SimulatedDevice(1 << 30)
    spread = plan_offload(OffloadConfig(device_expert_bytes=95), infos, device)
    assert spread.slots == {"a": 3, "b": 3, "c": 3}
    whole = plan_offload(OffloadConfig(device_expert_bytes=95), infos, device, whole_layers=True)
    assert whole.slots == {"a": 4, "b": 4, "c": 0}  # layer order, not the list's; 15 bytes left unspent
    assert "The budget holds whole layers: 2 of 3 expert layers keep all their experts" in " ".join(whole.statements)
    assert whole_layers_held(infos, 95) == 2 and whole_layers_held(infos, 39) == 0 and whole_layers_held(infos, 120) == 3
    # a layer the user capped below all its experts is never whole
    capped = OffloadConfig(device_expert_bytes=95, node_overrides={"a": NodeOverride(max_resident_slots=3)})
    assert plan_offload(capped, infos, device, whole_layers=True).slots == {"a": 0, "b": 4, "c": 4}


def test_required_mode_refuses_whole_layers_that_the_budget_cannot_hold():
    """mode=required with the budget on whole layers: one that holds none would leave every expert on the CPU."""
    infos = [_info("a", 0), _info("b", 1)]  # 40 bytes a layer
    device = SimulatedDevice(1 << 30)
    required = OffloadConfig(mode="required", device_expert_bytes=39)
    with pytest.raises(OffloadPlanError) as error:
        plan_offload(required, infos, device, whole_layers=True)
    assert str(error.value) == ("offload mode 'required': the expert budget of 39 bytes holds no whole layer (the "
                                "smallest needs 40 bytes on the device); the layer split 'spread' places the budget "
                                "expert by expert")
    assert plan_offload(required, infos, device).slots == {"a": 2, "b": 1}
    assert plan_offload(required.updated(device_expert_bytes=40), infos, device, whole_layers=True).slots == {"a": 4,
                                                                                                               "b": 0}


def test_the_engine_switches_to_whole_layers_when_measured_faster_with_the_same_answers(model_folder, cpu_run):
    model, engine = half_budget_engine(model_folder, first=1, settle=1, window=2, recheck=1000)
    budget = engine.plan.budget_bytes
    num_experts = model.folder.experts[0].spec.num_experts
    assert engine.whole_layers is False and all(0 < layer.num_slots < num_experts for layer in engine.slots)
    # step times as a machine where whole layers decode in two thirds of the spread's time would give them, taken as
    # the card's (the simulated device's projection of them: the last test); the trials compare them alone, without
    # the wall time end_step adds for the accounts each step left for it (milliseconds on a loaded machine)
    def step_s():
        return 0.020 if engine.whole_layers else 0.030

    engine._trial_seconds = lambda seconds: step_s()
    model.decoder.on_step_end = lambda seconds, tokens: engine.end_step(step_s(), tokens)
    run = greedy_run(model)
    assert engine.whole_layers is True and engine.split_trials.trials == 1
    counts = sorted(layer.num_slots for layer in engine.slots)
    assert counts[0] == 0 and counts[-1] == num_experts and set(counts) == {0, num_experts}
    assert any("The budget holds whole layers" in text for text in engine.plan.statements)
    assert engine.copy_state()["layer_split"] == {"mode": "auto", "whole_layers": True,
                                                   "layers_whole": counts.count(num_experts), "trials": 1,
                                                   "measuring": None,
                                                   "measured_ms": {"spread": pytest.approx(30.0, abs=1.0),
                                                                   "whole": pytest.approx(20.0, abs=1.0)}}
    assert_same_as_cpu(run, cpu_run)  # the switch mid-conversation changes no answer
    # a prompt under whole layers: the layers without slots stream their busy experts in prefill waves
    prompt = model.tokenizer.encode("A second prompt, prefilled with the budget on whole layers.")
    ours = model.decoder.forward(model.new_state(), prompt)
    cpu = LoadedModel.open(model_folder)
    ref = cpu.decoder.forward(cpu.new_state(), prompt)
    assert abs(ours - ref).max() / abs(ref).max() <= 1e-5
    # a budget change starts again from the spread
    engine.reconfigure(OffloadConfig(device_expert_bytes=budget))
    assert engine.whole_layers is False and engine.split_trials.trials == 0


def test_no_trials_where_the_user_placed_the_nodes_or_placement_is_static(model_folder):
    budget = int(0.5 * device_expert_bytes(model_folder))
    names = [info.name for info in LoadedModel.open(model_folder).folder.experts]
    for config in (OffloadConfig(device_expert_bytes=budget, placement="static"),
                   OffloadConfig(device_expert_bytes=budget, node_overrides={names[0]: NodeOverride(2)}),
                   OffloadConfig(device_expert_bytes=0)):
        model = LoadedModel.open(model_folder, offload=config, device=SimulatedDevice(1 << 30))
        engine = model.offload
        engine.set_layer_split("auto")
        engine.split_trials = LayerSplitTrials(first=0, settle=0, window=1)
        for seconds in (0.030, 0.001, 0.001):
            engine.end_step(seconds, 1)
        assert engine.whole_layers is False and engine.split_trials.trials == 0


def test_a_fixed_split_is_planned_at_once_and_an_unknown_one_refused(model_folder):
    _model, engine = half_budget_engine(model_folder, "whole")
    assert engine.whole_layers is True and engine.copy_state()["layer_split"]["mode"] == "whole"
    engine.end_step(0.001, 1)  # no trials under a fixed split
    assert engine.whole_layers is True
    from engine.errors import WorkbenchError
    with pytest.raises(WorkbenchError, match="layer split 'layers': one of auto, spread, whole"):
        engine.set_layer_split("layers")


def test_a_re_plan_the_trials_ask_for_that_fails_keeps_the_plan_in_force_and_ends_the_trials(model_folder, monkeypatch):
    from engine.errors import WorkbenchError

    _model, engine = half_budget_engine(model_folder, first=0, settle=0, window=1)
    slots = [layer.num_slots for layer in engine.slots]

    def refused(config):
        raise WorkbenchError("the GPU ran out of memory")

    monkeypatch.setattr(engine, "_replan", refused)
    engine.end_step(0.030, 1)  # the spread measured: whole layers asked for, refused
    assert engine.whole_layers is False and engine.layer_split_mode == "spread"
    assert [layer.num_slots for layer in engine.slots] == slots
    assert engine.plan.statements[-1] == ("The layer split's trials asked for whole layers, and the re-plan failed "
                                          "(the GPU ran out of memory): decode goes on with the budget spread over "
                                          "every layer, with no more trials.")
    engine.end_step(0.001, 1)  # no more trials
    assert engine.split_trials.trials == 0


@pytest.mark.parametrize("error, said", [
    (RuntimeError("cuMemHostRegister failed: CUDA_ERROR_INVALID_VALUE"),
     "RuntimeError: cuMemHostRegister failed: CUDA_ERROR_INVALID_VALUE"),
    (OSError(12, "Cannot allocate memory"), "OSError: [Errno 12] Cannot allocate memory")])
def test_a_re_plan_the_trials_ask_for_that_the_driver_or_host_memory_fails_keeps_decoding(model_folder, cpu_run,
                                                                                        monkeypatch, error, said):
    """The trials' re-plan was caught only where refused (a WorkbenchError): the driver or the host's memory failing it
    stopped decoding, though _replan had put the plan in force back. Decoding goes on under that plan, with no more
    trials, and the plan says what failed."""
    model, engine = half_budget_engine(model_folder, first=0, settle=0, window=1)
    plan, slots = engine.plan, [layer.num_slots for layer in engine.slots]
    real, raised = type(engine)._plan_streaming, []

    def fails_once(self, *args, **kwargs):
        if not raised:
            raised.append(error)
            raise error
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(engine), "_plan_streaming", fails_once)
    engine.end_step(0.030, 1)  # the spread measured: whole layers asked for, their streaming slots failed
    assert raised == [error] and engine.plan is plan
    assert engine.whole_layers is False and engine.layer_split_mode == "spread"
    assert [layer.num_slots for layer in engine.slots] == slots
    assert engine.plan.statements[-1] == (f"The layer split's trials asked for whole layers, and the re-plan failed "
                                          f"({said}): decode goes on with the budget spread over every layer, with no "
                                          f"more trials.")
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert engine.split_trials.trials == 0 and not engine.whole_layers


def _a_re_plan_refused_by_a_data_file_stops_the_answer(model_folder, tmp_path, change, said, what):
    """The trials' re-plan, asked for at the first decode step's safe point, refused as `change(data)` (run during that
    step) leaves the data file: the answer stops there with the refusal `said(data)`, no step after it, the plan in
    force kept, and the plan's last statement says the answer stopped before a step read the data file `what`."""
    from engine.errors import ModelFileError
    from engine.generation import GenerationParams, generate

    folder = tmp_path / "m"
    shutil.copytree(model_folder, folder)
    model, engine = half_budget_engine(folder, first=0, settle=0, window=1)
    plan = engine.plan
    data = folder / "model.onnx.data"
    refusal = said(data)
    safe_point = model.decoder.on_step_end

    def changed_first(seconds, tokens):  # the file changed during the first decode step, before its safe point
        if tokens == 1:
            change(data)
        safe_point(seconds, tokens)

    model.decoder.on_step_end = changed_first
    prompt = model.tokenizer.encode("The expert offload engine must be exact.")
    with pytest.raises(ModelFileError) as refused:
        generate(model, model.new_state(), [], prompt, GenerationParams(max_new_tokens=8))
    assert str(refused.value) == refusal
    assert model.decoder.profile["steps"] == 1  # the prefill's: the decode step stopped at its safe point
    assert engine.plan is plan and engine.whole_layers is False and engine.layer_split_mode == "spread"
    assert engine.plan.statements[-1] == (f"The layer split's trials asked for whole layers, and the re-plan failed "
                                          f"({refusal}): the answer stopped there, before a step read the data file "
                                          f"{what}; the plan keeps the budget spread over every layer, with no more "
                                          f"trials.")


def test_a_re_plan_the_trials_ask_for_refused_on_a_data_file_cut_short_stops_the_answer(model_folder, tmp_path):
    """The trials' re-plan, refused since a data file was truncated after the load, said "decode goes on" and the
    answer went on to steps that read the file past its new end (SIGBUS). The answer stops at that safe point with
    the refusal naming the file, no step after it, and the plan says so."""
    size = (model_folder / "model.onnx.data").stat().st_size

    def said(data):
        return (f"{data}: truncated since the model was loaded: it has {size - 4} bytes of the {size} its initializers "
                "take; load the model again")

    _a_re_plan_refused_by_a_data_file_stops_the_answer(model_folder, tmp_path, lambda data: os.truncate(data, size - 4),
                                                       said, "cut short")


def test_a_re_plan_the_trials_ask_for_refused_on_a_data_file_written_in_place_stops_the_answer(model_folder,
                                                                                                tmp_path):
    """The trials' re-plan, refused since a data file was written to in place after the load (its first check: the
    mapping shows the new bytes), said "decode goes on with" the plan in force, and the rest of the answer came from
    the changed weights, which the next answer's first check refuses. The answer stops at that safe point with the
    refusal naming the file, no step after it, and the plan says so."""
    def written(data):
        with open(data, "r+b") as file:
            file.write(b"\0")
        stamp = data.stat()
        os.utime(data, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1_000_000))  # past the timestamps' granularity

    def said(data):
        return f"{data}: changed since the model was loaded (written to in place); load the model again"

    _a_re_plan_refused_by_a_data_file_stops_the_answer(model_folder, tmp_path, written, said, "written to in place")


def test_a_failed_re_plans_check_of_the_data_files_reads_each_size_once(model_folder, monkeypatch):
    """What stopped a failed re-plan's answer (_file_refusal) read each mapped data file's size twice: once for a file
    cut short (mmap.size, a check since removed), then again with the file's time (check_mapped_files, fstat). The one
    fstat a file tells both, the refusal saying which."""
    _model, engine = half_budget_engine(model_folder)
    source = engine.host_cache.source
    fstat, reads = os.fstat, []
    monkeypatch.setattr(os, "fstat", lambda fd: (reads.append(fd), fstat(fd))[1])
    assert engine._file_refusal() == (None, None)
    assert len(reads) == len(source._maps) == 1


def test_the_trials_time_a_step_with_the_accounts_it_left_for_its_safe_point(model_folder, monkeypatch):
    """A path whose host runs ahead of the GPU (the tier) leaves its layers' accounts to the step's end, where "both"
    takes them within the step: timed without them, the tier looked 1.4 ms a step faster than it decoded (H200,
    Qwen3-30B-A3B-like at 50%, thirty-seventh session) and kept the decode path against a faster "both"."""
    _model, engine = half_budget_engine(model_folder, first=0, settle=0, window=1)
    seen = []
    monkeypatch.setattr(engine.split_trials, "step", lambda seconds, tokens: seen.append(seconds))
    taken = []
    engine.defer(lambda: (time.sleep(0.020), taken.append(1)), lambda: False)  # not ready within the step
    engine.end_step(0.050, 1)
    assert taken == [1] and not engine.deferred
    assert 0.050 + 0.020 <= seen[0] < 0.050 + 0.5
    engine.end_step(0.050, 1)  # nothing left for the safe point: the step's own seconds (no projection: no CPU work)
    assert seen[1] == pytest.approx(0.050, abs=0.015)  # (not the 20 ms account again; room for a busy machine)


def test_on_the_simulated_device_the_trials_compare_the_cards_projected_step_times(model_folder, monkeypatch):
    _model, engine = half_budget_engine(model_folder, first=0, settle=0, window=1)
    seen = []
    monkeypatch.setattr(engine.split_trials, "step", lambda seconds, tokens: seen.append(seconds))
    decode = engine.stats.phases["decode"]
    engine.end_step(0.050, 1)  # the first safe point: no totals to difference yet, the wall time
    decode.cpu_s += 0.010      # this step: the CPU's experts 10 ms, the stand-in's 20 ms, the card's path 4 ms
    decode.standin_s += 0.020
    decode.critical_s += 0.004
    engine.end_step(0.050, 1)
    assert seen == [pytest.approx(0.050, abs=1e-3), pytest.approx(0.050 - 0.010 - 0.020 + 0.004, abs=1e-3)]


def test_a_layer_split_whose_re_plan_fails_reads_as_the_split_its_layers_run(copy_fixture):
    """set_layer_split set the split before re-planning: where the re-plan failed (here a data file written to since
    the load), the plan stayed spread while the split read "whole", as the sweep's putting back of a model's own split
    left it. The split and its trials read as they were, what the layers run."""
    import os

    from engine.errors import ModelFileError
    from engine.offload.layer_split import WHOLE

    folder = copy_fixture("gptoss")
    budget = int(0.5 * device_expert_bytes(folder))
    model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=budget), device=SimulatedDevice(1 << 30),
                             layer_split="spread")
    engine = model.offload
    trials, slots = engine.split_trials, [layer.num_slots for layer in engine.slots]
    data = folder / "model.onnx.data"
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 1_000_000_000))
    with pytest.raises(ModelFileError, match="changed since the model was loaded"):
        engine.set_layer_split(WHOLE)
    assert (engine.layer_split_mode, engine.whole_layers, engine.split_trials) == ("spread", False, trials)
    assert [layer.num_slots for layer in engine.slots] == slots
