"""The projection of a simulated-device run onto the simulated card (engine/offload/projection.py)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.generation import GenerationParams, LoadedModel
from engine.offload import OffloadConfig, SimulatedDevice
from engine.offload.devices import Bandwidths
from engine.offload.miss_policy import MissCosts
from engine.offload.planner import all_resident_bytes
from engine.offload.projection import layer_critical_s, project_run, projected_seconds, saving_s
from engine.offload.stats import LayerStats
from engine.records.scenarios import run_scenario
from tests.conftest import fixture_folder


def test_layer_critical_path_by_hand():
    assert layer_critical_s(0.25) == 0.25                                       # no device work: the CPU's time
    assert layer_critical_s(0.25, resident_s=0.5) == 0.5                        # the CPU waits for the device
    assert layer_critical_s(1.0, 0.5, miss_copy_s=0.25, miss_device_s=0.125) == 1.0
    # copies (0.75 on the copy stream) outlast the residents (0.5); the copied experts run after both
    assert layer_critical_s(0.25, 0.5, miss_copy_s=0.75, miss_device_s=0.125) == 0.875
    # prefill waves, serial: t = max(0 + 0.125, 0.5) + 0.25 = 0.75; t = max(0.75 + 0.5, 0.75) + 0.125 = 1.375
    assert layer_critical_s(0.5, 0.5, waves=[(0.125, 0.25), (0.5, 0.125)]) == 1.375 + 0.5


def test_critical_path_is_the_miss_policys_step_model():
    costs = MissCosts(cpu_s=np.array([0.3, 0.2, 0.1]), copy_s=0.05, device_s=0.01, resident_s=0.04)
    for mask in ([False] * 3, [True, False, False], [True, True, False], [True] * 3):
        mask = np.array(mask)
        m = int(mask.sum())
        cpu = float(costs.cpu_s[~mask].sum())
        if m:  # as the hybrid node passes a decode step with copies: one launch, residents and copies, after them
            critical = layer_critical_s(cpu, miss_copy_s=m * costs.copy_s,
                                        miss_device_s=costs.resident_s + m * costs.device_s)
        else:
            critical = layer_critical_s(cpu, costs.resident_s)
        assert critical == pytest.approx(costs.step_seconds(mask), abs=1e-15)


def test_projection_on_hand_made_layer_stats():
    layers = [LayerStats(cpu_s=2.0, standin_s=3.0, critical_s=2.5), LayerStats(cpu_s=1.0, critical_s=1.0)]
    assert saving_s(layers) == 2.5                                  # (3 + 2 − 2.5) + (0 + 1 − 1)
    assert projected_seconds(10.0, layers) == 7.5
    assert projected_seconds(1.0, layers) == 0.0                    # never negative
    decode = LayerStats(cpu_s=1.0, standin_s=2.0, critical_s=0.5)   # saves 2.5 of 4 s
    prefill = LayerStats(cpu_s=0.5, standin_s=0.5, critical_s=0.25)  # saves 0.75 of 1 s
    block = project_run(Bandwidths(pcie=10e9, hbm=500e9), completion_s=6.0, all_layers=[decode, prefill],
                        prefill_s=1.0, prefill_layers=[prefill], decode_s=4.0, decoded_tokens=6, decode_layers=[decode])
    assert block["decode_tokens_per_s"] == 6 / 1.5 and block["prefill_s"] == 0.25
    assert block["completion_s"] == 6.0 - 2.5 - 0.75
    assert block["bandwidths"] == {"pcie_bytes_per_s": 10e9, "hbm_bytes_per_s": 500e9}


def test_chat_statistics_line_states_the_projection():
    pytest.importorskip("PySide6")  # (the file is collected on the GPU machine too, which has no Qt)
    from app.gui.chat_panel import stats_line

    timings = {"time_to_first_token_s": 0.1, "decode_tokens_per_s": 50.0, "total_s": 1.0, "generated_tokens": 9,
               "prompt_tokens": 4}
    assert "projected" not in stats_line({"timings": timings, "finish_reason": "eos"})
    line = stats_line({"timings": dict(timings, projected_decode_tokens_per_s=123.4), "finish_reason": "eos"})
    assert "50.0 tok/s" in line and " · projected on the simulated card: 123.4 tok/s · " in line


@pytest.fixture(scope="module")
def fast_card():
    """The gptoss fixture on a simulated card with (nearly) free copies and device reads."""
    device = SimulatedDevice(1 << 30, bandwidths=Bandwidths(pcie=1e15, hbm=1e15))
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(device_expert_bytes=0), device=device)
    def phases():
        return {k: (v.cpu_s, v.standin_s, v.critical_s) for k, v in model.offload.stats.phases.items()}

    runs = {}
    for name, budget in (("none", 0), ("all", all_resident_bytes(model.offload.infos))):
        model.offload.reconfigure(model.offload.config.updated(device_expert_bytes=budget))
        before = phases()
        record = run_scenario(model, "short", GenerationParams(max_new_tokens=8), device)
        # the run's own: the model's statistics are running totals (a measured run adds to them)
        runs[name] = (record, {k: tuple(a - b for a, b in zip(after, before.get(k, (0.0, 0.0, 0.0))))
                               for k, after in phases().items()})
    return device, runs


def test_standin_time_is_measured_only_with_resident_experts(fast_card):
    _device, runs = fast_card
    (none, none_phases), (every, _) = runs["none"], runs["all"]
    assert all(layer["hits"] == 0 for layer in none.layers)
    assert all(layer["standin_s"] > 0 and layer["misses"] == 0 for layer in every.layers)
    # budget 0: no decode step computes on the device (the prefill may still stream cold experts in waves,
    # which the card computes too: their stand-in time is counted, with the layers' copies)
    cpu, standin, critical = none_phases["decode"]
    assert standin == 0 and critical == pytest.approx(cpu) and cpu > 0
    assert all(layer["standin_s"] == 0 or layer["copy_bytes"] > 0 for layer in none.layers)
    assert none.timings["projected"]["decode_tokens_per_s"] == pytest.approx(none.timings["decode_tokens_per_s"])


def test_projection_goes_the_real_gpus_way(fast_card):
    """With nearly free device reads and copies, all resident must project faster than none resident. Compared on
    each run's own components (no wall time of one run against another's): the card's expert time per decode
    step, and at 100% the projection against the same run's measurement."""
    _device, runs = fast_card
    (none, none_phases), (every, every_phases) = runs["none"], runs["all"]
    steps = {name: max(1, sum(max(0, t["generated_tokens"] - 1) for t in record.turns))
             for name, record in (("none", none), ("all", every))}
    cpu0, standin0, critical0 = none_phases["decode"]
    cpu1, standin1, critical1 = every_phases["decode"]
    assert standin0 == 0 and cpu1 == 0 and standin1 > 0 and cpu0 > 0
    assert critical1 / steps["all"] < critical0 / steps["none"]  # the card's expert time per step
    assert critical1 < standin1 / 100                            # modelled device reads at 1 PB/s: next to nothing
    # the same run: its CPU stand-in replaced by the card's (tiny) device time projects faster than measured
    projected = every.timings["projected"]
    assert projected["decode_tokens_per_s"] > every.timings["decode_tokens_per_s"]
    assert projected["completion_s"] < every.timings["completion_s"]
    # and with the host overhead of the 100% run, the 0% run's expert time would be slower than the projection
    host = every.turns[0]["timings"]["decode_s"] - standin1 - cpu1
    assert host + critical1 <= host + critical0 * steps["all"] / steps["none"]
    assert projected["bandwidths"] == {"pcie_bytes_per_s": 1e15, "hbm_bytes_per_s": 1e15}


def test_the_agreement_meters_exact_routing_passes_add_nothing_to_the_projection():
    """Under approximate routing the agreement meter runs the answer's steps again with exact routing, a shadow pass no
    timing counts (agreement_s is left out of them). Its stand-in, CPU and critical-path seconds still went into the
    phase totals that the projection takes out of those timings, so the projected times came out short. The phases
    now count the answer's own steps alone, as the layers' statistics do."""
    from engine.generation import generate

    folder = fixture_folder("gptoss")
    config = OffloadConfig(device_expert_bytes=200_000, min_expert_weight=0.3)
    model = LoadedModel.open(folder, offload=config, device=SimulatedDevice(64 << 20))
    result = generate(model, model.new_state(), [], model.tokenizer.encode("Approximate routing on"),
                      GenerationParams(max_new_tokens=8))
    assert result.routing_agreement is not None and result.timings.agreement_s > 0  # the shadow passes ran
    stats = model.offload.stats
    for key in ("cpu_s", "standin_s", "critical_s"):
        phases = sum(getattr(phase, key) for phase in stats.phases.values())
        assert phases == pytest.approx(sum(getattr(layer, key) for layer in stats.layers), rel=1e-9), key
