"""The graph partition: what crosses a cut comes from the data flow; experts never reach onnxruntime."""

from __future__ import annotations

import os
import threading
from dataclasses import replace

import numpy as np
import pytest

from engine.dense_segment import DenseSegment
from engine.generation import LoadedModel
from engine.model_folder import ModelFolder
from engine.partition import ExpertStep, Segment, plan_partition
from tests.conftest import FIXTURE_NAMES, fixture_folder


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_steps_alternate_and_cover_every_node(name):
    folder = ModelFolder.open(fixture_folder(name))
    plan = folder.plan
    assert plan.steps[0].on_host  # the mask's lengths (test_the_attention_masks_lengths_are_worked_out_on_the_host)
    kinds = [type(s) for s in plan.steps[1:]]
    assert kinds[0] is Segment and kinds[-1] is Segment
    assert all(a is not b for a, b in zip(kinds, kinds[1:])), "expert steps are separated by dense segments"
    counted = sum(len(s.nodes) for s in plan.segments) + len(plan.expert_steps)
    non_constant = [n for n in folder.onnx.proto.graph.node]  # Constant nodes were folded into initializers
    assert counted == len(non_constant)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_expert_weights_never_reach_onnxruntime(name):
    folder = ModelFolder.open(fixture_folder(name))
    expert_tensors = {t for info in folder.experts for t in info.weight_inputs.values()}
    for segment in folder.plan.segments:
        assert not expert_tensors & set(segment.initializers)
    assert folder.dense_bytes + folder.expert_bytes == sum(folder.onnx.nbytes(n) for n in folder.onnx.initializers)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_the_attention_masks_lengths_are_worked_out_on_the_host(name):
    """genai's attn_mask_subgraph (seqlens_k, total_sequence_length) in a segment of its own on the host: the first
    segment on the device then reads no mask, whose length grows at every step, and can be replayed as a CUDA graph."""
    folder = ModelFolder.open(fixture_folder(name))
    host, first = folder.plan.steps[:2]
    assert [s.on_host for s in folder.plan.segments] == [True] + [False] * (len(folder.plan.segments) - 1)
    assert host.inputs == ["attention_mask"]
    assert [n.op_type for n in host.nodes] == ["ReduceSum", "Sub", "Cast", "Shape", "Gather", "Cast"]
    pre = "/model/attn_mask_reformat/attn_mask_subgraph"
    assert sorted(host.outputs) == [f"{pre}/Gather/Cast/output_0", f"{pre}/Sub/Cast/output_0"]
    assert "attention_mask" not in first.inputs and "input_ids" in first.inputs
    assert first.nodes[0].op_type != "ReduceSum"


def test_the_masks_segment_runs_on_one_host_thread_and_gives_the_lengths():
    model = LoadedModel.open(fixture_folder("qwen35moe"))
    host = model.decoder.steps[0]
    assert host.segment.on_host and host.session.get_providers() == ["CPUExecutionProvider"]
    assert host.session.get_session_options().intra_op_num_threads == 1
    pre = "/model/attn_mask_reformat/attn_mask_subgraph"
    lengths = host.run({"attention_mask": np.ones((1, 5), np.int64)}, model.new_state())
    assert lengths[f"{pre}/Sub/Cast/output_0"].tolist() == [4] and int(lengths[f"{pre}/Gather/Cast/output_0"]) == 5


def test_a_mask_made_into_a_large_tensor_stays_on_the_device():
    """Only the mask's lengths move to the host: a node outside HOST_MASK_OPS (a 4-D mask's Expand, as large as the
    sequence squared) and what reads it stay in the device's segment."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Shape", ["attention_mask"], ["shape"]),
             helper.make_node("Expand", ["attention_mask", "shape"], ["big"]),
             helper.make_node("Cast", ["big"], ["big_float"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["x", "big_float"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, 4]),
                                           helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    plan = plan_partition(graph, set(), "attention_mask")
    host, device = plan.steps
    assert [n.op_type for n in host.nodes] == ["Shape"] and host.outputs == ["shape"]
    assert [n.op_type for n in device.nodes] == ["Expand", "Cast", "Add"] and not device.on_host
    assert plan_partition(graph, set()).steps[0].nodes == nodes  # no mask named: one segment, as before


def test_cut_tensors_come_from_the_data_flow():
    folder = ModelFolder.open(fixture_folder("qwen35moe"))
    steps = folder.plan.steps[1:]  # after the mask's segment on the host
    second = steps[2]
    expert_before = steps[1]
    assert isinstance(expert_before, ExpertStep)
    # The next segment reads the expert output, the residual sum (SkipSimplifiedLayerNorm output 3),
    # the shared-expert input, mask lengths and MRoPE position ids, and owns layer 1's KV cache.
    assert expert_before.node.output[0] in second.inputs
    assert "/model/layers.0/post_attention_layernorm/output_3" in second.inputs
    assert "position_ids" in second.inputs
    assert {"past_key_values.1.key", "past_key_values.1.value"} <= set(second.inputs)
    assert {"present.1.key", "present.1.value"} <= set(second.outputs)
    # Each state input is read by exactly one segment.
    owners = {}
    for segment in folder.plan.segments:
        for name in segment.inputs:
            if name.startswith(("past_key_values.", "past.")):
                assert name not in owners
                owners[name] = segment.index
    assert len(owners) == len([i for i in folder.onnx.proto.graph.input if i.name.startswith(("past_key", "past."))])


def _thread_count() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task")) if os.path.isdir("/proc/self/task") else threading.active_count()


def test_thread_pools_do_not_multiply_with_segments():
    model = LoadedModel.open(fixture_folder("qwen35moe"))  # 6 segments (the mask's on the host)
    before = _thread_count()
    LoadedModel.open(fixture_folder("qwen35moe"))
    segments = [s for s in model.decoder.steps if isinstance(s, DenseSegment)]
    assert len(segments) == 6
    assert _thread_count() - before <= 1


def test_an_expert_nodes_model_layer_is_the_one_its_name_gives_else_its_position():
    info = ModelFolder.open(fixture_folder("gptoss")).experts[1]
    assert (info.layer, info.model_layer) == (1, 1)
    assert replace(info, name="/model/layers.17/moe/QMoE").model_layer == 17
    assert replace(info, name="model.layers.4.mlp/QMoE").model_layer == 1  # not the builder's form: its position
    assert replace(info, name="/model/sublayers.9/moe").model_layer == 1
