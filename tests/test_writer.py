"""engine.writer: random-weight MoE folders in onnxruntime-genai's builder format."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jinja2
import numpy as np
import onnx
import onnxruntime as ort

import pytest
from onnx import helper, numpy_helper

from engine.ort_env import session_options
from engine.writer import WriterSpec, write_model

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path("/work/shared/fixtures/genai/gptoss")
needs_fixture = pytest.mark.skipif(not FIXTURE.is_dir(), reason="builder fixture not present")


# ---- helpers ------------------------------------------------------------------------------------

def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])


def empty_past(sess: ort.InferenceSession, spec: WriterSpec) -> dict[str, np.ndarray]:
    """KV inputs the way onnxruntime-genai feeds them: full layers start empty, sliding layers get
    a window-sized buffer (GroupQueryAttention's sliding_window_cache needs that capacity)."""
    dt = np.float16 if spec.dtype == "float16" else np.float32
    feeds = {}
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values."):
            length = spec.sliding_window if i.shape[2] == "past_sliding_length" else 0
            feeds[i.name] = np.zeros((1, spec.num_kv_heads, length, spec.head_size), dt)
    return feeds


def prefill_and_decode(folder: Path, spec: WriterSpec, prompt_len: int = 5):
    sess = session(folder / "model.onnx")
    names = [o.name for o in sess.get_outputs()]
    ids = np.random.default_rng(7).integers(3, spec.vocab_size, prompt_len)
    feeds = empty_past(sess, spec)
    feeds.update(input_ids=ids[None].astype(np.int64), attention_mask=np.ones((1, prompt_len), np.int64))
    first = dict(zip(names, sess.run(None, feeds)))
    for name, value in first.items():
        if name.startswith("present."):
            feeds[name.replace("present.", "past_key_values.")] = value
    feeds.update(input_ids=np.array([[int(first["logits"][0, -1].argmax())]], np.int64),
                 attention_mask=np.ones((1, prompt_len + 1), np.int64))
    second = dict(zip(names, sess.run(None, feeds)))
    return first, second


def with_extra_outputs(folder: Path, names: list[str], out_name: str = "probe.onnx") -> Path:
    """A copy of model.onnx (same external data) that also outputs the given intermediate values."""
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    elem = model.graph.output[0].type.tensor_type.elem_type
    for name in names:
        model.graph.output.append(helper.make_tensor_value_info(name, elem, None))
    path = folder / out_name
    path.write_bytes(model.SerializeToString())
    return path


def key_tree(obj):
    if isinstance(obj, dict):
        return {k: key_tree(v) for k, v in obj.items()}
    return None


RUN_SPECS = {
    "int4_block32_swiglu": WriterSpec(),
    "int8_per_row_zero_points": WriterSpec(bits=8, block_size=0, zero_points=True),
    "int4_block32_zero_points": WriterSpec(zero_points=True, expert_bias=False),
    "int4_relu": WriterSpec(activation="relu", block_size=64),
    "int4_gelu_per_row": WriterSpec(activation="gelu", block_size=0, swiglu_fusion=0),
    "fp16": WriterSpec(dtype="float16"),
    "sliding_window": WriterSpec(layers=3, sliding_window=64),
}


# ---- running in onnxruntime ---------------------------------------------------------------------

@pytest.mark.parametrize("key", list(RUN_SPECS))
def test_written_model_runs_prefill_and_decode(tmp_path, key):
    spec = RUN_SPECS[key]
    folder = write_model(tmp_path / key, spec)
    first, second = prefill_and_decode(folder, spec)
    want = np.float16 if spec.dtype == "float16" else np.float32
    assert first["logits"].shape == (1, 5, spec.vocab_size) and first["logits"].dtype == want
    assert second["logits"].shape == (1, 1, spec.vocab_size)
    for out in (first, second):
        assert np.isfinite(out["logits"].astype(np.float32)).all()
        assert out["logits"].astype(np.float32).std() > 0.1   # not a dead model
    for i in range(spec.layers):
        kv = spec.sliding_window if spec.is_sliding(i) else None
        assert first[f"present.{i}.key"].shape == (1, spec.num_kv_heads, kv or 5, spec.head_size)
        assert second[f"present.{i}.value"].shape == (1, spec.num_kv_heads, kv or 6, spec.head_size)


def test_same_spec_and_seed_give_the_same_bytes(tmp_path):
    spec = WriterSpec(zero_points=True, sliding_window=32)
    a, b = write_model(tmp_path / "a", spec), write_model(tmp_path / "b", spec)
    for name in ("model.onnx.data", "model.onnx", "tokenizer.json", "genai_config.json", "README.txt"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    c = write_model(tmp_path / "c", WriterSpec(zero_points=True, sliding_window=32, seed=1))
    assert (a / "model.onnx.data").read_bytes() != (c / "model.onnx.data").read_bytes()


def test_deep_fp16_model_stays_finite(tmp_path):
    spec = WriterSpec(dtype="float16", layers=48, hidden_size=64, inter_size=64, num_experts=4, num_heads=2,
                      num_kv_heads=1, head_size=32, sliding_window=16)
    folder = write_model(tmp_path / "deep", spec)
    last = f"/model/layers.{spec.layers - 1}/post_attention_layernorm/output_3"
    probe = with_extra_outputs(folder, [last])
    sess = session(probe)
    n = 64
    feeds = empty_past(sess, spec)
    feeds.update(input_ids=np.random.default_rng(0).integers(3, 512, (1, n)).astype(np.int64),
                 attention_mask=np.ones((1, n), np.int64))
    logits, residual = sess.run(["logits", last], feeds)
    assert np.isfinite(logits.astype(np.float32)).all()
    rms = float(np.sqrt(np.mean(residual.astype(np.float32) ** 2)))
    assert 0.5 < rms < 30, rms   # O(1) growth with depth, far from fp16's 65504


def test_routing_spreads_over_experts(tmp_path):
    spec = WriterSpec(num_experts=16, top_k=2)
    folder = write_model(tmp_path / "r", spec)
    routers = [f"/model/layers.{i}/moe/router/Reshape/output_0" for i in range(spec.layers)]
    sess = session(with_extra_outputs(folder, routers))
    n = 200
    feeds = empty_past(sess, spec)
    feeds.update(input_ids=np.random.default_rng(3).integers(3, spec.vocab_size, (1, n)).astype(np.int64),
                 attention_mask=np.ones((1, n), np.int64))
    for layer, logits in enumerate(sess.run(routers, feeds)):
        assert logits.shape == (n, spec.num_experts)
        top = np.argsort(-logits, axis=1)[:, : spec.top_k]
        counts = np.bincount(top.ravel(), minlength=spec.num_experts)
        assert np.count_nonzero(counts) >= 12, (layer, counts)
        assert counts.max() / counts.sum() < 0.25, (layer, counts)


# ---- graph and file format ----------------------------------------------------------------------

@needs_fixture
def test_graph_matches_the_builders_gptoss_fixture(tmp_path):
    """Same spec as the fixture: identical node names/ops/wiring/attributes, initializer names and
    shapes, and graph inputs/outputs."""
    ours = onnx.load(str(write_model(tmp_path / "m", WriterSpec(sliding_window=64)) / "model.onnx"),
                     load_external_data=False)
    ref = onnx.load(str(FIXTURE / "model.onnx"), load_external_data=False)
    assert ours.ir_version == ref.ir_version == 10
    assert {(o.domain, o.version) for o in ours.opset_import} == {(o.domain, o.version) for o in ref.opset_import}
    assert len(ours.graph.node) == len(ref.graph.node)
    for a, b in zip(ours.graph.node, ref.graph.node):
        assert (a.op_type, a.name, a.domain, list(a.input), list(a.output)) == \
               (b.op_type, b.name, b.domain, list(b.input), list(b.output))
        if a.op_type != "Constant":
            attrs = lambda n: {x.name: helper.get_attribute_value(x) for x in n.attribute}  # noqa: E731
            assert attrs(a) == attrs(b), a.name
    dims = lambda g: {t.name: (t.data_type, list(t.dims)) for t in g.initializer}  # noqa: E731
    assert dims(ours.graph) == dims(ref.graph)
    assert str(ours.graph.input) == str(ref.graph.input)
    assert str(ours.graph.output) == str(ref.graph.output)


def test_external_data_offsets_are_aligned_and_inside_the_file(tmp_path):
    folder = write_model(tmp_path / "m", WriterSpec(zero_points=True))
    size = (folder / "model.onnx.data").stat().st_size
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    spans = []
    for t in model.graph.initializer:
        assert t.data_location == onnx.TensorProto.EXTERNAL and not t.raw_data
        ext = {e.key: e.value for e in t.external_data}
        assert ext["location"] == "model.onnx.data"
        offset, length = int(ext["offset"]), int(ext["length"])
        assert offset % (4096 if length >= 4096 else 64) == 0, t.name
        assert length == np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize * int(np.prod(t.dims))
        spans.append((offset, offset + length))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert spans[-1][1] == size
    # and the data reads back through onnx's own loader
    full = onnx.load(str(folder / "model.onnx"))
    emb = numpy_helper.to_array(next(t for t in full.graph.initializer if t.name == "model.embed_tokens.weight"))
    assert emb.shape == (512, 128) and abs(float(emb.mean())) < 0.02 and 0.9 < float(emb.std()) < 1.1


@pytest.mark.parametrize("kw, fc1, fc1_scales, fc1_zp, fc2, fc3", [
    (dict(), (8, 256, 64), (8, 256, 4), None, (8, 128, 64), None),
    (dict(bits=8, block_size=0, zero_points=True), (8, 256, 128), (8, 256), (8, 256), (8, 128, 128), None),
    (dict(block_size=0, zero_points=True), (8, 256, 64), (8, 256), (8, 128), (8, 128, 64), None),
    (dict(block_size=32, zero_points=True, inter_size=64), (8, 128, 64), (8, 128, 4), (8, 128, 2), (8, 128, 32), None),
    (dict(activation="silu"), (8, 128, 64), (8, 128, 4), None, (8, 128, 64), None),
    (dict(swiglu_fusion=0, zero_points=True), (8, 128, 64), (8, 128, 4), (8, 128, 2), (8, 128, 64), (8, 128, 64)),
    (dict(swiglu_fusion=2), (8, 256, 64), (8, 256, 4), None, (8, 128, 64), None),
])
def test_qmoe_node_and_expert_layout(tmp_path, kw, fc1, fc1_scales, fc1_zp, fc2, fc3):
    spec = WriterSpec(**kw)
    model = onnx.load(str(write_model(tmp_path / "m", spec) / "model.onnx"), load_external_data=False)
    dims = {t.name: tuple(t.dims) for t in model.graph.initializer}
    types = {t.name: t.data_type for t in model.graph.initializer}
    node = next(n for n in model.graph.node if n.name == "/model/layers.1/moe/QMoE")
    assert node.op_type == "QMoE" and node.domain == "com.microsoft" and len(node.input) == 14
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["k"] == spec.top_k and attrs["normalize_routing_weights"] == 1
    assert attrs["expert_weight_bits"] == spec.bits and "weights_prepacked" not in attrs
    assert attrs["activation_type"] == spec.activation.encode()
    assert attrs.get("block_size") == (spec.block_size or None)
    assert attrs["swiglu_fusion"] == (spec.swiglu_fusion if spec.gated else 0)
    if spec.gated:
        assert attrs["swiglu_limit"] == pytest.approx(7.0) and attrs["activation_alpha"] == pytest.approx(1.702)
    w1, s1, b1, w2, s2, b2, w3, s3, b3, z1, z2, z3 = node.input[2:]
    assert dims[w1] == fc1 and dims[s1] == fc1_scales and dims[w2] == fc2
    assert types[w1] == onnx.TensorProto.UINT8 and types[s1] == onnx.TensorProto.FLOAT
    assert dims[b1] == (8, fc1[1]) and dims[b2] == (8, 128)
    assert (dims[z1] if z1 else None) == fc1_zp and bool(z2) == spec.zero_points
    assert (dims[w3] if w3 else None) == fc3 and bool(s3) == bool(b3) == (fc3 is not None)
    prefix = "model.layers.1.moe.experts."
    want1 = {0: "gate_proj", 1: "gate_up_proj", 2: "gate_up_proj"}[spec.swiglu_fusion] if spec.gated else "up_proj"
    assert w1 == prefix + want1 + ".qweight" and s1 == prefix + want1 + ".scales" and b1 == prefix + want1 + ".bias"
    assert w2 == prefix + "down_proj.qweight"
    if z1:
        assert z1 == prefix + want1 + ".zero_points"


def test_scales_have_random_signs_and_zero_points_sit_mid_range(tmp_path):
    folder = write_model(tmp_path / "m", WriterSpec(bits=8, block_size=0, zero_points=True))
    full = onnx.load(str(folder / "model.onnx"))
    arrays = {t.name: numpy_helper.to_array(t) for t in full.graph.initializer}
    scales = arrays["model.layers.0.moe.experts.gate_up_proj.scales"]
    assert 0.4 < float((scales > 0).mean()) < 0.6
    zp = arrays["model.layers.0.moe.experts.down_proj.zero_points"]
    assert zp.min() >= 127 and zp.max() <= 129
    codes = arrays["model.layers.0.moe.experts.down_proj.qweight"].astype(np.int32) - 128
    assert abs(float(codes.mean())) < 1.0 and codes.min() >= -127


def test_fp16_spec_uses_fp16_io_scales_and_caches(tmp_path):
    model = onnx.load(str(write_model(tmp_path / "m", WriterSpec(dtype="float16")) / "model.onnx"),
                      load_external_data=False)
    types = {t.name: t.data_type for t in model.graph.initializer}
    f16 = onnx.TensorProto.FLOAT16
    assert types["cos_cache"] == f16 and types["model.layers.0.moe.experts.gate_up_proj.scales"] == f16
    assert types["lm_head.MatMul.weight_scales"] == f16
    assert all(v.type.tensor_type.elem_type == f16 for v in model.graph.output)


def test_invalid_specs_raise_clear_errors(tmp_path):
    # (more layouts, and their invalid combinations: tests/test_writer_layouts.py)
    for bad, words in [(dict(bits=5), "2, 3, 4 or 8"), (dict(quant_type="fp6"), "quant_type"),
                       (dict(block_size=48), "power of two"), (dict(block_size=256), "divisible"),
                       (dict(activation="swish"), "activation"), (dict(vocab_size=100), "vocab_size"),
                       (dict(num_heads=3, num_kv_heads=2), "multiple"), (dict(top_k=9), "top_k")]:
        with pytest.raises(ValueError, match=words):
            write_model(tmp_path / "bad", WriterSpec(**bad))


def test_progress_is_monotonic_and_reaches_one(tmp_path):
    seen = []
    write_model(tmp_path / "m", WriterSpec(), progress=seen.append)
    assert seen[0] == 0.0 and seen[-1] == 1.0 and len(seen) > 3
    assert all(a <= b for a, b in zip(seen, seen[1:]))



def test_a_write_interrupted_partway_removes_what_it_wrote(tmp_path, monkeypatch):
    """Ctrl-C while the weights were written left the tokenizer files and the folder made for them."""
    import engine.writer.write

    def interrupted(file, *_args):
        file.write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.writer.write, "write_tensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_model(tmp_path / "made" / "m", WriterSpec())
    assert list(tmp_path.iterdir()) == []

# ---- streaming ----------------------------------------------------------------------------------

def test_writing_a_large_model_streams(tmp_path):
    """~200 MB of experts, written in a fresh process: its peak RSS grows by far less than that."""
    script = textwrap.dedent(f"""
        import json, os, resource, sys
        sys.path.insert(0, {str(ROOT)!r})
        from engine.writer import WriterSpec, write_model
        write_model({str(tmp_path / 'warm')!r}, WriterSpec())          # imports, tokenizer training
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        spec = WriterSpec(hidden_size=1024, inter_size=1024, num_experts=64, num_heads=8, num_kv_heads=2,
                          head_size=128)
        folder = write_model({str(tmp_path / 'big')!r}, spec)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({{"growth_kb": after - before, "size": os.path.getsize(folder / "model.onnx.data")}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["size"] > 200e6
    assert result["growth_kb"] < 50 * 1024, result


# ---- tokenizer and config files -----------------------------------------------------------------

def test_tokenizer_round_trips_and_is_compact(tmp_path):
    from tokenizers import Tokenizer

    folder = write_model(tmp_path / "m", WriterSpec())
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.get_vocab_size() <= 512
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|start|>", "<|end|>")] == [0, 1, 2]
    for text in ("hello world", "Hello world! The quick brown fox.", "naïve café — 你好 🙂\n\ttabs", "<|start|>user"):
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert len(tok.encode("hello world").ids) < 11
    assert len(tok.encode("The model answers your question.").ids) < 15
    ref = json.loads((FIXTURE / "tokenizer.json").read_text()) if FIXTURE.is_dir() else None
    ours = json.loads((folder / "tokenizer.json").read_text())
    assert ours["pre_tokenizer"]["type"] == ours["decoder"]["type"] == "ByteLevel"
    if ref:
        assert ours["added_tokens"] == ref["added_tokens"]
        assert ours["post_processor"] == ref["post_processor"]


@needs_fixture
def test_config_files_follow_the_fixture(tmp_path):
    spec = WriterSpec(layers=4, sliding_window=128, context_length=4096, description="unit-test model")
    folder = write_model(tmp_path / "m", spec)
    ref = json.loads((FIXTURE / "genai_config.json").read_text())
    cfg = json.loads((folder / "genai_config.json").read_text())
    assert key_tree(cfg) == key_tree(ref)
    dec = cfg["model"]["decoder"]
    assert dec["sliding_window"]["window_size"] == 128 and dec["sliding_window"]["layers"] == [0, 2]
    assert (dec["num_hidden_layers"], dec["head_size"], cfg["model"]["context_length"]) == (4, 32, 4096)
    assert (cfg["model"]["eos_token_id"], cfg["model"]["bos_token_id"], cfg["model"]["type"]) == (0, 1, "gptoss")
    no_window = json.loads((write_model(tmp_path / "n", WriterSpec()) / "genai_config.json").read_text())
    assert "sliding_window" not in no_window["model"]["decoder"]

    tc, ref_tc = (json.loads((d / "tokenizer_config.json").read_text()) for d in (folder, FIXTURE))
    assert set(tc) == set(ref_tc) and tc["model_max_length"] == 4096
    assert (folder / "chat_template.jinja").read_text() == (FIXTURE / "chat_template.jinja").read_text()
    chat = jinja2.Template((folder / "chat_template.jinja").read_text()).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert chat == "<|start|>user\nhi<|end|><|start|>assistant\n"

    readme = (folder / "README.txt").read_text()
    assert "RANDOM" in readme and "unit-test model" in readme and "sliding_window = 128" in readme
    meta = {p.key: p.value for p in onnx.load(str(folder / "model.onnx"), load_external_data=False).metadata_props}
    assert json.loads(meta["moe_workbench.writer_spec"])["layers"] == 4


@pytest.mark.parametrize("spec", [WriterSpec(layers=7, hidden_size=64, inter_size=64, num_experts=4),
                                  WriterSpec(layers=6, hidden_size=64, inter_size=64, num_experts=4, sliding_window=64),
                                  WriterSpec(layers=5, hidden_size=64, inter_size=64, num_experts=3, top_k=1,
                                             quant_type="int", bits=3, zero_points=True, block_size=16),
                                  WriterSpec(layers=9, hidden_size=64, inter_size=64, num_experts=4, quant_type="nvfp4",
                                             dtype="float16")])
def test_write_sizes_counted_on_a_few_layers_are_the_written_ones(tmp_path, spec):
    """write_sizes counts a spec on graphs of at most four layers (a graph of every layer takes memory in proportion
    to them): the weights' size exactly, the graph's closely."""
    from engine.writer.write import write_sizes

    sizes = write_sizes(spec)
    write_model(tmp_path, spec)
    assert sizes.data_bytes == (tmp_path / "model.onnx.data").stat().st_size
    assert sizes.graph_bytes == pytest.approx((tmp_path / "model.onnx").stat().st_size, rel=0.03)
