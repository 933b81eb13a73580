"""The history of saved runs: a filterable table (model, scenario, label), one run opened in detail,
two runs compared side by side, the filtered table exported as JSON, CSV or Markdown."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QAbstractItemView, QComboBox, QDialog, QDialogButtonBox, QFileDialog, QHBoxLayout,
                               QHeaderView, QLabel, QLineEdit, QPushButton, QTableWidget, QTableWidgetItem,
                               QTextBrowser, QVBoxLayout, QWidget)

from app.gui.record_report import compare_html, detail_html, fmt, title
from engine.errors import not_written, one_line
from engine.records.history import History, budget_text, default_path, device_text
from engine.records.schema import RecordError
from engine.records.scenarios import SCENARIOS
from engine.records.side_by_side import SCENARIO as SIDE_BY_SIDE, SCENARIO_AT_ONCE as SIDE_BY_SIDE_AT_ONCE
from engine.units import counted

HEADERS = ("id", "created", "scenario", "label", "model", "device", "budget", "routing", "load", "first token",
           "decode", "completion", "tokens", "device peak", "process RSS peak")
FIRST_NUMBER = HEADERS.index("load")  # the columns from here on are numbers, right-aligned
DEVICE = HEADERS.index("device")
RSS = HEADERS.index("process RSS peak")
RSS_TIP = ("The resident memory of the process that ran it, at its peak during the run: every model loaded in it. A "
           "side-by-side run's holds both sides' models (\"A and B loaded\").")
BOTH_LOADED = " (A and B loaded)"
EXPORTS = {"json": "JSON (*.json)", "csv": "CSV (*.csv)", "markdown": "Markdown (*.md)"}
SUFFIX = {"json": ".json", "csv": ".csv", "markdown": ".md"}


def _routing(row: dict) -> str:
    """Exact routing, or approximate with the run's token agreement with exact routing (what it cost in answers)."""
    if not row["approximate_routing"]:
        return "exact"
    agreement = row["routing_agreement"]
    return "approximate" if agreement is None else f"approximate, {agreement:.0%} agreement"


def _local_time(created: str | None) -> str:
    """A record's time (ISO 8601, UTC) in the machine's time zone, as the user reads a clock."""
    try:
        return datetime.fromisoformat(created).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except (TypeError, ValueError):
        return created or ""


def _cells(row: dict) -> list[str]:
    return [str(row["id"]), _local_time(row["created"]), row["scenario"] or "", row["label"] or "",
            Path(row["model"] or "").name, device_text(row), budget_text(row) or "—", _routing(row),
            fmt(row["load_s"], "s"), fmt(row["ttft_s"], "s"), fmt(row["decode_tokens_per_s"], "tok/s"),
            fmt(row["completion_s"], "s"), fmt(row["generated_tokens"], "n"), fmt(row["peak_device_bytes"], "bytes"),
            fmt(row["peak_rss_bytes"], "bytes") + (BOTH_LOADED if row["other_side_loaded"] else "")]


class RecordDialog(QDialog):
    """A non-modal window of HTML: a run's detail or a comparison."""

    def __init__(self, heading: str, body: str, parent=None):
        super().__init__(parent)
        self.setWindowTitle(heading)
        self.browser = QTextBrowser()
        self.browser.setHtml(body)
        self.browser.setAccessibleName(heading)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.close)
        layout = QVBoxLayout(self)
        layout.addWidget(self.browser)
        layout.addWidget(buttons)
        self.resize(760, 640)

    def text(self) -> str:
        return self.browser.toPlainText()


class HistoryView(QWidget):
    failed = Signal(str)

    def __init__(self, history_path: str | Path | None = None, parent=None):
        super().__init__(parent)
        self.history_path = history_path
        self._history: History | None = None
        self.dialogs: list[RecordDialog] = []
        self.model_filter = QLineEdit(placeholderText="model folder contains…", clearButtonEnabled=True)
        self.scenario_filter = QComboBox()
        self.scenario_filter.addItem("any scenario", "")
        for name in (*SCENARIOS, SIDE_BY_SIDE, SIDE_BY_SIDE_AT_ONCE):
            self.scenario_filter.addItem(name, name)
        self.label_filter = QLineEdit(placeholderText="label contains…", clearButtonEnabled=True)
        for widget, name in ((self.model_filter, "Filter by model"), (self.scenario_filter, "Filter by scenario"),
                             (self.label_filter, "Filter by label")):
            widget.setAccessibleName(name)
        self.table = QTableWidget(0, len(HEADERS))
        self.table.setHorizontalHeaderLabels(HEADERS)
        self.table.horizontalHeaderItem(RSS).setToolTip(RSS_TIP)
        self.table.setAccessibleName("Saved runs")
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().hide()
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.open_button = QPushButton("Open")
        self.compare_button = QPushButton("Compare two")
        self.export_button = QPushButton("Export…")
        self.refresh_button = QPushButton("Refresh")
        self.count = QLabel()
        self.open_button.setToolTip("The selected run in detail (or double-click a row)")
        self.compare_button.setToolTip("Select two runs (Ctrl+click) to compare them metric by metric")
        self.export_button.setToolTip("The runs the filters show, as JSON (full records), CSV or Markdown")

        filters = QHBoxLayout()
        filters.addWidget(self.model_filter, 2)
        filters.addWidget(self.scenario_filter, 1)
        filters.addWidget(self.label_filter, 2)
        buttons = QHBoxLayout()
        for button in (self.open_button, self.compare_button, self.export_button, self.refresh_button):
            buttons.addWidget(button)
        buttons.addWidget(self.count, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(filters)
        layout.addWidget(self.table, 1)
        layout.addLayout(buttons)

        self.model_filter.textChanged.connect(self.refresh)
        self.label_filter.textChanged.connect(self.refresh)
        self.scenario_filter.currentIndexChanged.connect(self.refresh)
        self.table.itemSelectionChanged.connect(self._selection_changed)
        self.table.doubleClicked.connect(lambda _index: self.open_selected())
        self.open_button.clicked.connect(self.open_selected)
        self.compare_button.clicked.connect(self.compare_selected)
        self.export_button.clicked.connect(lambda: self.export())
        self.refresh_button.clicked.connect(self.refresh)
        self.refresh()

    @property
    def history(self) -> History:
        if self._history is None:
            self._history = History(self.history_path)
        return self._history

    def filters(self) -> dict:
        return {"model": self.model_filter.text().strip() or None, "scenario": self.scenario_filter.currentData() or None,
                "label": self.label_filter.text().strip() or None}

    def refresh(self) -> None:
        path = Path(self.history_path) if self.history_path else default_path()
        try:
            rows = self.history.rows(**self.filters()) if path.is_file() else []  # nothing saved yet: no file made
        except Exception as exc:  # a damaged or locked history file is a message, not a crash
            said = one_line(exc)  # History's own errors name the file: named once
            self.failed.emit(f"Could not read the history{'' if str(path) in said else f' {path}'}: {said}")
            rows = []
        selected = set(self.selected_ids())
        self.table.setRowCount(len(rows))
        for r, row in enumerate(rows):
            for c, text in enumerate(_cells(row)):
                item = QTableWidgetItem(text)
                item.setData(Qt.ItemDataRole.UserRole, row["id"])
                if c >= FIRST_NUMBER:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                elif c == DEVICE and row["device_fallback"]:  # the short form's reason whole (the run's detail too)
                    item.setToolTip(row["device_fallback"])
                self.table.setItem(r, c, item)
        for r, row in enumerate(rows):
            if row["id"] in selected:
                self.table.selectRow(r)
        self.count.setText(f"{len(rows)} run{'' if len(rows) == 1 else 's'}")
        self._selection_changed()

    def ids(self) -> list[int]:
        return [self.table.item(r, 0).data(Qt.ItemDataRole.UserRole) for r in range(self.table.rowCount())]

    def selected_ids(self) -> list[int]:
        rows = sorted({index.row() for index in self.table.selectionModel().selectedRows()})
        return [self.table.item(r, 0).data(Qt.ItemDataRole.UserRole) for r in rows]

    def select_ids(self, ids: list[int]) -> None:
        self.table.clearSelection()
        mode = self.table.selectionMode()
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.MultiSelection)
        for r, run_id in enumerate(self.ids()):
            if run_id in ids:
                self.table.selectRow(r)
        self.table.setSelectionMode(mode)

    def _selection_changed(self) -> None:
        count = len(self.selected_ids())
        self.open_button.setEnabled(count == 1)
        self.compare_button.setEnabled(count == 2)
        self.export_button.setEnabled(self.table.rowCount() > 0)

    def _show(self, heading: str, body: str) -> RecordDialog:
        dialog = RecordDialog(heading, body, self)
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dialog.destroyed.connect(lambda _o=None, d=dialog: self.dialogs.remove(d) if d in self.dialogs else None)
        self.dialogs.append(dialog)
        dialog.show()
        return dialog

    def open_selected(self) -> RecordDialog | None:
        ids = self.selected_ids()
        if len(ids) != 1:
            return None
        try:
            record = self.history.get(ids[0])
        except Exception as exc:
            self.failed.emit(self._unread(exc, f"run {ids[0]}"))
            return None
        return self._show(title(record, ids[0]), detail_html(record, ids[0]))

    @staticmethod
    def _unread(exc: Exception, what: str) -> str:
        """What a run's record that could not be read says: History.get's errors name the run and the file."""
        if isinstance(exc, KeyError):  # removed (another window, a tool) since the table was read
            return f"Could not read {exc.args[0]} (removed since the list was read: Refresh lists what is there)"
        return f"Could not read {exc}" if isinstance(exc, RecordError) else f"Could not read {what}: {one_line(exc)}"

    def compare_selected(self) -> RecordDialog | None:
        ids = self.selected_ids()
        if len(ids) != 2:
            return None
        a_id, b_id = sorted(ids)  # the older run is A
        try:
            a, b = self.history.get(a_id), self.history.get(b_id)
        except Exception as exc:
            self.failed.emit(self._unread(exc, "the runs"))
            return None
        return self._show(f"Run {a_id} (A) and run {b_id} (B)", compare_html(a, b, (a_id, b_id)))

    def export(self, path: str | None = None, fmt_name: str | None = None) -> Path | None:
        """Write the filtered runs; without a path, a file dialog asks (its file type picks the format)."""
        if path is None:
            start = str(Path.home() / "moe-workbench-runs.md")
            path, chosen = QFileDialog.getSaveFileName(self, "Export the runs shown", start, ";;".join(EXPORTS.values()),
                                                       EXPORTS["markdown"])
            if not path:
                return None
            fmt_name = next((key for key, text in EXPORTS.items() if text == chosen), None)
        if fmt_name is None:
            suffix = Path(path).suffix.lower()
            fmt_name = next((key for key, s in SUFFIX.items() if s == suffix), "markdown")
        target = Path(path)
        if not target.suffix:
            target = target.with_suffix(SUFFIX[fmt_name])
        unreadable: list[str] = []
        try:
            text = self.history.export(fmt_name, unreadable, **self.filters())
            target.write_bytes(text.encode("utf-8"))  # as is: CSV keeps \r\n
        except OSError as exc:
            self.failed.emit(f"Could not export to {target}: {not_written(exc, target)}")
            return None
        except Exception as exc:  # History's own errors name its file
            self.failed.emit(f"Could not export to {target}: {one_line(exc)}")
            return None
        self.count.setText(f"{counted(self.table.rowCount(), 'run')} · exported to {target.name}")
        if unreadable:
            self.failed.emit(f"Exported to {target.name} without {counted(len(unreadable), 'unreadable run')}: {unreadable[0]}"
                             + (" …" if len(unreadable) > 1 else ""))
        return target
