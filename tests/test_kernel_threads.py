"""engine/kernel_threads.py: the CPU expert kernels' thread count, fixed or following the cores other processes
leave free; on scripted loads and clocks, and in a real decode."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from engine.generation import LoadedModel
from engine.host_load import HostLoad
from engine.kernel_threads import WINDOW_S, KernelThreads, threads_for
from engine.offload import OffloadConfig, SimulatedDevice
from tests.test_offload import assert_same_as_cpu, cpu_run, greedy_run, model_folder  # noqa: F401 (fixtures)


class ScriptedLoad:
    """HostLoadMeter's stand-in: each meter made reads the next share of the script (the last one from then on)."""

    def __init__(self, *others):
        self.others, self.meters, self.reads = list(others), 0, 0

    def __call__(self):
        self.meters += 1
        return self

    def read(self) -> HostLoad:
        self.reads += 1
        share = self.others.pop(0) if len(self.others) > 1 else self.others[0]
        return HostLoad(steal=0.0, others=share)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def runners(count=3):
    return [SimpleNamespace(kernel=SimpleNamespace(num_threads=None)) for _ in range(count)]


def windows(threads: KernelThreads, clock: Clock, count: int) -> list[int]:
    """The count in force after each of `count` windows."""
    seen = []
    for _ in range(count):
        clock.now += WINDOW_S
        threads.step_ended()
        seen.append(threads.in_force)
    return seen


@pytest.mark.parametrize("cores, share, want", [
    (2, 0.0, 2), (2, 0.2, 2), (2, 0.3, 1), (2, 0.5, 1), (2, 1.0, 1),  # 0.4 of a core costs no thread; 0.6 one
    (16, 0.03, 16), (16, 0.04, 15), (16, 0.5, 8), (16, 0.97, 1)])
def test_the_automatic_count_leaves_the_busy_cores_rounded(cores, share, want):
    assert threads_for(cores, share) == want


def test_the_cores_are_at_most_numbas_threads(monkeypatch):
    import numba

    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 1)  # NUMBA_NUM_THREADS=1 in the environment
    assert KernelThreads(runners()).cores == 1 and KernelThreads(runners(), cores=4).cores == 4


def test_kernels_capped_below_the_machines_cpus_count_the_busy_cores_of_the_machine(monkeypatch):
    """The other processes' share is of all the machine's CPUs' time. With the kernels held to 4 of 16 CPUs
    (NUMBA_NUM_THREADS=4, or an affinity), a build on 8 of them read as 0.5 x 4 = 2 busy cores: the count fell to 2
    threads with 8 CPUs idle, and the statistics said 2.0 cores busy."""
    import psutil

    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 16)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    clock = Clock()
    threads = KernelThreads(runners(), 0, cores=4, meter=ScriptedLoad(0.5, 0.5, 0.8, 0.8), clock=clock)
    assert windows(threads, clock, 2) == [4, 4] and threads.state()["others_busy_cores"] == 8.0
    assert windows(threads, clock, 2) == [4, 3]  # 12.8 busy of 16: 3 left


def test_under_an_affinity_the_busy_share_is_of_the_cpus_this_process_may_run_on(monkeypatch):
    """Pinned to 4 of 16 CPUs (taskset), the meter's shares are of those 4 (engine/host_load.py): other processes
    keeping 2 of them busy (0.5) were read as 8 busy of the 16, leaving the kernels all 4 threads on 2 free cores."""
    import psutil

    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 16)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    clock = Clock()
    threads = KernelThreads(runners(), 0, cores=4, meter=ScriptedLoad(0.5), clock=clock)
    assert windows(threads, clock, 2) == [4, 2] and threads.state()["others_busy_cores"] == 2.0


def test_the_count_moves_after_two_windows_that_agree_and_comes_back():
    load, clock, nodes = ScriptedLoad(0.0, 0.5, 0.5, 0.5, 0.0, 0.0), Clock(), runners()
    threads = KernelThreads(nodes, 0, cores=4, meter=load, clock=clock)
    assert threads.in_force == 4 and all(n.kernel.num_threads == 4 for n in nodes)
    assert windows(threads, clock, 6) == [4, 4, 2, 2, 2, 4]
    assert all(n.kernel.num_threads == 4 for n in nodes) and threads.changes == 2
    assert threads.state() == {"cpu_threads_in_force": 4, "cpu_threads_automatic": True, "cores": 4,
                               "others_busy_cores": 0.0, "cpu_threads_changes": 2}


def test_decoders_of_this_process_stepping_at_once_share_the_cores_and_one_left_alone_takes_them_back():
    clock, left_nodes, right_nodes = Clock(), runners(), runners()
    left = KernelThreads(left_nodes, 0, cores=4, meter=ScriptedLoad(0.0), clock=clock)
    right = KernelThreads(right_nodes, 0, cores=4, meter=ScriptedLoad(0.0), clock=clock)
    seen = []
    for _ in range(12):  # both step four times a window: a side-by-side chat answered at once
        clock.now += WINDOW_S / 4
        left.step_ended()
        right.step_ended()
        seen.append((left.in_force, right.in_force))
    assert seen[3::4] == [(4, 4), (2, 2), (2, 2)]  # the first window asks for half each, the second agrees
    assert all(n.kernel.num_threads == 2 for n in left_nodes + right_nodes)
    assert windows(left, clock, 3) == [2, 4, 4]  # the right side stopped: its last step is more than a window old


def test_a_window_across_a_pause_between_turns_is_not_judged():
    load, clock = ScriptedLoad(0.75, 0.75, 0.0), Clock()
    threads = KernelThreads(runners(), 0, cores=4, meter=load, clock=clock)
    clock.now += 10.0  # no step for ten seconds (between two answers), the others busy meanwhile
    threads.step_ended()
    assert load.reads == 0
    assert windows(threads, clock, 3) == [4, 1, 1]  # judged from the first window of the next turn on


def test_a_window_shorter_than_its_length_reads_nothing_and_a_burst_moves_nothing():
    load, clock = ScriptedLoad(0.5, 0.0, 0.5, 0.0), Clock()
    threads = KernelThreads(runners(), 0, cores=4, meter=load, clock=clock)
    clock.now += WINDOW_S / 2
    threads.step_ended()
    assert load.reads == 0
    assert windows(threads, clock, 4) == [4, 4, 4, 4]  # one busy window at a time: a burst
    assert threads.others_cores == 0.0 and threads.changes == 0


def test_a_fixed_count_never_reads_the_load_and_a_request_for_the_count_in_force_keeps_the_window():
    load, clock, nodes = ScriptedLoad(0.75), Clock(), runners()
    threads = KernelThreads(nodes, 3, cores=4, meter=load, clock=clock)
    assert windows(threads, clock, 3) == [3, 3, 3] and load.meters == 0 and not threads.automatic
    threads.request(0)  # automatic from every core
    assert threads.in_force == 4 and all(n.kernel.num_threads == 4 for n in nodes)
    clock.now += WINDOW_S
    threads.step_ended()  # the first window asks for one thread
    threads.request(0)  # asked again (a budget change): the window and the count it asked for stay
    clock.now += WINDOW_S
    threads.step_ended()
    assert threads.in_force == 1 and all(n.kernel.num_threads == 1 for n in nodes)
    threads.request(2)
    assert threads.in_force == 2 and all(n.kernel.num_threads == 2 for n in nodes)


def test_a_decode_whose_threads_change_mid_run_gives_the_all_cpu_tokens(model_folder, cpu_run):  # noqa: F811
    model = LoadedModel.open(model_folder)
    decoder = model.decoder
    assert decoder.kernel_threads.automatic  # no count given
    clock = Clock()

    class Ticking(ScriptedLoad):  # every meter read is a window later
        def read(self):
            clock.now += WINDOW_S
            return super().read()

    load = Ticking(0.0, 0.75, 0.75, 0.75, 0.0)
    nodes = decoder.kernel_threads.runners
    decoder.kernel_threads = KernelThreads(nodes, 0, cores=4, meter=load, clock=clock)
    clock.now += WINDOW_S
    seen = []
    original = decoder.kernel_threads.step_ended

    def step_ended():
        original()
        seen.append(decoder.kernel_threads.in_force)
    decoder.kernel_threads.step_ended = step_ended
    run = greedy_run(model)
    assert seen[:4] == [4, 4, 1, 1] and len(nodes) == len(model.folder.experts)
    assert_same_as_cpu(run, cpu_run)


def test_the_offload_engine_shares_the_decoders_count_and_cpu_threads_sets_it(model_folder):  # noqa: F811
    model = LoadedModel.open(model_folder, offload=OffloadConfig(cpu_threads=3), device=SimulatedDevice(1 << 30))
    threads = model.offload.kernel_threads
    assert threads is model.decoder.kernel_threads and threads.in_force == min(3, threads.cores) and not threads.automatic
    model.offload.reconfigure(model.offload.config.updated(cpu_threads=64))  # more than the cores: the cores run
    assert threads.in_force == threads.cores and model.offload.stats_dict()["cpu_threads"]["cpu_threads_in_force"] == \
        threads.cores
    model.offload.reconfigure(model.offload.config.updated(cpu_threads=0))
    assert threads.automatic and threads.in_force == threads.cores
    assert all(r.kernel.num_threads == threads.cores for r in model.offload.runners)
    assert model.offload.stats_dict()["cpu_threads"]["cpu_threads_automatic"] is True
    assert np.isfinite(greedy_run(model, steps=2)[0][-1]).all()


def test_settling_puts_the_count_the_load_asks_for_in_force_at_once_and_a_fixed_count_waits_for_nothing():
    load, clock, nodes, slept = ScriptedLoad(0.5, 0.0, 0.0), Clock(), runners(), []
    threads = KernelThreads(nodes, 0, cores=4, meter=load, clock=clock)
    assert threads.settle(sleep=slept.append) == WINDOW_S and slept == [WINDOW_S]
    assert threads.in_force == 2 and all(n.kernel.num_threads == 2 for n in nodes) and threads.changes == 1
    assert threads.others_cores == 2.0
    assert windows(threads, clock, 3) == [2, 4, 4]  # the steps' windows take it on from there
    assert threads.settle(sleep=slept.append) == 0.0  # just after a step: those windows follow the load already
    clock.now += 10.0
    assert threads.settle(sleep=slept.append) == WINDOW_S and len(slept) == 2  # after a pause
    fixed = KernelThreads(runners(), 3, cores=4, meter=load, clock=clock)
    reads = load.reads
    assert fixed.settle(sleep=slept.append) == 0.0 and fixed.in_force == 3 and load.reads == reads
    assert len(slept) == 2
