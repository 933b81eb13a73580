"""The workstation window: model, budgets, live graphs, placement and chat in docks the user can
rearrange (remembered), following the system's light or dark scheme, every action on the keyboard.

The engine runs in one worker thread (app.gui.engine_worker), the telemetry sampler in another
(app.gui.telemetry); this window only shows what they report."""

from __future__ import annotations

import difflib
import filecmp
import hashlib
import itertools
import json
import os
import re
import shutil
import time
from collections import deque
from importlib.resources import files
from pathlib import Path

from PySide6.QtCore import QByteArray, QEvent, QSettings, Qt, QTimer, Slot
from PySide6.QtGui import QAction, QActionGroup, QIcon, QKeySequence
from PySide6.QtWidgets import (QApplication, QDockWidget, QFileDialog, QLabel, QMainWindow, QMessageBox, QTabWidget,
                               QVBoxLayout, QWidget)

from app.gui import theme
from app.gui.budget_panel import BudgetPanel, kept_settings_problem
from app.gui.chat_panel import ChatPanel, answered_text
from app.gui.collector import GuiCollector
from app.gui.contention import (THRESHOLDS as CONTENTION_THRESHOLDS, ThroughputWatch, WarningHold, cpu_taken,
                                sample_warnings)
from app.gui.contention_view import ContentionView
from app.gui.engine_worker import WorkerThread
from app.gui.graphs_panel import GraphsPanel
from app.gui.history_view import HistoryView
from app.gui.model_panel import ModelPanel
from app.gui.placement_view import PlacementView
from app.gui.scenario_view import ScenarioView
from app.gui.side_by_side_view import SideBySideView
from app.gui.sweep_view import REPEATS_MAX, SweepView
from app.gui.telemetry import SamplerThread
from app.gui.widgets import MAX_ANSWER_TOKENS, Banner, scrolled
from engine.offload.config import OffloadConfig
from engine.offload.cuda_device import kernels_compile_wait
from engine.records.lengths import SWEEP_REPEATS
from engine.units import duration_text

RECENT_MAX = 10
# package data (pyproject.toml): found in an installed wheel as in the checkout
ICON = files("app") / "resources" / "moe-workbench.svg"
STATE_VERSION = 1
# what the engine worker reports as busy while a records job runs, and what the status bar says
JOB_LABELS = {"recording": "Recording scenarios…", "sweeping": "Sweeping budgets…",
              "comparing": "Comparing side by side…", "contention": "Running the contention test…"}
# what Stop stops in each busy state it can stop (opening a folder, preparing the kernels and re-planning it cannot)
STOPPABLE = {"generating": "the answer", "loading": "the load", "recording": "the scenario runs",
             "sweeping": "the budget sweep", "comparing": "the side-by-side comparison",
             "contention": "the contention test"}
STOP_TIP = "Stop the answer, the load or the records job that runs"
NO_MODEL_SAID = "; no model is loaded."  # the status bar's end of a stop the window's Unload made
# the activities whose answers' tokens the tokens/s graph counts (a records job's stream says them: new_tokens);
# side by side's stream says when its answers start and end (its `answering`): its job loads and warms B first
ANSWERING = ("generating", "recording", "sweeping")


def settings_from_env() -> QSettings:
    """MOE_WORKBENCH_SETTINGS=/path/file.ini keeps settings in that file (tests, screenshots)."""
    path = os.environ.get("MOE_WORKBENCH_SETTINGS")
    if path:
        return QSettings(path, QSettings.Format.IniFormat)
    return QSettings("moe-workbench", "moe-workbench")


def unit_hint(text: str) -> str:
    """What a refusal adds for a kept count typed with a unit or word after it (512 tokens, 3x): not taken, as 512k is
    no 512."""
    return ": write the number alone, without a unit" if re.fullmatch(r"\s*[0-9]+\s*[^\W\d]+\s*", text) else ""


def saved_length(raw) -> int | None:
    """An answer length the settings keep: the user's, or None (the box's own: the model's, the sweep's) where none is
    kept; ValueError says one that does not fit (a hand-edited or older settings file)."""
    try:
        tokens = json.loads(raw) if raw else None
    except (ValueError, TypeError):
        tokens = raw
    if tokens is not None and (type(tokens) is not int or not 1 <= tokens <= MAX_ANSWER_TOKENS):
        # Qt reads 1,000 as the list ["1", "000"]. Not taken as a thousand: where a comma marks decimals it is one
        typed = as_kept(raw)
        if re.fullmatch(r"\d{1,3}([, ]\d{3})+", typed.strip()):
            raise ValueError(f"{typed} is not a whole number of tokens: thousands separators are not taken")
        raise ValueError(f"{typed} is not a length of 1 to {MAX_ANSWER_TOKENS} tokens, or null{unit_hint(typed)}")
    return tokens


def as_kept(value) -> str:
    """A kept value as a refusal names it: an empty one would leave the sentence without its subject, and one Qt split
    at its commas (dark,light read as ["dark", "light"]) is said as typed."""
    if isinstance(value, list):
        return ",".join(map(str, value))
    return "an empty value" if value == "" else str(value)


def not_a_text(value) -> str:
    """Why a kept value Qt did not read as a text cannot be used: Qt reads a hand-edited value with a comma and no
    quotes as a list of texts (and drops the quotes in it)."""
    return f"{value} is not a text: in the file, one with a comma needs quotes"


# what a JSON value typed with single quotes needs instead: Qt drops a double quote in the file with no backslash
SINGLE_QUOTES = 'uses single quotes: JSON needs double quotes, written \\" in the file'


def stops_at_single_quote(text: str) -> bool:
    """Whether JSON refuses the text where a single quote stands ({'top_k': 40}, as Python writes it)."""
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        return exc.pos < len(text) and text[exc.pos] == "'"
    except ValueError:
        return False
    return False


def kept_json(raw):
    """What a JSON text the settings keep holds; ValueError says why it cannot be read (a hand-edited file)."""
    if not isinstance(raw, str):
        # Qt split it at its commas: said as typed
        if isinstance(raw, list) and stops_at_single_quote(typed := ", ".join(map(str, raw))):
            raise ValueError(f"{typed} {SINGLE_QUOTES}, and the whole value in quotes for its comma")
        problem = not_a_text(raw)
        # Qt dropped the quotes inside too: in quotes alone, {"top_k": 40, ...} would read as {top_k: 40, ...}
        if isinstance(raw, list) and not any('"' in str(item) for item in raw):
            problem += ', and each of its own quotes a backslash (\\")'
        raise ValueError(problem)
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        if exc.pos < len(raw) and raw[exc.pos] == "'":
            raise ValueError(f"{raw} {SINGLE_QUOTES}") from None
        # a value copied from Python: its True, False and None are not JSON's
        if python := re.match(r"(True|False|None)\b", raw[exc.pos:]):
            json_word = {"True": "true", "False": "false", "None": "null"}[python[1]]
            raise ValueError(f"{raw} is not JSON: JSON writes {python[1]} as {json_word}") from None
        # Qt drops a quote with no backslash before it: {"top_k": 40} typed in the file reads as {top_k: 40}, which
        # JSON refuses where a quoted text should start (every object or list these settings keep holds texts)
        if (raw.lstrip().startswith(("{", "[")) and '"' not in raw
                and exc.msg in ("Expecting property name enclosed in double quotes", "Expecting value")):
            raise ValueError(f'{raw} is not JSON: in the file, each of its quotes needs a backslash (\\"), or Qt '
                             "drops it") from None
        # (its "line 1 column 3" counts in the value, not in the file)
        raise ValueError(f"{raw} is not JSON: {exc.msg} at character {exc.pos + 1} of it") from None
    except ValueError as exc:  # a number past Python's 4300 digits
        raise ValueError(f"not JSON: {exc}") from None


def saved_repeats(raw) -> int:
    """The sweep's repeats the settings keep, else the default where none is; ValueError says one that does not fit
    (a hand-edited file)."""
    if raw is None:
        return SWEEP_REPEATS
    text = str(raw).strip()
    if not (text.isdigit() and 1 <= int(text) <= REPEATS_MAX):
        raise ValueError(f"{as_kept(raw)} is not a count of 1 to {REPEATS_MAX}{unit_hint(text)}")
    return int(text)


def same_folder(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def distinct_folders(paths: list[str]) -> list[str]:
    """`paths` with each folder once, as first listed: /a/b, /a/b/ and a link to it name one folder (compared
    resolved), shown as spelt."""
    seen: set[str] = set()
    kept = []
    for path in paths:
        if (real := os.path.realpath(path)) not in seen:
            seen.add(real)
            kept.append(path)
    return kept


def app_icon() -> QIcon:
    return QIcon(str(ICON)) if ICON.is_file() else QIcon()


class MainWindow(QMainWindow):
    def __init__(self, settings: QSettings | None = None, sample_interval_ms: int = 1000, nvml: bool = True,
                 demo_dir: str | None = None, history_path: str | Path | None = None,
                 configurations_path: str | Path | None = None):
        """history_path / configurations_path: where runs and named configurations are kept
        (default: the user's data folder)."""
        super().__init__()
        self.setObjectName("mainWindow")
        self.setWindowTitle("MoE Workbench")
        self.setWindowIcon(app_icon())
        # garbage collected on this thread only (collector.py): Qt objects freed on the engine's thread deadlocked
        self.collector = GuiCollector(self)
        self.settings = settings if settings is not None else settings_from_env()
        self.facts = None
        self.loaded_path: str | None = None
        self.model_on_gpu = False  # the loaded model uses the real CUDA card (its other processes compete with it)
        self.busy = ""
        self.last_error = ""
        self._load_settings: dict | None = None
        self._closed = False
        self.engine_stopped = True  # False: the engine's thread was still in a call when the window closed
        self._pending_demo_load = False
        self._opened_as: str | None = None  # the folder being opened or loaded as the user named it (_as_named)
        self.watch = ThroughputWatch()
        self.threads_given_way = False  # the CPU kernels' automatic thread count below their cores (the last stats)
        self.warnings = WarningHold()

        self._worker_thread = WorkerThread(demo_dir)
        self.worker = self._worker_thread.worker
        self._sampler_thread = SamplerThread(sample_interval_ms, nvml)
        self.sampler = self._sampler_thread.sampler

        # panels
        self.model_panel = ModelPanel()
        self.budget_panel = BudgetPanel(configurations_path=configurations_path)
        self.graphs = GraphsPanel()
        self.placement = PlacementView()
        self.chat = ChatPanel()
        self.error_banner = Banner("error")
        self.contention_banner = Banner("warn")
        self.contention_banner.setAccessibleName("Contention warning")
        self.contention_banner.close_button.clicked.connect(self.warnings.dismiss)
        self.contention_banner.setToolTip(CONTENTION_THRESHOLDS)
        self.settings_banner = Banner("warn")
        self.settings_banner.setAccessibleName("Settings warning")
        self._check_settings_file()
        # records: history (with scenario runs), budget sweep, side-by-side chat, contention test
        self.scenarios = ScenarioView(history_path)
        self.history = HistoryView(history_path)
        self.sweep = SweepView(history_path, configurations_path)
        self.side_by_side = SideBySideView(history_path)
        self.contention_view = ContentionView()
        # how Record's and the sweep's answers choose their tokens, kept in the settings beside their lengths
        self.answer_choices = {"record": self.scenarios.answers, "sweep": self.sweep.answers}
        for choice in self.answer_choices.values():  # they may sample as the chat's settings say
            choice.chat_options = self.chat.options
        # their and the contention test's reasoning settings, kept beside them as the chat's options keep its own
        self.reasoning_choices = {"record": self.scenarios.reasoning, "sweep": self.sweep.reasoning,
                                  "contention": self.contention_view.reasoning}
        self.job_views = {"recording": self.scenarios, "sweeping": self.sweep, "comparing": self.side_by_side,
                          "contention": self.contention_view}
        # the answer lengths kept in the settings beside the chat's (its options hold its own)
        self.answer_lengths = {"side_by_side": self.side_by_side.max_tokens, "record": self.scenarios.max_tokens,
                               "contention": self.contention_view.max_tokens, "sweep": self.sweep.max_tokens}
        # the load or records job stopped while queued (_stop_queued): its stop is said as the window sees it begin
        self._cancel_when_started: str | None = None
        # the load or records job sent to the worker that it has not started yet: the window is busy with it already
        self._waiting: str | None = None
        self._stopping: str | None = None  # what Stop was asked to stop (STOPPABLE) in the activity that runs
        self._unload_stops: str | None = None  # what the window's Unload stopped (STOPPABLE), until that is said
        # while a stop waits on the GPU kernels' first compile: said again each second, with how long it has run
        self._stop_wait = QTimer(self, interval=1000)
        self._stop_wait.timeout.connect(self._say_stopping)
        self._load_note = ""  # the last of the worker's load notes the status bar showed (_on_load_note)
        self._chat_requests = 0  # the chat's requests to the worker, numbered (EngineWorker.stopped_request)
        self._chat_waiting: int | None = None  # the one sent whose answer has not come back
        self._loads = 0  # the window's loads sent to the worker, numbered (EngineWorker.stopped_load)
        self._jobs = 0  # the records jobs sent to the worker, numbered (EngineWorker.stopped_job)
        self._busy_sent: deque[tuple[str, float]] = deque()  # the worker's activity changes not yet received, as sent
        history_box = QWidget()
        history_column = QVBoxLayout(history_box)
        history_column.setContentsMargins(4, 4, 4, 4)
        history_column.addWidget(self.scenarios)
        history_column.addWidget(self.history, 1)

        central = QWidget()
        column = QVBoxLayout(central)
        column.setContentsMargins(6, 6, 6, 0)
        column.addWidget(self.error_banner)
        column.addWidget(self.contention_banner)
        column.addWidget(self.settings_banner)
        self.tabs = QTabWidget()
        self.tabs.setDocumentMode(True)
        self.tabs.addTab(self.chat, "Ch&at")  # Alt+A: the Chat menu has Alt+C
        self.side_by_side_page = scrolled(self.side_by_side)
        self.tabs.addTab(self.side_by_side_page, "&Side by side")
        column.addWidget(self.tabs, 1)
        self.setCentralWidget(central)
        self.setDockNestingEnabled(True)
        # the placement view sits under the chat only; model, budgets and graphs run full height
        self.setCorner(Qt.Corner.BottomLeftCorner, Qt.DockWidgetArea.LeftDockWidgetArea)
        self.setCorner(Qt.Corner.BottomRightCorner, Qt.DockWidgetArea.RightDockWidgetArea)
        self.docks = {
            "model": self._dock("Model", "modelDock", self.model_panel, Qt.DockWidgetArea.LeftDockWidgetArea),
            "budget": self._dock("Budgets", "budgetDock", self.budget_panel, Qt.DockWidgetArea.LeftDockWidgetArea),
            "graphs": self._dock("Machine", "graphsDock", self.graphs, Qt.DockWidgetArea.RightDockWidgetArea),
            "placement": self._dock("Placement", "placementDock", self.placement,
                                    Qt.DockWidgetArea.BottomDockWidgetArea),
        }
        self.splitDockWidget(self.docks["model"], self.docks["budget"], Qt.Orientation.Vertical)
        area = Qt.DockWidgetArea.BottomDockWidgetArea
        self.record_docks = {
            "history": self._dock("History", "historyDock", scrolled(history_box), area),
            "sweep": self._dock("Budget sweep", "sweepDock", scrolled(self.sweep), area),
            "contention": self._dock("Contention test", "contentionDock", scrolled(self.contention_view), area),
        }
        for dock in self.record_docks.values():
            self.tabifyDockWidget(self.docks["placement"], dock)
        self.docks["placement"].raise_()
        self.status_state = QLabel("Idle")
        self.status_model = QLabel("No model loaded")
        self.status_device = QLabel()
        self.statusBar().addWidget(self.status_state)
        self.statusBar().addWidget(self.status_model, 1)
        self.statusBar().addPermanentWidget(self.status_device)
        self._make_actions()
        self.resize(1600, 1000)
        self.resizeDocks([self.docks["model"], self.docks["graphs"]], [440, 440], Qt.Orientation.Horizontal)
        self.resizeDocks([self.docks["model"], self.docks["budget"]], [470, 510], Qt.Orientation.Vertical)
        self.resizeDocks([self.docks["placement"]], [320], Qt.Orientation.Vertical)
        self._default_state = self.saveState(STATE_VERSION)
        self.setAcceptDrops(True)

        # wiring: panels -> window -> worker
        self.model_panel.openRequested.connect(self.choose_model)
        self.model_panel.recentChosen.connect(self.open_recent)
        self.model_panel.demoRequested.connect(self.load_demo)
        self.model_panel.loadRequested.connect(self.load)
        self.model_panel.unloadRequested.connect(self.unload)
        self.model_panel.stopRequested.connect(self.stop)
        self.budget_panel.estimateChanged.connect(self.model_panel.show_estimate)
        self.budget_panel.estimateChanged.connect(lambda *_estimate: self._update_state())  # (Load: refused or not)
        self.budget_panel.applyRequested.connect(self.apply_settings)
        self.chat.sendRequested.connect(self._send)
        self.chat.regenerateRequested.connect(self._regenerate)
        self.chat.stopRequested.connect(self.stop)
        self.chat.newChatRequested.connect(self._new_chat)
        self.tabs.currentChanged.connect(lambda _index: self._update_chat_actions())  # Send: the chat's or both sides'
        # worker -> window (queued: the worker emits from its own thread)
        w = self.worker
        # when the worker said each change (before it is queued to _on_busy): the tokens/s graph's clock
        w.busyChanged.connect(lambda activity: self._busy_sent.append((activity, time.monotonic())),
                              Qt.ConnectionType.DirectConnection)
        w.busyChanged.connect(self._on_busy)
        w.inspected.connect(self._on_inspected)
        w.loadProgress.connect(self.model_panel.set_progress)
        w.loadNote.connect(self._on_load_note)
        w.loaded.connect(self._on_loaded)
        w.streamed.connect(self._on_streamed)
        w.answered.connect(self._on_answered)
        w.offloadStats.connect(self._on_stats)
        w.replanned.connect(self._on_replanned)
        w.landedChanged.connect(self.model_panel.show_landed)
        w.unloaded.connect(self._on_unloaded)
        w.dropped.connect(self._on_dropped)
        w.failed.connect(self._on_failed)
        w.jobProgress.connect(self._on_job_progress)
        w.jobStreamed.connect(self._on_job_streamed)
        w.jobFinished.connect(self._on_job_finished)
        w.jobFailed.connect(self._on_job_failed)
        w.jobSkipped.connect(self._on_job_skipped)
        for kind, view in self.job_views.items():
            view.jobRequested.connect(self.run_job)
            view.cancelRequested.connect(lambda k=kind: self.cancel_job(k))
            view.failed.connect(self.show_error)
            if hasattr(view, "recorded"):
                view.recorded.connect(lambda _ids: self.history.refresh())
        self.history.failed.connect(self.show_error)
        self.sampler.sampled.connect(self._on_sample)
        self.sampler.failed.connect(self.graphs.show_sampling_failure)

        self._restore()
        app = QApplication.instance()
        app.styleHints().colorSchemeChanged.connect(self._scheme_changed)  # disconnected with the window
        self.apply_theme()
        self._show_recent(distinct_folders(self.recent()))  # (a list kept before folders were compared resolved)
        self._update_state()

    # --- construction ------------------------------------------------------------------------------
    def _dock(self, title: str, name: str, widget: QWidget, area) -> QDockWidget:
        dock = QDockWidget(title, self)
        dock.setObjectName(name)
        dock.setWidget(widget)
        dock.setFeatures(QDockWidget.DockWidgetFeature.DockWidgetMovable
                         | QDockWidget.DockWidgetFeature.DockWidgetFloatable
                         | QDockWidget.DockWidgetFeature.DockWidgetClosable)
        self.addDockWidget(area, dock)
        return dock

    def _action(self, text: str, slot, shortcut=None, tip: str = "") -> QAction:
        action = QAction(text, self)
        if shortcut:
            action.setShortcut(QKeySequence(shortcut))
        if tip:
            action.setStatusTip(tip)
            action.setToolTip(tip)
        action.triggered.connect(slot)
        self.addAction(action)
        return action

    def _make_actions(self) -> None:
        self.open_action = self._action("&Open model folder…", self.choose_model, QKeySequence.StandardKey.Open)
        self.demo_action = self._action("&Demo model", self.load_demo, "Ctrl+D",
                                        "Load the embedded random-weight demo model")
        self.load_action = self._action("&Load", self.load, "Ctrl+L",
                                        "Load the open model with the budget panel's settings")
        self.unload_action = self._action("&Unload", self.unload, "Ctrl+U", "Stop what runs and free the model")
        self.stop_action = self._action("&Stop", self.stop, "Esc", STOP_TIP)
        self.quit_action = self._action("&Quit", self.close, QKeySequence.StandardKey.Quit)
        self.send_action = self._action("&Send", lambda: self._answer(self.chat.send), "Ctrl+Return",
                                        "Send the message; on the Side by side tab, answer both")
        self.regenerate_action = self._action("&Regenerate", lambda: self._answer(self.chat.regenerate), "Ctrl+Shift+R",
                                              "Answer the last message again; on the Side by side tab, answer both")
        self.new_chat_action = self._action("&New chat", lambda: self._in_chat(self.chat.new_chat),
                                            QKeySequence.StandardKey.New)
        self.copy_action = self._action("&Copy last answer", self.chat.copy_last, "Ctrl+Shift+C")
        self.focus_action = self._action("&Focus the message box", lambda: self._in_chat(self.chat.prompt.setFocus),
                                         "Ctrl+K")
        self.pause_action = self._action("&Pause graphs", lambda: self.graphs.set_paused(not self.graphs.paused),
                                         "Ctrl+P")
        self.reset_layout_action = self._action("&Reset layout", self.reset_layout)
        self.shortcuts_action = self._action("&Keyboard shortcuts", self.show_shortcuts,
                                             QKeySequence.StandardKey.HelpContents)

        menu = self.menuBar().addMenu("&File")
        menu.addAction(self.open_action)
        self.recent_menu = menu.addMenu("Open &recent")
        menu.addAction(self.demo_action)
        menu.addSeparator()
        menu.addAction(self.load_action)
        menu.addAction(self.unload_action)
        menu.addSeparator()
        menu.addAction(self.quit_action)
        menu = self.menuBar().addMenu("&Chat")
        for action in (self.send_action, self.stop_action, self.regenerate_action, self.new_chat_action,
                       self.copy_action, self.focus_action):
            menu.addAction(action)
        view = self.menuBar().addMenu("&View")
        for index, (key, dock) in enumerate({**self.docks, **self.record_docks}.items(), start=1):
            toggle = dock.toggleViewAction()
            toggle.setShortcut(QKeySequence(f"Alt+{index}"))
            view.addAction(toggle)
        view.addSeparator()
        view.addAction(self.pause_action)
        theme_menu = view.addMenu("&Theme")
        self.theme_group = QActionGroup(self)
        self.theme_actions = {}
        for key, label in (("system", "Follow the &system"), ("light", "&Light"), ("dark", "&Dark")):
            action = QAction(label, self, checkable=True)
            action.triggered.connect(lambda _c=False, k=key: self.set_theme(k))
            self.theme_group.addAction(action)
            theme_menu.addAction(action)
            self.theme_actions[key] = action
        view.addAction(self.reset_layout_action)
        help_menu = self.menuBar().addMenu("&Help")
        help_menu.addAction(self.shortcuts_action)

    def _answer(self, chat_action) -> None:
        """Send and Regenerate: the shown tab's, the chat's or the side-by-side comparison's (the chat is hidden
        behind that tab: its draft is not what the user means to send)."""
        if self.tabs.currentWidget() is self.side_by_side_page:
            self.side_by_side.answer_both()
        else:
            chat_action()

    def _in_chat(self, chat_action) -> None:
        """A chat action, with the Chat tab brought forward so that what it does is seen."""
        self.tabs.setCurrentWidget(self.chat)
        chat_action()

    # --- settings --------------------------------------------------------------------------------
    def _check_settings_file(self) -> None:
        """Say where the settings file cannot be read. Qt reads what it can of a malformed one and writes only that
        back at the next save, so the file as it was is kept beside it first."""
        name = self.settings.fileName()
        status = self.settings.status()
        if status == QSettings.Status.FormatError:
            bad = name + ".bad"
            try:
                for number in itertools.count(2):  # an earlier malformed file, kept already, stays too
                    if not os.path.exists(bad) or filecmp.cmp(name, bad, shallow=False):
                        break
                    bad = f"{name}.bad{number}"
                shutil.copyfile(name, bad)
                kept = f"the file as it was is kept as {bad}"
            except OSError as exc:
                kept = f"it could not be kept as {bad} ({exc.strerror or exc}), and the next save drops the rest"
            self._warn_settings(f"{name}: not a well-formed settings file: what could be read is used, and {kept}")
        elif status == QSettings.Status.AccessError:
            self._warn_settings(f"{name}: settings not readable (no permission, or not a file): the window starts "
                                "from its defaults and cannot save its settings")

    def _restore(self) -> None:
        s = self.settings
        geometry = s.value("window/geometry")
        if isinstance(geometry, QByteArray) and not geometry.isEmpty():
            self.restoreGeometry(geometry)
        state = s.value("window/state")
        if isinstance(state, QByteArray) and not state.isEmpty():
            self.restoreState(state, STATE_VERSION)
        theme_choice = s.value("view/theme")
        self.theme_choice = theme_choice if theme_choice in ("system", "light", "dark") else "system"
        if theme_choice is not None and theme_choice != self.theme_choice:  # one the menu has no entry for
            self._refuse_kept("view/theme", "theme", f"{as_kept(theme_choice)} is not a theme name: the themes are "
                              "system, light and dark", "the system's is used")
        chat = s.value("chat/options")
        if chat:
            try:
                options = kept_json(chat)
            except ValueError as exc:
                problem = str(exc)
            else:
                try:
                    if not isinstance(options, dict):
                        raise TypeError(f"{json.dumps(options)} is not a JSON object")
                    self.chat.set_options(options)
                    problem = ""
                except (ValueError, TypeError) as exc:
                    problem = str(exc)
            if problem:
                self.chat.set_options({})  # (a value refused partway leaves those before it set)
                self._refuse_kept("chat/options", "chat options", problem, "the chat starts from its defaults")
        prompt = s.value("chat/system_prompt", "")
        if isinstance(prompt, str):
            self.chat.system_prompt.setPlainText(prompt)
        else:
            self._refuse_kept("chat/system_prompt", "system prompt", not_a_text(prompt), "the chat starts with none")
        for key, box in self.answer_lengths.items():
            try:
                box.choose(saved_length(s.value(f"{key}/max_new_tokens")))
            except ValueError as exc:
                self._refuse_kept(f"{key}/max_new_tokens", "answer length", str(exc), "its default is used")
        for key, choice in self.answer_choices.items():
            answers = s.value(f"{key}/answers")
            choice.setCurrentIndex(max(0, choice.findData(answers)))
            if answers is not None and choice.currentData() != answers:
                known = ", ".join(str(choice.itemData(i)) for i in range(choice.count()))
                self._refuse_kept(f"{key}/answers", "answers choice", f"{as_kept(answers)} is not one of {known}",
                                  f"{choice.currentData()} is used")
        for key, choice in self.reasoning_choices.items():
            reasoning = s.value(f"{key}/reasoning")
            if reasoning is not None and not isinstance(reasoning, str):  # (a value of ours is one word)
                self._refuse_kept(f"{key}/reasoning", "reasoning setting", not_a_text(as_kept(reasoning)),
                                  "the template's default is used")
                continue
            choice.choose(reasoning or None)
        try:
            self.sweep.repeats.setValue(saved_repeats(s.value("sweep/repeats")))
        except ValueError as exc:
            self._refuse_kept("sweep/repeats", "sweep's repeats", str(exc), f"its default, {SWEEP_REPEATS}, is used")
        self._say_unknown_keys()

    def _say_unknown_keys(self) -> None:
        """Say the keys of the settings file that the window never reads (chat/option typed for chat/options): a
        setting edited by hand under one would otherwise be passed over without a word."""
        known = ["window/geometry", "window/state", "view/theme", "chat/options", "chat/system_prompt", "recent",
                 *(f"{key}/max_new_tokens" for key in self.answer_lengths),
                 *(f"{key}/answers" for key in self.answer_choices),
                 *(f"{key}/reasoning" for key in self.reasoning_choices), "sweep/repeats"]
        # the file's own keys: with fallbacks Qt lists those of the organisation's and the system's files too (and on
        # macOS the global domain's), which are neither the user's to fix nor in this file
        fallbacks = self.settings.fallbacksEnabled()
        self.settings.setFallbacksEnabled(False)
        keys = self.settings.allKeys()
        self.settings.setFallbacksEnabled(fallbacks)
        for key in keys:
            # a model's budgets are kept under its folder's hash, and an unusable value under its key with .bad added
            if key in known or re.fullmatch(r"models/[0-9a-f]{16}|.+\.bad[0-9]*", key):
                continue
            near = difflib.get_close_matches(key, known, n=1)
            self._warn_settings(f"{self.settings.fileName()}: {key} is not a setting the workbench keeps"
                                + (f" (did you mean {near[0]}?)" if near else "") + ": it is not used, and left there")

    def _refuse_kept(self, key: str, what: str, problem: str, instead: str) -> None:
        """Say a kept value that cannot be used, and move it aside so that the next save does not write over it."""
        self._warn_settings(f"{self.settings.fileName()}: the {what} kept under {key} cannot be used ({problem}): "
                            f"{instead}; what was kept is now under {self._set_aside(key, self.settings.value(key))} "
                            "there")

    def save_settings(self) -> None:
        s = self.settings
        s.setValue("window/geometry", self.saveGeometry())
        s.setValue("window/state", self.saveState(STATE_VERSION))
        s.setValue("view/theme", self.theme_choice)
        s.setValue("chat/options", json.dumps(self.chat.options()))
        s.setValue("chat/system_prompt", self.chat.system_prompt.toPlainText())
        for key, box in self.answer_lengths.items():
            s.setValue(f"{key}/max_new_tokens", json.dumps(box.chosen))  # null: the model's own
        for key, choice in self.answer_choices.items():
            s.setValue(f"{key}/answers", choice.currentData())
        for key, choice in self.reasoning_choices.items():
            s.setValue(f"{key}/reasoning", choice.chosen or "")  # "": the template's default
        s.setValue("sweep/repeats", self.sweep.repeats.value())
        s.sync()

    @staticmethod
    def _model_key(path: str) -> str:
        return "models/" + hashlib.sha1(str(Path(path).expanduser().resolve()).encode()).hexdigest()[:16]

    def model_settings(self, path: str) -> dict | None:
        """The budgets kept for the model at `path`, None where none are. Kept ones that cannot be used are said, and
        moved to a key of their own (`<key>.bad`), so that the next save does not write over them."""
        key = self._model_key(path)
        raw = self.settings.value(key)
        if not raw:
            return None
        try:
            kept = kept_json(raw)
        except ValueError as exc:
            problem = str(exc)
        else:
            budget = kept.get("budget") if isinstance(kept, dict) else None
            problem = (kept_settings_problem(budget) if isinstance(budget, dict)
                       else f"no budget object in {json.dumps(kept)}")
            if not problem:
                self._say_gone_popularity(path, key, budget)
                return budget
        bad = self._set_aside(key, raw)
        self._warn_settings(
            f"{self.settings.fileName()}: the budgets kept for {path} cannot be used ({problem}): the Budgets panel "
            f"shows the defaults; what was kept is now under {bad} there")
        return None

    def _say_gone_popularity(self, path: str, key: str, budget: dict) -> None:
        """Say a popularity file the kept budgets name that is no longer there (moved or deleted since): the budgets
        are kept as they are (putting the file back mends them), but every load would fail on it until cleared."""
        popularity = OffloadConfig.from_entries(budget.get("entries", {})).popularity_file
        if popularity and not os.path.isfile(popularity):
            why = "not a file" if os.path.exists(popularity) else "no such file"
            self._warn_settings(
                f"{self.settings.fileName()}: the budgets kept for {path} name the popularity file {popularity} "
                f"({why}): a load fails on it until it is back, or taken out with Stop using the popularity file in "
                f"the Budgets panel or out of what is kept under {key} there")

    def _set_aside(self, key: str, raw) -> str:
        """Move the unusable value under `key` to a key of its own (`<key>.bad`), so that the next save does not
        write over it; the key it is under now."""
        bad = key + ".bad"
        for number in itertools.count(2):  # an earlier unusable value, kept already, stays too
            if self.settings.value(bad) in (None, raw):
                break
            bad = f"{key}.bad{number}"
        self.settings.setValue(bad, raw)
        self.settings.remove(key)
        self.settings.sync()
        return bad

    def _warn_settings(self, text: str) -> None:
        """Say a problem with the settings file, on a line below those said already and not dismissed (one start
        can find several)."""
        said = self.settings_banner.text() if not self.settings_banner.isHidden() else ""
        if text not in said.split("\n"):
            self.settings_banner.show_message("\n".join(filter(None, (said, text))))

    def save_model_settings(self, path: str, budget: dict) -> None:
        self.settings.setValue(self._model_key(path), json.dumps({"path": path, "budget": budget}))
        self.settings.sync()
        if self.settings.status() == QSettings.Status.AccessError:
            self._warn_settings(f"{self.settings.fileName()}: not writable: the budgets for {path} are used now "
                                "but not kept for the next start")

    def recent(self) -> list[str]:
        raw = self.settings.value("recent")
        if not raw:  # none, or left empty by hand (as empty chat options or budgets are none)
            return []
        try:
            paths = kept_json(raw)
        except ValueError as exc:
            problem = str(exc)
        else:
            if isinstance(paths, list) and all(isinstance(p, str) for p in paths):
                return paths
            problem = f"{json.dumps(paths)} is not a list of paths"
        self._refuse_kept("recent", "recent models", problem, "Open recent starts empty")
        return []

    def _remember_recent(self, path: str) -> None:
        self._keep_recent([path] + self.recent())  # (first, as named this time: under another name it goes)

    def _keep_recent(self, paths: list[str]) -> None:
        paths = distinct_folders(paths)[:RECENT_MAX]
        self.settings.setValue("recent", json.dumps(paths))
        self._show_recent(paths)

    def _show_recent(self, paths: list[str]) -> None:
        self.model_panel.set_recent(paths)
        self.recent_menu.clear()
        for p in paths:
            action = self.recent_menu.addAction(p)
            action.triggered.connect(lambda _c=False, x=p: self.open_recent(x))
        self._update_recent()

    def _as_named(self, path: str) -> str:
        """The folder the worker opened (`path`, resolved) as the user named it, made absolute (through a link, say),
        which the recent models show; `path` where it was opened otherwise (the demo)."""
        named, self._opened_as = self._opened_as, None
        return named if named is not None and os.path.realpath(named) == path else path

    def _update_recent(self) -> None:
        # as Open: while the window is busy an open would queue behind what runs
        self.recent_menu.setEnabled(not self._busy_with() and bool(self.recent_menu.actions()))

    # --- theme and layout --------------------------------------------------------------------------
    @Slot(Qt.ColorScheme)
    def _scheme_changed(self, _scheme) -> None:
        if self.theme_choice == "system":
            self.apply_theme()

    def set_theme(self, choice: str) -> None:
        self.theme_choice = choice
        self.apply_theme()

    def apply_theme(self) -> None:
        t = theme.apply(QApplication.instance(), self.theme_choice)
        self.theme_actions[self.theme_choice].setChecked(True)
        self.graphs.apply_theme(t)
        self.placement.apply_theme(t)
        self.sweep.apply_theme(t)
        self.error_banner.restyle()
        self.contention_banner.restyle()
        self.settings_banner.restyle()
        self.chat.render()
        if self.facts is not None:
            self.model_panel.show_facts(self.facts)
        self.budget_panel.refresh()
        return None

    def reset_layout(self) -> None:
        self.restoreState(self._default_state, STATE_VERSION)
        for dock in (*self.docks.values(), *self.record_docks.values()):
            dock.show()

    def show_shortcuts(self) -> None:
        rows = []
        for action in self.actions():
            if action.shortcut().toString():
                rows.append(f"<tr><td><b>{action.shortcut().toString(QKeySequence.SequenceFormat.NativeText)}</b></td>"
                            f"<td>&nbsp;{action.text().replace('&', '')}</td></tr>")
        for key, dock in {**self.docks, **self.record_docks}.items():
            rows.append(f"<tr><td><b>{dock.toggleViewAction().shortcut().toString()}</b></td>"
                        f"<td>&nbsp;show/hide {dock.windowTitle()}</td></tr>")
        QMessageBox.information(self, "Keyboard shortcuts", "<table>" + "".join(rows) + "</table>")

    # --- actions -----------------------------------------------------------------------------------
    @Slot()
    def choose_model(self) -> None:
        # the folder open now, else the last opened that is still there (the settings keep it from run to run)
        start = self.facts.path if self.facts else next((p for p in self.recent() if os.path.isdir(p)),
                                                        str(Path.home()))
        path = QFileDialog.getExistingDirectory(self, "Open a model folder (genai_config.json, model.onnx)", start)
        if path:
            self.open_model(path)

    def open_model(self, path: str) -> None:
        """Inspect a folder: the table, the verdict and the estimates appear; loading is one click more."""
        self.error_banner.hide()
        self._opened_as = os.path.abspath(os.path.expanduser(path))
        self._wait_for("opening")
        self.worker.requestOpen.emit(str(path))

    def open_recent(self, path: str) -> None:
        """A model picked from Open recent. One whose folder is gone (moved or deleted since it was opened) is dropped
        from the list, and said so: kept, it would fail again at each pick."""
        if os.path.isdir(path):
            self.open_model(path)
            return
        self._keep_recent([p for p in self.recent() if os.path.realpath(p) != os.path.realpath(path)])
        why = "not a folder" if os.path.exists(path) else "no such folder"
        self.show_error(f"Could not open {path}: {why} (moved or deleted since it was opened): it is dropped from "
                        "the recent models")

    @Slot()
    def load_demo(self) -> None:
        self.error_banner.hide()
        self._opened_as = None
        self._pending_demo_load = True
        self._wait_for("opening")
        self.worker.requestDemo.emit(False)

    def _wait_for(self, activity: str) -> None:
        """A request sent to the worker: the window is busy with it until it begins (where nothing else waits)."""
        if self._waiting is None:
            self._waiting = activity
            self._update_state()

    def load_model(self, path: str) -> None:
        """Load a folder (inspecting it first if it is not the open one) with its remembered settings."""
        path = str(path)
        self._opened_as = os.path.abspath(os.path.expanduser(path))
        same = self.facts is not None and Path(self.facts.path).resolve() == Path(path).resolve()
        settings = self.budget_panel.settings() if same else (self.model_settings(path) or {})
        self._start_load(path, settings)

    @Slot()
    def load(self) -> None:
        if self._can_load():
            self._start_load(self.facts.path, self.budget_panel.settings())

    def _start_load(self, path: str, settings: dict) -> None:
        self.error_banner.hide()
        self._load_settings = settings
        self.model_panel.set_progress(0.0)
        self.graphs.add_marker("load", "load")
        self._cancel_when_started = None
        self._waiting = "loading"
        self._loads += 1
        self.worker.requestLoad.emit(path, {**settings, "request": self._loads})
        self._update_state()

    @Slot()
    def unload(self) -> None:
        # the last error was of the model going now (a load this stops says so after, as it ends)
        self.error_banner.hide()
        self._stop_chat_request()
        self.worker.unload_asked = True
        queued = self._waiting == "loading"  # stopped too, before it reads the folder (else it runs in full, for the
        # Unload queued behind it to undo)
        if queued:
            self._stop_queued()
        self.worker.cancel.set()
        self.worker.requestUnload.emit()
        stopping = "loading" if queued else self.busy
        # a load or a records job is stopped first, as Stop stops them (a load, or side by side's of B, may have the GPU
        # kernels' first compile to wait on), and said as it ends, with the model gone (_show_activity); the chat's
        # answer says its own stop
        if stopping in STOPPABLE and stopping != "generating":
            self._stopping = STOPPABLE[stopping]
            self._unload_stops = self._stopping
            self._say_stopping()

    def _stop_chat_request(self) -> bool:
        """Stop the chat's request that was sent but not seen to begin: the worker skips it, or ends it at its first
        token where it began meanwhile. Whether there was one."""
        if self._chat_waiting is None or self.busy == "generating":
            return False
        self.worker.stopped_request = self._chat_waiting
        return True

    @Slot()
    def stop(self) -> None:
        """Stop the chat's answer where one is pending (sent, or running), else what runs where it can be stopped
        (STOPPABLE), else the load or records job sent but not begun (_stop_queued); and say so in the status bar."""
        self._unload_stops = None  # (a stop said from now on is this one's, not an Unload's)
        if self._stop_chat_request():
            what = STOPPABLE["generating"]
        else:
            what = STOPPABLE.get(self.busy)
            if what is not None:
                self.worker.cancel.set()
            elif self._waiting in STOPPABLE:  # queued, not seen to begin
                what = STOPPABLE[self._waiting]
                self._stop_queued()
            else:
                return
        self._stopping = what
        self._say_stopping()

    def _stop_queued(self) -> None:
        """Stop the load or records job the window sent but has not seen begin. Still queued, it does not run: a load
        reads no folder (EngineWorker.stopped_load), a records job is skipped (EngineWorker.stopped_job). One the
        worker began meanwhile stops at its next stop point, its number reaching it alone (the stop flag would stop
        what runs ahead of it too, or what runs after it where it had ended by the time the window heard it began): a
        load before it drops the loaded model where it has not yet."""
        self._cancel_when_started = self._waiting
        if self._waiting == "loading":
            self.worker.stopped_load = self._loads
        else:
            self.worker.stopped_job = self._jobs

    @Slot()
    def _say_stopping(self) -> None:
        """What the status bar says while a stop waits (a load's, or side by side's B's): where the GPU expert kernels'
        first compile runs, which NVRTC does not let a stop interrupt (up to 2 minutes), that it waits for it."""
        if not self._stopping:
            self._stop_wait.stop()
            return
        wait = kernels_compile_wait()
        self.status_state.setText(f"Stopping {self._stopping} once {wait}." if wait
                                  else f"Stopping {self._stopping}…")
        if wait and not self._stop_wait.isActive():
            self._stop_wait.start()
        elif not wait:
            self._stop_wait.stop()

    # --- records jobs: scenarios, sweeps, side-by-side, contention ---------------------------------------
    def run_job(self, kind: str, job) -> None:
        """Queue a records job in the engine worker (after whatever it runs now)."""
        self.error_banner.hide()
        self._cancel_when_started = None
        self._waiting = kind
        self._jobs += 1
        self.worker.requestJob.emit(kind, job, self._jobs)
        self._update_state()

    def cancel_job(self, kind: str) -> None:
        if self.busy == kind:
            self.stop()
        elif self._waiting == kind:  # queued, not started (Stop would stop an answer the window sent before it)
            self._stop_queued()
            self._stopping = STOPPABLE[kind]
            self._say_stopping()

    @Slot(str)
    def _on_job_skipped(self, kind: str) -> None:
        """A records job stopped while it waited in the worker's queue: it did not run."""
        if self._waiting == kind:
            self._waiting = None
        self._cancel_when_started = self._stopping = None
        self._say_stopping()  # (no longer said each second)
        self.status_state.setText(f"Stopped {STOPPABLE[kind]} while queued: nothing ran.")
        view = self.job_views[kind]
        if hasattr(view, "show_not_started"):  # (side by side's sides, cleared as it was sent)
            view.show_not_started()
        view.bar.finish("Cancelled while queued: nothing ran, nothing saved.")
        self._update_state()

    @Slot(str, object, str)
    def _on_job_progress(self, kind: str, fraction: float | None, text: str) -> None:
        self.job_views[kind].on_progress(fraction, text)

    @Slot(str, object)
    def _on_job_streamed(self, kind: str, payload) -> None:
        view = self.job_views[kind]
        if hasattr(view, "on_streamed"):
            view.on_streamed(payload)
        if "answering" in payload:  # (before its tokens: the first batch starts the answers' time)
            self.graphs.set_answering(payload["answering"], now=payload["sent"])
        self.graphs.count_tokens(payload.get("new_tokens", 0))  # (the records jobs that answer say how many)

    @Slot(str, object)
    def _on_job_finished(self, kind: str, result) -> None:
        if kind == "sweeping" and self._unload_stops == STOPPABLE[kind]:
            result.unloaded = True  # the model goes next: not at the budgets the sweep put back
        self.job_views[kind].on_finished(result)
        self.history.refresh()

    @Slot(str, str)
    def _on_job_failed(self, kind: str, message: str, saved_ids: list) -> None:
        self.job_views[kind].on_failed(message)
        if saved_ids:  # a side by side that failed once A's record was saved: the History tab lists that run now
            self.history.refresh()

    def apply_settings(self, settings: dict, reload: bool) -> None:
        if self.facts is None:
            return
        # remembered for the model once the engine accepts them (_on_loaded, _on_replanned), not if it refuses them
        if reload:
            self._start_load(self.facts.path, settings)
        else:
            self.error_banner.hide()  # (an Apply refused before is no error of this one, which says its own)
            self.worker.requestReplan.emit(settings)

    def _send(self, text: str, options: dict) -> None:
        self.contention_banner.hide()
        self.error_banner.hide()  # (the last answer's failure, or another's, is no error of this answer's)
        self.worker.requestSend.emit(text, self._chat_request(options))

    def _regenerate(self, options: dict) -> None:
        self.contention_banner.hide()
        self.error_banner.hide()
        self.worker.requestRegenerate.emit(self._chat_request(options))

    def _chat_request(self, options: dict) -> dict:
        """The chat's options, numbered; from now until its answer comes back the chat is busy and Stop stops it."""
        self._chat_requests += 1
        self._chat_waiting = self._chat_requests
        self._update_state()
        return {**options, "request": self._chat_requests}

    def _new_chat(self, system_prompt: str) -> None:
        self.worker.requestNewChat.emit(system_prompt)
        self._update_chat_actions()  # (no answer left to regenerate or copy)

    # --- drag and drop -----------------------------------------------------------------------------
    @staticmethod
    def _dropped_folder(mime) -> str | None:
        for url in mime.urls() if mime.hasUrls() else []:
            if url.isLocalFile():
                path = Path(url.toLocalFile())
                return str(path if path.is_dir() else path.parent)
        return None

    def dragEnterEvent(self, event) -> None:
        if self._dropped_folder(event.mimeData()):
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:
        folder = self._dropped_folder(event.mimeData())
        if folder:
            event.acceptProposedAction()
            self.open_model(folder)

    # --- worker signals ----------------------------------------------------------------------------
    @Slot(str)
    def _on_busy(self, activity: str) -> None:
        previous, self.busy = self.busy, activity
        stopping, self._stopping = self._stopping, None  # a stop is said of the activity it was asked in
        if self._cancel_when_started not in (None, activity):  # a queued job stopped: said once it starts and ends
            self._stopping, stopping = stopping, None
        sent = self._busy_sent.popleft() if self._busy_sent and self._busy_sent[0][0] == activity else (None, None)
        self.graphs.set_answering(activity in ANSWERING, now=sent[1])
        if activity == "generating":
            self.graphs.add_marker("generate", "generate")
            self.warnings.reset()  # the banner speaks of this answer (_send took the last one's down)
        elif previous == "generating":
            self.graphs.add_marker("answer", "generate")
        if activity in JOB_LABELS:
            self.graphs.add_marker(activity, "generate")
        if activity in (*JOB_LABELS, "loading", "opening"):
            if self._waiting == activity:
                self._waiting = None
            if self._cancel_when_started == activity:  # (stopped by its number: _stop_queued)
                self._stopping = STOPPABLE[activity]  # said as it ends, as for one stopped while it ran
            self._cancel_when_started = None
        self._update_state()
        self._show_activity(stopping)
        self._say_stopping()

    @Slot(str)
    def _on_load_note(self, text: str) -> None:
        """What a load is doing where its progress stands still (the GPU kernels compiling), in the status bar until
        the next activity's label: the window's load, or a side-by-side comparison's of B; not over a stop asked
        meanwhile, which is said as the activity ends, and which says what it waits for where the note is the
        kernels' compile beginning."""
        if self.busy and self._stopping:
            self._say_stopping()
        elif self.busy:
            self._load_note = text
            self.status_state.setText(text)

    @Slot(object)
    def _on_inspected(self, facts) -> None:
        self.facts = facts
        self.model_panel.show_facts(facts)
        self.budget_panel.set_facts(facts, self._load_settings
                                    if self._load_settings is not None and self.busy == "loading"
                                    else self.model_settings(facts.path))
        other_loaded = self.loaded_path is not None and Path(self.loaded_path).resolve() != Path(facts.path).resolve()
        if other_loaded:
            self.budget_panel.mark_loaded(None)
        elif self.loaded_path is not None and self.busy != "loading":  # the loaded model opened again: still in force
            self.budget_panel.mark_loaded(self._load_settings or self.budget_panel.settings())
        self._remember_recent(self._as_named(facts.path))
        shown = f"{facts.name} (not loaded; {Path(self.loaded_path).name} is)" if other_loaded else facts.name
        self.setWindowTitle(f"{shown} — MoE Workbench")
        self._update_state()
        if self._pending_demo_load:
            self._pending_demo_load = False
            self._start_load(facts.path, self.budget_panel.settings())

    @Slot(dict)
    def _on_loaded(self, info: dict) -> None:
        self.loaded_path = info["path"]
        self.model_on_gpu = info.get("on_gpu", False)
        self.graphs.set_cuda_device(info["device"] if self.model_on_gpu else "")
        self.model_panel.show_loaded(info["path"], info["landed"])
        self.setWindowTitle(f"{Path(info['path']).name} — MoE Workbench")
        settings = self._load_settings if self._load_settings else self.budget_panel.settings()
        self.budget_panel.mark_loaded(settings)
        self.save_model_settings(info["path"], settings)
        self.watch.reset()
        self.placement.forget_rate()
        self.chat.entries.clear()  # a load starts a new conversation
        self.worker.requestNewChat.emit(self.chat.system_prompt.toPlainText())  # (after the load: one refused keeps it)
        self.chat.set_reasoning_choices(info.get("reasoning_choices", []))
        for choice in self.reasoning_choices.values():  # their answers take the setting as the chat's do
            choice.set_choices(info.get("reasoning_choices", []))
        self.chat.set_model_sampling(info.get("sampling"))
        self.chat.max_tokens.set_model(info["reasoning_answer_tokens"])
        self.chat.render()
        beams = info.get("beam_search_note")
        for choice in self.answer_choices.values():  # said where Record or the sweep answer as the model's search
            choice.set_beam_search_note(beams or "")
        self.chat.live.setText(f"New conversation with {Path(info['path']).name}."
                               + self.chat.load_hints(info.get("reasons_first", False))
                               + (f" {beams}." if beams else ""))
        self.graphs.add_marker("loaded", "load")
        self.side_by_side.set_loaded(info["path"], info.get("entries"), settings)
        for view in (self.side_by_side, self.scenarios, self.contention_view):
            view.max_tokens.set_model(info["reasoning_answer_tokens"])
        self.sweep.set_model(info["reasoning_answer_tokens"])
        demo = "  ·  demo model: RANDOM weights, its text is meaningless" if info.get("is_demo") else ""
        self.status_model.setText(f"{Path(info['path']).name} loaded in {duration_text(info['load_s'])}{demo}")
        self.status_device.setText(f"experts: {info['device']} · dense part: {info.get('dense_device', 'CPU')}")
        self._update_state()

    @Slot(str, str, int)
    def _on_streamed(self, reasoning: str, text: str, tokens: int) -> None:
        self.chat.append_text(text, tokens, reasoning)
        self.graphs.count_tokens(tokens)

    @Slot(dict)
    def _on_answered(self, result: dict) -> None:
        self._chat_waiting = None
        self.chat.finish_answer(result)
        t = result.get("timings") or {}
        if t:
            self.status_state.setText(answered_text(t, stopped=result.get("finish_reason") == "cancelled"))
        elif result.get("began") is False:
            self._stopping = None
            self.status_state.setText("Stopped the answer before it began.")
        self._update_state()

    @Slot(object)
    def _on_stats(self, data: dict) -> None:
        self.placement.set_stats(data)
        self.budget_panel.set_live_pinned(data.get("pinned"))
        self.budget_panel.set_live_arena_over_tier(data.get("arena_over_tier"))
        self.budget_panel.set_live_slots(data["slots"], data.get("left_to_copies") or [])
        self.graphs.set_simulated_memory(data.get("device_memory"))
        self.budget_panel.set_own_vram(data.get("own_device_bytes", 0))
        if data.get("cpu_expert_rate"):
            self.watch.add(data["cpu_expert_rate"])
        threads = (data.get("copies") or {}).get("cpu_threads") or {}
        # the automatic count left other processes cores (engine/kernel_threads.py): the kernels' rate falls with it
        self.threads_given_way = bool(threads.get("cpu_threads_automatic")
                                      and threads["cpu_threads_in_force"] < threads["cores"])

    @Slot(dict)
    def _on_replanned(self, info: dict) -> None:
        # the CPU's share of the experts changed, and with it its calls' size and their bytes a second (a call's fixed
        # cost weighs more on fewer experts): measured against the old plan's level, that read as contention
        self.watch.reset()
        self.placement.forget_rate()
        self.model_panel.show_landed(info["landed"])
        if "settings" in info:  # what the model runs with from now on; a refused Apply leaves the old in force
            self._load_settings = info["settings"]
            self.save_model_settings(self.loaded_path, info["settings"])
        if self.facts is not None and same_folder(self.facts.path, self.loaded_path):  # not another folder's budgets
            self.budget_panel.mark_loaded(self._load_settings or self.budget_panel.settings())
        self.status_state.setText(info.get("by_engine") or "Re-planned without reloading")
        if info.get("by_engine"):
            self.graphs.add_marker("whole layers" if "whole layers" in info["by_engine"] else "spread", "event")
        if "entries" in info:
            self.side_by_side.set_loaded(self.loaded_path, info["entries"], info.get("settings"))

    @Slot()
    def _on_unloaded(self) -> None:
        self.loaded_path = None
        self.model_on_gpu = False
        self.model_panel.show_unloaded()
        self.setWindowTitle(f"{self.facts.name} — MoE Workbench" if self.facts is not None else "MoE Workbench")
        self.budget_panel.mark_loaded(None)
        self.placement.clear()
        self.graphs.set_simulated_memory(None)
        self.graphs.set_cuda_device("")
        self.side_by_side.set_loaded(None)
        self.sweep.set_model(None)
        self.status_model.setText("No model loaded")
        self.status_device.setText("")
        # (a stopped load's own line comes as the worker goes idle; where Unload stopped it, that line says no model
        # is loaded, and stays: _show_activity)
        if not (self._stopping or self.status_state.text().endswith(NO_MODEL_SAID)):
            self.status_state.setText("Idle")
        self.chat.live.setText("No model loaded: load one to chat.")
        self._update_state()

    @Slot()
    def _on_dropped(self) -> None:
        # the next load runs (minutes on a large model): the model it replaced is gone, its layers and memory with it
        self.placement.clear()
        self.graphs.set_simulated_memory(None)
        self.graphs.set_cuda_device("")

    def show_error(self, message: str) -> None:
        """Any error, the engine's or the window's own, as a message (never a crash)."""
        self._on_failed(message)

    @Slot(str)
    def _on_failed(self, message: str) -> None:
        self._pending_demo_load = False
        self.last_error = message
        self.error_banner.show_message(message)
        self.graphs.add_marker("error", "error")

    @Slot(dict)
    def _on_sample(self, sample: dict) -> None:
        self.graphs.add_sample(sample)
        self.budget_panel.set_gpu(sample.get("gpu"), sample.get("gpu_note", ""))
        warnings = sample_warnings(sample, self.model_on_gpu)
        if self.busy != "generating":
            self.warnings.note(warnings)  # (a competitor busy before an answer is said at the answer's first sample)
            return
        # the CPU's warning still held counts too: the kernels' rate lags the samples (a median of readings, and
        # the automatic thread count coming back a second after a competitor ends)
        held = "cpu" in self.warnings.shown or "steal" in self.warnings.shown
        slow = self.watch.warning(cpu_taken(sample) or held or self.threads_given_way)
        if slow:
            warnings["throughput"] = slow
        self.show_contention(self.warnings.update(warnings))

    def show_contention(self, warnings: list[str]) -> None:
        """The warnings held up while generating (WarningHold); none takes the banner down (it stayed up, saying
        other processes used the cores, until the next answer started)."""
        if not warnings:
            self.contention_banner.hide()
            return
        self.contention_banner.show_message("While generating: " + " ".join(warnings))

    # --- state -------------------------------------------------------------------------------------
    def _update_state(self) -> None:
        loaded = self.loaded_path is not None
        busy = self._busy_with()
        chat_waits = self._chat_waiting is not None
        self.model_panel.set_state(busy, loaded)
        self.chat.set_state(busy=bool(busy), loaded=loaded, answering=busy == "generating" or chat_waits)
        for action in (self.open_action, self.demo_action):
            action.setEnabled(not busy)
        self._update_recent()
        self.load_action.setEnabled(self._can_load())
        self.model_panel.load_button.setEnabled(self._can_load())  # (the panel knows nothing of the estimate)
        self.unload_action.setEnabled(loaded or busy in ("loading", "generating", *JOB_LABELS))
        what = STOPPABLE["generating"] if chat_waits else STOPPABLE.get(busy)
        if what is None:
            what = STOPPABLE.get(self._waiting)
        self.stop_action.setEnabled(what is not None)
        self.stop_action.setText(f"&Stop {what}" if what else "&Stop")
        self.stop_action.setToolTip(f"Stop {what}" if what else STOP_TIP)
        for view in self.job_views.values():
            view.set_state(busy, loaded)
        self.budget_panel.set_busy(bool(busy))
        self._update_chat_actions()

    def _update_chat_actions(self) -> None:
        """The Chat menu's actions on where what they do on the tab shown can be done, as the buttons that do it say:
        Send and Regenerate answer both sides on the Side by side tab (_answer)."""
        on_side = self.tabs.currentWidget() is self.side_by_side_page
        answer_both = self.side_by_side.bar.run_button.isEnabled()
        self.send_action.setEnabled(answer_both if on_side else self.chat.send_button.isEnabled())
        self.regenerate_action.setEnabled(answer_both if on_side else self.chat.regenerate_button.isEnabled())
        self.new_chat_action.setEnabled(self.chat.new_button.isEnabled())
        self.copy_action.setEnabled(self.chat.copy_button.isEnabled())

    def _can_load(self) -> bool:
        """Whether Load may start: idle, with a model shown that the kernels run (a load of one they cannot would drop
        the loaded model, then fail), and, while a model is loaded, with settings the estimate does not refuse (its
        plan fails after the loaded model went: a pinned ring below one expert, a substitution rank past top-k)."""
        refused = self.loaded_path is not None and bool(getattr(self.budget_panel.last_estimate, "error", ""))
        return not (self._busy_with() or refused) and self.facts is not None and self.facts.supported

    def _busy_with(self) -> str:
        """What the window is busy with: the worker's activity, or the load or records job it has not begun yet, or
        the chat's message whose answer it has not begun (a load or an open sent now would wait behind that answer,
        as behind one that runs, and Stop would stop the answer, not them)."""
        return self.busy or self._waiting or ("generating" if self._chat_waiting is not None else "")

    def _show_activity(self, stopped: str | None) -> None:
        """The status bar as the worker's activity changes: what runs now; once idle, what Stop stopped (`stopped`,
        where the status bar still says it is stopping it) or Ready in place of what ran (an answer's own line, an
        error's, a re-plan's stay)."""
        labels = {"opening": "Opening…", "loading": "Loading…", "preparing": "Preparing the CPU kernels…",
                  "generating": "Generating…", "replanning": "Re-planning…", **JOB_LABELS}
        if self.busy:
            self.status_state.setText(labels.get(self.busy, self.busy))
        elif stopped and self.status_state.text().startswith(f"Stopping {stopped}"):
            # the Unload that stopped it leaves no model loaded: the one the load kept goes next (_on_unloaded)
            unloading, self._unload_stops = stopped == self._unload_stops, None
            self.status_state.setText(f"Stopped {stopped}{NO_MODEL_SAID if unloading else '.'}")
        elif self.status_state.text() in (*labels.values(), self._load_note):
            self.status_state.setText("Ready" if self.loaded_path is not None else "Idle")

    def changeEvent(self, event) -> None:
        super().changeEvent(event)
        if event.type() == QEvent.Type.WindowStateChange and not self.isMinimized():
            self.graphs.catch_up()  # (restored: the graphs drew nothing while it was minimised)
        if event.type() == QEvent.Type.ActivationChange:  # back from an editor: the popularity file may have changed
            self.budget_panel.update_apply()

    def closeEvent(self, event) -> None:
        if not self._closed:
            self._closed = True
            self.save_settings()
            self._sampler_thread.stop()
            self.engine_stopped = self._worker_thread.stop()
            self.collector.stop()
        super().closeEvent(event)
