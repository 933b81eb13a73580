"""The minimal window against the real engine (offscreen): load, chat, errors, stop."""

from __future__ import annotations

import pytest

pytest.importorskip("pytestqt")

from app.gui.main_window import MainWindow  # noqa: E402
from tests.conftest import fixture_folder  # noqa: E402


@pytest.fixture
def window(qtbot):
    win = MainWindow()
    qtbot.addWidget(win)
    win.show()
    yield win
    win.close()


def load(qtbot, window, path):
    """Load through the worker and wait until the window has handled the outcome.

    (The worker emits from its own thread, so a blocker on its signal can wake before the
    window's queued slots have run: wait on what the window shows instead.)"""
    window.load_model(str(path))
    qtbot.waitUntil(lambda: window.open_button.isEnabled() and not window.model_label.text().startswith("Loading"),
                    timeout=120000)


def test_load_and_chat_streams_an_answer(qtbot, window):
    progress = []
    window.worker.loadProgress.connect(progress.append)
    load(qtbot, window, fixture_folder("gptoss"))
    assert "loaded in" in window.model_label.text()
    assert "runs: all 2 expert nodes" in window.inspection.toPlainText()
    assert progress and progress[-1] == pytest.approx(1.0)
    tokens = []
    window.worker.token.connect(tokens.append)
    window.prompt.setText("Hello")
    with qtbot.waitSignal(window.worker.answered, timeout=120000) as answered:
        window.send()
    assert answered.args[0]["timings"]["generated_tokens"] >= 1
    qtbot.waitUntil(lambda: "tok/s" in window.stats.text())
    assert "".join(tokens) in window.transcript.toPlainText()


def test_corrupt_model_shows_a_message_and_window_stays_usable(qtbot, window, copy_fixture):
    broken = copy_fixture("gptoss")
    (broken / "model.onnx").write_bytes(b"not a model")
    load(qtbot, window, broken)
    assert window.error_banner.isVisible()
    assert "not a valid ONNX model" in window.error_banner.text()
    load(qtbot, window, fixture_folder("lfm2moe"))
    assert not window.error_banner.isVisible() and "loaded in" in window.model_label.text()


def test_stop_mid_answer(qtbot, window):
    load(qtbot, window, fixture_folder("gptoss"))
    window.worker.token.connect(lambda _delta: window.stop_button.click())
    window.prompt.setText("Tell a long story")
    with qtbot.waitSignal(window.worker.answered, timeout=120000) as answered:
        window.worker.requestSend.emit("Tell a long story", {"max_new_tokens": 200})
    assert answered.args[0]["finish_reason"] == "cancelled"
    assert answered.args[0]["timings"]["generated_tokens"] < 200
