"""GpuQMoE._capture on the CPU, with a stand-in stream: no garbage collection while the launches are captured (a CUDA
graph freed then fails to be destroyed and leaves CUDA's last error set for the next kernel that checks it)."""
import gc
from types import SimpleNamespace

import kernels.gpu.qmoe as qmoe


class _Stream:
    def __init__(self):
        self.log = []

    def begin_capture(self, mode=None):
        self.log.append("begin")

    def end_capture(self):
        self.log.append("end")
        return "graph"


def test_launches_are_captured_with_the_garbage_collector_off(monkeypatch):
    fake_cupy = SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(streamCaptureModeThreadLocal=1)))
    monkeypatch.setattr(qmoe, "_cp", lambda: fake_cupy)
    stream, during = _Stream(), []
    assert gc.isenabled()
    assert qmoe.GpuQMoE._capture(stream, lambda: during.append(gc.isenabled())) == "graph"
    assert during == [False] and stream.log == ["begin", "end"] and gc.isenabled()

    def failing():
        raise RuntimeError("not capturable")

    assert qmoe.GpuQMoE._capture(_Stream(), failing) is qmoe._EAGER and gc.isenabled()
