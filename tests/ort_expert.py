"""onnxruntime's own QMoE kernel as a stand-in for ours, to prove the graph partition exact."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from engine.expert_node import CpuExpertNode
from engine.onnx_file import OnnxFile
from engine.ort_env import session_options
from tests.qmoe_oracle import build_model, require_oracle


class OrtExpertKernel:
    """Same forward() as CpuQMoE, computed by a one-node onnxruntime session."""

    def __init__(self, runner: CpuExpertNode, source: OnnxFile):
        require_oracle()
        info = runner.info
        tensors = {role: np.asarray(source.array(name)) for role, name in info.weight_inputs.items()}
        self._info, self._tensors, self._sessions = info, tensors, {}

    def forward(self, x, router_logits, router_weights=None):
        key = (x.dtype.str, x.shape)  # the oracle model fixes the token count
        if key not in self._sessions:
            tensors = dict(self._tensors, router_probs=router_logits)
            model = build_model(self._info.op_type, self._info.attributes, tensors, [None] * x.ndim, x.dtype)
            self._sessions[key] = ort.InferenceSession(model.SerializeToString(), session_options(),
                                                       providers=["CPUExecutionProvider"])
        return self._sessions[key].run(None, {"input": x, "router_probs": router_logits})[0]


def use_onnxruntime_experts(model) -> None:
    """Swap every expert node of a LoadedModel to onnxruntime's kernel."""
    for runner in model.decoder.steps:
        if isinstance(runner, CpuExpertNode):
            runner.kernel = OrtExpertKernel(runner, model.folder.onnx)
