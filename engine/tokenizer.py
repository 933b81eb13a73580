"""The model's tokenizer (HF tokenizers, tokenizer.json) and chat template (sandboxed Jinja2)."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from engine.errors import (ModelFileError, PromptError, WorkbenchError, lfs_pointer, no_link_loop, not_a_file,
                           read_model_json, read_model_text)
from engine.units import counted

# the special tokens transformers hands a chat template (its special_tokens_map), where tokenizer_config.json sets them
SPECIAL_TOKEN_NAMES = ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
RENDER_LIMIT_S = 2.0  # a chat template renders in milliseconds; one still running after this is refused
RENDER_MAX_CHARS = 4_000_000  # the most a * or ** in a template may make (a string, a list, a number's digits)
LIPSUM_MAX_WORDS = 100_000  # the most a lipsum() may make (a tenth of a second)


def _token_text(value, origin: str, field: str) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...} (null: none). Another value, a
    number or a list, was read as no token: the template then rendered without it (an eos_token of ''), unsaid."""
    text = value.get("content") if isinstance(value, dict) else value
    if text is None and not isinstance(value, dict) or isinstance(text, str):
        return text
    raise ModelFileError(f"{origin}: '{field}' is {json.dumps(value)[:40]}, not a token's text (a string or "
                         '{"content": "..."})')


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson for chat templates: Jinja2's own escapes <, >, & and ' for HTML (\\u003c...) and every
    non-ASCII character, which would put other text (and other tokens) in the prompt than the model was trained on."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja2's sandbox, bounded in time and size: a template that loops for ever or multiplies a string into
    gigabytes would hang the engine thread, which Stop cannot interrupt. Every call the template makes (range() among
    them: jinja2's sandbox caps each at 100,000 items) and every round of a loop check a deadline, and * and ** check
    what they would make."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, **options):
        super().__init__(**options)
        self.deadline = float("inf")
        self.globals["lipsum"] = self._lipsum

    @staticmethod
    def _lipsum(n=5, html=True, min=20, max=100):  # noqa: A002 (jinja2's own names)
        """Jinja2's lipsum, which makes its paragraphs (each of `max` words at most) in one call: bounded as a loop."""
        if n * max > LIPSUM_MAX_WORDS:
            raise jinja2.exceptions.SecurityError(f"lipsum({n}) would make up to {n * max:,} words")
        return jinja2.utils.generate_lorem_ipsum(n, html, min, max)

    def _in_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise jinja2.exceptions.SecurityError(f"still rendering after {RENDER_LIMIT_S:g} s (a loop without end?)")

    def unsafe_undefined(self, obj, attribute):
        """A refused attribute (__class__, a list's append) stops the render: the sandbox's undefined value for it
        would write nothing, a prompt other than the template says."""
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe.")

    def paced(self, items):
        """What a {% for %} goes over, checking the deadline at each round (ChatTemplate wraps every loop in it)."""
        for item in items:
            self._in_time()
            yield item

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
        __self._in_time()
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context, operator, left, right):
        self._in_time()
        if operator == "*":
            for items, count in ((left, right), (right, left)):
                if (isinstance(items, (str, list, tuple)) and isinstance(count, int)
                        and len(items) * count > RENDER_MAX_CHARS):
                    raise jinja2.exceptions.SecurityError(f"a * would make {len(items) * count:,} items")
        elif (isinstance(left, int) and isinstance(right, int) and abs(left) > 1
              and right * abs(left).bit_length() > 4 * RENDER_MAX_CHARS):  # the bits ** would make
            raise jinja2.exceptions.SecurityError(f"{left} ** {right} is too large")
        return super().call_binop(context, operator, left, right)


class _GenerationBlocks(jinja2.ext.Extension):
    """transformers' {% generation %}…{% endgeneration %} around an assistant's turn (LFM2.5's template has it): it
    marks the tokens a training run learns from; a chat writes the body as it is, in a scope of its own as
    transformers' call block gives it."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _paced_loops(template: jinja2.nodes.Template) -> jinja2.nodes.Template:
    """Each {% for %} of `template` over the environment's `paced(…)` (a name no template can set): a loop that calls
    nothing (nested loops over a range made once) would otherwise run past the deadline, which calls, * and ** check."""
    for loop in template.find_all(jinja2.nodes.For):
        loop.iter = jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute("paced"), [loop.iter], [], None, None,
                                      lineno=loop.lineno)
    return template


class ChatTemplate:
    """A chat template rendered in a sandbox: a model folder is data, never code."""

    def __init__(self, source: str, origin: str, special_tokens: dict[str, str | None]):
        self.origin = origin
        # The same environment transformers uses for chat templates, sandboxed, and bounded.
        env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                              extensions=["jinja2.ext.loopcontrols", _GenerationBlocks])
        env.globals["raise_exception"] = self._raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(_paced_loops(env.parse(source)))
        except jinja2.TemplateError as exc:
            raise ModelFileError(f"{origin}: chat template does not parse ({exc})") from None
        self._special = special_tokens
        self._env = env
        self.source = source

    def _raise(self, message: str):
        raise PromptError(f"{self.origin}: the chat template refused the conversation: {message}")

    def render(self, messages: list[dict], add_generation_prompt: bool = True, variables: dict | None = None) -> str:
        """`variables`: what else the template reads (a reasoning setting: engine/reasoning.py)."""
        self._env.deadline = time.monotonic() + RENDER_LIMIT_S
        try:
            rendered = self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._special, **(variables or {}))
        except WorkbenchError:  # raise_exception's refusal
            raise
        except Exception as exc:  # the template's own faults: 1/0, a recursion, a loop too long, too much memory
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ModelFileError(f"{self.origin}: chat template failed to render ({reason})") from None
        if messages and not rendered.strip():  # (one that reads another name than `messages`)
            raise ModelFileError(f"{self.origin}: the chat template wrote nothing for a conversation of "
                                 f"{counted(len(messages), 'message')}")
        # what the template adds to the conversation is bounded as * is: a filter (center, indent, format) makes
        # gigabytes in one call, which the tokenizer then took minutes and as many gigabytes again to refuse
        conversation = sum(len(str(value)) for message in messages for value in message.values())
        if len(rendered) > conversation + RENDER_MAX_CHARS:
            raise ModelFileError(f"{self.origin}: the chat template wrote {len(rendered):,} characters for a "
                                 f"conversation of {conversation:,}; a template may add {RENDER_MAX_CHARS:,} at most")
        return rendered


class ModelTokenizer:
    """Encodes prompts, decodes streamed tokens, and applies the chat template."""

    def __init__(self, folder: Path):
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not no_link_loop(path).is_file():
            raise ModelFileError(f"{path}: {not_a_file(path)}")
        text = read_model_text(path)
        try:
            self._tok = Tokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            reason = lfs_pointer(path) or f"not a valid tokenizer ({str(exc).splitlines()[0]})"
            raise ModelFileError(f"{path}: {reason}") from None
        # the truncation and padding a training run may have left in tokenizer.json would cut or pad every prompt:
        # off, as transformers has them unless a call asks
        self._tok.no_truncation()
        self._tok.no_padding()
        config = self._read_config(folder / "tokenizer_config.json")
        origin = str(folder / "tokenizer_config.json")
        self.bos_token = _token_text(config.get("bos_token"), origin, "bos_token")
        self.eos_token = _token_text(config.get("eos_token"), origin, "eos_token")
        self.chat_template = self._load_template(folder, config)
        self.special_ids = frozenset(i for i, token in self._tok.get_added_tokens_decoder().items() if token.special)

    @staticmethod
    def _read_config(path: Path) -> dict:
        if not no_link_loop(path).is_file():
            return {}
        config = read_model_json(path)
        if not isinstance(config, dict):
            raise ModelFileError(f"{path}: expected a JSON object")
        return config

    def _load_template(self, folder: Path, config: dict) -> ChatTemplate | None:
        special = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        origin = str(folder / "tokenizer_config.json")
        special.update((name, text) for name in SPECIAL_TOKEN_NAMES
                       if (text := _token_text(config.get(name), origin, name)))
        extra = config.get("additional_special_tokens")
        if extra is not None and not isinstance(extra, list):  # (a bare string was passed over, as no tokens)
            raise ModelFileError(f"{origin}: 'additional_special_tokens' is {json.dumps(extra)[:40]}, not a list of "
                                 "tokens' texts")
        if extra is not None:
            special["additional_special_tokens"] = [
                text for token in extra if (text := _token_text(token, origin, "additional_special_tokens"))]
        jinja_file = folder / "chat_template.jinja"
        if no_link_loop(jinja_file).is_file():
            return ChatTemplate(read_model_text(jinja_file), str(jinja_file), special)
        if jinja_file.exists():  # a folder (or a device) of that name: the model's template was meant to be there
            raise ModelFileError(f"{jinja_file}: {not_a_file(jinja_file)}")
        template = config.get("chat_template")
        if template is not None and not isinstance(template, (str, list, dict)):
            raise ModelFileError(f"{origin}: 'chat_template' is {json.dumps(template)[:40]}, not a template or a list "
                                 "of named templates")
        # transformers' named templates: [{"name": "default", "template": "..."}, ...], or the {name: template} it
        # reads them into; an entry of another form was passed over, and the error named no fault of it
        if isinstance(template, list):
            for item in template:
                if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                        and isinstance(item.get("template"), str)):
                    raise ModelFileError(f"{origin}: 'chat_template' holds {json.dumps(item)[:40]}, not a named "
                                         'template ({"name": "...", "template": "..."})')
            template = {item["name"]: item["template"] for item in template}
        if isinstance(template, dict):
            if "default" not in template:
                raise ModelFileError(f"{origin}: chat_template names templates {sorted(map(str, template))} but no "
                                     "'default' one")
            if not isinstance(template["default"], str):
                raise ModelFileError(f"{origin}: 'chat_template.default' is {json.dumps(template['default'])[:40]}, "
                                     "not a template")
            template, origin = template["default"], f"{origin} (chat template 'default')"
        if isinstance(template, str):
            return ChatTemplate(template, origin, special)
        return None

    def same_as(self, other: "ModelTokenizer") -> bool:
        """Whether `other` maps text to the same token ids (the same vocabulary, merges and special tokens)."""
        return self._tok.to_str() == other._tok.to_str()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The tokens of `text`; add_special_tokens: with what the tokenizer's post-processor adds (a BOS), which a
        rendered chat template already holds where the model wants it."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True, keep: frozenset[int] = frozenset()) -> str:
        """keep: special tokens written as their text all the same (the marks an answer's format reads)."""
        if keep and skip_special_tokens:
            ids, skip_special_tokens = [i for i in ids if i in keep or i not in self.special_ids], False
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def specials_in(self, texts) -> dict[int, str]:
        """The special tokens whose text is in one of `texts` (stop strings that name <|im_end|>), with their text."""
        return {i: token.content for i, token in self._tok.get_added_tokens_decoder().items()
                if token.special and any(token.content in text for text in texts)}

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self._tok.token_to_id(text)

    def template_fault(self) -> str | None:
        """Why the chat template cannot render a conversation of one user message (a chat's first prompt), rendered
        as a chat renders it (the same sandbox and time limit): a template that raises, fails or loops fails every
        chat, which inspect says before a load. None where it renders, or where there is none (--raw needs none)."""
        if self.chat_template is None:
            return None
        try:
            self.chat_template.render([{"role": "user", "content": "Hello"}])
        except WorkbenchError as exc:
            return str(exc)
        return None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, variables: dict | None = None) -> str:
        if self.chat_template is None:
            raise PromptError("this model has no chat template (in tokenizer_config.json or chat_template.jinja), which a "
                              "chat needs: 'moe-workbench generate --raw' feeds a prompt as it is")
        return self.chat_template.render(messages, add_generation_prompt, variables)


class StreamDecoder:
    """Turns a growing list of token ids into text increments, holding back incomplete UTF-8; `keep`: special tokens
    written as their text (ModelTokenizer.decode).

    Each token decodes a window of the last tokens, not the whole answer (at 30,000 tokens that took 5 ms a token):
    the tokens since the text given out last, after the ones that gave it, whose text is taken off the window's (as
    text-generation-inference does). Given-out text always ends on a whole character, so the window starts on one;
    the tokens before it give a decoder that drops a first token's leading space (SentencePiece's) its context."""

    def __init__(self, tokenizer: ModelTokenizer, keep: frozenset[int] = frozenset()):
        self._tokenizer = tokenizer
        self._keep = keep
        self._ids: list[int] = []  # the special tokens not kept are left out as they come
        self._start = 0  # where the window begins
        self._given = 0  # the tokens whose text is given out (from _start: the window's context)
        self._emitted = ""

    def push(self, token_id: int) -> str:
        if token_id in self._keep or token_id not in self._tokenizer.special_ids:
            self._ids.append(token_id)
        return self._advance(final=False)

    def finish(self) -> str:
        """What push held back when the answer ends: bytes that never made a whole character (an answer cut inside
        one, or bytes a model writes that no character has) stay as U+FFFD, as a plain decode shows them. Without
        this, an answer whose every prefix ends so kept no text at all."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        window = self._decode(self._ids[self._start:])
        if window.endswith("\ufffd") and not final:
            return ""  # a multi-byte character is not complete yet
        context = self._decode(self._ids[self._start:self._given])
        # a window whose text does not begin with the context's: a decoder that reads a run of byte tokens as one
        # (SentencePiece's ByteFallback: U+FFFD for each byte of a run cut inside a character, its whole characters
        # too, which were given out already), the new tokens decoded alone
        delta = window[len(context):] if window.startswith(context) else self._decode(self._ids[self._given:])
        self._emitted += delta
        if len(self._ids) > self._given:  # (a special token left out moves nothing)
            self._start, self._given = self._given, len(self._ids)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    @property
    def text(self) -> str:
        return self._emitted
