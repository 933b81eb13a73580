"""onnxruntime session options shared by every session the engine creates.

Each session gets its own intra-op thread pool, which blocks between runs rather than spinning
(session_options below): a process-wide pool cannot be told not to spin, and its spinning threads
held the cores the expert kernels needed next.

Where the dense segments run is a DenseDevice: the CPU, or onnxruntime's CUDA execution provider
when the experts' device is a CUDA GPU and the installed onnxruntime offers that provider
(onnxruntime-gpu). Nothing here imports GPU-only modules; CuPy is imported only on the CUDA path.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import threading
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import onnx
import onnxruntime as ort

from engine.errors import WorkbenchError, error_reason
from engine.offload.device_memory import ARENA_BUDGET_HINT, SHARED_ARENA_HINT
from engine.units import human_bytes

_ORT_TYPES = {
    "tensor(float)": 1, "tensor(uint8)": 2, "tensor(int8)": 3, "tensor(uint16)": 4, "tensor(int16)": 5,
    "tensor(int32)": 6, "tensor(int64)": 7, "tensor(string)": 8, "tensor(bool)": 9, "tensor(float16)": 10,
    "tensor(double)": 11, "tensor(uint32)": 12, "tensor(uint64)": 13, "tensor(bfloat16)": 16,
}

@functools.cache
def known_operators() -> frozenset[tuple[str, str]] | None:
    """(domain, op type) of every operator this onnxruntime build has a schema for ('ai.onnx' for the default
    domain); None where the build does not say."""
    try:
        from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema
    except ImportError:
        return None
    return frozenset((schema.domain or "ai.onnx", schema.name) for schema in get_all_operator_schema())


def unknown_operator(nodes) -> str | None:
    """Why onnxruntime could not run one of `nodes` (the dense part's), or None: an operator it does not have, which
    only its session would otherwise say, at load (inspect would have called the model runnable)."""
    known = known_operators()
    if known is None:
        return None
    for node in nodes:
        if (node.domain or "ai.onnx", node.op_type) not in known:
            return (f"node '{node.name}': operator '{node.op_type}' of domain '{node.domain or 'ai.onnx'}' is not one "
                    f"onnxruntime {ort.__version__} has")
    return None


def unloadable_versions(model: onnx.ModelProto) -> str | None:
    """Why onnxruntime would refuse `model`'s IR version or operator set versions, or None. Its own answer: a
    one-node model stamped with the same versions, loaded (milliseconds), since only its session knows its limits.
    Two onnxruntime builds installed are refused first: they can answer nothing about a model."""
    _require_single_build_once()
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "versions",
                                   [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    probe = onnx.helper.make_model(graph, opset_imports=list(model.opset_import))
    probe.ir_version = model.ir_version
    # the probe's Identity needs the default domain, which onnxruntime lends a model importing other sets only; a model
    # importing none at all (a model.onnx cut short after its graph) it refuses, and so the probe must
    if probe.opset_import and not any(o.domain in ("", "ai.onnx") for o in probe.opset_import):
        probe.opset_import.append(onnx.helper.make_opsetid("", onnx.defs.onnx_opset_version()))
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types
        return f"onnxruntime {ort.__version__} cannot load IR version {model.ir_version} with operator sets " \
               f"{_opsets(model)}: {error_reason(exc)}"
    return None


def _opsets(model: onnx.ModelProto) -> str:
    return ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in model.opset_import) or "none"


def cpu_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def installed_onnxruntime_builds() -> list[str]:
    """The onnxruntime distributions installed in the folder this process imports onnxruntime from; more
    than one there means they overwrite each other's files. One in another folder of the path is shadowed
    by the imported one: harmless, not listed."""
    here = Path(ort.__file__).resolve().parent.parent
    names = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino")
    return [f"{name} {dist.version}" for name in names for dist in metadata.distributions(name=name)
            if Path(dist.locate_file("")).resolve() == here]


# Uninstalling one of them takes the files they share, so the advice is a clean reinstall (make install alone finds
# its stamp up to date and does nothing).
def require_single_build(builds: list[str]) -> None:
    if len(builds) > 1:
        raise WorkbenchError(f"several onnxruntime builds are installed ({', '.join(builds)}); they share one "
                             "module and break each other: uninstall them all and install one (in a checkout, "
                             "make clean install installs the one this machine needs)")


@functools.cache
def _require_single_build_once() -> None:
    require_single_build(installed_onnxruntime_builds())


# onnxruntime's pool threads spin after each run, waiting for more work, and cannot be told not to
# in a process-wide pool (Python exposes no spin control for it). Every decode step alternates
# between onnxruntime (dense segments) and Numba (expert kernels) dozens of times, so spinning
# pool threads hold the cores the expert kernels need next: each session gets its own pool that
# blocks instead (session.intra_op.allow_spinning = 0).
def session_options(external_data_folder: str | None = None, threads: int | None = None,
                    spinning: bool = False) -> ort.SessionOptions:
    """Options for an engine session: its own pool of `threads` (default: all cores), not spinning
    unless asked (a benchmark's reference session, which runs alone); host memory from the shared CPU arena."""
    _require_single_build_once()
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or cpu_threads()
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if _register_shared_cpu_arena():
        options.add_session_config_entry("session.use_env_allocators", "1")
    options.log_severity_level = 4  # fatal only: a failed run's error says it in its exception, in one line
    if external_data_folder:
        # Sub-models are built in memory; their dense initializers still point into the model's data file.
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", external_data_folder)
    return options


@functools.cache
def _register_shared_cpu_arena() -> bool:
    """One onnxruntime arena in host memory for every engine session (session.use_env_allocators), made once. A
    session's own arena keeps the peak of its largest run for good, and the dense part is a session per segment:
    after two 2000-token prompts an 8-layer, 1024-wide model's 9 sessions held 1.6 GB (0.5 GB with one arena, whose
    peak is the largest segment's run; the segments run one after the other)."""
    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    try:
        ort.create_and_register_allocator(info, ort.OrtArenaCfg({"arena_extend_strategy": 1}))  # 1 = kSameAsRequested
    except Exception:  # a build that cannot: each session keeps its own arena, as before
        return False
    return True


def elem_type(ort_type: str) -> int:
    """onnxruntime's 'tensor(float)' as ONNX's TensorProto element type."""
    return _ORT_TYPES[ort_type]


# --- where the dense part runs ------------------------------------------------------------------
CUDA_EP = "CUDAExecutionProvider"
# Under gpu_device_mem_limit, the least onnxruntime's arena may get (activations and workspace of
# the dense segments); with less, the dense part stays on the CPU and says why.
MIN_DENSE_ARENA = 64 << 20


class DenseDoesNotFit(WorkbenchError):
    """The dense part cannot go to the GPU (its one-line reason is the message)."""


def cuda_provider_options(device_id: int, gpu_mem_limit: int = 0, stream_pointer: int = 0) -> dict[str, str]:
    """The CUDA EP's options: the experts' device, onnxruntime's arena capped at `gpu_mem_limit` (0 =
    no cap) and grown by exactly what is asked (kSameAsRequested: no power-of-two overshoot past
    the cap), and our CuPy stream as its compute stream (array_backend.CupyBackend says why)."""
    options = {"device_id": str(device_id), "arena_extend_strategy": "kSameAsRequested"}
    if gpu_mem_limit:
        options["gpu_mem_limit"] = str(gpu_mem_limit)
    if stream_pointer:
        options["user_compute_stream"] = str(stream_pointer)
    return options


def dense_arena_limit(mem_limit: int, available: int, state_bytes: int, dense_weight_bytes: int) -> int:
    """onnxruntime's gpu_mem_limit under gpu_device_mem_limit (`mem_limit`, 0 = none: returns 0).

    `available` is what the device has left under the limit once the offload plan has taken its
    expert slots and prefill staging ring (DeviceMemory.available after OffloadEngine is built: the
    plan's reserve_device_bytes, automatic or given, is the part of it the plan left for KV, state
    and workspace, plus whatever the slots did not fill). From that, the conversation's state at full
    context (CuPy, outside onnxruntime's arena, growth included) and the dense weights (allocated
    exactly, outside the arena: session.use_device_allocator_for_initializers) are taken; the arena,
    shared by every dense segment, gets the rest (or less, where a model loaded earlier in the process registered
    it smaller: shared_arena_cap).
    """
    if not mem_limit:
        return 0
    arena = available - state_bytes - dense_weight_bytes
    if arena < MIN_DENSE_ARENA:
        raise DenseDoesNotFit(
            f"gpu_device_mem_limit={mem_limit} leaves {human_bytes(max(0, available))} after the expert slots and "
            f"staging; the KV cache and state at their longest ({human_bytes(state_bytes)}), the dense weights "
            f"({human_bytes(dense_weight_bytes)}) and onnxruntime's workspace ({human_bytes(MIN_DENSE_ARENA)} at "
            "least) need more" + ARENA_BUDGET_HINT)
    return arena


def cuda_ep_missing_reason() -> str | None:
    """Why this onnxruntime cannot run the CUDA EP, or None when it offers it and can load the CUDA libraries it
    needs."""
    if CUDA_EP in ort.get_available_providers():
        return cuda_libraries_missing()
    builds = installed_onnxruntime_builds()
    if any(build.startswith("onnxruntime-gpu ") for build in builds):
        return f"the installed {', '.join(builds)} offers no {CUDA_EP}"
    # not "install onnxruntime-gpu": beside the CPU build the two break each other (require_single_build)
    return ("onnxruntime here is the CPU build (`make install` on a machine with an NVIDIA driver installs "
            "onnxruntime-gpu in its place)")


@functools.cache
def cuda_libraries_missing() -> str | None:
    """Load the CUDA libraries onnxruntime-gpu's CUDA EP links (cuBLAS, cuRAND, the CUDA runtime) from the NVIDIA
    wheels its extras install (pyproject's cuda12 / cuda13: a machine with only the driver has them nowhere else),
    else from the system's library path: onnxruntime.preload_dlls, once a process. Returns which could not be loaded,
    or None. preload_dlls prints what it could not load; that text is the reason, not output."""
    if not hasattr(ort, "preload_dlls"):  # (older than 1.21: the libraries must be on the library path)
        return None
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        ort.preload_dlls(cuda=True, cudnn=True, msvc=False)
    missing = re.findall(r"^Failed to load (?:\S*/)?(\S+?):", printed.getvalue(), re.MULTILINE)
    if not missing:
        return None
    return (f"onnxruntime-gpu's CUDA execution provider needs {', '.join(dict.fromkeys(missing))}, which cannot be "
            "loaded (install the cuda12 or cuda13 extra, which brings them: make clean install)")


_shared_arenas: dict[int, int] = {}  # device id -> max_mem of the arena registered with onnxruntime's env (0: no cap)
_arena_locks: dict[int, threading.Lock] = {}  # device id -> dense_step_lock's lock
_registering = threading.Lock()  # two loads at once must not both find no arena and both register one


def dense_step_lock(device_id: int) -> threading.Lock:
    """Held for a decode or prompt step of a model whose dense part is on GPU `device_id`: the steps of models that
    share the device's arena (register_shared_cuda_arena) run one at a time, as in a side-by-side chat answered at
    once. onnxruntime gives a run's scratch back to the arena when the run returns, before its kernels have run on
    the model's stream (runs are not synchronised: DeviceOutputs.no_sync), and a run on another model's stream may be
    handed it at once; a replayed CUDA graph (dense_graph.py) writes the scratch it was captured with. A step ends
    with the logits on the host, its dense work done."""
    return _arena_locks.setdefault(device_id, threading.Lock())  # one call: atomic, two threads get the same lock


def register_shared_cuda_arena(device_id: int, max_mem: int) -> int:
    """One onnxruntime arena on the device for every dense session (session.use_env_allocators): a cap on each of 49
    per-session arenas would not cap their sum. The first call registers it at `max_mem` (0: no cap); onnxruntime keeps
    an env allocator for the life of the process and can neither replace nor remove it, so every call returns the
    max_mem it was registered at, which shared_arena_cap weighs against a later model's limit."""
    with _registering:
        if device_id in _shared_arenas:
            return _shared_arenas[device_id]
        info = ort.OrtMemoryInfo("Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, device_id, ort.OrtMemType.DEFAULT)
        arena = ort.OrtArenaCfg({"max_mem": max_mem, "arena_extend_strategy": 1})  # 1 = kSameAsRequested
        try:
            ort.create_and_register_allocator_v2(CUDA_EP, info, cuda_provider_options(device_id, max_mem), arena)
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DenseDoesNotFit(f"onnxruntime cannot make its GPU arena on device {device_id}: {first}") from None
        _shared_arenas[device_id] = max_mem
        return max_mem


def shared_arena_cap(device_id: int, registered: int, arena: int, mem_limit: int) -> int:
    """The cap in force on onnxruntime's arena for a model whose gpu_device_mem_limit (`mem_limit`, 0 = none) leaves it
    `arena` bytes (dense_arena_limit), where the device's arena was registered at `registered` (0 = no cap), perhaps by
    a model loaded earlier (a reload, side-by-side's B). A registered cap within `arena` holds the model to its limit:
    that cap is what it counts, the rest stays its experts'. A larger one, or none, would let onnxruntime take more
    than the limit leaves: DenseDoesNotFit, naming the arena."""
    if registered == arena or not mem_limit or 0 < registered < arena:
        return registered
    if not registered:
        raise DenseDoesNotFit(
            f"onnxruntime's GPU arena on device {device_id} was registered without a cap by a model loaded earlier in "
            "this process without gpu_device_mem_limit, and onnxruntime keeps it until the process ends; it cannot "
            f"hold this model to gpu_device_mem_limit={mem_limit} (restart and load this model first)")
    raise DenseDoesNotFit(
        f"onnxruntime's GPU arena on device {device_id} was registered at {human_bytes(registered)} by a model loaded "
        "earlier in this process, and onnxruntime keeps it at that size until the process ends; this model's "
        f"gpu_device_mem_limit={mem_limit} leaves it {human_bytes(arena)} after the expert slots, staging, state and "
        f"dense weights, {human_bytes(registered - arena)} short" + SHARED_ARENA_HINT)


def dense_arena(device_id: int, mem_limit: int, available: int, state_bytes: int, dense_weight_bytes: int,
                register: bool = True) -> tuple[int, int]:
    """(the cap in force on onnxruntime's arena for a model's dense part on GPU `device_id`, what its
    gpu_device_mem_limit left the arena): dense_arena_limit, then the device's arena weighed by shared_arena_cap. The
    load registers the arena where none is (register_shared_cuda_arena); with `register` False (the budget panel's
    estimate, before any load) nothing is registered, and a device without one is taken as the load would find it:
    registered at what this model's limit leaves. Raises DenseDoesNotFit with the reason the dense part stays on the
    CPU."""
    left = dense_arena_limit(mem_limit, available, state_bytes, dense_weight_bytes)
    if register:
        registered = register_shared_cuda_arena(device_id, left)
    else:
        registered = _shared_arenas.get(device_id, left)
    return shared_arena_cap(device_id, registered, left, mem_limit), left


def dense_refusal(device, available: int, state_bytes: int, dense_weight_bytes: int) -> str | None:
    """Why a load would keep the dense part on the CPU where the offload plan leaves `available` bytes of `device`:
    onnxruntime's arena not fitting beside the plan (dense_arena, nothing registered), None where it fits."""
    try:
        dense_arena(device.index, device.memory.limit, available, state_bytes, dense_weight_bytes, register=False)
    except DenseDoesNotFit as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class DenseDevice:
    """Where the dense segments run and why. `backend` holds the state buffers (None: NumPy)."""
    kind: str = "cpu"            # "cpu" or "cuda"
    reason: str = ""
    device_id: int = 0
    arena_limit: int = 0         # onnxruntime's gpu_mem_limit; 0 = no cap
    state_bytes: int = 0         # the state at its longest (GenaiConfig.longest_sequence), growth included (on the GPU)
    backend: object = None
    arena_left: int | None = None  # where the arena in force was registered by an earlier model (shared_arena_cap):
    #                               what this model's gpu_device_mem_limit left for it (0: no limit)
    threads: int | None = None   # onnxruntime's intra-op threads (None: one on the GPU, below; a thread a core on the CPU)

    def providers(self) -> list:
        if self.kind != "cuda":
            return ["CPUExecutionProvider"]
        stream = getattr(self.backend, "stream_pointer", 0)
        return [(CUDA_EP, cuda_provider_options(self.device_id, self.arena_limit, stream)), "CPUExecutionProvider"]

    # On the GPU a dense segment's nodes run on the CUDA EP; its CPU nodes are shape arithmetic. A pool of CPU threads
    # there only has threads to wake, next to the expert kernels' threads: one thread, the caller's. (On the H200
    # machine the two differed by less than the noise between runs: RESULTS, ninth session.) dense_pool_on_gpu = True
    # restores the pool, for benchmarks that compare the two.
    dense_pool_on_gpu = False

    def session_options(self, external_data_folder: str | None = None) -> ort.SessionOptions:
        threads = self.threads
        if threads is None and self.kind == "cuda" and not DenseDevice.dense_pool_on_gpu:
            threads = 1
        options = session_options(external_data_folder, threads=threads)
        if self.kind == "cuda":
            if not _register_shared_cpu_arena():  # (where it is, session_options asked for the env's allocators)
                options.add_session_config_entry("session.use_env_allocators", "1")
            # Dense weights take exactly their size, outside the arena (dense_arena_limit counts them).
            options.add_session_config_entry("session.use_device_allocator_for_initializers", "1")
        return options

    @property
    def provider_words(self) -> str:
        return "'s CUDA execution provider" if self.kind == "cuda" else ""

    @property
    def statement(self) -> str:
        if self.kind != "cuda":
            return f"The dense part runs on the CPU: {self.reason}."
        cap = f"; onnxruntime's arena is capped at {human_bytes(self.arena_limit)}" if self.arena_limit else ""
        if self.arena_left is not None:
            cap += (" (registered at that size by a model loaded earlier in this process: onnxruntime keeps one arena "
                    "per GPU until the process ends; " +
                    (f"this model's gpu_device_mem_limit left {human_bytes(self.arena_left)} for it)" if self.arena_left
                     else "this model has no gpu_device_mem_limit)"))
        return (f"The dense part runs on GPU {self.device_id} with onnxruntime's CUDA execution provider; the KV "
                f"cache and state (up to {human_bytes(self.state_bytes)}) live in GPU memory{cap}.")


CPU_DENSE = DenseDevice("cpu", "no GPU device is in use")
# The attention mask's lengths (partition.HOST_MASK_OPS): a few integer operations on the caller's thread; a pool's
# threads would only have to wake beside the expert kernels' (~100 µs a step on an H100 host with a thread a core and
# an IO binding; ~8 µs on the dev VM this way, DenseSegment.run)
MASK_DENSE = DenseDevice("cpu", "the attention mask's lengths are worked out on the host", threads=1)


def kv_dtype_reason(kv_dtypes) -> str | None:
    """Why KV caches of these element types cannot live on the GPU, or None.

    onnxruntime's CUDA GroupQueryAttention is registered for fp16 and bf16 only: with an fp32 KV
    cache onnxruntime would put attention on the CPU EP and copy the cache across every step, and
    past and present would no longer be one buffer written in place. bf16 buffers would need a
    CuPy dtype CuPy does not have (a 2-byte stand-in with onnxruntime told the element type: not
    done yet)."""
    names = sorted({np_dtype.name for np_dtype in kv_dtypes})
    if not names or names == ["float16"]:
        return None
    if "float32" in names:
        return ("the model's KV cache is fp32 and onnxruntime's CUDA GroupQueryAttention takes fp16 or bf16 only "
                "(a CUDA export of the model, with fp16 activations, runs there)")
    return f"the model's KV cache is {', '.join(names)}; the GPU state buffers take fp16 only for now"


def dense_cpu_reason(device_kind: str | None, kv_dtypes=()) -> str | None:
    """Why the dense part stays on the CPU with experts on a device of this kind ("cuda",
    "simulated", None), or None when it goes to the GPU (if gpu_device_mem_limit leaves it room)."""
    if device_kind != "cuda":
        return "the GPU is simulated, for the experts only" if device_kind == "simulated" else CPU_DENSE.reason
    return cuda_ep_missing_reason() or kv_dtype_reason(kv_dtypes)


def dense_goes_to(device, kv_dtypes=()) -> bool:
    """Whether the dense part is meant to run on `device` (a CudaDevice whose onnxruntime has the CUDA EP and whose
    KV caches it takes), where mode=disabled puts every expert too (planner.plan_offload)."""
    return device is not None and dense_cpu_reason(device.kind, kv_dtypes) is None


def choose_dense_device(device, state_bytes: int, dense_weight_bytes: int, kv_dtypes=()) -> DenseDevice:
    """The DenseDevice for experts on `device` (None, a SimulatedDevice or a CudaDevice), after the
    offload plan has taken its share of the device's memory. Its arena_limit is the cap in force on onnxruntime's
    arena, which LoadedModel counts against gpu_device_mem_limit: what the limit leaves (dense_arena_limit), or the
    smaller cap the device's arena was registered at by a model loaded earlier (shared_arena_cap)."""
    why = dense_cpu_reason(getattr(device, "kind", None), kv_dtypes)
    if why:
        return DenseDevice("cpu", why)
    try:
        arena, left = dense_arena(device.index, device.memory.limit, device.memory.available, state_bytes,
                                  dense_weight_bytes)
    except DenseDoesNotFit as exc:
        return DenseDevice("cpu", str(exc))
    from engine.array_backend import cupy_backend

    return DenseDevice("cuda", f"onnxruntime's {CUDA_EP} on device {device.index}", device.index, arena,
                       state_bytes, cupy_backend(device.index), None if arena == left else left)
