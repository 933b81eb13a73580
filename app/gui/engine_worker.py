"""The engine's one long-lived worker: open, load, generate, re-plan and unload run one after the
other in its thread, never overlapping and never blocking the window (GPT4All's chatllm shape).

Every request is a queued signal into the worker; every result comes back as a signal. Stop is a
threading.Event the window sets directly, so it works at any moment: mid-answer (the next token
ends the answer) and mid-load (the next progress report ends the load). A chat request stopped
before it began (the window numbers them: options["request"]) is not run; one the worker began
meanwhile ends at its first token. A load stopped before the window saw it begin (numbered too:
settings["request"]) stops at its next stop point, before the loaded model goes where it has not gone yet (that model
stays), and stops nothing else: the stop flag would stop whatever ran ahead of it. A records job
stopped before the window saw it begin (numbered too) is not run; one the worker began meanwhile ends at its first
stop point (_JobStop), the flag left alone likewise. Any engine error becomes a `failed` message; the worker stays
usable.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from PySide6.QtCore import QObject, QThread, Signal, Slot

# Imported here, on the main thread, before the worker starts (see app/gui/__init__.py).
import engine.offload.engine  # noqa: F401  (the engine imports these lazily when it loads a model)
import engine.offload.hybrid_node  # noqa: F401
import kernels.cpu  # noqa: F401
from app.gui.chat_panel import ANSWER_TOKENS
from app.gui.estimate import layer_summary, model_facts
from app.gui.records_jobs import JobContext, chat_sampling
from app.inspect_report import inspection
from engine.demo_model import DEMO_NAME, ensure_demo_model
from engine.errors import WorkbenchError, one_line
from engine.generation import DENSE_RESERVATION, Conversation, GenerationParams, LoadedModel
from engine.kernel_warmup import warm_model
from engine.model_folder import ModelFolder
from engine.offload import OffloadConfig, SimulatedDevice
from engine.offload.cuda_device import cuda_device_or_cpu
from engine.offload.decode_path import PATH_WORDS, default_decode_path, measured_words
from engine.offload.layer_split import default_layer_split
from engine.offload.projection import decode_totals, is_simulated, projected_decode_rate
from engine.reasoning import reasoning_choices
from engine.sampling import beam_search_note, describe, model_sampling
from engine.units import counted, duration_text, human_bytes
from kernels.cpu.threads import binding_warning

STATS_INTERVAL_S = 0.25
STREAM_INTERVAL_S = 0.033  # tokens are sent to the window in batches: one queued call per token costs decode speed


def open_failure(path: str, exc: Exception) -> str:
    """'Could not open FOLDER: why', the folder said once: a refusal of the folder itself (ModelFolder's "no such
    folder", "not readable") starts with its resolved path, and the line read "Could not open X: X: no such folder"."""
    why = one_line(exc)
    if why.startswith(f"{Path(path).expanduser().resolve()}:"):
        return f"Could not open {why}"
    return f"Could not open {path}: {why}"


class LoadCancelled(WorkbenchError):
    """The user stopped a load."""


def _needs_reload(old, new) -> list[str]:
    return [name for name in ("gpu_device_mem_limit",) if getattr(old, name) != getattr(new, name)]


class EngineWorker(QObject):
    # results, emitted from the worker thread
    busyChanged = Signal(str)          # "opening" | "loading" | "preparing" | "generating" | "replanning" | "" (idle)
    inspected = Signal(object)         # app.gui.estimate.ModelFacts
    loadProgress = Signal(float)
    loadNote = Signal(str)             # what a long load does where no progress shows (the GPU kernels compiling)
    loaded = Signal(dict)              # path, load_s, device, statements, landed, entries
    streamed = Signal(str, str, int)   # reasoning, answer, tokens: what came since the last, in batches (~30 a second)
    answered = Signal(dict)            # text, finish_reason, timings, reused_cache_tokens, routing_agreement, offload
    offloadStats = Signal(object)      # dict: placement and traffic (numpy), a few times a second while generating
    replanned = Signal(dict)           # statements, landed; entries, settings: what Apply put in force; by_engine: why,
                                       # when the engine re-planned by itself
    landedChanged = Signal(list)       # "where everything landed" again: the engine re-weighed its miss slots
    unloaded = Signal()
    dropped = Signal()                 # the loaded model went to free its memory for the next load (loading now)
    failed = Signal(str)               # one line for the user
    jobProgress = Signal(str, object, str)  # job kind, fraction done (None: how far cannot be told), what runs now
    jobStreamed = Signal(str, object)      # job kind, a batch of streamed answer text (the job's own shape)
    jobFinished = Signal(str, object)      # job kind, its result
    jobFailed = Signal(str, str, list)     # job kind, one line (also sent as `failed`), the runs it saved all the same
    jobSkipped = Signal(str)               # job kind: stopped while it waited in the queue (stopped_job), not run

    # requests, queued into the worker thread
    requestOpen = Signal(str)                  # inspect a folder (no sessions)
    requestDemo = Signal(bool)                 # write (if needed) and open the demo model; load it if True
    requestLoad = Signal(str, dict)            # path, {"device": {...}, "entries": {...}}
    requestSend = Signal(str, dict)            # text, options
    requestRegenerate = Signal(dict)
    requestNewChat = Signal(str)               # system prompt
    requestReplan = Signal(dict)               # {"entries": offload entries, "layer_split": ...}
    requestUnload = Signal()
    requestJob = Signal(str, object, int)      # kind ("recording", "sweeping", ...), a records job, its number

    def __init__(self, demo_dir: str | None = None):
        super().__init__()
        self.cancel = threading.Event()
        self.stopped_request = 0  # the chat request (options["request"]) the window stopped before it saw it begin
        self.stopped_load = 0  # the load (settings["request"]) the window stopped before it saw it begin
        self._load_request = None  # the number of the load that runs (settings["request"]; None: the demo's own)
        self.stopped_job = 0  # the records job (requestJob's number) the window stopped before it saw it begin
        self.unload_asked = False  # the window's Unload, queued behind what runs now, is still to come (_unload)
        self.demo_dir = demo_dir
        self._folder = None
        self._folder_open_s = 0.0  # the seconds ModelFolder.open took for _folder
        self._facts = None
        self._loaded_facts = None
        self._model = None
        self._device = None
        self._device_fallback = ""  # why the loaded model's experts all run on the CPU, its CUDA GPU unusable (notes)
        self._conversation = None
        self._system_prompt = ""
        self._last_stats = 0.0
        self._decode_mark = None
        self._landed_whole = False  # the layer split the last "landed" statements described (engine re-plans)
        self._landed_path = ""  # ... and the decode path (its trials switch it)
        self._landed_miss: list[int] = []  # ... and the slots a layer left to copied misses (the engine re-weighs them)
        self._landed_opening = False  # ... and whether static placement was still counting routing before it places
        self._landed_statements: list[str] = []  # ... and the plan's statements (the engine adds to them mid-decode)
        self.requestOpen.connect(self._open)
        self.requestDemo.connect(self._demo)
        self.requestLoad.connect(self._load)
        self.requestSend.connect(self._send)
        self.requestRegenerate.connect(self._regenerate)
        self.requestNewChat.connect(self._new_chat)
        self.requestReplan.connect(self._replan)
        self.requestUnload.connect(self._unload)
        self.requestJob.connect(self._job)
        self._device_choice: dict = {}

    # --- opening and loading ---------------------------------------------------------------------
    def _open_folder(self, path: str):
        started = time.perf_counter()
        folder = ModelFolder.open(path)
        # (a load counts it, as LoadedModel.open does for the command line's and side-by-side B's)
        self._folder_open_s = time.perf_counter() - started
        facts = model_facts(folder, inspection(folder), is_demo=folder.folder.name == DEMO_NAME)
        self._folder, self._facts = folder, facts
        return facts

    @Slot(str)
    def _open(self, path: str) -> None:
        self.busyChanged.emit("opening")
        try:
            self.inspected.emit(self._open_folder(path))
        except Exception as exc:
            self.failed.emit(open_failure(path, exc))
        finally:
            self.busyChanged.emit("")

    @Slot(bool)
    def _demo(self, load: bool) -> None:
        self.busyChanged.emit("opening")
        try:
            path = str(ensure_demo_model(self.demo_dir))
            self.inspected.emit(self._open_folder(path))
        except Exception as exc:
            self.failed.emit(f"Could not prepare the demo model: {one_line(exc)}")
            self.busyChanged.emit("")
            return
        self.busyChanged.emit("")
        if load:
            self._load(path, {})

    def _make_device(self, choice: dict, config, notes: list[str]):
        """The device resident experts live on, or None (CPU only). A CUDA GPU that cannot be
        opened falls back to the CPU with a note, unless mode=required."""
        kind = choice.get("kind", "cpu")
        if kind == "simulated":
            capacity = int(choice.get("capacity", 8 << 30))
            return SimulatedDevice(capacity, mem_limit=config.gpu_device_mem_limit,
                                   name=f"simulated GPU, {human_bytes(capacity)}")
        if kind == "cuda":
            device, note = cuda_device_or_cpu(config.gpu_device_mem_limit, config.mode, report=self.loadNote.emit)
            if note:  # said as the load goes on on the CPU (over "Compiling the GPU expert kernels ..." that failed)
                notes.append(note)
                self.loadNote.emit(note)
            return device
        return None

    @Slot(str, dict)
    def _load(self, path: str, settings: dict) -> None:
        self.cancel.clear()
        self._load_request = settings.get("request")
        self.busyChanged.emit("loading")
        kept = f"; {self._loaded_facts.name} stays loaded" if self._model is not None else ""
        unloaded = None  # once this load has dropped the model loaded before: its name ('' where none was)
        mode = None  # the offload mode this load runs under, once read (its failure's advice follows it)
        try:
            self._stop_point()  # (stopped while it waited in the queue: the folder is not read)
            # the folder read again before the loaded model goes: one that cannot be opened now (broken since it was
            # inspected) is refused with the loaded model and its conversation kept
            previous = self._facts.path if self._facts else None
            self._open_folder(path)
            if previous is None or Path(previous).resolve() != Path(path).resolve():
                self.inspected.emit(self._facts)
            config = OffloadConfig.from_entries(settings.get("entries", {}))
            mode = config.mode
            notes: list[str] = []
            # A CUDA GPU the loaded model holds no memory on is opened before that model goes: one that CuPy, the
            # driver or NVRTC leaves unusable, or that cannot be opened (busy: another process holds it in
            # exclusive-process mode; its memory taken), is refused under mode=required with the loaded model kept.
            # Where the loaded model is on the GPU, its memory must be freed first: a failure then says it went.
            opened_first = (settings.get("device", {}).get("kind") == "cuda"
                            and getattr(self._device, "kind", None) != "cuda")
            device = None
            if opened_first:
                self._stop_point()  # (stopped while the folder opened: the GPU kernels' first compile is not begun)
                device = self._make_device(settings.get("device", {}), config, notes)
            self._stop_point()  # Stop while the folder or the GPU opened: the loaded model stays
            unloaded = self._loaded_facts.name if self._model is not None else ""
            self._drop_model()
            if unloaded:
                self.dropped.emit()
            if not opened_first:
                self._stop_point()  # (a CUDA GPU opened again measures its copies, and may compile its kernels)
                device = self._make_device(settings.get("device", {}), config, notes)
            self._device_choice = dict(settings.get("device", {}))

            def progress(fraction: float) -> None:  # (the plan follows the expert runners' last report)
                self._stop_point()
                self.loadProgress.emit(fraction)

            started = time.perf_counter() - self._folder_open_s
            folder, self._folder = self._folder, None  # a folder's sessions belong to one load
            model = LoadedModel(folder, progress=progress, offload=config, device=device,
                                layer_split=_layer_split(settings), decode_path=_decode_path(settings),
                                opened_s=self._folder_open_s)
            self._model, self._device, self._loaded_facts = model, device, self._facts
            self._device_fallback = notes[0] if notes else ""  # (where everything landed says it, as do its records)
            self._conversation = Conversation(model, system_prompt=self._system_prompt or None)
            self.loadProgress.emit(1.0)
            self.loaded.emit({"path": self._facts.path, "load_s": time.perf_counter() - started,
                              "device": device.name if device is not None else "CPU only",
                              "dense_device": "GPU" if model.dense_device == "cuda" else "CPU",
                              "on_gpu": getattr(device, "kind", None) == "cuda",  # (a simulated GPU: no real card's)
                              "landed": self._landed(), "statements": list(model.offload.plan.statements),
                              "entries": config.to_entries(), "is_demo": self._facts.is_demo,
                              "reasoning_choices": list(reasoning_choices(model.tokenizer)),
                              "reasons_first": model.answer_format.kind != "plain",
                              "reasoning_answer_tokens": model.reasoning_answer_tokens,
                              "sampling": _model_sampling(model), "beam_search_note": beam_search_note(model.config)})
            self._emit_stats()
            # the CPU kernels, the offload engine's bookkeeping and the host-part worker's loop compiled now (a first
            # run on this machine: tens of seconds a layout), not in the first answer's time to its first token;
            # milliseconds once Numba has them cached
            self.busyChanged.emit("preparing")
            warm_model(model)
        except Exception as exc:  # the window shows it; the worker stays usable
            dropped = unloaded is not None  # else refused or stopped before the loaded model went: it stays
            if dropped:
                self._drop_model()
                after = (f"; {unloaded} was unloaded first, to free its memory, and is no longer loaded" if unloaded
                         else "")
            elif self.unload_asked and kept:  # (the Unload that stopped this load unloads the model next)
                after = f"; {self._loaded_facts.name} is unloaded, as asked"
            else:
                after = kept
            if isinstance(exc, LoadCancelled):
                self.failed.emit(f"Loading stopped{after}.")
            else:
                self.failed.emit(f"Could not load {path}: {one_line(exc, mode)}{after}")
            if dropped:
                self.unloaded.emit()
        finally:
            self._folder = None
            self.busyChanged.emit("")

    def _stop_point(self) -> None:
        """Where a load ends if Stop was asked: before each of its costly phases (the folder opened and inspected, the
        GPU opened and its kernels compiled, the expert runners built and planned) and at each progress report. Stop
        is the stop flag, or this load's number as stopped_load: the window's stop of a load it has not seen begin,
        which reaches that load alone (the flag would stop whatever runs ahead of it)."""
        if self.load_stopped():
            raise LoadCancelled("loading stopped")

    def load_stopped(self) -> bool:
        """Whether Stop was asked of the load that runs, either way (_stop_point)."""
        return self.cancel.is_set() or (self._load_request is not None and self._load_request == self.stopped_load)

    def _landed(self) -> list[str]:
        """Plain sentences: where every part of the loaded model is, and why (first, while it runs every expert on the
        CPU for want of its CUDA GPU, the load's note saying so: re-plans rebuild these sentences too)."""
        model, facts, offload = self._model, self._loaded_facts, self._model.offload
        self._landed_whole = offload.whole_layers
        self._landed_path = offload.decode_path_in_force
        self._landed_miss = offload.slots_left_to_copies()
        self._landed_statements = list(offload.plan.statements)
        lines = [self._device_fallback] if self._device_fallback else []
        per_layer = [(info.model_layer, info.name, offload.plan.slots.get(info.name, 0), info.spec.num_experts)
                     for info in offload.infos]
        lines += offload.plan.statements
        state = offload.copy_state()
        lines += [said for said in (split_sentence(state["layer_split"]), path_sentence(state["decode_path"])) if said]
        opening = (state.get("static_placement") or {}).get("opening_tokens_left", 0)
        self._landed_opening = bool(opening)
        if self._device is not None:
            # adaptive placement leaves some slots to copied misses: the residents are fewer than the slots there;
            # static placement's opening leaves them all to copies until it places its residents
            miss = self._landed_miss
            lines.append(f"{'Expert slots' if any(miss) or opening else 'Experts resident'} per layer: "
                         f"{layer_summary(per_layer, miss)}.")
            if opening:  # (with a popularity file, the slots its counts do not fill: the plan names their layers)
                where = ("into the slots the popularity file's counts do not fill" if offload.config.popularity_file
                         else "in each layer into its slots")
                lines.append(f"Static placement counts routing for {counted(opening, 'more token')}, then copies "
                             f"the experts routed most {where} for good (copied misses use them meanwhile).")
            memory = self._device.memory
            slots = offload.plan.device_bytes(offload.infos, offload.host_tier)
            parts = [f"expert slots {human_bytes(slots)}"] + [
                f"{purpose} {human_bytes(n)}" for purpose, n in sorted(memory.by_purpose.items())
                if n and not purpose.startswith("expert slots")]
            lines.append(f"{self._device.name}: {human_bytes(memory.used)} in use of {human_bytes(memory.ceiling)} "
                         f"({', '.join(parts)}).")
            if getattr(self._device, "kernels_note", ""):  # (a CUDA device's load that compiled the GPU kernels)
                lines.append(self._device.kernels_note)
            pinned = offload.pinned_info()
            if pinned:
                lines.append(pinned_sentence(pinned, offload.wave_experts))
            if model.host_registration is not None:
                description = model.host_registration.describe()
                lines.append(description[0].upper() + description[1:] + ("" if description.endswith(".") else "."))
        lines.append(f"The dense part: {human_bytes(facts.dense_bytes)} of attention, norms, routers and embeddings "
                     f"in {facts.dense_segments} onnxruntime segments. {model.dense_statement}")
        if model.dense_device != "cuda":
            lines.append(f"KV cache and state live in host memory beside the dense part: up to "
                         f"{human_bytes(facts.kv_cache_bytes())} at {facts.longest_sequence_words}.")
        lines.append(threads_sentence(offload.config.cpu_threads, offload.kernel_threads.cores))
        binding = binding_warning()
        if binding:
            lines.append(binding[0].upper() + binding[1:])
        if offload.config.approximate_routing:
            lines.append("Approximate routing is on: answers report their token agreement with exact routing.")
        return lines

    # --- chat ------------------------------------------------------------------------------------
    def _params(self, options: dict):
        sampling = chat_sampling(options)
        stops = tuple(s for s in options.get("stop_strings", ()) if s)
        return GenerationParams(max_new_tokens=max(1, int(options.get("max_new_tokens", ANSWER_TOKENS))),
                                sampling=sampling, stop_strings=stops, reasoning=options.get("reasoning"))

    def _run_turn(self, conversation, text: str | None, options: dict) -> None:
        """One answer: to `text`, or the last message answered again where it is None."""
        self.cancel.clear()
        request = options.get("request")
        if request is not None and request == self.stopped_request:  # stopped before it began: not run
            self.answered.emit({"text": "", "finish_reason": "cancelled", "timings": {}, "began": False})
            return
        self.busyChanged.emit("generating")
        try:
            params = self._params(options)
            self._last_stats = time.perf_counter()
            self._decode_mark = None
            pending: list[str] = []
            thoughts: list[str] = []  # the reasoning's pieces since the last batch (engine/reasoning.py)
            last_flush = [0.0]

            def flush() -> None:
                if pending:
                    self.streamed.emit("".join(thoughts), "".join(pending), len(pending))
                    pending.clear()
                    thoughts.clear()

            def on_text(_token, delta):
                if request is not None and request == self.stopped_request:  # stopped as it began: ends here
                    self.cancel.set()
                pending.append(delta)
                now = time.perf_counter()
                if now - last_flush[0] >= STREAM_INTERVAL_S:
                    last_flush[0] = now
                    flush()
                if now - self._last_stats >= STATS_INTERVAL_S:
                    self._last_stats = now
                    self._emit_stats(decode=True)

            before = miss_split(getattr(self._model, "offload", None))
            decode_before = decode_totals(getattr(self._model, "offload", None), self._device)
            try:
                def on_reasoning(_token, delta):
                    thoughts.append(delta)

                result = (conversation.send(text, params, on_text, self.cancel, on_reasoning) if text is not None
                          else conversation.regenerate(params, on_text, self.cancel, on_reasoning))
            finally:
                flush()
            self._conversation = conversation
            after = miss_split(getattr(self._model, "offload", None))
            timings = result.timings.as_dict()
            projected = projected_decode_rate(decode_before, decode_totals(getattr(self._model, "offload", None),
                                                                           self._device),
                                              result.timings.decode_s, result.timings.generated_tokens)
            if projected is not None:
                timings["projected_decode_tokens_per_s"] = projected
            self.answered.emit({"text": result.text, "reasoning": result.reasoning,
                                "cut_in_reasoning": result.cut_in_reasoning, "finish_reason": result.finish_reason,
                                "timings": timings, "reused_cache_tokens": result.reused_cache_tokens,
                                "routing_agreement": result.routing_agreement,
                                "offload": {} if cpu_only(self._model) else
                                {key: after[key] - before.get(key, 0) for key in after}})
            self._emit_stats()
        except Exception as exc:
            said = one_line(exc, _offload_mode(self._model))
            self.failed.emit(said)
            self.answered.emit({"text": "", "finish_reason": "error", "error": said, "timings": {}})
        finally:
            self.busyChanged.emit("")

    @Slot(str, dict)
    def _send(self, text: str, options: dict) -> None:
        if self._conversation is None:
            self.failed.emit("No model is loaded: open one (or the demo model) first.")
            self.answered.emit({"text": "", "finish_reason": "error", "error": "no model", "timings": {}})
            return
        self._run_turn(self._conversation, text, options)

    @Slot(dict)
    def _regenerate(self, options: dict) -> None:
        """Answer the last user message again (Conversation.regenerate: from its prompt's state where the conversation
        kept it, else with the turns before it fed afresh); a failed one leaves the last answer, as the chat shows
        it."""
        old = self._conversation
        if old is None or len(old.messages) < 2 or old.messages[-1]["role"] != "assistant":
            self.failed.emit("There is no answer to regenerate.")
            self.answered.emit({"text": "", "finish_reason": "error", "error": "nothing to regenerate", "timings": {}})
            return
        self._run_turn(old, None, options)

    @Slot(str)
    def _new_chat(self, system_prompt: str) -> None:
        self._system_prompt = system_prompt.strip()
        if self._model is not None:
            self._conversation = Conversation(self._model, system_prompt=self._system_prompt or None)

    # --- re-planning and statistics --------------------------------------------------------------
    @Slot(dict)
    def _replan(self, settings: dict) -> None:
        if self._model is None:
            self.failed.emit("No model is loaded: the settings apply at the next load.")
            return
        self.busyChanged.emit("replanning")
        mode = None  # the offload mode being applied, once read (its failure's advice follows it)
        try:
            config = OffloadConfig.from_entries(settings.get("entries", {}))
            mode = config.mode
            blocked = _needs_reload(self._model.offload.config, config)
            if blocked:
                raise WorkbenchError(f"{', '.join(blocked)} changes only when the model is loaded again (Apply and reload)")
            self._model.offload.reconfigure(config, layer_split=_layer_split(settings),
                                            decode_path=_decode_path(settings))
            self.replanned.emit({"statements": list(self._model.offload.plan.statements), "landed": self._landed(),
                                 "entries": config.to_entries(), "settings": settings})
            self._emit_stats()
        except Exception as exc:
            self.failed.emit(f"Could not apply the settings: {one_line(exc, mode)}")
        finally:
            self.busyChanged.emit("")

    def _emit_stats(self, decode: bool = False) -> None:
        """Placement and traffic of the loaded model (emitted from the worker, between tokens).

        During decode it also measures the CPU expert throughput since the previous report: the
        bytes of expert weights the CPU kernels read (one expert per missed token-expert pair the CPU
        computed: misses copied to the device are not read by the CPU) per second of their own time."""
        offload = self._model.offload if self._model is not None else None
        if offload is None:
            return
        if offload.whole_layers != self._landed_whole:  # the layer split's trials re-planned (layer_split.py)
            self.replanned.emit({"statements": list(offload.plan.statements), "landed": self._landed(),
                                 "by_engine": "Measured faster: the expert budget now holds " + (
                                     "whole layers" if offload.whole_layers else "part of every layer")})
        elif offload.decode_path_in_force != self._landed_path and not offload.path_trials.measuring:
            self.replanned.emit({"statements": list(offload.plan.statements), "landed": self._landed(),
                                 "by_engine": "Measured faster: cold experts are now "
                                              + PATH_WORDS[offload.decode_path_in_force]})
        elif (offload.slots_left_to_copies() != self._landed_miss  # the copies' measured worth moved the split
              or getattr(offload.policy, "opening", False) != self._landed_opening  # static placement chose
              # a sentence the engine added to the plan in force: a re-plan the layer split's trials asked for failed
              or offload.plan.statements != self._landed_statements):
            self.landedChanged.emit(self._landed())
        stats = offload.stats
        layers = [{"hits": s.hits, "misses": s.misses, "cpu_s": s.cpu_s, "device_s": s.device_s,
                   "copy_bytes": s.copy_bytes, "swaps": s.swaps, "fills": s.fills, "misses_cpu": s.misses_cpu,
                   "misses_copied": s.misses_copied, "miss_copies": s.miss_copies, "misses_read": s.misses_read,
                   "routed_on_device": s.routed_on_device, "expert_hits": stats.expert_hits[i].copy(),
                   "expert_misses": stats.expert_misses[i].copy()}
                  for i, s in enumerate(stats.layers)]
        bpe = [info.bytes_per_expert for info in offload.infos]
        cpu_bytes = sum(layer["misses_cpu"] * b for layer, b in zip(layers, bpe))
        cpu_s = sum(layer["cpu_s"] for layer in layers)
        rate = 0.0
        if decode:
            if self._decode_mark is not None:
                d_bytes, d_s = cpu_bytes - self._decode_mark[0], cpu_s - self._decode_mark[1]
                rate = d_bytes / d_s if d_s >= 0.02 and d_bytes > 0 else 0.0
            self._decode_mark = (cpu_bytes, cpu_s)
        rows = offload.resident_map()
        width = max((len(row) for row in rows), default=0)
        resident = np.zeros((len(rows), width), bool)
        valid = np.zeros((len(rows), width), bool)
        traffic = np.zeros((len(rows), width), np.float32)
        if offload.config.placement == "adaptive":  # recent routing per expert (placement's own decayed count)
            scores = getattr(offload.policy, "scores", None) or []
        else:  # static placement's scores hold the popularity file's counts too: the routing counted since load
            scores = [layer["expert_hits"] + layer["expert_misses"] for layer in layers]
        for index, row in enumerate(rows):
            resident[index, :len(row)] = row
            valid[index, :len(row)] = True
            if index < len(scores):
                traffic[index, :len(scores[index])] = scores[index]
        self.offloadStats.emit({
            "time": time.monotonic(), "steps": stats.steps, "layers": layers, "resident": resident,
            "slots": [layer.num_slots for layer in offload.slots],
            "valid": valid, "traffic": traffic, "placement": offload.config.placement,
            "cpu_execution": offload.config.cpu_execution, "layer_names": [i.name for i in offload.infos],
            "layer_index": [i.model_layer for i in offload.infos], "bytes_per_expert": bpe,
            "cpu_expert_bytes": cpu_bytes, "cpu_expert_s": cpu_s, "cpu_expert_rate": rate,
            "approximation": dict(vars(offload.approximation)),
            "cpu_only": cpu_only(self._model),
            "misses": miss_split(offload), "step_splits": [tuple(split) for split in stats.step_splits[-STEP_SPLITS:]],
            "pinned": offload.pinned_info(), "wave_experts": offload.wave_experts,
            "copies": offload.copy_state(), "device_memory": self._simulated_memory(),
            "left_to_copies": offload.slots_left_to_copies(),  # (adaptive's miss slots, or static's unchosen slots)
            "own_device_bytes": own_device_bytes(self._model, self._device),
            "arena_over_tier": offload.arena_over_tier,  # (its re-plans make no host tier while set)
        })

    def _simulated_memory(self) -> dict | None:
        """A simulated GPU's memory as the engine accounts it (NVML samples a real card's); None on any other."""
        if not is_simulated(self._device):
            return None
        memory = self._device.memory
        return {"name": self._device.name, "used": memory.used, "high_water": memory.high_water,
                "ceiling": memory.ceiling}

    # --- records jobs: scenarios, sweeps, side-by-side, contention -------------------------------------
    @Slot(str, object, int)
    def _job(self, kind: str, job, request: int = 0) -> None:
        """Run a records job on the loaded model in this thread, so it never overlaps a load, an
        answer or a re-plan. Stop (self.cancel, or its number as stopped_job: _JobStop) reaches it between tokens."""
        if request and request == self.stopped_job:  # stopped while it waited behind what ran: not run
            self.jobSkipped.emit(kind)
            return
        self.cancel.clear()
        self.busyChanged.emit(kind)
        trials = _trials(self._model)
        try:
            context = JobContext(
                model=self._model, device=self._device, device_choice=dict(self._device_choice),
                cancel=_JobStop(self, request),
                progress=lambda fraction, text="": self.jobProgress.emit(
                    kind, None if fraction is None else float(fraction), text),
                stream=lambda payload: self.jobStreamed.emit(kind, payload),
                make_device=self._make_device, device_fallback=self._device_fallback)
            self.jobFinished.emit(kind, job(context))
        except Exception as exc:  # the window shows it; the worker stays usable
            said = one_line(exc, _offload_mode(self._model))
            self.failed.emit(said)
            self.jobFailed.emit(kind, said, list(getattr(exc, "saved_ids", [])))  # AfterAnswersFailed
        finally:
            try:
                if [id(t) for t in _trials(self._model)] != [id(t) for t in trials]:
                    # the job re-planned (a sweep puts the user's budgets back): the trials start afresh, from the
                    # spread and the path cpu_execution gives, which the next statistics would call measured faster
                    self.landedChanged.emit(self._landed())
                self._emit_stats()
            except Exception:
                pass
            self.busyChanged.emit("")

    # --- unloading ---------------------------------------------------------------------------------
    def _drop_model(self) -> None:
        """Forget the loaded model. The GPU's queued work (placement's last copies into the model's slots) is waited
        for first: once freed, the slots' memory goes to the next allocations at once (CudaDevice.quiesce)."""
        if self._model is not None and self._device is not None:
            try:
                self._device.quiesce()
            except Exception as exc:  # a GPU in an error state: the model is dropped all the same
                self.failed.emit(one_line(exc, _offload_mode(self._model)))
        self._conversation = None
        self._model = None
        self._device = None
        self._device_fallback = ""

    @Slot()
    def _unload(self) -> None:
        self.unload_asked = False
        had = self._model is not None
        self._drop_model()
        if had:
            self.unloaded.emit()


class _JobStop:
    """A records job's stop (JobContext.cancel), read where it can end (between tokens, phases and scenarios): the
    worker's stop flag, which Stop sets for what runs, or the job's number as stopped_job, the window's stop of a job
    it has not seen begin, which reaches that job alone (the flag, set once the window heard the job begin, would stop
    whatever the worker ran next where the job had ended by then)."""

    def __init__(self, worker: EngineWorker, request: int):
        self._worker = worker
        self._request = request  # 0: not numbered (a job the window did not send)

    def is_set(self) -> bool:
        return self._worker.cancel.is_set() or (self._request != 0 and self._request == self._worker.stopped_job)


def _offload_mode(model) -> str | None:
    """The offload mode `model` runs under (None: no offload), which the GPU out of memory is said by (one_line)."""
    return model.offload.config.mode if getattr(model, "offload", None) is not None else None


def _trials(model) -> list:
    """The loaded model's layer split and decode path trials, which a re-plan (OffloadEngine.reconfigure) makes anew
    (compared by identity: held here, neither's id is reused)."""
    offload = getattr(model, "offload", None)
    return [offload.split_trials, offload.path_trials] if offload is not None else []


def own_device_bytes(model, device) -> int:
    """The loaded model's memory on a CUDA GPU that the engine knows it allocated: its expert slots, staging ring and
    streaming slots (the device's count) and, where the dense part runs there, its weights (allocated exactly). Not
    the KV cache and onnxruntime's arena, which grow as they need: under gpu_device_mem_limit the device counts their
    caps, not what they hold. 0 on any other device."""
    if model is None or getattr(device, "kind", None) != "cuda":
        return 0
    memory = device.memory
    own = memory.used - memory.by_purpose.get(DENSE_RESERVATION, 0)
    return own + (model.folder.dense_bytes if model.dense.kind == "cuda" else 0)


def split_sentence(split: dict) -> str:
    """The layer split in force and why, for "where everything landed" ('' before any trial under auto)."""
    measured = split.get("measured_ms") or {}
    if split.get("mode") in ("spread", "whole"):
        return f"Layer split fixed: {'whole layers' if split['mode'] == 'whole' else 'spread over every layer'}."
    if not {"spread", "whole"} <= measured.keys():
        return ""
    kept = "whole layers" if split.get("whole_layers") else "the budget spread over every layer"
    return (f"Layer split measured while decoding: {kept} (a decode step took {duration_text(measured['whole'] / 1e3)} "
            f"with whole layers, {duration_text(measured['spread'] / 1e3)} spread).")


def _model_sampling(model) -> dict | None:
    """The model's own sampling defaults (genai_config.json's search) for the chat's Model defaults, with their words;
    None where the search section holds a value the sampler refuses (the chat keeps its own settings then)."""
    try:
        params = model_sampling(model.config)
    except WorkbenchError:
        return None
    return {"temperature": params.temperature if params.do_sample else 0.0, "top_k": params.top_k,
            "top_p": params.top_p, "repetition_penalty": params.repetition_penalty,
            "seed": -1 if params.seed is None else params.seed, "words": describe(params)}


def _layer_split(settings: dict) -> str:
    """The budget panel's layer split for the engine; "auto" is the engine's default (default_layer_split)."""
    split = settings.get("layer_split") or "auto"
    return default_layer_split() if split == "auto" else split


def _decode_path(settings: dict) -> str:
    """The budget panel's decode path for the engine; "auto" is the engine's default (default_decode_path)."""
    path = settings.get("decode_path") or "auto"
    return default_decode_path() if path == "auto" else path


def path_sentence(path: dict) -> str:
    """Where decode computes cold experts, once the trials have measured the ways ('' before, and without a host
    tier: the plan's statements say why there is none)."""
    measured = path.get("measured_ms") or {}
    if not path.get("host_tier") or len(measured) < 2:
        return ""
    kept = PATH_WORDS[path.get("in_force", "cpu")]
    return f"Cold experts measured while decoding: {kept} (a decode step took {measured_words(measured)})."


def threads_sentence(cpu_threads: int, cores: int) -> str:
    """What the CPU expert kernels' thread count is (engine/kernel_threads.py), for "where everything landed": `cores`
    is the most they run on (KernelThreads.cores), which a larger cpu_threads gets."""
    if cpu_threads > cores:
        return (f"CPU expert kernels use {cores} CPU threads, the most they run on here (cpu_threads={cpu_threads} "
                "asks for more).")
    if cpu_threads:
        return f"CPU expert kernels use {cpu_threads} CPU thread{'' if cpu_threads == 1 else 's'}."
    return (f"CPU expert kernels use all {cores} CPU threads, fewer while other processes keep cores busy "
            "(cpu_threads automatic).")


STEP_SPLITS = 256  # the most recent decoder steps' miss splits sent to the window


def cpu_only(model) -> bool:
    """Whether every expert of the loaded model runs on the CPU (no device, or offload disabled with the dense part
    there): nothing is resident, so its routed experts are no misses and none is copied anywhere."""
    offload = getattr(model, "offload", None)
    return offload is None or offload.plan.placement_mode == "cpu_only"


def miss_split(offload) -> dict:
    """Where the misses ran, summed over layers: missed pairs on the CPU, copied to the device (spare slots or
    prefill waves) and read by the device from the host tier, experts the decode miss policy copied into spare slots,
    and the experts the placement admitted from those copies."""
    if offload is None:
        return {}
    total = offload.stats.totals()
    return {"steps": offload.stats.steps, "misses": total.misses, "misses_cpu": total.misses_cpu,
            "misses_copied": total.misses_copied, "miss_copies": total.miss_copies, "misses_read": total.misses_read,
            "admissions": int(getattr(offload.policy, "admissions", 0))}


def pinned_sentence(pinned: dict, wave_experts: int) -> str:
    """The pinned staging ring of the loaded model, for 'where everything landed'."""
    return (f"Pinned staging ring (page-locked host memory every copy to the device goes through): "
            f"{human_bytes(pinned['bytes'])}, high-water {human_bytes(pinned['high_water'])} so far, "
            f"{pinned['copies']} copies; prefill waves of {counted(wave_experts, 'expert')}.")


class WorkerThread:
    """Owns the QThread the worker lives in."""

    def __init__(self, demo_dir: str | None = None):
        self.thread = QThread()
        self.thread.setObjectName("engine")
        self.worker = EngineWorker(demo_dir)
        self.worker.moveToThread(self.thread)
        self.thread.start()

    def stop(self, wait_ms: int = 15000) -> bool:
        """Cancel what the engine does and end its thread; whether it ended within `wait_ms`. It is never terminated:
        a thread stopped inside native code (Numba compiling a first run's kernels, a CPU kernel) would abort the
        process or leave its locks held."""
        self.worker.cancel.set()
        self.thread.quit()
        return self.thread.wait(wait_ms)
