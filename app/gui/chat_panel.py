"""The chat pane: streaming answers, multi-turn with the cache kept, a system prompt, sampling
settings, stop, regenerate, copy; under each answer its time to first token, tokens/s, the time it took
("answered in": the answer's, where History's "completion" is a run's) and tokens. A model that reasons first
(engine/reasoning.py) has its reasoning in a muted block above the answer, open while it streams ("Thinking…"),
collapsed once the answer begins; a click opens or closes it."""

from __future__ import annotations

import html
import json
import re
import time

from PySide6.QtCore import Qt, QUrl, Signal
from PySide6.QtGui import QGuiApplication, QKeyEvent, QTextCursor
from PySide6.QtWidgets import (QDoubleSpinBox, QFrame, QGridLayout, QHBoxLayout, QLabel, QLineEdit,
                               QPlainTextEdit, QPushButton, QSpinBox, QTextBrowser, QToolButton,
                               QVBoxLayout, QWidget)

from app.gui import theme
from app.gui.placement_view import split_text
from app.gui.stream_pacing import Pacer
from app.gui.widgets import MAX_ANSWER_TOKENS, AnswerLength, OneLineLabel, ReasoningChoice, unknown_key
from engine.offload.approximate import agreement_text
from engine.units import counted, decode_rate, duration_text

# Settings ▸ Stop at: texts separated by |, but for the bars of a special token's own text (<|im_end|>), which a stop
# text may name (engine/generation.py's VisibleText)
STOP_TEXT = re.compile(r"(?:<\|[^|<>\s]*\|>|[^|])+")
# the transcript's text shows its spaces as streaming inserts them (an answer's code indented), not as HTML does
KEEP_SPACES = "white-space:pre-wrap"
FINISH = {"eos": "end of text", "length": "token limit", "stop_string": "stop text", "cancelled": "stopped",
          "context": "context full", "max_length": "the model's search.max_length", "error": "error"}


class PromptEdit(QPlainTextEdit):
    """Enter sends, Shift+Enter starts a new line."""

    submitted = Signal()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if (event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
                and not event.modifiers() & Qt.KeyboardModifier.ShiftModifier):
            self.submitted.emit()
            return
        super().keyPressEvent(event)


def miss_split_text(split: dict) -> str:
    """Where this answer's misses ran: 'misses: ' and split_text."""
    return "misses: " + split_text(split) if split.get("misses") else ""


def answered_text(timings: dict, stopped: bool = False) -> str:
    """The status bar's line once an answer ends (`stopped`: by Stop)."""
    tokens = timings["generated_tokens"]
    said = "Stopped the answer" if stopped else "Answered"
    # an answer's one token was the prefill's: no decode rate to say
    return ", ".join(filter(None, [f"{said}: {counted(tokens, 'token')}",
                                   decode_rate(timings["decode_tokens_per_s"], none="")]))


def stats_line(result: dict) -> str:
    t = result.get("timings") or {}
    if result.get("finish_reason") == "error":
        return f"error: {result.get('error', '')}"
    if not t:
        return ""
    tokens = t["generated_tokens"]
    parts = [f"first token {duration_text(t['time_to_first_token_s'])}", decode_rate(t["decode_tokens_per_s"], none=""),
             f"answered in {duration_text(t['total_s'])}", counted(tokens, "token")]
    if t.get("projected_decode_tokens_per_s"):  # a simulated device (engine/offload/projection.py)
        parts.append(f"projected on the simulated card: {decode_rate(t['projected_decode_tokens_per_s'])}")
    prompt = f"prompt {t['prompt_tokens']} tokens"
    if result.get("reused_cache_tokens"):
        prompt += f" (+{result['reused_cache_tokens']} cached)"
    parts.append(prompt)
    if t.get("prefill_tokens_per_s"):
        parts.append(f"prefill {t['prefill_tokens_per_s']:.0f} tok/s")
    if result.get("routing_agreement") is not None:
        parts.append(agreement_text(result["routing_agreement"], t["generated_tokens"]))
    split = miss_split_text(result.get("offload") or {})
    if split:
        parts.append(split)
    finish = FINISH.get(result.get("finish_reason"), result.get("finish_reason", ""))
    if result.get("finish_reason") in ("context", "max_length"):  # the limit reached: the sequence's every token
        finish += f" of {result.get('reused_cache_tokens', 0) + t['prompt_tokens'] + tokens} tokens"
    parts.append(finish + (" while reasoning, before any answer" if result.get("cut_in_reasoning") else ""))
    return " · ".join(filter(None, parts))  # no decode rate for an answer whose one token was the prefill's


def shown_html(text: str) -> str:
    """`text` for a KEEP_SPACES paragraph, its lines as streaming inserts them: a \r\n is one line break there."""
    return html.escape(text.replace("\r\n", "\n")).replace("\n", "<br>")


def reasoning_html(entry: dict, index: int, t) -> str:
    """An answer's reasoning: a header that opens and closes it (an anchor), and the text, muted, when open."""
    if not entry.get("reasoning"):
        return ""
    thinking = entry.get("streaming") and not entry["text"]
    words = len(entry["reasoning"].split())
    label = "Thinking…" if thinking else f"Reasoning · {words} word{'s' if words != 1 else ''}"
    arrow = "▾" if entry.get("reasoning_open") else "▸"
    head = (f"<p style='margin-top:2px; margin-bottom:0px; font-size:small'><a href='reasoning:{index}' "
            f"style='color:{t.muted}; text-decoration:none'>{arrow} {label}</a></p>")
    if not entry.get("reasoning_open"):
        return head
    text = shown_html(entry["reasoning"])
    return head + (f"<p style='color:{t.muted}; margin-top:2px; margin-bottom:0px; margin-left:12px; {KEEP_SPACES}'>"
                   f"<i>{text}</i></p>")


def copied_text(entry: dict) -> str:
    """What copy copies of an answer: its text, or its reasoning where it has none (stopped while reasoning)."""
    return entry["text"] or entry.get("reasoning", "")


def _kept_number(options: dict, key: str, default: float | int, whole: bool) -> float | int:
    """A number kept in the chat's options (a settings file, maybe hand-edited), refused unless its box holds it as it
    is: int() would cut 3.7 to 3, read true as 1 and raise OverflowError on 1e400."""
    value = options.get(key, default)
    if type(value) is not int and (whole or type(value) is not float):
        raise TypeError(f"{key} {json.dumps(value)} is not a {'whole ' if whole else ''}number")
    return value


def _number(value: float | int) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


# an answer length below which a model that reasons first is told it may end before it answers (load_hints)
REASONING_TOKENS = 1024
# the chat's answer length for a model that answers at once; one that reasons first has its own
# (LoadedModel.answer_tokens)
ANSWER_TOKENS = 256


class ChatPanel(QWidget):
    sendRequested = Signal(str, dict)
    regenerateRequested = Signal(dict)
    stopRequested = Signal()
    newChatRequested = Signal(str)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("chatPanel")
        # {"role": "user"|"assistant", "text", "stats", "result"}; an answer's also "reasoning", "reasoning_open"
        self.entries: list[dict] = []
        self.busy = False
        self.loaded = False
        self._started = 0.0
        self._streamed = 0
        self._unshown = ""  # streamed text that goes in at the document's end when the pacer shows it
        self._pacer = Pacer(self._show_unshown, self)

        self.transcript = QTextBrowser()
        self.transcript.setOpenLinks(False)
        self.transcript.setAccessibleName("Conversation")
        self.transcript.anchorClicked.connect(self._anchor)
        self.live = OneLineLabel()
        self.live.setAccessibleName("Generation status")

        self.prompt = PromptEdit()
        self.prompt.setPlaceholderText("Message — Enter sends, Shift+Enter for a new line")
        self.prompt.setAccessibleName("Message")
        self.prompt.setMaximumHeight(84)
        self.prompt.setTabChangesFocus(True)
        self.send_button = QPushButton("Send")
        self.send_button.setToolTip("Send  Enter / Ctrl+Return")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setToolTip("Stop the answer  Esc")
        self.regenerate_button = QPushButton("Regenerate")
        self.regenerate_button.setToolTip("Answer the last message again  Ctrl+Shift+R")
        self.copy_button = QPushButton("Copy")
        self.copy_button.setToolTip("Copy the last answer  Ctrl+Shift+C")
        self.new_button = QPushButton("New chat")
        self.new_button.setToolTip("Start over with the system prompt below  Ctrl+N")
        self.settings_button = QToolButton(text="Settings ▾")
        self.settings_button.setCheckable(True)
        self.settings_button.setToolTip("System prompt and sampling")

        # settings
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setPlaceholderText("System prompt (applies from the next new chat)")
        self.system_prompt.setMaximumHeight(60)
        self.system_prompt.setAccessibleName("System prompt")
        self.system_prompt.setTabChangesFocus(True)
        self.max_tokens = AnswerLength(ANSWER_TOKENS)
        self.temperature = QDoubleSpinBox(decimals=2, singleStep=0.1)
        self.temperature.setRange(0.0, 5.0)
        self.temperature.setSpecialValueText("greedy")
        self.top_k = QSpinBox()
        self.top_k.setRange(0, 100_000)
        self.top_k.setSpecialValueText("off")
        self.top_p = QDoubleSpinBox(decimals=2, singleStep=0.05)
        self.top_p.setRange(0.0, 1.0)  # 0: the most likely token, or beside a top-k top-k alone (engine/sampling.py)
        self.top_p.setValue(1.0)
        self.repetition = QDoubleSpinBox(decimals=2, singleStep=0.05)
        self.repetition.setRange(0.5, 3.0)
        self.repetition.setValue(1.0)
        self.seed = QSpinBox()
        self.seed.setRange(-1, 2**31 - 1)
        self.seed.setValue(-1)
        self.seed.setSpecialValueText("random")
        self.stops = QLineEdit()
        self.stops.setPlaceholderText("stop texts, separated by |; a special token, <|im_end|>, is one")
        self.reasoning = ReasoningChoice()  # where the model's chat template has a reasoning setting
        self.model_defaults_button = QPushButton("Model defaults")
        self._model_sampling: dict | None = None  # the loaded model's own sampling (genai_config.json's search)
        self.set_model_sampling(None)
        self.settings_frame = QFrame()
        grid = QGridLayout(self.settings_frame)
        grid.setContentsMargins(0, 0, 0, 0)
        grid.addWidget(self.system_prompt, 0, 0, 1, 6)
        pairs = [("Max tokens", self.max_tokens), ("Temperature", self.temperature), ("Top-k", self.top_k),
                 ("Top-p", self.top_p), ("Repetition", self.repetition), ("Seed", self.seed)]
        for i, (name, widget) in enumerate(pairs):
            label = QLabel(name)
            label.setBuddy(widget)
            widget.setAccessibleName(name)
            grid.addWidget(label, 1 + i // 3, (i % 3) * 2)
            grid.addWidget(widget, 1 + i // 3, (i % 3) * 2 + 1)
        stop_label = QLabel("Stop at")
        stop_label.setBuddy(self.stops)
        grid.addWidget(stop_label, 3, 0)
        grid.addWidget(self.stops, 3, 1, 1, 3)
        reasoning_label = QLabel("Reasoning")
        reasoning_label.setBuddy(self.reasoning)
        grid.addWidget(reasoning_label, 3, 4)
        grid.addWidget(self.reasoning, 3, 5)
        grid.addWidget(self.model_defaults_button, 4, 5)
        self.settings_frame.hide()
        self.settings_button.toggled.connect(self.settings_frame.setVisible)

        actions = QHBoxLayout()  # (the status line has a row of its own: beside the buttons it had ~30 pixels)
        actions.addStretch(1)
        for button in (self.settings_button, self.new_button, self.copy_button, self.regenerate_button):
            actions.addWidget(button)
        input_row = QHBoxLayout()
        input_row.addWidget(self.prompt, 1)
        buttons = QVBoxLayout()
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        input_row.addLayout(buttons)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.transcript, 1)
        layout.addWidget(self.live)
        layout.addLayout(actions)
        layout.addWidget(self.settings_frame)
        layout.addLayout(input_row)

        self.prompt.submitted.connect(self.send)
        self.send_button.clicked.connect(self.send)
        self.stop_button.clicked.connect(self.stopRequested)
        self.regenerate_button.clicked.connect(self.regenerate)
        self.copy_button.clicked.connect(self.copy_last)
        self.new_button.clicked.connect(self.new_chat)
        self.model_defaults_button.clicked.connect(self.use_model_sampling)
        self.set_state(busy=False, loaded=False)
        self.render()

    # --- options ---------------------------------------------------------------------------------
    def options(self) -> dict:
        return {"max_new_tokens": self.max_tokens.value(), "max_new_tokens_chosen": self.max_tokens.chosen is not None,
                "temperature": self.temperature.value(),
                "top_k": self.top_k.value(), "top_p": self.top_p.value(),
                "repetition_penalty": self.repetition.value(), "seed": self.seed.value(),
                "stop_strings": [s for s in STOP_TEXT.findall(self.stops.text()) if s.strip()],
                "reasoning": self.reasoning.currentData()}

    def set_options(self, options: dict) -> None:
        unknown = unknown_key(options, list(self.options()), "chat option")
        if unknown:
            raise ValueError(unknown)
        stops = options.get("stop_strings", [])
        if not isinstance(stops, list) or not all(isinstance(stop, str) for stop in stops):
            raise TypeError(f"stop_strings {json.dumps(stops)} is not a list of strings")
        tokens = _kept_number(options, "max_new_tokens", ANSWER_TOKENS, whole=True)
        if not 1 <= tokens <= MAX_ANSWER_TOKENS:  # (the box would show another, and one below 1 answers 1 token)
            raise ValueError(f"max_new_tokens {tokens} is not a length of 1 to {MAX_ANSWER_TOKENS} tokens")
        # settings saved before the length followed the model hold it, chosen or not: the old default was not chosen
        chosen = options.get("max_new_tokens_chosen", tokens != ANSWER_TOKENS)
        if type(chosen) is not bool:
            raise TypeError(f"max_new_tokens_chosen {json.dumps(chosen)} is not true or false")
        reasoning = options.get("reasoning")
        if reasoning is not None and not isinstance(reasoning, str):
            raise TypeError(f"reasoning {json.dumps(reasoning)} is not a reasoning value or null")
        self.max_tokens.choose(tokens if chosen else None)
        for key, box, _name, default in self._sampling_boxes():
            value = _kept_number(options, key, default, whole=isinstance(box, QSpinBox))
            number = float(value) if isinstance(box, QDoubleSpinBox) else value
            # a box holds its nearest without a word (NaN its least), and a QSpinBox raises past 32 bits
            if not box.minimum() <= number <= box.maximum():
                raise ValueError(f"{key} {json.dumps(value)} is not within {_number(box.minimum())} to "
                                 f"{_number(box.maximum())}")
            box.setValue(number)
        self.stops.setText("|".join(stops))
        self.reasoning.choose(reasoning)

    def set_reasoning_choices(self, choices: list[str]) -> None:
        """The loaded model's reasoning values (engine/reasoning.py), none for a template without the setting."""
        self.reasoning.set_choices(choices)

    def set_model_sampling(self, sampling: dict | None) -> None:
        """The loaded model's own sampling settings (engine_worker._model_sampling), which Model defaults fills in."""
        self._model_sampling = sampling
        self.model_defaults_button.setEnabled(sampling is not None)
        self.model_defaults_button.setToolTip(
            f"Use the model's own sampling settings (its genai_config.json): {sampling['words']}" if sampling
            else "No model loaded, or its genai_config.json's search section holds a value the sampler refuses")

    def _sampling_boxes(self) -> tuple:
        """Each sampling option's key, its box, the box's label and the option's default (the sampler's own)."""
        return (("temperature", self.temperature, "Temperature", 0.0), ("top_k", self.top_k, "Top-k", 0),
                ("top_p", self.top_p, "Top-p", 1.0), ("repetition_penalty", self.repetition, "Repetition", 1.0),
                ("seed", self.seed, "Seed", -1))

    def use_model_sampling(self) -> None:
        """Fill in the model's own sampling, saying which of its values a box cannot hold and what it holds instead
        (the sampler takes values past the boxes' ranges: any temperature, a seed past 32 bits)."""
        if self._model_sampling is None:
            return
        clamped = []
        for key, box, name, _default in self._sampling_boxes():
            value = self._model_sampling[key]
            box.setValue(min(max(value, box.minimum()), box.maximum()))  # (a QSpinBox raises past 32 bits)
            if not box.minimum() <= value <= box.maximum():
                clamped.append(f"{key} {_number(value)} is outside {name}'s {_number(box.minimum())} to "
                               f"{_number(box.maximum())}, set to {_number(box.value())}")
        if clamped:
            self.live.setText("The model's " + "; ".join(clamped) + ".")

    def load_hints(self, reasons_first: bool) -> str:
        """What to say as a model loads: that it samples by its own defaults while the chat answers greedily, and that
        a model which reasons first (engine/reasoning.py) often needs more than a short answer length."""
        hints = ""
        if self._model_sampling is not None and self._model_sampling["temperature"] and not self.temperature.value():
            hints += (f" Its genai_config.json samples ({self._model_sampling['words']}); these answers are greedy: "
                      "Settings ▸ Model defaults.")
        if reasons_first and self.max_tokens.value() < REASONING_TOKENS:
            hints += (f" It reasons before it answers, which often takes more than the {self.max_tokens.value()} "
                      "tokens Settings ▸ Max tokens allows.")
        return hints

    # --- actions ---------------------------------------------------------------------------------
    def send(self) -> None:
        text = self.prompt.toPlainText().strip()
        if not text or self.busy or not self.loaded:
            return
        self.prompt.clear()
        self.entries.append({"role": "user", "text": text})
        self._begin_answer()
        self.sendRequested.emit(text, self.options())

    def regenerate(self) -> None:
        if self.busy or not self.entries or self.entries[-1]["role"] != "assistant":
            return
        last = self.entries.pop()
        self._begin_answer()
        if last.get("result", {}).get("finish_reason") == "error":
            # the engine's conversation never took the failed turn: its message is sent again
            self.sendRequested.emit(self.entries[-2]["text"], self.options())
        else:
            self.entries[-1]["replaces"] = last  # back in its place where Stop comes before the new one begins
            self.regenerateRequested.emit(self.options())

    def new_chat(self) -> None:
        if self.busy:
            return
        self.entries.clear()
        self.render()
        self.set_state(self.busy, self.loaded)  # Regenerate and Copy: no answer left to act on
        self.live.setText("New conversation.")  # (not the statistics of an answer no longer shown)
        self.newChatRequested.emit(self.system_prompt.toPlainText())

    def copy_last(self) -> None:
        last = next((entry for entry in reversed(self.entries) if entry["role"] == "assistant"), None)
        if last is None:
            return
        if not copied_text(last):  # (not the answer before it)
            self.live.setText("The last answer has no text to copy.")
            return
        QGuiApplication.clipboard().setText(copied_text(last))
        self.live.setText("Copied the last answer.")

    def _anchor(self, url: QUrl) -> None:
        if url.scheme() == "reasoning":
            index = int(url.path() or url.host() or 0)
            if 0 <= index < len(self.entries):
                self.entries[index]["reasoning_open"] = not self.entries[index].get("reasoning_open")
                self.render()
        elif url.scheme() == "copy":
            index = int(url.path() or url.host() or 0)
            if 0 <= index < len(self.entries):
                QGuiApplication.clipboard().setText(copied_text(self.entries[index]))
                self.live.setText("Copied.")

    # --- streaming -------------------------------------------------------------------------------
    def _begin_answer(self) -> None:
        self.entries.append({"role": "assistant", "text": "", "reasoning": "", "reasoning_open": True, "stats": "",
                             "streaming": True})
        self._started = time.monotonic()
        self._streamed = 0
        self.render()
        self.live.setText("Waiting for the first token…")

    def append_text(self, delta: str, tokens: int = 1, reasoning: str = "") -> None:
        """The answer's new text and its reasoning's. Text goes in at the document's end, which is where the answer
        (or, before it begins, the open reasoning) ends, with the batches that come before the pacer shows them
        (stream_pacing.py); the entry is drawn again where that changes."""
        if not self.entries or not self.entries[-1].get("streaming"):
            return
        entry = self.entries[-1]
        thinking_began = reasoning and not entry["reasoning"]
        answer_began = delta and not entry["text"] and (entry["reasoning"] or reasoning)
        reasoning_after_answer = reasoning and entry["text"] and entry["reasoning_open"]
        entry["reasoning"] += reasoning
        entry["text"] += delta
        self._streamed += tokens
        if answer_began:
            entry["reasoning_open"] = False  # the answer is what matters now; the reasoning stays a click away
        if thinking_began or answer_began or reasoning_after_answer:
            self.render()
        else:
            self._unshown += (reasoning if entry["reasoning_open"] else "") + delta
            self._pacer.schedule()
        elapsed = time.monotonic() - self._started
        doing = "Thinking" if entry["reasoning"] and not entry["text"] else "Generating"
        self.live.setText(f"{doing}… {counted(self._streamed, 'token')} in {duration_text(elapsed)}")

    def _show_unshown(self) -> None:
        text, self._unshown = self._unshown, ""
        if not text:
            return
        bar = self.transcript.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        cursor = QTextCursor(self.transcript.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertText(text)
        if at_bottom:
            bar.setValue(bar.maximum())

    def finish_answer(self, result: dict) -> None:
        if not self.entries or self.entries[-1]["role"] != "assistant":
            return
        entry = self.entries[-1]
        entry["streaming"] = False
        replaced = entry.pop("replaces", None)
        if result.get("began") is False:  # stopped before the engine began it: not run, its conversation as it was
            self._take_back(replaced)
            return
        if result.get("finish_reason") == "error" and replaced is not None:  # the engine's conversation kept it too
            self.entries[-1] = replaced
            self.render()
            self.live.setText("Could not answer again: the last answer stays.")
            return
        if result.get("finish_reason") != "error" or not entry["text"]:
            entry["text"] = result.get("text", entry["text"]) or entry["text"]
            entry["reasoning"] = result.get("reasoning") or entry["reasoning"]
        entry["stats"] = stats_line(result)
        entry["result"] = result
        if result.get("finish_reason") == "error" and not entry["text"]:
            self.entries.pop()
            if self.entries and self.entries[-1]["role"] == "user":
                self._message_back(self.entries.pop()["text"])
        self.render()
        self.live.setText(entry["stats"] if result.get("finish_reason") != "error" else "")

    def _take_back(self, replaced: dict | None) -> None:
        """The answer Stop ended before it began, gone: the answer it would have replaced back, or its message back in
        the box (before what was typed since), as the engine's conversation has them."""
        self.entries.pop()
        if replaced is not None:
            self.entries.append(replaced)
            said = "the last answer stays"
        else:
            self._message_back(self.entries.pop()["text"])
            said = "message back in the box"
        self.render()
        self.live.setText(f"Stopped before it began: {said}.")

    def _message_back(self, text: str) -> None:
        """A message the engine did not take back in the box, before what was typed there since it was sent."""
        typed = self.prompt.toPlainText()
        self.prompt.setPlainText(text + ("\n" + typed if typed else ""))

    # --- rendering -------------------------------------------------------------------------------
    def welcome_html(self, t) -> str:
        if self.loaded:
            return (f"<p style='color:{t.muted}; margin-top:24px' align='center'>Ask the model something below. "
                    "Enter sends, Shift+Enter starts a new line; Esc stops an answer.</p>")
        keys = [("Ctrl+O", "open a model folder (or drop one on the window)"), ("Ctrl+D", "load the demo model"),
                ("Ctrl+L", "load the open model with the budget panel's settings"), ("Alt+1…7", "show or hide panels"),
                ("F1", "every shortcut")]
        rows = "".join(f"<tr><td align='right' style='color:{t.accent}'><b>{k}</b></td><td>&nbsp;&nbsp;{v}</td></tr>"
                       for k, v in keys)
        return (f"<div align='center' style='margin-top:40px'><p style='font-size:x-large'><b>MoE Workbench</b></p>"
                f"<p style='color:{t.muted}'>Mixture-of-Experts models whose experts don't fit in VRAM: "
                "choose where experts live, watch the machine, chat.</p>"
                f"<table align='center' cellpadding='3' style='margin-top:12px'>{rows}</table></div>")

    def render(self) -> None:
        """The whole transcript, streamed text not shown yet included."""
        self._unshown = ""
        self._pacer.cancel()
        t = theme.current()
        if not self.entries:
            self.transcript.setHtml(self.welcome_html(t))
            return
        blocks = []
        for index, entry in enumerate(self.entries):
            text = shown_html(entry["text"])
            if entry["role"] == "user":
                blocks.append(
                    f"<table width='100%' cellpadding='8' style='margin-top:10px'><tr><td bgcolor='{t.surface}'>"
                    f"<span style='color:{t.muted}; font-size:small'><b>You</b></span><br>"
                    f"<span style='{KEEP_SPACES}'>{text}</span></td></tr></table>")
            else:
                stats = ""
                if entry.get("stats"):
                    stats = (f"<p style='color:{t.muted}; font-size:small; margin-top:2px'>"
                             f"{html.escape(entry['stats'])}"
                             f" · <a href='copy:{index}' style='color:{t.accent}'>copy</a></p>")
                # an answer not begun under open reasoning is left out: the reasoning streams in at the document's end
                answer = (f"<p style='margin-top:2px; margin-bottom:0px; {KEEP_SPACES}'>{text}</p>"
                          if text or not entry.get("reasoning") or not entry.get("reasoning_open") else "")
                blocks.append(f"<p style='margin-top:8px; margin-bottom:0px'>"
                              f"<span style='color:{t.accent}; font-size:small'><b>Model</b></span></p>"
                              f"{reasoning_html(entry, index, t)}{answer}{stats}")
        self.transcript.setHtml("".join(blocks))
        self.transcript.verticalScrollBar().setValue(self.transcript.verticalScrollBar().maximum())

    def set_state(self, busy: bool, loaded: bool, answering: bool = False) -> None:
        """busy: the engine runs something; answering: it is this chat's answer, which Stop stops (and nothing else)."""
        if loaded != self.loaded and not self.entries:
            self.loaded = loaded
            self.render()
        self.busy, self.loaded = busy, loaded
        has_answer = (bool(self.entries) and self.entries[-1]["role"] == "assistant"
                      and not self.entries[-1].get("streaming"))
        self.send_button.setEnabled(loaded and not busy)
        self.stop_button.setEnabled(answering)
        self.regenerate_button.setEnabled(loaded and not busy and has_answer)
        self.new_button.setEnabled(loaded and not busy)
        self.copy_button.setEnabled(has_answer)
        self.prompt.setPlaceholderText("Message — Enter sends, Shift+Enter for a new line" if loaded
                                       else "Load a model first (the demo model is one click away: Ctrl+D)")
