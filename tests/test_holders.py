"""tests/holders.py: the chain that keeps an object alive, as a failing test's message gives it."""

import threading

from tests.holders import holders

KEPT = {}


class Model:
    pass


def test_a_module_global_that_keeps_an_object_is_named_with_its_key():
    model = Model()
    KEPT["last"] = [model]
    try:
        chain = holders(model)
    finally:
        KEPT.clear()
    assert "globals of tests.test_holders['KEPT'] -> dict of 1['last'] -> list of 1 -> Model" in chain


def test_a_running_thread_that_keeps_an_object_is_named():
    model, release = Model(), threading.Event()

    def serve(held):
        release.wait(10)

    thread = threading.Thread(target=serve, args=(model,))
    thread.start()
    try:
        chain = holders(model)
    finally:
        release.set()
        thread.join()
    assert "globals of threading['_active'] -> dict of " in chain and chain.endswith("-> Thread -> tuple of 1 -> Model")
