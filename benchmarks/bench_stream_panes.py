"""Benchmark: the window's cost of a streamed answer, in a side-by-side column or the chat pane, with and without line
breaks (Qt lays a paragraph out whole at each insertion into it, so one long line is the costly case).

Batches of `--words` words, the first of them (a `--reasoning` share) the answer's reasoning, a line break every
`--line-words` words (0: none). Two ways to send them:
  burst   appended one after the other on the window's thread, as a stream the window fell behind on reaches it (the
          measurement of a15844e); seconds until the last of it shows
  paced   sent from another thread, `--every-ms` apart, as the workers send them: to both side-by-side columns (or to
          the chat), with a probe timer on the window's thread. Seconds until the last of it shows, how long after the
          last batch was sent, the window thread's CPU seconds (time the sender, like the engine, may wait for the
          GIL) and the probe's longest wait (how long a click would have waited at worst)

    python benchmarks/bench_stream_panes.py [--pane column|chat] [--mode burst|paced] [--batches 2000] [--words 4]
                                            [--line-words 0] [--reasoning 0.5] [--every-ms 5]
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from PySide6.QtCore import QEventLoop, QObject, QTimer, Signal  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")


def batches(count: int, words: int, line_words: int) -> list[str]:
    """`count` batches of `words` words each, a space before each word, a line break after every `line_words`th."""
    out, n = [], 0
    for _ in range(count):
        batch = ""
        for _ in range(words):
            n += 1
            batch += " " + WORDS[n % len(WORDS)] + ("\n" if line_words and n % line_words == 0 else "")
        out.append(batch)
    return out


class Sink:
    """A pane that takes (side, answer, reasoning) batches, and says whether it shows the whole of what it took."""

    def __init__(self, pane: str, app: QApplication):
        self.app, self.pane = app, pane
        if pane == "column":
            from app.gui.side_by_side_view import Column

            self.widgets = [Column("A"), Column("B")]
            self.documents = [column.answer.document() for column in self.widgets]
        else:
            from app.gui.chat_panel import ChatPanel

            chat = ChatPanel()
            chat.entries.append({"role": "user", "text": "Tell me"})
            chat._begin_answer()
            self.widgets, self.documents = [chat], [chat.transcript.document()]
        for widget in self.widgets:
            widget.resize(600, 800)
            widget.show()
        self.taken = [""] * len(self.widgets)
        app.processEvents()

    def take(self, side: int, text: str, reasoning: str) -> None:
        if self.pane == "column":
            self.widgets[side].append(text, reasoning)
        else:
            self.widgets[0].append_text(text, 1, reasoning)
        self.taken[side] += text

    def all_shown(self) -> bool:
        return all(" ".join(doc.toPlainText().split()).endswith(" ".join(taken.split())[-40:])
                   for doc, taken in zip(self.documents, self.taken))

    def wait_shown(self) -> None:
        while not self.all_shown():
            self.app.processEvents()
            time.sleep(0.001)


def burst(sink: Sink, stream: list[tuple[str, str]]) -> dict:
    started = time.perf_counter()
    for text, reasoning in stream:
        for side in range(len(sink.widgets)):
            sink.take(side, text, reasoning)
    sink.wait_shown()
    return {"s": time.perf_counter() - started}


class Sender(QObject):
    batch = Signal(int, str, str)


def paced(sink: Sink, stream: list[tuple[str, str]], every_s: float) -> dict:
    sender = Sender()  # lives on the window's thread: the other thread's emits are queued to it
    sender.batch.connect(sink.take)
    sent = {}

    def send() -> None:
        for text, reasoning in stream:
            for side in range(len(sink.widgets)):
                sender.batch.emit(side, text, reasoning)
            time.sleep(every_s)
        sent["at"] = time.perf_counter()

    waits, last = [0.0], [time.perf_counter()]
    loop = QEventLoop()

    def probe() -> None:  # also ends the run once the last batch is sent and shown
        now = time.perf_counter()
        waits[0] = max(waits[0], now - last[0])
        last[0] = now
        if "at" in sent and sink.all_shown():
            loop.quit()

    timer = QTimer(interval=5)
    timer.timeout.connect(probe)
    timer.start()
    started = last[0] = time.perf_counter()
    cpu = time.thread_time()
    thread = threading.Thread(target=send)
    thread.start()
    loop.exec()
    done, cpu = time.perf_counter(), time.thread_time() - cpu
    thread.join()
    timer.stop()
    return {"s": done - started, "lag_s": done - sent["at"], "window_cpu_s": cpu, "longest_wait_ms": waits[0] * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pane", choices=("column", "chat"), default="column")
    parser.add_argument("--mode", choices=("burst", "paced"), default="burst")
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--words", type=int, default=4)
    parser.add_argument("--line-words", type=int, default=0, help="a line break every this many words; 0: none")
    parser.add_argument("--reasoning", type=float, default=0.5, help="the share of the batches that are reasoning")
    parser.add_argument("--every-ms", type=float, default=5.0, help="paced: the time between batches")
    args = parser.parse_args()
    app = QApplication.instance() or QApplication([])
    texts = batches(args.batches, args.words, args.line_words)
    thinking = int(args.batches * args.reasoning)
    stream = [("", text) if i < thinking else (text, "") for i, text in enumerate(texts)]
    sink = Sink(args.pane, app)
    result = burst(sink, stream) if args.mode == "burst" else paced(sink, stream, args.every_ms / 1000)
    figures = "  ".join(f"{key} {value:.2f}" if key != "longest_wait_ms" else f"{key} {value:.0f}"
                        for key, value in result.items())
    print(f"{args.pane} {args.mode}: {args.batches} batches, {sum(map(len, texts))} characters a side, line break "
          f"{'every ' + str(args.line_words) + ' words' if args.line_words else 'never'}: {figures}")


if __name__ == "__main__":
    main()
