"""The workstation window against the real engine on fixture models (offscreen Qt).

Every wait is on what the WINDOW shows (qtbot.waitUntil): the worker emits from its own thread, so
a blocker on a worker signal can wake before the window's queued slots have run.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pytestqt")

from PySide6.QtCore import QCoreApplication, QMimeData, QPointF, QSettings, Qt, QTimer, QUrl  # noqa: E402
from PySide6.QtGui import QDropEvent, QPalette  # noqa: E402
from PySide6.QtWidgets import QLabel  # noqa: E402

from app.gui.collector import due_generation  # noqa: E402
from app.gui.contention import CALM_SAMPLES  # noqa: E402
from app.gui.engine_worker import threads_sentence  # noqa: E402
from app.gui.main_window import STOPPABLE, MainWindow  # noqa: E402
from app.gui.placement_view import copies_text, threads_text  # noqa: E402
from app.gui.widgets import MAX_ANSWER_TOKENS  # noqa: E402
from engine.offload.config import OffloadConfig  # noqa: E402
from engine.ort_env import cpu_threads  # noqa: E402
from engine.offload.decode_path import tier_bytes  # noqa: E402
from engine.units import counted, human_bytes  # noqa: E402
from tests.conftest import REPO, fixture_folder  # noqa: E402

WAIT = 120_000


def make_window(qtbot, tmp_path, **kwargs):
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    win = MainWindow(settings=settings, sample_interval_ms=kwargs.pop("sample_interval_ms", 200),
                     demo_dir=str(tmp_path / "demo"), **kwargs)
    qtbot.addWidget(win)
    win.show()
    return win


@pytest.fixture
def window(qtbot, tmp_path):
    win = make_window(qtbot, tmp_path)
    yield win
    win.close()


@pytest.fixture
def own_samples_only(window):
    """The window fed only the test's own samples: its sampler stopped and what it noted of this machine's real load
    forgotten. A sample of a busy host (other tests, a loaded CI machine) noted before the test's first one counted
    toward raising the CPU warning, which then came up one sample early."""
    window._sampler_thread.stop()
    QCoreApplication.processEvents()  # samples already queued arrive now, before the slate is wiped
    window.warnings.reset()  # (in place: the banner's close button is connected to this hold)
    window.warnings.recent.clear()
    window.watch.reset()


def same(a, b) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def load(qtbot, window, path, settings=None):
    """Load through the worker and wait until the window shows the outcome."""
    if settings is not None:
        window.save_model_settings(str(path), settings)
    window.load_model(str(path))
    qtbot.waitUntil(lambda: not window.busy and (same(window.loaded_path, path) or window.error_banner.isVisible()),
                    timeout=WAIT)


def ask(qtbot, window, text, max_tokens=24):
    window.chat.max_tokens.setValue(max_tokens)
    window.chat.prompt.setPlainText(text)
    window.chat.send()
    qtbot.waitUntil(lambda: bool(not window.busy and window.chat.entries and window.chat.entries[-1].get("stats")),
                    timeout=WAIT)
    return window.chat.entries[-1]


@functools.cache
def slot() -> int:
    """One gpt-oss fixture expert in a device slot (the GPU kernels' layout), as the planner budgets it."""
    from engine.model_folder import ModelFolder

    return ModelFolder.open(fixture_folder("gptoss")).experts[0].device_bytes_per_expert


@functools.cache
def staged() -> int:
    """One gpt-oss fixture expert as the engine stages it in the pinned ring (the device's own count)."""
    from engine.generation import LoadedModel
    from engine.offload import OffloadConfig, SimulatedDevice

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(fixture_folder("gptoss"), offload=OffloadConfig(), device=device)
    return max(device.staging_bytes_per_expert(runner) for runner in model.offload.runners)


def simulated() -> dict:  # 3 gpt-oss fixture experts on the device (one layer's worth+)
    return {"device": {"kind": "simulated", "capacity": 8 << 30}, "entries": {"device_expert_bytes": str(3 * slot())}}


def test_window_opens_and_remembers_layout_and_theme(qtbot, tmp_path):
    win = make_window(qtbot, tmp_path)
    assert win.isVisible() and set(win.docks) == {"model", "budget", "graphs", "placement"}
    assert not win.chat.send_button.isEnabled()  # nothing loaded yet
    assert win.status_state.text() == "Idle"
    win.docks["placement"].hide()
    win.set_theme("dark")
    qtbot.waitUntil(lambda: win.palette().color(QPalette.ColorRole.Window).lightness() < 128)
    win.close()
    again = make_window(qtbot, tmp_path)
    assert again.docks["placement"].isHidden()
    assert again.theme_choice == "dark"
    qtbot.waitUntil(lambda: again.palette().color(QPalette.ColorRole.Window).lightness() < 128)
    again.set_theme("light")
    qtbot.waitUntil(lambda: again.palette().color(QPalette.ColorRole.Window).lightness() > 128)
    again.reset_layout()
    assert not again.docks["placement"].isHidden()
    again.close()


@pytest.mark.parametrize("kept", ["Dark", "blue", ""])
def test_a_theme_the_settings_file_names_that_is_none_of_the_menus_follows_the_system_as_the_menu_says(
        qtbot, tmp_path, monkeypatch, kept):
    """A hand-edited view/theme the menu has no entry for ticked "Follow the system" while the window was drawn light
    (only "dark" drew it dark), on a dark desktop too."""
    from app.gui import theme

    monkeypatch.setattr(theme, "system_is_dark", lambda _app: True)
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    settings.setValue("view/theme", kept)
    settings.sync()
    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.theme_choice == "system" and win.theme_actions["system"].isChecked()
    qtbot.waitUntil(lambda: win.palette().color(QPalette.ColorRole.Window).lightness() < 128)
    win.close()
    assert QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat).value("view/theme") == "system"


def test_open_starts_where_the_last_model_was_opened_after_a_restart(qtbot, tmp_path, monkeypatch):
    """The Open dialog started in the home folder at every start, though the settings keep the models opened last;
    it starts at the last that is still there now (a moved one is passed over), home where none is."""
    from PySide6.QtWidgets import QFileDialog

    starts = []
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda _parent, _title, start: starts.append(start) or "")
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    kept = fixture_folder("gptoss")
    settings.setValue("recent", json.dumps([str(tmp_path / "moved"), str(kept)]))
    settings.sync()
    win = make_window(qtbot, tmp_path, nvml=False)
    win.choose_model()
    win.close()
    settings.setValue("recent", json.dumps([str(tmp_path / "moved")]))
    settings.sync()
    again = make_window(qtbot, tmp_path, nvml=False)
    again.choose_model()
    again.close()
    assert starts == [str(kept), str(Path.home())]


def test_a_folder_that_cannot_be_opened_is_said_with_its_path_once(qtbot, window, tmp_path):
    """Opening a folder the window cannot open said "Could not open X: X: no such folder (...)", the path twice (the
    refusal starts with the folder it refuses); a file inside the folder it refuses is still named after the folder."""
    gone = tmp_path / "gone"
    window.open_model(str(gone))
    qtbot.waitUntil(lambda: window.error_banner.isVisible() and not window.busy, timeout=WAIT)
    assert window.error_banner.text() == (f"Could not open {gone}: no such folder (point at the folder holding "
                                          "genai_config.json and model.onnx)")
    empty = tmp_path / "empty"
    empty.mkdir()
    window.error_banner.hide()
    window.open_model(str(empty))
    qtbot.waitUntil(lambda: window.error_banner.isVisible() and not window.busy, timeout=WAIT)
    assert window.error_banner.text().startswith(f"Could not open {empty}: {empty / 'genai_config.json'}")


def test_a_recent_model_whose_folder_is_gone_is_dropped_from_the_list_and_said_once(qtbot, tmp_path):
    """A recent model whose folder had moved stayed in Open recent, and picking it said "Could not open X: X: no such
    folder (point at the folder holding genai_config.json and model.onnx)", the path twice, at every pick. Picked
    from the panel's Recent or the window's menu, it is now dropped from the list and said so, with its path once."""
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    kept, moved, replaced = fixture_folder("gptoss"), tmp_path / "moved", tmp_path / "replaced"
    replaced.write_text("a file where the model's folder was")
    settings.setValue("recent", json.dumps([str(moved), str(replaced), str(kept)]))
    settings.sync()
    win = make_window(qtbot, tmp_path, nvml=False)
    win.model_panel.recent_menu.actions()[0].trigger()
    assert win.error_banner.text() == (f"Could not open {moved}: no such folder (moved or deleted since it was "
                                       "opened): it is dropped from the recent models")
    win.recent_menu.actions()[0].trigger()
    assert win.error_banner.text() == (f"Could not open {replaced}: not a folder (moved or deleted since it was "
                                       "opened): it is dropped from the recent models")
    assert win.recent() == [str(kept)] and win.facts is None and not win.busy
    assert [a.text() for a in win.recent_menu.actions()] == [a.text() for a in win.model_panel.recent_menu.actions()]
    assert [a.text() for a in win.recent_menu.actions()] == [str(kept)]
    win.recent_menu.actions()[0].trigger()  # one still there opens as before
    qtbot.waitUntil(lambda: win.facts is not None and not win.busy, timeout=WAIT)
    assert win.facts.path == str(kept) and win.error_banner.isHidden()
    win.close()


def test_open_recent_lists_a_folder_once_however_it_was_named_and_shows_it_as_named(qtbot, tmp_path):
    """Open recent compared paths as text: the same folder named /a/b, /a/b/ or through a link was listed once for
    each name. Folders are compared resolved, each listed once, as the user last named it (a link as the link)."""
    gptoss, lfm2moe = str(fixture_folder("gptoss")), str(fixture_folder("lfm2moe"))
    link = tmp_path / "models" / "current"
    link.parent.mkdir()
    link.symlink_to(gptoss, target_is_directory=True)
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    settings.setValue("recent", json.dumps([gptoss + "/", lfm2moe, gptoss]))  # (kept so before)
    settings.sync()
    win = make_window(qtbot, tmp_path, nvml=False)

    def listed() -> list[str]:
        shown = [a.text() for a in win.recent_menu.actions()]
        assert shown == [a.text() for a in win.model_panel.recent_menu.actions()]
        return shown

    assert listed() == [gptoss + "/", lfm2moe]
    for named, shown in ((str(link), str(link)), (gptoss + "/", gptoss), (str(link) + "/", str(link))):
        win.open_model(named)
        qtbot.waitUntil(lambda: not (win.busy or win._waiting), timeout=WAIT)
        assert win.recent() == listed() == [shown, lfm2moe], named
        assert same(win.facts.path, gptoss) and win.error_banner.isHidden()
    win.recent_menu.actions()[1].trigger()
    qtbot.waitUntil(lambda: not (win.busy or win._waiting), timeout=WAIT)
    assert win.recent() == [lfm2moe, str(link)]
    win.close()


@pytest.mark.parametrize("tokens", [-5, 0, 250_000])
def test_a_chat_length_the_settings_file_keeps_out_of_range_is_said_not_answered_with(qtbot, tmp_path, tokens):
    """Kept as the user's own, a chat length of -5 in a hand-edited settings file answered 1 token, without a word
    (0 followed the model and 250000 the box's most, still with no word): the other views' lengths are checked, the
    chat's was not. It is now said, and the chat starts from its defaults."""
    ini = str(tmp_path / "settings.ini")
    settings = QSettings(ini, QSettings.Format.IniFormat)
    settings.setValue("chat/options", json.dumps({"max_new_tokens": tokens, "max_new_tokens_chosen": True}))
    settings.sync()
    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.settings_banner.text().startswith(
        f"{ini}: the chat options kept under chat/options cannot be used (max_new_tokens {tokens} is not a length of "
        f"1 to {MAX_ANSWER_TOKENS} tokens): the chat starts from its defaults")
    assert win.chat.max_tokens.chosen is None and win.chat.options()["max_new_tokens"] == win.chat.max_tokens.plain
    win.close()


@pytest.mark.parametrize("kept, problem", [
    ('{"seed": 2147483648}', "seed 2147483648 is not within -1 to 2147483647"),
    ('{"top_k": 1099511627776}', "top_k 1099511627776 is not within 0 to 100000"),
    ('{"temperature": NaN}', "temperature NaN is not within 0 to 5"),
    ('{"temperature": 99}', "temperature 99 is not within 0 to 5"),
    ('{"top_p": -3}', "top_p -3 is not within 0 to 1"),
    ('{"repetition_penalty": 0.1}', "repetition_penalty 0.1 is not within 0.5 to 3"),
    ('{"seed": 1e400}', "seed Infinity is not a whole number"),
    ('{"seed": 3.7}', "seed 3.7 is not a whole number"),
    ('{"top_k": true}', "top_k true is not a whole number"),
    ('{"max_new_tokens": 5.5}', "max_new_tokens 5.5 is not a whole number"),
    ('{"temperature": "0.7"}', 'temperature "0.7" is not a number'),
    ('{"max_new_tokens": 300, "max_new_tokens_chosen": "no"}', 'max_new_tokens_chosen "no" is not true or false'),
    # (copied from Python: said as "Expecting value at character 50 of it")
    ('{"max_new_tokens": 300, "max_new_tokens_chosen": True}',
     '{"max_new_tokens": 300, "max_new_tokens_chosen": True} is not JSON: JSON writes True as true'),
    ('{"reasoning": None}', '{"reasoning": None} is not JSON: JSON writes None as null'),
    ('{"reasoning": ["high"]}', 'reasoning ["high"] is not a reasoning value or null'),
    ('{"topk": 40}', "topk is not a chat option: did you mean top_k?"),
    ('{"temperature": 0.7, "colour": "blue"}', "colour is not a chat option (they are max_new_tokens, "
     "max_new_tokens_chosen, temperature, top_k, top_p, repetition_penalty, seed, stop_strings, reasoning)"),
])
def test_chat_options_the_settings_file_keeps_out_of_range_or_of_the_wrong_kind_are_said(qtbot, tmp_path, kept,
                                                                                          problem):
    """Out of a box's range: a hand-edited chat seed or top-k past 32 bits raised OverflowError from the box, and the
    window did not open; a temperature of 99 or NaN, a top-p of -3, became the box's nearest (NaN its least) without a
    word. Of the wrong kind: a seed of 1e400 raised OverflowError (int() of infinity); a seed of 3.7 became 3, a top-k
    of true 1, a length 5.5 the user's 5, "no" chose the length, and a reasoning of ["high"] was dropped, all without a
    word. Of no option: a misspelt topk left top-k at its default without a word. Each is now said and set aside, and
    the chat starts from its defaults."""
    ini = str(tmp_path / "settings.ini")
    settings = QSettings(ini, QSettings.Format.IniFormat)
    settings.setValue("chat/options", kept)
    settings.sync()
    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.settings_banner.text() == (
        f"{ini}: the chat options kept under chat/options cannot be used ({problem}): the chat starts from its "
        "defaults; what was kept is now under chat/options.bad there")
    options = win.chat.options()
    assert (options["seed"], options["top_k"], options["temperature"], options["top_p"], options["repetition_penalty"],
            options["max_new_tokens_chosen"], options["reasoning"]) == (-1, 0, 0.0, 1.0, 1.0, False, None)
    win.close()
    assert QSettings(ini, QSettings.Format.IniFormat).value("chat/options.bad") == kept


def test_the_answer_lengths_the_user_sets_outlive_the_window_and_unset_ones_follow_the_model(qtbot, tmp_path):
    """Side by side's, Record's and the contention test's lengths are kept in the settings as the chat's are: one the
    user set comes back after a restart, whatever the model; one they did not set follows the model loaded."""
    win = make_window(qtbot, tmp_path, nvml=False)
    boxes = (win.side_by_side.max_tokens, win.scenarios.max_tokens, win.contention_view.max_tokens)
    for box in boxes:
        box.set_model(2048)  # a model that reasons first
    win.side_by_side.max_tokens.setValue(600)
    win.contention_view.max_tokens.setValue(20)
    win.chat.max_tokens.setValue(300)
    win.close()
    again = make_window(qtbot, tmp_path, nvml=False)
    boxes = (again.side_by_side.max_tokens, again.scenarios.max_tokens, again.contention_view.max_tokens)
    assert [box.chosen for box in boxes] == [600, None, 20] and again.chat.max_tokens.chosen == 300
    for box in boxes:
        box.set_model(4096)
    assert [box.value() for box in boxes] == [600, 4096, 20]
    for box in boxes:
        box.set_model(None)  # one that answers at once: the unset length is that view's own for it
    assert [box.value() for box in boxes] == [600, 64, 20]
    again.side_by_side.max_tokens.setValue(64)  # the model's own again: it follows each model from now on
    again.close()
    third = make_window(qtbot, tmp_path, nvml=False)
    third.side_by_side.max_tokens.set_model(2048)
    assert third.side_by_side.max_tokens.value() == 2048 and third.contention_view.max_tokens.value() == 20
    third.close()


def test_the_sweeps_tokens_the_user_sets_outlive_the_window_and_unset_stays_the_sweeps_own(qtbot, tmp_path):
    """Budget sweep's Tokens is kept as the other views' lengths are: one the user set comes back after a restart
    (it came back as 32); set to the sweep's own, or never set, it stays the sweep's own, saved as no length."""
    from engine.records.lengths import SWEEP_TOKENS

    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.sweep.max_tokens.value() == SWEEP_TOKENS == 32 and win.sweep.max_tokens.chosen is None
    win.sweep.max_tokens.setValue(200)
    win.close()
    again = make_window(qtbot, tmp_path, nvml=False)
    assert again.sweep.max_tokens.value() == 200 and again.sweep.max_tokens.chosen == 200
    again.sweep.max_tokens.setValue(SWEEP_TOKENS)
    again.close()
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    assert settings.value("sweep/max_new_tokens") == "null"  # the sweep's own: another default would follow
    third = make_window(qtbot, tmp_path, nvml=False)
    assert third.sweep.max_tokens.value() == SWEEP_TOKENS and third.sweep.max_tokens.chosen is None
    third.close()


def test_the_sweeps_repeats_outlive_the_window_and_a_kept_value_that_does_not_fit_is_the_default(qtbot, tmp_path):
    from engine.records.lengths import SWEEP_REPEATS

    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.sweep.repeats.value() == SWEEP_REPEATS == 3
    win.sweep.repeats.setValue(1)
    win.close()
    again = make_window(qtbot, tmp_path, nvml=False)
    assert again.sweep.repeats.value() == 1
    again.close()
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    for raw in ("0", "10", "lots", "-2"):
        settings.setValue("sweep/repeats", raw)
        settings.sync()
        third = make_window(qtbot, tmp_path, nvml=False)
        assert third.sweep.repeats.value() == SWEEP_REPEATS, raw
        third.close()


def test_a_settings_file_holding_no_length_that_fits_leaves_the_length_to_the_model(qtbot, tmp_path):
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    for key, raw in (("side_by_side", "0"), ("record", "lots"), ("contention", "true"), ("sweep", "100001")):
        settings.setValue(f"{key}/max_new_tokens", raw)
    settings.sync()
    win = make_window(qtbot, tmp_path, nvml=False)
    assert [box.chosen for box in win.answer_lengths.values()] == [None, None, None, None]
    assert win.sweep.max_tokens.value() == 32
    win.close()


def test_other_kept_settings_that_do_not_fit_are_said_and_kept_aside(qtbot, tmp_path):
    """A hand-edited answer length, answers choice, sweep repeats or theme that did not fit became the default without
    a word, and the next save wrote over it. Each is now said, on a line of its own, and kept under a key of its own."""
    from engine.records.lengths import SWEEP_REPEATS

    ini = str(tmp_path / "settings.ini")
    settings = QSettings(ini, QSettings.Format.IniFormat)
    kept = {"view/theme": "purple", "record/max_new_tokens": "lots", "sweep/max_new_tokens": "9999999",
            "sweep/answers": "beams", "sweep/repeats": "99999999999999999999"}
    for key, raw in kept.items():
        settings.setValue(key, raw)
    settings.sync()
    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.settings_banner.text().split("\n") == [
        f"{ini}: the theme kept under view/theme cannot be used (purple is not a theme name: the themes are system, "
        "light and dark): the system's is used; what was kept is now under view/theme.bad there",
        f"{ini}: the answer length kept under record/max_new_tokens cannot be used (lots is not a length of 1 to "
        f"{MAX_ANSWER_TOKENS} tokens, or null): its default is used; what was kept is now under "
        "record/max_new_tokens.bad there",
        f"{ini}: the answer length kept under sweep/max_new_tokens cannot be used (9999999 is not a length of 1 to "
        f"{MAX_ANSWER_TOKENS} tokens, or null): its default is used; what was kept is now under "
        "sweep/max_new_tokens.bad there",
        f"{ini}: the answers choice kept under sweep/answers cannot be used (beams is not one of greedy, model, "
        "chat): greedy is used; what was kept is now under sweep/answers.bad there",
        f"{ini}: the sweep's repeats kept under sweep/repeats cannot be used (99999999999999999999 is not a count of "
        f"1 to 9): its default, {SWEEP_REPEATS}, is used; what was kept is now under sweep/repeats.bad there"]
    assert win.theme_choice == "system" and win.scenarios.max_tokens.chosen is None
    assert win.sweep.answers.currentData() == "greedy" and win.sweep.repeats.value() == SWEEP_REPEATS
    win.close()
    settings = QSettings(ini, QSettings.Format.IniFormat)
    assert {key: settings.value(key + ".bad") for key in kept} == kept


def test_an_answer_length_kept_with_thousands_separators_is_said_as_that_not_as_a_list(qtbot, tmp_path):
    """Qt reads an answer length typed in as 1,000 as the list ["1", "000"]: it was refused as "['1', '000'] is not a
    length of 1 to 100000 tokens, or null". It is not taken as a thousand (where a comma marks decimals it is one):
    it, and one in quotes or with a space, is now said to be no whole number, thousands separators not taken."""
    ini = tmp_path / "settings.ini"
    ini.write_text('[record]\nmax_new_tokens=1,000\n[sweep]\nmax_new_tokens="2,500"\n'
                   "[contention]\nmax_new_tokens=1 000\n")
    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.settings_banner.text().split("\n") == [
        f"{ini}: the answer length kept under {key}/max_new_tokens cannot be used ({typed} is not a whole number of "
        f"tokens: thousands separators are not taken): its default is used; what was kept is now under "
        f"{key}/max_new_tokens.bad there" for key, typed in (("record", "1,000"), ("contention", "1 000"),
                                                             ("sweep", "2,500"))]
    assert [box.chosen for box in win.answer_lengths.values()] == [None, None, None, None]
    win.close()
    settings = QSettings(str(ini), QSettings.Format.IniFormat)
    assert settings.value("record/max_new_tokens.bad") == ["1", "000"]


def test_an_answer_length_qt_split_at_a_comma_is_said_as_typed(qtbot, tmp_path):
    """An answer length with a comma that is no thousands separator (512,lots) was said as Qt's list of its parts:
    "['512', 'lots'] is not a length of 1 to 100000 tokens, or null". It is now said as typed, as other kept values
    are (as_kept)."""
    ini = tmp_path / "settings.ini"
    ini.write_text("[record]\nmax_new_tokens=512,lots\n")
    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.settings_banner.text() == (
        f"{ini}: the answer length kept under record/max_new_tokens cannot be used (512,lots is not a length of 1 to "
        f"{MAX_ANSWER_TOKENS} tokens, or null): its default is used; what was kept is now under "
        "record/max_new_tokens.bad there")
    win.close()


def test_counts_kept_with_a_unit_are_said_to_need_the_number_alone(qtbot, tmp_path):
    """An answer length typed as 512 tokens, or sweep repeats as 3x, was refused as "512 tokens is not a length of 1 to
    100000 tokens, or null", though 512 is one: the refusal did not say the unit was what it could not take. It now
    says to write the number alone (not taken for it: 512k is no 512)."""
    from engine.records.lengths import SWEEP_REPEATS

    ini = tmp_path / "settings.ini"
    ini.write_text("[record]\nmax_new_tokens=512 tokens\n[sweep]\nmax_new_tokens=2k\nrepeats=3x\n")
    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.settings_banner.text().split("\n") == [
        f"{ini}: the answer length kept under {key}/max_new_tokens cannot be used ({typed} is not a length of 1 to "
        f"{MAX_ANSWER_TOKENS} tokens, or null: write the number alone, without a unit): its default is used; what "
        f"was kept is now under {key}/max_new_tokens.bad there" for key, typed in (("record", "512 tokens"),
                                                                                  ("sweep", "2k"))] + [
        f"{ini}: the sweep's repeats kept under sweep/repeats cannot be used (3x is not a count of 1 to 9: write the "
        f"number alone, without a unit): its default, {SWEEP_REPEATS}, is used; what was kept is now under "
        "sweep/repeats.bad there"]
    assert win.scenarios.max_tokens.chosen is None and win.sweep.repeats.value() == SWEEP_REPEATS
    win.close()


def test_settings_file_keys_the_window_never_reads_are_said_with_the_nearest_and_left(qtbot, tmp_path):
    """A setting typed by hand under a key the window never reads (chat/option for chat/options, recnt for recent)
    was passed over without a word: the user saw their edit do nothing. Each such key is now said, with the key it is
    near; it is left in the file. Models' budgets (under their folder's hash) and values set aside (.bad) are not."""
    ini = tmp_path / "settings.ini"
    key = MainWindow._model_key("/m")
    ini.write_text(f'[General]\nrecnt=x\ncolour=blue\n[chat]\noption={{}}\n[models]\n{key.split("/")[1]}={{}}\n'
                   "[view]\ntheme.bad=purple\ntheme.bad2=blue\n")
    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.settings_banner.text().split("\n") == [
        f"{ini}: chat/option is not a setting the workbench keeps (did you mean chat/options?): it is not used, and "
        "left there",
        f"{ini}: colour is not a setting the workbench keeps: it is not used, and left there",
        f"{ini}: recnt is not a setting the workbench keeps (did you mean recent?): it is not used, and left there"]
    win.close()
    settings = QSettings(str(ini), QSettings.Format.IniFormat)
    assert [settings.value(k) for k in ("recnt", "colour", "chat/option")] == ["x", "blue", "{}"]


def test_keys_of_the_organisations_settings_file_are_not_said_as_the_users(qtbot, tmp_path):
    """Qt's allKeys() lists the keys of the fallback files too (the organisation's, the system's, on macOS the global
    domain): each was said as a key of the user's file the window never reads."""
    from PySide6.QtCore import QStandardPaths

    (tmp_path / "moe-workbench").mkdir()
    (tmp_path / "moe-workbench.ini").write_text("[General]\ncolour=blue\n")  # the organisation's, shared
    ini = tmp_path / "moe-workbench" / "moe-workbench.ini"
    ini.write_text("[General]\nrecnt=x\n")
    default = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.GenericConfigLocation)
    QSettings.setPath(QSettings.Format.IniFormat, QSettings.Scope.UserScope, str(tmp_path))
    try:
        settings = QSettings(QSettings.Format.IniFormat, QSettings.Scope.UserScope, "moe-workbench", "moe-workbench")
        assert settings.value("colour") == "blue"  # (the fallback is read)
        win = MainWindow(settings=settings, sample_interval_ms=200, demo_dir=str(tmp_path / "demo"), nvml=False)
        qtbot.addWidget(win)
    finally:
        QSettings.setPath(QSettings.Format.IniFormat, QSettings.Scope.UserScope, default)
    assert win.settings_banner.text() == (f"{ini}: recnt is not a setting the workbench keeps (did you mean recent?): "
                                          "it is not used, and left there")
    win.close()


def test_kept_settings_left_empty_are_said_as_that(qtbot, tmp_path):
    """A theme, answers choice or sweep repeats left empty in a hand-edited settings file was said with nothing where
    the value goes: "( is not system, light or dark)". It is now said as an empty value. Recent models left empty
    were refused as "not JSON: Expecting value: line 1 column 1 (char 0)": they are now none, as empty chat options
    or budgets are."""
    from engine.records.lengths import SWEEP_REPEATS

    ini = tmp_path / "settings.ini"
    ini.write_text("[General]\nrecent=\n[view]\ntheme=\n[sweep]\nanswers=\nrepeats=\n")
    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.recent() == []  # none, as empty chat options or budgets are
    assert win.settings_banner.text().split("\n") == [
        f"{ini}: the theme kept under view/theme cannot be used (an empty value is not a theme name: the themes are "
        "system, light and dark): the system's is used; what was kept is now under view/theme.bad there",
        f"{ini}: the answers choice kept under sweep/answers cannot be used (an empty value is not one of greedy, "
        "model, chat): greedy is used; what was kept is now under sweep/answers.bad there",
        f"{ini}: the sweep's repeats kept under sweep/repeats cannot be used (an empty value is not a count of 1 to "
        f"9): its default, {SWEEP_REPEATS}, is used; what was kept is now under sweep/repeats.bad there"]
    win.close()


def test_kept_settings_typed_with_a_comma_are_said_as_typed_not_as_the_list_qt_reads(qtbot, tmp_path):
    """Qt reads a settings file's unquoted value with a comma as a list of texts: a theme typed as dark,light was
    refused as "['dark', 'light'] is not system, light or dark", which reads as a Python list and gives no reason
    where the file's dark and light are both themes; an answers choice or sweep repeats likewise. Each is now said as
    typed, the theme as no theme name, with the themes there are."""
    from engine.records.lengths import SWEEP_REPEATS

    ini = tmp_path / "settings.ini"
    ini.write_text("[view]\ntheme=dark,light\n[sweep]\nanswers=greedy, model\nrepeats=3,4\n")
    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.settings_banner.text().split("\n") == [
        f"{ini}: the theme kept under view/theme cannot be used (dark,light is not a theme name: the themes are "
        "system, light and dark): the system's is used; what was kept is now under view/theme.bad there",
        f"{ini}: the answers choice kept under sweep/answers cannot be used (greedy,model is not one of greedy, "
        "model, chat): greedy is used; what was kept is now under sweep/answers.bad there",
        f"{ini}: the sweep's repeats kept under sweep/repeats cannot be used (3,4 is not a count of 1 to 9): its "
        f"default, {SWEEP_REPEATS}, is used; what was kept is now under sweep/repeats.bad there"]
    assert win.theme_choice == "system" and win.sweep.repeats.value() == SWEEP_REPEATS
    win.close()
    assert QSettings(str(ini), QSettings.Format.IniFormat).value("view/theme.bad") == ["dark", "light"]


def test_a_hand_edited_system_prompt_qt_reads_as_a_list_is_said_not_sent(qtbot, tmp_path):
    """Qt reads a settings file's unquoted value with a comma as a list of texts: a system prompt written in by hand as
    Be brief, be kind became the prompt "['Be brief', 'be kind']", sent to the model without a word. It is now said
    and kept aside, and the chat starts with no system prompt."""
    ini = tmp_path / "settings.ini"
    ini.write_text("[chat]\nsystem_prompt=Be brief, be kind\n")
    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.settings_banner.text() == (
        f"{ini}: the system prompt kept under chat/system_prompt cannot be used (['Be brief', 'be kind'] is not a "
        "text: in the file, one with a comma needs quotes): the chat starts with none; what was kept is now under "
        "chat/system_prompt.bad there")
    assert win.chat.system_prompt.toPlainText() == ""
    win.close()
    assert QSettings(str(ini), QSettings.Format.IniFormat).value("chat/system_prompt.bad") == ["Be brief", "be kind"]


def test_hand_edited_json_settings_qt_reads_as_lists_are_said_with_the_hint_and_kept_as_read(qtbot, tmp_path):
    """Qt reads a settings file's unquoted value with a comma as a list of texts, dropping the quotes in it: chat
    options, recent models or a model's budgets written in by hand as JSON were refused as "not JSON: the JSON object
    must be str, bytes or bytearray, not list", which says nothing of the file. Each now gives the system prompt's
    hint, and what Qt read is kept aside as read. That hint alone, followed, left the quotes in it dropped: where none
    is left, it says they need a backslash too."""
    ini = tmp_path / "settings.ini"
    key = MainWindow._model_key("/m")
    ini.write_text('[General]\nrecent=["/a", "/b"]\n[chat]\noptions={"temperature": 0.7, "top_k": 40}\n'
                   f'[models]\n{key.split("/")[1]}={{"path": "/m", "budget": {{}}}}\n')
    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.model_settings("/m") is None
    hint = 'in the file, one with a comma needs quotes, and each of its own quotes a backslash (\\")'
    assert win.settings_banner.text().split("\n") == [
        f"{ini}: the chat options kept under chat/options cannot be used (['{{temperature: 0.7', 'top_k: 40}}'] is "
        f"not a text: {hint}): the chat starts from its defaults; what was kept is now under chat/options.bad there",
        f"{ini}: the recent models kept under recent cannot be used (['[/a', '/b]'] is not a text: {hint}): Open "
        "recent starts empty; what was kept is now under recent.bad there",
        f"{ini}: the budgets kept for /m cannot be used (['{{path: /m', 'budget: {{}}}}'] is not a text: {hint}): the "
        f"Budgets panel shows the defaults; what was kept is now under {key}.bad there"]
    assert win.chat.options()["temperature"] == 0.0 and win.chat.options()["top_k"] == 0
    win.close()
    settings = QSettings(str(ini), QSettings.Format.IniFormat)
    assert [settings.value(k + ".bad") for k in ("chat/options", "recent", key)] == [
        ["{temperature: 0.7", "top_k: 40}"], ["[/a", "/b]"], ["{path: /m", "budget: {}}"]]
    assert "options.bad={temperature: 0.7, top_k: 40}\n" in ini.read_text()  # the line as it was, less its quotes
    ini.write_text('[General]\nrecent=[\\"/a\\", \\"/b\\"]\n')  # its quotes kept: only the quotes around it lack
    again = make_window(qtbot, tmp_path, nvml=False)
    assert again.recent() == []
    assert again.settings_banner.text() == (
        f"""{ini}: the recent models kept under recent cannot be used (['["/a"', '"/b"]'] is not a text: in the """
        "file, one with a comma needs quotes): Open recent starts empty; what was kept is now under recent.bad there")
    again.close()


def test_hand_edited_json_settings_whose_quotes_qt_dropped_are_said_with_the_backslash_hint(qtbot, tmp_path):
    """Qt drops a settings file's quotes that have no backslash before them: JSON typed in by hand with no comma, or
    in quotes with one, was refused as "not JSON: Expecting property name enclosed in double quotes: line 1 column 2
    (char 1)", though the user had written the quotes. Each now says what Qt read and that the quotes need a
    backslash; written so, the same options are used."""
    ini = tmp_path / "settings.ini"
    key = MainWindow._model_key("/m")
    ini.write_text('[General]\nrecent=["/a" "/b"]\n[chat]\noptions="{"temperature": 0.7, "top_k": 40}"\n'
                   f'[models]\n{key.split("/")[1]}={{"budget": {{}}}}\n')
    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.model_settings("/m") is None
    hint = 'is not JSON: in the file, each of its quotes needs a backslash (\\"), or Qt drops it'
    assert win.settings_banner.text().split("\n") == [
        f"{ini}: the chat options kept under chat/options cannot be used ({{temperature: 0.7, top_k: 40}} {hint}): the "
        "chat starts from its defaults; what was kept is now under chat/options.bad there",
        f"{ini}: the recent models kept under recent cannot be used ([/a/b] {hint}): Open recent starts empty; what "
        "was kept is now under recent.bad there",
        f"{ini}: the budgets kept for /m cannot be used ({{budget: {{}}}} {hint}): the Budgets panel shows the "
        f"defaults; what was kept is now under {key}.bad there"]
    win.close()
    ini.write_text('[General]\nrecent=[\\"/a\\"]\n[chat]\noptions="{\\"temperature\\": 0.7, \\"top_k\\": 40}"\n'
                   f'[models]\n{key.split("/")[1]}={{\\"budget\\": {{}}}}\n')
    again = make_window(qtbot, tmp_path, nvml=False)
    assert again.model_settings("/m") == {} and again.recent() == ["/a"]
    assert again.chat.options()["temperature"] == 0.7 and again.chat.options()["top_k"] == 40
    assert again.settings_banner.isHidden()
    again.close()


def test_json_settings_typed_in_single_quotes_are_said_to_need_double_quotes(qtbot, tmp_path):
    """Chat options typed with single quotes ({'top_k': 40}, which Qt keeps) were said in JSON's own words ("Expecting
    property name enclosed in double quotes at character 2 of it"), and with a comma, split by Qt, to need a backslash
    before each of their quotes, which leads to \\'. Each now says it uses single quotes and what JSON needs; written
    so, the same options are used."""
    ini = tmp_path / "settings.ini"
    key = MainWindow._model_key("/m")
    ini.write_text("[General]\nrecent=['/a', '/b']\n[chat]\noptions={'top_k': 40}\n"
                   f"[models]\n{key.split('/')[1]}=\"{{'budget': {{}}, 'path': '/m'}}\"\n")
    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.model_settings("/m") is None
    hint = 'uses single quotes: JSON needs double quotes, written \\" in the file'
    assert win.settings_banner.text().split("\n") == [
        f"{ini}: the chat options kept under chat/options cannot be used ({{'top_k': 40}} {hint}): the chat starts "
        "from its defaults; what was kept is now under chat/options.bad there",
        f"{ini}: the recent models kept under recent cannot be used (['/a', '/b'] {hint}, and the whole value in "
        "quotes for its comma): Open recent starts empty; what was kept is now under recent.bad there",
        f"{ini}: the budgets kept for /m cannot be used ({{'budget': {{}}, 'path': '/m'}} {hint}): the Budgets panel "
        f"shows the defaults; what was kept is now under {key}.bad there"]
    win.close()
    ini.write_text('[General]\nrecent="[\\"/a\\", \\"/b\\"]"\n[chat]\noptions={\\"top_k\\": 40}\n')
    again = make_window(qtbot, tmp_path, nvml=False)
    assert again.recent() == ["/a", "/b"] and again.chat.options()["top_k"] == 40
    assert again.settings_banner.isHidden()
    again.close()


def test_a_hand_edited_json_setting_that_is_not_json_is_said_with_the_value_its_position_counts_in(qtbot, tmp_path):
    """A JSON setting that is not JSON was said as "not JSON: Expecting ',' delimiter: line 1 column 7 (char 6)":
    the line and column count in the value, but the message names the file, whose line 1 is a section. The value is
    now said as read, and the character counts in it."""
    ini = tmp_path / "settings.ini"
    ini.write_text('[General]\nrecent=[\\"/a\\" \\"/b\\"]\n')
    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.recent() == []
    assert win.settings_banner.text() == (
        f'{ini}: the recent models kept under recent cannot be used (["/a" "/b"] is not JSON: Expecting '
        "',' delimiter at character 7 of it): Open recent starts empty; what was kept is now under recent.bad there")
    win.close()


UNUSABLE_BUDGETS = [
    ("{not json", '{not json is not JSON: in the file, each of its quotes needs a backslash (\\"), or Qt drops it'),
    # (said "no budget object in it", without what was read)
    ('{"path": "m", "budget": ["cuda"]}', 'no budget object in {"path": "m", "budget": ["cuda"]}'),
    ('["m", {"kv_tokens": 4096}]', 'no budget object in ["m", {"kv_tokens": 4096}]'),
    ('{"path": "m", "budget": {"device": "cuda"}}', 'device "cuda" is not {"kind": cpu, simulated or cuda}'),
    ('{"path": "m", "budget": {"kv_tokens": "lots"}}',
     'kv_tokens "lots" is not a whole number of tokens from 1 to 2147483647'),
    # (said no more than that, where a capacity in quotes was said with the number to write)
    ('{"path": "m", "budget": {"kv_tokens": "4096"}}',
     'kv_tokens "4096" is not a whole number of tokens from 1 to 2147483647 (write it as a number: 4096)'),
    ('{"path": "m", "budget": {"kv_tokens": "0"}}',
     'kv_tokens "0" is not a whole number of tokens from 1 to 2147483647'),
    # (raised TypeError, unhashable, as the model opened)
    ('{"path": "m", "budget": {"device": {"kind": ["cuda"]}}}',
     'device {"kind": ["cuda"]} is not {"kind": cpu, simulated or cuda}'),
    ('{"path": "m", "budget": {"layer_split": {"whole": 1}}}',
     'layer_split {"whole": 1} is not one of auto, spread, whole'),
    # (the Budgets panel took a simulated GPU of 5 B, which typed there is refused)
    ('{"path": "m", "budget": {"device": {"kind": "simulated", "capacity": 5}}}',
     "device capacity 5 is not a byte count of at least 1048576"),
    # (said no more than that, as though 8 GiB were not one)
    ('{"path": "m", "budget": {"device": {"kind": "simulated", "capacity": "8 GiB"}}}',
     'device capacity "8 GiB" is not a byte count of at least 1048576 (write it as a number: 8589934592)'),
    ('{"path": "m", "budget": {"device": {"kind": "simulated", "capacity": "8589934592"}}}',
     'device capacity "8589934592" is not a byte count of at least 1048576 (write it as a number: 8589934592)'),
    ('{"path": "m", "budget": {"device": {"kind": "simulated", "capacity": "5 KiB"}}}',
     'device capacity "5 KiB" is not a byte count of at least 1048576'),
    # (raised OverflowError from the box as the model opened)
    ('{"path": "m", "budget": {"kv_tokens": 1099511627776}}',
     "kv_tokens 1099511627776 is not a whole number of tokens from 1 to 2147483647"),
    ('{"path": "m", "budget": {"entries": {"session.moe.offload.device_expert_bytes": "-5"}}}',
     "session.moe.offload.device_expert_bytes='-5': expected an integer >= 0, in digits only"),
    # (misspelt, each left its setting at the default without a word)
    ('{"path": "m", "budget": {"kvtokens": 4096}}', "kvtokens is not a budget setting: did you mean kv_tokens?"),
    ('{"path": "m", "budget": {"gpu": "cuda"}}', "gpu is not a budget setting (they are device, entries, kv_tokens, "
     "layer_split, decode_path)"),
    ('{"path": "m", "budget": {"device": {"kind": "simulated", "capacty": 4294967296}}}',
     "capacty is not a device setting: did you mean capacity?"),
]


def opened_with_kept_budgets(qtbot, tmp_path, kept: str):
    """A window whose settings file keeps `kept` as gptoss's budgets, with gptoss opened (not loaded): (the window, the
    settings file, the model's path, its key there)."""
    ini = str(tmp_path / "settings.ini")
    path = str(fixture_folder("gptoss"))
    key = MainWindow._model_key(path)
    settings = QSettings(ini, QSettings.Format.IniFormat)
    settings.setValue(key, kept)
    settings.sync()
    win = make_window(qtbot, tmp_path, nvml=False)
    win.open_model(path)
    qtbot.waitUntil(lambda: win.facts is not None and not win.busy, timeout=WAIT)
    return win, ini, path, key


@pytest.mark.parametrize("kept, problem", UNUSABLE_BUDGETS)
def test_budgets_kept_for_a_model_that_cannot_be_used_are_said_and_kept_aside(qtbot, tmp_path, kept, problem):
    """A model's kept budgets that could not be read (corrupt JSON, wrong types, entries refused) were silently
    replaced by the defaults (or crashed the window), and the next load wrote over them: the user never knew."""
    win, ini, path, key = opened_with_kept_budgets(qtbot, tmp_path, kept)
    assert win.settings_banner.isVisible() and win.settings_banner.text() == (
        f"{ini}: the budgets kept for {path} cannot be used ({problem}): the Budgets panel shows the defaults; "
        f"what was kept is now under {key}.bad there")
    assert win.budget_panel.config() == OffloadConfig()
    win.save_model_settings(path, win.budget_panel.settings())  # what a load does
    win.close()
    settings = QSettings(ini, QSettings.Format.IniFormat)
    assert settings.value(key + ".bad") == kept and json.loads(settings.value(key))["budget"]["entries"] == {}


def test_a_kept_popularity_file_that_is_gone_is_said_as_the_model_opens_with_how_to_clear_it(qtbot, tmp_path):
    """Budgets kept with a popularity file moved or deleted since were taken without a word: only the load said it,
    and every load failed on it until the budgets changed. It is now said as the model opens, before any load, naming
    the file and how to clear it; the budgets stay as kept (the file put back mends them)."""
    gone = tmp_path / "popularity.json"
    kept = json.dumps({"path": str(fixture_folder("gptoss")),
                       "budget": {"entries": {"session.moe.offload.popularity_file": str(gone)}}})
    win, ini, path, key = opened_with_kept_budgets(qtbot, tmp_path, kept)
    settings = QSettings(ini, QSettings.Format.IniFormat)
    assert win.settings_banner.isVisible() and win.settings_banner.text() == (
        f"{ini}: the budgets kept for {path} name the popularity file {gone} (no such file): a load fails on it until "
        f"it is back, or taken out with Stop using the popularity file in the Budgets panel or out of what is kept "
        f"under {key} there")
    assert win.budget_panel.config().popularity_file == str(gone) and settings.value(key) == kept
    win.budget_panel.clear_popularity_button.click()  # the way the line names
    assert win.budget_panel.config() == OffloadConfig() and settings.value(key) == kept  # (kept until a load takes it)
    win.settings_banner.hide()
    gone.write_text("{}")  # put back: nothing to say
    assert win.model_settings(path)["entries"] == {"session.moe.offload.popularity_file": str(gone)}
    assert win.settings_banner.isHidden()
    win.close()


def test_a_settings_file_that_cannot_be_read_is_said_and_a_malformed_one_kept_before_it_is_written(qtbot, tmp_path):
    """Qt reads what it can of a malformed settings file and rewrites it without the rest at the next save; an
    unreadable one (permissions, a folder) gives the defaults. Both were silent."""
    ini = tmp_path / "settings.ini"
    ini.write_text("[view]\ntheme=dark\n[[[\n")
    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.settings_banner.isVisible() and win.settings_banner.text() == (
        f"{ini}: not a well-formed settings file: what could be read is used, and the file as it was is kept as "
        f"{ini}.bad")
    win.close()
    assert (tmp_path / "settings.ini.bad").read_text() == "[view]\ntheme=dark\n[[[\n"
    ini.unlink()
    ini.mkdir()
    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.settings_banner.isVisible() and win.settings_banner.text() == (
        f"{ini}: settings not readable (no permission, or not a file): the window starts from its defaults and "
        "cannot save its settings")
    win.close()
    (tmp_path / "blocked").write_text("a file where the settings' folder would be")
    win = make_window(qtbot, tmp_path / "blocked", nvml=False)
    assert not win.settings_banner.isVisible()  # no settings yet: nothing to say
    win.save_model_settings("/m", win.budget_panel.settings())
    assert win.settings_banner.isVisible() and win.settings_banner.text() == (
        f"{tmp_path}/blocked/settings.ini: not writable: the budgets for /m are used now but not kept for the next "
        "start")
    win.close()


def test_a_second_malformed_settings_file_is_kept_beside_the_first_not_over_it(qtbot, tmp_path):
    """The malformed settings file was copied to settings.ini.bad at each start that found one: a second malformed
    file replaced the first one kept. Now the second goes to settings.ini.bad2 (as a model's budgets go to
    <key>.bad2); the same file found again is not kept twice."""
    ini = tmp_path / "settings.ini"
    for text, kept in (("[view]\ntheme=dark\n[[[\n", "bad"), ("[chat\nsystem_prompt=hi\n", "bad2"),
                       ("[chat\nsystem_prompt=hi\n", "bad2")):
        ini.write_text(text)
        win = make_window(qtbot, tmp_path, nvml=False)
        assert win.settings_banner.text() == (f"{ini}: not a well-formed settings file: what could be read is used, "
                                              f"and the file as it was is kept as {ini}.{kept}")
        win.close()
    assert (tmp_path / "settings.ini.bad").read_text() == "[view]\ntheme=dark\n[[[\n"
    assert (tmp_path / "settings.ini.bad2").read_text() == "[chat\nsystem_prompt=hi\n"
    assert not (tmp_path / "settings.ini.bad3").exists()


UNUSABLE_RECENT = [
    ("{not json", '{not json is not JSON: in the file, each of its quotes needs a backslash (\\"), or Qt drops it'),
    ('{"/m": 1}', '{"/m": 1} is not a list of paths'),
    ('["/m", 3]', '["/m", 3] is not a list of paths'),
    ('"/m"', '"/m" is not a list of paths'),  # (its letters were the recent models)
]
UNUSABLE_CHAT_OPTIONS = [
    ("[1", "[1 is not JSON: Expecting ',' delimiter at character 3 of it"),
    ('["/m"]', '["/m"] is not a JSON object'),
    ('{"top_k": "many"}', 'top_k "many" is not a whole number'),
    ('{"stop_strings": "END"}', 'stop_strings "END" is not a list of strings'),
]


@pytest.mark.parametrize("recent, recent_problem, options, options_problem",
                         [(*r, *o) for r, o in zip(UNUSABLE_RECENT, UNUSABLE_CHAT_OPTIONS)])
def test_a_malformed_recent_list_or_chat_options_are_said_and_kept_aside(qtbot, tmp_path, recent, recent_problem,
                                                                          options, options_problem):
    """The settings file's recent models list and chat options that could not be read were dropped silently (and the
    next save wrote over them); chat options not an object ("[...]") stopped the window opening, and stop_strings
    "END" became the stop strings E, N and D. Each is now said, on a line of its own, and kept under a key of its
    own; the window starts from the defaults there. A recent list or chat options of the wrong kind were said as "not a
    list of paths", "not a JSON object", without what was read: it is named, as other refusals name it."""
    ini = str(tmp_path / "settings.ini")
    settings = QSettings(ini, QSettings.Format.IniFormat)
    settings.setValue("recent", recent)
    settings.setValue("chat/options", options)
    settings.setValue("chat/options.bad", "an earlier one, kept")
    settings.sync()
    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.settings_banner.isVisible() and win.settings_banner.text() == (
        f"{ini}: the chat options kept under chat/options cannot be used ({options_problem}): the chat starts from "
        f"its defaults; what was kept is now under chat/options.bad2 there\n"
        f"{ini}: the recent models kept under recent cannot be used ({recent_problem}): Open recent starts empty; "
        f"what was kept is now under recent.bad there")
    assert win.chat.options()["stop_strings"] == [] and win.chat.options()["top_k"] == 0
    assert not win.recent_menu.isEnabled()
    win.close()  # saves the chat's options
    settings = QSettings(ini, QSettings.Format.IniFormat)
    assert settings.value("recent.bad") == recent and settings.value("chat/options.bad2") == options
    assert settings.value("chat/options.bad") == "an earlier one, kept"


def test_load_with_progress_then_chat_streams_with_statistics(qtbot, window, monkeypatch):
    import app.gui.engine_worker as engine_worker

    progress, busy, warmed = [], [], []
    window.worker.loadProgress.connect(progress.append)
    window.worker.busyChanged.connect(busy.append)
    real_warm = engine_worker.warm_model
    monkeypatch.setattr(engine_worker, "warm_model",
                        lambda model: warmed.append(model.decoder.steps) or real_warm(model))
    path = fixture_folder("gptoss")
    load(qtbot, window, path, simulated())
    assert same(window.loaded_path, path) and not window.error_banner.isVisible()
    # after the load, the CPU kernels compiled (a first run) while the window says so, before any answer
    assert busy[-3:] == ["loading", "preparing", ""] and warmed == [window.worker._model.decoder.steps]
    window._on_busy("preparing")
    assert window.status_state.text() == "Preparing the CPU kernels…" and not window.chat.send_button.isEnabled()
    window._on_busy("")
    assert progress and progress[-1] == pytest.approx(1.0) and not window.model_panel.progress.isVisible()
    # the inspection, the verdict for the chosen mode, and where everything landed
    assert window.model_panel.table.rowCount() == 2
    assert window.model_panel.table.item(0, 5).text() in ("2/8 on device", "1/8 on device")
    assert "Runs (mode <b>auto</b>, simulated GPU" in window.model_panel.verdict.text()
    landed = window.model_panel.landed.text()
    assert "3 expert slots for the 16 experts on the simulated GPU" in landed
    assert "The dense part runs on the CPU: the GPU is simulated, for the experts only" in landed
    assert "KV cache" in landed
    assert threads_sentence(0, cpu_threads()) in landed  # the budget's cpu_threads: automatic
    assert window.status_device.text().endswith("dense part: CPU")
    assert "Load" not in window.model_panel.load_button.text() or window.model_panel.load_button.text() == "Reload"

    batches = []
    window.worker.streamed.connect(lambda _reasoning, text, n: batches.append((text, n)))
    first = ask(qtbot, window, "Hello")
    streamed = "".join(text for text, _n in batches)
    assert batches and sum(n for _t, n in batches) == int(first["stats"].split(" tokens")[0].rsplit(" ", 1)[-1])
    assert first["text"] and streamed.startswith(first["text"][:10])
    stats = first["stats"]
    assert "first token" in stats and "tok/s" in stats and " · answered in " in stats and "tokens" in stats
    assert first["text"] and first["text"][:5] in window.chat.transcript.toPlainText()
    assert "first token" in window.chat.transcript.toPlainText()
    assert window.status_state.text().startswith("Answered: ")  # (the busy label took its place: "Ready")
    # the placement view saw the traffic: 3 resident cells, hits and misses counted
    qtbot.waitUntil(lambda: window.placement.updates > 0 and "hit rate" in window.placement.summary.text())
    assert sum(map(sum, window.placement.heatmap.data["resident"])) == 3
    assert window.placement.heatmap.tooltip_at(0, 0).startswith("Layer 0, expert 0:")
    assert "This expert:" in window.placement.heatmap.tooltip_at(0, 0)  # exact per-expert counts from the engine
    # no NVIDIA GPU to sample: the Machine panel shows the simulated GPU's memory as the engine counts it
    memory = window.worker._device.memory
    if window.graphs.samples[-1]["gpu"] is None:
        assert (f"simulated GPU, 8.0 GiB</b> (the engine's own count): {human_bytes(memory.used)} in use of 8.0 GiB, "
                f"high-water {human_bytes(memory.high_water)}.") in window.graphs.gpu_note.text()

    # multi-turn keeps the cache; regenerate answers the last message again
    second = ask(qtbot, window, "And then?")
    assert "cached" in second["stats"]
    entries_before = len(window.chat.entries)
    window.chat.regenerate()
    qtbot.waitUntil(lambda: bool(not window.busy and window.chat.entries[-1].get("stats")), timeout=WAIT)
    assert len(window.chat.entries) == entries_before and window.chat.entries[-2]["text"] == "And then?"
    window.chat.copy_last()
    from PySide6.QtGui import QGuiApplication

    assert QGuiApplication.clipboard().text() == window.chat.entries[-1]["text"]


def test_every_expert_on_the_cpu_is_said_as_such_not_as_misses_and_copies_to_a_device(qtbot, window):
    """The first screen (the demo model, CPU only): no device, so nothing is resident, missed or copied to it."""
    load(qtbot, window, fixture_folder("gptoss"))
    answer = ask(qtbot, window, "Hello", max_tokens=4)
    assert "misses" not in answer["stats"] and "copied" not in answer["stats"]
    qtbot.waitUntil(lambda: window.placement.updates > 0 and (window.placement.heatmap.data or {}).get("steps", 0) >= 4)
    summary = window.placement.summary.text()
    assert summary.startswith("All 16 experts run on the CPU"), summary
    assert "miss" not in summary and "copied" not in summary and "swaps" not in summary
    tooltip = window.placement.heatmap.tooltip_at(0, 0)
    assert tooltip.startswith("Layer 0, expert 0: on the CPU, as every expert is\n")
    layer = window.placement.heatmap.data["layers"][0]
    assert f"This expert: {counted(layer['expert_misses'][0], 'routed token')} (counted exactly)" in tooltip
    assert "miss" not in tooltip and "slot" not in tooltip


def test_budget_control_changes_the_plan_shown_and_apply_replans_without_reload(qtbot, window):
    path = fixture_folder("gptoss")
    window.open_model(str(path))
    qtbot.waitUntil(lambda: window.facts is not None and window.model_panel.table.rowCount() == 2 and not window.busy,
                    timeout=WAIT)
    budget = window.budget_panel
    budget.device.setCurrentIndex(budget.device.findData("simulated"))
    budget.expert_bytes.setValue(4 * slot())
    budget.expert_bytes.valueChanged.emit(budget.expert_bytes.value())
    qtbot.waitUntil(lambda: "4 of 16" in budget.layer_text.text())
    assert "2 of 8 in every layer" in budget.layer_text.text()
    assert "resident experts" in budget.vram_legend.text() and "KV cache" in budget.vram_legend.text()
    assert "4 expert slots on the device for the 16 experts, the rest on the CPU" in window.model_panel.verdict.text()
    # the slider moves the estimate live
    budget.expert_bytes.slider.setValue(budget.expert_bytes.STEPS)  # everything
    qtbot.waitUntil(lambda: "16 of 16" in budget.layer_text.text())
    assert "all 8 on device" == window.model_panel.table.item(1, 5).text()
    assert "all 16 experts resident on the device." in window.model_panel.verdict.text()
    budget.expert_bytes.setValue(2 * slot())
    budget.expert_bytes.valueChanged.emit(budget.expert_bytes.value())
    qtbot.waitUntil(lambda: "2 of 16" in budget.layer_text.text())

    loads = []
    window.worker.loaded.connect(loads.append)
    window.load()
    qtbot.waitUntil(lambda: same(window.loaded_path, path) and not window.busy, timeout=WAIT)
    assert "2 expert slots for the 16 experts" in window.model_panel.landed.text()
    assert not budget.apply_button.isEnabled() and budget.applied_label.text() == "Applied to the loaded model"

    budget.expert_bytes.setValue(6 * slot())
    budget.expert_bytes.valueChanged.emit(budget.expert_bytes.value())
    qtbot.waitUntil(lambda: budget.apply_button.isEnabled())
    assert budget.apply_button.text() == "Apply"
    budget.apply_button.click()
    qtbot.waitUntil(lambda: "6 expert slots for the 16 experts" in window.model_panel.landed.text() and not window.busy,
                    timeout=WAIT)
    assert len(loads) == 1, "Apply re-planned without loading again"
    assert window.status_state.text() == "Re-planned without reloading"
    # a device limit needs a reload, and the button says so
    budget.mem_limit.setValue(1 << 30)
    budget.mem_limit.valueChanged.emit(budget.mem_limit.value())
    qtbot.waitUntil(lambda: budget.apply_button.text() == "Apply and reload")
    # settings are remembered per model
    assert window.model_settings(str(path))["entries"]["session.moe.offload.device_expert_bytes"] == str(6 * slot())


def load_leaving_a_slot_to_copies(qtbot, window, monkeypatch):
    """gpt-oss loaded with 3 slots a layer, adaptive placement leaving 1 of each to copied misses; its engine."""
    import engine.offload.engine as offload_engine

    monkeypatch.setattr(offload_engine, "miss_slots", lambda *args, **kwargs: 1)
    load(qtbot, window, fixture_folder("gptoss"),
         {"device": {"kind": "simulated", "capacity": 8 << 30}, "entries": {"device_expert_bytes": str(6 * slot())}})
    return window.worker._model.offload  # the worker is idle: the engine's figures hold still


def test_a_cpu_only_placement_view_says_nothing_of_residents_misses_or_hit_rates(qtbot, window):
    """On a CPU-only load the placement view's legend read 'resident · cold · missed now' (Traffic: 'hits · misses'),
    red 'missed now' dots marked the experts routing chose lately, and the column right of the grid was headed 'hits'
    with nothing under it: without a device no expert is resident, cold or missed. The legend says the experts run on
    the CPU, no cell is dotted, and the column has no heading."""
    from PySide6.QtGui import QColor

    from app.gui import theme

    load(qtbot, window, fixture_folder("gptoss"))
    ask(qtbot, window, "Hello", max_tokens=4)
    placement = window.placement
    qtbot.waitUntil(lambda: placement.updates > 0 and (placement.heatmap.data or {}).get("steps", 0) >= 4)
    legend = placement.legend.text()
    assert "on the CPU" in legend and "missed" not in legend and "cold" not in legend, legend
    assert not placement.heatmap.missed.any()
    placement.traffic.setChecked(True)
    legend = placement.legend.text()
    assert "routed" in legend and "hits" not in legend and "misses" not in legend, legend
    heatmap = placement.heatmap
    heatmap.resize(600, 200)
    image = heatmap.grab().toImage()
    rows, cols, cw, ch = heatmap._grid()
    background = QColor(theme.current().background).rgb()
    right = range(heatmap.LEFT + cols * cw + 2, heatmap.width())
    assert all(image.pixel(x, y) == background for x in right for y in range(heatmap.TOP + rows * ch))


def test_where_everything_landed_tells_the_resident_experts_from_the_slots_left_to_copied_misses(qtbot, window,
                                                                                                monkeypatch):
    """Adaptive placement leaving a slot of each layer to copied misses: 'where everything landed' counts each layer's
    slots, the resident experts placement keeps in them and the slots left to copies, as the engine holds them (it
    said '6 of 16 experts resident' and '3 of 8 in every layer' where placement kept 2 a layer, as the placement view
    showed)."""
    offload = load_leaving_a_slot_to_copies(qtbot, window, monkeypatch)
    assert [layer.num_slots for layer in offload.slots] == [3, 3] and offload.policy.miss_slots == [1, 1]
    assert [int(np.count_nonzero(layer.expert_in >= 0)) for layer in offload.slots] == [2, 2]
    landed = window.model_panel.landed.text()
    assert "6 expert slots for the 16 experts on the simulated GPU" in landed
    assert "Expert slots per layer: 3 of 8 in every layer (2 layers): 2 resident experts, 1 left for copied misses." \
        in landed


def test_the_placement_view_counts_the_slots_filled_at_load_apart_from_placements_swaps(qtbot, window):
    """Straight after a load the placement view said '3 swaps' (22 on a larger model): the slots placement filled at
    load were counted as swaps, though routing had moved nothing yet. It says the slots filled, and 0 swaps, in the
    summary and in each layer's tooltip line."""
    load(qtbot, window, fixture_folder("gptoss"), simulated())
    offload = window.worker._model.offload
    filled = [int(np.count_nonzero(layer.expert_in >= 0)) for layer in offload.slots]
    window.worker._emit_stats()
    qtbot.waitUntil(lambda: window.placement.updates > 0, timeout=WAIT)
    summary = window.placement.summary.text()
    assert f"placement: {sum(filled)} slots filled, 0 swaps" in summary and sum(filled) == 3, summary
    window.placement.heatmap.data["layers"][0].update(hits=3, misses=1)  # as after a step: the layer line shows
    tooltip = window.placement.heatmap.tooltip_at(0, 0)
    assert f"(75% hit rate), {counted(filled[0], 'slot')} filled, 0 swaps" in tooltip, tooltip


def test_the_placement_view_and_graphs_forget_a_model_dropped_for_the_next_load(qtbot, window, tmp_path):
    """Loading another model drops the loaded one first, but the placement view went on showing its layers, and the
    Machine panel its simulated GPU's memory, until the next model had loaded (minutes on a large one). They are
    cleared as the worker drops it; a load refused before that keeps them (the model stays loaded)."""
    load(qtbot, window, fixture_folder("gptoss"), simulated())
    assert window.placement.heatmap.data["resident"].shape == (2, 8)
    from PySide6.QtCore import QObject, Slot

    seen = []  # what the window showed as the next load's first progress came (the worker had dropped gptoss)

    class Progress(QObject):  # (on the window's thread: the worker's signals come in their order)
        @Slot(float)
        def came(self, _fraction: float) -> None:
            seen.append((window.placement.heatmap.data, window.placement.summary.text(), window.graphs._simulated))

    progress = Progress()
    window.worker.loadProgress.connect(progress.came)
    load(qtbot, window, fixture_folder("lfm2moe"))
    assert seen and seen[0] == (None, "No model loaded.", None)
    assert window.placement.heatmap.data["resident"].shape == (3, 8)
    load(qtbot, window, tmp_path / "gone")  # refused before lfm2moe goes: it stays loaded, and shown
    assert window.error_banner.isVisible() and window.placement.heatmap.data["resident"].shape == (3, 8)


def test_the_placement_view_says_static_placement_is_counting_routing_before_it_places(qtbot, window):
    """Static placement without a popularity file places nothing until its opening has counted routing
    (StaticPlacement): the view said '0 slots filled, 0 swaps' beside slots holding copied misses, as if that were its
    placement, and where everything landed said 'Experts resident per layer: 3 of 8' with none resident. Both say how
    many more tokens it counts first, and once it has chosen, nothing of the opening."""
    from app.gui.placement_view import static_text

    settings = simulated()
    settings["entries"].update(placement="static")
    load(qtbot, window, fixture_folder("gptoss"), settings)
    engine = window.worker._model.offload
    window.worker._emit_stats()
    qtbot.waitUntil(lambda: window.placement.updates > 0, timeout=WAIT)
    # 8 routed pairs for each of the 8 experts, at 2 a token
    assert "static placement counts routing for 32 more tokens, then places its residents" in (
        window.placement.summary.text())
    landed = window.model_panel.landed.text()  # nothing is resident yet: slots, and what fills them
    assert "Expert slots per layer: " in landed and "Experts resident" not in landed
    assert ("Static placement counts routing for 32 more tokens, then copies the experts routed most in each layer "
            "into its slots for good (copied misses use them meanwhile).") in landed
    ask(qtbot, window, "Hello there, tell me a story about experts", max_tokens=40)
    qtbot.waitUntil(lambda: (window.placement.heatmap.data or {}).get("steps") == engine.stats.steps, timeout=WAIT)
    assert not engine.policy.opening and "counts routing" not in window.placement.summary.text()
    qtbot.waitUntil(lambda: "Experts resident per layer: " in window.model_panel.landed.text(), timeout=WAIT)
    assert "Static placement counts routing" not in window.model_panel.landed.text()
    state = engine.copy_state()["static_placement"]
    assert state["opening_tokens_left"] == 0 and static_text(state) in window.placement.summary.text()


def test_the_placement_views_summary_counts_static_placements_opening_copies_as_copies(qtbot, window):
    """During static placement's opening its slots hold copied misses, placed by the miss policy, not by placement
    (StaticPlacement): the summary counted them as resident experts ('1 of 16 experts resident')."""
    settings = simulated()
    settings["entries"].update(placement="static")
    load(qtbot, window, fixture_folder("gptoss"), settings)
    engine = window.worker._model.offload
    assert engine.policy.opening and engine.slots[0].num_slots > 0
    engine.slots[0].place(0, 5)  # as a copied miss would (its bookkeeping: nothing runs after)
    window.worker._emit_stats()
    qtbot.waitUntil(lambda: window.placement.updates > 0, timeout=WAIT)
    slots = sum(layer.num_slots for layer in engine.slots)
    total = sum(info.spec.num_experts for info in engine.infos)
    assert window.placement.summary.text().startswith(
        f"1 of {total} experts on the device, in {slots} slots: 0 resident experts, {slots} left for copied misses · ")


def test_where_everything_landed_follows_the_engines_re_weighing_of_its_miss_slots(qtbot, window, monkeypatch):
    """The engine weighs the slots it leaves to copied misses again as it measures what a copy earns; the landed text
    kept the load's split (1 left for copied misses) after the engine had given every slot back to residents."""
    offload = load_leaving_a_slot_to_copies(qtbot, window, monkeypatch)
    assert "1 left for copied misses" in window.model_panel.landed.text()
    offload.policy.miss_slots = [0, 0]  # as _weigh_miss_slots leaves them where copies do not pay
    window.worker._emit_stats()
    qtbot.waitUntil(lambda: "copied misses" not in window.model_panel.landed.text(), timeout=WAIT)
    assert "Experts resident per layer: 3 of 8 in every layer (2 layers)." in window.model_panel.landed.text()


def test_where_everything_landed_says_a_layer_split_re_plan_that_failed_while_decoding(qtbot, window, monkeypatch):
    """A re-plan the layer split's trials ask for that fails keeps the plan in force and adds a sentence saying so to
    its statements (OffloadEngine._split_failed): the split, the decode path and the slots unchanged, where everything
    landed kept the load's sentences without it until the model was loaded or re-planned again. It shows it at the
    next statistics, as it shows a re-weighing of the miss slots."""
    import html

    from engine.offload.layer_split import LayerSplitTrials

    load(qtbot, window, fixture_folder("gptoss"), {"device": {"kind": "simulated", "capacity": 8 << 30},
                                                   "entries": {"device_expert_bytes": str(8 * slot())}})
    engine = window.worker._model.offload
    engine.layer_split_mode = "auto"  # (the test suite's default split is fixed: MOE_LAYER_SPLIT)
    engine.split_trials = LayerSplitTrials(first=0, settle=0, window=1)

    def fails(config):
        raise RuntimeError("cuMemHostRegister failed: CUDA_ERROR_INVALID_VALUE")

    monkeypatch.setattr(engine, "_replan", fails)
    engine.end_step(0.030, 1)  # the spread measured: whole layers asked for, their re-plan failed
    said = ("The layer split's trials asked for whole layers, and the re-plan failed (RuntimeError: cuMemHostRegister "
            "failed: CUDA_ERROR_INVALID_VALUE): decode goes on with the budget spread over every layer, with no more "
            "trials.")
    assert engine.plan.statements[-1] == said and not engine.whole_layers
    assert html.escape(said) not in window.model_panel.landed.text()
    window.worker._emit_stats()
    qtbot.waitUntil(lambda: html.escape(said) in window.model_panel.landed.text(), timeout=WAIT)
    assert "Measured faster" not in window.status_state.text()  # nothing changed but the sentence


def test_static_placements_traffic_is_the_routing_counted_not_the_popularity_file(qtbot, window, tmp_path):
    """Static placement's traffic (the heatmap's Traffic colours, the tooltip's 'Routing: n (routing count, not
    decayed)') was the placement's scores: the popularity file's counts plus the routing since. An expert the file
    ranked 1000 read 'Routing: 1000.00' and glowed as hit though routing never chose it."""
    popularity = tmp_path / "popularity.json"
    popularity.write_text(json.dumps({"/model/layers.0/moe/QMoE": [1000] * 4 + [0] * 4,
                                      "/model/layers.1/moe/QMoE": [0] * 4 + [1000] * 4}))
    settings = simulated()
    settings["entries"].update(placement="static", popularity_file=str(popularity))
    load(qtbot, window, fixture_folder("gptoss"), settings)
    ask(qtbot, window, "Hello", max_tokens=4)
    placement = window.placement
    qtbot.waitUntil(lambda: (placement.heatmap.data or {}).get("steps") == window.worker._model.offload.stats.steps)
    data = placement.heatmap.data
    routed = np.array([layer["expert_hits"] + layer["expert_misses"] for layer in data["layers"]])
    assert routed.sum() > 0 and np.array_equal(data["traffic"], routed)
    assert f"Routing: {routed[0, 0]:.2f} (routing count, not decayed)" in placement.heatmap.tooltip_at(0, 0)


def test_a_popularity_file_edited_after_apply_can_be_applied_again_and_places_its_new_residents(qtbot, window,
                                                                                              tmp_path):
    """Apply stays off while the settings are those in force, so a popularity file edited since (same path, new
    counts) could not be applied again: static placement kept the old file's residents until a reload. Back in the
    window, the edit is noticed: Apply says so, and the re-plan places the file's new residents."""
    from PySide6.QtCore import QEvent
    from PySide6.QtWidgets import QApplication

    names = ("/model/layers.0/moe/QMoE", "/model/layers.1/moe/QMoE")
    popularity = tmp_path / "popularity.json"
    popularity.write_text(json.dumps({name: [1000] * 2 + [0] * 6 for name in names}))
    settings = simulated()
    settings["entries"].update(placement="static", popularity_file=str(popularity))
    load(qtbot, window, fixture_folder("gptoss"), settings)
    budget, engine = window.budget_panel, window.worker._model.offload
    assert not budget.apply_button.isEnabled()
    popularity.write_text(json.dumps({name: [0] * 6 + [1000] * 2 for name in names}) + "\n")
    QApplication.sendEvent(window, QEvent(QEvent.Type.ActivationChange))  # the user comes back to the window
    assert budget.apply_button.isEnabled()
    assert budget.applied_label.text() == "Changed: popularity.json was edited since it was applied"
    budget.apply_button.click()
    qtbot.waitUntil(lambda: not budget.apply_button.isEnabled() and not window.busy, timeout=WAIT)
    assert all(set(layer.resident().tolist()) <= {6, 7} for layer in engine.slots)
    assert f"{popularity} changed since it was read: its new counts placed the residents afresh." in (
        engine.plan.statements)
    assert budget.applied_label.text() == "Applied to the loaded model"
    popularity.unlink()
    QApplication.sendEvent(window, QEvent(QEvent.Type.ActivationChange))
    assert budget.applied_label.text() == "Changed: popularity.json is gone since it was applied"


def test_the_placement_view_says_each_layers_cpu_share_where_the_layers_split_tables_differ(qtbot, window):
    """Under "both" each layer has its split table (copy_state's cold_split "tables": layers of another expert size, or
    fixed tables of their own, as here); the summary's share was the first layer's alone. Where the layers' shares
    differ it says each with its layers, and each row's tooltip gives its own layer's table."""
    load(qtbot, window, fixture_folder("gptoss"), {**simulated(), "decode_path": "both"})
    engine = window.worker._model.offload
    k = engine.infos[0].spec.k
    first, second = np.zeros(k + 1, dtype=np.int32), np.minimum(np.arange(k + 1), 1).astype(np.int32)
    engine.fix_split_tables(lambda layer: (second if layer == 1 else first, None))
    ask(qtbot, window, "Hello", max_tokens=4)
    placement = window.placement
    qtbot.waitUntil(lambda: (placement.heatmap.data or {}).get("steps") == engine.stats.steps)
    assert engine.decode_path_in_force == "both"
    assert (f"a share computed on the CPU at once (up to 0 of {k} in layer 0 and 1 of {k} in layer 1 when all are "
            "cold") in placement.summary.text()
    assert (f"Layer 1's CPU share: 1 of {k} when all are cold ({second.tolist()} of c cold)"
            in placement.heatmap.tooltip_at(1, 0))
    assert (f"Layer 0's CPU share: 0 of {k} when all are cold ({first.tolist()} of c cold)"
            in placement.heatmap.tooltip_at(0, 0))
    # the layers as the model numbers them (the grid's rows); tables that differ below all cold give one share
    tables = [{"layers": [0, 2], "cpu_takes": [0, 0, 1, 1, 2], "split_rows": None, "inter_size": 2880},
              {"layers": [1], "cpu_takes": [0, 1, 1, 2, 2], "split_rows": [0, 0, 0, 0, 2432], "inter_size": 2880}]
    both = {"host_tier": True, "in_force": "both", "cold_split": {"cpu_takes": [0, 0, 1, 1, 2], "tables": tables}}
    assert copies_text({"decode_path": both}, [3, 5, 7]).endswith(
        "(up to 2 of 4 in layers 3, 7 and 2 and 16% of one more of 4 in layer 5 when all are cold)")
    tables[1]["split_rows"] = None
    assert copies_text({"decode_path": both}, [3, 5, 7]).endswith("(up to 2 of 4 when all are cold)")


def test_the_tooltip_counts_a_layers_steps_routed_on_the_device_as_the_engine_does(qtbot, window):
    """The tooltip's 'steps routed and computed on the device' (LayerStats.routed_on_device) never showed: the worker
    left the count out of its statistics. With the GPU reading cold experts from host memory (decode path tier) it
    must not say every expert was resident."""
    load(qtbot, window, fixture_folder("gptoss"), {**simulated(), "decode_path": "tier"})
    ask(qtbot, window, "Hello", max_tokens=4)
    engine = window.worker._model.offload
    heatmap = window.placement.heatmap
    qtbot.waitUntil(lambda: (heatmap.data or {}).get("steps") == engine.stats.steps)
    layer = engine.stats.layers[0]
    assert layer.routed_on_device > 0 and layer.misses_read > 0
    assert (f"Layer 0: {layer.routed_on_device} steps routed on the device (resident experts, and cold ones read by "
            "the GPU from host memory)") in heatmap.tooltip_at(0, 0)
    assert "every expert resident" not in heatmap.tooltip_at(0, 0)


def test_the_placement_view_counts_its_experts_in_the_slots_the_engine_leaves_to_copied_misses(qtbot, window,
                                                                                              monkeypatch):
    """The placement view's summary adds up with the heatmap and the landed text: the experts on the device, in the
    engine's slots, of them the resident experts and those left to copied misses, summed per layer as the engine holds
    them (it said '4 of 16 experts resident' beside '1 slot per layer kept for copies': the most any layer kept)."""
    offload = load_leaving_a_slot_to_copies(qtbot, window, monkeypatch)
    placement = window.placement
    qtbot.waitUntil(lambda: placement.updates > 0)
    on_device = sum(int(np.count_nonzero(layer.slot_of >= 0)) for layer in offload.slots)
    assert on_device == int(placement.heatmap.data["resident"].sum()) == 4
    assert placement.summary.text().startswith("4 of 16 experts on the device, in 6 slots: 4 resident experts, "
                                               "2 left for copied misses")
    assert "kept for copies" not in placement.summary.text()


def test_a_cells_tooltip_in_a_layer_that_leaves_slots_to_copied_misses_counts_its_slots_as_the_summary(
        qtbot, window, monkeypatch):
    """An expert in a slot of a layer that leaves slots to copied misses was 'resident on the device' in its tooltip,
    where the summary and where everything landed said the layer's slots held fewer residents than that (a walk saw
    'resident' in a layer of '0 resident experts, 1 left for copied misses'). The tooltip counts the layer's slots as
    they do; with none left to copies, an expert in a slot is resident."""
    offload = load_leaving_a_slot_to_copies(qtbot, window, monkeypatch)
    placement = window.placement
    qtbot.waitUntil(lambda: placement.updates > 0)
    expert = int(np.flatnonzero(offload.slots[1].slot_of >= 0)[0])
    assert placement.heatmap.tooltip_at(1, expert).startswith(
        f"Layer 1, expert {expert}: on the device, in the layer's 3 slots (2 resident experts, 1 left for copied "
        "misses)\n")
    import engine.offload.engine as offload_engine

    monkeypatch.setattr(offload_engine, "miss_slots", lambda *args, **kwargs: 0)  # every slot for residents
    load(qtbot, window, fixture_folder("gptoss"), simulated())
    qtbot.waitUntil(lambda: (placement.heatmap.data or {}).get("left_to_copies") == [0, 0])
    expert = int(np.flatnonzero(window.worker._model.offload.slots[1].slot_of >= 0)[0])
    assert placement.heatmap.tooltip_at(1, expert).startswith(f"Layer 1, expert {expert}: resident on the device\n")


def test_the_placement_view_says_static_placement_measures_the_slots_a_popularity_file_leaves(qtbot, window, tmp_path):
    """Static placement from a popularity file that counts one expert a layer, with 3 slots a layer: the other 2 were
    left to copied misses for good (the view said so). Its opening now measures routing for them: the view says the
    tokens it counts, as before any layer's choice. Meanwhile those 2 hold copied misses, not residents: the summary
    counted a copy there as a resident expert ('3 of 16 experts resident'), as it does not in an opening's slots."""
    import json

    path = tmp_path / "popularity.json"
    path.write_text(json.dumps({name: [0, 0, 7, 0, 0, 0, 0, 0] for name in ("/model/layers.0/moe/QMoE",
                                                                             "/model/layers.1/moe/QMoE")}))
    load(qtbot, window, fixture_folder("gptoss"),
         {"device": {"kind": "simulated", "capacity": 8 << 30},
          "entries": {"device_expert_bytes": str(6 * slot()), "placement": "static", "popularity_file": str(path)}})
    offload = window.worker._model.offload
    assert [layer.resident().tolist() for layer in offload.slots] == [[2], [2]]
    placement = window.placement
    window.worker._emit_stats()
    qtbot.waitUntil(lambda: placement.updates > 0)
    offload.policy.admit(0, 1, 5)  # as a copied miss would (its bookkeeping: nothing runs after)
    window.worker._emit_stats()
    qtbot.waitUntil(lambda: placement.summary.text().startswith("3 of 16"))
    text = placement.summary.text()
    assert text.startswith("3 of 16 experts on the device, in 6 slots: 2 resident experts, "
                           "4 left for copied misses · "), text
    assert "static placement counts routing for 32 more tokens, then places its residents" in text, text


def test_the_budget_estimate_of_the_settings_in_force_counts_the_slots_the_engine_leaves_to_copied_misses(
        qtbot, window, monkeypatch):
    """Loaded, the budget panel's estimate of the settings in force says each layer's slots, the resident experts and
    the slots left to copied misses as the engine holds them (it said '6 of 16 experts resident' where placement kept
    4); other settings, whose miss slots the engine has not weighed, count the experts their slots hold."""
    offload = load_leaving_a_slot_to_copies(qtbot, window, monkeypatch)
    budget = window.budget_panel
    assert offload.policy.miss_slots == [1, 1]
    qtbot.waitUntil(lambda: "copied misses" in budget.layer_text.text())
    assert budget.layer_text.text() == ("<b>6 expert slots</b> for 16 experts: 3 of 8 in every layer (2 layers): "
                                        "2 resident experts, 1 left for copied misses")
    budget.expert_bytes.setValue(4 * slot())
    budget.expert_bytes.valueChanged.emit(budget.expert_bytes.value())
    qtbot.waitUntil(lambda: budget.layer_text.text() == "<b>4 of 16</b> experts resident: 2 of 8 in every layer "
                                                        "(2 layers)")


def test_a_change_made_before_an_answer_can_still_be_applied_after_it(qtbot, window):
    """Apply waits while the engine is busy and is offered again once it is idle: a change made before an answer
    was left 'not applied yet' beside a greyed-out Apply until some control moved."""
    path = fixture_folder("gptoss")
    load(qtbot, window, path, simulated())
    budget = window.budget_panel
    budget.wave.setValue(2)
    qtbot.waitUntil(lambda: budget.apply_button.isEnabled())
    ask(qtbot, window, "Hello", max_tokens=4)
    assert budget.applied_label.text() == "Changed: not applied yet" and budget.apply_button.isEnabled()
    window._on_busy("generating")  # a control moved while answering: Apply waits for the answer
    budget.wave.setValue(3)
    qtbot.wait(50)
    assert not budget.apply_button.isEnabled()
    window._on_busy("")
    assert budget.apply_button.isEnabled()


def test_miss_split_and_pinned_ring_shown_are_the_engines(qtbot, window):
    from engine.units import human_bytes

    path = fixture_folder("gptoss")
    settings = {"device": {"kind": "simulated", "capacity": 8 << 30},   # 3 of 16 experts resident; a 3-expert ring
                "entries": {"device_expert_bytes": str(3 * slot()), "pinned_bytes": str(3 * staged())}}
    load(qtbot, window, path, settings)
    assert same(window.loaded_path, path) and not window.error_banner.isVisible()
    offload = window.worker._model.offload  # the worker is idle: the engine's figures hold still
    pinned = offload.pinned_info()
    assert pinned["bytes"] == 3 * staged() and offload.wave_experts == 1  # the ring bounds the wave: 3 // 2
    budget = window.budget_panel
    # the budget panel showed, before the load, the ring and the wave the engine took
    assert budget.last_estimate.staging.pinned_bytes == pinned["bytes"]
    assert budget.last_estimate.staging.wave_experts == offload.wave_experts
    assert f"Ring <b>{human_bytes(pinned['bytes'])}</b> = 3 experts" in budget.pinned_note.text()
    assert "prefill waves of <b>1</b>" in budget.pinned_note.text()
    # where everything landed: the ring, its high-water mark and copies, as pinned_info() says
    landed = window.model_panel.landed.text()
    assert (f"Pinned staging ring (page-locked host memory every copy to the device goes through): "
            f"{human_bytes(pinned['bytes'])}, high-water {human_bytes(pinned['high_water'])} so far, "
            f"{pinned['copies']} copies; prefill waves of 1 expert.") in landed

    before = offload.stats.totals()
    entry = ask(qtbot, window, "Hello", max_tokens=16)
    stats = offload.stats
    totals = stats.totals()
    assert 0 < totals.misses == totals.misses_cpu + totals.misses_copied  # partially resident: misses happen
    # the answer's statistics: this answer's split, as the engine counted it
    answer = (f"misses: {totals.misses_cpu - before.misses_cpu} on the CPU, "
              f"{totals.misses_copied - before.misses_copied} copied to the device "
              f"({totals.miss_copies - before.miss_copies} decode copies)")
    assert answer in entry["stats"] and entry["result"]["offload"]["misses"] == totals.misses - before.misses
    # the placement view: cumulative split, the last step's split, the ring; every figure the engine's
    qtbot.waitUntil(lambda: window.placement.split.get("steps") == stats.steps)
    placement = window.placement
    assert placement.split == {"steps": stats.steps, "misses": totals.misses, "misses_cpu": totals.misses_cpu,
                               "misses_copied": totals.misses_copied, "miss_copies": totals.miss_copies,
                               "misses_read": 0, "admissions": offload.policy.admissions}
    assert placement.last_step == tuple(stats.step_splits[-1])
    assert placement.pinned == offload.pinned_info() and placement.pinned["copies"] > pinned["copies"]
    summary = placement.summary.text()
    assert (f"misses since load: {totals.misses_cpu} on the CPU, {totals.misses_copied} copied to the device "
            f"({totals.miss_copies} decode copies)") in summary
    assert f"last step: {stats.step_splits[-1][0]} on the CPU, {stats.step_splits[-1][1]} copied" in summary
    assert copies_text({"miss_slots": offload.policy.miss_slots,
                        "later_hits_per_copy": offload.copy_reuse.value}) in summary
    live = offload.pinned_info()
    assert f"pinned ring {human_bytes(live['bytes'])}, high-water {human_bytes(live['high_water'])}" in summary
    assert 0 < live["high_water"] <= live["bytes"]
    layer = stats.layers[0]
    assert (f"Layer 0 misses: {layer.misses_cpu} on the CPU, {layer.misses_copied} copied to the device "
            f"({layer.miss_copies} decode copies)") in placement.heatmap.tooltip_at(0, 0)
    # the budget panel shows the loaded model's ring and high-water too
    assert (f"Loaded model: ring {human_bytes(live['bytes'])}, high-water {human_bytes(live['high_water'])}, "
            f"{live['copies']} copies") in budget.pinned_note.text()
    # CPU throughput counts only the misses the CPU computed
    data = placement.heatmap.data
    assert data["cpu_expert_bytes"] == sum(s.misses_cpu * info.bytes_per_expert
                                           for s, info in zip(stats.layers, offload.infos))


def open_on_simulated(qtbot, window, expert_bytes: int):
    """The gpt-oss fixture opened (not loaded), the budget panel on the simulated GPU with this expert budget."""
    path = fixture_folder("gptoss")
    window.open_model(str(path))
    qtbot.waitUntil(lambda: window.facts is not None and not window.busy, timeout=WAIT)
    budget = window.budget_panel
    budget.device.setCurrentIndex(budget.device.findData("simulated"))
    budget.expert_bytes.setValue(expert_bytes)
    budget.expert_bytes.valueChanged.emit(budget.expert_bytes.value())
    return path, budget


def test_the_pinned_slider_reaches_the_automatic_ring_of_a_tiny_model(qtbot, window):
    """The Pinned slider's far end was the stored experts' bytes, while the automatic ring (two prefill waves of
    experts as staged) of the gpt-oss fixture is more than all its 16 experts: leaving auto started beyond the
    slider's reach, and sliding to its end gave a smaller ring. The far end is now the automatic ring."""
    _path, budget = open_on_simulated(qtbot, window, 3 * slot())
    qtbot.waitUntil(lambda: "3 of 16" in budget.layer_text.text())
    auto_ring = budget.last_estimate.staging.pinned_bytes
    assert auto_ring == 2 * 8 * staged() > window.facts.expert_bytes  # the tiny model's case
    budget.pinned_bytes.auto.setChecked(False)
    qtbot.waitUntil(lambda: budget.config().pinned_bytes == auto_ring)
    assert budget.pinned_bytes.slider.value() == budget.pinned_bytes.STEPS
    budget.pinned_bytes.slider.setValue(0)
    budget.pinned_bytes.slider.setValue(budget.pinned_bytes.STEPS)  # back to the far end: the automatic ring again
    assert budget.pinned_bytes.value() == auto_ring


def test_the_pinned_slider_reaches_the_automatic_ring_with_a_value_set(qtbot, window):
    """The far end was raised to the automatic ring only while Pinned was on auto: a model opened with a value kept
    in its budgets (3 experts' ring) had the slider end at the stored experts' bytes, short of the ring auto takes,
    which the value could then not be slid back to. The far end is the automatic ring either way."""
    path = fixture_folder("gptoss")
    window.save_model_settings(str(path), {"device": {"kind": "simulated", "capacity": 8 << 30},
                                           "entries": {"device_expert_bytes": str(3 * slot()),
                                                       "pinned_bytes": str(3 * staged())}})
    window.open_model(str(path))
    qtbot.waitUntil(lambda: window.facts is not None and not window.busy, timeout=WAIT)
    budget = window.budget_panel
    assert budget.config().pinned_bytes == 3 * staged() and "3 of 16" in budget.layer_text.text()
    auto_ring = budget.last_estimate.staging.auto_pinned_bytes
    assert auto_ring == 2 * 8 * staged() > window.facts.expert_bytes
    budget.pinned_bytes.slider.setValue(budget.pinned_bytes.STEPS)
    assert budget.pinned_bytes.value() == auto_ring
    qtbot.waitUntil(lambda: budget.last_estimate.staging.pinned_bytes == auto_ring)
    assert budget.last_estimate.staging.wave_experts == 8  # the wave auto gives: two waves fill the ring


def test_leaving_the_automatic_expert_budget_starts_from_the_budget_auto_gave(qtbot, window):
    """Unticking auto on device_expert_bytes left the slider at 0 bytes: every expert left the device in the estimate
    ('0 of 16' where auto had all 16 resident), and the user had to find the budget again. As Pinned starts from the
    ring auto gave, the expert budget starts from auto's, up to the slider's far end (every expert in a slot)."""
    window.open_model(str(fixture_folder("gptoss")))
    qtbot.waitUntil(lambda: window.facts is not None and not window.busy, timeout=WAIT)
    budget = window.budget_panel
    budget.device.setCurrentIndex(budget.device.findData("simulated"))
    qtbot.waitUntil(lambda: "16 of 16" in budget.layer_text.text())
    assert budget.config().device_expert_bytes is None and budget.last_estimate.plan.budget_bytes > 16 * slot()
    budget.expert_bytes.auto.setChecked(False)
    assert budget.expert_bytes.value() == budget.expert_bytes.maximum() == 16 * slot()
    qtbot.waitUntil(lambda: budget.config().device_expert_bytes == 16 * slot())
    assert "16 of 16" in budget.layer_text.text()
    budget.expert_bytes.setValue(3 * slot())  # a value of the user's own is kept when auto is ticked and unticked
    budget.expert_bytes.auto.setChecked(True)
    budget.expert_bytes.auto.setChecked(False)
    assert budget.expert_bytes.value() == 3 * slot()


def test_a_model_opened_with_no_budgets_kept_keeps_the_device_chosen(qtbot, window):
    """A model with no budgets kept came up on 'CPU only' whatever device was chosen: the demo tried on a simulated
    GPU, then another model opened, showed every expert on the CPU and loaded so. It now starts from the defaults on
    the device chosen, as Defaults leaves them; a model with budgets kept comes up with its own device."""
    path, budget = open_on_simulated(qtbot, window, 3 * slot())
    budget.sim_size.setValue(4 << 30)
    budget.sim_size.valueChanged.emit(budget.sim_size.value())
    window.save_model_settings(str(path), budget.settings())
    window.open_model(str(fixture_folder("lfm2moe")))
    qtbot.waitUntil(lambda: window.facts.name == "lfm2moe" and not window.busy, timeout=WAIT)
    assert budget.device_settings() == {"kind": "simulated", "capacity": 4 << 30}
    assert budget.config().device_expert_bytes is None and "simulated GPU, 4.0 GiB" in budget.statements.text()
    budget.device.setCurrentIndex(budget.device.findData("cpu"))
    window.open_model(str(path))
    qtbot.waitUntil(lambda: window.facts.name == "gptoss" and not window.busy, timeout=WAIT)
    assert budget.device_settings() == {"kind": "simulated", "capacity": 4 << 30}
    assert budget.config().device_expert_bytes == 3 * slot()


def test_leaving_the_automatic_reserve_or_host_cache_starts_from_what_auto_gave(qtbot, window):
    """Unticking auto on Reserve or Host cache left them at 0 bytes, while the expert budget and Pinned start from
    what auto gave: a reserve of 0 gave the automatic budget the whole device (no room for the KV cache and
    workspace), a host cache of 0 kept no expert in host memory. They now start from auto's: the reserve the
    estimate says the automatic budget keeps free, the host cache every expert's pages (the slider's far end)."""
    window.open_model(str(fixture_folder("gptoss")))
    qtbot.waitUntil(lambda: window.facts is not None and not window.busy, timeout=WAIT)
    budget = window.budget_panel
    budget.device.setCurrentIndex(budget.device.findData("simulated"))
    qtbot.waitUntil(lambda: "16 of 16" in budget.layer_text.text())
    est = budget.last_estimate
    reserve, automatic = est.reserve_bytes, est.plan.budget_bytes
    assert reserve >= 512 << 20 and f"keeps {human_bytes(reserve)} free" in budget.vram_legend.text()
    budget.reserve_bytes.auto.setChecked(False)
    assert budget.reserve_bytes.value() == reserve and budget.config().reserve_device_bytes == reserve
    qtbot.waitUntil(lambda: budget.last_estimate is not est)
    assert budget.last_estimate.plan.budget_bytes == automatic  # the same reserve: the same automatic budget
    expert_bytes = window.facts.expert_bytes
    assert budget.host_bytes.value() is None and budget.host_bytes.maximum() == expert_bytes
    budget.host_bytes.auto.setChecked(False)
    assert budget.host_bytes.value() == budget.config().host_expert_bytes == expert_bytes
    # a value of the user's own is kept when auto is ticked and unticked again
    for control, own in ((budget.reserve_bytes, 1 << 30), (budget.host_bytes, expert_bytes // 2)):
        control.setValue(own)
        control.auto.setChecked(True)
        control.auto.setChecked(False)
        assert control.value() == own


def test_a_pinned_ring_below_one_expert_is_refused_with_the_engines_message(qtbot, window):
    from engine.offload.config import OffloadConfig
    from engine.offload.planner import OffloadPlanError
    from engine.offload.staging import ring_bytes

    path, budget = open_on_simulated(qtbot, window, 3 * slot())
    qtbot.waitUntil(lambda: "3 of 16" in budget.layer_text.text())
    # leaving auto starts from the ring auto gave, not from 0 bytes
    auto_ring = budget.last_estimate.staging.pinned_bytes
    budget.pinned_bytes.auto.setChecked(False)
    qtbot.waitUntil(lambda: budget.config().pinned_bytes == auto_ring and "Ring <b>" in budget.pinned_note.text())
    # the control moves the ring and the wave live
    budget.pinned_bytes.setValue(5 * staged())
    budget.pinned_bytes.valueChanged.emit(budget.pinned_bytes.value())
    qtbot.waitUntil(lambda: "= 5 experts" in budget.pinned_note.text())
    assert "prefill waves of <b>2</b>" in budget.pinned_note.text()
    # below one expert: refused, in the engine's words, in the panel and the verdict
    with pytest.raises(OffloadPlanError) as engine_says:
        ring_bytes(OffloadConfig(pinned_bytes=staged() - 1), staged(), 8)
    message = str(engine_says.value)
    budget.pinned_bytes.setValue(staged() - 1)
    budget.pinned_bytes.valueChanged.emit(budget.pinned_bytes.value())
    qtbot.waitUntil(lambda: "Refused" in budget.pinned_note.text())
    assert budget.last_estimate.error == message and message in budget.pinned_note.text()
    assert message in budget.statements.text() and "Refused" in window.model_panel.verdict.text()
    # loading with it: the engine refuses with the same message, the window stays usable
    window.load()
    qtbot.waitUntil(lambda: not window.busy and window.error_banner.isVisible(), timeout=WAIT)
    assert message in window.error_banner.text() and window.loaded_path is None
    budget.pinned_bytes.setValue(staged())
    budget.pinned_bytes.valueChanged.emit(budget.pinned_bytes.value())
    qtbot.waitUntil(lambda: "= 1 expert of" in budget.pinned_note.text())
    window.load()
    qtbot.waitUntil(lambda: same(window.loaded_path, path) and not window.busy, timeout=WAIT)
    offload = window.worker._model.offload
    assert offload.pinned_info()["bytes"] == staged() and offload.wave_experts == 1
    # a ring the estimate refuses: Apply is not offered on the loaded model
    budget.pinned_bytes.setValue(staged() - 1)
    budget.pinned_bytes.valueChanged.emit(budget.pinned_bytes.value())
    qtbot.waitUntil(lambda: "Refused" in budget.pinned_note.text())
    assert not budget.apply_button.isEnabled()
    assert budget.applied_label.text() == "Changed: refused, not applied (see the estimate)"
    # asked all the same (where the estimate and the engine disagree): the engine refuses, the old ring stays in
    # force, answers go on
    window.error_banner.hide()
    budget.applyRequested.emit(budget.settings(), bool(budget.needs_reload()))
    qtbot.waitUntil(lambda: not window.busy and window.error_banner.isVisible(), timeout=WAIT)
    assert window.error_banner.text() == f"Could not apply the settings: {message}"
    assert offload.pinned_info()["bytes"] == staged() and offload.config.pinned_bytes == staged()
    entry = ask(qtbot, window, "Hello", max_tokens=4)
    assert entry["text"] and "misses:" in entry["stats"]


def test_reload_is_not_offered_with_settings_the_estimate_refuses_where_it_would_cost_the_loaded_model(qtbot, window):
    """A pinned ring below one expert, refused in red by the estimate, left Reload on: the load dropped the loaded
    model and its conversation, then failed as the estimate said ('… was unloaded first, to free its memory, and is
    no longer loaded'). With a model loaded, Load and Reload are off while the estimate refuses, as Apply is; with
    none loaded, a load says the engine's refusal, as before."""
    path = fixture_folder("gptoss")
    load(qtbot, window, path, simulated())
    ask(qtbot, window, "Hello", 3)
    budget, panel = window.budget_panel, window.model_panel
    assert panel.load_button.isEnabled() and panel.load_button.text() == "Reload" and window.load_action.isEnabled()
    budget.pinned_bytes.setValue(staged() - 1)
    budget.pinned_bytes.valueChanged.emit(budget.pinned_bytes.value())
    qtbot.waitUntil(lambda: "Refused" in panel.verdict.text())
    assert not panel.load_button.isEnabled() and not window.load_action.isEnabled()
    window.load_action.trigger()
    window.load()
    qtbot.wait(200)
    assert same(window.loaded_path, path) and not window.error_banner.isVisible() and len(window.chat.entries) == 2
    budget.pinned_bytes.setValue(staged())
    budget.pinned_bytes.valueChanged.emit(budget.pinned_bytes.value())
    qtbot.waitUntil(lambda: panel.load_button.isEnabled() and window.load_action.isEnabled())
    window.unload()
    qtbot.waitUntil(lambda: window.loaded_path is None and not window.busy, timeout=WAIT)
    budget.pinned_bytes.setValue(staged() - 1)
    budget.pinned_bytes.valueChanged.emit(budget.pinned_bytes.value())
    qtbot.waitUntil(lambda: "Refused" in panel.verdict.text())
    assert panel.load_button.isEnabled() and window.load_action.isEnabled()


def test_the_engines_own_replan_after_a_refused_apply_keeps_the_settings_in_force_as_applied(qtbot, window):
    """A refused Apply leaves the old settings in force; the engine's next re-plan of its own (a layer split trial)
    marked the refused ones applied, so the panel compared every change with settings the model never ran."""
    path = fixture_folder("gptoss")
    load(qtbot, window, path, simulated())
    budget, offload = window.budget_panel, window.worker._model.offload
    in_force = budget.applied
    refused = {**in_force, "entries": {**in_force["entries"], "pinned_bytes": str(staged() - 1)}}
    budget.applyRequested.emit(refused, False)  # where the estimate and the engine disagree: the engine refuses
    qtbot.waitUntil(lambda: not window.busy and window.error_banner.isVisible(), timeout=WAIT)
    assert "Could not apply the settings" in window.error_banner.text() and budget.applied == in_force
    offload.layer_split_mode = "auto"
    offload.split_trials.measured = {"spread": 0.030, "whole": 0.020}
    offload._set_whole_layers(True)
    window.worker._emit_stats()
    qtbot.waitUntil(lambda: "Measured faster" in window.status_state.text(), timeout=WAIT)
    assert budget.applied == in_force and budget.applied_label.text() == "Applied to the loaded model"


def test_an_apply_the_engine_accepts_takes_down_the_error_of_one_it_refused_before(qtbot, window):
    """A refused Apply's 'Could not apply the settings: …' stayed up over the next Apply, which the engine accepted:
    the status bar said 'Re-planned without reloading' under it, and answers went on under it too. An Apply takes the
    last error down, as a load, an open or a records job does; one the engine refuses says its own."""
    load(qtbot, window, fixture_folder("gptoss"), simulated())
    budget = window.budget_panel
    refused = {**budget.applied, "entries": {**budget.applied["entries"], "pinned_bytes": str(staged() - 1)}}
    budget.applyRequested.emit(refused, False)
    qtbot.waitUntil(lambda: not window.busy and window.error_banner.isVisible(), timeout=WAIT)
    assert window.error_banner.text().startswith("Could not apply the settings: ")
    budget.expert_bytes.setValue(6 * slot())
    budget.expert_bytes.valueChanged.emit(budget.expert_bytes.value())
    qtbot.waitUntil(lambda: budget.apply_button.isEnabled())
    budget.apply_button.click()
    qtbot.waitUntil(lambda: "6 expert slots for the 16 experts" in window.model_panel.landed.text() and not window.busy,
                    timeout=WAIT)
    assert window.status_state.text() == "Re-planned without reloading" and not window.error_banner.isVisible()
    budget.applyRequested.emit(refused, False)
    qtbot.waitUntil(lambda: not window.busy and window.error_banner.isVisible(), timeout=WAIT)
    assert window.error_banner.text().startswith("Could not apply the settings: ")


def test_unload_takes_down_the_error_of_the_model_it_unloads(qtbot, window):
    """A refused Apply's error stayed up over Unload, which has nothing to do with it: the window said 'No model
    loaded' under 'Could not apply the settings: …'. Unload takes the last error down, as Send, Apply and a load
    do."""
    load(qtbot, window, fixture_folder("gptoss"), simulated())
    budget = window.budget_panel
    refused = {**budget.applied, "entries": {**budget.applied["entries"], "pinned_bytes": str(staged() - 1)}}
    budget.applyRequested.emit(refused, False)
    qtbot.waitUntil(lambda: not window.busy and window.error_banner.isVisible(), timeout=WAIT)
    window.unload()
    qtbot.waitUntil(lambda: window.loaded_path is None and not window.busy, timeout=WAIT)
    assert not window.error_banner.isVisible() and window.status_model.text() == "No model loaded"


def test_only_settings_the_engine_accepted_are_remembered_for_the_model(qtbot, window):
    """The next load of a model uses its remembered settings: an Apply the engine refused (a re-plan, or the load of an
    Apply and reload) was remembered all the same, so the model came back with settings it never ran."""
    path = fixture_folder("gptoss")
    load(qtbot, window, path, simulated())
    budget = window.budget_panel
    in_force = budget.applied
    assert window.model_settings(str(path)) == in_force
    refused = {**in_force, "entries": {**in_force["entries"], "pinned_bytes": str(staged() - 1)}}
    budget.applyRequested.emit(refused, False)
    qtbot.waitUntil(lambda: not window.busy and window.error_banner.isVisible(), timeout=WAIT)
    assert "Could not apply the settings" in window.error_banner.text()
    assert window.model_settings(str(path)) == in_force
    # an Apply the engine accepts is remembered
    window.error_banner.hide()
    accepted = {**in_force, "entries": {**in_force["entries"], "device_expert_bytes": str(6 * slot())}}
    budget.applyRequested.emit(accepted, False)
    qtbot.waitUntil(lambda: not window.busy and budget.applied == accepted, timeout=WAIT)
    assert window.model_settings(str(path)) == accepted
    # an Apply and reload whose load is refused is not
    budget.applyRequested.emit({**refused, "entries": {**refused["entries"], "gpu_device_mem_limit": str(1 << 30)}},
                               True)
    qtbot.waitUntil(lambda: not window.busy and window.error_banner.isVisible(), timeout=WAIT)
    assert window.model_settings(str(path)) == accepted


def test_streaming_slots_control_is_estimated_and_applied_as_the_engine_plans(qtbot, window):
    path, budget = open_on_simulated(qtbot, window, 0)
    qtbot.waitUntil(lambda: "device_working_bytes would let" in budget.statements.text())  # off: the hint
    assert budget.config().device_working_bytes is None
    window.load()
    qtbot.waitUntil(lambda: same(window.loaded_path, path) and not window.busy, timeout=WAIT)
    offload = window.worker._model.offload
    assert offload.streaming.groups == []
    budget.working_bytes.setValue(64 << 20)
    budget.working_bytes.valueChanged.emit(budget.working_bytes.value())
    qtbot.waitUntil(lambda: "shared streaming slots" in budget.statements.text() and budget.apply_button.isEnabled())
    assert "decode streaming slots" in budget.vram_legend.text()
    budget.apply_button.click()
    qtbot.waitUntil(lambda: not window.busy and bool(offload.streaming.groups) and not budget.dirty(), timeout=WAIT)
    assert offload.config.device_working_bytes == 64 << 20 and window.worker._model.offload is offload  # no reload
    assert window.model_settings(str(path))["entries"]["session.moe.offload.device_working_bytes"] == str(64 << 20)


def test_a_cold_experts_tooltip_says_where_its_misses_run_after_an_apply(qtbot, window):
    """The tooltip said a miss on a cold expert ran on the CPU whatever cpu_execution and the decode path said: under
    cpu_execution=disabled every miss is copied in, and with the host tier the GPU reads it from host memory."""
    path = fixture_folder("gptoss")
    settings = simulated()
    load(qtbot, window, path, {**settings, "entries": {**settings["entries"], "cpu_execution": "disabled"}})
    heatmap, budget = window.placement.heatmap, window.budget_panel
    qtbot.waitUntil(lambda: heatmap.data is not None, timeout=WAIT)
    cold = int(heatmap.data["resident"][0].argmin())  # 3 of 16 experts resident: layer 0 has cold ones
    assert "cold (a miss is copied to the device before it runs)" in heatmap.tooltip_at(0, cold)
    budget.cpu_execution.setCurrentText("auto")
    budget.decode_path.setCurrentIndex(budget.decode_path.findData("tier"))
    qtbot.waitUntil(lambda: budget.apply_button.isEnabled())
    budget.apply_button.click()
    qtbot.waitUntil(lambda: not window.busy and "read by the GPU" in heatmap.tooltip_at(0, cold), timeout=WAIT)
    assert "cold (a miss is read by the GPU from host memory)" in heatmap.tooltip_at(0, cold)


def test_graphs_receive_samples_and_pause(qtbot, window):
    qtbot.waitUntil(lambda: window.graphs.sample_count >= 3, timeout=10_000)
    x, y = window.graphs.curves["ram_this"].getData()
    assert len(x) >= 3 and y[-1] > 0
    assert len(window.graphs.core_curves) >= 1
    gpu = window.graphs.samples[-1]["gpu"]
    if gpu is None:  # no NVIDIA GPU: the graphs say so instead of drawing zeros
        assert window.graphs.gpu_note.isVisible() and "GPU" in window.graphs.gpu_note.text()
        assert not window.graphs.rows["vram"][1].isVisible()
    else:
        assert window.graphs.rows["vram"][1].isVisible()
    window.graphs.set_paused(True)
    frozen = len(window.graphs.curves["ram_this"].getData()[0])
    count = window.graphs.sample_count
    qtbot.waitUntil(lambda: window.graphs.sample_count >= count + 2, timeout=10_000)
    assert len(window.graphs.curves["ram_this"].getData()[0]) == frozen
    window.graphs.set_paused(False)
    assert len(window.graphs.curves["ram_this"].getData()[0]) > frozen


def test_graphs_draw_nothing_while_not_on_screen_and_catch_up_when_shown(qtbot, window):
    """Minimised, or the Machine dock closed, the graphs redrew every second for no one: the samples are kept, the
    drawing waits, and what came meanwhile is drawn when the window is restored or the dock shown again."""
    qtbot.waitUntil(lambda: window.graphs.sample_count >= 1, timeout=10_000)
    window._sampler_thread.stop()  # (the test gives the samples)
    sample = dict(window.graphs.samples[-1])
    graphs, drawn = window.graphs, lambda: len(window.graphs.curves["ram_this"].getData()[0])
    window._on_sample(dict(sample, t=sample["t"] + 1))
    before = drawn()
    assert before == graphs.sample_count
    window.showMinimized()
    for step in range(2, 5):
        window._on_sample(dict(sample, t=sample["t"] + step))
    assert drawn() == before and graphs.sample_count == before + 3
    window.showNormal()
    assert drawn() == graphs.sample_count
    window.docks["graphs"].close()
    window._on_sample(dict(sample, t=sample["t"] + 5))
    assert drawn() == graphs.sample_count - 1
    window.docks["graphs"].show()
    assert drawn() == graphs.sample_count


def test_sampling_that_keeps_failing_is_said_once_over_the_graphs(qtbot, window, monkeypatch):
    """psutil raising on every tick: the graphs say so in one line (not 'waiting for the first sample…' forever),
    once, and the line goes with the next sample that works."""
    import psutil

    lines = []
    window.sampler.failed.connect(lines.append)

    def refused():
        raise psutil.AccessDenied(msg="/proc/meminfo")

    monkeypatch.setattr(psutil, "virtual_memory", refused)
    qtbot.waitUntil(lambda: window.graphs.sampling_failure.isVisible(), timeout=10_000)
    count = window.graphs.sample_count
    qtbot.wait(1000)  # five more ticks at 200 ms, all failing
    assert lines == ["Sampling the machine failed (psutil.AccessDenied: /proc/meminfo); the graphs resume when a "
                     "sample works."]
    assert window.graphs.sampling_failure.text() == lines[0] and window.graphs.sample_count == count
    monkeypatch.undo()
    qtbot.waitUntil(lambda: window.graphs.sample_count > count, timeout=10_000)
    assert not window.graphs.sampling_failure.isVisible() and not window.error_banner.isVisible()


def test_a_model_that_asks_for_beam_search_is_told_on_load_to_answer_one_sequence(qtbot, window, copy_fixture):
    import json

    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["search"]["num_beams"] = 4
    (folder / "genai_config.json").write_text(json.dumps(config))
    load(qtbot, window, folder)
    assert window.chat.live.text() == (
        "New conversation with gptoss. The model's genai_config.json asks for beam search (search.num_beams 4), which "
        "MoE Workbench does not do: its answers are one sequence, greedy or sampled.")


def test_record_and_sweep_with_the_models_sampling_say_it_does_no_beam_search(qtbot, window, copy_fixture):
    """With "The model's sampling" chosen for Record or the sweep, a genai_config.json asking for beam search went
    unsaid in the window (the command line warns): each says the note while that choice is made."""
    import json

    from app.gui.records_jobs import GREEDY, MODEL_SAMPLING

    folder = copy_fixture("gptoss")
    config = json.loads((folder / "genai_config.json").read_text())
    config["search"]["num_beams"] = 4
    (folder / "genai_config.json").write_text(json.dumps(config))
    load(qtbot, window, folder)
    note = ("The model's genai_config.json asks for beam search (search.num_beams 4), which MoE Workbench does not do: "
            "its answers are one sequence, greedy or sampled.")
    for answers in (window.scenarios.answers, window.sweep.answers):
        answers.setCurrentIndex(answers.findData(GREEDY))
        assert answers.note.isHidden()
        answers.setCurrentIndex(answers.findData(MODEL_SAMPLING))
        assert not answers.note.isHidden() and answers.note.text() == note
    load(qtbot, window, fixture_folder("gptoss"))  # a model that asks for none
    assert window.scenarios.answers.note.isHidden() and window.sweep.answers.note.isHidden()


def test_corrupt_model_shows_a_message_and_the_window_stays_usable(qtbot, window, copy_fixture):
    broken = copy_fixture("gptoss")
    (broken / "model.onnx").write_bytes(b"not a model")
    load(qtbot, window, broken)
    assert window.error_banner.isVisible()
    assert "not a valid ONNX model" in window.error_banner.text()
    assert window.loaded_path is None and window.model_panel.open_button.isEnabled()
    load(qtbot, window, fixture_folder("lfm2moe"))
    assert not window.error_banner.isVisible() and same(window.loaded_path, fixture_folder("lfm2moe"))
    assert "dense part" in window.model_panel.landed.text()


def test_a_data_file_truncated_after_the_load_is_refused_by_name_not_a_crash(qtbot, window, copy_fixture):
    """The experts are read from the memory-mapped data file as the answers need them: one rewritten in place (cut
    short) after the load killed the process at the next answer (SIGBUS). The answer is refused, naming the file, and
    the window loads the folder again once it is whole."""
    folder = copy_fixture("lfm2moe")
    load(qtbot, window, folder)
    ask(qtbot, window, "Hello", 4)
    data = folder / "model.onnx.data"
    whole = data.read_bytes()
    data.write_bytes(whole[:4096])
    window.chat.prompt.setPlainText("Hello again")
    window.chat.send()
    qtbot.waitUntil(lambda: window.error_banner.isVisible() and window.chat.send_button.isEnabled(), timeout=WAIT)
    assert window.error_banner.text() == (f"{data}: truncated since the model was loaded: it has 4096 bytes of the "
                                          f"{len(whole)} its initializers take; load the model again")
    assert window.chat.prompt.toPlainText() == "Hello again" and len(window.chat.entries) == 2
    data.write_bytes(whole)
    window.unload()
    qtbot.waitUntil(lambda: window.loaded_path is None and not window.busy, timeout=WAIT)
    load(qtbot, window, folder)
    assert ask(qtbot, window, "Hello", 4)["result"]["finish_reason"] == "length"


def test_a_data_file_replaced_after_the_load_answers_from_the_loaded_bytes_and_the_next_load_from_recent_reads_it(
        qtbot, window, copy_fixture):
    """A data file replaced by another after the load (written anew and renamed over it, as an export may do) is not
    refused: the loaded model's mapping is of the file it loaded, kept open, and it answers from those bytes. Opened
    from Recent and loaded again, the model reads the new file."""
    folder = copy_fixture("lfm2moe")
    load(qtbot, window, folder)
    data = folder / "model.onnx.data"
    whole = data.read_bytes()
    fresh = folder.parent / "fresh.data"
    fresh.write_bytes(bytes(16) + whole[16:])  # the first initializer's first bytes zeroed
    os.replace(fresh, data)
    loaded = window.worker._model
    assert ask(qtbot, window, "Hello", 4)["result"]["finish_reason"] == "length" and not window.error_banner.isVisible()
    assert loaded.folder.onnx.mapping("model.onnx.data")[:16] == whole[:16] != bytes(16)
    assert window.recent_menu.actions()[0].text() == str(folder)
    window.recent_menu.actions()[0].trigger()
    qtbot.waitUntil(lambda: not (window.busy or window._waiting), timeout=WAIT)
    window.load()
    qtbot.waitUntil(lambda: not window.busy and window.worker._model not in (None, loaded), timeout=WAIT)
    assert window.worker._model.folder.onnx.mapping("model.onnx.data")[:16] == bytes(16)
    assert ask(qtbot, window, "Hello", 4)["result"]["finish_reason"] == "length" and not window.error_banner.isVisible()


def test_regenerate_after_an_answer_that_failed_midway_answers_that_message(qtbot, window, monkeypatch):
    """The failed answer keeps what it streamed in the transcript, but the engine's conversation never took that turn:
    Regenerate must answer the failed message, not the one before it."""
    load(qtbot, window, fixture_folder("lfm2moe"))
    first = ask(qtbot, window, "Hello", 6)
    decoder = window.worker._model.decoder
    real, calls = decoder.forward, []

    def fails_at_the_second_decode_step(state, token_ids):
        calls.append(len(token_ids))
        if len(calls) == 3:
            raise RuntimeError("CUDA error: out of memory")
        return real(state, token_ids)

    monkeypatch.setattr(decoder, "forward", fails_at_the_second_decode_step)
    failed = ask(qtbot, window, "Tell me more", 6)
    assert failed["stats"].startswith("error: RuntimeError: CUDA error: out of memory") and failed["text"]
    monkeypatch.setattr(decoder, "forward", real)
    window.chat.regenerate()
    qtbot.waitUntil(lambda: bool(not window.busy and window.chat.entries[-1].get("stats")), timeout=WAIT)
    answer = window.chat.entries[-1]
    assert [(e["role"], e["text"]) for e in window.chat.entries[:3]] == [
        ("user", "Hello"), ("assistant", first["text"]), ("user", "Tell me more")]
    assert window.worker._conversation.messages == [
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": first["text"]},
        {"role": "user", "content": "Tell me more"}, {"role": "assistant", "content": answer["text"]}]


def test_the_next_answer_takes_down_the_error_of_one_that_failed(qtbot, window, monkeypatch):
    """An answer that failed put its error up; it stayed up over the next answers, which the engine gave (a load, an
    open or a records job takes the last error down as it is asked for; the chat's Send and Regenerate did not)."""
    load(qtbot, window, fixture_folder("lfm2moe"))
    decoder = window.worker._model.decoder
    real = decoder.forward

    def out_of_memory(state, token_ids):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(decoder, "forward", out_of_memory)
    window.chat.max_tokens.setValue(3)
    window.chat.prompt.setPlainText("Hello")
    window.chat.send()
    qtbot.waitUntil(lambda: window.error_banner.isVisible() and not window.busy and window._chat_waiting is None,
                    timeout=WAIT)
    assert "CUDA error: out of memory" in window.error_banner.text()
    monkeypatch.setattr(decoder, "forward", real)
    answer = ask(qtbot, window, "Hello", 3)
    assert answer["result"]["finish_reason"] == "length" and not window.error_banner.isVisible()
    monkeypatch.setattr(decoder, "forward", out_of_memory)
    window.chat.regenerate()
    qtbot.waitUntil(lambda: window.error_banner.isVisible() and not window.busy and window._chat_waiting is None,
                    timeout=WAIT)
    monkeypatch.setattr(decoder, "forward", real)
    window.chat.regenerate()
    qtbot.waitUntil(lambda: not window.busy and window._chat_waiting is None, timeout=WAIT)
    assert window.chat.entries[-1]["result"]["finish_reason"] == "length" and not window.error_banner.isVisible()


def test_stop_mid_answer_and_unload_at_any_moment(qtbot, window):
    # lfm2moe's greedy answer runs to the length limit (gptoss's ends on eos after 62 tokens, which a slow
    # machine can reach before the queued stop arrives)
    load(qtbot, window, fixture_folder("lfm2moe"))
    window.worker.streamed.connect(lambda _reasoning, _text, _n: window.chat.stop_button.click())
    window.chat.max_tokens.setValue(400)
    window.chat.prompt.setPlainText("Tell a long story")
    window.chat.send()
    qtbot.waitUntil(lambda: bool(not window.busy and window.chat.entries[-1].get("stats")), timeout=WAIT)
    answer = window.chat.entries[-1]
    assert answer["result"]["finish_reason"] == "cancelled" and answer["stats"].endswith("stopped")
    assert answer["result"]["timings"]["generated_tokens"] < 400
    tokens = answer["result"]["timings"]["generated_tokens"]
    assert window.status_state.text().startswith(f"Stopped the answer: {tokens} token")  # not "Ready"
    # unload in the middle of an answer
    window.worker.streamed.disconnect()
    window.worker.streamed.connect(window._on_streamed)
    started = []
    window.worker.streamed.connect(lambda _r, _t, _n: started or (started.append(1), window.unload()))
    window.chat.prompt.setPlainText("Another long one")
    window.chat.send()
    qtbot.waitUntil(lambda: window.loaded_path is None and not window.busy, timeout=WAIT)
    assert not window.chat.send_button.isEnabled() and window.placement.heatmap.data is None
    assert window.model_panel.landed.text() == "Not loaded."


def test_the_tokens_graph_reads_the_answers_rate_where_the_window_catches_up_on_it_at_once(qtbot, window,
                                                                                          own_samples_only):
    """The tokens/s graph timed an answer by the window's own clock as the worker's and the sampler's signals arrived:
    a window busy for a while (drawing, on a loaded machine) caught up on them at once, and the sample then read the
    tokens over the moment that took (thousands of tokens a second where the answer made a hundred; on this 2-core
    machine, busy with other work, the demo's answers of 125-170 tok/s read up to 862). The time is now as the worker
    and the sampler sent them."""
    import time

    from app.gui.telemetry import SystemProbe

    sample, worker, sampler = SystemProbe(nvml=False).sample(), window.worker, window.sampler
    before = len(window.graphs.samples)

    def answer() -> None:  # 40 tokens in 0.4 s, a sample, 10 tokens in 0.1 s and the end, a sample: 100 tok/s
        worker.busyChanged.emit("generating")
        time.sleep(0.4)
        worker.streamed.emit("", "x" * 40, 40)
        sampler.sampled.emit(dict(sample, sent=time.monotonic()))
        time.sleep(0.1)
        worker.streamed.emit("", "x" * 10, 10)
        worker.busyChanged.emit("")
        sampler.sampled.emit(dict(sample, sent=time.monotonic()))

    thread = threading.Thread(target=answer)
    thread.start()
    thread.join()  # (the window's thread waits meanwhile: it receives them all at once)
    qtbot.waitUntil(lambda: len(window.graphs.samples) == before + 2 and not window.busy)
    rates = [s["tokens_per_s"] for s in list(window.graphs.samples)[-2:]]
    assert all(0 < rate <= 100.0 for rate in rates), rates  # (a slow machine's sleeps only lower them)


def test_the_tokens_graph_times_side_by_side_from_its_answers_start_not_from_bs_load(qtbot, window, own_samples_only):
    """The tokens/s graph timed side by side's answers from the job's start: B's load (seconds for a large model), the
    engines' trials decoded before the answers and the saving after counted as answering, and answers of 660-1300
    tok/s read 60. The time is now from the sides' first status to the last side's end, as the job's stream says."""
    from app.gui.records_jobs import JobContext
    from app.gui.side_streams import SideStreams
    from app.gui.telemetry import SystemProbe

    sample, worker, sampler = SystemProbe(nvml=False).sample(), window.worker, window.sampler
    before = len(window.graphs.samples)
    ctx = JobContext(None, None, {}, threading.Event(), lambda fraction, text="": None,
                     lambda payload: worker.jobStreamed.emit("comparing", payload), None)

    def compare() -> None:  # B loaded in 1 s, then 2 x 10 tokens in 0.1 s, then 0.4 s saving: 200 tok/s
        worker.busyChanged.emit("comparing")
        time.sleep(1.0)
        streams = SideStreams(ctx, 64, (True, True), False, interval_s=3600)
        streams.flush()
        for side in (0, 1):
            time.sleep(0.05)
            for _ in range(10):
                streams.on_text(side, None, "ab"[side])
            streams.on_done(side, "eos", 10)
        time.sleep(0.4)
        worker.busyChanged.emit("")
        sampler.sampled.emit(dict(sample, sent=time.monotonic()))

    thread = threading.Thread(target=compare)
    thread.start()
    thread.join()
    qtbot.waitUntil(lambda: len(window.graphs.samples) == before + 1 and not window.busy)
    rate = window.graphs.samples[-1]["tokens_per_s"]
    assert 50.0 < rate <= 200.0, rate  # (a slow machine's sleeps only lower it; timed from the job's start: 13)


def test_stop_between_send_and_the_answers_start_is_not_lost(qtbot, window):
    """Between Send and the worker taking the request, the chat's Stop was off (and Send on: a second Enter queued a
    second message), and Esc did nothing: the answer ran in full. Stop now works from Send on; a request stopped before
    it began is not run, its message goes back in the box, and a regenerate stopped so keeps the answer it would have
    replaced."""
    from PySide6.QtCore import QTimer

    load(qtbot, window, fixture_folder("lfm2moe"))
    first = ask(qtbot, window, "Hello", 6)
    engine_turns = list(window.worker._conversation.messages)
    gate = __import__("threading").Event()

    def hold_the_worker():  # the request waits in the worker's queue until the test lets it go
        QTimer.singleShot(0, window.worker, lambda: gate.wait(30))

    hold_the_worker()
    window.chat.prompt.setPlainText("Tell a long story")
    window.chat.send()
    assert window.chat.stop_button.isEnabled() and window.stop_action.isEnabled()
    assert not window.chat.send_button.isEnabled() and not window.chat.new_button.isEnabled()
    window.chat.stop_button.click()
    assert window.status_state.text() == "Stopping the answer…"
    gate.set()
    qtbot.waitUntil(lambda: window.chat.send_button.isEnabled(), timeout=WAIT)
    assert [(e["role"], e["text"]) for e in window.chat.entries] == [("user", "Hello"), ("assistant", first["text"])]
    assert window.chat.prompt.toPlainText() == "Tell a long story"
    assert window.chat.live.text() == "Stopped before it began: message back in the box."
    assert window.status_state.text() == "Stopped the answer before it began."
    assert window.worker._conversation.messages == engine_turns
    # Regenerate, stopped the same way (Esc): the answer stays
    gate.clear()
    hold_the_worker()
    window.chat.prompt.clear()
    window.chat.regenerate()
    window.stop_action.trigger()
    gate.set()
    qtbot.waitUntil(lambda: window.chat.send_button.isEnabled(), timeout=WAIT)
    assert [(e["role"], e["text"]) for e in window.chat.entries] == [("user", "Hello"), ("assistant", first["text"])]
    assert window.chat.entries[-1]["stats"] == first["stats"] and window.chat.regenerate_button.isEnabled()
    assert window.chat.live.text() == "Stopped before it began: the last answer stays."
    assert window.worker._conversation.messages == engine_turns
    # the next message is answered in full
    assert ask(qtbot, window, "Hello again", 4)["result"]["finish_reason"] != "cancelled"
    # Stop after the worker began the answer, before the window heard of it: the answer ends at its first token
    began = __import__("threading").Event()
    window.worker.busyChanged.connect(lambda activity: activity == "generating" and began.set(),
                                      Qt.ConnectionType.DirectConnection)
    window.chat.max_tokens.setValue(400)
    window.chat.prompt.setPlainText("Tell a long story")
    window.chat.send()
    assert began.wait(30) and window.busy == ""  # (the window's own slot has not run)
    window.chat.stop_button.click()
    qtbot.waitUntil(lambda: window.chat.send_button.isEnabled(), timeout=WAIT)
    answer = window.chat.entries[-1]
    assert answer["result"]["finish_reason"] == "cancelled" and answer["result"]["timings"]["generated_tokens"] == 1
    assert window.status_state.text() == "Stopped the answer: 1 token"


def hold_loads_until_stopped(window) -> None:
    """Loads wait at their first step until the window's stop reaches the worker, by the stop flag or by the load's
    number (EngineWorker.load_stopped), at most 30 s (a fixture loads in milliseconds)."""
    worker = window.worker

    def hold(_fraction) -> None:
        for _ in range(3000):
            if worker.load_stopped():
                return
            worker.cancel.wait(0.01)

    worker.loadProgress.connect(hold, Qt.ConnectionType.DirectConnection)


def load_settled(window) -> threading.Event:
    """Set in the worker, before the window hears of it, once a load reports progress (the loaded model has gone) or
    ends. (Connect it before hold_loads_until_stopped, which holds the load at its first report.)"""
    settled = threading.Event()
    window.worker.loadProgress.connect(lambda _fraction: settled.set(), Qt.ConnectionType.DirectConnection)
    window.worker.busyChanged.connect(lambda activity: activity or settled.set(), Qt.ConnectionType.DirectConnection)
    return settled


def test_a_load_held_at_its_first_report_ends_as_soon_as_it_is_stopped_by_its_number(qtbot, window):
    """hold_loads_until_stopped waited on the stop flag alone: a load held at its first report that the window stopped
    by its number (it had not yet heard the load begin, so Stop reaches that load alone) sat out the hold's 30 s
    before its next stop point ended it. The hold ends as soon as the stop reaches the load, either way."""
    window.open_model(str(fixture_folder("lfm2moe")))
    qtbot.waitUntil(lambda: window.load_action.isEnabled(), timeout=WAIT)
    held, ended = threading.Event(), threading.Event()
    window.worker.loadProgress.connect(lambda _fraction: held.set(), Qt.ConnectionType.DirectConnection)
    window.worker.busyChanged.connect(lambda activity: activity or ended.set(), Qt.ConnectionType.DirectConnection)
    hold_loads_until_stopped(window)
    window.load_action.trigger()
    assert held.wait(30) and window.busy == "" and window._waiting == "loading"  # (the window's own slot has not run)
    window.stop_action.trigger()
    assert window.worker.stopped_load and not window.worker.cancel.is_set()
    assert ended.wait(20)  # (the hold's most is 30 s)
    qtbot.waitUntil(lambda: not (window.busy or window._waiting), timeout=WAIT)
    assert window.status_state.text() == "Stopped the load." and window.loaded_path is None


def test_nothing_else_starts_between_load_and_the_loads_start_and_stop_stops_it(qtbot, window):
    """Between Load and the worker taking it, the window was idle: a message sent at once (Ctrl+L, Ctrl+Return) was
    answered by the model the load made, while the load's new conversation had cleared it off the transcript. Load
    now makes the window busy at once, and Stop then stops the load before it begins: the model loaded stays."""
    load(qtbot, window, fixture_folder("lfm2moe"))
    window.load_action.trigger()
    assert not window.chat.send_button.isEnabled() and not window.load_action.isEnabled()
    window.chat.prompt.setPlainText("Quick one")
    window.chat.send()
    assert window.chat.prompt.toPlainText() == "Quick one" and window._chat_waiting is None
    qtbot.waitUntil(lambda: window.chat.send_button.isEnabled(), timeout=WAIT)
    assert window.chat.entries == [] and window.worker._conversation.messages == []
    # The load waits behind what the worker runs. Stop reached it once the window heard it began: by then the worker
    # had dropped the loaded model, or not (the load was then stopped with it kept), as the two threads ran.
    gate, settled = threading.Event(), load_settled(window)
    hold_loads_until_stopped(window)
    QTimer.singleShot(0, window.worker, lambda: gate.wait(30))
    window.load_action.trigger()
    assert window.stop_action.isEnabled() and window.stop_action.text() == "&Stop the load"
    window.stop_action.trigger()
    gate.set()
    assert settled.wait(30)  # (the window hears nothing of the load meanwhile)
    qtbot.waitUntil(lambda: window.load_action.isEnabled(), timeout=WAIT)
    assert window.error_banner.text() == "Loading stopped; lfm2moe stays loaded."
    assert same(window.loaded_path, fixture_folder("lfm2moe")) and window.status_state.text() == "Stopped the load."
    assert window.chat.send_button.isEnabled() and window.model_panel.landed.text() != "Not loaded."


def test_nothing_queues_behind_a_chat_message_whose_answer_has_not_begun(qtbot, window):
    """Between Send and the worker beginning the answer, Load, Open and Apply stayed on: a load then waited behind the
    answer, and its Stop (the model panel's Cancel) stopped the answer instead, the load running after it all the
    same. From Send on the window is busy with the answer, as with one that runs."""
    load(qtbot, window, fixture_folder("lfm2moe"))
    gate = threading.Event()
    QTimer.singleShot(0, window.worker, lambda: gate.wait(30))  # (the answer waits behind what the worker runs)
    window.chat.max_tokens.setValue(4)
    window.chat.prompt.setPlainText("Hello")
    window.chat.send()
    assert window.busy == "" and window._chat_waiting == 1
    assert not window.load_action.isEnabled() and not window.model_panel.load_button.isEnabled()
    assert not window.open_action.isEnabled() and not window.recent_menu.isEnabled() and window.budget_panel.busy
    assert not window.scenarios.bar.run_button.isEnabled()
    assert window.unload_action.isEnabled() and window.stop_action.text() == "&Stop the answer"
    gate.set()
    qtbot.waitUntil(lambda: not window.busy and bool(window.chat.entries[-1].get("stats")), timeout=WAIT)
    assert window.chat.entries[-1]["result"]["finish_reason"] == "length"
    assert window.load_action.isEnabled() and window.open_action.isEnabled() and not window.budget_panel.busy


def test_a_load_stopped_before_the_window_hears_it_began_keeps_the_loaded_model(qtbot, window):
    """Stop of a load the worker had begun, before the window heard so (busyChanged is queued), reached the worker
    only once the window heard: by then the worker had dropped the loaded model. Stop now reaches it at once, and the
    load stops before the loaded model goes."""
    load(qtbot, window, fixture_folder("lfm2moe"))
    began, gate, settled = threading.Event(), threading.Event(), load_settled(window)

    def hold_as_it_begins(activity: str) -> None:  # the worker, having begun the load, waits before it opens the folder
        if activity == "loading":
            began.set()
            gate.wait(30)

    window.worker.busyChanged.connect(hold_as_it_begins, Qt.ConnectionType.DirectConnection)
    hold_loads_until_stopped(window)
    window.load_action.trigger()
    assert began.wait(30) and window.busy == ""  # (the window's own slot has not run)
    window.stop_action.trigger()
    gate.set()
    assert settled.wait(30)
    qtbot.waitUntil(lambda: window.load_action.isEnabled(), timeout=WAIT)
    assert window.error_banner.text() == "Loading stopped; lfm2moe stays loaded."
    assert same(window.loaded_path, fixture_folder("lfm2moe")) and window.status_state.text() == "Stopped the load."


def test_stop_of_a_queued_load_reaches_that_load_alone_not_what_runs_ahead_of_it(qtbot, window):
    """Stop of a load queued behind what the worker ran set the worker's stop flag, which stops whatever runs: what ran
    ahead of the load was stopped with it (harmless only while the window queues no load behind an answer or records
    job). The stop now reaches the load alone, by its number: what runs goes on to its end, and the load, begun after
    it, stops before it reads the folder."""
    load(qtbot, window, fixture_folder("lfm2moe"))
    began, gate, stopped = threading.Event(), threading.Event(), []

    def running() -> None:  # as an answer or a records job: clears the flag as it begins, and ends where it is set
        window.worker.cancel.clear()
        began.set()
        gate.wait(30)
        stopped.append(window.worker.cancel.is_set())

    QTimer.singleShot(0, window.worker, running)
    assert began.wait(30)
    window.load_action.trigger()
    assert window.stop_action.text() == "&Stop the load"
    window.stop_action.trigger()
    gate.set()
    qtbot.waitUntil(lambda: window.load_action.isEnabled(), timeout=WAIT)
    assert stopped == [False]
    assert window.error_banner.text() == "Loading stopped; lfm2moe stays loaded."
    assert same(window.loaded_path, fixture_folder("lfm2moe")) and window.status_state.text() == "Stopped the load."


def test_a_records_job_stopped_while_it_waits_in_the_queue_is_not_run(qtbot, window):
    """A records job sent to the worker behind what it ran, stopped (its view's Cancel, or Esc) before it began, was
    stopped only once the window heard it begin: it began all the same (Record's first answer, a sweep's first
    re-plan), the view saying "Cancelling…" until then. The worker now drops it from its queue, and the view and the
    status bar say it was stopped while queued."""
    load(qtbot, window, fixture_folder("lfm2moe"))
    began = []
    window.worker.busyChanged.connect(began.append, Qt.ConnectionType.DirectConnection)
    window.side_by_side.prompt.setPlainText("Hello")
    for kind, view, stop in (("recording", window.scenarios, lambda: window.scenarios.bar.cancel_button.click()),
                             ("sweeping", window.sweep, window.stop_action.trigger),
                             ("comparing", window.side_by_side, lambda: window.side_by_side.bar.cancel_button.click())):
        gate = threading.Event()
        QTimer.singleShot(0, window.worker, lambda: gate.wait(30))  # (the job waits behind what the worker runs)
        view.bar.run_button.click()
        assert window._waiting == kind and view.bar.cancel_button.isEnabled()
        stop()
        what = STOPPABLE[kind]
        assert window.status_state.text() == f"Stopping {what}…" and not window.worker.cancel.is_set()
        gate.set()
        qtbot.waitUntil(lambda: not (window.busy or window._waiting), timeout=WAIT)
        assert view.bar.status.text() == "Cancelled while queued: nothing ran, nothing saved.", kind
        assert window.status_state.text() == f"Stopped {what} while queued: nothing ran."
        assert view.bar.run_button.isEnabled() and not view.bar.cancel_button.isEnabled()
    assert began == []  # (the worker began none of them)
    assert [column.answer.toPlainText() for column in (window.side_by_side.left, window.side_by_side.right)] == [
        "Not started: the comparison was stopped before A began.",
        "Not started: the comparison was stopped before B began."]
    window.scenarios.bar.run_button.click()  # the next job runs
    qtbot.waitUntil(lambda: not (window.busy or window._waiting), timeout=WAIT)
    assert began == ["recording", ""] and window.scenarios.result.saved


def test_stop_of_a_records_job_the_window_has_not_seen_begin_reaches_that_job_alone(qtbot, window):
    """A records job the worker had begun, stopped before the window heard so, was stopped by the worker's stop flag
    once the window heard it begin: where the job had ended by then, the flag stopped whatever the worker ran next. The
    stop now reaches the job alone, by its number: the job ends at its first stop point, and what runs next is not
    stopped."""
    load(qtbot, window, fixture_folder("lfm2moe"))
    began, gate, ran, heard, stopped = threading.Event(), threading.Event(), threading.Event(), threading.Event(), []

    def hold_as_it_begins(activity: str) -> None:  # the worker, having begun the job, waits before it runs it
        if activity == "recording":
            began.set()
            gate.wait(30)

    def next_one() -> None:  # what the worker runs after the job: clears the flag as it begins, ends where it is set
        window.worker.cancel.clear()
        ran.set()
        heard.wait(30)
        stopped.append(window.worker.cancel.is_set())

    window.worker.busyChanged.connect(hold_as_it_begins, Qt.ConnectionType.DirectConnection)
    window.scenarios.bar.run_button.click()
    assert began.wait(30) and window.busy == ""  # (the window's own slot has not run)
    window.scenarios.bar.cancel_button.click()
    QTimer.singleShot(0, window.worker, next_one)
    gate.set()
    assert ran.wait(WAIT / 1000)  # the job has ended, before the window hears it began
    qtbot.waitUntil(lambda: not (window.busy or window._waiting), timeout=WAIT)
    heard.set()
    qtbot.waitUntil(lambda: bool(stopped), timeout=WAIT)
    assert stopped == [False]
    assert window.scenarios.bar.status.text() == "Cancelled before the first run began; nothing saved."
    assert window.scenarios.result.saved == [] and window.status_state.text() == "Stopped the scenario runs."


def test_open_recent_is_off_while_open_is(qtbot, window):
    """File > Open recent stayed on while the window was busy, Open off: a folder chosen from it then was opened
    after what ran (the load), over the folder that load had just shown. It is on where Open is."""
    window.open_model(str(fixture_folder("gptoss")))
    qtbot.waitUntil(lambda: window.facts is not None and not window.busy, timeout=WAIT)
    assert window.recent_menu.isEnabled() and window.open_action.isEnabled()
    hold_loads_until_stopped(window)
    window.load_model(str(fixture_folder("lfm2moe")))
    assert not window.open_action.isEnabled() and not window.recent_menu.isEnabled()
    # the load's folder, inspected as it loads, joins the recent list: the menu stays off
    qtbot.waitUntil(lambda: window.busy == "loading" and window.facts.name == "lfm2moe", timeout=WAIT)
    assert len(window.recent_menu.actions()) == 2 and not window.recent_menu.isEnabled()
    assert not window.model_panel.recent_button.isEnabled()
    window.stop_action.trigger()
    qtbot.waitUntil(lambda: not window.busy, timeout=WAIT)
    assert window.recent_menu.isEnabled() and window.open_action.isEnabled()


def test_load_right_after_open_loads_the_folder_opened(qtbot, window):
    """Between Open and the worker inspecting the folder, Load stayed on for the folder shown before: Open then Ctrl+L
    loaded that one, and the window showed it again in place of the one opened. Load now waits for the opening."""
    window.open_model(str(fixture_folder("lfm2moe")))
    qtbot.waitUntil(lambda: window.load_action.isEnabled(), timeout=WAIT)
    window.open_model(str(fixture_folder("gptoss")))
    assert not window.load_action.isEnabled() and not window.model_panel.load_button.isEnabled()
    window.load_action.trigger()
    qtbot.waitUntil(lambda: window.load_action.isEnabled() and window.facts.name == "gptoss", timeout=WAIT)
    window.load_action.trigger()
    qtbot.waitUntil(lambda: window.loaded_path is not None and not window.busy, timeout=WAIT)
    assert same(window.loaded_path, fixture_folder("gptoss")) and window.windowTitle() == "gptoss — MoE Workbench"


def test_a_load_stopped_while_it_runs_says_so_in_the_status_bar(qtbot, window):
    """The failed load's `unloaded` wrote Idle over "Stopping the load…", so the status bar never said the load was
    stopped, as it says of everything else Stop stops."""
    window.open_model(str(fixture_folder("lfm2moe")))
    qtbot.waitUntil(lambda: window.load_action.isEnabled(), timeout=WAIT)
    hold_loads_until_stopped(window)
    window.load_action.trigger()
    qtbot.waitUntil(lambda: window.busy == "loading", timeout=WAIT)
    window.model_panel.cancel_button.click()
    assert window.status_state.text() == "Stopping the load…"
    qtbot.waitUntil(lambda: not window.busy, timeout=WAIT)
    assert window.status_state.text() == "Stopped the load." and window.loaded_path is None


def test_stop_does_what_it_says_in_every_busy_state_and_says_what_it_stopped(qtbot, window):
    """The chat's Stop stops the chat's answer only: it is off while a records job runs in another tab (it stopped that
    job) and while nothing can be stopped (opening a folder, preparing the kernels, re-planning: Stop did nothing
    there). Esc and Chat ▸ Stop name what they stop, and the status bar says what was stopped."""
    cancel = window.worker.cancel
    for activity in ("opening", "preparing", "replanning", "sweeping", "comparing", "recording", "contention"):
        window._on_busy(activity)
        assert not window.chat.stop_button.isEnabled(), activity
        window.chat.stop_button.click()
        assert not cancel.is_set(), activity
    for activity in ("opening", "preparing", "replanning"):
        window._on_busy(activity)
        assert not window.stop_action.isEnabled(), activity
        window.stop()
        assert not cancel.is_set(), activity
    window._on_busy("")
    for activity, what in (("generating", "the answer"), ("loading", "the load"), ("sweeping", "the budget sweep"),
                           ("comparing", "the side-by-side comparison"), ("recording", "the scenario runs"),
                           ("contention", "the contention test")):
        window._on_busy(activity)
        assert window.chat.stop_button.isEnabled() == (activity == "generating"), activity
        assert window.stop_action.isEnabled() and window.stop_action.text().replace("&", "") == f"Stop {what}"
        window.stop_action.trigger()
        assert cancel.is_set() and window.status_state.text() == f"Stopping {what}…"
        cancel.clear()
        window._on_busy("")
        assert window.status_state.text() == f"Stopped {what}."
    window._on_busy("sweeping")
    window.cancel_job("sweeping")  # the view's own Cancel
    assert cancel.is_set() and window.status_state.text() == "Stopping the budget sweep…"
    cancel.clear()
    window._on_busy("")


def test_new_chat_leaves_no_regenerate_or_copy_on_and_no_answers_statistics_under_the_empty_transcript(qtbot, window):
    """New chat cleared the transcript but left Regenerate and Copy on, which then did nothing, and the status line
    under the empty transcript kept the last answer's statistics."""
    load(qtbot, window, fixture_folder("lfm2moe"))
    ask(qtbot, window, "Hello", 3)
    chat = window.chat
    assert chat.regenerate_button.isEnabled() and chat.copy_button.isEnabled()
    chat.new_button.click()
    assert chat.entries == [] and chat.live.text() == "New conversation."
    assert not chat.regenerate_button.isEnabled() and not chat.copy_button.isEnabled()
    assert chat.send_button.isEnabled() and chat.new_button.isEnabled()
    qtbot.waitUntil(lambda: window.worker._conversation.messages == [], timeout=WAIT)


def test_the_chat_menus_actions_are_on_only_where_they_can_act_on_the_tab_shown(qtbot, window):
    """Chat ▸ Send, Regenerate, New chat and Copy last answer were always on: with no model loaded, while an answer
    ran, or with no answer to regenerate or copy, choosing one did nothing. They follow the chat's buttons now, and on
    the Side by side tab Send and Regenerate follow its Answer both."""
    actions = (window.send_action, window.regenerate_action, window.new_chat_action, window.copy_action)
    assert [action.isEnabled() for action in actions] == [False, False, False, False]
    load(qtbot, window, fixture_folder("lfm2moe"))
    assert [action.isEnabled() for action in actions] == [True, False, True, False]
    window.chat.max_tokens.setValue(2000)
    window.chat.prompt.setPlainText("A long story")
    window.chat.send()
    assert [action.isEnabled() for action in actions] == [False, False, False, False]
    qtbot.waitUntil(lambda: window.busy == "generating", timeout=WAIT)
    assert [action.isEnabled() for action in actions] == [False, False, False, False]
    window.stop()
    qtbot.waitUntil(lambda: not window.busy and bool(window.chat.entries[-1].get("stats")), timeout=WAIT)
    assert [action.isEnabled() for action in actions] == [True, True, True, True]
    window.chat.new_button.click()
    assert [action.isEnabled() for action in actions] == [True, False, True, False]
    window.tabs.setCurrentWidget(window.side_by_side_page)
    assert [action.isEnabled() for action in actions] == [True, True, True, False]  # Answer both, twice
    window.unload()
    qtbot.waitUntil(lambda: window.loaded_path is None and not window.busy, timeout=WAIT)
    assert [action.isEnabled() for action in actions] == [False, False, False, False]
    window.tabs.setCurrentWidget(window.chat)
    assert [action.isEnabled() for action in actions] == [False, False, False, False]


def test_opening_another_folder_says_which_model_stays_loaded_and_unload_clears_the_chat(qtbot, window):
    loaded = fixture_folder("lfm2moe")
    load(qtbot, window, loaded)
    window.open_model(str(fixture_folder("gptoss")))  # inspected, not loaded
    qtbot.waitUntil(lambda: window.facts is not None and window.facts.name == "gptoss" and not window.busy,
                    timeout=WAIT)
    assert same(window.loaded_path, loaded)
    assert window.windowTitle() == "gptoss (not loaded; lfm2moe is) — MoE Workbench"
    landed = window.model_panel.landed.text()
    assert "Not loaded. <b>lfm2moe</b> is the loaded model" in landed and "Load to switch" in landed
    assert window.model_panel.unload_button.toolTip() == "Stop what runs and free lfm2moe  Ctrl+U"
    assert window.model_panel.load_button.text() == "Load"
    load(qtbot, window, fixture_folder("gptoss"))
    assert window.windowTitle() == "gptoss — MoE Workbench"
    assert window.model_panel.unload_button.toolTip() == "Stop what runs and free gptoss  Ctrl+U"
    window.unload()
    qtbot.waitUntil(lambda: window.loaded_path is None and not window.busy, timeout=WAIT)
    assert window.model_panel.landed.text() == "Not loaded."
    assert window.chat.live.text() == "No model loaded: load one to chat." and window.status_state.text() == "Idle"


def test_opening_the_loaded_model_again_keeps_its_budgets_applied_and_apply_at_hand(qtbot, window):
    """The loaded model opened again (another folder shown meanwhile, then Open recent of it) showed its budgets as
    "Used at the next load", and Apply stayed off after an edit: the panel no longer knew the model was loaded."""
    loaded = fixture_folder("gptoss")
    load(qtbot, window, loaded, simulated())
    budget = window.budget_panel
    in_force = budget.settings()
    for shown in (fixture_folder("lfm2moe"), loaded):
        window.open_model(str(shown))
        qtbot.waitUntil(lambda s=shown: same(window.facts.path, s) and not window.busy, timeout=WAIT)
    assert same(window.loaded_path, loaded) and window.windowTitle() == "gptoss — MoE Workbench"
    assert budget.loaded and budget.settings() == in_force and not budget.dirty()
    assert budget.applied_label.text() == "Applied to the loaded model" and not budget.apply_button.isEnabled()
    budget.expert_bytes.setValue(6 * slot())
    budget.expert_bytes.valueChanged.emit(budget.expert_bytes.value())
    qtbot.waitUntil(budget.apply_button.isEnabled)
    budget.apply_button.click()
    qtbot.waitUntil(lambda: not window.busy and budget.applied == budget.settings() != in_force, timeout=WAIT)
    assert window.worker._model.offload.config.device_expert_bytes == 6 * slot()
    assert window.model_settings(str(loaded)) == budget.applied


def test_where_the_loaded_model_landed_is_shown_with_it_not_over_another_folder_shown(qtbot, window):
    """With another folder shown, news of where the loaded model's experts went (a trial's outcome) replaced that
    folder's "Not loaded" line; and the loaded model opened again kept saying "Not loaded", though it was."""
    loaded = fixture_folder("gptoss")
    load(qtbot, window, loaded)
    landed = window.model_panel.landed
    window.open_model(str(fixture_folder("lfm2moe")))
    qtbot.waitUntil(lambda: window.facts.name == "lfm2moe" and not window.busy, timeout=WAIT)
    window.worker.landedChanged.emit(["Decode: whole layers measured faster"])
    assert landed.text().startswith("Not loaded. <b>gptoss</b> is the loaded model")
    window.open_model(str(loaded))
    qtbot.waitUntil(lambda: window.facts.name == "gptoss" and not window.busy, timeout=WAIT)
    assert landed.text() == "<ul style='margin-left:-20px'><li>Decode: whole layers measured faster</li></ul>"


def test_the_engines_own_replan_of_the_loaded_model_leaves_the_budgets_of_another_folder_shown_alone(qtbot, window):
    """With another folder shown, the engine's own re-plan of the loaded model (a layer split trial's outcome, while
    the chat answers) marked the Budgets panel, showing the other folder, as loaded with the loaded model's settings:
    it said them applied, and Apply then put the shown folder's budgets on the loaded model and kept them for it."""
    loaded = fixture_folder("gptoss")
    load(qtbot, window, loaded, simulated())
    kept = window.model_settings(str(loaded))
    window.open_model(str(fixture_folder("lfm2moe")))
    qtbot.waitUntil(lambda: window.facts.name == "lfm2moe" and not window.busy, timeout=WAIT)
    budget = window.budget_panel
    window.worker.replanned.emit({"statements": [], "landed": ["Measured faster"],
                                  "by_engine": "Measured faster: the expert budget now holds whole layers"})
    assert not budget.loaded and budget.applied is None and budget.applied_label.text() == "Used at the next load"
    budget.expert_bytes.setValue(1 << 20)
    budget.expert_bytes.valueChanged.emit(budget.expert_bytes.value())
    qtbot.wait(50)
    assert not budget.apply_button.isEnabled() and window.model_settings(str(loaded)) == kept


def test_the_window_fits_a_laptop_screen_and_long_status_lines_end_in_an_ellipsis(qtbot, window):
    # 1366 x 768 less a taskbar: the record views and the side-by-side form scroll rather than set the minimum
    # (it was 1226 x 1018 before they did)
    load(qtbot, window, fixture_folder("gptoss"))
    hint = window.minimumSizeHint()
    assert hint.width() <= 1280 and hint.height() <= 700, hint
    window.resize(1280, 720)
    qtbot.waitUntil(lambda: window.size().height() == 720)
    live = window.chat.live
    text = "first token 52 ms · 372.2 tok/s · 0.50 s · 120 tokens · " + "projected on the simulated card " * 8
    live.setText(text)
    shown = QLabel.text(live)
    assert live.text() == live.toolTip() == text and shown.endswith("…") and len(shown) < len(text)


def test_the_chats_status_line_shows_whole_in_a_laptop_size_window(qtbot, window):
    """The chat's status line shared its row with Settings, New chat, Copy and Regenerate: in a 1280 x 720 window it
    had ~30 pixels, and read 'Gen…' while an answer streamed, 'fir…' once it ended. It has a row of its own."""
    window.resize(1280, 720)
    qtbot.waitUntil(lambda: window.size().height() == 720)
    live = window.chat.live
    for text in ("Generating… 1024 tokens in 12.50 s", "Stopped before it began: message back in the box.",
                 "first token 52 ms · 372.2 tok/s · 2.50 s · 931 tokens"):
        live.setText(text)
        assert QLabel.text(live) == text


def test_the_graphs_status_line_fits_their_dock_in_a_laptop_size_window(qtbot, window):
    """The live graphs' status line (samples, last time, paused, the markers' legend) was wider than the dock of a
    1280 x 720 window: cut off at the right, the legend's 'error' and part of 'answer' gone. It is shorter and fits,
    or ends in an ellipsis, its tooltip saying it in words; the legend, apart, shows whole."""
    from PySide6.QtGui import QTextDocument

    window.resize(1280, 720)
    qtbot.waitUntil(lambda: window.size().height() == 720)
    graphs = window.graphs
    qtbot.waitUntil(lambda: graphs.sample_count > 0, timeout=WAIT)
    sample = graphs.samples[-1]
    for index in range(600):  # ten minutes of samples: the longest count
        graphs.add_sample(dict(sample, t=sample["t"] + 1 + index))
    graphs.set_paused(True)

    def shown(label) -> str:
        document = QTextDocument()
        document.setHtml(QLabel.text(label))
        return document.toPlainText()

    status = graphs.status
    assert f"{graphs.sample_count} samples" in status.text() and "paused" in status.text()
    fits = status.fontMetrics().horizontalAdvance(shown(status)) <= status.contentsRect().width()
    assert fits and (shown(status) == status.text() or shown(status).endswith("…"))
    assert status.toolTip().startswith(f"{graphs.sample_count} samples kept (the last 10 minutes), the last taken at ")
    assert status.toolTip().endswith("; paused: the graphs stay as they are, sampling goes on")
    legend = graphs.legend
    assert shown(legend).split() == ["┆", "load", "┆", "answer", "┆", "error"]
    assert legend.fontMetrics().horizontalAdvance(shown(legend)) <= legend.contentsRect().width()


def test_unloading_waits_for_the_gpus_queued_work_and_survives_a_gpu_error(qtbot, window):
    """The worker waits for the device (CudaDevice.quiesce: placement's last copies into the slots) before it lets
    the model go; a GPU in an error state is reported in one line and the model is unloaded all the same."""
    path = fixture_folder("gptoss")
    load(qtbot, window, path, simulated())
    worker, waited = window.worker, []
    worker._device.quiesce = lambda: waited.append(worker._model is not None)
    window.unload()
    qtbot.waitUntil(lambda: window.loaded_path is None and not window.busy, timeout=WAIT)
    assert waited == [True]  # waited for while the model still held its slots
    load(qtbot, window, path, simulated())

    def broken():
        raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered")

    worker._device.quiesce = broken
    window.unload()
    qtbot.waitUntil(lambda: window.loaded_path is None and not window.busy, timeout=WAIT)
    assert "an illegal memory access was encountered" in window.error_banner.text()
    assert worker._model is None and window.model_panel.landed.text() == "Not loaded."


def test_garbage_is_collected_on_the_windows_thread_while_it_lives(qtbot, tmp_path):
    """No automatic collection while a window lives (one on the engine's thread would destroy a closed window's
    widgets there); its timer collects on the GUI thread instead, and automatic collection is back once it closes."""
    import gc
    import threading
    import weakref

    win = make_window(qtbot, tmp_path)
    try:
        assert not gc.isenabled()
        threads = []

        class Cycle:
            def __init__(self):
                self.me = self

            def __del__(self):
                threads.append(threading.current_thread())

        garbage = weakref.ref(Cycle())
        # generation 0's count past its threshold. It counts allocations less deallocations, and a closed window's
        # objects freed meanwhile (an earlier test's) took it back below: so allocate at every look until it collects
        kept = []
        qtbot.waitUntil(lambda: kept.append([[] for _ in range(1000)]) or garbage() is None, timeout=5000)
        del kept
        assert threads == [threading.main_thread()]
    finally:
        win.close()
    assert gc.isenabled()


def test_the_collector_picks_the_generation_automatic_collection_would():
    assert due_generation((701, 3, 2), (700, 10, 10)) == 0
    assert due_generation((701, 11, 2), (700, 10, 10)) == 1
    assert due_generation((701, 11, 11), (700, 10, 10)) == 2
    assert due_generation((700, 11, 11), (700, 10, 10)) is None  # generation 0 not due: none is


@pytest.mark.usefixtures("own_samples_only")
def test_contention_banner_names_the_processes(qtbot, window):
    window._on_busy("generating")
    sample = {"t": 1.0, "wall": 0.0, "cpu_per_core": [90.0, 95.0], "cpu_total": 92.0, "others_cpu_cores": 1.2,
              "top_cpu": [{"pid": 7, "name": "baloo_file", "cores": 1.1, "rss": 1 << 30}], "top_ram": [],
              "ram_total": 16 << 30, "ram_available": 8 << 30, "ram_this": 1 << 30, "ram_others": 7 << 30,
              "gpu": None, "gpu_note": "no NVIDIA GPU"}
    window._on_sample(sample)
    window._on_sample(sample)  # (a warning is said at its second sample of three)
    assert window.contention_banner.isVisible() and "baloo_file" in window.contention_banner.text()
    for rate in (1e9, 10e9, 11e9, 10e9, 9e9, 10e9, 4e9, 4e9, 4e9, 4e9):
        window.watch.add(rate)
    window._on_sample(dict(sample, others_cpu_cores=0.0, top_cpu=[]))
    assert not window.watch.warning()  # four slow readings are not enough
    window.watch.add(4e9)
    window._on_sample(dict(sample, others_cpu_cores=0.0, top_cpu=[]))
    assert "fell to 4.00 GB/s from its usual 10.00 GB/s" in window.contention_banner.text()
    window._on_sample(sample)  # baloo_file back on the cores: it, not memory bandwidth, is what the drop is put to
    assert "(40%) as other processes or guests take its CPUs' time." in window.contention_banner.text()
    assert "memory bandwidth" not in window.contention_banner.text()
    for rate in (10e9,) * 5:  # the CPU's throughput back, the other processes quiet: the banner goes
        window.watch.add(rate)
    for _ in range(CALM_SAMPLES):
        window._on_sample(dict(sample, others_cpu_cores=0.0, top_cpu=[]))
    assert not window.contention_banner.isVisible()
    window._on_busy("")


@pytest.mark.usefixtures("own_samples_only")
def test_a_competitor_at_the_threshold_keeps_the_banner_up_instead_of_blinking_it(qtbot, window):
    """A build between its compile jobs takes 1.1 cores one second and 0.3 the next: the banner came and went every
    second (and the chat under it moved each time). A warning raised stays until several samples in a row are calm."""
    window._on_busy("generating")
    sample = {"t": 1.0, "wall": 0.0, "cpu_per_core": [90.0, 95.0], "cpu_total": 92.0, "others_cpu_cores": 1.1,
              "top_cpu": [{"pid": 7, "name": "cc1plus", "cores": 1.0, "rss": 1 << 28}], "top_ram": [],
              "ram_total": 16 << 30, "ram_available": 8 << 30, "ram_this": 1 << 30, "ram_others": 7 << 30,
              "gpu": None, "gpu_note": "no NVIDIA GPU"}
    calm = dict(sample, others_cpu_cores=0.3, top_cpu=[])
    seen = []
    for others in (sample, calm, sample, calm, calm, sample, calm):
        window._on_sample(others)
        seen.append(window.contention_banner.isVisible())
    assert seen == [False, False] + [True] * 5 and "cc1plus" in window.contention_banner.text()
    for _ in range(CALM_SAMPLES - 1):
        window._on_sample(calm)
    assert not window.contention_banner.isVisible()  # calm for CALM_SAMPLES samples in a row: it goes
    window._on_sample(sample)
    window._on_busy("")
    window._on_busy("generating")  # a new answer starts with no banner, and a calm first sample raises none
    window._on_sample(calm)
    assert not window.contention_banner.isVisible()
    window._on_busy("")
    window._on_sample(sample)  # between answers: the build busy before the next answer is said at its first sample
    window._on_busy("generating")
    window._on_sample(sample)
    assert window.contention_banner.isVisible() and "cc1plus" in window.contention_banner.text()
    window._on_busy("")


@pytest.mark.usefixtures("own_samples_only")
def test_a_warning_at_its_threshold_is_held_beside_another_that_stays(qtbot, window):
    """Host memory nearly full throughout, a build hovering at the CPU threshold: the banner stayed up, but its text
    lost and regained the build every second (the hold kept only the whole list, replaced by each sample's). Each
    kind of warning is held on its own."""
    window._on_busy("generating")
    full = {"t": 1.0, "wall": 0.0, "cpu_per_core": [90.0, 95.0], "cpu_total": 92.0, "others_cpu_cores": 0.3,
            "top_cpu": [], "top_ram": [], "ram_total": 16 << 30, "ram_available": 1 << 30, "ram_this": 14 << 30,
            "ram_others": 1 << 30, "gpu": None, "gpu_note": "no NVIDIA GPU"}
    busy = dict(full, others_cpu_cores=1.1, top_cpu=[{"pid": 7, "name": "cc1plus", "cores": 1.0, "rss": 1 << 28}])
    texts = []
    for sample in (busy, busy, full, busy, full, full):
        window._on_sample(sample)
        texts.append(window.contention_banner.text())
    assert all("cc1plus (1.0 cores, 256.0 MiB resident)" in text and "Host memory is nearly full" in text
               for text in texts[1:]), texts
    window._on_sample(full)  # calm for CALM_SAMPLES samples in a row: the build's warning goes, host memory's stays
    assert "cc1plus" not in window.contention_banner.text()
    assert "Host memory is nearly full" in window.contention_banner.text()
    window._on_busy("")


def test_the_contention_banner_states_when_it_warns(qtbot, window):
    """'Other processes use 0.6 of 2 CPU cores' said nothing of why 0.6 was worth a warning, or what would be."""
    assert window.contention_banner.toolTip() == (
        "Said while the model generates, where other processes use at least 20% of this process's CPU cores (and half "
        "a core), a virtual machine's host gives other guests at least 10% of its CPU time, less than 10% of host "
        "memory is available, other processes hold at least 10% of the memory of the GPU the model runs on (as NVML "
        "counts each process's: the driver's own reservations are none's, processes that only draw the screen are "
        "left out, and memory the driver does not say whose is not counted), or the CPU experts' "
        "throughput falls below 50% of its usual rate (the upper quartile of its last 10 minutes in decode since the "
        "load or the last Apply). Each is said once 2 of 3 samples in a row show it, and goes after 3 calm samples in "
        "a row; ✕ keeps it down until then.")


@pytest.mark.usefixtures("own_samples_only")
def test_the_throughput_still_low_just_after_a_competitor_ends_is_not_blamed_on_memory_bandwidth(qtbot, window):
    """The kernels' rate lags the CPU graph (a median of 1.25 s of readings, the automatic thread count coming back
    after a second): the sample after a build ended was calm while the rate was still low, and the banner added
    'something competes for memory bandwidth', a cause that was never there, for the seconds the CPU warning stayed."""
    window._on_busy("generating")
    calm = {"t": 1.0, "wall": 0.0, "cpu_per_core": [90.0, 95.0], "cpu_total": 92.0, "others_cpu_cores": 0.0,
            "top_cpu": [], "top_ram": [], "ram_total": 16 << 30, "ram_available": 8 << 30, "ram_this": 1 << 30,
            "ram_others": 7 << 30, "gpu": None, "gpu_note": "no NVIDIA GPU"}
    busy = dict(calm, others_cpu_cores=1.1, top_cpu=[{"pid": 7, "name": "cc1plus", "cores": 1.0, "rss": 1 << 28}])
    for rate in (1,) + (10,) * 10:
        window.watch.add(rate * 1e9)
    window._on_sample(busy)
    for rate in (4,) * 5:  # the build on the kernels' cores
        window.watch.add(rate * 1e9)
    window._on_sample(busy)
    window._on_sample(calm)  # the build has ended; the rate has not caught up yet
    assert "cc1plus" in window.contention_banner.text()
    assert "memory bandwidth" not in window.contention_banner.text(), window.contention_banner.text()
    assert "as other processes or guests take its CPUs' time" in window.contention_banner.text()
    for _ in range(CALM_SAMPLES):  # long after the build, the rate still low: now something else is the cause
        window._on_sample(calm)
    assert "something competes for memory bandwidth" in window.contention_banner.text()
    window._on_busy("")


@pytest.mark.usefixtures("own_samples_only")
def test_a_throughput_drop_while_the_thread_count_gives_way_is_not_blamed_on_memory_bandwidth(qtbot, window):
    """Other processes at 0.45 of 2 cores, just under the banner's threshold, had the automatic count on 1 of the 2
    threads; the kernels' rate halved with it, and the banner put that to 'something competes for memory bandwidth'."""
    import numpy as np

    window._on_busy("generating")
    quiet = {"t": 1.0, "wall": 0.0, "cpu_per_core": [90.0, 95.0], "cpu_total": 92.0, "others_cpu_cores": 0.45,
             "top_cpu": [], "top_ram": [], "ram_total": 16 << 30, "ram_available": 8 << 30, "ram_this": 1 << 30,
             "ram_others": 7 << 30, "gpu": None, "gpu_note": "no NVIDIA GPU"}
    for rate in (1,) + (10,) * 10 + (4,) * 5:
        window.watch.add(rate * 1e9)
    threads = {"cpu_threads_in_force": 1, "cpu_threads_automatic": True, "cores": 2, "others_busy_cores": 0.6,
               "cpu_threads_changes": 1}
    window._on_stats({"resident": np.array([[True, False]]), "traffic": np.ones((1, 2)),
                      "valid": np.ones((1, 2), bool), "placement": "adaptive", "layer_names": ["a/QMoE"],
                      "layer_index": [0], "bytes_per_expert": [1024], "layers": [{"hits": 3, "misses": 1, "swaps": 0}],
                      "slots": [1], "copies": {"cpu_threads": threads}, "cpu_expert_rate": 0.0})
    window._on_sample(quiet)
    assert "memory bandwidth" not in window.contention_banner.text(), window.contention_banner.text()
    assert "fell to 4.00 GB/s from its usual 10.00 GB/s" in window.contention_banner.text()
    window._on_busy("")


@pytest.mark.usefixtures("own_samples_only")
def test_a_dismissed_contention_warning_stays_down_until_it_ends_or_another_comes(qtbot, window):
    """The banner's ✕ hid it for under a second: the next sample, with the same build still running, showed it again,
    and every second after."""
    window._on_busy("generating")
    calm = {"t": 1.0, "wall": 0.0, "cpu_per_core": [90.0, 95.0], "cpu_total": 92.0, "others_cpu_cores": 0.3,
            "top_cpu": [], "top_ram": [], "ram_total": 16 << 30, "ram_available": 8 << 30, "ram_this": 1 << 30,
            "ram_others": 7 << 30, "gpu": None, "gpu_note": "no NVIDIA GPU"}
    busy = dict(calm, others_cpu_cores=1.1, top_cpu=[{"pid": 7, "name": "cc1plus", "cores": 1.0, "rss": 1 << 28}])
    window._on_sample(busy)
    window._on_sample(busy)
    qtbot.mouseClick(window.contention_banner.close_button, Qt.MouseButton.LeftButton)
    for _ in range(3):
        window._on_sample(busy)
        assert not window.contention_banner.isVisible()
    full = dict(busy, ram_available=1 << 30, ram_this=14 << 30, ram_others=1 << 30)
    window._on_sample(full)
    window._on_sample(full)  # a new kind of problem is said, the dismissed one not again
    assert window.contention_banner.isVisible() and "cc1plus" not in window.contention_banner.text()
    assert "Host memory is nearly full" in window.contention_banner.text()
    for _ in range(CALM_SAMPLES):
        window._on_sample(calm)
    window._on_sample(busy)
    window._on_sample(busy)  # the build ended (calm long enough) and a new one began: said again
    assert "cc1plus" in window.contention_banner.text()
    window._on_busy("")


def test_other_processes_vram_is_not_blamed_while_the_model_runs_without_the_gpu(qtbot, window):
    """A model on the CPU (or a simulated GPU) uses no memory of the real card: the banner said 'Other processes hold
    20.0 GiB of the GPU's 80.0 GiB: blender (20.0 GiB)' while it generated, a competitor that took nothing from it."""
    gpu = {"name": "NVIDIA Test GPU", "total": 80 << 30, "used": 20 << 30, "free": 60 << 30, "this": 0,
           "others": 20 << 30, "listed": 20 << 30, "util": 30.0, "per_process": True,
           "top": [{"pid": 7, "name": "blender", "bytes": 20 << 30}]}
    sample = {"t": 1.0, "wall": 0.0, "cpu_per_core": [50.0, 50.0], "cpu_total": 50.0, "others_cpu_cores": 0.0,
              "top_cpu": [], "top_ram": [], "ram_total": 16 << 30, "ram_available": 8 << 30, "ram_this": 1 << 30,
              "ram_others": 7 << 30, "gpu": gpu, "gpu_note": ""}
    for settings in ({"device": {"kind": "cpu"}, "entries": {}}, simulated()):
        load(qtbot, window, fixture_folder("gptoss"), settings)
        window._on_busy("generating")
        window._on_sample(sample)
        assert not window.contention_banner.isVisible(), window.contention_banner.text()
        window._on_busy("")
    window.model_on_gpu = True  # as a model loaded on the CUDA device: the card's competitors count
    window._on_busy("generating")
    window._on_sample(sample)
    window._on_sample(sample)
    assert "blender (20.0 GiB)" in window.contention_banner.text()
    window._on_busy("")


def test_a_model_loaded_without_file_backing_keeps_its_settings_open_to_change(qtbot, window, monkeypatch):
    """Its experts are in RAM already: the estimate does not ask the host for them again (with less available than
    their size it refused every setting, Apply disabled, while the model ran with them)."""
    import psutil

    path = fixture_folder("gptoss")
    load(qtbot, window, path, {"device": {"kind": "cpu"}, "entries": {"allow_file_backing": "0"}})
    assert same(window.loaded_path, path)
    budget = window.budget_panel
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": 1000}))
    budget.refresh()
    assert not budget.last_estimate.error


@pytest.mark.usefixtures("own_samples_only")
def test_a_replan_starts_the_cpu_throughput_watch_again(qtbot, window):
    """A larger expert budget leaves the CPU fewer experts a call, whose bytes a second fall with the call's fixed
    cost (9 GB/s at no budget, 1-4 GB/s at 75% on the dev VM's 8-layer model): measured against the start under
    the old plan, that read as something competing for memory bandwidth."""
    window._on_busy("generating")
    sample = {"t": 1.0, "wall": 0.0, "cpu_per_core": [50.0, 50.0], "cpu_total": 50.0, "others_cpu_cores": 0.0,
              "top_cpu": [], "top_ram": [], "ram_total": 16 << 30, "ram_available": 8 << 30, "ram_this": 1 << 30,
              "ram_others": 7 << 30, "gpu": None, "gpu_note": "no NVIDIA GPU"}
    for rate in (9e9,) * 6:
        window.watch.add(rate)
    window._on_replanned({"landed": ["re-planned"], "statements": []})
    for rate in (3e9,) * 11:
        window.watch.add(rate)
    window._on_sample(sample)
    assert window.watch.baseline == 3e9 and not window.contention_banner.isVisible()
    window._on_busy("")


def test_the_placement_summary_says_no_cpu_rate_measured_under_another_plan_or_model(qtbot, window):
    """The CPU experts' read rate is measured in decode under one plan of one model: after an Apply or a load it is
    gone until decode measures it again (a CPU-only lfm2moe loaded after gpt-oss said 'CPU experts read 3.4 MiB/s
    in decode', gpt-oss's, before it had decoded a token). So is the CPU throughput watch's level: another model's
    rate is not this one's."""
    placement = window.placement
    for rate in (9e9,) * 7:  # an earlier model's decode
        window.watch.add(rate)
    assert window.watch.baseline == 9e9
    load(qtbot, window, fixture_folder("gptoss"), simulated())
    assert window.watch.baseline == 0.0  # (fewer measurements than a level needs: none yet of this model's)
    qtbot.waitUntil(lambda: placement.updates > 0, timeout=WAIT)
    measured = lambda: placement.set_stats({**placement.heatmap.data, "cpu_expert_rate": 3.5 * 2**20})  # noqa: E731
    measured()
    assert placement.summary.text().endswith(" · CPU experts read 3.5 MiB/s in decode")
    updates = placement.updates
    window.apply_settings({**simulated(), "entries": {"device_expert_bytes": str(4 * slot())}}, reload=False)
    qtbot.waitUntil(lambda: not window.busy and placement.updates > updates, timeout=WAIT)
    assert int(placement.heatmap.data["resident"].sum()) == 4 and "CPU experts read" not in placement.summary.text()
    measured()
    load(qtbot, window, fixture_folder("lfm2moe"), {"device": {"kind": "cpu"}, "entries": {}})
    assert int(placement.heatmap.data["valid"].sum()) == 24  # lfm2moe's stats (the worker sent them before idle)
    assert placement.summary.text() == "All 24 experts run on the CPU"


def test_drop_a_folder_and_demo_model(qtbot, window):
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(fixture_folder("qwen35moe") / "model.onnx"))])
    event = QDropEvent(QPointF(10, 10), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                       Qt.KeyboardModifier.NoModifier)
    window.dropEvent(event)
    qtbot.waitUntil(lambda: window.facts is not None and window.facts.name == "qwen35moe" and not window.busy,
                    timeout=WAIT)
    assert same(window.recent()[0], fixture_folder("qwen35moe"))
    # the demo model is one key away (the window is keyboard driven: every action has a shortcut)
    window.activateWindow()
    qtbot.waitUntil(window.isActiveWindow)
    qtbot.keyClick(window, Qt.Key.Key_D, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: window.loaded_path is not None and "demo" in window.loaded_path and not window.busy,
                    timeout=WAIT)
    assert window.model_panel.badge.isVisible() and "RANDOM" in window.model_panel.badge.text()
    assert "RANDOM weights" in window.status_model.text()


def test_moe_workbench_without_arguments_opens_the_window_on_the_demo(qtbot, tmp_path, monkeypatch):
    from PySide6.QtCore import QEventLoop, QTimer
    from PySide6.QtWidgets import QApplication

    from app.gui.main import run_gui

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # where the demo model gets written
    monkeypatch.setenv("MOE_WORKBENCH_SETTINGS", str(tmp_path / "settings.ini"))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # run_gui installs its own
    app = QApplication.instance()
    names = (app.applicationName(), app.organizationName())
    # run_gui's app.exec() becomes a nested loop: quitting the application itself would leave Qt
    # "closing" and the worker threads of later tests' windows would never run their event loops
    loop = QEventLoop()
    monkeypatch.setattr(app, "exec", loop.exec)
    seen = {}

    def check():
        windows = [w for w in app.topLevelWidgets() if isinstance(w, MainWindow) and w.isVisible()]
        if windows and windows[0].loaded_path and not windows[0].busy:
            seen["path"] = windows[0].loaded_path
            windows[0].close()
            loop.exit(0)

    poll = QTimer(interval=100, timeout=check)
    give_up = QTimer(singleShot=True, interval=60_000, timeout=lambda: loop.exit(1))
    poll.start()
    give_up.start()
    try:
        assert run_gui(None) == 0
    finally:
        poll.stop()
        give_up.stop()
    assert "demo-moe" in seen.get("path", "") and str(tmp_path / "cache") in seen["path"]
    assert app.desktopFileName() == "moe-workbench"
    app.setApplicationName(names[0])
    app.setOrganizationName(names[1])


def test_the_landed_sentence_says_a_fixed_or_the_automatic_thread_count():
    assert threads_sentence(1, 16) == "CPU expert kernels use 1 CPU thread."
    assert threads_sentence(8, 16) == "CPU expert kernels use 8 CPU threads."
    assert threads_sentence(0, 16) == ("CPU expert kernels use all 16 CPU threads, fewer while other processes keep "
                                       "cores busy (cpu_threads automatic).")
    # more than the kernels run on: the count in force, not the one asked for (it said "use 64 CPU threads" on 16)
    assert threads_sentence(64, 16) == ("CPU expert kernels use 16 CPU threads, the most they run on here "
                                        "(cpu_threads=64 asks for more).")


def test_the_summary_says_when_the_automatic_thread_count_left_cores_to_other_processes():
    state = {"cpu_threads_in_force": 6, "cpu_threads_automatic": True, "cores": 8, "others_busy_cores": 2.14}
    assert threads_text(state) == "CPU experts on 6 of 8 threads: other processes keep 2.1 cores busy"
    assert threads_text({**state, "cpu_threads_in_force": 8}) == ""  # every core
    assert threads_text({**state, "cpu_threads_automatic": False}) == ""  # a count the user chose
    assert threads_text({}) == ""  # a record of a version before it


def test_the_copies_line_says_their_later_hits():
    # the slots left to copies are the summary's first part (slots_text), counted per layer
    assert copies_text({"miss_slots": [0, 2, 1], "later_hits_per_copy": 0.934}) == "each copy earning 0.93 later hits"
    assert copies_text({"miss_slots": [1], "later_hits_per_copy": None}) == ""
    assert copies_text({"miss_slots": [0, 0], "later_hits_per_copy": 0.5}) == "each copy earning 0.50 later hits"
    assert copies_text({"placement": {"swaps_paused": False, "net_hits_per_swap": 2.314}}) == \
        "each placement swap earning 2.31 hits"
    assert copies_text({"placement": {"swaps_paused": True, "net_hits_per_swap": 0.046}}) == \
        "placement's swaps paused (a swap earned 0.05 hits lately: routing shows no recency)"
    assert copies_text({"placement": {"swaps_paused": False, "net_hits_per_swap": None}}) == ""
    assert copies_text({}) == ""
    assert copies_text({"miss_slots": [0], "later_hits_per_copy": None, "streaming_slots": [4]}) == \
        "4 streaming slots for layers without slots"
    assert copies_text({"layer_split": {"whole_layers": True, "measured_ms": {"spread": 30.04, "whole": 20.0}}}) == \
        "whole layers on the device (measured 20.0 ms a token against 30.0 ms spread)"
    assert copies_text({"layer_split": {"whole_layers": True, "measured_ms": {}}}) == "whole layers on the device"
    assert copies_text({"layer_split": {"whole_layers": True, "layers_whole": 1, "measured_ms": {}}}) == \
        "whole layers on the device"
    assert copies_text({"layer_split": {"whole_layers": True, "layers_whole": 0, "measured_ms": {}}}) == \
        "whole layers: no layer fits the expert budget"
    assert copies_text({"layer_split": {"whole_layers": False, "measured_ms": {"spread": 20.0, "whole": 30.0}}}) == ""
    assert copies_text({"layer_split": {"whole_layers": True, "measured_ms": {}, "measuring": "whole"}}) == \
        "timing the layer split: whole layers now"
    assert copies_text({"miss_slots": [1], "layer_split": {"whole_layers": False, "measuring": "spread"}}) == \
        "timing the layer split: the budget spread over every layer now"
    assert copies_text({"miss_slots": [2], "cpu_bytes_per_s": 64.2e9, "cpu_call_s": 190e-6}) == \
        "CPU misses priced at 64.2 GB/s + 190 µs a call"
    assert copies_text({"cpu_bytes_per_s": 25e9, "cpu_call_s": 0.0}) == "CPU misses priced at 25.0 GB/s"
    assert copies_text({"cpu_bytes_per_s": None, "cpu_call_s": 0.0}) == ""
    # the rate in force, the measured one beside it where the host's streaming read clamped it (cpu_rate_state)
    assert copies_text({"cpu_bytes_per_s": 40e9, "cpu_measured_bytes_per_s": 400e9, "cpu_call_s": 2e-6}) == \
        "CPU misses priced at 40.0 GB/s + 2.00 µs a call (measured 400.0 GB/s, clamped to the host's streaming read)"
    # with the measured line's own fixed cost: the held line's is made through the calls' mean (6.25 µs where the
    # measured 60 GB/s + 100 µs is held to 40 GB/s), and "+ 6.25 µs a call (measured 60.0 GB/s, ...)" read as a line
    # of 60 GB/s + 6.25 µs, which nobody measured nor priced
    assert copies_text({"cpu_bytes_per_s": 40e9, "cpu_measured_bytes_per_s": 60e9, "cpu_call_s": 6.25e-6,
                        "cpu_measured_call_s": 100e-6}) == (
        "CPU misses priced at 40.0 GB/s + 6.25 µs a call (measured 60.0 GB/s + 100 µs a call, its rate clamped to "
        "the host's streaming read)")
    assert copies_text({"cpu_bytes_per_s": 25e9, "cpu_measured_bytes_per_s": 25e9, "cpu_call_s": 0.0}) == \
        "CPU misses priced at 25.0 GB/s"
    # a rate below 0.05 GB/s (tiny experts, a busy CPU: each call's fixed cost) read "0.0 GB/s", as if free
    assert copies_text({"cpu_bytes_per_s": 32.7e6, "cpu_call_s": 0.0173}) == \
        "CPU misses priced at 32.7 MB/s + 17.3 ms a call"  # (it said "17300 µs": every time as duration_text says it)



def test_the_copies_line_and_the_landed_sentences_say_where_decode_computes_cold_experts():
    from app.gui.engine_worker import path_sentence

    measured = {"tier": 18.04, "cpu": 25.0}
    assert copies_text({"decode_path": {"host_tier": True, "in_force": "tier", "measured_ms": measured}}) == \
        "cold experts read by the GPU from host memory (measured a token: 18.0 ms read by the GPU, 25.0 ms on the CPU)"
    assert copies_text({"decode_path": {"host_tier": True, "in_force": "cpu", "measured_ms": {}}}) == \
        "cold experts computed on the CPU"
    assert copies_text({"decode_path": {"host_tier": True, "in_force": "both", "measured_ms": {}}}) == \
        "cold experts read by the GPU from host memory, a share computed on the CPU at once"
    both = {"host_tier": True, "in_force": "both", "measured_ms": {}, "cold_split": {"cpu_takes": [0, 0, 1, 1, 2]}}
    assert copies_text({"decode_path": both}) == ("cold experts read by the GPU from host memory, a share computed on "
                                                  "the CPU at once (up to 2 of 4 when all are cold)")
    # a pair split by rows with the GPU (kernels/cold_split.py): the CPU's rows of it, of the expert's intermediate
    split = {**both, "cold_split": {"cpu_takes": [0, 0, 1, 1, 2], "split_rows": [0, 0, 0, 0, 2432], "inter_size": 2880}}
    assert copies_text({"decode_path": split}).endswith("(up to 2 and 16% of one more of 4 when all are cold)")
    # a trial of the split against whole pairs (split_share.py: RowSplitTrials)
    timed = {**split["cold_split"], "rows": {"splits": True, "measuring": "a pair split by rows"}}
    assert copies_text({"decode_path": {**split, "cold_split": timed}}).endswith(
        "(up to 2 and 16% of one more of 4 when all are cold, timing a pair split by rows now)")
    both["cold_split"]["host_gap_s"] = 190.4e-6
    assert copies_text({"decode_path": both}).endswith("(up to 2 of 4 when all are cold, after 190 µs of host work a "
                                                       "layer)")
    both["cold_split"]["share"] = {"shift": 0, "measuring": "one fewer"}  # a trial of the CPU's share (split_share)
    assert copies_text({"decode_path": both}).endswith("(up to 2 of 4 when all are cold, timing one pair fewer now, "
                                                       "after 190 µs of host work a layer)")
    both["cold_split"]["share"] = {"shift": -1, "measuring": None}
    assert copies_text({"decode_path": both}).endswith("(up to 2 of 4 when all are cold, one pair fewer than the rates "
                                                       "give, as measured faster, after 190 µs of host work a layer)")
    both["cold_split"]["cpu_bytes_per_s"] = 65.4e9  # the "both" parts' measured rate (OffloadEngine.split_rate)
    assert copies_text({"decode_path": both}).endswith("one pair fewer than the rates give, as measured faster, the "
                                                       "CPU's parts at 65 GB/s, after 190 µs of host work a layer)")
    assert copies_text({"decode_path": {**both, "cold_split": {**both["cold_split"], "cpu_bytes_per_s": 420e6}}}) \
        .endswith("the CPU's parts at 420 MB/s, after 190 µs of host work a layer)")  # not "0 GB/s"
    clamped = {**both["cold_split"], "cpu_bytes_per_s": 40e9, "cpu_measured_bytes_per_s": 65.4e9}
    assert copies_text({"decode_path": {**both, "cold_split": clamped}}).endswith(
        "the CPU's parts at 40 GB/s (measured 65 GB/s, clamped to the host's streaming read), after 190 µs of host "
        "work a layer)")
    both["cold_split"]["slow_steps_left_out"] = 3  # steps slowed by other work, not counted (spike_gate)
    assert copies_text({"decode_path": both}).endswith("the CPU's parts at 65 GB/s (3 slow steps left out), after 190 "
                                                       "µs of host work a layer)")
    assert copies_text({"decode_path": {"host_tier": True, "in_force": "tier", "measuring": "cpu"}}) == \
        "timing where cold experts run: computed on the CPU now"
    assert copies_text({"decode_path": {"host_tier": False, "in_force": "cpu", "measured_ms": {}}}) == ""
    assert path_sentence({"host_tier": True, "in_force": "cpu", "measured_ms": {"tier": 30.0, "cpu": 20.04}}) == \
        ("Cold experts measured while decoding: computed on the CPU (a decode step took 30.0 ms read by the GPU, "
         "20.0 ms on the CPU).")
    assert path_sentence({"host_tier": True, "in_force": "both",
                          "measured_ms": {"tier": 30.0, "cpu": 35.0, "both": 25.04}}) == \
        ("Cold experts measured while decoding: read by the GPU from host memory, a share computed on the CPU at once "
         "(a decode step took 30.0 ms read by the GPU, 35.0 ms on the CPU, 25.0 ms both).")
    assert path_sentence({"host_tier": True, "in_force": "tier", "measured_ms": {}}) == ""
    assert path_sentence({"host_tier": False, "in_force": "cpu", "measured_ms": {"tier": 1.0, "cpu": 2.0}}) == ""


def test_whole_layers_with_a_budget_below_one_layer_are_said_to_hold_no_layer(qtbot, window):
    """The layer split "whole" with a budget that holds no layer whole: the placement summary said "whole layers on
    the device" beside "0 of 16 experts resident". It says no layer fits, as where everything landed does."""
    load(qtbot, window, fixture_folder("gptoss"), {**simulated(), "layer_split": "whole"})  # 3 of a layer's 8
    assert window.worker._model.offload.whole_layers
    assert "The budget holds whole layers: 0 of 2 expert layers" in window.model_panel.landed.text()
    qtbot.waitUntil(lambda: window.placement.updates > 0, timeout=WAIT)
    summary = window.placement.summary.text()
    assert summary.startswith("0 of 16 experts resident · ")
    assert "whole layers: no layer fits the expert budget" in summary and "whole layers on the device" not in summary


def test_the_layer_split_chosen_in_the_budget_panel_plans_whole_layers_and_applies_without_reload(qtbot, window):
    path = fixture_folder("gptoss")
    window.open_model(str(path))
    qtbot.waitUntil(lambda: window.facts is not None and not window.busy, timeout=WAIT)
    budget = window.budget_panel
    budget.device.setCurrentIndex(budget.device.findData("simulated"))
    budget.expert_bytes.setValue(8 * slot())  # half of the 16 experts: one of the two layers whole
    budget.expert_bytes.valueChanged.emit(budget.expert_bytes.value())
    qtbot.waitUntil(lambda: "4 of 8 in every layer" in budget.layer_text.text())
    assert ("While decoding, the engine also tries this budget on whole layers (1 of 2 layers keeping all their "
            "experts)") in budget.statements.text()  # the measured split, the default
    budget.layer_split.setCurrentIndex(budget.layer_split.findData("whole"))
    qtbot.waitUntil(lambda: "layer 0: 8 of 8; layer 1: 0 of 8" in budget.layer_text.text())
    assert "While decoding" not in budget.statements.text()
    window.load()
    qtbot.waitUntil(lambda: same(window.loaded_path, path) and not window.busy, timeout=WAIT)
    engine = window.worker._model.offload
    assert engine.layer_split_mode == "whole" and engine.whole_layers
    assert "The budget holds whole layers: 1 of 2 expert layers" in window.model_panel.landed.text()
    assert not budget.apply_button.isEnabled()
    # back to the spread: applied on the loaded model, no reload
    budget.layer_split.setCurrentIndex(budget.layer_split.findData("spread"))
    qtbot.waitUntil(lambda: budget.apply_button.isEnabled() and "4 of 8 in every layer" in budget.layer_text.text())
    assert budget.apply_button.text() == "Apply"
    budget.apply_button.click()
    qtbot.waitUntil(lambda: engine.layer_split_mode == "spread" and not window.busy and not budget.dirty(),
                    timeout=WAIT)
    assert not engine.whole_layers and [layer.num_slots for layer in engine.slots] == [4, 4]
    assert window.model_settings(str(path))["layer_split"] == "spread"
    # the decode path: this app's own setting too, applied without reload
    budget.decode_path.setCurrentIndex(budget.decode_path.findData("tier"))
    qtbot.waitUntil(lambda: budget.apply_button.isEnabled())
    # the estimate says so before applying: the simulated GPU simulates the tier
    qtbot.waitUntil(lambda: "decode reads cold experts on the GPU from a host tier of" in budget.statements.text(),
                    timeout=WAIT)
    tier = human_bytes(tier_bytes(window.facts.experts))  # ... and the host memory it pins is in the host bar
    assert f"host tier</td><td align='right' style='white-space:pre'>&nbsp;{tier}" in budget.host_legend.text()
    assert budget.apply_button.text() == "Apply"
    budget.apply_button.click()
    qtbot.waitUntil(lambda: engine.decode_path_mode == "tier" and not window.busy and not budget.dirty(), timeout=WAIT)
    assert window.model_settings(str(path))["decode_path"] == "tier"
    qtbot.waitUntil(lambda: "decode reads cold experts on the GPU from a host tier of"
                    in window.model_panel.landed.text(), timeout=WAIT)
    assert engine.decode_path_in_force == "tier" and engine.host_tier
    qtbot.waitUntil(lambda: "Layer split fixed: spread over every layer." in window.model_panel.landed.text(),
                    timeout=WAIT)
    # the engine's own re-plan (a trial found whole layers faster): the window says so and shows where things landed
    engine.layer_split_mode = "auto"
    engine.split_trials.measured = {"spread": 0.030, "whole": 0.020}
    engine._set_whole_layers(True)
    window.worker._emit_stats()
    qtbot.waitUntil(lambda: "Measured faster: the expert budget now holds whole layers" in window.status_state.text(),
                    timeout=WAIT)
    assert ("Layer split measured while decoding: whole layers (a decode step took 20.0 ms with whole layers, "
            "30.0 ms spread).") in window.model_panel.landed.text()
    assert "The budget holds whole layers: 1 of 2 expert layers" in window.model_panel.landed.text()


def test_stop_and_esc_cancel_a_records_job_that_is_queued_but_not_started(qtbot, window):
    """A records job sent to the worker behind something else: Stop and Esc were off (only the job's own Cancel
    worked). They cancel it now: it is not run, and the status bar says it was stopped."""
    from PySide6.QtCore import QTimer

    load(qtbot, window, fixture_folder("lfm2moe"))
    gate = __import__("threading").Event()
    QTimer.singleShot(0, window.worker, lambda: gate.wait(30))  # the job waits in the worker's queue
    view = window.scenarios
    view.scenario.setCurrentText("multiturn")
    view.max_tokens.setValue(300)
    view.bar.run_button.click()
    assert window.busy == "" and window.stop_action.isEnabled()
    assert window.stop_action.text().replace("&", "") == "Stop the scenario runs"
    window.stop_action.trigger()
    assert window.status_state.text() == "Stopping the scenario runs…"
    gate.set()
    qtbot.waitUntil(lambda: not view.bar.running and not (window.busy or window._waiting), timeout=WAIT)
    assert view.result is None and view.bar.status.text() == "Cancelled while queued: nothing ran, nothing saved."
    assert window.status_state.text() == "Stopped the scenario runs while queued: nothing ran."
    assert not window.stop_action.isEnabled()


def test_the_record_and_sweep_answer_choices_outlive_the_window(qtbot, tmp_path):
    """Record's and the sweep's Answers (greedy, the model's or the chat's sampling) are kept as their lengths are."""
    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.scenarios.answers.currentData() == win.sweep.answers.currentData() == "greedy"
    win.scenarios.answers.setCurrentIndex(win.scenarios.answers.findData("chat"))
    win.sweep.answers.setCurrentIndex(win.sweep.answers.findData("model"))
    win.close()
    again = make_window(qtbot, tmp_path, nvml=False)
    assert (again.scenarios.answers.currentData(), again.sweep.answers.currentData()) == ("chat", "model")


def test_the_record_and_sweep_reasoning_settings_outlive_the_window_as_their_other_settings_do(qtbot, tmp_path):
    """Record's and the sweep's Reasoning went back to the template's default when the window reopened, where their
    Tokens, Answers and Repeats (and the chat's Reasoning) were kept: a sweep run again after a restart rendered its
    answers otherwise than the last without a word. It is kept, the user's value whether or not the loaded model
    takes it; one Qt cannot read as a word is said and the default used."""
    win = make_window(qtbot, tmp_path, nvml=False)
    assert win.scenarios.reasoning.chosen is win.sweep.reasoning.chosen is None
    win.scenarios.reasoning.choose("off")
    win.sweep.reasoning.choose("high")
    win.close()
    again = make_window(qtbot, tmp_path, nvml=False)
    assert (again.scenarios.reasoning.chosen, again.sweep.reasoning.chosen) == ("off", "high")
    again.sweep.reasoning.set_choices(["low", "medium", "high"])  # a gpt-oss model loads
    assert again.sweep.reasoning.currentData() == "high"
    again.sweep.reasoning.choose(None)
    again.close()
    ini = str(tmp_path / "settings.ini")
    settings = QSettings(ini, QSettings.Format.IniFormat)
    assert settings.value("sweep/reasoning") == ""  # the template's default
    settings.setValue("record/reasoning", ["on", "off"])  # on,off in the file: Qt reads a list
    settings.sync()
    third = make_window(qtbot, tmp_path, nvml=False)
    assert third.scenarios.reasoning.chosen is third.sweep.reasoning.chosen is None
    assert third.settings_banner.text() == (
        f"{ini}: the reasoning setting kept under record/reasoning cannot be used (on,off is not a text: in the "
        "file, one with a comma needs quotes): the template's default is used; what was kept is now under "
        "record/reasoning.bad there")


def test_an_unsupported_model_shown_cannot_be_loaded_by_the_menu_either_and_the_loaded_one_stays(qtbot, window,
                                                                                                  copy_fixture):
    """Load (the button) is off for a model whose expert nodes the kernels cannot run, but Model > Load (Ctrl+L)
    stayed on: it dropped the loaded model, then failed on the unsupported one."""
    import onnx

    loaded = fixture_folder("gptoss")
    load(qtbot, window, loaded)
    folder = copy_fixture("lfm2moe")
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == "QMoE")
    next(a for a in node.attribute if a.name == "k").i = 9  # more than its 8 experts
    onnx.save(model, str(folder / "model.onnx"))
    window.open_model(str(folder))
    qtbot.waitUntil(lambda: window.facts is not None and window.facts.name == "lfm2moe" and not window.busy,
                    timeout=WAIT)
    assert not window.facts.supported
    assert not window.model_panel.load_button.isEnabled() and not window.load_action.isEnabled()
    window.load_action.trigger()
    window.load()
    qtbot.wait(200)
    assert not window.busy and same(window.loaded_path, loaded) and not window.error_banner.isVisible()


def test_once_the_loaded_model_is_gone_the_title_no_longer_says_it_is_loaded(qtbot, window, copy_fixture,
                                                                             monkeypatch):
    """With gptoss loaded and lfm2moe shown, the title reads 'lfm2moe (not loaded; gptoss is)'; it kept saying so
    after Unload, and after a failed load of lfm2moe (which drops gptoss first)."""
    from app.gui import engine_worker

    load(qtbot, window, fixture_folder("gptoss"))
    shown = copy_fixture("lfm2moe")
    window.open_model(str(shown))
    qtbot.waitUntil(lambda: window.facts is not None and window.facts.name == "lfm2moe" and not window.busy,
                    timeout=WAIT)
    assert window.windowTitle() == "lfm2moe (not loaded; gptoss is) — MoE Workbench"
    window.unload()
    qtbot.waitUntil(lambda: window.loaded_path is None and not window.busy, timeout=WAIT)
    assert window.windowTitle() == "lfm2moe — MoE Workbench"

    load(qtbot, window, fixture_folder("gptoss"))
    window.open_model(str(shown))
    qtbot.waitUntil(lambda: window.facts is not None and window.facts.name == "lfm2moe" and not window.busy,
                    timeout=WAIT)
    def out_of_memory(*args, **kwargs):  # a load that fails once gptoss is dropped (a folder that opens)
        raise MemoryError("out of host memory")
    monkeypatch.setattr(engine_worker, "LoadedModel", out_of_memory)
    window.load()
    qtbot.waitUntil(lambda: not window.busy and window.error_banner.isVisible(), timeout=WAIT)
    assert window.loaded_path is None
    assert window.last_error == (f"Could not load {shown}: MemoryError: out of host memory; gptoss was unloaded first, "
                                 "to free its memory, and is no longer loaded")
    assert window.windowTitle() == "lfm2moe — MoE Workbench"
    assert window.model_panel.load_button.isEnabled() and window.model_panel.load_button.text() == "Load"
    assert not window.model_panel.unload_button.isEnabled() and window.model_panel.landed.text() == "Not loaded."


def test_a_load_that_runs_out_of_gpu_memory_under_offload_disabled_names_no_expert_budget(qtbot, window,
                                                                                           monkeypatch):
    """A load under mode=disabled (every expert beside the dense part, the expert budgets not applied) that ran out of
    the card's memory advised lowering device_expert_bytes; it says what frees the memory under that mode."""
    from app.gui import engine_worker

    OutOfMemoryError = type("OutOfMemoryError", (MemoryError,), {})  # CuPy's name

    def out_of_memory(*args, **kwargs):
        raise OutOfMemoryError("Out of memory allocating 512 bytes (allocated so far: 0 bytes).")
    monkeypatch.setattr(engine_worker, "LoadedModel", out_of_memory)
    folder = fixture_folder("gptoss")
    load(qtbot, window, folder, {"device": {"kind": "simulated", "capacity": 1 << 30}, "entries": {"mode": "disabled"}})
    assert window.last_error == (f"Could not load {folder}: OutOfMemoryError: Out of memory allocating 512 bytes "
                                 "(allocated so far: 0 bytes).; the GPU ran out of memory: use mode=auto, which keeps "
                                 "the experts that do not fit on the CPU, or free what other processes hold on the GPU")


def test_an_unload_whose_gpu_ran_out_of_memory_under_offload_disabled_names_no_expert_budget(qtbot, window,
                                                                                                monkeypatch):
    """The model dropped while its device's queued work failed with the card out of memory: the line said it without
    the model's offload mode, so under mode=disabled it advised lowering device_expert_bytes, which applies there to
    no expert. It says what frees the memory under that mode, and the model is dropped all the same."""
    from engine.errors import GPU_OUT_OF_MEMORY_DISABLED
    from engine.offload import SimulatedDevice

    OutOfMemoryError = type("OutOfMemoryError", (MemoryError,), {})  # CuPy's name

    def out_of_memory(device):
        raise OutOfMemoryError("Out of memory allocating 512 bytes (allocated so far: 0 bytes).")
    load(qtbot, window, fixture_folder("gptoss"), {"device": {"kind": "simulated", "capacity": 1 << 30},
                                                   "entries": {"mode": "disabled"}})
    monkeypatch.setattr(SimulatedDevice, "quiesce", out_of_memory)
    window.unload()
    qtbot.waitUntil(lambda: window.loaded_path is None and not window.busy, timeout=WAIT)
    assert window.last_error == ("OutOfMemoryError: Out of memory allocating 512 bytes (allocated so far: 0 bytes).; "
                                 + GPU_OUT_OF_MEMORY_DISABLED)


def test_a_load_under_mode_required_on_a_cuda_gpu_without_cupy_keeps_the_loaded_model(qtbot, window, monkeypatch):
    """The CUDA GPU chosen under mode=required on a machine whose GPU stack cannot run it (no CuPy here; no driver or
    NVRTC alike): the worker dropped the loaded model and its conversation, then refused the load. It is refused
    first, as the device would refuse it, with the loaded model kept."""
    loaded = fixture_folder("gptoss")
    load(qtbot, window, loaded)
    ask(qtbot, window, "Hello", 4)
    monkeypatch.setitem(sys.modules, "cupy", None)  # (import cupy fails, as on a machine without it)
    other = fixture_folder("lfm2moe")
    load(qtbot, window, other, {"device": {"kind": "cuda"}, "entries": {"mode": "required"}})
    assert window.last_error == (f"Could not load {other}: the CUDA GPU needs CuPy (install with `make install` on a "
                                 "machine with an NVIDIA driver); gptoss stays loaded")
    assert same(window.loaded_path, loaded)
    assert [m["role"] for m in window.worker._conversation.messages] == ["user", "assistant"]


def test_the_gpu_kernels_compiling_at_a_load_is_said_in_the_status_bar_and_where_everything_landed(qtbot, window,
                                                                                                 monkeypatch):
    """A first load on a GPU without a prebuilt cubin waits 1-2 minutes on NVRTC compiling the expert kernels, and the
    window said nothing: "Loading…" and a progress bar standing still. The device's report (CudaDevice.ensure_kernels,
    from a timer thread) shows in the status bar as it comes, and the compile's note where everything landed. A
    simulated GPU stands in for the CUDA one, which reports as a load's compile would."""
    import threading

    from app.gui import engine_worker
    from engine.offload import SimulatedDevice

    compiling = "Compiling the GPU expert kernels for sm_90 (a first load on this GPU without a prebuilt cubin: ...)."
    compiled = "The GPU expert kernels were compiled for sm_90 in 81 s; later loads take them from CuPy's cache in /c."

    def cuda_device_or_cpu(mem_limit, mode, report):
        device = SimulatedDevice(8 << 30, mem_limit=mem_limit, name="stand-in CUDA GPU")
        saying = threading.Thread(target=report, args=(compiling,))
        saying.start()
        saying.join()
        device.kernels_note = compiled
        report(compiled)
        return device, ""

    monkeypatch.setattr(engine_worker, "cuda_device_or_cpu", cuda_device_or_cpu)
    shown = []
    monkeypatch.setattr(window.status_state, "setText",
                        lambda text: shown.append(text) or QLabel.setText(window.status_state, text))
    load(qtbot, window, fixture_folder("gptoss"), {"device": {"kind": "cuda"}})
    assert shown[:4] == ["Loading…", compiling, compiled, "Preparing the CPU kernels…"]
    assert "<li>The GPU expert kernels were compiled for sm_90 in 81 s; later loads take them from CuPy" in (
        window.model_panel.landed.text())


def test_gpu_kernels_nvrtc_cannot_compile_load_the_experts_on_the_cpu_under_auto(qtbot, window, monkeypatch):
    """NVRTC failing on the GPU expert kernels failed a mode=auto load on CuPy's multi-line log, found at the first
    slots, where every other unusable GPU loads with the experts on the CPU; and the status bar went on saying the
    kernels were compiling. Now the load goes on on the CPU, saying why in the status bar and where everything landed.
    A stand-in CuPy whose compile fails after the notice's time."""
    import kernels.gpu._module as kernel_module
    from tests.test_gpu_kernel_notice import COMPILE_FAILED, NVRTC_LOG, CompileException, Refused, stand_in_cupy

    stand_in_cupy(monkeypatch)
    failing = Refused(CompileException(NVRTC_LOG, "source", "kern.cu", ()), compile_s=0.3)
    monkeypatch.setattr(kernel_module, "load_module", lambda cc: (failing, "nvrtc"))
    shown = []
    monkeypatch.setattr(window.status_state, "setText",
                        lambda text: shown.append(text) or QLabel.setText(window.status_state, text))
    path = fixture_folder("gptoss")
    load(qtbot, window, path, {"device": {"kind": "cuda"}})
    note = f"The CUDA GPU was asked for but cannot be used ({COMPILE_FAILED}); every expert runs on the CPU instead."
    assert same(window.loaded_path, path) and window.worker._device is None
    assert [text.split(" (")[0] for text in shown[:4]] == [
        "Loading…", "Compiling the GPU expert kernels for sm_90", note.split(" (")[0], "Preparing the CPU kernels…"]
    assert shown[2] == note
    landed = window.model_panel.landed.text()
    assert ("<li>The CUDA GPU was asked for but cannot be used (NVRTC cannot compile the GPU expert kernels for "
            "sm_90, the Stand-in GPU (80 GiB): 5f1e0c_2.cubin.cu(988): error: identifier") in landed


def test_where_everything_landed_keeps_why_the_experts_run_on_the_cpu_after_an_apply(qtbot, window, monkeypatch):
    """A model whose CUDA GPU could not be used (mode=auto) said why at the top of "where everything landed", but the
    worker rebuilt that text without it after a re-plan (Apply), so the panel no longer said why every expert runs on
    the CPU though the model was loaded as before. Every rebuild now keeps the reason while the model stays loaded. A
    stand-in for the worker's CUDA GPU that another process holds."""
    from app.gui import engine_worker

    busy = ("CUDA device 0 cannot be opened (CUDARuntimeError: cudaErrorDevicesUnavailable: CUDA-capable device(s) "
            "is/are busy or unavailable)")
    note = f"The CUDA GPU was asked for but cannot be used ({busy}); every expert runs on the CPU instead."
    monkeypatch.setattr(engine_worker, "cuda_device_or_cpu", lambda mem_limit, mode, report: (None, note))
    load(qtbot, window, fixture_folder("gptoss"), {"device": {"kind": "cuda"}})
    landed, budget = window.model_panel.landed, window.budget_panel
    assert landed.text().startswith(f"<ul style='margin-left:-20px'><li>{note}</li><li>")
    budget.placement.setCurrentText("static")
    qtbot.waitUntil(budget.apply_button.isEnabled)
    budget.apply_button.click()
    qtbot.waitUntil(lambda: not window.busy and not budget.apply_button.isEnabled(), timeout=WAIT)
    assert window.status_state.text() == "Re-planned without reloading"
    assert landed.text().startswith(f"<ul style='margin-left:-20px'><li>{note}</li><li>")
    assert landed.text().count(note) == 1
    load(qtbot, window, fixture_folder("lfm2moe"))  # another model, no GPU asked for: no reason to say
    assert note not in landed.text() and window.worker._device_fallback == ""


@pytest.mark.parametrize("press", ["stop", "unload"])
def test_a_stop_of_a_load_waiting_on_the_gpu_kernels_first_compile_says_what_it_waits_for(qtbot, window, monkeypatch,
                                                                                          request, press):
    """Stop (or Unload) pressed while a load's GPU expert kernels compile for the first time waits out NVRTC's compile,
    up to 2 minutes that nothing interrupts: the status bar said only "Stopping the load…" (Unload: nothing at all),
    and a compile notice that came after the stop was not shown. It now says what the stop waits for, how long the
    compile has run (counted on as it runs) and that its kernels are kept. A stand-in CuPy whose compile runs until
    the test ends it; its notice comes after Stop."""
    import re
    import threading

    import engine.offload.cuda_device as cuda_device
    import kernels.gpu._module as kernel_module
    from tests.test_gpu_kernel_notice import _Module, stand_in_cupy

    stand_in_cupy(monkeypatch)
    # (2 s: pressed within 0.5 s of the compile's start, beside other tests' compiles on 2 cores the press came late)
    monkeypatch.setattr(cuda_device, "KERNEL_NOTICE_AFTER_S", 2.0)
    compiling, finish = threading.Event(), threading.Event()
    request.addfinalizer(finish.set)  # (a failed test's worker not left waiting)

    class Compiling(_Module):
        def get_function(self, name):
            compiling.set()
            finish.wait(WAIT / 1000)

    monkeypatch.setattr(kernel_module, "load_module", lambda cc: (Compiling(0.0), "nvrtc"))
    path = fixture_folder("gptoss")
    window.save_model_settings(str(path), {"device": {"kind": "cuda"}})
    window.load_model(str(path))
    qtbot.waitUntil(lambda: compiling.is_set() and window.busy == "loading", timeout=WAIT)
    getattr(window, press)()  # before the compile's notice
    assert window.status_state.text() == "Stopping the load…"
    qtbot.waitUntil(lambda: "first compile" in window.status_state.text(), timeout=10_000)

    def waits(seconds: str) -> str:
        return (f"Stopping the load once the GPU expert kernels' first compile for sm_90 ends: it cannot be "
                f"interrupted ({seconds} s so far, about 1-2 minutes in all), and CuPy's cache in /cache/cupy keeps "
                f"the kernels for later loads.")

    def said_seconds() -> float | None:
        """The seconds the status bar says the compile has run, where it says waits(those seconds), as every time is
        said (units.duration_text: it said "2 s so far", where the window says a time "2.00 s")."""
        found = re.search(r"\((\d+\.\d\d) s so far", window.status_state.text())
        return float(found[1]) if found and window.status_state.text() == waits(found[1]) else None

    assert 2 <= (said_seconds() or 0) < 6  # (its notice came 2 s in)
    started, cc, cache = cuda_device._kernels_compiling[0]
    cuda_device._kernels_compiling[0] = (started - 60, cc, cache)  # a minute on: said again as the seconds go
    qtbot.waitUntil(lambda: (said_seconds() or 0) >= 60, timeout=3000)
    finish.set()
    qtbot.waitUntil(lambda: not window.busy, timeout=WAIT)
    assert window.status_state.text() == "Stopped the load" + ("; no model is loaded." if press == "unload" else ".")
    assert window.last_error == "Loading stopped." and window.loaded_path is None
    assert cuda_device._kernels_compiling == {} and cuda_device.kernels_compile_wait() == ""


def test_the_budget_panel_says_the_gpu_cannot_be_used_once_a_load_found_its_kernels_refused(qtbot, window,
                                                                                            monkeypatch):
    """After a load under mode=auto found the GPU expert kernels refused and ran every expert on the CPU, the budget
    panel went on estimating the experts on the GPU, for this load and the next, which falls back the same way. It
    now says the GPU cannot be used, and why, as for a GPU without CuPy."""
    import kernels.gpu._module as kernel_module
    from tests.test_gpu_kernel_notice import COMPILE_FAILED, NVRTC_LOG, CompileException, Refused, stand_in_cupy

    stand_in_cupy(monkeypatch)
    failing = Refused(CompileException(NVRTC_LOG, "source", "kern.cu", ()))
    monkeypatch.setattr(kernel_module, "load_module", lambda cc: (failing, "nvrtc"))
    load(qtbot, window, fixture_folder("gptoss"), {"device": {"kind": "cuda"}})
    assert window.loaded_path is not None and window.worker._device is None
    assert window.budget_panel.device_choice().error == COMPILE_FAILED
    assert window.budget_panel.statements.text().split("<br>")[0].endswith(
        f"The CUDA GPU cannot be used ({COMPILE_FAILED}): every expert would run on the CPU.")


def test_the_gpu_kernels_compiling_for_a_side_by_side_b_is_said_in_the_status_bar_and_goes_when_it_ends(window):
    """A side-by-side comparison loads B on the CUDA GPU itself: the first there in the process compiles the kernels,
    whose report the status bar showed only under "loading", so the comparison stood at "loading the right side" for
    1-2 minutes without a word. A note still shown as the activity ends (a load whose compile failed, a comparison)
    stayed up after it, over an idle window. As the worker reports them (its own thread's signals, here the
    window's)."""
    compiling = "Compiling the GPU expert kernels for sm_90 (...)."
    for activity in ("comparing", "loading"):
        window.worker.busyChanged.emit(activity)
        window.worker.loadNote.emit(compiling)
        assert window.status_state.text() == compiling
        window.worker.busyChanged.emit("")
        assert window.status_state.text() == "Idle"
    window.worker.loadNote.emit(compiling)  # (none comes while idle; one late is not shown)
    assert window.status_state.text() == "Idle"


def test_unload_while_a_side_by_side_bs_gpu_kernels_compile_says_what_it_waits_for(window, monkeypatch):
    """Unload, as Stop, stops a side-by-side comparison, whose load of B on the CUDA GPU may wait out the GPU kernels'
    first compile, which nothing interrupts: Stop said so, Unload left the compile's notice up, then the idle line,
    never saying the comparison stopped. As the worker reports them (its own thread's signals, here the window's)."""
    import time

    import engine.offload.cuda_device as cuda_device

    window.worker.busyChanged.emit("comparing")
    monkeypatch.setitem(cuda_device._kernels_compiling, 0, (time.perf_counter() - 5, "90", "/cache/cupy"))
    window.worker.loadNote.emit("Compiling the GPU expert kernels for sm_90 (...).")
    window.unload()
    assert window.status_state.text().startswith(
        "Stopping the side-by-side comparison once the GPU expert kernels' first compile for sm_90 ends: it cannot be "
        "interrupted (")
    del cuda_device._kernels_compiling[0]
    window.worker.busyChanged.emit("")
    assert window.status_state.text() == "Stopped the side-by-side comparison; no model is loaded."


def test_a_load_under_mode_required_on_a_busy_cuda_gpu_keeps_the_loaded_model(qtbot, window, monkeypatch):
    """A CUDA GPU there that cannot be opened (another process holds it in exclusive-process mode, or its memory):
    under mode=required the worker dropped the loaded model, then failed to open the device, and said only that the
    new load failed. A GPU the loaded model holds no memory on is now opened before that model goes: the load is
    refused with the loaded model and its conversation kept."""
    from app.gui import engine_worker
    from engine.offload.cuda_device import NoCudaDevice

    busy = ("CUDA device 0 cannot be opened (CUDARuntimeError: cudaErrorDevicesUnavailable: CUDA-capable device(s) "
            "is/are busy or unavailable)")

    def cuda_device_or_cpu(mem_limit, mode, report):
        assert mode == "required" and window.worker._model is not None  # opened while the loaded model is there
        raise NoCudaDevice(busy)

    loaded = fixture_folder("gptoss")
    load(qtbot, window, loaded)
    ask(qtbot, window, "Hello", 4)
    monkeypatch.setattr(engine_worker, "cuda_device_or_cpu", cuda_device_or_cpu)
    other = fixture_folder("lfm2moe")
    load(qtbot, window, other, {"device": {"kind": "cuda"}, "entries": {"mode": "required"}})
    assert window.last_error == f"Could not load {other}: {busy}; gptoss stays loaded"
    assert same(window.loaded_path, loaded) and window.worker._model is not None
    assert [m["role"] for m in window.worker._conversation.messages] == ["user", "assistant"]


def test_stop_while_the_cuda_gpu_opens_keeps_the_loaded_model(qtbot, window, monkeypatch):
    """Stop while the load opened the CUDA GPU (its bandwidth probe: a second or two) or read the folder: the worker
    went on to drop the loaded model, and stopped the load at its first progress report after, leaving nothing loaded.
    It now stops before the loaded model goes."""
    from app.gui import engine_worker
    from engine.offload import SimulatedDevice

    def cuda_device_or_cpu(mem_limit, mode, report):
        window.worker.cancel.set()  # Stop, as the window sets it, while the device opens
        return SimulatedDevice(8 << 30, mem_limit=mem_limit, name="stand-in CUDA GPU"), ""

    loaded = fixture_folder("gptoss")
    load(qtbot, window, loaded)
    ask(qtbot, window, "Hello", 4)
    monkeypatch.setattr(engine_worker, "cuda_device_or_cpu", cuda_device_or_cpu)
    load(qtbot, window, fixture_folder("lfm2moe"), {"device": {"kind": "cuda"}})
    assert window.last_error == "Loading stopped; gptoss stays loaded."
    assert same(window.loaded_path, loaded) and window.worker._model is not None
    assert [m["role"] for m in window.worker._conversation.messages] == ["user", "assistant"]


def test_a_stopped_load_goes_into_no_costly_phase_after_the_stop(qtbot, window, monkeypatch):
    """A load stopped before it began still opened and inspected the model folder, and one stopped while the folder
    opened went on to open the CUDA GPU (a first compile of its kernels: 1-2 minutes NVRTC cannot interrupt), or, the
    loaded model dropped, the device: the stop was checked after them. The load now checks it before each phase and
    ends with its "stopped" line. Stand-ins for the CUDA GPU and for the folder's reading, which record their calls."""
    from app.gui import engine_worker
    from engine.offload import SimulatedDevice

    worker, opened, devices = window.worker, [], []
    load(qtbot, window, fixture_folder("gptoss"), simulated())
    open_folder, make_device = worker._open_folder, worker._make_device

    def opening(path):
        opened.append(Path(path).name)
        return open_folder(path)

    def cuda_device_or_cpu(mem_limit, mode, report):
        devices.append("cuda")
        return SimulatedDevice(8 << 30, mem_limit=mem_limit, name="stand-in CUDA GPU"), ""

    monkeypatch.setattr(worker, "_open_folder", opening)
    monkeypatch.setattr(engine_worker, "cuda_device_or_cpu", cuda_device_or_cpu)
    monkeypatch.setattr(worker, "_make_device", lambda *args: devices.append(args[0]["kind"]) or make_device(*args))
    other = fixture_folder("lfm2moe")
    on_gpu = {"device": {"kind": "cuda"}}

    def stopped_load(settings, held: bool = False) -> str:
        gate = threading.Event()
        if held:  # (the load waits behind what the worker runs)
            QTimer.singleShot(0, worker, lambda: gate.wait(30))
        window._start_load(str(other), settings)  # (as Load, whichever folder the window shows)
        if held:
            window.stop_action.trigger()
            gate.set()
        qtbot.waitUntil(lambda: not (window.busy or window._waiting) and window.error_banner.isVisible(),
                        timeout=WAIT)
        return window.last_error

    # stopped while it waits in the worker's queue: no folder read, no GPU opened
    assert stopped_load(on_gpu, held=True) == "Loading stopped; gptoss stays loaded."
    assert opened == [] and devices == [] and window.status_state.text() == "Stopped the load."
    # stopped while the folder opens: the CUDA GPU is not opened
    monkeypatch.setattr(worker, "_open_folder", lambda path: (opening(path), worker.cancel.set())[0])
    assert stopped_load(on_gpu) == "Loading stopped; gptoss stays loaded."
    assert opened == ["lfm2moe"] and devices == [] and same(window.loaded_path, fixture_folder("gptoss"))
    # stopped as the loaded model goes, on a device made after it (a CUDA GPU the loaded model was on): none is made
    monkeypatch.setattr(worker, "_open_folder", opening)
    drop = worker._drop_model
    monkeypatch.setattr(worker, "_drop_model", lambda: (drop(), worker.cancel.set()))
    assert stopped_load(simulated()) == ("Loading stopped; gptoss was unloaded first, to free its memory, and is no "
                                         "longer loaded.")
    assert opened == ["lfm2moe", "lfm2moe"] and devices == [] and window.loaded_path is None


def test_unload_while_a_load_opens_the_gpu_says_the_loaded_model_goes(qtbot, window, monkeypatch):
    """Unload pressed while a load opened the GPU (before the loaded model goes) stops the load, and the queued Unload
    then unloaded the model the window's banner had just said "stays loaded". The banner now says it is unloaded."""
    import threading

    from app.gui import engine_worker
    from engine.offload import SimulatedDevice

    opening, unload_pressed = threading.Event(), threading.Event()

    def cuda_device_or_cpu(mem_limit, mode, report):
        opening.set()
        unload_pressed.wait(WAIT / 1000)
        return SimulatedDevice(8 << 30, mem_limit=mem_limit, name="stand-in CUDA GPU"), ""

    load(qtbot, window, fixture_folder("gptoss"))
    monkeypatch.setattr(engine_worker, "cuda_device_or_cpu", cuda_device_or_cpu)
    other = fixture_folder("lfm2moe")
    window.save_model_settings(str(other), {"device": {"kind": "cuda"}})
    window.load_model(str(other))
    qtbot.waitUntil(opening.is_set, timeout=WAIT)
    window.unload()
    unload_pressed.set()
    qtbot.waitUntil(lambda: not window.busy and window.loaded_path is None and window.error_banner.isVisible(),
                    timeout=WAIT)
    qtbot.wait(200)  # (anything else the worker says)
    assert window.last_error == "Loading stopped; gptoss is unloaded, as asked."
    assert window.loaded_path is None and window.worker._model is None


def test_unload_while_a_load_waits_in_the_queue_stops_it_before_it_reads_the_folder(qtbot, window, monkeypatch):
    """Unload pressed while a load waited behind what the worker ran let that load run in full (the folder read, the
    loaded model dropped, the new one built), and the Unload queued behind it then dropped the model it made. Unload
    now stops the queued load, which says so, before it reads the folder: no model is left loaded."""
    load(qtbot, window, fixture_folder("gptoss"))
    opened, open_folder = [], window.worker._open_folder
    monkeypatch.setattr(window.worker, "_open_folder", lambda path: opened.append(path) or open_folder(path))
    gate = threading.Event()
    QTimer.singleShot(0, window.worker, lambda: gate.wait(30))  # (the load waits behind what the worker runs)
    window._start_load(str(fixture_folder("lfm2moe")), {})
    assert window.unload_action.isEnabled()
    window.unload_action.trigger()
    assert window.status_state.text() == "Stopping the load…"
    gate.set()
    qtbot.waitUntil(lambda: not (window.worker.unload_asked or window.busy or window._waiting)
                    and window.loaded_path is None, timeout=WAIT)
    assert window.last_error == "Loading stopped; gptoss is unloaded, as asked." and window.error_banner.isVisible()
    assert opened == [] and window.worker._model is None and window.model_panel.landed.text() == "Not loaded."
    assert window.facts.name == "gptoss" and window.windowTitle() == "gptoss — MoE Workbench"


def test_unload_that_stops_a_load_says_so_and_that_no_model_is_loaded(qtbot, window):
    """Unload that stopped a load, queued or running, said "Stopping the load…", then "Idle" where the load kept the
    loaded model: the Unload's own `unloaded`, after the stop's line, wrote over it. The status bar now says the load
    was stopped and that no model is loaded, however far the load had gone."""
    load(qtbot, window, fixture_folder("gptoss"))
    gate = threading.Event()
    QTimer.singleShot(0, window.worker, lambda: gate.wait(30))  # (the load waits behind what the worker runs)
    window._start_load(str(fixture_folder("lfm2moe")), {})
    window.unload_action.trigger()
    gate.set()
    qtbot.waitUntil(lambda: not (window.busy or window._waiting) and window.loaded_path is None, timeout=WAIT)
    assert window.status_state.text() == "Stopped the load; no model is loaded."
    load(qtbot, window, fixture_folder("gptoss"))
    assert window.status_state.text() == "Ready"
    # a load that runs: stopped before or after it dropped gptoss (its own `unloaded` then comes before it ends)
    hold_loads_until_stopped(window)
    window.load_model(str(fixture_folder("lfm2moe")))
    qtbot.waitUntil(lambda: window.busy == "loading", timeout=WAIT)
    window.unload_action.trigger()
    qtbot.waitUntil(lambda: not window.busy and window.loaded_path is None, timeout=WAIT)
    assert window.status_state.text() == "Stopped the load; no model is loaded."


def test_a_load_of_a_folder_broken_since_it_was_opened_keeps_the_loaded_model_and_its_conversation(qtbot, window,
                                                                                                      copy_fixture):
    """The worker dropped the loaded model, and the window had its conversation started again, before it read the
    folder to load: one whose data file went after it was opened left no model loaded at all."""
    loaded = fixture_folder("gptoss")
    load(qtbot, window, loaded)
    ask(qtbot, window, "Hello", 4)
    shown = copy_fixture("lfm2moe")
    window.open_model(str(shown))
    qtbot.waitUntil(lambda: window.facts is not None and window.facts.name == "lfm2moe" and not window.busy,
                    timeout=WAIT)
    (shown / "model.onnx.data").unlink()
    window.load()
    qtbot.waitUntil(lambda: not window.busy and window.error_banner.isVisible(), timeout=WAIT)
    assert window.last_error == (f"Could not load {shown}: {shown / 'model.onnx.data'}: missing (external data of "
                                 "initializer 'model.layers.0.operator_layernorm.weight'); gptoss stays loaded")
    assert same(window.loaded_path, loaded)
    assert window.windowTitle() == "lfm2moe (not loaded; gptoss is) — MoE Workbench"
    assert [m["role"] for m in window.worker._conversation.messages] == ["user", "assistant"]
    assert ask(qtbot, window, "Again", 4)["result"]["finish_reason"] == "length"
    assert len(window.worker._conversation.messages) == 4 and len(window.chat.entries) == 4


def test_a_regenerate_that_fails_leaves_the_last_answer_in_the_transcript_and_the_conversation(qtbot, window,
                                                                                                 monkeypatch):
    """A regenerate refused (the conversation fed again past the context) or failing (out of memory) dropped the last
    answer from both the transcript and the engine's conversation, and put its message back in the box: the answer was
    lost for good, and sending the message again met the same refusal."""
    load(qtbot, window, fixture_folder("lfm2moe"))
    first = ask(qtbot, window, "Hello", 6)
    decoder = window.worker._model.decoder
    real = decoder.forward

    def fails(state, token_ids):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(decoder, "forward", fails)
    window.chat.regenerate()
    qtbot.waitUntil(lambda: not window.busy and not window.chat.entries[-1].get("streaming"), timeout=WAIT)
    assert [(e["role"], e["text"]) for e in window.chat.entries] == [("user", "Hello"), ("assistant", first["text"])]
    assert window.chat.prompt.toPlainText() == "" and window.chat.regenerate_button.isEnabled()
    assert window.chat.live.text() == "Could not answer again: the last answer stays."
    assert window.worker._conversation.messages == [
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": first["text"]}]
    monkeypatch.setattr(decoder, "forward", real)
    window.chat.regenerate()  # answered again from a state the failure left consistent: greedy, the same answer
    qtbot.waitUntil(lambda: bool(not window.busy and window.chat.entries[-1].get("stats")), timeout=WAIT)
    assert [(e["role"], e["text"]) for e in window.chat.entries] == [("user", "Hello"), ("assistant", first["text"])]


def test_each_alt_letter_of_the_window_opens_one_thing(window):
    """The menu bar's menus and the central tabs take their Alt+letter from the same window: two of one letter
    (the Chat menu and the Chat tab) made Alt+C open the menu on one press and switch tabs on the next."""
    import re

    def letter(text: str) -> str:
        found = re.search(r"&([^&\s])", text.replace("&&", ""))
        return found.group(1).lower() if found else ""

    titles = [action.text() for action in window.menuBar().actions()]
    titles += [window.tabs.tabText(i) for i in range(window.tabs.count())]
    letters = [letter(title) for title in titles if letter(title)]
    assert len(letters) == len(set(letters)), titles


def test_the_screenshot_script_says_why_a_load_failed_and_what_one_still_did_at_its_limit(qtbot, window, tmp_path,
                                                                                           monkeypatch):
    """docs/make_screenshot.py waited 300 s for the model loaded and the window idle: a load that failed waited it out,
    and one whose first run was still compiling its CPU kernels (five minutes on a busy 2-core machine) gave up, both
    saying "the model did not load: " and no more; the script then aborted, its engine thread still running."""
    import importlib.util

    from app.gui import engine_worker

    spec = importlib.util.spec_from_file_location("make_screenshot", REPO / "docs" / "make_screenshot.py")
    shot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shot)
    empty = tmp_path / "empty"
    empty.mkdir()
    started = time.monotonic()
    said = shot.load(window, empty, timeout=WAIT / 1000)
    assert time.monotonic() - started < WAIT / 2000
    assert said == f"the model did not load: {window.last_error}" and said.startswith("the model did not load: Could ")
    assert str(empty) in said
    compiled = threading.Event()
    monkeypatch.setattr(engine_worker, "warm_model", lambda model: compiled.wait(WAIT / 1000))
    assert shot.load(window, fixture_folder("gptoss"), timeout=3) == (
        "the model did not load in 3 s: Preparing the CPU kernels…")
    compiled.set()
    window.unload()
    qtbot.waitUntil(lambda: window.loaded_path is None and not window.busy, timeout=WAIT)
    assert shot.load(window, fixture_folder("gptoss"), timeout=WAIT / 1000) == ""
    assert same(window.loaded_path, fixture_folder("gptoss"))
