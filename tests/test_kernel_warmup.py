"""engine/kernel_warmup.py: each distinct CPU kernel of a model run once, before a timed run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from engine.kernel_warmup import warm_cpu_kernels
from kernels.cpu import CpuQMoE
from kernels.qmoe_spec import QMoESpec
from tests.conftest import fixture_folder
from tests.qmoe_oracle import make_case
from tests.test_bad_input import REPO


def _kernel(dtype) -> CpuQMoE:
    attrs, t, x, _ = make_case(seed=2, E=6, H=64, I=32, k=2, bits=4, block_size=32, T=1, activation="swiglu",
                               swiglu_fusion=1, swiglu_limit=7.0, alpha=1.702, dtype=dtype)
    return CpuQMoE(QMoESpec.from_tensors("t", "QMoE", attrs, t, x.shape), t)


def test_each_layout_is_run_once_for_a_decode_step_and_a_prefill(monkeypatch):
    calls, gemm = [], []
    forward, gemm_batched = CpuQMoE.forward, CpuQMoE._gemm_batched

    def counted_forward(self, x, logits, router_weights=None):
        calls.append((id(self), x.shape[0]))
        return forward(self, x, logits, router_weights)

    monkeypatch.setattr(CpuQMoE, "forward", counted_forward)
    monkeypatch.setattr(CpuQMoE, "_gemm_batched",
                        lambda self, *args: gemm.append(id(self)) or gemm_batched(self, *args))
    fp32, fp32_again, fp16 = _kernel(np.float32), _kernel(np.float32), _kernel(np.float16)
    dense = SimpleNamespace()  # a dense segment: no kernel
    seconds = warm_cpu_kernels([dense, SimpleNamespace(kernel=fp32), dense, SimpleNamespace(kernel=fp32_again),
                                SimpleNamespace(kernel=fp16)])
    prefill = CpuQMoE.gemv_max_rows + 1
    # fp32_again shares fp32's layout (the same compiled kernels); fp16's scales are another type
    assert calls == [(id(fp32), 1), (id(fp32), prefill), (id(fp16), 1), (id(fp16), prefill)]
    assert gemm == [id(fp32), id(fp16)] and seconds > 0  # the prefill's tokens reached the GEMM path


FIRST_CALLS = r"""
import sys
import numba
from numba.core.dispatcher import Dispatcher
from engine.demo_model import ensure_demo_model
from engine.generation import GenerationParams, LoadedModel
from engine.offload import OffloadConfig, SimulatedDevice
import engine.records.scenarios as scenarios

timed, first_calls = [False], []
compile_for_args = Dispatcher._compile_for_args  # what a call of types not yet seen in this process goes through

def spy(self, *args, **kws):
    if timed[0]:
        first_calls.append(f"{self.py_func.__qualname__}{tuple(str(numba.typeof(a)) for a in args)}")
    return compile_for_args(self, *args, **kws)

Dispatcher._compile_for_args = spy
device = SimulatedDevice(8 << 30) if sys.argv[1] == "simulated" else None
offload = OffloadConfig(device_expert_bytes=int(sys.argv[2])) if device is not None else None
model = LoadedModel.open(ensure_demo_model(), offload=offload, device=device, decode_path=sys.argv[3])

class Timed(scenarios.PeakSampler):  # the clock starts with the run's sampler
    def __enter__(self):
        timed[0] = True
        return super().__enter__()

scenarios.PeakSampler = Timed
record = scenarios.run_scenario(model, "short", GenerationParams(max_new_tokens=12), device)
assert record.turns[0]["generated_tokens"] == 12
print("\n".join(first_calls) or "none")
"""


@pytest.mark.parametrize("device,budget,path", [("simulated", 2_000_000, "auto"), ("simulated", 2_000_000, "both"),
                                                ("simulated", 0, "cpu"), ("cpu", 0, "auto")])
def test_a_records_timed_part_calls_no_compiled_function_for_the_first_time(device, budget, path):
    """Numba compiles a function at its first call for each argument type (a first run: seconds), or loads it from
    its cache (every process); either inside the clock made a record's first token 3x slower (kernel_warmup.py)."""
    result = subprocess.run([sys.executable, "-c", FIRST_CALLS, device, str(budget), path], capture_output=True,
                            text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "none", f"first called in the timed part:\n{result.stdout}"


GENERATE_FIRST_CALLS = r"""
import sys
import numba
from numba.core.dispatcher import Dispatcher
import engine.generation as generation
from app.cli import main

timed, first_calls = [False], []
compile_for_args = Dispatcher._compile_for_args

def spy(self, *args, **kws):
    if timed[0]:
        first_calls.append(f"{self.py_func.__qualname__}{tuple(str(numba.typeof(a)) for a in args)}")
    return compile_for_args(self, *args, **kws)

Dispatcher._compile_for_args = spy
generate = generation.generate

def timed_generate(*args, before_feed=None, **kwargs):
    # the answer's clock starts in generate once the prompt is accepted, after before_feed (the command line's
    # warm-up) has run (time to first token, its total)
    def feed():
        if before_feed is not None:
            before_feed()
        timed[0] = True
    return generate(*args, before_feed=feed, **kwargs)

generation.generate = timed_generate
assert main(["generate", sys.argv[1], "--prompt", "The experts", "--device", "simulated", "--offload",
             "device_expert_bytes=282624", "--max-new-tokens", "6", "--greedy", "--json"]) == 0
print("\n".join(first_calls) or "none", file=sys.stderr)
"""


def test_generates_answer_times_call_no_compiled_function_for_the_first_time(tmp_path):
    """`generate` timed its answer from a model whose CPU kernels and offload bookkeeping had not run: their first
    call, inside the clock, compiled them on a cold Numba cache (the stand-in's 122 s on the simulated device, read
    as the answer's time to first token) or loaded them from the cache. It compiles them before the answer, as a record
    does (kernel_warmup.py), and says how long that took in its JSON."""
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path),
           "XDG_CACHE_HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", GENERATE_FIRST_CALLS, str(fixture_folder("gptoss"))],
                            capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == "none", f"first called in the timed part:\n{result.stderr}"
    timings = json.loads(result.stdout)["timings"]
    assert timings["kernel_warm_up_s"] > 0 and timings["time_to_first_token_s"] > 0


class _Model:
    """What warm_model reads of a loaded model with offload, and no more (a weak reference says when it is gone)."""

    def __init__(self):
        self.folder = SimpleNamespace(onnx=SimpleNamespace(check_mapped_files=lambda: None))
        self.decoder = SimpleNamespace(steps=[], host_part_loops=lambda: [])
        self.offload = SimpleNamespace()


def test_a_model_warmed_through_a_first_compile_is_dropped_at_once(monkeypatch):
    """Numba's compiler keeps errors it recovered from in its caches with their tracebacks, whose frames link to their
    callers': a first compile made on warm_model's thread held its frame, and so the model, for the process's life (a
    dropped model kept its CUDA device in the whole GPU run). warm_model makes the first calls on a thread of their
    own."""
    import gc
    import weakref

    from engine import kernel_warmup

    kept = []  # the compiler's cache

    def compile_keeping_its_error():
        try:
            raise NotImplementedError("no definition for lowering static_setitem")
        except NotImplementedError as exc:
            kept.append(exc)

    monkeypatch.setattr(kernel_warmup, "warm_offload_bookkeeping", compile_keeping_its_error)
    gc.disable()  # (nothing here is a cycle: the model goes at its last reference, or not at all)
    try:
        model = _Model()
        kernel_warmup.warm_model(model)
        dropped = weakref.ref(model)
        del model
        assert len(kept) == 1 and dropped() is None
    finally:
        gc.enable()


def test_an_error_of_the_first_calls_is_raised_by_warm_model(monkeypatch):
    from engine import kernel_warmup

    def fails():
        raise ValueError("kernel for /model/layers.0/moe/QMoE: no such layout")

    monkeypatch.setattr(kernel_warmup, "warm_offload_bookkeeping", fails)
    with pytest.raises(ValueError, match=r"^kernel for /model/layers.0/moe/QMoE: no such layout$"):
        kernel_warmup.warm_model(_Model())
