"""What the README tells a newcomer, held against the code: the command lines it shows parse, and every environment
variable the code or the suite reads is in its table."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from tests.conftest import REPO

README = (REPO / "README.md").read_text()
# os.environ.get("NAME"), os.environ["NAME"], os.environ.setdefault("NAME", ...), os.getenv("NAME")
ENV_READ = re.compile(r"""(?:environ(?:\.get|\.setdefault)?\(?\[?|getenv\()\s*["']((?:MOE|QMOE)_[A-Z0-9_]+)["']""")


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    from app.cli import _build_parser

    parser = _build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _readme_command_lines() -> list[tuple[str, str]]:
    """(subcommand, the rest of the line) of every `moe-workbench COMMAND …` line in the README's sh blocks."""
    lines = []
    for block in re.findall(r"```sh\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            match = re.match(r"\s*(?:\.venv/bin/)?moe-workbench\s+([a-z][a-z-]*)(.*)", line.split("  # ")[0])
            if match:
                lines.append((match.group(1), match.group(2)))
    return lines


def test_every_option_in_the_readmes_command_lines_is_one_its_command_takes():
    commands = _subcommands()
    lines = _readme_command_lines()
    assert {command for command, _rest in lines} >= {"gui", "inspect", "generate", "write-model", "record", "sweep",
                                                      "history", "contention"}
    unknown = [(command, flag) for command, rest in lines
               for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest)
               if flag not in commands[command]._option_string_actions]
    assert unknown == []
    # the choices it spells out (--device cpu|simulated|cuda) are the command's
    for command, rest in lines:
        for flag, values in re.findall(r"(--[a-z-]+)[ =]([a-z0-9]+(?:\|[a-z0-9]+)+)", rest):
            choices = commands[command]._option_string_actions[flag].choices
            assert set(values.split("|")) == {str(choice) for choice in choices}, (command, flag)


def test_the_alternatives_in_the_readmes_command_lines_are_the_commands_exclusive_options():
    """The README's `[--greedy | --temperature T --top-k K --top-p P --seed S]` (and record's `[--model-sampling |
    --temperature T --top-k K --top-p P]`) made --top-k, --top-p and --seed part of --temperature's alternative, where
    each is an option of its own (--help: it applies to the model's own sampling too). Each `[A | B]` of its command
    lines is one of the command's mutually exclusive groups, whole."""
    commands = _subcommands()
    for command, rest in _readme_command_lines():
        for alternatives in re.findall(r"\[([^][]* \| [^][]*)\]", rest):
            groups = [{name for action in group._group_actions for name in action.option_strings}
                      for group in commands[command]._mutually_exclusive_groups]
            assert set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", alternatives)) in groups, (command, alternatives)


def test_every_environment_variable_the_code_or_the_suite_reads_is_in_the_readmes_table():
    table = README[README.index("| variable | what it does |"):]
    sources = [*REPO.glob("app/**/*.py"), *REPO.glob("engine/**/*.py"), *REPO.glob("kernels/**/*.py"),
               REPO / "tests" / "conftest.py"]
    read = {name for path in sources for name in ENV_READ.findall(path.read_text())}
    assert {"MOE_WORKBENCH_DEBUG", "MOE_LAYER_SPLIT", "QMOE_GPU_NO_CUBIN"} <= read  # the pattern finds them
    assert sorted(name for name in read if f"`{name}" not in table) == []


def test_the_readme_says_how_many_steps_a_sweep_point_settles_for_at_most():
    """The README said a sweep point decodes unrecorded until the engine's trials end "up to 200 steps", where the
    sweep allows SETTLE_STEPS_MAX (264: the trials' 200 and room for a window a noisy step lengthened)."""
    from engine.records.sweep import SETTLE_STEPS_MAX

    assert f"until none is under way or due (up to {SETTLE_STEPS_MAX} steps;" in README.replace("\n", " ")


def test_the_readme_says_what_a_data_file_changed_after_the_load_does():
    """A data file replaced by another after the load is let be (the loaded model answers from the file it mapped, and
    the next load reads the new one: test_gui's test of it), where one cut short or written to in place is refused:
    the README said neither, and a user who exported a model again into a loaded one's folder could not tell which
    weights answered."""
    said = README.replace("\n  ", " ")
    assert ("a data file cut short or written to in place since (the model exported again into its folder) fails the "
            "load, or stops the answer, run or re-plan before it reads the file, in a line naming it") in said
    assert ("One deleted or replaced by another file after the load (written anew and renamed over it) is not refused: "
            "the loaded model answers from the file it loaded, and the next load, Recent's included, reads the file "
            "then in the folder.") in said


def test_every_offload_setting_the_readme_names_is_one_offload_config_takes():
    from dataclasses import fields

    from engine.offload.config import ALIASES, UNUSED_KEYS, OffloadConfig, short_key

    keys = {f.name for f in fields(OffloadConfig)} | set(ALIASES)
    listed = README[README.index("keys, full or short ("):]
    listed = listed[:listed.index("…)")]
    short_names = re.findall(r"`([a-z_]+)`", listed)
    assert len(short_names) >= 10 and set(short_names) <= keys
    unused = README[:README.index("are kept for onnxruntime but change nothing")]
    unused = unused[unused.rindex("is refused here"):]
    assert set(re.findall(r"`([a-z_]+)`", unused)) == UNUSED_KEYS
    # `key=value` in the prose (a side-by-side B's layer_split= and decode_path= lines are this app's own settings)
    settings = [(key, value) for key, value in re.findall(r"`([a-z_]+)=([^`\s]+)`", README)
                if key not in ("layer_split", "decode_path", "to")]
    # --offload KEY=VALUE in the command lines
    for block in re.findall(r"```sh\n(.*?)```", README, re.S):
        settings += re.findall(r"--offload[ =]([a-z_.]+)=(\S+)", block)
    assert {short_key(key) for key, _value in settings} >= {"mode", "cpu_execution", "device_expert_bytes"}
    refused = []
    for key, values in settings:
        for value in values.split("|"):
            try:
                OffloadConfig.from_entries({key: value})
            except Exception as exc:
                refused.append(f"{key}={value}: {exc}")
    assert refused == []


def test_every_option_the_readmes_prose_names_is_one_a_command_takes():
    commands = _subcommands()
    others = {"--arch": "kernels/gpu/build.py", "--n-cpu-moe": None}  # python -m kernels.gpu.build's; llama.cpp's
    taken = {flag for parser in commands.values() for flag in parser._option_string_actions}
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", README))
    assert len(named) > 30 and sorted(named - taken - set(others)) == []
    assert '"--arch"' in (REPO / others["--arch"]).read_text()
    # "generate --stop", "`sweep` ... `--both-splits`": the option is that command's
    commands_named = "|".join(commands)
    pairs = re.findall(rf"(?<![\w-])({commands_named})[` ]+(--[a-z][a-z0-9-]*)", README)
    assert len(pairs) >= 8
    assert [(command, flag) for command, flag in pairs if flag not in commands[command]._option_string_actions] == []
    # the values it spells out (--decode-path auto|cpu|tier|both) are among the option's choices (of a command that
    # takes it: contention's --scenario has no all)
    spelled = re.findall(r"(--[a-z-]+)[ =\n]([a-z0-9]+(?:\|[a-z0-9]+)+)", README)
    assert {flag for flag, _values in spelled} >= {"--device", "--layer-split", "--decode-path", "--export"}
    for flag, values in spelled:
        actions = [parser._option_string_actions.get(flag) for parser in commands.values()]
        choices = [{str(choice) for choice in action.choices} for action in actions if action and action.choices]
        assert any(set(values.split("|")) <= held for held in choices), (flag, values)


def test_every_environment_variable_in_the_readmes_table_is_one_something_reads():
    table = README[README.index("| variable | what it does |"):]
    named = set(re.findall(r"`((?:MOE|QMOE)_[A-Z0-9_]+)", table))
    sources = [*REPO.glob("app/**/*.py"), *REPO.glob("engine/**/*.py"), *REPO.glob("kernels/**/*.py"),
               *REPO.glob("packaging/*.py"), REPO / "tests" / "conftest.py"]
    read = {name for path in sources for name in ENV_READ.findall(path.read_text())}
    assert len(named) >= 14 and sorted(named - read) == []


def test_the_x_libraries_the_readme_names_are_the_ones_the_window_checks_for():
    from app.gui.main import XCB_LIBRARIES, debian_package

    said = README[README.index("Qt's xcb platform needs"):]
    said = said[:said.index("where some are missing")]
    assert set(re.search(r"\(Debian: `([^`]+)`\)", said).group(1).split()) == set(map(debian_package, XCB_LIBRARIES))


def test_the_libraries_qt_links_that_the_readme_names_are_the_ones_the_window_checks_for():
    from app.gui.main import QT_LIBRARIES

    said = README[README.index("Qt's own GUI modules, which the window and the test suite"):]
    said = said[:said.index("names those missing in one line")]
    assert re.search(r"\(Debian: `([^`]+)`\)", said).group(1).split() == list(dict.fromkeys(QT_LIBRARIES.values()))


def test_every_file_the_readme_names_is_in_the_checkout():
    # files a model folder, the history or the window writes, not the checkout's
    written = {"genai_config.json", "model.onnx", "model.onnx.data", "configurations.json", "FILE.bad"}
    ticked = set(re.findall(r"`([\w./-]+\.(?:py|md|json|png|svg|desktop|data|onnx|bad))`", README)) - written
    linked = set(re.findall(r"\]\(([^)\s]+)\)", README))
    assert len(ticked) > 25 and len(linked) >= 4
    missing = sorted(name for name in ticked | linked
                     if not (REPO / name).exists() and ("/" in name or not any(REPO.glob(f"*/**/{name}"))))
    assert missing == []


def test_every_relative_link_in_the_readme_and_the_markdown_files_under_docs_resolves():
    # each from the file that holds it: docs/h100/contention.md links its record as record.json
    files = [REPO / "README.md", *REPO.glob("docs/**/*.md")]
    links = [(path, target.split("#")[0]) for path in files
             for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text())
             if not re.match(r"[a-z]+:", target) and not target.startswith("#")]
    assert {path.name for path, _target in links} == {"README.md", "contention.md"}
    missing = [f"{path.relative_to(REPO)}: {target}" for path, target in links if not (path.parent / target).exists()]
    assert missing == []


def test_the_readme_says_where_the_history_and_the_saved_configurations_are():
    # a sweep's --save-as kept its recommendation "in `configurations.json` there", a "there" that named no folder
    import os

    from engine.records import configurations, history

    said = README.replace("\n", " ")
    assert ("live in SQLite, `history.sqlite3` in the user data folder (`moe-workbench` in `$XDG_DATA_HOME`, else in "
            "`~/.local/share`, on Linux)") in said
    assert "in `configurations.json` beside the history," in said
    folder = Path(os.environ["XDG_DATA_HOME"]) / "moe-workbench"  # (tests/conftest.py sets it)
    assert history.default_path() == folder / "history.sqlite3"
    assert configurations.default_path() == folder / "configurations.json"


def test_the_keys_the_readme_gives_for_sweep_json_are_the_ones_it_prints(tmp_path, capsys):
    # the README's list of the object's keys left out warm_up, the unrecorded answer before the first point
    import json

    from app.cli import main
    from tests.conftest import fixture_folder

    said = README.replace("\n", " ")
    said = said[said.index("`sweep --json` prints one object: "):]
    said = said[:said.index(", null where the sweep stopped early")]
    rows = said[said.index("`points`, a row per point ("):said.index("), then `recommended_budget_bytes`")]
    top = re.sub(r"\([^()]*\)", "", said.replace(rows, "`points`"))  # (less what the parentheses say of each key)
    warm_up = said[said.index("`warm_up`"):said.index("`points`")]
    assert main(["sweep", str(fixture_folder("gptoss")), "--device", "simulated", "--max-new-tokens", "2", "--repeats",
                 "1", "--points", "2", "--history", str(tmp_path / "h.sqlite"), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert re.findall(r"`([a-z_]+)`", top) == list(printed)
    # every row's keys, and under approximate routing (not run here) its token agreement
    named = set(re.findall(r"`([a-z_]+)`", rows))
    assert set(printed["points"][0]) <= named and named - set(printed["points"][0]) == {"points", "routing_agreement"}
    assert re.findall(r"`([a-z_]+)`", warm_up)[1:] == list(printed["warm_up"])
