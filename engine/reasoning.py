"""Answers that reason before they answer: the model's answer format, recognised from its tokenizer and chat template,
and an answer split into its reasoning and its final text as its tokens come.

- harmony (gpt-oss): `<|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final<|message|>…`.
  Harmony's channels: analysis is the reasoning; final the answer; commentary holds tool calls, and preambles, text
  the model writes for the user before it calls tools (OpenAI's harmony guide: unlike the reasoning, meant to be
  shown). A commentary message is the answer, then, unless it is addressed to a tool (`to=functions.f`, in the header
  before or after <|channel|>): a tool call, which the workbench does not run, is reasoning, shown as
  `→ functions.f: {arguments}`, as is a message of another channel (analysis to a built-in tool among them).
- think tags (Qwen3 and its kin): `<think>…</think>` before the answer, or only `…</think>` where the template's
  generation prompt opened the tag.
- plain: all of it is the answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.errors import PromptError
from engine.tokenizer import ModelTokenizer, StreamDecoder

HARMONY_MARKS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")  # a message's end (the last two are eos tokens too)
OPEN, CLOSE = "<think>", "</think>"
_HARMONY_PIECES = re.compile("(" + "|".join(map(re.escape, HARMONY_MARKS)) + ")")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")  # a harmony header's `to=functions.f`
# the most new tokens an answer that reasons first takes where nothing else says (LoadedModel.answer_tokens): the output
# length Qwen3's model card advises for most queries
REASONING_ANSWER_TOKENS = 32768


@dataclass(frozen=True)
class AnswerFormat:
    kind: str                              # "harmony", "think" or "plain"
    marks: frozenset[int] = frozenset()    # the tokens the split reads: decoded as their text, special or not

    def split(self, tokenizer: ModelTokenizer, prompt_tokens: list[int], named: dict[int, str] | None = None
              ) -> "AnswerSplit":
        """A split for the answer to `prompt_tokens` (whose end may open the answer's first message or tag); `named`:
        the special tokens stop strings name (ModelTokenizer.specials_in), with their text."""
        named = named or {}
        stream = StreamDecoder(tokenizer, self.marks | frozenset(named))
        if self.kind == "harmony":
            opening = _harmony_opening(tokenizer.decode(prompt_tokens, keep=self.marks))
            return AnswerSplit(stream, lambda text, _ended: _split_harmony(opening + text), named)
        if self.kind == "think":
            opened = tokenizer.decode(prompt_tokens, keep=self.marks).rstrip().endswith(OPEN)
            return AnswerSplit(stream, lambda text, ended: _split_think(text, opened, ended), named)
        return AnswerSplit(stream, lambda text, _ended: ("", text), named)


def answer_format(tokenizer: ModelTokenizer) -> AnswerFormat:
    """Harmony where the tokenizer has <|channel|> and <|message|> tokens; think tags where it has <think> and
    </think> tokens or the chat template writes the tags; plain otherwise."""
    def ids(names) -> frozenset[int]:
        return frozenset(i for i in map(tokenizer.token_id, names) if i is not None)

    if tokenizer.token_id("<|channel|>") is not None and tokenizer.token_id("<|message|>") is not None:
        return AnswerFormat("harmony", ids(HARMONY_MARKS))
    tags = ids((OPEN, CLOSE))
    if len(tags) == 2 or CLOSE in _template_source(tokenizer):
        return AnswerFormat("think", tags)
    return AnswerFormat("plain")


def _template_source(tokenizer: ModelTokenizer) -> str:
    return tokenizer.chat_template.source if tokenizer.chat_template is not None else ""


class AnswerSplit:
    """One answer's tokens, as they come, split into `reasoning` and `answer`. Both only grow: what either says while
    the answer streams it still says at the end (incomplete UTF-8 is held back, and an end that may still become a
    closing tag). A special token that stop strings name (`named`) is read as its text, which neither part shows, but
    `written_answer`, the answer where stop strings are looked for (engine/generation.py's VisibleText), holds."""

    def __init__(self, stream: StreamDecoder, parse, named: dict[int, str]):
        self._stream = stream
        self._parse = parse  # (text so far, ended) -> (reasoning, answer)
        self._named = named
        self._reasoning, self._answer = _Part(), _Part()

    def push(self, token: int) -> None:
        self._stream.push(token)
        self._grow(self._parse(self._stream.text, False), self._named.get(token))

    def finish(self) -> None:
        """The answer ends: what was held back is given out (StreamDecoder.finish)."""
        self._stream.finish()
        self._grow(self._parse(self._stream.text, True), None)

    def _grow(self, parts: tuple[str, str], special: str | None) -> None:
        self._reasoning.grow(parts[0], special)
        self._answer.grow(parts[1], special)

    @property
    def reasoning(self) -> str:
        return self._reasoning.shown

    @property
    def answer(self) -> str:
        return self._answer.shown

    @property
    def written_answer(self) -> str:
        return self._answer.written

    def shown_length(self, written_length: int) -> int:
        """How much of `answer` the first `written_length` characters of `written_answer` show."""
        return self._answer.shown_length(written_length)


class _Part:
    """The reasoning or the answer as written, named special tokens as their text, and as shown, without them."""

    def __init__(self):
        self.written = self.shown = ""
        self._hidden: list[tuple[int, int]] = []  # where in `written` a special token's text is

    def grow(self, written: str, special: str | None) -> None:
        """`written` now (it only grows); `special`: the text of the named special token just read, left out of what is
        shown where this part grew by it (not where the format read it as a mark)."""
        new = written[len(self.written):]
        if special and new.endswith(special):
            self._hidden.append((len(written) - len(special), len(written)))
            new = new[:-len(special)]
        self.written, self.shown = written, self.shown + new

    def shown_length(self, written_length: int) -> int:
        return written_length - sum(min(end, written_length) - start
                                    for start, end in self._hidden if start < written_length)


def _harmony_opening(prompt: str) -> str:
    """What the answer continues: the prompt's last message from its <|start|>, less any text of its body (a prompt
    that ends inside a message's body, <|start|>assistant<|channel|>final<|message|>…, has the answer continue it)."""
    at = prompt.rfind("<|start|>")
    if at < 0:
        return ""
    tail = prompt[at:]
    body = tail.rfind("<|message|>")
    if body >= 0 and not any(end in tail[body:] for end in HARMONY_ENDS):
        return tail[:body + len("<|message|>")]
    return tail


def _channel(header: str) -> str | None:
    """A harmony header's channel: `analysis` of `assistant<|channel|>analysis`, `commentary` of
    `<|channel|>commentary to=functions.f <|constrain|>json`; None without one."""
    at = header.rfind("<|channel|>")
    if at < 0:
        return None
    words = header[at + len("<|channel|>"):].split("<|constrain|>")[0].split()
    return words[0] if words else None


def _recipient(header: str) -> str | None:
    """A harmony header's recipient: `functions.f` of `assistant to=functions.f<|channel|>commentary json` and of
    `<|channel|>commentary to=functions.f <|constrain|>json`; None without one."""
    found = _RECIPIENT.search(header)
    return found.group(1) if found else None


def _split_harmony(text: str) -> tuple[str, str]:
    """The final channel's messages and commentary's preambles are the answer, the other messages (tool calls among
    them) the reasoning (the module's docstring); a message without a channel, and text outside any message (a prompt
    without harmony's structure), are the answer too. A header (between <|start|> or <|channel|> and <|message|>) is
    neither."""
    reasoning: list[str] = []
    answer: list[str] = []
    parts, header, state = answer, "", "outside"
    for piece in _HARMONY_PIECES.split(text):
        if piece == "<|start|>" or (piece == "<|channel|>" and state != "header"):
            state, header = "header", piece
        elif piece in ("<|channel|>", "<|constrain|>"):
            header += piece if state == "header" else ""
        elif piece == "<|message|>":
            recipient = _recipient(header)
            parts = answer if recipient is None and _channel(header) in (None, "final", "commentary") else reasoning
            parts.append(f"→ {recipient}: " if recipient else "")
            state, header = "message", ""
        elif piece in HARMONY_ENDS:
            state = "outside"
        elif state == "header":
            header += piece
        elif piece:
            if state == "outside":
                parts, state = answer, "message"
                parts.append("")
            parts[-1] += piece
    return "\n\n".join(p for p in reasoning if p), "\n\n".join(p for p in answer if p)


def _split_think(text: str, opened: bool, ended: bool) -> tuple[str, str]:
    """Reasoning between <think> (or the start, where the prompt `opened` the tag) and </think>, the answer after it;
    an answer that does not begin with <think> is all answer, and one whose tag never closes all reasoning."""
    body = text.lstrip()
    if not opened:
        if not body.startswith(OPEN):
            if not ended and OPEN.startswith(body):  # nothing yet, or the tag's beginning: which one is not known
                return "", ""
            return "", text
        body = body[len(OPEN):]
    close = body.find(CLOSE)
    if close >= 0:
        return body[:close].strip(), body[close + len(CLOSE):].lstrip()
    if not ended:  # an end that may become </think> is held back, and trailing space, which the tag would drop
        held = next((n for n in range(min(len(CLOSE) - 1, len(body)), 0, -1) if body.endswith(CLOSE[:n])), 0)
        body = body[:len(body) - held]
    return body.strip(), ""


# The reasoning settings real chat templates read: gpt-oss's `reasoning_effort` (its system message says "Reasoning:
# low|medium|high", "medium" where unset) and Qwen3's `enable_thinking` (false: the template writes an empty think
# block, so the model answers at once). Where a template reads neither, it has no such setting.
EFFORTS = ("low", "medium", "high")
THINKING = ("on", "off")


def reasoning_choices(tokenizer: ModelTokenizer) -> tuple[str, ...]:
    """The values the model's chat template takes for its reasoning setting (ReasoningChoice), () where it has none."""
    source = _template_source(tokenizer)
    if "reasoning_effort" in source:
        return EFFORTS
    if "enable_thinking" in source:
        return THINKING
    return ()


def reasoning_variables(tokenizer: ModelTokenizer, choice: str | None, said_as: str = "") -> dict:
    """The chat template's variables for `choice` (None: the template's own default); a PromptError naming the
    values this model takes where it takes another, and the choice as `said_as` says it (the command line's option;
    by default "reasoning 'high'")."""
    if choice is None:
        return {}
    choices = reasoning_choices(tokenizer)
    if choice not in choices:
        takes = f"takes {', '.join(choices)}" if choices else "has no reasoning setting"
        named = said_as or f"reasoning '{choice}'"
        raise PromptError(f"{named}: this model's chat template {takes}")
    return {"reasoning_effort": choice} if choices == EFFORTS else {"enable_thinking": choice == "on"}
