"""A record view's run line: Run, Cancel, a progress bar and one line of what is happening (ending in an ellipsis
where the window is too narrow for it, the whole line in its tooltip, as the chat's status line)."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QHBoxLayout, QProgressBar, QPushButton, QWidget

from app.gui.widgets import OneLineLabel

STEPS = 1000


class JobBar(QWidget):
    runRequested = Signal()
    cancelRequested = Signal()

    def __init__(self, run_text: str = "Run", cancel_tip: str = "Stop at the next token", parent=None):
        super().__init__(parent)
        self.running = False
        self.run_button = QPushButton(run_text)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setToolTip(cancel_tip)
        self.cancel_button.setAccessibleDescription(cancel_tip)
        self.progress = QProgressBar()
        self.progress.setRange(0, STEPS)
        self.progress.setTextVisible(False)
        self.progress.setMaximumHeight(12)
        self.status = OneLineLabel()
        self.status.setAccessibleName("Status")
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.run_button)
        row.addWidget(self.cancel_button)
        row.addWidget(self.progress, 1)
        row.addWidget(self.status, 2)
        self.run_button.clicked.connect(self.runRequested)
        self.cancel_button.clicked.connect(self._cancel)
        self.progress.hide()
        self.set_state(busy=False, can_run=False)

    def _cancel(self) -> None:
        if self.running:
            self.status.setText("Cancelling…")
            self.cancelRequested.emit()

    def set_state(self, busy: bool, can_run: bool) -> None:
        """busy: the engine worker runs something (this job or another)."""
        self.run_button.setEnabled(can_run and not busy)
        self.cancel_button.setEnabled(self.running)

    def start(self, text: str) -> None:
        self.running = True
        self.progress.setRange(0, STEPS)
        self.progress.setValue(0)
        self.progress.show()
        self.status.setText(text)
        self.cancel_button.setEnabled(True)
        self.run_button.setEnabled(False)

    def set_progress(self, fraction: float | None, text: str = "") -> None:
        """fraction None: the job cannot tell how far it is (an answer ends where the model ends it), which the bar
        shows as busy rather than as a share."""
        if fraction is None:
            self.progress.setRange(0, 0)
        else:
            self.progress.setRange(0, STEPS)
            self.progress.setValue(round(max(0.0, min(1.0, fraction)) * STEPS))
        if text and self.status.text() != "Cancelling…":
            self.status.setText(text)

    def finish(self, text: str) -> None:
        self.running = False
        self.progress.hide()
        self.status.setText(text)
        self.cancel_button.setEnabled(False)
