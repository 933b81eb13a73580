"""The host-part worker (engine/offload/host_part_worker.py, kernels/cpu/host_parts.py): "both" layers' CPU parts
computed by a compiled loop on a thread of its own. Here a Python thread plays the GPU: it publishes each launched
layer's routing into the real PublishedRouting block (over host memory) and waits for the gate, as the gated merge
does; the parts must equal the CPU kernel's on the same pairs. The decoder's side (_run_steps_beside) runs on fakes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numba
import numpy as np
import pytest
from onnx import TensorProto

from engine.errors import WorkbenchError
from engine.offload import host_part_worker
from engine.offload.host_part_worker import HostPartWorker, JobDone
from kernels.cold_split import cpu_spans
from kernels.cpu import CpuQMoE, host_parts, numba_cache
from kernels.gpu.published import PublishedRouting
from kernels.reference import route as ref_route
from tests.haswell_check import ROOT
from tests.qmoe_oracle import make_case
from tests.test_decoder_ahead import FakeDense, _Later, _read, make_decoder
from tests.test_qmoe_cpu import _spec

pytestmark = pytest.mark.skipif(not host_part_worker.supported(), reason="the compiled loop is x86-64 only")

HOST_CUPY = SimpleNamespace(cuda=SimpleNamespace(alloc_pinned_memory=bytearray), empty=np.empty, zeros=np.zeros,
                            int32=np.int32, float32=np.float32, uint32=np.uint32)


@pytest.fixture(scope="module")
def kernel():
    attrs, t, x, _ = make_case(seed=3, E=16, H=128, I=96, k=4, bits=4, block_size=32, T=3, activation="swiglu",
                               swiglu_fusion=1)
    kernel = CpuQMoE(_spec(attrs, t, x), t)
    for dtype in (np.float16, np.float32):  # the loop compiled for both (minutes on a 2-core VM), before any timing
        assert host_part_worker.compile_loop(kernel, dtype)
    # and the kernel FakeGpu checks the parts with: compiled in its thread on a cold cache, it would hold the GIL for
    # longer than a drain waits
    kernel.run_experts(x[:1].astype(np.float32), np.zeros((1, 4), np.int32), np.full((1, 4), 0.25, np.float32),
                       out=np.zeros((1, kernel.spec.hidden_size), np.float32))
    return kernel


class Step:
    """SplitStep's interface as the worker reads it: the node (layer, kernel, name), the pending launch's block."""

    def __init__(self, layer: int, kernel, published: PublishedRouting, gate_on_device: bool = True):
        self.node = SimpleNamespace(layer=layer, kernel=kernel, info=SimpleNamespace(name=f"layer{layer}"))
        self.pending = SimpleNamespace(published=published)
        self.store = SimpleNamespace(split_gate_on_device=lambda pending: gate_on_device)
        self.abandoned = False

    def abandon(self):
        self.abandoned = True
        self.pending.published.part.fill(0.0)
        self.pending.published.open_gate()


class FakeGpu(threading.Thread):
    """Publishes each job's routing once the previous job's gate is up (route_split after the gated merge and the
    dense segment), then keeps the part the gate let through."""

    def __init__(self, kernel, jobs, seed=0, bad_id=None, split_at=None):
        super().__init__(daemon=True)
        self.kernel, self.jobs, self.rng, self.bad_id = kernel, jobs, np.random.default_rng(seed), bad_id
        self.split_at = split_at  # a step's first pair split there (kernels/cold_split.py: split_cold_rows' code)
        self.parts, self.wanted, self.timed_out = [], [], False

    def run(self):
        spec = self.kernel.spec
        for step in self.jobs:
            published = step.pending.published
            tokens = published.tokens
            x = self.rng.standard_normal((tokens, spec.hidden_size)).astype(published.x.dtype)
            ids, w = ref_route(self.rng.standard_normal((tokens, spec.num_experts)).astype(np.float32), spec)
            on_cpu = self.rng.integers(0, 2, ids.shape)
            if self.bad_id is not None and step is self.jobs[self.bad_id]:
                ids[0, 0], on_cpu[0, 0] = spec.num_experts + 3, 1
            if self.split_at is not None:
                on_cpu[0, 0] = self.split_at + 1
            published.x[:], published.ids[:], published.w[:], published.on_cpu[:] = x, ids, w, on_cpu
            time.sleep(0.002)  # the worker gets there first: it waits for this routing
            published.flag[0] = published.launched
            deadline = time.perf_counter() + 60
            while published.gate[0] != published.launched:
                if time.perf_counter() > deadline:
                    self.timed_out = True
                    return
            self.parts.append(published.part.copy())
            if self.bad_id is not None:
                continue
            spans = cpu_spans(ids, on_cpu, spec.num_experts, spec.inter_size)
            self.wanted.append(self.kernel.run_experts(x.astype(np.float32), np.where(on_cpu != 0, ids, -1), w,
                                                       out=np.zeros(x.shape, np.float32), spans=spans))


def blocks(layers: int, tokens: int, kernel, dtype=np.float16) -> list[PublishedRouting]:
    spec = kernel.spec
    return [PublishedRouting(HOST_CUPY, tokens, spec.k, spec.hidden_size, dtype) for _ in range(layers)]


def launch(published: PublishedRouting) -> None:
    published.launched += 1  # CudaSlots' launch counter: the flag and the gate carry it


def worker_step(worker, kernel, published, seed, split_at=None) -> list:
    """One decode step's layers through the worker, each part checked against the kernel's (FakeGpu's split_at: each
    layer's first pair split there); the step's jobs."""
    jobs = []
    for layer, block in enumerate(published):
        launch(block)
        jobs.append(Step(layer, kernel, block))
    gpu = FakeGpu(kernel, jobs, seed=seed, split_at=split_at)
    gpu.start()
    for job in jobs:
        assert worker.take(job)
    worker.drain()
    gpu.join(30)
    assert not gpu.timed_out and len(gpu.parts) == len(jobs)
    for got, want in zip(gpu.parts, gpu.wanted):  # the same rows, sums and order of sums as the kernel's call
        assert np.array_equal(got, want)
    return jobs


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_the_worker_computes_each_layers_cpu_part_and_raises_its_gate_in_order(kernel, dtype):
    worker = HostPartWorker(threads=1)
    published = blocks(3, 2, kernel, dtype)
    for step_no in range(2):  # two decode steps: the loop carries on from one to the next
        jobs = worker_step(worker, kernel, published, step_no)
        done = worker.collect()
        assert [job.step for job in done] == jobs and not worker.collect()
        for job in done:
            assert job.reached <= job.routed <= job.gated and job.cpu_s > 0
            assert job.pairs == np.count_nonzero(job.step.pending.published.on_cpu)
        assert [int(block.gate[0]) for block in published] == [step_no + 1] * 3


def test_the_worker_computes_the_cpus_rows_of_a_split_pair(kernel):
    """A pair coded r + 1 is the CPU's part of a pair split with the GPU: the part has the expert's rows from r on
    only (the kernel's part on those rows), and the next step's whole pairs have all their rows again."""
    worker = HostPartWorker(threads=2)
    published = blocks(2, 1, kernel)
    for step_no, split_at in enumerate((40, None, 8)):
        worker_step(worker, kernel, published, step_no, split_at)
        assert len(worker.collect()) == 2


def test_two_threads_compute_each_part(kernel):
    """The kernel's threads forked and joined for each job (moe_gemv's parallel region), from step to step."""
    worker = HostPartWorker(threads=2)
    published = blocks(3, 2, kernel)
    for step_no in range(3):
        jobs = worker_step(worker, kernel, published, 10 + step_no)
        assert [job.step for job in worker.collect()] == jobs


def test_new_threads_remake_every_layers_entry_before_the_next_step(kernel):
    worker = HostPartWorker(threads=1)
    published = blocks(3, 2, kernel)
    worker_step(worker, kernel, published, 0)
    assert worker._params[:, 5].tolist() == [1, 1, 1]  # host_part_args' threads
    worker.set_threads(2)  # the automatic count moved (engine/kernel_threads.py)
    assert worker._params[:, 5].tolist() == [2, 2, 2] and not worker.pending
    worker_step(worker, kernel, published, 1)
    assert [int(block.gate[0]) for block in published] == [2, 2, 2]


def test_a_job_waited_for_the_gpu_where_its_routing_came_after_the_worker_got_there():
    assert JobDone(None, reached=1.0, routed=1.0 + 1e-4, gated=1.5, pairs=2).waited
    assert not JobDone(None, reached=1.0, routed=1.0 + 1e-7, gated=1.5, pairs=2).waited  # there already
    assert JobDone(None, reached=1.0, routed=1.25, gated=1.5, pairs=2).cpu_s == 0.25


def test_a_bad_expert_id_fails_with_the_layers_name_and_lets_every_gate_go(kernel):
    worker = HostPartWorker(threads=1)
    published = blocks(3, 1, kernel)
    jobs = []
    for layer, block in enumerate(published):
        launch(block)
        jobs.append(Step(layer, kernel, block))
    gpu = FakeGpu(kernel, jobs, bad_id=1)
    gpu.start()
    taken = 0
    with pytest.raises(WorkbenchError, match=r"^layer1: .*expert id out of range"):
        for job in jobs:  # (the error comes at the next drain: layer 2's admission, or the step's end)
            assert worker.take(job)
            taken += 1
        worker.drain()
    for job in jobs[taken:]:
        job.abandon()  # launched, not taken: the decoder lets it go (_run_steps_beside)
    gpu.join(30)
    assert not gpu.timed_out  # layer 1's gate (abandoned) and layer 2's came up
    assert [job.abandoned for job in jobs] == [False, True, True]
    assert len(worker.collect()) == 0 and not worker.pending
    # the worker takes jobs again after the failure
    for block in published:
        launch(block)
    jobs = [Step(layer, kernel, block) for layer, block in enumerate(published)]
    gpu = FakeGpu(kernel, jobs, seed=4)
    gpu.start()
    assert all(worker.take(job) for job in jobs)
    worker.drain()
    gpu.join(30)
    assert len(worker.collect()) == 3


def test_cancel_raises_the_gates_of_the_jobs_left(kernel):
    worker = HostPartWorker(threads=1)
    published = blocks(2, 1, kernel)
    for layer, block in enumerate(published):
        assert worker._admit(layer, kernel, block)  # (a layer's first take waits for the jobs before it)
        launch(block)
    jobs = [Step(layer, kernel, block) for layer, block in enumerate(published)]
    assert all(worker.take(job) for job in jobs)  # no routing is ever published
    time.sleep(0.01)
    worker.cancel()
    assert [job.abandoned for job in jobs] == [True, True]
    assert [int(block.gate[0]) for block in published] == [1, 1] and not worker.pending


def test_a_step_the_loop_cannot_run_or_gate_is_not_taken(kernel):
    worker = HostPartWorker(threads=1)
    block = blocks(1, 1, kernel)[0]
    launch(block)
    assert not worker.take(Step(0, SimpleNamespace(), block))  # no host_part_args: a delegated layout
    assert not worker.take(Step(0, kernel, block, gate_on_device=False))  # a merge that does not wait on the GPU
    many = PublishedRouting(HOST_CUPY, kernel.gemv_max_rows + 1, kernel.spec.k, kernel.spec.hidden_size, np.float16)
    launch(many)
    assert not worker.take(Step(1, kernel, many))  # more tokens than the fused decode kernel takes per expert
    assert not worker.pending


# ---------------------------------------------------------------- the decoder's side, on fakes
class FakeWorker:
    """HostPartWorker's interface: takes what `accepts` says, logs drains and collects."""

    def __init__(self, log, accepts=lambda step: True):
        self.log, self.accepts, self.jobs, self.cancelled = log, accepts, [], False
        self.finished = []  # jobs done and not collected yet

    def take(self, step):
        if not self.accepts(step):
            return False
        self.log.append(("take", step.node.name))
        self.jobs.append(step)
        return True

    def drain(self, while_waiting=None, leave=0):
        """The jobs end one at a time (the worker's gates) but the last `leave`, `while_waiting` called after each."""
        self.log.append(("drain",) if not leave else ("drain", leave))
        pending = [step for step in self.jobs if not getattr(step, "done", False)]
        for step in pending[:max(len(pending) - leave, 0)]:
            step.gate["open"] = step.done = True
            self.finished.append(step)
            if while_waiting is not None:
                while_waiting()
        self.log.append(("drained",))

    def collect(self):
        done, self.finished = self.finished, []
        return [SimpleNamespace(step=step) for step in done]

    def cancel(self):
        self.cancelled = True


class Node:
    """A layer that launches a "both" step (FakeStep from test_decoder_ahead) or runs whole."""

    def __init__(self, name, source, output, log, both=True, fails=False):
        from tests.test_decoder_ahead import FakeNode

        self.fake = FakeNode(name, source, output, log, both=both, fails=fails)
        self.info, self.name, self.log = self.fake.info, name, log
        self.engine = SimpleNamespace(settle=lambda most=2: log.append(("settle", most)) or 0)

    def host_part_done(self, job):
        self.log.append(("done", self.name))

    def launch_ahead(self, values):
        step = self.fake.launch_ahead(values)
        if step is not None:
            step.node = self
            step.pending = None
        return step

    def run(self, values):
        return self.fake.run(values)

    @property
    def fails(self):  # (FakeStep.finish reads its node's)
        return self.fake.fails


class LaunchingDense(FakeDense):
    """A dense segment on the GPU: its run is queued behind the gates before it (nothing read on the host)."""

    def run(self, values, state, decode=False):
        self.log.append(("run", self.name))
        return {self.output: _Later(values[self.source], 1)}


def decoder_layers(log, count, **node):
    runners = []
    for i in range(count):
        runners.append(LaunchingDense(f"dense{i}", "h0" if i == 0 else f"y{i - 1}", f"x{i}", log))
        runners.append(Node(f"node{i}", f"x{i}", f"y{i}", log, **node))
    runners.append(LaunchingDense(f"dense{count}", f"y{count - 1}", "logits", log))
    return runners


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_the_loop_compiled_at_load_is_the_one_a_real_block_runs(kernel, dtype):
    """compile_loop's stand-in block gives the loop the types a published block gives: admitting a real layer after
    it compiles nothing more."""
    spec = kernel.spec
    warm, _ = host_part_worker.loop_item(kernel, host_part_worker.HostBlock(1, spec.k, spec.hidden_size, dtype), 1)
    real, _ = host_part_worker.loop_item(kernel, blocks(1, 1, kernel, dtype)[0], 4)
    assert numba.typeof(warm) == numba.typeof(real)
    compiled = len(host_parts.run_host_parts.signatures)
    assert HostPartWorker(threads=1)._admit(0, kernel, blocks(1, 1, kernel, dtype)[0])
    assert len(host_parts.run_host_parts.signatures) == compiled


def test_compile_loop_refuses_a_kernel_the_loop_cannot_run(kernel):
    assert not host_part_worker.compile_loop(SimpleNamespace(spec=kernel.spec), np.float16)  # no host_part_args
    assert not host_part_worker.compile_loop(kernel, np.float64)  # an activations' dtype the loop has no copy for


def test_the_decoder_compiles_the_loop_once_per_kind_of_layer_where_the_dense_part_is_on_the_gpu(monkeypatch):
    compiled = []
    monkeypatch.setattr(host_part_worker, "compile_loop", lambda kernel, dtype: compiled.append((kernel, dtype)))
    first, second = SimpleNamespace(compiled_for=("int4",)), SimpleNamespace(compiled_for=("int8",))
    runners = decoder_layers([], 3)
    for node, kernel in zip(runners[1::2], (first, first, second)):
        node.kernel, node.info = kernel, SimpleNamespace(name=node.name)
    model = make_decoder(runners)
    model._expert_input_types = {f"node{i}": TensorProto.FLOAT16 for i in range(3)}
    assert model.warm_host_part_loop() == 0.0  # the dense part on the CPU: no "both" step takes the worker
    assert compiled == []
    model.dense = SimpleNamespace(kind="cuda")
    model.warm_host_part_loop()
    assert compiled == [(first, np.float16), (second, np.float16)]


def test_the_decoder_hands_each_both_layer_to_the_worker_and_goes_on():
    log = []
    model = make_decoder(decoder_layers(log, 2))
    worker = FakeWorker(log)
    values = {"h0": 0}
    model.layers_beside = 0
    _dense, _experts, late = model._run_steps_beside(values, None, worker)
    assert not late and _read(values["logits"]) == 23
    assert [entry for entry in log if entry[0] in ("launch", "take", "drain", "finish")] == [
        ("launch", "node0"), ("take", "node0"), ("launch", "node1"), ("take", "node1"), ("drain", 1), ("drain",)]
    assert model.layers_beside == 2


def test_the_step_collects_jobs_and_takes_accounts_before_its_last_segment_waits_for_the_logits():
    """The host launches the layers far ahead of the worker, then waits in the last segment's run for the logits: the
    jobs done are collected and their accounts settled before that run, while the worker computes the last layer,
    not after the step (where the GPU waits for them)."""
    log = []
    model = make_decoder(decoder_layers(log, 3))
    model.layers_beside = 0
    model._run_steps_beside({"h0": 0}, None, FakeWorker(log))
    start = log.index(("drain", 1))
    assert log[start:] == [("drain", 1), ("done", "node0"), ("settle", 1), ("done", "node1"), ("settle", 1),
                           ("drained",), ("run", "dense3"), ("drain",), ("drained",), ("done", "node2")]


def test_drain_calls_its_host_work_while_a_job_waits_for_the_gpus_routing(kernel):
    worker = HostPartWorker(threads=1)
    layers = blocks(1, 1, kernel)
    launch(layers[0])
    steps = [Step(0, kernel, layers[0])]
    assert worker.take(steps[0])
    gpu = FakeGpu(kernel, steps)
    calls = []

    def host_work():
        if not calls:
            gpu.start()  # the routing comes only now: the drain has to wait for it
        calls.append(1)

    worker.drain(host_work)
    gpu.join(30)
    assert len(calls) >= 1 and not gpu.timed_out and len(gpu.parts) == 1
    assert [job.step for job in worker.collect()] == steps


def test_a_layer_the_worker_does_not_take_runs_here_after_a_drain():
    log = []
    model = make_decoder(decoder_layers(log, 2))
    worker = FakeWorker(log, accepts=lambda step: step.node.name != "node1")
    values = {"h0": 0}
    model.layers_beside = 0
    model._run_steps_beside(values, None, worker)
    assert _read(values["logits"]) == 23
    kinds = [entry[:2] for entry in log if entry[0] in ("launch", "take", "drain", "finish")]
    assert kinds == [("launch", "node0"), ("take", "node0"), ("launch", "node1"), ("drain",), ("finish", "node1"),
                     ("drain", 1), ("drain",)]
    assert model.layers_beside == 1


@pytest.mark.parametrize("gave_up", [False, True])
def test_a_layer_run_here_whose_merge_gave_up_makes_the_step_run_again(gave_up):
    """Its merge waited for this thread's gate; the device's word says whether it gave up (read after the step)."""
    log = []
    runners = decoder_layers(log, 2)
    runners[3].fake.gave_up = gave_up
    model = make_decoder(runners)
    model.layers_beside = 0
    _dense, _experts, late = model._run_steps_beside({"h0": 0}, None,
                                                    FakeWorker(log, accepts=lambda step: step.node.name != "node1"))
    assert late == gave_up


def test_the_engine_thread_gives_its_openmp_pool_back_after_a_step_that_left_every_part_to_the_worker(monkeypatch):
    """Two pools beside each other throttle both (kernels/cpu/omp_pool.py): once the worker took layers in the step
    before, a step whose layers all went to the worker gives this thread's pool back after it; a step that ran a layer
    here keeps it for the next."""
    from engine import decoder as decoder_module

    released = []
    monkeypatch.setattr(decoder_module, "release_pool", lambda: released.append(1) or True)
    log = []
    model = make_decoder(decoder_layers(log, 2))
    model._worker_took = True  # (the steps before handed the worker layers: no pool handed over at a first take)
    refuse = {"node1"}
    worker = FakeWorker(log, accepts=lambda step: step.node.name not in refuse)
    model._run_steps_beside({"h0": 0}, None, worker)  # node1 ran here: the pool stays
    assert released == [] and model._pool_here
    refuse.clear()
    model._run_steps_beside({"h0": 0}, None, worker)  # every layer to the worker: the pool given back
    assert released == [1] and not model._pool_here
    model._run_steps_beside({"h0": 0}, None, worker)  # none to give back
    assert released == [1]


def test_a_step_handing_the_worker_its_first_layer_after_a_step_that_handed_none_gives_the_pool_back_at_once(
        monkeypatch):
    """After a step whose CPU parts all ran here (a shape's first ungated launches, a step without the worker: a
    prompt's, one run again), this thread's pool still spins: it is given back right after the step's first layer
    goes to the worker, before the next layer is launched, not after the step."""
    from engine import decoder as decoder_module

    log = []
    monkeypatch.setattr(decoder_module, "release_pool", lambda: log.append(("release",)) or True)
    model = make_decoder(decoder_layers(log, 2))
    refuse = {"node0", "node1"}
    worker = FakeWorker(log, accepts=lambda step: step.node.name not in refuse)
    model._run_steps_beside({"h0": 0}, None, worker)  # every layer ran here
    assert ("release",) not in log and model._pool_here
    refuse.clear()
    log.clear()
    model._run_steps_beside({"h0": 0}, None, worker)
    assert [entry[:2] for entry in log if entry[0] in ("launch", "take", "release")] == [
        ("launch", "node0"), ("take", "node0"), ("release",), ("launch", "node1"), ("take", "node1")]
    assert not model._pool_here
    model._run_steps({"h0": 0}, None, False)  # a step without the worker: CPU parts here again
    refuse.add("node1")
    log.clear()
    model._run_steps_beside({"h0": 0}, None, worker)  # handed over at node0's take, made again by node1 here
    assert [entry[:2] for entry in log if entry[0] in ("take", "release", "finish")] == [
        ("take", "node0"), ("release",), ("finish", "node1")]
    assert model._pool_here  # kept after the step: node1 runs here


def test_the_worker_gives_its_openmp_pool_back_when_it_goes_to_sleep(kernel, monkeypatch):
    released = []  # by the worker's thread (other tests' workers, asleep, may give theirs back meanwhile)
    monkeypatch.setattr(host_part_worker, "release_pool", lambda: released.append(threading.current_thread()))
    worker = HostPartWorker(threads=1)
    monkeypatch.setattr(host_part_worker, "IDLE_S", 0.001)
    layers = blocks(1, 1, kernel)
    steps = [Step(0, kernel, layers[0])]
    gpu = FakeGpu(kernel, steps)
    launch(layers[0])
    assert worker.take(steps[0])
    gpu.start()
    worker.drain()
    gpu.join(10)
    deadline = time.perf_counter() + 10
    while worker._thread not in released and time.perf_counter() < deadline:  # the loop returns after IDLE_S idle
        time.sleep(0.005)
    assert released.count(worker._thread) == 1


def test_an_error_cancels_the_worker_and_abandons_the_layer_launched():
    log = []
    runners = decoder_layers(log, 2)
    model = make_decoder(runners)
    worker = FakeWorker(log, accepts=lambda step: step.node.name != "node1")
    runners[3].fake.fails = True  # node1's own host part fails
    model.layers_beside = 0
    with pytest.raises(RuntimeError, match="node1 failed"):
        model._run_steps_beside({"h0": 0}, None, worker)
    assert worker.cancelled and ("abandon", "node1") in log  # node0's gate is the worker's, node1's raised here


def test_a_dropped_worker_goes_with_what_it_holds_and_its_thread_ends(kernel):
    """The worker's thread held the worker (its bound method) for as long as the process: a model dropped left its
    worker, its layers' kernels over the model's mapped file and the published blocks' pinned and GPU memory behind,
    and a thread asleep for each model loaded."""
    import gc
    import weakref

    worker = HostPartWorker(threads=1)
    layers = blocks(1, 1, kernel)
    worker_step(worker, kernel, layers, seed=5)
    assert len(worker.collect()) == 1
    thread = worker._thread
    dropped = [weakref.ref(worker), weakref.ref(layers[0])]
    gc.disable()  # (no cycle either)
    try:
        del worker, layers
        thread.join(10)  # the loop returns after IDLE_S idle, and the thread then lets the worker go
        assert not thread.is_alive() and [ref() for ref in dropped] == [None, None]
    finally:
        gc.enable()


FIRST_CALL = """
import sys
import numpy as np
from types import SimpleNamespace
from numba.np.ufunc import parallel
from engine.offload import host_part_worker
from kernels.cpu import CpuQMoE
from kernels.gpu.published import PublishedRouting
from tests.qmoe_oracle import make_case
from tests.test_host_part_worker import HOST_CUPY, Step
from tests.test_qmoe_cpu import _spec

attrs, t, x, _ = make_case(seed=3, E=16, H=128, I=96, k=4, bits=4, block_size=32, T=3, activation="swiglu",
                           swiglu_fusion=1)
kernel = CpuQMoE(_spec(attrs, t, x), t)
assert not parallel._is_initialized  # nothing has run a parallel kernel in this process
assert host_part_worker.compile_loop(kernel, np.float16)
spec = kernel.spec
block = PublishedRouting(HOST_CUPY, 2, spec.k, spec.hidden_size, np.float16)
block.launched += 1
block.x[:] = x[:2]
block.ids[:] = [[0, 3, 5, 7], [1, 3, 9, 15]]
block.w[:], block.on_cpu[:], block.flag[0] = 0.25, 1, block.launched  # routed before the job is taken
worker = host_part_worker.HostPartWorker(threads=2)
assert worker.take(Step(0, kernel, block))
worker.drain()
np.save(sys.argv[1], block.part)
"""


def test_a_cached_loop_that_launches_no_threading_layer_runs_as_a_processs_first_call(kernel, tmp_path):
    """Numba (0.68) writes the loop's cache entry without the hook that launches its threading layer at a load where
    the writing process loaded moe_gemv from the cache rather than compiling it (a library rebuilt from the cache keeps
    no reload hooks): the suite's warming process, any process after the one that compiled the kernels. A process
    whose first kernel call was such a loop died (SIGSEGV). Here the fixture's entries as such a process writes them,
    in a cache of their own: a fresh process loads the loop first and computes a part."""
    cached = host_parts.run_host_parts._cache
    cache = cached._cache_file
    folder = tmp_path / "numba" / Path(cached.cache_path).relative_to(numba_cache.cache_root())
    folder.mkdir(parents=True)
    shutil.copy(cache._index_path, folder)
    for name in cache._load_index().values():
        libdata, fndesc, env, signature, objectmode, lifted, typeann, _reload_init, envs = cache._load_data(name)
        (folder / name).write_bytes(cache._dump((libdata, fndesc, env, signature, objectmode, lifted, typeann, [],
                                                 envs)))
    part = tmp_path / "part.npy"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", FIRST_CALL, str(part)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    x = make_case(seed=3, E=16, H=128, I=96, k=4, bits=4, block_size=32, T=3, activation="swiglu",
                  swiglu_fusion=1)[2][:2]
    ids = np.array([[0, 3, 5, 7], [1, 3, 9, 15]], np.int32)
    want = kernel.run_experts(x.astype(np.float16).astype(np.float32), ids, np.full(ids.shape, 0.25, np.float32),
                              out=np.zeros((2, kernel.spec.hidden_size), np.float32))
    assert np.array_equal(np.load(part), want)
