"""Decode steps routed by a realistic routing trace instead of the model's router (benchmarks only).

Random-weight models route almost uniformly, the worst case for any cache; real models repeat recent experts and
favour some (anchors.md). To measure the engine under real-like routing, not only project it, `TraceRouting`
replaces, within its `with` block, the experts every decode step routes to in each expert layer by the trace's
(engine/offload/traces.py: [tokens, layers, k]) and keeps the model's own routing weights in rank order. Prompt
steps (more than one token) route as the model does. The tokens decoded are then not the model's; the engine's work
is what such routing asks for: hits, misses, copies, placement moves.

It wraps `route` where the hybrid expert nodes call it (engine.offload.hybrid_node.route): those nodes call it once
per expert layer per step, in layer order, so the n-th decode call is token n // layers, layer n % layers.
"""
from __future__ import annotations

import numpy as np

import engine.offload.hybrid_node as hybrid_node


class TraceRouting:
    def __init__(self, trace: np.ndarray, num_layers: int):
        if trace.ndim != 3 or trace.shape[1] != num_layers:
            raise ValueError(f"a trace of [tokens, {num_layers} layers, k] is needed, not {list(trace.shape)}")
        self.trace, self.num_layers = trace, num_layers
        self.calls = 0  # decode-step calls routed so far
        self._route = None

    def _routed(self, logits, spec, router_weights=None):
        ids, weights = self._route(logits, spec, router_weights)
        if ids.shape[0] != 1:
            return ids, weights  # a prompt step: the model's routing
        token, layer = divmod(self.calls, self.num_layers)
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
