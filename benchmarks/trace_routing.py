"""Decode steps routed by a realistic routing trace instead of the model's router (benchmarks only).

Random-weight models route almost uniformly, the worst case for any cache; real models repeat recent experts and
favour some (anchors.md). To measure the engine under real-like routing, not only project it, `TraceRouting`
replaces, within its `with` block, the experts every decode step routes to in each expert layer by the trace's
(engine/offload/traces.py: [tokens, layers, k]) and keeps the model's own routing weights in rank order. Prompt
steps (more than one token) route as the model does. The tokens decoded are then not the model's; the engine's work
is what such routing asks for: hits, misses, copies, placement moves.

It wraps `route` where the hybrid expert nodes call it (engine.offload.hybrid_node.route). A node's run() calls it
once per step, in layer order, except where the layer keeps every expert (with the dense part on the GPU such a layer
routes on the device: the model's routing, and all of it hits); the layer is the calling node's, and a decode step
starts where a call's layer is not after the last one's. The statistics' routing of a fully resident layer
(account_resident) keeps the model's routing, as its launch did.
"""
from __future__ import annotations

import sys

import numpy as np

import engine.offload.hybrid_node as hybrid_node


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
        self._token, self._last_layer = -1, num_layers  # the trace's token of the current decode step
        self._route = None

    def _routed(self, logits, spec, router_weights=None):
        ids, weights = self._route(logits, spec, router_weights)
        caller = _calling_node(sys._getframe(1))
        if ids.shape[0] != 1 or caller is None or caller.f_code.co_name != "run":
            return ids, weights  # a prompt step, or not a node's own routing: the model's
        layer = caller.f_locals["self"].layer
        if layer <= self._last_layer:
            self._token += 1
        token, self._last_layer = self._token, layer
        if token >= self.trace.shape[0]:
            raise IndexError(f"the routing trace holds {self.trace.shape[0]} tokens; decode asked for more")
        self.calls += 1
        chosen = self.trace[token, layer]
        if chosen.size != ids.shape[1]:
            raise ValueError(f"the trace routes to {chosen.size} experts per token, the model to {ids.shape[1]}")
        return chosen.astype(ids.dtype).reshape(ids.shape), weights

    def __enter__(self):
        self._route = hybrid_node.route
        hybrid_node.route = self._routed
        return self

    def __exit__(self, *exc):
        hybrid_node.route = self._route
        return False
