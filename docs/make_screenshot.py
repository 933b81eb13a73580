"""Screenshot of the window with a model loaded and three answers shown: docs/window.png.

    xvfb-run -s "-screen 0 1920x1200x24" .venv/bin/python docs/make_screenshot.py [--theme dark|light] [--out PATH]

It writes a random-weight model (16 expert layers, 32 experts each, top-4) into a temporary folder,
loads it on a simulated 96 MiB GPU (the model is small) whose expert budget holds 40% of the experts, asks three
questions, lets the graphs gather a few samples and grabs the window. The text the model writes is
meaningless: its weights are random (the window says so).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
LOAD_S = 1800.0  # the most a load may take, a first run's compile of its CPU kernels included


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--theme", default="dark", choices=["dark", "light", "system"])
    parser.add_argument("--out", default=str(REPO / "docs" / "window.png"))
    parser.add_argument("--size", default="1680x1020")
    args = parser.parse_args()

    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    app = QApplication(sys.argv)
    app.setApplicationName("MoE Workbench")
    app.setDesktopFileName("moe-workbench")

    from app.gui.main_window import MainWindow, app_icon
    from engine.writer import WriterSpec, write_model

    app.setWindowIcon(app_icon())
    tmp = Path(tempfile.mkdtemp(prefix="moe-workbench-shot-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # the written model and settings
    spec = WriterSpec(layers=16, hidden_size=256, num_experts=32, top_k=4, inter_size=256, num_heads=8, num_kv_heads=2,
                      head_size=32, vocab_size=1024, context_length=8192, sliding_window=128, seed=7,
                      description="random weights, for the screenshot")
    model = write_model(tmp / "moe-16x32-random", spec)

    settings = QSettings(str(tmp / "settings.ini"), QSettings.Format.IniFormat)
    settings.setValue("view/theme", args.theme)
    window = MainWindow(settings=settings, sample_interval_ms=1000, demo_dir=str(tmp / "demo"))
    width, height = (int(v) for v in args.size.split("x"))
    window.resize(width, height)
    window.show()
    wait(lambda: window.graphs.sample_count >= 25, 40)  # some history in the graphs first

    from engine.model_folder import ModelFolder

    expert_bytes = ModelFolder.open(model).expert_bytes
    window.save_model_settings(str(model), {
        "device": {"kind": "simulated", "capacity": 96 << 20},
        "entries": {"device_expert_bytes": str(int(expert_bytes * 0.4)), "placement": "adaptive"},
        "kv_tokens": 8192})
    problem = load(window, model)
    if problem:
        return failed(window, tmp, problem)
    window.chat.system_prompt.setPlainText("You are a concise assistant.")
    window.chat.new_chat()
    for question, tokens in (("What is a mixture-of-experts model?", 48),
                             ("Why do some experts stay on the GPU and others on the CPU?", 120),
                             ("How much VRAM would the KV cache take at 8k tokens?", 80)):
        window.chat.max_tokens.setValue(tokens)
        window.chat.prompt.setPlainText(question)
        window.chat.send()
        if not wait(lambda: not window.busy and bool(window.chat.entries and window.chat.entries[-1].get("stats"))):
            return failed(window, tmp, f"no answer: {window.last_error or window.status_state.text()}")
    samples = window.graphs.sample_count
    wait(lambda: window.graphs.sample_count >= samples + 3, 10)
    window.chat.prompt.setPlainText("")
    window.grab().save(args.out)
    print(args.out)
    window.close()
    return 0


def wait(condition, timeout: float = 300.0) -> bool:
    """Run the event loop until condition() holds. (QEventLoop.exec releases the GIL while idle, as
    app.exec() does; QTest.qWait does not, and the engine's worker thread would starve.)"""
    from PySide6.QtCore import QEventLoop, QTimer

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        loop = QEventLoop()
        QTimer.singleShot(50, loop.quit)
        loop.exec()
        if condition():
            return True
    return False


def load(window, model: Path, timeout: float = LOAD_S) -> str:
    """Load `model` in the window and wait until its CPU kernels are ready; '' once they are, else why not: the
    window's error, or what it still did after `timeout` (a machine's first run compiles the kernels after the load,
    "Preparing the CPU kernels…": minutes where the cores are few or busy)."""
    window.last_error = ""  # (an earlier one is not this load's)
    window.load_model(str(model))

    def loaded() -> bool:
        return window.loaded_path is not None and Path(window.loaded_path).resolve() == Path(model).resolve()

    if not wait(lambda: not window.busy and (loaded() or bool(window.last_error)), timeout):
        return f"the model did not load in {timeout:.0f} s: {window.status_state.text()}"
    return "" if loaded() else f"the model did not load: {window.last_error}"


def failed(window, tmp: Path, reason: str) -> int:
    """Say why, and close the window, whose engine thread may still be inside a compile that nothing interrupts: as
    app/gui/main.py, exit without destroying its QThread (Python's exit would, which aborts the process), the written
    model removed first (os._exit runs no atexit)."""
    print(reason, file=sys.stderr)
    window.close()
    if not window.engine_stopped:
        shutil.rmtree(tmp, ignore_errors=True)
        sys.stderr.flush()
        os._exit(1)
    return 1


if __name__ == "__main__":
    sys.exit(main())
