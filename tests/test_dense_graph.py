"""engine/dense_graph.py on the CPU, with a stand-in for CuPy's stream capture: when a segment's run is captured,
replayed, given up on, and how its host inputs reach the device. The GPU test (test_dense_device.py,
test_cuda_dense_graphs_replay_what_onnxruntime_runs) checks replayed decoding against onnxruntime's own runs."""

from types import SimpleNamespace

import numpy as np
import pytest

from engine import dense_graph
from engine.dense_graph import MAX_GRAPHS, WARM_RUNS, SegmentGraphs


class FakeStream:
    ptr = 77

    def __init__(self, log):
        self.log = log
        self.capturing = False

    def begin_capture(self, mode=None):
        self.log.append(("begin", mode))
        self.capturing = True

    def end_capture(self):
        self.log.append(("end",))
        self.capturing = False
        return SimpleNamespace(launch=lambda stream: self.log.append(("launch", stream.ptr)))


class FakeBackend:
    def __init__(self):
        self.log = []
        self.stream = FakeStream(self.log)
        runtime = SimpleNamespace(streamCaptureModeRelaxed=2,
                                  memcpyAsync=lambda dst, src, n, kind, stream: self.log.append(("copy", n, kind, stream)))
        buffers = self

        class Array(np.ndarray):
            @property
            def data(self):
                return SimpleNamespace(ptr=self.ctypes.data)

        def empty(shape, dtype):
            buffers.log.append(("alloc", tuple(shape)))
            return np.empty(shape, dtype).view(Array)

        self.xp = SimpleNamespace(cuda=SimpleNamespace(runtime=runtime), empty=empty)

    def _scope(self):
        import contextlib
        return contextlib.nullcontext()


def test_a_key_is_captured_after_its_warm_runs_then_replayed():
    backend = FakeBackend()
    graphs = SegmentGraphs(backend, frozenset(), {})
    key = ((1, (1, 8)),)
    assert not graphs.replay(key)
    assert [graphs.due(key) for _ in range(WARM_RUNS + 1)] == [False] * WARM_RUNS + [True]
    ran = []
    assert graphs.capture(key, lambda: ran.append(backend.stream.capturing))
    assert ran == [True]  # onnxruntime's run happened under capture, relaxed (its arena may allocate)
    assert backend.log == [("begin", 2), ("end",), ("launch", 77)]  # and the captured graph ran once
    assert graphs.replay(key) and backend.log[-1] == ("launch", 77)
    assert not graphs.replay(((2, (1, 8)),))  # other buffers: not this graph


def test_a_runs_key_is_its_buffers_pointers_and_shapes_read_again_only_for_other_arrays():
    class Buffer:
        """A device array: reading `.data` is counted (CuPy makes an object each time)."""
        reads = 0

        def __init__(self, ptr, shape):
            self._ptr, self.shape = ptr, shape

        @property
        def data(self):
            Buffer.reads += 1
            return SimpleNamespace(ptr=self._ptr)

    graphs = SegmentGraphs(FakeBackend(), frozenset(), {})
    x, kv, out = Buffer(100, (1, 8)), Buffer(200, (1, 2, 64, 8)), Buffer(300, (1, 8))
    key = graphs.key_of([x, kv, out])
    assert key == ((100, (1, 8)), (200, (1, 2, 64, 8)), (300, (1, 8))) and Buffer.reads == 3
    assert graphs.key_of([x, kv, out]) is key and Buffer.reads == 3  # a decode step's same arrays: nothing read
    grown = Buffer(400, (1, 2, 128, 8))  # the KV buffer grew: a new array
    assert graphs.key_of([x, grown, out]) == ((100, (1, 8)), (400, (1, 2, 128, 8)), (300, (1, 8)))
    assert Buffer.reads == 6
    assert graphs.key_of([x, grown]) == ((100, (1, 8)), (400, (1, 2, 128, 8)))  # fewer arrays
    same_place = Buffer(100, (1, 8))  # another object at the same pointer: read, the same key
    assert graphs.key_of([same_place, grown]) == ((100, (1, 8)), (400, (1, 2, 128, 8))) and Buffer.reads == 10
    graphs.forget_key()  # a prompt's run: the arrays are not kept
    assert graphs.key_of([same_place, grown]) == ((100, (1, 8)), (400, (1, 2, 128, 8))) and Buffer.reads == 12


def test_a_run_that_fails_under_capture_ends_it_and_stops_capturing_for_the_binding():
    backend = FakeBackend()
    graphs = SegmentGraphs(backend, frozenset(), {})

    def run():
        raise RuntimeError("CUDA failure 900: operation not permitted when stream is capturing\nmore detail")

    assert not graphs.capture(("k",), run)
    assert backend.log == [("begin", 2), ("end",)]
    assert graphs.failed == "onnxruntime's run under capture: CUDA failure 900: operation not permitted when stream " \
                            "is capturing"
    assert not graphs.replay(("k",))


def test_graphs_captured_before_a_dense_session_was_created_on_the_gpu_are_captured_again():
    """A session created later (another model loaded) may keep buffers in a graph's scratch: the graph is dropped."""
    backend = FakeBackend()
    graphs = SegmentGraphs(backend, frozenset(), {})
    key = ((1, (1, 8)),)
    assert graphs.capture(key, lambda: None) and graphs.replay(key)
    dense_graph.arena_changed()
    assert not graphs.replay(key) and not graphs.replay(key)  # dropped, not replayed again
    assert [graphs.due(key) for _ in range(WARM_RUNS + 1)] == [False] * WARM_RUNS + [True]  # warm runs again
    assert graphs.capture(key, lambda: None) and graphs.replay(key)
    other = ((2, (1, 8)),)
    dense_graph.arena_changed()  # a capture after the change: the older graphs go, the new one replays at once
    assert graphs.capture(other, lambda: None) and graphs.replay(other) and not graphs.replay(key)


def test_old_graphs_give_way_to_new_keys():
    graphs = SegmentGraphs(FakeBackend(), frozenset(), {})
    keys = [(i,) for i in range(MAX_GRAPHS + 1)]
    for key in keys:
        assert graphs.capture(key, lambda: None)
    assert not graphs.replay(keys[0]) and all(graphs.replay(key) for key in keys[1:])


def test_host_inputs_read_on_the_device_go_through_one_buffer_per_model():
    backend = FakeBackend()
    graphs = SegmentGraphs(backend, frozenset({"total_sequence_length"}), {})
    later = SegmentGraphs(backend, frozenset({"total_sequence_length"}), {})  # the next segment of the step
    first = graphs.stage("seqlens_k", np.array([5], np.int32))
    assert later.stage("seqlens_k", np.array([5], np.int32)) is first  # the same values: no second copy
    again = graphs.stage("seqlens_k", np.array([6], np.int32))
    assert again is first  # the same device buffer at every step: the graph's pointer
    assert backend.log == [("alloc", (1,)), ("copy", 4, 1, 77), ("copy", 4, 1, 77)]
    grown = graphs.stage("seqlens_k", np.array([[6, 7]], np.int32))
    assert grown is not first and grown.shape == (1, 2) and backend.log[-1] == ("copy", 8, 1, 77)
    other = SegmentGraphs(FakeBackend(), frozenset(), {})  # another model: buffers of its own
    assert other.stage("seqlens_k", np.array([[6, 7]], np.int32)) is not grown


def test_a_replay_is_launched_again_only_onto_the_same_arrays_and_staging(monkeypatch):
    """LastReplay (the next decode step's launch of a segment's replay without its run): launched again while the
    bound device arrays and state buffers are the very objects, the host inputs staged into the same buffer (this
    step's values copied there first); not where any of them is another, the arena changed, or replays are off."""
    backend = FakeBackend()
    graphs = SegmentGraphs(backend, frozenset(), {})
    assert graphs.capture(("k",), lambda: None)
    graph = graphs.replay(("k",))
    hidden, kv = np.zeros(8, np.float32), [np.zeros(4, np.float16), np.zeros(4, np.float16)]
    staged = graphs.stage("seqlens_k", np.array([5], np.int32))
    results = {"out": np.zeros(8, np.float32)}
    last = dense_graph.LastReplay(graphs, graph, (("hidden", hidden),), (("seqlens_k", staged),), tuple(kv), results)
    replays, log = graphs.replays, len(backend.log)
    values = {"hidden": hidden, "seqlens_k": np.array([6], np.int32)}
    again = last.launch(values, list(kv))
    assert again == results and again is not results and graphs.replays == replays + 1
    assert backend.log[log:] == [("copy", 4, 1, 77), ("launch", 77)]  # this step's lengths, then the graph
    assert last.launch({**values, "hidden": hidden.copy()}, list(kv)) is None  # another array bound
    assert last.launch(values, [kv[0], kv[1].copy()]) is None  # a KV buffer made again (grown)
    with monkeypatch.context() as patch:
        patch.setattr(dense_graph, "enabled", False)
        assert last.launch(values, list(kv)) is None
    with monkeypatch.context() as patch:
        patch.setattr(dense_graph, "_arena_generation", dense_graph._arena_generation + 1)  # a session made since
        assert last.launch(values, list(kv)) is None
    assert last.launch(values, list(kv)) == results  # each of those alone was what stopped it
    assert last.launch({**values, "seqlens_k": np.array([[6, 7]], np.int32)}, list(kv)) is None  # staged elsewhere
    assert graphs.replays == replays + 2 and backend.log.count(("launch", 77)) == 4  # the capture's, replay, 2 again


def test_a_binding_remembers_its_replay_by_what_it_bound_and_staged():
    """SegmentBinding._remember: the cut tensors given as device arrays are checked by identity, the host ones that
    are staged by their buffer; total_sequence_length (the capacity) and inputs onnxruntime reads on the host are
    neither (the state buffers stand for the capacity)."""
    from engine.dense_segment import SegmentBinding

    backend = FakeBackend()
    graphs = SegmentGraphs(backend, frozenset({"total_sequence_length"}), {"total_sequence_length": None})
    hidden = SimpleNamespace(shape=(1, 4))  # a device array: not a NumPy array to the binding
    kv = SimpleNamespace(array=np.zeros(2), present=np.zeros(2))
    binding = SimpleNamespace(cut=["hidden", "seqlens_k", "total_sequence_length"], state_inputs=[("past", kv)],
                              state_outputs=[("present", kv)], _on_device=SimpleNamespace(results={"out": hidden}))
    binding._state_arrays = lambda: SegmentBinding._state_arrays(binding)
    values = {"hidden": hidden, "seqlens_k": np.array([3], np.int32), "total_sequence_length": np.array(9, np.int32)}
    staged = graphs.stage("seqlens_k", values["seqlens_k"])
    inputs = {"hidden": hidden, "seqlens_k": staged, "total_sequence_length": np.array(64, np.int32)}
    last = SegmentBinding._remember(binding, graphs, "graph", values, inputs)
    assert last.device_inputs == (("hidden", hidden),) and last.staged == (("seqlens_k", staged),)
    assert last.state_arrays == (kv.array, kv.present) and last.results == {"out": hidden}


def test_a_kept_binding_launches_its_replay_again_before_running():
    """SegmentBindings.run: a binding kept for the state whose last replay holds is launched again (run_again's
    results), with no run; where run_again gives None the binding runs as before."""
    from engine.dense_segment import SegmentBindings

    calls = []
    session = object()

    class Bound:
        def __init__(self, again):
            self.session, self.again = session, again

        def run_again(self, values):
            calls.append("again")
            return self.again

        def run(self, values):
            calls.append("run")
            return {"ran": True}

        def holds(self, values, results):
            return 0

    bindings, state = SegmentBindings(), type("State", (), {})()  # (kept by weak reference)
    bindings._by_state[state] = Bound({"again": True})
    assert bindings.run(session, [], [], {}, state) == {"again": True} and calls == ["again"]
    bindings._by_state[state] = Bound(None)
    assert bindings.run(session, [], [], {}, state) == {"ran": True} and calls == ["again", "again", "run"]


def test_graphs_are_on_unless_turned_off(monkeypatch):
    import importlib

    monkeypatch.delenv("MOE_DENSE_GRAPHS", raising=False)
    assert importlib.reload(dense_graph).enabled is True
    monkeypatch.setenv("MOE_DENSE_GRAPHS", "0")
    assert importlib.reload(dense_graph).enabled is False
    monkeypatch.delenv("MOE_DENSE_GRAPHS")
    importlib.reload(dense_graph)


def test_replayed_runs_take_the_kv_capacity_for_total_sequence_length():
    import onnx

    def gqa(name, window=-1, total="total_seq_len"):
        return onnx.helper.make_node("GroupQueryAttention", ["q", "", "", f"past_{name}.key", f"past_{name}.value",
                                     "seqlens_k", total], ["o", "pk", "pv"], domain="com.microsoft",
                                     local_window_size=window, num_heads=4, kv_num_heads=2)

    add = onnx.helper.make_node("Add", ["a", "b"], ["c"])
    inputs = ["q", "seqlens_k", "total_seq_len", "past_1.key", "past_1.value"]
    assert dense_graph.total_length_inputs([add, gqa("1")], inputs) == {"total_seq_len": "past_1.key"}
    assert dense_graph.total_length_inputs([add], inputs) == {}
    assert dense_graph.total_length_inputs([gqa("1", window=16)], inputs) is None  # sliding window: not replayed
    conv = onnx.helper.make_node("Conv", ["a", "w"], ["y"])
    assert dense_graph.total_length_inputs([add, conv, gqa("1")], inputs) is None  # not checked on a GPU: not replayed
    slot = SimpleNamespace(array=np.zeros((1, 2, 256, 8), np.float16))
    graphs = SegmentGraphs(FakeBackend(), frozenset({"total_seq_len"}), {"total_seq_len": slot})
    first = graphs.total_length("total_seq_len")
    assert first.dtype == np.int32 and int(first) == 256 and graphs.total_length("total_seq_len") is first
    slot.array = np.zeros((1, 2, 512, 8), np.float16)  # the KV buffer grew
    assert int(graphs.total_length("total_seq_len")) == 512



def test_the_diagnosis_compares_a_replay_with_onnxruntimes_run_after_it(monkeypatch):
    backend = FakeBackend()

    class Out(np.ndarray):
        def copy(self):
            return np.array(self).view(Out)

    backend.xp.abs, backend.xp.float32 = np.abs, np.float32
    out = np.array([1.0, 2.0], np.float32).view(Out)
    graphs = SegmentGraphs(backend, frozenset(), {})
    monkeypatch.setattr(dense_graph, "mismatches", [])

    def same():
        out[:] = [1.0, 2.0]

    graphs.check(("k",), {"y": out}, same)
    assert dense_graph.mismatches == [] and graphs.checked == 1

    def differs():
        out[:] = [1.0, 2.5]

    graphs.check(("k",), {"y": out}, differs)
    assert [m["output"] for m in dense_graph.mismatches] == ["y"]
    assert dense_graph.mismatches[0]["relative"] == pytest.approx(0.5 / 2.5)
