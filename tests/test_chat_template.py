"""Chat templates render as transformers renders them (its Jinja2 set-up, written out here as the oracle)."""

from __future__ import annotations

import json
import time
from datetime import datetime

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import ModelFileError, PromptError
from engine.tokenizer import RENDER_LIMIT_S, RENDER_MAX_CHARS, ModelTokenizer
from tests.conftest import FIXTURE_NAMES, fixture_folder

# Room past the render's deadline for a busy machine (a run beside a compile took 3.5 s to refuse a 100 MB template);
# what the timed tests tell apart is a refusal from a render run to its end, which takes minutes.
LOADED_MACHINE_S = 10

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>é</b> & 'you'"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Why?"}]


def transformers_render(source: str, messages: list[dict], **special) -> str:
    """transformers' apply_chat_template(tokenize=False, add_generation_prompt=True): its environment and filters."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source).render(messages=messages, add_generation_prompt=True, **special)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_the_fixtures_templates_render_a_system_prompt_and_turns_as_transformers_and_add_no_second_bos(name):
    folder = fixture_folder(name)
    tokenizer = ModelTokenizer(folder)
    expected = transformers_render((folder / "chat_template.jinja").read_text(), CONVERSATION,
                                   bos_token="<|start|>", eos_token="<|endoftext|>")
    rendered = tokenizer.render_chat(CONVERSATION)
    assert rendered == expected and rendered.endswith("<|end|><|start|>assistant\n")  # the generation prompt
    ids = tokenizer.encode(rendered)
    assert ids[0] == tokenizer.token_id("<|start|>") and ids[1] != ids[0]
    assert ids.count(tokenizer.token_id("<|start|>")) == 5  # four turns and the generation prompt, no BOS added


def test_tojson_writes_what_transformers_writes(copy_fixture):
    """Jinja2's own tojson escapes HTML characters and non-ASCII ones (\\u003cb\\u003e, \\u00e9): tool and
    structured-content templates would put other text in the prompt than transformers does."""
    folder = copy_fixture("gptoss")
    source = "{% for m in messages %}{{ m | tojson }}|{{ m['content'] | tojson(indent=2) }}\n{% endfor %}"
    (folder / "chat_template.jinja").write_text(source)
    rendered = ModelTokenizer(folder).render_chat(CONVERSATION[1:2])
    assert rendered == transformers_render(source, CONVERSATION[1:2])
    assert rendered == '{"role": "user", "content": "Hi <b>é</b> & \'you\'"}|"Hi <b>é</b> & \'you\'"\n'


def test_a_model_without_a_chat_template_says_what_a_chat_needs_and_what_runs_without(copy_fixture):
    """The message reaches the window's chat, which has no --raw: it says what --raw belongs to."""
    folder = copy_fixture("gptoss")
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(PromptError) as refused:
        ModelTokenizer(folder).render_chat(CONVERSATION)
    assert str(refused.value) == ("this model has no chat template (in tokenizer_config.json or chat_template.jinja), "
                                  "which a chat needs: 'moe-workbench generate --raw' feeds a prompt as it is")


def test_a_template_reads_every_special_token_that_tokenizer_config_sets_as_transformers_hands_them(copy_fixture):
    """transformers renders with its special_tokens_map: pad, unk and the additional ones too, not bos and eos only."""
    folder = copy_fixture("qwen35moe")  # pad_token and unk_token <|endoftext|>
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["additional_special_tokens"] = ["<|end|>", {"content": "<|start|>", "special": True}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    source = ("{{ bos_token }}|{{ pad_token }}|{{ unk_token }}|{{ additional_special_tokens | join(',') }}|"
              "{{ sep_token }}")
    (folder / "chat_template.jinja").write_text(source)
    expected = transformers_render(source, CONVERSATION, bos_token="<|start|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|end|>", "<|start|>"])
    assert ModelTokenizer(folder).render_chat(CONVERSATION) == expected == (
        "<|start|>|<|endoftext|>|<|endoftext|>|<|end|>,<|start|>|")


def test_tokenizer_configs_chat_template_as_named_templates_or_of_the_wrong_kind(copy_fixture):
    """transformers reads the named templates it saves as a list into {name: template}, and takes that form too; a
    chat_template of any other kind is named, not taken for a model without one."""
    folder = copy_fixture("qwen35moe")
    (folder / "chat_template.jinja").unlink()
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = {"tool_use": "TOOLS", "default": "{% for m in messages %}<{{ m.content }}>{% endfor %}"}
    config_path.write_text(json.dumps(config))
    assert ModelTokenizer(folder).render_chat([{"role": "user", "content": "hi"}]) == "<hi>"
    for wrong, shown in ((5, "5"), (True, "true")):
        config["chat_template"] = wrong
        config_path.write_text(json.dumps(config))
        with pytest.raises(ModelFileError, match=rf"tokenizer_config.json: 'chat_template' is {shown}, not a template "
                                                 "or a list of named templates"):
            ModelTokenizer(folder)


def test_a_template_that_loops_without_calling_anything_is_stopped_in_one_line_naming_it(copy_fixture):
    """The render's deadline was checked at calls, * and ** only: loops over a range made once (10^8 rounds here, one
    without end just as well) ran on past it, with the engine thread that Stop cannot interrupt."""
    folder = copy_fixture("gptoss")
    (folder / "chat_template.jinja").write_text(
        "{% set r = range(100000) %}{% for i in r[:1000] %}{% for j in r %}{% endfor %}{% endfor %}done")
    started = time.monotonic()
    with pytest.raises(ModelFileError) as refused:
        ModelTokenizer(folder).render_chat(CONVERSATION)
    assert str(refused.value) == (f"{folder / 'chat_template.jinja'}: chat template failed to render (still rendering "
                                  "after 2 s (a loop without end?))")
    assert time.monotonic() - started < RENDER_LIMIT_S + LOADED_MACHINE_S


def test_loops_still_give_what_a_template_reads_of_them(copy_fixture):
    folder = copy_fixture("gptoss")
    source = ("{% for m in messages if m.role != 'system' %}{{ loop.index }}/{{ loop.length }}{{ loop.last }}"
              "{{ loop.previtem.role if loop.previtem }} {% else %}none{% endfor %}|"
              "{% for k, v in {'a': 1} | dictsort %}{{ k }}{{ v }}{% endfor %}|{% for c in '' %}x{% else %}empty{% endfor %}")
    (folder / "chat_template.jinja").write_text(source)
    assert ModelTokenizer(folder).render_chat(CONVERSATION) == transformers_render(source, CONVERSATION) == (
        "1/3False 2/3Falseuser 3/3Trueassistant |a1|empty")


def test_a_template_that_renders_nothing_of_the_conversation_is_named_not_called_an_empty_prompt(copy_fixture):
    """A template that reads another name than `messages` renders nothing; the user, who wrote a message, was told
    "the prompt is empty"."""
    folder = copy_fixture("gptoss")
    (folder / "chat_template.jinja").write_text("{% for m in conversation %}{{ m.content }}{% endfor %}\n")
    with pytest.raises(ModelFileError) as refused:
        ModelTokenizer(folder).render_chat(CONVERSATION)
    assert str(refused.value) == (f"{folder / 'chat_template.jinja'}: the chat template wrote nothing for a "
                                  "conversation of 4 messages")


@pytest.mark.parametrize("source, refused", [
    ("{{ messages.__class__ }}", "'__class__' of 'list'"),
    ("{{ '{0.__class__}'.format(messages) }}", "'__class__' of 'list'"),
    ("{% if messages.append is defined %}mutable{% endif %}", "'append' of 'list'")])
def test_a_template_that_reads_an_attribute_the_sandbox_refuses_is_named_in_one_line(copy_fixture, source, refused):
    """The sandbox answered such a read with an undefined value, which a template writes as nothing: the prompt was
    silently other than the template says. transformers' sandbox does the same, but no chat template reads one."""
    folder = copy_fixture("gptoss")
    (folder / "chat_template.jinja").write_text(source + "{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ModelFileError) as error:
        ModelTokenizer(folder).render_chat(CONVERSATION)
    assert str(error.value) == (f"{folder / 'chat_template.jinja'}: chat template failed to render (access to "
                                f"attribute {refused} object is unsafe.)")


@pytest.mark.parametrize("source", ["{{ 'a b'|center(100000000) }}", "{{ '%0100000000d'|format(1) }}",
                                    "{{ '{:>100000000}'.format(1) }}", "{{ ('a\\n' * 101)|indent(1000000) }}"])
def test_a_template_that_writes_more_than_it_may_add_is_refused_before_the_tokenizer(copy_fixture, source):
    """A filter or a format width makes 100 MB in one call, past the bound * has: the prompt then took 140 s and 8 GB
    to tokenize before 'the prompt has 6250009 tokens' (a width of 10^9 ran out of memory)."""
    folder = copy_fixture("gptoss")
    (folder / "chat_template.jinja").write_text(source + "{% for m in messages %}{{ m.content }}{% endfor %}")
    started = time.monotonic()
    with pytest.raises(ModelFileError) as refused:
        ModelTokenizer(folder).render_chat(CONVERSATION)
    assert str(refused.value).startswith(f"{folder / 'chat_template.jinja'}: the chat template wrote 100,0")
    assert str(refused.value).endswith(" characters for a conversation of 61; a template may add 4,000,000 at most")
    assert time.monotonic() - started < RENDER_LIMIT_S + LOADED_MACHINE_S
    long_message = [{"role": "user", "content": "x" * (RENDER_MAX_CHARS + 1)}]  # the conversation's own text is not
    (folder / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.content }}>{% endfor %}")
    assert len(ModelTokenizer(folder).render_chat(long_message)) == RENDER_MAX_CHARS + 3


def test_lipsum_is_bounded_as_a_loop_is(copy_fixture):
    """Jinja2's lipsum makes its paragraphs in one call, which the deadline is not checked in: lipsum(100000) took 15 s
    past it, a larger n minutes. A few paragraphs still come."""
    folder = copy_fixture("gptoss")
    template = folder / "chat_template.jinja"
    template.write_text("{{ lipsum(2, html=False) | wordcount > 30 }}")
    assert ModelTokenizer(folder).render_chat(CONVERSATION) == "True"
    template.write_text("{{ lipsum(2000) }}")
    with pytest.raises(ModelFileError) as refused:
        ModelTokenizer(folder).render_chat(CONVERSATION)
    assert str(refused.value) == (f"{template}: chat template failed to render (lipsum(2000) would make up to 200,000 "
                                  "words)")
