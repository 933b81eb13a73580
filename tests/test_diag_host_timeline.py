"""benchmarks/diag_host_timeline.py: a "both" layer's host chain from one gate to the next, from timed events."""

import pytest

from benchmarks.diag_host_timeline import Timeline, main, report, summarise

US = 1e-6


def test_the_chain_between_gates_is_read_in_its_most_common_order():
    timeline = Timeline()
    events = [("gate", 0, 1), ("dense", 3, 13), ("launch", 15, 35), ("wait", 40, 45), ("cpu", 46, 146),
              ("gate", 147, 150), ("dense", 152, 162), ("launch", 165.5, 185.5), ("wait", 190.5, 195.5),
              ("cpu", 196.5, 296.5), ("gate", 297.5, 300.5),
              ("dense", 302, 310)]  # (a step's tail: no gate after it, not a stretch)
    timeline.events = [(name, start * US, end * US) for name, start, end in events]
    order, rows, count, total = summarise(timeline)
    assert order == ("dense", "launch", "wait", "cpu", "gate") and (count, total) == (2, 2)
    got = {name: (round(gap, 3), round(span, 3)) for name, gap, span in rows}
    assert got == {"dense": (2.0, 10.0), "launch": (2.75, 20.0), "wait": (5.0, 5.0), "cpu": (1.0, 100.0),
                   "gate": (1.0, 3.0)}
    # gaps 2 + 2.75 + 5 before the wait, dense 10 and launch 20 between
    assert "the host's work from a gate to its wait for the next routing: 39.8 µs" in report(timeline)


def test_an_event_inside_another_is_part_of_it():
    class Owner:
        def outer(self):
            return self.inner() + 1

        def inner(self):
            return 1

    timeline = Timeline()
    timeline.wrap(Owner, "outer", "launch")
    timeline.wrap(Owner, "inner", "cpu")
    timeline.recording = True
    assert Owner().outer() == 2 and Owner().inner() == 1
    timeline.unwrap()
    assert [name for name, _, _ in timeline.events] == ["launch", "cpu"]
    assert Owner.outer.__name__ == "outer"  # the class as it was


@pytest.mark.parametrize("ahead", [False, True])
def test_on_the_standin_each_layer_launches_waits_computes_and_raises_its_gate(capsys, ahead):
    import tests.test_offload as test_offload
    from engine import decoder

    spec = test_offload.SPEC
    main(["--standin", "--steps", "4", "--warmup", "4"] + (["--ahead"] if ahead else []))
    assert test_offload.SPEC is spec and decoder.launch_ahead is False  # as they were, for the tests after
    out = capsys.readouterr().out
    assert f"launch ahead {'on' if ahead else 'off'}" in out
    events = [line.split()[0] for line in out.splitlines() if line.strip().split(" ")[0] in
              ("dense", "launch", "wait", "cpu", "gate")]
    assert [e for e in events if e != "dense"] == ["launch", "wait", "cpu", "gate"]
    assert "the host's work from a gate to its wait for the next routing" in out


def test_the_header_gives_every_layers_split_table(capsys, monkeypatch):
    """The header line gave the first layer's table alone ("CPU takes [...] of c cold"), though each layer has its own
    (another expert size, or fixed tables of their own, as here): each distinct table is given with its layers."""
    import numpy as np

    import benchmarks.diag_host_timeline as diag

    own = np.array([0, 1, 1, 2, 2, 3, 3, 4, 4], dtype=np.int32)
    others = np.array([0, 0, 1, 1, 2, 2, 3, 3, 4], dtype=np.int32)
    on_standin = diag.on_standin

    def with_fixed_tables(args):  # layer 2's table of its own
        model, timeline = on_standin(args)
        model.offload.fix_split_tables(lambda layer: (own if layer == 2 else others, None))
        return model, timeline

    monkeypatch.setattr(diag, "on_standin", with_fixed_tables)
    main(["--standin", "--steps", "2", "--warmup", "2"])
    header = capsys.readouterr().out.splitlines()[0]
    assert (", CPU takes [0, 0, 1, 1, 2, 2, 3, 3, 4] of c cold in layers 0-1, 3 and [0, 1, 1, 2, 2, 3, 3, 4, 4] in "
            "layer 2 (fixed tables") in header, header
