"""The model's tokenizer encodes a prompt as transformers' fast tokenizer does (tokenizers' own settings in
tokenizer.json aside)."""

from __future__ import annotations

import json

from engine.tokenizer import ModelTokenizer
from tests.conftest import fixture_folder

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


def test_streaming_decodes_a_few_tokens_at_each_not_the_whole_answer(monkeypatch):
    """Each token decoded the whole answer so far: at 30,000 tokens (a reasoning model's answer length) 5 ms a token
    on this machine, counted in the decode time and rate. Each now decodes the tokens since the last whole character
    and the few before them, and the text is still what the whole answer decodes to: characters split over tokens,
    special tokens left out or kept, bytes that never make a character."""
    from engine.tokenizer import StreamDecoder

    tokenizer = ModelTokenizer(fixture_folder("gptoss"))
    decoded = []
    plain_decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda ids, **kw: decoded.append(len(ids)) or plain_decode(ids, **kw))
    end, start = tokenizer.token_id("<|end|>"), tokenizer.token_id("<|start|>")
    zhong = tokenizer.encode("中")
    answer = (tokenizer.encode(" héllo 中文 😀 wörld") + [end, start]) * 150 + zhong[:2] + [end] + zhong[:1]
    for keep in (frozenset(), frozenset({end})):
        decoded.clear()
        stream = StreamDecoder(tokenizer, keep)
        pieces = [stream.push(token) for token in answer] + [stream.finish()]
        assert "".join(pieces) == stream.text == plain_decode(answer, keep=keep)
        assert not any(piece.endswith("\ufffd") for piece in pieces[:-2])  # no character shown in halves
        assert sum(decoded) < 6 * len(answer)
