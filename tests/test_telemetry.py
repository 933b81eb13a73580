"""The window's telemetry thread (app.gui.telemetry)."""
from __future__ import annotations

import threading

import pytest

pytest.importorskip("pytestqt")

import app.gui.telemetry as telemetry  # noqa: E402


def test_the_probe_and_nvml_open_on_the_callers_thread_not_the_samplers(qtbot, monkeypatch):
    """Opening NVML loads its library (a dlopen): done on the window's thread before the sampler's thread starts, so
    that thread never loads a library while the window's thread builds Qt objects (that deadlocked the suite)."""
    opened = []
    monkeypatch.setattr(telemetry, "Nvml", lambda: opened.append(threading.get_ident()) or _NoGpu())
    sampler = telemetry.SamplerThread(interval_ms=20, nvml=True)
    try:
        assert opened == [threading.get_ident()]
        with qtbot.waitSignal(sampler.sampler.sampled, timeout=5000) as sampled:
            pass
        assert sampled.args[0]["gpu"] is None and sampled.args[0]["gpu_note"] == "no GPU here"
        assert 0.0 <= sampled.args[0]["cpu_steal_share"] <= 1.0  # (a share of the CPUs' time; 0 off Linux)
        assert opened == [threading.get_ident()]  # the samples did not open it again
    finally:
        sampler.stop()


class _NoGpu:
    note = "no GPU here"
    retrying = False

    def sample(self):
        return None


def test_other_processes_memory_is_not_hidden_by_this_process_mapped_file(monkeypatch):
    """This process's mapped model pages are page cache, counted in `available` already: only its other pages are
    taken off what is used, so other processes' memory shows beside a mapped model (it read 0 beside a 0.5 GB one)."""
    gib = 1 << 30
    monkeypatch.setattr(telemetry.psutil, "virtual_memory", lambda: _Memory(total=16 * gib, available=12 * gib))
    probe = telemetry.SystemProbe(nvml=False)
    probe.me = _Process(rss=3 * gib, shared=2 * gib)  # 2 GiB of it the model's file mapping
    sample = probe.sample()
    assert sample["ram_this"] == 3 * gib
    assert sample["ram_others"] == 3 * gib  # 16 - 12 used, less this process's 1 GiB of its own memory


class _Memory:
    def __init__(self, total, available):
        self.total, self.available = total, available


class _Process:
    pid = -1

    def __init__(self, rss, shared, cores=0.0):
        self.rss, self.shared, self.cores = rss, shared, cores

    def memory_info(self):
        return self

    def cpu_percent(self, interval):
        return self.cores * 100.0


def test_steal_time_is_not_taken_for_other_processes(monkeypatch):
    """psutil counts a virtual machine's steal time as busy: with nothing else running, 30% steal on 2 cores read as
    other processes using 0.6 cores (a warning naming nobody)."""
    monkeypatch.setattr(telemetry.psutil, "cpu_percent", lambda interval, percpu=False: [80.0, 80.0])
    monkeypatch.setattr(telemetry.psutil, "cpu_times_percent", lambda interval, percpu=False: [_Steal(30.0)] * 2)
    monkeypatch.setattr(telemetry.psutil, "virtual_memory", lambda: _Memory(total=16 << 30, available=12 << 30))
    probe = telemetry.SystemProbe(nvml=False)
    probe.me = _Process(rss=1 << 30, shared=0, cores=1.0)
    sample = probe.sample()
    assert sample["cpu_steal_share"] == pytest.approx(0.3)
    assert sample["others_cpu_cores"] == pytest.approx(0.0)  # 1.6 cores busy: 1.0 this process, 0.6 stolen


class _Steal:
    def __init__(self, steal):
        self.steal = steal


def _four_cpus(monkeypatch, per_core, ours):
    monkeypatch.setattr(telemetry.psutil, "cpu_percent", lambda interval, percpu=False: list(per_core))
    monkeypatch.setattr(telemetry.psutil, "cpu_times_percent", lambda interval, percpu=False: [_Steal(0.0)] * 4)
    monkeypatch.setattr(telemetry.psutil, "virtual_memory", lambda: _Memory(total=16 << 30, available=12 << 30))
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(ours))
    probe = telemetry.SystemProbe(nvml=False)
    probe.me = _Process(rss=1 << 30, shared=0, cores=0.1)
    probe._samples = 1  # (no walk of the machine's processes)
    return probe.sample()


def test_other_processes_count_only_on_the_cpus_this_process_may_run_on(monkeypatch):
    """A build pinned to CPUs 0-1 (taskset) does not compete with a workbench pinned to 2-3: the whole machine's load
    (2.1 other cores of 4) raised the warning; on our two CPUs the others use 0.1 of a core. A build on our CPUs still
    raises it, saying which CPUs are meant."""
    from tests.test_gui_parts import warned

    elsewhere = _four_cpus(monkeypatch, [100.0, 100.0, 10.0, 10.0], ours={2, 3})
    assert elsewhere["others_cpu_cores"] == pytest.approx(0.1)
    assert elsewhere["cpu_ours"] == [2, 3]
    assert warned(dict(elsewhere, gpu=None)) == []
    here = _four_cpus(monkeypatch, [10.0, 10.0, 100.0, 100.0], ours={2, 3})
    assert here["others_cpu_cores"] == pytest.approx(1.9)
    assert warned(dict(here, gpu=None)) == [
        "Other processes use 1.9 of the 2 CPU cores this process may run on (of 4)."
        " The CPU expert kernels run on the cores they leave: pausing them speeds the answer."]
    everywhere = _four_cpus(monkeypatch, [100.0, 100.0, 10.0, 10.0], ours={0, 1, 2, 3})
    assert warned(dict(everywhere, gpu=None)) == [
        "Other processes use 2.1 of 4 CPU cores. The CPU expert kernels run on the cores they leave: pausing them "
        "speeds the answer."]


class _Times:
    def __init__(self, own, children):
        self.user, self.system, self.children_user, self.children_system = own, 0.0, children, 0.0


class _Proc:
    """A process as psutil shows it, its CPU seconds (own, and its waited-for children's) set by the test."""

    def __init__(self, pid, name, ppid, own=0.0, children=0.0, affinity=(0, 1), created=0.0):
        self.pid, self.name, self.ppid, self.own, self.children = pid, name, ppid, own, children
        self.affinity, self.created, self._last = list(affinity), created, None

    @property
    def info(self):
        return {"name": self.name, "ppid": self.ppid, "cpu_times": _Times(self.own, self.children),
                "memory_info": _Process(rss=1 << 20, shared=0), "create_time": self.created}

    def cpu_percent(self, interval):  # psutil's: this process's own time since the call before
        import time

        now, last = time.monotonic(), self._last
        self._last = (now, self.own)
        return 0.0 if last is None else (self.own - last[1]) / (now - last[0]) * 100.0

    def oneshot(self):
        import contextlib

        return contextlib.nullcontext()

    def memory_info(self):
        return _Process(rss=1 << 20, shared=0)

    def cpu_affinity(self):
        return self.affinity

    def cmdline(self):
        return [self.name]


def test_a_build_s_short_lived_jobs_are_named_by_the_build_on_this_process_s_cpus(monkeypatch):
    """make -j starts compilers that end between two walks of the processes: each needed two walks of its own to have a
    CPU figure, so none was ever named, nor make, whose own time is small. The time of the jobs make waited for (its
    children times) counts toward make, a job alive at the walk joins make's process group, and a long-lived job that
    ended (with its own child) is not counted twice. A build pinned to a CPU this process may not use is not named."""
    import time

    make = _Proc(10, "make", 1, own=1.0)
    ld = _Proc(13, "ld", 10, own=3.0)
    as_ = _Proc(14, "as", 13, own=2.0)
    editor = _Proc(20, "editor", 1, own=5.0)
    pinned = _Proc(30, "pinned-build", 1, affinity=(0,))
    kswapd, kworker = _Proc(40, "kswapd0", 2, own=1.0), _Proc(41, "kworker/1:1", 2, own=1.0)
    running = [make, ld, as_, editor, pinned, kswapd, kworker]
    groups = {10: 10, 12: 10, 13: 10, 14: 10, 20: 20, 30: 30, 40: 0, 41: 0}  # (0: the kernel's threads)
    monkeypatch.setattr(telemetry.psutil, "process_iter", lambda attrs=None: iter(list(running)))
    monkeypatch.setattr("os.getpgid", lambda pid: groups.get(pid, 999))
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {1})
    monkeypatch.setattr(telemetry.psutil, "cpu_percent", lambda interval, percpu=False: [100.0, 100.0])
    monkeypatch.setattr(telemetry.psutil, "cpu_times_percent", lambda interval, percpu=False: [_Steal(0.0)] * 2)
    monkeypatch.setattr(telemetry.psutil, "virtual_memory", lambda: _Memory(total=16 << 30, available=12 << 30))
    probe = telemetry.SystemProbe(nvml=False)
    probe.me = _Process(rss=1 << 30, shared=0)
    probe.sample()  # the first walk: which processes there are
    time.sleep(0.2)
    make.own += 0.01
    as_.own += 0.01   # as ends, waited for by ld, which ends, waited for by make
    ld.own += 0.02
    make.children += 0.1 + ld.own + as_.own  # and a compiler that started and ended between the walks, 0.1 s
    # a compiler running at the walk (its start time as psutil tells it, from the boot time in whole seconds, may read
    # as before the walk before)
    cc1 = _Proc(12, "cc1", 10, own=0.06, created=time.time() - 1.0)
    editor.own += 0.1
    pinned.own += 0.15
    kswapd.own += 0.03
    kworker.own += 0.02
    running[:] = [make, cc1, editor, pinned, kswapd, kworker]
    top = probe.sample()["top_cpu"]
    assert [p["name"] for p in top] == ["make and 1 process it started", "editor", "kswapd0", "kworker/1:1"]
    assert top[0]["cores"] / top[1]["cores"] == pytest.approx(2.0)  # make 0.01 + 0.1 + its jobs 0.03, cc1 0.06


def test_with_a_cpu_offline_the_cores_this_process_may_run_on_are_found_by_number(monkeypatch, tmp_path):
    """psutil's per-core list has the online CPUs in order, their numbers dropped: with CPU 2 of 8 offline, a
    workbench pinned to CPUs 6-7 (taskset) beside a build on both read entries 6 and 7 (CPU 7, and past the list's
    end): 'other processes use 0.9 of the 1 CPU cores this process may run on', and the walk that names them looked
    for processes allowed on CPUs 6 and 7 by those entries' positions, not their numbers."""
    from tests.test_gui_parts import warned
    from engine import host_load

    online = tmp_path / "online"
    online.write_text("0-1,3-7\n")
    monkeypatch.setattr(host_load, "ONLINE_CPUS", str(online), raising=False)
    monkeypatch.setattr(telemetry.psutil, "cpu_percent",
                        lambda interval, percpu=False: [0.0] * 5 + [100.0, 100.0])
    monkeypatch.setattr(telemetry.psutil, "cpu_times_percent", lambda interval, percpu=False: [_Steal(0.0)] * 7)
    monkeypatch.setattr(telemetry.psutil, "virtual_memory", lambda: _Memory(total=16 << 30, available=12 << 30))
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {6, 7})
    probe = telemetry.SystemProbe(nvml=False)
    probe.me = _Process(rss=1 << 30, shared=0, cores=0.1)
    walked = []
    monkeypatch.setattr(probe._walk, "walk", lambda ours: walked.append(ours) or ([], []))
    sample = probe.sample()
    assert sample["cpu_ours"] == [5, 6] and sample["others_cpu_cores"] == pytest.approx(1.9)
    assert walked == [{6, 7}]
    assert warned(dict(sample, gpu=None)) == [
        "Other processes use 1.9 of the 2 CPU cores this process may run on (of 7)."
        " The CPU expert kernels run on the cores they leave: pausing them speeds the answer."]


def test_a_group_whose_leader_only_waits_is_named_by_the_process_that_works(monkeypatch):
    """`timeout 600 python -m pytest` and `nohup python train.py` lead their process group while the python does the
    work: three such groups were warned about as 'timeout and 1 process it started (87%), timeout and 1 process it
    started (71%), ...', names that say neither what runs nor which is which. A leader that only waits for one busy
    process gives way to it; a build's make, whose jobs' time is its own, still names the build."""
    import time

    timeout = _Proc(50, "timeout", 1)
    pytest_ = _Proc(51, "python", 50, own=1.0)
    running = [timeout, pytest_]
    monkeypatch.setattr(telemetry.psutil, "process_iter", lambda attrs=None: iter(list(running)))
    monkeypatch.setattr("os.getpgid", lambda pid: {50: 50, 51: 50}.get(pid, 999))
    walk = telemetry.ProcessWalk(me=-1)
    walk.walk({0, 1})
    time.sleep(0.2)
    pytest_.own += 0.1
    top, _ = walk.walk({0, 1})
    assert [p["name"] for p in top] == ["python (started by timeout)"]
    assert top[0]["pid"] == 51 and top[0]["cores"] == pytest.approx(0.5, rel=0.2)
