"""The engine's logits against one unmodified onnxruntime session over the same model.

Prefill plus 32 greedy decode steps, fed the same way (genai-style state buffers). The fixtures
are real builder output; writer-made models add other layouts.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from engine.decoder import OrtReferenceDecoder
from engine.generation import LoadedModel
from engine.writer import WriterSpec, write_model
from tests.conftest import fixture_folder
from tests.ort_expert import use_onnxruntime_experts

DECODE_STEPS = 32
PROMPT = "The quick brown fox jumps over the lazy dog, then asks: why?"


def max_relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max())


def run_both(model: LoadedModel):
    """Greedy prefill + decode through the engine and the reference; per-step errors and tokens."""
    reference = OrtReferenceDecoder(model.folder.onnx, model.folder.logits_name)
    ours_state, ref_state = model.new_state(), model.new_state()
    prompt = model.tokenizer.encode(PROMPT)
    ours, ref = model.decoder.forward(ours_state, prompt), reference.forward(ref_state, prompt)
    errors, ours_tokens, ref_tokens = [max_relative_error(ours, ref)], [], []
    for _ in range(DECODE_STEPS):
        ours_tokens.append(int(ours[-1].argmax()))
        ref_tokens.append(int(ref[-1].argmax()))
        # Each side continues with its own token: identical tokens are what is tested.
        ours = model.decoder.forward(ours_state, [ours_tokens[-1]])
        ref = reference.forward(ref_state, [ref_tokens[-1]])
        errors.append(max_relative_error(ours, ref))
    return errors, ours_tokens, ref_tokens


@pytest.fixture(scope="module", params=["gptoss", "lfm2moe", "qwen35moe"])
def fixture_model(request):
    return request.param, LoadedModel.open(fixture_folder(request.param))


def with_fp32_dense_activations(folder: Path, target: Path) -> Path:
    """A copy of a model whose dense MatMulNBits nodes keep fp32 activations (accuracy_level 0).

    The builder emits accuracy_level 4: onnxruntime quantises each dense layer's input to int8, so
    a 1-ulp difference in an expert output can flip one int8 code and move the logits by ~1e-3.
    Any kernel that does not reproduce onnxruntime's summation order bit for bit sees that; the
    copy lets the comparison measure our expert kernels on the real architecture.
    """
    shutil.copytree(folder, target)
    model = onnx.load(str(target / "model.onnx"), load_external_data=False)
    for node in model.graph.node:
        for attr in node.attribute:
            if node.op_type == "MatMulNBits" and attr.name == "accuracy_level":
                attr.i = 0
    (target / "model.onnx").chmod(0o644)
    onnx.save(model, str(target / "model.onnx"))
    return target


def test_partition_is_exact_with_onnxruntime_expert_kernels(fixture_model):
    """With onnxruntime's own QMoE kernel in the expert steps, the partitioned graph reproduces the
    whole-model session bit for bit: cuts, state binding and feeding add no error."""
    name, _ = fixture_model
    model = LoadedModel.open(fixture_folder(name))
    use_onnxruntime_experts(model)
    errors, ours, ref = run_both(model)
    assert max(errors) == 0.0
    assert ours == ref


@pytest.mark.parametrize("name", ["gptoss", "lfm2moe", "qwen35moe"])
def test_engine_matches_onnxruntime_on_fixture(name, tmp_path):
    model = LoadedModel.open(with_fp32_dense_activations(fixture_folder(name), tmp_path / name))
    errors, ours, ref = run_both(model)
    assert ours == ref, f"{name}: greedy tokens diverge"
    assert max(errors) <= 1e-4, f"{name}: max relative error {max(errors):.2e}"


def test_engine_follows_onnxruntime_on_unmodified_fixture(fixture_model):
    """As the builder wrote them (int8 dense activations), the greedy tokens still agree and the
    logits stay within the size of one int8 rounding flip."""
    name, model = fixture_model
    errors, ours, ref = run_both(model)
    assert ours == ref, f"{name}: greedy tokens diverge"
    assert max(errors) < 2e-2


@pytest.mark.parametrize("name", ["gptoss", "lfm2moe", "qwen35moe"])
def test_engine_matches_onnxruntime_over_a_conversation_past_the_sliding_window(name, tmp_path):
    """As a chat feeds it: a first prompt longer than gpt-oss's sliding window (64), decode steps, a second turn's
    prompt fed as one chunk onto the kept state, more decode steps."""
    model = LoadedModel.open(with_fp32_dense_activations(fixture_folder(name), tmp_path / name))
    reference = OrtReferenceDecoder(model.folder.onnx, model.folder.logits_name)
    ours_state, ref_state = model.new_state(), model.new_state()
    turns = [[int(t) for t in np.random.default_rng(seed).integers(3, 500, size)] for seed, size in ((1, 100), (2, 20))]
    errors, ours_tokens, ref_tokens = [], [], []
    for prompt in turns:
        ours, ref = model.decoder.forward(ours_state, prompt), reference.forward(ref_state, prompt)
        errors.append(max_relative_error(ours, ref))
        for _ in range(8):
            ours_tokens.append(int(ours[-1].argmax()))
            ref_tokens.append(int(ref[-1].argmax()))
            ours = model.decoder.forward(ours_state, [ours_tokens[-1]])
            ref = reference.forward(ref_state, [ref_tokens[-1]])
            errors.append(max_relative_error(ours, ref))
    assert ours_state.past_length == ref_state.past_length == 136
    assert ours_tokens == ref_tokens, f"{name}: greedy tokens diverge"
    assert max(errors) <= 1e-4, f"{name}: max relative error {max(errors):.2e}"


# Dense MatMulNBits at accuracy_level 0 (fp32 activations), as with_fp32_dense_activations explains.
EXACT = {"dense_accuracy_level": 0}
WRITER_LAYOUTS = {
    "int4-block32-swiglu": WriterSpec(layers=2, num_experts=8, top_k=2, seed=1, **EXACT),
    "int8-perrow-zp": WriterSpec(layers=2, bits=8, block_size=0, zero_points=True, seed=2, **EXACT),
    "int4-block64-zp-sliding": WriterSpec(layers=3, hidden_size=128, inter_size=128, block_size=64, zero_points=True,
                                           sliding_window=16, seed=3, **EXACT),
    "int4-perrow-relu": WriterSpec(layers=2, block_size=0, activation="relu", swiglu_limit=None, seed=4, **EXACT),
    "int8-perrow-silu-16experts": WriterSpec(layers=2, bits=8, block_size=0, num_experts=16, top_k=4,
                                             activation="silu", swiglu_limit=None, seed=5, **EXACT),
}


@pytest.mark.parametrize("layout", sorted(WRITER_LAYOUTS))
def test_engine_matches_onnxruntime_on_written_model(layout, tmp_path):
    folder = write_model(tmp_path / layout, WRITER_LAYOUTS[layout])
    model = LoadedModel.open(folder)
    errors, ours, ref = run_both(model)
    assert ours == ref
    assert max(errors) <= 1e-4, f"{layout}: max relative error {max(errors):.2e}"


def test_engine_matches_onnxruntime_on_fp16_model(tmp_path):
    """fp16 activations end to end: onnxruntime's fp16 QMoE rounds differently (qmoe.md: ~5e-4)."""
    folder = write_model(tmp_path / "fp16", WriterSpec(layers=2, dtype="float16", seed=11, **EXACT))
    errors, ours, ref = run_both(LoadedModel.open(folder))
    assert ours == ref
    assert max(errors) <= 5e-3
