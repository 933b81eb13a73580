"""Two offload configurations compared in one process, in alternating rounds (issue #4).

On the H200 machine, runs of one configuration differ by 10-15% between processes at 0-50% resident (RESULTS.md,
ninth session): more than most engine changes, so an A/B across processes says nothing. Here one loaded model
alternates between configuration A and B at each resident fraction: `--rounds` rounds, A then B in even rounds and B
then A in odd ones, each reconfigured (the budget of the fraction plus the variant's offload keys), warmed up and
decoded for `--decode-tokens` tokens. Reported per fraction: each configuration's median tokens/s and the paired
ratio B / A of each round (median, min, max). What the engine learns at run time (the miss policy's measured CPU rate
and copy reuse) carries over from one configuration to the next, as it would for a user who changes a setting.
A variant may also set switches, after each reconfiguration: `gpu.NAME=INT` (an attribute of every GpuQMoE the engine
holds: the nodes' slots and the streaming slots, e.g. gpu.driver_copies=0), `cpu.NAME=INT` (an attribute of every CPU
expert kernel, e.g. cpu.gemv_chunk_kb=16), `rate.NAME=INT` (an attribute of the miss policy's measured CPU rate,
CpuRate, e.g. rate.fit=0: the average rate alone, no fixed cost per call fitted), `engine.NAME=INT` (an attribute of the
offload engine, e.g. engine.weigh_miss_slots=0: adaptive placement leaves no slot to copied misses), `slots.NAME=INT`
(an attribute of every node's device slots, e.g. slots.split_on_dense=0: every "both" launch through the compute
stream), `policy.NAME=NUMBER` (an attribute of the placement policy, e.g. policy.max_swaps=1 or policy.margin=3.0:
adaptive placement's swaps per layer per safe point and its hysteresis), `judge.NAME=NUMBER` (an attribute of adaptive
placement's swap judge, engine/offload/swap_judge.py, e.g. judge.pays=3.0: the net hits a swap must earn lately for
swaps to go on), `dense.graphs=0|1` (the dense segments' decode runs replayed as CUDA graphs, engine/dense_graph.py),
`dense.relaunch=0|1` (a replay launched again at the next step without the run) and `dense.ahead=0|1` (a "both" layer's
host part left until the next dense segment and layer are launched: engine/decoder.py's launch_ahead; with
dense.worker=0, as the worker takes its place), `dense.worker=0|1` (each "both" layer's host part done by the host-part
worker's thread: engine/decoder.py's host_part_worker, on by default), `dense.pool_back=0|1` (a thread's OpenMP pool
given back when the other takes over the CPU parts: kernels/cpu/omp_pool.py, on by default); a switch one variant names
and the other does not keeps its default there. `split=auto|spread|whole` sets a variant's layer split (spread unless
named) and `path=auto|cpu|tier|both` its decode path (engine/offload/decode_path.py). Each round's engine figures (hit
rate, misses, copies, swaps, slots left to copies, the split and the decode path in force: engine_figures) go into the
result file beside the rates. The file is written after each fraction: where a later one fails (on a real card it may
lack room for the tier's mappings), the earlier ones are kept, and "failed" names that fraction and why.

With `--split-table first` (or a list of the CPU's pairs per cold count) every round of both variants decodes under
"both" (a variant naming no path gets it; one naming another, or where "both" is not in force at a fraction that
leaves an expert cold, is refused) with fixed tables, where the engine would make them again from rates it measures,
which move between rounds enough for a 1.18x between identical configurations (RESULTS.md, fortieth session): for
A/Bs of host-work changes.
'first' makes two tables for each layer from the same costs, its own as measured in A's warm-up: one that may split
a pair by rows, for a variant with the split on, and one of whole pairs, for a variant with engine.row_split=0, so that
an A/B of the split compares the split alone. The engine's trials of the CPU's share and of the split do not run
under fixed tables (OffloadEngine.fix_split_tables); each round's record names the tables it ran ("fixed_tables":
"split" or "whole"). At a fraction with every expert resident no table is fixed, as none would run: the record's
"split_tables" says why.

With `--trace` every decode is routed by the realistic trace (benchmarks/trace_routing.py, the same trace for A and
B in a round) instead of the random weights' nearly uniform routing, after `--decode-warmup` trace-routed steps.

    python benchmarks/bench_offload_ab.py --shape gpt-oss-20b-like --dtype float16 --fractions 0.25,0.5 \
        --b cpu_threads=15 [--a KEY=VALUE,...] [--rounds 6] [--decode-tokens 16] [--device cuda|simulated] \
        [--trace --decode-warmup 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_offload import (SHAPES, all_resident, decode, judge_words, path_run, path_text,  # noqa: E402
                                      shape_spec, split_words, traced_decode)
from benchmarks.common import model_folder, write_result, written_model  # noqa: E402
from engine import decoder, dense_graph  # noqa: E402
from engine.generation import LoadedModel  # noqa: E402
from engine.offload import OffloadConfig  # noqa: E402
from engine.offload.config import PREFIX  # noqa: E402
from engine.offload.decode_path import BOTH, MODES as PATH_MODES, default_decode_path  # noqa: E402
from engine.offload.layer_split import MODES as SPLIT_MODES, SPREAD  # noqa: E402
from engine.offload.miss_policy import cpu_rate_words as words  # noqa: E402
from engine.offload.planner import all_resident_bytes  # noqa: E402
from engine.units import counted, layer_words  # noqa: E402
from kernels.cpu import omp_pool  # noqa: E402


SWITCH_PREFIXES = ("gpu.", "cpu.", "rate.", "engine.", "slots.", "policy.", "judge.", "dense.")
NUMBER_PREFIXES = ("policy.", "judge.")  # switches that take a float as well as an integer
# the dense switches' module flags
DENSE_SWITCHES = {"dense.graphs": (dense_graph, "enabled"), "dense.relaunch": (dense_graph, "relaunch"),
                  "dense.ahead": (decoder, "launch_ahead"), "dense.worker": (decoder, "host_part_worker"),
                  "dense.pool_back": (omp_pool, "enabled")}
SPLIT = "split="  # a variant's layer split
# decode steps after the first trial before a variant under trials is timed: a switch to "both" makes its split
# tables afresh (engine.py: SPLIT_TABLE_FIRST steps, the host's gap measured again); timed at once, a round ran 19 ms
# a step where its trial measured 15 and "both" asked for ran 15.6 (thirty-fifth session). bench_offload's 96 warm-up
# steps leave 20 after the trial
SETTLE_AFTER_TRIAL = 20
PATH = "path="  # a variant's decode path (engine/offload/decode_path.py)
# --split-table first: warm-ups more, at most, until the CPU's parts and the GPU's reads of the tier are measured
FIRST_MORE_WARMUPS = 4
# --split-table at a fraction with every expert resident: why its record holds no tables
NOT_FIXED = "every expert is resident, so no decode step has a cold pair for a table to split"


def variant(text: str) -> dict:
    """Offload entries 'key=value,key=value' (short or full names; '' = none) as OffloadConfig changes (switches
    left out: switches())."""
    items = [item.strip() for item in text.split(",")]
    for item in items:
        if item and "=" not in item:  # (gpu_offload_run.sh's AB="--b ''" hands over the two quote characters)
            raise SystemExit(f"variant item {item!r} is not key=value (no change: an empty variant, or a switch at its "
                             f"default)")
    entries = dict(item.split("=", 1) for item in items
                   if item and not item.startswith(SWITCH_PREFIXES + (SPLIT, PATH)))
    parsed = OffloadConfig.from_entries(entries)
    changes = {name[len(PREFIX):]: getattr(parsed, name[len(PREFIX):]) for name in parsed.to_entries()}
    if "device_expert_bytes" in changes:
        raise SystemExit("device_expert_bytes is set by --fractions, not by a variant")
    return changes


def switches(text: str) -> dict[str, int | float]:
    """A variant's switch entries as {name with its prefix: INT, or a float for 'policy.' and 'judge.' switches}:
    'gpu.NAME' an attribute of every GpuQMoE the engine holds, 'cpu.NAME' one of every CPU expert kernel, 'rate.NAME'
    one of the engine's CpuRate, 'engine.NAME' one of the offload engine, 'slots.NAME' one of every node's device slots
    (CudaSlots), 'policy.NAME' one of the placement policy (engine/offload/placement.py), 'judge.NAME' one of its swap
    judge (adaptive placement's, engine/offload/swap_judge.py), 'dense.graphs' the dense segments' CUDA graphs
    (engine.dense_graph.enabled), 'dense.relaunch' their launch again without the run (.relaunch), 'dense.ahead' the
    next layer launched before a "both" layer's host part (engine.decoder.launch_ahead), 'dense.worker' the host parts
    on the host-part worker (engine.decoder.host_part_worker), 'dense.pool_back' a thread's OpenMP pool given back when
    the other takes over (kernels.cpu.omp_pool.enabled)."""
    found = {}
    for item in text.split(","):
        item = item.strip()
        if item.startswith(SWITCH_PREFIXES):
            name, _, value = item.partition("=")
            if name.startswith("dense.") and name not in DENSE_SWITCHES:
                raise SystemExit(f"{item}: the dense switches are {', '.join(DENSE_SWITCHES)}")
            try:
                found[name] = int(value)
            except ValueError:
                if not name.startswith(NUMBER_PREFIXES):
                    raise SystemExit(f"{item}: a switch takes an integer") from None
                try:
                    found[name] = float(value)
                except ValueError:
                    raise SystemExit(f"{item}: a {name.partition('.')[0]} switch takes a number") from None
    return found


def _named(text: str, prefix: str, modes: tuple[str, ...], default: str) -> str:
    """The last 'prefix=VALUE' entry of a variant (`default` where it names none), checked against `modes`."""
    named = [item.strip()[len(prefix):] for item in text.split(",") if item.strip().startswith(prefix)]
    value = named[-1] if named else default
    if value not in modes:
        raise SystemExit(f"{prefix}{value}: one of {', '.join(modes)}")
    return value


def layer_split(text: str) -> str:
    """A variant's layer split ('split=...'; spread where it names none)."""
    return _named(text, SPLIT, SPLIT_MODES, SPREAD)


def decode_path(text: str) -> str:
    """A variant's decode path ('path=auto|cpu|tier|both'; the engine's default where it names none: MOE_DECODE_PATH,
    else auto, whose trials may switch the path within a round: name it in both variants to compare paths)."""
    return _named(text, PATH, PATH_MODES, default_decode_path())


def fixed_tables_path(name: str, text: str) -> str:
    """Variant `name`'s decode path under --split-table: "both", the only path the fixed tables hold on, where it
    names none (not MOE_DECODE_PATH's default); one naming another is refused, as its rounds would time the path
    trials (under auto the tables apply only while a trial has "both" in force) or a path with no tables."""
    path = _named(text, PATH, PATH_MODES, BOTH)
    if path != BOTH:
        raise SystemExit(f"--split-table: variant {name} names path={path}, but the fixed tables hold only under "
                         f"\"both\" (name path=both or no path)")
    return path


def gpu_kernels(model: LoadedModel) -> list:
    """Every GpuQMoE the offload engine holds now (its nodes' slots, the streaming slots), each once."""
    engine = model.offload
    found = [getattr(store, "gpu", None) for store in engine.stores]
    found += [getattr(group, "gpu", None) for group in engine.streaming.by_layer]
    unique = {id(gpu): gpu for gpu in found if gpu is not None}
    return list(unique.values())


def cpu_kernels(model: LoadedModel) -> list:
    """Every expert node's CPU kernel (what `cpu.` switches set), each once."""
    found = [getattr(runner, "kernel", None) for runner in model.decoder.steps]
    unique = {id(kernel): kernel for kernel in found if kernel is not None}
    return list(unique.values())


def _targets(model: LoadedModel, name: str) -> tuple[list, str, str]:
    """(the objects switch `name` sets, the attribute, what they are called in errors)."""
    prefix, _, attribute = name.partition(".")
    if prefix == "cpu":
        return cpu_kernels(model), attribute, "the CPU expert kernel"
    if prefix == "rate":
        return [model.offload.cpu_rate, model.offload.split_rate], attribute, "the CPU rate"
    if prefix == "engine":
        return [model.offload], attribute, "the offload engine"
    if prefix == "slots":
        return [store for store in model.offload.stores if store is not None], attribute, "CudaSlots"
    if prefix == "policy":
        return [model.offload.policy], attribute, "the placement policy"
    if prefix == "judge":
        # none under static placement: its variant keeps no judge to set (as a gpu. switch without a GPU)
        judge = getattr(model.offload.policy, "judge", None)
        return [] if judge is None else [judge], attribute, "the swap judge"
    return gpu_kernels(model), attribute, "GpuQMoE"


def current_switches(model: LoadedModel, names) -> dict[str, int | float | None]:
    """The values the named switches have now (an attribute as the first kernel has it; a float stays one, and None,
    as a CPU rate's ceiling or stream on the simulated device, stays None so that it is set back as it was)."""
    values = {}
    for name in names:
        if name in DENSE_SWITCHES:
            values[name] = int(getattr(*DENSE_SWITCHES[name]))
            continue
        kernels, attribute, _ = _targets(model, name)
        if kernels and hasattr(kernels[0], attribute):
            value = getattr(kernels[0], attribute)
            values[name] = value if value is None or isinstance(value, float) else int(value)
    return values


def set_switches(model: LoadedModel, values: dict[str, int | float]) -> None:
    for name, value in values.items():
        if name in DENSE_SWITCHES:
            setattr(*DENSE_SWITCHES[name], bool(value))
            continue
        kernels, attribute, what = _targets(model, name)
        for kernel in kernels:
            if not hasattr(kernel, attribute):
                raise SystemExit(f"{name}: {what} has no such switch")
            setattr(kernel, attribute, value)


def open_model(shape: str, layers: int | None, folder: str | None, dtype: str = "float16", device: str = "cuda",
               prefix: str = "bench-offload-ab-") -> tuple[LoadedModel, list[int]]:
    """The shape's model (written into `folder` once, reused after), loaded with no expert budget on `device` ("cuda"
    or "simulated") once the work load leaves in the background has finished: the page-locking of its experts
    (copies go straight from the page-locked mapping in every configuration) and the population of their pages (it
    reads the whole file on the CPU's cores beside the first rounds otherwise); and a 16-token prompt."""
    path = written_model(model_folder(folder, prefix), shape_spec(shape, layers, dtype))
    if device == "cuda":
        from engine.offload.cuda_device import open_cuda_device
        opened = open_cuda_device()
    else:
        from engine.offload import SimulatedDevice
        opened = SimulatedDevice(200 << 30)
    model = LoadedModel.open(path, offload=OffloadConfig(device_expert_bytes=0), device=opened)
    model.wait_until_settled()
    model.decoder.warm_host_part_loop()
    return model, [int(t) for t in np.random.default_rng(0).integers(3, 400, 16)]


def engine_figures(model: LoadedModel) -> dict:
    """What the offload engine did in the decode just timed (its statistics are reset after the warm-up): the hit
    rate, the misses computed on the CPU, copied and read from the host tier, the experts the miss policy copied,
    placement's swaps (and, under adaptive placement, whether its judge paused them: swap_judge.py), the most slots a
    layer left to copies, the layer split and the decode path in force ("all resident" where no expert was cold, as
    the engine's records say: none ran; under "both", the CPU's share in each layer and the host's measured work
    between layers: cold_split) and the CPU kernels' rate as the engine measured it (CpuRate: bytes a second and a
    call's fixed seconds), so that a ratio can be read against its causes."""
    engine = model.offload
    totals, state = engine.stats.totals(), engine.copy_state()
    path = path_run(model, state["decode_path"])
    # the "both" parts' under "both"; in force, and as measured (OffloadEngine.cpu_rate_state)
    rate = engine.cpu_rate_state(engine.split_cpu_rate if engine.splits_cold else engine.cpu_rate)
    return {"hit_rate": totals.hit_rate, "misses_cpu": totals.misses_cpu, "misses_copied": totals.misses_copied,
            "misses_read": totals.misses_read, "miss_copies": totals.miss_copies, "swaps": totals.swaps,
            "miss_slots": max(state["miss_slots"], default=0), "whole_layers": state["layer_split"]["whole_layers"],
            "decode_path": path["in_force"], "cold_split": path["cold_split"], "path": path,
            "placement": state.get("placement"), "cpu_rate": rate["cpu_bytes_per_s"],
            "cpu_measured_rate": rate["cpu_measured_bytes_per_s"], "cpu_fixed_s": rate["cpu_call_s"],
            "cpu_measured_fixed_s": rate["cpu_measured_call_s"]}


def cpu_rate_words(figures: dict) -> str:
    """', CPU kernels 138 GB/s + 44 µs a call' where the engine measured its CPU kernels, with the measured line where
    the stream clamped its rate (miss_policy.cpu_rate_words); else ''."""
    if not figures.get("cpu_rate"):
        return ""
    return ", CPU kernels " + words(figures["cpu_rate"], figures["cpu_measured_rate"], figures["cpu_fixed_s"],
                                    figures["cpu_measured_fixed_s"])


def last_round_line(name: str, last: dict) -> str:
    """Variant `name`'s engine figures in its last round (a paired_rounds detail), as printed under the medians."""
    return (f"{name} in its last round: hit {last['hit_rate']:.2f}, misses cpu/copied/read "
            f"{last['misses_cpu']}/{last['misses_copied']}/{last['misses_read']}, copies {last['miss_copies']}, "
            f"swaps {last['swaps']}{judge_words(last.get('placement'))}, miss slots {last['miss_slots']}, "
            f"{'whole layers' if last['whole_layers'] else 'spread'}{path_text(last['path'])}"
            f"{split_words(last['cold_split'], last['fixed_tables'])}{cpu_rate_words(last)}, "
            f"{counted(last['layers_ahead'], 'layer')} launched ahead, {last['layers_beside']} on the worker, "
            f"{counted(last['steps_run_again'], 'step')} run again (warm-up included)")


def split_table(text: str | None):
    """--split-table: None (the engine's own tables, made again from the rates it measures), "first" (the table the
    engine made for A after a warm-up, kept), or the CPU's pairs per cold count ("0,0,1,1,2"), an array."""
    if text is None or text == "first":
        return text
    try:
        return np.array([int(count) for count in text.split(",")], np.int64)
    except ValueError:
        raise SystemExit(f"--split-table {text}: 'first' or the CPU's pairs per cold count, e.g. 0,0,1,1,2") from None


def fix_split_table(model: LoadedModel, table, budget: int, changes: dict, path: str, prompt: list[int],
                    warmup: int) -> dict:
    """Every layer's tables under "both" fixed for every round of both variants, where the engine would make them
    again from rates it measures, which move between rounds (a 1.18x between identical configurations, RESULTS.md
    fortieth session). `table` (split_table's): the CPU's whole pairs per cold count, or "first": the tables the
    engine makes for each layer from the costs it measured in A's warm-up (a layer's own: its experts' size and
    rows), both kinds from the same costs: the share with a pair split by rows where the layer's store splits pairs
    (kernels/cold_split.py: split_tables), and whole pairs only. A variant with engine.row_split=0 decodes under the
    second, one with it on under the first, so an A/B of the split compares the split alone. Returns, per layer (None
    for one with no device store, which has no "both" step), the tables fixed ({"split": [[share, rows], ...],
    "whole": [[share, None], ...]}) and, for "first", the costs they were made from ("costs_us": per layer, the CPU's
    an expert and a call, the GPU's an expert read from the tier, the host's gap between layers, µs; the
    sixty-seventh session's Qwen A/B could not tell them afterwards). Where every expert is resident under A's
    configuration none is fixed (no step has a cold pair to split): all three None, and "not_fixed" says why."""
    engine = model.offload
    if not isinstance(table, str):
        for info in engine.infos:
            if info.spec.k + 1 != table.size:
                raise SystemExit(f"--split-table {table.tolist()}: {info.name} takes {counted(info.spec.k, 'expert')} "
                                 f"a token, so a table of {info.spec.k + 1} counts")
    engine.reconfigure(OffloadConfig(device_expert_bytes=budget, **changes), decode_path=path)
    if all_resident(model):  # tables made here would be recorded though none ran ("first"'s from start-up guesses)
        return {"split": None, "whole": None, "costs_us": None, "not_fixed": NOT_FIXED}
    layers = [index for index, store in enumerate(engine.stores) if store is not None]
    split, whole, costs = [None] * len(engine.stores), [None] * len(engine.stores), None
    if isinstance(table, str):  # "first": from the costs the engine measures in A's warm-up
        decode(model, prompt, 1, warmup=warmup)
        # until both sides' rates are measured, not their start-up guesses
        for _more in range(FIRST_MORE_WARMUPS):
            if engine.split_rate.value is not None and engine.tier_read.value is not None:
                break
            decode(model, prompt, 1, warmup=warmup)
        costs = [None] * len(engine.stores)
        for layer in layers:
            split[layer] = engine.split_tables_from_costs(layer, getattr(engine.stores[layer], "splits_rows", False))
            whole[layer] = engine.split_tables_from_costs(layer, False)
            # what they were made from (µs): the CPU's an expert and a call, the GPU's an expert from the tier, the
            # host's gap
            costs[layer] = [seconds * 1e6 for seconds in (*engine._split_costs(layer), engine.host_gap.value)]
    else:
        for layer in layers:
            split[layer] = whole[layer] = (table, None)
    # read at each call: a variant's switch picks (fixed_tables); no share or row trials meanwhile
    engine.fix_split_tables(lambda layer: (split if engine.row_split else whole)[layer])
    return {"split": _listed(split), "whole": _listed(whole), "costs_us": costs}


def _listed(tables: list) -> list:
    """Per layer (share, rows) arrays, or None, as lists (a result file's)."""
    return [None if pair is None else [pair[0].tolist(), None if pair[1] is None else pair[1].tolist()]
            for pair in tables]


def tables_lines(fixed: dict) -> list[str]:
    """fix_split_table's tables as printed: a line for each run of layers with the same tables and costs ("layers
    0-23" where every layer's are alike), or why none was fixed."""
    if fixed.get("not_fixed"):
        return [f"no tables fixed: {fixed['not_fixed']}"]
    costs = fixed["costs_us"] or [None] * len(fixed["split"])
    runs: list[list] = []  # [first layer, last layer, (split, whole, costs)]
    for layer, same in enumerate(zip(fixed["split"], fixed["whole"], costs)):
        if same[0] is None:
            continue
        if runs and runs[-1][2] == same and runs[-1][1] == layer - 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer, same])
    lines = []
    for first, last, ((share, rows), (whole, _), made) in runs:
        layers = layer_words(list(range(first, last + 1)))
        made = "" if made is None else (f" (from the CPU's {made[0]:.0f} µs an expert + {made[1]:.0f} µs a call, the "
                                        f"GPU's {made[2]:.0f} µs an expert, the host's {made[3]:.0f} µs between "
                                        f"layers)")
        lines.append(f"tables fixed, {layers}: the CPU's pairs {share}, a pair split at rows {rows}; whole pairs "
                     f"{whole}{made}")
    return lines


def paired_rounds(model: LoadedModel, budget: int, changes: dict, rounds: int, prompt: list[int],
                  tokens: int, variant_switches: dict | None = None, splits: dict | None = None,
                  trace: bool = False, warmup: int = 32, details: dict | None = None,
                  paths: dict | None = None, table=None) -> dict[str, list[float]]:
    """Tokens/s of configurations "A" and "B" (`changes` of each, their switches: every name either names, with its
    default where one does not, and their layer splits) in `rounds` alternating rounds at one budget; with `trace`,
    routed by a realistic trace, the same for both in a round. `details` ({"A": [], "B": []}), where given, gets each
    round's engine_figures, and under "tables" the tables fixed where `table` is given. `table`: split_table's, fixed
    for every round (fix_split_table), else the engine's own."""
    variant_switches = variant_switches or {"A": {}, "B": {}}
    splits = splits or {"A": SPREAD, "B": SPREAD}
    paths = paths or {"A": default_decode_path(), "B": default_decode_path()}
    if table is not None:
        fixed = fix_split_table(model, table, budget, changes["A"], paths["A"], prompt, warmup)
        if details is not None:
            details["tables"] = fixed
    rates = {"A": [], "B": []}
    defaults = None
    try:
        for r in range(rounds):
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                model.offload.reconfigure(OffloadConfig(device_expert_bytes=budget, **changes[name]),
                                          layer_split=splits[name], decode_path=paths[name])
                if defaults is None:
                    defaults = current_switches(model, set(variant_switches["A"]) | set(variant_switches["B"]))
                set_switches(model, {**defaults, **variant_switches[name]})
                # "both" asked for may not be in force (cpu_execution=disabled: the tier; no host tier: the CPU),
                # and its rounds would then time no fixed table (where every expert is resident, none has a cold
                # pair to time it with on any path: fixed_tables)
                if table is not None and model.offload.decode_path_in_force != BOTH and not all_resident(model):
                    raise SystemExit(f"--split-table: variant {name} decodes on the path "
                                     f"{model.offload.decode_path_in_force}, not \"both\", where the fixed tables hold")
                trial = first_trial_steps(model)
                warm = max(warmup, trial + SETTLE_AFTER_TRIAL if trial else 0)
                counted = decoder_counts(model)
                if trace:
                    rate = traced_decode(model, prompt, tokens, warm, seed=100 + r)
                else:
                    rate, _rows = decode(model, prompt, tokens, warmup=warm)
                rates[name].append(rate)
                if details is not None:
                    ahead, beside, again = (after - before for after, before in zip(decoder_counts(model), counted))
                    details[name].append({**engine_figures(model), "layers_ahead": ahead, "layers_beside": beside,
                                          "steps_run_again": again, "fixed_tables": fixed_tables(model, table)})
    finally:
        if defaults is not None:  # as found: the next budget's rounds take their defaults from here
            set_switches(model, defaults)
        if table is not None:  # the engine's own again
            model.offload.fix_split_tables(None)
    return rates


def fixed_tables(model: LoadedModel, table) -> str | None:
    """Which of fix_split_table's tables a round decoded under: "split" (a variant with engine.row_split on) or
    "whole"; None without --split-table (the engine's own), and where every expert is resident (no decode step has a
    cold pair for a table to split)."""
    if table is None or all_resident(model):
        return None
    return "split" if model.offload.row_split else "whole"


def decoder_counts(model: LoadedModel) -> tuple[int, int, int]:
    """The decoder's counts so far of layers launched ahead, of layers whose host part the worker did and of steps
    run again (engine/decoder.py)."""
    return model.decoder.layers_ahead, model.decoder.layers_beside, model.decoder.steps_run_again


def first_trial_steps(model: LoadedModel) -> int:
    """Decode steps until the decode path's first trial after a reconfiguration has ended, where trials choose the
    path (decode path auto with a host tier; 0 elsewhere). A variant timed before then is timed on whichever path
    the trial measures at that moment (the thirty-third session's placement A/B timed mostly the CPU path so), or
    right after it switched (SETTLE_AFTER_TRIAL)."""
    engine = model.offload
    return engine.path_trials.first_trial_steps if engine is not None and engine.path_trials_run() else 0


def variant_help() -> str:
    """--a's help: the items a variant may hold (variant, switches, layer_split, decode_path)."""
    integers = [f"{prefix}NAME=INT" for prefix in SWITCH_PREFIXES if prefix not in NUMBER_PREFIXES + ("dense.",)]
    switched = integers + [f"{prefix}NAME=NUMBER" for prefix in NUMBER_PREFIXES] + [
        f"{name}=0|1" for name in DENSE_SWITCHES]
    return (f"configuration A, comma-separated items: offload entries KEY=VALUE (short or full names); switches set "
            f"after each reconfiguration: {', '.join(switched)} (a switch only the other variant names keeps its "
            f"default); split={'|'.join(SPLIT_MODES)} (default {SPREAD}); path={'|'.join(PATH_MODES)} (default "
            f"MOE_DECODE_PATH from the environment, else auto; under --split-table {BOTH}, the only one allowed); "
            f"'' = the defaults")


def summary(rates: dict[str, list[float]]) -> dict:
    ratios = [b / a for a, b in zip(rates["A"], rates["B"])]
    return {"a_median": statistics.median(rates["A"]), "b_median": statistics.median(rates["B"]),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "a": rates["A"], "b": rates["B"]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt-oss-20b-like",
                        help="the writer-made model's shape (bench_offload's)")
    parser.add_argument("--device", choices=["cuda", "simulated"], default="cuda",
                        help="the CUDA card, or the simulated device (its \"device\" compute on the CPU)")
    parser.add_argument("--dtype", choices=["float32", "float16"], default="float16",
                        help="activations and KV cache (float16 lets the dense part run on the GPU)")
    parser.add_argument("--layers", type=int, help="fewer layers than the shape has (quick runs)")
    parser.add_argument("--folder", help="write the model here (default: a temporary folder); reused if present")
    parser.add_argument("--fractions", default="0.25,0.5", help="resident fractions, comma-separated")
    parser.add_argument("--a", default="", help=variant_help())
    parser.add_argument("--b", required=True, help="configuration B, its items as --a's")
    parser.add_argument("--rounds", type=int, default=6,
                        help="rounds at each fraction, A then B in even rounds and B then A in odd ones (the ratio "
                             "B / A is taken in each round)")
    parser.add_argument("--decode-tokens", type=int, default=16, help="decode steps timed for each variant in a round")
    parser.add_argument("--decode-warmup", type=int, default=32,
                        help="decode steps before the timed ones, after each reconfiguration: what the engine "
                             "measures as it runs settles in them (decode path \"both\" timed its start-up table with "
                             "4: RESULTS.md, thirtieth session); more where the decode path's trials run, until "
                             f"{SETTLE_AFTER_TRIAL} steps after the first has ended")
    parser.add_argument("--trace", action="store_true", help="route every decode step by a realistic trace")
    parser.add_argument("--split-table", help="under \"both\": 'first' (the tables the engine makes from A's "
                                              "warm-up, kept for every round: with a pair split by rows, and whole "
                                              "pairs for a variant with engine.row_split=0) or the CPU's pairs per "
                                              "cold count (0,0,1,1,2); default: the engine's own, made again as its "
                                              "measured rates move")
    parser.add_argument("--no-write", action="store_true", help="print only (no result file)")
    args = parser.parse_args(argv)
    changes = {"A": variant(args.a), "B": variant(args.b)}
    chosen = {"A": switches(args.a), "B": switches(args.b)}
    splits = {"A": layer_split(args.a), "B": layer_split(args.b)}
    paths = {name: fixed_tables_path(name, text) if args.split_table else decode_path(text)
             for name, text in (("A", args.a), ("B", args.b))}
    table = split_table(args.split_table)

    model, prompt = open_model(args.shape, args.layers, args.folder, args.dtype, args.device, "bench-offload-ab-")
    print(f"A: {args.a or 'defaults'}   B: {args.b}   dense part on the {model.dense_device}", flush=True)
    figures, results = [], {}

    def write(failed: dict | None = None) -> Path | None:
        """The result file with the fractions measured so far (and the one that failed, where one did)."""
        if args.no_write:
            return None
        return write_result(f"offload-ab-{args.shape}", figures,
                            config={"a": changes["A"], "b": changes["B"], "a_switches": chosen["A"],
                                    "b_switches": chosen["B"], "a_split": splits["A"], "b_split": splits["B"],
                                    "a_path": paths["A"], "b_path": paths["B"],
                                    "rounds": args.rounds, "trace": args.trace, "decode_warmup": args.decode_warmup,
                                    "split_table": args.split_table, "decode_tokens": args.decode_tokens,
                                    "device": args.device, "per_fraction": results},
                            failed=failed)

    for fraction in [float(f) for f in args.fractions.split(",")]:
        budget = int(fraction * all_resident_bytes(model.folder.experts))
        details = {"A": [], "B": []}
        try:
            result = summary(paired_rounds(model, budget, changes, args.rounds, prompt, args.decode_tokens, chosen,
                                           splits, args.trace, args.decode_warmup, details, paths, table))
        except (Exception, SystemExit) as exc:
            # a later fraction may be refused (on a real card, no room left for the tier's mappings): the fractions
            # measured before it are kept, written with the fraction that failed and why
            why = str(exc) if isinstance(exc, SystemExit) else f"{type(exc).__name__}: {exc}"
            print(f"{fraction:5.0%}  failed: {why}", flush=True)
            path = write({"fraction": f"{fraction:.2f}", "error": why}) if figures else None
            if path is not None:
                print(f"wrote {path} (the fractions before it)", flush=True)
            raise
        results[f"{fraction:.2f}"] = {**result, "a_rounds": details["A"], "b_rounds": details["B"],
                                      "split_tables": details.get("tables")}
        print(f"{fraction:5.0%}  A {result['a_median']:6.1f} tok/s   B {result['b_median']:6.1f} tok/s   "
              f"B / A per round: median {result['ratio_median']:.3f} (min {result['ratio_min']:.3f}, "
              f"max {result['ratio_max']:.3f}, {counted(args.rounds, 'round')})", flush=True)
        if details.get("tables"):
            for line in tables_lines(details["tables"]):
                print(f"       {line}", flush=True)
        for name in ("A", "B"):
            print(f"       {last_round_line(name, details[name][-1])}", flush=True)
        figures.append({"name": f"decode B / A at {fraction:.0%} resident", "value": result["b_median"],
                        "unit": "tokens/s", "reference": "configuration A, alternating rounds in the same process",
                        "reference_value": result["a_median"], "ratio": result["ratio_median"]})
        path = write()  # after every fraction: a run stopped by its time limit keeps the fractions it finished
    if path is not None:
        print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
