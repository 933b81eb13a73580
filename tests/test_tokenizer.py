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


def byte_fallback_tokenizer(folder):
    """A SentencePiece-style tokenizer as Llama's, Mixtral's and Phi-3.5-MoE's tokenizer.json are: characters outside
    the vocabulary as byte tokens, whose decoder makes each run of them one text (each byte U+FFFD where the run is
    not all whole characters)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}, "▁": 259, "a": 260,
             "▁a": 261}
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, text in enumerate(("<unk>", "<s>", "</s>"))],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                           {"type": "Replace", "pattern": {"String": " "},
                                                            "content": "▁"}]},
        "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": ["▁ a"]}}))
    return ModelTokenizer(folder)


def test_an_answer_cut_inside_a_byte_token_character_keeps_what_it_showed(tmp_path):
    """An answer in characters spelt as byte tokens (Chinese, for Llama's tokenizer) cut inside its last one: the
    whole answer decodes that run of bytes as U+FFFD each, 中 among them, which the stream had shown. The stream
    then gave out the whole answer again after it: 'a中a����'. It now gives out U+FFFD for the cut character."""
    from engine.tokenizer import StreamDecoder

    tokenizer = byte_fallback_tokenizer(tmp_path / "llama")
    ids = tokenizer.encode("a中中")
    assert len(ids) == 7, "▁a and three byte tokens for each 中"
    stream = StreamDecoder(tokenizer)
    pieces = [stream.push(token) for token in ids[:5]] + [stream.finish()]
    assert pieces == ["a", "", "", "中", "", "\ufffd"] and stream.text == "a中\ufffd"
