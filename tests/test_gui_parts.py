"""The window's parts that need no engine run: estimates, contention rules, NVML sampling (with a
stand-in NVML), byte parsing, the .desktop file and the icon."""

from __future__ import annotations

import configparser
import itertools
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pytestqt")

from app.gui.contention import ThroughputWatch, sample_warnings  # noqa: E402
from app.gui.estimate import DeviceChoice, estimate, layer_summary, model_facts  # noqa: E402
from app.gui.widgets import parse_bytes  # noqa: E402
from app.inspect_report import inspection  # noqa: E402
from engine.model_folder import ModelFolder  # noqa: E402
from engine.offload import OffloadConfig  # noqa: E402
from engine.offload.planner import all_resident_bytes  # noqa: E402
from engine.units import human_bytes  # noqa: E402
from tests.conftest import REPO, fixture_folder  # noqa: E402


@pytest.fixture(scope="module")
def gptoss():
    folder = ModelFolder.open(fixture_folder("gptoss"))
    return model_facts(folder, inspection(folder))


def warned(sample: dict, on_gpu: bool = True) -> list[str]:
    """The contention banner's sentences for one telemetry sample, in its order."""
    return list(sample_warnings(sample, on_gpu).values())


def test_kv_cache_estimate_from_the_graph(gptoss):
    # gpt-oss fixture: layer 0 sliding (window 64), layer 1 full; 2 kv heads x head size 32, fp32, key + value
    per_token = 2 * 2 * 32 * 4
    assert gptoss.kv_bytes_per_token == per_token and gptoss.kv_window_bytes_per_token == per_token
    # the full layer's buffer as it may grow (1,536 rows for 1,000 tokens), the sliding one at its whole window
    assert gptoss.kv_cache_bytes(1000) == per_token * 1536 + per_token * 64
    assert gptoss.kv_cache_bytes(10) == per_token * 256 + per_token * 64
    assert gptoss.kv_words(1000) == "1000 tokens (its buffers may grow to 1536 rows: they double)"
    assert gptoss.kv_words(256) == "256 tokens" and gptoss.kv_words() == "2048 tokens"  # (the context: 2,048)
    lfm = ModelFolder.open(fixture_folder("lfm2moe"))
    facts = model_facts(lfm, inspection(lfm))
    assert facts.state_bytes == 2 * 2 * 128 * 2 * 4  # two conv states of two buffers each, fixed whatever the context


@pytest.mark.parametrize("name", ["gptoss", "lfm2moe", "qwen35moe"])
def test_the_kv_cache_and_state_estimate_is_what_the_decoder_state_holds_at_full_context(name):
    """Conv and recurrent state take two buffers each (a step reads one and writes the other): the estimate, the
    model summary and the landed sentence counted one."""
    from engine.decoder_state import DecoderState

    folder = ModelFolder.open(fixture_folder(name))
    facts = model_facts(folder, inspection(folder))
    state = DecoderState(folder.config, folder.onnx.proto.graph)
    state.reserve(folder.config.context_length)
    held = sum(slot.array.nbytes + (0 if slot.spare is None else slot.spare.nbytes) for slot in state.slots)
    host = {p.key: p.bytes for p in estimate(facts, OffloadConfig(), DeviceChoice()).host_parts}
    assert host["kv"] == facts.kv_cache_bytes() == held


@pytest.mark.parametrize("name", ["gptoss", "qwen35moe"])
def test_the_kv_estimate_below_the_context_is_the_most_the_decoder_state_holds_for_that_many_tokens(name):
    """The KV buffers grow to at least twice what they held: a 768-token prompt and one token more take 1,536 rows
    for 769 tokens. The estimate for a length counted the tokens alone, and the engine went up to ~2x past it."""
    from engine.decoder_state import DecoderState

    folder = ModelFolder.open(fixture_folder(name))
    facts = model_facts(folder, inspection(folder))
    rng = np.random.default_rng(3)
    paths = [[768, 1], [1000], [1, 1, 1]] + [rng.integers(1, 300, 6).tolist() for _ in range(20)]
    for steps in paths:
        state = DecoderState(folder.config, folder.onnx.proto.graph)
        most = 0
        for new in steps:
            state.reserve(new)
            state.past_length += new
            most = max(most, sum(slot.array.nbytes + (0 if slot.spare is None else slot.spare.nbytes)
                                 for slot in state.slots))
            assert most <= facts.kv_cache_bytes(state.past_length), (steps, state.past_length)
        if steps == [768, 1]:  # the worst path for 769 tokens: the estimate is what it holds, not less
            assert most == facts.kv_cache_bytes(769)


def test_estimate_follows_the_planner(gptoss):
    slot = gptoss.experts[0].device_bytes_per_expert  # one expert in a device slot (the GPU kernels' layout)
    config = OffloadConfig(device_expert_bytes=5 * slot)
    est = estimate(gptoss, config, DeviceChoice("simulated", 1 << 30))
    assert est.resident == 5 and est.total_experts == 16 and not est.error
    assert [r for _l, _n, r, _e in est.per_layer] == [3, 2]
    # a slot holds more than the stored expert the model panel lists (31.5 KiB): said, so the sums reconcile
    assert est.device_parts[0].note == "5 experts, 34.5 KiB a slot: the GPU kernels' layout of 31.5 KiB stored"
    parts = {p.key: p.bytes for p in est.device_parts}
    assert parts["experts"] == 5 * slot and parts["dense"] == 0 and parts["kv"] == 0
    assert parts["workspace"] == est.staging_bytes > 0
    assert sum(parts.values()) == 1 << 30  # the parts add up to the device
    limited = estimate(gptoss, config.updated(gpu_device_mem_limit=1 << 20), DeviceChoice("simulated", 1 << 30))
    assert limited.ceiling == 1 << 20 and {p.key for p in limited.device_parts} >= {"limit"}
    assert estimate(gptoss, config, DeviceChoice("cpu")).resident == 0
    refused = estimate(gptoss, config.updated(mode="required"), DeviceChoice("cpu"))
    # said in the window, which has no --device
    assert refused.error == "offload mode 'required' needs a GPU device (a simulated GPU or the CUDA GPU)"
    # an unusable GPU: the engine runs every expert on the CPU in modes auto and disabled, and refuses under required
    unusable = estimate(gptoss, config, DeviceChoice("cuda", error="no CUDA device"))
    assert not unusable.error and unusable.resident == 0 and unusable.device_parts == []
    assert unusable.statements[0] == "The CUDA GPU cannot be used (no CUDA device): every expert would run on the CPU."
    required = estimate(gptoss, config.updated(mode="required"), DeviceChoice("cuda", error="no CUDA device"))
    assert required.error == "no CUDA device" and required.resident == 0
    assert layer_summary(est.per_layer) == "layer 0: 3 of 8; layer 1: 2 of 8"
    # with the slots each layer leaves to copied misses: its resident experts and those slots apart
    assert layer_summary(est.per_layer, [1, 0]) == \
        "layer 0: 3 of 8 (2 resident experts, 1 left for copied misses); layer 1: 2 of 8"
    assert layer_summary(est.per_layer[:1] * 2, [2, 2]) == \
        "3 of 8 in every layer (2 layers): 1 resident expert, 2 left for copied misses"


def test_estimate_puts_the_dense_part_where_the_engine_would(gptoss, monkeypatch):
    import dataclasses

    from engine import ort_env

    config = OffloadConfig(device_expert_bytes=0)
    card = DeviceChoice("cuda", 1 << 30, name="test card")
    monkeypatch.setattr(ort_env, "cuda_ep_missing_reason",
                        lambda: "onnxruntime here is the CPU build (`make install` ...)")
    cpu_build = estimate(gptoss, config, card)
    assert {p.key: p.bytes for p in cpu_build.device_parts}["dense"] == 0
    assert "The dense part would run on the CPU: onnxruntime here is the CPU build" in " ".join(cpu_build.statements)
    monkeypatch.setattr(ort_env, "cuda_ep_missing_reason", lambda: None)  # as with onnxruntime-gpu
    # the fixtures' KV caches are fp32: GroupQueryAttention on CUDA is fp16/bf16
    fp32_kv = estimate(gptoss, config, card)
    assert gptoss.kv_dtypes == frozenset({np.dtype(np.float32)})
    assert "KV cache is fp32" in " ".join(fp32_kv.statements)
    fp16 = dataclasses.replace(gptoss, kv_dtypes=frozenset({np.dtype(np.float16)}))
    on_gpu = estimate(fp16, config, card)
    device = {p.key: p.bytes for p in on_gpu.device_parts}
    host = {p.key: p.bytes for p in on_gpu.host_parts}
    assert device["dense"] == fp16.dense_bytes and device["kv"] == fp16.kv_cache_bytes()
    assert host["dense"] == 0 and host["kv"] == 0
    assert sum(device.values()) == 1 << 30  # the parts still add up to the card
    simulated = estimate(fp16, config, DeviceChoice("simulated", 1 << 30))
    assert "The dense part would run on the CPU: the GPU is simulated" in " ".join(simulated.statements)


def test_the_estimate_makes_no_host_tier_where_the_dense_part_runs_on_the_cpu(gptoss, monkeypatch):
    """As the engine: a CUDA card whose dense part runs on the CPU gets no host tier (decode's inputs never sit in GPU
    memory), its slots no tier mappings, and the estimate says why; the streaming slots device_working_bytes asks for
    are made for the decode steps that copy misses into them. With the dense part on the card the tier is made."""
    import dataclasses

    from engine import ort_env

    config = OffloadConfig(device_expert_bytes=0, device_working_bytes=1 << 20)
    card = DeviceChoice("cuda", 1 << 30, name="test card")
    monkeypatch.setattr(ort_env, "cuda_ep_missing_reason", lambda: "onnxruntime here is the CPU build")
    est = estimate(gptoss, config, card, decode_path="tier")
    assert not est.error and not est.host_tier
    assert ("Cold experts are computed on the CPU: no host tier is made, since the dense part runs on the CPU "
            "(onnxruntime here is the CPU build), so decode's expert inputs never sit in GPU memory and no decode step "
            "could read the tier.") in est.statements, est.statements
    parts = {p.key: p for p in est.device_parts}
    assert parts["experts"].bytes == 0 and "decode streaming slots" in parts["workspace"].note
    monkeypatch.setattr(ort_env, "cuda_ep_missing_reason", lambda: None)  # as with onnxruntime-gpu
    fp16 = dataclasses.replace(gptoss, kv_dtypes=frozenset({np.dtype(np.float16)}))
    on_gpu = estimate(fp16, config, card, decode_path="tier")
    parts = {p.key: p for p in on_gpu.device_parts}
    assert on_gpu.host_tier and parts["experts"].bytes > 0 and "decode streaming slots" not in parts["workspace"].note


def test_the_estimate_plans_the_host_tier_away_where_the_arena_keeps_the_dense_part_on_the_cpu(gptoss, monkeypatch):
    """As the engine, which plans again once onnxruntime's arena did not fit beside the plan and the dense part stayed
    on the CPU (OffloadEngine.dense_landed): no host tier, its reason said, the streaming slots made. Here the arena a
    model loaded earlier registered (stood in: ort_env._shared_arenas) is more than gpu_device_mem_limit leaves."""
    from engine import ort_env

    monkeypatch.setattr(ort_env, "cuda_ep_missing_reason", lambda: None)  # as with onnxruntime-gpu
    monkeypatch.setattr(ort_env, "kv_dtype_reason", lambda kv_dtypes: None)  # (the fixture's KV caches are fp32)
    monkeypatch.setattr(ort_env, "_shared_arenas", {0: 200 << 20})
    config = OffloadConfig(device_expert_bytes=0, device_working_bytes=1 << 20, gpu_device_mem_limit=128 << 20)
    est = estimate(gptoss, config, DeviceChoice("cuda", 1 << 30, name="test card"), decode_path="tier")
    stay = "Loaded with these settings, the dense part would stay on the CPU: "
    stays = [s for s in est.statements if s.startswith(stay)]
    assert not est.error and len(stays) == 1 and not est.host_tier, est.statements
    at_load = stays[0].removeprefix(stay)[:-1]
    assert (f"Cold experts are computed on the CPU: no host tier is made, since the dense part runs on the CPU "
            f"({at_load}), so decode's expert inputs never sit in GPU memory and no decode step could read the "
            "tier.") in est.statements, est.statements
    parts = {p.key: p for p in est.device_parts}
    assert parts["experts"].bytes == 0 and "decode streaming slots" in parts["workspace"].note


def test_the_estimate_keeps_the_dense_part_on_the_card_without_the_tier_where_only_its_mappings_left_the_arena_short(
        gptoss, monkeypatch):
    """As the engine, which tries the card again once the plan without the tier left onnxruntime's arena the room the
    tier's device mappings took (OffloadEngine.dense_landed): the estimate said the dense part would stay on the CPU.
    Here the mappings (a 2 MiB granule for each of the 16 slot arrays) leave 80 MiB too little for the arena; the slots
    alone, none under device_expert_bytes=0, leave enough."""
    from engine import ort_env

    monkeypatch.setattr(ort_env, "cuda_ep_missing_reason", lambda: None)  # as with onnxruntime-gpu
    monkeypatch.setattr(ort_env, "kv_dtype_reason", lambda kv_dtypes: None)  # (the fixture's KV caches are fp32)
    config = OffloadConfig(device_expert_bytes=0, gpu_device_mem_limit=80 << 20)
    est = estimate(gptoss, config, DeviceChoice("cuda", 1 << 30, name="test card"), decode_path="tier")
    no_tier = [s for s in est.statements if "no host tier is made" in s]
    assert not est.error and not est.host_tier and no_tier == [
        "Cold experts are computed on the CPU: no host tier is made, since onnxruntime's arena for the dense part fits "
        f"on the card beside the expert slots but not beside the tier's device mappings (gpu_device_mem_limit="
        f"{80 << 20} leaves 47.5 MiB after the expert slots and staging; the KV cache and state at their longest (1.5 "
        "MiB), the dense weights (618.9 KiB) and onnxruntime's workspace (64.0 MiB at least) need more (raise "
        "reserve_device_bytes or lower device_expert_bytes))."], est.statements
    assert est.statements[-1] == ("The dense part would run on the GPU with onnxruntime's CUDA execution provider, its "
                                  "KV cache and state in GPU memory."), est.statements
    device = {p.key: p.bytes for p in est.device_parts}
    assert device["experts"] == 0 and device["dense"] == gptoss.dense_bytes and device["kv"] > 0


def test_the_estimate_runs_every_expert_on_the_cpu_under_offload_disabled_where_the_arena_keeps_the_dense_part_there(
        gptoss, monkeypatch):
    """mode=disabled runs every expert where the dense part runs: where onnxruntime's arena does not fit beside the
    experts under gpu_device_mem_limit, the load keeps the dense part on the CPU and plans every expert there too
    (OffloadEngine.dense_landed). The estimate still showed them all resident on the card beside a dense part on the
    CPU."""
    from engine import ort_env

    monkeypatch.setattr(ort_env, "cuda_ep_missing_reason", lambda: None)  # as with onnxruntime-gpu
    monkeypatch.setattr(ort_env, "kv_dtype_reason", lambda kv_dtypes: None)  # (the fixture's KV caches are fp32)
    config = OffloadConfig(mode="disabled", reserve_device_bytes=0, gpu_device_mem_limit=64 << 20)
    est = estimate(gptoss, config, DeviceChoice("cuda", 1 << 30, name="test card"))
    assert not est.error and est.plan.placement_mode == "cpu_only" and set(est.plan.slots.values()) == {0}
    # the expert budgets do not apply under mode=disabled: the plan's sentence does not say the arena check's hint to
    # raise or lower them, and gives inspect's reason (test_cli); the estimate does not say it again
    at_load = (f"gpu_device_mem_limit={64 << 20} leaves 63.5 MiB after the expert slots and staging; the KV cache and "
               "state at their longest (1.5 MiB), the dense weights (618.9 KiB) and onnxruntime's workspace (64.0 MiB "
               "at least) need more: raise gpu_device_mem_limit, or use mode=auto, which keeps the experts that do not "
               "fit on the CPU")
    assert est.statements == [f"All experts run on the CPU: offload is disabled, and the dense part runs on the CPU "
                              f"({at_load})."]
    assert {p.key: p.note for p in est.device_parts}["dense"] == f"on the CPU: {at_load} (618.9 KiB in host RAM)"
    device = {p.key: p.bytes for p in est.device_parts}
    assert device["experts"] == device["dense"] == device["kv"] == device["workspace"] == 0
    assert device["free"] == 64 << 20


def test_the_estimate_of_a_model_whose_expert_nodes_the_engine_runs_none_of_says_where_the_arena_keeps_the_dense_part(
        gptoss, monkeypatch):
    """With no expert node the engine runs there is no plan, and so nothing for the load to plan again: under
    mode=disabled on a card where onnxruntime's arena would not fit, the estimate re-planned all the same and raised
    AttributeError (its streaming slots None). It says where the dense part would run, as with any other model."""
    from dataclasses import replace

    from engine import ort_env

    monkeypatch.setattr(ort_env, "cuda_ep_missing_reason", lambda: None)  # as with onnxruntime-gpu
    monkeypatch.setattr(ort_env, "kv_dtype_reason", lambda kv_dtypes: None)  # (the fixture's KV caches are fp32)
    facts = replace(gptoss, experts=[replace(info, spec=None, unsupported="a stand-in") for info in gptoss.experts])
    config = OffloadConfig(mode="disabled", reserve_device_bytes=0, gpu_device_mem_limit=64 << 20)
    est = estimate(facts, config, DeviceChoice("cuda", 1 << 30, name="test card"))
    assert not est.error and est.plan is None and est.resident == 0
    assert est.statements == [
        f"Expert node '/model/layers.{layer}/moe/QMoE' (layer {layer}) is left out of the plan: a stand-in; the load "
        "refuses the model while it has this node." for layer in (0, 1)] + [
        "Loaded with these settings, the dense part would stay on the CPU: "
        f"gpu_device_mem_limit={64 << 20} leaves 64.0 MiB after the expert slots and staging; the KV cache and state "
        "at their longest (1.5 MiB), the dense weights (618.9 KiB) and onnxruntime's workspace (64.0 MiB at least) "
        "need more: raise gpu_device_mem_limit, or use mode=auto, which keeps the experts that do not fit on the CPU."]


def test_under_offload_disabled_the_estimate_says_what_lets_the_arena_registered_earlier_fit(gptoss, monkeypatch):
    """mode=disabled, where a model loaded earlier in this process registered onnxruntime's GPU arena (stood in:
    ort_env._shared_arenas) at more than gpu_device_mem_limit leaves it beside every expert: the reason the dense part
    stays on the CPU said "lower device_expert_bytes", a budget mode=disabled does not apply, in both the plan's
    sentence and the dense part's. Under mode=auto the arena check's own hint stays."""
    from engine import ort_env

    monkeypatch.setattr(ort_env, "cuda_ep_missing_reason", lambda: None)  # as with onnxruntime-gpu
    monkeypatch.setattr(ort_env, "kv_dtype_reason", lambda kv_dtypes: None)  # (the fixture's KV caches are fp32)
    monkeypatch.setattr(ort_env, "_shared_arenas", {0: 200 << 20})
    card = DeviceChoice("cuda", 1 << 30, name="test card")
    config = OffloadConfig(mode="disabled", reserve_device_bytes=0, gpu_device_mem_limit=128 << 20)
    est = estimate(gptoss, config, card)

    def arena(left: str, short: str) -> str:
        return ("onnxruntime's GPU arena on device 0 was registered at 200.0 MiB by a model loaded earlier in this "
                "process, and onnxruntime keeps it at that size until the process ends; this model's "
                f"gpu_device_mem_limit={128 << 20} leaves it {left} after the expert slots, staging, state and dense "
                f"weights, {short} short")

    at_load = (arena("125.3 MiB", "74.7 MiB") + ": raise gpu_device_mem_limit, or use mode=auto, which keeps the "
               "experts that do not fit on the CPU, or restart and load this model first")
    assert not est.error and est.plan.placement_mode == "cpu_only", est.statements
    assert est.statements == [f"All experts run on the CPU: offload is disabled, and the dense part runs on the CPU "
                              f"({at_load})."]
    auto = estimate(gptoss, config.updated(mode="auto"), card)
    assert (f"Loaded with these settings, the dense part would stay on the CPU: {arena('124.8 MiB', '75.2 MiB')} "
            "(lower device_expert_bytes, or restart and load this model first).") in auto.statements, auto.statements


def test_the_budget_panel_says_before_a_load_when_the_arena_registered_earlier_keeps_the_dense_part_on_the_cpu(
        qtbot, gptoss, monkeypatch):
    """The CUDA GPU chosen with gpu_device_mem_limit, where a model loaded earlier in this process registered
    onnxruntime's GPU arena (stood in: ort_env._shared_arenas) at more than this configuration's limit leaves it: the
    panel says why the load would keep the dense part on the CPU, and its VRAM legend shows no dense part on the card.
    With an arena the limit can hold, it says the dense part would run on the GPU."""
    from PySide6.QtWidgets import QLabel

    import app.gui.budget_panel as budget_panel
    from engine import ort_env

    def registered(*_args):
        raise AssertionError("the estimate registered an arena")

    monkeypatch.setattr(ort_env, "cuda_ep_missing_reason", lambda: None)  # as with onnxruntime-gpu
    monkeypatch.setattr(ort_env, "kv_dtype_reason", lambda kv_dtypes: None)  # (the fixture's KV caches are fp32)
    monkeypatch.setattr(ort_env, "register_shared_cuda_arena", registered)
    monkeypatch.setattr(budget_panel, "cuda_status", lambda: "")
    arenas = {0: 200 << 20}  # registered at 200 MiB by an earlier model
    monkeypatch.setattr(ort_env, "_shared_arenas", arenas)
    panel = budget_panel.BudgetPanel()
    qtbot.addWidget(panel)
    panel.set_gpu({"total": 1 << 30, "others": 0, "name": "test card"})
    entries = {"device_expert_bytes": str(2 * gptoss.experts[0].device_bytes_per_expert),
               "gpu_device_mem_limit": str(128 << 20)}
    panel.set_facts(gptoss, {"device": {"kind": "cuda"}, "entries": entries})
    shown = QLabel.text(panel.statements)
    assert ("Loaded with these settings, the dense part would stay on the CPU: onnxruntime's GPU arena on device 0 was "
            "registered at 200.0 MiB by a model loaded earlier in this process") in shown
    assert "restart and load this model first" in shown and "would run on the GPU" not in shown
    assert "on the CPU: onnxruntime&#x27;s GPU arena" in panel.vram_legend.text()  # the dense part's row
    arenas[0] = 64 << 20  # one this limit can hold
    panel.refresh()
    assert "The dense part would run on the GPU with onnxruntime's CUDA execution provider" in QLabel.text(
        panel.statements)


def test_the_budget_panel_promises_no_host_tier_the_loaded_models_re_plans_will_not_make(qtbot, gptoss, monkeypatch):
    """Where the load put the dense part on the card without the host tier (the tier's device mappings left
    onnxruntime's arena short: OffloadEngine.arena_over_tier), the engine's re-plans make no tier while the model is
    loaded. The panel's estimate of the settings an Apply re-plans with promised the tier wherever the arena
    registered fits beside its mappings (a smaller budget than the load's, say): its host memory counted it, and its
    sentence said decode reads it. It says now, in the engine's words, that none is made; a change that needs a
    reload, and the model unloaded, estimate the tier as a load makes it."""
    import app.gui.budget_panel as budget_panel
    from engine import ort_env
    from engine.offload.decode_path import tier_beside_arena

    monkeypatch.setattr(ort_env, "cuda_ep_missing_reason", lambda: None)  # as with onnxruntime-gpu
    monkeypatch.setattr(ort_env, "kv_dtype_reason", lambda kv_dtypes: None)  # (the fixture's KV caches are fp32)
    monkeypatch.setattr(budget_panel, "cuda_status", lambda: "")
    monkeypatch.setattr(ort_env, "_shared_arenas", {0: 64 << 20})  # the loaded model's, beside which the tier fits
    panel = budget_panel.BudgetPanel()
    qtbot.addWidget(panel)
    panel.set_gpu({"total": 1 << 30, "others": 0, "name": "test card"})
    entries = {"device_expert_bytes": str(2 * gptoss.experts[0].device_bytes_per_expert),
               "gpu_device_mem_limit": str(256 << 20)}
    settings = {"device": {"kind": "cuda"}, "entries": entries, "decode_path": "tier"}
    panel.set_facts(gptoss, settings)
    panel.mark_loaded(settings)
    tier_made = "Instead, decode reads cold experts on the GPU from a host tier of "

    def tier() -> tuple[bool, list[str], str]:
        est = panel.last_estimate
        said = [s for s in est.statements if "host tier" in s and "device memory" not in s]
        return est.host_tier, said, panel.host_legend.text()

    made, said, legend = tier()
    assert made and said[0].startswith(tier_made) and "host tier" in legend  # (the engine holds no refusal)
    refusal = f"gpu_device_mem_limit={256 << 20} leaves 70.0 MiB after the expert slots and staging; a stand-in"
    panel.set_live_arena_over_tier(refusal)
    made, said, legend = tier()
    assert not made and said == [tier_beside_arena(OffloadConfig.from_entries(entries), refusal)]
    assert "host tier" not in legend
    panel.mem_limit.setValue(512 << 20)  # Apply and reload: a load makes the tier where it fits
    panel.refresh()
    assert panel.needs_reload() == ["gpu_device_mem_limit"] and tier()[0] and tier()[1][0].startswith(tier_made)
    panel.mem_limit.setValue(256 << 20)
    panel.refresh()
    assert not tier()[0]
    panel.mark_loaded(None)  # unloaded: the next load's own tier
    assert tier()[0] and tier()[1][0].startswith(tier_made)


def engine_on(name: str, config: OffloadConfig, choice: DeviceChoice, decode_path: str | None = None):
    """The real offload engine on a simulated device named as the estimate's stand-in."""
    from engine.generation import LoadedModel
    from engine.offload import SimulatedDevice

    device = SimulatedDevice(choice.capacity, mem_limit=config.gpu_device_mem_limit, name=choice.label)
    model = LoadedModel.open(fixture_folder(name), offload=config, device=device, decode_path=decode_path)
    return model.offload, device


@pytest.mark.parametrize("name", ["gptoss", "lfm2moe", "qwen35moe"])
def test_estimate_follows_the_engine_for_pinned_bytes(name):
    folder = ModelFolder.open(fixture_folder(name))
    facts = model_facts(folder, inspection(folder))
    slot = max(info.device_bytes_per_expert for info in facts.experts)
    choice = DeviceChoice("simulated", 1 << 30)
    engine, device = engine_on(name, OffloadConfig(), choice)
    per = max(device.staging_bytes_per_expert(runner) for runner in engine.runners)  # one expert as staged
    waves = set()
    # auto, one expert, just short of two, two, five, and far more than a wave needs
    for pinned in (None, per, 2 * per - 1, 2 * per, 5 * per, 100 * per):
        config = OffloadConfig(device_expert_bytes=5 * slot, pinned_bytes=pinned, prefill_wave_experts=4)
        est = estimate(facts, config, choice)
        engine, device = engine_on(name, config, choice)
        assert not est.error and est.staging.staged_expert_bytes == per
        assert est.staging.pinned_bytes == engine.pinned_info()["bytes"] == device.pinned.capacity
        assert est.staging.wave_experts == engine.wave_experts
        assert est.staging_bytes == device.memory.by_purpose["prefill staging ring"]
        assert [r for _l, _n, r, _e in est.per_layer] == [engine.plan.slots[info.name] for info in engine.infos]
        assert est.statements[:len(engine.plan.statements)] == engine.plan.statements  # same sentences, ring included
        parts = {p.key: p.bytes for p in est.host_parts}
        assert parts["pinned"] == engine.pinned_info()["bytes"]
        waves.add(est.staging.wave_experts)
        if pinned is None:
            assert est.staging.pinned_bytes == 2 * 4 * per and est.staging.wave_experts == 4
        else:  # an explicit ring bounds the wave: pinned // (2 x expert), at least one
            assert est.staging.pinned_bytes == pinned
            assert est.staging.wave_experts == min(4, max(1, pinned // (2 * per)))
    assert waves == {1, 2, 4}

    # below one expert: the engine refuses, and the estimate says the engine's own words
    config = OffloadConfig(device_expert_bytes=5 * slot, pinned_bytes=per - 1)
    est = estimate(facts, config, choice)
    with pytest.raises(Exception) as refused:
        engine_on(name, config, choice)
    assert est.error == str(refused.value) and "pinned_bytes" in est.error and str(per) in est.error
    assert est.statements[0] == est.error and est.staging is None and est.resident == 0
    assert "pinned" not in {p.key for p in est.host_parts}
    # without a device (or with offload disabled) there is no ring to refuse
    assert not estimate(facts, config, DeviceChoice("cpu")).error
    assert not estimate(facts, config.updated(mode="disabled"), choice).error


def test_host_memory_estimate_follows_the_host_cache_and_file_backing(gptoss):
    """The experts' host memory as host_expert_bytes and allow_file_backing keep it (the estimate showed the whole
    mapped file whatever they said), and allow_file_backing=0 refused where the engine refuses it."""
    total = gptoss.expert_bytes

    def experts(config):
        return next(p for p in estimate(gptoss, config, DeviceChoice("cpu")).host_parts if p.key == "experts")

    assert experts(OffloadConfig()).bytes == total
    assert experts(OffloadConfig(host_expert_bytes=total // 4)).bytes == total // 4
    in_ram = experts(OffloadConfig(allow_file_backing=False))
    assert in_ram.bytes == total and "allow_file_backing=0" in in_ram.note
    refused = estimate(gptoss, OffloadConfig(allow_file_backing=False, host_expert_bytes=total - 1),
                       DeviceChoice("simulated", 1 << 30))
    assert refused.error == (f"allow_file_backing=0 keeps all {total} bytes of experts in host memory, more than "
                             f"host_expert_bytes={total - 1}")
    assert refused.plan is None and refused.statements[0] == refused.error


def test_the_estimate_says_where_the_experts_mapped_exceed_the_host_memory_available(gptoss, monkeypatch):
    """RAM smaller than the model: the host memory section showed the experts' whole size as the model's, more than the
    machine had, without a word (a run's RSS never gets there: the OS drops pages and reads them back from the file)."""
    import psutil

    total = gptoss.expert_bytes
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": total // 2}))
    said = (f"The experts' {human_bytes(total)} in host memory are more than the {human_bytes(total // 2)} available: "
            "the OS keeps what fits and reads the rest back from the model file as routing needs them, slower than "
            "from RAM (host_expert_bytes bounds what stays mapped).")
    assert said in estimate(gptoss, OffloadConfig(), DeviceChoice("cpu")).statements
    assert said in estimate(gptoss, OffloadConfig(), DeviceChoice("simulated", 1 << 30)).statements
    bounded = estimate(gptoss, OffloadConfig(host_expert_bytes=total // 4), DeviceChoice("cpu")).statements
    assert not any("more than the" in line for line in bounded)


def test_without_file_backing_the_estimate_counts_the_loaded_models_copy_as_available(gptoss, monkeypatch):
    """allow_file_backing=0 needs host memory for the copy; a loaded model's experts already copied need none again
    (as OffloadEngine._check_file_backing counts them), or a model larger than what is left could change no setting."""
    import psutil

    total = gptoss.expert_bytes
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": total // 2}))
    config = OffloadConfig(allow_file_backing=False)
    assert estimate(gptoss, config, DeviceChoice("cpu")).error == (
        f"allow_file_backing=0 keeps all {total} bytes of experts in host memory, more than the {total // 2} bytes of "
        "host memory available")
    assert not estimate(gptoss, config, DeviceChoice("cpu"), experts_in_ram=total).error


def test_contention_rules():
    calm = {"cpu_per_core": [50.0] * 8, "others_cpu_cores": 0.4, "ram_total": 100, "ram_available": 50, "gpu": None}
    assert warned(calm) == []
    busy = dict(calm, others_cpu_cores=2.5, top_cpu=[{"name": "python indexer.py", "cores": 2.4}])
    # what competes, how much, and what to do: the CPU's and the card's said nothing of the last
    assert warned(busy) == ["Other processes use 2.5 of 8 CPU cores: python indexer.py (2.4 cores)."
                            " The CPU expert kernels run on the cores they leave: pausing them speeds the answer."]
    full = dict(calm, ram_total=100 << 30, ram_available=5 << 30, ram_this=10 << 30, ram_others=85 << 30,
                top_ram=[{"name": "firefox", "rss": 3 << 30}])
    # (it said "other processes hold 85.0 GiB", the kernel's memory in it, where the graph says "other processes and
    # the kernel" of the same number)
    assert warned(full) == ["Host memory is nearly full (5.0 GiB of 100.0 GiB available; this process holds "
                            "10.0 GiB): other processes and the kernel hold 85.0 GiB, the largest firefox (3.0 GiB)."]
    stolen = dict(calm, cpu_steal_share=0.25)
    assert warned(stolen) == ["This virtual machine's host gives 25% of its CPU time to other guests (steal "
                                    "time): the CPU's expert kernels run slower and less evenly."]
    assert warned(dict(calm, cpu_steal_share=0.05)) == []
    gpu = dict(calm, gpu={"total": 80 << 30, "listed": 20 << 30, "top": [{"name": "blender", "bytes": 20 << 30}]})
    assert warned(gpu) == ["Other processes hold 20.0 GiB of the GPU's 80.0 GiB: blender (20.0 GiB). Memory they free "
                           "leaves room for more resident experts (device_expert_bytes)."]
    # a driver that hides per-process memory (a container): NVML's "others" is all in use, this process's included
    hidden = dict(calm, gpu={"total": 80 << 30, "used": 40 << 30, "this": 0, "others": 40 << 30, "top": [],
                             "per_process": False})
    assert warned(hidden) == []
    watch = ThroughputWatch()
    for rate in (1, 10, 10, 10, 10, 10, 6, 6, 6, 6, 6):
        watch.add(rate * 1e9)
    assert watch.baseline == 10e9 and watch.current == 6e9 and watch.warning() == ""  # 60%: not clearly below


def test_a_one_sample_spike_raises_no_warning_and_a_competitor_between_its_jobs_does():
    """A process on the cores for one second (a browser's tab opening) raised the banner, which then stayed for the
    three calm samples after: four seconds of warning about nothing that lasted. A build that takes the cores one
    second in two is still said, at its second busy sample, and one busy before the answer began at the answer's
    first; host memory's warning, like the CPU's, waits for two."""
    from app.gui.contention import WarningHold

    calm = {"cpu_per_core": [50.0] * 2, "others_cpu_cores": 0.1, "ram_total": 100, "ram_available": 50, "gpu": None}
    busy = dict(calm, others_cpu_cores=1.2, top_cpu=[{"name": "firefox", "cores": 1.1}])
    hold = WarningHold()
    assert [hold.update(sample_warnings(s)) for s in (calm, busy, calm, calm, calm)] == [[]] * 5
    said = ["Other processes use 1.2 of 2 CPU cores: firefox (1.1 cores)."
            " The CPU expert kernels run on the cores they leave: pausing them speeds the answer."]
    assert [hold.update(sample_warnings(s)) for s in (busy, calm, busy, calm)] == [[], [], said, said]
    hold.reset()  # a new answer; the competitor was busy the second before it began, between answers
    hold.note(sample_warnings(busy))
    assert hold.update(sample_warnings(busy)) == said
    hold = WarningHold()
    full = dict(calm, ram_available=5)
    assert [len(hold.update(sample_warnings(full))) for _ in range(2)] == [0, 1]
    hold.reset()  # the throughput's warning is a median of readings already: said at once
    assert hold.update({"throughput": "CPU expert throughput fell."}) == ["CPU expert throughput fell."]


def test_a_cpu_competitor_is_named_with_its_cores_and_its_memory():
    """'Other processes use 2.5 of 8 CPU cores: python indexer.py (240%)': a percentage beside a count of cores (of
    one core? of all?), and nothing of the memory the competitor holds, which the walk of processes had measured."""
    busy = {"cpu_per_core": [50.0] * 8, "others_cpu_cores": 2.5, "ram_total": 100, "ram_available": 50, "gpu": None,
            "top_cpu": [{"name": "python indexer.py", "cores": 2.4, "rss": 3 << 29},
                        {"name": "make and 3 processes it started", "cores": 0.06, "rss": 0}]}
    assert warned(busy) == ["Other processes use 2.5 of 8 CPU cores: python indexer.py (2.4 cores, 1.5 GiB "
                                  "resident), make and 3 processes it started (0.1 cores). The CPU expert kernels run "
                                  "on the cores they leave: pausing them speeds the answer."]


def test_a_workbench_pinned_to_one_core_is_said_to_run_on_one_core_not_one_cores():
    """taskset -c 3 beside a build: 'Other processes use 0.9 of the 1 CPU cores this process may run on (of 8)'."""
    pinned = {"cpu_per_core": [100.0] * 8, "cpu_ours": [3], "others_cpu_cores": 0.9, "ram_total": 100,
              "ram_available": 50, "gpu": None}
    assert warned(pinned)[0].startswith("Other processes use 0.9 of the 1 CPU core this process may run on (of 8). ")
    alone = dict(pinned, cpu_per_core=[100.0], cpu_ours=[0])  # (a one-core machine)
    assert warned(alone)[0].startswith("Other processes use 0.9 of 1 CPU core. ")


def test_the_throughput_watch_measures_against_its_best_not_a_cold_start():
    """The first measurements after a load can be cold (the experts' pages still being mapped in): 4 GB/s, then 10
    once warm. A competitor that cut the warm rate to 40% later (4 GB/s) read as 100% of that cold start, unsaid."""
    watch = ThroughputWatch()
    for rate in (1, 4, 4, 4, 4, 4) + (10,) * 5 + (4,) * 5:
        watch.add(rate * 1e9)
    assert watch.baseline == 10e9 and watch.current == 4e9
    assert watch.warning() == ("CPU expert throughput fell to 4.00 GB/s from its usual 10.00 GB/s (40%): something "
                               "competes for memory bandwidth.")


def test_a_fast_spell_does_not_make_later_normal_speed_read_as_a_drop():
    """The level was the best rate since the load until an Apply: a spell at 25 GB/s (the same few experts, warm in
    the caches) made the 10 GB/s after it read as 'fell to 10.00 GB/s from 25.00 GB/s (40%)'. The level is the upper
    quartile of a window of measurements: a competitor after the spell is said against 10, and one that stays becomes
    the level once it fills three quarters of the window."""
    watch = ThroughputWatch()
    for rate in (1,) + (10,) * 40 + (25,) * 10 + (10,) * 5:
        watch.add(rate * 1e9)
    assert watch.current == 10e9 and watch.baseline == 10e9 and watch.warning() == ""
    for rate in (4,) * 5:
        watch.add(rate * 1e9)
    assert watch.warning().startswith("CPU expert throughput fell to 4.00 GB/s from its usual 10.00 GB/s (40%)")
    lasting = ThroughputWatch(window=40)
    for rate in (1,) + (10,) * 40 + (4,) * 20:
        lasting.add(rate * 1e9)
    assert lasting.baseline == 10e9 and lasting.warning()  # half the window: still a drop
    for rate in (4,) * 20:
        lasting.add(rate * 1e9)
    assert lasting.baseline == 4e9 and lasting.warning() == ""  # the whole window: what this machine gives now


def test_a_throughput_drop_while_other_processes_take_the_cores_is_not_blamed_on_memory_bandwidth():
    """The kernels' rate is of their wall time: other processes on their cores (or the automatic thread count giving
    way to them) slow it as much as a bandwidth thief. The banner said 'Other processes use 6.0 of 8 CPU cores' and
    then 'CPU expert throughput fell ...: something competes for memory bandwidth', a second, wrong cause."""
    from app.gui.contention import cpu_taken

    watch = ThroughputWatch()
    for rate in (1,) + (10,) * 5 + (4,) * 5:
        watch.add(rate * 1e9)
    calm = {"cpu_per_core": [50.0] * 8, "others_cpu_cores": 0.4, "ram_total": 100, "ram_available": 50, "gpu": None}
    assert not cpu_taken(calm)
    assert watch.warning(cpu_taken(calm)).endswith("(40%): something competes for memory bandwidth.")
    for busy in (dict(calm, others_cpu_cores=6.0), dict(calm, cpu_steal_share=0.3)):
        assert cpu_taken(busy) and len(warned(busy)) == 1
        assert watch.warning(cpu_taken(busy)) == (
            "CPU expert throughput fell to 4.00 GB/s from its usual 10.00 GB/s (40%) as other processes or guests "
            "take its CPUs' time.")


def test_the_throughput_level_is_computed_once_a_sample(monkeypatch):
    """warning(), asked on every telemetry sample, read the level (the upper quartile of up to 2,400 readings) up to
    four times: two to judge the drop and two more to say it. It is computed once."""
    import statistics

    quantiles, calls = statistics.quantiles, []
    monkeypatch.setattr(statistics, "quantiles", lambda *args, **kwargs: calls.append(1) or quantiles(*args, **kwargs))
    watch = ThroughputWatch()
    for rate in (1,) + (10,) * 2395 + (4,) * 5:
        watch.add(rate * 1e9)
    assert len(watch.readings) == 2400
    assert watch.warning().startswith("CPU expert throughput fell to 4.00 GB/s from its usual 10.00 GB/s (40%)")
    assert len(calls) == 1
    for _ in range(3):  # the rate back: the next sample's judgement, calm, computes it once more
        watch.add(10e9)
    assert watch.warning() == "" and len(calls) == 2


def test_the_host_memory_warning_blames_this_process_when_it_holds_most():
    """Experts copied into RAM (allow_file_backing=0) fill host memory: the model's own, not the other processes' that
    happen to be largest, so the warning says what this process holds and what leaves room."""
    full = {"cpu_per_core": [50.0] * 8, "others_cpu_cores": 0.4, "gpu": None, "ram_total": 64 << 30,
            "ram_available": 2 << 30, "ram_this": 54 << 30, "ram_others": 8 << 30,
            "top_ram": [{"name": "firefox", "rss": 3 << 30}]}
    assert warned(full) == [
        "Host memory is nearly full (2.0 GiB of 64.0 GiB available): this process holds 54.0 GiB of it, the model's "
        "own experts and caches. A host cache budget (host_expert_bytes) or allowing file backing leaves room."]


def test_a_typed_size_is_exact_and_within_what_onnxruntime_takes():
    """A size typed in bytes went through a double: 9007199254740993 became ...992 and 18446744073709551615 (the
    largest onnxruntime takes) 18446744073709551616, which it and our parser refuse; so did '20000000 TiB', taken
    as it was and written to the settings."""
    assert parse_bytes("9007199254740993") == 9007199254740993
    assert parse_bytes("18446744073709551615") == 2**64 - 1 and parse_bytes("0.1 KiB") == 102
    with pytest.raises(ValueError, match=r"^'20000000 TiB' is more than 18446744073709551615 bytes, the most a "
                                         r"setting takes$"):
        parse_bytes("20000000 TiB")


def test_parse_bytes():
    assert parse_bytes("1.5 GiB") == 3 << 29 and parse_bytes("512M") == 512 << 20 and parse_bytes("1000") == 1000
    assert parse_bytes("auto") is None
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_a_log_scale_byte_slider_reaches_small_and_large_sizes(qapp):
    from app.gui.widgets import ByteControl

    control = ByteControl(80 << 30, auto_text=None, log_from=64 << 20)
    control.setValue(96 << 20)
    assert 0 < control.slider.value() < 100  # 96 MiB sits off the left end (a linear slider put it at 1 of 1000)
    control.slider.setValue(control.STEPS)
    assert control.value() == 80 << 30
    control.slider.setValue(0)
    assert control.value() == 64 << 20
    control.slider.setValue(control.STEPS // 2)  # the middle of a log scale: the geometric mean
    assert control.value() == pytest.approx(((64 << 20) * (80 << 30)) ** 0.5, rel=1e-6)
    linear = ByteControl(1 << 30)
    linear.slider.setValue(linear.STEPS // 4)
    assert linear.value() == 1 << 28


def test_return_on_a_byte_field_as_shown_keeps_its_exact_value(qapp):
    """The field shows a value rounded ('97.7 KiB' for 100000 bytes): Return on it, unchanged, left the budget at
    what the rounded text reads (100044), a change the user never made."""
    from app.gui.widgets import ByteControl

    control = ByteControl(1 << 30)
    control.setValue(100_000)
    changes = []
    control.valueChanged.connect(changes.append)
    control.text.editingFinished.emit()
    assert control.value() == 100_000 and changes == []
    control.text.setText("200 KiB")  # typed: a new value
    control.text.editingFinished.emit()
    assert control.value() == 200 << 10 and changes == [200 << 10]


def test_a_byte_field_says_why_it_refuses_what_was_typed(qapp):
    """Text that is no size was put back without a word: the field now says why, and the value stays."""
    from PySide6.QtWidgets import QToolTip

    from app.gui.widgets import ByteControl

    control = ByteControl(1 << 30)
    control.show()
    control.setValue(100_000)
    for typed, said in (("1e9", "'1e9' is not a size (e.g. 512 MiB, 1.5 GiB)"),
                        ("-5", "'-5' is not a size (e.g. 512 MiB, 1.5 GiB)")):
        control.text.setText(typed)
        control.text.editingFinished.emit()
        assert QToolTip.text() == said and control.value() == 100_000 and control.text.text() == "97.7 KiB"
    simulated = ByteControl(80 << 30, auto_text=None)  # a size with no automatic choice (the simulated GPU's)
    simulated.show()
    simulated.setValue(8 << 30)
    simulated.text.setText("auto")
    simulated.text.editingFinished.emit()
    assert QToolTip.text() == "'auto': this setting needs a size (e.g. 8 GiB)"
    assert simulated.value() == 8 << 30 and simulated.text.text() == "8.0 GiB"


def test_the_simulated_gpus_size_refuses_less_than_the_command_lines_least_where_typed(qapp, gptoss):
    """A simulated size of 0 typed into the budget panel showed '0 B' while the estimate and the load used a card of
    1 GiB, and 100 bytes made a card the command line refuses (--simulated-vram takes at least 1 MiB). The field now
    refuses less than 1 MiB where it was typed, saying so, and keeps the size in force."""
    from PySide6.QtWidgets import QToolTip

    from app.gui.budget_panel import BudgetPanel

    panel = BudgetPanel()
    panel.show()
    panel.set_facts(gptoss, {"device": {"kind": "simulated", "capacity": 96 << 20}})
    for typed in ("0", "100", "1023 KiB"):
        panel.sim_size.text.setText(typed)
        panel.sim_size.text.editingFinished.emit()
        assert QToolTip.text() == f"'{typed}': the simulated GPU needs at least 1.0 MiB"
        assert panel.sim_size.text.text() == "96.0 MiB"
        assert panel.device_settings() == {"kind": "simulated", "capacity": 96 << 20}
    panel.sim_size.text.setText("1 MiB")
    panel.sim_size.text.editingFinished.emit()
    assert panel.device_settings() == {"kind": "simulated", "capacity": 1 << 20}


def test_a_device_limit_or_streaming_slots_of_0_show_as_none_and_off_as_the_estimate_reads_them(qapp, gptoss):
    """gpu_device_mem_limit=0 is no limit and device_working_bytes 0 no streaming slots: the Device limit slider at its
    left end, or 0 typed, showed '0 B' with 'none' unticked while the estimate planned without a limit (the VRAM title
    named none), and 'off' typed into Streaming slots, the word its own box shows, was refused as no size. 0 typed, or
    the box's word, ticks the box; the sliders' left ends are their first step, a limit the estimate then counts."""
    from PySide6.QtWidgets import QToolTip

    from app.gui.budget_panel import BudgetPanel

    panel = BudgetPanel()
    panel.show()
    panel.set_facts(gptoss, {"device": {"kind": "simulated", "capacity": 8 << 30}})
    limit, working = panel.mem_limit, panel.working_bytes
    limit.auto.setChecked(False)
    limit.slider.setValue(0)
    panel.refresh()
    assert limit.value() == round(8 * (1 << 30) / limit.STEPS) and limit.text.text() == "8.2 MiB"
    assert panel.config().gpu_device_mem_limit == limit.value() and panel.vram_title.text().endswith(", limit 8.2 MiB")
    for control, typed in ((limit, "0"), (limit, "none"), (working, "0"), (working, "off")):
        control.auto.setChecked(False)
        control.setValue(1 << 20)
        control.text.setText(typed)
        control.text.editingFinished.emit()
        assert control.auto.isChecked() and control.value() is None and control.text.text() == control.auto.text()
    assert panel.config().gpu_device_mem_limit == 0 and panel.config().device_working_bytes is None
    working.slider.setValue(0)  # (the box ticked: the slider is off, and stays so)
    assert working.value() is None
    panel.expert_bytes.setValue(1 << 20)
    panel.expert_bytes.slider.setValue(0)  # 0 experts is a budget of its own: the left end stays 0
    assert panel.expert_bytes.value() == 0 and panel.expert_bytes.text.text() == "0 B"
    QToolTip.hideText()


def test_desktop_file_matches_the_application_and_has_an_icon(qapp):
    entry = configparser.ConfigParser(interpolation=None)
    entry.optionxform = str
    entry.read(REPO / "packaging" / "moe-workbench.desktop")
    desktop = entry["Desktop Entry"]
    assert desktop["Type"] == "Application" and desktop["Exec"].startswith("moe-workbench")
    assert desktop["StartupWMClass"] == "moe-workbench"
    assert 'setDesktopFileName("moe-workbench")' in (REPO / "app" / "gui" / "main.py").read_text()
    from app.gui.main_window import ICON, app_icon

    # the window's icon, which make desktop installs under the entry's Icon name
    assert ICON.is_file() and ICON.name == f"{desktop['Icon']}.svg" and not app_icon().isNull()
    assert f"install -D -m 644 {Path(ICON).resolve().relative_to(REPO)} " in (REPO / "Makefile").read_text()


def test_placement_tooltip_says_where_a_fully_resident_layer_routed(qapp):
    from app.gui.placement_view import Heatmap

    heatmap = Heatmap()
    layers = [{"hits": 40, "misses": 0, "swaps": 0, "routed_on_device": 10},
              {"hits": 30, "misses": 10, "swaps": 2, "misses_cpu": 10, "routed_on_device": 0}]
    heatmap.set_data({"resident": np.array([[True, True], [True, False]]), "traffic": np.zeros((2, 2)),
                      "valid": np.ones((2, 2), bool), "placement": "adaptive", "layer_names": ["a/QMoE", "b/QMoE"],
                      "layer_index": [0, 1], "bytes_per_expert": [1024, 1024], "layers": layers})
    assert ("Layer 0: 10 steps routed and computed on the device (every expert resident: no round trip to the host)"
            in heatmap.tooltip_at(0, 0))
    assert "routed and computed on the device" not in heatmap.tooltip_at(1, 0)
    layers[1].update(misses_read=10, misses_cpu=0, routed_on_device=4)  # the GPU read the cold ones (tier)
    assert ("Layer 1: 4 steps routed on the device (resident experts, and cold ones read by the GPU from host memory)"
            in heatmap.tooltip_at(1, 0))


def test_a_static_placements_cold_experts_are_missed_now_only_when_a_miss_was_counted_since_the_last_update(qapp):
    """Static placement's count never decays: every cold expert routed once since load kept its 'missed now' dot and
    '— missed recently' for good (12 of 13 cold experts after one 3-token answer on the gpt-oss fixture). There, a
    cold expert is missed now where the engine counted a miss on it since the update before."""
    from app.gui.placement_view import Heatmap

    heatmap = Heatmap()

    def update(misses: list[int], placement: str = "static", traffic=(5.0, 5.0, 0.0)) -> None:
        heatmap.set_data({"resident": np.array([[True, False, False]]), "traffic": np.array([traffic], np.float32),
                          "valid": np.ones((1, 3), bool), "placement": placement, "layer_names": ["a/QMoE"],
                          "layer_index": [0], "bytes_per_expert": [1024],
                          "layers": [{"hits": 5, "misses": sum(misses), "swaps": 0,
                                      "expert_hits": np.array([5, 0, 0]), "expert_misses": np.array(misses)}]})

    def dotted() -> list[bool]:
        return [" — missed recently" in heatmap.tooltip_at(0, col) for col in range(3)]

    update([0, 5, 0])  # expert 1 missed 5 times since load
    assert dotted() == [False, True, False] and heatmap.tooltip_at(0, 1).splitlines()[1] == (
        "Routing: 5.00 (routing count, not decayed) — missed recently")
    update([0, 5, 0])  # nothing routed since: a count of 5 is no miss now
    assert dotted() == [False, False, False]
    update([0, 5, 1], traffic=(5.0, 5.0, 1.0))
    assert dotted() == [False, False, True]
    update([0, 0, 0])  # the engine's counts started again (a record's run): what they count now is since then
    update([0, 1, 0], traffic=(5.0, 6.0, 1.0))
    assert dotted() == [False, True, False]
    heatmap.set_data(None)
    update([0, 5, 0], placement="adaptive", traffic=(5.0, 0.3, 0.9))  # adaptive: the decayed count says it
    assert dotted() == [False, False, True] and heatmap.tooltip_at(0, 2).splitlines()[1] == (
        "Recent routing: 0.90 (decayed routing count, ~10 steps) — missed recently")


def test_an_experts_tooltip_counts_one_hit_one_miss_and_one_routed_token_in_the_singular(qapp):
    """An expert routed once read 'This expert: 7 hits, 1 misses' ('1 routed tokens' on the CPU) in its tooltip."""
    from app.gui.placement_view import Heatmap

    heatmap = Heatmap()
    for cpu_only in (False, True):
        heatmap.set_data({"resident": np.array([[False, False]]), "traffic": np.ones((1, 2), np.float32),
                          "valid": np.ones((1, 2), bool), "placement": "adaptive", "layer_names": ["a/QMoE"],
                          "layer_index": [0], "bytes_per_expert": [1024], "cpu_only": cpu_only,
                          "layers": [{"hits": 8, "misses": 1, "swaps": 0, "expert_hits": np.array([1, 7]),
                                      "expert_misses": np.array([0, 1])}]})
        lines = [heatmap.tooltip_at(0, 0).splitlines()[3], heatmap.tooltip_at(0, 1).splitlines()[3]]
        expected = (["This expert: 1 routed token (counted exactly)", "This expert: 8 routed tokens (counted exactly)"]
                    if cpu_only else ["This expert: 1 hit, 0 misses (routed tokens, counted exactly)",
                                      "This expert: 7 hits, 1 miss (routed tokens, counted exactly)"])
        assert lines == expected


def test_a_layers_hit_rate_counts_one_hit_and_one_miss_in_the_singular(qapp):
    """A layer routed once to the device and once not read 'Layer 0: 1 hits, 1 misses (50% hit rate)' in its
    tooltips (its cells' and the rows' beside the grid), and the summary '(1 hits, 1 misses)'."""
    from app.gui.placement_view import PlacementView, hit_rate_text

    view = PlacementView()
    stats = {"resident": np.array([[True, False]]), "traffic": np.ones((1, 2)), "valid": np.ones((1, 2), bool),
             "placement": "adaptive", "layer_names": ["a/QMoE"], "layer_index": [0], "bytes_per_expert": [1024],
             "layers": [{"hits": 1, "misses": 1, "swaps": 1, "fills": 1}]}
    view.set_stats(stats)
    assert hit_rate_text(stats, 0) == "Layer 0: 1 hit, 1 miss (50% hit rate), 1 slot filled, 1 swap"
    assert hit_rate_text(stats, 0) in view.heatmap.tooltip_at(0, 0).splitlines()
    assert "hit rate since load 50% (1 hit, 1 miss)" in view.summary.text()
    stats["layers"][0].update(hits=2, misses=3)
    view.set_stats(stats)
    assert hit_rate_text(stats, 0) == "Layer 0: 2 hits, 3 misses (40% hit rate), 1 slot filled, 1 swap"
    assert "hit rate since load 40% (2 hits, 3 misses)" in view.summary.text()


def test_the_placement_summary_counts_every_miss_and_the_legend_follows_the_mode(qapp):
    from app.gui.chat_panel import miss_split_text
    from app.gui.placement_view import PlacementView

    view = PlacementView()
    layers = [{"hits": 30, "misses": 10, "swaps": 0}]
    split = {"steps": 4, "misses": 10, "misses_cpu": 4, "misses_copied": 1, "miss_copies": 1, "misses_read": 5}
    view.set_stats({"resident": np.array([[True, False]]), "traffic": np.ones((1, 2)), "valid": np.ones((1, 2), bool),
                    "placement": "adaptive", "layer_names": ["a/QMoE"], "layer_index": [0], "bytes_per_expert": [1024],
                    "layers": layers, "misses": split, "step_splits": [(1, 0, 2)]})
    summary = view.summary.text()
    # the engine's counts since load (a chat answer's own are under it): said so, beside the last step's
    assert "hit rate since load 75% (30 hits, 10 misses)" in summary
    # 4 + 1 + 5: every miss is in the split (the GPU's reads from the host tier were left out)
    assert ("misses since load: 4 on the CPU, 1 copied to the device (1 decode copies), 5 read by the GPU from host "
            "memory" in summary)
    assert "last step: 1 on the CPU, 0 copied, 2 read from host memory" in summary
    assert miss_split_text(split) == ("misses: 4 on the CPU, 1 copied to the device (1 decode copies), 5 read by the "
                                      "GPU from host memory")
    assert miss_split_text(dict(split, misses_read=0)) == ("misses: 4 on the CPU, 1 copied to the device (1 decode "
                                                           "copies)")
    assert "resident" in view.legend.text() and "missed now" in view.legend.text()
    view.traffic.setChecked(True)
    assert view.heatmap.mode == "traffic"
    assert "hits" in view.legend.text() and "misses" in view.legend.text() and "resident" not in view.legend.text()
    view.residency.setChecked(True)
    assert "missed now" in view.legend.text()


def test_the_graphs_time_axis_counts_seconds_ago_upward(qapp):
    """The samples sit at their seconds before the last (x below 0), and the axis said 'seconds ago' under '-60',
    '-30', '0': a minute ago read as -60 seconds ago. It reads 60, 30, 0."""
    from app.gui.graphs_panel import GraphsPanel

    graphs = GraphsPanel()
    axis = graphs.tps_plot.getAxis("bottom")
    assert axis.labelText == "seconds ago"
    assert axis.tickStrings([-60.0, -30.0, 0.0], 1.0, 30.0) == ["60", "30", "0"]


def test_the_tokens_graph_reads_the_rate_while_answering(qapp, monkeypatch):
    from types import SimpleNamespace

    import app.gui.graphs_panel as graphs_panel
    from app.gui.graphs_panel import GraphsPanel
    from app.gui.telemetry import SystemProbe

    clock = [0.0]  # the window's thread's clock, as samples arrive
    monkeypatch.setattr(graphs_panel, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    def arrives(at: float, taken: float) -> None:
        clock[0] = at
        graphs.add_sample(dict(sample, t=taken))

    graphs = GraphsPanel()
    sample = SystemProbe(nvml=False).sample()
    arrives(100.0, 100.0)
    # a 0.25 s answer of 50 tokens inside a 1 s sample: 200 tok/s (not 50, the tokens over the whole sample)
    graphs.set_answering(True, now=100.5)
    graphs.count_tokens(50)
    graphs.set_answering(False, now=100.75)
    arrives(101.0, 101.0)
    assert graphs.samples[-1]["tokens_per_s"] == pytest.approx(200.0)
    # an answer running across samples: each sample takes its own part of the time, as the window's thread saw it.
    # A sample taken at 101.6 that arrives at 102.0, 30 tokens counted by then: 60 tok/s over the 0.5 s answered
    # (its own time gave 0.1 s of answering to the 30 tokens: 300 tok/s, then 100 tokens over 1.4 s: 71 tok/s)
    graphs.set_answering(True, now=101.5)
    graphs.count_tokens(30)
    arrives(102.0, 101.6)
    graphs.count_tokens(100)
    graphs.set_answering(False, now=103.0)
    arrives(103.1, 102.9)
    assert [s["tokens_per_s"] for s in list(graphs.samples)[-2:]] == pytest.approx([60.0, 100.0])
    arrives(104.0, 104.0)
    assert graphs.samples[-1]["tokens_per_s"] == 0.0


def test_paused_graphs_say_so(qtbot):
    """Pausing froze the graphs but their status line, redrawn only with them, never said 'paused'."""
    from app.gui.graphs_panel import GraphsPanel
    from app.gui.telemetry import SystemProbe

    graphs = GraphsPanel()
    qtbot.addWidget(graphs)
    graphs.show()
    sample = SystemProbe(nvml=False).sample()
    graphs.add_sample(sample)
    assert "paused" not in graphs.status.text() and graphs.status.text().startswith("1 sample · ")
    graphs.set_paused(True)
    graphs.add_sample(dict(sample, t=sample["t"] + 1))
    assert graphs.status.text().startswith("paused · 1 sample · ")
    graphs.set_paused(False)
    assert "paused" not in graphs.status.text() and "2 samples" in graphs.status.text()


def test_a_cpu_put_online_or_offline_leaves_a_gap_in_its_line_not_a_broken_graph(qtbot):
    """A CPU coming online (a VM given another vCPU) makes the samples' per-core lists of two lengths: drawing them
    raised ValueError (an inhomogeneous array) on every sample for the ten minutes of history, each one an 'Internal
    error' message and an error marker, and the contention warnings after the graphs were never checked."""
    from app.gui.graphs_panel import GraphsPanel

    graphs = GraphsPanel()
    qtbot.addWidget(graphs)
    graphs.show()
    sample = {"t": 1.0, "wall": 0.0, "cpu_per_core": [50.0, 50.0], "cpu_total": 50.0, "others_cpu_cores": 0.0,
              "ram_total": 16 << 30, "ram_available": 8 << 30, "ram_this": 1 << 30, "ram_others": 7 << 30,
              "gpu": None}
    graphs.add_sample(sample)
    graphs.add_sample(dict(sample, t=2.0, cpu_per_core=[50.0, 50.0, 100.0]))
    assert "3 cores" in graphs.cpu_plot.header.text()
    _, third = graphs.core_curves[2].getData()
    assert np.isnan(third[0]) and third[1] == 100.0
    graphs.add_sample(dict(sample, t=3.0))  # and offline again
    assert "2 cores" in graphs.cpu_plot.header.text() and len(graphs.samples) == 3


def test_a_gpu_that_stops_answering_mid_run_is_not_said_to_be_missing(qtbot, monkeypatch):
    """NVML failing mid-run (the GPU lost, the driver reloaded) hid the VRAM graphs under 'NVML stopped answering
    (...). VRAM and GPU utilisation graphs appear on a machine with one.': on a machine with one. The window goes on,
    the note says the graphs come back when NVML answers, and they do; once NVML is given up (engine.nvml.RETRIES),
    it no longer says so."""
    import engine.nvml as nvml
    from app.gui.graphs_panel import GraphsPanel
    from tests.test_nvml import FakeNvml

    class Lost(Exception):
        pass

    fake = FakeNvml([])
    answers = fake.nvmlDeviceGetMemoryInfo
    now = [0.0]
    monkeypatch.setattr(nvml.Nvml, "clock", staticmethod(lambda: now[0]))
    monkeypatch.setattr(nvml, "pynvml", fake)
    gpu = nvml.Nvml()
    graphs = GraphsPanel()
    qtbot.addWidget(graphs)
    graphs.show()
    sample = {"t": 1.0, "wall": 0.0, "cpu_per_core": [50.0], "cpu_total": 50.0, "others_cpu_cores": 0.0,
              "ram_total": 16 << 30, "ram_available": 8 << 30, "ram_this": 1 << 30, "ram_others": 7 << 30}
    graphs.add_sample(dict(sample, gpu=gpu.sample(), gpu_note=""))
    assert graphs.vram_plot.header.isVisible()

    def lost(handle):
        raise Lost("GPU is lost")

    monkeypatch.setattr(fake, "nvmlDeviceGetMemoryInfo", lost)
    graphs.add_sample(dict(sample, t=2.0, gpu=gpu.sample(), gpu_note=gpu.note, gpu_retrying=gpu.retrying))
    assert not graphs.vram_plot.header.isVisible()
    assert graphs.gpu_note.text() == ("<b>GPU:</b> NVML stopped answering (GPU is lost); NVML is asked again in 5 s. "
                                      "The VRAM and GPU utilisation graphs come back when it answers again.")
    now[0] += nvml.RETRY_AFTER_S
    monkeypatch.setattr(fake, "nvmlDeviceGetMemoryInfo", answers)
    graphs.add_sample(dict(sample, t=3.0, gpu=gpu.sample(), gpu_note=""))
    assert graphs.vram_plot.header.isVisible() and graphs.gpu_note.isHidden()
    monkeypatch.setattr(fake, "nvmlDeviceGetMemoryInfo", lost)
    for _ in range(nvml.RETRIES + 1):  # NVML given up after its tries: the note no longer says the graphs come back
        now[0] += nvml.RETRY_AFTER_S
        graphs.add_sample(dict(sample, t=4.0, gpu=gpu.sample(), gpu_note=gpu.note, gpu_retrying=gpu.retrying))
    assert graphs.gpu_note.text() == ("<b>GPU:</b> NVML stopped answering (GPU is lost); NVML was asked 13 times, 5 s "
                                      "apart, and is no longer asked (restart MoE Workbench to read the GPU).")


def test_a_simulated_gpus_memory_is_shown_beside_a_real_gpus_graphs(qtbot, monkeypatch):
    """A model on the simulated GPU ("what if I had an 8 GB card?") on a machine with an NVIDIA GPU: the graphs showed
    the real card only, and the simulated card's memory as the engine counts it (in use, high-water) nowhere."""
    import engine.nvml as nvml
    from app.gui.graphs_panel import GraphsPanel
    from tests.test_nvml import FakeNvml

    monkeypatch.setattr(nvml, "pynvml", FakeNvml([]))
    graphs = GraphsPanel()
    qtbot.addWidget(graphs)
    graphs.show()
    sample = {"t": 1.0, "wall": 0.0, "cpu_per_core": [50.0], "cpu_total": 50.0, "others_cpu_cores": 0.0,
              "ram_total": 16 << 30, "ram_available": 8 << 30, "ram_this": 1 << 30, "ram_others": 7 << 30,
              "gpu": nvml.Nvml().sample(), "gpu_note": ""}
    graphs.set_simulated_memory({"name": "simulated GPU, 8.0 GiB", "used": 3 << 20, "high_water": 5 << 20,
                                 "ceiling": 8 << 30})
    graphs.add_sample(sample)
    assert graphs.vram_plot.header.isVisible() and graphs.gpu_note.isVisible()
    assert graphs.gpu_note.text() == ("<b>simulated GPU, 8.0 GiB</b> (the engine's own count; the graphs show this "
                                      "machine's GPU): 3.0 MiB in use of 8.0 GiB, high-water 5.0 MiB.")
    graphs.set_simulated_memory(None)  # unloaded
    assert graphs.gpu_note.isHidden()


def test_a_model_on_the_cuda_gpu_without_nvml_is_not_said_to_have_no_gpu(qtbot):
    """CUDA works but NVML does not (a container given the compute capability only: no libnvidia-ml; nvmlInit refused):
    with a model running on the GPU, the graphs said "GPU: no NVIDIA GPU (NVML Shared Library Not Found). VRAM and GPU
    utilisation graphs appear on a machine with one." They say which GPU runs the model and that NVML gives no
    reading."""
    from app.gui.graphs_panel import GraphsPanel

    graphs = GraphsPanel()
    qtbot.addWidget(graphs)
    graphs.show()
    sample = {"t": 1.0, "wall": 0.0, "cpu_per_core": [50.0], "cpu_total": 50.0, "others_cpu_cores": 0.0,
              "ram_total": 16 << 30, "ram_available": 8 << 30, "ram_this": 1 << 30, "ram_others": 7 << 30,
              "gpu": None, "gpu_note": "no NVIDIA GPU (NVML Shared Library Not Found)"}
    graphs.set_cuda_device("NVIDIA H100 80GB HBM3 (80 GiB)")
    graphs.add_sample(sample)
    assert graphs.gpu_note.text() == (
        "<b>GPU:</b> the model runs on <b>NVIDIA H100 80GB HBM3 (80 GiB)</b>, but NVML, which the VRAM and GPU "
        "utilisation graphs read, gives no reading (no NVIDIA GPU (NVML Shared Library Not Found)).")
    graphs.set_cuda_device("")  # unloaded
    assert graphs.gpu_note.text() == ("<b>GPU:</b> no NVIDIA GPU (NVML Shared Library Not Found). VRAM and GPU "
                                      "utilisation graphs appear on a machine with one.")


def _graphs_after_one_sample(qtbot, gpu, gpu_note):
    """The graphs panel, shown, after one sample of a host with 16 GiB (8 available, 1 this process's, 7 others')."""
    from app.gui.graphs_panel import GraphsPanel

    graphs = GraphsPanel()
    qtbot.addWidget(graphs)
    graphs.show()
    graphs.add_sample({"t": 1.0, "wall": 0.0, "cpu_per_core": [50.0], "cpu_total": 50.0, "others_cpu_cores": 0.0,
                       "ram_total": 16 << 30, "ram_available": 8 << 30, "ram_this": 1 << 30, "ram_others": 7 << 30,
                       "gpu": gpu, "gpu_note": gpu_note})
    return graphs


def test_where_the_driver_hides_whose_vram_is_whose_this_process_is_not_said_to_hold_none(qtbot, monkeypatch):
    """A driver (or a container) that hides per-process memory: the VRAM header read 'this process 0.00' beside
    'others 30.00 (ours included ...)', a wrong number for a model holding most of the 30 GiB."""
    import engine.nvml as nvml
    from tests.test_nvml import FakeNvml

    monkeypatch.setattr(nvml, "pynvml", FakeNvml([(os.getpid(), 0)], hide_per_process=True))
    graphs = _graphs_after_one_sample(qtbot, nvml.Nvml().sample(), "")  # (kept: its labels go with it)
    header = graphs.vram_plot.header.text()
    assert "this process 0 B" not in header
    assert "in use 30.0 GiB (this process's and others': the driver does not say whose)" in header
    assert "free 50.0 GiB of 80.0 GiB" in header


def test_the_vram_graph_says_the_drivers_own_memory_apart_from_other_processes(qtbot, monkeypatch):
    """'others 1.00' on a card where another process held 256 MiB and the driver its own 768 MiB (no process's, there
    with nothing running): the header said other processes held four times what they did."""
    import engine.nvml as nvml
    from tests.test_nvml import DriverReserves

    monkeypatch.setattr(nvml, "pynvml", DriverReserves([(os.getpid(), 5 << 30), (os.getppid(), 256 << 20)], 768 << 20))
    graphs = _graphs_after_one_sample(qtbot, nvml.Nvml().sample(), "")  # (kept: its labels go with it)
    header = graphs.vram_plot.header.text()
    assert "this process 5.0 GiB" in header and "other processes 256.0 MiB, driver and display 768.0 MiB" in header
    assert "others 1.0" not in header


def test_the_vram_graph_says_each_figure_in_one_format_with_its_unit(qtbot, monkeypatch):
    """The VRAM header said what is held with two decimals and no unit, free and the total with one and only the total
    with its unit ('this process 5.00 · other processes 0.25, driver and display 0.75 · free 2.0 of 8.0 GiB'), where
    the host memory header beside it says each figure in human_bytes: the VRAM header does too, and a model that holds
    less than a GiB reads in MiB, not as 0.05."""
    import engine.nvml as nvml
    from tests.test_nvml import DriverReserves

    monkeypatch.setattr(nvml, "pynvml", DriverReserves([(os.getpid(), 50 << 20), (os.getppid(), 1 << 30)], 3 << 30))
    graphs = _graphs_after_one_sample(qtbot, nvml.Nvml().sample(), "")  # (kept: its labels go with it)
    header = graphs.vram_plot.header.text()
    assert "this process 50.0 MiB" in header and "other processes 1.0 GiB, driver and display 3.0 GiB" in header
    assert "free 4.0 GiB of 8.0 GiB" in header


def test_the_host_memory_graph_says_its_others_hold_the_kernels_own_memory(qtbot):
    """The host memory header's 'others 7.0' is all that is neither available nor this process's: the kernel's own
    memory (page tables, slab, buffers) is in it beside other processes'. It is said so, the number kept."""

    graphs = _graphs_after_one_sample(qtbot, None, "no NVIDIA GPU")
    header = graphs.ram_plot.header.text()
    assert "other processes and the kernel 7.0 GiB" in header and "others 7.0" not in header


def test_the_host_memory_graph_says_each_figure_in_one_format_with_its_unit(qtbot):
    """The host memory header said this process with two decimals and the others with one, and only the last figure
    had a unit ('this process 1.00 · other processes and the kernel 7.0 · available 8.0 of 16.0 GiB'): each is now
    human_bytes', unit included, as a model small enough to be counted in MiB reads too."""
    graphs = _graphs_after_one_sample(qtbot, None, "no NVIDIA GPU")
    header = graphs.ram_plot.header.text()
    assert "this process 1.0 GiB" in header and "other processes and the kernel 7.0 GiB" in header
    assert "available 8.0 GiB of 16.0 GiB" in header
    graphs.add_sample({"t": 2.0, "wall": 1.0, "cpu_per_core": [50.0], "cpu_total": 50.0, "others_cpu_cores": 0.0,
                       "ram_total": 16 << 30, "ram_available": 8 << 30, "ram_this": 300 << 20,
                       "ram_others": (8 << 30) - (300 << 20), "gpu": None, "gpu_note": "no NVIDIA GPU"})
    assert "this process 300.0 MiB" in graphs.ram_plot.header.text()


def test_a_failing_sampler_says_so_once_and_a_working_sample_clears_it(qapp):
    """psutil raising on every tick left the graphs at 'waiting for the first sample…' with no word: the failure is
    reported once, in one line naming it, and the graphs' note goes when a sample comes."""
    import psutil

    from app.gui.graphs_panel import GraphsPanel
    from app.gui.telemetry import Sampler, SystemProbe

    real = SystemProbe(nvml=False)

    class Probe:
        fails = 3

        def sample(self):
            if self.fails:
                self.fails -= 1
                raise psutil.AccessDenied(pid=1, msg="/proc/stat")
            return real.sample()

    sampler, graphs = Sampler(Probe()), GraphsPanel()
    failures, samples = [], []
    sampler.failed.connect(failures.append)
    sampler.failed.connect(graphs.show_sampling_failure)
    sampler.sampled.connect(samples.append)
    sampler.sampled.connect(graphs.add_sample)
    for _ in range(3):
        sampler._tick()
    assert failures == ["Sampling the machine failed (psutil.AccessDenied: /proc/stat (pid=1)); the graphs resume "
                        "when a sample works."] and samples == []
    assert not graphs.sampling_failure.isHidden() and graphs.sampling_failure.text() == failures[0]
    sampler._tick()
    assert len(samples) == 1 and graphs.sampling_failure.isHidden()


def test_report_tables_keep_an_answers_line_breaks_and_escape_its_markup():
    from app.gui.record_report import _table

    cell = _table([("one\ntwo <b>", "x")], ("A", "B"))
    assert "<td>one<br>two &lt;b&gt;</td>" in cell


@pytest.mark.parametrize("working, decode_path", [(None, None), (1 << 30, None), (1 << 30, "tier")])
def test_estimate_follows_the_engine_for_streaming_slots(working, decode_path):
    """A zero expert budget: the decode streaming slots device_working_bytes asks for are workspace in the estimate
    as in the engine, and the plan's sentences are the engine's (including the hint where none are asked for); under
    decode path 'tier', which copies no miss, neither makes them."""
    folder = ModelFolder.open(fixture_folder("gptoss"))
    facts = model_facts(folder, inspection(folder))
    choice = DeviceChoice("simulated", 1 << 30)
    config = OffloadConfig(device_expert_bytes=0, device_working_bytes=working)
    est = estimate(facts, config, choice, decode_path=decode_path)
    engine, device = engine_on("gptoss", config, choice, decode_path)
    assert est.host_tier == engine.host_tier == (decode_path == "tier")
    workspace = {p.key: p for p in est.device_parts}["workspace"]
    streaming = device.memory.by_purpose.get("decode streaming slots", 0)
    assert workspace.bytes == device.memory.by_purpose["prefill staging ring"] + streaming
    assert (streaming > 0) == (working is not None and decode_path is None)
    assert ("decode streaming slots" in workspace.note) == bool(streaming)
    assert est.statements[:len(engine.plan.statements)] == engine.plan.statements
    assert any("streaming" in s or "device_working_bytes" in s for s in est.statements)


def device_parts_held(device) -> dict[str, int]:
    """What a loaded engine holds on its simulated device, summed by the estimate's device part."""
    held = {"experts": 0, "workspace": 0}
    for purpose, nbytes in device.memory.by_purpose.items():
        if purpose.startswith("expert slots of "):
            held["experts"] += nbytes
        else:
            assert purpose in ("prefill staging ring", "decode streaming slots"), purpose  # a part the estimate lacks
            held["workspace"] += nbytes
    return held


def estimated_device_parts(est) -> dict[str, int]:
    parts = {p.key: p.bytes for p in est.device_parts}
    # the dense part stays on the CPU beside a simulated GPU
    assert parts["dense"] == parts["kv"] == parts["others"] == 0
    return {"experts": parts["experts"], "workspace": parts["workspace"]}


@pytest.mark.parametrize("name", ["gptoss", "lfm2moe", "qwen35moe"])
def test_the_estimates_device_parts_are_what_the_loaded_engine_holds(name):
    """Every device part of the estimate, and their sum, against what the engine holds by purpose once loaded on a
    simulated device: budgets from none to every expert resident, both placements, explicit pinned rings and prefill
    waves, decode streaming slots, on a roomy device and on devices a few slots large (where the parts compete)."""
    folder = ModelFolder.open(fixture_folder(name))
    facts = model_facts(folder, inspection(folder))
    slot = max(info.device_bytes_per_expert for info in facts.experts if info.gpu is not None)
    budgets = (None, 0, 7 * slot // 2, all_resident_bytes(facts.experts))
    compared = 0
    for capacity, budget, placement, pinned, wave, working in itertools.product(
            (1 << 30, 6 * slot, 3 * slot), budgets, ("static", "adaptive"), (None, 3 * slot), (4, 2), (None, 1 << 20)):
        config = OffloadConfig(device_expert_bytes=budget, placement=placement, pinned_bytes=pinned,
                               prefill_wave_experts=wave, device_working_bytes=working)
        choice = DeviceChoice("simulated", capacity)
        est = estimate(facts, config, choice)
        engine, device = engine_on(name, config, choice)
        assert not est.error
        assert estimated_device_parts(est) == device_parts_held(device), (capacity, budget, placement, pinned, wave)
        assert sum(estimated_device_parts(est).values()) == device.memory.used == device.memory.high_water
        assert [r for _l, _n, r, _e in est.per_layer] == [engine.plan.slots[info.name] for info in engine.infos]
        assert est.statements[:len(engine.plan.statements)] == engine.plan.statements  # streaming's included
        compared += 1
    assert compared == 3 * 4 * 2 * 2 * 2 * 2


@pytest.mark.parametrize("name", ["gptoss", "qwen35moe"])
def test_the_estimate_counts_the_host_tiers_granule_rounded_mappings_as_the_engine_reserves_them(name):
    """Decode path 'tier': the slots are mapped with the host tier, each slot array rounded up to the 2 MiB granule (a
    granule an array even at 0 slots). The estimate counted slots x expert bytes and promised the tier where the device
    or gpu_device_mem_limit holds the slots but not the rounded mappings; it counts what the engine reserves now, and
    says the engine's sentence where the tier is not made."""
    folder = ModelFolder.open(fixture_folder(name))
    facts = model_facts(folder, inspection(folder))
    slot = max(info.device_bytes_per_expert for info in facts.experts if info.gpu is not None)
    granules = sum(len(info.gpu.tier_rows) for info in facts.experts if info.gpu is not None)
    made = {}
    for capacity, limit, budget in ((1 << 30, 0, 0), (1 << 30, 0, 3 * slot), (1 << 30, granules << 20, 3 * slot),
                                    (1 << 30, (granules + 8) << 21, 3 * slot)):
        config = OffloadConfig(device_expert_bytes=budget, gpu_device_mem_limit=limit)
        choice = DeviceChoice("simulated", capacity)
        est = estimate(facts, config, choice, decode_path="tier")
        engine, device = engine_on(name, config, choice, decode_path="tier")
        assert not est.error
        assert estimated_device_parts(est) == device_parts_held(device), (limit, budget)
        assert est.host_tier == engine.host_tier
        made[limit] = engine.host_tier
        assert sum(estimated_device_parts(est).values()) == device.memory.high_water
        assert est.statements[:len(engine.plan.statements)] == engine.plan.statements
        if engine.host_tier:
            rounded = engine.plan.device_bytes(engine.infos, host_tier=True)
            assert estimated_device_parts(est)["experts"] == rounded >= granules * (2 << 20)
        else:  # the slots alone fit: the tier's mappings do not
            assert engine.plan.device_bytes(engine.infos) < limit
            said = [s for s in est.statements if "no host tier" in s]
            assert len(said) == 1 and said[0].startswith("Cold experts are computed on the CPU: no host tier is made, "
                                                         "since its device mappings need ")
            assert f"free for them under gpu_device_mem_limit={limit}." in said[0]
    assert made == {0: True, granules << 20: False, (granules + 8) << 21: True}


def test_where_everything_landed_counts_the_host_tiers_device_mappings_as_the_device_holds_them():
    """With the host tier the device holds the slots' granule-rounded mappings (2 MiB a slot array here, with no slot
    at all); 'where everything landed' said 'expert slots 0 B' beside a device in use by them."""
    from types import SimpleNamespace

    from app.gui.engine_worker import EngineWorker
    from engine.generation import LoadedModel
    from engine.offload import SimulatedDevice

    folder = ModelFolder.open(fixture_folder("gptoss"))
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(device_expert_bytes=0), device=device,
                             decode_path="tier")
    assert model.offload.host_tier
    worker = SimpleNamespace(_model=model, _loaded_facts=model_facts(folder, inspection(folder)), _device=device,
                             _device_fallback="")
    landed = " ".join(EngineWorker._landed(worker))
    held = sum(n for purpose, n in device.memory.by_purpose.items() if purpose.startswith("expert slots of "))
    assert held >= 2 << 20 and f"(expert slots {human_bytes(held)}, " in landed


def _landed_under_static_placement(tmp_path, counts: dict):
    """gptoss on a simulated device, 3 slots a layer, static placement from a popularity file of `counts` (node name ->
    counts): (the model, the file, 'where everything landed')."""
    import json
    from types import SimpleNamespace

    from app.gui.engine_worker import EngineWorker
    from engine.generation import LoadedModel
    from engine.offload import SimulatedDevice

    folder = ModelFolder.open(fixture_folder("gptoss"))
    path = tmp_path / "popularity.json"
    path.write_text(json.dumps(counts))
    device = SimulatedDevice(1 << 30)
    overrides = ";".join(f"{info.name}:max_resident_slots=3" for info in folder.experts)
    model = LoadedModel.open(fixture_folder("gptoss"), device=device,
                             offload=OffloadConfig.from_entries({"session.moe.offload.placement": "static",
                                                                 "session.moe.offload.popularity_file": str(path),
                                                                 "session.moe.offload.node_overrides": overrides}))
    worker = SimpleNamespace(_model=model, _loaded_facts=model_facts(folder, inspection(folder)), _device=device,
                             _device_fallback="")
    return model, path, " ".join(EngineWorker._landed(worker))


def test_where_everything_landed_says_static_placement_measures_the_slots_a_popularity_file_leaves(tmp_path):
    """A popularity file that counts fewer experts than a layer has slots: static placement chose only counted
    experts, leaving the other slots to copied misses for good. Its opening now measures routing for them, and where
    everything landed says so, which nodes the file counts too few experts of, and how many of the slots hold copied
    misses meanwhile (it said the slots alone, the copies in them counted as residents elsewhere)."""
    names = [info.name for info in ModelFolder.open(fixture_folder("gptoss")).experts]
    model, path, landed = _landed_under_static_placement(tmp_path, {name: [0, 0, 7, 0, 0, 0, 0, 0] for name in names})
    assert [layer.resident().tolist() for layer in model.offload.slots] == [[2], [2]]
    assert ("Expert slots per layer: 3 of 8 in every layer (2 layers): 1 resident expert, 2 left for copied misses."
            in landed), landed
    assert ("Static placement counts routing for 32 more tokens, then copies the experts routed most into the slots "
            "the popularity file's counts do not fill for good (copied misses use them meanwhile)." in landed)
    assert (f"{path} counts fewer experts than the layer has slots in 2 expert nodes ('{names[0]}', '{names[1]}'): "
            "static placement places the counted ones at once and fills the slots left with the experts its opening "
            "measures routed most.") in landed


def test_where_everything_landed_says_static_placement_measures_only_the_layers_the_popularity_file_leaves_out(
        tmp_path):
    """A popularity file that names one of two expert nodes: the other is measured by static placement's opening, and
    where everything landed said it would then copy 'the experts routed most in each layer' into its slots, the
    file's layer too, whose residents the file placed at load."""
    first = ModelFolder.open(fixture_folder("gptoss")).experts[0].name
    model, path, landed = _landed_under_static_placement(tmp_path, {first: [0, 0, 7, 5, 3, 0, 0, 0]})
    assert [layer.resident().tolist() for layer in model.offload.slots] == [[2, 3, 4], []]
    assert ("Static placement counts routing for 32 more tokens, then copies the experts routed most into the slots "
            "the popularity file's counts do not fill for good (copied misses use them meanwhile)." in landed)
    assert (f"{path} counts 1 of 2 expert nodes ('/model/layers.0/moe/QMoE'); static placement measures the other 1 "
            "over its opening ('/model/layers.1/moe/QMoE').") in landed


def test_where_everything_landed_says_static_placement_measures_a_layer_the_popularity_file_counts_0_throughout(
        tmp_path):
    """A node the popularity file names with every count 0 tells static placement nothing: its opening measures it, as
    one the file leaves out, and where everything landed says so (it said every slot was resident: nothing was)."""
    first, second = (info.name for info in ModelFolder.open(fixture_folder("gptoss")).experts)
    model, path, landed = _landed_under_static_placement(tmp_path, {first: [0, 0, 7, 5, 3, 0, 0, 0], second: [0] * 8})
    assert [layer.resident().tolist() for layer in model.offload.slots] == [[2, 3, 4], []]
    assert ("Static placement counts routing for 32 more tokens, then copies the experts routed most into the slots "
            "the popularity file's counts do not fill for good (copied misses use them meanwhile)." in landed)
    assert (f"{path} counts 1 of 2 expert nodes ('{first}'); static placement measures the other 1 over its opening "
            f"(0 for every expert: '{second}').") in landed


def test_streaming_slots_are_estimated_in_what_the_resident_slots_leave():
    """qwen35moe on a device of six slots, 3.5 slots of budget and a pinned ring of three experts: the prefill ring
    takes two slots' worth, the plan three resident slots, and one streaming slot fits in what is left. The estimate
    planned its streaming slots before counting the resident ones on its stand-in device, so it showed two
    (workspace 4 slots, 7 in all on a device of 6)."""
    folder = ModelFolder.open(fixture_folder("qwen35moe"))
    facts = model_facts(folder, inspection(folder))
    slot = 35328
    config = OffloadConfig(device_expert_bytes=7 * slot // 2, pinned_bytes=3 * slot, device_working_bytes=1 << 20)
    choice = DeviceChoice("simulated", 6 * slot)
    est = estimate(facts, config, choice)
    _engine, device = engine_on("qwen35moe", config, choice)
    assert device.memory.by_purpose["decode streaming slots"] == slot
    assert estimated_device_parts(est) == {"experts": 3 * slot, "workspace": 2 * slot + slot}
    assert sum(estimated_device_parts(est).values()) == device.memory.used == 6 * slot
    assert {p.key: p.bytes for p in est.device_parts}["free"] == 0


def test_the_budget_panels_cuda_status_opens_no_device(monkeypatch):
    """The budget panel asks from the GUI thread whether CUDA is there: it must not open a device, whose host
    bandwidth probe would leave an OpenMP pool on the GUI thread beside the engine thread's (cuda_device_problem)."""
    import app.gui.budget_panel as budget_panel
    import engine.offload.cuda_device as cuda_device

    def opened(*_args, **_kwargs):
        raise AssertionError("opened a CUDA device on the GUI thread")
    monkeypatch.setattr(cuda_device, "open_cuda_device", opened)
    monkeypatch.setattr(cuda_device, "CudaDevice", opened)
    monkeypatch.setattr(cuda_device, "cuda_device_problem", lambda index=0: "no CUDA device: stand-in")
    assert budget_panel.cuda_status() == "no CUDA device: stand-in"
    monkeypatch.setattr(cuda_device, "cuda_device_problem", lambda index=0: "")
    assert budget_panel.cuda_status() == ""


def test_the_verdict_column_says_refused_where_the_load_would_refuse_in_mode_auto(qapp, gptoss):
    """A pinned ring below one expert refuses the load under mode=auto too: each layer said it would run on the CPU."""
    from app.gui.model_panel import ModelPanel

    panel = ModelPanel()
    panel.show_facts(gptoss)
    refused = estimate(gptoss, OffloadConfig(pinned_bytes=100), DeviceChoice("simulated", 1 << 30))
    assert refused.error.startswith("session.moe.offload.pinned_bytes=100 holds no expert")
    panel.show_estimate(refused, "auto", "simulated GPU, 1.0 GiB")
    assert [panel.table.item(row, 5).text() for row in range(panel.table.rowCount())] == ["refused", "refused"]
    assert "Refused (mode <b>auto</b>, simulated GPU, 1.0 GiB): session.moe.offload.pinned_bytes=100" in \
        panel.verdict.text()
    panel.show_estimate(estimate(gptoss, OffloadConfig(), DeviceChoice()), "auto", "CPU only")
    assert [panel.table.item(row, 5).text() for row in range(panel.table.rowCount())] == ["CPU", "CPU"]


def test_the_free_part_says_what_the_automatic_budget_keeps_of_a_device_smaller_than_its_reserve(gptoss):
    """The automatic reserve is at least 512 MiB: on a 1 MiB simulated GPU the free part said it kept 512 MiB free."""
    est = estimate(gptoss, OffloadConfig(), DeviceChoice("simulated", 1 << 20))
    free = {p.key: p for p in est.device_parts}["free"]
    room = (1 << 20) - est.staging_bytes
    assert free.bytes == room and free.note == f"the automatic budget keeps {human_bytes(room)} free"
    roomy = estimate(gptoss, OffloadConfig(), DeviceChoice("simulated", 1 << 30))
    assert {p.key: p for p in roomy.device_parts}["free"].note == "the automatic budget keeps 512.0 MiB free"


def test_defaults_reset_the_budgets_but_keep_the_device(qapp, gptoss):
    from app.gui.budget_panel import BudgetPanel

    panel = BudgetPanel()
    panel.set_facts(gptoss, {"device": {"kind": "simulated", "capacity": 96 << 20},
                             "entries": {"device_expert_bytes": "35328", "placement": "static"}})
    assert panel.config().placement == "static"
    panel.reset_defaults()
    assert panel.device_settings() == {"kind": "simulated", "capacity": 96 << 20}
    assert panel.config() == OffloadConfig()


def test_settings_that_mean_nothing_without_a_device_are_not_offered_on_the_cpu(qapp, gptoss):
    """Placement, the layer split and where cold experts run were offered on 'CPU only', and Apply said they were
    applied, though every expert runs on the CPU there (as the device budgets, which the panel greys out)."""
    from app.gui.budget_panel import BudgetPanel

    panel = BudgetPanel()
    panel.set_facts(gptoss, {"device": {"kind": "cpu"}})
    device_only = (panel.placement, panel.layer_split, panel.decode_path, panel.expert_bytes)
    assert not any(control.isEnabled() for control in device_only)
    panel.set_settings({"device": {"kind": "simulated", "capacity": 1 << 30}})
    assert all(control.isEnabled() for control in device_only)


def test_the_kv_estimate_stops_at_the_models_context(qapp, gptoss):
    """The KV length took up to 10 million tokens whatever the model, and the estimate counted a KV cache the engine,
    which refuses a conversation past the context, never holds (a remembered 100,000 for a 2,048-token model)."""
    from app.gui.budget_panel import BudgetPanel

    panel = BudgetPanel()
    panel.set_facts(gptoss, {"device": {"kind": "cpu"}, "kv_tokens": 100_000})
    assert panel.kv_tokens.value() == gptoss.context_length == 2048
    host = {p.key: p.bytes for p in panel.last_estimate.host_parts}
    assert host["kv"] == gptoss.kv_cache_bytes(2048)


def test_the_kv_estimate_is_sized_for_search_max_length_below_the_context(qapp, copy_fixture):
    """onnxruntime-genai allocates the KV cache for search.max_length, which bounds every conversation: the model's
    summary, the window's estimate and its KV length counted the whole context (2,048 tokens) where it is 512."""
    from app.gui.budget_panel import BudgetPanel
    from app.gui.model_panel import ModelPanel

    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["search"]["max_length"] = 512
    (folder / "genai_config.json").write_text(json.dumps(config))
    opened = ModelFolder.open(folder)
    facts = model_facts(opened, inspection(opened))
    per_token = 2 * 2 * 32 * 4  # key + value, 2 kv heads x head size 32, fp32
    assert facts.kv_cache_bytes() == per_token * 512 + per_token * 64  # the full layer at 512 rows, the window's 64
    assert facts.kv_words() == "512 tokens (search.max_length, below the 2048-token context)"
    panel = BudgetPanel()
    panel.set_facts(facts, {"device": {"kind": "cpu"}, "kv_tokens": 2048})
    assert panel.kv_tokens.value() == panel.kv_tokens.maximum() == 512
    host = {p.key: (p.bytes, p.note) for p in panel.last_estimate.host_parts}
    assert host["kv"] == (facts.kv_cache_bytes(), "512 tokens (search.max_length, below the 2048-token context)")
    model_panel = ModelPanel()
    model_panel.show_facts(facts)
    assert model_panel.summary.text().endswith(
        f"KV cache {human_bytes(facts.kv_cache_bytes())} at search.max_length's 512 tokens (below the 2048-token "
        "context)")


def test_the_budget_panel_keeps_a_loaded_configurations_values_as_they_are(qtbot, gptoss):
    """Values onnxruntime accepts that the controls once rounded or capped (3 decimals, a threshold of at most 1, a
    wave of at most 4096 experts) are shown and applied as loaded, not rewritten as a change nobody made."""
    from app.gui.budget_panel import BudgetPanel

    entries = {"session.moe.offload.min_expert_weight": "0.0005", "session.moe.offload.tail_substitution_threshold":
               "2.5", "session.moe.offload.prefill_wave_experts": "5000", "session.moe.offload.cpu_threads": "2000"}
    settings = {"device": {"kind": "simulated", "capacity": 96 << 20}, "entries": entries}
    panel = BudgetPanel()
    qtbot.addWidget(panel)
    panel.set_facts(gptoss, settings)
    assert panel.config() == OffloadConfig.from_entries(entries) and panel.config().to_entries() == entries
    panel.mark_loaded(settings)
    assert not panel.dirty() and panel.applied_label.text() == "Applied to the loaded model"
    assert panel.min_weight.text() == "0.0005" and panel.tail_threshold.text() == "2.5"


def test_the_divergence_sentence_tells_a_near_tie_from_a_clear_difference():
    from app.gui.side_by_side_view import divergence_text

    assert divergence_text(None, None) == "The two answers are identical, token for token."
    tie = divergence_text(4, (0.068, 0.05))
    assert tie.startswith("The answers diverge at generated token 5 (index 4), highlighted in both columns. There A "
                          "preferred its token to B's by 0.068 in log-probability, and B its own to A's by 0.050: near "
                          "ties")
    assert "clearly different" in divergence_text(0, (0.41, 0.72))
    assert "near ties" not in divergence_text(0, (0.41, 0.05))
    assert divergence_text(3, None).endswith("highlighted in both columns.")


def test_bs_settings_refuse_one_key_given_two_values():
    """'device_expert_bytes=10' then 'device_expert_bytes=20' ran B with 20 and said nothing (a short and a full
    name for one setting were refused already: the engine's 'conflicting values for one setting')."""
    from app.gui.side_by_side_view import parse_entries
    from engine.errors import WorkbenchError

    with pytest.raises(WorkbenchError) as caught:
        parse_entries("device_expert_bytes=10\nplacement=static\ndevice_expert_bytes=20")
    assert str(caught.value) == ("line 3 of B's settings: device_expert_bytes=20, but line 1 gave it 10: one value "
                                 "a setting")
    with pytest.raises(WorkbenchError, match="^line 2 of B's settings: layer_split=spread, but line 1 gave it whole"):
        parse_entries("layer_split=whole\nlayer_split=spread")
    assert parse_entries("placement=static\nplacement=static  # again") == {"placement": "static"}


def test_side_by_side_compares_the_two_sides_speed_and_says_which_routing_each_used():
    from types import SimpleNamespace

    from app.gui.side_by_side_view import routing_text, speed_text

    def record(first_token_s, rate, scenario="side-by-side", agreement=None):
        timings = {"time_to_first_token_s": first_token_s, "decode_tokens_per_s": rate}
        return SimpleNamespace(turns=[{"timings": timings}], scenario=scenario,
                               approximate_routing=agreement is not None, routing_agreement=agreement, timings={})

    assert speed_text(record(0.012, 40.0), record(0.0034, 50.0)) == (
        "B gave its first token in 3.40 ms, A in 12.0 ms; B decoded at 1.25× A's rate (50.0 against 40.0 tok/s).")
    assert speed_text(record(0.01, 0.0), record(0.02, 0.0)) == "B gave its first token in 20.0 ms, A in 10.0 ms."
    at_once = "side-by-side, at once"
    assert speed_text(record(0.01, 40.0, at_once), record(0.01, 20.0, at_once)).endswith(
        "(20.0 against 40.0 tok/s), answering at once, each slowed by the other.")
    assert routing_text(record(0.01, 1.0)) == "exact"
    assert routing_text(record(0.01, 1.0, agreement=0.875)) == "approximate: 88% token agreement with exact routing"


def test_side_by_side_on_a_simulated_card_says_each_sides_projected_decode_rate_beside_the_measured(qapp):
    """On a simulated card (how the window has budgets compared without a GPU) every expert is computed on the CPU,
    so the measured decode rates of two budgets differ by noise: the columns and the comparison said only those, where
    the chat, the history and the sweep say the rate projected for the card as well."""
    from types import SimpleNamespace

    from app.gui.side_by_side_view import side_stats, speed_text

    def record(first_token_s, rate, projected):
        timings = {"time_to_first_token_s": first_token_s, "decode_tokens_per_s": rate}
        return SimpleNamespace(turns=[{"timings": timings, "generated_tokens": 12, "finish_reason": "length"}],
                               scenario="side-by-side", approximate_routing=False,
                               timings={"completion_s": 0.05, "projected": {"decode_tokens_per_s": projected}},
                               peaks={"device_bytes": 0},
                               offload={})

    a, b = record(0.034, 588.5, 621.8), record(0.017, 661.5, 1529.9)
    assert side_stats(a)["decode"] == "588.5 tok/s, projected 621.8 tok/s"
    assert speed_text(a, b) == (
        "B gave its first token in 17.0 ms, A in 34.0 ms; B decoded at 1.12× A's rate (661.5 against 588.5 tok/s); "
        "projected on the simulated card, B decodes at 2.46× A's rate (1529.9 against 621.8 tok/s).")
    one_token = record(0.034, 0.0, None)  # nothing decoded: no rate, measured or projected
    assert side_stats(one_token)["decode"] == "—"
    assert speed_text(one_token, b) == "B gave its first token in 17.0 ms, A in 34.0 ms."


def test_side_by_sides_columns_keep_how_each_answer_ended_once_the_comparison_ends(qapp):
    """While the answers streamed each column said how its answer ended ("stopped at the model's search.max_length
    (11 tokens)"); once the comparison ended that became the bare count ("11"), beside A's "50", and nothing said that
    B had run out of its model's sequence length rather than answered otherwise."""
    from types import SimpleNamespace

    from app.gui.side_by_side_view import side_stats
    from app.gui.side_streams import side_status

    def record(finish_reason, tokens):
        timings = {"time_to_first_token_s": 0.01, "decode_tokens_per_s": 40.0}
        return SimpleNamespace(turns=[{"timings": timings, "generated_tokens": tokens, "finish_reason": finish_reason}],
                               approximate_routing=False, timings={"completion_s": 0.3}, peaks={"device_bytes": None},
                               offload={})

    assert side_stats(record("max_length", 11))["tokens"] == "stopped at the model's search.max_length (11 tokens)"
    assert side_stats(record("length", 50))["tokens"] == "stopped at the length (50 tokens)"
    assert side_stats(record("eos", 1))["tokens"] == "done (1 token)"
    assert side_stats(record("cancelled", 1_234))["tokens"] == "stopped (1,234 tokens)"
    assert side_stats(record("eos", 7))["tokens"] == side_status(1, "eos", 7, 64)  # what it said as it ended, kept


def test_side_by_side_on_the_cpu_says_only_the_device_settings_b_changed_did_nothing():
    """A model loaded for the CPU with the Budgets panel's budget and placement kept in its entries: B as a copy of A
    with one more CPU thread was told "B's device_expert_bytes, placement changed nothing", settings B had not
    changed. Only the device settings where B differs from A are said."""
    from types import SimpleNamespace

    from app.gui.side_by_side_view import idle_settings_text

    def record(**entries):
        return SimpleNamespace(offload={"device": "cpu", "entries": {f"session.moe.offload.{key}": value
                                                                     for key, value in entries.items()}})

    a = record(device_expert_bytes="105984", placement="static")
    assert idle_settings_text(a, record(device_expert_bytes="105984", placement="static", cpu_threads="1")) == ""
    assert idle_settings_text(a, record(device_expert_bytes="0", placement="static")).startswith(
        " B's device_expert_bytes changed nothing: the model is loaded for the CPU, where every expert runs")
    assert idle_settings_text(a, record(device_expert_bytes="105984")).startswith(" B's placement changed nothing")


def test_side_by_side_on_the_cpu_says_bs_layer_split_or_decode_path_changed_nothing():
    """B's layer_split=whole or decode_path=tier beside an A loaded for the CPU ran every expert on the CPU as A did
    (its record: whole layers asked, the CPU path in force), and the comparison said nothing of it, where it says so
    of B's device_expert_bytes: the two answers read as whole layers or the host tier making no difference."""
    from types import SimpleNamespace

    from app.gui.side_by_side_view import idle_settings_text

    def record(split="spread", path="cpu"):
        return SimpleNamespace(offload={"device": "cpu", "entries": {}, "layer_split": {"mode": split},
                                        "decode_path": {"mode": path, "in_force": "cpu"}})

    assert idle_settings_text(record(), record()) == ""
    assert idle_settings_text(record(), record(split="whole")).startswith(
        " B's layer_split changed nothing: the model is loaded for the CPU, where every expert runs")
    assert idle_settings_text(record(), record(split="whole", path="tier")).startswith(
        " B's layer_split, decode_path changed nothing: ")


def test_side_by_sides_columns_show_each_sides_device_peak(qapp):
    """Each side's record measures its device's peak (history's "device peak"), yet the columns showed speed only:
    two budgets compared without what each held on the device. A side without a device says so."""
    from types import SimpleNamespace

    from app.gui.side_by_side_view import side_stats

    def record(device_bytes):
        timings = {"time_to_first_token_s": 0.01, "decode_tokens_per_s": 40.0}
        return SimpleNamespace(turns=[{"timings": timings, "generated_tokens": 8, "finish_reason": "length"}],
                               approximate_routing=False, timings={"completion_s": 0.3},
                               peaks={"device_bytes": device_bytes},
                               offload={})

    assert side_stats(record(671232))["device peak"] == "655.5 KiB"
    assert side_stats(record(None))["device peak"] == "no device: every expert on the CPU"


def test_side_by_side_explains_bs_budget_only_where_a_held_the_memory_it_lacked(qapp):
    """B's automatic budget is explained as computed beside A only where that made it smaller: not where B set its own
    budget, its gpu_device_mem_limit bounded what it had free (as it would alone), every expert fit anyway, or it saw
    as much free as A."""
    from dataclasses import replace

    from app.gui.side_by_side_view import budget_beside_a_text, budget_text
    from engine.records.side_by_side import SideBudget

    a = SideBudget(6 << 30, asked_bytes=None, free_bytes=7 << 30, leaves_cold=True, limited=False)
    b = SideBudget(1 << 30, asked_bytes=None, free_bytes=2 << 30, leaves_cold=True, limited=False)
    assert budget_text(b) == "1.0 GiB, automatic: of 2.0 GiB free"
    assert budget_text(replace(b, asked_bytes=1 << 30)) == "1.0 GiB, device_expert_bytes"
    assert budget_text(None) == "—"
    assert budget_beside_a_text((a, b)).startswith(
        " B's automatic expert budget, 1.0 GiB, was computed from the 2.0 GiB the device had free beside A, which "
        "stays loaded and holds its part of it (A's plan saw 7.0 GiB free)")
    for alone in (replace(b, asked_bytes=1 << 30), replace(b, limited=True), replace(b, leaves_cold=False),
                  replace(b, free_bytes=a.free_bytes)):
        assert budget_beside_a_text((a, alone)) == ""
    assert budget_beside_a_text((None, b)) == budget_beside_a_text((a, None)) == ""


def test_a_one_token_answer_shows_no_decode_rate(qapp):
    """One token is the prefill's: nothing was decoded, so there is no rate to show (the chat said '0.0 tok/s · 1
    tokens', the status bar 'Answered: 1 tokens, 0.0 tok/s', side by side 'decode 0.0 tok/s')."""
    from types import SimpleNamespace

    from app.gui.chat_panel import answered_text, stats_line
    from app.gui.side_by_side_view import side_stats

    one = {"time_to_first_token_s": 0.171, "decode_tokens_per_s": 0.0, "total_s": 0.17, "generated_tokens": 1,
           "prompt_tokens": 16}
    assert stats_line({"timings": one, "finish_reason": "length"}) == (
        "first token 171 ms · answered in 170 ms · 1 token · prompt 16 tokens · token limit")
    assert answered_text(one) == "Answered: 1 token"
    two = dict(one, decode_tokens_per_s=40.0, generated_tokens=2)
    assert stats_line({"timings": two, "finish_reason": "eos"}).startswith(
        "first token 171 ms · 40.0 tok/s · answered in 170 ms · 2 tokens · ")
    assert answered_text(two) == "Answered: 2 tokens, 40.0 tok/s"
    record = SimpleNamespace(turns=[{"timings": one, "generated_tokens": 1, "finish_reason": "length"}],
                             approximate_routing=False, timings={"completion_s": 0.17}, peaks={"device_bytes": None},
                             offload={})
    assert side_stats(record)["decode"] == "—" and side_stats(record)["tokens"] == "stopped at the length (1 token)"


def test_a_fast_answers_time_reads_in_three_figures():
    """The chat's line under an answer and side by side's total (now its completion) gave the answer's time to two
    decimals: a small model's answer of a few milliseconds read "0.00 s", where a record's line and the history give
    three figures under a second."""
    from types import SimpleNamespace

    from app.gui.chat_panel import stats_line
    from app.gui.side_by_side_view import side_stats

    fast = {"time_to_first_token_s": 0.0009, "decode_tokens_per_s": 2500.0, "total_s": 0.0022, "generated_tokens": 4,
            "prompt_tokens": 16}
    assert stats_line({"timings": fast, "finish_reason": "length"}).startswith(
        "first token 900 µs · 2500.0 tok/s · answered in 2.20 ms · 4 tokens · ")

    def completion(seconds: float) -> str:
        turn = {"timings": fast, "generated_tokens": 4, "finish_reason": "length"}
        return side_stats(SimpleNamespace(turns=[turn], approximate_routing=False, timings={"completion_s": seconds},
                                          peaks={"device_bytes": None}, offload={}))["completion"]
    assert (completion(0.0022), completion(12.345)) == ("2.20 ms", "12.35 s")


def test_side_by_sides_completion_is_the_runs_under_the_historys_name(qapp):
    """A column's "total" was its answer's time (the turn's total_s), the History's "completion" the run's (the
    record's completion_s, which counts the prompt's rendering and encoding too): one record, two names, two times.
    The column now gives the run's completion, under the History's name."""
    from types import SimpleNamespace

    from app.gui.history_view import HEADERS
    from app.gui.side_by_side_view import STATS, side_stats

    turn = {"timings": {"time_to_first_token_s": 0.01, "decode_tokens_per_s": 40.0, "total_s": 0.25},
            "generated_tokens": 8, "finish_reason": "length"}
    record = SimpleNamespace(turns=[turn], approximate_routing=False, timings={"completion_s": 0.3},
                             peaks={"device_bytes": None}, offload={})
    assert side_stats(record)["completion"] == "300 ms"
    assert "completion" in STATS and "completion" in HEADERS and "total" not in STATS


def test_the_window_gives_a_time_in_one_format_wherever_it_shows_one(qapp):
    """History gave a run's completion as "123 ms" while side by side gave the same record's as "0.123 s", and the
    chat's first token "1 ms" for 0.9 ms: every time in these views is units.duration_text's."""
    from types import SimpleNamespace

    from app.gui.chat_panel import stats_line
    from app.gui.record_report import fmt
    from app.gui.side_by_side_view import side_stats

    for seconds, text in ((0.123, "123 ms"), (0.0022, "2.20 ms"), (0.0009, "900 µs"), (0.9996, "1.00 s"),
                          (12.345, "12.35 s")):
        timings = {"time_to_first_token_s": seconds, "decode_tokens_per_s": 40.0, "total_s": seconds,
                   "generated_tokens": 2, "prompt_tokens": 4}
        record = SimpleNamespace(turns=[{"timings": timings, "generated_tokens": 2, "finish_reason": "length"}],
                                 approximate_routing=False, timings={"completion_s": seconds},
                                 peaks={"device_bytes": None}, offload={})
        stats = side_stats(record)
        line = stats_line({"timings": timings, "finish_reason": "length"})
        assert fmt(seconds, "s") == stats["completion"] == stats["first token"] == text
        assert line.startswith(f"first token {text} · 40.0 tok/s · answered in {text} · ")


def test_the_chats_answer_time_is_named_apart_from_a_runs_completion():
    """The chat's line gave its answer's time (the turn's total_s) with no word, which the README and the pane called
    "total", while History and side by side call a run's time (the record's completion_s) "completion": the line
    names the answer's own time."""
    from app.gui.chat_panel import stats_line

    timings = {"time_to_first_token_s": 0.1, "decode_tokens_per_s": 50.0, "total_s": 1.5, "generated_tokens": 8,
               "prompt_tokens": 4}
    parts = stats_line({"timings": timings, "finish_reason": "length"}).split(" · ")
    assert parts[2] == "answered in 1.50 s"
    assert not any(word in part for part in parts for word in ("total", "completion"))


def test_an_answers_agreement_with_exact_routing_says_of_how_many_tokens():
    from app.gui.chat_panel import stats_line

    timings = {"time_to_first_token_s": 0.1, "decode_tokens_per_s": 50.0, "total_s": 1.0, "generated_tokens": 8,
               "prompt_tokens": 4}
    line = stats_line({"timings": timings, "finish_reason": "length", "routing_agreement": 0.75})
    assert " · token agreement with exact routing 75% (6 of 8 tokens) · " in line


def test_a_saved_configuration_of_this_model_fills_the_budgets(qtbot, gptoss, tmp_path):
    from app.gui.budget_panel import BudgetPanel
    from engine.records.configurations import save_configuration

    path = tmp_path / "configurations.json"
    save_configuration("tight", gptoss.path, OffloadConfig(device_expert_bytes=70656, placement="static"),
                       note="sweep recommendation", path=path)
    save_configuration("other model", fixture_folder("lfm2moe"), OffloadConfig(device_expert_bytes=1), path=path)
    panel = BudgetPanel(configurations_path=path)
    qtbot.addWidget(panel)  # deleted at the test's end: a menu with Python slots left to the process's exit crashed it
    panel.set_facts(gptoss, {"device": {"kind": "simulated", "capacity": 96 << 20}})
    panel.saved_menu.aboutToShow.emit()
    actions = panel.saved_menu.actions()
    assert [a.text() for a in actions] == ["tight"] and actions[0].toolTip() == "sweep recommendation"
    assert panel.saved_menu.toolTipsVisible()  # a QMenu shows none unless told: the note (a sweep's split) was unseen
    actions[0].trigger()
    assert panel.config() == OffloadConfig(device_expert_bytes=70656, placement="static")
    assert panel.device_settings() == {"kind": "simulated", "capacity": 96 << 20}
    assert "2 of 16" in panel.layer_text.text()  # the estimate follows
    save_configuration("hand-edited", gptoss.path, OffloadConfig(), path=path)
    edited = json.loads(path.read_text())
    edited["hand-edited"]["entries"] = {"session.moe.offload.mode": "sometimes"}
    path.write_text(json.dumps(edited))
    panel.saved_menu.aboutToShow.emit()
    assert [(a.text(), a.isEnabled()) for a in panel.saved_menu.actions()] == [
        ("hand-edited: not usable, session.moe.offload.mode='sometimes': expected one of disabled, auto, required",
         False),
        ("tight", True)]
    empty = BudgetPanel(configurations_path=tmp_path / "none.json")
    qtbot.addWidget(empty)
    empty.set_facts(gptoss, None)
    empty.saved_menu.aboutToShow.emit()
    assert [(a.text(), a.isEnabled()) for a in empty.saved_menu.actions()] == [
        ("None saved for this model (Budget sweep ▸ Save as configuration)", False)]


def test_a_saved_configuration_sets_the_layer_split_and_decode_path_it_was_saved_with(qtbot, gptoss, tmp_path):
    """A configuration held onnxruntime's keys only: chosen in the Saved menu it left the panel's layer split and
    decode path as they were, not as the sweep ran it. It now sets them; one saved before they were kept leaves the
    panel's; a value no choice has makes it not usable, said in the menu."""
    from app.gui.budget_panel import BudgetPanel
    from engine.records.configurations import save_configuration

    path = tmp_path / "configurations.json"
    save_configuration("swept", gptoss.path, OffloadConfig(device_expert_bytes=70656), path=path,
                       own={"layer_split": "whole", "decode_path": "cpu"})
    save_configuration("older", gptoss.path, OffloadConfig(device_expert_bytes=0), path=path)
    panel = BudgetPanel(configurations_path=path)
    qtbot.addWidget(panel)
    panel.set_facts(gptoss, {"device": {"kind": "simulated", "capacity": 96 << 20}})
    panel.saved_menu.aboutToShow.emit()
    actions = {a.text(): a for a in panel.saved_menu.actions()}
    actions["swept"].trigger()
    assert panel.config() == OffloadConfig(device_expert_bytes=70656)
    assert (panel.settings()["layer_split"], panel.settings()["decode_path"]) == ("whole", "cpu")
    actions["older"].trigger()
    assert panel.config() == OffloadConfig(device_expert_bytes=0)
    assert (panel.settings()["layer_split"], panel.settings()["decode_path"]) == ("whole", "cpu")
    edited = json.loads(path.read_text())
    edited["swept"]["layer_split"] = "halves"
    path.write_text(json.dumps(edited))
    panel.saved_menu.aboutToShow.emit()
    assert [(a.text(), a.isEnabled()) for a in panel.saved_menu.actions()] == [
        ("older", True), ("swept: not usable, layer_split 'halves' is not one of auto, spread, whole", False)]


def test_saved_configurations_that_cannot_be_read_are_said_in_the_menu_not_shown_as_none_saved(qtbot, gptoss, tmp_path):
    """A damaged configurations.json read as 'None saved for this model (Budget sweep ▸ Save as configuration)': the
    user was sent to save one, which the sweep then refused over the same file."""
    from app.gui.budget_panel import BudgetPanel

    path = tmp_path / "configurations.json"
    path.write_text("{broken")
    panel = BudgetPanel(configurations_path=path)
    qtbot.addWidget(panel)
    panel.set_facts(gptoss, None)
    panel.saved_menu.aboutToShow.emit()
    assert [(a.text(), a.isEnabled()) for a in panel.saved_menu.actions()] == [
        (f"{path}: not readable as saved configurations (JSONDecodeError: Expecting property name enclosed in "
         "double quotes: line 1 column 2 (char 1))", False)]


def test_stopping_a_busy_engine_thread_waits_and_never_terminates_it(qapp):
    """Terminating the engine's thread inside native code (a first run's compilation) aborted the process: stop()
    says the thread is still busy, and run_gui then ends the process without destroying it (os._exit)."""
    import threading

    from PySide6.QtCore import QTimer

    from app.gui.engine_worker import WorkerThread

    engine = WorkerThread()
    busy, release = threading.Event(), threading.Event()
    QTimer.singleShot(0, engine.worker, lambda: (busy.set(), release.wait(10)))
    for _ in range(500):  # (5 s at most)
        if busy.wait(0.01):
            break
        qapp.processEvents()
    assert busy.is_set()
    assert engine.stop(wait_ms=100) is False and engine.thread.isRunning()
    release.set()
    assert engine.thread.wait(5000) and not engine.thread.isRunning()


@pytest.mark.parametrize("limited", [True, False], ids=["gpu_device_mem_limit", "no limit"])
def test_the_estimate_on_a_card_other_processes_use_plans_as_the_load(gptoss, monkeypatch, qtbot, limited):
    """Other processes hold 3 GiB of the card: the load's CudaDevice (a stand-in CuPy whose driver reports what they
    leave free) plans under gpu_device_mem_limit, which bounds this process only, and the budget panel, from NVML's
    total and others, shows the automatic budget and the experts per layer that the load then plans."""
    import contextlib
    import types

    from PySide6.QtWidgets import QLabel

    import app.gui.budget_panel as budget_panel
    import engine.offload.cuda_device as cuda_device
    from app.gui.estimate import staging_for
    from engine.offload.devices import Bandwidths
    from engine.offload.planner import AUTO_RESERVE_MIN, plan_offload

    slot, others = gptoss.experts[0].device_bytes_per_expert, 3 << 30
    staging = estimate(gptoss, OffloadConfig(), DeviceChoice("cuda", 8 << 30, others)).staging_bytes
    room = AUTO_RESERVE_MIN + staging + 5 * slot + slot // 2  # the automatic budget holds 5 experts
    total, limit = (8 << 30, room) if limited else (others + room, 0)
    config = OffloadConfig(gpu_device_mem_limit=limit)

    runtime = types.SimpleNamespace(memGetInfo=lambda: (total - others, total),
                                    getDeviceProperties=lambda index: {"name": b"test card"})
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime, Device=lambda i: contextlib.nullcontext(),
                                                            Stream=lambda non_blocking: object()),
                                 get_default_memory_pool=lambda: types.SimpleNamespace(free_all_blocks=lambda: None))
    monkeypatch.setattr(cuda_device, "_cupy", lambda: cupy)
    monkeypatch.setattr(cuda_device, "_measure_all", lambda cp: Bandwidths(pcie=50e9, hbm=3e12, cpu=100e9))
    monkeypatch.setattr(cuda_device, "_set_cap", lambda *args: None)
    monkeypatch.setattr(cuda_device, "_forget_cap", lambda *args: None)
    device = cuda_device.CudaDevice(0, mem_limit=limit)
    staging_for(config, gptoss.staged_nodes, device)  # the load takes its staging before it plans
    loaded = plan_offload(config, gptoss.experts, device)

    monkeypatch.setattr(budget_panel, "cuda_status", lambda: "")
    panel = budget_panel.BudgetPanel()
    qtbot.addWidget(panel)
    panel.set_gpu({"total": total, "others": others, "name": "test card"})
    panel.set_facts(gptoss, {"device": {"kind": "cuda"}, "entries": {"gpu_device_mem_limit": str(limit)}})
    est = panel.last_estimate
    assert est.plan.budget_bytes == loaded.budget_bytes
    assert [resident for _l, name, resident, _e in est.per_layer] == [loaded.slots[i.name] for i in gptoss.experts]
    assert QLabel.text(panel.layer_text) == "<b>5 of 16</b> experts resident: layer 0: 3 of 8; layer 1: 2 of 8"
    parts = {part.key: part.bytes for part in est.device_parts}
    assert sum(parts.values()) == total and parts["others"] == others
    assert ("limit" in parts) == limited and (", limit" in panel.vram_title.text()) == limited


def test_a_cuda_gpu_chosen_that_cannot_be_used_is_said_over_the_vram_not_taken_for_none_chosen(qtbot, gptoss,
                                                                                                 monkeypatch):
    from app.gui import budget_panel

    monkeypatch.setattr(budget_panel, "cuda_status", lambda: "the CUDA GPU needs CuPy")
    panel = budget_panel.BudgetPanel()
    qtbot.addWidget(panel)
    panel.set_facts(gptoss, {"device": {"kind": "cuda"}, "entries": {}})
    assert panel.device.currentData() == "cuda"
    assert panel.vram_title.text() == "VRAM — the CUDA GPU cannot be used"
    panel.device.setCurrentIndex(panel.device.findData("cpu"))
    panel.refresh()
    assert panel.vram_title.text() == "VRAM — no GPU device chosen"


def test_a_model_that_cannot_run_says_so_once(qapp, copy_fixture):
    """The verdict of a model with an unsupported expert node: 'Cannot run (...): 1 of 2 ...', not 'Cannot run (...):
    cannot run: 1 of 2 ...'."""
    from app.gui.model_panel import ModelPanel
    from tests.test_bad_input import _attribute, _edit_onnx, _qmoe

    folder = copy_fixture("gptoss")
    _edit_onnx(folder, lambda model: _attribute(_qmoe(model), "k", 9))
    opened = ModelFolder.open(folder)
    facts = model_facts(opened, inspection(opened))
    panel = ModelPanel()
    panel.show_facts(facts)
    panel.show_estimate(estimate(facts, OffloadConfig(), DeviceChoice()), "auto", "CPU only")
    assert "Cannot run (mode <b>auto</b>, CPU only): 1 of 2 expert nodes are unsupported" in panel.verdict.text()


def test_the_layer_bars_tooltip_counts_a_layers_slots_not_resident_experts(qapp):
    """Adaptive placement may leave some of a layer's slots to copied misses once loaded: the estimate's bars count
    slots, as the plan does ('6 expert slots for the 16 experts'), and say resident only where every expert is."""
    from app.gui.widgets import LayerBars

    bars = LayerBars()
    bars.setRows([(0, "/model/layers.0/moe", 1, 8), (1, "/model/layers.1/moe", 3, 8), (2, "/model/layers.2/moe", 8, 8)])
    assert [bars.tooltip_at(i) for i in range(3)] == [
        "layer 0: 1 expert slot for its 8 experts\n/model/layers.0/moe",
        "layer 1: 3 expert slots for its 8 experts\n/model/layers.1/moe",
        "layer 2: all 8 experts resident\n/model/layers.2/moe"]


def test_the_budget_panel_keeps_every_value_of_the_vocabulary_as_loaded(qtbot, gptoss):
    """Each value of tests/test_offload_vocabulary.py's table, and values onnxruntime takes that the controls capped or
    rounded (a substitution rank above 64 became 64, a threshold above 1e6 became 1e6, a weight below 5e-7 became 0:
    approximate routing silently off), comes out of the panel as it went in."""
    from app.gui.budget_panel import BudgetPanel
    from tests.test_offload_vocabulary import SAMPLES

    panel = BudgetPanel()
    qtbot.addWidget(panel)
    edges = [("tail_substitution_min_rank", "100"), ("tail_substitution_min_rank", "2147483647"),
             ("tail_substitution_threshold", "10000000"), ("tail_substitution_threshold", "3.4e38"),
             ("tail_substitution_threshold", "0.00000001"), ("min_expert_weight", "0.0000001"),
             ("min_expert_weight", "1e-45"), ("min_expert_weight", "0.123456789"), ("min_expert_weight", "1.00000001"),
             ("tail_substitution_threshold", "3.40282356e38")]
    for key, given in [(key, given) for key, given, _, _ in SAMPLES] + edges:
        entries = {key: given}
        panel.set_facts(gptoss, {"device": {"kind": "simulated", "capacity": 96 << 20}, "entries": entries})
        assert panel.config() == OffloadConfig.from_entries(entries), (key, given)
        assert OffloadConfig.from_entries(panel.settings()["entries"]) == OffloadConfig.from_entries(entries)
    panel.set_facts(gptoss, {"entries": {"min_expert_weight": "0.0000001", "tail_substitution_threshold": "3.4e38"}})
    assert panel.min_weight.text() == "0.0000001" and panel.tail_threshold.text() == "34" + "0" * 37


def test_bs_settings_keep_a_hash_inside_a_value():
    """B starts as a copy of A's entries, one KEY=VALUE a line, where '#' started a comment anywhere: A's
    popularity_file=/runs/#3/pop.json became B's '/runs/' (a folder, not A's file) and budget_group=team#2 'team'.
    A comment now starts at a line's start or after a space, and A's entries read back as they are."""
    from app.gui.side_by_side_view import entries_text, offload_entries, parse_entries

    loaded = OffloadConfig.from_entries({"popularity_file": "/runs/#3/pop.json", "budget_group": "team#2",
                                         "node_overrides": "/m/#0/QMoE:max_resident_slots=2"}).to_entries()
    assert parse_entries(entries_text(loaded)) == loaded
    assert offload_entries(parse_entries(entries_text(loaded))).to_entries() == loaded
    assert parse_entries("# B\nplacement=static # again\nmode=required\t# tab") == {"placement": "static",
                                                                                     "mode": "required"}


def test_bs_misspelt_layer_split_or_decode_path_is_said_with_the_setting_it_likely_meant():
    """B's settings take layer_split and decode_path beside onnxruntime's keys, but one misspelt (layer_splt) was
    refused with onnxruntime's keys as the known ones, neither of these among them, so nothing pointed at the typo."""
    from app.gui.side_by_side_view import parse_entries
    from engine.errors import WorkbenchError

    for given, meant in (("layer_splt=whole", "layer_split"), ("decode_pth=cpu", "decode_path"),
                         ("session.moe.offload.layer_split=whole", "layer_split")):
        with pytest.raises(WorkbenchError) as refused:
            parse_entries(given)
        key = given.partition("=")[0]
        assert str(refused.value) == f"B's settings: unknown offload key '{key}': did you mean '{meant}'?"
    with pytest.raises(WorkbenchError) as refused:
        parse_entries("seed=1")
    assert ", decode_path, " in str(refused.value) and ", layer_split, " in str(refused.value)


def test_streaming_slots_at_zero_are_off_not_a_value_onnxruntime_refuses(qapp, gptoss):
    """The Streaming slots slider's left end (or a typed 0) with 'off' unticked gave device_working_bytes=0, which
    onnxruntime refuses (bytes > 0) and so did Apply and the next load ('expected an integer >= 1'), while the
    estimate said nothing. No slots is off: the setting is left out."""
    from app.gui.budget_panel import BudgetPanel

    panel = BudgetPanel()
    panel.set_facts(gptoss, {"device": {"kind": "simulated", "capacity": 96 << 20}})
    panel.working_bytes.auto.setChecked(False)
    panel.working_bytes.slider.setValue(0)  # the left end is the first step (0 would be off, which the box says)
    assert panel.config().device_working_bytes == round(panel.working_bytes.maximum() / 1000)
    panel.working_bytes.text.setText("0")
    panel.working_bytes.text.editingFinished.emit()
    assert panel.working_bytes.auto.isChecked() and panel.config().device_working_bytes is None
    assert OffloadConfig.from_entries(panel.settings()["entries"]) == OffloadConfig()
    panel.working_bytes.auto.setChecked(False)
    panel.working_bytes.slider.setValue(1000)
    assert panel.config().device_working_bytes == panel.working_bytes.maximum()


def test_bs_settings_read_back_every_value_of_the_vocabulary_as_a_copy_of_as():
    from app.gui.side_by_side_view import entries_text, offload_entries, parse_entries
    from tests.test_offload_vocabulary import SAMPLES

    for key, given, _, _ in SAMPLES:
        config = OffloadConfig.from_entries({key: given})
        assert offload_entries(parse_entries(entries_text(config.to_entries()))) == config, (key, given)


def _card(total, used, this=0, per_process=True):
    """An NVML reading as engine.nvml.Nvml.sample gives it."""
    return {"name": "test card", "total": total, "used": used, "free": total - used, "this": this,
            "others": max(0, used - this), "util": 0.0, "top": [], "per_process": per_process}


def test_one_nvml_sample_that_fails_keeps_the_panels_last_reading(gptoss, monkeypatch, qtbot):
    """NVML failing for a single sample (Nvml.sample() None) set the CUDA choice's capacity to 0: the estimate jumped
    to a 0-byte card for that second. The last reading stays until NVML answers again, said to be stale once it stays
    away for a few samples."""
    import app.gui.budget_panel as budget_panel

    monkeypatch.setattr(budget_panel, "cuda_status", lambda: "")
    panel = budget_panel.BudgetPanel()
    qtbot.addWidget(panel)
    panel.set_gpu(_card(8 << 30, 1 << 30))
    panel.set_facts(gptoss, {"device": {"kind": "cuda"}})
    good = panel.last_estimate
    note = panel.device_note.text()
    assert good.capacity == 8 << 30 and not good.error
    panel.set_gpu(None)  # one sample NVML did not answer
    panel.refresh()
    est = panel.last_estimate
    assert est.capacity == 8 << 30 and not est.error and est.statements == good.statements
    assert [(p.key, p.bytes) for p in est.device_parts] == [(p.key, p.bytes) for p in good.device_parts]
    assert panel.device_note.text() == note
    for _ in range(budget_panel.STALE_GPU_SAMPLES - 1):
        panel.set_gpu(None)
    panel.refresh()
    assert panel.last_estimate.capacity == 8 << 30
    assert panel.device_note.text() == (f"{note} (stale: NVML has not answered for the last "
                                        f"{budget_panel.STALE_GPU_SAMPLES} samples; this is its last reading)")
    panel.set_gpu(_card(8 << 30, 2 << 30))  # it answers again
    panel.refresh()
    assert panel.device_note.text() == note
    assert {p.key: p.bytes for p in panel.last_estimate.device_parts}["others"] == 2 << 30


def test_where_the_driver_hides_per_process_vram_the_models_own_is_not_counted_as_other_processes(gptoss, monkeypatch,
                                                                                                   qtbot):
    """Without per-process figures NVML's 'others' is all the memory in use, the loaded model's own included: the
    estimate counted the model's VRAM once as other processes' and again as its own parts, so the free VRAM it showed
    was short by the model's own use. The model's own allocation, as the engine counts it, is taken off."""
    import app.gui.budget_panel as budget_panel

    monkeypatch.setattr(budget_panel, "cuda_status", lambda: "")
    panel = budget_panel.BudgetPanel()
    qtbot.addWidget(panel)
    total, others, own = 8 << 30, 1 << 30, 300 << 20
    panel.set_gpu(_card(total, others + own, per_process=False))
    panel.set_facts(gptoss, {"device": {"kind": "cuda"}})
    panel.mark_loaded(panel.settings())
    panel.set_own_vram(own)
    panel.refresh()
    shown = {p.key: p.bytes for p in panel.last_estimate.device_parts}
    alone = estimate(gptoss, panel.config(), DeviceChoice("cuda", total, others, "test card"), panel.kv_tokens.value())
    assert shown["others"] == others
    assert shown["free"] == {p.key: p.bytes for p in alone.device_parts}["free"]
    assert sum(shown.values()) == total
    notes = {p.key: p.note for p in panel.last_estimate.device_parts}
    assert notes["others"] == ("NVML's memory in use less this model's own as the engine counts it (the driver does "
                               "not say whose; its KV cache and onnxruntime's workspace are in it)")
    # a reading that names this process's memory (some processes listed with theirs) is not taken off twice
    panel.set_gpu(_card(total, others + own, this=own, per_process=False))
    panel.refresh()
    assert {p.key: p.bytes for p in panel.last_estimate.device_parts}["others"] == others
    # unloaded, the model holds nothing there: what is in use is others'
    panel.set_gpu(_card(total, others + own, per_process=False))
    panel.mark_loaded(None)
    assert {p.key: p.bytes for p in panel.last_estimate.device_parts}["others"] == others + own
    assert {p.key: p.note for p in panel.last_estimate.device_parts}["others"] == (
        "NVML's memory in use (the driver does not say whose)")


def test_the_budget_panels_other_vram_is_said_with_the_drivers_own_part(gptoss, monkeypatch, qtbot):
    """The VRAM breakdown's 'other processes 1.0 GiB, measured by NVML' held the driver's own 768 MiB beside the 256
    MiB another process held: right for planning (what the card leaves this one), wrong as a sentence about other
    processes. It is said as other processes' and the driver's, with NVML's parts."""
    import app.gui.budget_panel as budget_panel
    import engine.nvml as nvml
    from tests.test_nvml import DriverReserves

    monkeypatch.setattr(budget_panel, "cuda_status", lambda: "")
    monkeypatch.setattr(nvml, "pynvml", DriverReserves([(os.getpid(), 5 << 30), (os.getppid(), 256 << 20)], 768 << 20))
    panel = budget_panel.BudgetPanel()
    qtbot.addWidget(panel)
    panel.set_gpu(nvml.Nvml().sample())
    panel.set_facts(gptoss, {"device": {"kind": "cuda"}})
    others = {p.key: p for p in panel.last_estimate.device_parts}["others"]
    assert (others.label, others.bytes) == ("other processes and the driver", 1 << 30)
    assert others.note == "NVML: 256.0 MiB other processes', 768.0 MiB the driver's own reservations and the display's"


def test_the_models_own_vram_is_what_the_engine_allocated_not_the_dense_parts_caps():
    """What the worker tells the budget panel the loaded model holds on its CUDA GPU: the device's count (slots,
    staging, streaming) and the dense weights; the dense reservation under gpu_device_mem_limit counts caps (the
    arena's, the KV cache at full context), which are not taken as allocated."""
    import types

    from app.gui.engine_worker import own_device_bytes
    from engine.generation import DENSE_RESERVATION
    from engine.offload.device_memory import DeviceMemory

    memory = DeviceMemory(capacity=8 << 30, limit=4 << 30)
    memory.reserve(100 << 20, "prefill staging ring")
    memory.reserve(500 << 20, "expert slots of layer 0")
    memory.reserve(2 << 30, DENSE_RESERVATION)
    device = types.SimpleNamespace(kind="cuda", memory=memory)
    model = types.SimpleNamespace(folder=types.SimpleNamespace(dense_bytes=40 << 20),
                                  dense=types.SimpleNamespace(kind="cuda"))
    assert own_device_bytes(model, device) == (100 << 20) + (500 << 20) + (40 << 20)
    model.dense.kind = "cpu"
    assert own_device_bytes(model, device) == 600 << 20
    assert own_device_bytes(model, types.SimpleNamespace(kind="simulated", memory=memory)) == 0
    assert own_device_bytes(None, device) == 0 and own_device_bytes(model, None) == 0


def test_the_budget_panel_shows_the_settings_it_has_no_control_for_and_keeps_them(gptoss, qtbot):
    """node_overrides, async_max_tokens, allow_file_backing and the like were in force but shown nowhere, although
    the panel is said to show every setting: they are listed read-only in onnxruntime's key names, with their
    values, and a slider's change applies them as they were."""
    from PySide6.QtWidgets import QLabel

    from app.gui.budget_panel import OTHER_KEYS, BudgetPanel

    assert set(OTHER_KEYS) == {"node_overrides", "allow_file_backing", "async_max_tokens", "popularity_file",
                               "host_working_bytes", "budget_group", "source_root", "derived_cache_dir",
                               "skip_zero_cold_doorbell"}
    node = gptoss.experts[0].name
    entries = {"node_overrides": f"{node}:max_resident_slots=1", "async_max_tokens": "4",
               "budget_group": "team<2>"}
    panel = BudgetPanel()
    qtbot.addWidget(panel)
    panel.set_facts(gptoss, {"device": {"kind": "simulated", "capacity": 96 << 20}, "entries": entries})
    panel.mark_loaded(panel.settings())
    shown = re.sub("<[^>]+>", " ", QLabel.text(panel.other_settings)).replace("  ", " ")
    assert f"node_overrides = {node}:max_resident_slots=1" in shown
    assert "async_max_tokens = 4" in shown
    assert "budget_group = team&lt;2&gt; (kept for onnxruntime; no effect in this engine)" in shown
    assert "At their defaults: allow_file_backing=1, skip_zero_cold_doorbell=0" in shown
    assert "Not set: host_working_bytes, popularity_file, source_root, derived_cache_dir" in shown
    panel.expert_bytes.auto.setChecked(False)
    panel.expert_bytes.slider.setValue(panel.expert_bytes.slider.maximum() // 2)
    with qtbot.waitSignal(panel.applyRequested) as applied:
        panel.refresh()
        assert panel.apply_button.isEnabled()
        panel.apply_button.click()
    sent = OffloadConfig.from_entries(applied.args[0]["entries"])
    assert sent.node_overrides == OffloadConfig.from_entries(entries).node_overrides
    assert sent.async_max_tokens == 4 and sent.budget_group == "team<2>" and sent.device_expert_bytes is not None
    assert f"<b>node_overrides</b> = {node}:max_resident_slots=1" in QLabel.text(panel.other_settings)


def test_the_budget_panel_stops_using_a_popularity_file_and_keeps_every_other_setting(gptoss, qtbot, tmp_path):
    """A popularity file kept with the budgets (one moved since fails every load) could be taken out only by
    Defaults, which reset every budget too. Stop using the popularity file, shown beside it, takes out that key alone
    and says so; Apply sends the rest as they were."""
    from PySide6.QtWidgets import QLabel

    from app.gui.budget_panel import BudgetPanel

    popularity = tmp_path / "popularity.json"
    entries = {"placement": "static", "popularity_file": str(popularity), "device_expert_bytes": str(3 << 20),
               "async_max_tokens": "4", "cpu_threads": "2"}
    settings = {"device": {"kind": "simulated", "capacity": 96 << 20}, "entries": entries, "layer_split": "whole",
                "decode_path": "cpu"}
    panel = BudgetPanel()
    qtbot.addWidget(panel)
    panel.show()
    panel.set_facts(gptoss, settings)
    panel.mark_loaded(panel.settings())
    before = panel.settings()
    assert panel.clear_popularity_button.isVisible() and not panel.popularity_note.isVisible()
    panel.clear_popularity_button.click()
    after = panel.settings()
    assert after["entries"] == {k: v for k, v in before["entries"].items() if not k.endswith(".popularity_file")}
    assert len(after["entries"]) == len(before["entries"]) - 1
    assert {k: v for k, v in after.items() if k != "entries"} == {k: v for k, v in before.items() if k != "entries"}
    assert panel.popularity_note.isVisible() and panel.popularity_note.text() == (
        f"popularity_file {popularity} taken out, the other settings kept: Apply places the experts without it")
    assert not panel.clear_popularity_button.isVisible()
    assert "popularity_file" in QLabel.text(panel.other_settings).split("Not set: ")[1]
    assert panel.applied_label.text() == "Changed: not applied yet"
    with qtbot.waitSignal(panel.applyRequested) as applied:
        panel.apply_button.click()
    assert applied.args == [after, False]
    panel.mark_loaded(after)  # (what the window does once the engine took them)
    assert not panel.popularity_note.isVisible() and panel.applied_label.text() == "Applied to the loaded model"
    panel.mark_loaded(None)
    panel.set_settings(settings)  # not loaded: the next load is what goes without it
    panel.clear_popularity_button.click()
    assert panel.popularity_note.text() == (f"popularity_file {popularity} taken out, the other settings kept: the "
                                            "next load places the experts without it")


def test_a_cuda_gpu_without_an_nvml_reading_is_not_shown_as_a_0_byte_card(gptoss, monkeypatch, qtbot):
    """Before NVML's first reading, or where it gives none (a driver without NVML), the CUDA choice said 'CUDA GPU:
    0 B' and 'of the 0 B the device has free', as if the card had no memory. It says its memory is not known, and
    why, until a reading comes."""
    import app.gui.budget_panel as budget_panel

    monkeypatch.setattr(budget_panel, "cuda_status", lambda: "")
    panel = budget_panel.BudgetPanel()
    qtbot.addWidget(panel)
    panel.set_facts(gptoss, {"device": {"kind": "cuda"}})
    assert panel.device_note.text() == ("CUDA GPU: its memory is not known yet (NVML has given no reading); the "
                                        "estimate counts a card of 0 B, the load measures the card itself")
    panel.set_gpu(None, "no NVIDIA GPU (NVML Shared Library Not Found)")
    panel.refresh()
    assert panel.device_note.text() == ("CUDA GPU: its memory is not known yet (no NVIDIA GPU (NVML Shared Library "
                                        "Not Found)); the estimate counts a card of 0 B, the load measures the card "
                                        "itself")
    panel.set_gpu(_card(8 << 30, 1 << 30))
    panel.refresh()
    assert panel.device_note.text() == "test card: 8.0 GiB"


def test_the_approximate_routing_controls_say_what_they_do(qapp):
    """'…from rank' had the key's name alone for a tooltip, and 'Substitute below' left out that the weight decides:
    each says what it takes and what its values mean, as the engine applies them (engine/offload/approximate.py)."""
    from PySide6.QtWidgets import QLabel

    from app.gui.budget_panel import BudgetPanel

    panel = BudgetPanel()
    tips = {label.text(): label.toolTip() for label in panel.findChildren(QLabel)}
    assert tips["Drop below weight"] == (
        "min_expert_weight: drop each routed expert whose routing weight is below this, never a token's top-ranked "
        "one (with 'only cold experts', only those not resident); the others keep their weights, not renormalised. "
        "off = 0")
    assert tips["Substitute below"] == (
        "tail_substitution_threshold: a cold routed expert whose routing weight is below this, from the rank below "
        "on, is replaced by the resident expert the router scores highest among those it did not choose, with the "
        "same weight. off = 0")
    assert tips["…from rank"] == (
        "tail_substitution_min_rank: the first routing rank that may be substituted: 0 = a token's top-ranked expert "
        "too, 1 = from the second on (the default); below each expert node's top-k")


def test_the_approximate_routing_controls_that_narrow_another_are_offered_only_with_it(qapp):
    """'only cold experts' narrows what Drop below weight drops and '…from rank' where Substitute below substitutes:
    with those off they changed nothing, yet were offered. They are greyed out until the setting they narrow is on."""
    from app.gui.budget_panel import BudgetPanel

    panel = BudgetPanel()
    panel.device.setCurrentIndex(panel.device.findData("simulated"))
    panel.refresh()
    assert not panel.cold_only.isEnabled() and not panel.tail_rank.isEnabled()
    panel.min_weight.setValue(0.2)
    panel.refresh()
    assert panel.cold_only.isEnabled() and not panel.tail_rank.isEnabled()
    panel.tail_threshold.setValue(0.3)
    panel.refresh()
    assert panel.cold_only.isEnabled() and panel.tail_rank.isEnabled()
    # tail substitution puts a resident expert in a cold one's place: without a device none is resident (dropping
    # experts below a weight applies there too)
    panel.device.setCurrentIndex(panel.device.findData("cpu"))
    panel.refresh()
    assert panel.min_weight.isEnabled() and panel.cold_only.isEnabled()
    assert not panel.tail_threshold.isEnabled() and not panel.tail_rank.isEnabled()


def test_cpu_execution_is_offered_only_with_a_device(qapp):
    """CPU execution says whether cold experts may be computed on the CPU or are copied to the device: with CPU only
    every expert runs on the CPU, and the choice (offered all the same) changed nothing."""
    from app.gui.budget_panel import BudgetPanel

    panel = BudgetPanel()
    panel.device.setCurrentIndex(panel.device.findData("cpu"))
    panel.refresh()
    assert not panel.cpu_execution.isEnabled() and panel.threads.isEnabled()
    panel.device.setCurrentIndex(panel.device.findData("simulated"))
    panel.refresh()
    assert panel.cpu_execution.isEnabled()


def test_the_placement_summary_says_approximate_routings_counts_are_of_routed_experts(qapp):
    """'approximate routing: 12 dropped' left unsaid what was dropped: routed experts (k a token in each layer), not
    12 of the model's experts."""
    from app.gui.placement_view import PlacementView

    view = PlacementView()
    view.set_stats({"resident": np.array([[True, False]]), "traffic": np.ones((1, 2)), "valid": np.ones((1, 2), bool),
                    "placement": "adaptive", "layer_names": ["a/QMoE"], "layer_index": [0], "bytes_per_expert": [1024],
                    "layers": [{"hits": 30, "misses": 10, "swaps": 0}], "approximation": {"dropped": 12,
                                                                                         "substituted": 3}})
    assert view.summary.text().endswith(" · approximate routing: 12 routed experts dropped, 3 substituted")


def test_a_model_without_expert_nodes_says_onnxruntime_runs_all_of_it(qapp, copy_fixture):
    """A dense model (no QMoE / MoE node) runs, all of it in onnxruntime; its verdict read 'runs: all 0 expert nodes
    are supported by our CPU kernels' and, in the panel, 'every expert runs on the CPU'."""
    import onnx

    from app.gui.model_panel import ModelPanel
    from tests.test_bad_input import _edit_onnx

    def experts_to_identity(model):
        for node in model.graph.node:
            if node.op_type == "QMoE":
                node.CopyFrom(onnx.helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name))

    folder = copy_fixture("gptoss")
    _edit_onnx(folder, experts_to_identity)
    opened = ModelFolder.open(folder)
    report = inspection(opened)
    assert report["supported"] and report["verdict"] == "runs: no expert nodes: onnxruntime runs the whole model"
    panel = ModelPanel()
    panel.show_facts(model_facts(opened, report))
    panel.show_estimate(estimate(panel.facts, OffloadConfig(), DeviceChoice()), "auto", "CPU only")
    assert ("Runs (mode <b>auto</b>, CPU only): no expert nodes: onnxruntime runs the whole model."
            in panel.verdict.text())


def test_the_sweep_plots_svg_draws_its_axes_at_the_scale_of_its_points(qtbot, tmp_path):
    """The axes are pictures recorded at the window's 96 dpi; the SVG generator's own 72 dpi drew them, their ticks
    and labels at 3/4 of the curves' scale, so that the 414 KiB point sat above the axis's 550 and the recommended
    line beside the wrong value. Every group the SVG draws text in is at the curves' scale."""
    from app.sweep_plot import export_sweep_plot

    rows = [{"budget_bytes": budget, "fraction": budget / 847872, "split": None, "completion_s": completion,
             "decode_tokens_per_s": 800.0, "peak_device_bytes": 565248 + budget, "peak_rss_bytes": 550_000_000,
             "settle_steps": 0, "decode_path": "cpu"} for budget, completion in ((0, 0.057), (423936, 0.05),
                                                                                 (847872, 0.07))]
    svg = export_sweep_plot(rows, 423936, tmp_path / "sweep.svg").read_text()
    scales = {float(scale) for scale in re.findall(r'transform="matrix\(([-\d.]+),0,0,[-\d.]+,[-\d.]+,[-\d.]+\)"\s*'
                                                     r'font-family[^>]*>\s*<text', svg)}
    assert scales == {1.0}


def test_the_sweep_plot_file_says_what_its_red_line_is_off_the_simulated_device(qtbot, tmp_path, monkeypatch):
    """The file's red dashed line (the recommended budget) was said only on the simulated device ("red: recommended by
    the projected time"): a CUDA sweep's plot drew it on every panel with nothing to say what it was."""
    import pyqtgraph as pg

    from app.sweep_plot import export_sweep_plot

    titles = []
    plot = pg.PlotItem.plot
    monkeypatch.setattr(pg.PlotItem, "plot", lambda self, x, y, **kw: titles.append(self.titleLabel.text)
                        or plot(self, x, y, **kw))
    rows = [{"budget_bytes": budget, "fraction": budget / 847872, "split": None, "completion_s": 0.05,
             "decode_tokens_per_s": 800.0, "peak_device_bytes": 565248 + budget, "peak_rss_bytes": 550_000_000,
             "settle_steps": 0, "decode_path": "cpu"} for budget in (0, 847872)]
    export_sweep_plot(rows, 847872, tmp_path / "sweep.png")
    completion = next(title for title in titles if title.startswith("completion"))
    assert "red: the recommended budget" in completion


def test_the_sweep_plot_file_leaves_out_budgets_of_one_token_answers_from_its_decode_panel(qtbot, tmp_path,
                                                                                         monkeypatch):
    """`sweep --plot` drew a budget whose answers were one token each (no decode step after the prefill's token, no
    rate) at 0 tok/s, measured and projected, as if decoding had stalled there; the window's plot leaves it out and
    says so. The file's decode panel leaves it out too and its title says which budget, and why."""
    import pyqtgraph as pg

    from app.sweep_plot import export_sweep_plot

    drawn = []  # (panel title, y values) of every series drawn
    plot = pg.PlotItem.plot
    monkeypatch.setattr(pg.PlotItem, "plot", lambda self, x, y, **kw: drawn.append((self.titleLabel.text, list(y)))
                        or plot(self, x, y, **kw))
    rows = [{"budget_bytes": budget, "fraction": budget / 847872, "split": None, "completion_s": 0.05,
             "decode_tokens_per_s": rate, "peak_device_bytes": 565248 + budget, "peak_rss_bytes": 550_000_000,
             "settle_steps": 0, "decode_path": "cpu", "projected_completion_s": 0.01,
             "projected_decode_tokens_per_s": rate and 2 * rate} for budget, rate in ((0, None), (847872, 800.0))]
    export_sweep_plot(rows, 847872, tmp_path / "sweep.png")
    decode = [(title, values) for title, values in drawn if title.startswith("decode")]
    assert [values for _title, values in decode] == [[800.0], [1600.0]]
    assert decode[0][0].startswith("decode<br>") and "left out, one-token answers: 0 B</span>" in decode[0][0]
    assert [values for title, values in drawn if title.startswith("completion")] == [[0.05, 0.05], [0.01, 0.01]]


def test_under_offload_disabled_the_estimate_says_once_that_the_dense_part_runs_on_the_cpu(gptoss):
    """mode=disabled on the simulated GPU: the plan's sentence says the dense part runs on the CPU and why, and the
    estimate said it again in its own words after it."""
    est = estimate(gptoss, OffloadConfig(mode="disabled"), DeviceChoice("simulated", 1 << 30))
    assert est.statements == ["All experts run on the CPU: offload is disabled, and the dense part runs on the CPU "
                              "(the GPU is simulated, for the experts only)."]
    # under mode=auto the plan says where the experts go, the estimate where the dense part runs
    auto = estimate(gptoss, OffloadConfig(), DeviceChoice("simulated", 1 << 30))
    assert auto.statements[-1] == "The dense part would run on the CPU: the GPU is simulated, for the experts only."


@pytest.mark.parametrize("path", ["tier", "both"])
def test_offload_disabled_makes_no_host_tier_whatever_decode_path_is_asked(gptoss, path):
    """mode=disabled runs every expert where the dense part runs (here the CPU). Asking the decode path 'tier' or
    'both' still pinned a host tier of every expert and decoded by reading them on the (simulated) GPU, while the plan
    said 'All experts run on the CPU: offload is disabled'; the budget panel showed that tier in host memory too."""
    from engine.generation import LoadedModel
    from engine.offload import SimulatedDevice
    from engine.offload import decode_path as paths

    config = OffloadConfig(mode="disabled")
    est = estimate(gptoss, config, DeviceChoice("simulated", 1 << 30))
    made, said = paths.tier_verdict(path, config, gptoss.experts, est.plan.slots, "simulated", 100 << 30)
    assert not made and said == ("No host tier is made: offload is disabled, so every expert runs where the dense "
                                 f"part runs (decode path '{path}' does not apply).")
    device = SimulatedDevice(1 << 30, name="simulated GPU, 1.0 GiB")
    engine = LoadedModel.open(fixture_folder("gptoss"), offload=config, device=device, decode_path=path).offload
    assert engine.decode_path_in_force == "cpu" and "host_tier_bytes" not in engine.pinned_info()
    assert engine.plan.statements == ["All experts run on the CPU: offload is disabled, and the dense part runs on "
                                      "the CPU (the GPU is simulated, for the experts only).", said]
    assert est.plan.statements == engine.plan.statements[:1]


def test_apply_keeps_the_automatic_budget_the_load_gave_beside_a_dense_part_held_under_the_limit(gptoss):
    """Under gpu_device_mem_limit a dense part on the GPU reserves what the plan left (the automatic budget's reserve
    and the slots' leftover: LoadedModel's DENSE_RESERVATION). A re-plan took the reserve again from what remained, so
    Apply with the automatic budget dropped to 0 slots where the load, and the panel's estimate, held all 16. The
    dense reservation is now counted as that reserve. (The dense part is put on the simulated GPU by hand, as the load
    does on a CUDA GPU.)"""
    from engine.generation import DENSE_RESERVATION, LoadedModel
    from engine.offload import SimulatedDevice

    config = OffloadConfig(gpu_device_mem_limit=1 << 30)
    choice = DeviceChoice("simulated", 2 << 30)
    device = SimulatedDevice(2 << 30, mem_limit=1 << 30, name=choice.label)
    engine = LoadedModel.open(fixture_folder("gptoss"), offload=config, device=device).offload
    estimated = [r for _l, _n, r, _e in estimate(gptoss, config, choice).per_layer]
    assert estimated == [engine.plan.slots[info.name] for info in engine.infos] == [8, 8]
    device.memory.reserve(device.memory.available, DENSE_RESERVATION)
    engine.reconfigure(config.updated(placement="static"))
    assert [engine.plan.slots[info.name] for info in engine.infos] == estimated
    # a reserve larger than the dense part holds still leaves fewer slots
    engine.reconfigure(config.updated(reserve_device_bytes=(1 << 30) - 100 * 1024))
    assert sum(engine.plan.slots.values()) < 16


def test_an_estimate_whose_parts_overfill_the_card_says_so_with_the_numbers(gptoss, monkeypatch):
    """Without gpu_device_mem_limit nothing checks that the dense part, its KV cache at the longest sequence, the
    expert slots and the staging ring fit the card together (the load puts the dense part there all the same). The
    estimate showed 2.7 MiB of parts on a 2.5 MiB card with 0 B free and no word of it."""
    from engine import ort_env

    monkeypatch.setattr(ort_env, "cuda_ep_missing_reason", lambda: None)
    monkeypatch.setattr(ort_env, "kv_dtype_reason", lambda kv_dtypes: None)
    card = DeviceChoice("cuda", 5 << 19, name="test card")
    est = estimate(gptoss, OffloadConfig(reserve_device_bytes=0), card)
    parts = {p.key: p.bytes for p in est.device_parts}
    need = parts["experts"] + parts["dense"] + parts["kv"] + parts["workspace"]
    assert need == 2845568 > 5 << 19 and parts["free"] == 0 and not est.error
    assert est.statements[-1] == (
        "Together these need 2.7 MiB of the test card, more than the 2.5 MiB it has for this model: the dense part and "
        "its KV cache at 2048 tokens would not fit beside the experts (a larger reserve_device_bytes or a smaller "
        "device_expert_bytes leaves them room; gpu_device_mem_limit makes the load keep the dense part on the CPU "
        "where it does not fit).")
    # mode=disabled applies no expert budget (every expert goes beside the dense part): device_expert_bytes not said
    disabled = estimate(gptoss, OffloadConfig(mode="disabled", reserve_device_bytes=0),
                        DeviceChoice("cuda", 2 << 20, name="test card"))
    assert not disabled.error and disabled.plan.placement_mode == "all_resident", disabled.statements
    assert disabled.statements[-1] == (
        "Together these need 2.2 MiB of the test card, more than the 2.0 MiB it has for this model: the dense part and "
        "its KV cache at 2048 tokens would not fit beside the experts (mode=auto keeps the experts that do not fit "
        "beside it on the CPU; gpu_device_mem_limit makes the load keep the dense part, and every expert with it, on "
        "the CPU where it does not fit).")
    # nor a larger reserve_device_bytes: every expert still goes on the card, now refused beside the larger reserve
    parts = {p.key: p.bytes for p in disabled.device_parts}
    reserved = estimate(gptoss, OffloadConfig(mode="disabled", reserve_device_bytes=parts["dense"] + parts["kv"]),
                        DeviceChoice("cuda", 2 << 20, name="test card"))
    assert reserved.error.startswith("offload mode 'disabled' keeps every expert where the dense part runs")
    roomy = estimate(gptoss, OffloadConfig(), DeviceChoice("cuda", 3 << 20, name="test card"))
    assert not any(s.startswith("Together these need") for s in roomy.statements)


def test_tab_moves_on_from_the_side_by_side_boxes_as_from_the_chats(qtbot):
    """Tab in the side-by-side prompt or B's settings typed a tab character into them (the keyboard could leave them
    only with Ctrl+Tab), where the chat's boxes move the focus on."""
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QApplication

    from app.gui.side_by_side_view import SideBySideView

    view = SideBySideView()
    qtbot.addWidget(view)
    view.show()
    qtbot.waitExposed(view)
    view.activateWindow()
    for box in (view.prompt, view.right_entries):
        box.setPlainText("text")
        box.setFocus()
        qtbot.waitUntil(box.hasFocus)
        qtbot.keyClick(box, Qt.Key.Key_Tab)
        assert box.toPlainText() == "text" and QApplication.focusWidget() is not box


def test_a_side_by_side_columns_answer_and_statistics_are_named_by_its_title_now(qtbot):
    """A column's answer and statistics kept the names of its first title for a screen reader ('B: modified decode')
    where the column said 'B: lfm2moe · same settings' (a B of another model, A's settings). They follow its title."""
    from app.gui.side_by_side_view import SideBySideView

    view = SideBySideView()
    qtbot.addWidget(view)
    view.set_loaded("/models/gptoss", {})
    view.prompt.setPlainText("Hello")
    view.right_folder.setText("/models/lfm2moe")
    view.run()
    assert (view.left.title(), view.right.title()) == ("A: gptoss as loaded", "B: lfm2moe · same settings")
    for column in (view.left, view.right):
        assert column.accessibleName() == column.title()
        assert column.answer.accessibleName() == f"{column.title()} answer"
        assert [label.accessibleName() for label in column.values.values()] == [
            f"{column.title()} {name}" for name in column.values]


def test_the_budget_panels_statements_show_angle_brackets_and_ampersands_as_written(qapp, gptoss):
    """The statements went into a rich-text label unescaped: a node name with '<' (or an NVRTC error naming
    std::vector<int>, a folder with '&') read as a tag, and the label lost the text from there on."""
    from app.gui.budget_panel import BudgetPanel
    from PySide6.QtGui import QTextDocument

    panel = BudgetPanel()
    panel.set_facts(gptoss, {"device": {"kind": "simulated", "capacity": 1 << 30},
                             "entries": {"node_overrides": "vector<int>&x:max_resident_slots=1"}})
    assert panel.last_estimate.error.startswith("node_overrides names 'vector<int>&x', which is no expert node")
    shown = QTextDocument()
    shown.setHtml(panel.statements.text())
    assert shown.toPlainText().startswith("node_overrides names 'vector<int>&x', which is no expert node"), \
        shown.toPlainText()


def test_the_budget_panel_promises_the_layer_split_trials_only_where_the_engine_runs_them(qapp, gptoss):
    """The engine times the budget on whole layers only without a host tier (OffloadEngine.trials_pending: a layer
    read from the tier has no host round trip to save); under decode path 'tier' (and 'auto', the default, which makes
    the tier on a GPU) the panel still said "While decoding, the engine also tries this budget on whole layers"."""
    from app.gui.budget_panel import BudgetPanel
    from engine.generation import LoadedModel
    from engine.offload import SimulatedDevice

    slot = gptoss.experts[0].device_bytes_per_expert
    panel = BudgetPanel()
    tries = ("While decoding, the engine also tries this budget on whole layers (1 of 2 layers keeping all their "
             "experts)")
    for path, promised in (("cpu", True), ("tier", False)):
        panel.set_facts(gptoss, {"device": {"kind": "simulated", "capacity": 1 << 30}, "decode_path": path,
                                 "entries": {"device_expert_bytes": str(8 * slot)}})
        config = panel.config()
        engine = LoadedModel.open(fixture_folder("gptoss"), offload=config, device=SimulatedDevice(1 << 30),
                                  decode_path=path, layer_split="auto").offload
        assert panel.last_estimate.host_tier == engine.host_tier == (path == "tier")
        assert engine.trials_pending == promised  # no other trial under the cpu path or 'tier' at load
        assert (tries in panel.statements.text()) == promised, (path, panel.statements.text())


def test_the_decode_path_and_working_memory_tooltips_say_what_the_host_tier_takes_and_leaves():
    """The decode path's tooltip counted the host tier in host memory alone, where its device mappings take a 2 MiB
    granule a slot array even at no slot (32 MiB for a two-layer model at a budget of 0); device_working_bytes' said
    its slots let slotless layers' misses go over PCIe, where under the tier the GPU reads those experts itself."""
    from app.gui.budget_panel import PATH_TIP, WORKING_TIP

    assert ("its device mappings round each slot array up to the 2.0 MiB granule, one granule even with no slot"
            in PATH_TIP)
    assert "Used where decode computes cold experts on the CPU: under the host tier the GPU reads those" in WORKING_TIP


def test_a_cells_tooltip_follows_the_live_updates_while_it_shows(qtbot):
    """The tooltip was written when the mouse moved: live while generating, a cell that placement made resident (blue)
    went on saying 'cold' with the counts of that moment, and a tooltip left over a model unloaded named its layer. It
    now says the cell's data again at every update, and goes where the cell does."""
    from PySide6.QtCore import QEvent, QPointF, Qt
    from PySide6.QtGui import QMouseEvent
    from PySide6.QtWidgets import QToolTip

    from app.gui.placement_view import Heatmap

    heatmap = Heatmap()
    heatmap.resize(600, 200)
    heatmap.show()

    def update(resident: bool, hits: int) -> None:
        heatmap.set_data({"resident": np.array([[resident, False]]), "traffic": np.ones((1, 2), np.float32),
                          "valid": np.ones((1, 2), bool), "placement": "adaptive", "layer_names": ["a/QMoE"],
                          "layer_index": [0], "bytes_per_expert": [1024],
                          "layers": [{"hits": hits, "misses": 1, "swaps": 0, "expert_hits": np.array([hits, 0]),
                                      "expert_misses": np.array([1, 0])}]})

    update(False, 0)
    where = QPointF(Heatmap.LEFT + 2, Heatmap.TOP + 2)  # expert 0
    heatmap.mouseMoveEvent(QMouseEvent(QEvent.Type.MouseMove, where, heatmap.mapToGlobal(where),
                                       Qt.MouseButton.NoButton, Qt.MouseButton.NoButton,
                                       Qt.KeyboardModifier.NoModifier))
    assert QToolTip.isVisible() and QToolTip.text().splitlines()[0] == (
        "Layer 0, expert 0: cold (a miss runs on the CPU, or is copied into a spare slot)")
    update(True, 7)  # placement copied expert 0 in, and routing hit it 7 times since
    assert QToolTip.text().splitlines()[0] == "Layer 0, expert 0: resident on the device"
    assert QToolTip.text().splitlines()[3] == "This expert: 7 hits, 1 miss (routed tokens, counted exactly)"
    heatmap.set_data(None)  # unloaded
    qtbot.waitUntil(lambda: not QToolTip.isVisible(), timeout=2000)  # (Qt hides a tooltip after 300 ms)


def qwen3_30b_like_stats(layers: int = 48, experts: int = 128) -> dict:
    """Placement stats of a 48-layer, 128-expert model (Qwen3-30B-A3B's shape): in every layer experts 0, 1, 8, 9,
    16, 17, ... resident, expert e routed e % 7 times, and hit or missed that many times as it is resident or cold."""
    expert = np.arange(experts)
    resident = np.broadcast_to(expert % 8 < 2, (layers, experts)).copy()
    routed = (expert % 7).astype(np.int64)
    return {"resident": resident, "traffic": np.broadcast_to(routed.astype(np.float32), (layers, experts)).copy(),
            "valid": np.ones((layers, experts), bool), "placement": "adaptive",
            "layer_names": [f"/model/layers.{i}/moe/QMoE" for i in range(layers)], "layer_index": list(range(layers)),
            "bytes_per_expert": [1 << 20] * layers, "slots": [experts // 4] * layers,
            "layers": [{"hits": int(routed[expert % 8 < 2].sum()), "misses": int(routed[expert % 8 >= 2].sum()),
                        "swaps": 0, "expert_hits": np.where(expert % 8 < 2, routed, 0),
                        "expert_misses": np.where(expert % 8 < 2, 0, routed)} for _ in range(layers)]}


def test_a_dock_too_narrow_for_every_expert_puts_several_in_a_cell_and_says_so(qtbot):
    """Cells were as wide as the width allowed, clamped to 1 pixel: in the narrowest dock a 128-expert model's were 2
    pixels, too narrow to point at, and more experts than pixels ran past the widget, cut off unsaid. A cell now
    holds as many experts as it takes for each to be 3 pixels wide or more: every expert of every layer is in exactly
    one cell, the view says how many a cell holds, and a cell's tooltip names its experts. Wide enough, a cell is one
    expert, as before."""
    from PySide6.QtCore import QEvent, QPointF, Qt
    from PySide6.QtGui import QMouseEvent
    from PySide6.QtWidgets import QToolTip, QVBoxLayout, QWidget

    from app.gui.placement_view import Heatmap, PlacementView

    dock = QWidget()  # (a top-level view would keep a wider size)
    qtbot.addWidget(dock)
    view = PlacementView()
    QVBoxLayout(dock).addWidget(view)
    dock.resize(200, 400)  # as narrow as the view goes
    dock.show()
    qtbot.waitExposed(dock)
    view.set_stats(qwen3_30b_like_stats())
    heatmap = view.heatmap

    def cells() -> list[list[tuple[int, int]]]:
        """Each layer's cells, left to right, as the mouse finds them: (first expert, last expert)."""
        rows, columns, cw, ch = heatmap._grid()
        assert heatmap.LEFT + columns * cw <= heatmap.width() - heatmap.RIGHT  # the whole grid in the widget
        found = [[heatmap.cell_at(heatmap.LEFT + c * cw + cw / 2, heatmap.TOP + r * ch + ch / 2)
                  for c in range(columns)] for r in range(rows)]
        assert all(cell[0] == r for r, row in enumerate(found) for cell in row)
        return [[cell[1:] for cell in row] for row in found]

    per = heatmap.experts_a_cell()
    rows, columns, cw, ch = heatmap._grid()
    assert heatmap.width() < 400 and per > 1 and cw >= Heatmap.MIN_CELL
    found = cells()
    assert len(found) == 48
    for row in found:  # every expert in exactly one cell, in order
        assert [e for first, last in row for e in range(first, last + 1)] == list(range(128))
        assert all(last - first + 1 == per for first, last in row[:-1])
    assert view.cells.text() == f"{per} experts a cell, shaded by the share on the device"
    view.traffic.setChecked(True)
    assert view.cells.text() == f"{per} experts a cell, coloured as its most routed"
    view.residency.setChecked(True)

    first, last = found[5][1]  # layer 5's second cell: experts per to 2 per - 1
    assert (first, last) == (per, 2 * per - 1)
    tooltip = heatmap.tooltip_at(5, first, last).splitlines()
    on = [e for e in range(first, last + 1) if e % 8 < 2]
    cold = [e for e in range(first, last + 1) if e % 8 >= 2]
    words = "; ".join(words for words, group in (
        ("resident on the device: " + ", ".join(map(str, on)), on),
        ("cold (a miss runs on the CPU, or is copied into a spare slot): " + ", ".join(map(str, cold)), cold)) if group)
    assert tooltip[0] == f"Layer 5, experts {first}-{last}: {words}"
    hottest = max(range(first, last + 1), key=lambda e: (e % 7, -e))
    assert tooltip[1].startswith(f"Recent routing, most in the cell, expert {hottest}: {hottest % 7:.2f} (")
    assert tooltip[2] == "Expert size: 1.0 MiB each"
    hits, misses = sum(e % 7 for e in on), sum(e % 7 for e in cold)
    assert tooltip[3] == (f"These {per} experts: {hits} hit{'s' * (hits != 1)}, {misses} miss{'es' * (misses != 1)} "
                          "(routed tokens, counted exactly)")
    # the mouse over that cell shows that tooltip
    where = QPointF(heatmap.LEFT + cw + cw / 2, heatmap.TOP + 5 * ch + ch / 2)
    heatmap.mouseMoveEvent(QMouseEvent(QEvent.Type.MouseMove, where, heatmap.mapToGlobal(where),
                                       Qt.MouseButton.NoButton, Qt.MouseButton.NoButton,
                                       Qt.KeyboardModifier.NoModifier))
    assert QToolTip.text().splitlines()[0] == tooltip[0]
    QToolTip.hideText()

    dock.resize(1200, 400)  # wide: one expert a cell, said nowhere
    qtbot.waitUntil(lambda: heatmap.width() > 1000)
    assert heatmap.experts_a_cell() == 1 and view.cells.text() == ""
    assert cells() == [[(e, e) for e in range(128)]] * 48
    assert heatmap.tooltip_at(5, 9).splitlines()[:4] == [
        "Layer 5, expert 9: resident on the device", "Recent routing: 2.00 (decayed routing count, ~10 steps)",
        "Expert size: 1.0 MiB", "This expert: 2 hits, 0 misses (routed tokens, counted exactly)"]


def test_a_dock_too_short_for_every_layer_scrolls_to_rows_the_mouse_can_point_at(qtbot):
    """Rows were as high as the heatmap's height over the layer count, clamped to 1 pixel: a 48-layer model in a short
    dock got 1-pixel rows no mouse can point at, and more layers than pixels ran past the widget, cut off unsaid. The
    heatmap now asks for 3 pixels a row, the view scrolls to every layer and says so; tall enough, it does not."""
    from PySide6.QtCore import QPoint
    from PySide6.QtWidgets import QVBoxLayout, QWidget

    from app.gui.placement_view import Heatmap, PlacementView

    dock = QWidget()
    qtbot.addWidget(dock)
    view = PlacementView()
    QVBoxLayout(dock).addWidget(view)
    dock.resize(900, 150)
    dock.show()
    qtbot.waitExposed(dock)
    view.set_stats(qwen3_30b_like_stats())
    heatmap, bar = view.heatmap, view.scroll_area.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0)
    rows, columns, cw, ch = heatmap._grid()
    assert rows == 48 and ch >= Heatmap.MIN_CELL and heatmap.TOP + rows * ch <= heatmap.height()
    assert view.scroll_area.viewport().height() < heatmap.height()
    assert view.cells.isVisibleTo(view) and view.cells.text() == "scroll for all 48 layers"
    bar.setValue(bar.maximum())  # the last layer: in sight, and its row the mouse's
    last = heatmap.mapTo(view.scroll_area.viewport(), QPoint(heatmap.LEFT + 1, heatmap.TOP + 47 * ch + ch // 2))
    assert 0 <= last.y() < view.scroll_area.viewport().height()
    assert heatmap.cell_at(heatmap.LEFT + 1, heatmap.TOP + 47 * ch + ch / 2) == (47, 0, 0)

    dock.resize(900, 800)  # tall enough: every layer in sight, nothing to say
    qtbot.waitUntil(lambda: bar.maximum() == 0)
    assert not view.cells.isVisibleTo(view) and view.cells.text() == ""


def test_no_expert_number_in_the_heatmaps_header_runs_past_the_grid_into_the_hits_heading(qapp):
    """The header numbered every few cells in a box wider than the cells it labels: at 4 pixels a cell a 128-expert
    grid's last number, 126, ran past the grid's edge into the layers' hit-rate heading, '126hits', which read as a
    count of hits. A number that would pass the grid's edge is left out."""
    from PySide6.QtGui import QFontMetricsF

    from app.gui.placement_view import Heatmap

    heatmap = Heatmap()
    heatmap.resize(Heatmap.LEFT + Heatmap.RIGHT + 4 * 128 + 3, 200)
    stats = qwen3_30b_like_stats(layers=1)
    heatmap.set_data(stats)
    rows, cells, cw, ch = heatmap._grid()
    assert (cells, cw) == (128, 4)
    metrics = QFontMetricsF(heatmap.label_font())
    labels = heatmap.column_labels(metrics)
    assert [number for _, number in labels] == [str(6 * i) for i in range(21)]  # 0, 6, ..., 120: not 126
    assert all(x + metrics.horizontalAdvance(number) <= heatmap.LEFT + cells * cw for x, number in labels)


def thin_rowed_heatmap(monkeypatch, drawn: list):
    """A Heatmap of qwen3_30b_like_stats, 3 pixels a row, layer r hitting r% of 100 routed tokens, painted once with
    every drawText(rect, flags, text) and drawLine(from, to) in `drawn`, as (what, args)."""
    from PySide6.QtGui import QPainter

    from app.gui import placement_view
    from app.gui.placement_view import Heatmap

    class Recording(QPainter):
        def drawText(self, *args):
            drawn.append(("text", args))
            super().drawText(*args)

        def drawLine(self, *args):
            drawn.append(("line", args))
            super().drawLine(*args)

    monkeypatch.setattr(placement_view, "QPainter", Recording)
    heatmap = Heatmap()
    heatmap.resize(600, Heatmap.TOP + 48 * Heatmap.MIN_CELL + 2)
    stats = qwen3_30b_like_stats()
    for r, layer in enumerate(stats["layers"]):
        layer.update(hits=r, misses=100 - r)
    heatmap.set_data(stats)
    heatmap.grab()
    return heatmap


def test_a_thin_rows_label_and_hit_rate_sit_on_their_own_row_with_a_tick(qapp, monkeypatch):
    """With rows thinner than a label, every few rows are labelled, each label centred in a 12-pixel box from its row's
    top: at 3 pixels a row, layer 0's number and hit rate sat on layer 2's row, layer 4's on layer 6's, and so on, read
    as the wrong layer's. Each is centred on its own row, and a tick beside the grid points at that row."""
    drawn: list = []
    heatmap = thin_rowed_heatmap(monkeypatch, drawn)
    rows, cells, cw, ch = heatmap._grid()
    assert (rows, ch) == (48, 3)
    right = heatmap.LEFT + cells * cw

    def row_at(y: float) -> int:
        return int((y - heatmap.TOP) // ch)

    texts = [args for what, args in drawn if what == "text"]
    numbers = [(row_at(rect.center().y()), text) for rect, _, text in texts
               if rect.right() <= heatmap.LEFT and text.isdigit()]
    rates = [(row_at(rect.center().y()), text) for rect, _, text in texts if rect.left() > right and text.endswith("%")]
    assert numbers == [(r, str(r)) for r in range(0, 48, 4)]  # every 4th layer's number, on its row
    assert rates == [(r, f"{r}%") for r in range(0, 48, 4)]   # and its hit rate
    lines = [args for what, args in drawn if what == "line"]
    ticks = [(start.x() < heatmap.LEFT, row_at(start.y())) for start, end in lines if start.y() == end.y()]
    assert ticks == [(side, r) for r in range(0, 48, 4) for side in (True, False)]


def test_every_row_beside_the_grid_has_a_tooltip_with_its_layer_and_hit_rate(qtbot):
    """Thin rows' numbers and hit rates are drawn every few rows, and the mouse beside the grid got no tooltip: the
    layer and hit rate of a row without a label could not be read anywhere but in its cells' tooltips. The mouse on
    either side of any row now shows its layer and hit rate, and its node."""
    from PySide6.QtCore import QEvent, QPointF, Qt
    from PySide6.QtGui import QMouseEvent
    from PySide6.QtWidgets import QToolTip

    from app.gui.placement_view import Heatmap

    heatmap = Heatmap()
    qtbot.addWidget(heatmap)
    heatmap.resize(600, Heatmap.TOP + 48 * Heatmap.MIN_CELL + 2)
    stats = qwen3_30b_like_stats()
    for r, layer in enumerate(stats["layers"]):
        layer.update(hits=r, misses=100 - r)
    stats["layers"][3].update(hits=0, misses=0)
    heatmap.set_data(stats)
    heatmap.show()
    qtbot.waitExposed(heatmap)
    rows, cells, cw, ch = heatmap._grid()
    assert (rows, ch) == (48, 3)

    def tooltip(x: float, row: int) -> str:
        where = QPointF(x, heatmap.TOP + row * ch + ch / 2)
        heatmap.mouseMoveEvent(QMouseEvent(QEvent.Type.MouseMove, where, heatmap.mapToGlobal(where),
                                           Qt.MouseButton.NoButton, Qt.MouseButton.NoButton,
                                           Qt.KeyboardModifier.NoModifier))
        return QToolTip.text()

    numbers, rates = heatmap.LEFT / 2, heatmap.LEFT + cells * cw + heatmap.RIGHT / 2
    for x, row in ((numbers, 1), (rates, 2), (numbers, 47), (rates, 45)):  # rows drawn without a label
        hits = "1 hit" if row == 1 else f"{row} hits"
        assert tooltip(x, row) == (f"Layer {row}: {hits}, {100 - row} misses ({row}% hit rate), 0 slots filled, "
                                   f"0 swaps\n/model/layers.{row}/moe/QMoE")
    assert tooltip(numbers, 3) == "Layer 3: no hits or misses yet\n/model/layers.3/moe/QMoE"
    assert tooltip(heatmap.LEFT + 1, 2).startswith("Layer 2, expert 0: ")  # a cell's own, as before
    heatmap.set_data(dict(stats, cpu_only=True))  # no hit rates without a device
    assert tooltip(numbers, 1) == "Layer 1: every expert on the CPU\n/model/layers.1/moe/QMoE"
    QToolTip.hideText()


def placement_view_in_a_dock(qtbot, width: int):
    """A placement view alone in a dock `width` pixels wide, shown, with a Qwen3-30B-like model's statistics."""
    from PySide6.QtWidgets import QVBoxLayout, QWidget

    from app.gui.placement_view import PlacementView

    dock = QWidget()
    qtbot.addWidget(dock)
    view = PlacementView()
    box = QVBoxLayout(dock)
    box.setContentsMargins(0, 0, 0, 0)
    box.addWidget(view)
    dock.resize(width, 500)
    dock.show()
    qtbot.waitExposed(dock)
    view.set_stats(qwen3_30b_like_stats())
    return dock, view


def test_the_placement_legend_wraps_under_the_mode_buttons_in_a_narrow_dock_and_nothing_overlaps(qtbot):
    """The legend sat beside the mode buttons on one line that never wrapped, so it set the view's minimum width (in
    Residency ~380 pixels, in Traffic ~600): no dock could be made narrower. It wraps now, beside the buttons where its
    line fits there and on a row of its own under them where it does not: a 250-pixel dock holds the view, with no
    part over another or cut off."""
    dock, view = placement_view_in_a_dock(qtbot, 250)
    legend, buttons = view.legend, view.residency

    def laid_out(width: int, beside: bool) -> None:
        """The view `width` pixels wide, the legend beside the buttons or under them, every label as tall as its text,
        and every part in the view, none over another."""
        labels = (legend, view.summary, view.cells)
        assert view.minimumSizeHint().width() <= width
        dock.resize(width, 500)
        qtbot.waitUntil(lambda: view.width() == width and (legend.y() < buttons.geometry().bottom()) == beside
                        and all(label.height() >= label.heightForWidth(label.width()) for label in labels
                                if label.isVisibleTo(view)))
        parts = [view.residency, view.traffic, legend, view.summary, view.cells, view.scroll_area]
        shown = [part.geometry() for part in parts if part.isVisibleTo(view)]
        assert all(view.rect().contains(rect) for rect in shown)
        assert not [(a, b) for a, b in itertools.combinations(shown, 2) if a.intersects(b)]
        heatmap = view.heatmap
        _, cells, cw, _ = heatmap._grid()
        assert heatmap.LEFT + cells * cw + heatmap.RIGHT <= heatmap.width() <= view.scroll_area.width()

    laid_out(250, beside=False)
    one_line = legend.height()
    view.traffic.setChecked(True)  # Traffic's longer legend: two lines
    laid_out(250, beside=False)
    assert legend.height() > one_line
    laid_out(900, beside=True)     # wide: beside the buttons, on one line, as before
    assert legend.height() <= buttons.height() and legend.heightForWidth(legend.width()) == one_line
    laid_out(500, beside=False)    # Traffic's line does not fit beside the buttons in 500 pixels, Residency's does
    view.residency.setChecked(True)
    laid_out(500, beside=True)


def shown_lines(label) -> list[str]:
    """The lines a word-wrapped rich-text label shows at its width (laid out as QLabel lays it out)."""
    from PySide6.QtGui import QTextDocument

    doc = QTextDocument()
    doc.setDocumentMargin(0)
    doc.setDefaultFont(label.font())
    doc.setHtml(label.text())
    doc.setTextWidth(label.contentsRect().width())
    doc.size()  # (lays it out)
    lines, block = [], doc.begin()
    while block.isValid():
        layout = block.layout()
        for line in map(layout.lineAt, range(layout.lineCount())):
            lines.append(block.text()[line.textStart():line.textStart() + line.textLength()].replace("\xa0", " "))
        block = block.next()
    return [line.strip() for line in lines]


def test_the_placement_legend_wraps_between_its_entries_not_inside_one(qtbot):
    """In a 250-pixel dock Traffic's legend wrapped inside an entry: '■ on the device now: hits ■ cold now:' over
    'misses (stronger: more routing)', the red square's words split and 'misses' read as the next entry's. It wraps
    between entries: each line holds whole ones."""
    _, view = placement_view_in_a_dock(qtbot, 250)
    view.traffic.setChecked(True)
    qtbot.waitUntil(lambda: view.legend.width() <= 250 and view.legend.y() > view.traffic.geometry().bottom())
    lines = [re.split(r"\s{2,}", line) for line in shown_lines(view.legend)]
    assert len(lines) > 1 and sum(lines, []) == ["■ on the device now: hits", "■ cold now: misses",
                                                 "(stronger: more routing)"], lines


def test_traffics_colours_say_where_an_expert_is_now_not_that_its_routing_hit(qapp):
    """Traffic's legend read '■ hits ■ misses' and its button 'blue = hits on resident experts', but a cell's colour
    is where its expert is now and its strength the routing counted before: an expert placement had just copied in
    showed in blue, as hits, the routing it had missed (its tooltip: 'This expert: 0 hits, 5 misses'). Both say it."""
    from app.gui.placement_view import PlacementView

    view = PlacementView()
    view.set_stats({"resident": np.array([[True, False]]), "traffic": np.array([[5.0, 1.0]], np.float32),
                    "valid": np.ones((1, 2), bool), "placement": "adaptive", "layer_names": ["a/QMoE"],
                    "layer_index": [0], "bytes_per_expert": [1024],
                    "layers": [{"hits": 0, "misses": 6, "swaps": 1, "expert_hits": np.array([0, 0]),
                                "expert_misses": np.array([5, 1])}]})
    view.traffic.setChecked(True)
    assert re.sub("<[^>]+>", "", view.legend.text()).split(" &nbsp; ") == [
        "■ on the device now: hits", "■ cold now: misses", "(stronger: more routing)"]
    assert view.heatmap.tooltip_at(0, 0).splitlines()[3] == ("This expert: 0 hits, 5 misses (routed tokens, counted "
                                                             "exactly)")
    assert view.traffic.toolTip() == ("How much routing each expert gets (stronger: more), coloured by where it is "
                                      "now: blue on the device, where routing to it hits, red cold, where it misses. "
                                      "An expert placed lately shows in blue the routing it missed before: its "
                                      "tooltip counts both.")


def test_the_residency_legend_says_on_the_device_where_slots_are_left_to_copied_misses(qapp):
    """Where placement leaves slots to copied misses, the summary counts '0 resident experts' in a layer whose two
    blue cells are copied misses, and the legend called those cells 'resident'. It names them as the summary and the
    tooltips do: on the device."""
    from app.gui.placement_view import PlacementView

    view = PlacementView()

    def update(left: int) -> None:
        view.set_stats({"resident": np.array([[True, True, False, False]]), "traffic": np.zeros((1, 4), np.float32),
                        "valid": np.ones((1, 4), bool), "placement": "adaptive", "layer_names": ["a/QMoE"],
                        "layer_index": [0], "bytes_per_expert": [1024], "slots": [2], "left_to_copies": [left],
                        "layers": [{"hits": 3, "misses": 1, "swaps": 0}]})

    update(2)
    assert view.summary.text().startswith("2 of 4 experts on the device, in 2 slots: 0 resident experts, 2 left for "
                                          "copied misses")
    assert re.sub("<[^>]+>", "", view.legend.text()).split(" &nbsp; ")[0] == "■ on the device"
    # (it said "Resident (blue)" whatever the slots held, and the theme; and that routing "hits" a cold expert, where
    # a hit is routing to a resident one: the dots are misses, as the legend says)
    assert view.residency.toolTip() == ("Experts on the device (resident, or in a slot left to copied misses: the "
                                        "legend and the summary say which) or cold; dots: cold experts missed now "
                                        "(routed to while cold)")
    update(0)
    assert view.summary.text().startswith("2 of 4 experts resident")
    assert re.sub("<[^>]+>", "", view.legend.text()).split(" &nbsp; ")[0] == "■ resident"
