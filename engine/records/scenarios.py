"""Measured scenarios (short question, long input, multi-turn chat) that produce run records."""

from __future__ import annotations

import copy
import threading
import time
import weakref
from datetime import datetime, timezone

import psutil

from engine.errors import ConversationFullError, PromptError
from engine.generation import Conversation, GenerationParams, LoadedModel
from engine.host_load import HostLoadMeter
from engine.kernel_warmup import warm_model
from engine.offload.projection import is_simulated, project_run
from engine.nvml import Nvml
from engine.reasoning import reasoning_variables
from engine.records.environment import machine, versions
from engine.records.lengths import SCENARIO_TOKENS
from engine.records.schema import ALL_RESIDENT, RunRecord, generation_settings, model_identity
from engine.units import human_bytes
from kernels.gpu.host_tier import TIER_GRANULE

SCENARIOS = ("short", "long", "multiturn")
LONG_PROMPT_TOKENS = 2000
WARM_UP_TOKENS = 4  # the unrecorded answer before a model's first timed run (warm_up_answer)
MULTITURN_QUESTIONS = (
    "What is a mixture-of-experts model?",
    "Why do its experts not all fit in GPU memory?",
    "Which experts should stay on the GPU?",
    "What happens when routing hits a cold expert?",
    "How would you measure whether offload helps?",
    "Summarise our conversation in one sentence.",
)
_PASSAGE = ("Mixture-of-experts language models route every token through a few of many expert "
            "feed-forward networks. Only the routed experts are read for a token, so a model far larger "
            "than the GPU's memory can still answer quickly when the experts that matter stay resident "
            "and the rest are computed on the CPU or copied in just in time. ")


def scenario_turns(name: str, tokenizer, config, max_new_tokens: int, reasoning: str | None = None) -> list[str]:
    """The scenario's messages; the long input refused where the model's sequences (GenaiConfig.longest_sequence: the
    context, or search.max_length below it) cannot hold it and the answer, its tokens counted as the run renders it,
    with the answers' reasoning setting (`reasoning`, GenerationParams.reasoning). The multiturn's are not checked
    here: the room its later turns have depends on the answers before them, and run_scenario refuses the first that
    has none."""
    if name == "short":
        return ["In two sentences, what does a CPU/GPU expert offload engine do?"]
    if name == "multiturn":
        return list(MULTITURN_QUESTIONS)
    if name == "long":
        prompt, prompt_tokens = _long_prompt(tokenizer, reasoning)
        needed = prompt_tokens + max_new_tokens
        if config.search.max_length < min(needed, config.context_length):
            raise PromptError(f"the long-input scenario needs sequences of at least {needed} tokens; the model's "
                              f"genai_config.json search.max_length is {config.search.max_length}")
        if config.context_length < needed:
            raise PromptError(f"the long-input scenario needs a context of at least {needed} tokens; the model has "
                              f"{config.context_length}")
        return [prompt]
    raise ValueError(f"unknown scenario '{name}' (known: {', '.join(SCENARIOS)})")


def scenario_answer_tokens(model: LoadedModel, name: str, reasoning: str | None = None) -> int:
    """A scenario's answer length where the user sets none: the model's (LoadedModel.answer_tokens: SCENARIO_TOKENS
    for one that answers at once); the long scenario's within what the model's sequences (the context, or
    search.max_length below it) leave after its input, rendered as the runs that take this length render it (with
    their reasoning setting, `reasoning`: None is the template's own default), but not below SCENARIO_TOKENS
    (scenario_turns refuses sequences too short for that)."""
    tokens = model.answer_tokens(SCENARIO_TOKENS)
    if name == "long":
        _prompt, prompt_tokens = _long_prompt(model.tokenizer, reasoning)
        return min(tokens, max(SCENARIO_TOKENS, model.config.longest_sequence - prompt_tokens))
    return tokens


# tokenizer -> (its chat template, {reasoning setting: _long_prompt's (prompt, tokens) rendered with them}): building
# it renders and encodes the growing prompt ~100 times (~0.2 s on the fixtures), and a record, a sweep's every run and
# the answer length each ask for it. Weak on the tokenizer: a closed model's goes with it.
_LONG_PROMPTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _long_prompt(tokenizer, reasoning: str | None) -> tuple[str, int]:
    """A report whose chat-rendered prompt is just over LONG_PROMPT_TOKENS tokens, and its tokens: the word that
    passes the target may take several of the model's tokens. Rendered as a run with the `reasoning` setting renders
    it (Conversation.send: Qwen3's thinking off adds an empty think block). Made once for each tokenizer, chat
    template and setting."""
    template = getattr(tokenizer, "chat_template", None)
    made = _LONG_PROMPTS.get(tokenizer)
    if made is None or made[0] is not template:  # another template renders other tokens around the prompt
        made = _LONG_PROMPTS[tokenizer] = (template, {})
    if reasoning not in made[1]:
        made[1][reasoning] = _make_long_prompt(tokenizer, reasoning_variables(tokenizer, reasoning))
    return made[1][reasoning]


def _make_long_prompt(tokenizer, variables: dict) -> tuple[str, int]:
    def tokens(text: str) -> int:
        return len(tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": text}], variables=variables)))

    text = "Read this report and list its three main points.\n\n"
    while tokens(text + _PASSAGE) < LONG_PROMPT_TOKENS:
        text += _PASSAGE
    for word in (_PASSAGE.split() * 4):  # then word by word, so the prompt ends just past the target
        if tokens(text) >= LONG_PROMPT_TOKENS:
            break
        text += word + " "
    return text, tokens(text)


def _reset_rss_high_water() -> bool:
    """Set Linux's high-water mark of this process's RSS (VmHWM) to what it holds now; False where it cannot be (not
    Linux, a /proc that refuses it)."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def _rss_high_water() -> int:
    """The most RSS this process held since _reset_rss_high_water (VmHWM, in kB in /proc/self/status)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakSampler:
    """Samples this process's RSS, the device's memory in use and, on an NVIDIA GPU, this process's VRAM as NVML
    reports it every `interval` seconds. The RSS peak is Linux's high-water mark where it can be reset at the start,
    which holds what was taken and given back between two samples too. The process's VRAM stays None where the driver
    or a container hides per-process memory (also when NVML lists this process under another pid: a container's
    namespace)."""

    def __init__(self, device=None, interval: float = 0.05):
        self.device, self.interval = device, interval
        self.rss = 0
        self.rss_start = 0  # at the first sample: what the process held already (an earlier run's memory is kept)
        self.device_bytes = 0
        self.process_device_bytes: int | None = None
        self._nvml = Nvml(device.index) if getattr(device, "kind", None) == "cuda" else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-sampler", daemon=True)
        self._process = psutil.Process()

    def _sample(self) -> None:
        self.rss = max(self.rss, self._process.memory_info().rss)
        if self.device is not None:
            self.device_bytes = max(self.device_bytes, self.device.memory.used, self.device.memory.run_peak)
        if self._nvml is not None:
            gpu = self._nvml.sample()
            if gpu is not None and gpu["per_process"] and gpu["this"] > 0:
                self.process_device_bytes = max(self.process_device_bytes or 0, gpu["this"])

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "PeakSampler":
        if self.device is not None:
            # the run's own device peak, as RSS's: the device's high-water mark holds the load's, or a larger budget's
            # before a re-plan
            self.device.memory.mark()
        self._high_water = _reset_rss_high_water()
        self._sample()
        self.rss_start = self.rss
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        if self._high_water:
            self.rss = max(self.rss, _rss_high_water())


TIER_MAPPINGS = "host tier mappings"
TIER_MAPPINGS_WHY = (f"the host tier maps each slot array's device rows rounded up to the {human_bytes(TIER_GRANULE)} "
                     "mapping granule, a granule even with no slot")


def device_parts(by_purpose: dict[str, int], host_tier: bool) -> dict[str, int]:
    """What the device holds, by part, from DeviceMemory's by_purpose (each node's slots together): the expert slots,
    or with the host tier its device mappings (each slot array's device rows rounded up to the mapping granule, a
    granule even with no slot: more than the budget where it is small), the prefill staging ring, any decode streaming
    slots, a dense part on the device."""
    slots = TIER_MAPPINGS if host_tier else "expert slots"
    parts = {slots: 0}  # first
    for purpose, nbytes in by_purpose.items():
        name = slots if purpose.startswith("expert slots of ") else purpose
        parts[name] = parts.get(name, 0) + nbytes
    return {name: nbytes for name, nbytes in parts.items() if nbytes}


def device_parts_text(parts: dict[str, int]) -> str:
    """Device parts (device_parts) in words: "expert slots 552.0 KiB + prefill staging ring 552.0 KiB"."""
    return " + ".join(f"{name} {human_bytes(nbytes)}" for name, nbytes in parts.items())


def pinned_bytes(model: LoadedModel) -> int | None:
    """Page-locked host memory the staging ring and the host tier hold (allocated at load or re-plan, held
    throughout); None without a real ring (all-CPU, or the simulated device's accounted ring)."""
    info = model.offload.pinned_info() if model.offload is not None else {}
    return info["bytes"] + info.get("host_tier_bytes", 0) if info.get("kind") == "pinned" else None


def offload_description(model: LoadedModel, device) -> dict:
    """Where the experts and the dense part ran, and the CPU kernels' threads at the end of the run
    (engine/kernel_threads.py)."""
    threads = model.decoder.kernel_threads.state()
    dense = {"device": model.dense_device, "reason": model.dense_reason}
    if model.offload is None:
        return {"device": "cpu", "entries": {}, "plan": "All experts run on the CPU.", "cpu_threads": threads,
                "dense": dense}
    state = model.offload.copy_state()
    path = state["decode_path"]
    if model.offload.plan.placement_mode == "all_resident":  # no expert was cold: no decode path ran
        path = dict(path, in_force=ALL_RESIDENT)
    config = model.offload.config
    return {"device": device.name if device is not None else "cpu", "entries": config.to_entries(),
            # the expert budget the plan set: device_expert_bytes, or less where the device had less free (the
            # planner's cut: side-by-side's B beside A), or the automatic one; None where offload is disabled
            "budget_bytes": model.offload.plan.budget_bytes if config.mode != "disabled" else None,
            "placement_mode": model.offload.plan.placement_mode, "slots": model.offload.plan.slots,
            # the experts placement kept in device slots as the run ended, not the slots it left to copied misses:
            # what a sweep point's share resident is measured by
            "resident_experts": model.offload.resident_experts(),
            "copy_slots": sum(model.offload.slots_left_to_copies()),
            "statements": model.offload.plan.statements, "layer_split": state["layer_split"],
            "decode_path": path, "cpu_threads": threads, "dense": dense,
            # the popularity file's bytes that placed the experts: its path alone would not tell an edited one
            "popularity_sha256": model.offload.popularity_sha256}


def run_scenario(model: LoadedModel, name: str, params: GenerationParams, device=None, label: str = "",
                 cancel: threading.Event | None = None, progress=None, on_text=None,
                 length_setting: str = "answer length") -> RunRecord:
    """Run one named scenario on a loaded model and measure it. `cancel` ends the answer at the next
    token (and skips the turns after it); `on_text(token, delta)` streams every answer. A turn the model's context
    cannot take after the answers before it is a PromptError saying what leaves the turns more room: the
    conversation's own refusal ends in the chat's remedy, "start a new conversation", which no scenario run can take.
    `length_setting` names the answers' length limit there as the user sets it (the window's answer length, the
    command line's --max-new-tokens)."""
    turns_text = scenario_turns(name, model.tokenizer, model.config, params.max_new_tokens, params.reasoning)
    try:
        return run_turns(model, turns_text, params, device, name, label, cancel, progress, on_text)
    except ConversationFullError as exc:
        raise PromptError(f"{exc.problem} (a smaller {length_setting} leaves the scenario's turns more room)") from None


def decoded_tokens(turns: list[dict]) -> int:
    """The tokens a run's answers decoded: each answer's after its first (the prefill gives that), as a record's
    decode rate counts them."""
    return sum(max(0, turn["generated_tokens"] - 1) for turn in turns)


def run_turns(model: LoadedModel, turns_text: list[str], params: GenerationParams, device=None,
              scenario: str = "custom", label: str = "", cancel: threading.Event | None = None, progress=None,
              on_text=None, on_reasoning=None) -> RunRecord:
    """Send the turns as one conversation and measure it: timings, peaks, offload statistics. The model settles first
    and, before its first timed run, gives an unrecorded warm-up answer, both off the clock (_settle). `on_text` and
    `on_reasoning` stream every answer (Conversation.send)."""
    settle_s, warm_up_s = _settle(model, cancel)
    # the run's statistics from zero, the model's running totals (the chat's: the placement view's) put back after it
    earlier = copy.deepcopy(model.offload.stats) if model.offload is not None else None
    if earlier is not None:
        model.offload.stats.reset(len(model.offload.slots))
    try:
        return _measure_turns(model, turns_text, params, device, scenario, label, cancel, progress, on_text,
                              on_reasoning, settle_s, warm_up_s)
    finally:
        if earlier is not None:
            model.offload.stats.add_earlier(earlier)


def _settle(model: LoadedModel, cancel: threading.Event | None) -> tuple[float, float]:
    """What runs before a timed run, off its clock and its statistics. Returns the seconds settling took, and the
    warm-up seconds this record says (model.warm_up_s, then 0 for the records after it): the model's warm-up answer's,
    given here where the model has given none or before by side by side; a sweep point's unrecorded answer's, for the
    point's first record; else 0 (a sweep says its answer before the first point itself: run_sweep's on_warm_up)."""
    # a model loaded a moment ago (side-by-side's B, a sweep's first point) still maps its experts in the background;
    # the CPU kernels are compiled (a first run on this machine) and the automatic thread count follows the other
    # processes' load before the clock starts
    settle_s = model.wait_until_settled(cancel)
    if cancel is not None and cancel.is_set():
        return settle_s, 0.0
    settle_s += warm_model(model) + model.decoder.kernel_threads.settle()
    if model.warm_up_s is None and warm_up_answer(model, cancel) is None:
        return settle_s, 0.0  # stopped: the model gives its warm-up again before its next timed run
    warm_up_s, model.warm_up_s = model.warm_up_s, 0.0  # said by this record, not by the next ones
    return settle_s, warm_up_s


def warm_up_answer(model: LoadedModel, cancel: threading.Event | None = None) -> float | None:
    """A short greedy answer, not recorded, that pays what a model's first answer after its load pays (onnxruntime's
    first runs, its arena's growth, the placement's first steps: on the dev VM a first short record on the gptoss
    fixture took 56 ms against 23-26 ms for the next ones); returns its seconds. Each timed run after it starts from
    the same warm state, as the sweep's and the contention test's runs do. None where `cancel` stopped it: a cut-short
    answer's seconds are no warm-up's, so model.warm_up_s stays as it was (None: the warm-up is still to give)."""
    started = time.perf_counter()
    result = Conversation(model).send(scenario_turns("short", model.tokenizer, model.config, WARM_UP_TOKENS)[0],
                                      GenerationParams(max_new_tokens=WARM_UP_TOKENS), cancel=cancel)
    if result.finish_reason == "cancelled":
        return None
    model.warm_up_s = time.perf_counter() - started  # the next record says it (a sweep says its own instead)
    return model.warm_up_s


def _measure_turns(model: LoadedModel, turns_text: list[str], params: GenerationParams, device, name: str, label: str,
                   cancel: threading.Event | None, progress, on_text, on_reasoning, settle_s: float,
                   warm_up_s: float) -> RunRecord:
    conversation = Conversation(model)
    approximated = copy.copy(model.offload.approximation) if model.offload is not None else None  # counts from load
    turns = []
    first_prefill = None  # the first turn's prefill phase totals (its prefill_s is the record's)
    meter = HostLoadMeter()
    with PeakSampler(device) as peaks:
        started = time.perf_counter()  # the sampler's thread started (and, at the end, stopped) off the clock
        for index, text in enumerate(turns_text):
            if cancel is not None and cancel.is_set():
                break
            result = conversation.send(text, params, on_text=on_text, cancel=cancel, on_reasoning=on_reasoning)
            turns.append({"prompt": text, "answer": result.text, "reasoning": result.reasoning,
                          "prompt_tokens": len(result.prompt_tokens),
                          "tokens": result.tokens,
                          "generated_tokens": len(result.tokens), "finish_reason": result.finish_reason,
                          "reused_cache_tokens": result.reused_cache_tokens, "timings": result.timings.as_dict(),
                          "routing_agreement": result.routing_agreement})
            if index == 0 and model.offload is not None:
                first_prefill = copy.copy(model.offload.stats.phases["prefill"])
            if progress:
                progress((index + 1) / len(turns_text))
        # less approximate routing's exact-routing shadow passes (they measure its answers, and are no part of them)
        completion = time.perf_counter() - started - sum(t["timings"]["agreement_s"] for t in turns)
    host_load = meter.read()
    decode_s = sum(t["timings"]["decode_s"] for t in turns)
    decoded = decoded_tokens(turns)
    stats = model.offload.stats_dict() if model.offload is not None else None
    approximation = {}
    if model.offload is not None and model.offload.config.approximate_routing:
        now = model.offload.approximation
        approximation = {"dropped": now.dropped - approximated.dropped,
                         "substituted": now.substituted - approximated.substituted}
    # the run's agreement over its tokens (the meter compares each answer's every token once), not the turns' mean
    measured = [t for t in turns if t["routing_agreement"] is not None]
    compared = sum(t["generated_tokens"] for t in measured)
    agreed = sum(t["routing_agreement"] * t["generated_tokens"] for t in measured)
    timings = {"load_s": model.load_s, "prefill_s": turns[0]["timings"]["prefill_s"] if turns else None,
               "time_to_first_token_s": turns[0]["timings"]["time_to_first_token_s"] if turns else None,
               # none where every answer was one token: no decode step ran (decode_s is the moment after it)
               "decode_tokens_per_s": decoded / decode_s if decoded and decode_s else None, "completion_s": completion,
               "turns": len(turns), "cancelled": len(turns) < len(turns_text)
               or any(t["finish_reason"] == "cancelled" for t in turns), "settle_s": settle_s,
               "warm_up_s": warm_up_s}
    if model.offload is not None and is_simulated(device):
        # What the simulated card would give (engine/offload/projection.py); the measured values stay as they are.
        phases = model.offload.stats.phases
        timings["projected"] = project_run(
            device.bandwidths, completion, list(phases.values()),
            prefill_s=timings["prefill_s"], prefill_layers=[first_prefill] if first_prefill else [],
            decode_s=decode_s, decoded_tokens=decoded, decode_layers=[phases["decode"]])
    return RunRecord(
        scenario=name, created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        versions=versions(), machine=machine(), model=model_identity(model.folder),
        offload=offload_description(model, device),
        timings=timings,
        peaks={"device_bytes": peaks.device_bytes if device is not None else None,
               # what the device held at that peak (absent in records written before it existed)
               **({"device_parts": device_parts(device.memory.run_peak_parts,
                                                bool(model.offload and model.offload.host_tier))}
                  if device is not None else {}),
               "process_device_bytes": peaks.process_device_bytes, "rss_bytes": peaks.rss,
               "rss_start_bytes": peaks.rss_start,
               "pinned_bytes": pinned_bytes(model)},
        layers=stats["layers"] if stats else [], bytes_moved=stats["copy_bytes"] if stats else 0,
        turns=turns, approximate_routing=bool(model.offload and model.offload.config.approximate_routing),
        host_load=host_load.as_dict(),
        routing_agreement=agreed / compared if compared else None, approximation=approximation,
        generation=generation_settings(params), label=label)
