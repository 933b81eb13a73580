"""The budget panel: every offload setting in onnxruntime's vocabulary, each with a live estimate as
it moves (experts resident per layer, a VRAM breakdown, host memory), and Apply, which re-plans the
loaded model without reloading wherever the engine allows."""

from __future__ import annotations

import html
import json
from dataclasses import fields
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QFormLayout, QGroupBox, QHBoxLayout, QLabel, QMenu, QPushButton,
                               QSpinBox, QToolButton, QVBoxLayout, QWidget)

from app.gui import theme
from app.gui.estimate import GIB, DeviceChoice, Part, estimate, layer_summary
from app.gui.widgets import (ByteControl, LayerBars, SettingSpin, StackedBar, heading, legend_html, scrolled,
                             unknown_key)
from engine.errors import WorkbenchError
from engine.offload import decode_path as paths
from engine.offload.config import FLOAT32_MAX, INT32_MAX, PREFIX, UNUSED_KEYS, OffloadConfig, OffloadConfigError
from engine.offload.planner import all_resident_bytes, split_choosable
from engine.records.configurations import configurations_for, own_of, own_problem
from engine.units import counted, human_bytes, parse_bytes
from kernels.gpu.host_tier import TIER_GRANULE

DEVICES = (("cpu", "CPU only"), ("simulated", "Simulated GPU (size you choose)"), ("cuda", "CUDA GPU"))
RELOAD_FIELDS = ("gpu_device_mem_limit",)
SIMULATED_MIN = 1 << 20  # the least simulated GPU, as the command line's --simulated-vram
WORKING_TIP = ("device_working_bytes: device memory for decode streaming slots, shared by the layers that have no "
               "expert slot, so that their misses can also be copied over PCIe while the CPU computes the rest. Off by "
               "default: on the H200 machine they gained 1.05x for large experts (gpt-oss-20b) and lost 1.1x for small "
               "ones (Qwen3-30B-A3B); they pay where the CPU is slow against PCIe. Used where decode computes cold "
               "experts on the CPU: under the host tier the GPU reads those layers' experts itself")
SPLITS = (("auto", "measured while decoding"), ("spread", "spread over every layer"),
          ("whole", "whole layers on the device"))
SPLIT_TIP = ("How the expert budget is spent across layers. Spread (onnxruntime's way): every layer keeps some experts "
             "on the device, good where routing repeats recent experts, but every layer then pays a round trip "
             "through the host. Whole layers (llama.cpp's --n-cpu-moe): the first layers keep all their experts and "
             "run all on the device, the others run all on the CPU; faster where routing has little locality. "
             "Measured while decoding: the engine times both and keeps the faster (under adaptive placement, with CPU "
             "execution auto or enabled, without a host tier (decode path cpu, or auto where none is made); with one, "
             "spread). "
             "Not an onnxruntime key: this app's own setting")
PATHS = (("auto", "measured while decoding"), ("cpu", "computed on the CPU"),
         ("tier", "read by the GPU from host memory"), ("both", "read by the GPU, a share on the CPU"))
PATH_TIP = ("Where decode computes the experts that are in no GPU slot. On the CPU, while the GPU computes the "
            "resident ones: every partly resident layer then pays a round trip through the host. Read by the GPU: "
            "every expert is also kept in page-locked host memory (the experts' size again) and the GPU reads the "
            "cold ones over PCIe inside its kernel, with no round trip; its device mappings round each slot array up "
            f"to the {human_bytes(TIER_GRANULE)} granule, one granule even with no slot. Read by the GPU with a share "
            "on the CPU: the same, while the CPU computes some of each token's cold experts at once (how many, from "
            "the speeds measured while decoding); it can pay for large experts with few resident. Measured while "
            "decoding: the engine times the three and keeps the fastest (under CPU execution auto; disabled reads them "
            "on the GPU, enabled computes them on the CPU). The host memory is taken there only where at most half the "
            "memory available holds it and Pinned is auto; chosen here (read by the GPU, with or without a share), "
            "wherever the memory available holds it. Not an onnxruntime key: this app's own setting")
# the keys the panel's controls set (config()); the others are shown read-only and kept as they came
CONTROLLED_KEYS = frozenset({"mode", "placement", "cpu_execution", "device_expert_bytes", "reserve_device_bytes",
                             "gpu_device_mem_limit", "host_expert_bytes", "pinned_bytes", "device_working_bytes",
                             "cpu_threads", "prefill_wave_experts", "min_expert_weight", "skip_tail_cold_only",
                             "tail_substitution_threshold", "tail_substitution_min_rank"})
OTHER_KEYS = tuple(f.name for f in fields(OffloadConfig) if f.name not in CONTROLLED_KEYS)
OTHER_TIP = ("Settings in force that no control here sets: from the settings file, a saved configuration or the "
             "command line's --offload. Shown, not edited here; Apply keeps them as they are")
STALE_GPU_SAMPLES = 3  # telemetry samples (one a second) NVML may miss before its last reading is said to be stale
PINNED_TIP = ("pinned_bytes: the page-locked host ring every copy to the device goes through. auto = two prefill "
              "waves; a value bounds the ring and the prefill wave (ring // (2 x expert), at least 1); "
              "below one expert it is refused. The slider reaches all the experts, or auto's ring where that is more")


def cuda_status() -> str:
    """'' when CuPy finds a CUDA device, else the engine's message. The device is not opened here: the engine thread
    opens it (cuda_device_problem says why no other thread should)."""
    from engine.offload.cuda_device import cuda_device_problem

    try:
        return cuda_device_problem()
    except Exception as exc:  # noqa: BLE001 - a broken CUDA install: shown, never raised into the GUI
        return str(exc)


class BudgetPanel(QWidget):
    estimateChanged = Signal(object, str, str)    # Estimate, mode, device label
    applyRequested = Signal(dict, bool)           # settings, reload

    def __init__(self, parent=None, configurations_path=None):
        """configurations_path: where named configurations are saved (engine/records/configurations.py)."""
        super().__init__(parent)
        self.setObjectName("budgetPanel")
        self.configurations_path = Path(configurations_path) if configurations_path else None
        self.facts = None
        self.base = OffloadConfig()
        self.applied: dict | None = None   # what the loaded model runs with
        self._applied_config: OffloadConfig | None = None  # its entries parsed once (None: none, or unparsable)
        self._applied_popularity: tuple | None = None  # its popularity file's size and time when applied (_file_stamp)
        self.loaded = False
        self.busy = False  # the engine runs something (an answer, a job, a re-plan): Apply waits for it
        self._cuda_error: str | None = None
        self._gpu: dict | None = None   # NVML's last reading
        self._gpu_missed = 0            # samples since, in which NVML did not answer
        self._gpu_note = ""             # why NVML gave no reading (the telemetry sample's gpu_note)
        self._own_vram = 0              # the loaded model's own GPU memory, as the engine counts it
        self._arena_over_tier: str | None = None  # the loaded model's OffloadEngine.arena_over_tier
        self.last_estimate = None
        self._quiet = False

        # device
        self.device = QComboBox()
        for key, label in DEVICES:
            self.device.addItem(label, key)
        self.device.setAccessibleName("Device for resident experts")
        self.sim_size = ByteControl(80 * GIB, auto_text=None, log_from=64 << 20, minimum=SIMULATED_MIN,
                                    minimum_words="the simulated GPU")
        self.sim_size.setValue(8 * GIB)
        self.sim_size.setAccessibleName("Simulated GPU memory")
        self.device_note = QLabel(wordWrap=True)

        # budgets
        self.expert_bytes = ByteControl(1 << 30)
        self.expert_bytes.setAccessibleName("device_expert_bytes")
        self.reserve_bytes = ByteControl(8 * GIB)
        self.reserve_bytes.setAccessibleName("reserve_device_bytes")
        self.mem_limit = ByteControl(8 * GIB, auto_text="none", zero_is_auto=True)
        self.mem_limit.setAccessibleName("gpu_device_mem_limit")
        self.host_bytes = ByteControl(1 << 30)
        self.host_bytes.setAccessibleName("host_expert_bytes")
        self.pinned_bytes = ByteControl(1 << 30)
        self.pinned_bytes.setAccessibleName("pinned_bytes")
        self.working_bytes = ByteControl(1 << 30, auto_text="off", zero_is_auto=True)
        self.working_bytes.setAccessibleName("device_working_bytes")
        self.pinned_note = QLabel(wordWrap=True)   # the ring and wave the engine would take, or its refusal
        self.pinned_note.setAccessibleName("pinned_bytes effect")
        self._live_pinned: dict = {}               # the loaded model's ring (size, high-water), from its statistics
        self._live_slots: tuple = ()               # the loaded model's slots and miss slots per layer, ditto

        # policy
        self.mode = QComboBox()
        self.mode.addItems(["auto", "required", "disabled"])
        self.placement = QComboBox()
        self.placement.addItems(["adaptive", "static"])
        self.cpu_execution = QComboBox()
        self.cpu_execution.addItems(["auto", "enabled", "disabled"])
        # the ranges onnxruntime accepts, so that a loaded configuration is shown as it is
        self.threads = QSpinBox()
        self.threads.setRange(0, INT32_MAX)
        self.threads.setSpecialValueText("automatic")
        self.wave = QSpinBox()
        self.wave.setRange(1, INT32_MAX)
        self.layer_split = QComboBox()
        for key, label in SPLITS:
            self.layer_split.addItem(label, key)
        self.layer_split.setAccessibleName("Layer split")
        self.decode_path = QComboBox()
        for key, label in PATHS:
            self.decode_path.addItem(label, key)
        self.decode_path.setAccessibleName("Cold experts in decode")

        # approximate routing
        self.min_weight = SettingSpin(1.0)
        self.min_weight.setSpecialValueText("off")
        self.cold_only = QCheckBox("only cold experts")
        self.tail_threshold = SettingSpin(FLOAT32_MAX)  # onnxruntime's bound (a weight is at most 1)
        self.tail_threshold.setSpecialValueText("off")
        self.tail_rank = QSpinBox()
        self.tail_rank.setRange(0, INT32_MAX)  # below each node's k: the load says where not
        self.kv_tokens = QSpinBox()
        self.kv_tokens.setRange(1, 10_000_000)
        self.kv_tokens.setSingleStep(1024)
        self.kv_tokens.setSuffix(" tokens")
        self.kv_tokens.setValue(4096)

        # the estimate
        self.layer_bars = LayerBars()
        self.layer_text = QLabel(wordWrap=True)
        self.vram_bar = StackedBar()
        self.vram_legend = QLabel(wordWrap=True)
        self.vram_title = heading("VRAM")
        self.host_bar = StackedBar()
        self.host_legend = QLabel(wordWrap=True)
        self.statements = QLabel(wordWrap=True)
        self.statements.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        self.apply_button = QPushButton("Apply")
        self.apply_button.setToolTip("Re-plan the loaded model with these settings")
        self.defaults_button = QPushButton("Defaults")
        self.defaults_button.setToolTip("Every budget and setting back to its default (the device stays as chosen)")
        self.saved_button = QToolButton(text="Saved ▾")
        self.saved_button.setToolTip("Settings saved for this model (a budget sweep's Save as configuration); choose "
                                     "one, then Apply")
        self.saved_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        self.saved_menu = QMenu(self.saved_button)
        self.saved_menu.setToolTipsVisible(True)  # a configuration's note (a sweep's: its layer split) is its tooltip
        self.saved_menu.aboutToShow.connect(self._list_saved)
        self.saved_button.setMenu(self.saved_menu)
        self.applied_label = QLabel()

        form = lambda: QFormLayout()  # noqa: E731
        device_box = QGroupBox("Device")
        f = form()
        f.addRow("Experts live on", self.device)
        f.addRow("Simulated size", self.sim_size)
        f.addRow(self.device_note)
        device_box.setLayout(f)
        self._device_form = f

        budget_box = QGroupBox("Budgets")
        f = form()
        f.addRow(_label("Expert budget", "device_expert_bytes: bytes of expert weights kept on the device"),
                 self.expert_bytes)
        f.addRow(_label("Reserve", "reserve_device_bytes: kept free for KV cache and workspace when the budget is "
                        "auto"), self.reserve_bytes)
        f.addRow(_label("Device limit", "gpu_device_mem_limit: a hard cap on all device memory (needs a reload)"),
                 self.mem_limit)
        f.addRow(_label("Host cache", "host_expert_bytes: host memory kept for cold experts the CPU computes; "
                               "the least recently used beyond it are dropped back to the mapped file"),
                 self.host_bytes)
        f.addRow(_label("Pinned", PINNED_TIP), self.pinned_bytes)
        f.addRow(self.pinned_note)
        f.addRow(_label("Streaming slots", WORKING_TIP), self.working_bytes)
        budget_box.setLayout(f)

        policy_box = QGroupBox("Policy")
        f = form()
        f.addRow(_label("Mode", "mode: disabled (every expert where the dense part runs: the CUDA GPU with "
                             "onnxruntime-gpu, else the CPU), auto (offload where possible), required (refuse "
                             "otherwise)"), self.mode)
        f.addRow(_label("Placement", "placement: static (residents chosen once, from popularity_file or else from "
                                  "the routing of the first tokens, then never moved) or adaptive (decayed hit "
                                  "counts, swaps with hysteresis)"),
                 self.placement)
        f.addRow(_label("CPU execution", "cpu_execution: whether cold experts may be computed on the CPU. enabled: "
                                         "they may (each miss on the CPU or copied in, whichever is faster); disabled: "
                                         "never (on a CUDA GPU read from page-locked host memory where it holds them, "
                                         "else copied in); auto: the engine measures the ways while decoding (Cold "
                                         "experts)"), self.cpu_execution)
        f.addRow(_label("CPU threads", "cpu_threads for the CPU expert kernels; 0 = automatic: every core less "
                                       "those other processes keep busy; changes without reload"), self.threads)
        f.addRow(_label("Prefill wave", "prefill_wave_experts: cold experts streamed to the device per wave in "
                        "prefill"), self.wave)
        f.addRow(_label("Layer split", SPLIT_TIP), self.layer_split)
        f.addRow(_label("Cold experts", PATH_TIP), self.decode_path)
        policy_box.setLayout(f)

        approx_box = QGroupBox("Approximate routing")
        f = form()
        f.addRow(_label("Drop below weight", "min_expert_weight: drop each routed expert whose routing weight is below "
                                             "this, never a token's top-ranked one (with 'only cold experts', only "
                                             "those not resident); the others keep their weights, not renormalised. "
                                             "off = 0"), self.min_weight)
        f.addRow("", self.cold_only)
        f.addRow(_label("Substitute below", "tail_substitution_threshold: a cold routed expert whose routing weight is "
                                            "below this, from the rank below on, is replaced by the resident expert "
                                            "the router scores highest among those it did not choose, with the same "
                                            "weight. off = 0"), self.tail_threshold)
        f.addRow(_label("…from rank", "tail_substitution_min_rank: the first routing rank that may be substituted: "
                                      "0 = a token's top-ranked expert too, 1 = from the second on (the default); "
                                      "below each expert node's top-k"), self.tail_rank)
        approx_box.setLayout(f)

        other_box = QGroupBox("Other settings in force")
        other_box.setToolTip(OTHER_TIP)
        self.other_settings = QLabel(wordWrap=True)
        self.other_settings.setAccessibleName("Other settings in force")
        self.other_settings.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        # the popularity file is set only in the settings file, a saved configuration or --offload: taken out here
        # alone (Defaults resets every budget too)
        self.clear_popularity_button = QPushButton("Stop using the popularity file")
        self.clear_popularity_button.setToolTip("Take popularity_file out of these settings, the others kept as they "
                                                "are: placement then starts without its counts (Apply or the next "
                                                "load)")
        self.clear_popularity_button.clicked.connect(self.clear_popularity)
        self.popularity_note = QLabel(wordWrap=True)
        v = QVBoxLayout()
        v.addWidget(self.other_settings)
        v.addWidget(self.clear_popularity_button, 0, Qt.AlignmentFlag.AlignLeft)
        v.addWidget(self.popularity_note)
        other_box.setLayout(v)

        estimate_box = QGroupBox("Estimate")
        v = QVBoxLayout()
        v.addWidget(heading("Experts resident per layer"))
        v.addWidget(self.layer_bars)
        v.addWidget(self.layer_text)
        v.addWidget(self.vram_title)
        v.addWidget(self.vram_bar)
        v.addWidget(self.vram_legend)
        host_row = QHBoxLayout()
        host_row.addWidget(heading("Host memory"))
        host_row.addStretch(1)
        host_row.addWidget(QLabel("KV for"))
        host_row.addWidget(self.kv_tokens)
        v.addLayout(host_row)
        v.addWidget(self.host_bar)
        v.addWidget(self.host_legend)
        v.addWidget(self.statements)
        estimate_box.setLayout(v)

        inner = QWidget()
        column = QVBoxLayout(inner)
        column.addWidget(device_box)
        column.addWidget(estimate_box)
        column.addWidget(budget_box)
        column.addWidget(policy_box)
        column.addWidget(approx_box)
        column.addWidget(other_box)
        column.addStretch(1)
        scroll = scrolled(inner)
        buttons = QHBoxLayout()
        buttons.addWidget(self.applied_label, 1)
        buttons.addWidget(self.saved_button)
        buttons.addWidget(self.defaults_button)
        buttons.addWidget(self.apply_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(scroll, 1)
        layout.addLayout(buttons)

        # Re-estimate on every change, coalesced into one pass per event-loop turn.
        self._timer = QTimer(self, singleShot=True, interval=0)
        self._timer.timeout.connect(self.refresh)
        for control in (self.sim_size, self.expert_bytes, self.reserve_bytes, self.mem_limit, self.host_bytes,
                        self.pinned_bytes, self.working_bytes):
            control.valueChanged.connect(self._changed)
        for combo in (self.device, self.mode, self.placement, self.cpu_execution, self.layer_split, self.decode_path):
            combo.currentIndexChanged.connect(self._changed)
        for spin in (self.threads, self.wave, self.tail_rank, self.kv_tokens):
            spin.valueChanged.connect(self._changed)
        for spin in (self.min_weight, self.tail_threshold):
            spin.valueChanged.connect(self._changed)
        self.cold_only.toggled.connect(self._changed)
        self.expert_bytes.auto.toggled.connect(self._expert_auto_toggled)
        self.reserve_bytes.auto.toggled.connect(self._reserve_auto_toggled)
        self.host_bytes.auto.toggled.connect(self._host_auto_toggled)
        self.pinned_bytes.auto.toggled.connect(self._pinned_auto_toggled)
        self.apply_button.clicked.connect(self._apply)
        self.defaults_button.clicked.connect(self.reset_defaults)
        self.set_config(OffloadConfig())
        self.refresh()

    # --- settings in and out -----------------------------------------------------------------------
    def config(self) -> OffloadConfig:
        return self.base.updated(
            mode=self.mode.currentText(), placement=self.placement.currentText(),
            cpu_execution=self.cpu_execution.currentText(),
            device_expert_bytes=self.expert_bytes.value(), reserve_device_bytes=self.reserve_bytes.value(),
            gpu_device_mem_limit=self.mem_limit.value() or 0, host_expert_bytes=self.host_bytes.value(),
            pinned_bytes=self.pinned_bytes.value(), device_working_bytes=self.working_bytes.value() or None,  # 0: off
            cpu_threads=self.threads.value(),
            prefill_wave_experts=self.wave.value(), min_expert_weight=self.min_weight.value(),
            skip_tail_cold_only=self.cold_only.isChecked(), tail_substitution_threshold=self.tail_threshold.value(),
            tail_substitution_min_rank=self.tail_rank.value())

    def device_settings(self) -> dict:
        kind = self.device.currentData()
        return {"kind": kind, "capacity": int(self.sim_size.value() or GIB)} if kind == "simulated" else {"kind": kind}

    def settings(self) -> dict:
        """What the window remembers per model and sends to the worker: the device, the offload entries
        (onnxruntime's keys), the KV length the estimate counts, the layer split and the decode path (this app's own
        settings)."""
        return {"device": self.device_settings(), "entries": self.config().to_entries(),
                "kv_tokens": self.kv_tokens.value(), "layer_split": self.layer_split.currentData(),
                "decode_path": self.decode_path.currentData()}

    def set_config(self, config: OffloadConfig) -> None:
        self.popularity_note.setText("")  # (said of the settings it cleared, which these replace)
        self._quiet = True
        try:
            self.base = config
            self.mode.setCurrentText(config.mode)
            self.placement.setCurrentText(config.placement)
            self.cpu_execution.setCurrentText(config.cpu_execution)
            self.expert_bytes.setValue(config.device_expert_bytes)
            self.reserve_bytes.setValue(config.reserve_device_bytes)
            self.mem_limit.setValue(config.gpu_device_mem_limit or None)
            self.host_bytes.setValue(config.host_expert_bytes)
            self.pinned_bytes.setValue(config.pinned_bytes)
            self.working_bytes.setValue(config.device_working_bytes)
            self.threads.setValue(config.cpu_threads)
            self.wave.setValue(config.prefill_wave_experts)
            self.min_weight.setValue(config.min_expert_weight)
            self.cold_only.setChecked(config.skip_tail_cold_only)
            self.tail_threshold.setValue(config.tail_substitution_threshold)
            self.tail_rank.setValue(config.tail_substitution_min_rank)
        finally:
            self._quiet = False

    def set_settings(self, settings: dict | None) -> None:
        settings = settings or {}
        self._quiet = True
        try:
            device = settings.get("device", {})
            index = self.device.findData(device.get("kind", "cpu"))
            self.device.setCurrentIndex(max(0, index))
            if device.get("capacity"):
                self.sim_size.setValue(int(device["capacity"]))
            if self.facts is not None:
                self.kv_tokens.setValue(int(settings.get("kv_tokens") or self.facts.longest_sequence))
            self.layer_split.setCurrentIndex(max(0, self.layer_split.findData(settings.get("layer_split", "auto"))))
            self.decode_path.setCurrentIndex(max(0, self.decode_path.findData(settings.get("decode_path", "auto"))))
        finally:
            self._quiet = False
        try:
            config = OffloadConfig.from_entries(settings.get("entries", {}))
        except Exception:
            config = OffloadConfig()
        self.set_config(config)
        self.refresh()

    def _list_saved(self) -> None:
        self.saved_menu.clear()
        try:
            saved = configurations_for(self.facts.path, self.configurations_path) if self.facts is not None else {}
        except WorkbenchError as exc:  # said, not shown as none saved: a sweep could not save one there either
            self.saved_menu.addAction(str(exc)).setEnabled(False)
            return
        for name, item in sorted(saved.items()):
            problem = _entries_problem(item["entries"]) or own_problem(item)
            if problem:  # a hand-edited file: said, not filled in as the defaults
                self.saved_menu.addAction(f"{name}: not usable, {problem}").setEnabled(False)
                continue
            action = self.saved_menu.addAction(name, lambda item=item: self.use_saved(item))
            action.setToolTip(item.get("note", ""))
        if not saved:
            none = self.saved_menu.addAction("None saved for this model (Budget sweep ▸ Save as configuration)")
            none.setEnabled(False)

    def use_saved(self, item: dict) -> None:
        """A saved configuration's offload entries in the panel, on the device chosen, with the layer split and decode
        path it was saved with (one saved before they were kept leaves the panel's); Apply puts them in force."""
        self.set_settings({**self.settings(), "entries": item["entries"], **own_of(item)})
        self.refresh()

    def clear_popularity(self) -> None:
        """Take popularity_file out of the settings shown, every other setting kept, and say so."""
        path = self.base.popularity_file
        self.set_config(self.config().updated(popularity_file=None))
        self.popularity_note.setText(f"popularity_file {path} taken out, the other settings kept: "
                                     + ("Apply places the experts without it" if self.loaded
                                        else "the next load places the experts without it"))
        self.refresh()

    def reset_defaults(self) -> None:
        """Every budget and setting back to its default; where the experts live (the device) stays as chosen."""
        self.set_settings({"kv_tokens": self.facts.longest_sequence if self.facts else None,
                           "device": self.device_settings()})

    # --- model and machine ---------------------------------------------------------------------------
    def set_facts(self, facts, settings: dict | None) -> None:
        self.facts = facts
        self._set_applied(None)
        self.loaded = False
        # the expert budget's far end holds every expert in device slots (the GPU kernels' layout, larger
        # than the stored experts); the host cache holds stored experts. The pinned ring holds waves of experts as
        # staged, not the stored experts: its far end is raised to the automatic ring once an estimate gives it
        # (_show_pinned), with Pinned on auto or a value, which a tiny model's two prefill waves make more than all
        # its experts.
        self.expert_bytes.setMaximum(max(1, all_resident_bytes(facts.experts), facts.expert_bytes))
        for control in (self.host_bytes, self.pinned_bytes):
            control.setMaximum(max(1, facts.expert_bytes))
        # the KV cache never grows past the longest sequence: the context, or search.max_length below it
        self.kv_tokens.setMaximum(facts.longest_sequence)
        # a model with no budgets kept starts from the defaults on the device chosen, as Defaults leaves it: the
        # machine's GPU (or the simulated one tried) is not another for each model
        self.set_settings(settings if settings is not None else {"device": self.device_settings()})

    def set_gpu(self, gpu: dict | None, note: str = "") -> None:
        """The latest NVML reading: the CUDA choice's capacity and what other processes and the driver hold; `note`,
        why there is none. A sample without one (NVML did not answer) keeps the last reading: a card does not shrink
        to 0 bytes for a second."""
        if gpu is None and self._gpu is None:
            if note != self._gpu_note:
                self._gpu_note = note
                self._changed()
            return
        if gpu is None:
            self._gpu_missed += 1
            if self._gpu_missed >= STALE_GPU_SAMPLES and self.device.currentData() == "cuda":
                self._changed()  # says it is stale, and for how long
            return
        self._gpu, self._gpu_missed = gpu, 0
        if self.device.currentData() == "cuda" and gpu is not None:
            self._changed()

    def set_own_vram(self, nbytes: int) -> None:
        """The loaded model's own GPU memory as the engine counts it (engine_worker.own_device_bytes), which NVML's
        memory in use holds where the driver does not say whose it is."""
        if nbytes != self._own_vram:
            self._own_vram = nbytes
            self._changed()

    def mark_loaded(self, settings: dict | None) -> None:
        self.loaded = settings is not None
        self._cuda_error = None  # asked again: a load may have found the GPU's kernels refused (cuda_device_problem)
        if settings is None:
            self._live_pinned = {}
            self._own_vram = 0
            self._arena_over_tier = None
        self._set_applied(settings)
        self.refresh()

    def set_busy(self, busy: bool) -> None:
        self.busy = busy
        self._update_apply()

    def _set_applied(self, settings: dict | None) -> None:
        self.applied = settings
        self.popularity_note.setText("")  # (what it said Apply or a load would do is done, or no longer to be done)
        try:
            self._applied_config = OffloadConfig.from_entries(settings.get("entries", {})) if settings else None
        except OffloadConfigError:
            self._applied_config = None
        self._applied_popularity = _file_stamp(self._applied_config and self._applied_config.popularity_file)

    def popularity_edited(self) -> bool:
        """The popularity file in force was edited since it was applied (the engine reads it again at an Apply)."""
        path = self._applied_config and self._applied_config.popularity_file
        return bool(path) and _file_stamp(path) != self._applied_popularity

    def device_choice(self) -> DeviceChoice:
        kind = self.device.currentData()
        if kind == "simulated":
            return DeviceChoice("simulated", int(self.sim_size.value() or GIB))
        if kind == "cuda":
            if self._cuda_error is None:
                self._cuda_error = cuda_status()
            gpu = self._gpu or {}
            others, note = gpu.get("others", 0), ""
            if not gpu.get("per_process", True):
                # NVML's 'others' is then all the memory in use: the loaded model's own is not other processes'
                own = max(gpu.get("this", 0), self._own_vram if self.loaded else 0)
                others = max(0, gpu.get("used", 0) - own)
                note = ("NVML's memory in use less this model's own as the engine counts it (the driver does not say "
                        "whose; its KV cache and onnxruntime's workspace are in it)" if own
                        else "NVML's memory in use (the driver does not say whose)")
            elif gpu:
                # all in use but this process's, as the load plans with: the driver's own reservations (no process's)
                # and what only draws the screen are in it beside the other computing processes' that NVML lists
                listed = min(others, gpu.get("listed", 0))
                note = (f"NVML: {human_bytes(listed)} other processes', {human_bytes(others - listed)} the driver's "
                        "own reservations and the display's")
            return DeviceChoice("cuda", gpu.get("total", 0), others, gpu.get("name", "CUDA GPU"), self._cuda_error,
                                others_note=note)
        return DeviceChoice("cpu", 0)

    # --- live estimate -----------------------------------------------------------------------------
    def _changed(self, *_args) -> None:
        if not self._quiet:
            self._timer.start()

    def refresh(self) -> None:
        t = theme.current()
        choice = self.device_choice()
        on_device = choice.kind != "cpu"
        self._device_form.setRowVisible(self.sim_size, choice.kind == "simulated")
        # without a device every expert runs on the CPU: where experts live, move or compute changes nothing
        # (nor tail substitution: it puts a resident expert in a cold one's place)
        for control in (self.expert_bytes, self.reserve_bytes, self.mem_limit, self.wave, self.pinned_bytes,
                        self.working_bytes, self.placement, self.cpu_execution, self.layer_split, self.decode_path,
                        self.tail_threshold):
            control.setEnabled(on_device)
        # each narrows another setting, and does nothing while that one is off
        self.cold_only.setEnabled(self.min_weight.value() > 0)
        self.tail_rank.setEnabled(on_device and self.tail_threshold.value() > 0)
        capacity = choice.capacity if on_device and choice.capacity else 8 * GIB
        self.reserve_bytes.setMaximum(capacity)
        self.mem_limit.setMaximum(capacity)
        if choice.kind == "cpu":
            self.device_note.setText("Every expert runs on the CPU. Choose a simulated GPU to try budgets "
                                     "without a card, or the CUDA GPU.")
        elif choice.kind == "cuda":
            stale = (f" (stale: NVML has not answered for the last {self._gpu_missed} samples; this is its last "
                     "reading)" if self._gpu_missed >= STALE_GPU_SAMPLES else "")
            if choice.error:
                unavailable = html.escape(choice.error, quote=False)
                self.device_note.setText(f"<span style='color:{t.error}'>Unavailable: {unavailable}</span>")
            elif self._gpu is None:
                why = self._gpu_note or "NVML has given no reading"
                self.device_note.setText(f"{choice.label}: its memory is not known yet ({why}); the estimate counts a "
                                         "card of 0 B, the load measures the card itself")
            else:
                self.device_note.setText(f"{choice.label}: {human_bytes(choice.capacity)}{stale}")
        else:
            self.device_note.setText("Resident experts are accounted as on a GPU of this size and computed by the "
                                     "CPU kernels; copy and device times are modelled.")
        self.other_settings.setText(other_settings_html(self.base, t))
        self.clear_popularity_button.setVisible(bool(self.base.popularity_file))
        self.popularity_note.setVisible(bool(self.popularity_note.text()))
        if self.facts is None:
            self.layer_text.setText("Open a model to see estimates.")
            self.pinned_note.setText("")
            self._update_apply()
            return
        config = self.config()
        # Apply re-plans the loaded model, which makes no host tier while its arena holds the tier's room (a reload can)
        over_tier = self._arena_over_tier if self.loaded and not self.needs_reload() else None
        est = estimate(self.facts, config, choice, self.kv_tokens.value(),
                       whole_layers=self.layer_split.currentData() == "whole", experts_in_ram=self._experts_in_ram(),
                       decode_path=self._decode_path_mode(), arena_over_tier=over_tier)
        self.last_estimate = est
        self.layer_bars.setRows(est.per_layer)
        miss = self._live_miss_slots(est)
        head = (f"<b>{counted(est.resident, 'expert slot')}</b> for {est.total_experts} experts: " if any(miss)
                else "<b>%d of %d</b> experts resident: " % (est.resident, est.total_experts))
        self.layer_text.setText(head + layer_summary(est.per_layer, miss))
        if on_device and not choice.error:
            limited = any(part.key == "limit" for part in est.device_parts)  # not where other processes bound it
            self.vram_title.setText(f"VRAM — {choice.label}"
                                    + (f", limit {human_bytes(est.ceiling)}" if limited else ""))
            self.vram_bar.setParts(est.device_parts)
            self.vram_legend.setText(legend_html(est.device_parts, t))
            self.vram_bar.show()
        else:
            self.vram_title.setText(f"VRAM — the {choice.label} cannot be used" if choice.error
                                    else "VRAM — no GPU device chosen")
            self.vram_bar.hide()
            self.vram_legend.setText(f"<span style='color:{t.muted}'>Nothing of the model is on a GPU.</span>")
        host_parts = est.host_parts + self._tier(est, choice)
        self.host_bar.setParts(host_parts)
        self.host_legend.setText(legend_html(host_parts, t))
        self._show_pinned(est, choice, config)
        colour = t.error if est.error else t.text
        statements = est.statements + self._split_statement(est, config)
        # the statements are text (a node or folder name, an NVRTC error naming std::vector<int>): escaped for the label
        shown = "<br>".join(html.escape(statement, quote=False) for statement in statements)
        self.statements.setText(f"<span style='color:{colour}'>{shown}</span>")
        self._update_apply()
        self.estimateChanged.emit(est, config.mode, choice.label)

    def _split_statement(self, est, config: OffloadConfig) -> list[str]:
        """Under the measured layer split, what the engine will try besides the spread plan shown (where
        planner.split_choosable, as the engine asks it), and only without a host tier, as the engine tries it."""
        held = 0
        if self.layer_split.currentData() == "auto" and est.plan is not None and not est.host_tier:
            held = split_choosable(config, est.plan, self.facts.experts)
        if held == 0:
            return []
        layers = sum(1 for info in self.facts.experts if info.gpu is not None)
        return [f"While decoding, the engine also tries this budget on whole layers ({held} of "
                f"{counted(layers, 'layer')} keeping all their experts) and keeps whichever decodes faster "
                "(Layer split)."]

    def _experts_in_ram(self) -> int:
        """The loaded model's experts copied into RAM (it runs with allow_file_backing=0), else 0."""
        applied = self._applied_config
        if not self.loaded or applied is None:
            return 0
        return 0 if applied.allow_file_backing else self.facts.expert_bytes

    def _decode_path_mode(self) -> str:
        mode = self.decode_path.currentData()
        return paths.default_decode_path() if mode == "auto" else mode

    def _tier(self, est, choice: DeviceChoice) -> list[Part]:
        """The host tier's page-locked memory for the host-memory bar, where the estimate's plan gets one (its
        statements say what decode does with it, or why there is none)."""
        if not est.host_tier:
            return []
        note = "page-locked: every expert again, in the GPU kernels' layout" + (
            " (counted, not allocated, on a simulated GPU)" if choice.kind == "simulated" else "")
        return [Part("tier", "host tier", paths.tier_bytes(self.facts.experts), note)]

    def _show_pinned(self, est, choice: DeviceChoice, config: OffloadConfig) -> None:
        """What pinned_bytes does, live: the ring and the prefill wave it gives, or the engine's refusal;
        and, once loaded, the ring the model runs with and its high-water mark."""
        t = theme.current()
        if choice.kind == "cpu" or choice.error:
            text = f"<span style='color:{t.muted}'>No ring: nothing is copied to a device.</span>"
        elif config.mode == "disabled":
            text = f"<span style='color:{t.muted}'>No ring: offload is disabled.</span>"
        elif est.staging is not None:
            st = est.staging
            # leaving auto starts from auto's ring, and a value set can go back to it: the slider reaches it
            self.pinned_bytes.setMaximum(max(1, self.facts.expert_bytes, st.auto_pinned_bytes))
            how = "auto: two prefill waves" if config.pinned_bytes is None else "this value bounds the wave"
            text = (f"Ring <b>{human_bytes(st.pinned_bytes)}</b> = {counted(st.pinned_experts, 'expert')} of "
                    f"{human_bytes(st.staged_expert_bytes)} · prefill waves of <b>{st.wave_experts}</b> ({how})")
        elif est.error and "pinned_bytes" in est.error:
            text = f"<span style='color:{t.error}'>Refused: {html.escape(est.error)}</span>"
        else:
            text = ""
        live = self._live_pinned
        if live and self.loaded:
            text += (("<br>" if text else "") + f"<span style='color:{t.muted}'>Loaded model: ring "
                     f"{human_bytes(live['bytes'])}, high-water {human_bytes(live['high_water'])}, "
                     f"{live.get('copies', 0)} copies</span>")
        self.pinned_note.setText(text)

    def set_live_pinned(self, pinned: dict | None) -> None:
        """The loaded model's pinned ring (OffloadEngine.pinned_info()), from its latest statistics."""
        pinned = dict(pinned or {})
        if pinned != self._live_pinned:
            self._live_pinned = pinned
            if self.last_estimate is not None:
                self._show_pinned(self.last_estimate, self.device_choice(), self.config())

    def set_live_arena_over_tier(self, refusal: str | None) -> None:
        """The loaded model's OffloadEngine.arena_over_tier (its latest statistics): where its load put the dense part
        on the card without the host tier, whose device mappings left onnxruntime's arena short, its re-plans make no
        tier, and the estimate of what Apply re-plans says so."""
        if refusal != self._arena_over_tier:
            self._arena_over_tier = refusal
            if self.facts is not None:
                self.refresh()

    def set_live_slots(self, slots: list[int], miss_slots: list[int]) -> None:
        """The loaded model's slots and the slots adaptive placement leaves to copied misses, per layer (its latest
        statistics)."""
        live = (tuple(slots), tuple(miss_slots))
        if live != self._live_slots:
            self._live_slots = live
            if self.facts is not None:
                self.refresh()

    def _live_miss_slots(self, est) -> list[int]:
        """The loaded model's miss slots per layer where `est` plans the slots it holds (the settings in force), else
        none: the engine weighs them once its slots are made (OffloadEngine._weigh_miss_slots)."""
        slots, miss = self._live_slots or ((), ())
        if self.loaded and list(slots) == [r for _l, _n, r, _e in est.per_layer]:
            return list(miss)
        return []

    def _expert_auto_toggled(self, auto: bool) -> None:
        """Leaving auto starts from the budget auto gave, as far as the slider reaches (every expert in a slot): not
        from 0 bytes, which takes every expert off the device."""
        plan = self.last_estimate.plan if self.last_estimate is not None else None
        if not auto and plan is not None and not self.expert_bytes.value():
            self.expert_bytes.setValue(min(plan.budget_bytes, self.expert_bytes.maximum()))
            self._changed()

    def _reserve_auto_toggled(self, auto: bool) -> None:
        """Leaving auto starts from the reserve auto kept free, as the expert budget starts from auto's: not from 0
        bytes, which gives the automatic budget the whole device and leaves the KV cache and workspace no room."""
        reserve = self.last_estimate.reserve_bytes if self.last_estimate is not None else None
        if not auto and reserve is not None and not self.reserve_bytes.value():
            self.reserve_bytes.setValue(min(reserve, self.reserve_bytes.maximum()))
            self._changed()

    def _host_auto_toggled(self, auto: bool) -> None:
        """Leaving auto starts from what auto keeps, every expert's pages (the slider's far end): not from 0 bytes,
        which keeps no expert in host memory and reads each cold expert back from the file."""
        if not auto and self.facts is not None and not self.host_bytes.value():
            self.host_bytes.setValue(min(self.facts.expert_bytes, self.host_bytes.maximum()))
            self._changed()

    def _pinned_auto_toggled(self, auto: bool) -> None:
        """Leaving auto starts from the ring auto gave (not from 0 bytes, which holds no expert)."""
        staging = self.last_estimate.staging if self.last_estimate is not None else None
        if not auto and staging is not None and (self.pinned_bytes.value() or 0) < staging.staged_expert_bytes:
            self.pinned_bytes.setValue(staging.pinned_bytes)
            self._changed()

    # --- apply ---------------------------------------------------------------------------------------
    def needs_reload(self) -> list[str]:
        """Which changes since the load can only take effect by loading again."""
        if not self.applied:
            return []
        reasons = []
        if self.applied.get("device") != self.device_settings():
            reasons.append("device")
        old, new = self._applied_config, self.config()
        if old is not None:
            reasons += [name for name in RELOAD_FIELDS if getattr(old, name) != getattr(new, name)]
        return reasons

    def dirty(self) -> bool:
        if not self.applied:
            return False
        if self._applied_config is None:
            return True
        return self._settings_changed() or self.popularity_edited()

    def _settings_changed(self) -> bool:
        return (self._applied_config != self.config() or self.applied.get("device") != self.device_settings()
                or self.applied.get("layer_split", "auto") != self.layer_split.currentData()
                or self.applied.get("decode_path", "auto") != self.decode_path.currentData())

    def update_apply(self) -> None:
        """Apply's state looked at again (the window activated: a file it names may have been edited meanwhile)."""
        self._update_apply()

    def _update_apply(self) -> None:
        reload = self.needs_reload()
        self.apply_button.setText("Apply and reload" if reload else "Apply")
        refused = self.last_estimate is not None and bool(self.last_estimate.error)
        self.apply_button.setEnabled(self.loaded and self.dirty() and not refused and not self.busy)
        if not self.loaded:
            self.applied_label.setText("Used at the next load")
        elif self.dirty() and refused:
            self.applied_label.setText("Changed: refused, not applied (see the estimate)")
        elif self.dirty() and not self._settings_changed():  # the settings in force, their popularity file edited
            path = self._applied_config.popularity_file
            self.applied_label.setText(f"Changed: {Path(path).name} "
                                       f"{'was edited' if _file_stamp(path) else 'is gone'} since it was applied")
        elif self.dirty():
            self.applied_label.setText("Changed: " + ("needs a reload (" + ", ".join(reload) + ")" if reload
                                                      else "not applied yet"))
        else:
            self.applied_label.setText("Applied to the loaded model")

    def _apply(self) -> None:
        self.applyRequested.emit(self.settings(), bool(self.needs_reload()))


def _file_stamp(path: str | None) -> tuple | None:
    """A file's size and modification time, which an edit changes (None: no path, or no file there)."""
    try:
        stat = Path(path).stat() if path else None
    except OSError:
        return None
    return (stat.st_size, stat.st_mtime_ns) if stat else None


def other_settings_html(config: OffloadConfig, t) -> str:
    """The settings in `config` that no control of the panel shows (OTHER_KEYS), in onnxruntime's key names: those
    set, each with its value, then those at their defaults and those not set."""
    given = {key[len(PREFIX):]: value for key, value in config.to_entries().items()}
    written = {key[len(PREFIX):]: value for key, value in config.session_entries().items()}
    lines = [f"<b>{key}</b> = {html.escape(given[key])}"
             + (" (kept for onnxruntime; no effect in this engine)" if key in UNUSED_KEYS else "")
             for key in OTHER_KEYS if key in given]
    defaults = ", ".join(f"{key}={written[key]}" for key in OTHER_KEYS if key not in given and key in written)
    unset = ", ".join(key for key in OTHER_KEYS if key not in given and key not in written)
    rest = "; ".join(part for part in (defaults and f"At their defaults: {defaults}", unset and f"Not set: {unset}")
                     if part)
    return "<br>".join(lines + ([f"<span style='color:{t.muted}'>{rest}</span>"] if rest else []))


def kept_settings_problem(settings: dict) -> str:
    """Why budgets kept for a model (settings() as read back from the settings file, which may have been edited or
    damaged) cannot be used ('' where they can)."""
    if unknown := unknown_key(settings, ["device", "entries", "kv_tokens", "layer_split", "decode_path"],
                              "budget setting"):
        return unknown
    device = settings.get("device", {})
    if not isinstance(device, dict) or not _one_of(device.get("kind", "cpu"), DEVICES):
        return f'device {json.dumps(device)} is not {{"kind": cpu, simulated or cuda}}'
    if unknown := unknown_key(device, ["kind", "capacity"], "device setting"):
        return unknown
    capacity = device.get("capacity")
    if capacity is not None and (type(capacity) is not int or capacity < SIMULATED_MIN):  # as Simulated GPU refuses
        return (f"device capacity {json.dumps(capacity)} is not a byte count of at least {SIMULATED_MIN}"
                + _number_hint(capacity, parse_bytes, lambda size: size >= SIMULATED_MIN))
    kv_tokens = settings.get("kv_tokens")
    # (one past the model's longest sequence is that: the cache never grows past it; past 32 bits the box raises)
    if kv_tokens is not None and (type(kv_tokens) is not int or not 1 <= kv_tokens <= INT32_MAX):
        return (f"kv_tokens {json.dumps(kv_tokens)} is not a whole number of tokens from 1 to {INT32_MAX}"
                + _number_hint(kv_tokens, int, lambda tokens: 1 <= tokens <= INT32_MAX))
    for name, choices in (("layer_split", SPLITS), ("decode_path", PATHS)):
        value = settings.get(name, "auto")
        if not _one_of(value, choices):
            return f"{name} {json.dumps(value)} is not one of {', '.join(dict(choices))}"
    entries = settings.get("entries", {})
    if not isinstance(entries, dict):
        return "entries is not an object of offload keys"
    return _entries_problem(entries)


def _number_hint(value, read, fits) -> str:
    """What a refusal adds for a kept number typed as a text ("4096", "8 GiB") that `read` takes as one that `fits`:
    the number to write ('' for anything else). One rule for every number the budgets keep."""
    try:
        number = read(value) if isinstance(value, str) else None
    except ValueError:
        return ""
    return f" (write it as a number: {number})" if number is not None and fits(number) else ""


def _one_of(value, choices) -> bool:
    """Whether a kept value is one of the choices' keys (a list or object, unhashable, would raise TypeError there)."""
    return isinstance(value, str) and value in dict(choices)


def _entries_problem(entries: dict) -> str:
    """Why saved offload entries cannot be used ('' where they can)."""
    try:
        OffloadConfig.from_entries(entries)
    except OffloadConfigError as exc:
        return str(exc)
    return ""


def _label(text: str, tooltip: str) -> QLabel:
    label = QLabel(text)
    label.setToolTip(tooltip)
    return label
