"""Budget sweeps: run the scenarios at several expert budgets on one loaded model (re-planned,
not reloaded) and recommend, of the points within a margin of the fastest or tied with it (their repeats' spreads
overlap), the one with the least device peak (recommendation). With `splits`, each budget that holds some but not all
expert layers whole is run with the budget spread over every layer and on whole layers (engine/offload/layer_split.py),
fixed for the point.

After each re-plan the engine tries its ways (the decode path, the CPU's share under "both", the layer split:
trials.py) for up to ~200 decode steps, more than a sweep's answers give: a point's answers would time the ways tried,
not the one kept. So each point first decodes, unrecorded, until those trials are over (`settle`), and its answers
then run as a user's do at that budget once the engine has chosen, the trials' next measurement held until they end.
(Holding the path in force at the sweep's start instead ran every point on the CPU path where the model was loaded
with every expert resident: on the H100 machine a 4-layer gpt-oss-20b-shaped model decoded 50 tok/s at 25-75%
resident against 118 all-CPU.)"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from statistics import median

from engine.errors import PromptError, WorkbenchError, users_error
from engine.generation import GenerationParams, LoadedModel
from engine.offload.layer_split import SPREAD, WHOLE
from engine.offload.planner import BudgetAboveFree, all_resident_bytes, whole_layers_held
from engine.records.lengths import SWEEP_REPEATS
from engine.records.scenarios import (TIER_MAPPINGS, TIER_MAPPINGS_WHY, WARM_UP_TOKENS, decoded_tokens,
                                      device_parts_text, run_scenario, scenario_turns, warm_up_answer)
from engine.records.schema import RunRecord, decode_path_run
from engine.units import duration_text, human_bytes


@dataclass
class SweepPoint:
    budget_bytes: int
    # the budget's share of what every expert resident takes, in bytes (the table's "budget share"), not a share of
    # the experts: resident_share counts those
    fraction: float
    records: list[RunRecord] = field(default_factory=list)  # the runs, repeat by repeat: each repeat every scenario
    split: str | None = None  # the layer split the point ran with, where the sweep compared splits
    settle_steps: int = 0  # decode steps run before the point's answers, until the engine's trials were over
    repeats: int = 1  # the times the point ran its scenarios: its times are the medians over them
    # what the device held at the point's device peak, by part (scenarios.device_parts): what that peak is made of
    device_parts: dict[str, int] = field(default_factory=dict)
    # the layer split the point's answers ran on where the budget holds some but not all layers whole (`split`, or
    # the one --layer-split fixed, the engine's trial kept, or the spread where no trial ran, as with the plan's host
    # tier), None where the two hold the same
    split_run: str | None = None
    # the seconds of the point's unrecorded answer at its budget before its runs, which every one of them follows
    # (each record's point_warm_up_s); None where it gave none (a point made by hand)
    warm_up_s: float | None = None

    def repeat_runs(self) -> list[list[RunRecord]]:
        """The point's records, one list (every scenario's run) a repeat."""
        size = len(self.records) // self.repeats if self.records else 0
        return [self.records[i * size:(i + 1) * size] for i in range(self.repeats)] if size else []

    def repeat_seconds(self, projected: bool) -> list[float]:
        """Each repeat's completion time (its scenarios' together), projected for the simulated card or measured."""
        def seconds(record: RunRecord) -> float:
            return record.timings["projected"]["completion_s"] if projected else record.timings["completion_s"]
        return [sum(seconds(r) for r in runs) for runs in self.repeat_runs()]

    def spread_s(self, projected: bool) -> float:
        """How far the repeats' completion times stray from their median: their median absolute deviation, which one
        repeat slowed by something else on the machine does not widen (0 with one repeat)."""
        times = self.repeat_seconds(projected)
        if not times:
            return 0.0
        middle = median(times)
        return median(abs(t - middle) for t in times)

    @property
    def completion_s(self) -> float:
        """The median of the repeats' completion times."""
        times = self.repeat_seconds(projected=False)
        return median(times) if times else 0.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        """The median of the repeats' decode rates; a repeat's is its decoded tokens over their decode time, every
        run's turns together (not the mean of the runs' rates, where a short run's one answer weighed as much as a
        multiturn run's six). None where no repeat decoded a token past its answers' first (one-token answers), as a
        record's rate is: 0 would read as decoding stalled."""
        def rate(records: list[RunRecord]) -> float | None:
            seconds = sum(turn["timings"]["decode_s"] for r in records for turn in r.turns)
            tokens = sum(decoded_tokens(r.turns) for r in records)
            return tokens / seconds if tokens and seconds else None
        return _median_rate(rate(runs) for runs in self.repeat_runs())

    @property
    def projected(self) -> bool:
        """Every record carries a projection for the simulated card (a sweep on the simulated device)."""
        return bool(self.records) and all(r.timings.get("projected") for r in self.records)

    @property
    def projected_completion_s(self) -> float | None:
        """Completion time projected for the simulated card (engine/offload/projection.py), the median of the
        repeats'; None off it."""
        if not self.projected:
            return None
        return median(self.repeat_seconds(projected=True))

    @property
    def projected_decode_tokens_per_s(self) -> float | None:
        """The projected decode rate for the simulated card, the median of the repeats' (None as decode_tokens_per_s
        is, or off the simulated device)."""
        if not self.projected:
            return None

        def rate(records: list[RunRecord]) -> float | None:
            # a record keeps its projected rate, not its projected decode time: that is its decoded tokens over the rate
            timed = [(decoded_tokens(r.turns), r.timings["projected"]["decode_tokens_per_s"]) for r in records
                     if r.timings["projected"].get("decode_tokens_per_s")]
            seconds = sum(tokens / rate for tokens, rate in timed)
            return sum(tokens for tokens, _rate in timed) / seconds if seconds else None
        return _median_rate(rate(runs) for runs in self.repeat_runs())

    @property
    def routing_agreement(self) -> float | None:
        """With approximate routing, the point's token agreement with exact routing over its answers' tokens (as a
        record's is over its turns'); None where routing was exact."""
        measured = [r for r in self.records if r.routing_agreement is not None]
        tokens = sum(r.generated_tokens for r in measured)
        return sum(r.routing_agreement * r.generated_tokens for r in measured) / tokens if tokens else None

    @property
    def compared_tokens(self) -> int:
        """The answer tokens routing_agreement compared."""
        return sum(r.generated_tokens for r in self.records if r.routing_agreement is not None)

    @property
    def resident_share(self) -> float | None:
        """The share of the model's experts placement kept resident on the device as the point's runs ended (their
        mean), as the landed statement counts them: not the slots adaptive placement leaves to copied misses on the
        CPU path, whose copies come and go with the miss policy's timings (scenarios.offload_description). The
        budget's share, `fraction`, counts bytes, of which each layer takes the whole experts that fit (and on whole
        layers the budget past the layers it fills is not used): at 67% of two 8-expert layers, 5 of 8 in each, 62%."""
        shares = [r.offload["resident_experts"] / sum(node["experts"] or 0 for node in r.model["expert_nodes"])
                  for r in self.records if r.offload.get("resident_experts") is not None]
        return sum(shares) / len(shares) if shares else None

    @property
    def copy_slot_share(self) -> float | None:
        """The device slots placement left to copied misses as the point's runs ended, as a share of the model's
        experts (their mean): the budget `resident_share` leaves out, holding whichever misses were copied last."""
        shares = [r.offload["copy_slots"] / sum(node["experts"] or 0 for node in r.model["expert_nodes"])
                  for r in self.records if r.offload.get("copy_slots") is not None]
        return sum(shares) / len(shares) if shares else None

    @property
    def peak_device_bytes(self) -> int:
        return max((r.peaks["device_bytes"] or 0) for r in self.records) if self.records else 0

    @property
    def peak_rss_bytes(self) -> int:
        return max(r.peaks["rss_bytes"] for r in self.records) if self.records else 0

    @property
    def decode_path(self) -> str | None:
        """The decode path the point's answers ran on; "all resident" where no expert was cold (the path in force,
        cpu by default, would read as decoding on the CPU)."""
        return decode_path_run(self.records[0].offload) if self.records else None

    def as_dict(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "fraction": self.fraction, "resident_share": self.resident_share,
                "copy_slot_share": self.copy_slot_share, "split": self.split,
                "completion_s": self.completion_s,
                "decode_tokens_per_s": self.decode_tokens_per_s, "peak_device_bytes": self.peak_device_bytes,
                "peak_rss_bytes": self.peak_rss_bytes, "settle_steps": self.settle_steps,
                "decode_path": self.decode_path, "repeats": self.repeats, "device_parts": self.device_parts,
                "layer_split_run": self.split_run, "warm_up_s": self.warm_up_s,
                "repeat_completion_s": self.repeat_seconds(projected=False),
                **({"routing_agreement": self.routing_agreement} if self.routing_agreement is not None else {}),
                **({"projected_completion_s": self.projected_completion_s,
                    "projected_repeat_completion_s": self.repeat_seconds(projected=True),
                    "projected_decode_tokens_per_s": self.projected_decode_tokens_per_s,
                    "projected_bandwidths": self.records[0].timings["projected"].get("bandwidths")}
                   if self.projected else {})}


def _median_rate(rates) -> float | None:
    """The median of the repeats' rates that exist (a repeat of one-token answers has none); None where none does."""
    known = [rate for rate in rates if rate is not None]
    return median(known) if known else None


# check_mode's refusal, which the window's text before a sweep says too
DISABLED_REFUSED = ("a budget sweep compares expert budgets, and mode=disabled offloads no expert: sweep under "
                    "mode=auto or required")


def check_mode(mode: str) -> None:
    """Refuse a sweep under offload `mode` disabled, in one line (the command line's and the window's words): every
    expert goes where the dense part runs there, so each budget would run the same plan and compare nothing."""
    if mode == "disabled":
        raise WorkbenchError(DISABLED_REFUSED)


def budget_points(total_expert_bytes: int, count: int) -> list[tuple[float, int]]:
    """`count` budgets from none to every expert resident: (fraction, bytes)."""
    if count < 2:
        raise ValueError("a sweep needs at least 2 points")
    return [(i / (count - 1), round(total_expert_bytes * i / (count - 1))) for i in range(count)]


def share_decimals(fractions) -> int:
    """The fewest decimals of a percent that tell these budget shares apart: none where the points are a percent or
    more apart (up to 101 points), more for closer ones (201 points: 0.5%, 1.0%), whose runs' history labels would
    otherwise name several budgets as one."""
    shares = set(fractions)
    decimals = 0
    while len({f"{share:.{decimals}%}" for share in shares}) < len(shares):
        decimals += 1
    return decimals


def sweep_plan(model: LoadedModel, points: int, splits: tuple[str, ...] | None = None) -> list[tuple]:
    """(fraction, budget, split) of every point: each budget once (split None), or with `splits` once per split
    where the splits differ (a budget that holds some but not all expert layers whole), once (spread) elsewhere.
    Under offload mode 'required', which refuses a budget that holds no expert, the points below the smallest budget
    that holds one run once at that budget. A budget is run once however many points round to it."""
    infos = model.offload.infos
    layers = sum(1 for info in infos if info.gpu is not None)
    plan = []
    # 100% = every expert in a device slot: slots may be larger than the stored experts (converted layouts,
    # the prefill's fp16 scale copy), so the stored size would stop short of all resident
    total = all_resident_bytes(infos)
    smallest = min((info.device_bytes_per_expert for info in infos if info.gpu is not None), default=0)
    for fraction, budget in budget_points(total, points):
        if budget < smallest and model.offload.config.mode == "required":
            budget = smallest
            fraction = budget / total
        if plan and plan[-1][1] == budget:  # many points on few experts' bytes, or several below one expert
            continue
        if not splits:
            plan.append((fraction, budget, None))
        elif 0 < whole_layers_held(infos, budget) < layers:
            plan += [(fraction, budget, split) for split in splits]
        else:
            plan.append((fraction, budget, SPREAD))
    return plan


def fitting_scenarios(model: LoadedModel, scenarios: list[str], max_new_tokens: int,
                      reasoning: str | None = None) -> tuple[list[str], str]:
    """The scenarios scenario_turns accepts (with the answers' `reasoning` setting, as they render), and a line naming
    those it refuses (the long input on a short context) and why, "" where it refuses none: a sweep skips them, as the
    window's Record does, rather than refusing them at its first point (a multiturn whose later turns the context
    cannot hold still fails there). None accepted is a PromptError."""
    fits, skipped = [], []
    for name in scenarios:
        try:
            scenario_turns(name, model.tokenizer, model.config, max_new_tokens, reasoning)
        except PromptError as exc:
            skipped.append((name, str(exc)))
            continue
        fits.append(name)
    if not fits:
        raise PromptError("; ".join(reason for _name, reason in skipped))
    return fits, "; ".join(f"skipped {name}: {reason}" for name, reason in skipped)


def reasoning_length_note(own: int | None, max_new_tokens: int, reasoning: str | None = None) -> str:
    """What to say where a sweep's answer length stops a model that reasons first inside its reasoning (`own`: its
    LoadedModel.reasoning_answer_tokens, None for a model that answers at once; `reasoning`: the answers' setting, under
    which Qwen3's thinking "off" answers at once, after the empty think block its template writes). A sweep keeps the
    length it is given for every model: it times the same work at each budget, and reasoning decodes as an answer does,
    while a reasoning model's own length, thousands of tokens a run at every point and scenario, could make a sweep
    hours long."""
    if own is None or max_new_tokens >= own or reasoning == "off":
        return ""
    return (f"answers stop after {max_new_tokens} tokens, inside the reasoning of this model, which reasons first: a "
            f"sweep times the same work at each budget, and reasoning decodes as an answer does (the model's own "
            f"length is {own} tokens a run)")


# a first decode path trial ends by its 76th step, "both"'s first share trial 76 steps later and its row trial 48 after
# that, settled after the share trial's last switch (200 in all): room past them for a window a noisy step lengthened
SETTLE_STEPS_MAX = 264


def settle(model: LoadedModel, cancel: threading.Event | None = None) -> int:
    """Greedy decode steps, not recorded, until the engine's trials at the budget just planned are over
    (OffloadEngine.trials_pending), at most SETTLE_STEPS_MAX. Returns the steps run. Where the context is full, the
    steps go on in a new conversation (a model with a short context would otherwise leave the trials under way for
    the point's answers). They start once the background work the re-plan started is done (back from every expert
    resident: the experts' pages mapped in, their mapping page-locked): trials timed beside it would keep a way for
    the point's answers, which wait for it (run_turns), from steps it slowed."""
    model.wait_until_settled(cancel)
    if cancel is not None and cancel.is_set():
        return 0
    # its steps read the mapped experts outside any answer: past the end of a data file cut short since the load (the
    # wait above can take minutes), a read kills the process (SIGBUS)
    model.folder.onnx.check_mapped_files()
    # a tokenizer that encodes the text to nothing: a token of the model's own (the prompt only has to be one)
    prompt = model.tokenizer.encode("The experts of a mixture") or [_any_token(model)]
    prompt = prompt[:max(1, model.config.context_length - 1)]
    steps, state = 0, None
    for _ in range(2 * SETTLE_STEPS_MAX):  # forwards, the new conversations' prompts among them (a 1-token context)
        if steps >= SETTLE_STEPS_MAX or not model.offload.trials_pending or (cancel is not None and cancel.is_set()):
            break
        if state is None or state.past_length >= model.config.context_length:
            state = model.new_state()
            token = int(model.decoder.forward(state, prompt)[-1].argmax())
            continue
        token = int(model.decoder.forward(state, [token])[-1].argmax())
        steps += 1
    return steps


def _any_token(model: LoadedModel) -> int:
    config = model.config
    for token in (config.bos_token_id, *config.eos_token_ids, config.pad_token_id):
        if token is not None:
            return int(token)
    return 0


def run_sweep(model: LoadedModel, device, points: int, scenarios: list[str], params: GenerationParams,
              label: str = "sweep", progress=None, cancel: threading.Event | None = None,
              on_text=None, splits: tuple[str, ...] | None = None, on_point=None, on_settle=None,
              on_left_out=None, repeats: int = SWEEP_REPEATS, length_setting: str = "answer length",
              on_warm_up=None) -> list[SweepPoint]:
    """`cancel` (checked between tokens) ends the sweep early: SweepCancelled, whose note, as that of anything a
    point raises, says at which point (stopped_at); the points completed before it went to `on_point`.
    `progress(fraction)` after each scenario run; `on_text(token, delta)` streams every answer; `on_settle(fraction,
    split)` as a point starts its unrecorded decode (settle); `on_point(point)` as each point completes (the command
    line saves its runs then: an interrupted sweep keeps them). `splits` (e.g. ("spread", "whole")): the layer splits
    to compare at each budget (sweep_plan); the model's own layer split is put back afterwards (not where that re-plan
    is refused, e.g. on a data file cut short since the load or the device short of memory, or runs the card out of
    memory: the model stays at the last point's plan). Each point runs the scenarios `repeats` times, after an
    unrecorded warm-up answer at its budget (_run_point), and its times are the medians over the repeats.

    A point whose budget the device cannot hold runs at what it holds (the point says so: its budget and share), and
    the sweep ends there: the points above it would run at that budget again (under mode=required they would be
    refused, not reduced). They are left out; `on_left_out(note, count)` as the sweep finds that, before the point
    runs (`note`: which points and why). `length_setting`: the answers' length limit as the user sets it, which a
    multiturn past the context names (run_scenario).

    Before the first point the model answers once, unrecorded, at the budget it was loaded with: no point's records
    time that answer, so `on_warm_up(budget_bytes, fraction, seconds)` says what it took at which budget and share
    (warm_up_line)."""
    if model.offload is None:
        raise ValueError("a budget sweep needs a model loaded with offload on a device")
    if repeats < 1:
        raise ValueError(f"a sweep point runs its scenarios at least once, not {repeats} times")
    for name in scenarios:  # one scenario_turns refuses, refused before the first point (fitting_scenarios skips it)
        scenario_turns(name, model.tokenizer, model.config, params.max_new_tokens, params.reasoning)
    results = []
    plan = sweep_plan(model, points, splits)
    decimals = share_decimals(fraction for fraction, _budget, _split in plan)  # (for the points' runs' labels)
    ceiling = None  # the budget the device held less than: the points above it are left out
    total_runs = len(plan) * len(scenarios) * repeats
    mode = model.offload.layer_split_mode
    # Warm-up, not recorded: the first point's trials (settle) would otherwise time first-call costs (measured: the
    # CPU kernel 476 µs per step at the first point against 145 µs when repeated).
    loaded_budget = model.offload.plan.budget_bytes
    # (an automatic budget may be far above what every expert resident takes: a share above 100% would read as more)
    loaded_share = min(1.0, loaded_budget / all_resident_bytes(model.offload.infos))
    in_warm_up = f"before the first point, in its {WARM_UP_RUN}"  # (where it stopped, as a point's run is named)
    try:
        seconds = warm_up_answer(model, cancel)
    except BaseException as exc:  # Ctrl-C's too
        exc.add_note(in_warm_up)
        raise
    if seconds is None:  # stopped: its cut-short seconds are no warm-up's, and the sweep says where it stopped
        cancelled = SweepCancelled("the sweep was cancelled in its warm-up answer, before its first point")
        cancelled.add_note(in_warm_up)
        raise cancelled
    if cancel is not None and cancel.is_set():
        raise SweepCancelled("the sweep was cancelled before its first point")
    # said here, not by a record: the first point's unrecorded answer would take it for its own, thrown away
    model.warm_up_s = 0.0
    if on_warm_up:
        on_warm_up(loaded_budget, loaded_share, seconds)
    runs = 0

    def on_run() -> None:
        nonlocal runs
        runs += 1
        if progress:
            progress(runs / total_runs)

    try:
        for index, (fraction, budget, split) in enumerate(plan):
            if ceiling is not None and budget > ceiling:
                break
            where = _point_name(fraction, budget, split, index, len(plan))
            try:
                held = _replan(model, budget, split)
                if held < budget:  # the point is what ran
                    where = _point_name(held / all_resident_bytes(model.offload.infos), held, split, index, len(plan))
                if held < budget and ceiling is None:
                    ceiling = budget
                    left = [entry for entry in plan[index + 1:] if entry[1] > ceiling]
                    total_runs -= len(left) * len(scenarios) * repeats
                    if left and on_left_out:
                        on_left_out(_left_out_note(model, held, fraction, left), len(left))
                point = _run_point(model, device, held, fraction if held == budget else None, split, scenarios,
                                   params, label, cancel, on_text, on_settle, on_run, repeats, length_setting,
                                   decimals)
                if point is None:
                    raise SweepCancelled("the sweep was cancelled")
                results.append(point)
                if on_point:
                    on_point(point)
            except BaseException as exc:  # which point (Ctrl-C's too), for a caller that keeps those before it
                failed = getattr(exc, "sweep_run", "")  # the run that failed, where one did (_run_point)
                exc.add_note(f"{where}, in its {failed}" if failed else where)
                raise
        return results
    finally:
        # a point's unrecorded answer that its first record did not say (a cancel or a failure before that record)
        # is no warm-up of what runs next, at other budgets: the model gave its own before the first point
        model.warm_up_s = 0.0
        if model.offload.layer_split_mode != mode:
            try:
                model.offload.set_layer_split(mode)
            except Exception as exc:
                # a re-plan refused (a WorkbenchError: a data file cut short since the load, the device short of memory
                # now) or the card out of memory: not in place of the point's failure, nor of a sweep that completed;
                # the model stays at the last point's plan. A defect of ours still raises.
                if not users_error(exc):
                    raise


# what a sweep's note (stopped_at) calls its answer before the first point, and each point's before its runs
WARM_UP_RUN = "unrecorded warm-up answer"


class SweepCancelled(WorkbenchError):
    """A sweep stopped by its `cancel` event."""


def warm_up_line(budget_bytes: int, fraction: float, seconds: float) -> str:
    """What a sweep says of its unrecorded answer before the first point (run_sweep's on_warm_up), its budget as a
    point's is said."""
    return (f"warm-up before the first point, not recorded: an answer of up to {WARM_UP_TOKENS} tokens at the model's "
            f"loaded budget, budget share {fraction:.0%} (device_expert_bytes={budget_bytes}), took "
            f"{duration_text(seconds)}")


def _point_name(fraction: float, budget: int, split: str | None, index: int, count: int) -> str:
    return (f"at budget share {fraction:.0%}{f' {split}' if split else ''} (device_expert_bytes={budget}), "
            f"point {index + 1} of {count}")


def stopped_at(exc: BaseException) -> str:
    """Where run_sweep stopped on `exc`: the point its note names ("at budget share 50% (device_expert_bytes=282624),
    point 2 of 3", and where one of its runs failed which: ", in its long run (repeat 2 of 3)"), or before its first
    point (", in its unrecorded warm-up answer" where that answer failed or was stopped)."""
    return (getattr(exc, "__notes__", None) or ["before the first point"])[-1]


def _replan(model: LoadedModel, budget: int, split: str | None) -> int:
    """Re-plan at `budget`; the budget held, less where the device has less free: the planner holds what it has
    (its clamp), and under mode=required, which refuses that, the sweep asks for what it has."""
    config = model.offload.config.updated(device_expert_bytes=budget)
    try:
        model.offload.reconfigure(config, layer_split=split)
    except BudgetAboveFree as exc:
        model.offload.reconfigure(config.updated(device_expert_bytes=exc.available), layer_split=split)
    return model.offload.plan.budget_bytes


def _left_out_note(model: LoadedModel, held: int, fraction: float, left: list[tuple]) -> str:
    """What a sweep says where the device held less than the point at `fraction` asked."""
    names = ", ".join(f"{share:.0%}" + (f" {split}" if split else "") for share, _budget, split in left)
    held_share = held / all_resident_bytes(model.offload.infos)
    holds = f"the {human_bytes(held)} of experts the device holds (budget share {held_share:.0%})"
    why = (f"offload mode 'required' refuses a budget above {holds}" if model.offload.config.mode == "required"
           else f"a budget above {holds} runs at that budget again")
    points = "points at budget shares" if len(left) > 1 else "point at budget share"
    return (f"{why}: the sweep ends there, in place of the point at budget share {fraction:.0%}, and leaves out the "
            f"{points} {names}")


def _run_point(model: LoadedModel, device, budget: int, fraction: float | None, split: str | None,
               scenarios: list[str], params: GenerationParams, label: str, cancel, on_text, on_settle,
               on_run, repeats: int, length_setting: str, decimals: int) -> SweepPoint | None:
    """At the budget just planned (`fraction` None: its share of every expert resident, where it is less than the
    point asked), settle, answer once unrecorded, run the scenarios `repeats` times (`on_run()` after each run); None
    where cancelled (the point's last answer cut short is not a result). The runs' label gives the share to
    `decimals` places of a percent (share_decimals).

    The unrecorded answer puts every point's runs after the same warm state: settle decodes only where the engine has
    trials to run (none with every expert resident), and whatever a plan's first answer costs (its first prefill on
    the re-planned slots, the placement's first steps) would otherwise fall in one point's runs and not another's. The
    point's first record says its seconds (warm_up_s), the records after it 0, as a model's records after its load
    do; every record of the point says them too (point_warm_up_s), all of them following that answer."""
    if fraction is None:  # the point is what ran: its budget, share, label and the recommendation saved
        fraction = budget / all_resident_bytes(model.offload.infos)
    if on_settle:
        on_settle(fraction, split)
    point = SweepPoint(budget, fraction, split=split, settle_steps=settle(model, cancel), repeats=repeats)
    if cancel is not None and cancel.is_set():
        return None
    # the trials measure again some hundred decode steps after the last (trials.py: recheck), fewer than the point's
    # answers may decode: held for them all (and its warm-up's), every run of the point follows the same trials
    turns = sum(len(scenario_turns(name, model.tokenizer, model.config, params.max_new_tokens, params.reasoning))
                for name in scenarios)
    model.offload.hold_trials(WARM_UP_TOKENS + repeats * turns * params.max_new_tokens)
    try:
        length = min(WARM_UP_TOKENS, params.max_new_tokens)  # the model's warm-up answer's, or the sweep's if shorter
        # rendered as the point's runs render their prompts: another reasoning setting is another prompt
        warm_up = run_scenario(model, "short", GenerationParams(max_new_tokens=length, reasoning=params.reasoning),
                               device, cancel=cancel)
    except Exception as exc:
        exc.sweep_run = WARM_UP_RUN  # (a short one, whatever the scenarios)
        raise
    if cancel is not None and cancel.is_set():  # (not said by whatever runs on the model next)
        return None
    # said by the point's first record, as a model's first record after its load says its warm-up: what the first
    # answer at this budget took, which no record of the point times (its 0 read as "nothing was paid before it")
    point.warm_up_s = model.warm_up_s = warm_up.timings["completion_s"]
    infos = model.offload.infos
    if 0 < whole_layers_held(infos, budget) < sum(1 for info in infos if info.gpu is not None):
        point.split_run = WHOLE if model.offload.whole_layers else SPREAD
    tag = f"{label} budget share {fraction:.{decimals}%}" + (f" {split}" if split else "")
    for repeat in range(repeats):
        for scenario in scenarios:
            if cancel is not None and cancel.is_set():
                return None
            try:
                record = run_scenario(model, scenario, params, device, label=tag, cancel=cancel, on_text=on_text,
                                      length_setting=length_setting)
            except Exception as exc:  # the point's note names the scenario: several run at each point
                exc.sweep_run = f"{scenario} run" + (f" (repeat {repeat + 1} of {repeats})" if repeats > 1 else "")
                raise
            # every run follows the point's answer, which the first's warm_up_s alone says: the others' 0 would read,
            # beside another point's first, as timed without one
            record.timings["point_warm_up_s"] = point.warm_up_s
            point.records.append(record)
            if cancel is not None and cancel.is_set():
                return None
            on_run()
    point.device_parts = max(point.records, key=lambda r: r.peaks["device_bytes"] or 0).peaks["device_parts"]
    return point


def device_parts_line(points: list[SweepPoint]) -> str:
    """The points' device parts in one line (what their device peaks are made of); "" where none says them."""
    said = [f"budget share {point.fraction:.0%}{f' {point.split_run}' if point.split_run else ''}: "
            + device_parts_text(point.device_parts) for point in points if point.device_parts]
    if not said:
        return ""
    why = ""
    if any(TIER_MAPPINGS in point.device_parts for point in points):
        why = f" ({TIER_MAPPINGS_WHY}; with every expert resident none is mapped)"
    return f"device peak by part: {'; '.join(said)}{why}"


def point_warm_ups_line(points: list[SweepPoint]) -> str:
    """What each point's unrecorded answer at its budget took, which all its runs follow (not only its first, whose
    record alone says warm_up_s), in one line; "" where no point gave one."""
    said = [f"budget share {point.fraction:.0%}{f' {point.split}' if point.split else ''}: "
            f"{duration_text(point.warm_up_s)}" for point in points if point.warm_up_s is not None]
    if not said:
        return ""
    return ("every run of a point follows its unrecorded warm-up answer at the point's budget (its records' "
            f"point_warm_up_s), which took: {', '.join(said)}")


def copy_slots_line(points: list[SweepPoint]) -> str:
    """Where placement left device slots to copied misses (the CPU path), what "resident share" leaves out, in one
    line; "" where no point left any."""
    said = [f"budget share {point.fraction:.0%}{f' {point.split_run}' if point.split_run else ''}: "
            f"{point.copy_slot_share:.0%}" for point in points if point.copy_slot_share]  # (as device_parts_line)
    if not said:
        return ""
    return ("slots left to copied misses, as a share of the experts (not counted as resident: they hold whichever "
            f"misses were copied last): {', '.join(said)}")


@dataclass
class Recommendation:
    """The recommended point, the fastest, and why: of the points within the margin of the fastest's completion time,
    or tied with it (their medians no further apart than their spreads between repeats together), the one whose
    device peak is the least."""
    point: SweepPoint
    fastest: SweepPoint
    margin: float
    projected: bool  # compared by the completion times projected for the simulated card
    tie: bool  # the recommended point is not the fastest, and the repeats cannot tell them apart
    # the points with a smaller budget than the recommended one that were within the margin or tied, each holding more
    # on the device (the host tier's granule-rounded mappings, whole layers)
    passed_over: list[SweepPoint] = field(default_factory=list)

    def seconds(self, point: SweepPoint) -> float:
        return point.projected_completion_s if self.projected else point.completion_s

    @property
    def within_margin(self) -> bool:
        return self.seconds(self.point) <= self.seconds(self.fastest) * (1 + self.margin)

    @property
    def note(self) -> str:
        """What a configuration saved from it says of it."""
        if self.within_margin:
            return f"sweep recommendation within {self.margin * 100:g}% of the fastest"
        return (f"sweep recommendation tied with the fastest (at budget share {self.fastest.fraction:.0%}) within the "
                "spread between repeats")

    @property
    def tie_reason(self) -> str:
        best, fastest = self.point, self.fastest
        if best.peak_device_bytes < fastest.peak_device_bytes:
            holds = (f"it holds less on the device (device peak {human_bytes(best.peak_device_bytes)} against "
                     f"{human_bytes(fastest.peak_device_bytes)})")
        else:  # recommendation() prefers the fastest where everything else is equal
            holds = f"it holds as much on the device ({human_bytes(best.peak_device_bytes)}) on a smaller budget"
        spreads = " and ±".join(duration_text(point.spread_s(self.projected)) for point in (best, fastest))
        return f"they differ by less than their spreads between repeats (±{spreads}), and {holds}"

    @property
    def passed_over_text(self) -> str:
        """The smaller budgets passed over and their device peaks: "budget share 67%: 48.0 MiB, budget share 33%
        spread: 48.0 MiB"."""
        return ", ".join(f"budget share {p.fraction:.0%}{f' {p.split}' if p.split else ''}: "
                         f"{human_bytes(p.peak_device_bytes)}" for p in self.passed_over)

    def line(self) -> str:
        """The rule, one line: which point, its device peak, by which time against which fastest point, the times as
        the table and the window give them (units.duration_text), the repeats' spreads where they decided, and the
        smaller budgets passed over for holding more."""
        best, fastest = self.point, self.fastest
        split = f" {best.split}" if best.split else ""
        said = (f"recommended: {best.budget_bytes} bytes (budget share {best.fraction:.0%}{split}), the least device "
                f"peak ({human_bytes(best.peak_device_bytes)}) of the points whose {'projected ' * self.projected}"
                f"completion time is within {self.margin * 100:g}% of the fastest or ties with it: ")
        at = f"budget share {fastest.fraction:.0%}" + (f" {fastest.split}" if fastest.split else "")
        against = f"the fastest ({duration_text(self.seconds(fastest))}, at {at})"
        if best is fastest:
            said += f"itself the fastest ({duration_text(self.seconds(best))})"
        elif self.within_margin:
            said += f"{duration_text(self.seconds(best))}, within {self.margin * 100:g}% of {against}"
        else:
            said += f"{duration_text(self.seconds(best))}, tied with {against}"
        if self.tie:
            said += f"{'; a tie' if self.within_margin else ''}: {self.tie_reason}"
        if self.passed_over:
            said += f"; smaller budgets among them hold more on the device ({self.passed_over_text})"
        if best.repeats > 1:
            said += f"; each time the median of {best.repeats} repeats"
        return said


def recommendation(points: list[SweepPoint], margin: float = 0.10) -> Recommendation:
    """Of the points whose completion time (the median of its repeats) is within `margin` of the fastest point's, or
    ties with it (the two no further apart than their spreads between repeats, SweepPoint.spread_s, together: the
    repeats cannot tell them apart), the one with the least device peak: what leaves the device most free for other
    work at nearly the best speed. Of equal peaks the smaller budget, then the faster (of one budget's splits), then
    the fastest point itself. The peak, not the budget: with the host tier each slot array maps a whole granule, slots
    or none, and on whole layers a budget's unused rest is not held, so a smaller budget can hold more on the device.
    On a simulated device (every point projected) the projected completion times for the simulated card are
    compared."""
    projected = uses_projection(points)

    def seconds(point: SweepPoint) -> float:
        return point.projected_completion_s if projected else point.completion_s

    def ties(point: SweepPoint, other: SweepPoint) -> bool:
        return abs(seconds(point) - seconds(other)) <= point.spread_s(projected) + other.spread_s(projected)

    fastest = min(points, key=lambda point: (seconds(point), point.budget_bytes))
    eligible = [point for point in points
                if seconds(point) <= seconds(fastest) * (1 + margin) or ties(point, fastest)]
    best = min(eligible, key=lambda point: (point.peak_device_bytes, point.budget_bytes, seconds(point),
                                            point is not fastest))
    passed_over = [point for point in eligible if point.budget_bytes < best.budget_bytes]
    return Recommendation(best, fastest, margin, projected, tie=best is not fastest and ties(best, fastest),
                          passed_over=passed_over)


def recommend(points: list[SweepPoint], margin: float = 0.10) -> SweepPoint:
    """The recommended point (recommendation)."""
    return recommendation(points, margin).point


def uses_projection(points: list[SweepPoint]) -> bool:
    """Whether recommend() compares projected completion times (a sweep on the simulated device)."""
    return bool(points) and all(point.projected for point in points)
