"""Budget sweeps: run the scenarios at several expert budgets on one loaded model (re-planned,
not reloaded) and recommend the smallest budget within a margin of the best."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from engine.generation import GenerationParams, LoadedModel
from engine.offload.planner import all_resident_bytes
from engine.records.scenarios import run_scenario
from engine.records.schema import RunRecord


@dataclass
class SweepPoint:
    budget_bytes: int
    fraction: float
    records: list[RunRecord] = field(default_factory=list)

    @property
    def completion_s(self) -> float:
        return sum(r.timings["completion_s"] for r in self.records)

    @property
    def decode_tokens_per_s(self) -> float:
        rates = [r.timings["decode_tokens_per_s"] for r in self.records if r.timings["decode_tokens_per_s"]]
        return sum(rates) / len(rates) if rates else 0.0

    @property
    def peak_device_bytes(self) -> int:
        return max((r.peaks["device_bytes"] or 0) for r in self.records) if self.records else 0

    @property
    def peak_rss_bytes(self) -> int:
        return max(r.peaks["rss_bytes"] for r in self.records) if self.records else 0

    def as_dict(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "fraction": self.fraction, "completion_s": self.completion_s,
                "decode_tokens_per_s": self.decode_tokens_per_s, "peak_device_bytes": self.peak_device_bytes,
                "peak_rss_bytes": self.peak_rss_bytes}


def budget_points(total_expert_bytes: int, count: int) -> list[tuple[float, int]]:
    """`count` budgets from none to every expert resident: (fraction, bytes)."""
    if count < 2:
        raise ValueError("a sweep needs at least 2 points")
    return [(i / (count - 1), round(total_expert_bytes * i / (count - 1))) for i in range(count)]


def run_sweep(model: LoadedModel, device, points: int, scenarios: list[str], params: GenerationParams,
              label: str = "sweep", progress=None, cancel: threading.Event | None = None,
              on_text=None) -> list[SweepPoint]:
    """Only complete points are returned: `cancel` (checked between tokens) ends the sweep early.
    `progress(fraction)` after each scenario run; `on_text(token, delta)` streams every answer."""
    if model.offload is None:
        raise ValueError("a budget sweep needs a model loaded with offload on a device")
    results = []
    # 100% = every expert in a device slot: slots may be larger than the stored experts (converted layouts,
    # the prefill's fp16 scale copy), so the stored size would stop short of all resident
    plan = budget_points(all_resident_bytes(model.offload.infos), points)
    total_runs = len(plan) * len(scenarios)
    for index, (fraction, budget) in enumerate(plan):
        model.offload.reconfigure(model.offload.config.updated(device_expert_bytes=budget))
        device.memory.high_water = device.memory.used  # peaks per point
        point = SweepPoint(budget, fraction)
        for offset, scenario in enumerate(scenarios):
            if cancel is not None and cancel.is_set():
                return results
            point.records.append(run_scenario(model, scenario, params, device, label=f"{label} {fraction:.0%}",
                                              cancel=cancel, on_text=on_text))
            if cancel is not None and cancel.is_set():  # the point's last answer was cut short: not a result
                return results
            if progress:
                progress((index * len(scenarios) + offset + 1) / total_runs)
        results.append(point)
    return results


def recommend(points: list[SweepPoint], margin: float = 0.10) -> SweepPoint:
    """The smallest budget whose completion time is within `margin` of the fastest point."""
    best = min(point.completion_s for point in points)
    eligible = [point for point in points if point.completion_s <= best * (1 + margin)]
    return min(eligible, key=lambda point: point.budget_bytes)
