"""Small widgets the panels share: a byte-budget control, an answer length that follows the model, a stacked memory
bar, per-layer bars, a banner."""

from __future__ import annotations

import difflib
import html
import math
from decimal import Decimal
from typing import Callable

from PySide6.QtCore import QRectF, QSize, Qt, Signal
from PySide6.QtGui import QColor, QFont, QPainter, QPen
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFrame, QHBoxLayout, QLabel, QLineEdit,
                               QScrollArea, QSizePolicy, QSlider, QSpinBox, QToolButton, QToolTip, QWidget)

from app.gui import theme
from app.gui.records_jobs import ANSWER_CHOICES, CHAT_SAMPLING, MODEL_SAMPLING
from engine.sampling import RECORD_SEED
from engine.units import counted, human_bytes, parse_bytes

def unknown_key(kept: dict, known: list[str], what: str) -> str:
    """Why a kept object (a settings file's, maybe hand-edited) cannot be used where one of its keys is none of
    `known` ('' where each is): a misspelt one left its setting at the default without a word."""
    for key in kept:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            return f"{key} is not a {what}" + (f": did you mean {near[0]}?" if near
                                               else f" (they are {', '.join(known)})")
    return ""


def scrolled(widget: QWidget) -> QScrollArea:
    """`widget` in a frameless scroll area: the area it sits in may get smaller than the widget's minimum (a laptop's
    screen) and it scrolls rather than squeezing its contents over each other."""
    scroll = QScrollArea()
    scroll.setWidgetResizable(True)
    scroll.setFrameShape(QFrame.Shape.NoFrame)
    scroll.setWidget(widget)
    return scroll


class OneLineLabel(QLabel):
    """A one-line status that never widens its layout: what does not fit ends in an ellipsis, and the tooltip holds
    the whole text."""

    def __init__(self, text: str = ""):
        super().__init__()
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self._full = ""
        self.setText(text)

    def setText(self, text: str) -> None:  # noqa: N802 (Qt's name)
        self._full = text
        self.setToolTip(text)
        self._elide()

    def text(self) -> str:
        return self._full

    def resizeEvent(self, event) -> None:  # noqa: N802
        super().resizeEvent(event)
        self._elide()

    def _elide(self) -> None:
        width = max(0, self.contentsRect().width())
        super().setText(self.fontMetrics().elidedText(self._full, Qt.TextElideMode.ElideRight, width) if width
                        else self._full)


def part_colour(key: str, t: theme.Theme) -> str:
    return {"experts": t.accent, "dense": "#8250df" if not t.dark else "#a371f7",
            "kv": "#bf3989" if not t.dark else "#db61a2", "workspace": "#1b7c83" if not t.dark else "#39c5cf",
            "others": t.others, "free": t.free, "limit": t.grid}.get(key, t.muted)


class ByteControl(QWidget):
    """[auto] [slider] [text]: a byte budget, None meaning auto (or 'none' for a limit). With `log_from` the slider
    runs on a log scale from that size to the maximum (a GPU's size: 64 MiB and 80 GiB both within reach). A typed value
    below `minimum` is refused, with `minimum_words` saying what needs it. `zero_is_auto`: the setting reads 0 as the
    box's choice (gpu_device_mem_limit's none, device_working_bytes' off), so 0 typed ticks the box and the slider's
    left end is its first step: '0 B' shown beside an unticked box would be what the estimate does not count."""

    valueChanged = Signal(object)
    STEPS = 1000

    def __init__(self, maximum: int = 1 << 30, auto_text: str | None = "auto", parent=None, log_from: int = 0,
                 minimum: int = 0, minimum_words: str = "this setting", zero_is_auto: bool = False):
        super().__init__(parent)
        self._maximum = max(1, maximum)
        self._log_from = log_from
        self._minimum, self._minimum_words = minimum, minimum_words
        self._zero_is_auto = zero_is_auto
        self.auto = QCheckBox(auto_text) if auto_text else None
        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setRange(0, self.STEPS)
        self.slider.setPageStep(self.STEPS // 20)
        self.text = QLineEdit()
        self.text.setMaximumWidth(96)
        self.text.setAlignment(Qt.AlignmentFlag.AlignRight)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        if self.auto:
            layout.addWidget(self.auto)
            self.auto.toggled.connect(self._auto_toggled)
        layout.addWidget(self.slider, 1)
        layout.addWidget(self.text)
        self.slider.valueChanged.connect(self._slid)
        self.text.editingFinished.connect(self._typed)
        self._value: int | None = 0
        self._quiet = False
        self._show()

    def setAccessibleName(self, name: str) -> None:  # noqa: N802 (Qt naming)
        super().setAccessibleName(name)
        self.slider.setAccessibleName(name)
        self.text.setAccessibleName(name + " (bytes)")
        if self.auto:
            self.auto.setAccessibleName(name + ": " + self.auto.text())

    def maximum(self) -> int:
        return self._maximum

    def setMaximum(self, maximum: int) -> None:  # noqa: N802
        self._maximum = max(1, int(maximum))
        self._show()

    def value(self) -> int | None:
        return None if self.auto and self.auto.isChecked() else self._value

    def setValue(self, value: int | None) -> None:  # noqa: N802
        self._quiet = True
        try:
            if self.auto:
                self.auto.setChecked(value is None)
            if value is not None:
                self._value = int(value)
            self._show()
        finally:
            self._quiet = False

    def _show(self) -> None:
        auto = self.auto is not None and self.auto.isChecked()
        self.slider.setEnabled(not auto)
        self.text.setEnabled(not auto)
        old = self.slider.blockSignals(True)
        self.slider.setValue(round(self._fraction(self._value or 0) * self.STEPS))
        self.slider.blockSignals(old)
        self.text.setText(self.auto.text() if auto else human_bytes(self._value or 0))

    def _emit(self) -> None:
        if not self._quiet:
            self.valueChanged.emit(self.value())

    def _auto_toggled(self, checked: bool) -> None:
        if not checked and self._zero_is_auto:
            self._value = self._least(self._value or 0)
        self._show()
        self._emit()

    def _least(self, value: int) -> int:
        """`value`, or the slider's first step where the setting would read it as the box's choice (zero_is_auto)."""
        return max(value, round(self._maximum / self.STEPS), 1) if self._zero_is_auto else value

    def _fraction(self, value: int) -> float:
        """Where `value` sits on the slider, 0..1."""
        if self._log_from and self._maximum > self._log_from:
            value = max(value, self._log_from)
            return min(1.0, math.log(value / self._log_from) / math.log(self._maximum / self._log_from))
        return min(1.0, value / self._maximum)

    def _slid(self, position: int) -> None:
        fraction = position / self.STEPS
        if self._log_from and self._maximum > self._log_from:
            self._value = round(self._log_from * (self._maximum / self._log_from) ** fraction)
        else:
            self._value = self._least(round(self._maximum * fraction))
        self.text.setText(human_bytes(self._value))
        self._emit()

    def _typed(self) -> None:
        if self.text.text() == human_bytes(self._value or 0):  # Return on the value as shown, rounded: no new value
            return
        typed = self.text.text().strip()
        try:
            # the box's own word ('off') and, where the setting reads 0 so, 0 tick the box
            value = None if self.auto and typed.lower() == self.auto.text().lower() else parse_bytes(typed)
            if value == 0 and self._zero_is_auto:
                value = None
            if value is None and not self.auto:
                raise ValueError(f"'{self.text.text().strip()}': this setting needs a size (e.g. 8 GiB)")
            if value is not None and value < self._minimum:
                raise ValueError(f"'{self.text.text().strip()}': {self._minimum_words} needs at least "
                                 f"{human_bytes(self._minimum)}")
        except ValueError as exc:  # said where it was typed; the value stays
            self._show()
            QToolTip.showText(self.text.mapToGlobal(self.text.rect().bottomLeft()), str(exc), self.text)
            return
        if value is None:
            self.auto.setChecked(True)
            return
        self._value = value
        self._show()
        self._emit()


class SettingSpin(QDoubleSpinBox):
    """A float setting shown in the fewest decimals that give its value back (0.0005, 2.5, 0.0000001): a loaded
    configuration's value is kept as it is, however small, not rounded to the few decimals a fixed display would
    show (Qt rounds a value to `decimals` digits: 323 is its most, enough for any double of a 32-bit float's range)."""

    def __init__(self, maximum: float, single_step: float = 0.01, parent=None):
        super().__init__(parent, decimals=323, singleStep=single_step)
        self.setRange(0.0, maximum)

    def textFromValue(self, value: float) -> str:  # noqa: N802 (Qt naming)
        text = format(Decimal(repr(value)), "f")
        return text.rstrip("0").rstrip(".") if "." in text else text


MAX_ANSWER_TOKENS = 100_000  # the longest answer a length box takes (a reasoning model's own is at most 32,768)


class AnswerLength(QSpinBox):
    """An answer length in new tokens that follows the loaded model's (set_model) until the user sets another, which
    is kept from model to model (`chosen`); setting the model's own follows each model again. `plain` is the length
    for a model that answers at once; `note` ends the tooltip."""

    def __init__(self, plain: int, note: str = ""):
        super().__init__()
        self.setRange(1, MAX_ANSWER_TOKENS)
        self.plain, self.note = plain, note
        self.model_tokens = plain  # the loaded model's length
        self.chosen: int | None = None  # the user's; None: the model's
        self._show()
        self.valueChanged.connect(self._edited)

    def set_model(self, reasoning_tokens: int | None) -> None:
        """The loaded model's length: its own where it reasons first (LoadedModel.reasoning_answer_tokens), else
        `plain`."""
        self.model_tokens = reasoning_tokens or self.plain
        self._show()

    def choose(self, tokens: int | None) -> None:
        """The user's length, as saved settings restore it (None: the model's)."""
        self.chosen = tokens
        self._show()

    def _edited(self, tokens: int) -> None:
        self.chosen = None if tokens == self.model_tokens else tokens
        self._show()

    def _show(self) -> None:
        tokens = self.chosen or self.model_tokens
        self.blockSignals(True)  # not the user's edit
        self.setValue(tokens)
        self.blockSignals(False)
        self.setToolTip(
            f"Answers stop after {tokens} new tokens, "
            + (f"your length, kept from model to model; {self.model_tokens}, this model's own, follows the model "
               "loaded" if self.chosen else "this model's own length, which follows the model loaded (one that "
               "reasons first gets room for an answer after its reasoning)") + self.note)


class StackedBar(QWidget):
    """A horizontal bar of (key, label, bytes) parts, coloured by part, with a tooltip per part."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.parts = []
        self.setMinimumHeight(22)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMouseTracking(True)

    def sizeHint(self) -> QSize:
        return QSize(240, 22)

    def setParts(self, parts) -> None:  # noqa: N802
        self.parts = list(parts)
        self.update()

    def _rects(self):
        total = sum(p.bytes for p in self.parts)
        x, width = 0.0, float(self.width())
        for part in self.parts:
            w = width * part.bytes / total if total else 0
            yield part, QRectF(x, 0, w, self.height())
            x += w

    def paintEvent(self, _event) -> None:
        t = theme.current()
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.fillRect(self.rect(), QColor(t.surface))
        for part, rect in self._rects():
            if rect.width() <= 0:
                continue
            colour = QColor(part_colour(part.key, t))
            if part.key == "free":
                colour.setAlpha(90)
            painter.fillRect(rect, colour)
            if part.key == "limit":
                painter.setPen(QPen(QColor(t.muted), 1, Qt.PenStyle.DashLine))
                for x in range(int(rect.left()), int(rect.right()) + self.height(), 6):
                    painter.drawLine(x, self.height(), x - self.height(), 0)
        painter.setPen(QPen(QColor(t.grid)))
        painter.drawRect(self.rect().adjusted(0, 0, -1, -1))

    def mouseMoveEvent(self, event) -> None:
        for part, rect in self._rects():
            if rect.contains(event.position()):
                QToolTip.showText(event.globalPosition().toPoint(),
                                  f"{part.label}: {human_bytes(part.bytes)}" + (f"\n{part.note}" if part.note else ""),
                                  self)
                return
        QToolTip.hideText()


def legend_html(parts, t: theme.Theme) -> str:
    rows = []
    for part in parts:
        note = f"<span style='color:{t.muted}; font-size:small'>{html.escape(part.note)}</span>" if part.note else ""
        rows.append(f"<tr><td style='white-space:pre'><span style='color:{part_colour(part.key, t)}'>■</span> "
                    f"{html.escape(part.label)}</td><td align='right' style='white-space:pre'>"
                    f"&nbsp;{human_bytes(part.bytes)}&nbsp;&nbsp;</td><td>{note}</td></tr>")
    return "<table cellspacing='0' cellpadding='1'>" + "".join(rows) + "</table>"


class LayerBars(QWidget):
    """One thin column per expert layer: the share of its experts that have a slot on the device."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.rows: list[tuple[int, str, int, int]] = []
        self.setMinimumHeight(36)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMouseTracking(True)

    def sizeHint(self) -> QSize:
        return QSize(240, 40)

    def setRows(self, rows) -> None:  # noqa: N802
        self.rows = list(rows)
        self.update()

    def _column(self, index: int) -> QRectF:
        n = max(1, len(self.rows))
        w = self.width() / n
        return QRectF(index * w, 0, w, self.height())

    def paintEvent(self, _event) -> None:
        t = theme.current()
        painter = QPainter(self)
        painter.fillRect(self.rect(), QColor(t.surface))
        gap = 1 if self.width() / max(1, len(self.rows)) > 3 else 0
        for index, (_layer, _node, resident, experts) in enumerate(self.rows):
            rect = self._column(index).adjusted(0, 0, -gap, 0)
            painter.fillRect(rect, QColor(t.cold))
            if experts:
                h = rect.height() * resident / experts
                painter.fillRect(QRectF(rect.left(), rect.bottom() - h, rect.width(), h), QColor(t.accent))
        painter.setPen(QPen(QColor(t.grid)))
        painter.drawRect(self.rect().adjusted(0, 0, -1, -1))

    def tooltip_at(self, index: int) -> str:
        """A layer's device slots for its experts (adaptive placement may leave some to copied misses once loaded)."""
        layer, node, slots, experts = self.rows[index]
        held = (f"all {experts} experts resident" if slots == experts
                else f"{counted(slots, 'expert slot')} for its {experts} experts")
        return f"layer {layer}: {held}\n{node}"

    def mouseMoveEvent(self, event) -> None:
        for index in range(len(self.rows)):
            if self._column(index).contains(event.position()):
                QToolTip.showText(event.globalPosition().toPoint(), self.tooltip_at(index), self)
                return


class Banner(QFrame):
    """A coloured line of text with a close button: errors and warnings that never block the window."""

    def __init__(self, kind: str = "error", parent=None):
        super().__init__(parent)
        self.kind = kind
        self.label = QLabel(wordWrap=True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.close_button = QToolButton(text="✕")
        self.close_button.setAutoRaise(True)
        self.close_button.setAccessibleName("Dismiss")
        self.close_button.clicked.connect(self.hide)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(10, 6, 6, 6)
        layout.addWidget(self.label, 1)
        layout.addWidget(self.close_button, 0, Qt.AlignmentFlag.AlignTop)
        self.setAccessibleName("Error" if kind == "error" else "Warning")
        self.restyle()
        self.hide()

    def restyle(self) -> None:
        t = theme.current()
        colour = t.error if self.kind == "error" else t.warn
        self.setStyleSheet(f"Banner {{ background: {colour}; border-radius: 6px; }} "
                           f"QLabel, QToolButton {{ color: white; background: transparent; }}")

    def text(self) -> str:
        return self.label.text()

    def show_message(self, text: str) -> None:
        self.label.setText(text)
        self.show()


def heading(text: str) -> QLabel:
    label = QLabel(text)
    font = QFont(label.font())
    font.setBold(True)
    label.setFont(font)
    return label


class AnswersChoice(QComboBox):
    """How a records job's answers choose their tokens, as the command line's record and sweep take it: greedy, the
    model's genai_config.json sampling, or the chat's sampling settings (`chat_options`, set by the window: the chat's
    ChatPanel.options); seeded where they sample, and the records say which (records_jobs.record_sampling)."""

    def __init__(self, parent=None):
        super().__init__(parent)
        for choice, words in ANSWER_CHOICES.items():
            self.addItem(words, choice)
        self.setAccessibleName("Answers")
        self.setToolTip("How the answers choose their tokens: greedy, the model's own sampling (its genai_config.json) "
                        "or the chat's Settings; sampled answers are seeded (the seed chosen, else the model's, else "
                        f"{RECORD_SEED}) so a repeat run samples alike, and each record keeps what was used")
        self.chat_options: Callable[[], dict] = dict
        self.note = QLabel()  # the loaded model's beam_search_note while its sampling is chosen; the view places it
        self.note.setWordWrap(True)
        self.note.setAccessibleName("Answers note")
        self.note.hide()
        self._beams = ""
        self.currentIndexChanged.connect(lambda _index: self._show_note())

    def set_beam_search_note(self, note: str) -> None:
        """The loaded model's engine.sampling.beam_search_note ("" where it asks for no beam search)."""
        self._beams = note
        self._show_note()

    def _show_note(self) -> None:
        said = self._beams if self.currentData() == MODEL_SAMPLING else ""
        self.note.setText(f"{said}." if said else "")
        self.note.setVisible(bool(said))

    def job_settings(self) -> dict:
        """The records job's `answers` and `chat_options`."""
        choice = self.currentData()
        return {"answers": choice, "chat_options": self.chat_options() if choice == CHAT_SAMPLING else None}


class ReasoningChoice(QComboBox):
    """The chat template's reasoning setting (gpt-oss's effort, Qwen3's thinking) the answers take, as the command
    line's --reasoning takes it: "model default" (None) leaves it to the template. It offers the loaded model's values
    (set_choices); one chosen is kept while a model without it is loaded, and chosen again for one that takes it."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setAccessibleName("Reasoning")
        self.setToolTip("What the model's chat template takes for reasoning: gpt-oss's effort (low, medium, high), "
                        "Qwen3's thinking (on, off); 'model default' leaves it to the template")
        self._wanted: str | None = None  # the setting kept while a model without one is loaded
        self.set_choices([])
        self.activated.connect(lambda _index: self.choose(self.currentData()))

    def set_choices(self, choices: list[str]) -> None:
        """The loaded model's reasoning values (engine/reasoning.py), none for a template without the setting."""
        self.blockSignals(True)
        self.clear()
        self.addItem("model default" if choices else "none in this model", None)
        for choice in choices:
            self.addItem(choice, choice)
        self.setEnabled(bool(choices))
        self.blockSignals(False)
        self.choose(self._wanted)

    def choose(self, reasoning: str | None) -> None:
        """The user's setting (None: the template's default), shown where the loaded model takes it."""
        self._wanted = reasoning
        self.setCurrentIndex(max(0, self.findData(reasoning)))

    @property
    def chosen(self) -> str | None:
        """The user's setting, which the settings keep, whether or not the loaded model takes it."""
        return self._wanted
