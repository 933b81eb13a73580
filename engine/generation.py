"""Text generation: prefill, token-by-token decode, streaming, stop conditions, multi-turn chat."""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import psutil

from engine.decoder import PartitionedDecoder
from engine.decoder_state import DecoderState, StateSnapshot
from engine.errors import ConversationFullError, ModelFileError, PromptError, UnsupportedModelError, WorkbenchError
from engine.expert_prefault import ExpertPrefault
from engine.model_folder import ModelFolder
from engine.offload import OffloadConfig, attach_offload
from engine.offload.approximate import AgreementMeter
from engine.offload.dense_landing import land_dense
from engine.offload.device_memory import DENSE_RESERVATION
from engine.offload.planner import dense_cpu_words
from engine.ort_env import DenseDevice, choose_dense_device, dense_cpu_reason, dense_goes_to, dense_refusal
from engine.reasoning import REASONING_ANSWER_TOKENS, AnswerFormat, AnswerSplit, answer_format, reasoning_variables
from engine.sampling import Sampler, SamplingParams


@dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    stop_strings: tuple[str, ...] = ()
    reasoning: str | None = None  # the chat template's reasoning setting (engine/reasoning.py); None: its default


@dataclass
class Timings:
    prefill_s: float = 0.0
    time_to_first_token_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    agreement_s: float = 0.0  # approximate routing's exact-routing shadow passes (AgreementMeter), left out of the rest

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, over the time spent decoding them."""
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s and self.generated_tokens > 1 else 0.0

    def as_dict(self) -> dict:
        return {"prefill_s": self.prefill_s, "time_to_first_token_s": self.time_to_first_token_s,
                "decode_s": self.decode_s, "total_s": self.total_s, "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated_tokens, "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "decode_tokens_per_s": self.decode_tokens_per_s, "agreement_s": self.agreement_s}


@dataclass
class GenerationResult:
    prompt_tokens: list[int]
    tokens: list[int]
    text: str           # the answer: for a model that reasons first, its final text (engine/reasoning.py)
    finish_reason: str  # "eos", "length", "stop_string", "cancelled", "context", "max_length" (genai_config's search)
    timings: Timings
    reused_cache_tokens: int = 0
    routing_agreement: float | None = None  # with approximate routing: greedy-token agreement with exact routing
    reasoning: str = ""  # what the model wrote before its answer (analysis channel, <think>); empty for most models

    @property
    def cut_in_reasoning(self) -> bool:
        """Stopped (token limit, context, Stop) while still reasoning: no answer yet."""
        return bool(self.reasoning) and not self.text and self.finish_reason != "eos"


class LoadedModel:
    """A model ready to generate: the partitioned decoder built and timed.

    `device` is where resident experts live (None, a SimulatedDevice or a CudaDevice). The dense part
    follows onto a CUDA device when onnxruntime offers its CUDA execution provider; `dense_device`
    ("cpu" or "cuda"), `dense_reason` and `dense_statement` say where it landed and why.
    """

    def __init__(self, folder: ModelFolder, threads: int | None = None,
                 progress: Callable[[float], None] | None = None, offload: OffloadConfig | None = None,
                 device=None, layer_split: str | None = None, decode_path: str | None = None,
                 opened_s: float = 0.0):
        """opened_s: the seconds ModelFolder.open took (open() times it), counted in load_s."""
        problems = folder.unsupported()
        if problems:
            raise UnsupportedModelError(problems[0] + (f" (and {len(problems) - 1} more nodes)" if len(problems) > 1 else ""))
        started = time.perf_counter() - opened_s
        self.folder = folder
        self.config = folder.config
        self.tokenizer = folder.tokenizer
        self.answer_format: AnswerFormat = answer_format(self.tokenizer)
        # Expert runners first, the offload plan next, the dense sessions last: onnxruntime's GPU
        # arena gets what the plan leaves under gpu_device_mem_limit (ort_env.dense_arena_limit), or the
        # smaller arena a model loaded earlier in the process registered (ort_env.shared_arena_cap).
        self.decoder = PartitionedDecoder(folder.onnx, folder.plan, folder.experts, folder.logits_name, threads,
                                          progress, dense=None, vocabulary=folder.vocabulary)
        probe = DecoderState(self.config, folder.onnx.proto.graph)
        total, growth = probe.full_context_bytes()
        self.offload = None
        if offload is not None:
            self.offload = attach_offload(self.decoder, offload, device, layer_split, decode_path,
                                          dense_goes_to(device, probe.kv_dtypes()),
                                          dense_cpu_reason(getattr(device, "kind", None), probe.kv_dtypes()),
                                          lambda available: dense_refusal(device, available, total + growth,
                                                                          folder.dense_bytes))

        def place(why: str | None) -> str | None:
            """On the CPU for the engine's reason where it has one (dense_landing.land_dense), else on the card where
            onnxruntime's arena fits: why it runs on the CPU, None on the card."""
            self.dense: DenseDevice = (DenseDevice("cpu", why) if why else
                                       choose_dense_device(device, total + growth, folder.dense_bytes,
                                                           probe.kv_dtypes()))
            return None if self.dense.kind == "cuda" else self.dense.reason

        if self.offload is not None:  # (an arena that does not fit beside the plan leaves it on the CPU all the same)
            land_dense(self.offload, place)
        else:
            place(None)
        if self.dense.kind == "cuda" and getattr(device, "cp", None) is not None:
            # blocks cached in CuPy's pool (a model dropped before this load left its slots there), which no
            # accounting counts, go back before onnxruntime's arena takes its share
            device.cp.get_default_memory_pool().free_all_blocks()
        if self.dense.kind == "cuda" and hasattr(device, "dense_stream"):
            # fully resident layers order their launches after onnxruntime's stream, and it after them (CudaSlots)
            device.dense_stream = self.dense.backend.stream
        if self.dense.kind == "cuda" and device.memory.limit:
            # Counted against gpu_device_mem_limit, so a later re-plan cannot give it to experts.
            device.memory.reserve(total + growth + folder.dense_bytes + self.dense.arena_limit, DENSE_RESERVATION)
        self.decoder.open_dense(self.dense)
        self.load_s = time.perf_counter() - started
        # the seconds of the unrecorded warm-up answer before its first timed run (records/scenarios.warm_up_answer):
        # None until given, 0 once a record has said them
        self.warm_up_s: float | None = None
        self.prefault = self.host_registration = None
        self._start_unbounded_work(offload, device)
        if self.offload is not None:
            # a re-plan that leaves every expert resident starts it again (weakly held: the engine must not keep the
            # model, whose end undoes the registration, alive)
            self.offload.start_unbounded_work = weakref.WeakMethod(self._start_unbounded_work)

    def _start_unbounded_work(self, offload: OffloadConfig | None, device) -> None:
        """Where the experts stay in host memory anyway (_prefault_pays), their pages mapped in the background and,
        on a CUDA device, the GPU copying them straight from their page-locked mapping. The engine stops both when a
        bound or every expert resident makes them useless (OffloadEngine._end_unbounded_work)."""
        if not self._prefault_pays(offload):
            return
        self.prefault = ExpertPrefault(self.folder.onnx, self.folder.experts).start()
        if self.offload is not None:
            self.offload.prefault = self.prefault
        if hasattr(device, "register_experts"):
            self.host_registration = device.register_experts(self.folder.onnx, self.folder.experts, owner=self)

    def _background_work(self) -> list[threading.Event]:
        """What load left running in the background: the experts' pages mapped, their mapping page-locked."""
        return [work for work in (self.prefault.done if self.prefault is not None else None,
                                  self.host_registration.ready if self.host_registration is not None else None)
                if work is not None]

    @property
    def settled(self) -> bool:
        """Whether the background work after load is done."""
        return all(event.is_set() for event in self._background_work())

    def wait_until_settled(self, cancel: threading.Event | None = None, limit_s: float = 300.0) -> float:
        """Wait for the background work after load, so that what is measured next is the model's steady state, not
        its first seconds; returns the seconds waited. `cancel` ends the wait early, and so does `limit_s`."""
        started = time.perf_counter()
        for event in self._background_work():
            while not event.wait(0.1):
                if (cancel is not None and cancel.is_set()) or time.perf_counter() - started > limit_s:
                    return time.perf_counter() - started
        return time.perf_counter() - started

    def _prefault_pays(self, offload: OffloadConfig | None) -> bool:
        """Experts the CPU reads from the mapped file, with host memory not bounded (expert_prefault.py)."""
        if offload is None:
            return True
        plan = self.offload.plan
        return (offload.host_expert_bytes is None and bool(offload.allow_file_backing)
                and plan.placement_mode != "all_resident")

    @classmethod
    def open(cls, path, threads: int | None = None, progress=None, offload: OffloadConfig | None = None,
             device=None, layer_split: str | None = None, decode_path: str | None = None) -> "LoadedModel":
        """layer_split: how the expert budget is spread over the layers (engine/offload/layer_split.py: "auto",
        "spread" or "whole"; None: MOE_LAYER_SPLIT, else "auto"); decode_path: where decode computes cold experts
        (engine/offload/decode_path.py: "auto", "cpu", "tier" or "both"; None: MOE_DECODE_PATH, else "auto")."""
        started = time.perf_counter()
        folder = ModelFolder.open(path)
        return cls(folder, threads, progress, offload, device, layer_split, decode_path,
                   opened_s=time.perf_counter() - started)

    def new_state(self) -> DecoderState:
        """A conversation's state, on the device the dense part runs on."""
        return DecoderState(self.config, self.folder.onnx.proto.graph, self.decoder.state_backend)

    @property
    def dense_device(self) -> str:
        return self.dense.kind

    @property
    def offload_mode(self) -> str | None:
        """The offload mode this model runs under (None: no offload), which its GPU out of memory is said by
        (errors.one_line: under mode=disabled the expert budgets do not apply)."""
        return self.offload.config.mode if self.offload is not None else None

    @property
    def dense_reason(self) -> str:
        """Why the dense part runs where it does, as the offload mode in force says it (a re-plan may change the mode;
        the arena check's hint names expert budgets, which mode=disabled does not apply: planner.dense_cpu_words)."""
        if self.offload is None:
            return self.dense.reason
        return dense_cpu_words(self.dense.reason, self.offload.config.mode)

    @property
    def dense_statement(self) -> str:
        """The "where everything landed" statement's sentences on the dense part."""
        dense = replace(self.dense, reason=self.dense_reason)
        if not self.decoder.keeps_cut_tensors_on_device:
            return dense.statement
        return (dense.statement + " The expert layers take their inputs in GPU memory: a layer with every expert "
                "resident routes and computes there and hands its result to the next dense layer without a round trip "
                "to the host; in decode, a layer with cold experts adds the CPU's part to the GPU's there.")

    def answer_tokens(self, plain: int) -> int:
        """The answer length (new tokens) where the user sets none: reasoning_answer_tokens for a model that reasons
        first, else `plain`, the caller's own."""
        return self.reasoning_answer_tokens or plain

    @property
    def reasoning_answer_tokens(self) -> int | None:
        """For a model that reasons first (engine/reasoning.py), whose reasoning alone can take thousands of tokens,
        an answer length with room for an answer after it: as long as genai_config.json's search.max_length lets a
        sequence run, within the context (an answer stops where the context is full anyway), at most
        REASONING_ANSWER_TOKENS. None for a model that answers at once: any length will do."""
        if self.answer_format.kind == "plain":
            return None
        return min(self.config.search.max_length, self.config.context_length, REASONING_ANSWER_TOKENS)

    @property
    def eos_ids(self) -> set[int]:
        ids = set(self.config.eos_token_ids)
        token = self.tokenizer.token_id(self.tokenizer.eos_token)
        if token is not None:
            ids.add(token)
        return ids


class VisibleText:
    """How much of an answer's text may be shown while it streams: nothing from a stop string on, and not an end that
    could still grow into one (the answer's text is cut there too, so what streamed is what the answer says). Stop
    strings are looked for in the answer as written, with the special tokens they name (<|im_end|>) as their text
    (AnswerSplit.written_answer); what is shown leaves those out."""

    def __init__(self, stop_strings):
        self.stops = [stop for stop in stop_strings if stop]
        self.shown = 0  # characters given out so far

    def advance(self, split: AnswerSplit, final: bool = False) -> str:
        """The text to give out now, of the `split` answer so far (`final`: it grows no more)."""
        text = split.written_answer
        cut = len(text)
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0:
                cut = min(cut, at)
                continue
            if not final:
                held = next((n for n in range(min(len(stop) - 1, len(text)), 0, -1) if text.endswith(stop[:n])), 0)
                cut = min(cut, len(text) - held)
        cut = split.shown_length(cut)
        delta = split.answer[self.shown:cut]
        self.shown = max(self.shown, cut)
        return delta


def _finite(logits, model, position: int):
    """The logits, where none is NaN or +inf (one pass: max propagates NaN); else a ModelFileError. NaN or inf
    anywhere in the weights reaches every later logit, and the sampler would pick a token from them silently (an
    empty answer, in the bad-input review)."""
    if not np.isfinite(logits.max()):
        raise ModelFileError(f"{model.folder.folder}: the model computed logits that are not finite (NaN or inf) at "
                             f"position {position}: its weights hold NaN or inf, or its values overflow")
    return logits


def _sequence_cap(config) -> tuple[int, str]:
    """The most tokens a sequence may reach, the last sampled token (which is never fed) counted, and the finish
    reason there: genai_config.json's search.max_length where it is below the context, else the context. As
    onnxruntime-genai's generator: a sampled token joins the sequence, which is done once it reaches max_length (a
    max_length past the context it refuses; here the context bounds it)."""
    if config.search.max_length < config.context_length:
        return config.search.max_length, "max_length"
    return config.context_length, "context"


def _past_the_cap(past: int, new: int, cap: int, bound: str, earlier_turns: bool = False) -> PromptError:
    """The error to raise: a ConversationFullError where earlier turns take part of the room. earlier_turns: the `new`
    tokens are the conversation's earlier turns fed again whole (past is 0) and its message, not one prompt."""
    where = (f"the model's genai_config.json search.max_length of {cap}, prompt and answer together"
             if bound == "max_length" else f"the model's context of {cap}")
    if not past and earlier_turns:
        return ConversationFullError(
            f"the conversation so far, fed again whole, and this message come to {new} tokens, "
            + (f"past {where}" if bound == "context" and new > cap else f"which leave no room for an answer within "
               f"{where}"))
    if not past:
        if bound == "context" and new > cap:
            return PromptError(f"the prompt has {new} tokens but the model's context is {cap}")
        return PromptError(f"the prompt has {new} tokens, which leaves no room for an answer within {where}")
    total = f"the conversation so far ({past} tokens) and this message ({new}) come to {past + new} tokens"
    if bound == "context" and past + new > cap:
        return ConversationFullError(f"{total}, past {where}")
    return ConversationFullError(f"{total}, which leave no room for an answer within {where}")


def generate(model, state: DecoderState, fed_tokens: list[int], prompt_tokens: list[int], params: GenerationParams,
             on_text: Callable[[int, str], None] | None = None, cancel: threading.Event | None = None,
             decoder=None, on_reasoning: Callable[[int, str], None] | None = None,
             after_prompt: Callable[[np.ndarray], None] | None = None,
             prompt_logits: np.ndarray | None = None, snapshot_at: int | None = None,
             before_feed: Callable[[], None] | None = None) -> GenerationResult:
    """Feed `prompt_tokens` after what `state` already holds (`fed_tokens`), then decode.

    `fed_tokens` is extended in place with every token the state consumes. `on_text(token, delta)`
    is called as each token is produced, with the answer's new text; `on_reasoning(token, delta)` just before it,
    with the reasoning's (engine/reasoning.py; empty for a model that answers at once). Stop strings apply to the
    answer. `decoder` defaults to the model's own (tests pass the onnxruntime reference to compare).
    `after_prompt(logits)` is called with the prompt fed (Conversation's snapshot), or with its first `snapshot_at`
    tokens fed, the rest fed after; `prompt_logits` are the last prompt token's logits of a state restored just after
    it, to answer again with no prompt at all. `before_feed()` is called once the prompt is accepted, before anything
    is fed (the command line's kernel warm-up: a prompt refused is then refused at once).
    """
    if not prompt_tokens and prompt_logits is None:
        raise PromptError("the prompt is empty")
    model.folder.onnx.check_mapped_files()
    cap, bound = _sequence_cap(model.config)
    if state.past_length + len(prompt_tokens) + 1 > cap:  # room for one answer token at least
        raise _past_the_cap(state.past_length, len(prompt_tokens), cap, bound)
    if before_feed is not None:
        before_feed()
    decoder = decoder or model.decoder
    sampler = Sampler(params.sampling)
    # the prompt whose end may open the answer's first message or tag: all of it fed already where this answers a kept
    # prompt again (Conversation.regenerate)
    prompt = prompt_tokens or fed_tokens
    split = model.answer_format.split(model.tokenizer, prompt, model.tokenizer.specials_in(params.stop_strings))
    visible = VisibleText(params.stop_strings)
    reasoned = 0  # reasoning characters given out

    def give_out(token: int, final: bool, when_new: bool = False) -> None:
        """Both parts' new text to the callbacks (`when_new`: only where either has some)."""
        nonlocal reasoned
        delta, thought = visible.advance(split, final=final), split.reasoning[reasoned:]
        reasoned = len(split.reasoning)
        if when_new and not (delta or thought):
            return
        if on_reasoning:
            on_reasoning(token, thought)
        if on_text:
            on_text(token, delta)

    eos = model.eos_ids
    min_length = model.config.search.min_length
    timings = Timings(prompt_tokens=len(prompt_tokens))
    meter = None
    if model.offload is not None and model.offload.config.approximate_routing:
        meter = AgreementMeter(model, fed_tokens, lambda logits: sampler.greedy(
            logits, fed_tokens, tuple(eos) if state.past_length < min_length else ()))

    def shadow_s() -> float:  # the meter's steps so far, which no timing counts
        return meter.step_s if meter else 0.0

    started = time.perf_counter()
    if prompt_tokens:
        rest = prompt_tokens
        if after_prompt is not None and snapshot_at:
            head, rest = prompt_tokens[:snapshot_at], prompt_tokens[snapshot_at:]
            head_logits = _finite(decoder.forward(state, head)[-1], model, state.past_length - 1)
            fed_tokens.extend(head)
            after_prompt(head_logits)
        logits = _finite(decoder.forward(state, rest)[-1], model, state.past_length - 1)
        fed_tokens.extend(rest)
        if meter:  # (its choices read what was fed so far)
            meter.step(prompt_tokens, logits)
        if after_prompt is not None and not snapshot_at:
            after_prompt(logits)
    else:
        logits = prompt_logits
        if meter:
            meter.resumed(logits)
    timings.prefill_s = time.perf_counter() - started - shadow_s()
    generated: list[int] = []
    finish = "length"
    decode_started = None
    while len(generated) < params.max_new_tokens:
        # the sequence so far is what the state holds: no end of text while it is below search.min_length
        token = sampler(logits, fed_tokens, tuple(eos) if state.past_length < min_length else ())
        generated.append(token)
        if len(generated) == 1:
            timings.time_to_first_token_s = time.perf_counter() - started - shadow_s()
            decode_started, decode_shadow_started = time.perf_counter(), shadow_s()
        if token in eos:
            finish = "eos"
            break
        split.push(token)
        full = state.past_length + 1 >= cap  # the sequence so far: what was fed and this token
        last = len(generated) == params.max_new_tokens or full  # (the checks below)
        if last:
            split.finish()
        give_out(token, last)
        if any(stop in split.written_answer for stop in visible.stops):
            finish = "stop_string"
            break
        if cancel is not None and cancel.is_set():
            finish = "cancelled"
            break
        if len(generated) == params.max_new_tokens:
            break
        if full:
            finish = bound
            break
        logits = _finite(decoder.forward(state, [token])[-1], model, state.past_length - 1)
        fed_tokens.append(token)
        if meter:
            meter.step([token], logits)
    now = time.perf_counter()
    timings.decode_s = now - decode_started - (shadow_s() - decode_shadow_started) if decode_started else 0.0
    timings.total_s = now - started - shadow_s()
    timings.agreement_s = meter.catch_up_s + meter.step_s if meter else 0.0
    timings.generated_tokens = len(generated)
    split.finish()  # an answer that ended otherwise (eos, a stop string, cancelled)
    if generated:  # what was held back as a possible stop string or closing tag, or an incomplete character
        give_out(generated[-1], True, when_new=True)
    result = GenerationResult(list(prompt_tokens), generated, split.answer[:visible.shown], finish, timings,
                              reasoning=split.reasoning)
    if meter:
        result.routing_agreement = meter.agreement
    return result


# the most of the host's available memory a conversation's prompt snapshot may take
SNAPSHOT_SHARE = 0.25


@dataclass(frozen=True)
class PromptSnapshot:
    text: str             # the rendered conversation up to the answer (the generation prompt's end)
    fed: list[int]        # its tokens
    state: StateSnapshot  # the state with all of them fed
    logits: np.ndarray    # the last one's logits: what the answer's first token is sampled from


@dataclass
class Conversation:
    """A multi-turn chat whose KV cache and state carry over between turns.

    The cache holds the tokens actually fed, the model's own answer tokens included (never a
    re-tokenisation of their text), so a later turn only feeds what the chat template adds.
    """
    model: LoadedModel
    system_prompt: str | None = None
    messages: list[dict] = field(default_factory=list)
    state: DecoderState | None = None
    fed_tokens: list[int] = field(default_factory=list)
    _pending: list[int] = field(default_factory=list)  # the last answer token, sampled but not fed yet
    _rendered: str | None = None  # the conversation text that fed_tokens + _pending stand for
    # the state with the last turn's prompt fed but its last token, where the model's template writes an answer
    # otherwise than it was fed (without its reasoning): the next turn, or a regenerate, goes on from there
    _prompt_snapshot: PromptSnapshot | None = None

    def __post_init__(self):
        if self.system_prompt:
            self.messages.append({"role": "system", "content": self.system_prompt})

    def send(self, user_text: str, params: GenerationParams, on_text=None, cancel=None,
             on_reasoning=None, before_feed=None) -> GenerationResult:
        if not user_text.strip():
            raise PromptError("the prompt is empty")
        messages = self.messages + [{"role": "user", "content": user_text}]
        variables = reasoning_variables(self.model.tokenizer, params.reasoning)
        text = self.model.tokenizer.render_chat(messages, add_generation_prompt=True, variables=variables)
        if self.state is None:
            self.state = self.model.new_state()
        resumed = None  # the last prompt's logits, where this turn is that prompt answered again
        if self._rendered is None or not text.startswith(self._rendered):
            snapshot = self._prompt_snapshot
            if snapshot is not None and text.startswith(snapshot.text):  # the last answer written otherwise
                self.state.restore(snapshot.state)
                self._rendered, self._pending, self.fed_tokens = snapshot.text, [], list(snapshot.fed)
                resumed = snapshot.logits if text == snapshot.text else None
            else:  # first turn, or the template re-rendered earlier turns differently: all of it is fed afresh
                self._rendered, self._pending, self.fed_tokens = "", [], []
        new_tokens = self._pending + self.model.tokenizer.encode(text[len(self._rendered):])
        kept, snapshot_at = self._snapshot_point(messages, text, variables, new_tokens)
        if self.state.past_length != len(self.fed_tokens):  # it holds more: a failed turn's part, or an old render
            self.state.reset()
            snapshot_at = snapshot_at and len(self.fed_tokens) + snapshot_at
            new_tokens, self.fed_tokens = self.fed_tokens + new_tokens, []
        reused = len(self.fed_tokens)
        cap, bound = _sequence_cap(self.model.config)
        if not reused and len(new_tokens) + 1 > cap and any(m["role"] == "assistant" for m in self.messages):
            # (generate would call it all "the prompt")
            raise _past_the_cap(0, len(new_tokens), cap, bound, earlier_turns=True)
        earlier = self._prompt_snapshot

        def take_snapshot(logits) -> None:
            # a copy of the KV cache in host memory: left out where it would take much of what the host has free (a
            # long conversation's), and the next turn feeds the conversation afresh as before
            if self.state.snapshot_bytes() > SNAPSHOT_SHARE * psutil.virtual_memory().available:
                self._prompt_snapshot = None
                return
            self._prompt_snapshot = PromptSnapshot(text[:kept], list(self.fed_tokens), self.state.snapshot(),
                                                   logits.copy())

        snapshots = self._snapshots and snapshot_at != 0  # (0: the state restored from the one in hand is there)
        try:
            result = generate(self.model, self.state, self.fed_tokens, new_tokens, params, on_text, cancel,
                              on_reasoning=on_reasoning, after_prompt=take_snapshot if snapshots else None,
                              prompt_logits=resumed, snapshot_at=snapshot_at or None, before_feed=before_feed)
        except BaseException:
            # the state may hold this turn's prompt and first answer tokens, which the messages never will: the
            # conversation stays what it was, and the next turn feeds it again
            del self.fed_tokens[reused:]
            self._prompt_snapshot = earlier
            raise
        result.reused_cache_tokens = reused
        # the answer as the model's own template expects it: its final text, without the reasoning (gpt-oss's drops
        # past analysis, Qwen's strips <think> from past turns)
        self.messages = messages + [{"role": "assistant", "content": result.text}]
        ended_on_eos = result.finish_reason == "eos"
        self._pending = [] if ended_on_eos or not result.tokens else [result.tokens[-1]]
        # What the cache holds is the answer's every token, reasoning and format's marks included: where the next
        # render writes the answer otherwise (without its reasoning), the conversation is fed afresh. A stop string
        # trims the text below what the cache holds: the next turn starts afresh too.
        answer_tokens = result.tokens[:-1] if ended_on_eos else result.tokens
        fed_answer = self.model.tokenizer.decode(answer_tokens, keep=self.model.answer_format.marks)
        self._rendered = None if result.finish_reason == "stop_string" else text + fed_answer
        return result

    def _snapshot_point(self, messages: list[dict], text: str, variables: dict, new_tokens: list[int]
                        ) -> tuple[int, int | None]:
        """Where this turn's prompt snapshot goes: (the length of the prompt `text` it stands for, the tokens of
        `new_tokens` fed before it; None: all of them). At the prompt's end, unless the template writes a past answer
        without what its generation prompt opens (Qwen3.5's <think>, Qwen3's empty think block with thinking off):
        the next turn's render leaves the prompt there, and would feed the whole conversation again. The snapshot
        then goes where the next turn's renders (two stand-in answers and messages) leave the prompt, where its
        tokens split as the whole prompt's do; 0 tokens: the state restored from the snapshot in hand is there (a
        regenerate)."""
        if not self._snapshots:
            return len(text), None
        kept = len(text)
        for stand_in in ("A", "B"):
            try:
                later = self.model.tokenizer.render_chat(
                    messages + [{"role": "assistant", "content": stand_in}, {"role": "user", "content": stand_in}],
                    variables=variables)
            except WorkbenchError:
                return len(text), None
            kept = min(kept, len(os.path.commonprefix([text, later])))
        if kept == len(self._rendered) and self._prompt_snapshot and self._prompt_snapshot.text == self._rendered:
            return kept, 0
        if kept == len(text) or kept <= len(self._rendered):
            return len(text), None
        head = self._pending + self.model.tokenizer.encode(text[len(self._rendered):kept])
        if head + self.model.tokenizer.encode(text[kept:]) != new_tokens:
            return len(text), None
        return kept, len(head)

    @property
    def _snapshots(self) -> bool:
        """Whether each turn keeps its prompt's state: where the model's template writes an answer otherwise than it
        was fed (a reasoning model's, without its reasoning), so the next turn would otherwise feed everything again;
        not under approximate routing, whose exact-routing shadow follows the conversation token by token."""
        offload = self.model.offload
        return self.model.answer_format.kind != "plain" and not (offload and offload.config.approximate_routing)

    def regenerate(self, params: GenerationParams, on_text=None, cancel=None, on_reasoning=None) -> GenerationResult:
        """The last user message answered again: from the state its prompt left where there is a snapshot of it (a
        reasoning model's), else with the conversation before it fed afresh. One that fails leaves the last answer."""
        if len(self.messages) < 2 or self.messages[-1]["role"] != "assistant":
            raise PromptError("there is no answer to regenerate")
        user_text, kept = self.messages[-2]["content"], self.messages
        self.messages = self.messages[:-2]
        if self._prompt_snapshot is None:
            self._rendered = None  # fed afresh
        try:
            return self.send(user_text, params, on_text, cancel, on_reasoning)
        except BaseException:  # (send left the state as the next turn needs it for either)
            self.messages = kept  # the answer that a failed one would have replaced stays
            raise

    def reset(self) -> None:
        self.messages = [m for m in self.messages if m["role"] == "system"]
        self._prompt_snapshot = None
        if self.state is not None:
            self.state.reset()
        self.fed_tokens = []
        self._pending = []
        self._rendered = None
