"""The graph partition: what crosses a cut comes from the data flow; experts never reach onnxruntime."""

from __future__ import annotations

import os
import threading
from dataclasses import replace

import pytest

from engine.dense_segment import DenseSegment
from engine.generation import LoadedModel
from engine.model_folder import ModelFolder
from engine.partition import ExpertStep, Segment
from tests.conftest import FIXTURE_NAMES, fixture_folder


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_steps_alternate_and_cover_every_node(name):
    folder = ModelFolder.open(fixture_folder(name))
    plan = folder.plan
    kinds = [type(s) for s in plan.steps]
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


def test_cut_tensors_come_from_the_data_flow():
    folder = ModelFolder.open(fixture_folder("qwen35moe"))
    steps = folder.plan.steps
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
    model = LoadedModel.open(fixture_folder("qwen35moe"))  # 5 segments
    before = _thread_count()
    LoadedModel.open(fixture_folder("qwen35moe"))
    segments = [s for s in model.decoder.steps if isinstance(s, DenseSegment)]
    assert len(segments) == 5
    assert _thread_count() - before <= 1


def test_an_expert_nodes_model_layer_is_the_one_its_name_gives_else_its_position():
    info = ModelFolder.open(fixture_folder("gptoss")).experts[1]
    assert (info.layer, info.model_layer) == (1, 1)
    assert replace(info, name="/model/layers.17/moe/QMoE").model_layer == 17
    assert replace(info, name="model.layers.4.mlp/QMoE").model_layer == 1  # not the builder's form: its position
    assert replace(info, name="/model/sublayers.9/moe").model_layer == 1
