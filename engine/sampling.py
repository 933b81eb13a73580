"""Choosing the next token from logits: greedy, or sampled with temperature, top-k, top-p and a
repetition penalty (the same order and semantics as onnxruntime-genai and transformers)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0          # 0 = no limit
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def validate(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a number > 0, got {self.repetition_penalty}")
        if self.seed is not None and self.seed < 0:  # NumPy's generators take none below 0
            raise ValueError(f"seed must be >= 0, got {self.seed}")


class Sampler:
    def __init__(self, params: SamplingParams):
        params.validate()
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: list[int]) -> int:
        scores = np.asarray(logits, dtype=np.float64).copy()
        p = self.params
        if p.repetition_penalty != 1.0 and history:
            seen = np.unique(np.asarray(history, dtype=np.int64))
            seen = seen[seen < scores.size]
            scores[seen] = np.where(scores[seen] > 0, scores[seen] / p.repetition_penalty,
                                    scores[seen] * p.repetition_penalty)
        if not p.do_sample or p.temperature == 0:
            return int(np.argmax(scores))
        scores /= p.temperature
        order = np.argsort(-scores, kind="stable")
        if p.top_k:
            order = order[:p.top_k]
        probs = np.exp(scores[order] - scores[order[0]])
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)  # smallest prefix reaching top_p
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        return int(order[self._rng.choice(len(order), p=probs)])
