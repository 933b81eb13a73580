"""The `moe-workbench` command: open the window, inspect a model, generate text, record runs, sweep budgets, list the
history, test contention, write a model."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import threading
from pathlib import Path

from engine.errors import WorkbenchError, not_written, one_line, users_error
from engine.offload.decode_path import MODES as PATH_MODES
from engine.offload.layer_split import BOTH as BOTH_SPLITS, MODES as SPLIT_MODES
from engine.offload.projection import decode_totals, is_simulated, projected_decode_rate
from engine.reasoning import REASONING_ANSWER_TOKENS
from engine.records.contention import MAX_WORKERS
from engine.records.lengths import SCENARIO_TOKENS, SWEEP_REPEATS, SWEEP_TOKENS
from engine.sampling import RECORD_SEED
from engine.units import INT64_MAX, counted, decode_rate, duration_text, human_bytes, parse_bytes

PROG = "moe-workbench"
SIMULATED_VRAM = 8 << 30  # the simulated GPU's memory where --simulated-vram gives none
GENERATE_TOKENS = 128  # generate's answer length for a model that answers at once (LoadedModel.answer_tokens)
# pyproject lists no onnxruntime but in its extras (its CPU and GPU builds must not be installed together): a plain
# `pip install .` has none
NO_ONNXRUNTIME = ("onnxruntime is not installed: install moe-workbench with the extra for this machine, "
                  "pip install '.[cpu]', '.[cuda13]' (NVIDIA driver 580 or newer) or '.[cuda12]' (driver 525 or "
                  "newer); make does it")
# what is left where two builds were installed together and one removed: the files they share went with it
BROKEN_ONNXRUNTIME = ("onnxruntime is installed but broken ({}): removing one of two builds installed together takes "
                      "the files they share; uninstall onnxruntime and onnxruntime-gpu both, then install one (in a "
                      "checkout, make clean install installs the one this machine needs)")
NEEDS_NO_ONNXRUNTIME = ("write-model", "history")


MODEL_HELP = "model folder (genai_config.json, model.onnx and the tokenizer, as onnxruntime-genai's builder writes it)"
SCENARIO_HELP = ("short: one question; long: a report of about 2,000 tokens, its main points asked for; multiturn: "
                 "a chat of six questions")


def _scenario_all_help(fails: str) -> str:
    """--scenario's help for record or sweep: what is checked before the runs, the long input's room, and what is not,
    a multiturn's later turns (their room is what the answers before them leave, known only as they come)."""
    return (f"{SCENARIO_HELP}; all: the three, the long input left out where the model's sequences cannot hold it and "
            f"an answer of --max-new-tokens; a multiturn's turn the answers before it leave no room for fails {fails} "
            "(default short)")


class _Parser(argparse.ArgumentParser):
    """argparse's parser (its commands' too), whose refusal of a free-text option followed by an option's name says
    how to give a value that starts with '-' (_values_attached takes any other)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # argparse (3.11 to 3.13) takes -1 and -.5 for values but -1e-3 for an option's name, "expected one
        # argument", and has no public setting for what looks like a negative number (3.14 takes -1e-3 itself). The
        # public way, --temperature=-1e-3 written as _values_attached writes free text, needs the options that take a
        # value, which argparse keeps private too: its private matcher is replaced (test_cli's
        # test_argparse_reads_the_negative_number_matcher_the_parser_replaces fails where argparse drops it)
        self._negative_number_matcher = re.compile(r"^-([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$")
        self.words = []  # what this parser was given to parse (a command's: the words after its name)

    def parse_known_args(self, args=None, namespace=None):
        self.words = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        if re.fullmatch(f"argument ({'|'.join(FREE_TEXT)}): expected one argument", message):
            option = message.split()[1].removesuffix(":")
            last = self.words[-1] if self.words else ""
            if last.startswith("--") and option.startswith(last):  # the line ends at it (or at its abbreviation)
                message += " (its value is missing at the end of the line)"
            else:
                message += f" (one that starts with '-' is given as {option}=VALUE)"
        super().error(message)


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Run Mixture-of-Experts ONNX models with CPU/GPU expert offload.")
    commands = parser.add_subparsers(dest="command")

    gui = commands.add_parser("gui", help="open the window (the default with no command)")
    gui.add_argument("model", nargs="?", type=path_given, help="model folder to open (default: the demo model)")

    inspect = commands.add_parser("inspect", help="list every expert node, its layout and bytes, and whether it runs")
    inspect.add_argument("model", type=path_given, help=MODEL_HELP)
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    _add_device_arguments(inspect)

    gen = commands.add_parser("generate", help="generate text for a prompt")
    gen.add_argument("model", type=path_given, help=MODEL_HELP)
    gen.add_argument("--prompt", required=True, help="the (first) user message")
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--raw", action="store_true", help="tokenize the prompt as is, without the chat template")
    mode.add_argument("--chat", action="store_true",
                      help="multi-turn chat: after the first answer read more user turns from standard input, one per line")
    gen.add_argument("--system", help="system prompt (chat template only)")
    gen.add_argument("--max-new-tokens", type=at_least(1), help=_answer_length_help(GENERATE_TOKENS))
    sampling = gen.add_mutually_exclusive_group()
    sampling.add_argument("--greedy", action="store_true", help="always take the most likely token (without this or "
                          "--temperature: the model's own defaults, genai_config.json's search: greedy unless it samples)")
    _add_sampling_arguments(gen, sampling, "the sampler's seed, for a repeatable sampled answer (default: the "
                            "model's genai_config.json search.random_seed, where it sets one)")
    gen.add_argument("--stop", action="append", default=[], help="stop when this text appears in the answer; it may "
                     "name a special token, <|im_end|>, which the answer does not show (repeatable)")
    _add_reasoning_argument(gen, "")
    gen.add_argument("--threads", type=at_least(0), help="CPU threads for expert kernels, at most the cores (default "
                     "or 0: automatic, every core less those other processes keep busy)")
    _add_device_arguments(gen)
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object per answer: prompt_tokens, tokens, text, reasoning, finish_reason, "
                     "timings, dense (and offload with --device simulated or cuda, --offload or --config)")

    record = commands.add_parser("record", help="run measured scenarios and save resource records")
    record.add_argument("model", type=path_given, help=MODEL_HELP)
    record.add_argument("--scenario", choices=["short", "long", "multiturn", "all"], default="short",
                        help=_scenario_all_help("the run; the runs before it are saved"))
    record.add_argument("--max-new-tokens", type=at_least(1), help=_answer_length_help(
        SCENARIO_TOKENS, "; the long scenario's within what the context leaves after its input"))
    _add_record_sampling_arguments(record)
    _add_reasoning_argument(record, "every run's answers: ")
    record.add_argument("--label", default="", help="a name for these runs, shown by history and matched by its "
                        "--label")
    record.add_argument("--json", action="store_true", help="print the records as JSON")
    record.add_argument("--history", type=path_given, help="SQLite history file (default: the user's data folder)")
    _add_device_arguments(record)

    sweep = commands.add_parser("sweep", help="run scenarios across expert budgets and recommend one")
    sweep.add_argument("model", type=path_given, help=MODEL_HELP)
    sweep.add_argument("--points", type=at_least(2), default=5, help="budgets tried, from none to every expert "
                       "(default 5)")
    sweep.add_argument("--scenario", choices=["short", "long", "multiturn", "all"], default="short",
                       help=_scenario_all_help("the sweep at that point; the points before it are kept"))
    sweep.add_argument("--max-new-tokens", type=at_least(1), default=SWEEP_TOKENS,
                       help=f"the most tokens an answer generates, the same for every model (default {SWEEP_TOKENS}: "
                       "a sweep times the same work at each budget; a model that reasons first spends them on its "
                       "reasoning, which decodes as an answer does)")
    _add_record_sampling_arguments(sweep)
    _add_reasoning_argument(sweep, "every point's answers: ")
    sweep.add_argument("--repeats", type=at_least(1), default=SWEEP_REPEATS,
                       help=f"times each budget runs the scenarios (default {SWEEP_REPEATS}): its times are the "
                       "medians, and a budget whose median differs from the fastest's by less than their repeats' "
                       "spreads ties with it, as one within --margin does")
    sweep.add_argument("--margin", type=number, default=0.10, help="of the budgets within this fraction of "
                       "the fastest completion time (default 0.10) or tied with it, recommend the one with the least "
                       "device peak (of equal peaks the smaller budget)")
    sweep.add_argument("--plot", type=path_given, help="write the sweep plot here (.png or .svg)")
    sweep.add_argument("--save-as", type=configuration_name, metavar="NAME",
                       help="save the recommendation as a named configuration")
    sweep.add_argument("--both-splits", action="store_true",
                       help="at every budget that holds some but not all layers whole, run the budget spread over "
                            "every layer and on whole layers (the layer split), and recommend across both")
    sweep.add_argument("--json", action="store_true", help="print the warm-up before the first point, the points and "
                       "the recommendation as one JSON object")
    sweep.add_argument("--history", type=path_given, help="SQLite history file (default: the user's data folder)")
    _add_device_arguments(sweep)

    history = commands.add_parser("history", help="list or export saved run records")
    history.add_argument("--model", help="filter: model folder contains this")
    history.add_argument("--scenario", help="filter: runs of this scenario (short, long, multiturn, side-by-side, "
                                            "'side-by-side, at once')")
    history.add_argument("--label", help="filter: the run's label contains this (a sweep's: 'sweep budget share 25%%')")
    history.add_argument("--id", type=at_least(1), nargs="+", metavar="ID",
                         help="these runs only, as their whole records (JSON unless --export says otherwise)")
    history.add_argument("--export", choices=["json", "csv", "markdown"], help="print the records in this format")
    history.add_argument("--json", action="store_const", const="json", dest="export",
                         help="the same as --export json (as the other commands' --json)")
    history.add_argument("--history", type=path_given, help="SQLite history file (default: the user's data folder)")

    contention = commands.add_parser("contention", help="document indexing alone, inference alone, then both")
    contention.add_argument("model", type=path_given, help=MODEL_HELP)
    contention.add_argument("--workers", type=at_least(1, MAX_WORKERS), default=2,
                            help=f"indexing worker processes (default 2, at most {MAX_WORKERS})")
    contention.add_argument("--corpus", type=path_given, help="folder of .txt files (default: a generated corpus)")
    contention.add_argument("--scenario", choices=["short", "long", "multiturn"], default="short",
                            help=SCENARIO_HELP + " (default short)")
    contention.add_argument("--max-new-tokens", type=at_least(1), help=_answer_length_help(
        SCENARIO_TOKENS, "; the long scenario's within what the context leaves after its input; the test answers "
        "three times: a warm-up, alone, beside the indexing"))
    _add_record_sampling_arguments(contention)
    _add_reasoning_argument(contention, "the inference's answers: ")
    contention.add_argument("--json", action="store_true", help="print the report as one JSON object")
    _add_device_arguments(contention)

    write = commands.add_parser("write-model", help="write a random-weight model folder in the builder's format")
    write.add_argument("folder", type=path_given, help="a new or empty folder (see --force)")
    write.add_argument("--force", action="store_true", help="write into a folder that holds files already, replacing "
                       "the model files there")
    write.add_argument("--layers", type=int, default=2, help="decoder layers, each with an expert node (default 2)")
    write.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    write.add_argument("--experts", type=int, default=8, help="experts per layer (default 8)")
    write.add_argument("--top-k", type=int, default=2, help="experts routed per token (default 2)")
    write.add_argument("--intermediate", type=int, default=128, help="an expert's intermediate size (default 128)")
    write.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    write.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    write.add_argument("--head-size", type=int, default=32, help="an attention head's size (default 32)")
    write.add_argument("--quant-type", default="int", choices=["int", "fp4", "nvfp4", "fp8"],
                       help="expert layout: int (with --bits), fp4 (MXFP4), nvfp4, fp8 (e4m3)")
    # --bits, --block-size and --nvfp4-packing default to None (WriterSpec's defaults): given where the layout does
    # not take them, said so
    write.add_argument("--bits", type=int, choices=[2, 3, 4, 8], help="int: the experts' bits (default 4)")
    write.add_argument("--block-size", type=int,
                       help="int: K block, 0 = one scale per row; fp8: square block, 0 = per-expert global scale "
                       "(default 32)")
    write.add_argument("--zero-points", action="store_true", help="int: asymmetric, with zero points")
    write.add_argument("--prepacked", action="store_true", help="int4/int8 in CUTLASS's SM80 prepacked layout")
    write.add_argument("--nvfp4-packing", choices=["k_packed", "n_packed"],
                       help="nvfp4: K-packed [E, N, K/2] (default) or the legacy N-packed [E, K, N/2]")
    write.add_argument("--activation", default="swiglu", choices=["swiglu", "geglu", "relu", "relu2", "gelu", "silu",
                                                                   "identity"], help="the experts' (default swiglu)")
    write.add_argument("--sliding-window", type=int, help="window of the even layers (gpt-oss style)")
    write.add_argument("--context-length", type=int, default=2048, help="tokens (default 2048)")
    write.add_argument("--dtype", default="float32", choices=["float32", "float16"],
                       help="activations, scales and biases (default float32)")
    write.add_argument("--seed", type=int, default=0, help="the random weights' seed (default 0)")
    return parser


def at_least(minimum: int, maximum: int = INT64_MAX):
    """An argparse type: an integer of at least `minimum` (argparse names the option in its error), and at most
    `maximum`, by default what SQLite keeps (a record's length limit, a history id)."""
    def integer(text: str) -> int:
        value = int(text)  # a ValueError: argparse says "invalid integer value"
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: must be at least {minimum}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"{value}: must be at most {maximum}")
        return value
    return integer


class _AsTyped(float):
    """A number option's value, which an error prints as typed: `--temperature -1`, not -1.0."""

    def __str__(self) -> str:
        return self.text


def number(text: str) -> float:
    """An argparse type: a float (argparse says "invalid number value" of another), printed as typed."""
    value = _AsTyped(text)
    value.text = text.strip()
    return value


def size_at_least(minimum: int):
    """An argparse type: a size in bytes or with a unit (engine.units.parse_bytes), at least `minimum`."""
    def size(text: str) -> int:
        try:
            value = parse_bytes(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if value is not None and value < minimum and re.fullmatch(r"[0-9.]+", text.strip()):
            raise argparse.ArgumentTypeError(f"{text}: a number without a unit is bytes; a size here is at least "
                                             f"{human_bytes(minimum)} (8GiB, 512MiB)")
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"{text}: must be a size of at least {human_bytes(minimum)}")
        return value
    return size


def path_given(text: str) -> str:
    """An argparse type: a path, not empty (a script's unset variable): an empty model folder was the current folder,
    and an empty --plot, --history or --corpus was taken for none given, silently."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path names no file or folder")
    return text


def configuration_name(text: str) -> str:
    """An argparse type: a saved configuration's name, not empty (an empty one was taken for none given)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("a configuration needs a name")
    return text


def _answer_length_help(plain: int, more: str = "") -> str:
    """--max-new-tokens' help where its default follows the model (LoadedModel.answer_tokens)."""
    return (f"the most tokens an answer generates (default {plain}; for a model that reasons first, room for an answer "
            "after the reasoning: its genai_config.json's search.max_length, within its context, at most "
            f"{REASONING_ANSWER_TOKENS}{more})")


def _add_sampling_arguments(parser: argparse.ArgumentParser, choice, seed_help: str, plain: str = "with --greedy or "
                            "--temperature: ", own: str = "else the model's") -> None:
    """The sampling options, in onnxruntime-genai's search vocabulary; --temperature in `choice`, the group of the ways
    to choose the sampling. `plain` and `own` say when the defaults are plain and when the model's."""
    choice.add_argument("--temperature", type=number, help="sample with this temperature")
    parser.add_argument("--top-k", type=int, help=f"sample from the k most likely tokens (with --temperature: default "
                        f"0, all; {own})")
    parser.add_argument("--top-p", type=number, help="sample from the most likely tokens holding this probability "
                        f"(with --temperature: default 1.0, all; {own}; 0 beside a top-k above 1: top-k alone, as "
                        "onnxruntime-genai takes it)")
    parser.add_argument("--repetition-penalty", type=number, help="divide the logits of tokens seen so far by this "
                        f"({plain}default 1.0, none; {own})")
    parser.add_argument("--seed", type=int, help=seed_help)


def _add_record_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """record's, sweep's and contention's: greedy unless asked (as every record before the options was), seeded where
    sampled."""
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--model-sampling", action="store_true", help="answer as the model's genai_config.json search "
                        "section says (greedy unless it samples); without this or --temperature the answers are greedy")
    _add_sampling_arguments(parser, choice, "the sampler's seed where the answers sample (default: the model's "
                            f"genai_config.json search.random_seed where it sets one, else {RECORD_SEED}: a repeat run "
                            "samples as this one did); the record keeps it", plain="",
                            own="with --model-sampling: the model's")


def _add_reasoning_argument(parser: argparse.ArgumentParser, whose: str) -> None:
    """generate's, record's and sweep's --reasoning (`whose`: what it sets, said before the values)."""
    parser.add_argument("--reasoning", help=f"{whose}the chat template's reasoning setting, where it has one: low, "
                        "medium or high (gpt-oss's effort), on or off (Qwen3's thinking); default: the template's")


def _check_reasoning(args) -> None:
    """--reasoning refused, naming the values the model's chat template takes, before the model loads (minutes)."""
    if args.reasoning is None:
        return
    from engine.model_folder import folder_path
    from engine.reasoning import reasoning_variables
    from engine.tokenizer import ModelTokenizer

    reasoning_variables(ModelTokenizer(folder_path(args.model)), args.reasoning,
                        said_as=f"--reasoning '{args.reasoning}'")


def _add_device_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["cpu", "simulated", "cuda"], default="cpu",
                        help="where resident experts live: cpu (none), a simulated GPU, or the CUDA GPU")
    parser.add_argument("--config", type=configuration_name, metavar="NAME",
                        help="start from a saved configuration's offload settings, and the layer split and decode "
                             "path it was saved with (sweep --save-as NAME saves one; --offload entries, --layer-split "
                             "and --decode-path apply on top)")
    parser.add_argument("--offload", action="append", default=[], metavar="KEY=VALUE",
                        help="an offload setting in onnxruntime's vocabulary (session.moe.offload.KEY; "
                             "short names allowed, e.g. device_expert_bytes=2000000000 placement=static); repeatable")
    parser.add_argument("--simulated-vram", type=size_at_least(1 << 20), metavar="SIZE",
                        help="memory of the simulated GPU, in bytes or with a unit as the window takes it (8GiB, "
                             "'1.5 GB' quoted, 512M; default 8 GiB; with --device simulated)")
    parser.add_argument("--layer-split", choices=SPLIT_MODES,
                        help="the expert budget spread over every layer, or spent on whole layers (as llama.cpp's "
                             "--n-cpu-moe); auto (the default) measures both while decoding and keeps the faster, "
                             "without a host tier (decode path cpu, or auto where none is made); with one, spread")
    parser.add_argument("--decode-path", choices=PATH_MODES,
                        help="where decode computes cold experts on a CUDA device: cpu, tier (the GPU reads them "
                             "from page-locked host memory), or both (tier, and the CPU computes a share of them at "
                             "once); auto (the default) follows cpu_execution and, under its auto, measures the three "
                             "while decoding and keeps the fastest")


def _warning(sentence: str) -> str:
    """A warning line of one of the engine's sentences ("The CUDA GPU was asked for ...", which starts lines of the
    window and of a contention report as it is), worded after "warning:" as every other warning is: lower case, no
    full stop."""
    return f"warning: {sentence[:1].lower()}{sentence[1:].removesuffix('.')}"


def _offload_setup(args, fallback: list[str] | None = None, needs_device: str = "", kernels: bool = True):
    """(OffloadConfig, device) from --device/--offload, or (None, None) for plain CPU runs. Where a CUDA GPU cannot be
    used, the note that every expert runs on the CPU instead is printed, and appended to `fallback` where given; or,
    with `needs_device` (what needs one), refused. kernels: a CUDA GPU's expert kernels loaded too (a first compile
    takes 1-2 minutes), for what loads a model; not for a plan alone (inspect)."""
    from engine.offload import OffloadConfig, SimulatedDevice
    from engine.offload.config import DEVICE_KEYS, ROUTING_KEYS, UNUSED_KEYS, keys_among, short_key

    saved_entries = {}
    saved_auto = set()  # this app's own settings a configuration saved as auto, the default: said nowhere as given
    if args.config:
        from engine.records.configurations import load_configuration

        saved_for, saved, own = load_configuration(args.config)
        if Path(saved_for).resolve() != Path(args.model).resolve():
            print(f"warning: configuration '{args.config}' was saved for {saved_for}; its budgets are applied to "
                  f"{args.model} as they are", file=sys.stderr)
        saved_entries = saved.to_entries()
        # the layer split and the decode path it was saved with, unless given here (as --offload replaces an entry)
        for key, value in own.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
                if value == "auto":
                    saved_auto.add(key)
    given = {}
    for item in args.offload:
        key, eq, value = item.partition("=")
        if not eq or not key:  # (without a key: "unknown offload key ''" and every key listed)
            raise WorkbenchError(f"--offload {item!r}: expected KEY=VALUE")
        # the value as given: onnxruntime refuses spaces around it, and OffloadConfig says so
        if key in ("layer_split", "decode_path"):  # a side-by-side B's settings take them beside the keys
            raise WorkbenchError(f"--offload {item}: {key} is this app's own setting, not an onnxruntime "
                                 f"key: --{key.replace('_', '-')} {value}")
        if given.get(key, value) != value:  # as two names of one setting must agree (OffloadConfig.from_entries)
            raise WorkbenchError(f"conflicting values for one setting: {key}={given[key]!r} and {key}={value!r}")
        given[key] = value
    # --offload replaces the saved setting under whichever of its names (full, short, alias) it is given
    replaced = {short_key(key) for key in given}
    entries = {key: value for key, value in saved_entries.items() if short_key(key) not in replaced} | given
    idle_options = [f"--{key.replace('_', '-')}" for key in ("layer_split", "decode_path")
                    if args.device == "cpu" and getattr(args, key) is not None and key not in saved_auto]
    if args.simulated_vram is not None and args.device != "simulated":
        print(f"warning: --simulated-vram: no effect with --device {args.device}, which simulates no GPU (--device "
              "simulated)", file=sys.stderr)
    if idle_options:  # both choose among the ways a device takes experts
        print(f"warning: {', '.join(idle_options)}: no effect with --device cpu, where every expert runs on the CPU "
              "(--device simulated or cuda)", file=sys.stderr)
    if args.device == "cpu" and not entries:
        return None, None
    config = OffloadConfig.from_entries(entries)
    args.offload_mode = config.mode  # (the GPU running out of memory is said as the mode says it: errors.one_line)
    changed = config.to_entries()  # a setting given at its default (inspect's own export) changes nothing anywhere
    if args.device == "cpu":
        idle = keys_among(changed, DEVICE_KEYS)
        if idle:
            print(f"warning: {', '.join(idle)}: no effect with --device cpu, where every expert runs on the CPU "
                  "(--device simulated or cuda)", file=sys.stderr)
    if args.device == "simulated" and config.mode == "disabled":
        # every expert goes where the dense part runs, the CPU here; approximate routing's keys get their own warning
        idle = [key for key in keys_among(changed, DEVICE_KEYS) if key not in ROUTING_KEYS]
        if idle:
            print(f"warning: {', '.join(idle)}: no effect under mode=disabled on the simulated GPU, which takes "
                  "experts only: every expert runs on the CPU, beside the dense part", file=sys.stderr)
    idle_routing = config.idle_routing_settings()
    if idle_routing:
        print(f"warning: {', '.join(idle_routing)}: no effect under mode=disabled, which offloads nothing: routing is "
              "exact (approximate routing needs mode=auto or required)", file=sys.stderr)
    narrows = {"min_expert_weight": "whose drops it narrows to cold experts",
               "tail_substitution_threshold": "whose substitutions it narrows to these ranks"}
    for setting, narrowed in config.unpaired_routing_settings():
        print(f"warning: {setting}: no effect without {narrowed}, {narrows[narrowed]}", file=sys.stderr)
    unused = keys_among(changed, UNUSED_KEYS)
    if unused:
        print(f"warning: {', '.join(unused)}: kept for onnxruntime, but this engine does not use "
              f"{'it' if len(unused) == 1 else 'them'} (no effect here)", file=sys.stderr)
    if args.device == "simulated":
        return config, SimulatedDevice(args.simulated_vram or SIMULATED_VRAM, mem_limit=config.gpu_device_mem_limit)
    if args.device == "cuda":
        from engine.offload.cuda_device import cuda_device_or_cpu, open_cuda_device

        def report(text: str) -> None:  # what the load does where it takes long (the GPU kernels compiling)
            print(text, file=sys.stderr, flush=True)

        if needs_device:
            try:
                return config, open_cuda_device(mem_limit=config.gpu_device_mem_limit, report=report, kernels=True)
            except WorkbenchError as exc:
                raise WorkbenchError(f"{needs_device} needs a device, and the CUDA GPU cannot be used ({exc}); "
                                     "--device simulated gives a simulated one") from None
        device, note = cuda_device_or_cpu(config.gpu_device_mem_limit, config.mode, report=report, kernels=kernels)
        if note:
            print(_warning(note), file=sys.stderr)
            if fallback is not None:
                fallback.append(note)
        return config, device
    return config, None


def _cmd_inspect(args) -> int:
    from app.inspect_report import format_inspection, inspection
    from engine.model_folder import ModelFolder

    folder = ModelFolder.open(args.model)
    report = inspection(folder)
    fallback = []
    config, device = _offload_setup(args, fallback, kernels=False)
    if config is not None:
        import psutil

        from app.gui.estimate import staged_nodes, staging_for
        from engine.decoder_state import DecoderState
        from engine.offload import decode_path as paths
        from engine.offload.engine import load_popularity, popularity_statement
        from engine.offload.host_cache import file_backing_refusal
        from engine.offload.planner import all_resident_bytes
        from engine.offload.dense_landing import PlanPreview, land_dense, planned_experts
        from engine.ort_env import dense_cpu_reason, dense_refusal

        # what the engine checks at load, checked here too: the experts fit where allow_file_backing keeps them, the
        # pinned ring holds an expert, the popularity file reads
        refusal = file_backing_refusal(config, folder.expert_bytes, psutil.virtual_memory().available)
        if refusal:
            raise WorkbenchError(refusal)
        nodes = staged_nodes(folder)
        staging = staging_for(config, nodes, device)
        runnable, left_out = planned_experts(config, folder.experts)  # the nodes the engine runs: the load's plan
        rows = None  # the popularity file's counts (a file it cannot read refused here, as at load)
        if config.popularity_file:
            names = [i.name for i in runnable]
            rows = load_popularity(config.popularity_file, names, [i.spec.num_experts for i in runnable])
        state = DecoderState(folder.config, folder.onnx.proto.graph)
        kind = getattr(device, "kind", None)
        dense_cpu = dense_cpu_reason(kind, state.kv_dtypes())  # (a CUDA card's: no host tier)
        total, growth = state.full_context_bytes()

        def arena(ahead: int) -> str | None:  # the load's check, nothing registered, the device as the plan leaves it
            return dense_refusal(device, device.memory.available - ahead, total + growth, folder.dense_bytes)

        # the plan the load makes, its slots and streaming slots reserved on the device, made again where the load
        # would keep the dense part on the CPU (dense_landing.land_dense: the arena checked, not registered)
        preview = PlanPreview(config, runnable, nodes, device, kind, args.layer_split == "whole",
                              args.decode_path or paths.default_decode_path(), dense_cpu, arena)
        if device is not None:
            preview.make_slots()
            land_dense(preview, preview.place)
        plan = preview.plan
        # the nodes left out of the plan, then the sentences the load's plan says, in its order: the plan's, the
        # staging's, the tier's, the streaming slots'
        statements = left_out + plan.statements + (staging.statements(cold=plan.leaves_cold) if staging else [])
        statements += [preview.tier_said] if preview.tier_said else []
        statements += preview.streaming.statements if preview.streaming is not None else []
        # which nodes the file leaves out or counts too few experts of, where it does
        said_popularity = "" if rows is None else popularity_statement(
            config.popularity_file, rows, names, config.placement, [plan.slots.get(name, 0) for name in names])
        statements += [said_popularity] if said_popularity and plan.placement_mode == "hybrid" else []
        # the device planned for and why, where it is not the one asked for: a script reads the JSON, not stderr
        planned = {"asked": args.device, "planned_for": getattr(device, "kind", "cpu"),
                   "why": fallback[0] if fallback else None}
        report["offload"] = {"device": planned, "placement": plan.placement_mode, "budget_bytes": plan.budget_bytes,
                             "slots": plan.slots, "statements": statements,
                             "session_config_entries": config.session_entries()}
        if device is not None and config.mode != "disabled":  # budgets count slots in the GPU kernels' layout
            report["offload"]["all_resident_bytes"] = all_resident_bytes(folder.experts)
            report["offload"]["slot_bytes"] = {info.name: info.device_bytes_per_expert for info in folder.experts
                                               if info.gpu is not None}
    print(json.dumps(report, indent=2) if args.json else format_inspection(report))
    return 0 if report["supported"] else 1


# the names the engine's checks use, and the options that set them (so that an error names what the user typed)
SAMPLING_OPTIONS = {"repetition_penalty": "--repetition-penalty", "temperature": "--temperature", "top_k": "--top-k",
                    "top_p": "--top-p", "seed": "--seed"}
WRITER_OPTIONS = {"inter_size": "--intermediate", "hidden_size": "--hidden", "num_experts": "--experts",
                  "top_k": "--top-k", "num_heads": "--heads", "num_kv_heads": "--kv-heads", "head_size": "--head-size",
                  "layers": "--layers", "block_size": "--block-size", "context_length": "--context-length",
                  "sliding_window": "--sliding-window", "bits": "--bits"}


def _as_options(message: str, names: dict[str, str]) -> str:
    """`message` with the engine's field names replaced by the command-line options that set them."""
    return re.sub(r"\b(" + "|".join(names) + r")\b", lambda match: names[match.group(1)], message)


def _generation_params(args):
    from engine.generation import GenerationParams
    from engine.genai_config import load_genai_config
    from engine.model_folder import folder_path
    from engine.sampling import beam_search_note, describe

    if args.raw and args.system:
        raise WorkbenchError("--system needs the chat template, which --raw leaves out")
    if any(not stop for stop in args.stop):
        raise WorkbenchError("--stop needs some text (an empty one would stop at the first token)")
    own = args.temperature is None and not args.greedy  # the model's defaults, as onnxruntime-genai takes them
    config = load_genai_config(folder_path(args.model))
    sampling = _sampling(args, config, own)
    if not sampling.do_sample and (args.top_k is not None or args.top_p is not None or args.seed is not None):
        print("warning: --top-k, --top-p and --seed apply only when sampling (--temperature above 0, or a model whose "
              "genai_config.json samples); this answer is greedy", file=sys.stderr, flush=True)
    elif own and sampling.do_sample:
        seed = f", seed {sampling.seed}" if args.seed is None and sampling.seed is not None else ""  # the model's
        print(f"sampling as the model's genai_config.json says: {describe(sampling)}{seed} (--greedy for greedy "
              "answers)", file=sys.stderr, flush=True)
    beams = beam_search_note(config)
    if beams:
        print(_warning(beams), file=sys.stderr, flush=True)
    # the answer length once the model is loaded (_cmd_generate): its default follows the model
    return GenerationParams(sampling=sampling, stop_strings=tuple(args.stop), reasoning=args.reasoning)


def _sampling(args, config, own: bool):
    """The SamplingParams the options say: from the model's genai_config.json `config` (`own`) or from --temperature
    (none: greedy), with --top-k, --top-p, --repetition-penalty and --seed over them; without --seed, the model's
    search.random_seed."""
    from dataclasses import replace

    from engine.sampling import SamplingParams, model_sampling, model_seed

    base = (model_sampling(config) if own else
            SamplingParams(do_sample=bool(args.temperature), temperature=args.temperature or 1.0,
                           seed=model_seed(config)))
    given = {name: value for name, value in (("top_k", args.top_k), ("top_p", args.top_p),
                                             ("repetition_penalty", args.repetition_penalty)) if value is not None}
    sampling = replace(base, seed=base.seed if args.seed is None else args.seed, **given)
    try:
        sampling.validate()
    except ValueError as exc:
        raise WorkbenchError(_as_options(str(exc), SAMPLING_OPTIONS)) from None
    return sampling


def _record_sampling(args, what: str):
    """record's, sweep's and contention's SamplingParams: greedy unless asked, seeded (--seed, else the model's
    search.random_seed, else RECORD_SEED) where they sample, so that a repeat run samples as this one did; said on
    standard error where they sample."""
    from engine.genai_config import load_genai_config
    from engine.model_folder import folder_path
    from engine.sampling import beam_search_note, describe, recorded

    config = load_genai_config(folder_path(args.model))
    beams = beam_search_note(config) if args.model_sampling else ""  # otherwise the model's search is not asked for
    if beams:
        print(_warning(beams), file=sys.stderr, flush=True)
    sampling = recorded(_sampling(args, config, args.model_sampling), config)
    if not sampling.do_sample:
        if args.top_k is not None or args.top_p is not None or args.seed is not None:
            print("warning: --top-k, --top-p and --seed apply only when sampling (--temperature above 0, or "
                  "--model-sampling with a model whose genai_config.json samples); these answers are greedy",
                  file=sys.stderr, flush=True)
        return sampling
    print(f"{what}: sampling: {describe(sampling)}, seed {sampling.seed}", file=sys.stderr, flush=True)
    return sampling


class _StreamedAnswer:
    """The answer streamed to standard output; a reasoning model's reasoning to standard error, under "Thinking…" and
    ended by "…done thinking." where the answer begins, so that standard output holds the answer alone."""

    def __init__(self):
        self.thinking = False

    def reasoning(self, _token, delta: str) -> None:
        if delta and not self.thinking:
            print("Thinking…", file=sys.stderr, flush=True)
            self.thinking = True
        print(delta, end="", file=sys.stderr, flush=True)

    def answer(self, _token, delta: str) -> None:
        if delta:
            self.done_thinking()
        print(delta, end="", flush=True)

    def done_thinking(self) -> None:
        if self.thinking:
            print("\n…done thinking.\n", file=sys.stderr, flush=True)
            self.thinking = False


def _warm_up(model, as_json: bool) -> float:
    """The model's compiled kernels and bookkeeping run once (kernel_warmup.warm_model); its seconds. Where that took
    long, a line on standard error says why: Numba compiling (a first run on this machine, or after an upgrade), or
    loading them from its cache (a busy machine took over a second for that, and was said to compile)."""
    from numba.core import event as numba_event

    from engine.kernel_warmup import warm_model

    with numba_event.install_recorder("numba:compile") as compiles:  # (its listeners hear every thread)
        seconds = warm_model(model)
    if seconds >= 1 and not as_json:
        done = ("compiled in {} before the answer (once: Numba caches them)" if compiles.buffer else
                "loaded from Numba's cache in {} before the answer")
        print(f"generate: the CPU kernels {done.format(duration_text(seconds))}; not in the answer's times",
              file=sys.stderr, flush=True)
    return seconds


def _print_result(result, model, as_json: bool, projected: float | None = None, device: dict | None = None,
                  warm_up_s: float = 0.0) -> None:
    """`projected`: on the simulated device, the answer's decode rate projected for the card. `device`: the device
    asked for, the one the model runs on and why where they differ (the JSON's offload.device). `warm_up_s`: the
    seconds the kernels' warm-up (their compilation on a first run) took before the answer, off its clock."""
    from engine.offload.approximate import agreement_text

    if as_json:
        timings = {"load_s": model.load_s, "kernel_warm_up_s": warm_up_s, **result.timings.as_dict()}
        if projected is not None:
            timings["projected_decode_tokens_per_s"] = projected
        answer = {"prompt_tokens": result.prompt_tokens, "tokens": result.tokens, "text": result.text,
                  "reasoning": result.reasoning, "finish_reason": result.finish_reason, "timings": timings}
        answer["dense"] = {"device": model.dense_device, "reason": model.dense_reason}
        if model.offload is not None:
            answer["offload"] = {"device": device, "statements": model.offload.plan.statements,
                                 **model.offload.stats_dict()}
        if result.routing_agreement is not None:
            answer["routing_agreement"] = result.routing_agreement
            answer["offload"]["approximation"] = vars(model.offload.approximation)
        print(json.dumps(answer), flush=True)
    else:
        t = result.timings
        print(flush=True)  # the streamed answer's line ends on standard output, whatever becomes of standard error
        tokens = f"{t.generated_tokens} token{'s' if t.generated_tokens != 1 else ''}"
        agreement = (f"; {agreement_text(result.routing_agreement, t.generated_tokens)}"
                     if result.routing_agreement is not None else "")
        finish = result.finish_reason + (" while reasoning, before any answer" if result.cut_in_reasoning else "")
        # no decode rate for an answer whose one token was the prefill's
        said = [tokens, f"first after {duration_text(t.time_to_first_token_s)}",
                decode_rate(t.decode_tokens_per_s, none=""), duration_text(t.total_s)]
        if projected is not None:
            said.append(f"projected on the simulated card: {decode_rate(projected)}")
        print(f"[{', '.join(filter(None, said))}; {finish}{agreement}]", file=sys.stderr, flush=True)


def _warn_of_thread_binding() -> None:
    """On standard error (a --json answer on standard output is not disturbed): OpenMP thread binding asked for."""
    from kernels.cpu.threads import binding_warning

    binding = binding_warning()
    if binding:
        print(f"warning: {binding}", file=sys.stderr, flush=True)


def _warn_of_decode_path(asked: str | None, model) -> None:
    """On standard error: a decode path asked for that reads the host tier ("tier", "both") where the engine made none,
    with the plan's sentence saying why (the host's memory, approximate routing ...)."""
    from engine.offload.decode_path import ASKED_TIER

    offload = model.offload
    if asked in ASKED_TIER and offload is not None and not offload.host_tier and offload.tier_statement:
        print(f"warning: --decode-path {asked}: {offload.tier_statement}", file=sys.stderr, flush=True)


def _warn_after_load(args, model) -> None:
    """What record, sweep and contention say once the model is loaded: the kernels' threads bound to cores, a decode
    path asked for that reads no host tier, a cpu_threads above the cores."""
    _warn_of_thread_binding()
    _warn_of_decode_path(args.decode_path, model)
    _warn_of_thread_cap(model.decoder.kernel_threads, "cpu_threads=")


def _warn_of_thread_cap(threads, given_as: str) -> None:
    """On standard error: the count in force (--threads, or the offload's cpu_threads: `given_as` says which) runs on
    fewer threads, the most the kernels take (KernelThreads.cores)."""
    from engine.ort_env import cpu_threads

    asked = threads.requested
    if asked > threads.cores:
        why = ("the cores this process may use" if threads.cores == cpu_threads() else
               "NUMBA_NUM_THREADS, below the cores this process may use")
        print(f"warning: {given_as}{asked}: {threads.cores} used, the most the CPU expert kernels run on here ({why})",
              file=sys.stderr, flush=True)


def _cmd_generate(args) -> int:
    from dataclasses import replace

    from engine.errors import ConversationFullError, PromptError
    from engine.generation import Conversation, LoadedModel, generate

    params = _generation_params(args)
    if not args.prompt.strip():
        raise PromptError("the prompt is empty")
    if args.reasoning is not None and args.raw:
        raise PromptError("--reasoning is a chat template setting: it does nothing with --raw")
    _check_reasoning(args)
    fallback = []
    config, device = _offload_setup(args, fallback)
    # the device the answer ran on and why, where it is not the one asked for: a script reads the JSON, not stderr
    ran_on = {"asked": args.device, "ran_on": getattr(device, "kind", "cpu"), "why": fallback[0] if fallback else None}
    if config is not None and args.threads and config.cpu_threads not in (0, args.threads):
        raise WorkbenchError(f"conflicting values for one setting: --threads {args.threads} and "
                             f"cpu_threads={config.cpu_threads}")
    if config is not None and args.threads and not config.cpu_threads:  # the offload engine sets the threads then
        config = config.updated(cpu_threads=args.threads)
    model = LoadedModel.open(args.model, threads=args.threads, offload=config, device=device,
                             layer_split=args.layer_split, decode_path=args.decode_path)
    params = replace(params, max_new_tokens=args.max_new_tokens or model.answer_tokens(GENERATE_TOKENS))
    for warning in model.folder.eos_warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    _warn_of_thread_binding()
    _warn_of_decode_path(args.decode_path, model)
    threads = model.decoder.kernel_threads
    given_as = "--threads " if args.threads == threads.requested else "cpu_threads="  # (the offload's wins)
    _warn_of_thread_cap(threads, given_as)
    if args.device == "cuda" and not args.json:
        print(model.dense_statement, file=sys.stderr, flush=True)
        if model.host_registration is not None:
            print(model.host_registration.describe(), file=sys.stderr, flush=True)
    # compiled before the first answer's clock starts, as a record's run is (on a cold Numba cache: minutes, which
    # its time to first token would carry, and the simulated card's stand-in seconds with it), once the first prompt
    # is accepted: one that does not fit is refused at once, not after the compile
    warm_up_s: list[float] = []

    def warm_up_once() -> None:
        if not warm_up_s:
            warm_up_s.append(_warm_up(model, args.json))

    def said_warm_up() -> float:  # the first answer says the warm-up's seconds, the next ones 0
        seconds = warm_up_s[0] if warm_up_s else 0.0
        warm_up_s[:] = [0.0]
        return seconds
    printed = None if args.json else _StreamedAnswer()
    stream, reasoning = (printed.answer, printed.reasoning) if printed else (None, None)
    cancel = threading.Event()
    if args.raw:
        ids = model.tokenizer.encode(args.prompt, add_special_tokens=True)  # a BOS as the tokenizer adds it
        before = decode_totals(model.offload, device)
        result = generate(model, model.new_state(), [], ids, params, stream, cancel, on_reasoning=reasoning,
                          before_feed=warm_up_once)
        if printed:
            printed.done_thinking()
        _print_result(result, model, args.json, projected_decode_rate(
            before, decode_totals(model.offload, device), result.timings.decode_s,
            result.timings.generated_tokens), ran_on, said_warm_up())
        return 0
    conversation = Conversation(model, system_prompt=args.system)
    prompt = args.prompt
    while True:
        before = decode_totals(model.offload, device)
        try:
            result = conversation.send(prompt, params, stream, cancel, on_reasoning=reasoning,
                                       before_feed=warm_up_once)
        except ConversationFullError as exc:  # its "start a new conversation" is the window's New chat: none here
            raise PromptError(f"{exc.problem}: run generate --chat again for a new conversation") from None
        if printed:
            printed.done_thinking()
        _print_result(result, model, args.json, projected_decode_rate(
            before, decode_totals(model.offload, device), result.timings.decode_s,
            result.timings.generated_tokens), ran_on, said_warm_up())
        if not args.chat:
            return 0
        line = sys.stdin.readline()
        if not line:
            return 0
        prompt = line.rstrip("\r\n")  # (a file written on Windows ends its lines so)
        if not prompt.strip():
            return 0


def _cmd_write_model(args) -> int:
    import shutil

    import psutil

    from engine.writer import WriterSpec, write_model
    from engine.writer.write import PROTOBUF_LIMIT, unfinished_files, write_sizes

    folder = Path(args.folder)
    if folder.exists() and not folder.is_dir():
        raise WorkbenchError(f"{folder}: a file, not a folder")
    if folder.is_dir() and any(folder.iterdir()) and not args.force:
        left = unfinished_files(folder)  # (--force writes over them, as over the model's files)
        left = f"; {', '.join(left)}: left by a write that did not finish" if left else ""
        raise WorkbenchError(f"{folder}: holds files already; writing would replace its model (--force to do so){left}")
    kind = args.quant_type
    idle = [option for option, value, takes in (("--bits", args.bits, kind == "int"),
                                                ("--block-size", args.block_size, kind in ("int", "fp8")),
                                                ("--nvfp4-packing", args.nvfp4_packing, kind == "nvfp4"))
            if value is not None and not takes]
    if idle:
        fixed = {"fp4": " (fp4 has blocks of 32 4-bit values)", "nvfp4": " (nvfp4 has blocks of 16 4-bit values)",
                 "fp8": " (fp8 is e4m3)"}
        why = fixed.get(kind, "") if {"--bits", "--block-size"} & set(idle) else ""
        print(f"warning: {', '.join(idle)}: no effect with --quant-type {kind}{why}", file=sys.stderr)
    layout = {name: value for name, value in (("bits", args.bits), ("block_size", args.block_size),
                                              ("nvfp4_packing", args.nvfp4_packing)) if value is not None}
    try:
        spec = WriterSpec(layers=args.layers, hidden_size=args.hidden, num_experts=args.experts, top_k=args.top_k,
                          inter_size=args.intermediate, num_heads=args.heads, num_kv_heads=args.kv_heads,
                          head_size=args.head_size, zero_points=args.zero_points, dtype=args.dtype, seed=args.seed,
                          quant_type=args.quant_type, prepacked=args.prepacked, activation=args.activation,
                          sliding_window=args.sliding_window, context_length=args.context_length, **layout)
        # the disk and the memory checked first: a size mistyped (--experts 320 for 32) filled the disk for an hour,
        # then failed; --layers 100000000 filled the memory with its graph, and was killed
        sizes = write_sizes(spec)
        there = next(p for p in (folder.absolute(), *folder.absolute().parents) if p.exists())
        free = shutil.disk_usage(there).free
        if sizes.data_bytes > free:
            raise WorkbenchError(f"{folder}: not written: its weights take {human_bytes(sizes.data_bytes)}, more than "
                                 f"the {human_bytes(free)} free on the disk there")
        graph = f"its graph of {counted(spec.layers, 'layer')}"
        if sizes.graph_bytes > PROTOBUF_LIMIT:
            raise WorkbenchError(f"{folder}: not written: {graph} (model.onnx) takes about "
                                 f"{human_bytes(sizes.graph_bytes)}, past the 2.0 GiB one protobuf file holds")
        available = psutil.virtual_memory().available
        if hasattr(psutil, "RLIMIT_AS"):  # (Linux's ulimit -v: what this process may map in all)
            limit = psutil.Process().rlimit(psutil.RLIMIT_AS)[0]
            if limit != psutil.RLIM_INFINITY:
                available = min(available, max(0, limit - psutil.Process().memory_info().vms))
        if sizes.memory_bytes > available:
            largest = sizes.largest
            raise WorkbenchError(f"{folder}: not written: writing it takes about {human_bytes(sizes.memory_bytes)} of "
                                 f"memory, more than the {human_bytes(available)} available ({graph} about "
                                 f"{human_bytes(sizes.graph_memory_bytes)}; its weights, made a piece at a time, "
                                 f"about {human_bytes(sizes.stream_bytes)}: a piece of {largest.name} is "
                                 f"{human_bytes(largest.chunk_bytes)})")
        path = write_model(args.folder, spec)
    except ValueError as exc:
        raise WorkbenchError(_as_options(str(exc).removeprefix("WriterSpec: "), WRITER_OPTIONS)) from None
    except OSError as exc:  # a file where one of its folders is to be, a folder this user cannot write, a full disk
        raise WorkbenchError(f"{folder}: not written ({not_written(exc, exc.filename or folder)})") from None
    print(path)
    return 0


class _ProgressLine:
    """A progress line on standard error (the CLI's progress bar), redrawn in place on a terminal; elsewhere (a log
    file, a pipe) one line at the end."""

    def __init__(self, what: str):
        self.what = what
        self.terminal = sys.stderr.isatty()
        self.drawn = False  # a line drawn in place and not yet ended
        self.width = 0  # the widest drawn in place since the line began: a shorter one is padded over its end

    def __call__(self, fraction: float, text: str = "") -> None:
        """`text`: what runs now (contention's phase), after the share on a terminal."""
        if self.terminal:
            line = f"{self.what}: {fraction:6.1%}" + (f", {text}" if text else "")
            print(f"\r{line:{self.width}}", end="\n" if fraction >= 1 else "", file=sys.stderr, flush=True)
            self.drawn, self.width = fraction < 1, max(self.width, len(line))
        elif fraction >= 1:
            print(f"{self.what}: done", file=sys.stderr, flush=True)

    def end(self) -> None:
        """Ends a line drawn in place short of done, so that what follows (a stopped sweep's points) starts below it."""
        if self.drawn:
            print(file=sys.stderr, flush=True)
            self.drawn, self.width = False, 0

    def say(self, text: str) -> None:
        """A line of its own; on a terminal over the progress drawn so far (the next report draws it again below)."""
        print(("\r" if self.terminal else "") + f"{self.what}: {text}", file=sys.stderr, flush=True)
        self.drawn, self.width = False, 0


def _scenarios(name: str) -> list[str]:
    from engine.records.scenarios import SCENARIOS

    return list(SCENARIOS) if name == "all" else [name]


def _cmd_record(args) -> int:
    from engine.generation import GenerationParams, LoadedModel
    from engine.records.history import History
    from engine.errors import PromptError
    from engine.records.scenarios import run_scenario, scenario_answer_tokens, scenario_turns

    history = History(args.history)  # a bad history file refused before the model loads
    history.check_writable()
    sampling = _record_sampling(args, "record")
    _check_reasoning(args)
    fallback = []  # why every expert runs on the CPU where the CUDA GPU cannot be used: each record says it
    config, device = _offload_setup(args, fallback)
    model = LoadedModel.open(args.model, offload=config, device=device, layer_split=args.layer_split,
                             decode_path=args.decode_path)
    _warn_after_load(args, model)
    runs = []  # (scenario, answer length) of those scenario_turns accepts, checked before the first runs
    for scenario in _scenarios(args.scenario):
        tokens = args.max_new_tokens or scenario_answer_tokens(model, scenario, args.reasoning)
        try:
            scenario_turns(scenario, model.tokenizer, model.config, tokens, args.reasoning)
        except PromptError as exc:  # the long input on a short context: with "all", the others run
            if args.scenario != "all":
                raise
            print(f"record: skipped {scenario}: {exc}", file=sys.stderr, flush=True)
            continue
        runs.append((scenario, tokens))
    records = []
    for scenario, tokens in runs:
        try:
            params = GenerationParams(max_new_tokens=tokens, sampling=sampling, reasoning=args.reasoning)
            record = run_scenario(model, scenario, params, device, label=args.label,
                                  progress=_ProgressLine(f"scenario {scenario}"), length_setting="--max-new-tokens")
            if fallback:
                record.offload["device_fallback"] = fallback[0]
        except (Exception, KeyboardInterrupt) as exc:  # after runs were saved: say them (and print them, with --json)
            if os.environ.get("MOE_WORKBENCH_DEBUG"):
                raise
            if records:
                return _record_stopped(exc, scenario, records, args.json, getattr(args, "offload_mode", None))
            if isinstance(exc, PromptError):  # a prompt the model cannot take: whose, as _record_stopped says
                raise PromptError(f"{scenario}: {exc}") from None
            raise
        try:
            run_id = history.add(record)
        except WorkbenchError as exc:  # a full disk, a lock held past the timeout: the run measured is kept here
            print(json.dumps([*records, record.to_dict()], indent=2))
            raise WorkbenchError(f"{exc}; the runs measured are printed on standard output as JSON, the last "
                                 "without an id") from None
        records.append({"id": run_id, **record.to_dict()})  # as `history --export json` gives it
        if not args.json:
            t = record.timings
            print(f"{scenario}: run {run_id}: {counted(record.generated_tokens, 'token')} generated (at most "
                  f"{tokens} an answer), load {duration_text(t['load_s'])}, first token "
                  f"{duration_text(t['time_to_first_token_s'])}, decode {decode_rate(t['decode_tokens_per_s'])}, "
                  f"completion {duration_text(t['completion_s'])}, "
                  f"peak RSS {human_bytes(record.peaks['rss_bytes'])} "
                  f"({human_bytes(record.peaks['rss_start_bytes'])} at the start); CPU time taken by other processes "
                  f"{record.host_load['host_others_share']:.0%}, by the VM's host "
                  f"{record.host_load['host_steal_share']:.0%}" + _fallback_note(record) + _device_note(record, device)
                  + _agreement_note(record.routing_agreement, record.generated_tokens))
    if args.json:
        print(json.dumps(records, indent=2))
    return 0


def _record_stopped(exc: BaseException, scenario: str, records: list[dict], as_json: bool, mode: str | None) -> int:
    """record's end where `scenario` failed or was interrupted after `records` were saved: those printed as JSON where
    asked (each run's line was printed already otherwise), and one line saying where it stopped and what was kept
    (under offload `mode`)."""
    if as_json:
        print(json.dumps(records, indent=2))
    ids = ", ".join(str(record["id"]) for record in records)
    kept = f"the {counted(len(records), 'run')} before it {'is' if len(records) == 1 else 'are'} saved in the history " \
           f"(id{'' if len(records) == 1 else 's'} {ids})"
    if isinstance(exc, KeyboardInterrupt):
        print(f"{PROG}: interrupted during {scenario}; {kept}", file=sys.stderr)
        return 130
    users = users_error(exc)
    said = one_line(exc, mode)
    print(f"{PROG}: {'error' if users else 'internal error'}: {scenario}: {said}; {kept}", file=sys.stderr)
    return 2 if users else 3


def _fallback_note(record) -> str:
    """'; every expert ran on the CPU: the CUDA GPU asked for could not be used (REASON)' for a run whose CUDA GPU
    could not be used (its record's device_fallback: the line's "cpu" is not a choice), else ''."""
    from engine.records.schema import fallback_reason

    note = record.offload.get("device_fallback")
    if not note:
        return ""
    return f"; every expert ran on the CPU: the CUDA GPU asked for could not be used ({fallback_reason(note)})"


def _device_note(record, device) -> str:
    """record's line on a device: its memory peak and what it was made of (as a sweep's device line says them) and, on
    the simulated device, what the record projects for the card (its measured times have the CPU computing the card's
    experts too, one after the other)."""
    from engine.records.scenarios import TIER_MAPPINGS, TIER_MAPPINGS_WHY, device_parts_text

    if device is None:
        return ""
    parts = record.peaks["device_parts"]
    note = f"; device peak {human_bytes(record.peaks['device_bytes'])} of {human_bytes(device.memory.ceiling)}"
    if parts:
        note += f" ({device_parts_text(parts)}{f': {TIER_MAPPINGS_WHY}' if TIER_MAPPINGS in parts else ''})"
    projected = record.timings.get("projected")
    if projected:
        bw = projected["bandwidths"]
        note += (f"; projected for the simulated card (PCIe {bw['pcie_bytes_per_s'] / 1e9:.0f} GB/s, HBM "
                 f"{bw['hbm_bytes_per_s'] / 1e9:.0f} GB/s assumed; the times before are the CPU's, standing in for "
                 f"it): decode {decode_rate(projected['decode_tokens_per_s'])}, completion "
                 f"{duration_text(projected['completion_s'])}")
    return note


def _cmd_sweep(args) -> int:
    from engine.generation import GenerationParams, LoadedModel
    from engine.records.configurations import save_configuration
    from engine.records.history import History
    from engine.records.sweep import (check_mode, fitting_scenarios, reasoning_length_note, recommendation, run_sweep,
                                      stopped_at)

    if args.device == "cpu":
        raise WorkbenchError("a budget sweep needs --device simulated or --device cuda")
    if not 0 <= args.margin < math.inf:  # nan too
        raise WorkbenchError(f"--margin {args.margin}: a share of the fastest completion, 0 or more (0.1 = 10%)")
    if args.plot:
        from app.sweep_plot import plot_path_problem

        problem = plot_path_problem(args.plot)
        if problem:
            raise WorkbenchError(problem)
    history = History(args.history)  # a bad history file refused before the sweep runs
    history.check_writable()
    sampling = _record_sampling(args, "sweep")
    _check_reasoning(args)
    if args.save_as:
        from engine.records.configurations import check_saved

        check_saved(None, args.save_as, args.model)  # and a file, or a name, the recommendation could not be saved in
    config, device = _offload_setup(args, needs_device="a budget sweep")
    check_mode(config.mode)
    if config.device_expert_bytes is not None:  # (not "no effect": the load and the warm-up run at it)
        print(f"warning: device_expert_bytes={config.device_expert_bytes}: a sweep sets the expert budget at each "
              "point; this one sets only the budget the model loads with, at which it gives its unrecorded warm-up "
              "answer before the first point", file=sys.stderr, flush=True)
    model = LoadedModel.open(args.model, offload=config, device=device, layer_split=args.layer_split,
                             decode_path=args.decode_path)
    _warn_after_load(args, model)
    scenarios, skipped = fitting_scenarios(model, _scenarios(args.scenario), args.max_new_tokens, args.reasoning)
    if skipped:
        print(f"sweep: {skipped}", file=sys.stderr, flush=True)
    note = reasoning_length_note(model.reasoning_answer_tokens, args.max_new_tokens, args.reasoning)
    if note:
        print(f"sweep: {note}; --max-new-tokens sets another", file=sys.stderr, flush=True)
    saved_ids, done = [], []  # each point's runs, saved as it completes; the points completed
    ids_of = {}  # id(point): the history ids of its runs, for the JSON rows
    warm_up = {}  # the unrecorded answer before the first point: budget_bytes, fraction, seconds (run_sweep's)

    def save(point) -> None:
        first = len(saved_ids)
        history.add_all(point.records, saved_ids)
        ids_of[id(point)] = saved_ids[first:]
        done.append(point)

    progress = _ProgressLine("sweep")
    params = GenerationParams(max_new_tokens=args.max_new_tokens, sampling=sampling, reasoning=args.reasoning)
    try:
        points = run_sweep(model, device, args.points, scenarios, params, progress=progress,
                           splits=BOTH_SPLITS if args.both_splits else None, on_point=save, repeats=args.repeats,
                           on_left_out=lambda note, _count: progress.say(note), length_setting="--max-new-tokens",
                           on_warm_up=lambda budget, fraction, seconds: warm_up.update(
                               budget_bytes=budget, fraction=fraction, seconds=seconds))
    except KeyboardInterrupt as exc:  # Ctrl-C: the points completed, as a failed point's
        progress.end()
        _print_sweep(done, None, args, ids_of, warm_up, params)
        print(f"{PROG}: the sweep was interrupted {stopped_at(exc)}; {_kept(done, saved_ids, args)}", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("MOE_WORKBENCH_DEBUG"):
            raise
        progress.end()
        _print_sweep(done, None, args, ids_of, warm_up, params)
        users = users_error(exc)
        print(f"{PROG}: {'error' if users else 'internal error'}: the sweep failed {stopped_at(exc)}: {one_line(exc)}; "
              f"{_kept(done, saved_ids, args)}", file=sys.stderr)
        return 2 if users else 3
    chosen = recommendation(points, args.margin)
    best = chosen.point
    # the sweep is complete: a plot or a configuration not written loses neither its table nor the other
    plot_failure = save_failure = None
    if args.plot:
        from app.sweep_plot import export_sweep_plot

        try:
            export_sweep_plot([p.as_dict() for p in points], best.budget_bytes, args.plot)
        except Exception as exc:
            if os.environ.get("MOE_WORKBENCH_DEBUG"):
                raise
            plot_failure = exc
    if args.save_as:
        # the layer split and the decode path the points ran with (this app's own settings, not onnxruntime keys) are
        # saved beside the entries, and --config applies them too
        own = {"layer_split": best.split or args.layer_split or "auto", "decode_path": args.decode_path or "auto"}
        words = "".join(f" --{key.replace('_', '-')} {value}" for key, value in own.items() if value not in (None, "auto"))
        try:
            saved = save_configuration(args.save_as, Path(args.model).resolve(),
                                       model.offload.config.updated(device_expert_bytes=best.budget_bytes),
                                       note=chosen.note + (f"; with{words}" if words else ""), own=own)
        except WorkbenchError as exc:  # a full disk, the file changed during the sweep: the table stands
            save_failure = exc
        else:
            also = f", which also sets{words}" if words else ""
            print(f"saved as configuration '{args.save_as}' in {saved} (use it with --config {args.save_as}{also})",
                  file=sys.stderr)
    _print_sweep(points, chosen, args, ids_of, warm_up, params)
    completed = "the sweep completed: its points and recommendation are printed and its runs saved in the history"
    status = 0
    if save_failure is not None:
        print(f"{PROG}: error: --save-as {args.save_as}: {save_failure}; {completed}", file=sys.stderr)
        status = 2
    if plot_failure is not None:
        written = isinstance(plot_failure, OSError)  # a file that could not be written, not a fault of ours
        why = not_written(plot_failure, args.plot) if written else one_line(plot_failure)  # (no "[Errno 28]")
        print(f"{PROG}: {'error' if written else 'internal error'}: --plot {args.plot}: not written ({why}); "
              f"{completed}", file=sys.stderr)
        status = max(status, 2 if written else 3)
    return status


def _kept(points: list, saved_ids: list[int], args) -> str:
    """What a sweep that stopped early kept (its completed points, printed, and their runs in the history) and what it
    did not do for want of a recommendation."""
    if points:
        ids = f"id {saved_ids[0]}" if len(saved_ids) == 1 else f"ids {id_ranges(saved_ids)}"
        kept = (f"the {counted(len(points), 'point')} before it {'is' if len(points) == 1 else 'are'} printed, "
                f"{'its' if len(points) == 1 else 'their'} {counted(len(saved_ids), 'run')} saved in the history "
                f"({ids})")
    else:
        kept = "no point finished before it"
    skipped = ["no plot written"] * bool(args.plot) + [f"no configuration '{args.save_as}' saved"] * bool(args.save_as)
    return f"{kept}; no recommendation" + (f": {', '.join(skipped)}" if skipped else "")


def id_ranges(ids: list[int]) -> str:
    """History ids as saved, consecutive ones as a range ("1 to 3, 5 to 7, 9"): another process writing the same
    history between a sweep's points takes the ids between theirs."""
    runs = []  # [first, last] of each run of consecutive ids
    for run_id in ids:
        if runs and run_id == runs[-1][1] + 1:
            runs[-1][1] = run_id
        else:
            runs.append([run_id, run_id])
    return ", ".join(f"{first} to {last}" if last > first else f"{first}" for first, last in runs)


def _print_sweep(points: list, chosen, args, ids_of: dict, warm_up: dict, params) -> None:
    """The sweep's points on standard output, the Recommendation `chosen` marked and its rule under them (None: a sweep
    that stopped early recommends none); `ids_of`: each point's runs' history ids (by id(point)), which its JSON row
    gives; `warm_up`: the unrecorded answer before the first point (budget_bytes, fraction, seconds; empty where it
    did not finish), which no point's runs time; `params`: how every point's answers were asked for, which the JSON
    gives as each record keeps it."""
    from engine.records.schema import generation_settings
    from engine.records.sweep import (copy_slots_line, device_parts_line, point_warm_ups_line, uses_projection,
                                      warm_up_line)

    rows = [p.as_dict() for p in points]
    projected = uses_projection(points)
    best = chosen and chosen.point
    marks = ["  <- recommended" if point is best else "" for point in points]
    split_of = [f"  {p['split']:>6}" if args.both_splits else "" for p in rows]
    split_head = f"  {'split':>6}" if args.both_splits else ""
    paths = [row["decode_path"] or "" for row in rows]
    # approximate routing: what each budget's answers cost against exact routing (a smaller budget drops more)
    approximate = any("routing_agreement" in row for row in rows)
    agreement_head = f"  {'agreement':>9}" if approximate else ""
    agreements = [f"  {row['routing_agreement']:>9.0%}" if "routing_agreement" in row else f"  {'n/a':>9}"
                  for row in rows] if approximate else [""] * len(rows)

    def cell_rate(tokens_per_s: float | None) -> str:  # the heading says the unit
        return decode_rate(tokens_per_s, unit="", none="n/a")

    # the budget's share of every expert's bytes, and the share of the experts placement kept resident as the point's
    # runs ended, which may be less (a layer holds whole experts; on whole layers the budget past those it fills is not
    # used; on the CPU path placement may leave slots to copied misses)
    shares_head = f"{'budget share':>12}  {'resident share':>14}"

    def shares(row: dict) -> str:
        return f"{row['fraction']:>12.0%}  {row['resident_share']:>14.0%}"

    def peaks(row: dict) -> str:  # in the unit that fits: a small model's points differ by KiB
        return f"{human_bytes(row['peak_device_bytes']):>11}  {human_bytes(row['peak_rss_bytes']):>10}"

    if args.json:
        rows = [{**row, "record_ids": ids_of[id(point)]} for row, point in zip(rows, points)]
        print(json.dumps({"generation": generation_settings(params), "warm_up": warm_up or None, "points": rows,
                          "recommended_budget_bytes": best and best.budget_bytes,
                          "recommended_split": best and best.split,
                          "recommended_by": best and ("projected_completion_s" if projected else "completion_s"),
                          "recommended_as_tie": chosen and chosen.tie},
                         indent=2))
    elif projected:
        bw = rows[0]["projected_bandwidths"]
        print(f"simulated device: 'projected' = the simulated card (PCIe {bw['pcie_bytes_per_s'] / 1e9:.0f} GB/s, "
              f"HBM {bw['hbm_bytes_per_s'] / 1e9:.0f} GB/s assumed); the recommendation uses the projected completion")
        print(f"{'budget bytes':>12}  {shares_head}{split_head}  {'path':>12}  {'completion':>10}  "
              f"{'projected completion':>20}  {'decode tok/s':>12}  {'projected tok/s':>15}  {'device peak':>11}  "
              f"{'RSS peak':>10}{agreement_head}")
        for p, split, mark, path, agreement in zip(rows, split_of, marks, paths, agreements):
            print(f"{p['budget_bytes']:>12}  {shares(p)}{split}  {path:>12}  "
                  f"{duration_text(p['completion_s']):>10}  {duration_text(p['projected_completion_s']):>20}  "
                  f"{cell_rate(p['decode_tokens_per_s']):>12}  "
                  f"{cell_rate(p['projected_decode_tokens_per_s']):>15}  {peaks(p)}{agreement}{mark}")
    elif rows:
        print(f"{'budget bytes':>12}  {shares_head}{split_head}  {'path':>12}  {'completion':>10}  "
              f"{'decode tok/s':>12}  {'device peak':>11}  {'RSS peak':>10}{agreement_head}")
        for p, split, mark, path, agreement in zip(rows, split_of, marks, paths, agreements):
            print(f"{p['budget_bytes']:>12}  {shares(p)}{split}  {path:>12}  "
                  f"{duration_text(p['completion_s']):>10}  {cell_rate(p['decode_tokens_per_s']):>12}  "
                  f"{peaks(p)}{agreement}{mark}")
    if not args.json:  # on standard error: the rows stay the table a script reads
        parts = device_parts_line(points)  # (a stopped sweep's points too: its line after them says where it stopped)
        copies = copy_slots_line(points)  # (what "resident share" leaves out, said next to it)
        warm_ups = point_warm_ups_line(points)
        if warm_up:
            print(f"sweep: {warm_up_line(**warm_up)}", file=sys.stderr)
        if warm_ups:
            print(f"sweep: {warm_ups}", file=sys.stderr)
        if copies:
            print(f"sweep: {copies}", file=sys.stderr)
        if parts:
            print(f"sweep: {parts}", file=sys.stderr)
        if chosen is not None:
            print(chosen.line(), file=sys.stderr)


def _cmd_history(args) -> int:
    from engine.records.history import History, budget_text, device_text
    from engine.records.scenarios import SCENARIOS
    from engine.records.side_by_side import SCENARIO, SCENARIO_AT_ONCE

    known = (*SCENARIOS, SCENARIO, SCENARIO_AT_ONCE)
    if args.scenario and args.scenario not in known:
        raise WorkbenchError(f"--scenario {args.scenario!r}: runs are of scenario {', '.join(map(repr, known))}")
    history = History(args.history, create=False)
    filters = {"model": args.model, "scenario": args.scenario, "label": args.label, "ids": args.id}
    rows = history.rows(**filters)  # read once: the rows checked are the rows printed
    absent = sorted(set(args.id or ()) - {row["id"] for row in rows})
    if absent:  # every id checked before any run is printed: a script reads all of them or none
        # read again only here, for which of them the history lacks
        missing = sorted(set(absent) - {row["id"] for row in history.rows(ids=absent)})
        if missing:
            raise WorkbenchError(f"{history.path}: no run{'s' * (len(missing) > 1)} {', '.join(map(str, missing))}")
        # a run asked for by id that the other filters leave out would be left out unsaid
        given = ", ".join(f"--{name} {getattr(args, name)!r}" for name in ("model", "scenario", "label")
                          if getattr(args, name))
        raise WorkbenchError(f"{history.path}: run{'s' * (len(absent) > 1)} {', '.join(map(str, absent))} "
                             f"do{'es' * (len(absent) == 1)} not match {given}")
    if args.export or args.id:
        unreadable = []
        print(history.export_rows(args.export or "json", rows, unreadable), end="")
        for problem in unreadable:
            print(f"{PROG}: warning: {problem}: left out", file=sys.stderr)
        return 0
    if not rows:
        filtered = any(value for value in filters.values())
        print(f"no runs {'match' if filtered else 'saved'} in {history.path}", file=sys.stderr)
    for row in rows:
        label = " ".join((row["label"] or "-").splitlines())  # a label of two lines (given so) on its run's line
        print(f"{row['id']:>5}  {row['created']}  {row['scenario']:<9}  {label:<14}  "
              f"{device_text(row):<28}  budget {budget_text(row) or '-'}  "
              f"completion {duration_text(row['completion_s'])}{_projected_completion(row)}  "
              f"{_tokens_text(row['generated_tokens'])}  "
              + (f"(approximate routing{_agreement_note(row['routing_agreement'], row['generated_tokens'])})  "
                 if row["approximate_routing"] else "") + row["model"])
    return 0


def _projected_completion(row: dict) -> str:
    """' (projected for the simulated card 50.0 ms)' for a run on the simulated device, whose measured times have the
    CPU computing the card's experts too; else ''."""
    projected = row["projected_completion_s"]
    return "" if projected is None else f" (projected for the simulated card {duration_text(projected)})"


def _agreement_note(agreement: float | None, tokens: int) -> str:
    """'; token agreement with exact routing 94% (15 of 16 tokens)' for a run with approximate routing, else ''."""
    from engine.offload.approximate import agreement_text

    return "" if agreement is None else f"; {agreement_text(agreement, tokens)}"


def _tokens_text(tokens: int | None) -> str:
    return "tokens ?" if tokens is None else f"{tokens} token{'' if tokens == 1 else 's'}"


def _cmd_contention(args) -> int:
    from engine.errors import PromptError
    from engine.generation import GenerationParams, LoadedModel
    from engine.records.contention import corpus_problem, default_corpus, phase_after, run_contention
    from engine.records.scenarios import run_scenario, scenario_answer_tokens, scenario_turns
    from engine.records.schema import generation_settings

    corpus = Path(args.corpus) if args.corpus else default_corpus()  # checked before the model loads (minutes)
    named = f"--corpus {corpus}" if args.corpus else str(corpus)
    problem = corpus_problem(corpus)
    if problem:
        raise WorkbenchError(f"{named}: {problem}")
    sampling = _record_sampling(args, "contention")
    _check_reasoning(args)
    fallback = []  # why every expert runs on the CPU where the CUDA GPU cannot be used: the report says it
    config, device = _offload_setup(args, fallback)
    model = LoadedModel.open(args.model, offload=config, device=device, layer_split=args.layer_split,
                             decode_path=args.decode_path)
    _warn_after_load(args, model)
    tokens = args.max_new_tokens or scenario_answer_tokens(model, args.scenario, args.reasoning)
    params = GenerationParams(max_new_tokens=tokens, sampling=sampling, reasoning=args.reasoning)
    # the long input on a short context refused as record refuses it, not after the warm-up's indexing (minutes)
    scenario_turns(args.scenario, model.tokenizer, model.config, params.max_new_tokens, params.reasoning)

    def inference() -> float:
        try:
            return run_scenario(model, args.scenario, params, device,
                                length_setting="--max-new-tokens").timings["completion_s"]
        except PromptError as exc:  # whose prompt, as record says it
            raise PromptError(f"{args.scenario}: {exc}") from None

    line = _ProgressLine("contention")

    def progress(fraction: float) -> None:  # (as a phase ends: the next one named, as the window's bar names it)
        line(fraction, phase_after(fraction) if fraction < 1 else "")

    progress(0.0)
    try:
        report = run_contention(inference, corpus, args.workers, progress=progress,
                                threads=model.decoder.kernel_threads.state, generation=generation_settings(params),
                                device_fallback=fallback[0] if fallback else None, model=str(model.folder.folder),
                                device=getattr(device, "name", "cpu"), simulated=is_simulated(device),
                                scenario=args.scenario)
    finally:  # a refusal or an interruption starts below the line drawn
        line.end()
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.markdown(), end="")
    return 0


def _cmd_gui(args) -> int:
    from app.gui.main import run_gui

    return run_gui(args.model)


def require_onnxruntime() -> None:
    """Import onnxruntime, refusing one left broken in one line (its folder without its __init__ imports as an empty
    namespace package). One not installed at all raises ModuleNotFoundError, which main says in its own words."""
    try:
        import onnxruntime

        onnxruntime.InferenceSession
    except (ImportError, AttributeError) as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == "onnxruntime":
            raise
        raise WorkbenchError(BROKEN_ONNXRUNTIME.format(one_line(exc))) from None


# the options whose value is free text, which may start with '-' ("-hi", "-1 is negative")
FREE_TEXT = ("--prompt", "--system", "--stop", "--label", "--model")


def _values_attached(argv: list[str], options: set[str]) -> list[str]:
    """Values that start with '-' attached to their option (`--prompt -hi` as `--prompt=-hi`): argparse takes such a
    value for an option of its own, and refused it with "expected one argument", naming neither it nor its fault. A
    negative size (`--simulated-vram -8GiB`) is attached to be refused as no size; free text unless it names an
    option of `options` (`--prompt --json` lacks its prompt, and is refused so), or abbreviates one as argparse
    takes it."""
    attached = []
    for arg in argv:
        after = attached[-1] if attached else ""
        name = arg.partition("=")[0]
        if (after == "--simulated-vram" and re.fullmatch(r"-[0-9.]+ *[A-Za-z]+", arg)
                or after in FREE_TEXT and arg.startswith("-") and name not in options
                and not (name.startswith("--") and any(option.startswith(name) for option in options))):
            attached[-1] += f"={arg}"
        else:
            attached.append(arg)
    return attached


def _option_names(parser: argparse.ArgumentParser) -> set[str]:
    """The option strings of `parser` and of its commands."""
    names = set()
    for action in parser._actions:
        names.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                names |= _option_names(command)
    return names


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(_values_attached(sys.argv[1:] if argv is None else argv, _option_names(parser)))
    command = args.command or "gui"
    if args.command is None:
        args.model = None
    handlers = {"gui": _cmd_gui, "inspect": _cmd_inspect, "generate": _cmd_generate, "write-model": _cmd_write_model,
                "record": _cmd_record, "sweep": _cmd_sweep, "history": _cmd_history, "contention": _cmd_contention}
    try:
        if command not in NEEDS_NO_ONNXRUNTIME:
            require_onnxruntime()
        return handlers[command](args)
    except WorkbenchError as exc:
        print(f"{PROG}: error: {one_line(exc, getattr(args, 'offload_mode', None))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as Python's documentation advises
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:  # the user gets one line; MOE_WORKBENCH_DEBUG=1 shows the traceback
        if os.environ.get("MOE_WORKBENCH_DEBUG"):
            raise
        if isinstance(exc, ModuleNotFoundError) and exc.name == "onnxruntime":
            print(f"{PROG}: error: {NO_ONNXRUNTIME}", file=sys.stderr)
            return 2
        if users_error(exc):
            print(f"{PROG}: error: {one_line(exc, getattr(args, 'offload_mode', None))}", file=sys.stderr)
            return 2
        print(f"{PROG}: internal error: {one_line(exc)}", file=sys.stderr)
        return 3
