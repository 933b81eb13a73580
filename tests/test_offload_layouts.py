"""The offload engine on expert layouts the GPU kernels convert on upload (int2, mixed widths, nvfp4) or refuse
(fp8, an activation they do not implement), on the simulated device, which counts what a CUDA slot would take:
slots are budgeted at their size in the GPU layout, nodes the GPU refuses run all on the CPU (auto) or are
refused by name (required), and every answer equals the all-CPU run."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import engine.offload.hybrid_node as hybrid_node
from engine.generation import LoadedModel
from engine.model_folder import ModelFolder
from engine.offload import OffloadConfig, SimulatedDevice
from engine.offload.cuda_device import _round_up, staged_bytes
from engine.offload.devices import Bandwidths
from engine.offload.miss_policy import decode_costs, miss_costs
from engine.offload.planner import OffloadPlanError, plan_offload
from engine.writer import WriterSpec, write_model
from kernels.gpu import convert, layout
from tests.test_bad_input import assert_clean_error
from tests.test_offload import assert_same_as_cpu, greedy_run

BASE = dict(layers=3, hidden_size=128, inter_size=64, num_experts=8, top_k=2, dense_accuracy_level=0)
CONVERTED = {
    "nvfp4": dict(quant_type="nvfp4"),                      # -> int8 block 16, fp32 scales: 2.4x the stored bytes
    "int2": dict(bits=2, block_size=32),                    # -> int4
    "mixed-4-8": dict(bits=4, fc2_bits=8, block_size=0),    # -> int8 for both projections
}
STEPS = 6
FAST_PCIE = Bandwidths(pcie=1e15, hbm=1e15, cpu=1e6, cpu_flops=1e18)  # copying a miss always pays


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload-layouts")
    specs = {**CONVERTED, "fp8": dict(quant_type="fp8", block_size=32), "int4": {}}
    return {name: write_model(root / name, WriterSpec(seed=i + 3, **{**BASE, **kw}))
            for i, (name, kw) in enumerate(specs.items())}


@pytest.fixture(scope="module")
def cpu_runs(folders):
    return {}


def cpu_run(folders, cpu_runs, name):
    if name not in cpu_runs:
        cpu_runs[name] = greedy_run(LoadedModel.open(folders[name]), steps=STEPS)
    return cpu_runs[name]


def real_tensors(folder: ModelFolder, info) -> dict:
    from kernels.qmoe_spec import QMOE_INPUT_NAMES

    tensors = {role: None for role in QMOE_INPUT_NAMES}
    tensors.update({role: folder.onnx.array(name) for role, name in info.weight_inputs.items()})
    return tensors


# --- the GPU footprint of a node ------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONVERTED))
def test_the_footprint_is_the_converted_gpu_size(folders, name):
    folder = ModelFolder.open(folders[name])
    for info in folder.experts:
        tensors = real_tensors(folder, info)
        assert info.gpu_unsupported is None and info.gpu.conversion
        assert info.device_bytes_per_expert == info.gpu.slot_bytes == convert.gpu_expert_bytes(info.spec, tensors,
                                                                                                resident=True)
        assert info.gpu.read_bytes == convert.gpu_expert_bytes(info.spec, tensors)
        assert info.device_bytes_per_expert > info.bytes_per_expert  # converted: larger on the device
        conv = convert.for_gpu(info.spec, tensors)
        E = info.spec.num_experts
        assert info.gpu.wave_bytes == sum(t.nbytes // E for role, t in conv.tensors.items() if t is not None
                                          and not role.endswith("global_scale") and t.shape[0] == E)


def test_a_native_layout_is_not_converted_and_fp8_is_refused(folders):
    native = ModelFolder.open(folders["int4"]).experts[0]
    assert native.gpu.conversion == "" and native.gpu.read_bytes == native.bytes_per_expert
    for info in ModelFolder.open(folders["fp8"]).experts:
        assert info.gpu is None and info.device_bytes_per_expert == 0
        assert "fp8" in info.gpu_unsupported and info.name in info.gpu_unsupported
        assert info.spec is not None and info.unsupported is None  # the CPU runs it


# --- converted layouts: budgeted at their device size ----------------------------------------------

@pytest.mark.parametrize("name", sorted(CONVERTED))
def test_a_converted_layout_is_budgeted_at_its_device_size(folders, cpu_runs, name):
    infos = ModelFolder.open(folders[name]).experts
    slot = infos[0].device_bytes_per_expert
    budget = 7 * slot + slot // 2
    assert budget // infos[0].bytes_per_expert > 7  # the stored size would have planned more experts
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(folders[name], offload=OffloadConfig(device_expert_bytes=budget, placement="adaptive"),
                             device=device)
    plan = model.offload.plan
    per_layer = [plan.slots[info.name] for info in infos]
    assert sum(per_layer) == budget // slot == 7 and max(per_layer) - min(per_layer) <= 1  # even across layers
    assert plan.device_bytes(infos) == 7 * slot
    for info, count in zip(infos, per_layer):
        assert device.memory.by_purpose[f"expert slots of {info.name}"] == count * slot
    wave = model.offload.wave_experts
    assert device.memory.by_purpose["prefill staging ring"] == 2 * wave * slot  # a wave's slots are converted too
    assert any("converted for the GPU kernels" in line for line in plan.statements)
    assert_same_as_cpu(greedy_run(model, steps=STEPS), cpu_run(folders, cpu_runs, name))
    totals = model.offload.stats.totals()
    assert totals.hits > 0 and totals.misses > 0


def test_the_plan_matches_floor_of_budget_over_the_device_size(folders):
    infos = ModelFolder.open(folders["nvfp4"]).experts
    slot = infos[0].device_bytes_per_expert
    for count in (0, 1, 2, 5, 12, 24):
        for extra in (0, slot - 1):
            plan = plan_offload(OffloadConfig(device_expert_bytes=count * slot + extra), infos, SimulatedDevice(1 << 30))
            assert sum(plan.slots.values()) == min(count, 24)
    everything = plan_offload(OffloadConfig(device_expert_bytes=24 * slot), infos, SimulatedDevice(1 << 30))
    assert everything.placement_mode == "all_resident"
    short = plan_offload(OffloadConfig(device_expert_bytes=24 * slot - 1), infos, SimulatedDevice(1 << 30))
    assert short.placement_mode == "hybrid"


def test_the_miss_cost_model_uses_the_stored_and_the_device_sizes(folders, cpu_runs, monkeypatch):
    bw = Bandwidths(pcie=2.0, hbm=4.0, cpu=8.0, cpu_flops=1e18)
    costs = miss_costs(bw, 80, np.array([1, 1]), 0.0, copy_bytes=200, read_bytes=160)
    assert costs.cpu_s.tolist() == [10.0, 10.0] and costs.copy_s == 100.0 and costs.device_s == 40.0
    same = miss_costs(bw, 80, np.array([1]), 0.0)
    assert same.copy_s == 40.0 and same.device_s == 20.0  # without device sizes: the stored size
    seen = []

    def recording(bandwidths, expert_bytes, tokens, residents, **kwargs):
        seen.append((expert_bytes, kwargs))
        return decode_costs(bandwidths, expert_bytes, tokens, residents, **kwargs)

    monkeypatch.setattr(hybrid_node, "decode_costs", recording)
    info = ModelFolder.open(folders["nvfp4"]).experts[0]
    model = LoadedModel.open(folders["nvfp4"], device=SimulatedDevice(1 << 30, bandwidths=FAST_PCIE),
                             offload=OffloadConfig(placement="static", device_expert_bytes=4 * 3 * info.device_bytes_per_expert))
    assert_same_as_cpu(greedy_run(model, steps=STEPS), cpu_run(folders, cpu_runs, "nvfp4"))
    assert seen
    for expert_bytes, kwargs in seen:
        assert expert_bytes == info.bytes_per_expert  # the CPU reads the stored expert
        assert kwargs["copy_bytes"] == info.gpu.slot_bytes and kwargs["read_bytes"] == info.gpu.read_bytes
    totals = model.offload.stats.totals()
    assert totals.miss_copies > 0
    layer = model.offload.stats.layers[0]
    assert layer.copy_bytes % info.gpu.slot_bytes == 0  # copies move the converted, packed expert


@pytest.mark.parametrize("name", sorted(CONVERTED))
def test_staging_counts_the_converted_packed_layout(folders, name):
    model = LoadedModel.open(folders[name], offload=OffloadConfig(), device=SimulatedDevice(1 << 30))
    runner = model.offload.runners[0]
    spec, tensors = runner.info.spec, runner.tensors
    conv = convert.for_gpu(spec, tensors)
    packed = 0
    for lay in layout.make_layouts(conv.spec, conv.tensors):
        arrays = layout.pack(lay, *layout.raw_sources(conv.spec, conv.tensors, lay, np.array([1])))
        packed += sum(_round_up(a[0].nbytes) for a in arrays.values())  # what CudaSlots.load puts in the ring
    raw = sum(_round_up(t.nbytes // spec.num_experts) for t in tensors.values()
              if t is not None and t.ndim >= 1 and t.shape[0] == spec.num_experts)
    assert packed > raw  # converted: the packed expert is the larger of the two
    assert staged_bytes(runner) == max(raw, packed) == model.offload.device.staging_bytes_per_expert(runner)
    assert model.offload.device.pinned.capacity == 2 * OffloadConfig().prefill_wave_experts * staged_bytes(runner)


# --- nodes the GPU kernels refuse --------------------------------------------------------------------

def test_fp8_in_auto_mode_runs_all_on_the_cpu_with_the_reason(folders, cpu_runs):
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(folders["fp8"], offload=OffloadConfig(device_expert_bytes=1 << 20), device=device)
    plan = model.offload.plan
    assert set(plan.slots.values()) == {0} and plan.placement_mode == "hybrid"
    text = " ".join(plan.statements)
    assert "3 expert nodes (layers 0, 1, 2) run all on the CPU, because the GPU kernels cannot run them: fp8" in text and "fp8" in text
    assert all(store is None for store in model.offload.stores)
    assert device.memory.used == 0 and device.pinned is None and model.offload.wave_experts == 0
    assert_same_as_cpu(greedy_run(model, steps=STEPS), cpu_run(folders, cpu_runs, "fp8"))
    totals = model.offload.stats.totals()
    assert totals.hits == 0 and totals.misses > 0 and totals.copy_bytes == 0


def test_fp8_in_required_mode_is_refused_naming_the_node(folders, cli):
    infos = ModelFolder.open(folders["fp8"]).experts
    with pytest.raises(OffloadPlanError) as error:
        LoadedModel.open(folders["fp8"], offload=OffloadConfig(mode="required"), device=SimulatedDevice(1 << 30))
    message = str(error.value)
    assert message.startswith("offload mode 'required': the GPU kernels cannot run node")
    assert infos[0].name in message and "fp8" in message and "\n" not in message
    result = cli("inspect", str(folders["fp8"]), "--device", "simulated", "--offload", "mode=required")
    assert_clean_error(result, "required", infos[0].name, "fp8")


@pytest.fixture(scope="module")
def mixed_folder(folders, tmp_path_factory):
    """The int4 model with its middle node's swiglu limit after the activation: the CPU runs that node, the
    GPU kernels do not implement it (kernels.gpu.layout.check_activation)."""
    import shutil

    folder = tmp_path_factory.mktemp("mixed") / "m"
    shutil.copytree(folders["int4"], folder)
    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    node = [n for n in proto.graph.node if n.op_type == "QMoE"][1]
    node.attribute.append(onnx.helper.make_attribute("swiglu_limit_after_activation", 1))
    onnx.save(proto, str(folder / "model.onnx"))
    return folder


def test_mixed_nodes_put_the_runnable_ones_on_the_device(mixed_folder):
    infos = ModelFolder.open(mixed_folder).experts
    refused = infos[1]
    assert refused.gpu is None and "swiglu" in refused.gpu_unsupported
    assert all(info.gpu is not None for info in (infos[0], infos[2]))
    slot = infos[0].device_bytes_per_expert
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(mixed_folder, offload=OffloadConfig(device_expert_bytes=16 * slot), device=device)
    plan = model.offload.plan
    assert [plan.slots[info.name] for info in infos] == [8, 0, 8]  # every expert of the two runnable nodes
    assert plan.placement_mode == "hybrid"
    assert any(f"Expert node '{refused.name}' (layer 1) runs all on the CPU" in line for line in plan.statements)
    assert model.offload.stores[1] is None and model.offload.stores[0] is not None
    assert_same_as_cpu(greedy_run(model, steps=STEPS), greedy_run(LoadedModel.open(mixed_folder), steps=STEPS))
    layers = model.offload.stats.layers
    assert layers[0].misses == 0 and layers[2].misses == 0  # full layers were filled at load
    assert layers[1].hits == 0 and layers[1].misses > 0
    with pytest.raises(OffloadPlanError) as error:
        plan_offload(OffloadConfig(mode="required"), infos, device)
    assert refused.name in str(error.value) and infos[0].name not in str(error.value)
