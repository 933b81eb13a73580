"""Where a decode step's misses run: on the CPU, or copied over PCIe into a spare device slot and
computed there in the same step, or both at once (issue #4, anchors.md: misses split between CPU
compute and PCIe copies).

The model, per layer and step, with n cold experts hit by routing and S spare slots:

    cpu_i   = max(bytes / B_cpu, tokens_i · flops_per_token / F_cpu)   the CPU kernel on miss i, with B_cpu the
              lower of the streaming read bandwidth and the rate the CPU kernels reached on earlier decode
              steps' misses (CpuRate: their efficiency, and whatever else competes for the CPU)
    fixed   = the CPU kernels' cost per call whatever the misses (CpuRate.fixed_s: waking the threads, the
              wrapper; 0 until measured), paid when any miss stays on the CPU
    copy    = copy_bytes / B_pcie                                      one expert host -> device
    dev     = read_bytes / B_hbm                                       the device computing one expert
    prep    = host seconds to ready one expert for its copy (0 on the simulated device; on CUDA the
              median of the device's recent loads of experts that size: issuing the copy, with the
              conversion to the kernel layout and the write into the pinned ring where there is one)
    T(C)    = max( m·prep + [m < n]·fixed + Σ_{i ∉ C} cpu_i ,  t_resident + m·(prep + copy + dev) )
              + [m > 0]·launch,  m = |C|

for the set C of copied misses, m ≤ S (launch: the host time of a launch and merge of their own, where copies need
one: a step that routes to no resident expert, the decode streaming slots (streaming.py); decode_costs). The CPU
readies the copies, then computes its misses; the copies run on the copy stream meanwhile, and one launch computes
the residents and the copied experts once the copies are in (hybrid_node.py: a second launch for the copied ones
cost the host more than the residents' few µs of device time it let start earlier). A copied expert stays resident:
where routing comes back to it in the next steps it is a hit there, and each such hit saves the CPU reading it (the
device reads it instead). CopyReuse measures r, the later hits a copy earned, so a copy is credited with

    credit  = r · max(0, read − dev)                                   read: one expert's CPU read time

and the policy minimises W(C) = T(C) − m · credit (r = 0 until measured: this step alone, as under the
uniform routing of random weights; real routing repeats recent experts, anchors.md). All experts of a
layer have the same size, so for a given |C| = m the best C holds the m misses with the largest CPU
cost; the policy scans m = 0..min(n, S) and keeps the smallest W (ties: fewer copies, so no PCIe
traffic is spent for nothing).

bytes is the expert as stored (what the CPU kernel reads); copy_bytes is what a copy moves, the expert
packed in the GPU kernels' layout (GpuQMoE.pack_expert: converted for int2 / int3 / SM80 / mixed widths /
nvfp4 / mxfp4, with the fp16 block-scale copy), read_bytes what the device reads to compute it
(GpuFootprint in engine/expert_node.py). Both default to bytes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from engine.units import byte_rate


_TIE = 1e-12  # relative: values of W this close are equal (choose, copying_pays)
# A CpuRate's first calls slower than this many times their fastest are left out of its fit (CpuRate.warm_ratio):
# the calls of one to eight experts of a steady host's fit lie within k = 8 times one another, a kernel's first call
# (its compile, cold pages) took 5-90 ms against 0.2-0.6 ms
WARM_RATIO = 10.0
# The calls a CpuRate keeps to take again where its settings change (CpuRate._settle): at fit_keep 0.98 and keep 0.9,
# an older call weighs under 1e-35 of the newest
HISTORY = 4096


class CpuRate:
    """What the CPU expert kernels cost on decode misses, from their calls: seconds ≈ fixed_s + bytes / value.

    On the H200 machine's Xeon a call on Qwen3-30B-A3B-like's misses took ~180 µs plus ~66 GB/s (thirteenth
    session's notes), so one miss more or less in a call costs far less than the call's bytes / seconds say: a copy
    saves only the marginal cost of its miss, and the fixed cost only when no miss is left on the CPU.

    The fit: least squares of seconds on bytes over the calls, each weighted `fit_keep` per later call. It is used
    once `min_calls` calls were seen with bytes spread enough (standard deviation >= `min_spread` of their mean)
    and gives a positive slope and a rate no higher than `ceiling` (bytes per second; None: no ceiling). A fixed cost
    below 0 is noise about none: it is taken as 0 and the slope fitted through the origin, that line checked as the
    first would be (such lines were dropped whole, the calls priced at their average: "68 GB/s + 0 µs" at Qwen 0%,
    seventy-first session). Until then (and with `fit` off) fixed_s is 0 and value the average rate, an exponential
    average of bytes / seconds per call (weight `keep` on the past), each call's at most `ceiling`: one call timed
    too short would otherwise lift it past any rate the CPU reads at for tens of calls. value is None until measured.
    The average alone read 28-43 GB/s on that Xeon against 98 GB/s of streaming bandwidth.

    A fit's slope, once made, stays (`keep_fit`) while later calls give none, until they give a new one; its fixed
    cost follows those calls (the line through their mean, _through_recent). Calls of one size
    (a token's one or two misses under real-like routing) give no line, and the average rate then prices every
    miss at a whole call, fixed cost included (19 GB/s on the H200 machine's Qwen3-30B-A3B-like calls of one
    expert), which made the slot weighing leave every slot to copies (NOTES-overhead.md, twentieth session).

    Bytes spread just past min_spread with noisy times can give a line that is nearly flat: 1301 GB/s + 322 µs a call
    on the H100 host's Qwen3-30B-A3B-like calls at 50% resident, whose streaming read was ~120 GB/s (seventy-first
    session), as if one more miss cost the CPU nothing. A slope faster than `ceiling` is such a line, not a rate: it
    is refused as calls that give no line are (the kept slope or the average stays).

    A slope under the ceiling can be noise too (239 GB/s + 288 µs a call on calls whose own rates scattered widely,
    seventy-first session): a line whose bytes explain less than `min_r2` of how the calls' times vary (R², over the
    weighted calls) is refused the same way. R², not the residuals' size: calls of nearly one size with steady times
    have small residuals whatever slope their noise gives, while a slope is a claim that bytes drive the times.

    So is a line whose fixed cost takes more than `max_fixed_share` of the mean call (the weighted calls' mean
    seconds: the sums keep no calls to take a median of), as if the calls' bytes hardly mattered: the H200 Xeon's
    180 µs + 66 GB/s put ~47% of its calls of 1-8 experts in the fixed cost, the noise lines 87% (239 GB/s + 288 µs)
    and 99% (1301 GB/s + 322 µs) of theirs. Both noise lines read bytes faster than the host streams them; where
    `stream` (the host's streaming read, bytes per second; None: not known) is given, a line whose slope reads no
    faster than it is kept whatever its fixed cost's share: tiny experts make a genuine call almost all fixed cost
    (that Xeon's line with the fixture models' 16-32 KiB experts: 99%), and their average rate priced each miss at
    a share of a whole call: the split gave the CPU pairs that made a layer's part up to 1.8x slower, the miss
    policy chose copies up to 1.4x slower (seventy-second session: that line, copies or tier reads of 16-130 µs).

    The first `min_calls` calls reach the fit together, once all have come, less those that took more than
    `warm_ratio` times their fastest: warm-up calls (a kernel's first compile, cold pages: 5-90 ms where its calls
    take 0.2-0.6 ms) left no line for 190-480 calls, the fit keeping 0.98 of the past a call (their times' variance
    all theirs, R² near 0): the average rate priced a Qwen3-30B-A3B-like miss at ~32 GB/s beside the line's 66 +
    180 µs, whose slope is the miss's cost. (The average rate counts them: it prices nothing once a line stands, and
    keeps 0.9 of its past a call.)

    That window is eight calls, where the first decode step makes one a layer (HybridExpertNode), each reading its
    experts with cold pages and caches: a replay of that Xeon's calls whose first step over 48 layers read their bytes
    at 5 GB/s more (minor faults) priced the next six steps' calls ~5x over. So each layer's first call (observe's
    `layer`) is left out of the fit and the average alike: the next step's calls were priced within 17% (the stream,
    then the average until the line), the later ones' within 2% (test_a_cpu_rate_leaves_out_each_layers_first_call).
    A small model's window holds later steps' calls, slow ones too: with half of it slow, its median was a slow call,
    under which none was left out (four layers whose second step took 5 ms a call priced calls 12-93% off through forty
    steps); the fastest call is a steady one wherever any is (within 3% from the third step)."""

    def __init__(self, keep: float = 0.9, fit: bool = True, fit_keep: float = 0.98, min_calls: int = 8,
                 min_spread: float = 0.2, keep_fit: bool = True, ceiling: float | None = None, min_r2: float = 0.5,
                 max_fixed_share: float = 0.8, stream: float | None = None, warm_ratio: float = WARM_RATIO):
        self.keep, self.fit, self.fit_keep, self.min_calls, self.min_spread = keep, fit, fit_keep, min_calls, min_spread
        self.keep_fit, self.ceiling, self.min_r2, self.max_fixed_share = keep_fit, ceiling, min_r2, max_fixed_share
        self.stream, self.warm_ratio = stream, warm_ratio
        self._layers: set[int] = set()  # the layers whose first call came (observe)
        self._settings = self._settings_now()  # those the calls were taken under (_settle)
        self._start(warm=True)

    def _start(self, warm: bool) -> None:
        """No call taken yet; `warm`: the first calls still to come (the warm-up window, see the class docstring)."""
        self._first: list[tuple[float, float]] | None = [] if warm else None  # the first calls, until min_calls came
        self._average: float | None = None
        self._sums = [0.0] * 6  # weighted count, Σx, Σy, Σx², Σxy, Σy² (x bytes, y seconds)
        self._calls = 0
        self._taken: deque[tuple[float, float]] = deque(maxlen=HISTORY)  # the latest calls taken (_settle)
        self._fitted: tuple[float, float] | None = None  # _line(), computed when read after new calls
        self._stale = False
        self._kept = False  # _fitted is a kept slope through the recent calls (_through_recent), not their own line
        # (stream, priced()'s line held to it, None where refused), kept until calls come as _fitted is: priced() runs
        # at every layer whose misses the policy prices, and made the held line again each time
        self._held: tuple[float, tuple[float, float] | None] | None = None

    def _settings_now(self) -> tuple:
        return (self.keep, self.fit_keep, self.min_calls, self.min_spread, self.keep_fit, self.ceiling, self.min_r2,
                self.max_fixed_share, self.stream, self.warm_ratio)

    def _settle(self) -> None:
        """Where a setting changed since the calls were taken (bench_offload_ab's rate.NAME switches set them on a
        running rate), the calls kept are taken again under the settings now, as a fresh rate fed them would take them:
        the sums weigh their calls by fit_keep as they come and the average clamps each to the ceiling, and the lines
        made from them were kept until the next call. The latest HISTORY calls only: older ones, once dropped, are
        not taken again (the warm-up window is over by then)."""
        settings = self._settings_now()
        if settings == self._settings:
            return
        self._settings, calls, count = settings, list(self._taken), self._calls
        self._start(warm=count == len(calls))
        for nbytes, seconds in calls:
            self._take(nbytes, seconds)
        self._calls = count

    def observe(self, nbytes: int, seconds: float, layer: int | None = None) -> None:
        """A call of `nbytes` of experts that took `seconds`; `layer`: the layer it ran for, whose first call is left
        out of the fit and the average (see the class docstring; None: every call counts)."""
        if seconds <= 0 or nbytes <= 0:
            return
        if layer is not None and layer not in self._layers:
            self._layers.add(layer)  # its first call: cold pages, caches and threads
            return
        self._take(float(nbytes), float(seconds))

    def _take(self, x: float, y: float) -> None:
        """A call of x bytes in y seconds into the average and the fit."""
        self._taken.append((x, y))
        rate = x / y if self.ceiling is None else min(x / y, self.ceiling)
        self._average = rate if self._average is None else self.keep * self._average + (1 - self.keep) * rate
        keep = self.fit_keep
        if self._first is None:
            self._sums = [keep * old + new for old, new in zip(self._sums, (1.0, x, y, x * x, x * y, y * y))]
        else:
            self._warm(x, y)
        self._calls += 1
        self._stale = True  # refitted when read: layers without slots observe calls nobody prices

    def observe_many(self, calls: list[tuple[int, float]]) -> None:
        """observe() of each (bytes, seconds) in `calls`, in order, in a few array operations: the sums come out as
        one call at a time would leave them, to rounding. (SpikeGate hands over a "both" step's calls at its end,
        where the GPU idles: 48 observe() calls took ~100 µs of it on the H100 host, sixty-first session.)"""
        x, y = np.asarray(calls, np.float64).reshape(-1, 2).T
        counted = (x > 0) & (y > 0)
        x, y = x[counted], y[counted]
        if x.size == 0:
            return
        self._taken.extend(zip(x.tolist(), y.tolist()))
        rates = x / y if self.ceiling is None else np.minimum(x / y, self.ceiling)
        if self._average is None:
            self._average, rates = float(rates[0]), rates[1:]
        weights = self.keep ** np.arange(rates.size - 1, -1, -1)
        self._average = self.keep ** rates.size * self._average + (1 - self.keep) * float(weights @ rates)
        self._calls += x.size
        self._stale = True
        while self._first is not None and x.size:
            self._warm(float(x[0]), float(y[0]))
            x, y = x[1:], y[1:]
        self._add(x, y, np.ones(x.size))

    def _add(self, x: np.ndarray, y: np.ndarray, counted: np.ndarray) -> None:
        """The calls (x bytes, y seconds) into the fit's sums in order, those `counted` 0 left out."""
        weights = counted * self.fit_keep ** np.arange(x.size - 1, -1, -1)
        added = (weights.sum(), weights @ x, weights @ y, weights @ (x * x), weights @ (x * y), weights @ (y * y))
        decay = self.fit_keep ** x.size
        self._sums = [decay * old + float(new) for old, new in zip(self._sums, added)]

    def _warm(self, x: float, y: float) -> None:
        """A first call (see the class docstring): held until min_calls came, then all to the sums but the slow."""
        self._first.append((x, y))
        if len(self._first) >= self.min_calls:
            x, y = np.array(self._first, np.float64).T
            self._first = None
            self._add(x, y, y <= self.warm_ratio * y.min())

    def _line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per byte) of the fitted line, or None where the calls do not give one."""
        if self._calls < self.min_calls:
            return None
        w, sx, sy, sxx, sxy, syy = self._sums
        mean_x, mean_y = sx / w, sy / w
        var_x = sxx / w - mean_x * mean_x
        if var_x < (self.min_spread * mean_x) ** 2:
            return None
        slope = (sxy / w - mean_x * mean_y) / var_x
        return self._checked(mean_y - slope * mean_x, slope)

    def _checked(self, fixed: float, slope: float, least_slope: float = 0.0) -> tuple[float, float] | None:
        """The line (fixed seconds, seconds per byte) where it passes the checks in the class docstring, else None; a
        fixed cost below 0 taken as 0 and the slope fitted through the origin, no less than `least_slope`."""
        w, sx, sy, sxx, sxy, syy = self._sums
        mean_y = sy / w
        if fixed < 0:
            fixed, slope = 0.0, max(sxy / sxx, least_slope)
        faster = self.ceiling is not None and slope * self.ceiling < 1.0
        # R² = 1 - the mean squared residual over the variance of the calls' times (of this line, the origin's too)
        residual = (syy - 2 * (fixed * sy + slope * sxy - fixed * slope * sx) + slope * slope * sxx) / w + fixed * fixed
        explained = residual <= (1.0 - self.min_r2) * (syy / w - mean_y * mean_y)
        readable = self.stream is not None and slope * self.stream >= 1.0  # a slope no faster than the stream
        sane = fixed <= self.max_fixed_share * mean_y or readable
        return (fixed, slope) if slope > 0 and sane and not faster and explained else None

    def _current(self) -> tuple[float, float] | None:
        self._settle()
        if not self.fit:
            return None
        if self._stale:
            line = self._line()
            self._kept = line is None and self.keep_fit and self._fitted is not None
            if line is not None or not self.keep_fit:
                self._fitted = line
            elif self._fitted is not None:
                self._fitted = self._through_recent(self._fitted[1])
            self._stale = False
            self._held = None
        return self._fitted

    def priced(self, stream: float) -> tuple[float | None, float]:
        """(bytes per second, fixed seconds a call) a CPU miss is priced at where the host streams `stream` bytes per
        second (B_cpu and the fixed cost in the module docstring; None: not measured): value, at most the stream, and
        fixed_s, their line held to the stream where its slope reads faster. The held line passes through the calls'
        weighted means as the fitted one did, its fixed cost made again for the stream's slope and checked as the
        fitted line's was (a kept line's as _through_recent makes it); a fitted line refused so prices at the average
        rate, as one refused when fitted. Holding the slope alone kept the faster line's fixed cost: calls on 150 GB/s
        + 100 µs, 11 MB on average, held to 100 GB/s were priced 37 µs over what they took on average. The held line
        is kept until calls come or the stream changes."""
        line = self._current()
        if line is None or line[1] * stream >= 1.0:
            value = self.value
            return (None if value is None else min(value, stream)), self.fixed_s
        if self._held is None or self._held[0] != stream:
            slope = 1.0 / stream
            w, sx, sy = self._sums[:3]
            held = self._through_recent(slope) if self._kept else self._checked(sy / w - slope * sx / w, slope, slope)
            self._held = stream, held
        held = self._held[1]
        return (1.0 / held[1], held[0]) if held else (min(self._average, stream), 0.0)

    def _through_recent(self, slope: float) -> tuple[float, float]:
        """A kept line's slope through the mean of the calls the sums hold now (their fixed cost at least 0): calls of
        one size give no slope, but they do say what a call of that size costs now. A line fitted on other calls (the
        CPU path's calls of every cold expert, before a switch to "both", whose calls take a few) would otherwise price
        these by its own intercept (H200, Qwen3-30B-A3B-like: 143-152 µs a call kept, where one-expert calls in
        "both" took ~100 µs and four ~210, thirty-seventh session)."""
        w, sx, sy = self._sums[:3]
        return max(sy / w - slope * sx / w, 0.0), slope

    @property
    def average(self) -> float | None:
        """The average rate (see the class docstring), None until measured."""
        self._settle()
        return self._average

    @property
    def value(self) -> float | None:
        """Bytes per second of one more miss in a call (the fit's slope), else the average rate."""
        line = self._current()
        return 1.0 / line[1] if line else self._average

    @property
    def fixed_s(self) -> float:
        line = self._current()
        return line[0] if line else 0.0


class CopyReuse:
    """Hits that misses copied into spare slots earned in later steps (the credit in the module docstring).

    Per layer, the step each expert was last copied at; a later step that finds a token routed to it resident,
    within `window` steps of the copy, counts one reuse (once per step). value: reuses per copy, both counts
    decayed by `keep` per step so that the current routing weighs most; None until `min_copies` copies were made."""

    def __init__(self, num_experts: list[int], window: int = 8, keep: float = 0.98, min_copies: int = 4):
        self.window, self.keep, self.min_copies = window, keep, min_copies
        # per layer and expert, as Python ints: a decode step looks up a handful (issue #4)
        self._copied_at = [[-window - 1] * n for n in num_experts]
        self._last_copy = [-window - 1] * len(num_experts)
        self._made = 0  # copies ever made
        self.step = 0
        self.copies = 0.0  # decayed
        self.reuses = 0.0  # decayed

    def end_step(self) -> None:
        self.step += 1
        if self.copies > 1e-6:  # frozen once copies stopped long ago: the ratio is kept, no underflow
            self.copies *= self.keep
            self.reuses *= self.keep

    def copied(self, layer: int, experts: list[int]) -> None:
        copied_at = self._copied_at[layer]
        for expert in experts:
            copied_at[expert] = self.step
        self._last_copy[layer] = self.step
        self.copies += len(experts)
        self._made += len(experts)

    def hit(self, layer: int, ids: np.ndarray, resident: np.ndarray) -> None:
        """`ids[resident]`: this step's routed experts found resident in `layer` (repeats allowed)."""
        if self.step - self._last_copy[layer] > self.window:
            return  # nothing copied lately in this layer: no array work on the decode path
        copied_at, step, oldest = self._copied_at[layer], self.step, self.step - self.window
        self.reuses += len({expert for expert in ids[resident].tolist() if oldest <= copied_at[expert] < step})

    @property
    def value(self) -> float | None:
        return self.reuses / self.copies if self._made >= self.min_copies and self.copies > 0 else None


@dataclass(frozen=True)
class MissCosts:
    """Modelled seconds of one step's choices, for one layer."""
    cpu_s: np.ndarray      # [n] the CPU computing each miss
    copy_s: float          # copying one expert to the device
    device_s: float        # the device computing one copied expert
    resident_s: float      # the device computing this step's resident experts
    prepare_s: float = 0.0  # host seconds to ready one expert for its copy
    credit_s: float = 0.0   # later steps' expected savings per copy (CopyReuse)
    launch_s: float = 0.0   # host seconds a device part of its own adds once to a step with copies (the streaming
                            # slots' launch and merge; 0 where a launch of residents runs anyway)
    cpu_fixed_s: float = 0.0  # the CPU kernels' cost per call, paid while any miss stays on the CPU (CpuRate)

    def step_seconds(self, copied: np.ndarray) -> float:
        """T(C) for a bool mask (or index array) of copied misses."""
        m, rest = self._split(copied)
        return self._time(m, rest)

    def worth(self, copied: np.ndarray) -> float:
        """W(C) = T(C) - m · credit: what the policy minimises."""
        m, rest = self._split(copied)
        return self._worth(m, rest)

    def _split(self, copied) -> tuple[int, float]:
        mask = np.zeros(self.cpu_s.size, bool)
        mask[copied] = True
        return int(np.count_nonzero(mask)), float(self.cpu_s[~mask].sum())

    def _time(self, m: int, cpu_rest: float) -> float:
        cpu = m * self.prepare_s + cpu_rest + (self.cpu_fixed_s if m < self.cpu_s.size else 0.0)
        device = self.resident_s + m * (self.prepare_s + self.copy_s + self.device_s)
        return max(cpu, device) + (self.launch_s if m else 0.0)  # the host issues the launch before the CPU starts

    def _worth(self, m: int, cpu_rest: float) -> float:
        return self._time(m, cpu_rest) - m * self.credit_s


@dataclass(frozen=True)
class MissDecision:
    copied: np.ndarray     # indices (into the misses) to copy into spare slots
    predicted_s: float     # T of this choice
    worth_s: float         # W of this choice (T less the copies' credit)
    all_cpu_s: float       # T with every miss on the CPU
    most_copied_s: float   # T with as many misses copied as there are spare slots (largest CPU costs first)

    @property
    def num_copied(self) -> int:
        return int(self.copied.size)


def cpu_bytes_per_s(bandwidths, cpu_rate: float | None) -> float:
    """Bytes per second of the CPU on a miss (B_cpu in the module docstring), for the miss policy and the split's
    tables alike: the lower of the host's streaming read (bandwidths.cpu) and the CPU kernels' measured rate
    (CpuRate.value; None: not measured)."""
    return bandwidths.cpu if cpu_rate is None else min(bandwidths.cpu, cpu_rate)


def cpu_rate_words(in_force: float, measured: float, call_s: float, measured_call_s: float, decimals: int = 0) -> str:
    """'85 GB/s + 129 µs a call': the CPU's rate in force (cpu_bytes_per_s) and a call's fixed cost, with the measured
    line beside it where the host's streaming read held its rate lower: '40 GB/s + 6 µs a call (measured 60 GB/s +
    100 µs a call, its rate clamped to the stream)'. A report of the measured rate alone said a rate that neither the
    miss policy nor the split priced; the measured rate beside the fixed cost in force alone ('40 GB/s + 6 µs a call
    (measured 60, clamped to the stream)') read as a line of 60 GB/s + 6 µs, which nobody measured nor priced: the
    held line's fixed cost is its own, made through the calls' mean (CpuRate.priced). Rates under 1 GB/s in MB/s or
    kB/s (units.byte_rate): a slow host's 0.3 GB/s read '0 GB/s', as if free."""
    words = f"{byte_rate(in_force, decimals)} + {call_s * 1e6:.0f} µs a call"
    if measured > in_force:
        line = f"{byte_rate(measured, decimals)} + {measured_call_s * 1e6:.0f} µs a call"
        words += f" (measured {line}, its rate clamped to the stream)"
    return words


def miss_costs(bandwidths, expert_bytes: int, tokens, resident_s: float,
               flops_per_token: float = 0.0, prepare_s: float = 0.0, copy_bytes: int | None = None,
               read_bytes: int | None = None, cpu_rate: float | None = None,
               reuse: float | None = None, launch_s: float = 0.0, cpu_fixed_s: float = 0.0) -> MissCosts:
    """The cost model's inputs from measured (or assumed) bandwidths: `tokens` holds, per miss, the
    tokens routed to it in this step. `expert_bytes`: the stored expert (CPU reads); `copy_bytes` /
    `read_bytes`: the expert in the device's layout, copied / read by the device (default expert_bytes);
    `cpu_rate`: the CPU kernels' measured bytes per second (CpuRate), when lower than bandwidths.cpu;
    `reuse`: later hits per copy (CopyReuse; None: not measured, no credit); `launch_s`, `cpu_fixed_s`: see
    MissCosts (cpu_rate and cpu_fixed_s: CpuRate.value and .fixed_s)."""
    # Plain Python over the few misses of a decode step (n <= 8 per token): NumPy's per-call overhead on
    # such tiny arrays cost more than the arithmetic (issue #4).
    tokens = tokens.tolist() if isinstance(tokens, np.ndarray) else list(tokens)
    copy_bytes = expert_bytes if copy_bytes is None else copy_bytes
    read_bytes = expert_bytes if read_bytes is None else read_bytes
    read = expert_bytes / cpu_bytes_per_s(bandwidths, cpu_rate)
    if flops_per_token:
        per_token = flops_per_token / bandwidths.cpu_flops
        cpu = [max(read, float(t) * per_token) for t in tokens]
    else:
        cpu = [read] * len(tokens)
    device = read_bytes / bandwidths.hbm
    return MissCosts(cpu_s=np.array(cpu, dtype=np.float64), copy_s=copy_bytes / bandwidths.pcie,
                     device_s=device, resident_s=float(resident_s), prepare_s=float(prepare_s),
                     credit_s=(reuse or 0.0) * max(0.0, read - device), launch_s=float(launch_s),
                     cpu_fixed_s=float(cpu_fixed_s))


def decode_costs(bandwidths, expert_bytes: int, tokens, residents: int, launch_s: float = 0.0,
                 read_bytes: int | None = None, **costs) -> MissCosts:
    """miss_costs for a decode step whose routing found `residents` distinct experts resident, which one launch
    computes with the copied misses: their device time, and `launch_s` (the host time of a launch and merge of the
    device's own) charged to copies only where no resident is routed, as they alone would make the step's device part.
    The hybrid node prices its misses so, and miss_slots each split: a weighing that left these out chose other slots
    than the steps then paid for."""
    read_bytes = expert_bytes if read_bytes is None else read_bytes
    return miss_costs(bandwidths, expert_bytes, tokens, residents * read_bytes / bandwidths.hbm, read_bytes=read_bytes,
                      launch_s=0.0 if residents else launch_s, **costs)


def choose(costs: MissCosts, spare_slots: int) -> MissDecision:
    """The split of the misses that minimises the step's critical path (see the module docstring)."""
    # Plain Python: n is a decode step's misses (a handful); NumPy calls on such arrays cost more (issue #4).
    cpu = costs.cpu_s.tolist()
    n = len(cpu)
    order = sorted(range(n), key=lambda i: -cpu[i])  # stable: equal costs keep their order
    total = sum(cpu)
    most = min(n, max(0, int(spare_slots)))
    rests, removed = [total], 0.0
    for m in range(1, most + 1):
        removed += cpu[order[m - 1]]
        rests.append(total - removed)
    worths = [costs._worth(m, rest) for m, rest in enumerate(rests)]
    lowest = min(worths)
    # the fewest copies among equal values; equal within rounding: W is flat where each copy's credit buys back
    # exactly what it adds to the device's side, and the sums' rounding must not choose copies there
    best = next(m for m, worth in enumerate(worths) if worth <= lowest + _TIE * abs(lowest))
    return MissDecision(copied=np.array(sorted(order[:best]), dtype=np.int64),
                        predicted_s=costs._time(best, rests[best]), worth_s=worths[best],
                        all_cpu_s=costs._time(0, total), most_copied_s=costs._time(most, rests[most]))


def copying_pays(costs: MissCosts) -> bool:
    """Whether copying any miss can pay, whatever the spare slots: T(m) is convex in m (the CPU's term
    falls by ever smaller steps, the device's grows linearly) and so is W(m) = T(m) - m · credit,
    so some m > 0 beats m = 0 exactly when m = 1 does. Lets a caller skip looking for spare slots (issue #4).
    The CPU's fixed cost drops out at m = n only (no miss left on the CPU): m = n is tried too. A fixed launch_s
    breaks convexity at m = 0 (W jumps by it there): then every m is tried."""
    cpu = costs.cpu_s.tolist()
    if not cpu:
        return False
    total = sum(cpu)
    stay = costs._worth(0, total)
    if not costs.launch_s:
        if costs._worth(1, total - max(cpu)) < stay - _TIE * abs(stay):
            return True
        return bool(costs.cpu_fixed_s) and costs._worth(len(cpu), 0.0) < stay - _TIE * abs(stay)
    return choose(costs, len(cpu)).num_copied > 0


def miss_slots(bandwidths, expert_bytes: int, num_slots: int, num_experts: int, top_k: int, prepare_s: float = 0.0,
               copy_bytes: int | None = None, read_bytes: int | None = None, cpu_rate: float | None = None,
               reuse: float | None = None, cpu_fixed_s: float = 0.0, flops_per_token: float = 0.0,
               launch_s: float = 0.0) -> int:
    """How many of a layer's `num_slots` to leave to copied misses instead of filling them with residents, for
    token-by-token decode. For each split, a token's expected hits and misses under uniform routing and the miss
    policy's best value W for them (choose; with `reuse` measured, the copies' later hits are credited; a
    fractional miss count interpolates between the steps of its neighbours, each priced as the hybrid node prices
    such a step: decode_costs, its launch_s where no hit is left); the split with the least W, the fewest miss slots
    among equals. Each slot left to misses costs hits: it pays when the CPU is slow enough
    that a copy over PCIe beside it shortens the step more, or when copies earn enough later hits. Once a copy's
    credit exceeds its cost, every further miss lowers W and the weighing leaves all slots to copies: placement
    becomes a cache filled by the misses' copies. On the H200 (RESULTS.md, sixth session, run 7) that was the
    fastest split measured for gpt-oss and no slower for Qwen; the model does not weigh residents' own recency."""
    best, best_s = 0, None
    for spare in range(num_slots + 1):
        residents = min(num_slots - spare, num_experts)
        misses = top_k - top_k * residents / num_experts
        seconds = 0.0
        for count, share in ((int(misses), 1.0 - misses % 1.0), (int(misses) + 1, misses % 1.0)):
            if share > 0.0:  # one token's step: top_k - count of its experts resident
                costs = decode_costs(bandwidths, expert_bytes, [1] * count, top_k - count, launch_s, read_bytes,
                                     flops_per_token=flops_per_token, prepare_s=prepare_s, copy_bytes=copy_bytes,
                                     cpu_rate=cpu_rate, reuse=reuse, cpu_fixed_s=cpu_fixed_s)
                seconds += share * choose(costs, spare).worth_s
        if best_s is None or seconds < best_s * (1.0 - 1e-9):
            best, best_s = spare, seconds
    return best
