"""A decode step's kept pinned / device buffers (engine/offload/cuda_step.py) on a stand-in for CuPy whose
"device" memory is host memory and whose asynchronous copies are memmove: the layout of the one copy in, the
copy back, and the pool's reuse. The CUDA side runs in tests/test_offload_cuda.py (marker gpu)."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from engine.offload.cuda_step import (D2H, H2D, HostCopies, MergeBufferPool, RoutedBuffers, StepBufferPool,
                                      StepBuffers)


class FakeDeviceArray(np.ndarray):
    @property
    def data(self):
        return SimpleNamespace(ptr=self.ctypes.data)


class FakeCupy:
    float32, int32, uint8 = np.float32, np.int32, np.uint8
    ndarray = FakeDeviceArray
    copies: list = []

    class cuda:
        @staticmethod
        def alloc_pinned_memory(nbytes):
            return bytearray(nbytes)

        class Event:
            pass

        class runtime:
            @staticmethod
            def memcpyAsync(dst, src, size, kind, stream):
                FakeCupy.copies.append((kind, size, stream))
                ctypes.memmove(dst, src, size)

    @staticmethod
    def empty(shape, dtype):
        return np.zeros(shape, dtype).view(FakeDeviceArray)

    @staticmethod
    def ascontiguousarray(array):
        return np.ascontiguousarray(array).view(FakeDeviceArray)

    add, copyto = staticmethod(np.add), staticmethod(np.copyto)


class Stream:
    ptr = 77
    synchronized = 0

    def synchronize(self):
        self.synchronized += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_one_copy_carries_activations_ids_and_weights():
    FakeCupy.copies.clear()
    rng = np.random.default_rng(0)
    buffers = StepBuffers(FakeCupy, tokens=2, hidden=100, k=3)
    x = rng.standard_normal((2, 100)).astype(np.float16)  # fp16 activations go over as float32
    ids = np.array([[5, -1, 7], [0, 2, 127]], np.int64)
    weights = rng.random((2, 3)).astype(np.float32)
    buffers.upload(x, ids, weights, Stream())
    assert FakeCupy.copies == [(H2D, buffers.nbytes, Stream.ptr)]
    assert np.array_equal(np.asarray(buffers.x), x.astype(np.float32)) and buffers.x.dtype == np.float32
    assert np.array_equal(np.asarray(buffers.ids), ids) and buffers.ids.dtype == np.int32
    assert np.array_equal(np.asarray(buffers.w), weights)
    for view in (buffers.x, buffers.ids, buffers.w):  # views of the one device buffer, aligned
        assert np.shares_memory(view, buffers.device) and (view.ctypes.data - buffers.device.ctypes.data) % 256 == 0


def test_the_output_comes_back_through_pinned_memory():
    FakeCupy.copies.clear()
    buffers = StepBuffers(FakeCupy, tokens=1, hidden=64, k=2)
    buffers.out[:] = np.arange(64, dtype=np.float32)
    stream = Stream()
    result = buffers.download(stream)
    assert result.shape == (1, 64) and np.array_equal(result[0], np.arange(64, dtype=np.float32))
    assert not np.shares_memory(result, buffers.out)
    assert FakeCupy.copies == [(D2H, 64 * 4, Stream.ptr)] and stream.synchronized == 1


def test_the_pool_reuses_buffers_once_given_back():
    pool = StepBufferPool(FakeCupy, hidden=32)
    first = pool.take(1, 8)
    second = pool.take(1, 8)  # two launches in flight in one step: two sets
    assert first is not second
    pool.give_back(first)
    assert pool.take(1, 8) is first and pool.take(2, 8) is not second


def test_device_arrays_come_to_the_host_in_one_wait():
    FakeCupy.copies.clear()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 1, 48)).astype(np.float16).view(FakeDeviceArray)
    logits = rng.standard_normal((1, 16)).astype(np.float32).view(FakeDeviceArray)
    on_host = rng.standard_normal((1, 16)).astype(np.float32)  # not in device memory: passed as it is
    copies, stream = HostCopies(FakeCupy), Stream()
    got = copies.fetch([x, logits, on_host, None], stream)
    assert got[2] is on_host and got[3] is None
    for host, device in zip(got[:2], (x, logits)):
        assert type(host) is np.ndarray and host.dtype == device.dtype and np.array_equal(host, device)
        assert not np.shares_memory(host, device)
    assert FakeCupy.copies == [(D2H, x.nbytes, Stream.ptr), (D2H, logits.nbytes, Stream.ptr)]
    assert stream.synchronized == 1
    again = copies.fetch([logits], stream)  # the kept pinned buffer, from its start again
    assert again[0].ctypes.data == got[0].ctypes.data and np.array_equal(again[0], logits)


def test_routed_buffers_keep_a_result_in_the_dense_dtype_and_copy_the_routed_ids_over():
    FakeCupy.copies.clear()
    half = RoutedBuffers(FakeCupy, 1, 32, np.float16, 4)
    assert half.out32.dtype == np.float32 and half.out.dtype == np.float16 and half.out.shape == (1, 32)
    assert half.ids.dtype == np.int32 and half.ids.shape == (1, 4)
    single = RoutedBuffers(FakeCupy, 1, 32, np.float32, 4)
    assert single.out is single.out32  # float32 activations: no conversion
    half.ids[...] = [[7, 2, 9, 0]]  # what the launch wrote
    half.copy_ids(Stream())
    assert half.host_ids.tolist() == [[7, 2, 9, 0]] and half.host_ids.dtype == np.int32
    assert FakeCupy.copies == [(D2H, 16, Stream.ptr)]
    assert half.key == RoutedBuffers.key_of(1, np.float16) != RoutedBuffers.key_of(2, np.float16)
    assert half.key != RoutedBuffers.key_of(1, np.float32)
    view = half.result((1, 1, 32))  # the node's output shape: the same view at every step
    assert view.shape == (1, 1, 32) and np.shares_memory(view, half.out) and half.result((1, 1, 32)) is view


def _merge_sum(a, b, out):
    """GpuQMoE.merge_sum's arithmetic (its kernel runs in the gpu test below): float32 sum, one rounding."""
    np.copyto(out, a if b is None else a + b, casting="same_kind")


def test_a_merged_result_adds_the_cpus_part_to_the_devices_in_the_dense_dtype():
    FakeCupy.copies.clear()
    rng = np.random.default_rng(2)
    pool = MergeBufferPool(FakeCupy, 24)
    merge = pool.take(1, np.float16)
    assert pool.take(1, np.float16) is merge and pool.take(1, np.float32) is not merge
    cpu_part = rng.standard_normal((1, 24)).astype(np.float32)
    device_part = rng.standard_normal((1, 24)).astype(np.float32)
    merge.upload(cpu_part, Stream(), to_sum=False)
    assert FakeCupy.copies == [(H2D, cpu_part.nbytes, Stream.ptr)]
    merge.combine(device_part.copy().view(FakeDeviceArray), True, _merge_sum)
    view = merge.result((1, 1, 24))
    assert view.dtype == np.float16 and view.shape == (1, 1, 24) and merge.result((1, 1, 24)) is view
    assert np.array_equal(view.reshape(1, 24), (cpu_part + device_part).astype(np.float16))
    merge.combine(device_part.copy().view(FakeDeviceArray), False, _merge_sum)  # no CPU part this step
    assert np.array_equal(view.reshape(1, 24), device_part.astype(np.float16))
    # nothing on the device (no resident expert routed): converted on the host, copied straight into the sum, and
    # no kernel (combine is given none to call)
    FakeCupy.copies.clear()
    merge.upload(cpu_part, Stream(), to_sum=True)
    assert FakeCupy.copies == [(H2D, cpu_part.size * 2, Stream.ptr)]
    merge.combine(None, True, None)
    assert np.array_equal(view.reshape(1, 24), cpu_part.astype(np.float16))
    merge.combine(None, False, None)
    assert not view.any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_merge_sum_adds_and_converts_as_numpy_does(dtype):
    """GpuQMoE.merge_sum (source/merge.cu) against NumPy's float32 sum and one rounding, with and without the CPU's
    part, at a size that is no multiple of the block."""
    cp = pytest.importorskip("cupy")
    from kernels.gpu import GpuQMoE
    from kernels.qmoe_spec import QMoESpec
    from tests.qmoe_oracle import make_case

    attrs, t, x, _ = make_case(seed=5, E=4, H=64, I=32, k=2, bits=4, block_size=32, T=1, activation="swiglu",
                               swiglu_fusion=1)
    gpu = GpuQMoE(QMoESpec.from_tensors("test/QMoE", "QMoE", attrs, t, x.shape), t, num_slots=1, resident=[0])
    rng = np.random.default_rng(6)
    a, b = (rng.standard_normal((3, 2881)).astype(np.float32) * 300 for _ in range(2))
    out = cp.full(a.shape, 7, dtype)
    gpu.merge_sum(cp.asarray(a), cp.asarray(b), out)
    assert np.array_equal(out.get(), (a + b).astype(dtype))
    gpu.merge_sum(cp.asarray(b), None, out)
    assert np.array_equal(out.get(), b.astype(dtype))
    # on a stream of its own (the engine's compute stream) the launch is prepared once per buffers and goes to the
    # driver; new values in the same buffers are summed at every call
    a_dev, b_dev = cp.asarray(a), cp.asarray(b)
    with cp.cuda.Stream(non_blocking=True) as stream:
        for scale in (1.0, -0.5):
            a_dev.set(a * scale, stream=stream)
            gpu.merge_sum(a_dev, b_dev, out)
            stream.synchronize()
            assert np.array_equal(out.get(), (a * np.float32(scale) + b).astype(dtype))
        gpu.merge_sum(b_dev, None, out)
        stream.synchronize()
        assert np.array_equal(out.get(), b.astype(dtype))
    assert len(gpu._merge_launches) == 2  # (a, b) and (b alone): prepared once each


@pytest.mark.gpu
def test_staged_launches_replayed_as_a_graph_follow_new_inputs_swaps_and_workspace_growth():
    """GpuQMoE.run_staged: eager at the first call with given buffers, a CUDA graph from the second on. The
    replays must see each step's new inputs written into the same buffers, experts swapped into slots in place,
    and a workspace that grew in between (its graphs are dropped)."""
    cp = pytest.importorskip("cupy")
    from kernels.gpu import GpuQMoE
    from kernels.qmoe_spec import QMoESpec
    from tests.qmoe_oracle import make_case
    from tests.test_qmoe_gpu import _ref_pairs, _relerr

    attrs, t, x, _ = make_case(seed=31, E=8, H=128, I=64, k=2, bits=4, block_size=32, T=2, activation="swiglu",
                               swiglu_fusion=1)
    spec = QMoESpec.from_tensors("test/QMoE", "QMoE", attrs, t, x.shape)
    m = GpuQMoE(spec, t, num_slots=4, resident=[0, 1, 2, 3])
    stream = cp.cuda.Stream(non_blocking=True)
    pool = StepBufferPool(cp, spec.hidden_size)
    rng = np.random.default_rng(32)
    with stream:
        for step in range(6):
            if step == 3:
                m.upload_expert(6, 1, stream=stream)  # expert 1 out, 6 in: the slot map changes in place
            if step == 4:  # a larger launch grows the workspace: the graphs pointing into it are dropped
                m.run_experts(rng.standard_normal((40, 128)).astype(np.float32),
                              rng.integers(0, 8, (40, 2)), np.ones((40, 2), np.float32))
            xs = rng.standard_normal((2, 128)).astype(np.float32)
            ids = rng.integers(0, 8, (2, 2))
            ids[:, 1] = (ids[:, 0] + 1 + rng.integers(0, 7, 2)) % 8  # two different experts per token, as routed
            w = rng.uniform(0.1, 1, (2, 2)).astype(np.float32)
            buffers = pool.take(2, 2)
            buffers.upload(xs, ids, w, stream)
            m.run_staged(buffers.x, buffers.ids, buffers.w, buffers.out)
            got = buffers.download(stream).copy()
            pool.give_back(buffers)
            resident = m.slot_of[ids] >= 0
            want = _ref_pairs(xs, np.where(resident, ids, -1), w, spec, t)
            assert _relerr(got, want) <= 1e-4, f"step {step}"
            assert (len(m._graphs) == 1) == (step in (1, 2, 3, 5)), f"step {step}: {len(m._graphs)} graphs"


def test_routed_launches_with_the_very_same_arrays_go_straight_to_their_graph(monkeypatch):
    """GpuQMoE.run_routed's fast path, its control flow on a stand-in (what the graph computes: the GPU tests below).
    Once a call has been replayed as a graph, a call with the very same arrays, stream and decode configuration
    launches that graph without making its key; other arrays, another configuration, or inputs the kernels would
    read through a converted copy go through _replayed again, as every call does with the switch off."""
    from kernels.gpu import qmoe

    stream, graph, keys, launched = Stream(), SimpleNamespace(), [], []
    graph.launch = lambda on: launched.append(on.ptr)
    cuda = SimpleNamespace(get_current_stream=lambda: stream, runtime=SimpleNamespace(getDevice=lambda: 0))
    monkeypatch.setattr(qmoe, "_cp", lambda: SimpleNamespace(ndarray=FakeDeviceArray, cuda=cuda))
    m = qmoe.GpuQMoE.__new__(qmoe.GpuQMoE)  # the attributes run_routed reads, no module or buffers
    m.path, m.decode_max_tokens, m.decode_kernel, m.dec_cfg, m.dec5_cfg = "tc", 8, "v5", {"rank_route": 1}, {}
    m._device_id, m._routed_replay, m.routed_fast_calls, m.fast_routed = 0, None, 0, True

    def replayed(key, tokens, launch):  # GpuQMoE._replayed: eager at a key's first call, a graph from its second
        keys.append(key + (tuple(m.dec_cfg.items()),))  # (its key holds the decode configuration too)
        return graph if keys.count(keys[-1]) > 1 else None

    m._replayed = replayed
    x, logits, out32 = (FakeCupy.empty(shape, dtype) for shape, dtype in
                        (((1, 8), np.float16), ((1, 4), np.float16), ((1, 8), np.float32)))
    ids = FakeCupy.empty((1, 2), np.int32)

    def call(*arrays, ids_out=ids):
        assert m.run_routed(*arrays, ids_out=ids_out) is out32
        return len(keys), m.routed_fast_calls

    assert [call(x, logits, out32) for _ in range(4)] == [(1, 0), (2, 0), (2, 1), (2, 2)]
    assert launched == [Stream.ptr] * 2  # the graph itself, launched on the current stream
    m.dec_cfg["rank_route"] = 0  # another decode configuration: the key again (a graph of its own)
    assert [call(x, logits, out32) for _ in range(3)] == [(3, 2), (4, 2), (4, 3)]
    assert call(x, logits, out32, ids_out=FakeCupy.empty((1, 2), np.int32)) == (5, 3)  # another array
    # logits the kernels read through a converted copy (not contiguous): never straight to the graph
    strided = FakeCupy.empty((1, 8), np.float16)[:, ::2]
    assert [call(x, strided, out32) for _ in range(3)] == [(6, 3), (7, 3), (8, 3)]
    m.fast_routed = False  # bench_offload_ab's gpu.fast_routed=0: every call through the key
    assert [call(x, logits, out32) for _ in range(2)] == [(9, 3), (10, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_routed_launches_replayed_as_a_graph_match_the_reference(dtype):
    """GpuQMoE.run_routed (a fully resident layer: routing on the GPU, the result converted to the input's dtype):
    eager at the first call, a CUDA graph from the second; each step's new inputs written into the same buffers."""
    cp = pytest.importorskip("cupy")
    from kernels.gpu import GpuQMoE
    from kernels.qmoe_spec import QMoESpec
    from kernels.reference import qmoe_reference
    from tests.qmoe_oracle import make_case
    from tests.test_qmoe_gpu import _relerr

    attrs, t, x, _ = make_case(seed=33, E=8, H=128, I=64, k=2, bits=4, block_size=32, T=1, activation="swiglu",
                               swiglu_fusion=1)
    spec = QMoESpec.from_tensors("test/QMoE", "QMoE", attrs, t, x.shape)
    m = GpuQMoE(spec, t)  # every expert resident
    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(34)
    x_dev = cp.empty((1, 128), dtype)
    logits_dev = cp.empty((1, 8), dtype)
    out32 = cp.empty((1, 128), cp.float32)
    out = out32 if dtype == "float32" else cp.empty((1, 128), dtype)
    with stream:
        for step in range(4):
            xs = rng.standard_normal((1, 128)).astype(dtype)
            logits = rng.standard_normal((1, 8)).astype(dtype)
            x_dev.set(xs, stream=stream)
            logits_dev.set(logits, stream=stream)
            result = m.run_routed(x_dev, logits_dev, out32, out)
            assert result is out
            got = result.get(stream=stream).astype(np.float32)
            want = qmoe_reference(xs.astype(np.float32), logits.astype(np.float32), spec, t)
            assert _relerr(got, want) <= (1e-4 if dtype == "float32" else 2e-3), f"step {step}"
            # fp16 activations: the fp16 decode kernels (dec5h), recorded at the eager call and the capture
            assert m.last_decode_kernels[0].startswith("dec5h_" if dtype == "float16" else "dec5_")
            assert (len(m._graphs) == 1) == (step >= 1), f"step {step}: {len(m._graphs)} graphs"
            # from the third call on, the same arrays go straight to the graph (no key)
            assert m.routed_fast_calls == max(0, step - 1), f"step {step}"


@pytest.mark.gpu
@pytest.mark.parametrize("E,k,T,sparse_mixer", [
    (8, 2, 1, False),  # decode, routing by ranks
    (128, 8, 8, False),  # decode, routing by ranks at its limit (T k = 64)
    (64, 16, 8, False),  # decode, a warp per token (T k > 64) and the block's grouping
    (32, 4, 300, False),  # prefill (prefill_prep)
    (8, 2, 3, True),  # sparse mixer: routed on the host
])
def test_routed_launches_write_their_routing_to_ids_out(E, k, T, sparse_mixer):
    """run_routed's ids_out, which the offload engine's statistics of a fully resident layer read instead of routing
    the logits again on the host: each token's top-k experts in rank order, as the reference routes them, from every
    routing the launch may take; the result as without ids_out. Decode's later calls replay its CUDA graph."""
    cp = pytest.importorskip("cupy")
    from kernels.gpu import GpuQMoE
    from kernels.qmoe_spec import QMoESpec
    from kernels.reference import qmoe_reference, route
    from tests.qmoe_oracle import make_case
    from tests.test_qmoe_gpu import _relerr

    attrs, t, x, logits = make_case(seed=35 + E + T, E=E, H=64, I=32, k=k, bits=4, block_size=32, T=T,
                                    activation="swiglu", swiglu_fusion=1, sparse_mixer=sparse_mixer)
    spec = QMoESpec.from_tensors("test/QMoE", "QMoE", attrs, t, x.shape)
    m = GpuQMoE(spec, t)  # every expert resident
    want_ids, _ = route(logits, spec)
    want = qmoe_reference(x, logits, spec, t)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        x_dev, logits_dev = cp.asarray(x), cp.asarray(logits)
        out32, ids_out = cp.empty((T, 64), cp.float32), cp.empty((T, k), cp.int32)
        for call in range(3):
            ids_out.fill(-7)
            m.run_routed(x_dev, logits_dev, out32, ids_out=ids_out)
            np.testing.assert_array_equal(ids_out.get(stream=stream), want_ids, err_msg=f"call {call}")
            # the prefill kernels multiply in fp16 on the tensor cores, the decode kernels in bf16 hi/lo pairs
            assert _relerr(out32.get(stream=stream), want) <= (1e-4 if T <= m.decode_max_tokens else 3e-3), \
                f"call {call}"


# (bits, block_size, zero points, bias, dtype, H, I, activation, swiglu_fusion); the last one has FC3 (gated
# swiglu_fusion 0): layout.pack on the device, not pack_expert
_DEVICE_PACK_CASES = [
    (4, 32, True, True, "float32", 128, 64, "swiglu", 1),
    (8, 32, True, True, "float32", 128, 64, "swiglu", 1),
    (4, 64, False, True, "float16", 128, 64, "swiglu", 1),
    (8, 64, True, False, "bfloat16", 128, 128, "relu", 0),
    (4, 0, True, True, "bfloat16", 96, 40, "swiglu", 1),
    (8, 0, False, False, "float32", 96, 40, "relu", 0),
    (4, 0, True, False, "float16", 96, 40, "relu", 0),
    (8, 0, True, True, "float16", 80, 36, "swiglu", 1),
    (4, 32, False, False, "bfloat16", 96, 32, "swiglu", 2),
    (8, 16, True, True, "float32", 96, 48, "silu", 0),
    (4, 128, True, False, "float32", 256, 128, "swiglu", 2),
    (4, 32, True, True, "float32", 128, 64, "swiglu", 0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("bits,block_size,zero_points,bias,dtype,H,I,activation,fusion", _DEVICE_PACK_CASES)
def test_an_expert_converted_on_the_gpu_fills_its_slot_as_the_host_packing_does(bits, block_size, zero_points, bias,
                                                                                 dtype, H, I, activation, fusion):
    """GpuQMoE.upload_expert_device (stored rows copied over, kernel layout made on the GPU: one pack_expert launch
    for both projections, or layout.pack for FC3) against upload_expert (packed on the host): the same slot contents,
    byte for byte, and the same maps, the device's too."""
    cp = pytest.importorskip("cupy")
    import ml_dtypes

    from kernels.gpu import GpuQMoE
    from kernels.qmoe_spec import QMoESpec
    from tests.qmoe_oracle import make_case

    attrs, t, x, _ = make_case(seed=33, E=8, H=H, I=I, k=2, bits=bits, block_size=block_size, T=2,
                               activation=activation, swiglu_fusion=fusion, zero_points=zero_points, bias=bias,
                               dtype=ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype))
    spec = QMoESpec.from_tensors("test/QMoE", "QMoE", attrs, t, x.shape)
    host, device = GpuQMoE(spec, t, num_slots=3, resident=[]), GpuQMoE(spec, t, num_slots=3, resident=[])
    stream = cp.cuda.Stream(non_blocking=True)
    for slot, expert in ((0, 5), (2, 1), (0, 6)):  # the last one evicts expert 5
        host.upload_expert(expert, slot, stream=stream)
        device.upload_expert_device(expert, slot, stream=stream)
    stream.synchronize()
    assert device.device_packs == (0 if spec.has_fc3 else 3)
    for name in host.slots:
        for key in host.slots[name]:
            assert cp.array_equal(host.slots[name][key].view(cp.uint8), device.slots[name][key].view(cp.uint8)), \
                (name, key)
    assert np.array_equal(host.slot_of, device.slot_of) and device.slot_of[5] == -1 and device.slot_of[6] == 0
    assert np.array_equal(cp.asnumpy(device._slot_dev), device.slot_of)  # pack_expert updated the device's map
