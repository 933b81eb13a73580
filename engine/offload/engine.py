"""The offload engine: owns each expert node's device slots, the placement policy and the
statistics; re-plans on a loaded model when budgets change."""

from __future__ import annotations

import difflib
import functools
import gc
import hashlib
import json
import math
import os
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import numpy as np
import psutil

from engine.errors import ModelFileError, WorkbenchError, one_line
from engine.expert_node import CpuExpertNode
from engine.offload.approximate import ApproximationCounts
from engine.kernel_threads import KernelThreads
from engine.offload.config import OffloadConfig
from engine.offload import decode_path as paths
from engine.offload.decode_path import (BOTH, CPU, TIER, DecodePathTrials, HostGap, TierReadRate, checked_path,
                                        default_decode_path)
from engine.offload.dense_landing import DenseLanding
from engine.offload.device_memory import DeviceMemoryError
from engine.offload.devices import TIER_READ_SHARE
from engine.offload.host_cache import HostExpertCache, file_backing_refusal
from engine.offload.layer_split import SPREAD, WHOLE, LayerSplitTrials, checked_split, default_layer_split
from engine.offload.miss_policy import CopyReuse, CpuRate, cpu_bytes_per_s, miss_slots
from engine.offload.placement import (AdaptivePlacement, LayerSlots, StaticPlacement, Swap, adaptive_scores,
                                      counts_any, make_policy)
from engine.offload.planner import OffloadPlan, OffloadPlanError, plan_offload, split_choosable
from engine.offload.projection import is_simulated
from engine.offload.staging import NO_STAGING, plan_staging
from engine.offload.spike_gate import SpikeGate
from engine.offload.split_share import RowSplitTrials, SplitShareTrials, shifted
from engine.offload.streaming import StreamingPlan, plan_streaming
from engine.offload.stats import OffloadStats
from engine.offload.swap_allowance import SwapAllowance
from engine.onnx_file import DataFileChanged
from engine.units import counted
from kernels.cold_split import ROW_STEP, cpu_take_table, fc1_share, split_tables
from kernels.gpu.host_tier import HostTierError


def load_popularity(path: str, names: list[str], experts: list[int]) -> list[np.ndarray | None]:
    """popularity_file: JSON {node name: [count per expert]}; None for a node it leaves out (static placement measures
    that node's routing over its opening, as one it counts 0 throughout; adaptive placement starts it from no
    counts)."""
    return read_popularity(path, names, experts)[0]


def popularity_statement(path: str, rows: list[np.ndarray | None], names: list[str], placement: str,
                         slots: list[int] | None = None) -> str:
    """What the plan says of a popularity file that leaves some expert nodes out or counts 0 for every expert of some,
    and under static placement, of nodes where it counts fewer experts than the plan gives them `slots` ('' where
    there is nothing to say)."""
    said = []
    left = [name for name, row in zip(names, rows) if row is None]
    zero = [name for name, row in zip(names, rows) if row is not None and not counts_any(row)]
    if left or zero:
        named = [name for name, row in zip(names, rows) if counts_any(row)]
        how = ("static placement measures the other {} over its opening" if placement == "static" else
               "adaptive placement starts the other {} from no counts")
        which = _some_names(left)
        if zero:  # named in the file, with no count to tell one expert from another
            which = (f"left out: {which}; " if left else "") + f"0 for every expert: {_some_names(zero)}"
        said.append(f"{path} counts {len(named)} of {len(names)} expert nodes"
                    f"{f' ({_some_names(named)})' if named else ''}; {how.format(len(left) + len(zero))} ({which}).")
    short = [name for name, row, count in zip(names, rows, slots or ())
             if placement == "static" and counts_any(row) and np.count_nonzero(row) < count < row.size]
    if short:  # (StaticPlacement tops the file's choice up)
        said.append(f"{path} counts fewer experts than the layer has slots in {counted(len(short), 'expert node')} "
                    f"({_some_names(short)}): static placement places the counted ones at once and fills the slots "
                    "left with the experts its opening measures routed most.")
    return " ".join(said)


def _some_names(names: list[str]) -> str:
    """'a', or 'a', 'b', or 'a' … 'z'."""
    if len(names) > 2:
        return f"'{names[0]}' … '{names[-1]}'"
    return ", ".join(f"'{name}'" for name in names)


def read_popularity(path: str, names: list[str], experts: list[int]) -> tuple[list[np.ndarray | None], str]:
    """load_popularity's counts, and the SHA-256 of the file's bytes they were read from (a run's record keeps it)."""
    try:
        raw = Path(path).read_bytes()
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise WorkbenchError(f"{path}: cannot read the popularity file (not UTF-8 text: {exc.reason} at byte "
                             f"{exc.start})") from None
    except json.JSONDecodeError as exc:  # read, but not JSON: "cannot read" sent users to its permissions
        said = "is empty" if not raw.strip() else f"is not valid JSON ({exc})"
        raise WorkbenchError(f"{path}: the popularity file {said}") from None
    except (OSError, ValueError) as exc:  # ValueError: an integer past Python's digit limit
        # (an OSError's own words name the path again: "[Errno 2] No such file or directory: '/m/p.json'")
        said = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise WorkbenchError(f"{path}: cannot read the popularity file ({said})") from None
    if not isinstance(data, dict):
        raise WorkbenchError(f"{path}: the popularity file holds a JSON {type(data).__name__}, not an object of node "
                             "names to counts per expert")
    unknown = [name for name in data if name not in names]  # else left uniform, unsaid
    if len(unknown) > 1:  # not a typo: a file made for another model (of the same family: more layers)
        shown = ", ".join(f"'{name}'" for name in unknown[:2]) + (", …" if len(unknown) > 2 else "")
        ours = (f"this model's {len(names)} expert nodes: '{names[0]}' … '{names[-1]}'" if names
                else "this model has no expert node to place")
        raise WorkbenchError(f"{path}: the popularity file names {len(unknown)} nodes this model does not have "
                             f"({shown}): made for another model? ({ours})")
    for name in unknown:
        near = difflib.get_close_matches(name, names, n=1)
        raise WorkbenchError(f"{path}: the popularity file names '{name}', which is no expert node of this model"
                             + (f" (did you mean '{near[0]}'?)" if near else f" (they are {', '.join(names)})"))
    return ([_popularity_row(path, name, data[name], count) if name in data else None
             for name, count in zip(names, experts)], hashlib.sha256(raw).hexdigest())


def _popularity_row(path: str, name: str, row, count: int) -> np.ndarray:
    """A node's counts per expert from the popularity file: `count` finite numbers >= 0 (the times routing chose each
    expert, or shares of them: placement only ranks experts by them). The first that is none is named, with its
    expert: a row holds 128."""
    if not isinstance(row, list):
        raise WorkbenchError(f"{path}: node '{name}' has {json.dumps(row)[:80]}, not a list of counts per expert")
    if len(row) != count:
        raise WorkbenchError(f"{path}: node '{name}' has {len(row)} counts, the node has {count} experts")
    for expert, value in enumerate(row):
        wrong = "not a count (a number >= 0)"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an integer too large for a float (a negative one is no count at all)
                number = math.inf if value > 0 else -math.inf
            if math.isfinite(number) and number >= 0:
                continue
            if number == math.inf:  # (JSON's Infinity, and a float past the largest, 1e400, which reads as it)
                wrong = "too large a count"
        shown = json.dumps(value)
        shown = shown if len(shown) <= 40 else f"{shown[:40]}… ({len(shown)} characters)"
        raise WorkbenchError(f"{path}: node '{name}' has {shown} for expert {expert}, {wrong}")
    return np.asarray(row, dtype=np.float64)


# The miss slots are weighed when the placement is made, again at its second safe point (the CPU kernels' rate and
# a copy's host time measured by then: slots filled at load, a first step's misses), then every 16.
MISS_SLOTS_FIRST, MISS_SLOTS_EVERY = 2, 16
SPLIT_TABLE_EVERY = 16  # "both" decode steps between two cold_split_table's from the measured rates
# "both" decode steps after a switch to it before the table is made again from what its own steps measured (the
# tier's reads, the host's gap: unmeasured at the switch); the trials' settle, so a trial's window times that table
SPLIT_TABLE_FIRST = 4
# "both" decode steps, after it came into force or a re-plan, whose CPU parts the split's rate does not count: on the
# H200 the parts of the first steps after a switch ran up to 10x slower (the engine thread's OpenMP pool still
# spinning beside the worker's, GOMP_SPINCOUNT; a new tier's first reads), and the table made from them at
# SPLIT_TABLE_FIRST gave the CPU almost nothing for the trial's whole window (RESULTS.md, forty-second session)
SPLIT_RATE_SKIP = 3
# deferred accounts a layer takes at most (OffloadEngine.settle): one a layer keeps up with a host that runs ahead of
# the GPU; two let it catch up after a slower layer
SETTLE_PER_LAYER = 2
SETTLE_WAIT_S = 0.5  # settle_all_but's longest wait for the GPU before the step's last segment
# The fastest rate of one more miss a CpuRate's line may give, in the host's streaming reads as the device measured
# them at its opening (CpuRate.ceiling): cache-hot calls ran up to 1.4x cold ones (bench_cpu_scaling, RESULTS.md,
# first and seventy-first sessions) and the streaming read moved by up to 1.45x between processes on one host (88-128
# GB/s); a line past both is noise (1301 GB/s against ~120 streaming on the H100 host, seventy-first session)
CPU_RATE_CEILING = 2.0


class OffloadEngine(DenseLanding):
    def __init__(self, runners: list[CpuExpertNode], config: OffloadConfig, device, layer_split: str | None = None,
                 decode_path: str | None = None, kernel_threads: KernelThreads | None = None,
                 dense_on_device: bool = False, dense_cpu: str | None = None,
                 arena_refusal: Callable[[int], str | None] | None = None):
        self.runners = runners
        self.dense_on_device = dense_on_device  # where mode=disabled puts every expert (plan_offload)
        # why the dense part runs on the CPU (None: on the device): on a CUDA card no host tier is made then
        # (decode_path.tier_verdict); dense_landed says where the load put it
        self.dense_cpu = dense_cpu
        # why the load would keep the dense part on the CPU were the plan to leave it the given bytes of the device
        # (ort_env.dense_refusal; None: not known before the load sizes onnxruntime's arena)
        self.arena_refusal = arena_refusal
        # the arena check's refusal beside the host tier where the load put the dense part on the card without the
        # tier (dense_landed): its arena holds the room the tier's mappings would take for as long as the model is
        # loaded, so re-plans make no tier either and say why as the load's plan did (None: the load made no such
        # choice)
        self.arena_over_tier: str | None = None
        # the runners' CPU kernel threads (cpu_threads; 0: automatic): the decoder's, whose safe points move them
        self.kernel_threads = kernel_threads if kernel_threads is not None else KernelThreads(runners)
        self.infos = [runner.info for runner in runners]
        self.device = device
        self.host_cache = HostExpertCache(runners[0].source if runners else None, self.infos,
                                          config.host_expert_bytes)
        self.prefault = None  # the load's ExpertPrefault, where host memory is unbounded (LoadedModel sets it)
        # LoadedModel._start_unbounded_work, weakly held: starts the prefault and the page-locked mapping again
        self.start_unbounded_work: Callable[[], Callable | None] = lambda: None
        self.stats = OffloadStats()
        self.shadow = False
        self.approximation = ApproximationCounts()
        self.stats.reset(len(runners), [info.spec.num_experts for info in self.infos])
        self.config = config
        self._check_file_backing(config)
        self._apply_file_backing()
        self.staging = NO_STAGING  # the pinned ring and the device's prefill staging ring
        # the budget spread over every layer or spent on whole layers (layer_split.py): measured by trials under
        # "auto"; "spread" / "whole" fix it (the CLI's --layer-split, or MOE_LAYER_SPLIT where none is given)
        self.layer_split_mode = checked_split(layer_split or default_layer_split())
        # a pair split by rows between the CPU and the GPU under "both" (cold_split_rows), where row_trials find it
        # faster; MOE_ROW_SPLIT=0: whole pairs
        self.row_split = os.environ.get("MOE_ROW_SPLIT", "1") != "0"
        self.split_trials = LayerSplitTrials()
        self.whole_layers = self.layer_split_mode == WHOLE
        # where decode computes cold experts (decode_path.py): on the CPU, on the GPU from the host tier, or both at
        # once; under "auto" chosen from cpu_execution, by trials under its auto; "cpu" / "tier" / "both" fix it (the
        # CLI's --decode-path, or MOE_DECODE_PATH where none is given)
        self.decode_path_mode = checked_path(decode_path or default_decode_path())
        self.path_trials = DecodePathTrials()
        self._host_tier = False  # see host_tier
        self.reads_tier = False  # decode steps read cold experts from the host tier now (decode_path_in_force)
        self.splits_cold = False  # ... and the CPU computes a share of them at once (decode path "both")
        self._split_tables: dict = {}  # cold_split_table's, by expert size; made again as the rates move
        self.share_trials = SplitShareTrials()  # ... shifted by a pair as "both" steps say (split_share)
        self.row_trials = RowSplitTrials()  # ... with a pair split by rows where its steps run faster (ditto)
        self.fixed_split_tables = None  # fix_split_tables': every layer's tables given, with no share or row trials
        self._split_tables_due = SPLIT_TABLE_FIRST  # "both" decode steps until they are made again
        self.tier_read = TierReadRate()  # the GPU's reads from the tier in "both" steps (cold_split_table)
        self.host_gap = HostGap(measured=not is_simulated(device))  # the host's work between "both" layers (ditto)
        # the CPU's parts of "both" steps (a few experts a call, beside the GPU's reads of the tier), for the split's
        # table: a regime of their own, apart from the CPU path's calls of every cold expert
        self.split_rate = self._new_cpu_rate()
        self.split_gate = SpikeGate(self.split_rate)  # ... a step at a time, short slowdowns left out (spike_gate)
        # The last step's CPU parts not yet handed to the split's rate: the gate's end_step waits for the next settle()
        # (the next step's first layer is launched by then), since at a step's end the GPU idles. At Qwen3-30B-A3B-like
        # 50% on the H100 machine it took ~170 µs there, its arrays cold after the step's expert reads.
        self._gate_due = False
        self._split_rate_skip = 0  # "both" decode steps left whose parts split_rate does not count (SPLIT_RATE_SKIP)
        self._tier_bytes = 0  # page-locked host memory the tier maps, while there is one
        self.tier_statement = ""  # what the plan says about the host tier ('' where none was wanted)
        self._decode_mark: tuple | None = None  # the decode phase's totals at the last safe point (_trial_seconds)
        self._choosable: tuple | None = None  # (the plan, whether its split is choosable): _split_is_choosable
        self.plan: OffloadPlan = self._plan(config)
        self.arena_beside_every_expert(self.plan.device_bytes(self.infos))  # (before any slot is made)
        self.slots = [LayerSlots(info.spec.num_experts, self.plan.slots[info.name]) for info in self.infos]
        # Nodes the GPU kernels cannot run (info.gpu_unsupported, decided by the planner's check) get no device
        # store: they run all on the CPU, prefill waves and miss copies included.
        tier = self._tier_choice(config)  # made with the tier: the stores start without slots, made once below
        self.stores = [device.create_slots(runner, 0 if tier else self.plan.slots[info.name])
                       if device is not None and info.gpu is not None else None
                       for info, runner in zip(self.infos, runners)]
        for layer, store in enumerate(self.stores):
            if hasattr(store, "after_file_read"):  # it reads the mapped file on the host (copies; the stand-in)
                store.after_file_read = functools.partial(self.host_cache.release_after_read, layer)
        if tier:
            self._try_host_tier(config)
        if self.tier_statement:
            self.plan.statements.append(self.tier_statement)
        self._follow_path()
        self.streaming = self._plan_streaming(config)
        # the CPU kernels' measured rate on decode misses, for the miss policy
        self.cpu_rate = self._new_cpu_rate()
        self.copy_reuse = CopyReuse([info.spec.num_experts for info in self.infos])  # later hits copies earned
        # False: adaptive placement leaves no slot to copied misses (every slot wanted for a resident), from the next
        # weighing on; a benchmark switch (bench_offload_ab's engine.weigh_miss_slots=0), the weighing on by default
        self.weigh_miss_slots = True
        # statistics of this step that wait for the device's work (HybridExpertNode: fully resident layers, results
        # merged on the device), oldest first: (ready, account) pairs, see defer()
        self.deferred: deque = deque()
        popularity, self.popularity_sha256 = self._popularity(config)
        self._make_policy(popularity)
        self._say_popularity(config, popularity)
        self.swap_allowance = SwapAllowance()
        self._apply_cpu_threads()
        self.stats.pinned = self.pinned_info()

    def _new_cpu_rate(self) -> CpuRate:
        """A CPU rate held to the host's streaming read the device measured: its ceiling (CPU_RATE_CEILING times it),
        and the stream a line mostly of fixed cost is kept under (CpuRate.stream). Neither on the simulated device,
        whose bandwidths are assumed while its CPU kernels' calls are this machine's (a test's assumed 1 MB/s would
        refuse every line), nor without a device: the fit's own checks alone."""
        if self.device is None or is_simulated(self.device):
            return CpuRate()
        stream = self.device.bandwidths.cpu
        return CpuRate(ceiling=CPU_RATE_CEILING * stream, stream=stream)

    @property
    def host_tier(self) -> bool:
        """Whether every device store has the host tier: the experts in no GPU slot in page-locked host memory, which
        decode launches read on the GPU (GpuQMoE's host tier, kernels/gpu/host_tier.py), so that a layer's step needs
        no host round trip (HybridExpertNode). decode_path.py says when the engine makes it (set_decode_path)."""
        return self._host_tier

    def _tier_choice(self, config: OffloadConfig) -> bool:
        """Whether the plan in force under `config` gets the host tier (decode_path.py); tier_statement says what the
        plan tells the user about it."""
        # (asked before the stores are made: a re-plan has released them, and a released tier's memory with them)
        made, self.tier_statement = paths.tier_verdict(self.decode_path_mode, config, self.infos, self.plan.slots,
                                                       getattr(self.device, "kind", None), paths.host_available(),
                                                       self.device, self.dense_cpu, self.arena_over_tier)
        return made

    # the dense part's landing (dense_landing.DenseLanding: dense_landed, arena_beside_every_expert) on this engine
    def _on_card(self) -> bool:
        return getattr(self.device, "kind", None) == "cuda"

    def _arena_check(self, ahead: int = 0) -> str | None:
        return self.arena_refusal(self.device.memory.available - ahead) if self.arena_refusal is not None else None

    def _plan_for_dense(self) -> None:
        self.plan = self._plan(self.config)

    def _replan_for_dense(self) -> None:
        self.reconfigure(self.config)

    def _say_of_tier(self, said: str) -> None:
        if self.tier_statement:
            self.plan.statements[self.plan.statements.index(self.tier_statement)] = said
            self.tier_statement = said

    def _try_host_tier(self, config: OffloadConfig) -> bool:
        """Every store made again with the host tier (for `config`, the configuration being put in force); where the
        driver refuses its mappings or the device cannot hold them, the plan is made again for no tier (_plan_untiered)
        and tier_statement says why. Whether the tier was made."""
        try:
            self._make_stores(True)
        except (HostTierError, DeviceMemoryError) as exc:
            self._plan_untiered(config)
            self.tier_statement = f"{paths.without_tier(config)}: the host tier could not be made ({exc})."
            return False
        self._tier_bytes = sum(store.host_tier_bytes for store in self.stores if store is not None)
        self.tier_statement = paths.tier_sentence(self.decode_path_mode, config, self._tier_bytes)
        return True

    def _plan_untiered(self, config: OffloadConfig) -> None:
        """The plan in force made again for no host tier, its stores with it: the one made for the tier said what the
        tier's device mappings take and, under an automatic budget, left them room the slots now get."""
        for store in self.stores:
            if store is not None:
                store.release()
        self._release_staging()
        self.plan = self._plan(config, tier=False)
        for index, info in enumerate(self.infos):
            self.slots[index].resize(self.plan.slots[info.name])
        self._make_stores(False)

    def _switch_path(self) -> None:
        """After a trial switched the decode path: reads_tier follows, and the miss slots are weighed again (no slot
        is left to copied misses while the GPU reads them all)."""
        self._follow_path()
        self._weigh_miss_slots()

    def _follow_path(self, replanned: bool = False) -> None:
        """reads_tier and splits_cold as the decode path in force says (`replanned`: after a re-plan)."""
        in_force = self.decode_path_in_force
        self.reads_tier = in_force in paths.ASKED_TIER
        splits = in_force == BOTH
        if splits and (replanned or not self.splits_cold):
            self._split_rate_skip = SPLIT_RATE_SKIP
            # the tables from the rates as they are (after a re-plan, which started the share and row trials again,
            # not with their last choices)
            self._split_tables.clear()
        if splits and not self.splits_cold:  # ... and soon from the step's own
            self._split_tables_due = SPLIT_TABLE_FIRST
            # and the host's gap measured afresh: one that gave the CPU nothing would keep every layer on the tier's
            # step, where no gap is measured, for as long as "both" is in force (a trial of it included)
            self.host_gap.clear()
        self.splits_cold = splits

    def cold_split_table(self, layer: int) -> np.ndarray:
        """Under the decode path "both": how many of a token's c cold pairs the CPU takes in this layer's decode steps
        (kernels/cold_split.py), from the CPU kernels' rate as measured in the engine (CpuRate: a call's fixed cost and
        the rate of one more expert, each under whatever else the machine reads meanwhile) against the GPU's reads from
        the host tier as measured in these steps (TierReadRate; until then TIER_READ_SHARE of the measured PCIe
        bandwidth), the host's own work between two such layers on the CPU's side (HostGap); per expert size, made
        again every few decode steps as the measured rates and gap move; shifted by the share trials' choice
        (split_share.py)."""
        return self._split_pair_tables(layer)[0]

    def cold_split_rows(self, layer: int) -> np.ndarray | None:
        """Under the decode path "both": the rows of a token's split pair per count of its cold pairs beside
        cold_split_table's share (kernels/cold_split.py: split_tables; 0 where none is split), made with it; None where
        the layer's store splits no pair (its GPU decode kernels), where the row trials keep pairs whole
        (split_share.py: RowSplitTrials) or the environment's MOE_ROW_SPLIT is 0 (benchmarks' A/Bs)."""
        return self._split_pair_tables(layer)[1]

    def _split_pair_tables(self, layer: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(cold_split_table, cold_split_rows) of a layer, made from the costs (_split_costs) and kept per expert
        size: the share and the split pair's rows chosen together where the layer's store splits pairs."""
        if self.fixed_split_tables is not None:
            return self.fixed_split_tables(layer)
        splits_rows = self.row_split and self.row_trials.splits and getattr(self.stores[layer], "splits_rows", False)
        return self._made_tables(layer, splits_rows)

    def _made_tables(self, layer: int, splits_rows: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """The layer's tables from the costs with the share trials' shift, with a pair split by rows or whole pairs
        only (split_tables_from_costs), kept per expert size until they are made again."""
        info, store = self.infos[layer], self.stores[layer]
        key = (info.bytes_per_expert, store.read_bytes, info.spec.k, splits_rows)
        tables = self._split_tables.get(key)
        if tables is None:
            take, rows = self.split_tables_from_costs(layer, splits_rows)
            tables = self._split_tables[key] = (shifted(take, self.share_trials.shift), rows)
        return tables

    def fix_split_tables(self, tables) -> None:
        """Under "both": every layer's (cold_split_table, cold_split_rows) from `tables(layer)`, not made from the costs
        measured, and no share or row trials meanwhile: tables given ignore their shift and split, which copy_state
        would report as in force, and their ways would be timed for nothing (benchmarks' A/Bs that must differ by
        one thing: bench_offload_ab --split-table). None: the engine's own tables and trials again, from the start."""
        self.fixed_split_tables = tables
        self.share_trials, self.row_trials = SplitShareTrials(), RowSplitTrials()
        self._split_tables.clear()

    def split_tables_from_costs(self, layer: int, split_rows: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """(share, rows) as the costs measured now (_split_costs, the host's gap) make them, before the share trials'
        shift: with `split_rows` the share and a split pair's rows chosen together (kernels/cold_split.py:
        split_tables), else whole pairs only (cpu_take_table; rows None)."""
        info = self.infos[layer]
        costs = (*self._split_costs(layer), self.host_gap.value)
        if not split_rows:
            return cpu_take_table(info.spec.k, *costs), None
        in_part = getattr(self.runners[layer].kernel, "reads_rows_in_part", False)
        return split_tables(info.spec.k, info.spec.inter_size, ROW_STEP, *costs, fc1_share(info.spec.gated),
                            cpu_reads_fc2_whole=not in_part)

    def _split_costs(self, layer: int) -> tuple[float, float, float]:
        """The split's costs in this layer (seconds): the CPU's a cold expert (at the rate the miss policy prices it at,
        CpuRate.priced) and a call, the GPU's a cold expert read from the tier."""
        info, store = self.infos[layer], self.stores[layer]
        bandwidths = self.device.bandwidths
        rate, fixed_s = self.split_cpu_rate.priced(bandwidths.cpu)
        tier_bytes_per_s = self.tier_read.value or TIER_READ_SHARE * bandwidths.pcie
        return (info.bytes_per_expert / cpu_bytes_per_s(bandwidths, rate), fixed_s, store.read_bytes / tier_bytes_per_s)

    @property
    def split_cpu_rate(self) -> CpuRate:
        """The CPU's rate the split's table is made from: its parts' in "both" steps once measured, else the CPU
        path's calls'."""
        return self.split_rate if self.split_rate.value is not None else self.cpu_rate

    def cpu_rate_state(self, rate: CpuRate) -> dict:
        """What `rate` prices a CPU miss at: {"cpu_bytes_per_s": the rate in force (CpuRate.priced, at most the host's
        streaming read), "cpu_measured_bytes_per_s": the rate measured (CpuRate.value), both None until measured,
        "cpu_call_s": a call's fixed seconds in force, "cpu_measured_call_s": the measured line's (CpuRate.fixed_s; both
        0 until fitted)}. Where the stream holds the line, its fixed cost is made again through the calls' mean."""
        measured, measured_call_s = rate.value, rate.fixed_s
        in_force, call_s = ((measured, measured_call_s) if self.device is None
                            else rate.priced(self.device.bandwidths.cpu))
        return {"cpu_bytes_per_s": in_force, "cpu_measured_bytes_per_s": measured, "cpu_call_s": call_s,
                "cpu_measured_call_s": measured_call_s}

    def observe_split_part(self, nbytes: int, seconds: float) -> None:
        """A "both" step's CPU part of `nbytes` of experts took `seconds` (not counted in its first steps)."""
        if not self._split_rate_skip:
            self.split_gate.observe(nbytes, seconds)

    @property
    def decode_path_in_force(self) -> str:
        """"tier" where decode steps read cold experts from the host tier now, "both" where the CPU also computes a
        share of them, else "cpu". A decode path asked for wins over cpu_execution, which says what "auto" does
        (decode_path.tier_wanted): disabled reads from the tier (the CPU computes none), auto takes what the trials
        chose."""
        if not self._host_tier or self.decode_path_mode == CPU:
            return CPU
        if self.config.cpu_execution == "disabled":
            return TIER  # "both" too: the CPU computes no expert
        if self.decode_path_mode in paths.ASKED_TIER:
            return self.decode_path_mode
        return self.path_trials.choice

    @property
    def trials_pending(self) -> bool:
        """A trial is timing its ways now, or a first one since the last re-plan is still to come: the decode path's
        (where trials choose it), the CPU's share's under "both" (it starts once "both" is in force), the pair split by
        rows' (under "both", where the split's tables split a pair: _row_trials_run), the layer split's (auto, no host
        tier, a split to choose); or static placement is still counting routing before it chooses, or copying its
        choice in (its slots hold copied misses meanwhile). Until none is, decode steps time the ways the engine tries,
        not the one it keeps (a sweep's point, a benchmark's timed steps wait for that)."""
        if self.device is None:
            return False  # no device, no trials (end_step)
        if self._trial_measuring:
            return True
        if isinstance(self.policy, StaticPlacement) and (self.policy.opening or self.policy.to_place()):
            return True
        return ((self.path_trials_run() and self.path_trials.trials == 0)
                or (self.splits_cold and self.fixed_split_tables is None and self.share_trials.trials == 0)
                or (self.splits_cold and self.fixed_split_tables is None and self.row_trials.trials == 0
                    and self._row_trials_run())
                or (self.layer_split_mode == "auto" and not self._host_tier and self._split_is_choosable()
                    and self.split_trials.trials == 0))

    @property
    def _trial_measuring(self) -> bool:
        """One of the trials is timing its ways now."""
        return any(trials.measuring for trials in (self.path_trials, self.split_trials, self.share_trials,
                                                    self.row_trials))

    def hold_trials(self, steps: int) -> None:
        """No trial starts for at least `steps` decode steps (one under way is not cut): a sweep point's answers, after
        the first trials at its budget, run on the ways those chose, where a later trial's windows of the other ways
        would fall in some of its runs and not others. A re-plan starts the trials afresh."""
        for trials in (self.split_trials, self.path_trials, self.share_trials, self.row_trials):
            if not trials.measuring:
                trials.hold(steps)

    def pending_words(self) -> str:
        """What trials_pending waits for, as the end of 'decoding until ...' (the window's progress while a sweep point
        or a side-by-side comparison settles)."""
        if not self._trial_measuring and isinstance(self.policy, StaticPlacement):
            if self.policy.opening:
                return "static placement has counted its opening's routing"
            if self.policy.to_place():
                return "static placement's residents are copied in"
        return "the engine's trials of its ways are over"

    def rows_choosable(self) -> bool:
        """A pair may be split by rows under "both" (row_trials choose whether): MOE_ROW_SPLIT is not 0 and the
        device's stores split pairs (their decode kernels) of experts with more than ROW_STEP intermediate rows
        (split_tables splits at a multiple of it below them: with fewer, the trials would time whole pairs twice)."""
        return self.row_split and next(self._row_split_layers(), None) is not None

    def _row_split_layers(self):
        """The layers whose pairs may be split by rows (rows_choosable), first to last."""
        return (layer for layer, (info, store) in enumerate(zip(self.infos, self.stores))
                if getattr(store, "splits_rows", False) and info.spec.inter_size > ROW_STEP)

    def _row_trials_run(self) -> bool:
        """A pair may be split by rows (rows_choosable) and a row trial ran, runs now, or would start: the split's
        tables split a pair (_tables_split_a_pair)."""
        return self.rows_choosable() and (self.row_trials.trials > 0 or self.row_trials.measuring
                                          or self._tables_split_a_pair())

    def _tables_split_a_pair(self) -> bool:
        """Whether the split's tables as the costs measured now make them split a pair at some count of cold pairs in
        a layer whose pairs may be split: where none does, the split runs whole pairs as the other way does, and a
        row trial would time the same steps twice."""
        return any(self._made_tables(layer, True)[1].any() for layer in self._row_split_layers())

    def path_trials_run(self) -> bool:
        """The decode path is chosen by trials: cpu_execution=auto, decode path auto, a host tier made."""
        return self._host_tier and self.decode_path_mode == "auto" and self.config.cpu_execution == "auto"

    def _make_stores(self, host_tier: bool) -> None:
        """Every store made again with (or without) the host tier, at the plan's slot counts, the residents copied
        back."""
        self._host_tier = host_tier
        for info, store in zip(self.infos, self.stores):
            if store is not None:
                store.host_tier = host_tier
                store.resize(self.plan.slots[info.name])
        self._reload_residents()

    def copy_state(self) -> dict:
        """The miss policy's measured state: the slots each layer keeps for copied misses, the later hits a copy
        earns (None until enough copies were made), the decode streaming slots of each layout (streaming.py), and
        what it prices the CPU's misses at (cpu_rate_state: bytes per second of a miss in force and as measured, None
        until measured, and seconds per kernel call, 0 until fitted); whether adaptive placement's swaps are paused
        for earning too few hits (None: another placement); the layer split (with the layers whose every expert has a
        slot) and the decode path, each with its trials' state (and under "both", the CPU's share of the cold pairs);
        the CPU kernels' threads (KernelThreads.state)."""
        judge = getattr(self.policy, "judge", None)  # adaptive placement's: whether its swaps pay (swap_judge.py)
        return {"miss_slots": list(self.policy.miss_slots), "later_hits_per_copy": self.copy_reuse.value,
                "placement": None if judge is None else judge.state(), "static_placement": self._static_state(),
                "streaming_slots": [group.num_slots for group in self.streaming.groups],
                **self.cpu_rate_state(self.cpu_rate),
                "layer_split": {"mode": self.layer_split_mode, "whole_layers": self.whole_layers,
                                "layers_whole": sum(layer.num_slots == layer.num_experts for layer in self.slots),
                                **self.split_trials.state()},
                "decode_path": {"mode": self.decode_path_mode, "in_force": self.decode_path_in_force,
                                "host_tier": self._host_tier, "cold_split": self._cold_split_state(),
                                **self.path_trials.state()},
                "cpu_threads": self.kernel_threads.state()}

    def _static_state(self) -> dict | None:
        """Under static placement (StaticPlacement): the tokens its opening still counts before every layer has chosen
        its residents (0 once all have; a layer's pairs left over its top-k), and the chosen experts not yet copied in
        (at safe points, within the swap allowance); per layer, the slots its choice leaves to copied misses (an
        opening that counted fewer experts than the layer has slots, or a popularity file's counts while its opening
        tops their choice up; 0 before the layer has chosen). None under adaptive placement."""
        policy = self.policy
        if not isinstance(policy, StaticPlacement):
            return None
        tokens = [math.ceil(policy.opening_left(index) / info.spec.k) for index, info in enumerate(self.infos)]
        return {"opening_tokens_left": max(tokens, default=0), "to_place": policy.to_place(),
                "unchosen_slots": [policy.unchosen_slots(index) for index in range(len(self.slots))]}

    def _layer_tables(self) -> list[dict]:
        """Every device layer's split tables under "both", each distinct one once with the layers that use it, in the
        order of their first layer: [{"layers": [0, 1, ...], "cpu_takes": [...], "split_rows": [...] or None,
        "inter_size": the layers' intermediate rows, which split_rows split}] (layers of another expert size, or fixed
        tables of their own, differ from the first's)."""
        found: dict[tuple, list[int]] = {}
        for layer, store in enumerate(self.stores):
            if store is not None:
                take, rows = self._split_pair_tables(layer)
                key = (tuple(take.tolist()), None if rows is None else tuple(rows.tolist()),
                       self.infos[layer].spec.inter_size)
                found.setdefault(key, []).append(layer)
        return [{"layers": layers, "cpu_takes": list(take), "split_rows": None if rows is None else list(rows),
                 "inter_size": inter} for (take, rows, inter), layers in found.items()]

    def _cold_split_state(self) -> dict | None:
        """Under the decode path "both": how many of a token's cold pairs the CPU takes (the first device layer's
        table: cpu_takes[c] of c cold; every layer's, as distinct tables with their layers: "tables"), the GPU's
        measured rate reading the tier (None until measured), the host's measured work between two such layers
        (HostGap) and the share trials' state with the shift in force; the CPU's rate the table comes from
        (split_cpu_rate, as cpu_rate_state says it) and the slow steps that rate left out (spike_gate); where a pair
        may be split by rows and the row trials run (_row_trials_run), their state with whether the split is in force.
        Under tables fixed (fix_split_tables): "fixed" true, and no share or rows (no trials ran)."""
        if not self.splits_cold:
            return None
        fixed = self.fixed_split_tables is not None
        layer = next((index for index, store in enumerate(self.stores) if store is not None), None)
        rows = None if layer is None else self.cold_split_rows(layer)
        return {"cpu_takes": None if layer is None else self.cold_split_table(layer).tolist(),
                "split_rows": None if rows is None else rows.tolist(), "tables": self._layer_tables(),
                "inter_size": None if layer is None else self.infos[layer].spec.inter_size,
                **self.cpu_rate_state(self.split_cpu_rate),
                "tier_read_bytes_per_s": self.tier_read.value, "host_gap_s": self.host_gap.value,
                "slow_steps_left_out": self.split_gate.left_out,
                "fixed": fixed, "share": None if fixed else {"shift": self.share_trials.shift,
                                                             **self.share_trials.state()},
                "rows": None if fixed or not self._row_trials_run() else {"splits": self.row_trials.splits,
                                                                          **self.row_trials.state()}}

    def stats_dict(self) -> dict:
        """The statistics (OffloadStats.as_dict) and copy_state(): for records and --json."""
        return {**self.stats.as_dict(), **self.copy_state()}

    def _check_file_backing(self, config: OffloadConfig) -> None:
        """allow_file_backing=0 keeps every expert in host RAM, which host_expert_bytes and the memory available (with
        what the experts already copied there hold) must hold."""
        if not config.allow_file_backing:
            held = sum(info.weight_bytes for info, runner in zip(self.infos, self.runners) if runner.in_memory)
            refusal = file_backing_refusal(config, sum(info.weight_bytes for info in self.infos),
                                           psutil.virtual_memory().available + held)
            if refusal:
                raise OffloadPlanError(refusal)

    def _apply_file_backing(self) -> None:
        for runner in self.runners:
            runner.set_file_backing(self.config.allow_file_backing)
        if not self.config.allow_file_backing:
            # the copies' reads left the file's pages mapped beside them (the experts twice in RSS), and each read maps
            # pages around it (fault-around, a large folio), the tensor copied before among them: released once all
            # are copied
            for runner in self.runners:
                runner.release_file_pages()

    def _copy_into_ram(self, config: OffloadConfig) -> None:
        """allow_file_backing=0 set on the loaded model: every node's experts copied into host RAM before the plan
        changes (_apply_file_backing then releases the file's pages). A copy that fails midway (the host ran short of
        memory since _check_file_backing, a read of the file failed) puts every node back on the mapped file and is
        refused in one line: the configuration in force stays, whole."""
        if config.allow_file_backing or not self.config.allow_file_backing:
            return  # nothing to copy: file backing stays allowed, or the experts are in RAM already
        try:
            for runner in self.runners:
                runner.set_file_backing(False)
        except (MemoryError, OSError) as exc:
            self._back_on_file()
            raise WorkbenchError(f"allow_file_backing=0: copying the experts into host memory failed "
                                 f"({str(exc) or type(exc).__name__}); the configuration in force stays") from None

    def _back_on_file(self) -> None:
        """Every node as the configuration in force has it: copies made for a re-plan that failed dropped."""
        for runner in self.runners:
            runner.set_file_backing(self.config.allow_file_backing)

    def _apply_cpu_threads(self) -> None:
        """cpu_threads for the CPU expert kernels (0: automatic, engine/kernel_threads.py); from the next step on."""
        self.kernel_threads.request(self.config.cpu_threads)

    def _take_staging(self, config: OffloadConfig) -> None:
        """The staging rings `config` asks for (none under mode=disabled)."""
        if self.device is not None and config.mode != "disabled":
            self._reserve_staging(config)
        elif self.device is not None:
            self.device.set_pinned_ring(0)

    def _plan(self, config: OffloadConfig, tier: bool = True) -> OffloadPlan:
        """Reserve the staging ring, then plan the slots in what the device has left; for a host tier where one is
        planned (decode_path.tier_planned), unless `tier` is False."""
        self._take_staging(config)
        tier = tier and self.arena_over_tier is None and paths.tier_planned(
            self.decode_path_mode, config, self.infos, getattr(self.device, "kind", None), paths.host_available(),
            self.dense_cpu)
        plan = plan_offload(config, self.infos, self.device, whole_layers=self.whole_layers,
                            dense_on_device=self.dense_on_device, host_tier=tier, dense_cpu=self.dense_cpu)
        if self.device is not None and config.mode != "disabled":
            plan.statements.extend(self.staging.statements(cold=plan.leaves_cold))
        return plan

    def _plan_streaming(self, config: OffloadConfig, restoring: StreamingPlan | None = None) -> StreamingPlan:
        """The decode streaming slots of layers without an expert slot (streaming.py), once the slots and the host tier
        are made: none where every decode step reads cold experts from the tier (decode_path.fixed_tier_path; under
        the trials the CPU path may come into force at any trial, so they are kept through their switches). Their
        sentences go into the plan's, unless `restoring`: the slots of the plan in force again after a re-plan that
        failed (its sentences said already), made for the decode path it was made for."""
        tier_path = (paths.fixed_tier_path(self.decode_path_mode, self._host_tier) if restoring is None
                     else restoring.tier_path)
        streaming = plan_streaming(config, self.runners, [layer.num_slots for layer in self.slots], self.device,
                                   tier_path)
        if restoring is None:
            self.plan.statements.extend(streaming.statements)
        return streaming

    @property
    def wave_experts(self) -> int:
        """Cold experts streamed to the device per prefill wave (0: no waves)."""
        return self.staging.wave_experts

    def _gpu_runners(self) -> list[CpuExpertNode]:
        """The nodes whose experts can go on the device (the GPU kernels run their layout)."""
        return [runner for runner in self.runners if runner.info.gpu is not None]

    def _staged_expert_bytes(self) -> int:
        return max((self.device.staging_bytes_per_expert(runner) for runner in self._gpu_runners()), default=0)

    def _reserve_staging(self, config: OffloadConfig) -> None:
        """Take the pinned ring and the device's prefill staging ring (staging.plan_staging)."""
        largest_slot = max((runner.info.device_bytes_per_expert for runner in self._gpu_runners()), default=0)
        ring = getattr(self.device, "pinned", None)
        held = ring.capacity if getattr(ring, "kind", "") == "pinned" else 0  # page-locked now, replaced by the new
        layer_experts = max((runner.info.spec.num_experts for runner in self._gpu_runners()), default=0)
        staging = plan_staging(config, self._staged_expert_bytes(), largest_slot, self.device.memory.available,
                               psutil.virtual_memory().available + held, layer_experts)
        self.device.memory.reserve(staging.device_bytes, "prefill staging ring")
        self.staging = staging  # only once reserved: _release_staging gives back what it holds
        self.device.set_pinned_ring(staging.pinned_bytes)

    def _release_staging(self) -> None:
        """Releases the device's staging ring; the pinned ring stays until the next plan sizes it
        (kept when its size does not change, so a re-plan does not re-allocate pinned memory)."""
        if self.device is not None:
            self.device.memory.release(self.staging.device_bytes, "prefill staging ring")
        self.staging = NO_STAGING

    def pinned_info(self) -> dict:
        """The pinned staging ring: bytes, in_use, high_water, bytes_copied, copies ({} without one); with the host
        tier, host_tier_bytes: the page-locked host memory its mappings hold."""
        ring = getattr(self.device, "pinned", None)
        info = ring.info() if ring is not None else {}
        if self._host_tier:
            info["host_tier_bytes"] = self._tier_bytes
        return info

    def _make_policy(self, popularity: list[np.ndarray | None] | None, scores: list[np.ndarray] | None = None) -> None:
        """The placement policy, from the popularity file's counts where one is set (_popularity), with `scores` (what
        the placement learnt before a re-plan) when given.
        Adaptive placement's slots are filled now, best-scored experts first (lowest ids where nothing is known
        yet): left empty, they would fill one swap at a time within the swap allowance, ~100 decode steps for
        a gpt-oss-20b-sized model at 25% (seen on the H200). Static placement without a popularity file chooses its
        residents from the routing its opening counts and copies them in at safe points (StaticPlacement), as it does
        in a layer the file leaves out; a re-plan keeps the counts it measured (`scores`; not a popularity file's,
        taken off or changed: in a layer the same counts place, what its opening measured to top their choice up), and
        its layers past their opening choose for the new slots at once (those whose slots it keeps keep their
        choice)."""
        before = getattr(self, "policy", None)
        self.policy = make_policy(self.config.placement, self.slots, popularity)
        if scores is not None and self.config.placement == "adaptive" and len(scores) == len(self.policy.scores):
            # (static placement's counts, where the placement changed, scaled as a popularity file's are)
            self.policy.scores = scores if isinstance(before, AdaptivePlacement) else adaptive_scores(scores)
        elif (scores is not None and isinstance(before, StaticPlacement) and isinstance(self.policy, StaticPlacement)
              and len(scores) == len(self.policy.scores)):
            policy = self.policy
            for index, from_file in enumerate(policy.from_file):  # the layers it measured, measured still
                if from_file != before.from_file[index] or (
                        from_file and not np.array_equal(policy.file_counts[index], before.file_counts[index])):
                    continue
                # measured alike (by the opening, or by it topping the same counts' choice up): the counts hold
                policy.scores[index], policy.counted[index] = scores[index], before.counted[index]
                if before.chosen[index] is not None and before.chosen_for[index] == self.slots[index].num_slots:
                    # its slots kept: its residents stay (they never move), not chosen again from the counts, and the
                    # experts its opening chose (or counts to choose) for the slots a file's counts leave stay too
                    policy.chosen[index], policy.chosen_for[index] = before.chosen[index], before.chosen_for[index]
                    policy.topping_up[index] = before.topping_up[index]
        self._weigh_miss_slots()
        self._steps = 0  # safe points (end_step) since the placement was made: the miss slots are weighed again
        if popularity is not None or self.config.placement == "adaptive":
            self._apply(self.policy.initial())
        else:  # layers with a slot for every expert (all of them when all_resident) are filled now, and static
            # placement's layers past their opening (counts kept over a re-plan) choose for their new slots now
            self._apply(self._fill_all())
            self._apply(self.policy.rebalance())

    def _popularity(self, config: OffloadConfig) -> tuple[list[np.ndarray | None] | None, str | None]:
        """The popularity file's counts and SHA-256 (read_popularity); (None, None) where none is set."""
        if not config.popularity_file:
            return None, None
        return read_popularity(config.popularity_file, [i.name for i in self.infos],
                               [i.spec.num_experts for i in self.infos])

    def _say_popularity(self, config: OffloadConfig, popularity: list[np.ndarray | None] | None) -> None:
        """The plan says which expert nodes the popularity file leaves out, where it does (popularity_statement) and
        experts are placed (not where every one is resident)."""
        if popularity is None or self.plan.placement_mode != "hybrid":
            return
        said = popularity_statement(config.popularity_file, popularity, [i.name for i in self.infos], config.placement,
                                    [layer.num_slots for layer in self.slots])
        if said:
            self.plan.statements.append(said)

    def _weigh_miss_slots(self) -> None:
        """Per layer, the slots placement leaves to the miss policy's copies (miss_policy.miss_slots, placement.py),
        from the measured bandwidths, the CPU kernels' measured rate and the host time a copy took to issue. Only
        under adaptive placement: static placement wants the residents it chose (popularity) in every slot.
        None where the CPU computes no misses (cpu_execution=disabled), where a layer has no slot or a slot per
        expert, or without a device."""
        chosen, weighed = [], {}
        adaptive = self.config.placement == "adaptive"
        for index, (info, store) in enumerate(zip(self.infos, self.stores)):
            layer = self.slots[index]
            spec = info.spec
            if (not adaptive or not self.weigh_miss_slots or store is None or self.config.cpu_execution == "disabled"
                    or self.reads_tier or layer.num_slots == 0 or layer.num_slots >= spec.num_experts):
                chosen.append(0)
                continue
            key = (layer.num_slots, spec.num_experts, spec.k, info.bytes_per_expert, store.expert_bytes,
                   store.read_bytes, info.flops_per_token)
            if key not in weighed:
                # each split priced as the hybrid node prices its steps' misses (miss_policy.decode_costs)
                cpu_rate, cpu_fixed_s = self.cpu_rate.priced(self.device.bandwidths.cpu)
                weighed[key] = miss_slots(self.device.bandwidths, info.bytes_per_expert, layer.num_slots,
                                          spec.num_experts, spec.k, prepare_s=getattr(store, "prepare_s", 0.0),
                                          copy_bytes=store.expert_bytes, read_bytes=store.read_bytes,
                                          cpu_rate=cpu_rate, reuse=self.copy_reuse.value, cpu_fixed_s=cpu_fixed_s,
                                          flops_per_token=info.flops_per_token,
                                          launch_s=getattr(store, "launch_s", 0.0))
            chosen.append(weighed[key])
        self.policy.miss_slots = chosen

    def _fill_all(self):
        swaps = []
        for index, layer in enumerate(self.slots):
            if layer.expert_in.size < layer.slot_of.size:
                continue
            cold = iter(np.flatnonzero(layer.slot_of < 0))
            for slot in np.flatnonzero(layer.expert_in < 0):
                expert = int(next(cold))
                layer.place(int(slot), expert)
                swaps.append(Swap(index, int(slot), None, expert))
        return swaps

    def _apply(self, swaps, placed: bool = True) -> list[float]:
        """Make the swaps; each one's host seconds. `placed`: placement's own (counted as fills where the slot was
        empty, else as swaps; static placement's all as fills, since it never moves a resident of its own: it copies its
        chosen experts over copied misses), not residents copied back into resized slots."""
        spent = []
        static = placed and isinstance(self.policy, StaticPlacement)  # (residents copied back: before a policy is made)
        for swap in swaps:
            seconds = self.stores[swap.layer].load(swap.slot, swap.loaded)
            layer = self.stats.layers[swap.layer]
            layer.copy_bytes += self.stores[swap.layer].expert_bytes  # the expert in the kernels' layout
            layer.copy_s += seconds
            if placed and (swap.evicted is None or static):
                layer.fills += 1
            elif placed:
                layer.swaps += 1
            spent.append(seconds)
        return spent

    def defer(self, account, ready) -> None:
        """Take `account` (a step's statistics read from the device) once `ready()` says, without waiting, that the
        device's work it reads is done: in a later layer's settle(), or at the latest at the step's end."""
        self.deferred.append((ready, account))

    def settle(self, most: int = SETTLE_PER_LAYER) -> int:
        """Take up to `most` of the deferred accounts whose device work is done, oldest first; returns how many. A
        layer calls it once its own work is issued: with every expert resident the host runs ahead of the GPU, and the
        accounts taken at the step's end ran while the GPU sat idle (26 µs a layer of a 127 µs layer on the H200
        machine, Qwen3-30B-A3B-like, RESULTS.md sixteenth session); taken here, they fit in the host's slack while the
        GPU works."""
        if self._gate_due:  # (before this step's first account: the gate's steps stay apart)
            self._end_gate_step()
        deferred = self.deferred
        taken = 0
        while taken < most and deferred and deferred[0][0]():
            deferred.popleft()[1]()
            taken += 1
        return taken

    def settle_all_but(self, leave: int = 1, timeout_s: float = SETTLE_WAIT_S) -> None:
        """Take the deferred accounts as their device work ends, until at most `leave` are left (or `timeout_s` has
        passed: the rest stay for end_step). The decoder calls it before the step's last dense segment, whose run
        waits for the logits: the host launches the layers far ahead of the GPU, so settle() found few accounts
        ready during the step and end_step took the rest with the GPU idle (16-19 of 24 on the H100 machine, ~30 µs
        each). The accounts left behind keep the GPU busy while the last segment is launched."""
        deadline = time.perf_counter() + timeout_s
        while len(self.deferred) > leave and time.perf_counter() < deadline:
            if not self.settle(1):
                time.sleep(0)  # (a worker thread between two calls of its loop may want the GIL)

    @contextmanager
    def exact_routing(self):
        """Within: no approximate routing, no placement moves, no statistics (the agreement
        meter's shadow pass)."""
        saved = self.shadow
        self.shadow = True
        try:
            yield
        finally:
            self.shadow = saved

    @property
    def approximating(self) -> bool:
        return self.config.approximate_routing and not self.shadow

    def end_step(self, step_s: float | None = None, tokens: int = 1) -> None:
        """A safe point between decoder steps of `tokens` tokens: placement may move experts now, within the swap
        allowance earned by the step's `step_s` seconds (None: without a limit), or the layer split's trials
        (layer_split.py) re-plan the slots. The trials time a step with the accounts it left for here: a path whose
        host runs ahead of the GPU (the tier) leaves most of them, one whose host waits for each layer ("both") takes
        them within the step, and the next step starts after them either way."""
        if self.shadow:
            return
        accounts_started = time.perf_counter()
        if self._gate_due:  # no settle() since the last step's end
            self._end_gate_step()
        for _ready, account in self.deferred:
            account()
        self.deferred.clear()
        self._gate_due = True
        if step_s is not None:
            step_s += time.perf_counter() - accounts_started
        self.host_gap.step_ended()
        self.stats.end_step()
        self.copy_reuse.end_step()
        if self.device is not None:
            trial_s = self._trial_seconds(step_s)
            if (trial_s is not None and self.path_trials_run() and not self.split_trials.measuring
                    and not self.share_trials.measuring and not self.row_trials.measuring):
                if self.path_trials.step(trial_s, tokens) is not None:
                    self._switch_path()
                    return
            # the CPU's share of the cold pairs, while "both" is in force and no trial of the path is under way
            # and whether a pair is split by rows: the two trials take turns (split_share.py); none under tables fixed
            if (trial_s is not None and self.splits_cold and not self.path_trials.measuring
                    and self.fixed_split_tables is None):
                if not self.row_trials.measuring and self.share_trials.step(trial_s, tokens) is not None:
                    self._split_tables.clear()  # made again at once with the share now in force
                    # and no step of the row trial's next window before the switch settled (as each trial settles
                    # after its own)
                    self.row_trials.hold(self.row_trials.settle)
                    return
                if not self.share_trials.measuring and self.rows_choosable():
                    if self.row_trials.due and not self._tables_split_a_pair():
                        # no trial where the split's tables split no pair; asked again once they are made again
                        self.row_trials.hold(SPLIT_TABLE_EVERY)
                    elif self.row_trials.step(trial_s, tokens) is not None:
                        self._split_tables.clear()  # ... with the split or without it
                        # and no step of the share trial's next window before the switch settled: its wait may
                        # have run out while the row trial timed
                        self.share_trials.hold(self.share_trials.settle)
                        return
            # the layer split's trials only without a host tier: no layer's step then has a host round trip to save
            if (trial_s is not None and self.layer_split_mode == "auto" and not self._host_tier
                    and self._split_is_choosable()):
                wanted = self.split_trials.step(trial_s, tokens)
                if wanted is not None:
                    try:
                        self._set_whole_layers(wanted == WHOLE)
                    except Exception as exc:  # refused, or the driver or the host's memory failing it: the plan in
                        # force stays (_replan restored it), with no more trials, and decoding goes on under it; but
                        # not past a data file cut short or written to in place since the load (the re-plan's first
                        # check refuses both): the next step would read past its end (SIGBUS), or the rest of the
                        # answer come from weights other than the loaded model's (the next answer's first check
                        # refuses them), so the answer stops here with that refusal
                        self.layer_split_mode = WHOLE if self.whole_layers else SPREAD
                        refused, happened = self._file_refusal()
                        self.plan.statements.append(self._split_failed(wanted, exc, happened))
                        if refused is not None:
                            raise refused from None
                    return
            self._steps += 1
            if self._steps % MISS_SLOTS_EVERY == MISS_SLOTS_FIRST:
                self._weigh_miss_slots()
            if self.splits_cold:
                self._split_rate_skip = max(self._split_rate_skip - (tokens == 1), 0)
                self._split_tables_due -= 1
                if self._split_tables_due <= 0:
                    self._split_tables.clear()
                    self._split_tables_due = SPLIT_TABLE_EVERY
            limit = None if step_s is None else self.swap_allowance.grant(step_s)
            if limit != 0 and self.host_cache.source is not None:
                # placement's moves copy experts from the mapped file: past the end of a data file cut short since
                # the step's check a read kills the process (SIGBUS), and one written to in place since would put
                # other weights than the loaded model's in the slots, so the answer stops here by name, before
                # placement changes its tables (the step's check: one fstat a file, ~4 µs on the dev VM; none where
                # nothing may move)
                self.host_cache.source.check_mapped_files()
            self.swap_allowance.spent(self._apply(self.policy.rebalance(limit)))
            self.stats.pinned = self.pinned_info()

    def _end_gate_step(self) -> None:
        self._gate_due = False
        self.split_gate.end_step()

    def _trial_seconds(self, step_s: float | None) -> float | None:
        """A step's seconds as the layer split's trials compare them: the wall time, or on the simulated device the
        card's (projection.py: the stand-in's and the CPU's expert time replaced by the step's critical path), from
        the decode phase's totals since the last safe point (the step's deferred accounts are in by now)."""
        decode = self.stats.phases["decode"]
        mark = (decode, decode.cpu_s, decode.standin_s, decode.critical_s)
        last, self._decode_mark = self._decode_mark, mark
        if step_s is None or not is_simulated(self.device) or last is None or last[0] is not decode:
            return step_s  # no projection, or the statistics were reset since: the wall time
        return step_s - (mark[1] - last[1]) - (mark[2] - last[2]) + (mark[3] - last[3])

    def _split_is_choosable(self) -> bool:
        """planner.split_choosable for the plan in force, worked out once per plan (asked at every safe point)."""
        if self._choosable is None or self._choosable[0] is not self.plan:
            self._choosable = (self.plan, split_choosable(self.config, self.plan, self.infos) > 0)
        return self._choosable[1]

    def _file_refusal(self) -> tuple[ModelFileError | None, str | None]:
        """The refusal naming a mapped data file cut short or written to in place since the load, and what happened
        to it in a few words (None, None where neither did)."""
        source = self.host_cache.source
        if source is None:
            return None, None
        try:
            source.check_mapped_files()
        except DataFileChanged as exc:
            return exc, exc.change
        return None, None

    def _split_failed(self, wanted: str, exc: Exception, stops: str | None = None) -> str:
        """What the plan in force says once the re-plan the layer split's trials asked for (`wanted`) failed; `stops`:
        the answer stopped there, a data file having been cut short or written to in place (those words)."""
        kept = "whole layers" if self.whole_layers else "the budget spread over every layer"
        asked = "whole layers" if wanted == WHOLE else "the budget spread over every layer"
        failed = one_line(exc, self.config.mode)
        if stops:
            return (f"The layer split's trials asked for {asked}, and the re-plan failed ({failed}): the answer "
                    f"stopped there, before a step read the data file {stops}; the plan keeps {kept}, with no more "
                    "trials.")
        return (f"The layer split's trials asked for {asked}, and the re-plan failed ({failed}): decode goes on with "
                f"{kept}, with no more trials.")

    def _set_whole_layers(self, whole: bool) -> None:
        """Re-plan the same configuration with the budget on whole layers or spread (at a safe point)."""
        if whole == self.whole_layers:
            return
        self.whole_layers = whole
        try:
            self._replan(self.config)
        except BaseException:
            self.whole_layers = not whole
            raise

    def set_layer_split(self, mode: str) -> None:
        """"auto" (trials decide, from spread), "spread" or "whole" (fixed); re-plans where the split changes. A re-plan
        that fails leaves the split and its trials as they were, with the plan: they say what the layers run."""
        in_force = (self.layer_split_mode, self.split_trials)
        self.layer_split_mode = checked_split(mode)
        self.split_trials = LayerSplitTrials()
        try:
            self._set_whole_layers(mode == WHOLE)
        except BaseException:
            self.layer_split_mode, self.split_trials = in_force
            raise

    def set_decode_path(self, mode: str) -> None:
        """"auto", "cpu", "tier" or "both" (decode_path.py): a re-plan of the configuration in force makes or drops the
        host tier where that changes it; the trials start again. "tier" or "both" where the tier cannot be made (no
        device, the host's memory, the driver): a WorkbenchError saying why, the path as it was (where putting it back
        fails too, the error says that as well and the path asked stays)."""
        mode, before = checked_path(mode), self.decode_path_mode
        if mode in paths.ASKED_TIER and self.device is None:
            raise WorkbenchError(f"decode path '{mode}' needs a GPU (CUDA or simulated): it reads the experts from "
                                 f"host memory")
        self.reconfigure(self.config, decode_path=mode)
        if mode in paths.ASKED_TIER and not self._host_tier and self.tier_statement:
            refused = f"decode path '{mode}': {self.tier_statement}"
            try:
                self.reconfigure(self.config, decode_path=before)
            except Exception as exc:  # the refusal is still the answer to what was asked; the path asked stays
                failed = one_line(exc, self.config.mode)
                raise WorkbenchError(f"{refused} Decode path '{before}' could not be put back ({failed}), so '{mode}' "
                                     f"stays, without the tier.") from exc
            raise WorkbenchError(refused)

    def reconfigure(self, config: OffloadConfig, layer_split: str | None = None,
                    decode_path: str | None = None) -> None:
        """Apply new budgets or policy on the loaded model, without reloading; `layer_split` ("auto", "spread" or
        "whole") changes the split and `decode_path` ("auto", "cpu", "tier" or "both", decode_path.py) the decode path
        in the same re-plan. Under "auto" the trials start again, from the budget spread over every layer and from the
        host tier. A re-plan that fails (refused, or the device, the driver or the host's memory failing it) leaves the
        split, the decode path and their trials as they were, with the plan."""
        in_force = (self.layer_split_mode, self.decode_path_mode, self.whole_layers, self.split_trials,
                    self.path_trials, self.share_trials, self.row_trials)
        if layer_split is not None:
            self.layer_split_mode = checked_split(layer_split)
        if decode_path is not None:
            self.decode_path_mode = checked_path(decode_path)
        self.split_trials = LayerSplitTrials()
        self.path_trials = DecodePathTrials()
        self.share_trials = SplitShareTrials()
        self.row_trials = RowSplitTrials()
        self.whole_layers = self.layer_split_mode == WHOLE
        try:
            self._replan(config)
        except BaseException:
            (self.layer_split_mode, self.decode_path_mode, self.whole_layers, self.split_trials, self.path_trials,
             self.share_trials, self.row_trials) = in_force
            raise

    def _replan(self, config: OffloadConfig) -> None:
        if config.gpu_device_mem_limit != self.config.gpu_device_mem_limit:
            raise WorkbenchError("gpu_device_mem_limit can only change when the model is loaded again")
        # a re-plan reads the mapped experts (residents copied into the new slots, the copy into RAM, the host tier):
        # past the end of a data file cut short since the load, a read kills the process (SIGBUS)
        if self.host_cache.source is not None:
            self.host_cache.source.check_mapped_files()
        self._check_file_backing(config)
        popularity, digest = self._popularity(config)  # a file it cannot read refused before the plan changes
        self._copy_into_ram(config)  # ... and so is a copy of the experts into RAM that fails
        # what a re-plan that fails puts back (_restore_plan); tier_statement: _tier_choice says the new plan's before
        # its stores are made
        in_force = (self.config, self.plan, self.tier_statement, self._host_tier, self.streaming, self.policy,
                    self.reads_tier, self.splits_cold, [layer.expert_in.copy() for layer in self.slots])
        self.streaming.close()
        held_tier = self._host_tier
        for store in self.stores:  # release first so the new plan sees the whole budget
            if store is not None:
                store.release()
        if held_tier:
            gc.collect()  # the old tier's page-locked memory freed before a new one is made, were it held in a cycle
        self._release_staging()
        try:
            self.plan = self._plan(config)
        except BaseException:  # the old configuration stays in force
            self._restore_plan(in_force)
            raise
        if config.host_expert_bytes is not None:
            self._end_unbounded_work("host_expert_bytes was bounded on the loaded model (locked pages stay in memory "
                                     "whatever the bound)")
        elif not config.allow_file_backing:
            self._end_unbounded_work("allow_file_backing=0 was set on the loaded model (its experts are copied into "
                                     "RAM, where copies read them; the file's pages leave)")
        elif self.plan.placement_mode == "all_resident":
            self._end_unbounded_work("every expert is now resident on the GPU, so nothing is copied from the file "
                                     "(fewer resident page-locks it again)")
        for index, info in enumerate(self.infos):
            self.slots[index].resize(self.plan.slots[info.name])
        # the popularity file edited since it was read (the same path holding other bytes: re-applied to take them)
        edited = (digest is not None and config.popularity_file == self.config.popularity_file
                  and digest != self.popularity_sha256)
        try:
            self._put_in_force(config, popularity, edited)
        except BaseException:  # the device had less free than the plan counted on (another process took some), the
            # plan made again without a tier the driver refused failed (_try_host_tier), or a copy, the driver or the
            # host's memory failed the streaming slots, the file backing or the placement
            self._restore_plan(in_force)
            self._resume_unbounded_work()  # (ended above for the plan refused)
            raise
        self._say_popularity(config, popularity)
        self.popularity_sha256 = digest  # the file's bytes that placed the residents (a run's record keeps it)
        if edited:
            self.plan.statements.append(f"{config.popularity_file} changed since it was read: its new counts placed "
                                        "the residents afresh.")
        self._apply_cpu_threads()
        self._resume_unbounded_work()
        self.stats.pinned = self.pinned_info()

    def _put_in_force(self, config: OffloadConfig, popularity: list[np.ndarray | None] | None, edited: bool) -> None:
        """The re-plan's stores (with the host tier where it gets one), streaming slots, file backing and placement,
        once its plan is made and the slots resized to it."""
        if self._tier_choice(config):
            self._try_host_tier(config)
        else:
            self._make_stores(False)
        if self.tier_statement:
            self.plan.statements.append(self.tier_statement)
        self.streaming = self._plan_streaming(config)
        # what adaptive placement learnt so far still holds, unless a popularity file is set, changed, `edited` since
        # it was read or the placement changes: its counts then place the residents afresh, as at a load with it
        # (static placement would never move the old ones)
        placed_anew = bool(config.popularity_file) and (config.popularity_file != self.config.popularity_file or edited
                                                         or config.placement != self.config.placement)
        # (static placement keeps what it measured in the layers the file leaves out: _make_policy)
        static = config.placement == "static"
        old_scores = None if placed_anew and not static else self.policy.scores
        if placed_anew:
            for index, layer in enumerate(self.slots):  # emptied: _make_policy fills them from the file
                if static and not counts_any(popularity[index]):
                    continue
                slots = layer.num_slots
                layer.resize(0)
                layer.resize(slots)
        self.config = config
        self._follow_path(replanned=True)  # the miss slots are weighed with the policy below
        self.host_cache.set_budget(config.host_expert_bytes)
        self._apply_file_backing()
        self._make_policy(popularity, old_scores)

    def _resume_unbounded_work(self) -> None:
        """The population and the page-locked mapping started again where the configuration in force wants them and
        they are stopped: back from every expert resident, a host bound or file backing off (or loaded so; they start
        only where LoadedModel._prefault_pays says they pay), or after a re-plan that stopped them and failed.
        Prefill waves, swaps and copied misses read the file again, and through the pinned ring a 2,048-token prefill
        at 25% took 2.3x as long (RESULTS.md, fifty-fifth session). Started once the plan is in force, as load starts
        them once the engine is made: the registration's memory check then counts the host tier's page-locked memory
        (started before the tier, neither check counted the other's)."""
        if self.prefault is None:
            start = self.start_unbounded_work()
            if start is not None:
                start(self.config, self.device)

    def _restore_plan(self, in_force: tuple) -> None:
        """The configuration in force again after a re-plan that failed (`in_force`: _replan's): its config, file
        backing (_copy_into_ram's copies dropped), host budget, plan (whose sentences said it already) and what it says
        of the host tier, staging ring, slots and their residents, host tier, placement, decode path in force and
        streaming slots."""
        (self.config, plan, said, host_tier, streaming, self.policy, self.reads_tier, self.splits_cold,
         residents) = in_force
        self.streaming.close()  # (the failed plan's, where it made them)
        self.host_cache.set_budget(self.config.host_expert_bytes)
        self._back_on_file()
        for store in self.stores:
            if store is not None:
                store.release()
        self._release_staging()
        self._take_staging(self.config)
        self.plan, self.tier_statement = plan, said
        self._host_tier = host_tier
        for layer, store, kept in zip(self.slots, self.stores, residents):
            layer.resize(0)
            layer.resize(kept.size)
            for slot in np.flatnonzero(kept >= 0):
                layer.place(int(slot), int(kept[slot]))
            if store is not None:
                store.host_tier = host_tier
                store.resize(kept.size)
        self._reload_residents()
        # (reconfigure puts the decode path back only once this has run)
        self.streaming = self._plan_streaming(self.config, restoring=streaming)

    def _end_unbounded_work(self, why: str) -> None:
        """host_expert_bytes bounded, file backing turned off, or every expert made resident on the loaded model: what
        load started because the file's pages could stay in host memory (and be read) ends before the host cache drops
        them (set_budget) or the copy into RAM releases them (_apply_file_backing), or they would stay: the prefault,
        which maps pages in behind the cache's count, and the page-locked file mapping (register_experts), whose pages
        madvise cannot release (nor should copies read it once the experts are in RAM, or once none is copied). A
        re-plan with neither a bound nor file backing off, and fewer than every expert resident, starts both again
        (reconfigure)."""
        if self.prefault is not None:
            self.prefault.stop()
            self.prefault = None
        if getattr(self.device, "host_registration", None) is not None:
            self.device.unregister_experts(why)

    def _reload_residents(self) -> None:
        """Resized slots start empty on a real device: copy the kept residents back in."""
        for index, layer in enumerate(self.slots):
            if self.stores[index] is not None:
                self._apply([Swap(index, slot, None, int(expert))
                             for slot, expert in enumerate(layer.expert_in) if expert >= 0], placed=False)

    def resident_map(self) -> list[np.ndarray]:
        """Per layer, a bool per expert: resident on the device."""
        return [layer.slot_of >= 0 for layer in self.slots]

    def slots_left_to_copies(self) -> list[int]:
        """Per layer, the slots placement leaves to copied misses: adaptive placement's miss slots, or those static
        placement's choice leaves (an opening that counted fewer experts than the layer has slots, or a popularity
        file's counts until its opening tops them up), and every slot of a layer whose opening has not chosen yet (no
        popularity file, or a node it leaves out): placement has put nothing there, what they hold are copied misses,
        not residents."""
        policy = self.policy
        if isinstance(policy, StaticPlacement):
            return [slots.num_slots if policy.chosen[index] is None and policy.opening_left(index) else
                    policy.unchosen_slots(index) for index, slots in enumerate(self.slots)]
        return list(policy.miss_slots)

    def resident_experts(self) -> int:
        """The experts placement keeps in device slots now, as the landed statement counts them: not the slots it
        leaves to copied misses, whatever they hold (the misses copied last, by this answer or an earlier one, as the
        miss policy's timings chose)."""
        return sum(min(int(np.count_nonzero(layer.expert_in >= 0)), layer.num_slots - left)
                   for layer, left in zip(self.slots, self.slots_left_to_copies()))
