"""GPU execution of one com.microsoft QMoE node (int4 / int8 raw layout; other layouts converted exactly on upload by
``kernels.gpu.convert``): CuPy + CUDA C++ kernels.

Mirrors ``kernels.cpu.CpuQMoE``: ``forward(x, router_logits, router_weights=None)`` and
``run_experts(x2d, expert_ids, weights, out=None)``. CuPy is imported lazily: importing this module never needs it.

Storage: each projection's experts live in *slot* arrays ``[num_slots, ...]`` in the kernels' layout
(``kernels.gpu.layout``); ``slot_of[expert]`` maps experts to slots (-1 = not resident). By default every expert is
resident (num_slots = E). ``pack_expert`` converts one expert on the host (do it once, keep the result in pinned
memory) and ``upload_expert(e, slot, stream)`` copies it into a slot asynchronously: the offload engine's interface.
Pairs routed to a non-resident expert are skipped (they contribute nothing): the caller computes them elsewhere.

Paths:
* ``tc`` (sm_80+): decode (<= ``decode_max_tokens`` tokens): one grouped dequant-GEMV launch per projection on the
  tensor cores with bf16 hi/lo activations (fp32-accurate); fp16 activations (v5, ``dec5_cfg["f16"]``): fp16
  weights and activations, one f16 MMA per k-step, fp32 accumulation, FC2's activation rounded to fp16; prefill:
  grouped GEMM (fp16 tensor cores, fp32 accumulation; per-block scales folded in fp16, so ~1e-3 relative), compiled
  separately for int4 with blocks of 32 and no zero points, on wgmma where the module has it (``prefill_kernel``).
* ``fma`` (any GPU): plain fp32 FMA kernels over the same layout (exact fp32 dequantisation; slow).
Routing runs on the GPU with the CUDA semantics (softmax over all E, top-k, renormalise when
normalize_routing_weights; router_weights); the sparse mixer routes on the host (kernels.reference.route).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import operator
import os
import weakref

import numpy as np

from ..qmoe_spec import QMoESpec, UnsupportedLayout
from .. import reference as _ref
from . import convert as _conv
from . import layout as _lay
from ._module import has_wgmma, load_module
from .driver_calls import BatchCopyError, DriverCalls, DriverError
from .host_tier import TieredRows
from .launch_pdl import PdlLauncher
from .pack_device import DriverPackIssuer, descriptor, plan_for
from .pack_host import pack_expert_host

__all__ = ["GpuQMoE", "gpu_available", "routes_on_device"]

_ACT = {"relu": 0, "gelu": 1, "silu": 2, "identity": 3, "swiglu": 4}
DT_F32, DT_F16, DT_BF16 = 0, 1, 2


def _cp():
    import cupy

    return cupy


def routes_on_device(spec: QMoESpec) -> bool:
    """Whether the routing kernels take this node's routing (softmax top-k over at most 1024 experts: no sparse mixer);
    the others route on the host."""
    return not spec.use_sparse_mixer and spec.num_experts <= 1024


def gpu_available() -> bool:
    try:
        return _cp().cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def default_prefill_bm(pairs: int, resident_experts: int) -> int:
    """Tokens per prefill tile, from the mean (token, expert) pairs per resident expert m. An expert whose pairs exceed
    a tile takes a second one and dequantises its weights again. Measured on the H200 at 512 tokens (twenty-second
    session, pf_gemmc): m = 32 (shape B) BM 48 0.248 ms, 32 0.259, 64 0.291; m = 64 (shape A) BM 32 0.464, 48 0.509,
    64 0.459. 48 where m is 24-48 (measured at 32 only); 64 where m exceeds 128 (not measured); 32 otherwise."""
    m = pairs / max(1, resident_experts)
    if m > 128:
        return 64
    return 48 if 24 < m <= 48 else 32


def _is_bf16(dtype) -> bool:
    return np.dtype(dtype).name == "bfloat16"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Workspace:
    """Per-instance device buffers, grown on demand (never during a graph capture: warm up first)."""

    def __init__(self):
        self.T = self.P = self.tiles_cap = 0


class GpuQMoE:
    """Executes one QMoE node on an NVIDIA GPU. See the module docstring."""

    decode_max_tokens = 8  # batches of at most this many tokens take the decode (GEMV) path

    def __init__(self, spec: QMoESpec, tensors: dict, device: int = 0, num_slots: int | None = None,
                 resident=None, path: str = "auto", host_tier: bool = False):
        # Layouts the kernels do not read (int2 / int3, SM80 prepacked, mixed widths, nvfp4, mxfp4) are converted
        # exactly on the host, one expert at a time, when the expert is uploaded or packed (kernels.gpu.convert):
        # from here on spec / tensors describe the converted layout; fp8 weights are refused (no exact conversion)
        self.source_spec = spec
        self.conversion = _conv.for_gpu(spec, tensors)
        spec, tensors = self.conversion.spec, self.conversion.tensors
        self.spec = spec
        self.fc1, self.fc2 = _lay.make_layouts(spec, tensors)
        cp = _cp()
        E = spec.num_experts
        if E > 2048:
            raise UnsupportedLayout(f"node '{spec.node_name}': {E} experts (the GPU grouping kernel takes <= 2048)")
        self._tensors = {k: v for k, v in tensors.items() if v is not None}
        self.device = cp.cuda.Device(device)
        self._device_id = int(self.device.id)
        with self.device:
            self.cc = int(self.device.compute_capability)
            if path == "auto":
                path = "tc" if self.cc >= 80 else "fma"
            if path not in ("tc", "fma"):
                raise ValueError(f"path must be 'auto', 'tc' or 'fma', not {path!r}")
            if path == "tc" and self.cc < 80:
                raise UnsupportedLayout(f"tensor-core kernels need sm_80+, this GPU is sm_{self.cc}")
            self.path = path
            self.num_sms = int(self.device.attributes["MultiProcessorCount"])
            self._mod, self.compiled_from = load_module(str(self.cc))
            # asked here, not at the first prefill: that may run inside a CUDA graph's capture
            self.has_wgmma = path == "tc" and has_wgmma(str(self.cc))
            self._fns: dict = {}
            self._smem_set: dict = {}
            S = E if num_slots is None else int(num_slots)
            if S < 1:
                raise ValueError("num_slots must be >= 1")
            self.num_slots = S
            # host_tier: every expert also in page-locked host memory, in slot host0 + e of the same arrays, which
            # the kernels read over PCIe where the expert is in no GPU slot (host_tier.py); None: no such copies,
            # and the kernels skip the pairs of such experts
            self.host0 = None
            self.tier: TieredRows | None = None  # the host tier's mappings (their bytes: device_bytes, host_bytes)
            self.slots = self._alloc_tiered(S, E) if host_tier else {
                p.name: self._alloc_slots(p, S) for p in (self.fc1, self.fc2)}
            self.slot_of = np.full(E, -1, np.int32)
            self.expert_in_slot = np.full(S, -1, np.int32)
            self._slot_dev = cp.full(E, -1, dtype=cp.int32)
            self._dummy_u8 = cp.zeros(16, cp.uint8)
            self._dummy_u16 = cp.zeros(16, cp.uint16)
            self._dummy_f32 = cp.zeros(16, cp.float32)
            self._dummy_i32 = cp.zeros(16, cp.int32)
            self._occ: dict = {}
            self._carveout_set: set = set()
            self._ws = _Workspace()
            # run_staged's CUDA graphs by launch (buffers, shape, configuration); dropped when the workspace grows
            self._graphs: dict = {}
            self._graph_seen: set = set()
            # run_routed_split's graph for the very arrays of its last replay (_SplitReplay); calls that took it
            self._split_replay: _SplitReplay | None = None
            self.split_fast_calls = 0
            # the same for run_routed (a fully resident layer's, or the tier's, decode launch); fast_routed False:
            # every call through the key (bench_offload_ab's gpu.fast_routed=0)
            self._routed_replay: _SplitReplay | None = None
            self.routed_fast_calls = 0
            self.fast_routed = True
            # run_routed_split's stop record and gated merge in its graph, and repeat calls straight to that graph
            # (True); False: both after the graph, every call through the checks and the key (the thirty-second
            # session's order, for bench_offload_ab's gpu.fast_split=0)
            self.fast_split = True
            self._merge_launches: dict = {}  # merge_sum's and merge_gated's prepared launches (_launch_merge)
            # the offload engine's "both" decode layers queue their merge before the CPU's part exists (merge_gated,
            # True) or after it (merge_sum, False: the A/B, MOE_GATED_MERGE=0 for the engine's)
            self.gated_merge = os.environ.get("MOE_GATED_MERGE", "1") != "0"
            # a gated merge waits for its gate on the GPU, whoever raises it (the host-part worker's compiled loop)
            self.gate_waits_on_device = True
            # launch configuration of the decode kernels (benchmarks/bench_qmoe_gpu.py sweeps these; the defaults
            # are the H200 optimum at both benchmark shapes, W1 = 0: 2 warps per FC1 block when the FC1 grid
            # alone fills 4 blocks per SM, else 4; ksplit2 = 0: automatic); rank_route: decode_prep routes by ranks
            # counted by the whole block (1, where T * E <= 4096) or one warp per token in k arg-max rounds (0)
            self.dec_cfg = {"R1": 2, "W1": 0, "R2": 2, "W2": 2, "ksplit2": 2, "rank_route": 1}
            # decode kernels: "v4" (dec_gemv, grid over (row block, tile, K split)) or "v5" (dec5, stream-K: a grid
            # of the GPU's resident capacity, every warp one contiguous range of (tile, row tile, k-tile) units);
            # dec5_cfg["bps"]: blocks per SM (0 = the occupancy calculator's figure); "bps1" / "bps2": the same for
            # FC1 / FC2 alone (0 = "bps"): an FC1 grid that leaves room lets FC2's blocks (PDL) become resident
            # during FC1 and copy their first units' weights then; dec5_cfg["grid"]: a fixed number of blocks
            # instead (0 = bps * SMs, at most one block per 4 units of work);
            # dec5_cfg["l2_prefetch"]: FC1's warps prefetch FC2's weights and scales into L2 when done (1 / 0; off: the
            # forward was 2-4% faster without it at both benchmark shapes on the H200, fourth and ninth sessions);
            # dec5_cfg["f16"]: fp16 activations take the dec5h kernels (fp16 weights and activations, one f16 MMA per
            # k-step, FC2's activation rows rounded to fp16) (1, the default when the key is absent) or the bf16
            # hi / lo kernels as fp32 / bf16 activations do (0);
            # dec5_cfg["pdl"]: FC1 and FC2 launched with programmatic dependent launch (launch_pdl.py; sm_90+ only,
            # ignored below), so each starts its blocks during the previous kernel's tail (1 / 0; on: 4-4.5% less
            # time per fp16 forward at both benchmark shapes on the H200, 1% with fp32 x; thirteenth session)
            self.decode_kernel = "v5"
            self.dec5_cfg = {"bps": 0, "bps1": 0, "bps2": 0, "grid": 0, "l2_prefetch": 0, "f16": 1, "pdl": 1}
            self._pdl = PdlLauncher.from_driver() if self.cc >= 90 else None
            # the dec5 launches of the last eager decode call that went through PDL (tests check the path)
            self.last_decode_pdl = False
            # the dec5 kernels of the last decode call that launched them eagerly (FC1, FC2): tests check the path
            self.last_decode_kernels: tuple = ()
            self.prefill_bm = 0  # tokens per prefill tile (32, 48, 64, 128); 0 = default_prefill_bm's choice
            # prefill kernels: "v1w" = pf_gemmw (pf_gemmc on wgmma: 1.11x faster than pf_gemmc at 512 tokens on the
            # H200, twenty-third session) where v1c takes pf_gemmc and the module has wgmma (the sm_90a cubin), else
            # as v1c; "v1c" = pf_gemmc (pf_gemm compiled for int4, blocks of 32, no zero point: 1.2x faster than
            # pf_gemm) where the projection's layout is that and BM is 32, 48 or 64, else pf_gemm; "v1" = pf_gemm
            # always (tests and benchmarks compare them)
            self.prefill_kernel = "v1w"
            # the prefill kernels (FC1, FC2) of the last prefill call on the tensor-core path: tests check the path
            self.last_prefill_kernels: tuple = ()
            res = list(range(min(E, S))) if resident is None else [int(e) for e in resident]
            if len(res) > S:
                raise ValueError(f"{len(res)} resident experts do not fit in {S} slots")
            self._upload_initial(res)
            if host_tier:
                self._fill_host_tier()
            self._init_device_pack()
            # The slot arrays' memsets, the expert -> slot map and the pack tables were queued on the current stream;
            # the offload engine copies experts in on its copy stream, which does not wait for this one.
            cp.cuda.get_current_stream().synchronize()

    # ------------------------------------------------------------------ storage
    def _alloc_slots(self, p: _lay.ProjLayout, S: int) -> dict:
        cp = _cp()
        return {key: cp.zeros((S, n), dt) for key, (n, dt) in p.slot_arrays().items()}

    def _alloc_tiered(self, S: int, E: int) -> dict:
        """The slot arrays with a host tier: rows [0, S) in device memory (zeroed), rows [host0, host0 + E) in
        page-locked host memory, one address range per array (host_tier.TieredRows)."""
        cp = _cp()
        tensors = {p.name: p.slot_arrays() for p in (self.fc1, self.fc2)}
        rows = self.tier = TieredRows(self._device_id, S, E, self.fc1.row_bytes() + self.fc2.row_bytes())
        self.host0 = rows.host0
        slots = {}
        for name, t in tensors.items():
            slots[name] = {}
            for key, (n, dt) in t.items():
                arr = rows.array(cp, n, dt)
                arr[:S].fill(0)
                slots[name][key] = arr
        return slots

    def _fill_host_tier(self) -> None:
        """Every expert packed into its host row host0 + e."""
        self._pack_rows(np.arange(self.spec.num_experts, dtype=np.int64), self.host0)

    def _host0_arg(self) -> int:
        """pack_expert's host0: the host tier's first row, -1 without one."""
        return -1 if self.host0 is None else self.host0

    def _device_map(self) -> np.ndarray:
        """The expert -> slot map the kernels read: slot_of, with the host tier's row for every expert in no slot."""
        if self.host0 is None:
            return self.slot_of
        return np.where(self.slot_of >= 0, self.slot_of, self.host0 + np.arange(self.slot_of.size)).astype(np.int32)

    def expert_bytes(self) -> int:
        """Bytes the kernels read for one expert (weights, scales, zero points, biases of FC1(+FC3) and FC2), in the
        converted layout when the stored one was converted (int2 / int3 -> int4, fp4 -> int8 ...: up to twice the
        stored weight bytes; ``kernels.gpu.convert.gpu_expert_bytes`` computes it without CuPy)."""
        return self.fc1.slot_bytes() + self.fc2.slot_bytes()

    def expert_device_bytes(self) -> int:
        """``expert_bytes`` plus the fp16 copy of block scales the prefill kernel reads: device memory per slot."""
        return self.fc1.device_bytes() + self.fc2.device_bytes()

    def _upload_initial(self, experts: list) -> None:
        """The resident experts packed into their slots and the expert -> slot map, queued on the current stream
        (the constructor waits for it)."""
        es = np.asarray(experts, dtype=np.int64)
        self._pack_rows(es, 0)
        self.slot_of[es] = np.arange(len(es), dtype=np.int32)
        self.expert_in_slot[:len(es)] = es
        self._slot_dev.set(self._device_map())

    def _pack_rows(self, experts: np.ndarray, first_row: int) -> None:
        """`experts` packed on the device into consecutive slot-array rows from `first_row` on, ~512 MB of stored
        rows at a time, on the current stream."""
        cp = _cp()
        raw_per_expert = 3 * (self.fc1.NP * self.fc1.KP + self.fc2.NP * self.fc2.KP)
        chunk = max(1, (512 << 20) // max(raw_per_expert, 1))
        for i0 in range(0, len(experts), chunk):
            es = experts[i0:i0 + chunk]
            row = first_row + i0
            for p in (self.fc1, self.fc2):
                packed = _lay.pack(p, *_lay.raw_sources(self.spec, self._tensors, p, es, xp=cp), xp=cp)
                for key, arr in packed.items():
                    self.slots[p.name][key][row:row + len(es)] = arr

    def pack_expert(self, e: int) -> dict:
        """Expert e converted to the kernel layout on the host: {"fc1": {"w", "s", ["h"], ["z"], ["b"]}, "fc2": {...}}
        of 1-D NumPy arrays (a stored layout the kernels do not read is converted first, as at construction). Keep
        them (in pinned memory) to upload the expert later without converting again. Numba kernels
        (``kernels.gpu.pack_host``), byte for byte what ``layout.pack`` of ``layout.raw_sources`` gives; no CuPy."""
        return pack_expert_host(self.spec, self._tensors, self.fc1, self.fc2, e)

    def upload_expert(self, e: int, slot: int, stream=None, packed: dict | None = None) -> None:
        """Copy expert e (host, converted by ``pack_expert``) into ``slot`` on ``stream`` (default: the current
        CuPy stream), then point the expert->slot map at it (the expert held by the slot before is evicted).
        The copies are asynchronous only from pinned host memory; order the kernels that use the slot after
        ``stream`` (an event), and do not overwrite a slot that kernels in flight still read."""
        cp = _cp()
        e, slot = int(e), int(slot)
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range (num_slots={self.num_slots})")
        if packed is None:
            packed = self.pack_expert(e)
        with self.device:
            stream = stream or cp.cuda.get_current_stream()
            for p in (self.fc1, self.fc2):
                for key, arr in self.slots[p.name].items():
                    arr[slot].set(packed[p.name][key], stream=stream)
            self._map_slot(e, slot, stream)

    def upload_expert_device(self, e: int, slot: int, stream=None) -> None:
        """upload_expert converting on the GPU: the expert's stored rows are copied over as they are (a DMA when
        they are page-locked: engine/offload/host_register.py) and put in the kernel layout there, on ``stream``;
        the host only issues the work. Same contents as upload_expert. Common layouts take one ``pack_expert``
        launch for both projections, which also updates the device's expert -> slot map (kernels.gpu.pack_device);
        others go through layout.pack (~30 CuPy calls per projection). The common layouts' copies and launch go
        straight through the driver (``driver_copies``, kernels.gpu.driver_calls: to cut the host's ~40-55 us per
        expert through CuPy, benchmarks/bench_pack_host.py --issue) unless that failed before its first copy
        (``driver_copy_fallback`` says why), the memcpys of an expert in one batch (``batch_copies``)."""
        cp = _cp()
        e, slot = int(e), int(slot)
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range (num_slots={self.num_slots})")
        if self.driver_copies and self._pack_desc is not None and self.driver_copy_fallback is None:
            with self._made_current():
                issued = self._pack_expert_driver(e, slot, stream or cp.cuda.get_current_stream())
            if issued:
                self.device_packs += 1
                return
        with self.device:
            stream = stream or cp.cuda.get_current_stream()
            with stream:
                if self._pack_desc is not None:
                    self._pack_expert(e, slot, stream)
                    self.device_packs += 1
                    return
                for p in (self.fc1, self.fc2):
                    packed = _lay.pack(p, *_lay.raw_sources(self.spec, self._tensors, p, np.array([e]), xp=cp),
                                       xp=cp)
                    for key, arr in packed.items():
                        self.slots[p.name][key][slot] = arr[0]
            self._map_slot(e, slot, stream)

    def set_source(self, spec: QMoESpec, tensors: dict) -> None:
        """Take experts from another node's stored tensors from now on (pack_expert, upload_expert*): one set of
        slots shared by nodes of the same layout (the offload engine's decode streaming slots, one set for every
        layer). The node must be read as stored (no conversion) in exactly this instance's layout and staging plan;
        anything else raises ValueError. Checked once per node (by name), then a dictionary lookup. The slots keep
        what they hold: the caller decides what is valid."""
        known = self._sources.get(spec.node_name)
        if known is None:
            known = self._sources[spec.node_name] = self._source_of(spec, tensors)
        self._tensors, self._pack_copies = known

    def _source_of(self, spec: QMoESpec, tensors: dict) -> tuple:
        """set_source's check: (the tensors, pack_expert's host copies of them)."""
        if dataclasses.replace(spec, node_name=self.source_spec.node_name) != self.source_spec \
                or self.conversion.kind != "none":
            raise ValueError(f"node '{spec.node_name}': a layout other than the slots' ('{self.source_spec.node_name}')")
        tensors = {k: v for k, v in tensors.items() if v is not None}
        if set(tensors) != set(self._tensors) or any(
                tensors[k].shape != self._tensors[k].shape or tensors[k].dtype != self._tensors[k].dtype
                for k in tensors):
            raise ValueError(f"node '{spec.node_name}': tensors other than the slots' in shape or dtype")
        if self._pack_desc is None:
            return tensors, None
        plans = self._pack_plans(tensors)
        if plans is None or sum(plan.nbytes for plan in plans) != self._pack_bytes:
            raise ValueError(f"node '{spec.node_name}': its tensors are not packed as the slots' are")
        return tensors, self._host_copies(plans)

    def _pack_plans(self, tensors: dict):
        """pack_expert's plans for FC1 and FC2 of these tensors, or None (a layout it does not read)."""
        plan1 = plan_for(self.spec, tensors, self.fc1)
        plan2 = plan_for(self.spec, tensors, self.fc2, offset=plan1.nbytes) if plan1 else None
        return None if plan2 is None else (plan1, plan2)

    @staticmethod
    def _host_copies(plans) -> list:
        """Per stored tensor: (its offset in the staging, its host address, bytes per expert), read at every copy."""
        return [(off, a.ctypes.data, a.strides[0]) for plan in plans for a, off in plan.parts.values()]

    def _init_device_pack(self) -> None:
        """pack_expert's plans for both projections and their descriptor on the device, made once (None: a layout it
        does not read, layout.pack instead)."""
        self.device_packs = 0  # experts upload_expert_device packed with pack_expert (tests check the path taken)
        # pack_expert's copies and launch through the driver's calls (True) or CuPy's (False: the benchmarks' A/B;
        # MOE_DRIVER_COPIES=0 for the engine's, gpu_offload_ab.sh); driver_copy_fallback: why CuPy's calls are taken
        # for good (None: they are not); driver_packs: experts the driver path packed (tests check the path taken)
        self.driver_copies = os.environ.get("MOE_DRIVER_COPIES", "1") != "0"
        self.driver_copy_fallback = None
        self.driver_packs = 0
        # the driver path's memcpys of an expert in one cuMemcpyBatchAsync (True) or one call per stored tensor
        # (False: the A/B, MOE_BATCH_MEMCPY=0 for the engine's); batch_copy_fallback: why they go one by one for good
        # (no batch memcpy in the driver, a refused batch before the first went through); batch_packs: batched experts
        self.batch_copies = os.environ.get("MOE_BATCH_MEMCPY", "1") != "0"
        self.batch_copy_fallback = None
        self.batch_packs = 0
        self._driver_issuers: dict = {}  # stream pointer -> its DriverPackIssuer
        self._driver_staging: dict = {}  # stream pointer -> the staging buffer its issuer copies into
        self._pack_desc = None
        self._pack_copies = None
        self._sources: dict = {}  # node name -> (its tensors, pack_expert's copies of them): set_source
        plans = self._pack_plans(self._tensors)
        if plans is None:
            return
        cp = _cp()
        self._pack_bytes = sum(plan.nbytes for plan in plans)  # one expert's stored rows, staged for pack_expert
        self._pack_copies = self._host_copies(plans)
        self._pack_items = sum(p.w_bytes + p.s_len + (p.NP if p.has_bias else 0) for p in (self.fc1, self.fc2))
        # kept: the descriptor holds their device addresses
        self._row_src_dev = {p.name: cp.asarray(p.row_src.astype(np.int32)) for p in (self.fc1, self.fc2)}
        slot_arrays = {name: {key: (a.data.ptr, a.strides[0]) for key, a in arrays.items()}
                       for name, arrays in self.slots.items()}
        row_src = {name: a.data.ptr for name, a in self._row_src_dev.items()}
        self._pack_desc = cp.asarray(descriptor(plans, row_src, slot_arrays))
        self._sources[self.source_spec.node_name] = (self._tensors, self._pack_copies)

    def _pack_expert(self, e: int, slot: int, stream) -> None:
        """Expert e's stored rows copied to one device buffer (one copy per tensor, on `stream`), then one pack_expert
        launch writes the slot and points the device's map at it; the host's maps are updated here. The buffer goes
        back to CuPy's pool for `stream` when this returns: reused only by later work on that stream."""
        cp = _cp()
        staging = cp.empty(self._pack_bytes, cp.uint8)
        base = staging.data.ptr
        for offset, address, row_bytes in self._pack_copies:
            cp.cuda.runtime.memcpyAsync(base + offset, address + e * row_bytes, row_bytes,
                                        cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        old = self._map_host(e, slot)
        grid = max(1, min(_cdiv(self._pack_items, 256), 16 * self.num_sms))
        self._f("pack_expert")((grid,), (256,), (self._pack_desc, staging, np.int32(slot), self._slot_dev,
                                                 np.int32(e), np.int32(old), np.int32(self._host0_arg())))

    def _pack_expert_driver(self, e: int, slot: int, stream) -> bool:
        """_pack_expert through the driver's calls, the staging buffer and launch arguments made once per stream
        (pack_device.DriverPackIssuer); the host's maps are updated once the launch is queued. False where the
        driver path failed before its first copy: CuPy's calls from then on, the reason in driver_copy_fallback.
        The memcpys go in one batch (``batch_copies``) unless that failed before the first batch went through: one
        call per tensor from then on, the reason in batch_copy_fallback. The device must be current."""
        try:
            issuer = self._driver_issuers.get(stream.ptr)
            if issuer is None:
                issuer = self._driver_issuer(stream)
            old = int(self.expert_in_slot[slot])
            try:
                batched = issuer.issue(self._pack_copies, e, slot, old,
                                       self.batch_copies and self.batch_copy_fallback is None)
            except BatchCopyError as err:
                # raised before the launch; after a batch went through, a real failure as below
                if self.batch_packs:
                    raise
                self.batch_copy_fallback = str(err)
                batched = issuer.issue(self._pack_copies, e, slot, old, False)
        except DriverError as err:
            if self.driver_packs:  # it worked before: a real failure (a bad address ...), not a missing feature
                raise
            self.driver_copy_fallback = str(err)
            return False
        self._map_host(e, slot)
        self.driver_packs += 1
        self.batch_packs += batched
        return True

    def _driver_issuer(self, stream) -> DriverPackIssuer:
        """The driver path's issuer for `stream` (made on its first copy there)."""
        calls = DriverCalls.from_driver()
        if calls is None:
            raise DriverError("loading libcuda's cuMemcpyHtoDAsync_v2 and cuLaunchKernel", -1)
        staging = _staging_for(self._device_id, stream, self._pack_bytes)
        grid = max(1, min(_cdiv(self._pack_items, 256), 16 * self.num_sms))
        issuer = DriverPackIssuer(calls, self._f("pack_expert").kernel.ptr, grid, self._pack_desc.data.ptr,
                                  staging.array.data.ptr, self._slot_dev.data.ptr, stream.ptr, self._host0_arg())
        self._driver_issuers[stream.ptr] = issuer
        self._driver_staging[stream.ptr] = staging  # kept while this instance may copy on the stream
        return issuer

    def _map_host(self, e: int, slot: int) -> int:
        """The host's expert <-> slot maps with e in `slot`; returns the expert the slot held (-1: none)."""
        old = int(self.expert_in_slot[slot])
        if old >= 0 and old != e:
            self.slot_of[old] = -1
        prev = int(self.slot_of[e])
        if prev >= 0 and prev != slot:
            self.expert_in_slot[prev] = -1
        self.slot_of[e] = slot
        self.expert_in_slot[slot] = e
        return old

    def _map_slot(self, e: int, slot: int, stream) -> None:
        """Point the expert->slot map at `slot` for expert e (evicting the slot's previous expert), on `stream`."""
        self._map_host(e, slot)
        self._slot_dev.set(self._device_map(), stream=stream)

    def evict(self, slot: int, stream=None) -> None:
        """Mark ``slot`` empty (its expert becomes non-resident)."""
        cp = _cp()
        e = int(self.expert_in_slot[slot])
        if e >= 0:
            self.slot_of[e] = -1
        self.expert_in_slot[slot] = -1
        with self.device:
            self._slot_dev.set(self._device_map(), stream=stream or cp.cuda.get_current_stream())

    def resident_experts(self) -> np.ndarray:
        return np.nonzero(self.slot_of >= 0)[0]

    # ------------------------------------------------------------------ helpers
    def _f(self, name: str):
        f = self._fns.get(name)
        if f is None:
            f = self._fns[name] = self._mod.get_function(name)
        return f

    def _act_args(self):
        s = self.spec
        lim = s.swiglu_limit
        return (np.int32(_ACT[s.activation]), np.int32(int(self.fc1.gated)), np.float32(s.alpha),
                np.float32(s.beta), np.float32(0.0 if lim is None else lim), np.int32(lim is not None))

    def _proj_args(self, p: _lay.ProjLayout, bits_arg: bool = False, fp16_scales: bool = False):
        sl = self.slots[p.name]
        head = (sl["w"], np.int64(p.w_bytes), np.int32(p.NT), np.int32(p.KT))
        if bits_arg:
            head = head + (np.int32(p.bits),)
        s, sdt = (sl["h"], DT_F16) if (fp16_scales and p.has_h) else (sl["s"], p.sdt)
        return head + (s, np.int32(sdt), np.int32(p.NB), np.int32(p.bs_log2),
                       sl.get("z", self._dummy_u8), np.int32(int(p.has_zp)),
                       sl.get("b", self._dummy_f32), np.int32(int(p.has_bias)), np.int32(p.NP))

    def _workspace(self, T: int, P: int, tiles: int, kind: str) -> _Workspace:
        cp = _cp()
        ws = self._ws
        grow_t, grow_p = T > ws.T, P > ws.P
        if grow_t or grow_p or tiles > ws.tiles_cap:
            self._graphs.clear()  # captured launches point into the buffers replaced here
            self._graph_seen.clear()
            self._split_replay = self._routed_replay = None
        if grow_p or tiles > ws.tiles_cap:
            ws.P = max(P, 2 * ws.P) if grow_p else ws.P
            ws.tiles_cap = max(tiles, 2 * ws.tiles_cap, ws.P + 1)
            ws.ids = cp.zeros(ws.P, cp.int32)
            ws.w = cp.zeros(ws.P, cp.float32)
            ws.pair_tok = cp.zeros(ws.P, cp.int32)
            ws.pair_w = cp.zeros(ws.P, cp.float32)
            ws.tiles = cp.zeros(ws.tiles_cap * 4, cp.int32)
            ws.num_tiles = cp.zeros(1, cp.int32)
            for name in ("ahi", "alo", "a16", "a32", "part", "kdone", "ranks"):
                setattr(ws, name, None)
        if grow_t:
            ws.T = max(T, 2 * ws.T)
            for name in ("xhi", "xlo", "x16", "x32"):
                setattr(ws, name, None)
        KP1, KP2 = self.fc1.KP, self.fc2.KP
        if kind == "dec":
            if getattr(ws, "xhi", None) is None:
                ws.xhi = cp.zeros(ws.T * KP1, cp.uint16)
                ws.xlo = cp.zeros(ws.T * KP1, cp.uint16)
            if getattr(ws, "ahi", None) is None:
                ws.ahi = cp.zeros(ws.P * KP2, cp.uint16)
                ws.alo = cp.zeros(ws.P * KP2, cp.uint16)
            if getattr(ws, "part", None) is None:
                # dec5 FC1 split-K scratch [tile][row tile][128] fp32 and k-tiles-done counters [tile][row tile]:
                # zero here, left zero by every launch (the completing warp reads with atomicExch(.., 0))
                ws.part = cp.zeros(ws.tiles_cap * self.fc1.NT * 128, cp.float32)
                ws.kdone = cp.zeros(ws.tiles_cap * self.fc1.NT, cp.int32)
        elif kind == "tc":
            if T * KP1 >= 1 << 34:  # prefill_prep counts x16's 16-byte chunks in 32-bit ints
                raise ValueError(f"{self.spec.node_name}: {T} tokens of {KP1} features are too many for one prefill "
                                 "call")
            if getattr(ws, "x16", None) is None:
                ws.x16 = cp.zeros(ws.T * KP1, cp.uint16)
            if getattr(ws, "ranks", None) is None:
                ws.ranks = cp.zeros(ws.P, cp.int32)  # each pair's rank among its expert's pairs (prefill_prep)
            if getattr(ws, "counts", None) is None:
                # pairs per expert and the routing blocks' ticket: zero here, left zero by every prefill_prep
                ws.counts = cp.zeros(self.spec.num_experts, cp.int32)
                ws.ticket = cp.zeros(1, cp.int32)
            if getattr(ws, "a16", None) is None:
                ws.a16 = cp.zeros(ws.P * KP2, cp.uint16)
        else:
            if getattr(ws, "x32", None) is None:
                ws.x32 = cp.zeros(ws.T * self.spec.hidden_size, cp.float32)
            if getattr(ws, "a32", None) is None:
                ws.a32 = cp.zeros(ws.P * self.spec.inter_size, cp.float32)
        return ws

    def _to_device_act(self, a, width: int):
        """(contiguous device array [rows, width], dtype code) for fp32 / fp16 / bf16 (NumPy ml_dtypes) input."""
        cp = _cp()
        if isinstance(a, cp.ndarray):
            if a.dtype == cp.float16:
                code = DT_F16
            elif a.dtype == cp.float32:
                code = DT_F32
            else:
                a, code = a.astype(cp.float32), DT_F32
            return cp.ascontiguousarray(a).reshape(-1, width), code
        a = np.asarray(a)
        if _is_bf16(a.dtype):
            return cp.asarray(np.ascontiguousarray(a).view(np.uint16)).reshape(-1, width), DT_BF16
        if a.dtype == np.float16:
            return cp.asarray(np.ascontiguousarray(a)).reshape(-1, width), DT_F16
        return cp.asarray(np.ascontiguousarray(a, dtype=np.float32)).reshape(-1, width), DT_F32

    def _from_f32(self, out32, code: int):
        cp = _cp()
        if code == DT_F32:
            return out32
        if code == DT_F16:
            return out32.astype(cp.float16)
        res = cp.empty(out32.shape, cp.uint16)
        n = out32.size
        self._f("from_f32")((max(1, min(_cdiv(n, 256), 8 * self.num_sms)),), (256,),
                            (out32, res, np.int32(DT_BF16), np.int64(n)))
        return res

    @staticmethod
    def _host_result(res, dtype, shape):
        cp = _cp()
        h = cp.asnumpy(res)
        if _is_bf16(dtype):
            h = h.view(dtype)
        return h.reshape(shape)

    # ------------------------------------------------------------------ public API
    def route(self, router_logits, router_weights=None):
        """(expert_ids int32 [T, k], weights float32 [T, k]) as CuPy arrays (CUDA semantics, see the module doc)."""
        cp = _cp()
        spec = self.spec
        with self.device:
            if not routes_on_device(spec):  # host routing
                ids, w = _ref.route(_as_host(router_logits), spec,
                                    None if router_weights is None else _as_host(router_weights))
                return cp.asarray(ids), cp.asarray(w)
            lg, ldt = self._to_device_act(router_logits, spec.num_experts)
            T = lg.shape[0]
            ids = cp.empty((T, spec.k), cp.int32)
            w = cp.empty((T, spec.k), cp.float32)
            rw, rwdt = (self._dummy_f32, 0) if router_weights is None else \
                self._to_device_act(router_weights, spec.num_experts)
            if T:
                self._f("route_topk")((_cdiv(T, 8),), (256,), (
                    lg, np.int32(ldt), rw, np.int32(rwdt), np.int32(router_weights is not None), np.int32(T),
                    np.int32(spec.num_experts), np.int32(spec.k), np.int32(int(spec.normalize_routing_weights)),
                    ids, w))
            return ids, w

    def forward(self, x, router_logits, router_weights=None):
        """Same contract as kernels.reference.qmoe_reference: x [T, H] or [B, S, H] -> same shape and dtype.
        NumPy in -> NumPy out, CuPy in -> CuPy out."""
        cp = _cp()
        on_host = not isinstance(x, cp.ndarray)
        dtype, shape = x.dtype, x.shape
        with self.device:
            xd, code = self._to_device_act(x, self.spec.hidden_size)
            out32 = cp.empty((xd.shape[0], self.spec.hidden_size), cp.float32)
            self.forward_into(xd, router_logits, out32, router_weights, x_code=code)
            res = self._from_f32(out32, code)
            if on_host:
                return self._host_result(res, dtype, shape)
            return res.reshape(shape)

    def forward_into(self, x_dev, router_logits, out32, router_weights=None, x_code: int | None = None,
                     ids_out=None):
        """forward() on device arrays into a preallocated fp32 ``out32`` [T, H] (overwritten). With device inputs
        and warmed-up workspaces it launches kernels only (no allocation, no host sync): CUDA-graph capturable.
        Where given, ``ids_out`` (device int32 [T, k], C-contiguous) receives the routed experts of each token, in
        rank order (the routing kernels write them there)."""
        spec = self.spec
        with self.device:
            if x_code is None:
                x_dev, x_code = self._to_device_act(x_dev, spec.hidden_size)
            T = x_dev.shape[0]
            if not routes_on_device(spec):  # host routing (sparse mixer, > 1024 experts)
                ids, w = self.route(router_logits, router_weights)
                if ids_out is not None:
                    _cp().copyto(ids_out, ids.reshape(ids_out.shape))
                self._compute(x_dev, x_code, T, out32, ids=ids, wts=w, kk=spec.k, zero_out=True)
                return out32
            lg, ldt = self._to_device_act(router_logits, spec.num_experts)
            if router_weights is None:
                rw, rwdt = None, 0
            else:
                rw, rwdt = self._to_device_act(router_weights, spec.num_experts)
            self._compute(x_dev, x_code, T, out32, logits=lg, ldt=ldt, rw=rw, rwdt=rwdt, zero_out=True,
                          ids_out=ids_out)
            return out32

    def run_experts(self, x2d, expert_ids, weights, out=None):
        """out[t] += sum_j weights[t, j] * FFN_{expert_ids[t, j]}(x2d[t]); expert id -1 (and non-resident
        experts) skipped. Without ``out``: a new array of x2d's kind and dtype. With ``out`` (CuPy float32
        [T, H], C-contiguous): accumulated in place and returned."""
        cp = _cp()
        spec = self.spec
        on_host = not isinstance(x2d, cp.ndarray)
        dtype = x2d.dtype
        with self.device:
            xd, code = self._to_device_act(x2d, spec.hidden_size)
            T = xd.shape[0]
            if isinstance(expert_ids, np.ndarray) and expert_ids.size and int(expert_ids.max()) >= spec.num_experts:
                raise ValueError(f"expert id out of range (num_experts={spec.num_experts})")
            ids = cp.ascontiguousarray(cp.asarray(expert_ids).astype(cp.int32, copy=False)).reshape(T, -1)
            kk = ids.shape[1]
            w = cp.ascontiguousarray(cp.asarray(weights).astype(cp.float32, copy=False)).reshape(T, kk)
            acc = out if out is not None else cp.zeros((T, spec.hidden_size), cp.float32)
            self._compute(xd, code, T, acc, ids=ids, wts=w, kk=kk, zero_out=False)
            if out is not None:
                return out
            res = self._from_f32(acc, code)
            return self._host_result(res, dtype, (T, spec.hidden_size)) if on_host else res

    def run_staged(self, x_dev, ids_dev, w_dev, out):
        """run_experts for device inputs already in the kernels' types, all C-contiguous: x float32 [T, H], expert
        ids int32 [T, k], weights float32 [T, k]; ``out`` float32 [T, H] is overwritten, not accumulated into.
        Kernel launches only (no conversion, allocation or copy): the offload engine's decode path
        (engine/offload/cuda_step.py).

        The decode kernels' launches are replayed as one CUDA graph from the second call with the same buffers on:
        their Python launch work (argument marshalling of three launches, ~100 µs per layer on the H200) is paid
        once. A graph stays valid while the buffers it points into do: the workspace (dropped when it grows), the
        slot arrays and the expert->slot map (updated in place by upload_expert / evict)."""
        T, kk = x_dev.shape[0], ids_dev.shape[1]

        def launch():
            self._compute(x_dev, DT_F32, T, out, ids=ids_dev, wts=w_dev, kk=kk, zero_out=True)

        self._replayed(("staged", x_dev.data.ptr, ids_dev.data.ptr, w_dev.data.ptr, out.data.ptr, T, kk), T, launch)
        return out

    def run_routed(self, x_dev, logits_dev, out32, out=None, router_weights=None, ids_out=None):
        """forward_into for device inputs as a dense part on the GPU leaves them (x float32 / float16 [T, H], router
        logits [T, E], router weights likewise or None), every routed expert resident: the offload engine's fully
        resident layers. The result goes into ``out32`` (float32 [T, H], overwritten) and, when ``out`` is another
        array (x's dtype), is converted into it; the routing, where ``ids_out`` is given, into it (forward_into).
        Kernel launches only; replayed as one CUDA graph from the second call with the same buffers, as
        run_staged. A call with the very arrays, stream and configuration of the last replay launches that graph at
        once, as run_routed_split does (_SplitReplay): the pointers and the graph key cost ~10 µs a layer."""
        cp = _cp()
        stream = cp.cuda.get_current_stream()
        arrays = (x_dev, logits_dev, out32, out, router_weights, ids_out)
        config = self._decode_config()
        replay = self._routed_replay if self.fast_routed else None
        if replay is not None and replay.matches(arrays, config, stream.ptr):
            replay.graph.launch(stream)
            self.routed_fast_calls += 1
            return out32 if out is None else out
        T = x_dev.shape[0]

        def launch():
            self.forward_into(x_dev, logits_dev, out32, router_weights, ids_out=ids_out)
            if out is not None and out is not out32:
                cp.copyto(out, out32, casting="same_kind")

        pointers = tuple(0 if a is None else a.data.ptr
                         for a in (x_dev, logits_dev, router_weights, out32, out, ids_out))
        dtypes = tuple(None if a is None else a.dtype.str for a in (x_dev, logits_dev, router_weights, out))
        graph = self._replayed(("routed", *pointers, *dtypes, T), T, launch)
        self._routed_replay = None
        # only where the graph reads the caller's own arrays (forward_into converts others into a copy at each call)
        if (graph is not None and all(map(_read_as_given, (x_dev, logits_dev, router_weights)))
                and cp.cuda.runtime.getDevice() == self._device_id):  # the stream's device is the graph's
            self._routed_replay = _SplitReplay(arrays, stream.ptr, config, graph)
        return out32 if out is None else out

    def run_routed_split(self, x_dev, logits_dev, out32, published, router_weights=None, *, stop=None, merged=None,
                         timeout_s: float = 1.0):
        """run_routed for a layer whose cold experts the GPU and the CPU share (the offload engine's "both" decode
        path): route_split (route.cu) routes on the device, leaves the routing, the CPU's pairs and x in
        ``published`` (kernels/gpu/published.py: the host waits for it with ``published.wait``), and the decode
        kernels compute the other pairs (resident, or read from the host tier) into ``out32`` (float32 [T, H],
        overwritten). The CPU's share per count of cold pairs is ``published.cpu_take``. Then, where given, the CUDA
        event ``stop`` is recorded (the GPU's part done) and merge_gated adds the CPU's part into ``merged``
        (merge_gated's ``out``, with its ``timeout_s``). Kernel launches and that record only, replayed as one CUDA
        graph from the second call with the same buffers: the record as an event record node, the merge as one
        launch fewer for the host (where the driver cannot record inside a graph, both follow the graph).
        A call with the very arrays, stream and configuration of the last replay launches that graph at once
        (_SplitReplay): the checks, conversions and graph key below cost tens of µs a layer of the host's time,
        which a "both" layer waits for."""
        stream = _cp().cuda.get_current_stream()
        arrays = (x_dev, logits_dev, out32, published, router_weights, stop, merged)
        config = (*self._decode_config(), timeout_s)
        replay = self._split_replay if self.fast_split else None
        if replay is not None and replay.matches(arrays, config, stream.ptr):
            self.relaunch_split(replay.graph, published, stream)
            return out32
        spec = self.spec
        if not routes_on_device(spec):
            raise UnsupportedLayout(f"node '{spec.node_name}': route_split routes on the device (no sparse mixer, "
                                    f"<= 1024 experts)")
        T, E, k = x_dev.shape[0], spec.num_experts, spec.k
        if T > self.decode_max_tokens or (T, k) != published.dev_ids.shape:
            raise ValueError(f"route_split takes a decode step of <= {self.decode_max_tokens} tokens matching its "
                             f"buffers {published.dev_ids.shape}, not {T} tokens")
        x_code = {np.dtype(np.float32): DT_F32, np.dtype(np.float16): DT_F16,
                  np.dtype(np.uint16): DT_BF16}[np.dtype(x_dev.dtype)]
        lg, ldt = self._to_device_act(logits_dev, E)
        rw, rwdt = (None, 0) if router_weights is None else self._to_device_act(router_weights, E)
        rank_route = T * k <= 64 and k <= E and T * E <= 4096 and bool(self.dec_cfg.get("rank_route", 1))
        head = E + 2 * T * k
        smem = 4 * (((head + 3) & ~3) + T * E + T * k if rank_route else head)
        cold_from = self.host0 if self.host0 is not None else 2 ** 31 - 1
        # a pair split by rows (the tables' split_rows; route_split applies them at one token): where dec5 decodes
        split_args = ((published.split_rows, published.cut) if self.splits_rows else (np.uint64(0), np.uint64(0)))

        def launch():
            self._f("route_split")((1,), (256,), (
                lg, np.int32(ldt), self._dummy_f32 if rw is None else rw, np.int32(rwdt), np.int32(rw is not None),
                np.int32(T), np.int32(E), np.int32(k), np.int32(int(spec.normalize_routing_weights)), self._slot_dev,
                np.int32(cold_from), published.cpu_take, published.dev_ids, published.dev_w,
                np.uint64(published.device_ptr), np.int32(published.ids_at), np.int32(published.cpu_at),
                np.int32(published.w_at), np.int32(published.x_at), x_dev, np.int32(published.x_bytes),
                published.seq, np.int32(rank_route), *split_args), shared_mem=smem)
            self._compute(x_dev, x_code, T, out32, ids=published.dev_ids, wts=published.dev_w, kk=k, zero_out=True,
                          cut=split_args[1])
            if tail_inside:
                self._split_tail(_cp().cuda.get_current_stream(), published, out32, stop, merged, timeout_s, calls)

        calls = DriverCalls.from_driver()
        tail_inside = self.fast_split and calls is not None and calls.records_in_graphs
        if merged is not None:
            _check_part(published, out32.size)
        pointers = tuple(0 if a is None else a.data.ptr for a in (x_dev, lg, rw, out32, published.dev_ids, merged))
        tail = (0 if stop is None else stop.ptr, timeout_s, tail_inside)
        graph = self._replayed(("split", *pointers, *tail, x_code, ldt, rwdt, T), T, launch)
        if not tail_inside:
            with self.device:
                self._split_tail(_cp().cuda.get_current_stream(), published, out32, stop, merged, timeout_s, None)
        self._split_replay = None
        # only where the graph reads the caller's own arrays (a converted copy is made again at every call) and holds
        # the whole call
        if (graph is not None and _reads_in_place(lg, logits_dev) and _reads_in_place(rw, router_weights)
                and (tail_inside or (stop is None and merged is None))
                and _cp().cuda.runtime.getDevice() == self._device_id):  # the stream's device is the graph's
            self._split_replay = _SplitReplay(arrays, stream.ptr, config, graph)
        published.launched += 1
        return out32

    @property
    def splits_rows(self) -> bool:
        """Whether run_routed_split may split a pair by rows with the CPU (kernels/cold_split.py): its decode kernels
        (dec5) read a split pair's rows as the last tile."""
        return self.path == "tc" and self.decode_kernel == "v5"

    def split_graph(self, x_dev, logits_dev, out32, published, router_weights=None, *, stop=None, merged=None,
                    timeout_s: float = 1.0):
        """The graph run_routed_split launched last where these very arrays and the decode configuration are that
        call's (its fast path's test on any stream: a graph runs on whichever stream it is launched on), else None.
        The caller launches it with relaunch_split."""
        replay = self._split_replay if self.fast_split else None
        arrays = (x_dev, logits_dev, out32, published, router_weights, stop, merged)
        if replay is None or not replay.matches(arrays, (*self._decode_config(), timeout_s)):
            return None
        return replay.graph

    def relaunch_split(self, graph, published, stream) -> None:
        """split_graph's graph launched on `stream`, counted as run_routed_split's fast path counts its launches."""
        graph.launch(stream)
        published.launched += 1
        self.split_fast_calls += 1

    def _split_tail(self, stream, published, out32, stop, merged, timeout_s: float, calls) -> None:
        """run_routed_split's record of `stop` and its gated merge into `merged`, on `stream`: inside the launch that
        a graph captures (`calls`: the driver's, to record the event as a node of that graph while the stream is
        captured; the driver refuses that flag outside a capture, CUDA_ERROR_ILLEGAL_STATE), or after it (None)."""
        if stop is not None:
            if calls is not None and stream.is_capturing():
                calls.record_external(stop.ptr, stream.ptr)
            else:
                stop.record(stream)
        if merged is None:
            return
        if calls is None:
            self.merge_gated(published, out32, merged, timeout_s)
            return
        self._f("merge_gated")(self._merge_grid(out32.size), (256,),
                               self._merge_gated_args(published, out32, merged, timeout_s)())

    def _decode_config(self) -> tuple:
        """What a captured decode launch was made with besides its buffers (compared by value: the dicts are changed
        in place by benchmarks and tests)."""
        return self.path, self.decode_max_tokens, self.decode_kernel, self.dec_cfg, self.dec5_cfg

    def merge_gated(self, published, a, out, timeout_s: float = 1.0) -> None:
        """out = a + the CPU's part, queued on the current stream before the host has that part: merge.cu's
        merge_gated waits on the device until the host has written it into ``published.part`` and raised the gate
        (PublishedRouting.open_gate) for the latest run_routed_split, then adds it, read over PCIe. A gate still down
        after ``timeout_s`` leaves out = a and the launch's number in ``published.gate_failed()``. ``a`` float32
        [T, H] on the device, ``out`` float16 / float32; one launch (prepared once, as merge_sum's), capturable in a
        CUDA graph."""
        n = a.size
        _check_part(published, n)
        key = ("merge_gated", published.device_ptr, published.seq.data.ptr, a.data.ptr, out.data.ptr, n,
               out.dtype.char, int(timeout_s * 1e9))
        self._launch_merge(self._f("merge_gated"), key, n, self._merge_gated_args(published, a, out, timeout_s))

    @staticmethod
    def _merge_gated_args(published, a, out, timeout_s: float):
        """A function giving merge_gated's arguments."""
        n = a.size
        base = published.device_ptr
        timeout_ns = int(timeout_s * 1e9)

        def args():
            out_dt = {np.dtype(np.float16): DT_F16, np.dtype(np.float32): DT_F32}[np.dtype(out.dtype)]
            return (published.seq, np.uint64(base + published.gate_at), np.uint64(base + published.part_at), a, out,
                    np.int32(out_dt), np.int32(n), np.int64(timeout_ns), np.uint64(base + published.failed_at))

        return args

    def _merge_grid(self, n: int) -> tuple:
        """A merge's grid over n values: 256 a block, at most four blocks per SM (grid-stride beyond)."""
        return (max(1, min(_cdiv(n, 256), 4 * self.num_sms)),)

    def merge_sum(self, a, b, out) -> None:
        """out = a + b (b None: a alone), float32 device arrays in, out's dtype (float16 / float32) out, in one launch
        on the current stream: the offload engine's decode merge of the device's and the CPU's parts, at every layer
        with CPU misses. The launch is prepared once per (buffers, stream) and goes straight to the driver
        (driver_calls.PreparedLaunch: CuPy's launch marshals its arguments at every call); through CuPy where the
        driver's calls cannot be had, or on the legacy default stream."""
        n = a.size

        def args():
            out_dt = {np.dtype(np.float16): DT_F16, np.dtype(np.float32): DT_F32}[np.dtype(out.dtype)]
            return a, a if b is None else b, np.int32(b is not None), out, np.int32(out_dt), np.int32(n)

        key = ("merge_sum", a.data.ptr, 0 if b is None else b.data.ptr, out.data.ptr, n, out.dtype.char)
        self._launch_merge(self._f("merge_sum"), key, n, args)

    def _launch_merge(self, kernel, key: tuple, n: int, args) -> None:
        """Launch `kernel` (a merge of the module) over n values on the current stream, args() its arguments: prepared
        once per (key, stream) and handed straight to the driver from then on (driver_calls.PreparedLaunch: CuPy's
        launch marshals its arguments at every call); through CuPy where the driver's calls cannot be had, or on the
        legacy default stream."""
        stream_ptr = _cp().cuda.get_current_stream().ptr
        key = key + (stream_ptr,)
        prepared = self._merge_launches.get(key)
        if prepared is None:
            grid = self._merge_grid(n)
            calls = DriverCalls.from_driver() if stream_ptr else None
            with self.device:
                if calls is None:
                    kernel(grid, (256,), args())
                    return
                prepared = calls.prepare(kernel.kernel.ptr, grid, (256,), args(), 0, stream_ptr)
            if len(self._merge_launches) >= 16:  # buffers of shapes gone by (a decode of more tokens, a resize)
                self._merge_launches.clear()
            self._merge_launches[key] = prepared
        with self._made_current():
            prepared.launch()

    def _made_current(self):
        """This GPU made current for driver calls (they act on the current one): a no-op where it is already, which
        saves the hot paths (an expert's copy, the decode merge) CuPy's switch there and back."""
        return contextlib.nullcontext() if _cp().cuda.runtime.getDevice() == self._device_id else self.device

    def _replayed(self, key: tuple, T: int, launch):
        """Run `launch` (kernel launches on the current stream, nothing else) eagerly at the first call with this
        key and as one captured CUDA graph from the second on; eagerly always outside decode sizes or the tc path,
        or on the legacy default stream (capture needs a stream of its own). Returns the graph launched, or None."""
        cp = _cp()
        with self.device:
            stream = cp.cuda.get_current_stream()
            if self.path != "tc" or T > self.decode_max_tokens or stream.ptr == 0:
                launch()
                return None
            key = key + (self.decode_kernel, tuple(sorted(self.dec_cfg.items())), tuple(sorted(self.dec5_cfg.items())))
            graph = self._graphs.get(key)
            if graph is None and key in self._graph_seen:
                graph = self._graphs[key] = self._capture(stream, launch)
            if graph is None or graph is _EAGER:  # first call: eager, so the workspace is sized before a capture
                launch()
                self._graph_seen.add(key)  # after: a workspace that grew in this call forgot what was seen
                return None
            graph.launch(stream)
            return graph

    @staticmethod
    def _capture(stream, launch):
        """`launch`'s kernels captured as a CUDA graph (thread-local capture: another thread's CUDA calls meanwhile
        are not affected); _EAGER where this CuPy or driver cannot capture them. No garbage collection meanwhile: a
        graph it freed (another node's, one of a resized set of slots) would fail to be destroyed during the capture
        and leave CUDA's last error set for the next kernel that checks it (onnxruntime's nodes do)."""
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            return GpuQMoE._capture_launches(stream, launch)
        finally:
            if gc_was_on:
                gc.enable()

    @staticmethod
    def _capture_launches(stream, launch):
        cp = _cp()
        mode = getattr(cp.cuda.runtime, "streamCaptureModeThreadLocal", None)
        try:
            stream.begin_capture(*(() if mode is None else (mode,)))
        except Exception:  # noqa: BLE001 - no graphs here: the launches stay eager
            return _EAGER
        try:
            launch()
        except Exception:  # noqa: BLE001 - the capture is ended below and the launches run eagerly
            try:
                stream.end_capture()
            except Exception:  # noqa: BLE001
                pass
            return _EAGER
        try:
            return stream.end_capture()
        except Exception:  # noqa: BLE001 - a capture invalidated without launch() raising: the launches stay eager
            return _EAGER

    # ------------------------------------------------------------------ launches
    def _compute(self, xd, xdt, T, out, *, logits=None, ldt=0, rw=None, rwdt=0, ids=None, wts=None, kk=None,
                 zero_out=False, ids_out=None, cut=np.uint64(0)):
        spec = self.spec
        E, H, I = spec.num_experts, spec.hidden_size, spec.inter_size
        route = ids is None
        kk = spec.k if route else int(kk)
        P = T * kk
        if P == 0:
            if zero_out:
                out.fill(0)
            return
        decode = self.path == "tc" and T <= self.decode_max_tokens
        BM = self.prefill_bm or default_prefill_bm(P, int((self.slot_of >= 0).sum()))
        TM = 8 if decode else (BM if self.path == "tc" else 64)
        max_tiles = min(P, P // TM + min(E, P))
        ws = self._workspace(T, P, max_tiles, "dec" if decode else self.path)
        # routed here: the ids go to the workspace, or to ids_out where the caller wants them (forward_into)
        ids_d = (ws.ids if ids_out is None else ids_out) if route else ids
        w_d = ws.w if route else wts
        has_rw = rw is not None
        rw_arg = rw if has_rw else self._dummy_f32
        lg_arg = logits if route else self._dummy_f32
        route_args = (lg_arg, np.int32(ldt), rw_arg, np.int32(rwdt), np.int32(has_rw), np.int32(E), np.int32(spec.k),
                      np.int32(int(spec.normalize_routing_weights)))
        f1, f2 = self.fc1, self.fc2
        bits = f1.bits
        act = self._act_args()
        tiles_args = (ws.tiles, ws.num_tiles, ws.pair_tok, ws.pair_w)
        if decode:
            cfg = self.dec_cfg
            # fp16 activations through v5: the dec5h kernels (x copied as fp16 by decode_prep, FC2's rows fp16)
            f16 = self.decode_kernel == "v5" and xdt == DT_F16 and bool(self.dec5_cfg.get("f16", 1))
            nch = T * (f1.KP // 8)
            nblk = 1 + max(1, min(_cdiv(nch, 256), 4 * self.num_sms))  # block 0 routes, the others convert x
            # routing by ranks (route.cu, route_rank_block): the whole block at once, T * E keys in shared memory
            rank_route = (route and P <= 64 and spec.k <= E and T * E <= 4096 and bool(cfg.get("rank_route", 1)))
            self._f("decode_prep")((nblk,), (256,), (
                np.int32(route), *route_args, ids_d, w_d, np.int32(T), np.int32(kk), self._slot_dev, np.int32(TM),
                ws.pair_tok, ws.pair_w, ws.tiles, ws.num_tiles, np.int32(max_tiles), xd, np.int32(xdt), np.int32(H),
                np.int32(f1.KP), ws.xhi, ws.xlo, np.int32(f16), out, np.int64(out.size if zero_out else 0),
                np.int32(rank_route)),
                shared_mem=16 * E + 8 * P + 256 + (4 * (T * E + P) + 12 if rank_route else 0))
            if self.decode_kernel == "v5":
                sl2 = self.slots[f2.name]
                nbt2, tsh2 = self._dec5_kind(f2)
                pf2 = (sl2["w"], np.int64(f2.w_bytes), np.int32(f2.NT), np.int32(f2.KT), sl2["s"], np.int32(f2.sdt),
                       np.int32(f2.NB), np.int32(tsh2), np.int32(nbt2),
                       np.int32(1 if self.dec5_cfg.get("l2_prefetch", 0) else 0))
                no_pf2 = (self._dummy_u8, np.int64(0), np.int32(0), np.int32(0), self._dummy_f32, np.int32(0),
                          np.int32(0), np.int32(0), np.int32(1), np.int32(0))
                # activation slots per ring stage: FC1 one per token; FC2 one per tile column (<= 8 pairs; <= T
                # when routed on the GPU: a token picks an expert at most once)
                bc1, bc2 = T, (min(8, T) if route else min(8, P))
                # split (lo halves of the activations): x unless bf16, FC1's rows always; never for dec5h
                n1 = self._dec5(f1, 0, max_tiles, bc1, (
                    *tiles_args, np.int32(P), ws.xhi, ws.xlo, np.int32(xdt != DT_BF16 and not f16), np.int32(f1.KP),
                    np.int32(bc1), *act, np.int32(I), ws.ahi, ws.alo, np.int32(f2.KP), self._dummy_f32,
                    ws.part, ws.kdone, *pf2, cut), f16)
                n2 = self._dec5(f2, 1, max_tiles, bc2, (
                    *tiles_args, np.int32(P), ws.ahi, ws.alo, np.int32(not f16), np.int32(f2.KP), np.int32(bc2),
                    *act, np.int32(H), self._dummy_u16, self._dummy_u16, np.int32(0), out, self._dummy_f32,
                    self._dummy_i32, *no_pf2, cut), f16)
                self.last_decode_kernels = (n1, n2)
                return
            if self.decode_kernel != "v4":
                raise ValueError(f"decode_kernel must be 'v4' or 'v5', not {self.decode_kernel!r}")
            R1, W1 = cfg["R1"], cfg["W1"]
            if not W1:
                W1 = 2 if _cdiv(f1.NT, R1) * min(P, E) >= 4 * self.num_sms else 4
            self._launch(f"dec_gemv_{bits}_{R1}_0", (_cdiv(f1.NT, R1), max_tiles, 1), (32 * W1,), (
                *self._proj_args(f1), *tiles_args, ws.xhi, ws.xlo, np.int32(xdt != DT_BF16), np.int32(f1.KP), *act,
                np.int32(I), ws.ahi, ws.alo, np.int32(f2.KP), self._dummy_f32), self._dec_smem(f1, R1, W1))
            R2, W2 = cfg["R2"], cfg["W2"]
            ks = cfg["ksplit2"] or self._auto_ksplit(f2, R2, W2, min(P, E))
            self._launch(f"dec_gemv_{bits}_{R2}_1", (_cdiv(f2.NT, R2), max_tiles, ks), (32 * W2,), (
                *self._proj_args(f2), *tiles_args, ws.ahi, ws.alo, np.int32(1), np.int32(f2.KP), *act,
                np.int32(H), self._dummy_u16, self._dummy_u16, np.int32(0), out), self._dec_smem(f2, R2, W2))
            return
        if self.path == "tc":
            # routing, grouping, x into fp16 and the output's zeroing in one launch (route.cu): a routing block per
            # 16 tokens, then conversion blocks, as many as fit beside them in one wave (the routing's registers
            # allow one 512-thread block per SM), at least half as many as SMs
            nrb = _cdiv(T, 16)
            room = self._blocks_per_sm("prefill_prep", 512, 16 * E) * self.num_sms - nrb
            nconv = max(1, min(_cdiv(T * (f1.KP // 8), 512), max(room, self.num_sms // 2)))
            self._f("prefill_prep")((nrb + nconv,), (512,), (
                np.int32(route), *route_args, ids_d, w_d, np.int32(T), np.int32(kk), self._slot_dev, np.int32(TM),
                ws.ranks, ws.counts, ws.ticket, np.int32(nrb), ws.pair_tok, ws.pair_w, ws.tiles, ws.num_tiles,
                np.int32(max_tiles), xd, np.int32(xdt), np.int32(H), np.int32(f1.KP), ws.x16, out,
                np.int64(out.size if zero_out else 0)), shared_mem=16 * E)
            names = (self._pf_name(f1, 0, BM), self._pf_name(f2, 1, BM))
            self._launch(names[0], (_cdiv(f1.NT, 8), max_tiles), (128,), (
                *self._proj_args(f1, fp16_scales=True), *tiles_args, ws.x16, np.int32(f1.KP), *act, np.int32(I), ws.a16,
                np.int32(f2.KP), self._dummy_f32), self._pf_smem(names[0], BM))
            self._launch(names[1], (_cdiv(f2.NT, 8), max_tiles), (128,), (
                *self._proj_args(f2, fp16_scales=True), *tiles_args, ws.a16, np.int32(f2.KP), *act, np.int32(H), self._dummy_u16,
                np.int32(0), out), self._pf_smem(names[1], BM))
            self.last_prefill_kernels = names
            return
        if zero_out:
            out.fill(0)
        if route:
            self._f("route_topk")((_cdiv(T, 8),), (256,), (*route_args[:5], np.int32(T), *route_args[5:], ids_d,
                                                           w_d))
        self._f("build_tiles")((1,), (1024,), (
            ids_d, w_d, np.int32(P), np.int32(kk), self._slot_dev, np.int32(E), np.int32(TM), ws.pair_tok, ws.pair_w,
            ws.tiles, ws.num_tiles, np.int32(max_tiles)), shared_mem=16 * E)
        nel_blocks = max(1, min(_cdiv(T * f1.KP, 256), 8 * self.num_sms))
        if xdt == DT_F32:
            x32 = xd
        else:
            x32 = ws.x32
            self._f("to_f32")((nel_blocks,), (256,), (xd, np.int32(xdt), np.int64(T * H), x32))
        self._f("fma_fc1")((_cdiv(I, 8), max_tiles), (256,), (
            *self._proj_args(f1, bits_arg=True), ws.tiles, ws.num_tiles, ws.pair_tok, x32, np.int32(H), *act,
            np.int32(I), ws.a32))
        self._f("fma_fc2")((_cdiv(H, 8), max_tiles), (256,), (
            *self._proj_args(f2, bits_arg=True), *tiles_args, ws.a32, np.int32(I), np.int32(H), out))

    # dec5 (decode.cu / decode5.cu): 4 warps per block, DEC5_STAGES = 6 ring stages per warp, a 4096-byte cache of
    # tiles and pair tokens in front; keep these in step with decode5.cu
    DEC5_WARPS, DEC5_STAGES, DEC5_CACHE = 4, 6, 4096

    @staticmethod
    def _dec5_kind(p: _lay.ProjLayout) -> tuple[int, int]:
        """(scale blocks per 64-k tile NBT, block index shift tsh): NBT 1 = one scale per k-tile (block >= 64: block
        kt >> tsh; per row: tsh = 30, always block 0), 2 = block 32, 4 = block 16."""
        if p.bs_log2 < 0:
            return 1, 30
        if p.bs_log2 >= 6:
            return 1, p.bs_log2 - 6
        return 64 >> p.bs_log2, 0

    def _dec5_smem(self, p: _lay.ProjLayout, bcols: int) -> int:
        """Dynamic shared memory of dec5: the cache, then per warp DEC5_STAGES stages of weights (512 / 1024 bytes),
        NBT * 64 bytes of scales, NBT * 16 of zero points (if any), bcols * 256 of activation fragments."""
        nbt, _ = self._dec5_kind(p)
        stage = (512 if p.bits == 4 else 1024) + nbt * 64 + (nbt * 16 if p.has_zp else 0) + bcols * 256
        return self.DEC5_CACHE + self.DEC5_WARPS * self.DEC5_STAGES * stage

    def _blocks_per_sm(self, name: str, threads: int, smem: int) -> int:
        """Resident blocks per SM of kernel ``name`` (CUDA occupancy calculator; an estimate from its registers and
        shared memory if that is unavailable). Cached."""
        key = (name, threads, smem)
        v = self._occ.get(key)
        if v is None:
            cp = _cp()
            f = self._f(name)
            v = 0
            try:
                v = int(cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(f.kernel.ptr, threads, smem))
            except Exception:  # noqa: BLE001 - fall back to the estimate below
                v = 0
            if v <= 0:
                try:
                    regs = int(f.num_regs)
                except Exception:  # noqa: BLE001
                    regs = 80
                regs = max(8, -(-regs // 8) * 8)
                v = max(1, min(65536 // (regs * threads), (227 * 1024) // (smem + 1024), 2048 // threads, 32))
            self._occ[key] = v
        return v

    def _dec5(self, p: _lay.ProjLayout, mode: int, max_tiles: int, bcols: int, tail: tuple, f16: bool = False) -> str:
        """One dec5 launch for projection p (mode 0: FC1 + activation, 1: FC2 into the output); returns the kernel's
        name. ``bcols``: activation slots per ring stage (the kernel argument of that name, inside ``tail``).
        ``tail``: the arguments after the projection's own (tiles ... pf2, see QM_D5_ARGS in decode5.cu). ``f16``:
        the dec5h kernel (fp16 activations; the same arguments and shared memory)."""
        sl = self.slots[p.name]
        nbt, tsh = self._dec5_kind(p)
        pdl = bool(self.dec5_cfg.get("pdl", 0)) and self._pdl is not None
        # FC2 launched with PDL takes the instance that copies its weights before waiting for FC1 (suffix p)
        early = "p" if pdl and mode == 1 else ""
        name = f"dec5{'h' if f16 else ''}_{p.bits}_{nbt}_{int(p.has_zp)}_{mode}{early}"
        smem = self._dec5_smem(p, bcols)
        threads = 32 * self.DEC5_WARPS
        if name not in self._carveout_set:
            try:  # the occupancy figure assumes the largest shared-memory carveout: ask for it
                self._f(name).preferred_shared_memory_carveout = 100
            except Exception:  # noqa: BLE001
                pass
            self._carveout_set.add(name)
        grid = int(self.dec5_cfg.get("grid") or 0)  # a fixed grid (tests: long per-warp ranges)
        if grid <= 0:
            bps = (int(self.dec5_cfg.get(f"bps{mode + 1}") or 0) or int(self.dec5_cfg.get("bps") or 0)
                   or self._blocks_per_sm(name, threads, smem))
            units = max_tiles * p.NT * p.KT
            grid = max(1, min(bps * self.num_sms, _cdiv(units, self.DEC5_WARPS)))
        head = (sl["w"], np.int64(p.w_bytes), np.int32(p.NT), np.int32(p.KT), sl["s"], np.int32(p.sdt),
                np.int32(p.NB), np.int32(tsh), sl.get("z", self._dummy_u8), sl.get("b", self._dummy_f32),
                np.int32(int(p.has_bias)), np.int32(p.NP))
        self._launch(name, (grid,), (threads,), head + tuple(tail), smem, pdl=pdl)
        self.last_decode_pdl = pdl and self._pdl is not None
        return name

    def _dec_smem(self, p: _lay.ProjLayout, R: int, W: int) -> int:
        """Dynamic shared memory of dec_gemv: DEC_STAGES = 4 warp-stages of R * (TB + 320) bytes per warp, then the
        cross-warp reduction (W * R * 128 floats); mirrors decode.cu."""
        tb = 512 if p.bits == 4 else 1024
        return W * 4 * (R * tb + R * 320) + W * R * 512

    def _pf_name(self, p: _lay.ProjLayout, mode: int, BM: int) -> str:
        """The prefill kernel of projection ``p`` (mode 0 = FC1, 1 = FC2) at BM tokens per tile: pf_gemmc_4_<BM>_<mode>
        (compiled for int4, blocks of 32, no zero point; block scales always reach it as fp16: the layout's fp16 copy
        or fp16 as stored) where prefill_kernel "v1c", the layout and BM allow it, else pf_gemm_<bits>_<BM>_<mode>;
        "v1w" takes pf_gemmw_4_<BM>_<mode> where v1c would take pf_gemmc and the module has wgmma."""
        if self.prefill_kernel not in ("v1", "v1c", "v1w"):
            raise ValueError(f"prefill_kernel must be 'v1', 'v1c' or 'v1w', not {self.prefill_kernel!r}")
        if self.prefill_kernel != "v1" and BM in (32, 48, 64) and p.bits == 4 and p.bs_log2 == 5 and not p.has_zp:
            wg = self.prefill_kernel == "v1w" and self.has_wgmma
            return f"pf_gemm{'w' if wg else 'c'}_4_{BM}_{mode}"
        return f"pf_gemm_{p.bits}_{BM}_{mode}"

    def _pf_smem(self, name: str, BM: int) -> int:
        """Dynamic shared memory of prefill kernel ``name``: PF_STAGES = 4 stages of PfSmem<bits, BM>::STAGE bytes;
        pf_gemmw's stages rounded up to 1024 bytes, and 1024 more to align the first (prefill.cu)."""
        tb = 512 if self.fc1.bits == 4 else 1024
        stage = BM * 128 + 8 * tb + 8 * 256 + 8 * 64
        if name.startswith("pf_gemmw"):
            return 4 * _cdiv(stage, 1024) * 1024 + 1024
        return 4 * stage

    def _launch(self, name: str, grid, block, args, smem: int = 0, pdl: bool = False):
        """Launch kernel ``name`` on the current stream; ``pdl``: with programmatic dependent launch (the kernel must
        wait with QM_PDL_WAIT before it reads what earlier kernels wrote)."""
        f = self._f(name)
        if smem > 48 * 1024 and self._smem_set.get(name, 0) < smem:
            f.max_dynamic_shared_size_bytes = smem
            self._smem_set[name] = smem
        if pdl:
            try:
                self._pdl.launch(f.kernel.ptr, grid, block, args, smem, _cp().cuda.get_current_stream().ptr)
                return
            except RuntimeError:  # a driver that refuses the attribute: plain launches from now on
                self._pdl = None
        f(grid, block, args, shared_mem=smem)

    def _auto_ksplit(self, p: _lay.ProjLayout, R: int, W: int, tiles: int) -> int:
        blocks = _cdiv(p.NT, R) * max(1, tiles)
        units = p.KT if p.bs_log2 <= 6 else _cdiv(p.KT, 1 << (p.bs_log2 - 6))
        want = _cdiv(2 * self.num_sms, blocks)
        return int(max(1, min(want, units // (2 * W) if units >= 2 * W else 1)))


_EAGER = object()  # GpuQMoE._graphs: a launch that could not be captured runs eagerly


def _check_part(published, n: int) -> None:
    """merge_gated's CPU part (published.part) must hold the GPU's n values; else a ValueError saying both."""
    if published.part.size != n:
        raise ValueError(f"merge_gated: the CPU's part holds {published.part.size} values, the GPU's {n}")


def _reads_in_place(device_array, given) -> bool:
    """Whether `device_array` (what a launch reads) is `given`'s own device memory, not a copy made for the call."""
    if given is None:
        return device_array is None
    return (isinstance(given, _cp().ndarray) and device_array.data.ptr == given.data.ptr
            and device_array.dtype == given.dtype)


def _read_as_given(given) -> bool:
    """Whether the kernels read activations `given` (or None) in place: float16 / float32 C-contiguous device arrays
    (GpuQMoE._to_device_act makes a copy of any other)."""
    return given is None or (isinstance(given, _cp().ndarray) and given.dtype in (np.float16, np.float32)
                             and given.flags.c_contiguous)


class _SplitReplay:
    """run_routed_split's (or run_routed's) last replayed graph and what it was launched for: the arrays (by
    identity: an array object keeps its memory while it lives, and this holds them), the stream, the decode
    configuration."""

    __slots__ = ("arrays", "stream_ptr", "config", "graph")

    def __init__(self, arrays: tuple, stream_ptr: int, config: tuple, graph):
        self.arrays, self.stream_ptr, self.graph = arrays, stream_ptr, graph
        self.config = tuple(dict(c) if isinstance(c, dict) else c for c in config)  # a copy of the dicts' values

    def matches(self, arrays: tuple, config: tuple, stream_ptr: int | None = None) -> bool:
        """The very arrays and configuration, on the same stream where `stream_ptr` is given (None: any stream)."""
        return ((stream_ptr is None or stream_ptr == self.stream_ptr) and all(map(operator.is_, arrays, self.arrays))
                and config == self.config)


class _Staging:
    """A device buffer the driver path's copies stage experts in (a holder: weak references need one)."""

    def __init__(self, array):
        self.array = array


# (device id, stream pointer) -> the staging buffer of the driver path's copies on that stream, shared by every
# GpuQMoE copying there (the offload engine's, one per layer, share one buffer as they shared CuPy's cached block).
# Sharing is safe: every user queues its copies and pack_expert on the same stream, so they run one after another.
_STAGING: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _staging_for(device_id: int, stream, nbytes: int) -> _Staging:
    """A staging buffer of at least `nbytes` for copies on `stream` (the device current), allocated on first need
    from CuPy's pool for that stream: a block the pool hands back is free once the stream's earlier work is done."""
    key = (device_id, stream.ptr)
    staging = _STAGING.get(key)
    if staging is None or staging.array.nbytes < nbytes:
        cp = _cp()
        with stream:
            staging = _STAGING[key] = _Staging(cp.empty(nbytes, cp.uint8))
    return staging


def _as_host(a):
    try:
        import cupy

        if isinstance(a, cupy.ndarray):
            return cupy.asnumpy(a)
    except ImportError:
        pass
    return np.asarray(a)
