"""engine/collection_hold.py: no cyclic garbage collection inside decoder steps, the same collection after them."""
from __future__ import annotations

import gc
import threading

from engine.collection_hold import collection_held
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
            for _ in range(20_000):  # allocations enough to cross the collection's threshold
                [object()]
            return forward(*args)
        finally:
            seen["in_step"] = False

    model.decoder._run_steps = run_steps
    greedy_run(model, steps=2)
    gc.collect()
    assert seen["finalized"] >= 9 and seen["finalized_in_step"] == 0
