"""The real chat templates of the reasoning models the workbench runs (tests/data/chat_templates, see its README):
they render in the engine's sandbox, the answer's format is recognised from them and the models' own special tokens,
and a conversation feeds each what its template writes."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from engine.reasoning import answer_format
from engine.tokenizer import ModelTokenizer

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Why?"}]


def model_folder(copy_fixture, fixture: str, template: str, special=(), tags=(), eos=()) -> Path:
    """A fixture folder with a real template and the model's tokens that matter here: `special` added as special
    tokens, `tags` as plain added ones (Qwen3's <think> and </think> are not special), `eos` ending an answer."""
    folder = copy_fixture(fixture)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special])
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in tags])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text((TEMPLATES / template).read_text())
    if eos:
        config = json.loads((folder / "genai_config.json").read_text())
        config["model"]["eos_token_id"] = [tokenizer.token_to_id(token) for token in eos]
        (folder / "genai_config.json").write_text(json.dumps(config))
    return folder


def lfm25_folder(copy_fixture) -> Path:
    return model_folder(copy_fixture, "lfm2moe", "LiquidAI-LFM2.5-8B-A1B.jinja", ("<|im_start|>", "<|im_end|>"),
                        ("<think>", "</think>"), ("<|im_end|>",))


def test_lfm25_template_with_its_generation_blocks_renders(copy_fixture):
    """LFM2.5-8B-A1B's template marks the assistant's turns with transformers' {% generation %} (a training mask);
    a chat writes its body as it is. It strips a past turn's reasoning before </think>."""
    tokenizer = ModelTokenizer(lfm25_folder(copy_fixture))
    history = CONVERSATION[:2] + [{"role": "assistant", "content": "<think>Greet.</think>Hello!"}] + CONVERSATION[3:]
    assert tokenizer.render_chat(history) == (
        "<|start|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n")
    assert answer_format(tokenizer).kind == "think"
