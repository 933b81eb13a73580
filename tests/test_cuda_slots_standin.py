"""The CUDA device's slots (engine/offload/cuda_device.py CudaSlots) driven end to end on the CPU: CuPy replaced by
a stand-in whose "device" memory is host memory (copies are memmove, kernels run at once), GpuQMoE by one that
computes with the CPU kernel, and the dense part's cut tensors left in that "device" memory (DeviceOutputs over the
CuPy stand-in), as with the dense part on the GPU. What this checks is the Python of the device path: which path a
layer takes, buffers, streams and events in their order, statistics; the kernels and onnxruntime's CUDA EP run in
the gpu-marked tests (tests/test_offload_cuda.py, tests/test_dense_device.py)."""

from __future__ import annotations

import ctypes
import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import engine.offload.cuda_device as cuda_device
from engine.array_backend import CupyBackend
from engine.decoder_state import DecoderState
from engine.errors import WorkbenchError
from engine.generation import LoadedModel
from engine.model_folder import ModelFolder
from engine.offload import OffloadConfig
from engine.offload.decode_path import DecodePathTrials
from engine.offload.cuda_device import CudaSlots, CudaStreamingSlots, RecentHostSeconds, staged_bytes
from engine.offload.device_memory import DENSE_RESERVATION, DeviceMemory
from engine.offload.devices import GIB, TIER_READ_SHARE, Bandwidths
from engine.offload.engine import OffloadEngine
from engine.offload.miss_policy import cpu_bytes_per_s
from engine.ort_env import DenseDevice
from kernels.cold_split import cpu_take_table, device_spans, split_cold_rows
from kernels.cpu import CpuQMoE
from kernels.cpu.routing import route
from kernels.gpu.host_tier import HostTierError
from tests.test_dense_device import FakeDeviceArray
from tests.test_host_register import FakeRuntime
from tests.test_offload import (SPEC, assert_mapped_as_the_cache_holds, assert_same_as_cpu, device_expert_bytes,
                                greedy_run, time_paths_as_given)
from tests.test_offload_misses import line_calls, observed


def _device(array) -> FakeDeviceArray:
    return np.ascontiguousarray(array).view(FakeDeviceArray)


class FakeCupy:
    """The CuPy the device path uses, over NumPy; every stream and event op is logged in order."""

    float32, int32, uint8, uint32 = np.float32, np.int32, np.uint8, np.uint32
    ndarray = FakeDeviceArray

    def __init__(self):
        self.log: list[tuple] = []
        self.current = None
        self.events_done = True  # what an event query answers: the GPU keeps up with the host, or not
        fake = self

        class Event:
            def __init__(self, disable_timing=False):
                self.recorded_on = None

            def record(self, stream=None):
                self.recorded_on = stream or fake.current
                fake.log.append(("record", self.recorded_on.name))

            def synchronize(self):
                fake.log.append(("event sync", self.recorded_on.name if self.recorded_on else None))

            @property
            def done(self):  # cudaEventQuery: whether the work before the event finished (events_done says)
                fake.log.append(("event query", self.recorded_on.name if self.recorded_on else None))
                return fake.events_done

        class Stream:
            def __init__(self, non_blocking=False, name="stream"):
                self.name, self.ptr = name, id(self)

            def __enter__(self):
                self._saved, fake.current = fake.current, self
                return self

            def __exit__(self, *exc):
                fake.current = self._saved

            def record(self, event=None):
                event = event or Event()
                event.record(self)
                return event

            def wait_event(self, event):  # an event never recorded is waited for at once, as in CUDA
                fake.log.append(("wait", self.name, event.recorded_on.name if event.recorded_on else None))

            def synchronize(self):
                fake.log.append(("sync", self.name))

        class Device:
            def __init__(self, index=0):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return None

        def memcpy_async(dst, src, size, kind, stream):
            ctypes.memmove(dst, src, size)

        self.Stream, self.Event = Stream, Event
        self.default = Stream(name="default")
        self.cuda = SimpleNamespace(
            Stream=Stream, Event=Event, Device=Device, alloc_pinned_memory=lambda n: bytearray(max(1, n)),
            get_current_stream=lambda: fake.current or fake.default, get_elapsed_time=lambda start, stop: 0.25,
            runtime=SimpleNamespace(memcpyAsync=memcpy_async))

    @staticmethod
    def empty(shape, dtype):
        return np.zeros(shape, dtype).view(FakeDeviceArray)

    zeros = empty

    @staticmethod
    def asarray(array):
        return _device(array)

    ascontiguousarray = asarray
    add, copyto = staticmethod(np.add), staticmethod(np.copyto)

    @staticmethod
    def asnumpy(array):
        return np.array(array.view(np.ndarray))


class _Context:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


class FakeGpuQMoE:
    """GpuQMoE's interface to CudaSlots, computing with the node's CPU kernel on the experts in its slots (with
    `host_tier`, on every expert, as GpuQMoE's host tier reads the others from host memory)."""

    decode_max_tokens = 8
    tier = None  # GpuQMoE.tier: the host tier's mappings (made_tiers counts those made)
    made_tiers = 0

    def __init__(self, kernel, resident, host_tier=False, tier=None):
        self.kernel, self.spec = kernel, kernel.spec
        self.host_tier, self.tier = host_tier, tier
        FakeGpuQMoE.made_tiers += tier is not None
        self.device = _Context()
        self.slot_of = np.full(self.spec.num_experts, -1, np.int64)
        for slot, expert in enumerate(resident):
            self.slot_of[expert] = slot
        self.routed = 0

    def pack_expert(self, expert):
        return None

    def set_source(self, spec, tensors):
        """GpuQMoE.set_source: the streaming slots compute another node's experts from now on."""
        self.kernel, self.spec = CpuQMoE(spec, tensors), spec

    def upload_expert(self, expert, slot, stream=None, packed=None):
        self.slot_of[self.slot_of == slot] = -1
        self.slot_of[expert] = slot

    def _resident_only(self, ids):
        ids = np.asarray(ids, np.int64)
        if self.host_tier:
            return ids
        return np.where((ids >= 0) & (self.slot_of[np.maximum(ids, 0)] >= 0), ids, -1)

    def run_staged(self, x, ids, w, out, spans=None):
        target = out.view(np.ndarray)
        target[...] = 0
        self.kernel.run_experts(x.view(np.ndarray), self._resident_only(ids), np.asarray(w), out=target, spans=spans)

    @property
    def splits_rows(self):
        """GpuQMoE.splits_rows: the stand-in computes a split pair's rows with the CPU kernel where it can."""
        return self.kernel.splits_rows

    def run_experts(self, x, ids, w, out=None):
        self.kernel.run_experts(np.asarray(x).view(np.ndarray), self._resident_only(ids), np.asarray(w),
                                out=out.view(np.ndarray))
        return out

    def merge_sum(self, a, b, out):
        self.merge_sums = getattr(self, "merge_sums", 0) + 1
        np.copyto(out, a if b is None else a + b, casting="same_kind")

    gated_merge = True  # GpuQMoE.gated_merge: "both" layers queue merge_gated at the launch
    gate_waits_on_device = False  # this merge runs inside open_gate: the host-part worker cannot raise the gate

    def merge_gated(self, published, a, out, timeout_s=1.0):
        """GpuQMoE.merge_gated: the stand-in's kernels run at once, so this merge runs when the host raises the gate
        to this launch's number (inside open_gate) and not before; with no time to wait (timeout 0) it gives up at
        once, as the device's does after its timeout: out = a, the launch's number in the failed word."""
        want = published.launched
        if timeout_s <= 0:
            np.copyto(out, a, casting="same_kind")
            published.failed[0] = want
            return

        def open_gate():
            type(published).open_gate(published)
            if published.gate[0] == want:
                np.copyto(out, a + published.part, casting="same_kind")
                self.gated_merges = getattr(self, "gated_merges", 0) + 1

        published.open_gate = open_gate

    def run_routed(self, x, logits, out32, out=None, router_weights=None, ids_out=None):
        self.routed += 1
        ids, weights = route(np.asarray(logits, np.float32), self.spec, router_weights)
        if ids_out is not None:
            ids_out[...] = ids
        self.run_staged(x, ids, weights, out32)
        if out is not None and out is not out32:
            np.copyto(out, out32, casting="same_kind")
        return out32 if out is None else out


    def run_routed_split(self, x, logits, out32, published, router_weights=None, *, stop=None, merged=None,
                         timeout_s=1.0):
        """GpuQMoE.run_routed_split: route_split's rule (kernels.cold_split) on the slots' residency, the routing and
        x published with the flag raised, the device's pairs computed into out32; then `stop` recorded and the gated
        merge into `merged` queued, where given."""
        self.split_launches = getattr(self, "split_launches", 0) + 1
        self._last_split = ((x, logits, out32, published, router_weights, stop, merged), timeout_s)
        ids, weights = route(np.asarray(logits, np.float32), self.spec, router_weights)
        rows = np.asarray(published.split_rows) if self.splits_rows else np.zeros(self.spec.k + 1, np.int32)
        on_cpu = split_cold_rows(self.slot_of[ids] < 0, np.asarray(published.cpu_take), rows)
        published.ids[...], published.on_cpu[...], published.w[...] = ids, on_cpu, weights
        published.x[...] = np.asarray(x).reshape(published.x.shape)
        spans = device_spans(ids, on_cpu, self.spec.num_experts, self.spec.inter_size)
        self.run_staged(x, np.where(on_cpu == 1, -1, ids), weights, out32, spans)
        published.launched += 1
        published.flag[0] = published.launched
        if stop is not None:
            stop.record()
        if merged is not None:
            self.merge_gated(published, out32, merged, timeout_s)
        return out32


    def split_graph(self, x, logits, out32, published, router_weights=None, *, stop=None, merged=None,
                    timeout_s=1.0):
        """GpuQMoE.split_graph: the last run_routed_split call again (its "graph": the stand-in has none) where these
        are that call's very arrays and timeout, else None."""
        last = getattr(self, "_last_split", None)
        arrays = (x, logits, out32, published, router_weights, stop, merged)
        if last is None or last[1] != timeout_s or not all(a is b for a, b in zip(arrays, last[0])):
            return None

        def launch(stream):  # on `stream`: the stop event's record is logged there
            with stream:
                self.run_routed_split(*arrays[:5], stop=stop, merged=merged, timeout_s=timeout_s)
        return SimpleNamespace(launch=launch)

    def relaunch_split(self, graph, published, stream):
        """GpuQMoE.relaunch_split: the graph's work at once (run_routed_split counts the launch)."""
        self.split_relaunches = getattr(self, "split_relaunches", 0) + 1
        graph.launch(stream)


class FakeStreamingGpuQMoE(FakeGpuQMoE):
    """FakeGpuQMoE made as CudaStreamingSlots makes its GpuQMoE: from a node's spec and tensors, slots empty."""

    def __init__(self, spec, tensors, device=0, num_slots=None, resident=()):
        super().__init__(CpuQMoE(spec, tensors), resident)


class FakeCudaDevice:
    """CudaDevice's attributes over the CuPy stand-in (no pinned ring, no page-locked mapping)."""

    kind = "cuda"

    def __init__(self, cp):
        self.cp, self.index = cp, 0
        self.memory = DeviceMemory(capacity=8 * GIB)
        self.bandwidths = Bandwidths(pcie=25e9, hbm=1000e9, cpu=40e9)
        self.compute_stream = cp.Stream(name="compute")
        self.copy_stream = cp.Stream(name="copy")
        self.dense_stream = None
        self.host_registration = None
        self.pinned = None
        self.load_issue = {}
        self.slot_launch = {}
        self.name = "a CUDA stand-in"

    def staging_bytes_per_expert(self, runner) -> int:
        return staged_bytes(runner)

    def ensure_kernels(self) -> None:
        pass  # (the stand-in GpuQMoE computes with the CPU kernel)

    def set_pinned_ring(self, nbytes: int) -> None:
        pass

    def copy_seconds(self, nbytes: int) -> float:
        return nbytes / self.bandwidths.pcie

    def quiesce(self) -> None:
        self.cp.log.append(("device sync",))

    def create_slots(self, runner, num_slots: int) -> CudaSlots:
        return CudaSlots(self, runner, num_slots)

    def create_streaming_slots(self, runner, num_slots: int) -> CudaStreamingSlots:
        return CudaStreamingSlots(self, runner, num_slots)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    from engine.writer import write_model

    return write_model(tmp_path_factory.mktemp("standin") / "m", SPEC)


@pytest.fixture(scope="module")
def cpu_run(model_folder):
    return greedy_run(LoadedModel.open(model_folder))


def _fake_make(slots: CudaSlots, count, resident, tensors=None):
    """CudaSlots._make on the stand-in; with the host tier, mappings of one slot more than asked on the device (as the
    granule rounds up) and every expert on the host."""
    tiered = slots.host_tier and tensors is None
    tier = SimpleNamespace(device_bytes=(max(1, count) + 1) * slots.expert_bytes,
                           host_bytes=SPEC.num_experts * slots.expert_bytes) if tiered else None
    return FakeGpuQMoE(slots.runner.kernel, resident, host_tier=tiered, tier=tier)


def decode_on_device(model, cpu_run, launches: str) -> tuple:
    """A greedy run from fresh statistics: its tokens and logits the all-CPU run's, every layer's decode steps
    launched on the device once each (the stand-in GpuQMoE's count named `launches`) and counted as routed there.
    Returns (decode steps, the statistics' totals)."""
    engine = model.offload
    engine.stats.reset(SPEC.layers, [SPEC.num_experts] * SPEC.layers)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    steps = len(cpu_run[1])
    assert [getattr(store.gpu, launches) for store in engine.stores] == [steps] * SPEC.layers
    totals = engine.stats.totals()
    assert totals.routed_on_device == steps * SPEC.layers
    return steps, totals


def open_on_standin(model_folder, fraction, monkeypatch, decode_path=None, make=_fake_make,
                    streaming=FakeStreamingGpuQMoE, dense_on_device=True, mem_limit=0, **config):
    """The model on the stand-in device (its decode path `decode_path`, the tests' default where None; its slots made
    by `make`, its streaming slots' GpuQMoE a `streaming`; its memory held to `mem_limit`, as gpu_device_mem_limit
    holds a card's), its cut tensors left in the stand-in's memory, and a state there: the engine told the dense part
    runs there (as a load with onnxruntime's CUDA execution provider tells it), unless `dense_on_device` is False (the
    dense part wherever the load puts it: here on the CPU)."""
    cp = FakeCupy()
    monkeypatch.setattr(CudaSlots, "_make", make)
    monkeypatch.setattr("kernels.gpu.qmoe.GpuQMoE", streaming)  # what CudaStreamingSlots makes
    # Under "both", the split's table stays the one from the stand-in's bandwidths for a test's decode: made again from
    # the CPU kernel's measured rate and the host's gap, it can give the CPU no pair on a slow or busy machine, and the
    # steps would take the tier's way (correct, but not the step the tests check). test_offload.py tests the remaking.
    monkeypatch.setattr("engine.offload.engine.SPLIT_TABLE_FIRST", 10 ** 9)
    device = FakeCudaDevice(cp)
    device.memory.limit = mem_limit
    budget = int(fraction * device_expert_bytes(model_folder))
    offload = OffloadConfig(device_expert_bytes=budget, **config)
    if not dense_on_device:
        return LoadedModel.open(model_folder, device=device, offload=offload, decode_path=decode_path), cp
    with monkeypatch.context() as on_device:  # the load's plan made for the dense part on the device, and kept
        on_device.setattr("engine.generation.dense_cpu_reason", lambda kind, kv_dtypes: None)
        on_device.setattr(OffloadEngine, "dense_landed", lambda engine, dense_cpu: None)  # (onnxruntime's CPU here)
        model = LoadedModel.open(model_folder, device=device, offload=offload, decode_path=decode_path)
    backend = CupyBackend(cp)
    backend.device_type = "cpu"  # onnxruntime here binds host memory: the stand-in's "device" memory
    backend.stream.name = "dense"
    device.dense_stream = backend.stream
    dense = model.decoder.dense
    model.decoder.dense = DenseDevice("cuda", "the stand-in", backend=backend)
    model.decoder.place_cut_tensors()  # as with the dense part on the GPU
    model.decoder.dense = dense
    monkeypatch.setattr(model, "new_state", lambda: DecoderState(model.config, model.folder.onnx.proto.graph, backend))
    return model, cp


ONE_ROUTED_LAUNCH = [("record", "dense"), ("wait", "compute", "dense"), ("record", "compute"), ("record", "compute"),
                     ("wait", "dense", "compute")]
ACCOUNT = [("event query", "compute"), ("event sync", "compute")]  # a launch found done, its statistics taken
# a decode step's event before its last segment (the logits left on the device), waited for before the step's end
LAYERS_DONE = [("record", "dense"), ("event sync", "dense")]


def test_fully_resident_layers_route_on_the_standin_and_order_the_streams(model_folder, cpu_run, monkeypatch):
    model, cp = open_on_standin(model_folder, 1.0, monkeypatch)
    cp.events_done = False  # a GPU behind the host: no launch is done before the step's end
    model.decoder.before_last_segment = None  # (whose wait for the launches would never end on this GPU)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    stores = model.offload.stores
    assert [s.gpu.routed for s in stores] == [1 + len(cpu_run[1])] * SPEC.layers
    totals = model.offload.stats.totals()
    assert totals.misses == 0 and totals.hits > 0 and totals.device_s == pytest.approx(
        0.25e-3 * SPEC.layers * (1 + len(cpu_run[1])))
    assert not model.offload.deferred
    # the last decode step: each routed launch makes the compute stream wait for the dense part's, records start and
    # stop around the launch, and the dense part's stream waits for stop; each layer asks once whether the oldest
    # launch is done (it is not); the host waits for the layers (an event before the last segment, whose logits stay
    # on the device), then for each launch's stop event as the end of the step reads its time, and last for the
    # logits' copy
    last_sync = len(cp.log) - 1 - cp.log[::-1].index(("sync", "dense"))
    queried = ONE_ROUTED_LAUNCH + [("event query", "compute")]
    step_end = LAYERS_DONE + [("event sync", "compute")] * SPEC.layers
    assert cp.log[last_sync - 6 * SPEC.layers - len(step_end):last_sync] == queried * SPEC.layers + step_end
    assert cp.log[last_sync + 1:] == []


def test_fully_resident_layers_statistics_are_taken_in_the_step_once_their_launch_is_done(model_folder, cpu_run,
                                                                                        monkeypatch):
    """A GPU that keeps up with the host: each layer takes its launch's statistics as soon as the launch is done
    (OffloadEngine.settle), not after the step's last segment, with the same statistics as taken at the step's end."""
    behind, behind_cp = open_on_standin(model_folder, 1.0, monkeypatch)
    behind_cp.events_done = False
    behind.decoder.before_last_segment = None  # (whose wait for the launches would never end on this GPU)
    greedy_run(behind)
    model, cp = open_on_standin(model_folder, 1.0, monkeypatch)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert not model.offload.deferred
    last_sync = len(cp.log) - 1 - cp.log[::-1].index(("sync", "dense"))  # the logits' copy
    assert (cp.log[last_sync - 7 * SPEC.layers - len(LAYERS_DONE):last_sync]
            == (ONE_ROUTED_LAUNCH + ACCOUNT) * SPEC.layers + LAYERS_DONE)  # nothing left for the step's end
    ours, ref = model.offload.stats.as_dict(), behind.offload.stats.as_dict()
    for mine, theirs in zip(ours.pop("layers"), ref.pop("layers")):
        del mine["copy_s"], theirs["copy_s"]  # the loads' host time, measured
        assert mine == theirs and mine["routed_on_device"] == 1 + len(cpu_run[1])
    assert ours == ref
    for mine, theirs in zip(model.offload.policy.scores, behind.offload.policy.scores):
        assert np.array_equal(mine, theirs)


def test_statistics_left_behind_by_a_host_ahead_of_the_gpu_are_taken_before_the_last_segment(model_folder, cpu_run,
                                                                                             monkeypatch):
    """A GPU behind the host through the layers, which catches up while the host waits before the step's last
    segment (whose run waits for the logits): the launches' statistics are taken there as they end
    (OffloadEngine.settle_all_but), all but the last one, not at the step's end where the GPU would idle; the same
    statistics as a GPU that keeps up."""
    keeping_up, _ = open_on_standin(model_folder, 1.0, monkeypatch)
    greedy_run(keeping_up)
    model, cp = open_on_standin(model_folder, 1.0, monkeypatch)
    cp.events_done = False
    settle_all_but = model.offload.settle_all_but

    def gpu_catches_up_meanwhile():
        cp.log.append(("before the last segment",))
        cp.events_done = True
        settle_all_but()
        cp.events_done = False

    model.decoder.before_last_segment = gpu_catches_up_meanwhile
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert not model.offload.deferred
    last_sync = len(cp.log) - 1 - cp.log[::-1].index(("sync", "dense"))
    waited = cp.log.index(("before the last segment",), last_sync - 7 * SPEC.layers)
    # the last layer's account at the step's end, after the layers' event; the logits' copy last
    assert cp.log[waited + 1:last_sync] == ACCOUNT * (SPEC.layers - 1) + LAYERS_DONE + [("event sync", "compute")]
    assert cp.log[last_sync + 1:] == []
    ours, ref = model.offload.stats.as_dict(), keeping_up.offload.stats.as_dict()
    for mine, theirs in zip(ours.pop("layers"), ref.pop("layers")):
        del mine["copy_s"], theirs["copy_s"]  # the loads' host time, measured
        assert mine == theirs
    assert ours == ref


def test_the_wait_before_the_last_segment_gives_up_on_a_gpu_that_does_not_finish(model_folder, monkeypatch):
    """settle_all_but waits at most its timeout: what is left then stays for the step's end."""
    model, cp = open_on_standin(model_folder, 1.0, monkeypatch)
    model.decoder.before_last_segment = None
    cp.events_done = False
    state = model.new_state()
    model.decoder.forward(state, [5, 7])
    model.offload.deferred.extend([(lambda: False, lambda: None)] * 3)  # launches that never end
    started = time.perf_counter()
    model.offload.settle_all_but(1, timeout_s=0.05)
    assert 0.05 <= time.perf_counter() - started < 1.0 and len(model.offload.deferred) == 3
    model.offload.deferred.clear()


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_with_the_host_tier_decode_steps_of_partly_resident_layers_stay_on_the_device(model_folder, cpu_run,
                                                                                      monkeypatch, fraction):
    """OffloadEngine.host_tier: every store made again with the tier and its residents copied back, no slot left to
    copied misses; decode steps then route and compute on the device as fully resident layers do (the GPU reads
    the cold experts from host memory: no host round trip, no CPU kernel), with the all-CPU run's tokens; their
    cold pairs are counted as misses read. The prompt (a prefill) takes the hybrid path as before."""
    model, cp = open_on_standin(model_folder, fraction, monkeypatch)
    engine = model.offload
    engine.set_decode_path("tier")  # a re-plan: the slots filled again
    residents = [sorted(layer.resident().tolist()) for layer in engine.slots]
    assert all(store.host_tier and store.reads_cold for store in engine.stores) and engine.reads_tier
    assert [sorted(np.nonzero(store.gpu.slot_of >= 0)[0].tolist()) for store in engine.stores] == residents
    assert list(engine.policy.miss_slots) == [0] * SPEC.layers
    steps, totals = decode_on_device(model, cpu_run, "routed")
    assert engine.stats.phases["decode"].cpu_s == 0.0  # no CPU kernel in a decode step; the prompt's misses were
    assert totals.misses == totals.misses_cpu + totals.misses_copied + totals.misses_read
    decode_pairs = steps * SPEC.layers * SPEC.top_k
    assert 0 < totals.misses_read <= decode_pairs
    if fraction == 0.0:
        assert totals.misses_read == decode_pairs
    assert engine.stats.as_dict()["misses_read"] == totals.misses_read
    engine.set_decode_path("cpu")
    assert not any(store.reads_cold for store in engine.stores) and not engine.reads_tier


@pytest.mark.parametrize("gated", [True, False], ids=["gated-merge", "merge-after"])
@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_under_decode_path_both_the_cpu_takes_a_share_of_the_cold_pairs_the_gpu_reads(model_folder, cpu_run,
                                                                                       monkeypatch, fraction, gated):
    """Decode path "both": a decode step of a partly resident layer is routed on the device, which publishes the
    routing (no stream synchronisation: the host finds the flag raised) and computes every pair but the CPU's share
    (OffloadEngine.cold_split_table) from its slots and the host tier; the CPU computes that share, and the sum, made
    on the device, is the all-CPU run's. Each layer's step orders the streams as a routed launch does, with the CPU's
    part merged before the dense part's stream goes on: by the merge queued at the launch, which waits for the host's
    gate (gated, from a layer's second launch), or by one queued after the CPU's part. (Every launch through the
    compute stream here: a step launched again on the dense part's stream is the next test's.)"""
    monkeypatch.setattr(FakeGpuQMoE, "gated_merge", gated)
    monkeypatch.setattr(CudaSlots, "split_on_dense", False)
    model, cp = open_on_standin(model_folder, fraction, monkeypatch)
    engine = model.offload
    engine.set_decode_path("both")
    assert engine.decode_path_in_force == "both" and engine.reads_tier and engine.splits_cold
    table = engine.cold_split_table(0)
    assert table.tolist() == cpu_take_table(
        SPEC.top_k, engine.infos[0].bytes_per_expert / engine.device.bandwidths.cpu, 0.0,
        engine.stores[0].read_bytes / (TIER_READ_SHARE * engine.device.bandwidths.pcie)).tolist()
    assert table[-1] > 0  # the stand-in's rates give the CPU a share
    steps, totals = decode_on_device(model, cpu_run, "split_launches")
    merges = [(getattr(store.gpu, "gated_merges", 0), getattr(store.gpu, "merge_sums", 0)) for store in engine.stores]
    # (a layer's first launch merges after the CPU's part: its host may compile for longer than the gate waits)
    assert merges == [(steps - 1, 1) if gated else (0, steps)] * SPEC.layers
    # each layer's run() left the decoder its step, whose merge did not give up (the decoder asks after each step)
    nodes = [runner for runner in model.decoder.steps if hasattr(runner, "last_split")]
    assert len(nodes) == SPEC.layers and all(node.last_split is not None and not node.last_split.gave_up
                                             for node in nodes)
    assert totals.misses_cpu > 0 and totals.misses_read > 0 and engine.stats.phases["decode"].cpu_s > 0
    assert totals.misses == totals.misses_cpu + totals.misses_copied + totals.misses_read
    last_sync = len(cp.log) - 1 - cp.log[::-1].index(("sync", "dense"))
    step = cp.log[last_sync - 7 * SPEC.layers:last_sync]
    assert ("sync", "compute") not in step  # the routing reached the host without a stream synchronisation
    assert step.count(("wait", "dense", "compute")) == SPEC.layers  # each layer's merge before the next segment
    # the host's own work from a layer's CPU part to the next layer's launch is measured (HostGap), and the table made
    # again counts it on the CPU's side
    assert 0 < engine.host_gap.value < 0.5
    engine._split_tables.clear()
    info, store = engine.infos[0], engine.stores[0]
    assert engine.cold_split_table(0).tolist() == cpu_take_table(
        SPEC.top_k, info.bytes_per_expert / cpu_bytes_per_s(engine.device.bandwidths, engine.split_cpu_rate.value),
        engine.split_cpu_rate.fixed_s, store.read_bytes / engine.tier_read.value, engine.host_gap.value).tolist()
    engine.host_gap._gaps.extend([1.0] * engine.host_gap.WINDOW)  # a host slower than any read: all to the GPU
    engine._split_tables.clear()
    assert not engine.cold_split_table(0).any()
    # every layer then takes the tier's step and measures no gap: a later switch to "both" (a trial) measures afresh,
    # and the table is made again without the gap (whether the CPU then takes a share depends on the measured rates)
    engine.set_decode_path("tier")
    engine.set_decode_path("both")
    assert engine.host_gap.value == 0 and not engine._split_tables
    assert engine.cold_split_table(0).tolist() == cpu_take_table(
        SPEC.top_k, info.bytes_per_expert / cpu_bytes_per_s(engine.device.bandwidths, engine.split_cpu_rate.value),
        engine.split_cpu_rate.fixed_s, store.read_bytes / engine.tier_read.value, 0.0).tolist()
    engine.reconfigure(engine.config.updated(cpu_execution="disabled"))  # no CPU compute: the tier alone
    assert engine.decode_path_in_force == "tier" and not engine.splits_cold


def test_under_decode_path_both_a_pair_split_by_rows_gives_the_all_cpu_run(model_folder, cpu_run, monkeypatch):
    """Where the split's rows table splits a pair (OffloadEngine.cold_split_rows; here at row 32 of 64 for every count of
    cold pairs), a step of one token publishes the GPU's last cold pair coded by the CPU's first row, the device
    computes its rows below 32 and the CPU the rest: the run is the all-CPU run's, the split pairs counted as the
    CPU's misses, the tier's bytes read with the device's rows of them."""
    from engine.offload.split_share import SPLIT_ROWS

    model, _ = open_on_standin(model_folder, 0.0, monkeypatch)
    engine = model.offload
    engine.set_decode_path("both")
    assert engine.stores[0].splits_rows and engine.cold_split_rows(0) is None  # whole pairs until the row trials...
    engine.row_trials.choice = SPLIT_ROWS  # ... find the split faster
    assert engine.cold_split_rows(0) is not None  # (its rows: none within 64 rows, ROW_STEP's)
    rows = np.full(SPEC.top_k + 1, 32, np.int32)
    rows[0] = 0
    monkeypatch.setattr(engine, "cold_split_rows", lambda layer: rows)
    codes, launch = [], FakeGpuQMoE.run_routed_split

    def run_routed_split(self, x, logits, out32, published, *args, **kwargs):
        result = launch(self, x, logits, out32, published, *args, **kwargs)
        codes.append(published.on_cpu.copy())
        return result

    monkeypatch.setattr(FakeGpuQMoE, "run_routed_split", run_routed_split)
    observed = []
    monkeypatch.setattr(engine.tier_read, "observe", lambda nbytes, seconds: observed.append(nbytes))
    steps, totals = decode_on_device(model, cpu_run, "split_launches")
    split = [c for c in codes if (c > 1).any()]
    assert len(split) == len(codes) == steps * SPEC.layers  # every cold count above 0 splits: every step
    assert all(((c > 1).sum(), c.max()) == (1, 33) for c in split)
    assert totals.misses_cpu > 0 and totals.misses == totals.misses_cpu + totals.misses_copied + totals.misses_read
    read_bytes = engine.stores[0].read_bytes
    assert any(nbytes % read_bytes for nbytes in observed)  # a split pair's rows are part of an expert's bytes


def test_a_pair_is_split_by_rows_only_where_the_cpu_kernel_computes_a_part_of_an_expert(tmp_path, monkeypatch):
    """GpuQMoE.splits_rows says what the GPU's decode kernels do (the tensor-core path's dec5), whatever the node's
    layout; the split pair's other rows are the CPU kernel's, which computes a part of an expert through its fused
    decode kernel only (CpuQMoE.splits_rows: not with FC1 gate + FC3 up, swiglu_fusion 0). The stores said they split
    pairs wherever the GPU's kernels did, so the row trials timed the split there and its CPU part was refused
    (run_experts' spans) in the middle of a decode. Here they keep pairs whole: the run is the all-CPU run's."""
    from engine.offload.split_share import SPLIT_ROWS
    from engine.writer import write_model

    monkeypatch.setattr(FakeGpuQMoE, "splits_rows", property(lambda self: True))  # as GpuQMoE's on an sm_80+ card
    folder = write_model(tmp_path / "m", dataclasses.replace(SPEC, swiglu_fusion=0, inter_size=256))
    cpu_run = greedy_run(LoadedModel.open(folder))
    model, _ = open_on_standin(folder, 0.25, monkeypatch, decode_path="both")
    engine = model.offload
    assert engine.splits_cold and not engine.runners[0].kernel.splits_rows
    engine._split_costs = lambda layer: (100e-6, 0.0, 100e-6)  # the CPU and the GPU alike: a split where one can be
    engine.row_trials.choice = SPLIT_ROWS
    assert not engine.rows_choosable() and not engine.stores[0].splits_rows and engine.cold_split_rows(0) is None
    steps, totals = decode_on_device(model, cpu_run, "split_launches")
    assert totals.misses_cpu > 0  # the CPU's whole pairs



def test_a_both_step_launched_again_goes_straight_onto_the_dense_stream(model_folder, cpu_run, monkeypatch):
    """From a layer's third "both" launch (the first merges after the CPU's part, the second queues the gated merge
    in its graph), the last launch's graph is launched again on the dense part's stream: the step is the all-CPU
    run's, and no event, wait or launch of it touches the compute stream."""
    model, cp = open_on_standin(model_folder, 0.0, monkeypatch)
    engine = model.offload
    engine.set_decode_path("both")
    steps, totals = decode_on_device(model, cpu_run, "split_launches")
    assert [store.gpu.split_relaunches for store in engine.stores] == [steps - 2] * SPEC.layers
    assert totals.misses_cpu > 0 and totals.misses_read > 0
    last_sync = len(cp.log) - 1 - cp.log[::-1].index(("sync", "dense"))
    step = cp.log[last_sync - 4 * SPEC.layers:last_sync]
    assert not [entry for entry in step if "compute" in entry]
    # each layer: the start event and (inside the graph) the stop event recorded on the dense part's stream
    assert step.count(("record", "dense")) >= 2 * SPEC.layers
    monkeypatch.setattr(CudaSlots, "split_on_dense", False)  # switched off: through the compute stream again
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert [store.gpu.split_relaunches for store in engine.stores] == [steps - 2] * SPEC.layers


def test_a_gated_merge_that_gave_up_waiting_for_the_cpus_part_is_made_again(model_folder, cpu_run, monkeypatch):
    """Decode path "both" with the gated merge: where the host took longer over the CPU's part than the merge waits
    on the device (a first call's compilation, a paused host), the merge leaves the GPU's part alone and says so; the
    host finds that and adds the CPU's part as without the gate (merge_sum), so the tokens are still the all-CPU
    run's. Where it kept within the time, the gated merge alone adds the part."""
    monkeypatch.setattr(cuda_device, "GATE_TIMEOUT_S", 0.0)  # the stand-in's merge gives up at once
    model, _cp = open_on_standin(model_folder, 0.0, monkeypatch)
    engine = model.offload
    engine.set_decode_path("both")
    steps, totals = decode_on_device(model, cpu_run, "split_launches")
    assert totals.misses_cpu > 0
    assert [getattr(store.gpu, "merge_sums", 0) for store in engine.stores] == [steps] * SPEC.layers
    assert all(getattr(store.gpu, "gated_merges", 0) == 0 for store in engine.stores)
    # (launches again on the dense part's stream among them: that stream is the one waited for before the merge)
    assert [store.gpu.split_relaunches for store in engine.stores] == [steps - 2] * SPEC.layers
    monkeypatch.setattr(cuda_device, "GATE_TIMEOUT_S", 60.0)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert [(store.gpu.gated_merges, store.gpu.merge_sums) for store in engine.stores] == [(steps, steps)] * SPEC.layers


def test_a_host_held_after_a_gated_launch_finds_the_gate_late_and_merges_again(model_folder, cpu_run, monkeypatch):
    """The host held between a "both" layer's launch and its return (on the GPU: the garbage collection a CUDA graph's
    capture deferred, finalizing an object whose teardown syncs the device while the merge waits for the gate) for
    longer than the merge waits: the merge gives up, and the host's clock must count that time, so merge_split finds
    the gate late and adds the CPU's part itself. Timed from the launch's return, the gate looked in time: the step
    ran again, and before the gave-up word was read after each step (dac9782), its logits were wrong (the GPU test's
    [ahead-0.0] failure, RESULTS.md "Forty-ninth session")."""
    import time

    timeout = 0.2
    monkeypatch.setattr(cuda_device, "GATE_TIMEOUT_S", timeout)
    monkeypatch.setattr(CudaSlots, "split_on_dense", False)  # every launch through _launch_split

    def merge_gated(self, published, a, out, timeout_s=1.0):  # the device's: it gives up `timeout_s` after its launch
        want, queued = published.launched, time.perf_counter()

        def open_gate():
            type(published).open_gate(published)
            if time.perf_counter() - queued > timeout_s:
                np.copyto(out, a, casting="same_kind")
                published.failed[0] = want
            elif published.gate[0] == want:
                np.copyto(out, a + published.part, casting="same_kind")
        published.open_gate = open_gate

    launch = FakeGpuQMoE.run_routed_split
    held = []

    def held_once(self, *args, **kwargs):
        out = launch(self, *args, **kwargs)  # queued, the gated merge waiting for the gate ...
        if kwargs.get("merged") is not None and not held:
            held.append(self)
            time.sleep(2 * timeout)  # ... while the host is held
        return out

    monkeypatch.setattr(FakeGpuQMoE, "merge_gated", merge_gated)
    monkeypatch.setattr(FakeGpuQMoE, "run_routed_split", held_once)
    model, _cp = open_on_standin(model_folder, 0.0, monkeypatch)
    model.offload.set_decode_path("both")
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert held and model.decoder.steps_run_again == 0
    assert held[0].merge_sums >= 2  # the held launch's merge made again by merge_split (and the first launch's)


def test_the_cpu_rates_ceiling_comes_from_the_streaming_read_the_device_measured(model_folder, monkeypatch):
    """The engine's CPU rates (the miss policy's and the split's) refuse a line faster than twice the host's streaming
    read as the device measured it (here the stand-in's 40 GB/s): calls on a line of 100 GB/s + 110 µs a call leave
    them the calls' average. A line mostly of fixed cost whose slope reads no faster than the stream stands (tiny
    experts: 180 µs + 30 GB/s with 32 KiB experts, 99% of a call fixed)."""
    model, _cp = open_on_standin(model_folder, 0.5, monkeypatch)
    engine = model.offload
    assert engine.device.bandwidths.cpu == 40e9
    for rate in (engine.cpu_rate, engine.split_rate):
        assert (rate.ceiling, rate.stream) == (80e9, 40e9)
        observed(rate, line_calls(100e9, 110e-6))
        assert rate.value == rate.average and rate.fixed_s == 0.0
    tiny = observed(engine._new_cpu_rate(), [(n * 32256, 180e-6 + n * 32256 / 30e9) for n in [1, 2] * 10])
    assert (tiny.value, tiny.fixed_s) == (pytest.approx(30e9, rel=1e-6), pytest.approx(180e-6, rel=1e-6))


def test_a_binding_with_outputs_left_on_the_device_goes_without_a_garbage_collection(model_folder, monkeypatch):
    """A dense segment's binding and its DeviceOutputs hold no cycle: once dropped, the binding (onnxruntime's session
    with it, and the outputs' device buffers) goes at once, not at the next collection; on a GPU a collection comes
    after the step or on the window's timer, and a load right after an unload would measure less free VRAM."""
    import gc
    import weakref

    from engine.dense_segment import DenseSegment

    model, _cp = open_on_standin(model_folder, 0.5, monkeypatch)
    state = model.new_state()
    logits = model.decoder.forward(state, model.tokenizer.encode("Hello there"))
    model.decoder.forward(state, [int(logits[-1].argmax())])
    segments = [runner for runner in model.decoder.steps if isinstance(runner, DenseSegment)]
    bound = [weakref.ref(binding) for segment in segments for binding in segment.bindings._by_state.values()
             if binding._on_device is not None]
    assert len(bound) >= 2  # the segments whose outputs the next layer reads on the device
    gc.disable()
    try:
        for segment in segments:
            segment.bindings.clear()
        assert [ref() for ref in bound] == [None] * len(bound)
    finally:
        gc.enable()


def test_a_dense_backends_host_input_staging_goes_with_the_backend():
    """dense_graph keeps each backend's HostInputStaging in a WeakKeyDictionary, and the staging held its backend: the
    key never went, and with it the model's dense stream, its event and copy_out's page-locked buffers stayed for as
    long as the process, one set for each model loaded with its dense part on the GPU."""
    import gc
    import weakref

    from engine.dense_graph import staging_for

    backend = CupyBackend(FakeCupy())
    staging = staging_for(backend)
    staged = staging.stage("seqlens_k", np.array([5], np.int32))
    assert staging_for(backend) is staging and staged.view(np.ndarray).tolist() == [5]
    dropped = [weakref.ref(backend), weakref.ref(staging)]
    gc.disable()
    try:
        del backend, staging
        assert [ref() for ref in dropped] == [None, None]
    finally:
        gc.enable()


def test_under_decode_path_both_a_node_the_routing_kernel_cannot_route_takes_the_tiers_step(model_folder, cpu_run,
                                                                                            monkeypatch):
    """route_split routes on the device, softmax top-k over at most 1024 experts (kernels.gpu.qmoe.routes_on_device):
    a node with a sparse mixer or more experts takes the tier's step under "both", the others split, the tokens the
    all-CPU run's."""
    import dataclasses

    from engine.offload.hybrid_node import HybridExpertNode
    from kernels.gpu.qmoe import routes_on_device

    spec = LoadedModel.open(model_folder).folder.experts[0].spec
    assert routes_on_device(spec)
    assert not routes_on_device(dataclasses.replace(spec, use_sparse_mixer=True))
    assert not routes_on_device(dataclasses.replace(spec, num_experts=1025))
    model, _cp = open_on_standin(model_folder, 0.5, monkeypatch)
    engine = model.offload
    engine.set_decode_path("both")
    nodes = [step for step in model.decoder.steps if isinstance(step, HybridExpertNode)]
    nodes[1]._splittable = False  # as a sparse-mixer node would be
    assert_same_as_cpu(greedy_run(model), cpu_run)
    steps = len(cpu_run[1])
    assert [getattr(store.gpu, "split_launches", 0) for store in engine.stores] == [steps, 0, steps]
    assert engine.stores[1].gpu.routed == steps


def test_a_decode_steps_routing_that_never_reaches_the_host_is_a_one_line_error(model_folder, monkeypatch):
    """Decode path "both": where the routing kernel's flag never comes (a launch lost), the host stops spinning,
    waits for the launch to finish and, the flag still down, raises an error naming the node instead of waiting for
    ever. It waits for the launch's own event, not for its stream: the merge queued behind the launch waits for the
    host (a stream synchronisation there held a GPU that was behind for the gate's whole timeout)."""
    model, cp = open_on_standin(model_folder, 0.5, monkeypatch)
    engine = model.offload
    engine.set_decode_path("both")
    real = FakeGpuQMoE.run_routed_split

    def lost(self, x, logits, out32, published, router_weights=None, **tail):
        real(self, x, logits, out32, published, router_weights, **tail)
        published.flag[0] -= 1  # as if the kernel had not run

    monkeypatch.setattr(FakeGpuQMoE, "run_routed_split", lost)
    with pytest.raises(WorkbenchError, match=r"^[^\n]*: the GPU's routing of a decode step never reached the host "
                                             r"\(route_split published launch 0, expected 1\)$"):
        greedy_run(model)
    assert cp.log[-1] == ("event sync", "compute") and ("sync", "compute") not in cp.log


def test_a_host_tier_the_driver_refuses_leaves_decode_as_it_was(model_folder, cpu_run, monkeypatch):
    """A host tier that cannot be mapped (HostTierError) or does not fit the device: a one-line error, and the engine
    as before (no tier, the plan's slots with their residents)."""
    model, _cp = open_on_standin(model_folder, 0.5, monkeypatch)
    engine = model.offload
    counts = [store.num_slots for store in engine.stores]
    used = engine.device.memory.used

    def refused(self, slots, resident, tensors=None):
        if self.host_tier and tensors is None:
            raise HostTierError("cuMemCreate failed: CUresult 2")
        return _fake_make(self, slots, resident, tensors)

    monkeypatch.setattr(CudaSlots, "_make", refused)
    with pytest.raises(WorkbenchError, match=r"decode path 'tier': Cold experts are computed on the CPU: the host tier "
                                             r"could not be made \(cuMemCreate failed"):
        engine.set_decode_path("tier")
    assert engine.host_tier is False and not any(store.reads_cold for store in engine.stores)
    assert [store.num_slots for store in engine.stores] == counts and engine.device.memory.used == used
    residents = [sorted(layer.resident().tolist()) for layer in engine.slots]  # the re-plans filled the slots again
    assert [sorted(np.nonzero(store.gpu.slot_of >= 0)[0].tolist()) for store in engine.stores] == residents
    assert_same_as_cpu(greedy_run(model), cpu_run)


def test_by_default_the_host_tier_is_made_and_trials_choose_the_decode_path(model_folder, cpu_run, monkeypatch):
    """Decode path auto under cpu_execution=auto (the defaults): the tier is made at load and the plan says so; the
    trials (given step times here) time the tier, the CPU path, both and the tier again and keep the CPU path where it
    is the fastest: its decode steps then bring partly resident layers' inputs to the host and compute their cold
    experts on the CPU, with the all-CPU run's tokens throughout."""
    model, _cp = open_on_standin(model_folder, 0.5, monkeypatch, decode_path="auto")
    engine = model.offload
    assert engine.host_tier and engine.decode_path_in_force == "tier" and engine.reads_tier
    assert any(said.startswith("Decode can also read cold experts on the GPU from a host tier of ") and
               said.endswith("times that against the CPU and against both at once, and keeps the fastest.")
               for said in engine.plan.statements)
    engine.path_trials = DecodePathTrials(first=1, settle=1, window=2, recheck=100)
    paths = time_paths_as_given(model)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    # after each step: the prompt (not counted); decode: 1 skipped, 2 timed (-> the CPU path), 1 settling, 2 timed
    # (-> both), 1 settling, 2 timed (-> the tier), 1 settling, 2 timed (-> the CPU path kept)
    assert paths == ["tier"] * 3 + ["cpu"] * 3 + ["both"] * 3 + ["tier"] * 3 + ["cpu"], paths
    assert engine.path_trials.trials == 1 and not engine.reads_tier and engine.host_tier
    state = engine.copy_state()["decode_path"]
    assert state["in_force"] == "cpu" and state["measured_ms"] == {
        "tier": pytest.approx(30.0, abs=1.0), "cpu": pytest.approx(20.0, abs=1.0), "both": pytest.approx(25.0, abs=1.0)}
    engine.stats.reset(SPEC.layers, [SPEC.num_experts] * SPEC.layers)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert engine.stats.totals().misses_read == 0 and engine.stats.totals().misses_cpu > 0


@pytest.mark.parametrize("cpu_execution, made, in_force", [("enabled", False, "cpu"), ("disabled", True, "tier")])
def test_cpu_execution_decides_the_decode_path_without_trials(model_folder, cpu_run, monkeypatch, cpu_execution, made,
                                                              in_force):
    """cpu_execution=enabled keeps cold experts on the CPU (no tier made); disabled keeps them off it (the tier, read
    at every decode step, no trials)."""
    model, _cp = open_on_standin(model_folder, 0.5, monkeypatch, decode_path="auto", cpu_execution=cpu_execution)
    engine = model.offload
    assert engine.host_tier is made and engine.decode_path_in_force == in_force
    assert not engine.path_trials_run()
    engine.stats.reset(SPEC.layers, [SPEC.num_experts] * SPEC.layers)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert (engine.stats.totals().misses_read > 0) is made


def test_the_host_tier_is_not_made_where_the_host_cannot_spare_the_memory(model_folder, monkeypatch):
    """Under auto the tier takes at most half the host memory available, and an explicit pinned_bytes bounds
    page-locked memory to the staging ring: no tier, and the plan says why; asked for ("tier"), only the memory
    itself refuses it. All experts resident: no tier wanted, nothing said."""
    import engine.offload.decode_path as decode_path

    tier_bytes = sum(info.spec.num_experts * info.gpu.slot_bytes for info in ModelFolder.open(model_folder).experts)
    monkeypatch.setattr(decode_path, "host_available", lambda: int(1.5 * tier_bytes))
    model, _cp = open_on_standin(model_folder, 0.5, monkeypatch, decode_path="auto")
    engine = model.offload
    assert not engine.host_tier and engine.decode_path_in_force == "cpu"
    assert any(said.startswith("Cold experts are computed on the CPU: no host tier is made, since its ") and
               "exceed 50% of the host memory available" in said for said in engine.plan.statements)
    engine.set_decode_path("tier")  # asked for: 1.5x its size is available
    assert engine.host_tier and engine.reads_tier
    engine.reconfigure(engine.config.updated(pinned_bytes=1 << 20), decode_path="auto")
    assert not engine.host_tier
    assert any("pinned_bytes=1048576 bounds page-locked memory to the staging ring" in said
               for said in engine.plan.statements)
    monkeypatch.setattr(decode_path, "host_available", lambda: tier_bytes // 2)
    with pytest.raises(WorkbenchError, match="decode path 'tier': .* exceed the host memory available"):
        engine.set_decode_path("tier")
    assert not engine.host_tier and engine.decode_path_mode == "auto"
    engine.reconfigure(engine.config.updated(pinned_bytes=None, device_expert_bytes=device_expert_bytes(model_folder)))
    assert engine.slots[0].all_resident and not engine.host_tier
    assert not any("host tier" in said for said in engine.plan.statements)


DENSE_ON_CPU = "onnxruntime here is the CPU build"  # ort_env.cuda_ep_missing_reason, made this machine's alike


def assert_no_tier_and_decode_as_on_the_cpu(model, cpu_run, made_before: int) -> None:
    """A model on the stand-in whose dense part runs on the CPU: no host tier made (no mapping, no page-locked host
    memory, no device bytes beyond the slots), the plan says why, the streaming slots device_working_bytes asks for
    made for the decode steps that copy misses into them, and the all-CPU run's tokens with no miss read from a
    tier."""
    engine, memory = model.offload, model.offload.device.memory
    assert not engine.host_tier and engine.decode_path_in_force == "cpu" and not engine.reads_tier
    assert FakeGpuQMoE.made_tiers == made_before and not any(store.reads_cold for store in engine.stores)
    assert "host_tier_bytes" not in engine.pinned_info()
    assert f"Cold experts are computed on the CPU: no host tier is made, since the dense part runs on the CPU " \
           f"({DENSE_ON_CPU}), so decode's expert inputs never sit in GPU memory and no decode step could read the " \
           "tier." in engine.plan.statements, engine.plan.statements
    slots = sum(nbytes for purpose, nbytes in memory.by_purpose.items() if purpose.startswith("expert slots of "))
    assert slots == engine.plan.device_bytes(engine.infos) == 0
    streaming = sum(group.num_slots * group.slot_bytes for group in engine.streaming.groups)
    assert memory.by_purpose["decode streaming slots"] == streaming
    assert engine.streaming.groups and engine.streaming.tier_path is None
    engine.stats.reset(SPEC.layers, [SPEC.num_experts] * SPEC.layers)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    totals = engine.stats.totals()
    assert totals.misses_read == 0 and totals.misses_cpu + totals.misses_copied > 0


@pytest.mark.parametrize("mode", ["tier", "both", "auto"])
def test_no_host_tier_is_made_where_the_dense_part_runs_on_the_cpu(model_folder, cpu_run, monkeypatch, mode):
    """On a CUDA card whose dense part runs on the CPU (here: no CUDA execution provider) decode's inputs never sit in
    GPU memory, so every decode step routes on the host and computes cold experts on the CPU (HybridExpertNode.run):
    the tier was made all the same (page-locked host memory, device mappings, a plan that said decode reads it), and
    under 'tier' / 'both' the streaming slots were left out for it. Asked for, the tier is refused with that reason."""
    monkeypatch.setattr("engine.ort_env.cuda_ep_missing_reason", lambda: DENSE_ON_CPU)
    made_before = FakeGpuQMoE.made_tiers
    model, _cp = open_on_standin(model_folder, 0.0, monkeypatch, decode_path=mode, dense_on_device=False,
                                 device_working_bytes=1 << 30)
    assert model.dense_device == "cpu" and model.dense_reason == DENSE_ON_CPU
    assert_no_tier_and_decode_as_on_the_cpu(model, cpu_run, made_before)
    with pytest.raises(WorkbenchError, match=r"decode path 'tier': Cold experts are computed on the CPU: no host tier "
                                             r"is made, since the dense part runs on the CPU \(onnxruntime here"):
        model.offload.set_decode_path("tier")


@pytest.mark.parametrize("mode", ["tier", "auto"])
def test_a_host_tier_made_for_a_dense_part_that_stayed_on_the_cpu_is_planned_away(model_folder, cpu_run, monkeypatch,
                                                                                   mode):
    """The plan is made for the dense part where it is meant to go, before onnxruntime's arena is sized from what the
    plan leaves: where the arena does not fit, the dense part stays on the CPU all the same, and the tier made for it
    was never read. The engine, told where the dense part landed, plans again without it."""
    monkeypatch.setattr("engine.generation.dense_cpu_reason", lambda kind, kv_dtypes: None)  # meant for the card
    monkeypatch.setattr("engine.generation.choose_dense_device", lambda *args: DenseDevice("cpu", DENSE_ON_CPU))
    made_before = FakeGpuQMoE.made_tiers
    model, _cp = open_on_standin(model_folder, 0.0, monkeypatch, decode_path=mode, dense_on_device=False,
                                 device_working_bytes=1 << 30)
    assert FakeGpuQMoE.made_tiers > made_before  # (made for the plan first)
    assert_no_tier_and_decode_as_on_the_cpu(model, cpu_run, FakeGpuQMoE.made_tiers)
    assert model.offload.device.memory.used == (model.offload.staging.device_bytes
                                                + model.offload.device.memory.by_purpose["decode streaming slots"])


def test_the_dense_part_goes_to_the_card_after_all_where_only_the_host_tiers_mappings_kept_its_arena_off(model_folder,
                                                                                                        monkeypatch):
    """The tier's device mappings round each slot array up to the granule (here: a slot more). Where that took the room
    onnxruntime's arena lacked under gpu_device_mem_limit, the engine planned the tier away for the dense part on the
    CPU, and its mappings freed left the arena room on the card that no second try used. The engine now says where the
    plan without the tier lets the arena fit (the load tries the card again): told it landed there, the slots stay
    without the tier, the plan saying why none is made."""
    from engine.decoder_state import DecoderState as State
    from engine.ort_env import MIN_DENSE_ARENA

    model, _cp = open_on_standin(model_folder, 0.5, monkeypatch, decode_path="tier")
    memory = model.offload.device.memory
    per_expert = model.offload.stores[0].expert_bytes
    mappings = sum((2 if store.num_slots == 0 else 1) * per_expert for store in model.offload.stores)
    total, growth = State(model.config, model.folder.onnx.proto.graph).full_context_bytes()
    dense = total + growth + model.folder.dense_bytes + MIN_DENSE_ARENA
    # room for the dense part beside the slots, but not beside the tier's mappings too
    limit = memory.used - mappings + dense + mappings // 2
    model, _cp = open_on_standin(model_folder, 0.5, monkeypatch, decode_path="tier", mem_limit=limit)
    engine, memory = model.offload, model.offload.device.memory
    assert engine.host_tier
    refusal = engine.arena_refusal(memory.available)
    assert refusal.startswith(f"gpu_device_mem_limit={limit} leaves ")
    assert engine.dense_landed(refusal) == refusal  # (the load tries the card again)
    assert not engine.host_tier and engine.arena_refusal(memory.available) is None
    engine.dense_landed(None, refusal)
    assert engine.dense_cpu is None and engine.dense_on_device and engine.decode_path_in_force == "cpu"
    assert memory.used == limit - dense - mappings // 2
    said = [sentence for sentence in engine.plan.statements if "no host tier is made" in sentence]
    assert said == ["Cold experts are computed on the CPU: no host tier is made, since onnxruntime's arena for the "
                    "dense part fits on the card beside the expert slots but not beside the tier's device mappings "
                    f"({refusal})."]
    # the load's arena takes what the limit leaves beside the slots without the tier, for as long as the model is
    # loaded: a re-plan of the same settings planned the tier again (the dense part on the card), then refused it for
    # the room the arena holds, in other words than the load's plan; it makes the load's plan now
    memory.reserve(memory.available, DENSE_RESERVATION)
    planned = (list(engine.plan.statements), dict(engine.plan.slots), dict(memory.by_purpose))
    engine.reconfigure(engine.config)
    assert (list(engine.plan.statements), dict(engine.plan.slots), dict(memory.by_purpose)) == planned
    assert not engine.host_tier and engine.tier_statement == said[0]
    with pytest.raises(WorkbenchError, match=r"decode path 'tier': Cold experts are computed on the CPU: no host tier "
                                             r"is made, since onnxruntime's arena for the dense part fits on the card"):
        engine.set_decode_path("tier")
    # the load tries the card again with the arena the plan without the tier leaves (here onnxruntime cannot make it)
    from engine import ort_env

    monkeypatch.setattr(ort_env, "cuda_ep_missing_reason", lambda: None)  # as with onnxruntime-gpu
    monkeypatch.setattr(ort_env, "kv_dtype_reason", lambda kv_dtypes: None)  # (the model's KV caches are fp32)
    arenas = []

    def register(device_id, max_mem):
        arenas.append(max_mem)
        raise ort_env.DenseDoesNotFit("onnxruntime cannot make its GPU arena on device 0: a stand-in")

    monkeypatch.setattr(ort_env, "register_shared_cuda_arena", register)
    model, _cp = open_on_standin(model_folder, 0.5, monkeypatch, decode_path="tier", mem_limit=limit,
                                 dense_on_device=False)
    assert arenas == [MIN_DENSE_ARENA + mappings // 2] and not model.offload.host_tier
    assert model.dense_device == "cpu" and model.dense_reason == model.offload.dense_cpu == (
        "onnxruntime cannot make its GPU arena on device 0: a stand-in")
    # the plan says that reason too, not the first try's, which the tier's mappings (gone since) made
    said = [sentence for sentence in model.offload.plan.statements if "no host tier is made" in sentence]
    assert said == ["Cold experts are computed on the CPU: no host tier is made, since the dense part runs on the CPU "
                    "(onnxruntime cannot make its GPU arena on device 0: a stand-in), so decode's expert inputs never "
                    "sit in GPU memory and no decode step could read the tier."]
    # where even the slots alone leave the arena short, the dense part stays on the CPU: no second try
    model, _cp = open_on_standin(model_folder, 0.5, monkeypatch, decode_path="tier", mem_limit=limit - mappings)
    engine = model.offload
    refusal = engine.arena_refusal(engine.device.memory.available)
    assert engine.dense_landed(refusal) is None and engine.dense_cpu == refusal and not engine.host_tier


@pytest.mark.parametrize("loaded", ["disabled", "auto"])
def test_offload_disabled_runs_every_expert_on_the_cpu_where_the_arena_keeps_the_dense_part_there(model_folder,
                                                                                                   cpu_run,
                                                                                                   monkeypatch,
                                                                                                   loaded):
    """mode=disabled runs every expert where the dense part runs. The plan is made for the dense part where it is meant
    to go (onnxruntime's CUDA execution provider), before onnxruntime's arena is weighed beside it: where that does not
    fit under gpu_device_mem_limit, the dense part stays on the CPU, and every expert stayed on the card all the same
    (their bytes in its memory, each expert node's input sent there and back every step). The engine, told where the
    dense part landed, plans every expert onto the CPU and says why; so does a re-plan to mode=disabled of a model
    loaded under mode=auto."""
    from engine import ort_env
    from engine.offload.planner import all_resident_bytes

    monkeypatch.setattr(ort_env, "cuda_ep_missing_reason", lambda: None)  # as with onnxruntime-gpu
    monkeypatch.setattr(ort_env, "kv_dtype_reason", lambda kv_dtypes: None)  # (the model's KV caches are fp32)
    experts = ModelFolder.open(model_folder).experts
    # room for every expert beside no reserve, none for the dense part's state, weights and arena
    limit = all_resident_bytes(experts) + (1 << 20)
    model, _cp = open_on_standin(model_folder, 0.0, monkeypatch, dense_on_device=False, mem_limit=limit,
                                 mode=loaded, reserve_device_bytes=0)
    engine = model.offload
    if loaded != "disabled":
        engine.reconfigure(engine.config.updated(mode="disabled"))
    assert model.dense_device == "cpu"
    assert engine.plan.placement_mode == "cpu_only" and set(engine.plan.slots.values()) == {0}
    assert [layer.num_slots for layer in engine.slots] == [0] * SPEC.layers
    assert all(store is None or store.num_slots == 0 for store in engine.stores)
    assert engine.device.memory.used == 0
    # the arena check's hint names the expert budgets, which mode=disabled does not apply: its own hint in its place,
    # in the model's reason (generate --json's dense, where everything landed) as in the plan
    left = "1.0 MiB" if loaded == "disabled" else "1.5 MiB"  # (loaded under mode=auto: its budget of 0 left more)
    reason = (f"gpu_device_mem_limit={limit} leaves {left} after the expert slots and staging; the KV cache and state "
              "at their longest (3.5 MiB), the dense weights (654.0 KiB) and onnxruntime's workspace (64.0 MiB at "
              "least) need more")
    disabled = (reason + ": raise gpu_device_mem_limit, or use mode=auto, which keeps the experts that do not fit on "
                "the CPU")
    assert model.dense_reason == disabled
    assert model.dense_statement == f"The dense part runs on the CPU: {disabled}."
    assert engine.plan.statements == ["All experts run on the CPU: offload is disabled, and the dense part runs on the "
                                      f"CPU ({disabled})."]
    engine.stats.reset(SPEC.layers, [SPEC.num_experts] * SPEC.layers)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    totals = engine.stats.totals()
    assert totals.hits == 0 and totals.routed_on_device == 0 and totals.misses_cpu > 0
    assert engine.device.memory.used == 0
    engine.reconfigure(engine.config.updated(mode="auto"))  # a mode the expert budgets apply in: the check's own hint
    assert model.dense_reason == reason + " (raise reserve_device_bytes or lower device_expert_bytes)"


def test_offload_disabled_copies_no_expert_to_the_card_where_the_arena_would_not_fit_beside_them(model_folder,
                                                                                                  monkeypatch):
    """mode=disabled's plan takes nothing of the card but its slots, so whether onnxruntime's arena fits beside every
    expert is known from the plan. The load copied every expert to the card all the same, and the engine freed them
    once told the dense part stayed on the CPU: load time spent on copies, and a device peak of every expert. The plan
    now puts them on the CPU first, for the arena's reason weighed beside every expert, as the load then says it."""
    from engine import ort_env
    from engine.offload.planner import all_resident_bytes

    monkeypatch.setattr(ort_env, "cuda_ep_missing_reason", lambda: None)  # as with onnxruntime-gpu
    monkeypatch.setattr(ort_env, "kv_dtype_reason", lambda kv_dtypes: None)  # (the model's KV caches are fp32)
    limit = all_resident_bytes(ModelFolder.open(model_folder).experts) + (1 << 20)
    uploaded = []
    upload = FakeGpuQMoE.upload_expert
    monkeypatch.setattr(FakeGpuQMoE, "upload_expert", lambda gpu, expert, slot, **kw: (
        uploaded.append(expert), upload(gpu, expert, slot, **kw)))
    model, _cp = open_on_standin(model_folder, 0.0, monkeypatch, dense_on_device=False, mem_limit=limit,
                                 mode="disabled", reserve_device_bytes=0)
    engine = model.offload
    assert engine.device.memory.high_water == 0 and uploaded == []
    assert model.dense_device == "cpu" and model.dense_reason.startswith(
        f"gpu_device_mem_limit={limit} leaves 1.0 MiB after the expert slots and staging; ")
    # the engine keeps the load's reason as said (the plan and the model word it for mode=disabled)
    assert engine.plan.placement_mode == "cpu_only" and engine.dense_cpu == model.dense.reason
    assert model.dense_reason.endswith("raise gpu_device_mem_limit, or use mode=auto, which keeps the experts that do "
                                       "not fit on the CPU") and model.dense_reason in " ".join(engine.plan.statements)


def test_the_host_tiers_device_and_host_bytes_are_accounted(model_folder, monkeypatch):
    """The host tier's mappings: their device part (rounded up to the granule: here one slot more) reserved against
    the device's memory, their host part in pinned_info and the statistics; a re-plan makes each node's tier once
    (the stores released first, not resized to 0 with a tier of their own); switched off, the device bytes are
    given back."""
    model, _cp = open_on_standin(model_folder, 0.5, monkeypatch)
    engine, memory = model.offload, model.offload.device.memory
    plain = memory.used
    counts = [store.num_slots for store in engine.stores]
    per_expert = engine.stores[0].expert_bytes
    engine.set_decode_path("tier")
    # the zero-slot layers too get a GpuQMoE: one slot (max(1, 0)) and the rounding's one more
    extra = sum((2 if count == 0 else 1) * per_expert for count in counts)
    assert memory.used == plain + extra
    host = SPEC.layers * SPEC.num_experts * per_expert
    assert engine.pinned_info()["host_tier_bytes"] == host == engine.stats.pinned["host_tier_bytes"]
    FakeGpuQMoE.made_tiers = 0
    engine.reconfigure(engine.config)
    assert FakeGpuQMoE.made_tiers == SPEC.layers and memory.used == plain + extra
    engine.set_decode_path("cpu")
    assert memory.used == plain and "host_tier_bytes" not in engine.pinned_info()
    store, count = engine.stores[0], counts[0]

    def refused(self, slots, resident, tensors=None):
        raise HostTierError("cuMemCreate failed: CUresult 2")

    monkeypatch.setattr(CudaSlots, "_make", refused)
    with pytest.raises(HostTierError):
        store.resize(count)  # nothing kept: the slots' reservation given back with the failed GpuQMoE
    assert store.gpu is None and store.num_slots == 0 and memory.used == plain - count * per_expert


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_layers_with_cold_experts_merge_their_decode_results_on_the_standin(model_folder, cpu_run, monkeypatch,
                                                                            fraction):
    model, cp = open_on_standin(model_folder, fraction, monkeypatch)
    merged = []
    real = CudaSlots.merge_on_device

    def spy(self, pending, cpu_part, like):
        result, timing = real(self, pending, cpu_part, like)
        merged.append((type(like), type(result), pending is not None))
        return result, timing

    monkeypatch.setattr(CudaSlots, "merge_on_device", spy)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    steps = len(cpu_run[1])
    assert len(merged) == SPEC.layers * steps  # every decode layer-step; the prompt is a prefill
    assert all(like is FakeDeviceArray and result is FakeDeviceArray for like, result, _ in merged)
    assert any(launched for *_, launched in merged) == (fraction > 0)
    totals = model.offload.stats.totals()
    assert totals.misses > 0 and not model.offload.deferred
    # a merge: the dense part's stream waits for the compute stream after the addition, the host for nothing
    assert cp.log.count(("wait", "dense", "compute")) == len(merged)


def test_a_nodes_loads_are_waited_for_once_before_its_next_launch(model_folder, cpu_run, monkeypatch):
    """Loads into a node's slots (the residents at the start, the misses the policy copies, placement's swaps) go on
    the copy stream; the compute stream waits for them once, at the node's next launch, however many there were,
    and not at a launch with none since. It waits for the event recorded after the node's own last load, not for
    one recorded at the launch: that would wait for the loads of every node issued since (a safe point's swaps, layer
    after layer)."""
    model, cp = open_on_standin(model_folder, 0.5, monkeypatch)
    calls = []
    real_load, real_launch = CudaSlots.load, CudaSlots.launch

    def load(self, slot, expert):
        at = len(cp.log)
        result = real_load(self, slot, expert)
        assert cp.log[at:] == [("record", "copy")]  # right after the copy it issued
        calls.append(("load", self.name, at))
        return result

    def launch(self, *args, **kwargs):
        at = len(cp.log)
        result = real_launch(self, *args, **kwargs)
        calls.append(("launch", self.name, cp.log[at:at + 2]))
        return result

    monkeypatch.setattr(CudaSlots, "load", load)
    monkeypatch.setattr(CudaSlots, "launch", launch)
    model.offload.reconfigure(model.offload.config)  # the residents loaded again, through the spy
    assert_same_as_cpu(greedy_run(model), cpu_run)
    pending, waited = {}, 0
    for kind, node, logged in calls:
        if kind == "load":
            pending[node] = pending.get(node, 0) + 1
            continue
        if pending.pop(node, 0):
            assert logged[0] == ("wait", "compute", "copy")
            waited += 1
        else:
            assert ("wait", "compute", "copy") not in logged
    loads = sum(kind == "load" for kind, *_ in calls)
    assert waited and loads > waited  # several loads, fewer waits
    assert cp.log.count(("wait", "compute", "copy")) == waited


def test_a_replan_frees_slots_only_after_the_queued_work_is_done(model_folder, cpu_run, monkeypatch):
    """A re-plan (a budget change, the layer split's trials) frees every node's slots. Loads queued on the copy
    stream may still write them, and CuPy's pool hands freed memory out again at once: the device is waited for
    before any slots go, and so before the new plan's slots are made."""
    model, cp = open_on_standin(model_folder, 0.5, monkeypatch)
    events = []

    class Traced(FakeGpuQMoE):
        def __del__(self):
            events.append(("freed", len(cp.log)))

    def make(self, slots, resident, tensors=None):
        events.append(("made", len(cp.log)))
        return Traced(self.runner.kernel, resident)

    monkeypatch.setattr(CudaSlots, "_make", make)
    model.offload.reconfigure(model.offload.config)  # the plan's slots made again, now traced
    assert_same_as_cpu(greedy_run(model), cpu_run)  # loads and launches issued
    for slots in model.offload.stores:
        slots._launched = None  # the last launch's GpuQMoE: freed with the node's slots below
    cp.log.clear()
    events.clear()
    model.offload.reconfigure(model.offload.config.updated(device_expert_bytes=device_expert_bytes(model_folder) // 4))
    syncs = [at for at, entry in enumerate(cp.log) if entry == ("device sync",)]
    freed = [at for kind, at in events if kind == "freed"]
    made = [at for kind, at in events if kind == "made"]
    assert len(freed) == len(model.offload.stores) and made and syncs
    assert min(syncs) < min(freed) and min(freed) <= min(made)  # waited for, then freed, then made anew
    assert_same_as_cpu(greedy_run(model), cpu_run)


def test_a_replan_frees_the_streaming_slots_only_after_the_queued_work_is_done(model_folder, cpu_run, monkeypatch):
    """The decode streaming slots (a zero budget: misses copied into them) go at a re-plan too: after the wait."""
    model, cp = open_on_standin(model_folder, 0.0, monkeypatch, device_working_bytes=1 << 30)
    freed = []

    class Traced(FakeStreamingGpuQMoE):
        def __del__(self):
            freed.append(len(cp.log))

    monkeypatch.setattr("kernels.gpu.qmoe.GpuQMoE", Traced)
    model.offload.reconfigure(model.offload.config)  # streaming slots made again, now traced
    assert_same_as_cpu(greedy_run(model), cpu_run)  # misses copied into them
    for slots in model.offload.stores:
        slots._launched = None
    cp.log.clear()
    model.offload.reconfigure(model.offload.config)
    syncs = [at for at, entry in enumerate(cp.log) if entry == ("device sync",)]
    assert freed and syncs and min(syncs) < min(freed)


def test_the_host_seconds_of_loads_are_pooled_over_the_nodes_for_the_policy(model_folder, cpu_run, monkeypatch):
    """Every node's prepare_s (the miss policy's host seconds to ready one copy) is the median of the recent loads of
    experts that size on the device, whichever node made them: a node's first copies are priced by the others', and
    the slot weighing, which asks one node per layer shape, does not hang on that node's last copy alone."""
    model, _cp = open_on_standin(model_folder, 0.5, monkeypatch)
    (issue,) = model.offload.device.load_issue.values()  # one expert size in this model
    before, loads = issue._calls, []  # the residents' loads at open
    real_load = CudaSlots.load

    def load(self, slot, expert):
        loads.append(real_load(self, slot, expert))
        return loads[-1]

    monkeypatch.setattr(CudaSlots, "load", load)
    model.offload.reconfigure(model.offload.config)  # the residents loaded again, through the spy
    assert_same_as_cpu(greedy_run(model), cpu_run)
    stores = [store for store in model.offload.stores if store is not None]
    assert len(stores) > 1 and before > 0 and issue._calls - before == len(loads) >= 16
    assert issue.value == sorted(loads[-16:])[8] > 0.0  # the median of the window
    assert {store.prepare_s for store in stores} == {issue.value}


def test_streamed_misses_order_the_copy_and_compute_streams(model_folder, cpu_run, monkeypatch):
    """A zero budget: decode misses copied into the shared streaming slots. The copy stream waits for the last
    launch that read the slots (the first wait is for an event never recorded: none), the compute stream for the
    copies, and the slots' release is recorded on the compute stream after each launch."""
    model, cp = open_on_standin(model_folder, 0.0, monkeypatch, device_working_bytes=1 << 30)
    streams = []
    real = CudaSlots.stream

    def spy(self, streaming, experts):
        streams.append((len(cp.log), list(experts)))
        return real(self, streaming, experts)

    monkeypatch.setattr(CudaSlots, "stream", spy)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    group = model.offload.streaming.groups[0]
    assert isinstance(group, CudaStreamingSlots) and group.num_slots == SPEC.top_k
    assert model.offload.device.memory.by_purpose["decode streaming slots"] == SPEC.top_k * group.slot_bytes
    assert streams and sum(len(e) for _, e in streams) == model.offload.stats.totals().miss_copies
    first_at = streams[0][0]
    assert cp.log[first_at] == ("wait", "copy", None)
    for at, _ in streams[1:]:
        assert cp.log[at] == ("wait", "copy", "compute")
    for at, _ in streams:
        # the copies (memmoves, not logged), the copy stream's event, the compute stream's wait for it, then the
        # launch's start and stop and the slots' release
        assert cp.log[at + 1:at + 6] == [("record", "copy"), ("wait", "compute", "copy"), ("record", "compute"),
                                         ("record", "compute"), ("record", "compute")]


def test_host_seconds_for_the_policy_leave_out_the_first_call_and_take_the_median():
    """What the miss policy weighs for the streaming slots' copies and launches: one slow first call (the pack
    kernel's loading, a graph's capture) or one pause of the host cannot make copying look dear for good."""
    recent = RecentHostSeconds()
    recent.add(5e-3)  # the first call
    assert recent.value == 0.0
    for seconds in (40e-6, 3e-3, 30e-6):
        recent.add(seconds)
    assert recent.value == 40e-6
    for _ in range(16):
        recent.add(50e-6)
    assert recent.value == 50e-6  # older figures leave the window


def test_streamed_launches_and_copies_are_timed_for_the_policy(model_folder, cpu_run, monkeypatch):
    model, _cp = open_on_standin(model_folder, 0.0, monkeypatch, device_working_bytes=1 << 30)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    group = model.offload.streaming.groups[0]
    assert group.issue._calls > 1 and group.prepare_s > 0.0
    assert group.launching._calls == group.issue._calls and group.launch_s > 0.0  # each streamed launch, merged


def test_slot_launches_are_timed_for_the_policy(model_folder, cpu_run, monkeypatch):
    """Each decode launch from a node's slots, with its merge, is timed for the miss policy (launch_s: what copies
    cost a step whose device part they alone make), pooled by expert size like the loads."""
    model, _cp = open_on_standin(model_folder, 0.5, monkeypatch)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    store = next(s for s in model.offload.stores if s is not None and s.num_slots)
    assert store._launching._calls > 1 and store.launch_s > 0.0
    assert store._launching is model.offload.device.slot_launch[store.expert_bytes]


def test_routed_launches_reuse_their_input_views_only_for_the_same_contiguous_arrays(model_folder, monkeypatch):
    """launch_routed's [T, H] / [T, E] views of the dense part's kept buffers are made once while the same arrays
    come back; a non-contiguous input is copied at every call (a view kept of a copy would go stale)."""
    model, cp = open_on_standin(model_folder, 1.0, monkeypatch)
    store = next(s for s in model.offload.stores if s is not None)
    x = _device(np.arange(2 * SPEC.hidden_size, dtype=np.float32).reshape(1, 2, SPEC.hidden_size))
    logits = _device(np.ones((1, 2, SPEC.num_experts), np.float32))
    first = store._routed_views(x, logits, None, 2)
    assert first[0].shape == (2, SPEC.hidden_size) and first[1].shape == (2, SPEC.num_experts) and first[2] is None
    assert all(a is b for a, b in zip(store._routed_views(x, logits, None, 2), first))
    assert store._routed_views(x.copy(), logits, None, 2)[0] is not first[0]  # another array: new views
    strided = _device(np.ones((2, SPEC.num_experts * 2), np.float32))[:, ::2]
    again = store._routed_views(x, strided, None, 2)
    strided[0, 0] = 7.0
    assert float(store._routed_views(x, strided, None, 2)[1][0, 0]) == 7.0 and float(again[1][0, 0]) == 1.0


def test_the_hosts_wait_for_the_routing_does_its_idle_work_a_piece_at_a_time():
    """PublishedRouting.wait with `idle` (under launch ahead: the earlier layers' accounts): a piece of work at a time
    while the flag is down, the flag checked after each; once `idle` has none left it is not asked again, and the host
    spins, then synchronises the launch's event."""
    from kernels.gpu.published import PublishedRouting

    published = PublishedRouting(FakeCupy(), 1, SPEC.top_k, 8, np.float16)
    published.launched = 1
    pieces = []

    def idle():
        pieces.append(len(pieces))
        if len(pieces) == 3:
            published.flag[0] = 1  # the routing arrives during the third piece
        return True

    assert published.wait(None, idle) > 0.0 and pieces == [0, 1, 2]
    assert published.wait(None, idle) == 0.0 and pieces == [0, 1, 2]  # there at once: no work, no wait
    published.launched, pieces = 2, []
    arrived = SimpleNamespace(synchronize=lambda: published.flag.__setitem__(0, 2))  # the launch's stop event
    published.wait(arrived, lambda: pieces.append(1) and False)  # (append returns None: no work)
    assert pieces == [1]


def test_under_launch_ahead_each_both_layer_is_launched_before_its_host_part(model_folder, cpu_run, monkeypatch):
    """engine.decoder.launch_ahead on the stand-in: every "both" layer is launched by launch_ahead and its host part
    done by the decoder (SplitStep.finish, queued: earlier layers' accounts taken while it waits for the routing). The
    stand-in's dense segments are not replayed, so each layer is finished before the next segment runs, with nothing
    behind its merge. The tokens are the all-CPU run's, as in the same decode without launch ahead before it,
    and every pair counted once, no account left after a step."""
    from engine import decoder
    from engine.offload.hybrid_node import HybridExpertNode, SplitStep

    model, _cp = open_on_standin(model_folder, 0.5, monkeypatch)
    engine = model.offload
    engine.set_decode_path("both")
    _steps, without = decode_on_device(model, cpu_run, "split_launches")
    finishes = []
    real_finish = SplitStep.finish

    def finish(step, ahead=False, queued=False):
        finishes.append((ahead, queued))
        return real_finish(step, ahead, queued)

    monkeypatch.setattr(SplitStep, "finish", finish)
    monkeypatch.setattr(decoder, "launch_ahead", True)
    monkeypatch.setattr(decoder, "host_part_worker", False)
    launched = []
    real_launch = HybridExpertNode.launch_ahead
    monkeypatch.setattr(HybridExpertNode, "launch_ahead",
                        lambda node, values: launched.append(node.layer) or real_launch(node, values))
    for store in engine.stores:
        store.gpu.split_launches = 0
    steps, ahead = decode_on_device(model, cpu_run, "split_launches")
    assert finishes == [(False, True)] * (steps * SPEC.layers) and len(launched) >= steps * SPEC.layers
    assert model.decoder.layers_ahead == 0 and model.decoder.steps_run_again == 0
    # every pair counted once (placement has moved experts since the first decode: the split differs)
    assert ahead.hits + ahead.misses == without.hits + without.misses
    assert ahead.misses == ahead.misses_cpu + ahead.misses_copied + ahead.misses_read and ahead.misses_cpu > 0
    assert not engine.deferred


# --- the bounded host cache and the copies to the device -----------------------------------------------------------

class CopyingGpuQMoE(FakeGpuQMoE):
    """FakeGpuQMoE with "device memory" of its own, as a GPU has: it computes from its copies of the experts put in
    it, and reads an expert's rows from the node's (mapped) tensors only to copy them: in pack_expert (GpuQMoE packs
    them on the host there), for the residents it is made with (a prefill wave's first upload) and, with the host
    tier, for every expert (the tier's fill). FakeGpuQMoE computes from the mapped file, mapping what it computes."""

    direct_uploads = 0  # upload_expert_device calls, all instances: copies straight from a page-locked mapping

    def __init__(self, spec, tensors, device=0, num_slots=None, resident=(), tier=None):
        self.source = {role: t for role, t in tensors.items() if t is not None}
        self.rows = {role: np.zeros(t.shape, t.dtype) for role, t in self.source.items()}
        count = next(iter(self.rows.values())).shape[0]  # a wave's tensors hold its experts alone
        super().__init__(CpuQMoE(dataclasses.replace(spec, num_experts=count), self.rows), [],
                         host_tier=tier is not None, tier=tier)
        if tier is not None:
            for role, t in self.source.items():
                self.rows[role][...] = t
        for slot, expert in enumerate(resident):
            self.upload_expert(expert, slot, packed=self.pack_expert(expert))

    def pack_expert(self, expert):
        return {"rows": {role: np.array(t[expert]) for role, t in self.source.items()}}

    def set_source(self, spec, tensors):
        self.source = {role: t for role, t in tensors.items() if t is not None}

    def upload_expert(self, expert, slot, stream=None, packed=None):
        super().upload_expert(expert, slot)
        for role, row in packed["rows"].items():
            self.rows[role][expert] = row

    def upload_expert_device(self, expert, slot, stream=None):
        """GpuQMoE.upload_expert_device: the stored rows copied over as they are (read here, as the DMA reads them)."""
        CopyingGpuQMoE.direct_uploads += 1
        self.upload_expert(expert, slot, packed=self.pack_expert(expert))


def _copying_make(slots: CudaSlots, count, resident, tensors=None):
    """_fake_make's CudaSlots._make with CopyingGpuQMoE."""
    tier = None
    if slots.host_tier and tensors is None:
        tier = SimpleNamespace(device_bytes=(max(1, count) + 1) * slots.expert_bytes,
                               host_bytes=slots.runner.info.spec.num_experts * slots.expert_bytes)
    return CopyingGpuQMoE(slots.runner.info.spec, slots.runner.tensors if tensors is None else tensors,
                          resident=resident, tier=tier)


@pytest.fixture(scope="module")
def paged_folder(tmp_path_factory):
    """Experts large enough to count their pages: 126 KB each, 2 MB a layer."""
    from engine.writer import WriterSpec, write_model

    return write_model(tmp_path_factory.mktemp("paged") / "m", WriterSpec(
        layers=3, num_experts=16, top_k=4, hidden_size=256, inter_size=256, seed=5, dense_accuracy_level=0))


@pytest.fixture(scope="module")
def paged_cpu_run(paged_folder):
    return greedy_run(LoadedModel.open(paged_folder))


def open_copying(paged_folder, fraction, monkeypatch, ring=False, host_experts: int | None = 4, **config):
    """The model on the stand-in device with CopyingGpuQMoE's slots, through the pinned ring or not, under a host cache
    of `host_experts` experts' bytes (None: unbounded); its prompt's cold experts in prefill waves where they pay."""
    from engine.offload.cuda_device import CudaPinnedRing

    monkeypatch.setattr(FakeCudaDevice, "set_pinned_ring", lambda self, nbytes: setattr(
        self, "pinned", CudaPinnedRing(self.cp, nbytes) if ring and nbytes else None))
    per_expert = ModelFolder.open(paged_folder).experts[0].bytes_per_expert
    model, _cp = open_on_standin(paged_folder, fraction, monkeypatch, make=_copying_make, streaming=CopyingGpuQMoE,
                                 host_expert_bytes=None if host_experts is None else host_experts * per_expert,
                                 prefill_wave_experts=4, **config)
    assert (model.offload.device.pinned is not None) == ring
    return model


def copy_slowly(model, monkeypatch) -> list[tuple[str, int, int]]:
    """A CPU far slower than the copies from now on: every miss that can be is copied, the prompt's cold experts go in
    prefill waves. Returns the list that collects what is copied: ("load", layer, expert) of each copy into a slot or
    the streaming slots (_copy_in), ("wave", layer, expert) of each expert of a wave (stage)."""
    engine, copied = model.offload, []
    engine.device.bandwidths = dataclasses.replace(engine.device.bandwidths, cpu=1e3)
    copy_in, stage = CudaSlots._copy_in, CudaSlots.stage
    monkeypatch.setattr(CudaSlots, "_copy_in", lambda self, gpu, slot, expert: (
        copied.append(("load", engine.stores.index(self), expert)), copy_in(self, gpu, slot, expert))[1])
    monkeypatch.setattr(CudaSlots, "stage", lambda self, experts: (
        copied.extend(("wave", engine.stores.index(self), int(e)) for e in experts), stage(self, experts))[1])
    return copied


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="Linux's pagemap")
@pytest.mark.parametrize("ring", [False, True], ids=["no-ring", "pinned-ring"])
@pytest.mark.parametrize("fraction", [0.0, 0.5], ids=["streaming-slots", "spare-slots"])
def test_experts_copied_to_the_device_leave_the_host_cache_bounded(paged_folder, paged_cpu_run, monkeypatch, ring,
                                                                    fraction):
    """host_expert_bytes bounded the weight file's pages mapped for the experts the CPU computes, but the pages an
    expert's copy to the device read (packed on the host, into the pinned ring or not; a prefill wave's rows), and
    their neighbours that the reads mapped, stayed: every expert ever copied, the whole file (6.0 MB) here against a
    cache of 0.5 MB. Once read, those the cache does not hold leave; those it holds stay."""
    model = open_copying(paged_folder, fraction, monkeypatch, ring, device_working_bytes=1 << 30)
    engine = model.offload
    assert_same_as_cpu(greedy_run(model), paged_cpu_run)  # the CPU's share of the misses fills the cache
    assert engine.host_cache.evictions > 0
    copied, before = copy_slowly(model, monkeypatch), engine.stats.totals().miss_copies
    assert_same_as_cpu(greedy_run(model), paged_cpu_run)
    assert engine.stats.totals().miss_copies > before and {kind for kind, *_ in copied} == {"load", "wave"}
    assert_mapped_as_the_cache_holds(model)


@pytest.mark.parametrize("ring, fraction", [(False, 0.0), (True, 0.5)], ids=["streaming-no-ring", "slots-pinned-ring"])
def test_every_copy_read_from_the_file_is_told_to_the_host_cache(paged_folder, monkeypatch, ring, fraction):
    """Each expert a copy read from the mapped file, whichever way it went, is told to the host cache by its layer."""
    model = open_copying(paged_folder, fraction, monkeypatch, ring, device_working_bytes=1 << 30)
    told = []
    for layer, store in enumerate(model.offload.stores):
        store.after_file_read = lambda experts, layer=layer, release=store.after_file_read: (
            told.extend((layer, int(e)) for e in experts), release(experts))
    copied = copy_slowly(model, monkeypatch)
    greedy_run(model)
    assert {kind for kind, *_ in copied} == {"load", "wave"}
    assert {(layer, expert) for _kind, layer, expert in copied} == set(told)


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="Linux's pagemap")
def test_a_host_tier_filled_from_the_file_leaves_the_host_cache_bounded(paged_folder, paged_cpu_run, monkeypatch):
    """The host tier's fill reads every expert from the mapped file: those the cache does not hold leave."""
    model = open_copying(paged_folder, 0.5, monkeypatch)
    engine = model.offload
    assert_same_as_cpu(greedy_run(model), paged_cpu_run)
    engine.set_decode_path("tier")
    assert all(store.host_tier and store.gpu.tier is not None for store in engine.stores)
    assert_mapped_as_the_cache_holds(model)
    assert_same_as_cpu(greedy_run(model), paged_cpu_run)  # decode from the tier's copies
    assert_mapped_as_the_cache_holds(model)


# --- a bound set on a loaded model whose experts' mapping is page-locked -------------------------------------------

def register_on_standin(monkeypatch, runtime: FakeRuntime) -> None:
    """FakeCudaDevice page-locks the experts' mapping after load as CudaDevice does (host_register.py), through
    `runtime`'s cudaHostRegister."""
    def register_experts(self, source, infos, owner):
        self.cp.cuda.runtime.hostRegister = runtime.hostRegister
        self.cp.cuda.runtime.hostUnregister = runtime.hostUnregister
        return cuda_device.CudaDevice.register_experts(self, source, infos, owner)

    monkeypatch.setattr(FakeCudaDevice, "register_experts", register_experts, raising=False)
    monkeypatch.setattr(FakeCudaDevice, "unregister_experts", cuda_device.CudaDevice.unregister_experts, raising=False)


def bounded_to_four_experts(model) -> OffloadConfig:
    engine = model.offload
    return engine.config.updated(host_expert_bytes=4 * engine.infos[0].bytes_per_expert)


def assert_copies_bounded_through_the_host(model, cpu_run, monkeypatch) -> None:
    """No copy goes straight from the mapping any more; the CPU's share of the misses fills the cache, then copies
    of every miss that can be copied leave the mapped pages those the cache holds."""
    engine, uploads = model.offload, CopyingGpuQMoE.direct_uploads
    assert engine.device.host_registration is None and not any(store._direct() for store in engine.stores)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    copied = copy_slowly(model, monkeypatch)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert copied and CopyingGpuQMoE.direct_uploads == uploads
    assert_mapped_as_the_cache_holds(model)


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="Linux's pagemap")
def test_a_bound_set_on_the_loaded_model_undoes_the_page_locked_mapping(paged_folder, paged_cpu_run, monkeypatch):
    """Loaded with host memory unbounded, the experts' mapping was page-locked and copies went straight from it.
    host_expert_bytes bounded on the loaded model then left it locked: the cache's madvise cannot release locked pages,
    and the direct copies released none, so the bound did not hold. The bound undoes the registration first: every
    region unregistered, copies packed on the host into the pinned ring again, the mapped pages those the cache
    holds; the landed statement says the mapping is no longer page-locked."""
    runtime = FakeRuntime()
    register_on_standin(monkeypatch, runtime)
    monkeypatch.setattr(CopyingGpuQMoE, "direct_uploads", 0)
    model = open_copying(paged_folder, 0.5, monkeypatch, ring=True, host_experts=None, device_working_bytes=1 << 30)
    registration, bandwidths = model.host_registration, model.offload.device.bandwidths
    assert registration.ready.wait(10) and registration.registered
    registered = list(runtime.registered)
    copy_slowly(model, monkeypatch)
    assert_same_as_cpu(greedy_run(model), paged_cpu_run)
    assert CopyingGpuQMoE.direct_uploads > 0
    model.offload.device.bandwidths = bandwidths  # the CPU computes its share of the misses again
    model.offload.reconfigure(bounded_to_four_experts(model))
    assert runtime.registered == {} and sorted(runtime.unregistered) == sorted(registered)
    assert not registration.registered and "no longer page-locked" in registration.describe()
    copies = model.offload.device.pinned.copies
    assert_copies_bounded_through_the_host(model, paged_cpu_run, monkeypatch)
    assert model.offload.device.pinned.copies > copies


def test_file_backing_turned_off_on_the_loaded_model_undoes_the_page_locked_mapping(paged_folder, paged_cpu_run,
                                                                                     monkeypatch):
    """allow_file_backing=0 on a model loaded with the experts' mapping page-locked: the experts are copied into RAM,
    and the file's pages would have stayed locked beside them (the experts twice in RAM), the copies still going
    straight from the mapping. The registration is undone; copies are packed from the RAM copy; answers unchanged."""
    runtime = FakeRuntime()
    register_on_standin(monkeypatch, runtime)
    monkeypatch.setattr(CopyingGpuQMoE, "direct_uploads", 0)
    model = open_copying(paged_folder, 0.5, monkeypatch, ring=True, host_experts=None, device_working_bytes=1 << 30)
    registration = model.host_registration
    assert registration.ready.wait(10) and registration.registered
    registered = list(runtime.registered)
    model.offload.reconfigure(model.offload.config.updated(allow_file_backing=False))
    assert runtime.registered == {} and sorted(runtime.unregistered) == sorted(registered)
    assert "allow_file_backing=0" in registration.describe() and "no longer page-locked" in registration.describe()
    assert model.offload.device.host_registration is None and not any(store._direct() for store in model.offload.stores)
    uploads, copied = CopyingGpuQMoE.direct_uploads, copy_slowly(model, monkeypatch)
    assert_same_as_cpu(greedy_run(model), paged_cpu_run)
    assert copied and CopyingGpuQMoE.direct_uploads == uploads


def test_every_expert_made_resident_on_the_loaded_model_undoes_the_page_locked_mapping(paged_folder, paged_cpu_run,
                                                                                       monkeypatch):
    """A budget that makes every expert resident on a model loaded hybrid: nothing reads the experts' mapping any
    more, and its pages stayed locked in RAM (the whole experts' file, held from the rest of the machine). The
    registration is undone and the prefault stops; the answers are unchanged. Back to hybrid, both start again and
    copies go straight from the mapping once it is page-locked (they went through the pinned ring until a reload: a
    2,048-token prefill at 25% took 2.3x as long on the H100 machine). A host bound or file backing off ends both
    too, until the configuration has neither."""
    from engine.offload.planner import all_resident_bytes

    runtime = FakeRuntime()
    register_on_standin(monkeypatch, runtime)
    monkeypatch.setattr(CopyingGpuQMoE, "direct_uploads", 0)
    model = open_copying(paged_folder, 0.5, monkeypatch, ring=True, host_experts=None, device_working_bytes=1 << 30)
    registration, engine = model.host_registration, model.offload
    assert registration.ready.wait(10) and registration.registered and model.prefault is not None
    registered, hybrid = list(runtime.registered), engine.config
    engine.reconfigure(hybrid.updated(device_expert_bytes=2 * all_resident_bytes(engine.infos)))
    assert engine.plan.placement_mode == "all_resident"
    assert runtime.registered == {} and sorted(runtime.unregistered) == sorted(registered)
    assert "every expert is now resident" in registration.describe() and "no longer page-locked" in registration.describe()
    assert engine.prefault is None and engine.device.host_registration is None
    assert_same_as_cpu(greedy_run(model), paged_cpu_run)
    assert engine.stats.totals().misses == 0
    engine.reconfigure(hybrid)
    again = model.host_registration
    assert again is not registration and again is engine.device.host_registration
    assert again.ready.wait(10) and again.registered and sorted(runtime.registered) == sorted(registered)
    assert engine.prefault is model.prefault and model.prefault is not None
    assert model.prefault.done.wait(10) and model.prefault.populated_bytes > 0
    uploads, copied = CopyingGpuQMoE.direct_uploads, copy_slowly(model, monkeypatch)
    assert_same_as_cpu(greedy_run(model), paged_cpu_run)
    assert copied and CopyingGpuQMoE.direct_uploads > uploads
    engine.reconfigure(hybrid.updated(host_expert_bytes=4 * engine.infos[0].bytes_per_expert))
    assert runtime.registered == {} and engine.prefault is None
    engine.reconfigure(hybrid.updated(allow_file_backing=False))  # still no mapping to lock: the experts go to RAM
    assert runtime.registered == {} and engine.prefault is None and engine.device.host_registration is None
    engine.reconfigure(hybrid)  # the bound lifted: as a model loaded bounded and unbounded later, both start again
    after = model.host_registration
    assert after is engine.device.host_registration and after.ready.wait(10) and after.registered
    assert sorted(runtime.registered) == sorted(registered)
    assert engine.prefault is model.prefault and model.prefault is not None and model.prefault.done.wait(10)
    uploads, copied = CopyingGpuQMoE.direct_uploads, copy_slowly(model, monkeypatch)
    assert_same_as_cpu(greedy_run(model), paged_cpu_run)
    assert copied and CopyingGpuQMoE.direct_uploads > uploads


def test_a_model_loaded_with_every_expert_resident_page_locks_its_mapping_once_fewer_are(paged_folder, paged_cpu_run,
                                                                                          monkeypatch):
    """Loaded with room for every expert, nothing reads the experts' file, so load neither maps its pages in nor
    page-locks them; a smaller budget on the loaded model starts both, and copies then go straight from the mapping."""
    from engine.offload.planner import all_resident_bytes

    runtime = FakeRuntime()
    register_on_standin(monkeypatch, runtime)
    monkeypatch.setattr(CopyingGpuQMoE, "direct_uploads", 0)
    model = open_copying(paged_folder, 2.0, monkeypatch, ring=True, host_experts=None, device_working_bytes=1 << 30)
    engine = model.offload
    assert engine.plan.placement_mode == "all_resident"
    assert model.prefault is None and model.host_registration is None and runtime.registered == {}
    engine.reconfigure(engine.config.updated(device_expert_bytes=all_resident_bytes(engine.infos) // 2))
    registration = model.host_registration
    assert registration is not None and registration.ready.wait(10) and registration.registered
    assert engine.prefault is model.prefault and model.prefault is not None
    uploads, copied = CopyingGpuQMoE.direct_uploads, copy_slowly(model, monkeypatch)
    assert_same_as_cpu(greedy_run(model), paged_cpu_run)
    assert copied and CopyingGpuQMoE.direct_uploads > uploads


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="Linux's pagemap")
def test_a_bound_set_while_the_mapping_is_being_page_locked_waits_and_undoes_it(paged_folder, paged_cpu_run,
                                                                              monkeypatch):
    """The bound arrives while load's background work still runs: the registration thread inside a region's
    cudaHostRegister (seconds for a large model), the prefault inside a call mapping pages in. The re-plan waits for
    both calls to return; then no region is registered, the prefault maps nothing more, and copies leave the mapped
    pages those the cache holds."""
    from engine.onnx_file import OnnxFile

    gate = threading.Event()
    runtime = FakeRuntime(gate=gate)
    register_on_standin(monkeypatch, runtime)
    populate = OnnxFile.populate_pages

    def populate_when_let(self, *args):
        gate.wait()
        return populate(self, *args)

    monkeypatch.setattr(OnnxFile, "populate_pages", populate_when_let)
    model = open_copying(paged_folder, 0.5, monkeypatch, host_experts=None, device_working_bytes=1 << 30)
    registration, prefault = model.host_registration, model.prefault
    assert not registration.ready.is_set() and not prefault.done.is_set() and len(prefault.ranges) > 1
    with ThreadPoolExecutor(1) as pool:
        try:
            replan = pool.submit(model.offload.reconfigure, bounded_to_four_experts(model))
            assert not wait([replan], timeout=0.5).done  # waiting for the calls in progress
        finally:
            gate.set()
        replan.result(timeout=30)
    assert registration.ready.is_set() and not registration.registered
    assert len(runtime.unregistered) == 1 and runtime.registered == {}  # the region in progress, undone by its thread
    assert prefault.done.is_set() and prefault.populated_bytes == prefault.ranges[0][2]  # the call in progress alone
    assert_copies_bounded_through_the_host(model, paged_cpu_run, monkeypatch)


def test_back_from_every_expert_resident_the_mapping_is_page_locked_within_what_the_host_tier_leaves(
        paged_folder, monkeypatch):
    """Load makes the host tier first, then page-locks the experts' mapping only where at most 80% of the memory the
    tier leaves holds it (host_register.py). Back from every expert resident, the re-plan page-locked the mapping
    before it made the tier, against the memory the tier was about to take: on a host with room for one of them, the
    tier was then refused (decode had no tier to try) and the mapping locked, where load did the opposite; with
    more memory, both locked together more than either check allows. The re-plan does what load does."""
    import engine.offload.host_register as host_register
    from engine.offload import decode_path
    from engine.offload.engine import OffloadEngine
    from engine.offload.planner import all_resident_bytes

    folder = ModelFolder.open(paged_folder)
    tier = decode_path.tier_bytes(folder.experts)
    mapped = sum(size for _, _, size in host_register.mapping_regions(folder.onnx, folder.experts))
    low, high = max(2 * tier, mapped / host_register.AVAILABLE_SHARE), mapped / host_register.AVAILABLE_SHARE + tier
    assert low < high  # room for the tier, then too little for the mapping beside it; for the mapping alone
    runtime = FakeRuntime()
    register_on_standin(monkeypatch, runtime)
    tier_made = [False]
    make_stores = OffloadEngine._make_stores

    def tracked(self, host_tier):
        make_stores(self, host_tier)
        tier_made[0] = host_tier

    def available() -> int:  # a host whose free memory the tier and the registered mapping take
        locked = sum(size for size, _flags in runtime.registered.values())
        return int((low + high) / 2) - locked - (tier if tier_made[0] else 0)

    monkeypatch.setattr(OffloadEngine, "_make_stores", tracked)
    monkeypatch.setattr(decode_path, "host_available", available)
    monkeypatch.setattr(host_register, "psutil", SimpleNamespace(
        virtual_memory=lambda: SimpleNamespace(available=available())))
    monkeypatch.setenv("MOE_DECODE_PATH", "auto")  # the tier made, the trials choose the path: the defaults
    model = open_copying(paged_folder, 0.5, monkeypatch, host_experts=None, device_working_bytes=1 << 30)
    engine = model.offload
    assert model.host_registration.ready.wait(10)
    at_load = (engine.host_tier, model.host_registration.registered)
    assert at_load == (True, False) and "exceed 80% of the memory" in model.host_registration.reason
    hybrid = engine.config
    engine.reconfigure(hybrid.updated(device_expert_bytes=2 * all_resident_bytes(engine.infos)))
    assert engine.plan.placement_mode == "all_resident" and not engine.host_tier
    engine.reconfigure(hybrid)
    again = model.host_registration
    assert again.ready.wait(10)
    assert (engine.host_tier, again.registered) == at_load and "exceed 80% of the memory" in again.reason
    assert runtime.registered == {}
