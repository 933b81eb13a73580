"""When something else on the machine slows the model down (no Qt here).

Two kinds of warning, checked on every telemetry sample while the model generates:
- other processes take a significant share of the CPU, of host memory or of VRAM (named), or, on a virtual
  machine, the hypervisor gives a significant share of the CPUs' time to other guests (steal time); host memory
  nearly full with this process holding most of it is said to be the model's own;
- the engine's measured CPU expert throughput (bytes of expert weights the CPU kernels read per
  second of their own time, during decode) falls clearly below its usual level (ThroughputWatch):
  the sign that something competes for memory bandwidth even when the CPU graph looks calm.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from engine.units import counted, human_bytes

OTHERS_CPU_SHARE = 0.20       # other processes using this share of all cores...
OTHERS_CPU_MIN_CORES = 0.5    # ...and at least half a core
HOST_AVAILABLE_SHARE = 0.10   # less host memory available than this share of the total
HOST_OTHERS_SHARE = 0.25      # ...named as the cause where other processes (and the kernel) hold this share
VRAM_OTHERS_SHARE = 0.10      # other processes holding this share of the GPU's memory
CPU_STEAL_SHARE = 0.10        # a virtual machine's CPUs losing this share of their time to other guests
THROUGHPUT_DROP = 0.50        # current / usual level below this: warn
RAISE_SAMPLES = 2             # samples of the last RAISE_WITHIN that show a warning before it is raised...
RAISE_WITHIN = 3              # ...so one second's spike raises none, and a build between its jobs still does
CALM_SAMPLES = 3              # calm samples in a row before a raised warning comes down
KINDS = ("cpu", "steal", "host memory", "vram", "throughput")  # the banner's order


THRESHOLDS = (f"Said while the model generates, where other processes use at least {OTHERS_CPU_SHARE:.0%} of this "
              f"process's CPU cores (and half a core), a virtual machine's host gives other guests at least "
              f"{CPU_STEAL_SHARE:.0%} of its CPU time, less than {HOST_AVAILABLE_SHARE:.0%} of host memory is "
              f"available, other processes hold at least {VRAM_OTHERS_SHARE:.0%} of the memory of the GPU the model "
              f"runs on (as NVML counts each process's: the driver's own reservations are none's, processes that only "
              f"draw the screen are left out, and memory the driver does not say whose is not counted), or the CPU "
              f"experts' throughput falls below {THROUGHPUT_DROP:.0%} of its usual rate (the upper quartile of its "
              f"last 10 minutes in decode since the load or the last Apply). "
              f"Each is said once {RAISE_SAMPLES} of {RAISE_WITHIN} samples in a row show it, and goes after "
              f"{CALM_SAMPLES} calm samples in a row; ✕ keeps it down until then.")


def _cpu(p: dict) -> str:
    """'python indexer.py (2.4 cores, 1.5 GiB resident)': in the sentence's unit, with the memory it holds."""
    held = f", {human_bytes(p['rss'])} resident" if p.get("rss") else ""
    return f"{p['name']} ({p['cores']:.1f} cores{held})"


def _ram(p: dict) -> str:
    return f"{p['name']} ({human_bytes(p['rss'])})"


def _vram(p: dict) -> str:
    return f"{p['name']} ({human_bytes(p['bytes'])})"


def _names(items, fmt) -> str:
    return ", ".join(fmt(item) for item in items[:3])


def _cores(sample: dict) -> tuple[int, int]:
    """(the CPU cores this process may run on, all the machine's): a build pinned to the others does not compete."""
    all_cores = max(1, len(sample.get("cpu_per_core") or [1]))
    return len(sample.get("cpu_ours") or range(all_cores)), all_cores


def _others_take_cores(sample: dict) -> bool:
    return sample.get("others_cpu_cores", 0.0) >= max(OTHERS_CPU_MIN_CORES, OTHERS_CPU_SHARE * _cores(sample)[0])


def cpu_taken(sample: dict) -> bool:
    """Whether other processes, or a virtual machine's other guests, take a significant share of this process's CPUs
    (sample_warnings warns of either)."""
    return _others_take_cores(sample) or sample.get("cpu_steal_share", 0.0) >= CPU_STEAL_SHARE


def sample_warnings(sample: dict, on_gpu: bool = True) -> dict[str, str]:
    """Plain sentences about what competes with the model, from one telemetry sample (app.gui.telemetry), by kind
    ("cpu", "steal", "host memory", "vram"), for WarningHold. Without `on_gpu` (a model on the CPU or a simulated
    GPU) the card's memory is not the model's, and what holds it does not compete."""
    warnings = {}
    cores, all_cores = _cores(sample)
    others = sample.get("others_cpu_cores", 0.0)
    if _others_take_cores(sample):
        top = [p for p in sample.get("top_cpu", []) if p["cores"] >= 0.05]
        where = (counted(cores, "CPU core") if cores == all_cores else
                 f"the {counted(cores, 'CPU core')} this process may run on (of {all_cores})")
        warnings["cpu"] = (f"Other processes use {others:.1f} of {where}"
                           + ((": " + _names(top, _cpu)) if top else "")
                           + ". The CPU expert kernels run on the cores they leave: pausing them speeds the answer.")
    steal = sample.get("cpu_steal_share", 0.0)
    if steal >= CPU_STEAL_SHARE:
        # nothing on this machine to name: the CPU kernels' threads wait for each other, so they slow by more
        warnings["steal"] = (f"This virtual machine's host gives {steal:.0%} of its CPU time to other guests "
                             "(steal time): the CPU's expert kernels run slower and less evenly.")
    total, available = sample.get("ram_total", 0), sample.get("ram_available", 0)
    if total and available < HOST_AVAILABLE_SHARE * total:
        warnings["host memory"] = _host_memory(sample)
    gpu = sample.get("gpu")
    # the memory NVML lists under other processes that compute (engine/nvml.py), not all in use less ours: the
    # driver's own reservations are no process's, and no one can pause them. Nor the card's use at start-up as a
    # baseline: a competitor already there would be in it, unsaid. Where NVML hides some processes' memory, what it
    # lists is judged, as at least that much; never all in use less the engine's own count, which would blame its KV
    # cache and workspace (in a container's pid namespace, where whose is whose is not known, it lists none)
    if on_gpu and gpu and gpu.get("total") and gpu.get("listed", 0) >= VRAM_OTHERS_SHARE * gpu["total"]:
        top = gpu.get("top", [])
        hold = "hold" if gpu.get("per_process", True) else "hold at least"
        warnings["vram"] = (f"Other processes {hold} {human_bytes(gpu['listed'])} of the GPU's "
                            f"{human_bytes(gpu['total'])}" + ((": " + _names(top, _vram)) if top else "")
                            + ". Memory they free leaves room for more resident experts (device_expert_bytes).")
    return warnings


def _host_memory(sample: dict) -> str:
    """Host memory nearly full: the other processes named only where they hold a significant share, else this
    process's own (experts copied into RAM under allow_file_backing=0, a host cache) said to be the cause."""
    total, available = sample["ram_total"], sample["ram_available"]
    this, others = sample.get("ram_this", 0), sample.get("ram_others", 0)
    full = f"Host memory is nearly full ({human_bytes(available)} of {human_bytes(total)} available"
    if others >= HOST_OTHERS_SHARE * total:  # (ram_others is all but this process's: the kernel's memory is in it)
        top = sample.get("top_ram", [])
        return (f"{full}; this process holds {human_bytes(this)}): other processes and the kernel hold "
                f"{human_bytes(others)}"
                + ((", the largest " + _names(top, _ram)) if top else "") + ".")
    return (f"{full}): this process holds {human_bytes(this)} of it, the model's own experts and caches. A host "
            "cache budget (host_expert_bytes) or allowing file backing leaves room.")


@dataclass
class WarningHold:
    """The warnings the banner shows, each kind (sample_warnings's, and "throughput") held on its own: one raised stays
    up until CALM_SAMPLES samples in a row are calm of it, so a competitor hovering at a threshold (a build between
    its compile jobs) neither blinks the banner every second nor comes and goes from its text beside another. Those
    the user dismissed stay unsaid until they have come down. A sample's kind is raised only once RAISE_SAMPLES of the
    last RAISE_WITHIN samples show it: a process that took the cores for one second (a browser's tab opening) put
    the banner up for four seconds. The throughput's is raised at once: it is a median of readings already."""
    shown: dict[str, str] = field(default_factory=dict)
    calm: dict[str, int] = field(default_factory=dict)
    dismissed: set[str] = field(default_factory=set)
    recent: dict[str, list[bool]] = field(default_factory=dict)  # whether each of the last samples showed the kind

    def reset(self) -> None:
        """A new answer: nothing said yet. The samples just before it still count toward raising (note)."""
        self.shown, self.calm, self.dismissed = {}, {}, set()

    def note(self, warnings: dict[str, str]) -> None:
        """A sample's warnings, counted toward raising: between answers too, or a competitor busy all along went unsaid
        in an answer shorter than RAISE_SAMPLES samples."""
        for kind in KINDS:
            seen = self.recent.setdefault(kind, [])
            seen.append(kind in warnings)
            del seen[:-RAISE_WITHIN]

    def dismiss(self) -> None:
        self.dismissed = set(self.shown)

    def update(self, warnings: dict[str, str]) -> list[str]:
        for kind in list(self.shown):
            if kind not in warnings:
                self.calm[kind] += 1
                if self.calm[kind] >= CALM_SAMPLES:
                    del self.shown[kind], self.calm[kind]
                    self.dismissed.discard(kind)
        self.note(warnings)
        for kind, text in warnings.items():
            if kind in self.shown or kind == "throughput" or sum(self.recent[kind]) >= RAISE_SAMPLES:
                self.shown[kind], self.calm[kind] = text, 0
        return [self.shown[kind] for kind in KINDS if kind in self.shown and kind not in self.dismissed]


@dataclass
class ThroughputWatch:
    """CPU expert throughput (bytes/s) measured by the worker during decode, against its usual level.

    The current value is the median of the last few measurements, so that one slow quarter-second does not raise
    the banner. The usual level is the upper quartile of the last `window` measurements since a load or a re-plan
    (MainWindow resets it at each: another plan's rate is not this one's), the very first left out (it can include
    kernel compilation). A high quantile, so that the first cold measurements (the experts' pages still being mapped
    in) do not lower it and hide a competitor that came later; over a window, where the best since the start (as it
    was) kept a fast spell's rate until the next Apply, and normal speed after it read as contention. A spell under a
    quarter of the window moves the level not at all, and a competitor that stays is said until it fills three
    quarters of it (7.5 minutes of decode): by then its speed is what this machine gives, not a drop."""
    window: int = 2400  # measurements: 10 minutes of decode at the worker's one every 0.25 s (STATS_INTERVAL_S)
    start_samples: int = 5  # measurements before there is a level
    recent_samples: int = 5
    skipped: int = 0
    readings: list[float] = field(default_factory=list)

    def reset(self) -> None:
        self.readings.clear()
        self.skipped = 0

    def add(self, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            return
        if not self.skipped:
            self.skipped = 1
            return
        self.readings.append(bytes_per_s)
        del self.readings[:-self.window]

    @property
    def baseline(self) -> float:
        if len(self.readings) < self.start_samples:
            return 0.0
        return statistics.quantiles(self.readings, n=4, method="inclusive")[-1]

    @property
    def current(self) -> float:
        """The median of the last few, once there are as many beyond the level's first."""
        if len(self.readings) < self.start_samples + self.recent_samples:
            return 0.0
        return statistics.median(self.readings[-self.recent_samples:])

    def warning(self, cpu_taken: bool = False) -> str:
        """The drop, said where it is clear; with `cpu_taken` (contention.cpu_taken) the kernels' threads lose CPU
        time, which slows them as much (their rate is of wall time), so memory bandwidth is not what it names."""
        # each read once: the level is a quantile of up to `window` readings, asked on every telemetry sample
        baseline, current = self.baseline, self.current
        if not baseline or not current or current >= THROUGHPUT_DROP * baseline:
            return ""
        cause = (" as other processes or guests take its CPUs' time" if cpu_taken
                 else ": something competes for memory bandwidth")
        return (f"CPU expert throughput fell to {current / 1e9:.2f} GB/s from its usual "
                f"{baseline / 1e9:.2f} GB/s ({current / baseline:.0%}){cause}.")
