"""Writer-made models in every expert layout: the engine runs them (logits equal the same computation with
every expert node on the NumPy reference), `inspect` reports them supported, the QMoE nodes carry the layout's
attributes and tensors, and onnxruntime's own CPU QMoE agrees where it reads the layout."""
from __future__ import annotations

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import helper

from engine.decoder import OrtReferenceDecoder
from engine.expert_node import CpuExpertNode
from engine.generation import LoadedModel
from engine.writer import WriterSpec, write_model
from kernels import layouts as L
from kernels.reference import qmoe_reference
from tests.conftest import REPO
from tests.qmoe_oracle import require_oracle

BASE = dict(layers=2, hidden_size=128, inter_size=64, num_experts=8, top_k=2, dense_accuracy_level=0)
LAYOUTS = {  # name: (WriterSpec fields, words the inspect summary must contain)
    "int2-block32": (dict(bits=2, block_size=32), "int2 block 32"),
    "int3-block32-zp": (dict(bits=3, block_size=32, zero_points=True), "int3 block 32"),
    "int3-perrow-relu2": (dict(bits=3, block_size=0, activation="relu2"), "int3 per row, relu2"),
    "mixed-4-8": (dict(bits=4, fc2_bits=8, block_size=0), "fc1 int4 / fc2 int8 per row"),
    "int4-sm80": (dict(block_size=64, inter_size=128, prepacked=True), "int4 block 64 (SM80 prepacked)"),
    "int8-sm80": (dict(bits=8, block_size=0, inter_size=128, prepacked=True, swiglu_fusion=2),
                  "int8 per row (SM80 prepacked)"),
    "int4-geglu": (dict(activation="geglu", swiglu_fusion=2), "geglu (concatenated)"),
    "int4-limit-after": (dict(swiglu_limit_after_activation=True), "limit 7 after activation"),
    "nvfp4-kpacked": (dict(quant_type="nvfp4"), "nvfp4 K-packed"),
    "nvfp4-npacked": (dict(quant_type="nvfp4", nvfp4_packing="n_packed"), "nvfp4 N-packed"),
    "mxfp4-geglu": (dict(quant_type="fp4", activation="geglu"), "mxfp4 (e8m0 block 32"),
    "fp8-block32-fc3": (dict(quant_type="fp8", block_size=32, swiglu_fusion=0), "fp8 e4m3 square block 32x32"),
    "fp8-global": (dict(quant_type="fp8", block_size=0, activation="silu"), "fp8 e4m3 per-expert global scale"),
    "fp16-int3": (dict(bits=3, block_size=32, dtype="float16"), "int3 block 32"),
    "fp16-nvfp4": (dict(quant_type="nvfp4", dtype="float16"), "nvfp4 K-packed"),
}
PROMPT = list(range(3, 11))  # 8 tokens


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    return {name: write_model(root / name, WriterSpec(seed=i + 1, **{**BASE, **kw}))
            for i, (name, (kw, _)) in enumerate(LAYOUTS.items())}


class ReferenceExperts:
    """kernels.reference.qmoe_reference in place of a node's CPU kernel (same forward())."""

    def __init__(self, runner: CpuExpertNode, source):
        self.spec = runner.info.spec
        self.tensors = {role: np.asarray(source.array(name)) for role, name in runner.info.weight_inputs.items()}

    def forward(self, x, router_logits, router_weights=None):
        return qmoe_reference(x, router_logits, self.spec, self.tensors, router_weights)


def _prefill(model: LoadedModel) -> np.ndarray:
    return model.decoder.forward(model.new_state(), PROMPT).astype(np.float64)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_engine_runs_every_layout_like_the_reference(folders, name):
    model = LoadedModel.open(folders[name])
    assert all(info.spec is not None for info in model.folder.experts)
    ours = _prefill(model)
    for runner in model.decoder.steps:
        if isinstance(runner, CpuExpertNode):
            runner.kernel = ReferenceExperts(runner, model.folder.onnx)
    ref = _prefill(model)
    assert np.isfinite(ours).all() and ours.std() > 0.1  # a live model, not a constant
    tol = 1e-4 if LAYOUTS[name][0].get("dtype", "float32") == "float32" else 2e-2
    assert float(np.abs(ours - ref).max() / np.abs(ref).max()) <= tol


def test_inspect_reports_every_layout_supported(folders, cli):
    """`moe-workbench inspect --json` on a few folders (the first in a process), the same report in process for all."""
    from app.inspect_report import inspection
    from engine.model_folder import ModelFolder

    for name, (kw, words) in LAYOUTS.items():
        if name in ("int3-block32-zp", "int8-sm80", "nvfp4-npacked", "fp8-global"):
            args = ("inspect", str(folders[name]), "--json")
            out = (subprocess.run([sys.executable, "-m", "app", *args], cwd=REPO, capture_output=True, text=True,
                                  timeout=120) if name == "int3-block32-zp" else cli(*args))
            assert out.returncode == 0, out.stderr
            report = json.loads(out.stdout)
        else:
            report = json.loads(json.dumps(inspection(ModelFolder.open(folders[name]))))
        assert report["supported"], name
        assert all(words in n["layout"] for n in report["expert_nodes"]), (name, report["expert_nodes"][0]["layout"])
        node = report["expert_nodes"][0]
        assert node["bytes_per_expert"] * node["experts"] == node["bytes"]


def _qmoe(folder):
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == "QMoE")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    inits = {t.name: t for t in model.graph.initializer}
    return node, attrs, inits


def test_qmoe_attributes_and_tensors_per_layout(folders):
    node, attrs, inits = _qmoe(folders["int4-sm80"])
    assert attrs["weights_prepacked"] == 1 and tuple(inits[node.input[2]].dims) == (8, 128, 128)
    node, attrs, inits = _qmoe(folders["mixed-4-8"])
    assert attrs["expert_weight_bits"] == 4 and attrs["fc2_expert_weight_bits"] == 8
    assert tuple(inits[node.input[5]].dims) == (8, 128, 64)
    node, attrs, inits = _qmoe(folders["int3-block32-zp"])
    assert attrs["weights_prepacked"] == 0 and tuple(inits[node.input[2]].dims) == (8, 128, 48)
    assert tuple(inits[node.input[11]].dims) == (8, 128, 2)  # 4 blocks x 3 bits
    for name, prepacked, w1 in (("nvfp4-kpacked", 1, (8, 128, 64)), ("nvfp4-npacked", 0, (8, 128, 64))):
        node, attrs, inits = _qmoe(folders[name])
        assert attrs["quant_type"] == b"nvfp4" and attrs["weights_prepacked"] == prepacked
        assert tuple(inits[node.input[2]].dims) == w1
        assert inits[node.input[3]].data_type == onnx.TensorProto.FLOAT8E4M3FN
        assert node.input[15] and node.input[16] and tuple(inits[node.input[15]].dims) == (8,)
    node, attrs, inits = _qmoe(folders["mxfp4-geglu"])
    assert attrs["quant_type"] == b"fp4" and inits[node.input[3]].data_type == onnx.TensorProto.FLOAT8E8M0
    node, attrs, inits = _qmoe(folders["fp8-block32-fc3"])
    assert attrs["quant_type"] == b"fp8" and attrs["block_size"] == 32
    assert inits[node.input[2]].data_type == onnx.TensorProto.FLOAT8E4M3FN and tuple(inits[node.input[3]].dims) == (8, 2, 4)
    node, attrs, inits = _qmoe(folders["int4-limit-after"])
    assert attrs["swiglu_limit_after_activation"] == 1


def test_prepacked_and_n_packed_models_hold_the_same_weights_as_their_plain_twins(tmp_path):
    """Same seed: the SM80 model's codes are the raw model's codes, the N-packed nvfp4 model's the K-packed's."""
    spec = WriterSpec(**{**BASE, "layers": 1, "inter_size": 128, "block_size": 64, "seed": 5})
    raw = LoadedModel.open(write_model(tmp_path / "raw", spec)).folder
    sm80 = LoadedModel.open(write_model(tmp_path / "sm80", WriterSpec(**{**spec.to_dict(), "prepacked": True}))).folder
    a, b = raw.experts[0], sm80.experts[0]
    w_raw = np.asarray(raw.onnx.array(a.weight_inputs["fc1_experts_weights"]))
    w_sm80 = np.asarray(sm80.onnx.array(b.weight_inputs["fc1_experts_weights"]))
    np.testing.assert_array_equal(L.sm80_unpack(w_sm80, 256, 128, 4), L.unpack_bits(w_raw, 4, 128))
    kp = LoadedModel.open(write_model(tmp_path / "kp", WriterSpec(**{**BASE, "layers": 1, "quant_type": "nvfp4"})))
    npk = LoadedModel.open(write_model(tmp_path / "np", WriterSpec(**{**BASE, "layers": 1, "quant_type": "nvfp4",
                                                                      "nvfp4_packing": "n_packed"})))
    np.testing.assert_array_equal(_prefill(kp), _prefill(npk))


def test_onnxruntime_reads_the_writers_sm80_and_int2_models(tmp_path):
    """onnxruntime 1.32's CPU QMoE reads SM80 int4 (weights_prepacked=1) and int2 per row: the whole writer-made
    model through one onnxruntime session equals the engine's logits."""
    require_oracle()
    for i, kw in enumerate((dict(block_size=64, inter_size=128, prepacked=True), dict(bits=2, block_size=0))):
        model = LoadedModel.open(write_model(tmp_path / f"m{i}", WriterSpec(seed=9, **{**BASE, **kw})))
        reference = OrtReferenceDecoder(model.folder.onnx, model.folder.logits_name)
        ref = reference.forward(model.new_state(), PROMPT).astype(np.float64)
        assert float(np.abs(_prefill(model) - ref).max() / np.abs(ref).max()) <= 1e-4


def test_writer_layout_scales_and_codes_are_centred(folders):
    model = onnx.load(str(folders["nvfp4-kpacked"] / "model.onnx"))
    arrays = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    s = L.e4m3_to_float(arrays["model.layers.0.moe.experts.gate_up_proj.scales"].view(np.uint8))
    assert 0.4 < float((s > 0).mean()) < 0.6 and np.isfinite(s).all() and (s != 0).all()
    fp8 = onnx.load(str(folders["fp8-global"] / "model.onnx"))
    w = [onnx.numpy_helper.to_array(t) for t in fp8.graph.initializer if t.name.endswith("down_proj.qweight")][0]
    v = w.astype(np.float32)
    assert w.dtype == ml_dtypes.float8_e4m3fn and abs(float(v.mean())) < 0.5 and 10 < float(v.std()) < 22


@pytest.mark.parametrize("bad,words", [
    (dict(bits=5), "2, 3, 4 or 8"), (dict(fc2_bits=6), "fc2_bits"), (dict(quant_type="fp4", fc1_bits=4), "per-projection"),
    (dict(prepacked=True, bits=2), "int4 or int8"), (dict(prepacked=True, hidden_size=96, head_size=24), "divisible by 64"),
    (dict(quant_type="nvfp4", swiglu_fusion=0), "fc3_global_scale"), (dict(quant_type="fp8", zero_points=True), "zero"),
    (dict(activation="geglu", swiglu_fusion=0), "geglu"), (dict(nvfp4_packing="x"), "nvfp4_packing"),
    (dict(dtype="bfloat16"), "dtype"),
])
def test_invalid_layout_specs(tmp_path, bad, words):
    with pytest.raises(ValueError, match=words):
        write_model(tmp_path / "bad", WriterSpec(**{**BASE, **bad}))


def test_default_spec_dict_has_no_new_layout_keys():
    assert not {"fc1_bits", "prepacked", "nvfp4_packing", "swiglu_limit_after_activation"} & set(WriterSpec().to_dict())
    assert WriterSpec(prepacked=True).to_dict()["prepacked"] is True
