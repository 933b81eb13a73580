"""Side-by-side: two configurations (or models) answer the same prompt, one after the other by
default so they don't compete, at once on request; a record for each, where they diverge, and how firmly each side
chose its token there (a near tie that rounding can tip, or a clear difference)."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.errors import one_line
from engine.generation import GenerationParams, LoadedModel
from engine.offload.planner import under_limit
from engine.records.scenarios import run_turns, warm_up_answer
from engine.records.schema import RunRecord


SCENARIO = "side-by-side"
# Answered at the same time: the two shared the cores, and each side's CPU expert kernels ran beside the other side's
# OpenMP pool (a pool beside alone made a kernel call 1.32x as long on the H200 machine's 16 cores: RESULTS.md,
# twenty-fifth session), so their timings are not those of a run alone; the history keeps them apart.
SCENARIO_AT_ONCE = "side-by-side, at once"
# Below this log-probability margin a choice is a near tie: two configurations that round differently (another
# kernel, another summation order) can choose differently there, and with random weights they often do.
NEAR_TIE = 0.1


@dataclass
class Side:
    model: LoadedModel | None  # None: this side could not load (`failure` says why) and answers nothing
    device: object = None
    label: str = ""
    failure: str | None = None


@dataclass(frozen=True)
class SideBudget:
    """A side's expert budget as its plan set it, and the free device memory it was set beside (OffloadPlan)."""
    budget_bytes: int
    asked_bytes: int | None  # device_expert_bytes; None: automatic (the free memory less reserve_device_bytes)
    free_bytes: int
    leaves_cold: bool    # some expert has no slot, so a smaller budget costs this side speed
    limited: bool        # gpu_device_mem_limit, not the device's memory, bounds what it had free

    @property
    def automatic(self) -> bool:
        return self.asked_bytes is None

    @property
    def cut(self) -> bool:
        """A device_expert_bytes above what the device had free, cut to that (the planner's clamp)."""
        return self.asked_bytes is not None and self.budget_bytes < self.asked_bytes


def side_budget(side: Side) -> SideBudget | None:
    """None: no model, no device, or offload disabled (the expert budgets do not apply)."""
    offload = side.model.offload if side.model is not None else None
    if offload is None or side.device is None or offload.config.mode == "disabled":
        return None
    plan = offload.plan
    return SideBudget(plan.budget_bytes, offload.config.device_expert_bytes, plan.free_bytes, plan.leaves_cold,
                      bool(under_limit(side.device)))


def budget_beside_a(budgets: tuple[SideBudget | None, SideBudget | None]) -> bool:
    """Whether B's budget, automatic or cut to what the device had free, came out smaller than B's settings give
    alone: B is loaded while A stays loaded and holds its part of the device, so B's budget is set from less free
    memory than A's plan saw (where no gpu_device_mem_limit of B's bounds it anyway), and B keeps experts cold that
    more budget would hold."""
    a, b = budgets
    return (a is not None and b is not None and (b.automatic or b.cut) and b.leaves_cold and not b.limited
            and b.free_bytes < a.free_bytes)


@dataclass
class Comparison:
    records: tuple[RunRecord | None, RunRecord | None]  # None: that side failed
    divergence: int | None   # index of the first generated token where the answers differ; None if identical (or
                             # compared as text)
    # at the divergence, by how much each side's model preferred its own token to the other side's (their
    # logits' difference: the log-probabilities differ by as much); None where one answer only stopped earlier, or
    # for two models (each has its own vocabulary)
    margins: tuple[float, float] | None = None
    failures: tuple[str | None, str | None] = (None, None)  # each side's error on one line, where it could not answer
    margins_failure: str | None = None  # why the margins could not be computed (the answers stand), on one line
    # two models whose tokenizers differ: their token ids mean different text, so the answers are compared as text
    # (each side's reasoning, then its answer): `text_divergence` is the first character where they differ, None if
    # identical, and `divergence` is None
    by_text: bool = False
    text_divergence: int | None = None
    budgets: tuple[SideBudget | None, SideBudget | None] = (None, None)  # each side's expert budget (side_budget)

    def as_dict(self) -> dict:
        return {"divergence": self.divergence, "margins": self.margins, "failures": list(self.failures),
                "margins_failure": self.margins_failure, "by_text": self.by_text,
                "text_divergence": self.text_divergence,
                "budgets": [asdict(budget) if budget is not None else None for budget in self.budgets],
                "records": [r.to_dict() if r is not None else None for r in self.records]}


def preference(model: LoadedModel, prompt: str, answer: list[int], own: int, other: int) -> float:
    """How much `model`, fed `prompt` as a new conversation sends it and then `answer`, prefers the token `own` to
    `other` next: the difference of their logits."""
    # the forward pass reads the mapped experts outside any answer: past the end of a data file cut short since the
    # answers, a read kills the process (SIGBUS)
    model.folder.onnx.check_mapped_files()
    text = model.tokenizer.render_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
    logits = model.decoder.forward(model.new_state(), model.tokenizer.encode(text) + list(answer))[-1]
    return float(logits[own] - logits[other])


def same_folder(a: LoadedModel, b: LoadedModel) -> bool:
    return Path(a.folder.folder).resolve() == Path(b.folder.folder).resolve()


def same_tokenizer(a: LoadedModel, b: LoadedModel) -> bool:
    """Whether the two models' token ids mean the same text (one folder, or the same tokenizer)."""
    return same_folder(a, b) or a.tokenizer.same_as(b.tokenizer)


def generated_text(record: RunRecord) -> str:
    """A side's first turn as it was generated: its reasoning, then its answer."""
    turn = record.turns[0]
    return (turn.get("reasoning") or "") + turn["answer"]


def first_divergence(a, b) -> int | None:
    """The first index where two sequences (token ids, or text) differ; None if they are equal."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(left: Side, right: Side, prompt: str, params: GenerationParams, concurrent: bool = False,
            on_text=None, cancel: threading.Event | None = None, on_reasoning=None, on_done=None) -> Comparison:
    """on_text(side_index, token, delta) streams both columns (from two threads when concurrent), and
    on_reasoning(side_index, token, delta) their reasoning (generate's on_reasoning).
    on_done(side_index, finish_reason, generated_tokens) as each side that has a model ends, from its thread: its
    answer's finish reason and length, ("cancelled", 0) where it had not begun, ("error", None) where it failed.
    `cancel` ends the answer at the next token; a side that had not started then has no turn, and no margins are
    computed after it (their forward passes are engine work). The records' scenario
    is SCENARIO, or SCENARIO_AT_ONCE when concurrent. A side that fails (or could not load) has no record and its
    error in `failures`; the other side answers all the same."""
    records: list[RunRecord | None] = [None, None]
    failures: list[str | None] = [left.failure, right.failure]
    errors: list[BaseException] = []
    # else one answers alone; one model on both sides answers one after the other (its decoder state, offload engine
    # and statistics serve one answer at a time)
    concurrent = concurrent and left.model is not None and right.model is not None and left.model is not right.model
    scenario = SCENARIO_AT_ONCE if concurrent else SCENARIO

    def run(index: int, side: Side) -> None:
        if side.model is None:
            return
        stream = (lambda token, delta: on_text(index, token, delta)) if on_text else None
        reasoning = (lambda token, delta: on_reasoning(index, token, delta)) if on_reasoning else None
        try:
            records[index] = run_turns(side.model, [prompt], params, side.device, scenario,
                                       side.label or f"side {'AB'[index]}", cancel, on_text=stream,
                                       on_reasoning=reasoning)
        except Exception as exc:  # this side's answer fails, not the comparison
            failures[index] = one_line(exc, side.model.offload_mode)  # said as this side's own mode says it
        except BaseException as exc:  # raised again in the caller's thread
            errors.append(exc)
            return
        if not on_done:
            return
        record = records[index]
        if failures[index]:
            on_done(index, "error", None)
        elif record.turns:
            on_done(index, record.turns[0]["finish_reason"], record.turns[0]["generated_tokens"])
        else:
            on_done(index, "cancelled", 0)

    if concurrent:
        # each side's warm-up answer before either clock starts: given in the threads (run_turns), the one that ended
        # first would time its answer beside the other's warm-up
        for side in (left, right):
            if side.model.warm_up_s is None and (cancel is None or not cancel.is_set()):
                with contextlib.suppress(Exception):  # (its run gives it again, and its failure is the side's)
                    warm_up_answer(side.model, cancel)
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
    for record, side, other in zip(records, (left, right), (right, left)):
        if record is not None:
            # One process holds both sides' models (B is loaded beside A, which stays loaded), so its RSS and VRAM
            # peaks hold the other side's too; said, not subtracted: the level before an answer holds this side's
            # own model as well, the two may map the same model file's pages, and at once the other side is busy.
            record.peaks["other_side_loaded"] = other.model is not None and other.model is not side.model
    answered = all(record is not None and record.turns for record in records)
    tokens = [record.turns[0]["tokens"] for record in records] if answered else None
    by_text = answered and not same_tokenizer(left.model, right.model)
    divergence = first_divergence(*tokens) if answered and not by_text else None
    text_divergence = first_divergence(*(generated_text(record) for record in records)) if by_text else None
    margins = margins_failure = None
    stopped = cancel is not None and cancel.is_set()  # stop means no more engine work: no margins' forward passes
    if (divergence is not None and not stopped and same_folder(left.model, right.model)
            and all(divergence < len(side) for side in tokens)):
        prefix, (a, b) = tokens[0][:divergence], (side[divergence] for side in tokens)
        preferred = []
        for model, own, other in ((left.model, a, b), (right.model, b, a)):
            try:
                preferred.append(preference(model, prompt, prefix, own, other))
            except Exception as exc:  # the two answers and their records stand without them
                margins_failure = one_line(exc, model.offload_mode)  # the failing side's mode says it
                break
        else:
            margins = (preferred[0], preferred[1])
    return Comparison((records[0], records[1]), divergence, margins, (failures[0], failures[1]), margins_failure,
                      by_text, text_divergence, (side_budget(left), side_budget(right)))
