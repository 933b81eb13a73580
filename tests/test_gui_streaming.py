"""Streamed answers shown at a pace the window keeps (app/gui/stream_pacing.py): the batches that come before a
showing go in together, and nothing streamed is lost, or shown twice, as the stream ends, is stopped or fails."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

pytest.importorskip("pytestqt")

from app.gui.stream_pacing import INTERVAL_MS, LOAD, Pacer  # noqa: E402

LONG_LINE = [" a long line", " that never", " breaks"]  # one paragraph: Qt lays it out whole at each insertion


def test_a_pacer_shows_what_came_once_and_waits_longer_after_a_costly_showing(qtbot):
    from PySide6.QtCore import QObject

    shown, cost, owner = [], [0.0], QObject()
    pacer = Pacer(lambda: (shown.append(1), time.sleep(cost[0])), owner)
    for _ in range(3):
        pacer.schedule()
    assert shown == []
    qtbot.waitUntil(lambda: shown == [1], timeout=2000)
    qtbot.wait(3 * INTERVAL_MS)
    assert shown == [1]  # once for the three
    cost[0] = 0.02
    pacer.schedule()
    pacer.flush()  # at once, and the showing took 20 ms
    assert shown == [1, 1] and not pacer.timer.isActive()
    assert pacer.timer.interval() >= LOAD * 20
    pacer.schedule()
    pacer.cancel()  # what came is drawn otherwise: not shown by the pacer, and the next stream starts afresh
    qtbot.wait(3 * INTERVAL_MS)
    assert shown == [1, 1] and pacer.timer.interval() == INTERVAL_MS


def test_a_side_by_side_column_inserts_the_batches_that_come_before_it_shows_them_at_once(qtbot):
    from app.gui.side_by_side_view import Column

    column = Column("A")
    qtbot.addWidget(column)
    insertions = []
    column.answer.document().contentsChange.connect(lambda at, removed, added: insertions.append(added))
    for batch in LONG_LINE:
        column.append(batch, 1)
    assert insertions == [] and column.answer.toPlainText() == ""
    assert column.values["tokens"].text() == "3 …"
    qtbot.waitUntil(lambda: bool(insertions), timeout=2000)
    qtbot.wait(3 * INTERVAL_MS)
    assert insertions == [len("".join(LONG_LINE))]  # one insertion for the three
    assert column.answer.toPlainText() == column.text == "".join(LONG_LINE)


def _view(qtbot):
    from app.gui.side_by_side_view import SideBySideView

    view = SideBySideView()
    qtbot.addWidget(view)
    for side in (0, 1):
        view.on_streamed({"side": side, "text": "Hello", "tokens": 1})
        view.on_streamed({"side": side, "text": " there", "tokens": 1, "reasoning": ""})
    return view


def test_a_failed_comparison_shows_what_both_sides_streamed_at_once(qtbot):
    view = _view(qtbot)
    view.on_failed("the device went away")
    assert [column.answer.toPlainText() for column in (view.left, view.right)] == ["Hello there"] * 2


def test_a_comparison_that_ends_or_is_stopped_shows_its_answers_once(qtbot):
    """The end draws each column whole: the batches it had not shown yet are not inserted again after it."""
    from app.gui.records_jobs import SideBySideResult

    view = _view(qtbot)
    pieces = [["Hello", " there", "!"], ["Hello", " there"]]  # what streamed, and a last batch the end brought
    view.on_finished(SideBySideResult(None, pieces, cancelled=True))
    view.right.append(" again", 1)
    view.right.show_result(["Hello", " there", " again"], 2, {"tokens": "3"})  # the end of one that answered
    qtbot.wait(3 * INTERVAL_MS)
    assert [column.answer.toPlainText() for column in (view.left, view.right)] == ["Hello there!", "Hello there again"]


def test_a_column_shows_nothing_of_a_stream_it_failed_or_cleared(qtbot):
    view = _view(qtbot)
    view.left.show_failure("out of memory")
    view.right.clear()
    qtbot.wait(3 * INTERVAL_MS)
    assert view.left.answer.toPlainText() == "No answer: out of memory" and view.right.answer.toPlainText() == ""


def _chat(qtbot):
    from app.gui.chat_panel import ChatPanel

    chat = ChatPanel()
    qtbot.addWidget(chat)
    chat.set_state(busy=False, loaded=True)
    chat.prompt.setPlainText("Tell me")
    chat.send()
    return chat


def test_the_chat_inserts_the_batches_that_come_before_it_shows_them_at_once(qtbot):
    chat = _chat(qtbot)
    chat.append_text(LONG_LINE[0])  # the answer's first text draws it
    insertions = []
    chat.transcript.document().contentsChange.connect(lambda at, removed, added: insertions.append(added))
    for batch in LONG_LINE[1:]:
        chat.append_text(batch)
    assert insertions == [] and chat.live.text().startswith("Generating… 3 tokens")
    qtbot.waitUntil(lambda: bool(insertions), timeout=2000)
    qtbot.wait(3 * INTERVAL_MS)
    assert len(insertions) == 1  # one insertion for the two
    assert chat.transcript.toPlainText().endswith("".join(LONG_LINE).strip())


@pytest.mark.parametrize("finish_reason", ["eos", "cancelled", "error"])
def test_an_answer_that_ends_is_stopped_or_fails_shows_what_streamed_once(qtbot, finish_reason):
    """The end draws the transcript whole: the batches not shown yet are not inserted again after it. A failed answer
    keeps what it streamed; one that ends has its whole text."""
    chat = _chat(qtbot)
    for batch in LONG_LINE:
        chat.append_text(batch)
    text = "".join(LONG_LINE)
    result = {"text": "" if finish_reason == "error" else text, "finish_reason": finish_reason, "timings": {},
              "error": "boom"}
    chat.finish_answer(result)
    qtbot.wait(3 * INTERVAL_MS)
    assert chat.entries[-1]["text"] == text and chat.transcript.toPlainText().count(text.strip()) == 1


def test_side_by_side_says_the_tokens_each_side_streamed_against_the_length_not_a_share_of_it(qtbot):
    """A reasoning model's length (2,048 here) is where its answer must stop, not where it ends: the run line and both
    columns say the tokens so far against it, with the same counts, and the bar shows the answering as busy; it read
    (0.5 + 0.5 · 225 / 2,048), 55%, while the answers may have been nearly done."""
    import threading

    from app.gui.records_jobs import JobContext, _SideStreams
    from app.gui.side_by_side_view import SideBySideView, side_stats

    view = SideBySideView()
    qtbot.addWidget(view)
    ctx = JobContext(None, None, {}, threading.Event(), view.on_progress, view.on_streamed, None)
    view.bar.start("Loading B…")
    view.on_progress(0.25, "loading the right side")  # B's load can tell how far it is
    assert (view.bar.progress.maximum(), view.bar.progress.value()) == (1000, 250)
    streams = _SideStreams(ctx, 2048, (True, True))
    for side, count in ((0, 412), (1, 38)):
        for _ in range(count):
            streams.on_text(side, None, "ab"[side])
    streams.flush()
    assert view.bar.status.text() == "answering · A: 412, B: 38 tokens (at most 2,048 each)"
    assert view.bar.progress.minimum() == view.bar.progress.maximum() == 0  # busy, no share
    assert [column.values["tokens"].text() for column in (view.left, view.right)] == [
        "412 (at most 2,048) …", "38 (at most 2,048) …"]
    timings = {"time_to_first_token_s": 0.1, "decode_tokens_per_s": 9.0, "total_s": 140.0}
    record = SimpleNamespace(turns=[{"timings": timings, "generated_tokens": 1234}], approximate_routing=False)
    assert side_stats(record)["tokens"] == "1,234"  # the count the column ends on, written as it streamed
    view.bar.start("Loading B…")  # the next comparison's load shows its share again
    assert view.bar.progress.maximum() == 1000
    alone = _SideStreams(ctx, 64, (True, False))  # B could not load: A answers alone, and the line says A's alone
    alone.on_text(0, None, "a")
    alone.flush()
    assert view.bar.status.text() == "answering · A: 1 token (at most 64)"
