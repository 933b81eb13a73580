"""Fixture model folders that answer in a reasoning format: the gptoss fixture's tokenizer with harmony's special
tokens and a template written as gpt-oss's real one renders (past answers as their final channel, analysis dropped),
or with <think> tags and a template as Qwen3's (reasoning stripped from past answers, the tag opened or not)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer

HARMONY_TOKENS = ("<|channel|>", "<|message|>", "<|return|>", "<|constrain|>", "<|call|>")

HARMONY_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}<|end|>"
    "{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")

THINK_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{{ m['content'].split('</think>')[-1].lstrip() }}"
    "{% else %}{{ m['content'] }}{% endif %}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{{ opening }}{% endif %}")


def _add_tokens(folder: Path, tokens) -> Tokenizer:
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in tokens])
    tokenizer.save(str(folder / "tokenizer.json"))
    return tokenizer


def harmony_folder(copy_fixture) -> Path:
    """<|return|> and <|call|> end an answer, as in gpt-oss's genai_config.json."""
    folder = copy_fixture("gptoss")
    tokenizer = _add_tokens(folder, HARMONY_TOKENS)
    (folder / "chat_template.jinja").write_text(HARMONY_TEMPLATE)
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["eos_token_id"] = [0] + [tokenizer.token_to_id(token) for token in ("<|return|>", "<|call|>")]
    (folder / "genai_config.json").write_text(json.dumps(config))
    return folder


def think_folder(copy_fixture, opened: bool, tag_tokens: bool = True) -> Path:
    """opened: the generation prompt opens <think> (the answer holds only </think>); tag_tokens: the tags are tokens
    of the tokenizer (else only the template writes them: on the lfm2moe fixture, so that a test can have both)."""
    folder = copy_fixture("qwen35moe" if tag_tokens else "lfm2moe")
    if tag_tokens:
        _add_tokens(folder, ("<think>", "</think>"))
    (folder / "chat_template.jinja").write_text(THINK_TEMPLATE.replace("{{ opening }}", "<think>\n" if opened else ""))
    return folder


def thinking_switch_folder(copy_fixture) -> Path:
    """The lfm2moe fixture with a template as Qwen3's that reads enable_thinking: thinking off writes an empty think
    block after the prompt (in tokens of the fixture's own vocabulary: its weights run them), so a prompt rendered
    with the setting has more tokens than one rendered with the template's default."""
    folder = copy_fixture("lfm2moe")
    (folder / "chat_template.jinja").write_text(THINK_TEMPLATE.replace("{{ opening }}", (
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}")))
    return folder


class ScriptedForward:
    """A decoder's forward whose logits pick the scripted tokens in turn (answers of tokens the fixtures' random
    weights never write); `fed` records what each call was given."""

    def __init__(self, vocab: int, tokens: list[int]):
        self.vocab, self.tokens, self.fed = vocab, list(tokens), []

    def __call__(self, state, token_ids):
        self.fed.append(list(token_ids))
        state.advance(len(token_ids))
        logits = np.zeros((len(token_ids), self.vocab), np.float32)
        logits[-1, self.tokens.pop(0)] = 1.0
        return logits


class ScriptedStates:
    """A forward to patch on PartitionedDecoder (an instance: called without the decoder) that writes the same
    scripted answer in every decoder state, each conversation's: two models answering side by side both write it."""

    def __init__(self, vocab: int, tokens: list[int]):
        self.vocab, self.tokens = vocab, list(tokens)
        self.scripts: list[tuple[object, ScriptedForward]] = []  # (state, its script), states kept alive

    def __call__(self, state, token_ids):
        script = next((script for known, script in self.scripts if known is state), None)
        if script is None:
            script = ScriptedForward(self.vocab, self.tokens)
            self.scripts.append((state, script))
        return script(state, token_ids)


def scenario_answers(monkeypatch, module) -> list[tuple[str, int]]:
    """The answer and its token count of every scenario run `module` (which imported run_scenario) makes from now on,
    the indexing of the contention test made instant (its inference is what is looked at)."""
    import engine.records.contention as contention

    monkeypatch.setattr(contention, "index_folder", lambda _folder, _workers: (1, 0.1))
    answered, run_scenario = [], module.run_scenario

    def run(*args, **kwargs):
        record = run_scenario(*args, **kwargs)
        answered.append((record.turns[0]["answer"], record.turns[0]["generated_tokens"]))
        return record

    monkeypatch.setattr(module, "run_scenario", run)
    return answered


def renders_after_the_warm_up(monkeypatch, module) -> list[dict | None]:
    """The template variables of every chat render from now on, those of the model's own warm-up answer that `module`
    (which imported warm_up_answer) makes before its runs left out: the list is emptied as that answer ends."""
    from engine.tokenizer import ModelTokenizer

    rendered, render_chat, warm_up_answer = [], ModelTokenizer.render_chat, module.warm_up_answer

    def render(self, messages, add_generation_prompt=True, variables=None):
        rendered.append(variables)
        return render_chat(self, messages, add_generation_prompt, variables)

    def before_the_runs(*args):
        answered = warm_up_answer(*args)
        rendered.clear()
        return answered

    monkeypatch.setattr(ModelTokenizer, "render_chat", render)
    monkeypatch.setattr(module, "warm_up_answer", before_the_runs)
    return rendered


def awkward_tokens(tokenizer, text: str, every: int = 2) -> list[int]:
    """`text`'s tokens cut at awkward places, as a model may write them: each special token (`<|…|>`) one token, the
    text between encoded `every` characters at a time (so that words, a header's `to=functions.f`, a stop string
    are split across tokens; a character of several bytes is several tokens already in the fixtures' small
    vocabularies)."""
    tokens = []
    for piece in re.split(r"(<\|[a-z_]+\|>)", text):
        chunks = [piece] if piece.startswith("<|") else [piece[i:i + every] for i in range(0, len(piece), every)]
        tokens += [token for chunk in chunks for token in tokenizer.encode(chunk)]
    return tokens
