"""A minimal window: open a model (or the demo), see where it runs, chat with it."""

from __future__ import annotations

from PySide6.QtCore import Qt, Slot
from PySide6.QtGui import QFont, QKeySequence, QShortcut
from PySide6.QtWidgets import (QFileDialog, QHBoxLayout, QLabel, QLineEdit, QMainWindow,
                               QPlainTextEdit, QProgressBar, QPushButton, QSplitter, QVBoxLayout, QWidget)

from app.gui.engine_worker import WorkerThread


class MainWindow(QMainWindow):
    def __init__(self):
        super().__init__()
        self.setWindowTitle("MoE Workbench")
        self.resize(1100, 720)
        self._worker_thread = WorkerThread()
        self.worker = self._worker_thread.worker

        self.model_label = QLabel("No model loaded")
        self.open_button = QPushButton("Open model folder…")
        self.demo_button = QPushButton("Demo model")
        self.progress = QProgressBar()
        self.progress.setRange(0, 100)
        self.progress.setVisible(False)
        top = QHBoxLayout()
        top.addWidget(self.model_label, 1)
        top.addWidget(self.progress)
        top.addWidget(self.open_button)
        top.addWidget(self.demo_button)

        mono = QFont("monospace")
        mono.setStyleHint(QFont.StyleHint.Monospace)
        self.inspection = QPlainTextEdit(readOnly=True)
        self.inspection.setFont(mono)
        self.inspection.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.inspection.setPlaceholderText("The inspection of the model's expert layers appears here.")
        self.transcript = QPlainTextEdit(readOnly=True)
        self.transcript.setPlaceholderText("Load a model, then type a message below.")
        self.prompt = QLineEdit(placeholderText="Message (Enter to send)")
        self.send_button = QPushButton("Send")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        self.stats = QLabel("")
        chat_row = QHBoxLayout()
        chat_row.addWidget(self.prompt, 1)
        chat_row.addWidget(self.send_button)
        chat_row.addWidget(self.stop_button)
        chat = QWidget()
        chat_layout = QVBoxLayout(chat)
        chat_layout.addWidget(self.transcript, 1)
        chat_layout.addWidget(self.stats)
        chat_layout.addLayout(chat_row)
        splitter = QSplitter(Qt.Orientation.Horizontal)
        splitter.addWidget(self.inspection)
        splitter.addWidget(chat)
        splitter.setSizes([450, 650])

        # Errors show here, not in a modal box: the window stays usable.
        self.error_banner = QLabel(wordWrap=True)
        self.error_banner.setStyleSheet("QLabel { background: #b3261e; color: white; padding: 6px; border-radius: 4px; }")
        self.error_banner.setVisible(False)

        central = QWidget()
        layout = QVBoxLayout(central)
        layout.addLayout(top)
        layout.addWidget(self.error_banner)
        layout.addWidget(splitter, 1)
        self.setCentralWidget(central)

        self.open_button.clicked.connect(self.choose_model)
        self.demo_button.clicked.connect(self.load_demo)
        self.send_button.clicked.connect(self.send)
        self.prompt.returnPressed.connect(self.send)
        self.stop_button.clicked.connect(self.worker.cancel.set)
        QShortcut(QKeySequence("Ctrl+O"), self, self.choose_model)
        QShortcut(QKeySequence("Escape"), self, self.worker.cancel.set)
        self.worker.loadProgress.connect(lambda f: self.progress.setValue(int(f * 100)))
        self.worker.loaded.connect(self._on_loaded)
        self.worker.token.connect(self._on_token)
        self.worker.answered.connect(self._on_answered)
        self.worker.failed.connect(self._on_failed)
        self.worker.busyChanged.connect(self._on_busy)
        self.last_error = ""

    # --- actions --------------------------------------------------------------------------------
    @Slot()
    def choose_model(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Open a model folder (genai_config.json, model.onnx)")
        if path:
            self.load_model(path)

    @Slot()
    def load_demo(self) -> None:
        from engine.demo_model import ensure_demo_model

        try:
            path = ensure_demo_model()
        except Exception as exc:
            self._on_failed(f"Could not write the demo model: {exc}")
            return
        self.load_model(str(path))

    def load_model(self, path: str) -> None:
        self.error_banner.setVisible(False)
        self.model_label.setText(f"Loading {path} …")
        self.progress.setValue(0)
        self.progress.setVisible(True)
        self.worker.requestLoad.emit(path)

    @Slot()
    def send(self) -> None:
        text = self.prompt.text().strip()
        if not text:
            return
        self.prompt.clear()
        self.transcript.appendPlainText(f"\nYou: {text}\nModel: ")
        self.worker.requestSend.emit(text, {"max_new_tokens": 128})

    # --- engine signals -------------------------------------------------------------------------
    @Slot(dict)
    def _on_loaded(self, info: dict) -> None:
        self.progress.setVisible(False)
        from engine.demo_model import DEMO_NAME

        note = "  — the demo model: RANDOM weights, its text is meaningless" if info["model"].rstrip("/").endswith(DEMO_NAME) else ""
        self.model_label.setText(f"{info['model']}  (loaded in {info['load_s']:.2f} s; experts on the CPU){note}")
        self.inspection.setPlainText(info["summary"])

    @Slot(str)
    def _on_token(self, delta: str) -> None:
        cursor = self.transcript.textCursor()
        cursor.movePosition(cursor.MoveOperation.End)
        cursor.insertText(delta)
        self.transcript.setTextCursor(cursor)

    @Slot(dict)
    def _on_answered(self, result: dict) -> None:
        t = result["timings"]
        self.stats.setText(f"first token {t['time_to_first_token_s'] * 1000:.0f} ms · {t['decode_tokens_per_s']:.1f} tok/s · "
                           f"{t['total_s']:.2f} s · {t['generated_tokens']} tokens · {result['finish_reason']}")

    @Slot(str)
    def _on_failed(self, message: str) -> None:
        self.last_error = message
        self.progress.setVisible(False)
        if self.model_label.text().startswith("Loading"):
            self.model_label.setText("No model loaded")
        self.error_banner.setText(message)
        self.error_banner.setVisible(True)

    @Slot(bool)
    def _on_busy(self, busy: bool) -> None:
        for widget in (self.open_button, self.demo_button, self.send_button):
            widget.setEnabled(not busy)
        self.stop_button.setEnabled(busy)

    def closeEvent(self, event) -> None:
        self._worker_thread.stop()
        super().closeEvent(event)
