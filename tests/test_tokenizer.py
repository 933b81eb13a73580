"""The model's tokenizer encodes a prompt as transformers' fast tokenizer does (tokenizers' own settings in
tokenizer.json aside)."""

from __future__ import annotations

import json

from engine.tokenizer import ModelTokenizer

LONG = "hello world, this is a prompt of more than eight tokens"


def test_a_tokenizer_json_that_truncates_or_pads_leaves_the_prompt_whole(copy_fixture):
    """tokenizer.json may carry the truncation and padding a training run set (fine-tuned and re-quantized models'
    often do). tokenizers applies them to every encode: a prompt past max_length lost its end, the generation prompt
    among it, and a short one gained pad tokens after it. transformers turns both off unless a call asks for them."""
    folder = copy_fixture("gptoss")
    plain = ModelTokenizer(folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    data["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    data["padding"] = {"strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                       "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    (folder / "tokenizer.json").write_text(json.dumps(data))
    tokenizer = ModelTokenizer(folder)
    assert len(plain.encode(LONG)) > 8
    for text in (LONG, "hi", plain.render_chat([{"role": "user", "content": LONG}])):
        assert tokenizer.encode(text) == plain.encode(text)
        assert tokenizer.encode(text, add_special_tokens=True) == plain.encode(text, add_special_tokens=True)
    assert tokenizer.same_as(plain)
