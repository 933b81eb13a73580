"""benchmarks/competing_load.py: the burst of other work diag_path_trials starts at a chosen decode step."""

import time

from benchmarks.competing_load import CompetingLoad


def test_the_burst_starts_when_told_and_lasts_its_milliseconds():
    with CompetingLoad(processes=2, ms=300, buffer_mb=4) as load:
        time.sleep(0.2)  # ready and waiting: no burst yet
        assert all(child.poll() is None for child in load.children)
        started = time.perf_counter()
        load.start()
        codes = load.close()
        elapsed = time.perf_counter() - started
    assert codes == [0, 0]
    assert 0.3 <= elapsed < 5.0


def test_children_never_started_are_stopped_without_their_burst():
    load = CompetingLoad(processes=2, ms=60_000, buffer_mb=4)
    started = time.perf_counter()
    codes = load.close()
    assert time.perf_counter() - started < 5.0
    assert all(code != 0 for code in codes)
