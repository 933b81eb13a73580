"""Approximate routing (off by default): drop or substitute tail experts that are cold, and
measure what it costs in answers.

min_expert_weight drops routed experts whose weight is below it (only cold ones with
skip_tail_cold_only), never the top-ranked one; tail_substitution_threshold replaces a cold expert
of rank >= tail_substitution_min_rank (0 = the top-ranked one too, as onnxruntime allows) and weight
below the threshold by the resident expert the router scores highest among those not chosen.
Weights are not renormalised: a dropped expert's share is simply missing, as in onnxruntime's
description.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from engine.offload.config import OffloadConfig
from engine.units import counted


@dataclass
class ApproximationCounts:
    dropped: int = 0
    substituted: int = 0


def approximate_routing(ids: np.ndarray, weights: np.ndarray, logits: np.ndarray, slot_of: np.ndarray,
                        config: OffloadConfig, counts: ApproximationCounts) -> np.ndarray:
    """Returns new expert ids [T, k] (-1 = dropped); `weights` stay aligned by position."""
    routed, ids = ids, ids.copy()
    cold = slot_of[ids] < 0
    rank = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    if config.min_expert_weight > 0:
        drop = (weights < config.min_expert_weight) & (rank > 0)
        if config.skip_tail_cold_only:
            drop &= cold
        ids[drop] = -1
        counts.dropped += int(np.count_nonzero(drop))
    if config.tail_substitution_threshold > 0:
        candidates = (ids >= 0) & cold & (rank >= config.tail_substitution_min_rank) & (
            weights < config.tail_substitution_threshold)
        resident = np.flatnonzero(slot_of >= 0)
        for t, j in zip(*np.nonzero(candidates)):
            # not one the router chose: an expert min_expert_weight dropped would come back with a higher rank's weight
            free = resident[~(np.isin(resident, routed[t]) | np.isin(resident, ids[t]))]
            if free.size:
                ids[t, j] = free[np.argmax(logits[t, free])]
                counts.substituted += 1
    return ids


class AgreementMeter:
    """Token agreement between the approximate run and exact routing, teacher-forced: a shadow
    state with exact routing is fed the same tokens, and at each step both greedy choices are
    compared (`choose`: the token greedy decoding takes from logits at that point of the answer, its repetition
    penalty and banned end of text applied as the sampler applies them). It costs a second forward pass, and runs only
    while approximate routing is on: `catch_up_s` and `step_s` are its seconds, which the answer's timings leave out
    (they would halve the rate approximate routing is measured at)."""

    def __init__(self, model, history: list[int], choose):
        self.model = model
        self.choose = choose
        self.state = model.new_state()
        self.agreed = 0
        self.steps = 0
        self.step_s = 0.0
        self._caught_up = None  # the catch-up's last logits: what a prompt answered again from its snapshot is met by
        started = time.perf_counter()
        if history:  # a later turn: the shadow first catches up on the conversation so far
            with model.offload.exact_routing():
                self._caught_up = model.decoder.forward(self.state, history)[-1]
        self.catch_up_s = time.perf_counter() - started

    def step(self, token_ids, approximate_logits: np.ndarray) -> None:
        started = time.perf_counter()
        with self.model.offload.exact_routing():
            exact = self.model.decoder.forward(self.state, token_ids)[-1]
        self._compare(exact, approximate_logits)
        self.step_s += time.perf_counter() - started

    def resumed(self, prompt_logits: np.ndarray) -> None:
        """The first token of an answer given from its prompt's snapshot (no prompt fed), compared with the exact
        logits the catch-up ended on."""
        self._compare(self._caught_up, prompt_logits)

    def _compare(self, exact: np.ndarray, approximate_logits: np.ndarray) -> None:
        self.agreed += int(self.choose(exact) == self.choose(approximate_logits))
        self.steps += 1

    @property
    def agreement(self) -> float:
        return self.agreed / self.steps if self.steps else 1.0


def agreement_text(agreement: float, tokens: int) -> str:
    """An answer's agreement as a user reads it: of its tokens, not of routing choices, and of how many (the meter
    compares each token once, so the count is exact)."""
    return f"token agreement with exact routing {agreement:.0%} ({round(agreement * tokens)} of {counted(tokens, 'token')})"
