"""The model panel: open a folder (dialog, recent, drag and drop, the demo), see its expert layers and
the admission verdict before loading, load with progress, then read where everything landed."""

from __future__ import annotations

import html
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QFont
from PySide6.QtWidgets import (QAbstractItemView, QFrame, QHBoxLayout, QHeaderView, QLabel, QMenu, QProgressBar,
                               QPushButton, QScrollArea, QSizePolicy, QSplitter, QTableWidget, QTableWidgetItem,
                               QToolButton, QVBoxLayout, QWidget)

from app.gui import theme
from app.gui.widgets import heading
from app.inspect_report import NO_EXPERT_NODES, per_expert
from engine.units import counted, human_bytes

COLUMNS = ("Layer", "Experts", "Top-k", "Per expert", "Total", "Verdict", "Layout")


def not_loaded_text(loaded_path: str | None) -> str:
    """The model shown is not loaded; another one may be, and the chat, placement view and Unload act on that one."""
    if not loaded_path:
        return "Not loaded."
    name = html.escape(Path(loaded_path).name)
    return (f"Not loaded. <b>{name}</b> is the loaded model: the chat, the placement view and Unload act on it. "
            "Load to switch to this one.")


def _item(text: str, tooltip: str = "", align_right: bool = False) -> QTableWidgetItem:
    item = QTableWidgetItem(text)
    item.setFlags(Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable)
    if tooltip:
        item.setToolTip(tooltip)
    if align_right:
        item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
    return item


class ModelPanel(QWidget):
    openRequested = Signal()
    recentChosen = Signal(str)
    demoRequested = Signal()
    loadRequested = Signal()
    unloadRequested = Signal()
    stopRequested = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("modelPanel")
        self.facts = None
        self.loaded_path: str | None = None
        self._landed_lines: list[str] = []  # where the loaded model landed, shown while it is the model shown

        self.title = QLabel("No model")
        font = QFont(self.title.font())
        font.setPointSizeF(font.pointSizeF() * 1.25)
        font.setBold(True)
        self.title.setFont(font)
        self.title.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.badge = QLabel()
        self.badge.hide()
        self.path_label = QLabel("Open a model folder (Ctrl+O), drop one on the window, or try the demo model (Ctrl+D).")
        self.path_label.setWordWrap(True)
        self.path_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        self.open_button = QPushButton("Open…")
        self.open_button.setToolTip("Open a model folder (genai_config.json + model.onnx)  Ctrl+O")
        self.recent_button = QToolButton(text="Recent")
        self.recent_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        self.recent_menu = QMenu(self.recent_button)
        self.recent_button.setMenu(self.recent_menu)
        self.recent_button.setAccessibleName("Recent models")
        self.demo_button = QPushButton("Demo model")
        self.demo_button.setToolTip("Write (first time) and load the embedded random-weight demo model  Ctrl+D")
        self.load_button = QPushButton("Load")
        self.load_button.setDefault(True)
        self.load_button.setToolTip("Load with the budget panel's settings  Ctrl+L")
        self.unload_button = QPushButton("Unload")
        self.unload_button.setToolTip("Stop what runs and free the model  Ctrl+U")
        buttons = QHBoxLayout()
        for widget in (self.open_button, self.recent_button, self.demo_button):
            buttons.addWidget(widget)
        buttons.addStretch(1)
        buttons.addWidget(self.load_button)
        buttons.addWidget(self.unload_button)

        self.progress = QProgressBar()
        self.progress.setRange(0, 100)
        self.progress.setFormat("Loading %p%")
        self.progress.setAccessibleName("Load progress")
        self.progress.hide()
        self.cancel_button = QPushButton("Stop")
        self.cancel_button.setToolTip("Stop the load")
        self.cancel_button.hide()
        progress_row = QHBoxLayout()
        progress_row.addWidget(self.progress, 1)
        progress_row.addWidget(self.cancel_button)

        self.summary = QLabel()
        self.summary.setWordWrap(True)
        self.verdict = QLabel()
        self.verdict.setWordWrap(True)
        self.verdict.setTextFormat(Qt.TextFormat.RichText)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().hide()
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setAlternatingRowColors(True)
        self.table.setAccessibleName("Expert layers")
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.setWordWrap(False)  # the layout column stays whole: one line, the table scrolls sideways
        self.table.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.table.setMinimumHeight(70)

        self.landed = QLabel("Not loaded.")
        self.landed.setWordWrap(True)
        self.landed.setTextFormat(Qt.TextFormat.RichText)
        self.landed.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.landed.setAccessibleName("Where everything landed")

        title_row = QHBoxLayout()
        title_row.addWidget(self.title)
        title_row.addWidget(self.badge)
        title_row.addStretch(1)
        layout = QVBoxLayout(self)
        layout.addLayout(title_row)
        layout.addWidget(self.path_label)
        layout.addLayout(buttons)
        layout.addLayout(progress_row)
        layout.addWidget(self.summary)
        layout.addWidget(self.verdict)
        landed_box = QWidget()
        landed_layout = QVBoxLayout(landed_box)
        landed_layout.setContentsMargins(0, 4, 0, 0)
        landed_layout.addWidget(heading("Where everything landed"))
        landed_layout.addWidget(self.landed)
        landed_layout.addStretch(1)
        landed_scroll = QScrollArea()
        landed_scroll.setWidgetResizable(True)
        landed_scroll.setFrameShape(QFrame.Shape.NoFrame)
        landed_scroll.setWidget(landed_box)
        self.splitter = QSplitter(Qt.Orientation.Vertical)
        self.splitter.addWidget(self.table)
        self.splitter.addWidget(landed_scroll)
        self.splitter.setChildrenCollapsible(False)
        self.splitter.setSizes([170, 200])
        layout.addWidget(self.splitter, 1)

        self.open_button.clicked.connect(self.openRequested)
        self.demo_button.clicked.connect(self.demoRequested)
        self.load_button.clicked.connect(self.loadRequested)
        self.unload_button.clicked.connect(self.unloadRequested)
        self.cancel_button.clicked.connect(self.stopRequested)
        self.set_state(busy="", loaded=False)

    # --- content ---------------------------------------------------------------------------------
    def set_recent(self, paths: list[str]) -> None:
        self.recent_menu.clear()
        for path in paths:
            action = self.recent_menu.addAction(path)
            action.triggered.connect(lambda _checked=False, p=path: self.recentChosen.emit(p))
        self.recent_button.setEnabled(bool(paths))

    def show_facts(self, facts) -> None:
        self.facts = facts
        t = theme.current()
        self.title.setText(facts.name)
        self.path_label.setText(facts.path)
        if facts.is_demo:
            self.badge.setText("RANDOM WEIGHTS — its text is meaningless")
            self.badge.setStyleSheet(f"QLabel {{ color: white; background: {t.warn}; border-radius: 4px; padding: 1px 6px; }}")
            self.badge.show()
        else:
            self.badge.hide()
        report = facts.report
        self.summary.setText(
            f"{report['type']} · context {facts.context_length} tokens · experts {human_bytes(facts.expert_bytes)} in "
            f"{counted(len(report['expert_nodes']), 'layer')} · dense part {human_bytes(facts.dense_bytes)} in "
            f"{facts.dense_segments} onnxruntime segments · KV cache {human_bytes(facts.kv_cache_bytes())} at "
            f"{facts.longest_sequence_words}")
        nodes = report["expert_nodes"]
        self.table.setRowCount(len(nodes))
        for row, node in enumerate(nodes):
            tooltip = node["node"] + ("" if node["supported"] else f"\nUnsupported: {node['reason']}")
            self.table.setItem(row, 0, _item(str(node["model_layer"]), tooltip, True))
            self.table.setItem(row, 1, _item(str(node["experts"] or "?"), tooltip, True))
            self.table.setItem(row, 2, _item(str(node["top_k"] or "?"), tooltip, True))
            self.table.setItem(row, 3, _item(per_expert(node), tooltip, True))
            self.table.setItem(row, 4, _item(human_bytes(node["bytes"]), tooltip, True))
            self.table.setItem(row, 5, _item("…" if node["supported"] else "unsupported", tooltip))
            self.table.setItem(row, 6, _item(node["layout"] or f"UNSUPPORTED: {node['reason']}", tooltip))
        if self.loaded_path != facts.path:
            self.landed.setText(not_loaded_text(self.loaded_path))
        else:
            self.show_landed(self._landed_lines)
        self._name_unload()

    def _name_unload(self) -> None:
        """Unload acts on the loaded model, which is not always the one shown: its tooltip names it."""
        name = Path(self.loaded_path).name if self.loaded_path else "the model"
        self.unload_button.setToolTip(f"Stop what runs and free {name}  Ctrl+U")

    def show_loaded(self, path: str, landed: list[str]) -> None:
        self.loaded_path = path
        self.show_landed(landed)
        self._name_unload()

    def show_unloaded(self) -> None:
        self.loaded_path = None
        self.landed.setText(not_loaded_text(None))
        self._name_unload()

    def show_estimate(self, estimate, mode: str, device_label: str) -> None:
        """The admission verdict for the chosen mode and device, per layer and overall."""
        if self.facts is None:
            return
        t = theme.current()
        by_name = {name: (resident, experts) for _l, name, resident, experts in estimate.per_layer}
        for row, node in enumerate(self.facts.report["expert_nodes"]):
            item = self.table.item(row, 5)
            if item is None:
                continue
            if not node["supported"]:
                item.setText("unsupported")
                item.setForeground(Qt.GlobalColor.red)
                continue
            resident, experts = by_name.get(node["node"], (0, node["experts"] or 0))
            if estimate.error:  # the load refuses it in any mode (a CUDA GPU it cannot use is no error: all CPU)
                item.setText("refused")
            elif resident == experts and experts:
                item.setText(f"all {experts} on device")
            elif resident:
                item.setText(f"{resident}/{experts} on device")
            else:
                item.setText("CPU")
        supported = self.facts.supported
        where = f"mode <b>{html.escape(mode)}</b>, {html.escape(device_label)}"
        if estimate.error:
            colour, verdict = t.error, f"Refused ({where}): {html.escape(estimate.error)}"
        elif not supported:
            why = self.facts.report["verdict"].removeprefix("cannot run: ")  # (the inspection's own words)
            colour, verdict = t.error, f"Cannot run ({where}): {html.escape(why)}"
        else:
            total = estimate.total_experts
            if not self.facts.report["expert_nodes"]:
                placement = NO_EXPERT_NODES
            elif estimate.resident >= total > 0:
                placement = f"all {total} experts resident on the device"
            elif estimate.resident:
                # slots: adaptive placement may leave some to copied misses once loaded (the placement view tells)
                placement = (f"{counted(estimate.resident, 'expert slot')} on the device for the {total} experts, "
                             "the rest on the CPU")
            else:
                placement = "every expert runs on the CPU"
            colour, verdict = t.tokens, f"Runs ({where}): {placement}."
        self.verdict.setText(f"<span style='color:{colour}'>●</span> {verdict}")

    def show_landed(self, lines: list[str]) -> None:
        self._landed_lines = lines
        if self.facts is not None and self.facts.path != self.loaded_path:  # another folder shown: its line stays
            return
        items = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
        self.landed.setText(f"<ul style='margin-left:-20px'>{items}</ul>")

    # --- state -----------------------------------------------------------------------------------
    def set_progress(self, fraction: float) -> None:
        self.progress.setValue(int(round(fraction * 100)))

    def set_state(self, busy: str, loaded: bool) -> None:
        idle = not busy
        loading = busy == "loading"
        self.open_button.setEnabled(idle)
        self.recent_button.setEnabled(idle and bool(self.recent_menu.actions()))
        self.demo_button.setEnabled(idle)
        self.load_button.setEnabled(idle and self.facts is not None and self.facts.supported)
        self.load_button.setText("Reload" if loaded and self.facts is not None and self.loaded_path == self.facts.path else "Load")
        self.unload_button.setEnabled(loaded or busy in ("loading", "generating"))
        self.progress.setVisible(loading)
        self.cancel_button.setVisible(loading)
        if loading and self.progress.value() == 100:
            self.progress.setValue(0)
