"""Streamed answers shown at a pace the window keeps (app/gui/stream_pacing.py): the batches that come before a
showing go in together, and nothing streamed is lost, or shown twice, as the stream ends, is stopped or fails."""

from __future__ import annotations

import re
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
        column.append(batch)
    assert insertions == [] and column.answer.toPlainText() == ""
    qtbot.waitUntil(lambda: bool(insertions), timeout=2000)
    qtbot.wait(3 * INTERVAL_MS)
    assert insertions == [len("".join(LONG_LINE))]  # one insertion for the three
    assert column.answer.toPlainText() == column.text == "".join(LONG_LINE)


def _view(qtbot):
    from app.gui.side_by_side_view import SideBySideView

    view = SideBySideView()
    qtbot.addWidget(view)
    for side in (0, 1):
        view.on_streamed({"side": side, "text": "Hello", "reasoning": "", "status": "answering: 1 (at most 8)",
                          "state": "answering", "tokens": 1})
        view.on_streamed({"side": side, "text": " there", "reasoning": "", "status": "answering: 2 (at most 8)",
                          "state": "answering", "tokens": 2})
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
    view.right.append(" again")
    view.right.show_result(["Hello", " there", " again"], 2, {"tokens": "3"})  # the end of one that answered
    qtbot.wait(3 * INTERVAL_MS)
    assert [column.answer.toPlainText() for column in (view.left, view.right)] == ["Hello there!", "Hello there again"]


def test_a_column_shows_nothing_of_a_stream_it_failed_or_cleared(qtbot):
    view = _view(qtbot)
    view.left.show_failure("out of memory")
    view.right.clear()
    qtbot.wait(3 * INTERVAL_MS)
    assert view.left.answer.toPlainText() == "No answer: out of memory" and view.right.answer.toPlainText() == ""


def _chat(qtbot, message: str = "Tell me"):
    from app.gui.chat_panel import ChatPanel

    chat = ChatPanel()
    qtbot.addWidget(chat)
    chat.set_state(busy=False, loaded=True)
    chat.prompt.setPlainText(message)
    chat.send()
    return chat


def test_the_chats_live_counter_says_its_time_and_tokens_as_the_window_says_them(qtbot):
    """The live counter said '1 tokens in 0.3 s' (one decimal, its own format) where the answer's line after it says
    'answered in 250 ms': it counts its tokens and says its time as every time is said (units.duration_text)."""
    chat = _chat(qtbot)
    chat._started = time.monotonic() - 0.25
    chat.append_text(LONG_LINE[0])
    assert re.fullmatch(r"Generating… 1 token in 2[5-9]\d ms", chat.live.text()), chat.live.text()
    chat._started -= 12
    chat.append_text(LONG_LINE[1])
    assert re.fullmatch(r"Generating… 2 tokens in 12\.[2-9]\d s", chat.live.text()), chat.live.text()


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


def test_copy_of_a_last_answer_with_no_text_copies_nothing_and_says_so(qtbot):
    """An answer that ended at once (the model's end of text as its first token) shows nothing: Copy put the answer
    before it on the clipboard and said 'Copied the last answer.'"""
    from PySide6.QtGui import QGuiApplication

    chat = _chat(qtbot)
    chat.entries[-2:] = [{"role": "user", "text": "Hi"}, {"role": "assistant", "text": "Hello!", "stats": "s"},
                         {"role": "user", "text": "Why?"}, {"role": "assistant", "text": "", "stats": "s"}]
    QGuiApplication.clipboard().setText("kept")
    chat.copy_last()
    assert QGuiApplication.clipboard().text() == "kept" and chat.live.text() == "The last answer has no text to copy."


def _side_by_side(qtbot, answering=(True, True), concurrent=False, at_most=2048):
    """A side-by-side view fed by the streams its job feeds, and what its run line and columns say."""
    import threading

    from app.gui.records_jobs import JobContext
    from app.gui.side_by_side_view import SideBySideView
    from app.gui.side_streams import SideStreams

    view = SideBySideView()
    qtbot.addWidget(view)
    ctx = JobContext(None, None, {}, threading.Event(), view.on_progress, view.on_streamed, None)
    view.bar.start("Loading B…")
    streams = SideStreams(ctx, at_most, answering, concurrent, interval_s=3600)  # the test flushes

    def shown():
        return (view.bar.status.text(), *(column.values["tokens"].text() for column in (view.left, view.right)))

    def answer(side, count):
        for _ in range(count):
            streams.on_reasoning(side, None, "")
            streams.on_text(side, None, "ab"[side])

    return view, streams, shown, answer


def test_side_by_side_one_after_the_other_says_that_b_waits_for_a_and_when_a_is_done(qtbot):
    """Concurrent off: B waits while A answers (the line said "B: 0"), then prepares and answers; each side's tokens so
    far are said against the length it answers at most, and the bar shows busy rather than a share of that length (it
    read 0.5 + 0.5 · 225 / 2,048, 55%, while the answers may have been nearly done). A side's end says how it ended and
    its length as its record counts it."""
    view, streams, shown, answer = _side_by_side(qtbot)
    view.on_progress(0.25, "loading the right side")  # B's load can tell how far it is
    assert (view.bar.progress.maximum(), view.bar.progress.value()) == (1000, 250)
    streams.flush()  # the job's start
    assert shown() == ("A preparing its first token · B waiting for A", "preparing its first token", "waiting for A")
    assert view.bar.progress.minimum() == view.bar.progress.maximum() == 0  # busy, no share
    answer(0, 412)
    streams.flush()
    assert shown() == ("A answering: 412 (at most 2,048) · B waiting for A", "answering: 412 (at most 2,048)",
                       "waiting for A")
    streams.on_done(0, "eos", 413)  # its end-of-answer token streamed no text
    assert shown() == ("A done (413 tokens) · B preparing its first token", "done (413 tokens)",
                       "preparing its first token")
    answer(1, 38)
    streams.flush()
    assert shown() == ("A done (413 tokens) · B answering: 38 (at most 2,048)", "done (413 tokens)",
                       "answering: 38 (at most 2,048)")
    answer(1, 2010)
    streams.on_done(1, "length", 2048)
    assert shown() == ("A done (413 tokens) · B stopped at the length (2,048 tokens)", "done (413 tokens)",
                       "stopped at the length (2,048 tokens)")
    assert [column.text for column in (view.left, view.right)] == ["a" * 412, "b" * 2048]
    view.bar.start("Loading B…")  # the next comparison's load shows its share again
    assert view.bar.progress.maximum() == 1000


def test_side_by_side_says_b_prepares_after_a_until_its_first_token_which_it_says_at_once(qtbot):
    """After A's end B warms its model and reads the prompt, seconds for a large one, before its first token: it said
    "answering: 0" all that time. Its first token is said at once, however soon after the last report it comes."""
    view, streams, shown, answer = _side_by_side(qtbot)  # reports at most once an hour, unless the test flushes
    streams.flush()
    answer(0, 3)
    assert shown() == ("A answering: 1 (at most 2,048) · B waiting for A", "answering: 1 (at most 2,048)",
                       "waiting for A")
    streams.on_done(0, "eos", 4)
    assert shown()[1:] == ("done (4 tokens)", "preparing its first token")
    answer(1, 1)
    assert shown() == ("A done (4 tokens) · B answering: 1 (at most 2,048)", "done (4 tokens)",
                       "answering: 1 (at most 2,048)")
    streams.on_done(1, "cancelled", 1)
    assert shown()[2] == "stopped (1 token)"


def test_side_by_side_at_once_says_each_side_answering_and_which_is_done(qtbot):
    view, streams, shown, answer = _side_by_side(qtbot, concurrent=True)
    streams.flush()
    assert shown() == ("A preparing its first token · B preparing its first token", "preparing its first token",
                       "preparing its first token")
    answer(0, 412)
    answer(1, 1)
    streams.flush()
    assert shown() == ("A answering: 412 (at most 2,048) · B answering: 1 (at most 2,048)",
                       "answering: 412 (at most 2,048)", "answering: 1 (at most 2,048)")
    streams.on_done(1, "eos", 2)  # B ends first: A answers on
    answer(0, 2)
    streams.flush()
    assert shown() == ("A answering: 414 (at most 2,048) · B done (2 tokens)", "answering: 414 (at most 2,048)",
                       "done (2 tokens)")
    streams.on_done(0, "cancelled", 414)
    assert shown() == ("A stopped (414 tokens) · B done (2 tokens)", "stopped (414 tokens)", "done (2 tokens)")
    ended = _side_by_side(qtbot, concurrent=True)
    ended[1].flush()
    ended[1].on_done(1, "cancelled", 0)  # stopped before its first token
    assert ended[2]()[2] == "stopped (0 tokens)"


def test_side_by_side_with_b_unable_to_load_says_what_a_does_alone(qtbot):
    view, streams, shown, answer = _side_by_side(qtbot, answering=(True, False), at_most=64)
    streams.flush()
    assert shown() == ("A preparing its first token", "preparing its first token", "—")
    answer(0, 1)
    streams.on_done(0, "error", None)  # it failed: the tokens it streamed
    assert shown() == ("A failed (1 token)", "failed (1 token)", "—")


def test_a_failed_comparison_says_in_each_column_which_side_it_stopped(qtbot):
    """The whole job fails (the bar says "Failed: …"): a side still answering said "answering: 38 (at most 2,048)" as
    if it went on; now it says it stopped, with its tokens, one preparing or waiting that it stopped before its first
    token or never started. A side that had ended keeps its end."""
    view, streams, shown, answer = _side_by_side(qtbot)
    streams.flush()
    answer(0, 412)
    streams.on_done(0, "eos", 413)
    answer(1, 38)
    streams.flush()
    view.on_failed("CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered")
    assert shown() == ("Failed: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered",
                       "done (413 tokens)", "stopped: the comparison failed (38 tokens)")
    assert view.right.answer.toPlainText() == "b" * 38  # what it streamed stays

    view, streams, shown, answer = _side_by_side(qtbot)
    streams.flush()
    answer(0, 1)
    view.on_failed("boom")
    assert shown() == ("Failed: boom", "stopped: the comparison failed (1 token)", "not started: the comparison failed")

    view, streams, shown, answer = _side_by_side(qtbot, concurrent=True)
    streams.flush()
    view.on_failed("boom")
    assert shown()[1:] == ("stopped before its first token: the comparison failed",) * 2

    view, streams, shown, answer = _side_by_side(qtbot)
    view.on_failed("B's model: cannot be read")  # before either side said anything (B's load)
    assert shown() == ("Failed: B's model: cannot be read", "—", "—")


def test_side_by_sides_longest_run_line_ends_in_an_ellipsis_on_a_narrow_window_whole_in_its_tooltip(qtbot):
    """Both sides cut by the length: the run line was cut off mid-word by the window's edge. It ends in an ellipsis
    where the window is narrow (as the chat's status line does) and shows whole where it is wide; the tooltip always
    holds all of it."""
    from PySide6.QtWidgets import QLabel

    view, streams, shown, answer = _side_by_side(qtbot)
    streams.flush()
    for side in (0, 1):
        answer(side, 3)
        streams.on_done(side, "length", 2048)
    line = "A stopped at the length (2,048 tokens) · B stopped at the length (2,048 tokens)"
    view.resize(640, 600)
    view.show()
    qtbot.waitExposed(view)
    qtbot.waitUntil(lambda: QLabel.text(view.bar.status).endswith("…"))
    assert view.bar.status.text() == view.bar.status.toolTip() == line
    assert line.startswith(QLabel.text(view.bar.status)[:-1])
    view.resize(1600, 600)
    qtbot.waitUntil(lambda: QLabel.text(view.bar.status) == line)
    view.on_failed("boom")  # its next line too
    assert view.bar.status.toolTip() == "Failed: boom"


def test_side_by_sides_two_columns_stay_equal_and_still_whatever_their_statuses_titles_and_answers_say(qtbot):
    """A long status (a failure's, a very long one) widened its column while the answers streamed: the columns came
    out unequal and the layout jumped; a long title (B's changed settings) did too. Both columns keep their halves
    of the window; what does not fit ends in an ellipsis, the whole text in the tooltip."""
    from PySide6.QtWidgets import QApplication, QGroupBox, QLabel

    from app.gui.side_by_side_view import SideBySideView
    from app.gui.widgets import scrolled

    view = SideBySideView()
    area = scrolled(view)  # as the window holds it
    qtbot.addWidget(area)
    area.resize(1280, 800)
    area.show()
    qtbot.waitExposed(area)

    def widths():
        for _ in range(3):
            QApplication.processEvents()
        return view.left.width(), view.right.width()

    halves = widths()
    assert abs(halves[0] - halves[1]) <= 1
    status = "stopped before its first token: the comparison failed; " * 8
    view.on_streamed({"side": 0, "text": "", "reasoning": "", "status": status, "state": "preparing", "tokens": 0})
    view.on_streamed({"side": 1, "text": "", "reasoning": "", "status": "waiting for A", "state": "waiting",
                      "tokens": 0})
    assert widths() == halves
    assert view.left.values["tokens"].text() == view.left.values["tokens"].toolTip() == status
    assert QLabel.text(view.left.values["tokens"]).endswith("…")  # shown elided
    assert QLabel.text(view.right.values["tokens"]) == "waiting for A"  # one that fits shows whole

    title = "B: a-model · " + ", ".join(f"setting_{number}=1073741824" for number in range(12))
    view.right.setTitle(title)
    view.left.values["routing"].setText("approximate: 93% agreement with exact routing, " * 6)
    view.right.append("x" * 3000)  # an answer with no place to break
    view.right.flush()
    assert widths() == halves
    assert view.right.title() == view.right.toolTip() == view.right.accessibleName() == title
    assert QGroupBox.title(view.right).endswith("…")
    assert area.horizontalScrollBar().maximum() == 0  # nothing wider than the window
    view.right.setTitle("B: a-model · same settings")  # one that fits shows whole, without a tooltip
    assert widths() == halves
    assert QGroupBox.title(view.right) == "B: a-model · same settings" and view.right.toolTip() == ""


def test_a_side_by_side_column_ends_on_the_tokens_its_record_counts():
    from app.gui.side_by_side_view import side_stats

    timings = {"time_to_first_token_s": 0.1, "decode_tokens_per_s": 9.0}
    record = SimpleNamespace(turns=[{"timings": timings, "generated_tokens": 1234, "finish_reason": "length"}],
                             approximate_routing=False, timings={"completion_s": 140.0}, peaks={"device_bytes": None},
                             offload={})
    assert side_stats(record)["tokens"] == "stopped at the length (1,234 tokens)"


def _run_side_by_side_job(qtbot, monkeypatch, stand_in, quiesce=None, add=None):
    """SideBySideJob run as the worker runs it, into a view, with `stand_in` for compare, B's device waited for with
    `quiesce` and its records saved by `add`; what the run line and columns say and what each column shows then."""
    import threading

    import app.gui.records_jobs as jobs
    from app.gui.records_jobs import JobContext, SideBySideJob
    from app.gui.side_by_side_view import SideBySideView
    from engine.errors import one_line

    view = SideBySideView()
    qtbot.addWidget(view)
    device = SimpleNamespace(quiesce=quiesce or (lambda: None))
    monkeypatch.setattr(jobs.LoadedModel, "open", lambda *args, **kwargs: SimpleNamespace(settled=True, offload=None))
    monkeypatch.setattr(jobs, "compare", stand_in)
    monkeypatch.setattr(jobs, "History", lambda path: SimpleNamespace(add=add or (lambda record: 1)))
    left = SimpleNamespace(folder=SimpleNamespace(folder="/models/a"), offload=None)
    ctx = JobContext(left, None, {}, threading.Event(), view.on_progress, view.on_streamed,
                     lambda choice, config, notes: device)
    view.bar.start("Loading B…")
    try:  # as EngineWorker._job reports it
        view.on_finished(SideBySideJob("Compare", 8, {})(ctx))
    except Exception as exc:
        view.on_failed(one_line(exc))
    return ((view.bar.status.text(), *(column.values["tokens"].text() for column in (view.left, view.right))),
            [column.answer.toPlainText() for column in (view.left, view.right)])


def _streams_three_tokens(side, on_text, on_done=None):
    for delta in ("Hel", "lo", " there"):  # the first goes to the window at once, the others in the next batch
        on_text(side, None, delta)
    if on_done:
        on_done(side, "eos", 3)


def test_a_side_by_side_that_fails_shows_the_last_batch_its_columns_streamed(qtbot, monkeypatch):
    """compare fails mid-answer: the text streamed since the last batch went to the window, and A's tokens, reach the
    column before it says it stopped; nothing shows twice."""
    def fails(left, right, prompt, params, on_text=None, on_done=None, **_):
        _streams_three_tokens(0, on_text)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    shown, answers = _run_side_by_side_job(qtbot, monkeypatch, fails)
    assert shown[1:] == ("stopped: the comparison failed (3 tokens)", "not started: the comparison failed")
    assert answers == ["Hello there", ""]


class _Answered:
    """compare's stand-in: both sides stream their answer and end; a record each."""
    def __call__(self, left, right, prompt, params, on_text=None, on_done=None, **_):
        from engine.records.side_by_side import Comparison

        for side in (0, 1):
            _streams_three_tokens(side, on_text, on_done)
        record = SimpleNamespace(turns=[{"finish_reason": "eos"}])
        return Comparison((record, record), None)


def test_a_side_by_side_stopped_during_a_says_b_never_started(qtbot, monkeypatch):
    """One after the other, Stop during A's answer: B never starts (compare gives it a record without a turn). Its
    column showed "—" and an empty answer, as if B had answered nothing; it says B never started."""
    from engine.records.side_by_side import Comparison

    def stopped_in_a(left, right, prompt, params, on_text=None, on_done=None, **_):
        on_text(0, None, "Hel")
        on_text(0, None, "lo")
        on_done(0, "cancelled", 2)
        on_done(1, "cancelled", 0)  # (compare's end of a side that had not begun)
        timings = {"time_to_first_token_s": 0.1, "decode_tokens_per_s": 9.0}
        a = SimpleNamespace(turns=[{"finish_reason": "cancelled", "generated_tokens": 2, "timings": timings}],
                            approximate_routing=False, timings={"completion_s": 0.3}, peaks={"device_bytes": None},
                            offload={})
        return Comparison((a, SimpleNamespace(turns=[], approximate_routing=False)), None)

    shown, answers = _run_side_by_side_job(qtbot, monkeypatch, stopped_in_a)
    assert shown == ("Cancelled.", "stopped (2 tokens)", "not started")
    assert answers == ["Hello", "Not started: the comparison was stopped before B began."]


def test_a_side_by_side_whose_records_cannot_be_saved_says_so_beside_its_answers(qtbot, monkeypatch):
    import sqlite3

    def locked(record):
        raise sqlite3.OperationalError("database is locked")

    shown, answers = _run_side_by_side_job(qtbot, monkeypatch, _Answered(), add=locked)
    assert shown == ("Failed: saving to the history: OperationalError: database is locked; the answers above were "
                     "not saved", "done (3 tokens)", "done (3 tokens)")
    assert answers == ["Hello there", "Hello there"]
    saved = []

    def once(record):  # A's saved, B's not
        if saved:
            raise sqlite3.OperationalError("disk I/O error")
        saved.append(7)
        return 7

    shown, answers = _run_side_by_side_job(qtbot, monkeypatch, _Answered(), add=once)
    assert shown[0] == ("Failed: saving to the history: OperationalError: disk I/O error; only A's answer was saved, "
                        "as run 7")


def test_a_side_by_side_whose_device_fails_after_the_answers_says_so_and_saves_nothing(qtbot, monkeypatch):
    saved = []

    def quiesce():
        raise RuntimeError("cudaErrorLaunchFailure: unspecified launch failure")

    shown, answers = _run_side_by_side_job(qtbot, monkeypatch, _Answered(), quiesce=quiesce, add=saved.append)
    assert shown[0].startswith("Failed: waiting for B's device: RuntimeError: cudaErrorLaunchFailure: unspecified "
                               "launch failure")
    assert shown[0].endswith("; the answers above were not saved") and saved == []
    assert shown[1:] == ("done (3 tokens)", "done (3 tokens)") and answers == ["Hello there", "Hello there"]


def test_a_side_by_side_whose_margins_failed_shows_both_answers_saved_and_says_why_the_margins_are_missing(qtbot):
    from app.gui.records_jobs import SideBySideResult
    from engine.records.side_by_side import Comparison

    view = _view(qtbot)
    timings = {"time_to_first_token_s": 0.1, "decode_tokens_per_s": 9.0}
    record = SimpleNamespace(turns=[{"timings": timings, "generated_tokens": 2, "finish_reason": "length"}],
                             approximate_routing=False, scenario="side-by-side", offload={},
                             timings={"completion_s": 1.0}, peaks={"device_bytes": None})
    comparison = Comparison((record, record), 0, margins_failure="MemoryError: std::bad_alloc")
    view.on_finished(SideBySideResult(comparison, [["Hello", " there"]] * 2, saved_ids=[3, 4]))
    assert view.divergence.text().startswith(
        "The answers diverge at generated token 1 (index 0), highlighted in both columns. How firmly each side chose "
        "its token there could not be computed: MemoryError: std::bad_alloc. B gave its first token in ")
    assert view.bar.status.text() == "Saved runs 3, 4 to the history."
    assert [column.answer.toPlainText() for column in (view.left, view.right)] == ["Hello there"] * 2


def test_an_answer_keeps_its_indentation_and_runs_of_spaces_once_it_ends_as_it_streamed(qtbot):
    """Code in an answer: the stream inserts it as it is; the end draws the transcript again from HTML, which showed a
    run of spaces as one and none at a line's start, so the indentation that streamed vanished. The message too. A
    \r\n is one line break either way."""
    chat = _chat(qtbot, "fix:\n    x  = 1")
    code = "def f():\r\n    return  1\n"
    chat.append_text(code)
    chat._pacer.flush()
    assert "def f():\n    return  1" in chat.transcript.toPlainText()
    chat.finish_answer({"text": code, "finish_reason": "eos", "timings": {}})
    shown = chat.transcript.toPlainText()
    assert "fix:\n    x  = 1" in shown and "def f():\n    return  1" in shown
