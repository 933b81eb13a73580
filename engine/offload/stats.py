"""Per-step offload statistics for the window and the records."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class LayerStats:
    hits: int = 0            # routed (token, expert) pairs found resident
    misses: int = 0          # routed pairs whose expert was cold
    cpu_s: float = 0.0       # wall time of CPU expert compute
    device_s: float = 0.0    # device compute time (measured on CUDA, modelled on the simulated device)
    wait_s: float = 0.0      # time the CPU waited for the device after finishing its own experts
    copy_bytes: int = 0      # host -> device expert copies (swaps, misses copied in, prefill waves)
    copy_s: float = 0.0
    swaps: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass
class OffloadStats:
    layers: list[LayerStats] = field(default_factory=list)
    steps: int = 0

    def reset(self, num_layers: int) -> None:
        self.layers = [LayerStats() for _ in range(num_layers)]
        self.steps = 0

    def totals(self) -> LayerStats:
        total = LayerStats()
        for layer in self.layers:
            for name, value in asdict(layer).items():
                setattr(total, name, getattr(total, name) + value)
        return total

    def as_dict(self) -> dict:
        total = self.totals()
        return {"steps": self.steps, "hit_rate": total.hit_rate, "copy_bytes": total.copy_bytes,
                "cpu_s": total.cpu_s, "device_s": total.device_s, "wait_s": total.wait_s, "swaps": total.swaps,
                "layers": [dict(asdict(layer), hit_rate=layer.hit_rate) for layer in self.layers]}
