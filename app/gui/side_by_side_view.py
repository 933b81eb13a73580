"""Side-by-side chat: one prompt answered by the loaded model as it is (A) and by a modified copy (B:
other budgets, placement or approximate routing through the offload entries, or another model
folder), one after the other by default or at once; two streaming columns with the same statistics,
the first token where the answers differ highlighted in both, a record for each side. A model that reasons first
(engine/reasoning.py) has its reasoning in a muted block above its answer."""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from pathlib import Path

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtGui import QTextBlockFormat, QTextCursor
from PySide6.QtWidgets import (QCheckBox, QFileDialog, QGridLayout, QGroupBox, QHBoxLayout, QLabel, QLineEdit,
                               QPlainTextEdit, QPushButton, QStyle, QStyleOptionGroupBox, QTextBrowser, QVBoxLayout,
                               QWidget)

from app.gui import theme
from app.gui.job_bar import JobBar
from app.gui.records_jobs import SIDE_BY_SIDE_TOKENS, SideBySideJob, SideBySideResult
from app.gui.side_streams import ended_status, failed_status
from app.gui.stream_pacing import Pacer
from app.gui.widgets import AnswerLength, OneLineLabel
from engine.errors import WorkbenchError
from engine.offload import OffloadConfig
from engine.offload.config import DEVICE_KEYS, keys_among
from engine.offload.decode_path import MODES as PATH_MODES
from engine.offload.layer_split import MODES as SPLIT_MODES
from engine.records.side_by_side import NEAR_TIE, SCENARIO_AT_ONCE, SideBudget, budget_beside_a
from engine.units import decode_rate, duration_text, human_bytes

KIND = "comparing"
# "completion": the run's time, its record's completion_s, as the History's column of that name gives it
STATS = ("first token", "decode", "completion", "tokens", "expert budget", "device peak", "routing")


# this app's own settings beside onnxruntime's keys (engine/offload/layer_split.py, decode_path.py), with their values
SPLIT_KEY, PATH_KEY = "layer_split", "decode_path"
OWN_KEYS = {SPLIT_KEY: SPLIT_MODES, PATH_KEY: PATH_MODES}


def divergence_text(divergence: int | None, margins: tuple[float, float] | None,
                    margins_failure: str | None = None, by_text: bool = False,
                    text_divergence: int | None = None) -> str:
    """Where the answers part, and whether each side chose firmly there or between near-tied tokens (or why that
    could not be told); `by_text`: two tokenizers, the answers compared as text (Comparison.text_divergence)."""
    if by_text:
        why = "the two models' tokenizers differ, so the answers are compared as text, not token by token"
        if text_divergence is None:
            return f"The two answers are identical as text ({why})."
        return f"The answers' text diverges at character {text_divergence + 1}, highlighted in both columns ({why})."
    if divergence is None:
        return "The two answers are identical, token for token."
    text = f"The answers diverge at generated token {divergence + 1} (index {divergence}), highlighted in both columns."
    if margins_failure:
        return text + f" How firmly each side chose its token there could not be computed: {margins_failure}."
    if margins is None:
        return text
    a, b = margins
    text += (f" There A preferred its token to B's by {a:.3f} in log-probability, and B its own to A's by {b:.3f}: ")
    if max(abs(a), abs(b)) < NEAR_TIE:
        return text + ("near ties, which rounding differences between the two configurations can tip (random weights "
                       "make many).")
    return text + "the two configurations compute clearly different results there."


def parse_entries(text: str) -> dict:
    """key=value lines (onnxruntime names, short names allowed, layer_split=auto|spread|whole and
    decode_path=auto|cpu|tier|both); # at a line's start or after a space starts a comment (one inside a value, a
    path's or a node name's, is the value's)."""
    entries, lines = {}, {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = re.split(r"(?:^|\s)#", line, maxsplit=1)[0].strip()
        if not line:
            continue
        key, eq, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key:
            raise WorkbenchError(f"line {number} of B's settings, {line!r}: expected KEY=VALUE")
        if entries.get(key, value) != value:
            raise WorkbenchError(f"line {number} of B's settings: {key}={value}, but line {lines[key]} gave it "
                                 f"{entries[key]}: one value a setting")
        entries[key], lines[key] = value, number
    for key, modes in OWN_KEYS.items():
        if key in entries and entries[key] not in modes:
            raise WorkbenchError(f"B's settings: {key}={entries[key]}: one of {', '.join(modes)}")
    try:
        offload_entries(entries)  # names and values checked here, before anything runs
    except WorkbenchError as exc:
        raise WorkbenchError(f"B's settings: {exc}") from None
    return entries


def offload_entries(entries: dict) -> OffloadConfig:
    """The offload configuration of B's entries (all but this app's own settings)."""
    return OffloadConfig.from_entries({key: value for key, value in entries.items() if key not in OWN_KEYS},
                                      also_known=tuple(OWN_KEYS))


def entries_text(entries: dict) -> str:
    return "\n".join(f"{key}={value}" for key, value in sorted(entries.items()))


def speed_text(a, b) -> str:
    """B's first token and decode rate against A's (records that answered)."""
    ta, tb = (record.turns[0]["timings"] for record in (a, b))
    text = (f"B gave its first token in {duration_text(tb['time_to_first_token_s'])}, A in "
            f"{duration_text(ta['time_to_first_token_s'])}")
    if ta["decode_tokens_per_s"] and tb["decode_tokens_per_s"]:
        text += (f"; B decoded at {tb['decode_tokens_per_s'] / ta['decode_tokens_per_s']:.2f}× A's rate "
                 f"({tb['decode_tokens_per_s']:.1f} against {ta['decode_tokens_per_s']:.1f} tok/s)")
    pa, pb = projected_decode(a), projected_decode(b)
    if pa and pb:
        text += (f"; projected on the simulated card, B decodes at {pb / pa:.2f}× A's rate ({pb:.1f} against "
                 f"{pa:.1f} tok/s)")
    if a.scenario == SCENARIO_AT_ONCE:
        text += ", answering at once, each slowed by the other"
    return text + "."


def projected_decode(record) -> float | None:
    """The decode rate projected for the simulated card a side ran on (None on any other device, or nothing decoded):
    there every expert is computed on the CPU, so the measured rate says little of the budget's."""
    return (record.timings.get("projected") or {}).get("decode_tokens_per_s")


def a_title(path: str | None) -> str:
    return f"A: {Path(path).name} as loaded" if path else "A: the loaded model"


def idle_settings_text(a, b) -> str:
    """The device settings where B differs from A (the records of the two sides) while B, like the loaded model, has
    no device: they changed nothing (every expert ran on the CPU), which the comparison would not show otherwise."""
    a_entries, b_entries = a.offload.get("entries", {}), b.offload.get("entries", {})
    idle = keys_among({key for key in {*a_entries, *b_entries} if a_entries.get(key) != b_entries.get(key)},
                      DEVICE_KEYS)
    # this app's own settings choose among a device's ways too: the records hold them beside the entries
    idle += [key for key in OWN_KEYS
             if (a.offload.get(key) or {}).get("mode") != (b.offload.get(key) or {}).get("mode")]
    if b.offload.get("device") != "cpu" or not idle:
        return ""
    if b.offload.get("device_fallback"):  # the CUDA GPU was chosen, and B could not have it
        return f" B's {', '.join(idle)} changed nothing: {_sentence_part(b.offload['device_fallback'])}"
    return (f" B's {', '.join(idle)} changed nothing: the model is loaded for the CPU, where every expert runs (choose "
            "a simulated or CUDA device in Budgets, then load, to compare budgets).")


def routing_text(record) -> str:
    """Exact routing, or approximate with how often its greedy token was the one exact routing chose."""
    if not record.approximate_routing:
        return "exact"
    if record.routing_agreement is None:
        return "approximate"
    return f"approximate: {record.routing_agreement:.0%} token agreement with exact routing"


def saved_text(ids: list[int]) -> str:
    if not ids:
        return "Nothing to save: neither side answered."
    return f"Saved run{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))} to the history."


def side_stats(record, budget: SideBudget | None = None) -> dict[str, str]:
    if record is None or not record.turns:
        return dict.fromkeys(STATS, "—")
    turn = record.turns[0]
    t = turn["timings"]
    decode = decode_rate(t["decode_tokens_per_s"], none="—")
    if projected_decode(record):
        decode += f", projected {decode_rate(projected_decode(record))}"  # short: the comparison below names the card
    return {"first token": duration_text(t["time_to_first_token_s"]), "decode": decode,
            "completion": duration_text(record.timings["completion_s"]),
            "tokens": ended_status(turn["finish_reason"], turn["generated_tokens"]),
            "expert budget": budget_text(budget),
            "device peak": device_peak_text(record.peaks["device_bytes"], record.offload.get("device_fallback")),
            "routing": routing_text(record)}


def budget_text(budget: SideBudget | None) -> str:
    """A side's expert budget as its plan set it ("—": no device, or offload disabled)."""
    if budget is None:
        return "—"
    if budget.cut:
        return (f"{human_bytes(budget.budget_bytes)}, all the device had free "
                f"(device_expert_bytes={human_bytes(budget.asked_bytes)})")
    if not budget.automatic:
        return f"{human_bytes(budget.budget_bytes)}, device_expert_bytes"
    return f"{human_bytes(budget.budget_bytes)}, automatic: of {human_bytes(budget.free_bytes)} free"


def budget_beside_a_text(budgets: tuple[SideBudget | None, SideBudget | None]) -> str:
    """Where B's budget came out smaller for A holding its part of the device (budget_beside_a): why, and how to
    compare budgets on equal terms; else ''."""
    if not budget_beside_a(budgets):
        return ""
    a, b = budgets
    beside = (f"the {human_bytes(b.free_bytes)} the device had free beside A, which stays loaded and holds its part of "
              f"it (A's plan saw {human_bytes(a.free_bytes)} free)")
    if b.cut:
        why = (f" B's device_expert_bytes, {human_bytes(b.asked_bytes)}, is more than {beside}: B's budget is "
               f"{human_bytes(b.budget_bytes)}.")
    else:
        why = (f" B's automatic expert budget, {human_bytes(b.budget_bytes)}, was computed from {beside}: B has less "
               "than its settings give it alone.")
    return why + (" For budgets on equal terms give both sides a device_expert_bytes the device holds together (A's in "
                  "Budgets, then load).")


def device_peak_text(device_bytes: int | None, fallback: str | None = None) -> str:
    """The most a side held on its device while it answered (its record's peak); None: it had no device, for
    `fallback`'s reason where the CUDA GPU asked for could not be used."""
    if device_bytes is not None:
        return human_bytes(device_bytes)
    return f"no device: {_sentence_part(fallback)}" if fallback else "no device: every expert on the CPU"


def _sentence_part(sentence: str) -> str:
    """A sentence ("The CUDA GPU ...") to follow a colon."""
    return sentence[:1].lower() + sentence[1:]


class Column(QGroupBox):
    """One side's answer and statistics. Neither what it says nor its title sets its width: its status and statistics
    are one line each and its title one line (OneLineLabel's way: what does not fit ends in an ellipsis, the whole
    text in the tooltip), so the two columns stay as wide as each other, and still, while the answers stream."""

    def __init__(self, title: str, parent=None):
        super().__init__(parent)
        self._title = ""
        self.text = self.reasoning = ""
        # what its side was doing as last streamed (side_streams' state, its tokens so far); None: nothing said
        self.state: str | None = None
        self.tokens = 0
        # while it streams with a reasoning paragraph: the last character each part shows ("" before any), which decides
        # whether the next batch's leading whitespace shows (_shown), and where the reasoning ends
        self._reasoning_end = self._answer_end = ""
        self._reasoning_cursor: QTextCursor | None = None
        # what came and is not shown yet: the pacer shows it (stream_pacing.py)
        self._unshown_text = self._unshown_reasoning = ""
        self._pacer = Pacer(self._show_unshown, self)
        self.answer = QTextBrowser()
        self.values: dict[str, OneLineLabel] = {}
        grid = QGridLayout()
        for row, name in enumerate(STATS):
            grid.addWidget(QLabel(name), row, 0)
            self.values[name] = OneLineLabel("—")
            grid.addWidget(self.values[name], row, 1)
        grid.setColumnStretch(1, 1)  # the values have the room the names leave: a status fits before it is elided
        layout = QVBoxLayout(self)
        layout.addWidget(self.answer, 1)
        layout.addLayout(grid)
        self.setTitle(title)

    def setTitle(self, title: str) -> None:  # noqa: N802 (Qt's name)
        """The side's title, which a screen reader says of its answer and statistics too (they kept the first title,
        'B: modified' beside a B titled 'B: lfm2moe · same settings')."""
        self._title = title
        self._elide_title()
        self.answer.setAccessibleName(f"{title} answer")
        for name, label in self.values.items():
            label.setAccessibleName(f"{title} {name}")

    def title(self) -> str:
        return self._title

    def minimumSizeHint(self) -> QSize:  # noqa: N802
        """As narrow as its contents allow: QGroupBox's is at least its title's width, which widened a column whose
        title is long (B's changed settings)."""
        return QSize(QWidget.minimumSizeHint(self).width(), super().minimumSizeHint().height())

    def resizeEvent(self, event) -> None:  # noqa: N802
        super().resizeEvent(event)
        self._elide_title()

    def _elide_title(self) -> None:
        """The title as it fits the column's width, the whole of it in the tooltip where it does not."""
        option = QStyleOptionGroupBox()
        self.initStyleOption(option)
        option.text = ""  # what the style adds around the text, and where it starts (left-aligned: the most room)
        option.textAlignment = Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter
        label = self.style().subControlRect(QStyle.ComplexControl.CC_GroupBox, option,
                                            QStyle.SubControl.SC_GroupBoxLabel, self)
        room = self.width() - 2 * max(0, label.x()) - label.width()
        shown = self.fontMetrics().elidedText(self._title, Qt.TextElideMode.ElideRight, max(0, room))
        if shown != QGroupBox.title(self):
            super().setTitle(shown)
        self.setToolTip(self._title if shown != self._title else "")
        self.setAccessibleName(self._title)  # a screen reader's name for it: the whole title, not the one shown

    def clear(self) -> None:
        self.text, self.reasoning = "", ""
        self.state, self.tokens = None, 0
        self._reasoning_end = self._answer_end = ""
        self._drop_unshown()
        self.answer.clear()
        for label in self.values.values():
            label.setText("—")

    def append(self, text: str, reasoning: str = "") -> None:
        """A streamed batch, shown with those that come before the column's pacer shows them (stream_pacing.py)."""
        self.text += text
        self.reasoning += reasoning
        self._unshown_text += text
        self._unshown_reasoning += reasoning
        self._pacer.schedule()

    def show_status(self, status: str, state: str | None = None, tokens: int = 0) -> None:
        """What this side is doing while the two answer (side_streams.side_status), where its tokens show at the end;
        `state` and `tokens`: what it says, for the end of a comparison that fails (show_stopped)."""
        self.state, self.tokens = state, tokens
        self.values["tokens"].setText(status)

    def show_stopped(self) -> None:
        """The comparison failed as a whole: a side still under way says it stopped (or never started), what it
        streamed kept; a side that had ended keeps its end."""
        self.flush()
        status = failed_status(self.state, self.tokens)
        if status:
            self.show_status(status)

    def flush(self) -> None:
        """What came and is not shown yet, shown now: the stream ended without drawing the column again."""
        self._pacer.flush()

    def _drop_unshown(self) -> None:
        self._unshown_text = self._unshown_reasoning = ""
        self._pacer.cancel()

    def _show_unshown(self) -> None:
        """The batches not shown yet. Each part's new text goes in where that part ends, shown as the column drawn
        whole would show it, a new line in a block of its own: a showing costs the lines it extends, not the answer's
        length. The column is drawn whole only as its reasoning or its answer shows a first character (text inserted
        into an empty paragraph would not take the paragraph's format)."""
        text, reasoning = self._unshown_text, self._unshown_reasoning
        self._unshown_text = self._unshown_reasoning = ""
        if not text and not reasoning:
            return
        end = QTextCursor(self.answer.document())
        end.movePosition(QTextCursor.MoveOperation.End)
        if not self.reasoning:
            end.insertText(text)  # as setPlainText shows it
        elif self._reasoning_end and (self._answer_end or not _shown(text, "")):
            self._reasoning_end = _insert_shown(self._reasoning_cursor, reasoning, self._reasoning_end)
            self._answer_end = _insert_shown(end, text, self._answer_end)
        else:
            self.answer.setHtml(_with_reasoning(_escape(self.reasoning), _escape(self.text)))
            self._reasoning_end, self._answer_end = _shown(self.reasoning, "")[-1:], _shown(self.text, "")[-1:]
            self._reasoning_cursor = QTextCursor(self.answer.document().firstBlock())
            self._reasoning_cursor.movePosition(QTextCursor.MoveOperation.EndOfBlock)

    def show_failure(self, message: str) -> None:
        self._show_no_answer(f"No answer: {message}")

    def show_not_started(self, side: str) -> None:
        """A side the comparison was stopped before it began (B, one after the other, when A was stopped)."""
        self._show_no_answer(f"Not started: the comparison was stopped before {side} began.")
        self.values["tokens"].setText("not started")

    def _show_no_answer(self, text: str) -> None:
        self.text = self.reasoning = ""
        self._drop_unshown()
        self.answer.setPlainText(text)
        for label in self.values.values():
            label.setText("—")

    def show_result(self, pieces: list[str], divergence: int | None, stats: dict[str, str],
                    thoughts: Sequence[str] = ()) -> None:
        """The answer, below its reasoning (`thoughts`: its text per token, as `pieces` the answer's), with the token
        at `divergence` highlighted: in the reasoning where the answer had not begun by then, else in the answer
        (an end-of-answer mark when this side stopped there)."""
        self.text, self.reasoning = "".join(pieces), "".join(thoughts)
        self._drop_unshown()
        for name, value in stats.items():
            self.values[name].setText(value)
        in_reasoning = (divergence is not None and bool(self.reasoning)
                        and not "".join(pieces[:divergence + 1]).strip())
        reasoning = _marked(list(thoughts), divergence) if in_reasoning else _escape(self.reasoning)
        answer = _escape(self.text) if divergence is None or in_reasoning else _marked(pieces, divergence)
        self.answer.setHtml(_with_reasoning(reasoning, answer) if self.reasoning else answer)


def token_at(character: int | None, thoughts: Sequence[str], pieces: Sequence[str]) -> int | None:
    """The token of a side's stream (its reasoning and answer text per token) that holds `character` of its reasoning
    then answer; past its end, the end (this side stopped there)."""
    if character is None:
        return None
    length = 0
    for index in range(max(len(thoughts), len(pieces))):
        length += len(thoughts[index] if index < len(thoughts) else "") + len(pieces[index] if index < len(pieces) else "")
        if length > character:
            return index
    return max(len(thoughts), len(pieces))


def _marked(pieces: list[str], divergence: int) -> str:
    """The pieces' text with the one at `divergence` highlighted (a mark where it shows nothing)."""
    t = theme.current()
    mark = pieces[divergence] if divergence < len(pieces) else ""
    shown = _escape(mark) if mark.strip() else ("∎ end" if divergence >= len(pieces) else "▯")
    return (f"{_escape(''.join(pieces[:divergence]))}<span style='background:{t.warn}; color:white'>{shown}</span>"
            f"{_escape(''.join(pieces[divergence + 1:]))}")


def _with_reasoning(reasoning: str, answer: str) -> str:
    """An answer's HTML under its reasoning's, the reasoning muted and headed as such."""
    muted = theme.current().muted
    return (f"<p style='color:{muted}; font-size:small'><b>Reasoning</b><br><i>{reasoning}</i></p>"
            f"<p>{answer}</p>")


def _escape(text: str) -> str:
    return html.escape(text).replace("\n", "<br>")


# whitespace that an HTML paragraph shows as one space (Qt's white-space: normal): all but line breaks (<br> in
# _escape), no-break spaces and the separators \x1c-\x1f, which Qt keeps
_SPACES = re.compile(r"[^\S\n\xa0\x1c-\x1f]+")


def _shown(text: str, before: str) -> str:
    """What an _escape'd paragraph shows of `text` after `before`, the last character it shows ("" at its start):
    a run of whitespace as one space, none at a line's start."""
    joined = _SPACES.sub(" ", (before or "\n") + text).replace("\n ", "\n")
    return joined[1:]


def _insert_shown(cursor: QTextCursor, text: str, before: str) -> str:
    """`text` at `cursor` as setHtml would show it after `before` (_shown), each line after the first in a block of
    its own; the last character shown there now."""
    shown = _shown(text, before)
    for number, line in enumerate(shown.split("\n")):
        if number:
            _next_line(cursor)
        cursor.insertText(line)
    return shown[-1:] or before


def _next_line(cursor: QTextCursor) -> None:
    """A block that continues the cursor's paragraph on a new line, as <br> does: the paragraph's margin below moves
    to it, the one above stays where it is."""
    above = cursor.blockFormat()
    below = QTextBlockFormat(above)
    below.setTopMargin(0)
    above.setBottomMargin(0)
    cursor.setBlockFormat(above)
    cursor.insertBlock(below)


class SideBySideView(QWidget):
    jobRequested = Signal(str, object)
    cancelRequested = Signal()
    recorded = Signal(list)
    failed = Signal(str)

    def __init__(self, history_path=None, parent=None):
        super().__init__(parent)
        self.history_path = str(history_path) if history_path else None
        self.loaded_path: str | None = None
        self.loaded_entries: dict = {}
        self.result: SideBySideResult | None = None
        self.prompt = QPlainTextEdit()
        self.prompt.setPlaceholderText("One prompt, answered by both sides")
        self.prompt.setMaximumHeight(70)
        self.prompt.setAccessibleName("Side-by-side prompt")
        self.prompt.setTabChangesFocus(True)  # as the chat's boxes: Tab moves on, the keyboard's way out
        self.max_tokens = AnswerLength(SIDE_BY_SIDE_TOKENS, note=". Both sides answer the same length: where B is "
                                       "another model and you set none, the longer of the two models' own")
        self.max_tokens.setAccessibleName("Answer tokens")
        self.concurrent = QCheckBox("Concurrent")
        self.concurrent.setToolTip("Answer at the same time: they compete for the CPU, so their timings are not "
                                   "those of a run alone (saved as \"side-by-side, at once\"); off: one after the "
                                   "other")
        self.right_folder = QLineEdit(placeholderText="B's model folder (empty: the loaded model's)")
        self.right_folder.setAccessibleName("B's model folder")
        self.browse = QPushButton("Browse…")
        self.right_entries = QPlainTextEdit()
        self.right_entries.setAccessibleName("B's offload settings")
        self.right_entries.setTabChangesFocus(True)
        self.right_entries.setPlaceholderText("B's offload settings, KEY=VALUE per line, e.g.\n"
                                              "device_expert_bytes=0\nplacement=static\nmin_expert_weight=0.1\n"
                                              "layer_split=whole, decode_path=cpu (this app's own)")
        self.right_entries.setMaximumHeight(90)
        self.reset_button = QPushButton("Same as A")
        self.reset_button.setToolTip("B's settings: a copy of the loaded model's, to edit")
        self.bar = JobBar("Answer both", "Stop at the next token; a cancelled comparison saves nothing")
        self.left = Column("A: the loaded model")
        self.right = Column("B: modified")
        self.divergence = QLabel()
        self.divergence.setAccessibleName("Divergence")
        self.divergence.setWordWrap(True)

        options = QHBoxLayout()
        options.addWidget(QLabel("Tokens"))
        options.addWidget(self.max_tokens)
        options.addWidget(self.concurrent)
        options.addStretch(1)
        folder = QHBoxLayout()
        folder.addWidget(self.right_folder, 1)
        folder.addWidget(self.browse)
        folder.addWidget(self.reset_button)
        columns = QHBoxLayout()  # two equal halves, whatever the columns say (Column)
        columns.addWidget(self.left, 1)
        columns.addWidget(self.right, 1)
        layout = QVBoxLayout(self)
        layout.addWidget(self.prompt)
        layout.addLayout(options)
        layout.addLayout(folder)
        layout.addWidget(self.right_entries)
        layout.addWidget(self.bar)
        layout.addLayout(columns, 1)
        layout.addWidget(self.divergence)
        self.bar.runRequested.connect(self.run)
        self.bar.cancelRequested.connect(self.cancelRequested)
        self.browse.clicked.connect(self._browse)
        self.reset_button.clicked.connect(lambda: self.right_entries.setPlainText(entries_text(self.loaded_entries)))

    def set_loaded(self, path: str | None, entries: dict | None = None, settings: dict | None = None) -> None:
        """The loaded model and its settings (side A: its offload entries, and the Budgets panel's `settings` for this
        app's own, where not auto); B starts as a copy of A's settings."""
        old = entries_text(self.loaded_entries)
        own = {key: (settings or {}).get(key) or "auto" for key in OWN_KEYS}
        self.loaded_path = path
        self.loaded_entries = {**(entries or {}), **{key: mode for key, mode in own.items() if mode != "auto"}}
        if self.left.answer.document().isEmpty() and self.right.answer.document().isEmpty():
            self.left.setTitle(a_title(path))  # a comparison shown keeps the titles of the answers it shows
        if self.right_entries.toPlainText().strip() in ("", old):
            self.right_entries.setPlainText(entries_text(self.loaded_entries))

    def set_state(self, busy: str, loaded: bool) -> None:
        self.bar.set_state(bool(busy), loaded)

    def _browse(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "B's model folder", self.right_folder.text() or self.loaded_path or "")
        if path:
            self.right_folder.setText(path)

    def _labels(self, entries: dict, folder: str | None) -> tuple[str, str]:
        name = Path(self.loaded_path).name if self.loaded_path else "model"
        config_entries = offload_entries(entries).to_entries()
        loaded = {k: v for k, v in self.loaded_entries.items() if k not in OWN_KEYS}
        changed = [f"{k.rsplit('.', 1)[-1]}={v}" for k, v in sorted(config_entries.items()) if loaded.get(k) != v]
        dropped = [k.rsplit(".", 1)[-1] + " default" for k in loaded if k not in config_entries]
        changed += [f"{key}={entries.get(key, 'auto')}" for key in OWN_KEYS
                    if entries.get(key, "auto") != self.loaded_entries.get(key, "auto")]
        what = ", ".join(changed + dropped) or "same settings"
        b_name = Path(folder).name if folder else name
        return a_title(self.loaded_path), f"B: {b_name} · {what}"

    def answer_both(self) -> None:
        """Answer both, as the button does where it can (a model loaded, the engine idle)."""
        if self.bar.run_button.isEnabled():
            self.run()

    def run(self) -> None:
        try:
            entries = parse_entries(self.right_entries.toPlainText())
            folder = self.right_folder.text().strip() or None
            labels = self._labels(entries, folder)
        except WorkbenchError as exc:
            self.failed.emit(str(exc))
            return
        prompt = self.prompt.toPlainText()
        if not prompt.strip():
            self.failed.emit("Type a prompt for both sides first.")
            return
        self.left.clear()
        self.right.clear()
        self.left.setTitle(labels[0])
        self.right.setTitle(labels[1])
        self.divergence.setText("")
        self.result = None
        split, path = entries.pop(SPLIT_KEY, None), entries.pop(PATH_KEY, None)
        job = SideBySideJob(prompt, self.max_tokens.chosen, entries, folder, self.concurrent.isChecked(),
                            self.history_path, labels, right_layer_split=split, right_decode_path=path)
        self.bar.start("Loading B…")
        self.jobRequested.emit(KIND, job)

    # --- from the worker ---------------------------------------------------------------------------
    def on_progress(self, fraction: float | None, text: str) -> None:
        self.bar.set_progress(fraction, text)

    def on_streamed(self, payload: dict) -> None:
        column = (self.left, self.right)[payload["side"]]
        column.append(payload["text"], payload["reasoning"])
        column.show_status(payload["status"], payload["state"], payload["tokens"])

    def on_finished(self, result: SideBySideResult) -> None:
        self.result = result
        comparison = result.comparison
        records = comparison.records if comparison else (None, None)
        failures = comparison.failures if comparison else (None, None)
        divergence = comparison.divergence if comparison else None
        budgets = comparison.budgets if comparison else (None, None)
        for column, side, record, pieces, thoughts, failure, budget in zip(
                (self.left, self.right), "AB", records, result.pieces, result.thoughts, failures, budgets):
            if failure:
                column.show_failure(failure)
            elif result.cancelled and not (record and record.turns) and not pieces and not thoughts:
                column.show_not_started(side)
            else:
                by_text = comparison is not None and comparison.by_text
                at = token_at(comparison.text_divergence, thoughts, pieces) if by_text else divergence
                column.show_result(pieces, at, side_stats(record, budget), thoughts)
        if result.cancelled:
            self.divergence.setText("Cancelled: nothing saved.")
            self.bar.finish("Cancelled.")
            return
        failed = [f"{side} could not answer: {failure}" for side, failure in zip("AB", failures) if failure]
        if failed:
            self.divergence.setText(" ".join(failed))
        else:
            self.divergence.setText(divergence_text(divergence, comparison.margins, comparison.margins_failure,
                                                    comparison.by_text, comparison.text_divergence)
                                    + " " + speed_text(*records) + idle_settings_text(*records)
                                    + budget_beside_a_text(comparison.budgets))
        self.bar.finish(saved_text(result.saved_ids))
        self.recorded.emit(result.saved_ids)

    def show_not_started(self) -> None:
        """Stopped while it waited in the engine's queue: neither side began."""
        for column, side in ((self.left, "A"), (self.right, "B")):
            column.show_not_started(side)

    def on_failed(self, message: str) -> None:
        self.left.show_stopped()  # what each side streamed stays
        self.right.show_stopped()
        self.bar.finish(f"Failed: {message}")
