"""Answers that reason first (engine/reasoning.py): the format recognised from the tokenizer and template, the split
into reasoning and answer as tokens stream, stop strings on the answer only, and the conversation's history."""

from __future__ import annotations

import json
import threading

import pytest

from engine.errors import PromptError
from engine.generation import Conversation, GenerationParams, LoadedModel, generate
from engine.reasoning import REASONING_ANSWER_TOKENS, answer_format
from engine.tokenizer import ModelTokenizer
from tests.conftest import fixture_folder
from tests.reasoning_models import (ScriptedForward, ScriptedStates, awkward_tokens, harmony_folder,
                                    renders_after_the_warm_up, scenario_answers, think_folder, thinking_switch_folder)

ANALYSIS_THEN_FINAL = ("<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
                       "<|start|>assistant<|channel|>final<|message|>Hello there!")
HARMONY_PROMPT = "<|start|>user<|message|>Hi<|end|><|start|>assistant"


@pytest.fixture
def harmony(copy_fixture):
    return ModelTokenizer(harmony_folder(copy_fixture))


def stream(tokenizer, answer: str | list[int], prompt: str, end: int | None = None):
    """Push `answer`'s tokens (the first `end` of them) into a split for `prompt`: the (reasoning, answer) after each
    token, and the split after finish."""
    split = answer_format(tokenizer).split(tokenizer, tokenizer.encode(prompt))
    steps = []
    for token in (tokenizer.encode(answer) if isinstance(answer, str) else answer)[:end]:
        split.push(token)
        steps.append((split.reasoning, split.answer))
    split.finish()
    return steps, split


def grows(steps) -> bool:
    """Each part only grows, token by token: what streamed is never taken back."""
    return all(a.startswith(b) and x.startswith(y) for (b, y), (a, x) in zip(steps, steps[1:]))


def test_the_format_is_recognised_from_the_tokens_and_the_template(copy_fixture, harmony):
    assert answer_format(ModelTokenizer(fixture_folder("gptoss"))).kind == "plain"
    recognised = answer_format(harmony)
    assert recognised.kind == "harmony"
    assert {harmony.token_id(t) for t in ("<|channel|>", "<|message|>", "<|start|>", "<|end|>")} <= recognised.marks
    assert answer_format(ModelTokenizer(think_folder(copy_fixture, opened=False))).kind == "think"
    only_template = answer_format(ModelTokenizer(think_folder(copy_fixture, opened=True, tag_tokens=False)))
    assert only_template.kind == "think" and not only_template.marks


def test_harmony_analysis_then_final(harmony):
    steps, split = stream(harmony, ANALYSIS_THEN_FINAL, HARMONY_PROMPT)
    assert (split.reasoning, split.answer) == ("The user greets; answer briefly.", "Hello there!")
    assert grows(steps) and steps[-1] == (split.reasoning, split.answer)
    # no header ever shows: the answer is empty until the final channel's message begins
    first = next(i for i, (_r, a) in enumerate(steps) if a)
    assert steps[first - 1] == ("The user greets; answer briefly.", "") and steps[first][1] == "H"
    assert not any("analysis" in r or "assistant" in a or "final" in a for r, a in steps)


def test_harmony_final_only(harmony):
    _steps, split = stream(harmony, "<|channel|>final<|message|>Just this.", HARMONY_PROMPT)
    assert (split.reasoning, split.answer) == ("", "Just this.")


# A preamble on the commentary channel (text for the user before tool calls), then two tool calls: the recipient
# after the channel, as OpenAI's harmony guide writes it, and before it, as gpt-oss's chat template writes a past call.
PREAMBLE_AND_CALLS = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking Paris… then Rome.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
    "<|call|>"
    '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}<|call|>'
    "<|start|>assistant<|channel|>final<|message|>Sunny in both.")


def test_harmony_commentary_is_the_answer_unless_it_calls_a_tool(harmony):
    """Streamed in tokens cut inside words, headers and a character of three bytes: the preamble shows as the answer
    as it comes, before the calls; a tool call is reasoning, under its recipient; the answer never shows a header or
    a call's arguments, and neither part ever takes back what it showed."""
    tokens = awkward_tokens(harmony, PREAMBLE_AND_CALLS)
    assert len(tokens) > len(harmony.encode(PREAMBLE_AND_CALLS)) and harmony.decode(tokens, False) == PREAMBLE_AND_CALLS
    steps, split = stream(harmony, tokens, HARMONY_PROMPT)
    calls = '→ functions.get_weather: {"city": "Paris"}\n\n→ functions.get_weather: {"city": "Rome"}'
    assert (split.reasoning, split.answer) == ("Need the weather.\n\n" + calls,
                                               "Checking Paris… then Rome.\n\nSunny in both.")
    assert grows(steps) and ("Need the weather.", "Checking Paris… then Rome.") in steps
    assert not any(word in answer for _r, answer in steps for word in ("commentary", "to=", "json", "city", "\ufffd"))


def test_harmony_cut_inside_the_analysis_is_reasoning_only(harmony):
    tokens = harmony.encode(ANALYSIS_THEN_FINAL)
    cut = harmony.encode("<|channel|>analysis<|message|>The user")
    assert tokens[:len(cut)] == cut
    _steps, split = stream(harmony, ANALYSIS_THEN_FINAL, HARMONY_PROMPT, end=len(cut))
    assert (split.reasoning, split.answer) == ("The user", "")


def test_harmony_prompt_that_opens_the_final_message(harmony):
    _steps, split = stream(harmony, "Continued.", HARMONY_PROMPT + "<|channel|>final<|message|>Prefilled ")
    assert (split.reasoning, split.answer) == ("", "Continued.")


def test_harmony_reasoning_holds_back_an_incomplete_character(harmony):
    steps, split = stream(harmony, "<|channel|>analysis<|message|>a中b<|end|>", HARMONY_PROMPT)
    assert split.reasoning == "a中b" and grows(steps)
    assert not any("\ufffd" in r for r, _a in steps)


@pytest.mark.parametrize("tag_tokens", [True, False])
def test_think_tags_written_by_the_model(copy_fixture, tag_tokens):
    tokenizer = ModelTokenizer(think_folder(copy_fixture, opened=False, tag_tokens=tag_tokens))
    steps, split = stream(tokenizer, "<think>\nFirst, greet.\n</think>\n\nHello!", "<|start|>user\nHi<|end|>\n")
    assert (split.reasoning, split.answer) == ("First, greet.", "Hello!")
    assert grows(steps) and steps[-1] == ("First, greet.", "Hello!")
    assert not any("<" in r + a for r, a in steps)  # neither tag, nor a beginning of one, ever shows
    _steps, split = stream(tokenizer, "No thinking here.", "<|start|>user\nHi<|end|>\n")
    assert (split.reasoning, split.answer) == ("", "No thinking here.")


def test_think_tag_opened_by_the_template_and_never_closed(copy_fixture):
    tokenizer = ModelTokenizer(think_folder(copy_fixture, opened=True))
    prompt = tokenizer.render_chat([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<think>\n")
    steps, split = stream(tokenizer, "Greet back.\n</think>\n\nHello!", prompt)
    assert (split.reasoning, split.answer) == ("Greet back.", "Hello!") and grows(steps)
    steps, split = stream(tokenizer, "Greet back, then wait", prompt)
    assert (split.reasoning, split.answer) == ("Greet back, then wait", "")


@pytest.fixture
def harmony_model(copy_fixture):
    return LoadedModel.open(harmony_folder(copy_fixture))


def scripted_answer(model, monkeypatch, answer: str, **params):
    """`answer` generated (its tokens forced, then <|return|>), streamed through generate."""
    tokens = model.tokenizer.encode(answer) + [model.tokenizer.token_id("<|return|>")]
    monkeypatch.setattr(model.decoder, "forward", ScriptedForward(model.tokenizer.vocab_size, tokens))
    pieces = []
    result = generate(model, model.new_state(), [], model.tokenizer.encode(HARMONY_PROMPT),
                      GenerationParams(max_new_tokens=params.pop("max_new_tokens", len(tokens)), **params),
                      lambda token, delta: pieces.append(("answer", token, delta)),
                      on_reasoning=lambda token, delta: pieces.append(("reasoning", token, delta)))
    return result, pieces


def test_generate_streams_both_parts_and_the_result_holds_them(harmony_model, monkeypatch):
    result, pieces = scripted_answer(harmony_model, monkeypatch, ANALYSIS_THEN_FINAL)
    assert result.finish_reason == "eos" and not result.cut_in_reasoning
    assert (result.reasoning, result.text) == ("The user greets; answer briefly.", "Hello there!")
    assert "".join(d for kind, _t, d in pieces if kind == "reasoning") == result.reasoning
    assert "".join(d for kind, _t, d in pieces if kind == "answer") == result.text
    # both callbacks once a token, the reasoning's first: the generated tokens but the eos
    assert [t for kind, t, _d in pieces if kind == "answer"] == result.tokens[:-1]
    assert [t for kind, t, _d in pieces if kind == "reasoning"] == result.tokens[:-1]


def test_a_stop_string_applies_to_the_answer_only(harmony_model, monkeypatch):
    result, pieces = scripted_answer(harmony_model, monkeypatch, ANALYSIS_THEN_FINAL, stop_strings=("briefly", "re!"))
    assert result.finish_reason == "stop_string"
    assert (result.reasoning, result.text) == ("The user greets; answer briefly.", "Hello the")
    assert "".join(d for kind, _t, d in pieces if kind == "answer") == "Hello the"  # never "r" of "re!"


def test_an_answer_cut_inside_the_analysis_says_so(harmony_model, monkeypatch):
    result, pieces = scripted_answer(harmony_model, monkeypatch, ANALYSIS_THEN_FINAL, max_new_tokens=12)
    assert result.finish_reason == "length" and result.cut_in_reasoning
    assert result.text == "" and result.reasoning == "The user greets; answer"[:len(result.reasoning)]
    assert result.reasoning and "".join(d for kind, _t, d in pieces if kind == "reasoning") == result.reasoning


def test_an_answer_stopped_inside_the_analysis_is_reasoning_only(harmony_model, monkeypatch):
    tokenizer = harmony_model.tokenizer
    answer = tokenizer.encode(ANALYSIS_THEN_FINAL)
    monkeypatch.setattr(harmony_model.decoder, "forward", ScriptedForward(tokenizer.vocab_size, answer))
    cancel, thoughts = threading.Event(), []

    def on_reasoning(_token, delta):  # Stop pressed once the reasoning has shown some text
        thoughts.append(delta)
        if "".join(thoughts):
            cancel.set()

    result = generate(harmony_model, harmony_model.new_state(), [], tokenizer.encode(HARMONY_PROMPT),
                      GenerationParams(max_new_tokens=64), cancel=cancel, on_reasoning=on_reasoning)
    assert result.finish_reason == "cancelled" and result.cut_in_reasoning
    assert result.text == "" and result.reasoning == "".join(thoughts) == tokenizer.decode(answer[7:8]) == "T"


def test_the_history_keeps_the_final_answer_and_the_next_turn_goes_on_from_the_last_prompt(harmony_model, monkeypatch):
    """gpt-oss's template writes a past answer as its final channel and drops its analysis: the conversation keeps
    the final text as the answer's content, and since the cache holds the analysis the template no longer writes, the
    next turn goes on from the state the last prompt left (its snapshot), feeding only what the template writes after
    that prompt; a regenerate answers that prompt again from there, feeding nothing."""
    tokenizer = harmony_model.tokenizer
    end = tokenizer.token_id("<|return|>")
    second_answer = tokenizer.encode("<|channel|>final<|message|>Fine.") + [end]
    again = tokenizer.encode("<|channel|>final<|message|>Good.") + [end]
    forward = ScriptedForward(tokenizer.vocab_size,
                              tokenizer.encode(ANALYSIS_THEN_FINAL) + [end] + second_answer + again[1:])
    monkeypatch.setattr(harmony_model.decoder, "forward", forward)
    chat = Conversation(harmony_model)
    first = chat.send("Hi", GenerationParams(max_new_tokens=64))
    assert chat.messages[-1] == {"role": "assistant", "content": "Hello there!"} and first.text == "Hello there!"
    first_prompt = tokenizer.render_chat([{"role": "user", "content": "Hi"}])
    second = chat.send("How are you?", GenerationParams(max_new_tokens=64))
    assert second.text == "Fine." and second.reused_cache_tokens == len(tokenizer.encode(first_prompt))
    rendered = tokenizer.render_chat([{"role": "user", "content": "Hi"},
                                      {"role": "assistant", "content": "Hello there!"},
                                      {"role": "user", "content": "How are you?"}])
    assert "analysis" not in rendered and rendered.startswith(first_prompt)
    suffix = tokenizer.encode(rendered[len(first_prompt):])
    assert forward.fed[-len(second_answer)] == suffix
    assert chat.fed_tokens == tokenizer.encode(first_prompt) + suffix + second.tokens[:-1]
    calls = len(forward.fed)
    # answered again: its first token sampled from the prompt's kept logits (the forward is not called for them, so
    # the script's next tokens follow it: again[1:]), no prompt token fed
    third = chat.regenerate(GenerationParams(max_new_tokens=64))
    assert third.text == "Good." and third.reused_cache_tokens == len(tokenizer.encode(first_prompt) + suffix)
    assert forward.fed[calls] == [again[0]] and chat.messages[-1] == {"role": "assistant", "content": "Good."}


def test_the_generate_command_prints_the_answer_and_the_reasoning_apart(copy_fixture, monkeypatch, capsys):
    """Standard output holds the answer alone (a pipe gets what a plain model would give it); the reasoning streams
    to standard error; --json carries both."""
    from app import cli
    from engine.decoder import PartitionedDecoder

    folder = harmony_folder(copy_fixture)
    tokenizer = ModelTokenizer(folder)
    answer = tokenizer.encode(ANALYSIS_THEN_FINAL) + [tokenizer.token_id("<|return|>")]
    scripts = [ScriptedForward(tokenizer.vocab_size, answer) for _ in range(2)]
    monkeypatch.setattr(PartitionedDecoder, "forward", lambda _decoder, state, ids: scripts[0](state, ids))
    assert cli.main(["generate", str(folder), "--prompt", "Hi", "--max-new-tokens", "64"]) == 0
    out, err = capsys.readouterr()
    assert out == "Hello there!\n"
    assert "Thinking…\nThe user greets; answer briefly.\n…done thinking.\n" in err
    scripts.pop(0)
    assert cli.main(["generate", str(folder), "--prompt", "Hi", "--max-new-tokens", "64", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["text"], printed["reasoning"]) == ("Hello there!", "The user greets; answer briefly.")


def long_reasoning_answer(tokenizer) -> list[int]:
    """ANALYSIS_THEN_FINAL's tokens with a reasoning of 150 words more, then its end."""
    long_reasoning = ANALYSIS_THEN_FINAL.replace("answer briefly.", "answer briefly." + " the" * 150)
    return tokenizer.encode(long_reasoning) + [tokenizer.token_id("<|return|>")]


def configured(folder, context: int, search: dict):
    """`folder` with this context and these search settings in its genai_config.json (max_length: only where given)."""
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["context_length"] = context
    config["search"] = {**{k: v for k, v in config["search"].items() if k != "max_length"}, **search}
    (folder / "genai_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("search, context, length", [
    ({"max_length": 1500}, 2048, 1500),  # as long as the model's search.max_length lets a sequence run
    ({"max_length": 0}, 2048, 2048),     # none named: the context
    ({}, 2048, 2048),
    ({"max_length": 4096}, 2048, 2048),  # within the context
    ({"max_length": 131_072}, 131_072, REASONING_ANSWER_TOKENS)])  # gpt-oss's own: bounded
def test_the_answer_length_of_a_model_that_reasons_first_leaves_room_for_an_answer(copy_fixture, search, context,
                                                                                   length):
    reasons = LoadedModel.open(configured(harmony_folder(copy_fixture), context, search))
    assert reasons.answer_tokens(128) == reasons.reasoning_answer_tokens == length
    # one that answers at once: the caller's own
    answers = LoadedModel.open(configured(copy_fixture("lfm2moe"), context, search))
    assert answers.answer_tokens(128) == 128 and answers.reasoning_answer_tokens is None


def test_the_generate_command_leaves_a_model_that_reasons_first_room_for_its_answer(copy_fixture, monkeypatch,
                                                                                   capsys):
    """Without --max-new-tokens, a reasoning of 150 tokens no longer uses up the answer length (128 before); a length
    asked for is kept."""
    from app import cli
    from engine.decoder import PartitionedDecoder

    folder = harmony_folder(copy_fixture)
    tokenizer = ModelTokenizer(folder)
    answer = long_reasoning_answer(tokenizer)
    assert len(answer) > cli.GENERATE_TOKENS
    scripts = [ScriptedForward(tokenizer.vocab_size, answer) for _ in range(2)]
    monkeypatch.setattr(PartitionedDecoder, "forward", lambda _decoder, state, ids: scripts[0](state, ids))
    assert cli.main(["generate", str(folder), "--prompt", "Hi", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["text"], printed["finish_reason"], len(printed["tokens"])) == ("Hello there!", "eos", len(answer))
    scripts.pop(0)
    assert cli.main(["generate", str(folder), "--prompt", "Hi", "--json", "--max-new-tokens", "20"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["text"], printed["finish_reason"], len(printed["tokens"])) == ("", "length", 20)


@pytest.mark.parametrize("context, short, long", [
    (4096, 4096, 4096 - 2003),  # the long scenario's within what the context leaves after its input (2,003 tokens)
    (2048, 2048, 64)])          # ...but not below the plain length: scenario_turns refuses that context, as before
def test_a_scenarios_own_length_leaves_the_long_input_room(copy_fixture, context, short, long):
    from engine.records.scenarios import scenario_answer_tokens, scenario_turns

    reasons = LoadedModel.open(configured(harmony_folder(copy_fixture), context, {"max_length": context}))
    lengths = {name: scenario_answer_tokens(reasons, name) for name in ("short", "multiturn", "long")}
    assert lengths == {"short": short, "multiturn": short, "long": long}
    if context - 2003 >= 64:
        assert scenario_turns("long", reasons.tokenizer, reasons.config, long)
    else:
        with pytest.raises(PromptError, match="needs a context of at least 2067 tokens; the model has 2048"):
            scenario_turns("long", reasons.tokenizer, reasons.config, long)
    answers = LoadedModel.open(configured(copy_fixture("lfm2moe"), context, {"max_length": context}))
    assert {scenario_answer_tokens(answers, name) for name in ("short", "multiturn", "long")} == {64}


def test_the_long_scenario_is_bounded_by_search_max_length_below_the_context(copy_fixture):
    """A 4,096-token model whose search.max_length is 2,048: the long scenario's answer length was taken within the
    whole context (2,048 tokens after its input, 2,003 tokens here: 45 fit) and its check passed, so the run stopped at
    max_length, short of the answer asked for, where it should be refused up front, naming max_length."""
    from engine.records.scenarios import scenario_answer_tokens, scenario_turns

    reasons = LoadedModel.open(configured(harmony_folder(copy_fixture), 4096, {"max_length": 2048}))
    assert scenario_answer_tokens(reasons, "long") == 64  # not below the plain length
    assert scenario_turns("long", reasons.tokenizer, reasons.config, 45)
    with pytest.raises(PromptError, match="^the long-input scenario needs sequences of at least 2067 tokens; the "
                                          "model's genai_config.json search.max_length is 2048$"):
        scenario_turns("long", reasons.tokenizer, reasons.config, 64)


def test_the_record_command_leaves_a_model_that_reasons_first_room_for_its_answer(copy_fixture, monkeypatch, capsys,
                                                                                 tmp_path):
    """Without --max-new-tokens, a reasoning of 150 tokens no longer uses up the answer length (64 before); a length
    asked for is kept."""
    from app import cli
    from engine.decoder import PartitionedDecoder

    folder = harmony_folder(copy_fixture)
    tokenizer = ModelTokenizer(folder)
    answer = long_reasoning_answer(tokenizer)
    assert len(answer) > 64  # record's length for a model that answers at once
    monkeypatch.setattr(PartitionedDecoder, "forward", ScriptedStates(tokenizer.vocab_size, answer))
    history = str(tmp_path / "history.sqlite3")
    for asked, expected in (([], ("Hello there!", "eos", len(answer))),
                            (["--max-new-tokens", "20"], ("", "length", 20))):
        assert cli.main(["record", str(folder), "--json", "--history", history, *asked]) == 0
        turn = json.loads(capsys.readouterr().out)[0]["turns"][0]
        assert (turn["answer"], turn["finish_reason"], turn["generated_tokens"]) == expected


def test_the_contention_command_leaves_a_model_that_reasons_first_room_for_its_answer(copy_fixture, monkeypatch,
                                                                                     capsys, tmp_path):
    """Each of its three inferences answers after the reasoning of 150 tokens without --max-new-tokens (they stopped
    at 64, inside it); a length asked for is kept."""
    import engine.records.scenarios as scenarios
    from app import cli
    from engine.decoder import PartitionedDecoder
    from engine.records.contention import make_corpus

    folder = harmony_folder(copy_fixture)
    tokenizer = ModelTokenizer(folder)
    answer = long_reasoning_answer(tokenizer)
    monkeypatch.setattr(PartitionedDecoder, "forward", ScriptedStates(tokenizer.vocab_size, answer))
    answered = scenario_answers(monkeypatch, scenarios)
    corpus = str(make_corpus(tmp_path / "corpus", files=2, words_per_file=10))
    for asked, expected in (([], ("Hello there!", len(answer))), (["--max-new-tokens", "20"], ("", 20))):
        answered.clear()
        assert cli.main(["contention", str(folder), "--corpus", corpus, "--json", *asked]) == 0
        assert answered == [expected] * 3 and json.loads(capsys.readouterr().out)["inference_alone_s"] > 0


def test_the_sweep_command_keeps_its_length_for_a_model_that_reasons_first_and_says_so(copy_fixture, monkeypatch,
                                                                                      capsys, tmp_path):
    """A sweep answers its 32 tokens for every model: it times the same work at each budget, which a reasoning
    model's own length at every point could make hours long. It says where that stops inside the reasoning."""
    import engine.records.sweep as sweep
    from app import cli
    from engine.decoder import PartitionedDecoder

    folder = harmony_folder(copy_fixture)
    tokenizer = ModelTokenizer(folder)
    answer = long_reasoning_answer(tokenizer)
    monkeypatch.setattr(PartitionedDecoder, "forward", ScriptedStates(tokenizer.vocab_size, answer))
    answered = scenario_answers(monkeypatch, sweep)
    command = ["sweep", str(folder), "--device", "simulated", "--points", "2", "--json",
               "--history", str(tmp_path / "history.sqlite3")]
    assert cli.main(command) == 0
    # each point's warm-up, then its three repeats (the sweep's first warm-up, warm_up_answer, is no scenario run)
    assert answered == ([("", 4)] + [("", 32)] * 3) * 2
    assert ("sweep: answers stop after 32 tokens, inside the reasoning of this model, which reasons first: a sweep "
            "times the same work at each budget, and reasoning decodes as an answer does (the model's own length is "
            "2048 tokens a run); --max-new-tokens sets another\n") in capsys.readouterr().err
    answered.clear()
    assert cli.main([*command, "--max-new-tokens", "2048"]) == 0  # room for the answer: nothing to say
    assert [said for said in answered if said[1] != 4] == [("Hello there!", len(answer))] * 2 * 3  # not the warm-ups
    assert "inside the reasoning" not in capsys.readouterr().err


def test_a_record_keeps_the_reasoning_apart_and_older_records_still_read(harmony_model, monkeypatch):
    from app.gui.record_report import compare_html, detail_html
    from engine.records.scenarios import run_turns
    from engine.records.schema import RunRecord

    tokenizer = harmony_model.tokenizer
    answer = tokenizer.encode(ANALYSIS_THEN_FINAL) + [tokenizer.token_id("<|return|>")]
    monkeypatch.setattr(harmony_model.decoder, "forward", ScriptedForward(tokenizer.vocab_size, answer))
    harmony_model.warm_up_s = 0.0  # warmed up: run_turns' warm-up answer would take the scripted answer's first tokens
    record = RunRecord.from_dict(run_turns(harmony_model, ["Hi"], GenerationParams(max_new_tokens=64)).to_dict())
    turn = record.turns[0]
    assert (turn["answer"], turn["reasoning"]) == ("Hello there!", "The user greets; answer briefly.")
    assert "<b>Reasoning 1</b>:<br><i>The user greets; answer briefly.</i>" in detail_html(record)
    older = record.to_dict()
    del older["turns"][0]["reasoning"]  # a record written before answers had reasoning
    older = RunRecord.from_dict(older)
    assert "Reasoning" not in detail_html(older) and "Hello there!" in detail_html(older)
    assert "<h4>Reasoning 1</h4>" in compare_html(older, record)


def test_a_think_conversation_keeps_the_answer_and_feeds_what_the_template_writes(copy_fixture, monkeypatch):
    """A template that opens <think> and strips the reasoning from past answers, as Qwen3.5's: the answer holds only
    </think>; the history keeps the text after it, and the next turn is fed as a fresh conversation would be. It goes
    on from the state kept where the next render leaves the prompt, before the generation prompt's <think>: every turn
    fed the whole conversation again. (The prompt's head is fed apart for that state, a forward whose pick, a special
    token no text shows, is not taken.)"""
    model = LoadedModel.open(think_folder(copy_fixture, opened=True))
    tokenizer = model.tokenizer
    head = tokenizer.token_id("<|start|>")
    first, second = ([head] + tokenizer.encode(text) + [0] for text in ("Say hello.\n</think>\n\nHello!",
                                                                        "</think>Bye."))
    forward = ScriptedForward(tokenizer.vocab_size, first + second)
    monkeypatch.setattr(model.decoder, "forward", forward)
    chat = Conversation(model)
    answer = chat.send("Hi", GenerationParams(max_new_tokens=64))
    assert (answer.reasoning, answer.text) == ("Say hello.", "Hello!")
    assert chat.messages[-1] == {"role": "assistant", "content": "Hello!"}
    kept = tokenizer.encode(tokenizer.render_chat(chat.messages[:-1]).removesuffix("<think>\n"))
    again = chat.send("Bye", GenerationParams(max_new_tokens=64))
    assert (again.reasoning, again.text, again.reused_cache_tokens) == ("", "Bye.", len(kept))
    assert chat.fed_tokens == tokenizer.encode(tokenizer.render_chat(chat.messages[:-1])) + again.tokens[:-1]


def test_a_regenerate_from_the_prompts_state_reads_the_think_tag_the_prompt_opened(copy_fixture, monkeypatch):
    """A regenerate answers the last prompt again from its kept state, before the generation prompt's <think>
    (tests/test_reasoning.py's think conversation), feeding that alone: the answer still continues the <think> that
    prompt opened, so its reasoning is reasoning, not part of the answer with </think>."""
    model = LoadedModel.open(think_folder(copy_fixture, opened=True))
    tokenizer = model.tokenizer
    first, again = (tokenizer.encode(text) + [0] for text in ("Say hello.\n</think>\n\nHello!",
                                                              "Say hi back.\n</think>\n\nHi there!"))
    # (0: the forward of the first prompt's head, for the kept state, which picks nothing)
    monkeypatch.setattr(model.decoder, "forward", ScriptedForward(tokenizer.vocab_size, [0] + first + again))
    chat = Conversation(model)
    chat.send("Hi", GenerationParams(max_new_tokens=64))
    shown = []
    result = chat.regenerate(GenerationParams(max_new_tokens=64), on_text=lambda _token, delta: shown.append(delta))
    assert result.prompt_tokens == tokenizer.encode("<think>\n") and result.reused_cache_tokens > 0
    assert (result.reasoning, result.text, "".join(shown)) == ("Say hi back.", "Hi there!", "Hi there!")
    assert chat.messages[-1] == {"role": "assistant", "content": "Hi there!"}


def test_a_long_answer_is_split_without_a_pass_over_every_token_for_each(harmony, monkeypatch):
    """The special tokens the split does not read are left out as each comes, not by a Python pass over all the
    tokens so far at every token: at 2,000 tokens that pass cost ~0.1 ms a token (StreamDecoder decodes a few tokens
    at each: tests/test_tokenizer.py)."""
    class CountedIds(frozenset):
        lookups = 0

        def __contains__(self, token):
            CountedIds.lookups += 1
            return super().__contains__(token)

    monkeypatch.setattr(harmony, "special_ids", CountedIds(harmony.special_ids))
    words = harmony.encode(" the") * 990  # one token each: 2,000 tokens in all
    answer = (harmony.encode("<|channel|>analysis<|message|>") + words
              + harmony.encode("<|end|><|start|>assistant<|channel|>final<|message|>") + words)
    split = answer_format(harmony).split(harmony, harmony.encode(HARMONY_PROMPT))
    CountedIds.lookups = 0
    for token in answer:
        split.push(token)
    split.finish()
    assert split.answer == " the" * 990
    assert CountedIds.lookups <= 2 * len(answer)


def test_a_prompt_snapshot_that_would_take_much_of_the_hosts_free_memory_is_not_kept(harmony_model, monkeypatch):
    """A long conversation's KV copy is left out where it would take more than a quarter of the host's available
    memory: the next turn feeds the conversation afresh, as before snapshots."""
    from types import SimpleNamespace

    from engine import generation

    tokenizer = harmony_model.tokenizer
    end = tokenizer.token_id("<|return|>")
    second_answer = tokenizer.encode("<|channel|>final<|message|>Fine.") + [end]
    forward = ScriptedForward(tokenizer.vocab_size, tokenizer.encode(ANALYSIS_THEN_FINAL) + [end] + second_answer)
    monkeypatch.setattr(harmony_model.decoder, "forward", forward)
    chat = Conversation(harmony_model)
    monkeypatch.setattr(chat.model.new_state().__class__, "snapshot_bytes", lambda self: 4 << 30)
    monkeypatch.setattr(generation.psutil, "virtual_memory", lambda: SimpleNamespace(available=8 << 30))
    chat.send("Hi", GenerationParams(max_new_tokens=64))
    assert chat._prompt_snapshot is None
    assert chat.send("How are you?", GenerationParams(max_new_tokens=64)).reused_cache_tokens == 0


def _rendered_tokens(tokenizer, prompt: str, variables: dict) -> int:
    """`prompt`'s tokens as the chat template renders it with `variables`, counted here, not by the code under test."""
    return len(tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": prompt}], variables=variables)))


def scripted_hello(monkeypatch, tokenizer, config) -> None:
    """Every conversation answers "Hello there!" and ends: a context past the fixture's rotary cache (2,048 positions)
    can then hold the long input and an answer of 64 tokens or more."""
    from engine.decoder import PartitionedDecoder

    answer = tokenizer.encode("Hello there!") + [config.eos_token_ids[0]]
    monkeypatch.setattr(PartitionedDecoder, "forward", ScriptedStates(tokenizer.vocab_size, answer))


def seventy_tokens_of_room_with_thinking_off(copy_fixture, monkeypatch):
    """A model whose template switches thinking, answering "Hello there!", with a context that leaves the long
    scenario's input, rendered with thinking off, 70 tokens of answer: its folder, tokenizer, a config whose context
    does not bound the long input (for scenario_turns), and that context."""
    from types import SimpleNamespace

    from engine.genai_config import load_genai_config
    from engine.records.scenarios import scenario_turns

    folder = thinking_switch_folder(copy_fixture)
    tokenizer = ModelTokenizer(folder)
    scripted_hello(monkeypatch, tokenizer, load_genai_config(folder))
    roomy = SimpleNamespace(context_length=1 << 20, search=SimpleNamespace(max_length=1 << 20))
    off = {"enable_thinking": False}
    context = _rendered_tokens(tokenizer, scenario_turns("long", tokenizer, roomy, 1, "off")[0], off) + 70
    configured(folder, context, {"max_length": context})
    return folder, tokenizer, roomy, context


def test_the_record_command_counts_the_long_inputs_room_with_its_reasoning_setting(copy_fixture, monkeypatch, capsys,
                                                                                  tmp_path):
    """record had no reasoning setting, and its long scenario's own answer length (scenario_answer_tokens) counted the
    input as the template's default renders it: with thinking off, Qwen3's template writes an empty think block after
    it, so the length asked for more than the context leaves and the run was refused. `--reasoning` reaches the
    template, the length is counted with it, and the record keeps it; without it, the template's default, as before."""
    from app import cli

    folder, tokenizer, _roomy, context = seventy_tokens_of_room_with_thinking_off(copy_fixture, monkeypatch)
    off = {"enable_thinking": False}
    history = str(tmp_path / "history.sqlite3")
    for asked, setting, variables in (([], None, {}), (["--reasoning", "off"], "off", off)):
        status = cli.main(["record", str(folder), "--scenario", "long", "--json", "--history", history, *asked])
        out, err = capsys.readouterr()
        assert status == 0, err
        record = json.loads(out)[0]
        turn = record["turns"][0]
        fed = _rendered_tokens(tokenizer, turn["prompt"], variables)
        assert turn["prompt_tokens"] == fed and record["generation"]["reasoning"] == setting
        assert record["generation"]["max_new_tokens"] == context - fed
        if setting:  # the empty think block
            assert _rendered_tokens(tokenizer, turn["prompt"], {}) < fed
    status = cli.main(["record", str(folder), "--history", history, "--reasoning", "high"])
    assert status == 2 and capsys.readouterr().err == ("moe-workbench: error: --reasoning 'high': this model's chat "
                                                        "template takes on, off\n")


@pytest.mark.parametrize("setting, variables", [(None, {}), ("off", {"enable_thinking": False})])
def test_a_sweeps_reasoning_setting_reaches_every_points_prompts_and_records(copy_fixture, monkeypatch, capsys,
                                                                            tmp_path, setting, variables):
    """sweep had no reasoning setting: every point's answers rendered with the template's default. `--reasoning`
    renders every point's prompts with it (its unrecorded warm-up answer's too: it puts the point's runs after the same
    work), each record keeps it and its report says it; without it, the template's default, as before."""
    import engine.records.sweep as sweep
    from app import cli
    from app.gui.record_report import detail_html
    from engine.records.history import History
    from engine.records.scenarios import scenario_turns

    folder = thinking_switch_folder(copy_fixture)
    rendered = renders_after_the_warm_up(monkeypatch, sweep)  # (its warm-up at the loaded budget, as before a record)
    history = str(tmp_path / "history.sqlite3")
    status = cli.main(["sweep", str(folder), "--device", "simulated", "--points", "2", "--repeats", "1",
                       "--max-new-tokens", "2", "--history", history, *(["--reasoning", setting] if setting else [])])
    err = capsys.readouterr().err
    assert status == 0, err
    # thinking off answers at once: the answers do not stop inside a reasoning (it said they did)
    assert ("inside the reasoning of this model" in err) == (setting is None)
    # each point's warm-up and run (each send renders its prompt, and may render the turn after it)
    assert len(rendered) >= 4 and all(said == variables for said in rendered)
    saved = History(history)
    records = [saved.get(row["id"]) for row in saved.rows(label="sweep")]
    tokenizer = ModelTokenizer(folder)
    prompt = scenario_turns("short", tokenizer, None, 2)[0]
    assert len(records) == 2 and all(
        (r.generation["reasoning"], r.turns[0]["prompt_tokens"]) == (setting, _rendered_tokens(tokenizer, prompt,
                                                                                               variables))
        for r in records)
    assert f"<td>reasoning setting</td><td>{setting or 'the template&#x27;s default'}</td>" in detail_html(records[0])


def test_the_contention_command_renders_and_counts_its_answers_with_its_reasoning_setting(copy_fixture, monkeypatch,
                                                                                         capsys, tmp_path):
    """contention had no reasoning setting: its inference rendered with the template's default, and the long
    scenario's own answer length counted the input so, which with Qwen3's thinking off (an empty think block after
    the input) asked for more than the context leaves. `--reasoning` renders every inference's prompt with it, the
    length is counted with it, and the report keeps and says it; without it, the template's default, as before."""
    import engine.records.scenarios as scenarios
    from app import cli
    from engine.records.contention import make_corpus
    from engine.records.scenarios import scenario_turns

    folder, tokenizer, roomy, context = seventy_tokens_of_room_with_thinking_off(copy_fixture, monkeypatch)
    off = {"enable_thinking": False}
    rendered = renders_after_the_warm_up(monkeypatch, scenarios)  # (its warm-up after the load, as before a record)
    corpus = str(make_corpus(tmp_path / "corpus", files=2, words_per_file=10))
    command = ["contention", str(folder), "--corpus", corpus, "--scenario", "long", "--workers", "1"]
    for asked, setting, variables in (([], None, {}), (["--reasoning", "off"], "off", off)):
        rendered.clear()
        status = cli.main([*command, "--json", *asked])
        out, err = capsys.readouterr()
        assert status == 0, err
        generation = json.loads(out)["generation"]
        assert generation["reasoning"] == setting and rendered and all(said == variables for said in rendered)
        fed = _rendered_tokens(tokenizer, scenario_turns("long", tokenizer, roomy, 1, setting)[0], variables)
        assert generation["max_new_tokens"] == context - fed
    assert cli.main([*command, "--reasoning", "off"]) == 0
    assert "\nAnswers: greedy, reasoning setting off, at most 70 tokens each.\n" in capsys.readouterr().out
    status = cli.main([*command, "--reasoning", "high"])
    assert status == 2 and capsys.readouterr().err == ("moe-workbench: error: --reasoning 'high': this model's chat "
                                                        "template takes on, off\n")
