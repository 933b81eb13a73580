"""engine/host_load.py: the shares of the CPUs' time that other guests (steal) and other processes took while a
benchmark timed something."""
from __future__ import annotations

import time
from collections import namedtuple

import pytest

from engine import host_load

Machine = namedtuple("Machine", "user nice system idle iowait irq softirq steal guest guest_nice")
Own = namedtuple("Own", "user system children_user children_system")


def scripted(monkeypatch, machines, owns):
    machines, owns = iter(machines), iter(owns)
    monkeypatch.setattr(host_load.psutil, "cpu_times", lambda percpu=False: [next(machines)])
    monkeypatch.setattr(host_load.psutil, "Process", lambda: type("P", (), {"cpu_times": lambda self: next(owns)})())


def test_the_shares_are_of_all_cpus_time_between_the_meter_and_the_read(monkeypatch):
    # 100 CPU-seconds pass: 30 busy (user + system + irq + softirq; 5 of user were a guest's, counted in user
    # already), 50 idle, 5 iowait, 15 stolen; this process used 12 of the 30
    scripted(monkeypatch,
             [Machine(100, 0, 50, 500, 10, 0, 0, 20, 3, 0), Machine(120, 0, 58, 550, 15, 1, 1, 35, 8, 0)],
             [Own(10, 2, 0, 0), Own(19, 5, 0, 0)])
    load = host_load.HostLoadMeter().read()
    assert load.steal == pytest.approx(15 / 100)
    assert load.others == pytest.approx((30 - 12) / 100)
    assert load.as_dict() == {"host_steal_share": load.steal, "host_others_share": load.others}
    assert load.describe() == "steal 15.0%, other processes 18.0% of the CPUs' time"


def test_no_time_passed_reads_zero_and_this_process_alone_reads_no_others(monkeypatch):
    same = Machine(100, 0, 50, 500, 10, 0, 0, 20, 0, 0)
    scripted(monkeypatch, [same, same], [Own(1, 1, 0, 0), Own(1, 1, 0, 0)])
    assert host_load.HostLoadMeter().read() == host_load.HostLoad(0.0, 0.0)
    # all the busy time was ours (more than the machine's count, by the clocks' ticks): no negative share
    scripted(monkeypatch, [same, same._replace(user=110, idle=600)], [Own(0, 0, 0, 0), Own(11, 0, 0, 0)])
    assert host_load.HostLoadMeter().read() == host_load.HostLoad(0.0, 0.0)


def test_on_this_machine_the_shares_are_fractions():
    meter = host_load.HostLoadMeter()
    end = time.perf_counter() + 0.2
    while time.perf_counter() < end:
        pass
    load = meter.read()
    assert 0.0 <= load.steal <= 1.0 and 0.0 <= load.others <= 1.0


def test_with_children_the_worker_processes_this_one_waited_for_are_its_own_work(monkeypatch):
    # 100 CPU-seconds pass, 30 busy: this process used 5, the indexing workers it started and waited for 20
    before, after = Machine(100, 0, 50, 500, 10, 0, 0, 0, 0, 0), Machine(130, 0, 50, 570, 10, 0, 0, 0, 0, 0)
    owns = [Own(10, 0, 0, 0), Own(15, 0, 15, 5)]
    scripted(monkeypatch, [before, after], owns)
    assert host_load.HostLoadMeter().read().others == pytest.approx(25 / 100)  # the workers are other processes
    scripted(monkeypatch, [before, after], owns)
    assert host_load.HostLoadMeter(children=True).read().others == pytest.approx(5 / 100)


def test_only_the_cpus_this_process_may_run_on_count(monkeypatch):
    """A record made with the workbench pinned to CPU 1 (taskset) and a build pinned to CPU 0: the build's 50 busy
    CPU-seconds read as other processes' 25% of the two CPUs' time, a disturbed run; on CPU 1 nothing else ran."""
    quiet = Machine(0, 0, 0, 100, 0, 0, 0, 0, 0, 0)
    cpus = iter([[quiet, quiet], [quiet._replace(user=50, idle=150), quiet._replace(user=20, idle=180)]])

    def cpu_times(percpu=False):
        per_cpu = next(cpus)
        return per_cpu if percpu else Machine._make(map(sum, zip(*per_cpu)))

    monkeypatch.setattr(host_load.psutil, "cpu_times", cpu_times)
    owns = iter([Own(0, 0, 0, 0), Own(20, 0, 0, 0)])
    monkeypatch.setattr(host_load.psutil, "Process", lambda: type("P", (), {"cpu_times": lambda self: next(owns)})())
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {1})
    assert host_load.HostLoadMeter().read() == host_load.HostLoad(0.0, 0.0)


def test_with_a_cpu_offline_psutil_s_entries_are_the_online_cpus_in_order(monkeypatch, tmp_path):
    """psutil's per-CPU entries are /proc/stat's lines for the online CPUs, their numbers dropped: with CPU 2 of 8
    offline, entry 2 is CPU 3. Pinned to CPUs 6-7 (taskset), the meter read entries 6 and beyond (CPU 7 only, its
    other entry out of range): a build on CPU 6 (entry 5) was not seen."""
    online = tmp_path / "online"
    online.write_text("0-1,3-7\n")
    monkeypatch.setattr(host_load, "ONLINE_CPUS", str(online))
    assert host_load.cpu_numbers(7) == [0, 1, 3, 4, 5, 6, 7]
    assert host_load.cpu_numbers(8) == list(range(8))  # the lists disagree (a CPU came online between): by position
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {6, 7})
    assert host_load.our_cpus(7) == [5, 6]
    quiet = Machine(0, 0, 0, 100, 0, 0, 0, 0, 0, 0)
    idle, busy = quiet._replace(idle=200), quiet._replace(user=100)  # CPU 6: the build, the whole time
    cpus = iter([[quiet] * 7, [idle] * 5 + [busy, idle]])
    monkeypatch.setattr(host_load.psutil, "cpu_times", lambda percpu=False: next(cpus))
    owns = iter([Own(0, 0, 0, 0), Own(0, 0, 0, 0)])
    monkeypatch.setattr(host_load.psutil, "Process", lambda: type("P", (), {"cpu_times": lambda self: next(owns)})())
    assert host_load.HostLoadMeter().read() == host_load.HostLoad(0.0, 0.5)


def test_without_the_online_list_entry_i_is_cpu_i(monkeypatch, tmp_path):
    monkeypatch.setattr(host_load, "ONLINE_CPUS", str(tmp_path / "missing"))
    assert host_load.cpu_numbers(4) == [0, 1, 2, 3]
    (tmp_path / "garbled").write_text("0-x\n")
    monkeypatch.setattr(host_load, "ONLINE_CPUS", str(tmp_path / "garbled"))
    assert host_load.cpu_numbers(4) == [0, 1, 2, 3]


def test_a_cpu_put_offline_during_the_run_does_not_break_the_read(monkeypatch, tmp_path):
    """A CPU put offline (a VM's vCPU taken away) while a record ran: the meter indexed psutil's now shorter list by
    the positions it took at the start and raised IndexError at the run's end, losing the record. The CPUs there at
    both reads count, each by its number: CPU 2, entry 2 at the start and entry 1 at the end."""
    online = tmp_path / "online"
    monkeypatch.setattr(host_load, "ONLINE_CPUS", str(online))
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})
    quiet = Machine(0, 0, 0, 100, 0, 0, 0, 0, 0, 0)
    lists = iter([("0-2", [quiet] * 3), ("0,2", [quiet._replace(idle=200), quiet._replace(user=50, idle=150)])])

    def cpu_times(percpu=False):
        text, per_cpu = next(lists)
        online.write_text(text + "\n")
        return per_cpu

    monkeypatch.setattr(host_load.psutil, "cpu_times", cpu_times)
    owns = iter([Own(0, 0, 0, 0), Own(0, 0, 0, 0)])
    monkeypatch.setattr(host_load.psutil, "Process", lambda: type("P", (), {"cpu_times": lambda self: next(owns)})())
    assert host_load.HostLoadMeter().read() == host_load.HostLoad(0.0, 0.25)  # CPU 2 half busy, CPU 0 idle
