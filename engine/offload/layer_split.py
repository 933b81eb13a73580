"""Whether the expert budget is spread over every layer or spent on whole layers, chosen by measuring both (issue #4).

The planner spreads the budget evenly, as onnxruntime's offload does: every layer keeps some experts resident, and
where routing repeats recent experts most of a token's experts are hits in every layer. But every layer then takes the
hybrid path: its inputs come to the host, the miss policy decides, the CPU computes the misses and the result goes
back to the device, some hundreds of µs of host work a layer on the H200 machine. A layer that keeps all its experts
runs all on the device with no host round trip; a layer with none runs all on the CPU. Where routing has little
locality (random weights; nearly uniform routers) the spread's hit rate is only its slot fraction, and whole layers
decoded 1.14-1.66x faster on the H200 machine; with real-like routing the spread was as fast or faster (RESULTS.md,
twentieth session). Which one wins depends on the model, the routing and the machine, so the engine measures it.

The trials (trials.py) time `window` decode steps of the spread, of whole layers, and of the spread again (A-B-A);
whole layers are kept only when `margin` faster (the spread is onnxruntime's way and follows routing's locality: it
wins ties). The spread's second window comes after adaptive placement has learnt the routing for longer (its scores go
on learning under whole layers too, and a re-plan fills the slots by them). On the H200 machine a trial under a
realistic trace chose whole layers where the spread decoded faster in other runs (RESULTS.md, twenty-first session): a
first window caught in a slow spell or with placement still moving to the trace's experts is the likely reason, not
confirmed. A trial costs two re-plans, three where it switches (the residents copied again: ~0.1-0.3 s for
Qwen3-30B-A3B-like at half residency). On the simulated device the step times compared are those projected for the
card it simulates (OffloadEngine._trial_seconds, projection.py): its wall time computes the "device" experts on the
CPU.
"""

from __future__ import annotations

import os

from engine.errors import WorkbenchError
from engine.offload.trials import AbaTrials

SPREAD, WHOLE = "spread", "whole"
MODES = ("auto", SPREAD, WHOLE)  # auto: trials decide; spread / whole: that split, no trials
BOTH = (SPREAD, WHOLE)  # a budget sweep's splits where it compares them (engine/records/sweep.py)


def checked_split(mode: str) -> str:
    """`mode` if it is one of MODES; else a WorkbenchError naming it."""
    if mode not in MODES:
        raise WorkbenchError(f"layer split '{mode}': one of {', '.join(MODES)}")
    return mode


def default_layer_split() -> str:
    """The split an engine takes when none is asked for: MOE_LAYER_SPLIT (benchmarks' A/Bs, the test suite), else
    auto."""
    return os.environ.get("MOE_LAYER_SPLIT", "auto")


class LayerSplitTrials(AbaTrials):
    def __init__(self, **settings):
        super().__init__(SPREAD, WHOLE, **settings)

    @property
    def split(self) -> str:
        """The split in force."""
        return self.choice
