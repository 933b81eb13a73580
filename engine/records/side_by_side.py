"""Side-by-side: two configurations (or models) answer the same prompt, one after the other by
default so they don't compete, at once on request; a record for each and where they diverge."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from engine.generation import GenerationParams, LoadedModel
from engine.records.scenarios import run_turns
from engine.records.schema import RunRecord


SCENARIO = "side-by-side"
# Answered at the same time: the two shared the cores, and each side's CPU expert kernels ran beside the other side's
# OpenMP pool (a pool beside alone made a kernel call 1.32x as long on the H200 machine's 16 cores: RESULTS.md,
# twenty-fifth session), so their timings are not those of a run alone; the history keeps them apart.
SCENARIO_AT_ONCE = "side-by-side, at once"


@dataclass
class Side:
    model: LoadedModel
    device: object = None
    label: str = ""


@dataclass
class Comparison:
    records: tuple[RunRecord, RunRecord]
    divergence: int | None   # index of the first generated token where the answers differ; None if identical

    def as_dict(self) -> dict:
        return {"divergence": self.divergence, "records": [r.to_dict() for r in self.records]}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(left: Side, right: Side, prompt: str, params: GenerationParams, concurrent: bool = False,
            on_text=None, cancel: threading.Event | None = None) -> Comparison:
    """on_text(side_index, token, delta) streams both columns (from two threads when concurrent).
    `cancel` ends the answer at the next token; a side that had not started then has no turn. The records' scenario
    is SCENARIO, or SCENARIO_AT_ONCE when concurrent."""
    records: list[RunRecord | None] = [None, None]
    errors: list[BaseException] = []
    scenario = SCENARIO_AT_ONCE if concurrent else SCENARIO

    def run(index: int, side: Side) -> None:
        stream = (lambda token, delta: on_text(index, token, delta)) if on_text else None
        try:
            records[index] = run_turns(side.model, [prompt], params, side.device, scenario,
                                       side.label or f"side {'AB'[index]}", cancel, on_text=stream)
        except BaseException as exc:  # raised again in the caller's thread
            errors.append(exc)

    if concurrent:
        threads = [threading.Thread(target=run, args=(i, side)) for i, side in enumerate((left, right))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        run(0, left)
        if not errors:
            run(1, right)
    if errors:
        raise errors[0]
    answered = all(record.turns for record in records)
    divergence = first_divergence(records[0].turns[0]["tokens"], records[1].turns[0]["tokens"]) if answered else None
    return Comparison((records[0], records[1]), divergence)
