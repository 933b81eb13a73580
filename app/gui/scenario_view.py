"""Measured scenario runs from the window: short / long / multiturn / all on the loaded model, through
the engine worker, with progress and Cancel; every finished run becomes a record in the history."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QLineEdit, QVBoxLayout, QWidget

from app.gui.job_bar import JobBar
from app.gui.records_jobs import ScenarioJob, ScenarioResult, scenario_names
from app.gui.widgets import AnswerLength, AnswersChoice, ReasoningChoice
from engine.records.lengths import SCENARIO_TOKENS
from engine.records.scenarios import SCENARIOS

KIND = "recording"


class ScenarioView(QWidget):
    jobRequested = Signal(str, object)     # kind, job (the window sends it to the engine worker)
    cancelRequested = Signal()
    recorded = Signal(list)                # history ids saved
    failed = Signal(str)

    def __init__(self, history_path=None, parent=None):
        super().__init__(parent)
        self.history_path = str(history_path) if history_path else None
        self.result: ScenarioResult | None = None
        self.scenario = QComboBox()
        for name in (*SCENARIOS, "all"):
            self.scenario.addItem(name)
        self.scenario.setAccessibleName("Scenario")
        self.scenario.setToolTip("short: one question · long: a ~2000-token input · multiturn: six turns, cache kept · "
                                 "all: the three in turn")
        self.max_tokens = AnswerLength(SCENARIO_TOKENS, note=". The long scenario needs its input (2000 "
                                       "tokens or a few more) + a length you set within the model's context; the "
                                       "model's own there is what the context leaves after that input")
        self.max_tokens.setAccessibleName("Answer tokens")
        self.answers = AnswersChoice()
        self.reasoning = ReasoningChoice()
        self.label = QLineEdit(placeholderText="label (optional)")
        self.label.setAccessibleName("Label for the runs")
        self.bar = JobBar("Record", "Stop at the next token; a cancelled run is not saved")
        row = QHBoxLayout()
        row.addWidget(QLabel("Scenario"))
        row.addWidget(self.scenario)
        row.addWidget(QLabel("tokens"))
        row.addWidget(self.max_tokens)
        row.addWidget(self.answers)
        row.addWidget(self.reasoning)
        row.addWidget(self.label, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(row)
        layout.addWidget(self.answers.note)
        layout.addWidget(self.bar)
        self.bar.runRequested.connect(self.run)
        self.bar.cancelRequested.connect(self.cancelRequested)
        self.bar.status.setText("Runs measured scenarios on the loaded model and saves each to the history.")

    def set_state(self, busy: str, loaded: bool) -> None:
        self.bar.set_state(bool(busy), loaded)

    def run(self) -> None:
        names = scenario_names(self.scenario.currentText())
        job = ScenarioJob(names, self.max_tokens.chosen, self.history_path, self.label.text().strip(),
                          reasoning=self.reasoning.currentData(), **self.answers.job_settings())
        self.result = None
        self.bar.start(f"Starting {', '.join(names)}…")
        self.jobRequested.emit(KIND, job)

    # --- from the worker (routed by the window) ------------------------------------------------------
    def on_progress(self, fraction: float, text: str) -> None:
        self.bar.set_progress(fraction, text)

    def on_finished(self, result: ScenarioResult) -> None:
        self.result = result
        ids = [run_id for run_id, _record in result.saved]
        parts = [f"Saved run{'' if len(ids) == 1 else 's'} {', '.join(map(str, ids))}." if ids else "Nothing saved."]
        if result.failure:
            parts.insert(0, f"Failed during {result.failure} (not saved).")
            self.failed.emit(f"Failed during {result.failure}")
        elif result.cancelled is not None:
            parts.insert(0, f"Cancelled during {result.cancelled.scenario} (not saved).")
        elif result.cancelled_before and not ids:
            parts = ["Cancelled before the first run began; nothing saved."]
        elif result.cancelled_before:
            parts.insert(0, f"Cancelled before {result.cancelled_before} began (not run).")
        if result.errors:
            parts.append("Skipped " + "; ".join(result.errors))
            self.failed.emit("Scenario skipped: " + "; ".join(result.errors))
        self.bar.finish(" ".join(parts))
        if ids:
            self.recorded.emit(ids)

    def on_failed(self, message: str) -> None:
        self.bar.finish(f"Failed: {message}")
