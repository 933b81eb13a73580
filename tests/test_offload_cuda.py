"""Hybrid offload on the real GPU (marker gpu: skipped without one)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.generation import LoadedModel
from engine.offload import OffloadConfig
from engine.writer import WriterSpec, write_model
from tests.test_offload import greedy_run

pytestmark = pytest.mark.gpu

SPEC = WriterSpec(layers=3, num_experts=16, top_k=4, hidden_size=256, inter_size=256, seed=31, dense_accuracy_level=0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("cuda") / "m", SPEC)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("cpu_execution", ["auto", "disabled"])
def test_cuda_offload_matches_the_cpu(folder, fraction, cpu_execution):
    from engine.offload.cuda_device import open_cuda_device

    reference, ref_tokens = greedy_run(LoadedModel.open(folder), steps=8)
    device = open_cuda_device()
    budget = int(fraction * LoadedModel.open(folder).folder.expert_bytes)
    model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=budget, cpu_execution=cpu_execution),
                             device=device)
    logits, tokens = greedy_run(model, steps=8)
    errors = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits, reference)]
    assert max(errors) < 2e-2, errors  # GPU tensor-core paths round activations to fp16
    assert tokens[:4] == ref_tokens[:4]
    totals = model.offload.stats.totals()
    if fraction == 1.0:
        assert totals.misses == 0 and totals.device_s > 0
    assert device.memory.high_water <= device.memory.ceiling


def test_cuda_mem_limit_is_a_clean_error(folder):
    from engine.offload.cuda_device import open_cuda_device
    from engine.offload.device_memory import DeviceMemoryError

    limit = 64 << 10  # far below one layer's experts
    device = open_cuda_device(mem_limit=limit)
    with pytest.raises(DeviceMemoryError):
        device.memory.reserve(limit + 1, "a test allocation")
    import cupy

    cupy.get_default_memory_pool().set_limit(size=0)  # leave the process unlimited for other tests


def test_cuda_misses_copied_into_spare_slots_match_the_cpu(folder):
    """A (pretended) very slow CPU: the miss policy copies misses into spare slots through the
    pinned ring on the copy stream, computed on the GPU in the same step."""
    from dataclasses import replace

    from engine.offload.cuda_device import open_cuda_device

    reference, ref_tokens = greedy_run(LoadedModel.open(folder), steps=8)
    device = open_cuda_device()
    assert device.bandwidths.cpu > 1e9  # measured at start, not the default
    device.bandwidths = replace(device.bandwidths, cpu=1e3)
    budget = LoadedModel.open(folder).folder.expert_bytes // 2
    model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=budget, placement="static"), device=device)
    logits, tokens = greedy_run(model, steps=8)
    errors = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits, reference)]
    assert max(errors) < 2e-2, errors
    assert tokens[:4] == ref_tokens[:4]
    totals = model.offload.stats.totals()
    assert totals.miss_copies > 0 and totals.misses_cpu + totals.misses_copied == totals.misses
    ring = device.pinned
    assert ring.kind == "pinned" and ring.copies > 0 and 0 < ring.high_water <= ring.capacity


def test_cuda_waves_through_a_one_expert_pinned_ring(folder):
    from engine.offload.cuda_device import open_cuda_device

    reference = LoadedModel.open(folder)
    prompt = reference.tokenizer.encode(" ".join(["many tokens make the prompt long enough to stream experts"] * 6))
    expected = reference.decoder.forward(reference.new_state(), prompt)
    device = open_cuda_device()
    probe = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=0), device=device)
    one = max(device.staging_bytes_per_expert(runner) for runner in probe.offload.runners)
    probe.offload.reconfigure(probe.offload.config.updated(pinned_bytes=one, cpu_execution="disabled"))
    assert probe.offload.wave_experts == 1 and device.pinned.capacity == one
    logits = probe.decoder.forward(probe.new_state(), prompt)
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 2e-2
    assert device.pinned.copies > 0 and device.pinned.high_water <= one
    assert probe.offload.stats.totals().misses_cpu == 0
