"""The record views' work, run in the engine worker's thread (EngineWorker._job) so it never overlaps
a load, an answer or a re-plan: scenario runs, budget sweeps, side-by-side answers, the contention
test. No widgets here: a job takes a JobContext, reports progress through it and returns plain
results the views show. Cancel is the worker's stop (its threading.Event, or the job's number stopped): answers end
at the next token."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from app.gui.side_streams import SideStreams
from engine.errors import PromptError, WorkbenchError, gpu_out_of_memory, one_line, users_error
from engine.generation import GenerationParams, LoadedModel
from engine.offload import OffloadConfig
from engine.records.contention import (ContentionCancelled, ContentionReport, corpus_problem, default_corpus,
                                       phase_after, run_contention)
from engine.records.history import History
from engine.records.lengths import SWEEP_REPEATS
from engine.records.scenarios import SCENARIOS, run_scenario, scenario_answer_tokens, scenario_turns
from engine.records.schema import RunRecord, generation_settings
from engine.units import counted, human_bytes
from engine.records.side_by_side import Comparison, Side, compare
from engine.offload.device_memory import DeviceMemoryError
from engine.offload.layer_split import BOTH as BOTH_SPLITS
from engine.offload.planner import DeviceShort, under_limit
from engine.offload.projection import is_simulated
from engine.sampling import SamplingParams, model_sampling, recorded
from engine.records.sweep import (SweepCancelled, SweepPoint, check_mode, fitting_scenarios, reasoning_length_note,
                                  run_sweep, settle as end_trials, stopped_at, sweep_plan, warm_up_line)

REPORT_INTERVAL_S = 0.05  # progress and streamed text go to the window in batches
# side by side's answer length for models that answer at once where the user sets none (one that reasons first has its
# own, LoadedModel.answer_tokens); the scenario runs' and the contention test's is SCENARIO_TOKENS, the command line's
SIDE_BY_SIDE_TOKENS = 64


@dataclass
class JobContext:
    model: Any                                  # the worker's LoadedModel, or None
    device: Any                                 # where its resident experts live, or None (CPU)
    device_choice: dict                         # the Budgets panel's device choice it was loaded with
    cancel: Any                                 # is_set(): stopped (a threading.Event, or EngineWorker._JobStop)
    progress: Callable[..., None]               # progress(fraction, text); fraction None: how far cannot be told
    stream: Callable[[object], None]            # a batch of streamed text, in the job's own shape
    # make_device(choice, config, notes): the device for a choice, or None (CPU), a note appended to `notes` where a
    # CUDA GPU asked for cannot be used
    make_device: Callable[[dict, OffloadConfig, list[str]], Any]
    # why `model` runs every expert on the CPU where the CUDA GPU it was loaded for could not be used ('' otherwise):
    # the note make_device gave its load
    device_fallback: str = ""

    def loaded(self) -> LoadedModel:
        if self.model is None:
            raise WorkbenchError("No model is loaded: load one first (the demo model is one click away: Ctrl+D).")
        return self.model


def scenario_names(choice: str) -> list[str]:
    return list(SCENARIOS) if choice == "all" else [choice]


def answer_params(max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                  reasoning: str | None = None) -> GenerationParams:
    """Answers of `max_new_tokens`, greedy unless `sampling` says otherwise, with the chat template's `reasoning`
    setting (None: its default)."""
    if int(max_new_tokens) < 1:
        raise WorkbenchError(f"the answer length must be at least 1 token, got {max_new_tokens}")
    return GenerationParams(max_new_tokens=int(max_new_tokens), sampling=sampling, reasoning=reasoning)


def scenario_params(model: LoadedModel, name: str, chosen: int | None, sampling: SamplingParams = SamplingParams(),
                    reasoning: str | None = None) -> GenerationParams:
    """Answers of the user's length, or where they chose none the model's for the scenario (scenario_answer_tokens,
    counted with the `reasoning` setting); greedy unless `sampling` says otherwise."""
    tokens = scenario_answer_tokens(model, name, reasoning) if chosen is None else chosen
    return answer_params(tokens, sampling, reasoning)


# how the Record bar's and the sweep's answers choose their tokens (record_sampling)
GREEDY, MODEL_SAMPLING, CHAT_SAMPLING = "greedy", "model", "chat"
ANSWER_CHOICES = {GREEDY: "Greedy", MODEL_SAMPLING: "The model's sampling", CHAT_SAMPLING: "The chat's sampling"}


def chat_sampling(options: dict) -> SamplingParams:
    """The chat's sampling settings (ChatPanel.options: temperature 0 is greedy, seed -1 none), refused by name where
    the sampler refuses them."""
    temperature = float(options.get("temperature", 0.0))
    seed = options.get("seed")
    sampling = SamplingParams(do_sample=temperature > 0, temperature=temperature if temperature > 0 else 1.0,
                              top_k=int(options.get("top_k", 0)), top_p=float(options.get("top_p", 1.0)),
                              repetition_penalty=float(options.get("repetition_penalty", 1.0)),
                              seed=None if seed is None or int(seed) < 0 else int(seed))
    try:
        sampling.validate()
    except ValueError as exc:
        raise WorkbenchError(str(exc)) from None
    return sampling


def record_sampling(model: LoadedModel, choice: str, chat: dict | None = None) -> SamplingParams:
    """The recorded answers' sampling, as the command line's record and sweep choose it: greedy, the model's
    genai_config.json search (MODEL_SAMPLING) or the chat's settings (CHAT_SAMPLING, `chat`: ChatPanel.options);
    where they sample, seeded (the chosen seed, else the model's search.random_seed, else RECORD_SEED) so that a repeat
    run samples as this one did. A greedy answer has no seed: its record says none."""
    if choice == GREEDY:
        return SamplingParams()
    if choice == MODEL_SAMPLING:
        sampling = model_sampling(model.config)
    elif choice == CHAT_SAMPLING:
        sampling = chat_sampling(chat or {})
    else:
        raise WorkbenchError(f"unknown answer choice {choice!r}: one of {', '.join(ANSWER_CHOICES)}")
    return recorded(sampling, model.config)


def send_tokens(ctx: JobContext, count: int) -> None:
    """The tokens answered since the last batch, for the window's tokens/s graph (a batch of the job's stream)."""
    if count:
        ctx.stream({"new_tokens": count})


class _Reporter:
    """Turns per-token and per-turn callbacks into a few progress reports a second, each with the tokens answered
    since the last (send_tokens)."""

    def __init__(self, ctx: JobContext, start: float, span: float, what: str):
        self.ctx, self.start, self.span, self.what = ctx, start, span, what
        self.tokens = 0
        self.turns = 0.0
        self._last = 0.0
        self._unsent = 0

    def report(self, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self._last >= REPORT_INTERVAL_S:
            self._last = now
            send_tokens(self.ctx, self._unsent)
            self._unsent = 0
            self.ctx.progress(self.start + self.span * min(1.0, self.turns),
                              f"{self.what} · {self.tokens} token{'' if self.tokens == 1 else 's'}")

    def on_text(self, _token, _delta) -> None:
        self.tokens += 1
        self._unsent += 1
        self.report()

    def on_turn(self, fraction: float) -> None:
        self.turns = fraction
        self.report(force=True)


def settle(ctx: JobContext, model: LoadedModel, fraction: float | None, who: str) -> None:
    """Say so while a model's background work after load finishes (its experts mapped and page-locked: seconds for
    a large model); the measured runs start after it (run_turns waits for it)."""
    if not model.settled:
        ctx.progress(fraction, f"{who}: mapping its experts after load, before the timed run")
        model.wait_until_settled(ctx.cancel)


# --- scenarios ---------------------------------------------------------------------------------------

@dataclass
class ScenarioResult:
    saved: list[tuple[int, RunRecord]] = field(default_factory=list)   # (history id, record)
    errors: list[str] = field(default_factory=list)                    # scenarios that could not run, one line each
    cancelled: RunRecord | None = None                                 # the run cut short (not saved)
    cancelled_before: str = ""                                         # the scenario a cancel came before (not run)
    failure: str = ""  # "scenario: why", one line, where a run or its save failed after runs were saved ("": none)


@dataclass
class ScenarioJob:
    """Run scenarios one after the other and save each to the history. A cancelled run is not
    saved (its timings would mislead); the runs before it are, and so are they before a run (or its save) that failed.
    `max_new_tokens` None: the model's length."""
    scenarios: list[str]
    max_new_tokens: int | None
    history_path: str | None = None
    label: str = ""
    answers: str = GREEDY               # how the answers choose their tokens (record_sampling)
    chat_options: dict | None = None    # the chat's settings, for answers=CHAT_SAMPLING
    reasoning: str | None = None        # the chat template's reasoning setting (None: the template's default)

    def __call__(self, ctx: JobContext) -> ScenarioResult:
        model = ctx.loaded()
        history = History(self.history_path)
        history.check_writable()
        sampling = record_sampling(model, self.answers, self.chat_options)
        result = ScenarioResult()
        count = len(self.scenarios)
        settle(ctx, model, 0.0, "the model")
        for index, name in enumerate(self.scenarios):
            if ctx.cancel.is_set():
                result.cancelled_before = name
                break
            reporter = _Reporter(ctx, index / count, 1 / count, f"{name} ({index + 1} of {count})")
            reporter.report(force=True)
            params = scenario_params(model, name, self.max_new_tokens, sampling, self.reasoning)
            try:
                record = run_scenario(model, name, params, ctx.device, label=self.label, cancel=ctx.cancel,
                                      progress=reporter.on_turn, on_text=reporter.on_text)
                if ctx.device_fallback:  # (as side by side's records say it)
                    record.offload["device_fallback"] = ctx.device_fallback
                if record.timings["cancelled"]:
                    result.cancelled = record
                    break
                saved = []
                try:
                    history.add_all([record], saved)
                except WorkbenchError as exc:  # a full disk, a lock held past the timeout: the run is kept in a file
                    result.failure = f"{name}: {exc}"
                    break
                result.saved.append((saved[0], record))
            except PromptError as exc:  # e.g. the long input on a short context: the other scenarios still run
                result.errors.append(f"{name}: {exc}")
                continue
            except Exception as exc:  # after runs were saved: the result says them, and where it failed
                if not result.saved:
                    raise
                result.failure = f"{name}: {one_line(exc, model.offload_mode)}"
                break
        return result


# --- budget sweep ------------------------------------------------------------------------------------

@dataclass
class SweepResult:
    points: list[SweepPoint]
    requested: int              # the points the sweep planned (with both layer splits, two at some budgets), less
                                # those it left out
    model_folder: str
    base_entries: dict          # the loaded configuration the sweep started from (restored after it)
    saved_ids: list[int] = field(default_factory=list)
    length_note: str = ""       # where the answers stopped inside a reasoning model's reasoning (reasoning_length_note)
    stopped_at: str = ""        # where a sweep cancelled or failed stopped (engine.records.sweep.stopped_at: "at
                                # budget share 75% (device_expert_bytes=...), point 4 of 5"); "" for one that ran to
                                # its end
    failure: str = ""           # why its point failed, one line; "" where none did
    left_out: str = ""          # the points above what the device holds under mode=required, and why (run_sweep)
    skipped: str = ""           # the scenarios the model's context cannot hold, and why (fitting_scenarios)
    held_before: int = 0        # the expert bytes the loaded model's plan held before the sweep, and after it put the
    held_after: int = 0         # user's budgets back (less where the device has less free now)
    layer_split: str = "auto"   # the loaded model's layer split and decode path, which the points ran with (with
    decode_path: str = "auto"   # both splits, each point its own split)
    not_restored: str = ""      # why the user's budgets could not be put back (a data file changed since the load,
                                # whose line says to load the model again; the device short, or the card out of
                                # memory); "" where they were
    warm_up: str = ""           # what the unrecorded answer before the first point took (warm_up_line), which no
                                # point's runs time; "" where it did not finish
    unloaded: bool = False      # the window's Unload stopped it: the model goes next

    @property
    def budgets_back(self) -> str:
        """What the sweep left the model at, as the run line says it."""
        if self.unloaded:
            return "Unload stopped it: no model is loaded"
        if self.not_restored:  # said once where the point failed on the same file
            last = "the model stays at the sweep's last budget"
            return last if self.not_restored == self.failure else f"{last}: {self.not_restored}"
        if self.held_after >= self.held_before:
            return "the model is back at its own budgets"
        return (f"the model is back at its own budgets, but the device now holds {human_bytes(self.held_after)} of "
                f"its experts where it held {human_bytes(self.held_before)}")

    @property
    def cancelled(self) -> bool:
        return bool(self.stopped_at) and not self.failure


@dataclass
class SweepJob:
    """Re-plan the loaded model at `points` budgets from none to every expert (no reload), run the
    scenarios at each, `repeats` times (with `both_splits`, spread and on whole layers where a budget holds some
    layers whole: engine.records.sweep.sweep_plan), restore the loaded budgets. Each point's records go to the history
    as the point completes, as the command line saves them: a sweep cancelled or failed at a point keeps those before
    it."""
    points: int
    scenarios: list[str]
    max_new_tokens: int
    history_path: str | None = None
    label: str = "sweep"
    both_splits: bool = False
    answers: str = GREEDY               # how the answers choose their tokens (record_sampling)
    chat_options: dict | None = None    # the chat's settings, for answers=CHAT_SAMPLING
    repeats: int = SWEEP_REPEATS        # runs of the scenarios at each budget: the times compared are their medians
    reasoning: str | None = None        # the chat template's reasoning setting (None: the template's default)

    def __call__(self, ctx: JobContext) -> SweepResult:
        model = ctx.loaded()
        if ctx.device_fallback:  # the CUDA GPU was chosen, and the model could not have it (as `sweep` says)
            raise WorkbenchError(f"A budget sweep needs a device for resident experts, and the loaded model has none: "
                                 f"{ctx.device_fallback[:1].lower()}{ctx.device_fallback[1:]} A simulated GPU (Budgets "
                                 "panel) gives one.")
        if ctx.device is None or model.offload is None:
            raise WorkbenchError("A budget sweep needs a device for resident experts: load the model with a "
                                 "simulated GPU or the CUDA GPU (Budgets panel).")
        check_mode(model.offload.config.mode)  # refused in the command line's words, before anything runs
        params = answer_params(self.max_new_tokens, record_sampling(model, self.answers, self.chat_options),
                               self.reasoning)
        scenarios, skipped = fitting_scenarios(model, self.scenarios, params.max_new_tokens, params.reasoning)
        history = History(self.history_path)  # a bad history file refused before the sweep runs
        history.check_writable()
        original, held_before = model.offload.config, model.offload.plan.budget_bytes
        splits = BOTH_SPLITS if self.both_splits else None
        planned, left_out = [len(sweep_plan(model, self.points, splits))], [""]
        tokens, done, last, unsent = [0], [0], [0.0], [0]

        def total() -> int:
            return planned[0] * len(scenarios) * self.repeats

        def on_left_out(note: str, count: int) -> None:
            planned[0] -= count
            left_out[0] = note

        def on_text(_token, _delta) -> None:
            tokens[0] += 1
            unsent[0] += 1
            now = time.perf_counter()
            if now - last[0] >= REPORT_INTERVAL_S:
                last[0] = now
                send_tokens(ctx, unsent[0])
                unsent[0] = 0
                ctx.progress(done[0] / total(),
                             f"run {min(done[0] + 1, total())} of {total()} · {counted(tokens[0], 'token')}")

        def progress(fraction: float) -> None:
            send_tokens(ctx, unsent[0])  # the run's last ones
            unsent[0] = 0
            done[0] = round(fraction * total())
            tokens[0] = 0  # the next run's own
            ctx.progress(fraction, f"{done[0]} of {total()} runs done")

        # up to SETTLE_STEPS_MAX decode steps before the point's runs
        def on_settle(fraction: float, split: str | None) -> None:
            at = f"budget share {fraction:.0%}" + (f" ({split})" if split else "")
            # back from every expert resident, the experts' mapping first (sweep.settle waits for it)
            first = "" if model.settled else "mapping its experts again after the re-plan, then "
            ctx.progress(done[0] / total(), f"at {at}: {first}decoding until {model.offload.pending_words()}, "
                                          "unrecorded")

        def on_point(point: SweepPoint) -> None:
            history.add_all(point.records, saved_ids)  # one it cannot save is kept in a file its error names
            points.append(point)

        ctx.progress(0.0, f"run 1 of {total()}")
        points, saved_ids, where, failure, warm_up = [], [], "", "", [""]
        try:
            run_sweep(model, ctx.device, self.points, scenarios, params, label=self.label, progress=progress,
                      cancel=ctx.cancel, on_text=on_text, splits=splits, on_settle=on_settle, on_point=on_point,
                      on_left_out=on_left_out, repeats=self.repeats,
                      on_warm_up=lambda *said: warm_up.__setitem__(0, warm_up_line(*said)))
        except SweepCancelled as exc:
            where = stopped_at(exc)
        except Exception as exc:  # run_sweep's note names the point; before the first, the warm-up failed
            where, failure = stopped_at(exc), one_line(exc, original.mode)
        finally:
            # a re-plan that fails leaves the plan in force, the sweep's last budget: refused (a WorkbenchError: a data
            # file cut short, the device with less free than the budgets need now, as another process took some) or
            # the card out of memory. The points stay, and the result says why; a defect of ours still raises.
            not_restored = ""
            try:
                model.offload.reconfigure(original)  # the loaded model keeps the user's budgets
            except Exception as exc:
                if not users_error(exc):
                    raise
                not_restored = one_line(exc, original.mode)
        return SweepResult(points, planned[0], str(model.folder.folder), original.to_entries(), saved_ids=saved_ids,
                           length_note=reasoning_length_note(model.reasoning_answer_tokens, params.max_new_tokens,
                                                             params.reasoning),
                           stopped_at=where, failure=failure, left_out=left_out[0], skipped=skipped,
                           held_before=held_before, held_after=model.offload.plan.budget_bytes,
                           layer_split=model.offload.layer_split_mode, decode_path=model.offload.decode_path_mode,
                           not_restored=not_restored, warm_up=warm_up[0])


# --- side by side ------------------------------------------------------------------------------------

class _Cancelled(Exception):
    pass


@dataclass
class SideBySideResult:
    comparison: Comparison | None
    pieces: list[list[str]]     # each side's text per streamed token (an eos token streams no text)
    saved_ids: list[int] = field(default_factory=list)
    cancelled: bool = False
    thoughts: list[list[str]] = field(default_factory=lambda: [[], []])  # each side's reasoning per streamed token


@dataclass
class SideBySideJob:
    """Left: the loaded model as it is. Right: `right_folder` (default: the same folder) loaded
    again with `right_entries` (and `right_layer_split`, `right_decode_path`; None: the engine's defaults), beside the
    left on its device (what the left holds there stays held: an automatic budget of B's has what it leaves). One
    prompt, both answers, a record each (saved unless cancelled); a side that cannot load or answer has its
    one-line error instead, and the other side answers alone. `max_new_tokens` None: the models' own length."""
    prompt: str
    max_new_tokens: int | None
    right_entries: dict
    right_folder: str | None = None
    concurrent: bool = False
    history_path: str | None = None
    labels: tuple[str, str] = ("A: current", "B: modified")
    right_layer_split: str | None = None
    right_decode_path: str | None = None

    def __call__(self, ctx: JobContext) -> SideBySideResult:
        left = ctx.loaded()
        if not self.prompt.strip():
            raise PromptError("the prompt is empty")
        config = OffloadConfig.from_entries(self.right_entries)
        folder = self.right_folder or str(left.folder.folder)

        def load_progress(fraction: float) -> None:
            if ctx.cancel.is_set():
                raise _Cancelled()
            ctx.progress(fraction, "loading the right side")

        ctx.progress(0.0, "loading the right side")
        device = None
        fallback: list[str] = []  # why B runs every expert on the CPU where its CUDA GPU cannot be used
        held_by_a = ctx.device.memory.used if ctx.device is not None else 0  # A stays loaded, holding this
        try:
            # B is loaded beside A, which stays loaded: on the simulated card as on a real one, B has what A leaves
            device = (ctx.device.beside(config.gpu_device_mem_limit) if is_simulated(ctx.device)
                      else ctx.make_device(ctx.device_choice, config, fallback))
            right = Side(LoadedModel.open(folder, progress=load_progress, offload=config, device=device,
                                          layer_split=self.right_layer_split, decode_path=self.right_decode_path),
                         device, self.labels[1])
        except _Cancelled:
            return SideBySideResult(None, [[], []], cancelled=True)
        except Exception as exc:
            # a budget B's device cannot hold, a folder without a model, the card out of memory: A answers alone
            if not users_error(exc):
                raise
            short = isinstance(exc, (DeviceShort, DeviceMemoryError)) or gpu_out_of_memory(exc)
            # not where B's own gpu_device_mem_limit bounds what it has free: A's part of the card is not why then
            beside = (f" (beside A, which stays loaded and holds {human_bytes(held_by_a)} of the device)"
                      if device is not None and held_by_a and short and not under_limit(device) else "")
            # the error names the file; the card's memory is said as B's own mode says it
            right = Side(None, label=self.labels[1], failure=f"B's model: {one_line(exc, config.mode)}{beside}")
        if right.model is not None:
            settle(ctx, right.model, None, "the right side")
        # B is loaded afresh and A may be too: their answers would time the ways their engines try, not those kept
        for side, model in (("A", left), ("B", right.model)):
            if model is not None and model.offload is not None and model.offload.trials_pending:
                ctx.progress(None, f"{side}: decoding until {model.offload.pending_words()}, unrecorded")
                end_trials(model, ctx.cancel)
        tokens = self.max_new_tokens
        if tokens is None:  # both sides answer the same length: the longer of the models' own (B's may reason first)
            tokens = max(model.answer_tokens(SIDE_BY_SIDE_TOKENS) for model in (left, right.model) if model is not None)
        params = answer_params(tokens)  # greedy: the two configurations compared on their most likely tokens
        streams = SideStreams(ctx, params.max_new_tokens, (True, right.model is not None), self.concurrent,
                              REPORT_INTERVAL_S)
        streams.flush()  # who answers first, who waits
        comparison = None
        try:
            comparison = compare(Side(left, ctx.device, self.labels[0]), right, self.prompt, params,
                                 concurrent=self.concurrent, on_text=streams.on_text, cancel=ctx.cancel,
                                 on_reasoning=streams.on_reasoning, on_done=streams.on_done)
            for record, why in zip(comparison.records, (ctx.device_fallback, fallback[0] if fallback else "")):
                if why and record is not None:
                    record.offload["device_fallback"] = why
        finally:
            streams.flush()  # the last batches and the sides' ends, however compare ended (it sends only what is new)
            # the right model's queued copies done before its slots go back to CuPy's pool, which the loaded model's
            # allocations share (CudaDevice.quiesce)
            if device is not None:
                with _after_answers(comparison, "waiting for B's device", [], config.mode):
                    device.quiesce()
        cancelled = ctx.cancel.is_set() or any(not r.turns or r.turns[0]["finish_reason"] == "cancelled"
                                               for r in comparison.records if r is not None)
        result = SideBySideResult(comparison, streams.pieces, cancelled=cancelled, thoughts=streams.thoughts)
        if not cancelled:
            with _after_answers(comparison, "saving to the history", result.saved_ids):
                history = History(self.history_path)
                for record in comparison.records:
                    if record is not None:
                        result.saved_ids.append(history.add(record))
        return result


class AfterAnswersFailed(WorkbenchError):
    """A step once the sides answered failed (_after_answers); `saved_ids`: the runs the history kept before it."""

    def __init__(self, message: str, saved_ids: list[int]):
        super().__init__(message)
        self.saved_ids = list(saved_ids)


@contextmanager
def _after_answers(comparison: Comparison | None, step: str, saved_ids: list[int], mode: str | None = None):
    """A step once the sides have answered (`comparison`; None: compare failed, and so does the step, as it is): its
    failure says which step failed and which of the answers the history keeps (`saved_ids`: those saved so far, A's
    first), as the offload `mode` of the side whose work the step is says it (errors.one_line)."""
    try:
        yield
    except Exception as exc:
        if comparison is None:
            raise
        kept = f"only A's answer was saved, as run {saved_ids[0]}" if saved_ids else "the answers above were not saved"
        raise AfterAnswersFailed(f"{step}: {one_line(exc, mode)}; {kept}", saved_ids) from exc


# --- contention --------------------------------------------------------------------------------------

@dataclass
class ContentionResult:
    report: ContentionReport | None
    corpus: str
    cancelled: bool = False


@dataclass
class ContentionJob:
    """Index the corpus alone, run the scenario alone, then both at once. Cancel takes effect
    between phases (an answer in progress ends at its next token). `max_new_tokens` None: the model's length."""
    corpus: str | None
    workers: int
    scenario: str = "short"
    max_new_tokens: int | None = None
    reasoning: str | None = None        # the chat template's reasoning setting (None: the template's default)

    def __call__(self, ctx: JobContext) -> ContentionResult:
        model = ctx.loaded()
        if self.workers < 1:
            raise WorkbenchError(f"the indexing needs at least 1 worker process, got {self.workers}")
        params = scenario_params(model, self.scenario, self.max_new_tokens, reasoning=self.reasoning)
        try:  # the long input on a short context, in Record's words, before the corpus is made and indexed (minutes)
            scenario_turns(self.scenario, model.tokenizer, model.config, params.max_new_tokens, params.reasoning)
        except PromptError as exc:
            raise PromptError(f"{self.scenario}: {exc}") from None
        ctx.progress(0.0, "preparing the corpus" if not self.corpus else phase_after(0.0))
        corpus = Path(self.corpus).expanduser() if self.corpus else default_corpus()
        problem = corpus_problem(corpus)
        if problem:
            raise WorkbenchError(f"{corpus}: {problem}")
        ctx.progress(0.0, phase_after(0.0))

        def inference() -> float:
            try:
                return run_scenario(model, self.scenario, params, ctx.device, cancel=ctx.cancel).timings["completion_s"]
            except PromptError as exc:  # whose prompt, as Record says it
                raise PromptError(f"{self.scenario}: {exc}") from None

        def progress(fraction: float) -> None:  # (as a phase ends: the text names the next, which runs now)
            ctx.progress(fraction, phase_after(fraction))

        try:
            report = run_contention(inference, corpus, self.workers, progress=progress, cancel=ctx.cancel,
                                    threads=model.decoder.kernel_threads.state, generation=generation_settings(params),
                                    device_fallback=ctx.device_fallback or None, model=str(model.folder.folder),
                                    device=getattr(ctx.device, "name", "cpu"), simulated=is_simulated(ctx.device),
                                    scenario=self.scenario)
        except ContentionCancelled:
            return ContentionResult(None, str(corpus), cancelled=True)
        return ContentionResult(report, str(corpus))
