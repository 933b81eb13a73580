"""Choosing the next token from logits: greedy, or sampled with temperature, top-k, top-p and a
repetition penalty (the same order and semantics as onnxruntime-genai and transformers)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from engine.errors import ModelFileError
from engine.units import INT64_MAX

RECORD_SEED = 0  # the seed of recorded runs' sampled answers (record, sweep, the window's) where none is given


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0          # 0 = no limit
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    @property
    def cuts_by_top_p(self) -> bool:
        """Whether top_p cuts the tail: below 1, and not 0 beside a top_k above 1, which onnxruntime-genai samples as
        top-k alone (top_p 0 alone keeps the most likely token, the smallest set reaching 0)."""
        return self.top_p < 1 and (self.top_p > 0 or self.top_k <= 1)

    def validate(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature}")
        if not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.top_k > INT64_MAX:  # a record keeps it (and a top-k past the vocabulary is all of it)
            raise ValueError(f"top_k must be at most {INT64_MAX}, got {self.top_k}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a number > 0, got {self.repetition_penalty}")
        if self.seed is not None and self.seed < 0:  # NumPy's generators take none below 0
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.seed is not None and self.seed > INT64_MAX:  # a record keeps it
            raise ValueError(f"seed must be at most {INT64_MAX}, got {self.seed}")


def model_sampling(config) -> SamplingParams:
    """A model's own sampling defaults: genai_config.json's search section (which the builder copies from the model's
    generation_config: Qwen3's temperature 0.6, top-k 20, top-p 0.95, where greedy decoding makes thinking models
    repeat themselves), greedy unless it says do_sample, as onnxruntime-genai reads it; a value it refuses is named."""
    search = config.search
    params = SamplingParams(do_sample=search.do_sample and search.temperature > 0, temperature=search.temperature,
                            top_k=search.top_k, top_p=search.top_p, repetition_penalty=search.repetition_penalty,
                            seed=model_seed(config))
    try:
        params.validate()
    except ValueError as exc:
        raise ModelFileError(f"{config.path}: search: {exc}") from None
    return params


def model_seed(config) -> int | None:
    """genai_config.json's search.random_seed, what seeds sampling where the user gives no seed; None for its -1 (a
    fresh seed each time, as onnxruntime-genai takes it)."""
    seed = config.search.random_seed
    return seed if seed >= 0 else None


def recorded(sampling: SamplingParams, config) -> SamplingParams:
    """A recorded run's sampling (record, sweep, contention, the window's Record): where it samples, seeded (its own
    seed, else the model's search.random_seed, else RECORD_SEED) so that a repeat run samples as this one did; a
    greedy answer has no seed, and its record says none."""
    if not sampling.do_sample:
        return replace(sampling, seed=None)
    return replace(sampling, seed=next(seed for seed in (sampling.seed, model_seed(config), RECORD_SEED)
                                       if seed is not None))


def beam_search_note(config) -> str:
    """One sentence where genai_config.json asks for beam search (search.num_beams above 1, which the builder copies
    from the model's generation config), which the engine does not do; "" otherwise."""
    beams = config.search.num_beams
    if beams <= 1:
        return ""
    return (f"The model's genai_config.json asks for beam search (search.num_beams {beams}), which MoE Workbench does "
            "not do: its answers are one sequence, greedy or sampled")


def describe(params: SamplingParams) -> str:
    """'greedy', or the sampling settings in the words of the chat's settings and generate's options."""
    if not params.do_sample:
        return "greedy"
    words = [f"temperature {params.temperature:g}"]
    if params.top_k:
        words.append(f"top-k {params.top_k}")
    if params.cuts_by_top_p:
        words.append(f"top-p {params.top_p:g}")
    if params.repetition_penalty != 1:
        words.append(f"repetition penalty {params.repetition_penalty:g}")
    return ", ".join(words)


class Sampler:
    def __init__(self, params: SamplingParams):
        params.validate()
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: list[int], banned: tuple[int, ...] = ()) -> int:
        """The next token after `history`, never one of `banned` (the end of text before search.min_length)."""
        scores = self._scores(logits, history, banned)
        p = self.params
        if not p.do_sample or p.temperature == 0:
            return int(np.argmax(scores))
        scores /= p.temperature
        order = np.argsort(-scores, kind="stable")
        if p.top_k:
            order = order[:p.top_k]
        probs = np.exp(scores[order] - scores[order[0]])
        probs /= probs.sum()
        if p.cuts_by_top_p:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)  # smallest prefix reaching top_p
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        return int(order[self._rng.choice(len(order), p=probs)])

    def greedy(self, logits: np.ndarray, history: list[int], banned: tuple[int, ...] = ()) -> int:
        """The token a greedy choice takes after `history` (what approximate routing's agreement compares)."""
        return int(np.argmax(self._scores(logits, history, banned)))

    def _scores(self, logits: np.ndarray, history: list[int], banned: tuple[int, ...]) -> np.ndarray:
        """The logits as the choice reads them: `banned` out, the tokens of `history` penalised."""
        scores = np.asarray(logits, dtype=np.float64).copy()
        p = self.params
        if banned:
            scores[[token for token in banned if token < scores.size]] = -np.inf
        if p.repetition_penalty != 1.0 and history:
            seen = np.unique(np.asarray(history, dtype=np.int64))
            seen = seen[seen < scores.size]
            scores[seen] = np.where(scores[seen] > 0, scores[seen] / p.repetition_penalty,
                                    scores[seen] * p.repetition_penalty)
        return scores
