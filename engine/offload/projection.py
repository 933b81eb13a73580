"""What a run on the simulated device would take on the card it simulates.

The simulated device (devices.py) computes the "resident" experts with the CPU kernels, synchronously, so
its wall-clock timings are NOT the card's: the more experts resident, the more CPU work it does in series
with the CPU's own (cold) experts. It reports the card's device seconds (modelled: distinct experts ×
read_bytes / B_hbm) and copy seconds (bytes / B_pcie). This module replaces, per layer and step, the
simulated layer's CPU-serial time by the critical path a real card would give:

    one layer-step on the simulated device:  cpu + standin            (+ host overhead)
    the same on the card:                    T = critical path below  (+ the same host overhead)

    projected = wall − Σ_layer-steps (standin + cpu) + Σ_layer-steps T

with, per layer and step (the hybrid node's order of work, hybrid_node.py, and the CUDA device's streams):

    R       modelled device seconds of the resident experts, launched first (compute stream)
    waves   prefill waves, one after the other: the host stages wave i (copy c_i) once wave i−1 is
            collected, its compute d_i waits for the copy and for the device's earlier work; the host
            waits for each wave before the next:
                t = 0, dev = R;  for each wave: t = max(t + c_i, dev) + d_i; dev = t
                T = max(t + cpu, dev)        with the CPU computing the rest (cpu)
    decode  misses copied into spare slots first (m experts, copies m·c on the copy stream), then one launch
            computes the residents and the copied experts together (R + m·d) once the copies are in, while
            the CPU computes the rest: the hybrid node passes R + m·d as the copied work:
                T = max(cpu, m·c + R + m·d)

The decode form is miss_policy.py's step model, T(C) = max(Σ_{i∉C} cpu_i, t_resident + m·(copy + dev))
(prepare = 0 on the simulated device), with the CPU term measured instead of modelled. Without copies or
residents, T = cpu. It is Σ over steps of max(...), not max of the sums: the hybrid node adds each step's
T to LayerStats.critical_s and the stand-in's wall time to LayerStats.standin_s (0 on CUDA).

The host's own overhead (routing, bookkeeping, the dense layers, collect adding partial results) stays as
measured. The bandwidths are the simulated device's assumed ones (Bandwidths in devices.py), stated with
every projection.
"""

from __future__ import annotations

import copy
from typing import Iterable


def layer_critical_s(cpu_s: float, resident_s: float = 0.0, waves: Iterable[tuple[float, float]] = (),
                     miss_copy_s: float = 0.0, miss_device_s: float = 0.0) -> float:
    """T of one layer-step (module docstring): `cpu_s` the CPU's measured expert compute, `resident_s` the
    device's modelled seconds on the resident experts launched first, `waves` (copy s, device s) per prefill
    wave, `miss_copy_s` the copies into spare slots and `miss_device_s` the device work that waits for them."""
    t, dev = 0.0, resident_s
    for copy_s, device_s in waves:
        t = max(t + copy_s, dev) + device_s
        dev = t
    return max(t + cpu_s, max(dev, t + miss_copy_s) + miss_device_s)


def saving_s(layers) -> float:
    """Seconds the simulated device's wall time holds beyond the card's: Σ (standin + cpu − critical)."""
    return sum(layer.standin_s + layer.cpu_s - layer.critical_s for layer in layers)


def projected_seconds(wall_s: float, layers) -> float:
    """wall − Σ standin − Σ cpu + Σ critical, over LayerStats (or anything with those three attributes)."""
    return max(0.0, wall_s - saving_s(layers))


def decode_totals(offload, device):
    """On the simulated device, a copy of the decode phase's totals (LayerStats) so far, for projected_decode_rate;
    None on any other device or without offload."""
    if offload is None or not is_simulated(device):
        return None
    return copy.copy(offload.stats.phases["decode"])


def projected_decode_rate(before, after, decode_s: float, generated_tokens: int) -> float | None:
    """Decode tokens/s projected for the simulated card over one answer: `before` and `after` decode_totals around
    it, `decode_s` its measured decode time; None off the simulated device, or for an answer without a decode step."""
    if before is None or after is None or not decode_s or generated_tokens < 2:
        return None
    seconds = max(0.0, decode_s - (saving_s([after]) - saving_s([before])))
    return (generated_tokens - 1) / seconds if seconds > 0 else None


def bandwidths_dict(bandwidths) -> dict:
    return {"pcie_bytes_per_s": float(bandwidths.pcie), "hbm_bytes_per_s": float(bandwidths.hbm)}


def project_run(bandwidths, completion_s: float, all_layers, prefill_s: float | None = None, prefill_layers=(),
                decode_s: float = 0.0, decoded_tokens: int = 0, decode_layers=()) -> dict:
    """The `projected` block of a record on the simulated device: decode tokens/s, prefill s, completion s on
    the simulated card, with the bandwidths assumed. `*_layers`: the LayerStats (or phase totals) whose
    work the matching wall time holds."""
    decode = projected_seconds(decode_s, decode_layers) if decode_s else 0.0
    return {"decode_tokens_per_s": decoded_tokens / decode if decode_s and decode > 0 and decoded_tokens else None,
            "prefill_s": projected_seconds(prefill_s, prefill_layers) if prefill_s is not None else None,
            "completion_s": projected_seconds(completion_s, all_layers),
            "bandwidths": bandwidths_dict(bandwidths), "note": "projected for the simulated card"}


def is_simulated(device) -> bool:
    return getattr(device, "kind", None) == "simulated"
