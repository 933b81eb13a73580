"""Hybrid CPU/GPU expert offload: configuration, budgets, placement, execution (no Qt)."""

from engine.offload.config import OffloadConfig, OffloadConfigError
from engine.offload.devices import SimulatedDevice


def attach_offload(decoder, config: OffloadConfig, device, layer_split: str | None = None,
                   decode_path: str | None = None, dense_on_device: bool = False, dense_cpu: str | None = None,
                   arena_refusal=None):
    """Run the decoder's expert nodes through an OffloadEngine (its layer split and decode path: OffloadEngine;
    dense_on_device: the dense part goes to `device`, where mode=disabled puts every expert; dense_cpu: why it runs on
    the CPU, None where it does not; arena_refusal: OffloadEngine's); returns the engine."""
    from engine.expert_node import CpuExpertNode
    from engine.offload.engine import OffloadEngine
    from engine.offload.hybrid_node import HybridExpertNode

    positions = [i for i, step in enumerate(decoder.steps) if isinstance(step, CpuExpertNode)]
    engine = OffloadEngine([decoder.steps[i] for i in positions], config, device, layer_split, decode_path,
                           decoder.kernel_threads, dense_on_device, dense_cpu, arena_refusal)
    for layer, position in enumerate(positions):
        decoder.steps[position] = HybridExpertNode(decoder.steps[position], layer, engine)
    decoder.on_step_end = engine.end_step
    decoder.before_last_segment = engine.settle_all_but
    return engine


__all__ = ["OffloadConfig", "OffloadConfigError", "SimulatedDevice", "attach_offload"]
