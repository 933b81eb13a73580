"""Side by side's answers on their way to the window, from the engine worker's thread (no widgets here): both columns'
text in batches, and what each side is doing, said in its column and on the run line: waiting for the other side (they
answer one after the other unless Concurrent is on), preparing (before its first token: its experts mapped, its kernels
warmed, its prompt read), answering (its tokens so far against the length it answers at most: no share of that
length, an answer ends where the model ends it, a reasoning model's often far below its thousands of tokens), or done,
with how its answer ended and its length."""

from __future__ import annotations

import threading
import time

WAITING, PREPARING, ANSWERING = "waiting", "preparing", "answering"
# how an answer ended (generate's finish reasons; compare's "cancelled" for one that had not begun, "error")
ENDED = {"eos": "done", "stop_string": "done", "length": "stopped at the length", "cancelled": "stopped",
         "context": "stopped at the context's end", "max_length": "stopped at the model's search.max_length",
         "error": "failed"}


def side_status(side: int, state: str, tokens: int, at_most: int) -> str:
    """What one side is doing, as its column says it (the run line puts the side's letter before it)."""
    if state == WAITING:
        return f"waiting for {'AB'[1 - side]}"
    if state == PREPARING:
        return "preparing its first token"
    if state == ANSWERING:
        return f"answering: {tokens:,} (at most {at_most:,})"
    return ended_status(state, tokens)


def ended_status(finish_reason: str, tokens: int) -> str:
    """How a side's answer ended, and its length: what its column says once it ends."""
    return f"{ENDED.get(finish_reason, finish_reason)} ({tokens:,} token{'' if tokens == 1 else 's'})"


def failed_status(state: str | None, tokens: int) -> str | None:
    """What a side still under way says when the whole comparison fails (the run line says why), or None: a side that
    had ended keeps its end, and one that had said nothing yet says nothing."""
    if state == WAITING:
        return "not started: the comparison failed"
    if state == PREPARING:
        return "stopped before its first token: the comparison failed"
    if state == ANSWERING:
        return f"stopped: the comparison failed ({tokens:,} token{'' if tokens == 1 else 's'})"
    return None


def run_line(states: list[str | None], tokens: list[int], at_most: int) -> str:
    """What the sides that have a model to answer (state not None) are doing, one after the other."""
    return " · ".join(f"{'AB'[side]} {side_status(side, state, tokens[side], at_most)}"
                      for side, state in enumerate(states) if state is not None)


class SideStreams:
    """compare's callbacks: every token's text kept (for the divergence mark), its answer's and its reasoning's apart
    (generate calls on_reasoning just before on_text, with every token), sent in batches, each with its side's status;
    the run line with them, at most once every `interval_s` while they stream. `answering`: which sides have a model to
    answer; `concurrent`: both at once, else B waits for A's end. A side prepares until its first token."""

    def __init__(self, ctx, max_tokens: int, answering: tuple[bool, bool], concurrent: bool, interval_s: float):
        self.ctx, self.max_tokens, self.interval_s = ctx, max_tokens, interval_s
        self.states: list[str | None] = [PREPARING if answers else None for answers in answering]
        if all(answering) and not concurrent:
            self.states[1] = WAITING
        self.tokens = [0, 0]
        self.pieces: list[list[str]] = [[], []]
        self.thoughts: list[list[str]] = [[], []]
        self._pending: list[list[str]] = [[], []]
        self._pending_thoughts: list[list[str]] = [[], []]
        self._sent: list[str | None] = [None, None]  # each column's status as last sent
        self._lock = threading.Lock()
        self._last = 0.0

    def on_reasoning(self, side: int, _token, delta: str) -> None:
        with self._lock:
            self.thoughts[side].append(delta)
            self._pending_thoughts[side].append(delta)

    def on_text(self, side: int, _token, delta: str) -> None:
        with self._lock:
            self.pieces[side].append(delta)
            self._pending[side].append(delta)
            self.tokens[side] += 1
            first = self.states[side] == PREPARING
            if first:
                self.states[side] = ANSWERING
            now = time.perf_counter()
            if first or now - self._last >= self.interval_s:  # its first token said at once
                self._last = now
                self._flush()

    def on_done(self, side: int, finish_reason: str, generated_tokens: int | None) -> None:
        """compare's on_done: the side's end, its length as its record counts it (an end-of-answer token streams no
        text); the side waiting for it prepares its answer now."""
        with self._lock:
            self.states[side] = finish_reason
            if generated_tokens is not None:
                self.tokens[side] = generated_tokens
            if self.states[1 - side] == WAITING:
                self.states[1 - side] = PREPARING
            self._flush()

    def flush(self) -> None:
        """What has not gone to the window yet: at the start, each side's status; at the end, the last batches."""
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        # whether a side still answers, and when that was so (the tokens/s graph's clock: GraphsPanel.set_answering):
        # the graph times the answers from the sides' first status on: not B's load, the decoding of the engines' trials
        # (unrecorded, uncounted) before it, nor the saving after
        under_way = any(state in (WAITING, PREPARING, ANSWERING) for state in self.states)
        sent = time.monotonic()
        for side, state in enumerate(self.states):
            if state is None:
                continue
            status = side_status(side, state, self.tokens[side], self.max_tokens)
            if self._pending[side] or status != self._sent[side]:
                self.ctx.stream({"side": side, "text": "".join(self._pending[side]),
                                 "reasoning": "".join(self._pending_thoughts[side]), "status": status,
                                 "state": state, "tokens": self.tokens[side],
                                 "new_tokens": len(self._pending[side]),  # streamed since the last batch
                                 "answering": under_way, "sent": sent})
                self._pending[side], self._pending_thoughts[side], self._sent[side] = [], [], status
        self.ctx.progress(None, run_line(self.states, self.tokens, self.max_tokens))
