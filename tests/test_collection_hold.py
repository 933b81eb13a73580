"""engine/collection_hold.py: no cyclic garbage collection inside decoder steps (the same collection after them),
and the window's timer in place of automatic collection."""
from __future__ import annotations

import gc
import threading
import weakref

from engine.collection_hold import collect_on_timer, collect_unless_held, collection_held
from tests.test_offload import greedy_run, model_folder  # noqa: F401 (fixture)


def test_the_collection_is_held_while_any_step_runs_and_restored_after_the_last():
    assert gc.isenabled()
    inside, release = threading.Event(), threading.Event()

    def other_step():
        with collection_held():
            inside.set()
            release.wait(10)

    other = threading.Thread(target=other_step)
    other.start()
    inside.wait(10)
    with collection_held():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other step still runs
    release.set()
    other.join(10)
    assert gc.isenabled()


def test_a_collection_switched_off_before_stays_off():
    gc.disable()
    try:
        with collection_held():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_step_that_raises_restores_the_collection():
    try:
        with collection_held():
            raise ValueError("a step failed")
    except ValueError:
        pass
    assert gc.isenabled()


def test_no_finalizer_runs_inside_a_decoder_step(model_folder):  # noqa: F811
    from engine.generation import LoadedModel

    model = LoadedModel.open(model_folder)
    seen = {"in_step": False, "finalized_in_step": 0, "finalized": 0}

    class Cycle:  # garbage only a collection frees, whose finalizer notes when it ran
        def __init__(self):
            self.me = self

        def __del__(self):
            seen["finalized"] += 1
            seen["finalized_in_step"] += seen["in_step"]

    forward = model.decoder._run_steps

    def run_steps(*args):
        seen["in_step"] = True
        try:
            for _ in range(3):
                Cycle()
            kept = [[] for _ in range(2_000)]  # generation 0's count past the collection's threshold
            del kept
            return forward(*args)
        finally:
            seen["in_step"] = False

    model.decoder._run_steps = run_steps
    greedy_run(model, steps=2)
    gc.collect()
    assert seen["finalized"] >= 9 and seen["finalized_in_step"] == 0


def test_a_window_takes_automatic_collection_over_until_it_lets_go():
    release = collect_on_timer()
    try:
        assert not gc.isenabled()
        with collection_held():  # a step meanwhile leaves it off
            assert not collect_unless_held(0)
        assert not gc.isenabled()
        assert collect_unless_held(0)  # the window's own collections run between steps
    finally:
        release()
    assert gc.isenabled()
    release()  # a second release changes nothing
    assert gc.isenabled()


def test_a_collection_asked_for_runs_only_where_no_step_holds_it_off():
    class Cycle:
        def __init__(self):
            self.me = self

    gc.disable()  # only explicit collections from here
    try:
        garbage = weakref.ref(Cycle())
        with collection_held():
            assert not collect_unless_held() and garbage() is not None
        assert collect_unless_held() and garbage() is None
    finally:
        gc.enable()
