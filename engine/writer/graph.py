"""The decoder graph in onnxruntime-genai's gpt-oss form, and the plan of its initializers.

Node and initializer names follow the model builder's (compare
/work/shared/fixtures/genai/gptoss/model.onnx): the engine finds its cuts from the graph, so a
writer-made model should look exactly like a user's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from engine.writer import weights as W
from engine.writer.external_data import TensorPlan
from engine.writer.spec import WriterSpec

EPS = 1e-5
MS = "com.microsoft"
# Magnitudes (see weights.py for the scale rule). With near-uniform attention every token's attention
# output is about the mean of the values, a vector shared by all tokens; summed over many layers it
# pulls every token's router input the same way and routing collapses onto a few experts in deep
# layers. Sharper attention (q and k rows x2: score std ~4), a halved o_proj and small dense biases
# keep the shared part of the residual small: a 48-layer model routes near-uniformly in every layer.
QK_GAIN = 2.0
O_GAIN = 0.5
DENSE_BIAS_STD = 0.02
LM_HEAD_GAIN = 2.0


@dataclass
class GraphPlan:
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    outputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    tensors: list[TensorPlan] = field(default_factory=list)   # initializers, in file order


def expert_names(layer: int, spec: WriterSpec) -> dict[str, str]:
    """The projection prefixes of a layer's experts: FC1, FC2 and (fusion 0) FC3."""
    pre = f"model.layers.{layer}.moe.experts"
    if not spec.gated:
        return {"fc1": f"{pre}.up_proj", "fc2": f"{pre}.down_proj"}
    if spec.has_fc3:
        return {"fc1": f"{pre}.gate_proj", "fc2": f"{pre}.down_proj", "fc3": f"{pre}.up_proj"}
    return {"fc1": f"{pre}.gate_up_proj", "fc2": f"{pre}.down_proj"}


class _Builder:
    def __init__(self, spec: WriterSpec):
        self.spec = spec
        self.g = GraphPlan()
        self.constants: set[str] = set()
        self.io_type = W.onnx_type(spec.dtype)

    # -- helpers ---------------------------------------------------------------------------------
    def node(self, op, inputs, outputs, name, domain="", **attrs):
        self.g.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain or None, **attrs))
        return outputs

    def tensor(self, plan: TensorPlan) -> str:
        self.g.tensors.append(plan)
        return plan.name

    def int64_constant(self, values, scalar=False) -> str:
        label = str(values[0]) if scalar else str(list(values))
        out = f"/model/constants/INT64/{label}"
        if out not in self.constants:
            self.constants.add(out)
            arr = np.array(values[0] if scalar else values, np.int64)
            t = numpy_helper.from_array(arr, name=out)
            self.node("Constant", [], [out], f"/model/constant_nodes/INT64/{label}", value=t)
        return out

    def matmul(self, x: str, prefix: str, node_prefix: str, n: int, k: int, gain=1.0, out: str | None = None,
               row_gain=None) -> str:
        s = self.spec
        plans, attrs = W.matmul_nbits(prefix, n, k, s.dense_bits, s.seed, s.dtype, s.dense_accuracy_level, gain=gain,
                                      row_gain=row_gain)
        names = [self.tensor(p) for p in plans]
        out = out or f"{node_prefix}/MatMul/output_0"
        self.node("MatMulNBits", [x, *names], [out], f"{node_prefix}/MatMul_Q{s.dense_bits}", MS, **attrs)
        return out

    def add_bias(self, x: str, bias_name: str, node_prefix: str, n: int, std=DENSE_BIAS_STD) -> str:
        b = self.tensor(W.normal(bias_name, (n,), self.spec.seed, self.spec.dtype, std))
        return self.node("Add", [x, b], [f"{node_prefix}/Add/output_0"], f"{node_prefix}/Add")[0]

    def norm_weight(self, name: str) -> str:
        return self.tensor(W.normal(name, (self.spec.hidden_size,), self.spec.seed, self.spec.dtype, 0.05, 1.0))

    # -- graph -----------------------------------------------------------------------------------
    def io(self):
        s, t = self.spec, self.io_type
        g = self.g
        g.inputs.append(helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64,
                                                      ["batch_size", "sequence_length"]))
        g.inputs.append(helper.make_tensor_value_info("attention_mask", onnx.TensorProto.INT64,
                                                      ["batch_size", "total_sequence_length"]))
        for kind in ("key", "value"):
            for i in range(s.layers):
                past = "past_sliding_length" if s.is_sliding(i) else "past_sequence_length"
                g.inputs.append(helper.make_tensor_value_info(
                    f"past_key_values.{i}.{kind}", t, ["batch_size", s.num_kv_heads, past, "kv_cache_dim"]))
        g.outputs.append(helper.make_tensor_value_info("logits", t, ["batch_size", "sequence_length", s.vocab_size]))
        for kind in ("key", "value"):
            for i in range(s.layers):
                total = "total_sliding_length" if s.is_sliding(i) else "total_sequence_length"
                g.outputs.append(helper.make_tensor_value_info(
                    f"present.{i}.{kind}", t, ["batch_size", s.num_kv_heads, total, "kv_cache_dim"]))

    def attention_mask(self) -> tuple[str, str]:
        pre = "/model/attn_mask_reformat/attn_mask_subgraph"
        one_vec = self.int64_constant([1])
        rs = self.node("ReduceSum", ["attention_mask", one_vec], [f"{pre}/ReduceSum/output_0"], f"{pre}/ReduceSum",
                       keepdims=0)[0]
        sub = self.node("Sub", [rs, one_vec], [f"{pre}/Sub/output_0"], f"{pre}/Sub")[0]
        seqlens_k = self.node("Cast", [sub], [f"{pre}/Sub/Cast/output_0"], f"{pre}/Sub/Cast",
                              to=onnx.TensorProto.INT32)[0]
        shape = self.node("Shape", ["attention_mask"], [f"{pre}/Shape/output_0"], f"{pre}/Shape")[0]
        one = self.int64_constant([1], scalar=True)
        gather = self.node("Gather", [shape, one], [f"{pre}/Gather/output_0"], f"{pre}/Gather", axis=0)[0]
        total = self.node("Cast", [gather], [f"{pre}/Gather/Cast/output_0"], f"{pre}/Gather/Cast",
                          to=onnx.TensorProto.INT32)[0]
        return seqlens_k, total

    def skip_norm(self, residual: str, x: str, pre: str, weight: str, with_sum=True) -> tuple[str, str]:
        outs = [f"{pre}/output_0", "", "", f"{pre}/output_3"] if with_sum else [f"{pre}/output_0"]
        self.node("SkipSimplifiedLayerNormalization", [residual, x, weight], outs, f"{pre}/SkipLayerNorm", MS,
                  epsilon=EPS)
        return outs[0], outs[-1]

    def attention(self, layer: int, x: str, seqlens_k: str, total: str) -> str:
        s = self.spec
        mp, np_ = f"model.layers.{layer}.attn", f"/model/layers.{layer}/attn"
        qk_rows = (s.num_heads + s.num_kv_heads) * s.head_size
        qkv = self.matmul(x, f"{mp}.qkv_proj.MatMul", f"{np_}/qkv_proj", s.qkv_size, s.hidden_size,
                          row_gain=(qk_rows, QK_GAIN))
        qkv = self.add_bias(qkv, f"{mp}.qkv_proj.Add.bias", f"{np_}/qkv_proj", s.qkv_size)
        if layer == 0:
            for plan in W.rotary_caches(s.context_length, s.head_size, s.dtype):
                self.tensor(plan)
        inputs = [qkv, "", "", f"past_key_values.{layer}.key", f"past_key_values.{layer}.value",
                  seqlens_k, total, "cos_cache", "sin_cache"]
        if s.attention_sinks:
            sinks = self.tensor(W.normal(f"{mp}.sinks", (s.num_heads,), s.seed, s.dtype, 0.5))
            inputs += ["", "", sinks]
        attrs = dict(num_heads=s.num_heads, kv_num_heads=s.num_kv_heads, scale=float(s.head_size ** -0.5),
                     local_window_size=s.sliding_window if s.is_sliding(layer) else -1, softcap=0.0,
                     do_rotary=1, rotary_interleaved=0)
        if s.is_sliding(layer):
            attrs["sliding_window_cache"] = 1
        out = self.node("GroupQueryAttention", inputs,
                        [f"{np_}/GroupQueryAttention/output_0", f"present.{layer}.key", f"present.{layer}.value"],
                        f"{np_}/GroupQueryAttention", MS, **attrs)[0]
        o = self.matmul(out, f"{mp}.o_proj.MatMul", f"{np_}/o_proj", s.hidden_size, s.num_heads * s.head_size,
                        gain=O_GAIN)
        return self.add_bias(o, f"{mp}.o_proj.Add.bias", f"{np_}/o_proj", s.hidden_size)

    def moe(self, layer: int, x: str) -> str:
        s = self.spec
        mp, np_ = f"model.layers.{layer}.moe", f"/model/layers.{layer}/moe"
        E, H, I = s.num_experts, s.hidden_size, s.inter_size
        logits = self.matmul(x, f"{mp}.router.MatMul", f"{np_}/router", E, H)
        logits = self.add_bias(logits, f"{mp}.router.Add.bias", f"{np_}/router", E)
        shape = self.int64_constant([-1, E])
        router = self.node("Reshape", [logits, shape], [f"{np_}/router/Reshape/output_0"], f"{np_}/router/Reshape")[0]

        names = expert_names(layer, s)
        shapes = {"fc1": (s.fc1_rows, H), "fc2": (H, I)}
        if s.has_fc3:
            shapes["fc3"] = (I, H)
        projections = [self.expert_tensors(names[p], p, n, k) for p, (n, k) in shapes.items()]
        projections += [{}] * (3 - len(projections))
        for part in ("qweight", "scales", "bias", "zero_points", "global_scale"):   # the builder's file order
            for proj in projections:
                if part in proj:
                    self.tensor(proj[part])

        def ref(proj, part):
            return proj[part].name if part in proj else ""

        inputs = [x, router]
        for proj in projections:
            inputs += [ref(proj, "qweight"), ref(proj, "scales"), ref(proj, "bias")]
        inputs += [ref(p, "zero_points") for p in projections]
        if "global_scale" in projections[0]:
            inputs += ["", ref(projections[0], "global_scale"), ref(projections[1], "global_scale")]

        attrs: dict = {}
        if s.gated:
            attrs.update(activation_alpha=float(s.alpha), activation_beta=float(s.beta))
        attrs.update(activation_type=s.activation, expert_weight_bits=s.bits if s.quant_type == "int" else
                     s.projection_bits("fc1"), k=s.top_k, normalize_routing_weights=1,
                     swiglu_fusion=s.swiglu_fusion if s.gated else 0, use_sparse_mixer=0)
        if s.gated and s.swiglu_limit is not None:
            attrs["swiglu_limit"] = float(s.swiglu_limit)
            if s.swiglu_limit_after_activation and s.activation == "swiglu":
                attrs["swiglu_limit_after_activation"] = 1
        if s.quant_type == "int":
            for p in ("fc1", "fc2", "fc3"):
                if getattr(s, f"{p}_bits") is not None:
                    attrs[f"{p}_expert_weight_bits"] = getattr(s, f"{p}_bits")
            if s.block_size:
                attrs["block_size"] = s.block_size
            if s.prepacked:
                attrs["weights_prepacked"] = 1
            elif any(s.projection_bits(p) in (2, 3) for p in shapes):
                attrs["weights_prepacked"] = 0
        else:
            attrs["quant_type"] = s.quant_type
            if s.quant_type == "fp8" and s.block_size:
                attrs["block_size"] = s.block_size
            if s.quant_type == "nvfp4":
                attrs["weights_prepacked"] = 1 if s.nvfp4_packing == "k_packed" else 0
        return self.node("QMoE", inputs, [f"{np_}/QMoE/output_0"], f"{np_}/QMoE", MS, **attrs)[0]

    def expert_tensors(self, prefix: str, proj: str, n: int, k: int) -> dict:
        """The plans of one projection of a layer's experts, in the spec's layout."""
        s = self.spec
        E = s.num_experts
        if s.quant_type in ("fp4", "nvfp4"):
            return W.fp4_projection(prefix, E, n, k, s.quant_type, s.nvfp4_packing if s.quant_type == "nvfp4"
                                    else "k_packed", s.expert_bias, s.seed, s.dtype)
        if s.quant_type == "fp8":
            return W.fp8_projection(prefix, E, n, k, s.block_size, s.expert_bias, s.seed, s.dtype)
        return W.expert_projection(prefix, E, n, k, bits=s.projection_bits(proj), block=s.block_size,
                                   zero_points=s.zero_points, bias=s.expert_bias, seed=s.seed, dtype=s.dtype,
                                   **({"prepacked": True} if s.prepacked else {}))

    def build(self) -> GraphPlan:
        s = self.spec
        self.io()
        seqlens_k, total = self.attention_mask()
        emb = self.tensor(W.normal("model.embed_tokens.weight", (s.vocab_size, s.hidden_size), s.seed, s.dtype, 1.0))
        hidden = self.node("Gather", [emb, "input_ids"], ["/model/embed_tokens/Gather/output_0"],
                           "/model/embed_tokens/Gather")[0]
        residual, moe_out = hidden, None
        for i in range(s.layers):
            pre = f"/model/layers.{i}/input_layernorm"
            w = self.norm_weight(f"model.layers.{i}.input_layernorm.weight")
            if i == 0:
                x = self.node("SimplifiedLayerNormalization", [hidden, w], [f"{pre}/output_0"], f"{pre}/LayerNorm",
                              epsilon=EPS, axis=-1, stash_type=1)[0]
            else:
                x, residual = self.skip_norm(residual, moe_out, pre, w)
            attn = self.attention(i, x, seqlens_k, total)
            pre = f"/model/layers.{i}/post_attention_layernorm"
            w = self.norm_weight(f"model.layers.{i}.post_attention_layernorm.weight")
            x, residual = self.skip_norm(residual, attn, pre, w)
            moe_out = self.moe(i, x)
        L = s.layers
        w = self.norm_weight(f"model.layers.{L}.final_norm_layernorm.weight")
        x, _ = self.skip_norm(residual, moe_out, f"/model/layers.{L}/final_norm_layernorm", w, with_sum=False)
        self.matmul(x, "lm_head.MatMul", "/lm_head", s.vocab_size, s.hidden_size, gain=LM_HEAD_GAIN, out="logits")
        return self.g


def build_graph(spec: WriterSpec) -> GraphPlan:
    return _Builder(spec).build()


def make_model(plan: GraphPlan, initializers: list[onnx.TensorProto], doc: str,
               metadata: dict[str, str]) -> onnx.ModelProto:
    graph = helper.make_graph(plan.nodes, "main_graph", plan.inputs, plan.outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22), helper.make_opsetid(MS, 1)],
                              producer_name="moe-workbench-writer", ir_version=10, doc_string=doc)
    for k, v in metadata.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = k, v
    return model
