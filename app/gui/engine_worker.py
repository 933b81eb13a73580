"""The engine's single worker thread: load, generate and unload never overlap and never block the UI.

Every request is a queued signal into the worker; every result and error comes back as a signal.
An engine error becomes a message, never a crash.
"""

from __future__ import annotations

import threading

from PySide6.QtCore import QObject, QThread, Signal, Slot

from engine.errors import WorkbenchError


def _one_line(exc: Exception) -> str:
    if isinstance(exc, WorkbenchError):
        return str(exc)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


class EngineWorker(QObject):
    loadProgress = Signal(float)
    loaded = Signal(dict)           # {"model": path, "load_s": ..., "summary": text}
    token = Signal(str)
    answered = Signal(dict)         # text, finish_reason, timings
    failed = Signal(str)            # one line for the user
    busyChanged = Signal(bool)

    # Requests (queued into the worker thread)
    requestLoad = Signal(str)
    requestSend = Signal(str, dict)
    requestUnload = Signal()

    def __init__(self):
        super().__init__()
        self._model = None
        self._conversation = None
        self.cancel = threading.Event()
        self.requestLoad.connect(self._load)
        self.requestSend.connect(self._send)
        self.requestUnload.connect(self._unload)

    @Slot(str)
    def _load(self, path: str) -> None:
        from app.inspect_report import format_inspection, inspection
        from engine.generation import Conversation, LoadedModel
        from engine.model_folder import ModelFolder

        self.busyChanged.emit(True)
        try:
            self._unload()
            folder = ModelFolder.open(path)
            summary = format_inspection(inspection(folder))
            self._model = LoadedModel(folder, progress=self.loadProgress.emit)
            self._conversation = Conversation(self._model)
            self.loaded.emit({"model": path, "load_s": self._model.load_s, "summary": summary})
        except Exception as exc:  # the window shows it; the worker stays usable
            self._model = None
            self.failed.emit(f"Could not load {path}: {_one_line(exc)}")
        finally:
            self.busyChanged.emit(False)

    @Slot(str, dict)
    def _send(self, text: str, options: dict) -> None:
        from engine.generation import GenerationParams

        if self._conversation is None:
            self.failed.emit("No model is loaded.")
            return
        self.cancel.clear()
        self.busyChanged.emit(True)
        try:
            params = GenerationParams(max_new_tokens=int(options.get("max_new_tokens", 128)))
            result = self._conversation.send(text, params, lambda _t, delta: self.token.emit(delta), self.cancel)
            self.answered.emit({"text": result.text, "finish_reason": result.finish_reason,
                                "timings": result.timings.as_dict()})
        except Exception as exc:
            self.failed.emit(_one_line(exc))
        finally:
            self.busyChanged.emit(False)

    @Slot()
    def _unload(self) -> None:
        self._conversation = None
        self._model = None


class WorkerThread:
    """Owns the QThread the worker lives in."""

    def __init__(self):
        self.thread = QThread()
        self.thread.setObjectName("engine")
        self.worker = EngineWorker()
        self.worker.moveToThread(self.thread)
        self.thread.start()

    def stop(self) -> None:
        self.worker.cancel.set()
        self.thread.quit()
        self.thread.wait(10000)
