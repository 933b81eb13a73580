"""Generation on a real model: multi-turn cache reuse, stop conditions, cancellation, sampling."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from engine.errors import PromptError, WorkbenchError
from engine.generation import Conversation, GenerationParams, LoadedModel, generate
from engine.sampling import Sampler, SamplingParams
from tests.conftest import fixture_folder


@pytest.fixture(scope="module")
def model():
    return LoadedModel.open(fixture_folder("qwen35moe"))


def greedy(n: int, **kw) -> GenerationParams:
    return GenerationParams(max_new_tokens=n, **kw)


def test_second_turn_reuses_the_cache_and_equals_a_fresh_run(model):
    chat = Conversation(model, system_prompt="Be brief.")
    first = chat.send("Hello", greedy(6))
    held = list(chat.fed_tokens)
    second = chat.send("Tell me more", greedy(6))
    assert second.reused_cache_tokens == len(held) == len(first.prompt_tokens) + len(first.tokens) - 1
    # The second turn fed only the new tokens; a fresh state fed everything at once agrees.
    fresh = generate(model, model.new_state(), [], held + second.prompt_tokens, greedy(6))
    assert fresh.tokens == second.tokens
    assert len(second.prompt_tokens) < len(held)


def test_a_turn_that_fails_mid_answer_leaves_nothing_in_the_next_turns_context(model, monkeypatch):
    """An error while decoding (the KV cache's growth out of device memory, onnxruntime failing) leaves the failed
    turn's prompt and first answer tokens in the state but not in the messages: the next turn must not build on them."""
    chat = Conversation(model)
    chat.send("Hello", greedy(6))
    monkeypatch.setattr(model.decoder, "forward", _fails(model.decoder.forward, at_call=3))  # the 2nd decode step
    with pytest.raises(WorkbenchError, match="out of device memory"):
        chat.send("Tell me more", greedy(6))
    monkeypatch.undo()
    after = chat.send("Something else", greedy(6))
    without = Conversation(model)  # the same conversation without the failed turn
    without.send("Hello", greedy(6))
    assert after.tokens == without.send("Something else", greedy(6)).tokens
    assert chat.fed_tokens == without.fed_tokens


def test_a_turn_that_fails_after_the_template_rerendered_the_conversation_leaves_nothing_either(model, monkeypatch):
    """A template that renders earlier turns otherwise (a date, a thought left out) has the whole conversation fed
    afresh; when that turn fails, the next one must feed all of it again, not only its own message."""
    chat = Conversation(model)
    chat.send("Hello", greedy(6))
    render, renders = model.tokenizer.render_chat, []

    def dated_once(messages, add_generation_prompt=True, variables=None):  # the second turn's only: a date on top
        renders.append(messages)
        text = render(messages, add_generation_prompt, variables)
        return "Today is Monday.\n" + text if len(renders) == 1 else text

    monkeypatch.setattr(model.tokenizer, "render_chat", dated_once)
    monkeypatch.setattr(model.decoder, "forward", _fails(model.decoder.forward, at_call=2))
    with pytest.raises(WorkbenchError, match="out of device memory"):
        chat.send("Tell me more", greedy(6))
    monkeypatch.undo()
    after = chat.send("Something else", greedy(6))
    conversation = [{"role": "user", "content": "Hello"}, chat.messages[1], {"role": "user", "content": "Something else"}]
    fresh = generate(model, model.new_state(), [], model.tokenizer.encode(model.tokenizer.render_chat(conversation)),
                     greedy(6))
    assert after.prompt_tokens == fresh.prompt_tokens and after.tokens == fresh.tokens


def _fails(forward, at_call: int):
    """`forward`, raising at its call number `at_call` (1 is the first)."""
    calls = []

    def failing(state, token_ids):
        calls.append(len(token_ids))
        if len(calls) == at_call:
            raise WorkbenchError("out of device memory")
        return forward(state, token_ids)

    return failing


def test_approximate_routings_timings_leave_out_the_agreement_meters_passes(monkeypatch):
    """The agreement meter runs every step again with exact routing: its time is no part of the answer's (counted in
    them, it halved the rate an approximate configuration was measured at, in the chat and in its records)."""
    from contextlib import contextmanager

    from engine.offload import OffloadConfig, SimulatedDevice
    from engine.records.scenarios import run_turns

    model = LoadedModel.open(fixture_folder("gptoss"), device=SimulatedDevice(1 << 30),
                             offload=OffloadConfig(device_expert_bytes=0, min_expert_weight=0.5))
    generate(model, model.new_state(), [], model.tokenizer.encode("Hi"), greedy(4))  # the first steps' warm-up
    exact_routing = model.offload.exact_routing

    @contextmanager
    def slow_exact_routing():
        time.sleep(0.2)
        with exact_routing():
            yield

    monkeypatch.setattr(model.offload, "exact_routing", slow_exact_routing)
    started = time.perf_counter()
    result = generate(model, model.new_state(), [], model.tokenizer.encode("Hi"), greedy(4))
    wall = time.perf_counter() - started
    t = result.timings
    assert result.routing_agreement is not None and t.agreement_s >= 4 * 0.2  # the prompt's step and three tokens'
    assert t.total_s + t.agreement_s <= wall and t.decode_s < 3 * 0.2 and t.time_to_first_token_s < 0.2
    started = time.perf_counter()
    record = run_turns(model, ["Hi", "And?"], greedy(4))  # the second turn's meter catches up on the first
    wall = time.perf_counter() - started
    shadow = sum(turn["timings"]["agreement_s"] for turn in record.turns)
    assert shadow >= 2 * 4 * 0.2 + 0.2 and record.timings["completion_s"] <= wall - shadow


def test_a_conversation_that_reaches_the_context_says_so_and_what_to_do(copy_fixture):
    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["context_length"] = 80
    (folder / "genai_config.json").write_text(json.dumps(config))
    chat = Conversation(LoadedModel.open(folder))
    assert chat.send("Hello there", greedy(30)).finish_reason == "length"
    assert chat.send("Tell me more please now", greedy(30)).finish_reason == "context"
    assert len(chat.fed_tokens) == 79  # and the answer's last token, sampled, never fed: 80 in all
    with pytest.raises(PromptError) as refused:
        chat.send("again", greedy(30))
    new = 1 + len(chat.model.tokenizer.encode("<|end|><|start|>user\nagain<|end|><|start|>assistant\n"))
    assert str(refused.value) == (f"the conversation so far (79 tokens) and this message ({new}) come to {79 + new} "
                                  "tokens, past the model's context of 80: start a new conversation")
    with pytest.raises(PromptError, match="^the prompt has 314 tokens but the model's context is 80$"):
        Conversation(chat.model).send("word " * 100, greedy(30))


def test_cancel_between_tokens(model):
    cancel = threading.Event()
    seen = []

    def on_text(token, _delta):
        seen.append(token)
        if len(seen) == 3:
            cancel.set()

    result = generate(model, model.new_state(), [], model.tokenizer.encode("count"), greedy(50), on_text, cancel)
    assert result.finish_reason == "cancelled"
    assert len(result.tokens) == 3


def test_stop_string_trims_the_text(model):
    ids = model.tokenizer.encode("A story")
    full = generate(model, model.new_state(), [], ids, greedy(24))
    visible = full.text.strip()
    assert len(visible) > 6, "the fixture must produce some text"
    stop = visible[3:6]
    stopped = generate(model, model.new_state(), [], ids, greedy(24, stop_strings=(stop,)))
    assert stopped.finish_reason == "stop_string"
    assert stop not in stopped.text and full.text.startswith(stopped.text)


def test_stops_on_eos(copy_fixture):
    folder = copy_fixture("gptoss")
    first = generate(*_fresh(folder), greedy(1)).tokens[0]
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["eos_token_id"] = first
    (folder / "genai_config.json").write_text(json.dumps(config))
    result = generate(*_fresh(folder), greedy(10))
    assert result.finish_reason == "eos" and result.tokens == [first]


def _fresh(folder):
    m = LoadedModel.open(folder)
    return m, m.new_state(), [], m.tokenizer.encode("Hi")


class _ScriptedDecoder:
    """Logits that pick the scripted tokens in turn (a stand-in for the model's decoder)."""

    def __init__(self, vocab: int, tokens: list[int]):
        self.vocab, self.tokens = vocab, list(tokens)

    def forward(self, state, token_ids):
        state.advance(len(token_ids))
        logits = np.zeros((len(token_ids), self.vocab), np.float32)
        logits[-1, self.tokens.pop(0)] = 1.0
        return logits


def _scripted_answer(model, answer_ids: list[int], max_new_tokens: int):
    streamed = []
    result = generate(model, model.new_state(), [], model.tokenizer.encode("Hi"), greedy(max_new_tokens),
                      lambda _token, delta: streamed.append(delta),
                      decoder=_ScriptedDecoder(model.config.vocab_size, answer_ids))
    return result, streamed


def test_an_answer_cut_inside_a_character_keeps_its_bytes(model):
    # "a中b" is a, three byte tokens of 中, b: an answer of three tokens ends inside 中
    a, *zhong, b = model.tokenizer.encode("a中b")
    assert len(zhong) == 3, "the fixture's tokenizer spells 中 in three byte tokens"
    result, streamed = _scripted_answer(model, [a, zhong[0], zhong[1]], 3)
    assert result.finish_reason == "length"
    assert result.text == "a\ufffd" == model.tokenizer.decode(result.tokens)
    assert streamed == ["a", "", "\ufffd"]  # the held-back byte streams with the last token
    whole, streamed = _scripted_answer(model, [a, *zhong, b], 5)
    assert whole.text == "a中b" and streamed == ["a", "", "", "中", "b"]


def test_an_answer_of_bytes_that_never_make_a_character_keeps_them(model):
    # every prefix of this answer decodes to text ending in U+FFFD (two first bytes of 中, then one of é):
    # streaming holds each back, and the answer's text must still be what its tokens decode to
    zhong, e_acute = model.tokenizer.encode("中"), model.tokenizer.encode("é")
    answer = [zhong[0], zhong[0], e_acute[0]]
    result, streamed = _scripted_answer(model, answer, 3)
    assert result.text == model.tokenizer.decode(answer) == "\ufffd" * 3
    assert "".join(streamed) == result.text


def test_streaming_never_shows_a_stop_string_or_what_may_become_one(model):
    answer = model.tokenizer.encode("hello world, and more")
    streamed = []
    result = generate(model, model.new_state(), [], model.tokenizer.encode("Hi"),
                      greedy(len(answer), stop_strings=("lo w", "zz")),
                      lambda token, delta: streamed.append((token, delta)),
                      decoder=_ScriptedDecoder(model.config.vocab_size, answer))
    assert result.finish_reason == "stop_string" and result.text == "hel"
    assert "".join(delta for _t, delta in streamed) == "hel"  # "lo" was held back until it became the stop string
    assert [t for t, _d in streamed] == result.tokens  # one call a token
    # an end held back as a possible stop string is given out when the answer ends without one
    short = model.tokenizer.encode("hello")
    streamed = []
    result = generate(model, model.new_state(), [], model.tokenizer.encode("Hi"), greedy(len(short),
                      stop_strings=("lo w",)), lambda _token, delta: streamed.append(delta),
                      decoder=_ScriptedDecoder(model.config.vocab_size, short))
    assert result.finish_reason == "length" and result.text == "hello" == "".join(streamed)


def test_length_and_timings(model):
    result = generate(model, model.new_state(), [], model.tokenizer.encode("Hi"), greedy(5))
    assert result.finish_reason in ("length", "eos")
    t = result.timings
    assert t.prompt_tokens == len(result.prompt_tokens) and t.generated_tokens == len(result.tokens)
    assert 0 < t.prefill_s <= t.time_to_first_token_s <= t.total_s


def test_no_new_tokens_is_the_prompt_alone(model):
    """max_new_tokens=0 feeds the prompt and answers nothing (the last flush has no token to name)."""
    result = generate(model, model.new_state(), [], model.tokenizer.encode("Hi"), greedy(0))
    assert (result.tokens, result.text, result.reasoning, result.finish_reason) == ([], "", "", "length")


def test_empty_prompt_is_refused(model):
    with pytest.raises(PromptError, match="empty"):
        generate(model, model.new_state(), [], [], greedy(3))


def test_seeded_sampling_is_reproducible(model):
    params = GenerationParams(max_new_tokens=8, sampling=SamplingParams(do_sample=True, temperature=1.5, seed=7))
    ids = model.tokenizer.encode("Hi")
    a = generate(model, model.new_state(), [], ids, params)
    b = generate(model, model.new_state(), [], ids, params)
    assert a.tokens == b.tokens


def test_sampler_distribution_follows_softmax():
    logits = np.log(np.array([0.5, 0.3, 0.2, 1e-9]))
    sampler = Sampler(SamplingParams(do_sample=True, temperature=1.0, seed=0))
    draws = np.bincount([sampler(logits, []) for _ in range(20000)], minlength=4) / 20000
    assert np.allclose(draws, [0.5, 0.3, 0.2, 0.0], atol=0.015)


def test_sampler_top_p_and_top_k_cut_the_tail():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    top_p = Sampler(SamplingParams(do_sample=True, top_p=0.75, seed=1))
    assert set(top_p(logits, []) for _ in range(2000)) == {0, 1}
    top_k = Sampler(SamplingParams(do_sample=True, top_k=1, seed=1))
    assert set(top_k(logits, []) for _ in range(200)) == {0}


def reference_distribution(logits, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """transformers' warpers in their order, written out in NumPy: temperature, top-k, then top-p (the smallest set of
    the most likely tokens whose probability reaches top_p), renormalised."""
    probs = np.exp(logits / temperature - (logits / temperature).max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    kept = order[:top_k] if top_k else order
    within_k = probs[kept] / probs[kept].sum()
    reach = len(kept) if top_p >= 1 else int(np.argmax(np.cumsum(within_k) >= top_p)) + 1
    result = np.zeros_like(probs)
    result[kept[:reach]] = probs[kept[:reach]]
    return result / result.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 5, 1.0), (1.3, 0, 0.6), (0.5, 8, 0.8), (1.0, 100, 0.3)])
def test_sampling_follows_the_reference_warpers(temperature, top_k, top_p):
    logits = np.random.default_rng(1).normal(size=20) * 2  # top_k 100: more than the vocabulary, no limit
    sampler = Sampler(SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, seed=3))
    draws = np.bincount([sampler(logits, []) for _ in range(20000)], minlength=20) / 20000
    expected = reference_distribution(logits, temperature, top_k, top_p)
    assert set(np.flatnonzero(draws)) == set(np.flatnonzero(expected))
    assert np.abs(draws - expected).max() < 0.015


def test_sampling_edge_values_are_greedy():
    logits = np.random.default_rng(2).normal(size=20)
    best = int(np.argmax(logits))
    for params in (SamplingParams(do_sample=True, temperature=0.0, seed=1), SamplingParams(do_sample=True, top_p=0.01),
                   SamplingParams(do_sample=True, top_k=1), SamplingParams(do_sample=True, top_p=0)):
        sampler = Sampler(params)
        assert {sampler(logits, []) for _ in range(50)} == {best}
    with pytest.raises(ValueError, match=r"top_p must be in \[0, 1\], got 1.5"):
        Sampler(SamplingParams(do_sample=True, top_p=1.5))


def test_top_p_0_beside_a_top_k_is_top_k_alone_as_onnxruntime_genai_samples():
    """onnxruntime-genai takes top_p 0 next to a top_k above 1 as no top-p (it samples the top k), and alone as the
    most likely token (its nucleus reaches 0 at the first token); a model's genai_config.json may hold it."""
    logits = np.random.default_rng(4).normal(size=20) * 2
    sampler = Sampler(SamplingParams(do_sample=True, top_k=5, top_p=0, seed=2))
    draws = np.bincount([sampler(logits, []) for _ in range(20000)], minlength=20) / 20000
    expected = reference_distribution(logits, 1.0, 5, 1.0)
    assert set(np.flatnonzero(draws)) == set(np.flatnonzero(expected)) and np.abs(draws - expected).max() < 0.015


def test_repetition_penalty_demotes_seen_tokens():
    logits = np.array([2.0, 1.9, -1.0])
    assert Sampler(SamplingParams())(logits, [0]) == 0
    assert Sampler(SamplingParams(repetition_penalty=1.2))(logits, [0]) == 1


def test_load_time_counts_opening_the_folder(monkeypatch):
    import time

    from engine.model_folder import ModelFolder

    real = ModelFolder.open

    def slow_open(path):
        time.sleep(0.2)
        return real(path)

    monkeypatch.setattr(ModelFolder, "open", staticmethod(slow_open))
    assert LoadedModel.open(fixture_folder("lfm2moe")).load_s >= 0.2


@pytest.mark.parametrize("name", ["gptoss", "lfm2moe", "qwen35moe"])
def test_a_restored_state_snapshot_goes_on_as_a_fresh_state_fed_the_same(name):
    """A snapshot taken after a prompt, restored after more tokens were fed: the next tokens' logits equal a fresh
    state's fed the prompt and those tokens (full-attention KV cut back, sliding-window KV and conv/recurrent state
    restored whole); past its capacity step too (the KV buffers grown in between)."""
    model = LoadedModel.open(fixture_folder(name))
    rng = np.random.default_rng(5)
    prompt, answer, after = (rng.integers(10, 500, n).tolist() for n in (40, 300, 12))
    state = model.new_state()
    model.decoder.forward(state, prompt)
    snapshot = state.snapshot()
    model.decoder.forward(state, answer)  # an answer the next turn's template drops
    for _ in range(3):
        model.decoder.forward(state, [7])
    assert state.snapshot_bytes() > sum(a.nbytes for a in snapshot.arrays if a is not None)  # it grew since
    state.restore(snapshot)
    assert state.past_length == len(prompt)
    assert state.snapshot_bytes() == sum(a.nbytes for a in snapshot.arrays if a is not None)
    ours = model.decoder.forward(state, after)
    fresh = model.new_state()
    model.decoder.forward(fresh, prompt)
    reference = model.decoder.forward(fresh, after)
    assert np.abs(ours - reference).max() <= 1e-5 * np.abs(reference).max()


def test_search_max_length_bounds_prompt_and_answer(copy_fixture):
    """genai_config.json's search.max_length bounds the whole sequence, prompt and answer, as onnxruntime-genai's
    generator does; a prompt that leaves no room for an answer within it is refused, naming it."""
    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["search"]["max_length"] = 40
    (folder / "genai_config.json").write_text(json.dumps(config))
    model = LoadedModel.open(folder)
    state, fed, ids = model.new_state(), [], model.tokenizer.encode("Hi")
    result = generate(model, state, fed, ids, greedy(100))
    assert result.finish_reason == "max_length"
    assert len(ids) + len(result.tokens) == 40 and state.past_length == 40 - 1  # the last token is sampled, not fed
    with pytest.raises(PromptError, match="^the prompt has 40 tokens, which leaves no room for an answer within the "
                                          "model's genai_config.json search.max_length of 40, prompt and answer "
                                          "together$"):
        generate(model, model.new_state(), [], model.tokenizer.encode("word " * 50)[:40], greedy(5))


def test_a_max_length_equal_to_the_context_ends_the_sequence_at_it(copy_fixture):
    """Every builder folder writes search.max_length as the context length: the sequence, prompt and answer with the
    last sampled token (never fed), reaches it and no further, as onnxruntime-genai's generator stops there (it counts
    the sampled token in the sequence); it used to run one token past, to the context fed and one more sampled."""
    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["context_length"] = config["search"]["max_length"] = 40
    (folder / "genai_config.json").write_text(json.dumps(config))
    model = LoadedModel.open(folder)
    state, ids = model.new_state(), model.tokenizer.encode("Hi")
    result = generate(model, state, [], ids, greedy(100))
    assert result.finish_reason == "context"
    assert len(ids) + len(result.tokens) == 40 and state.past_length == 40 - 1
    words = model.tokenizer.encode("word " * 50)
    assert len(generate(model, model.new_state(), [], words[:39], greedy(5)).tokens) == 1
    with pytest.raises(PromptError, match="^the prompt has 40 tokens, which leaves no room for an answer within the "
                                          "model's context of 40$"):
        generate(model, model.new_state(), [], words[:40], greedy(5))


def test_search_min_length_holds_off_the_end_of_text(copy_fixture):
    """genai_config.json's search.min_length: no end-of-text token while the sequence, prompt and answer, is shorter
    (onnxruntime-genai's ApplyMinLength), the tokens before it as without."""
    folder = copy_fixture("gptoss")
    model = LoadedModel.open(folder)
    ids = model.tokenizer.encode("Hello there")
    free = generate(model, model.new_state(), [], ids, greedy(20))
    assert free.finish_reason == "eos" and len(free.tokens) < 10, "the fixture must end early"
    config = json.loads((folder / "genai_config.json").read_text())
    config["search"]["min_length"] = len(ids) + 10
    (folder / "genai_config.json").write_text(json.dumps(config))
    model = LoadedModel.open(folder)
    held = generate(model, model.new_state(), [], ids, greedy(20))
    assert held.tokens[:len(free.tokens) - 1] == free.tokens[:-1]
    assert not set(held.tokens[:10]) & model.eos_ids and len(held.tokens) > 10


def test_a_sliding_window_wider_than_the_context_keeps_its_whole_window(copy_fixture):
    """gptoss's window is 64 slots: with a 40-token context its sliding layer's KV buffer still holds 64 rows, as
    onnxruntime's GroupQueryAttention demands ("KV cache capacity (40) must be at least local_window_size (64)"
    where it holds fewer), and answers to the context's end as with a context the window fits in."""
    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["context_length"] = 40
    (folder / "genai_config.json").write_text(json.dumps(config))
    model = LoadedModel.open(folder)
    state, ids = model.new_state(), model.tokenizer.encode("Hi")
    narrow = generate(model, state, [], ids, greedy(100))
    assert narrow.finish_reason == "context" and state.past_length == 40 - 1
    rows = {slot.past_name: slot.array.shape[2] for slot in state.slots if slot.shared}
    assert rows == {"past_key_values.0.key": 64, "past_key_values.0.value": 64,  # the sliding layer: its window
                    "past_key_values.1.key": 40, "past_key_values.1.value": 40}
    wide = LoadedModel.open(fixture_folder("gptoss"))  # context 2048
    assert generate(wide, wide.new_state(), [], ids, greedy(len(narrow.tokens))).tokens == narrow.tokens


def test_a_conversation_fed_again_whole_past_the_context_is_called_the_conversation_not_the_prompt(copy_fixture):
    """Regenerate on a model that answers at once feeds the earlier turns afresh: refused there, the message spoke of
    "the prompt" of 122 tokens (the user's was a few) and said nothing of starting a new conversation."""
    folder = copy_fixture("qwen35moe")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["context_length"] = 100
    (folder / "genai_config.json").write_text(json.dumps(config))
    chat = Conversation(LoadedModel.open(folder))
    assert [chat.send(text, greedy(20)).finish_reason for text in ("Hello there", "Tell me more", "Go on")][-1] == "context"
    fed_again = len(chat.model.tokenizer.encode(chat.model.tokenizer.render_chat(chat.messages[:-1],
                                                                                 add_generation_prompt=True)))
    assert fed_again > 100
    with pytest.raises(PromptError) as refused:
        chat.regenerate(greedy(20))
    assert str(refused.value) == (f"the conversation so far, fed again whole, and this message come to {fed_again} "
                                  "tokens, past the model's context of 100: start a new conversation")
