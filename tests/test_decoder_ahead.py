"""PartitionedDecoder's "both" layers launched ahead (engine/decoder.py: _run_steps): a layer's host part waits until
the next dense segment's replay and the next layer are launched, and only then. Fake runners record the order of what
the decoder asks of them; the GPU tests (test_dense_device.py) run the real ones against the all-CPU model."""

from types import SimpleNamespace

import numpy as np
import pytest

from engine import decoder
from engine.decoder import PartitionedDecoder
from engine.dense_segment import DenseSegment
from engine.kernel_threads import KernelThreads


class FakeDense(DenseSegment):
    """A dense segment whose replay can (`replays`) or cannot be launched again; its output is its input plus one."""

    def __init__(self, name: str, source: str, output: str, log: list, replays: bool = True):
        self.name, self.source, self.output, self.log, self.replays = name, source, output, log, replays
        self.decode_bindings = None

    def run_again(self, values, state, decode=False):
        if not self.replays:
            return None
        self.log.append(("again", self.name))  # (a launch: nothing read on the host)
        return {self.output: _Later(values[self.source], 1)}

    def run(self, values, state, decode=False):
        self.log.append(("run", self.name, _read(values[self.source])))
        return {self.output: _read(values[self.source]) + 1}


class _Later:
    """A value the "GPU" writes later in stream order: readable once every gate before it is raised (_read)."""

    def __init__(self, source, add: int, gate: dict | None = None):
        self.source, self.add, self.gate = source, add, gate


def _read(value):
    if isinstance(value, _Later):
        if value.gate is not None and not value.gate["open"]:
            raise AssertionError("read behind a closed gate")
        return _read(value.source) + value.add
    return value


class FakeStep:
    """SplitStep's interface: the result known at the launch where the merge is queued (`gated`)."""

    def __init__(self, node, source, gated: bool, late: bool, gave_up: bool = False):
        self.node, self.gate, self.late, self.done = node, {"open": False}, late, False
        self.gave_up = gave_up  # the device's word that the merge gave up (read after the step)
        self.value = _Later(source, 10, self.gate)
        self.result_ahead = self.value if gated else None

    def finish_alone(self):
        return self.finish()

    def finish(self, ahead: bool = False, queued: bool = False):
        self.node.log.append(("finish", self.node.name, ahead))
        if self.node.fails:
            raise RuntimeError(f"{self.node.name} failed")
        self.gate["open"] = self.done = True
        return self.value

    def abandon(self):
        if not self.done:
            self.node.log.append(("abandon", self.node.name))
            self.gate["open"] = self.done = True


class FakeNode:
    """An expert layer that launches ahead (`both`: a "both" step, its merge queued at the launch where `gated`) or
    runs whole; its output is its input plus ten."""

    def __init__(self, name: str, source: str, output: str, log: list, both=True, gated=True, late=False, fails=False,
                 gave_up=False):
        self.name, self.source, self.log = name, source, log
        self.both, self.gated, self.late, self.fails, self.gave_up = both, gated, late, fails, gave_up
        self.info = SimpleNamespace(output=output)

    def launch_ahead(self, values):
        if not self.both:
            return None
        self.log.append(("launch", self.name))
        return FakeStep(self, values[self.source], self.gated, self.late, self.gave_up)

    def run(self, values):
        self.log.append(("run", self.name, _read(values[self.source])))
        # (HybridExpertNode.run: the "both" step it finished, whose merge the decoder asks about after the step)
        self.last_split = FakeStep(self, values[self.source], self.gated, self.late, self.gave_up) if self.both \
            else None
        return _read(values[self.source]) + 10


def make_decoder(runners) -> PartitionedDecoder:
    model = PartitionedDecoder.__new__(PartitionedDecoder)
    model.steps, model.dense, model.logits_name, model.on_step_end = runners, None, "logits", None
    model.before_last_segment = None
    model.profile = {"steps": 0, "dense_s": 0.0, "experts_s": 0.0, "total_s": 0.0}
    model.steps_run_again = model.layers_ahead = model.layers_beside = 0
    model._pool_here, model._worker_took, model._layers_done = True, False, None
    model.kernel_threads = KernelThreads([], 1)  # no CPU kernels to set
    model.source = SimpleNamespace(check_mapped_files=lambda: None)  # no data file mapped
    return model


def layers(log, count: int, **node) -> list:
    """dense0, node0, dense1, node1, ... dense{count}: h0 → x0 → y0 → x1 → ... → logits."""
    runners = []
    for i in range(count):
        runners.append(FakeDense(f"dense{i}", "h0" if i == 0 else f"y{i - 1}", f"x{i}", log))
        runners.append(FakeNode(f"node{i}", f"x{i}", f"y{i}", log, **node))
    runners.append(FakeDense(f"dense{count}", f"y{count - 1}", "logits", log, replays=False))
    return runners


def test_a_layers_host_part_waits_until_the_next_dense_segment_and_layer_are_launched():
    log = []
    model = make_decoder(layers(log, 3))
    values = {"h0": 0}
    _dense, _experts, late = model._run_steps(values, None, True)
    assert not late and _read(values["logits"]) == 34  # 0 + 1, + 10, + 1, + 10, + 1, + 10, + 1
    assert log == [("run", "dense0", 0), ("launch", "node0"),
                   ("again", "dense1"), ("launch", "node1"), ("finish", "node0", True),
                   ("again", "dense2"), ("launch", "node2"), ("finish", "node1", True),
                   # the last segment runs onnxruntime (no replay): the waiting layer is finished first, with nothing
                   # queued behind its merge
                   ("finish", "node2", False), ("run", "dense3", 33)]
    assert model.layers_ahead == 2


def test_without_launch_ahead_every_layer_runs_whole_in_turn():
    log = []
    model = make_decoder(layers(log, 2))
    values = {"h0": 0}
    model._run_steps(values, None, False)
    assert values["logits"] == 23
    assert log == [("run", "dense0", 0), ("run", "node0", 1), ("run", "dense1", 11), ("run", "node1", 12),
                   ("run", "dense2", 22)]
    assert model.layers_ahead == 0


def test_a_segment_that_cannot_be_launched_again_finishes_the_waiting_layer_before_its_run():
    log = []
    runners = layers(log, 2)
    runners[2].replays = False  # dense1: an onnxruntime run (it may wait for the GPU)
    model = make_decoder(runners)
    values = {"h0": 0}
    model._run_steps(values, None, True)
    assert values["logits"] == 23
    assert log[:5] == [("run", "dense0", 0), ("launch", "node0"), ("finish", "node0", False), ("run", "dense1", 11),
                       ("launch", "node1")]


def test_a_step_whose_merge_is_not_queued_at_the_launch_is_finished_at_once_after_the_waiting_one():
    log = []
    runners = layers(log, 3)
    runners[3].gated = False  # node1: its merge is queued by its host part (a first launch of a shape)
    model = make_decoder(runners)
    values = {"h0": 0}
    model._run_steps(values, None, True)
    assert _read(values["logits"]) == 34
    assert log[:7] == [("run", "dense0", 0), ("launch", "node0"), ("again", "dense1"), ("launch", "node1"),
                       ("finish", "node0", True), ("finish", "node1", False), ("run", "dense2", 22)]


def test_a_layer_that_does_not_launch_ahead_runs_after_the_waiting_one_is_finished():
    log = []
    runners = layers(log, 2)
    runners[3].both = False  # node1: the tier's step, or a layer on the CPU
    model = make_decoder(runners)
    values = {"h0": 0}
    model._run_steps(values, None, True)
    assert values["logits"] == 23
    assert log[:5] == [("run", "dense0", 0), ("launch", "node0"), ("again", "dense1"), ("finish", "node0", True),
                       ("run", "node1", 12)]


def test_a_failed_host_part_lets_the_gpu_past_the_gates_of_the_layers_launched_and_raises():
    log = []
    runners = layers(log, 3)
    runners[3].fails = True  # node1's host part
    model = make_decoder(runners)
    with pytest.raises(RuntimeError, match="node1 failed"):
        model._run_steps({"h0": 0}, None, True)
    # node2 was launched behind node1 when node1's host part failed: both gates raised
    assert log[-3:] == [("finish", "node1", True), ("abandon", "node1"), ("abandon", "node2")]


class FakeState:
    def __init__(self):
        self.past_length = 0
        self.backend = SimpleNamespace(device_type="cpu")

    def step_inputs(self, token_ids):
        return {"h0": np.array([float(self.past_length)])}

    def advance(self, count):
        self.past_length += count


@pytest.mark.parametrize("node,flag", [(0, "late"), (0, "gave_up"), (1, "gave_up")],
                         ids=["late-gate-work-behind-it", "gave-up-work-behind-it", "gave-up-nothing-behind-it"])
def test_a_late_gate_with_work_behind_it_or_a_merge_that_gave_up_runs_the_step_again(monkeypatch, node, flag):
    """late: node0's gate raised after its merge may have given up, node1 queued behind it. gave_up: the host's clock
    judged the gate in time, the device's word says the merge gave up (node1: nothing queued behind it)."""
    log = []
    runners = layers(log, 2)
    setattr(runners[2 * node + 1], flag, True)
    model = make_decoder(runners)
    monkeypatch.setattr(decoder, "launch_ahead", True)
    state = FakeState()
    logits = model.forward(state, [5])
    assert float(logits.ravel()[0]) == 23.0 and state.past_length == 1
    assert model.steps_run_again == 1
    # the first pass launched ahead; the second ran every layer whole
    assert log[-5:] == [("run", "dense0", 0.0), ("run", "node0", 1.0), ("run", "dense1", 11.0),
                        ("run", "node1", 12.0), ("run", "dense2", 22.0)]
    assert ("finish", "node0", True) in log[:-5]


def test_without_launch_ahead_a_step_whose_merge_gave_up_in_a_layers_run_runs_again(monkeypatch):
    log = []
    runners = layers(log, 2)
    runners[3].gave_up = True  # node1's run(): its merge gave up, though its gate was judged in time
    model = make_decoder(runners)
    monkeypatch.setattr(decoder, "launch_ahead", False)
    logits = model.forward(FakeState(), [5])
    assert float(logits.ravel()[0]) == 23.0 and model.steps_run_again == 1
    assert [entry[:2] for entry in log] == [("run", "dense0"), ("run", "node0"), ("run", "dense1"), ("run", "node1"),
                                            ("run", "dense2")] * 2


def test_a_late_gate_with_nothing_behind_it_is_left_to_the_layer(monkeypatch):
    """(merge_split merges again in place where it can: nothing has read the sum yet)"""
    log = []
    runners = layers(log, 1)
    runners[1].late = True
    model = make_decoder(runners)
    monkeypatch.setattr(decoder, "launch_ahead", True)
    model.forward(FakeState(), [5])
    assert model.steps_run_again == 0 and ("finish", "node0", False) in log
