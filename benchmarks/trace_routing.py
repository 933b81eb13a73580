"""Decode steps routed by a realistic routing trace instead of the model's router (benchmarks only).

Random-weight models route almost uniformly, the worst case for any cache; real models repeat recent experts and
favour some (anchors.md). To measure the engine under real-like routing, not only project it, `TraceRouting`
replaces, within its `with` block, the experts every decode step routes to in each expert layer by the trace's
(engine/offload/traces.py: [tokens, layers, k]) and keeps the model's own routing weights in rank order. Prompt
steps (more than one token) route as the model does. The tokens decoded are then not the model's; the engine's work
is what such routing asks for: hits, misses, copies, placement moves.

It wraps `route` where the hybrid expert nodes call it (engine.offload.hybrid_node.route). A node's run() calls it
once per step, in layer order, except where the step routes on the device (with the dense part on the GPU: a layer
that keeps every expert, or one whose cold experts the GPU reads from the host tier, with or without the CPU taking a
share of them): there it wraps the node's _run_resident and _run_split, which add a large bias to the trace's
experts' logits in GPU memory (on the dense part's stream, which wrote them), so that the device's routing picks them,
in the model's order among them; the statistics (account_resident, the routing route_split publishes) follow the same
biased logits. The layer is the calling node's, and a decode step starts where a
call's layer is not after the last one's.
"""
from __future__ import annotations

import sys

import numpy as np

import engine.offload.hybrid_node as hybrid_node

STEER = 64.0  # added to the trace's experts' logits where the device routes: above any other logit's lead
DEVICE_ROUTED = ("_run_resident", "_run_split")  # the HybridExpertNode methods whose steps route on the device


def _calling_node(frame, depth: int = 4):
    """The frame of the HybridExpertNode method that called route, past timing wrappers (bench_overhead's Meter);
    None if there is none within `depth` frames."""
    for _ in range(depth):
        if frame is None:
            return None
        if isinstance(frame.f_locals.get("self"), hybrid_node.HybridExpertNode):
            return frame
        frame = frame.f_back
    return None


class TraceRouting:
    def __init__(self, trace: np.ndarray, num_layers: int):
        if trace.ndim != 3 or trace.shape[1] != num_layers:
            raise ValueError(f"a trace of [tokens, {num_layers} layers, k] is needed, not {list(trace.shape)}")
        self.trace, self.num_layers = trace, num_layers
        self.calls = 0  # decode-step calls routed so far
        self.device_calls = 0  # of them, steps routed on the device (DEVICE_ROUTED)
        self._token, self._last_layer = -1, num_layers  # the trace's token of the current decode step
        self._route = None
        self._originals: dict = {}  # DEVICE_ROUTED's methods, wrapped while in the block
        self._bias = None  # _device_bias

    def _chosen(self, layer: int, k: int) -> np.ndarray:
        """The trace's experts for this layer's decode step (a new token where the layer is not after the last)."""
        if layer <= self._last_layer:
            self._token += 1
        token, self._last_layer = self._token, layer
        if token >= self.trace.shape[0]:
            raise IndexError(f"the routing trace holds {self.trace.shape[0]} tokens; decode asked for more")
        self.calls += 1
        chosen = self.trace[token, layer]
        if chosen.size != k:
            raise ValueError(f"the trace routes to {chosen.size} experts per token, the model to {k}")
        return chosen

    def _device_bias(self, cp, dtype, num_experts: int):
        """[tokens, layers, experts] in GPU memory: STEER at each step's and layer's trace experts, 0 elsewhere
        (made once, on the current stream)."""
        if self._bias is None or self._bias.dtype != dtype:
            bias = np.zeros((*self.trace.shape[:2], num_experts), dtype)
            np.put_along_axis(bias, self.trace.astype(np.int64), dtype.type(STEER), axis=2)
            self._bias = cp.asarray(bias)
        return self._bias

    def _routed(self, logits, spec, router_weights=None):
        ids, weights = self._route(logits, spec, router_weights)
        caller = _calling_node(sys._getframe(1))
        if ids.shape[0] != 1 or caller is None or caller.f_code.co_name != "run":
            return ids, weights  # a prompt step, or not a node's own routing: the model's
        chosen = self._chosen(caller.f_locals["self"].layer, ids.shape[1])
        return chosen.astype(ids.dtype).reshape(ids.shape), weights

    def _steer(self, node, store, x, logits) -> None:
        """A decode step routed on the device: its logits steered to the trace's experts, in place."""
        spec = node.info.spec
        if x.size == spec.hidden_size:  # a decode step: its logits steered to the trace's experts
            chosen = self._chosen(node.layer, spec.k)
            self.device_calls += 1
            if isinstance(logits, np.ndarray):  # the simulated device: the logits are the host's
                logits.reshape(-1)[chosen] += logits.dtype.type(STEER)
            else:  # one addition in GPU memory: the host's cost of steering kept to a launch a layer
                cp = store.device.cp
                with cp.cuda.Device(store.device.index), store.device.dense_stream or store.device.compute_stream:
                    flat = logits.reshape(-1)
                    flat += self._device_bias(cp, flat.dtype, spec.num_experts)[self._token, node.layer]

    def _steered(self, original):
        """`original` (one of DEVICE_ROUTED) with its step's logits steered first."""
        routing = self

        def run(node, store, x, logits, router_weights, *rest):  # rest: _run_split's table
            routing._steer(node, store, x, logits)
            return original(node, store, x, logits, router_weights, *rest)

        return run

    def __enter__(self):
        self._route = hybrid_node.route
        hybrid_node.route = self._routed
        node_class = hybrid_node.HybridExpertNode
        self._originals = {name: getattr(node_class, name) for name in DEVICE_ROUTED}
        for name, original in self._originals.items():
            setattr(node_class, name, self._steered(original))
        return self

    def __exit__(self, *exc):
        hybrid_node.route = self._route
        for name, original in self._originals.items():
            setattr(hybrid_node.HybridExpertNode, name, original)
        return False
