"""The real chat templates of the reasoning models the workbench runs (tests/data/chat_templates, see its README):
they render in the engine's sandbox, the answer's format is recognised from them and the models' own special tokens,
a conversation feeds each what its template writes, and a stop string may name one of their special tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer

from engine.generation import Conversation, GenerationParams, LoadedModel
from engine.errors import PromptError
from engine.reasoning import answer_format, reasoning_choices, reasoning_variables
from engine.tokenizer import ModelTokenizer
from tests.reasoning_models import ScriptedForward, awkward_tokens

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


def gptoss_folder(copy_fixture) -> Path:
    """gpt-oss: harmony's marks are special tokens; <|return|> and <|call|> end an answer, <|end|> a message."""
    return model_folder(copy_fixture, "gptoss", "openai-gpt-oss-120b.jinja",
                        ("<|channel|>", "<|message|>", "<|return|>", "<|constrain|>", "<|call|>"),
                        eos=("<|return|>", "<|call|>"))


def qwen3_folder(copy_fixture, opened: bool = False) -> Path:
    """Qwen3 (hybrid thinking), or with `opened` a Qwen3 "2507" Thinking model, whose generation prompt opens
    <think>."""
    folder = model_folder(copy_fixture, "qwen35moe", "Qwen-Qwen3-0.6B.jinja", ("<|im_start|>", "<|im_end|>"),
                          ("<think>", "</think>"), ("<|im_end|>",))
    if opened:
        template = (folder / "chat_template.jinja").read_text().split("{%- if add_generation_prompt %}")[0]
        (folder / "chat_template.jinja").write_text(
            template + "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n<think>\\n' }}\n{%- endif %}")
    return folder


def lfm2_folder(copy_fixture) -> Path:
    return model_folder(copy_fixture, "lfm2moe", "LiquidAI-LFM2.jinja", ("<|im_start|>", "<|im_end|>"),
                        eos=("<|im_end|>",))


@pytest.mark.parametrize("make, kind, generation_prompt", [
    (gptoss_folder, "harmony", "<|start|>user<|message|>Why?<|end|><|start|>assistant"),
    (qwen3_folder, "think", "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n"),
    (lambda copy: qwen3_folder(copy, opened=True), "think", "<|im_start|>assistant\n<think>\n"),
    (lfm2_folder, "plain", "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n")])
def test_real_templates_render_and_their_format_is_recognised(copy_fixture, make, kind, generation_prompt):
    tokenizer = ModelTokenizer(make(copy_fixture))
    rendered = tokenizer.render_chat(CONVERSATION)
    assert rendered.endswith(generation_prompt) and "Be brief." in rendered and "Hello!" in rendered
    assert answer_format(tokenizer).kind == kind


# What each model writes after its generation prompt (its end-of-answer token follows), and its two parts.
ANSWERS = {
    "gpt-oss": [("<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final<|message|>"
                 "Hello!", "The user greets.", "Hello!"),
                ("<|channel|>final<|message|>No reason.", "", "No reason.")],  # low reasoning effort: final at once
    "qwen3": [("<think>\nThe user greets.\n</think>\n\nHello!", "The user greets.", "Hello!"),
              ("<think>\n\n</think>\n\nNo reason.", "", "No reason.")],  # /no_think: an empty block
    "qwen3-thinking": [("The user greets.\n</think>\n\nHello!", "The user greets.", "Hello!"),
                       ("Short.\n</think>\n\nNo reason.", "Short.", "No reason.")],
    "lfm2": [("Hello!", "", "Hello!"), ("No reason.", "", "No reason.")]}
FOLDERS = {"gpt-oss": (gptoss_folder, "<|return|>"), "qwen3": (qwen3_folder, "<|im_end|>"),
           "qwen3-thinking": (lambda copy: qwen3_folder(copy, opened=True), "<|im_end|>"),
           "lfm2": (lfm2_folder, "<|im_end|>")}
# Where a past answer is written without what the generation prompt opens (<think>, or thinking off's empty think
# block), the prompt's head is fed apart for the state the next turn goes on from: a forward whose pick is not taken.
HEAD_FED_APART = {"qwen3-thinking": 1, "qwen3-off": 1}


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_a_conversation_splits_each_answer_and_feeds_what_the_template_writes(copy_fixture, monkeypatch, name):
    """Two turns: each answer split as the model writes it; the history holds the final text alone, and every turn
    is fed as the real template renders the conversation so far (past reasoning dropped by gpt-oss's and Qwen3's)."""
    make, end = FOLDERS[name]
    model = LoadedModel.open(make(copy_fixture))
    tokenizer = model.tokenizer
    head = [0] * HEAD_FED_APART.get(name, 0)
    script = [token for text, _r, _a in ANSWERS[name]
              for token in head + tokenizer.encode(text) + [tokenizer.token_id(end)]]
    monkeypatch.setattr(model.decoder, "forward", ScriptedForward(tokenizer.vocab_size, script))
    chat = Conversation(model, system_prompt="Be brief.")
    for turn, (user, (_text, reasoning, answer)) in enumerate(zip(("Hi", "Why?"), ANSWERS[name])):
        result = chat.send(user, GenerationParams(max_new_tokens=64))
        assert (result.finish_reason, result.reasoning, result.text) == ("eos", reasoning, answer)
        assert chat.messages[-1] == {"role": "assistant", "content": answer}
        fresh = tokenizer.encode(tokenizer.render_chat(chat.messages[:-1]))
        assert chat.fed_tokens == fresh + result.tokens[:-1]
        assert (result.reused_cache_tokens > 0) == (turn > 0)  # a later turn goes on from the cache


@pytest.mark.parametrize("make, choices", [(gptoss_folder, ("low", "medium", "high")), (qwen3_folder, ("on", "off")),
                                           (lfm2_folder, ())])
def test_the_reasoning_setting_is_what_each_template_reads(copy_fixture, make, choices):
    tokenizer = ModelTokenizer(make(copy_fixture))
    assert reasoning_choices(tokenizer) == choices
    with pytest.raises(PromptError) as error:
        reasoning_variables(tokenizer, "maximal")
    assert str(error.value) == ("reasoning 'maximal': this model's chat template "
                                + (f"takes {', '.join(choices)}" if choices else "has no reasoning setting"))


@pytest.mark.parametrize("name, setting, fed", [("gpt-oss", "low", "Reasoning: low"),
                                                ("gpt-oss", "high", "Reasoning: high"),
                                                ("qwen3", "off", "<think>\n\n</think>\n\n")])
def test_a_conversation_feeds_the_reasoning_setting_to_the_template(copy_fixture, monkeypatch, name, setting, fed):
    """gpt-oss's effort goes into its system message (medium where unset); Qwen3 with thinking off has the template
    write an empty think block after the generation prompt, so the model answers at once."""
    make, end = FOLDERS[name]
    model = LoadedModel.open(make(copy_fixture))
    tokenizer = model.tokenizer
    head = [0] * HEAD_FED_APART.get(f"{name}-{setting}", 0)
    script = head + tokenizer.encode(ANSWERS[name][1][0]) + [tokenizer.token_id(end)]
    monkeypatch.setattr(model.decoder, "forward", ScriptedForward(tokenizer.vocab_size, script))
    chat = Conversation(model)
    default = tokenizer.decode(tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": "Hi"}])),
                               skip_special_tokens=False)
    result = chat.send("Hi", GenerationParams(max_new_tokens=64, reasoning=setting))
    prompt = tokenizer.decode(chat.fed_tokens[:len(chat.fed_tokens) - len(result.tokens) + 1], skip_special_tokens=False)
    assert fed in prompt and fed not in default
    assert result.text == ANSWERS[name][1][2]


def test_gpt_oss_preamble_is_the_answer_and_a_tool_call_written_as_its_template_writes_one_reasoning(copy_fixture,
                                                                                                     monkeypatch):
    """gpt-oss's template sends tool calls to the commentary channel (its system message says so) and writes a call
    as `<|start|>assistant to=functions.f<|channel|>commentary json<|message|>…<|call|>`: a model that writes a
    preamble for the user, then such a call (<|call|> ends the answer), answers with the preamble; the call is in the
    reasoning, and the history keeps the preamble."""
    model = LoadedModel.open(gptoss_folder(copy_fixture))
    tokenizer = model.tokenizer
    assert "Calls to these tools must go to the commentary channel" in tokenizer.chat_template.source
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                                  "arguments": {"city": "Paris"}}}]}
    past = tokenizer.render_chat([{"role": "user", "content": "Weather?"}, call], add_generation_prompt=False)
    written_call = past[past.rindex("<|start|>assistant") + len("<|start|>assistant"):]
    assert written_call == ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
    answer = ("<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>commentary<|message|>"
              "Checking Paris…<|end|><|start|>assistant" + written_call)
    monkeypatch.setattr(model.decoder, "forward", ScriptedForward(tokenizer.vocab_size,
                                                                  awkward_tokens(tokenizer, answer)))
    chat, shown = Conversation(model), []
    result = chat.send("Weather in Paris?", GenerationParams(max_new_tokens=200),
                       on_text=lambda _token, delta: shown.append(delta))
    assert (result.finish_reason, result.text, "".join(shown)) == ("eos", "Checking Paris…", "Checking Paris…")
    assert result.reasoning == 'Look it up.\n\n→ functions.get_weather: {"city": "Paris"}'
    assert chat.messages[-1] == {"role": "assistant", "content": "Checking Paris…"}


def answered(model, written: str, stops: tuple[str, ...]):
    """The answer to "Hi" of a model that writes `written` (in tokens cut at awkward places), with `stops`; and what
    streamed of its answer."""
    tokens = awkward_tokens(model.tokenizer, written)
    model.decoder.forward = ScriptedForward(model.tokenizer.vocab_size, tokens)
    shown = []
    result = Conversation(model).send("Hi", GenerationParams(max_new_tokens=len(tokens), stop_strings=stops),
                                      on_text=lambda _token, delta: shown.append(delta))
    return result, "".join(shown)


def test_a_stop_string_names_a_special_token_which_the_answer_never_shows(copy_fixture):
    """LFM2 whose genai_config.json ends answers at <|endoftext|> alone, a model that writes its turn's end
    (<|im_end|>, a special token) and runs on into a next turn: a stop string <|im_end|> ends the answer there; one
    that begins in the text before the token holds that text back until it matches; one that is only part of the
    token's text names no token, and the answer runs on, with no special token shown."""
    model = LoadedModel.open(model_folder(copy_fixture, "lfm2moe", "LiquidAI-LFM2.jinja",
                                          ("<|im_start|>", "<|im_end|>")))
    assert model.tokenizer.token_id("<|im_end|>") not in model.eos_ids
    written = "Hello there!<|im_end|>\n<|im_start|>user\nMore"
    for stops, finish, text in [(("<|im_end|>",), "stop_string", "Hello there!"),
                                (("Bye", "there!<|im_end|>"), "stop_string", "Hello "),
                                (("im_end",), "length", "Hello there!\nuser\nMore")]:
        result, shown = answered(model, written, stops)
        assert (result.finish_reason, result.text, shown) == (finish, text, text)


def test_a_stop_string_naming_a_special_token_applies_to_the_answer_not_the_reasoning(copy_fixture):
    """Qwen3 where <|im_end|> does not end an answer: the token in the reasoning neither stops it nor shows; in the
    answer it stops it."""
    model = LoadedModel.open(model_folder(copy_fixture, "qwen35moe", "Qwen-Qwen3-0.6B.jinja",
                                          ("<|im_start|>", "<|im_end|>"), ("<think>", "</think>")))
    result, shown = answered(model, "<think>\nA turn ends with <|im_end|>.\n</think>\n\nHello!<|im_end|>\n<|im_start|>",
                             ("<|im_end|>",))
    assert (result.finish_reason, result.reasoning, result.text, shown) == (
        "stop_string", "A turn ends with .", "Hello!", "Hello!")



def test_the_long_input_is_counted_as_the_run_renders_it_with_its_reasoning_setting(copy_fixture):
    """The long scenario's input was counted as the template renders it without its variables, where the run renders
    it with the answers' reasoning setting: with thinking off, Qwen3's template writes an empty think block after the
    prompt, which the count left out, so a context that held the count and the answer but not the prompt as fed passed
    the check. Counted with the setting, the scenario is refused before it runs, naming the tokens it needs."""
    from engine.records.scenarios import run_scenario
    from tests.reasoning_models import thinking_switch_folder

    folder = thinking_switch_folder(copy_fixture)
    fed = run_scenario(LoadedModel.open(folder), "long", GenerationParams(max_new_tokens=1, reasoning="off")).turns[0][
        "prompt_tokens"]
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["context_length"] = config["search"]["max_length"] = fed + 7  # the prompt as fed and 7 tokens
    (folder / "genai_config.json").write_text(json.dumps(config))
    model = LoadedModel.open(folder)
    with pytest.raises(PromptError, match=f"^the long-input scenario needs a context of at least {fed + 8} tokens; the "
                                          f"model has {fed + 7}$"):
        run_scenario(model, "long", GenerationParams(max_new_tokens=8, reasoning="off"))
    assert run_scenario(model, "long", GenerationParams(max_new_tokens=7, reasoning="off")).turns[0][
        "generated_tokens"] == 7  # what fits: the count is the run's
