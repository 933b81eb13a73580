"""The contention test in the window: document indexing (worker processes into SQLite FTS5) alone,
inference alone, then both at once; each one's completion time and slowdown, saved as Markdown."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QComboBox, QFileDialog, QGridLayout, QHBoxLayout, QHeaderView, QLabel, QLineEdit,
                               QPushButton, QSpinBox, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from app.gui.job_bar import JobBar
from app.gui.records_jobs import ContentionJob, ContentionResult
from app.gui.widgets import AnswerLength, ReasoningChoice
from engine.errors import not_written
from engine.records.contention import MAX_WORKERS, RATIO_HEADER, STAND_IN, ContentionReport, phase_after, ratio_words
from engine.records.lengths import SCENARIO_TOKENS
from engine.records.scenarios import SCENARIOS
from engine.units import duration_text

KIND = "contention"


class ContentionView(QWidget):
    jobRequested = Signal(str, object)
    cancelRequested = Signal()
    failed = Signal(str)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.result: ContentionResult | None = None
        self.corpus = QLineEdit(placeholderText="folder of .txt files (empty: a generated corpus, ~20 MB, made once)")
        self.corpus.setAccessibleName("Corpus folder")
        self.browse = QPushButton("Browse…")
        self.workers = QSpinBox(minimum=1, maximum=MAX_WORKERS, value=2)
        self.workers.setAccessibleName("Indexing worker processes")
        self.scenario = QComboBox()
        for name in SCENARIOS:
            self.scenario.addItem(name)
        self.scenario.setAccessibleName("Inference scenario")
        self.max_tokens = AnswerLength(SCENARIO_TOKENS, note=". The test answers three times: a warm-up, alone, "
                                       "beside the indexing")
        self.max_tokens.setAccessibleName("Answer tokens")
        self.max_tokens.setSuffix(" tokens")
        self.reasoning = ReasoningChoice()
        self.bar = JobBar("Run the test", "Cancel takes effect between the five phases, the two warm-ups among them "
                          "(an answer stops at its next token)")
        note = QLabel("Cancel takes effect between phases: indexing that has started runs to its end.")
        note.setWordWrap(True)
        self.table = QTableWidget(2, 4)
        self.table.setHorizontalHeaderLabels(("workload", "alone", "together", RATIO_HEADER))
        self.table.setAccessibleName("Contention results")
        self.table.verticalHeader().hide()
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.table.setMaximumHeight(110)
        self.save_button = QPushButton("Save report…")
        self.save_button.setEnabled(False)

        form = QGridLayout()
        corpus_row = QHBoxLayout()
        corpus_row.addWidget(self.corpus, 1)
        corpus_row.addWidget(self.browse)
        form.addWidget(QLabel("Corpus"), 0, 0)
        form.addLayout(corpus_row, 0, 1, 1, 3)
        form.addWidget(QLabel("Workers"), 1, 0)
        form.addWidget(self.workers, 1, 1)
        form.addWidget(QLabel("Inference"), 1, 2)
        inference = QHBoxLayout()
        inference.addWidget(self.scenario)
        inference.addWidget(self.max_tokens)
        inference.addWidget(self.reasoning)
        form.addLayout(inference, 1, 3)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(form)
        layout.addWidget(note)
        layout.addWidget(self.bar)
        layout.addWidget(self.table)
        layout.addWidget(self.save_button)
        layout.addStretch(1)
        self.bar.runRequested.connect(self.run)
        self.bar.cancelRequested.connect(self.cancelRequested)
        self.browse.clicked.connect(self._browse)
        self.save_button.clicked.connect(lambda: self.save())

    def set_state(self, busy: str, loaded: bool) -> None:
        self.bar.set_state(bool(busy), loaded)

    def _browse(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "A folder of .txt files to index", self.corpus.text())
        if path:
            self.corpus.setText(path)

    def run(self) -> None:
        job = ContentionJob(self.corpus.text().strip() or None, self.workers.value(), self.scenario.currentText(),
                            self.max_tokens.chosen, self.reasoning.currentData())
        self.result = None
        self.save_button.setEnabled(False)
        self.table.clearContents()
        self.bar.start("Preparing the corpus…" if job.corpus is None else phase_after(0.0).capitalize() + "…")
        self.jobRequested.emit(KIND, job)

    def on_progress(self, fraction: float, text: str) -> None:
        self.bar.set_progress(fraction, text[:1].upper() + text[1:] + ("…" if fraction < 1 else ""))

    def on_finished(self, result: ContentionResult) -> None:
        self.result = result
        report = result.report
        if result.cancelled or report is None:
            self.bar.finish("Cancelled between phases: no report.")
            return
        for r, (name, alone, together, slowdown) in enumerate(report.rows()):
            for c, text in enumerate((name, duration_text(alone), duration_text(together), ratio_words(slowdown))):
                self.table.setItem(r, c, QTableWidgetItem(text))
        self.save_button.setEnabled(True)
        shares = report.others_share or {}
        beside = (f" Other processes took {shares['indexing_alone']:.0%} and {shares['inference_alone']:.0%} of the "
                  "CPUs' time while each ran alone." if shares else "")
        # (a slowdown below 1: faster together, which "0.93× slower" misread)
        cpu = f" {report.device_fallback}" if report.device_fallback else ""  # (the CUDA GPU asked for, unusable)
        # (on the simulated card, a slowdown read as the card's where it is the CPU's)
        stand_in = f" {STAND_IN}" if report.simulated else ""
        self.bar.finish(f"Done: together, the indexing took {report.indexing_slowdown:.2f}× its time alone and the "
                        f"inference {report.inference_slowdown:.2f}×." + threads_words(report) + beside + cpu
                        + stand_in)

    def on_failed(self, message: str) -> None:
        self.bar.finish(f"Failed: {message}")

    def save(self, path: str | None = None) -> Path | None:
        if self.result is None or self.result.report is None:
            return None
        if path is None:
            path, _ = QFileDialog.getSaveFileName(self, "Save the contention report",
                                                  str(Path.home() / "contention.md"), "Markdown (*.md)")
            if not path:
                return None
        target = Path(path)
        try:
            target.write_text(self.result.report.markdown(), encoding="utf-8")
        except OSError as exc:
            self.failed.emit(f"Could not save the report to {target}: {not_written(exc, target)}")
            return None
        self.bar.status.setText(f"Report saved to {target}.")
        return target


def threads_words(report: ContentionReport) -> str:
    """' CPU expert kernels: 2 of 2 threads alone, 1 beside the indexing (cpu_threads automatic).', as the report
    says it; '' where the counts were not read."""
    alone, together = report.threads_alone, report.threads_together
    if not alone or not together:
        return ""
    return (f" CPU expert kernels: {alone['cpu_threads_in_force']} of {alone['cores']} threads alone, "
            f"{together['cpu_threads_in_force']} beside the indexing"
            + (" (cpu_threads automatic)." if together["cpu_threads_automatic"] else "."))
