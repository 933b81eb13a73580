"""The chat pane and the record views with a model that reasons first (offscreen Qt, the real engine on a harmony
fixture whose answer is forced): the reasoning streams in a block above the answer, which collapses when the answer
begins; copy copies the answer; answer lengths leave room for an answer after the reasoning."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

pytest.importorskip("pytestqt")

from PySide6.QtCore import QUrl  # noqa: E402
from PySide6.QtGui import QGuiApplication  # noqa: E402

from engine.decoder import PartitionedDecoder  # noqa: E402
from engine.tokenizer import ModelTokenizer  # noqa: E402
from engine.generation import LoadedModel  # noqa: E402
from tests.reasoning_models import (ScriptedForward, ScriptedStates, harmony_folder,  # noqa: E402
                                    renders_after_the_warm_up, scenario_answers, thinking_switch_folder)
from tests.test_gui import WAIT, load, make_window  # noqa: E402

REASONING = "The user greets us. A short and friendly answer will do."
ANSWER = "Hello there!"


def long_answer(tokenizer) -> list[int]:
    """A harmony answer whose reasoning alone takes more tokens than any view's length for a model that answers at
    once, then ANSWER."""
    reasoning = REASONING + " Let me think." * 40
    tokens = (tokenizer.encode(f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant<|channel|>final"
                               f"<|message|>{ANSWER}") + [tokenizer.token_id("<|return|>")])
    assert len(tokens) > 100
    return tokens


def test_the_reasoning_streams_above_the_answer_and_collapses_when_it_begins(qtbot, tmp_path, copy_fixture,
                                                                             monkeypatch):
    folder = harmony_folder(copy_fixture)
    tokenizer = ModelTokenizer(folder)
    answer = (tokenizer.encode(f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>final"
                               f"<|message|>{ANSWER}") + [tokenizer.token_id("<|return|>")])
    scripted = ScriptedForward(tokenizer.vocab_size, answer)

    def slow_forward(_decoder, state, ids):  # slow enough for the window to show the reasoning alone first
        time.sleep(0.05)
        return scripted(state, ids)

    monkeypatch.setattr(PartitionedDecoder, "forward", slow_forward)
    window = make_window(qtbot, tmp_path)
    try:
        load(qtbot, window, folder)
        chat = window.chat
        # the model's own length (its search.max_length) leaves room for an answer after the reasoning
        assert chat.max_tokens.value() == 2048 and "It reasons before it answers" not in chat.live.text()
        assert "this model's own length" in chat.max_tokens.toolTip()
        assert not chat.reasoning.isEnabled()  # this stand-in template reads no reasoning setting
        chat.max_tokens.setValue(len(answer))
        chat.prompt.setPlainText("Hi")
        chat.send()
        qtbot.waitUntil(lambda: "The user greets" in chat.transcript.toPlainText(), timeout=WAIT)
        shown = chat.transcript.toPlainText()
        assert "▾ Thinking…" in shown and ANSWER[:2] not in shown and chat.live.text().startswith("Thinking…")
        qtbot.waitUntil(lambda: bool(not window.busy and chat.entries[-1].get("stats")), timeout=WAIT)
        entry = chat.entries[-1]
        assert (entry["text"], entry["reasoning"]) == (ANSWER, REASONING)
        shown = chat.transcript.toPlainText()
        assert "▸ Reasoning · 11 words" in shown and ANSWER in shown and "The user greets" not in shown
        chat._anchor(QUrl("reasoning:1"))  # a click on the header opens it
        shown = chat.transcript.toPlainText()
        assert "▾ Reasoning · 11 words" in shown and shown.index(REASONING) < shown.index(ANSWER)
        chat.copy_last()
        assert QGuiApplication.clipboard().text() == ANSWER
    finally:
        window.close()


def test_a_side_by_side_column_shows_the_reasoning_apart_and_marks_a_divergence_in_it(qtbot):
    from app.gui.side_by_side_view import Column

    column = Column("A")
    qtbot.addWidget(column)
    column.append("", reasoning="Think ")
    column.append("", reasoning="hard")
    column.flush()
    assert column.answer.toPlainText() == "Reasoning\nThink hard\n"
    column.append("Hi")
    column.flush()
    assert column.answer.toPlainText() == "Reasoning\nThink hard\nHi"
    # the answers part at token 1, inside the reasoning (this side's answer begins at token 3)
    thoughts, pieces = ["Think ", "hard", "", ""], ["", "", "", "Hi"]
    column.show_result(pieces, 1, {"tokens": "4"}, thoughts)
    assert column.answer.toPlainText() == "Reasoning\nThink hard\nHi"
    marked = column.answer.toHtml()
    assert marked.index("hard") < marked.index("Hi") and "background-color" in marked.split("hard")[0][-200:]
    column.show_result(pieces, 3, {"tokens": "4"}, thoughts)  # at token 3: in the answer
    marked = column.answer.toHtml()
    assert "background-color" in marked.split("Hi")[0][-200:] and "background-color" not in marked.split("hard")[0]


def _pixels(document, width: int = 240):
    """The document drawn `width` pixels wide."""
    from PySide6.QtGui import QColor, QImage, QPainter

    copy = document.clone()
    copy.setTextWidth(width)
    image = QImage(width, int(copy.size().height()) + 1, QImage.Format.Format_RGB32)
    image.fill(QColor("white"))
    painter = QPainter(image)
    copy.drawContents(painter)
    painter.end()
    return image


def _drawn_whole(reasoning: str, text: str):
    """The column's document as every batch drew it before batches were inserted: the whole of it, again."""
    from PySide6.QtGui import QTextDocument

    from app.gui.side_by_side_view import _escape, _with_reasoning

    document = QTextDocument()
    if reasoning:
        document.setHtml(_with_reasoning(_escape(reasoning), _escape(text)))
    else:
        document.setPlainText(text)
    return document


# (answer, reasoning) batches: a reasoning that shows nothing at first, runs of whitespace within and across batches,
# indented lines, HTML's own characters, more reasoning once the answer has begun (a harmony commentary channel)
BATCHES = [("", " "), ("", "The user  greets\tus."), ("", " \n  Short & <friendly>"), ("", "\n\n"),
           ("Hello", " Done"), ("  there!\n", ""), ("- one\n  - two", " (a note after the answer began)"), (" ", "\n"),
           (" three", "")]


def test_a_side_by_side_column_inserts_each_batch_and_shows_what_drawing_it_whole_showed(qtbot):
    from app.gui.side_by_side_view import Column

    column = Column("A")
    qtbot.addWidget(column)
    changes = []
    column.answer.document().contentsChange.connect(lambda _at, removed, added: changes.append(removed > added))
    reasoning = text = ""
    drawn_whole = []
    for batch, (more_text, more_reasoning) in enumerate(BATCHES):
        changes.clear()
        column.append(more_text, more_reasoning)
        column.flush()
        text, reasoning = text + more_text, reasoning + more_reasoning
        shown = _drawn_whole(reasoning, text)
        assert column.answer.toPlainText() == shown.toPlainText(), batch
        assert _pixels(column.answer.document()) == _pixels(shown), batch
        if any(changes):  # what the document held was removed
            drawn_whole.append(batch)
    # only as the reasoning paragraph came (showing nothing yet), as it showed a first character and as the answer did;
    # every batch drew the whole column before
    assert drawn_whole == [0, 1, 4]


def test_a_side_by_side_columns_streamed_answers_show_as_drawing_them_whole_did(qtbot):
    """Random batches of words, whitespace and line breaks, with and without reasoning, shown one by one or several
    together."""
    from app.gui.side_by_side_view import Column

    column = Column("A")
    qtbot.addWidget(column)
    rng = random.Random(5)
    pieces = ["word", " ", "  ", "\t", "\n", "\n\n", "<&>", "\xa0", "\r\n"]
    for _ in range(150):
        column.clear()
        reasoning = text = ""
        for _ in range(rng.randint(1, 12)):
            more_reasoning = "".join(rng.choices(pieces, k=rng.randint(0, 4))) if rng.random() < 0.6 else ""
            more_text = "".join(rng.choices(pieces, k=rng.randint(0, 4))) if rng.random() < 0.5 else ""
            column.append(more_text, more_reasoning)
            if rng.random() < 0.5:
                column.flush()
            reasoning, text = reasoning + more_reasoning, text + more_text
        column.flush()
        shown = _drawn_whole(reasoning, text)
        assert column.answer.toPlainText() == shown.toPlainText(), (reasoning, text)
        assert _pixels(column.answer.document()) == _pixels(shown), (reasoning, text)


def test_copy_of_an_answer_stopped_while_reasoning_copies_its_reasoning(qtbot):
    """Such an answer shows its reasoning alone, with a copy link under it: copy copies what it shows, not nothing
    (the link) nor the answer before it (the Copy button)."""
    from app.gui.chat_panel import ChatPanel

    chat = ChatPanel()
    qtbot.addWidget(chat)
    chat.entries = [{"role": "user", "text": "Hi"}, {"role": "assistant", "text": "Hello!", "stats": "s"},
                    {"role": "user", "text": "Why?"},
                    {"role": "assistant", "text": "", "reasoning": "Because", "reasoning_open": True, "stats": "s"}]
    chat.render()
    chat.copy_last()
    assert QGuiApplication.clipboard().text() == "Because"
    QGuiApplication.clipboard().setText("")
    chat._anchor(QUrl("copy:3"))
    assert QGuiApplication.clipboard().text() == "Because"
    chat._anchor(QUrl("copy:1"))
    assert QGuiApplication.clipboard().text() == "Hello!"


def test_the_reasoning_setting_offers_what_the_loaded_models_template_takes_and_keeps_the_users_choice(qtbot):
    from app.gui.chat_panel import ChatPanel

    chat = ChatPanel()
    qtbot.addWidget(chat)
    assert not chat.reasoning.isEnabled() and chat.options()["reasoning"] is None
    chat.set_reasoning_choices(["low", "medium", "high"])  # a gpt-oss model loads
    assert chat.reasoning.isEnabled() and chat.reasoning.itemText(0) == "model default"
    chat.reasoning.setCurrentIndex(chat.reasoning.findData("high"))
    chat.reasoning.activated.emit(chat.reasoning.currentIndex())  # as the user's pick
    assert chat.options()["reasoning"] == "high"
    chat.set_reasoning_choices([])  # a model without the setting: nothing is sent, the pick is kept
    assert chat.options()["reasoning"] is None and chat.reasoning.currentText() == "none in this model"
    chat.set_reasoning_choices(["low", "medium", "high"])
    assert chat.options()["reasoning"] == "high"
    chat.set_options({"reasoning": "on"})  # saved for a Qwen3 model, restored beside a gpt-oss one: the default
    assert chat.options()["reasoning"] is None
    chat.set_reasoning_choices(["on", "off"])
    assert chat.options()["reasoning"] == "on"


def test_model_defaults_fill_in_the_models_own_sampling_and_a_greedy_chat_is_told_of_them(qtbot):
    from app.gui.chat_panel import ChatPanel

    chat = ChatPanel()
    qtbot.addWidget(chat)
    assert not chat.model_defaults_button.isEnabled() and chat.load_hints(False) == ""
    chat.set_model_sampling({"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.0, "seed": 42,
                             "words": "temperature 0.6, top-k 20, top-p 0.95"})
    assert chat.load_hints(False) == (" Its genai_config.json samples (temperature 0.6, top-k 20, top-p 0.95); these "
                                      "answers are greedy: Settings ▸ Model defaults.")
    chat.model_defaults_button.click()
    options = chat.options()
    assert (options["temperature"], options["top_k"], options["top_p"], options["seed"]) == (0.6, 20, 0.95, 42)
    assert chat.load_hints(False) == ""  # sampling now
    assert chat.load_hints(True) == (" It reasons before it answers, which often takes more than the 256 tokens "
                                     "Settings ▸ Max tokens allows.")
    chat.max_tokens.setValue(4096)
    assert chat.load_hints(True) == ""
    chat.set_model_sampling({"temperature": 0.0, "top_k": 50, "top_p": 0.0, "repetition_penalty": 1.0, "seed": -1,
                             "words": "greedy"})
    chat.model_defaults_button.click()
    assert chat.options()["temperature"] == 0.0 and chat.load_hints(False) == ""
    assert chat.options()["top_p"] == 0.0  # the model's top_p 0 as it is (onnxruntime-genai takes it)
    assert chat.options()["seed"] == -1  # random: the model's random_seed -1


def test_model_defaults_say_which_of_the_models_values_a_box_cannot_hold(qtbot):
    """The sampler takes a temperature above the box's 5 and a seed past its 32 bits (engine/sampling.py): Model
    defaults filled them in clamped, the chat then sampling with values the model does not give, and said nothing."""
    from app.gui.chat_panel import ChatPanel

    chat = ChatPanel()
    qtbot.addWidget(chat)
    chat.set_model_sampling({"temperature": 7.5, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.0,
                             "seed": 2**40, "words": "temperature 7.5, top-k 20, top-p 0.95"})
    chat.model_defaults_button.click()
    options = chat.options()
    assert (options["temperature"], options["top_k"], options["top_p"], options["seed"]) == (5.0, 20, 0.95, 2**31 - 1)
    assert chat.live.text() == ("The model's temperature 7.5 is outside Temperature's 0 to 5, set to 5; seed "
                                f"{2**40} is outside Seed's -1 to {2**31 - 1}, set to {2**31 - 1}.")
    chat.live.setText("")
    chat.set_model_sampling({"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.0, "seed": 42,
                             "words": "temperature 0.6, top-k 20, top-p 0.95"})
    chat.model_defaults_button.click()
    assert chat.options()["temperature"] == 0.6 and chat.live.text() == ""  # all held: nothing to say


def test_max_tokens_follows_the_model_unless_the_user_chose_a_length(qtbot):
    from app.gui.chat_panel import ChatPanel

    chat = ChatPanel()
    qtbot.addWidget(chat)
    chat.max_tokens.set_model(2048)  # a model that reasons first loads
    assert chat.options()["max_new_tokens"] == 2048 and not chat.options()["max_new_tokens_chosen"]
    chat.max_tokens.set_model(None)  # then one that answers at once
    assert chat.max_tokens.value() == 256
    chat.max_tokens.setValue(600)  # the user's length, kept from model to model
    chat.max_tokens.set_model(2048)
    assert chat.options()["max_new_tokens"] == 600 and chat.options()["max_new_tokens_chosen"]
    shown = chat.max_tokens.toolTip()
    assert "after 600 new tokens, your length" in shown and "2048, this model's own" in shown
    saved = chat.options()
    chat.max_tokens.setValue(2048)  # the model's own again: it follows each model
    chat.max_tokens.set_model(None)
    assert chat.max_tokens.value() == 256
    chat.set_options(saved)  # restored: the user's length stays theirs
    chat.max_tokens.set_model(4096)
    assert chat.max_tokens.value() == 600
    chat.set_options({"max_new_tokens": 256})  # saved before the length followed the model: the old default
    assert chat.max_tokens.value() == 4096 and not chat.options()["max_new_tokens_chosen"]
    chat.set_options({"max_new_tokens": 300})  # ...and a length the user had set
    chat.max_tokens.set_model(2048)
    assert chat.max_tokens.value() == 300


def test_a_stop_text_may_name_a_special_token_whose_bars_separate_nothing(qtbot):
    from app.gui.chat_panel import ChatPanel

    chat = ChatPanel()
    qtbot.addWidget(chat)
    chat.stops.setText("<|im_end|>|Bye|x<|return|>y||")
    assert chat.options()["stop_strings"] == ["<|im_end|>", "Bye", "x<|return|>y"]
    chat.set_options(chat.options())
    assert chat.options()["stop_strings"] == ["<|im_end|>", "Bye", "x<|return|>y"]


@pytest.fixture
def reasoning_window(qtbot, tmp_path, copy_fixture, monkeypatch):
    """A window with a harmony model loaded whose every conversation answers long_answer; (window, its tokens)."""
    folder = harmony_folder(copy_fixture)
    tokenizer = ModelTokenizer(folder)
    answer = long_answer(tokenizer)
    monkeypatch.setattr(PartitionedDecoder, "forward", ScriptedStates(tokenizer.vocab_size, answer))
    window = make_window(qtbot, tmp_path, history_path=tmp_path / "history.sqlite3")
    load(qtbot, window, folder)
    yield window, answer
    window.close()


def run_job(qtbot, window, view):
    view.bar.run_button.click()
    qtbot.waitUntil(lambda: not view.bar.running and not window.busy, timeout=WAIT)
    return view.result


def test_side_by_side_leaves_a_model_that_reasons_first_room_for_its_answer(qtbot, reasoning_window):
    """Tokens follows the loaded model as the chat's Max tokens does: both sides answered after the reasoning where
    they stopped at 64 tokens inside it; a length the user sets is kept."""
    window, answer = reasoning_window
    view = window.side_by_side
    assert view.max_tokens.value() == 2048 and "this model's own length" in view.max_tokens.toolTip()
    view.prompt.setPlainText("Hi")
    records = run_job(qtbot, window, view).comparison.records
    for record, column in zip(records, (view.left, view.right)):
        turn = record.turns[0]
        assert (turn["answer"], turn["finish_reason"], turn["generated_tokens"]) == (ANSWER, "eos", len(answer))
        assert column.text == ANSWER
    view.max_tokens.setValue(20)
    records = run_job(qtbot, window, view).comparison.records
    assert [(r.turns[0]["answer"], r.turns[0]["generated_tokens"]) for r in records] == [("", 20), ("", 20)]


def test_side_by_side_answers_the_longer_of_the_two_models_own_lengths(copy_fixture, monkeypatch):
    """B may be another model: where the user set no length, both sides answer the longer of their models' own."""
    import app.gui.records_jobs as jobs

    answers_at_once, reasons_first = copy_fixture("lfm2moe"), harmony_folder(copy_fixture)
    lengths = []

    class Compared(Exception):
        pass

    def compare(_left, _right, _prompt, params, **_kwargs):
        lengths.append(params.max_new_tokens)
        raise Compared()

    monkeypatch.setattr(jobs, "compare", compare)
    ctx = jobs.JobContext(LoadedModel.open(answers_at_once), None, {}, threading.Event(), lambda _f, _t: None,
                          lambda _batch: None, lambda _choice, _config, _notes: None)
    for right, chosen in ((None, None), (reasons_first, None), (reasons_first, 20)):
        with pytest.raises(Compared):
            jobs.SideBySideJob("Hi", chosen, {}, right and str(right))(ctx)
    assert lengths == [64, 2048, 20]


def test_a_recorded_scenario_leaves_a_model_that_reasons_first_room_for_its_answer(qtbot, reasoning_window):
    """History's Record follows the loaded model as the chat does (it stopped at 64 tokens, inside the reasoning); a
    length the user sets is kept."""
    window, answer = reasoning_window
    view = window.scenarios
    assert view.max_tokens.value() == 2048 and "this model's own length" in view.max_tokens.toolTip()
    view.scenario.setCurrentText("short")
    turn = run_job(qtbot, window, view).saved[0][1].turns[0]
    assert (turn["answer"], turn["finish_reason"], turn["generated_tokens"]) == (ANSWER, "eos", len(answer))
    view.max_tokens.setValue(20)
    turn = run_job(qtbot, window, view).saved[0][1].turns[0]
    assert (turn["answer"], turn["finish_reason"], turn["generated_tokens"]) == ("", "length", 20)


def test_the_contention_test_leaves_a_model_that_reasons_first_room_for_its_answer(qtbot, reasoning_window,
                                                                                  monkeypatch, tmp_path):
    """Its three inferences follow the loaded model as the chat does (they stopped at 64 tokens, inside the
    reasoning); a length the user sets is kept."""
    import app.gui.records_jobs as jobs
    from engine.records.contention import make_corpus

    window, answer = reasoning_window
    answered = scenario_answers(monkeypatch, jobs)
    view = window.contention_view
    assert view.max_tokens.value() == 2048 and "this model's own length" in view.max_tokens.toolTip()
    view.corpus.setText(str(make_corpus(tmp_path / "corpus", files=2, words_per_file=10)))
    assert run_job(qtbot, window, view).report is not None
    assert answered == [(ANSWER, len(answer))] * 3
    answered.clear()
    view.max_tokens.setValue(20)
    assert run_job(qtbot, window, view).report is not None and answered == [("", 20)] * 3


def test_a_sweep_in_the_window_keeps_its_length_for_a_model_that_reasons_first_and_says_so(qtbot, copy_fixture,
                                                                                          monkeypatch, tmp_path):
    """Tokens stays the sweep's own for every model (a reasoning model's own length at every point could make a sweep
    hours long); where that stops the answers inside the reasoning, the sweep says so before it runs and as it ends."""
    import app.gui.records_jobs as jobs
    from app.gui.sweep_view import SweepView
    from engine.offload import OffloadConfig, SimulatedDevice

    folder = harmony_folder(copy_fixture)
    tokenizer = ModelTokenizer(folder)
    monkeypatch.setattr(PartitionedDecoder, "forward", ScriptedStates(tokenizer.vocab_size, long_answer(tokenizer)))
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=200_000), device=device)
    view = SweepView(tmp_path / "history.sqlite3")
    qtbot.addWidget(view)
    note = ("Answers stop after 32 tokens, inside the reasoning of this model, which reasons first: a sweep times the "
            "same work at each budget, and reasoning decodes as an answer does (the model's own length is 2048 tokens "
            "a run); Tokens sets another.")
    assert view.length_note.isHidden()  # no model yet
    view.set_model(model.reasoning_answer_tokens)  # said as the model loads, before any sweep
    assert not view.length_note.isHidden() and view.length_note.text() == note
    view.max_tokens.setValue(2048)  # room for the reasoning: nothing to say
    assert view.length_note.isHidden()
    view.max_tokens.setValue(32)
    assert view.length_note.text() == note and not view.length_note.isHidden()
    requested = []
    view.jobRequested.connect(lambda _kind, job: requested.append(job))
    view.points.setValue(2)
    view.scenario.setCurrentText("short")
    view.run()
    ctx = jobs.JobContext(model, device, {}, threading.Event(), lambda _f, _t: None, lambda _batch: None, None)
    result = requested[0](ctx)
    assert [(r.turns[0]["answer"], r.turns[0]["generated_tokens"]) for p in result.points for r in p.records] == [
        ("", 32)] * 2 * 3  # 3 repeats a point
    view.on_finished(result)
    assert view.bar.status.text() == "2 points; 6 runs saved to the history. " + note
    view.set_model(None)  # one that answers at once
    assert view.length_note.isHidden()


def test_the_sweep_says_where_its_answers_stop_as_a_model_that_reasons_first_loads(qtbot, reasoning_window):
    window, _answer = reasoning_window
    note = window.sweep.length_note
    assert not note.isHidden() and "(the model's own length is 2048" in note.text()
    window.unload()
    qtbot.waitUntil(lambda: window.loaded_path is None, timeout=WAIT)
    assert window.sweep.length_note.isHidden()


def test_the_sweeps_tokens_take_as_long_a_length_as_the_other_views(qtbot):
    from app.gui.sweep_view import SweepView
    from app.gui.widgets import AnswerLength

    view = SweepView()
    qtbot.addWidget(view)
    assert view.max_tokens.maximum() == AnswerLength(64).maximum() == 100_000
    view.max_tokens.setValue(32_768)  # a reasoning model's own, at most (engine/reasoning.py): 4096 before
    assert view.max_tokens.value() == 32_768


def test_the_models_own_sampling_for_model_defaults_carries_its_random_seed(copy_fixture):
    from types import SimpleNamespace

    from app.gui.engine_worker import _model_sampling
    from engine.genai_config import load_genai_config

    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["search"].update(do_sample=True, temperature=0.7, random_seed=9)
    (folder / "genai_config.json").write_text(json.dumps(config))
    sampling = _model_sampling(SimpleNamespace(config=load_genai_config(folder)))
    assert (sampling["temperature"], sampling["seed"]) == (0.7, 9)


def test_a_message_whose_answer_failed_before_any_text_goes_back_in_the_box_before_what_was_typed_since(qtbot):
    """A model that reasons first can think for minutes, time enough to type the next message; a failure before any
    answer text put the failed message back in the box over what was typed, which was lost."""
    from app.gui.chat_panel import ChatPanel

    chat = ChatPanel()
    qtbot.addWidget(chat)
    chat.set_state(busy=False, loaded=True)
    chat.prompt.setPlainText("Why is the sky blue?")
    chat.send()
    chat.append_text("", 1, reasoning="Light scatters")
    chat.prompt.setPlainText("And sunsets?")
    chat.finish_answer({"text": "", "finish_reason": "error", "error": "RuntimeError: out of memory", "timings": {}})
    assert chat.entries == [] and chat.prompt.toPlainText() == "Why is the sky blue?\nAnd sunsets?"


def test_an_answer_cut_at_the_context_says_the_limit_in_tokens():
    """"context full" alone left the user to guess how long the context is; the conversation (cached, prompt and
    answer, the last sampled token counted) is the limit reached."""
    from app.gui.chat_panel import stats_line

    timings = {"time_to_first_token_s": 0.1, "decode_tokens_per_s": 20.0, "total_s": 2.0, "generated_tokens": 31,
               "prompt_tokens": 166, "prefill_tokens_per_s": 500.0}
    assert stats_line({"finish_reason": "context", "timings": timings, "reused_cache_tokens": 1851}).endswith(
        " · context full of 2048 tokens")
    assert stats_line({"finish_reason": "max_length", "timings": timings}).endswith(
        " · the model's search.max_length of 197 tokens")


def test_record_and_the_sweep_take_a_reasoning_setting_to_their_prompts_and_records(qtbot, tmp_path, copy_fixture,
                                                                                    monkeypatch):
    """The window's Record and sweep had no reasoning setting: their answers rendered with the template's default, and
    Record's long scenario counted its own answer length with it too, so with thinking off (an empty think block after
    the input) that length asked for more than the context leaves. Each offers the loaded model's values; the one
    chosen renders every prompt, counts the long input's room, and each record keeps it."""
    from types import SimpleNamespace

    from engine.genai_config import load_genai_config
    from engine.records.history import History
    from engine.records.scenarios import scenario_turns
    from tests.reasoning_models import thinking_switch_folder
    from tests.test_reasoning import _rendered_tokens, configured, scripted_hello

    folder = thinking_switch_folder(copy_fixture)
    tokenizer = ModelTokenizer(folder)
    scripted_hello(monkeypatch, tokenizer, load_genai_config(folder))
    roomy = SimpleNamespace(context_length=1 << 20, search=SimpleNamespace(max_length=1 << 20))
    long_input, short = (scenario_turns(name, tokenizer, roomy, 1, "off")[0] for name in ("long", "short"))
    off = {"enable_thinking": False}
    context = _rendered_tokens(tokenizer, long_input, off) + 70  # the answer's room with thinking off: 70 tokens
    assert _rendered_tokens(tokenizer, long_input, {}) < context - 70  # (the default renders no block)
    configured(folder, context, {"max_length": context})
    history = History(tmp_path / "history.sqlite3")
    window = make_window(qtbot, tmp_path, history_path=tmp_path / "history.sqlite3")
    load(qtbot, window, folder, {"device": {"kind": "simulated", "capacity": 8 << 30}, "entries": {}})
    assert not window.sweep.length_note.isHidden()  # its 32 tokens stop inside the reasoning of this model
    for view in (window.scenarios, window.sweep):
        assert [view.reasoning.itemText(i) for i in range(view.reasoning.count())] == ["model default", "on", "off"]
        view.reasoning.setCurrentIndex(view.reasoning.findData("off"))
        view.reasoning.activated.emit(view.reasoning.currentIndex())  # as the user's pick
    assert window.sweep.length_note.isHidden()  # thinking off answers at once: it said they stopped inside a reasoning
    window.scenarios.scenario.setCurrentText("long")  # at the model's own length: what the context leaves
    result = run_job(qtbot, window, window.scenarios)
    assert result is not None and not result.errors, window.error_banner.label.text()
    saved = result.saved
    assert [(r.generation["reasoning"], r.generation["max_new_tokens"], r.turns[0]["prompt_tokens"])
            for _id, r in saved] == [("off", 70, context - 70)]
    window.sweep.points.setValue(2)
    window.sweep.repeats.setValue(1)
    window.sweep.max_tokens.setValue(2)
    window.sweep.scenario.setCurrentText("short")
    result = run_job(qtbot, window, window.sweep)
    assert result.length_note == "" and "inside the reasoning" not in window.sweep.bar.status.text()
    points = result.points
    assert [(r.generation["reasoning"], r.turns[0]["prompt_tokens"]) for p in points for r in p.records] == [
        ("off", _rendered_tokens(tokenizer, short, off))] * 2
    assert len(history.rows(label="sweep")) == 2
    window.close()


def test_the_contention_tests_reasoning_offers_the_models_values_reaches_its_answers_and_is_kept(qtbot, tmp_path,
                                                                                                copy_fixture,
                                                                                                monkeypatch):
    """The contention test had no Reasoning, where Record and the sweep have one: its answers rendered with the
    template's default. It offers the loaded model's values, its answers render with the one chosen, the report says
    it, and it is kept when the window reopens, as theirs is."""
    import engine.records.scenarios as scenarios
    from engine.genai_config import load_genai_config
    from engine.records.contention import make_corpus

    folder = thinking_switch_folder(copy_fixture)
    tokenizer = ModelTokenizer(folder)
    answer = tokenizer.encode("Hello there!") + [load_genai_config(folder).eos_token_ids[0]]
    monkeypatch.setattr(PartitionedDecoder, "forward", ScriptedStates(tokenizer.vocab_size, answer))
    rendered = renders_after_the_warm_up(monkeypatch, scenarios)  # (its warm-up after the load, as before a record)
    window = make_window(qtbot, tmp_path, history_path=tmp_path / "history.sqlite3")
    view = window.contention_view
    try:
        assert not view.reasoning.isEnabled()  # no model yet
        load(qtbot, window, folder)
        assert [view.reasoning.itemData(i) for i in range(view.reasoning.count())] == [None, "on", "off"]
        view.reasoning.choose("off")
        view.max_tokens.setValue(4)
        view.corpus.setText(str(make_corpus(tmp_path / "corpus", files=2, words_per_file=10)))
        rendered.clear()
        report = run_job(qtbot, window, view).report
        assert rendered and all(said == {"enable_thinking": False} for said in rendered)
        assert report.generation["reasoning"] == "off"
        assert "\nAnswers: greedy, reasoning setting off, at most 4 tokens each.\n" in report.markdown()
    finally:
        window.close()
    again = make_window(qtbot, tmp_path)
    assert again.contention_view.reasoning.chosen == "off"
    again.close()
