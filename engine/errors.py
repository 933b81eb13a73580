"""The one exception type the engine raises for bad input; its message is one line for the user."""

import errno
import json
import os
import re


class WorkbenchError(Exception):
    """A problem the user can act on: a bad file, an unsupported layout, a prompt too long.

    The message names the file, node or value and what is wrong, on one line.
    """

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class ModelFileError(WorkbenchError):
    """A model folder's file is missing, truncated, corrupt or malformed."""


def read_model_text(path) -> str:
    """A model folder's text file (JSON, a chat template) as UTF-8; a ModelFileError naming it where it is not
    readable or not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ModelFileError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ModelFileError(f"{path}: not readable ({exc.strerror or exc})") from None


def not_written(exc: OSError, path) -> str:
    """Why a file the user named could not be written, without the path and errno that OSError's text repeats:
    "its folder does not exist", else the system's reason ("Permission denied", "No space left on device")."""
    if isinstance(exc, FileNotFoundError) and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        return "its folder does not exist"
    return exc.strerror or one_line(exc)


def read_model_json(path):
    """A model folder's JSON file, parsed; a ModelFileError naming it where it is not readable or not JSON."""
    text = read_model_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelFileError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ModelFileError(f"{path}: not valid JSON (nested too deeply to read)") from None


def no_link_loop(path):
    """`path` as it is; a ModelFileError naming it where its symbolic links loop: it leads to no file, and
    Path.resolve raises a RuntimeError on it."""
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ModelFileError(f"{path}: a loop of symbolic links (it leads to no file)") from None
    return path


def not_a_file(path) -> str:
    """What is wrong where a model file is not a regular file: 'missing', or what is there instead."""
    if path.is_dir():
        return "a folder, not a file"
    return "not a regular file" if path.exists() else "missing"


LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def lfs_pointer(path) -> str | None:
    """What is wrong where a model file is a Git LFS pointer (a repository cloned without git-lfs, or before
    `git lfs pull`: a few lines of text standing for the file), else None."""
    try:
        with open(path, "rb") as file:
            head = file.read(1024)
    except OSError:
        return None
    if not head.startswith(LFS_POINTER):
        return None
    size = re.search(rb"^size (\d+)$", head, re.MULTILINE)
    stands_for = f" for {int(size.group(1)):,} bytes" if size else ""
    return (f"a Git LFS pointer{stands_for}, not the file itself (run 'git lfs pull' in the model folder to download "
            "it)")


class PromptError(WorkbenchError):
    """A prompt that cannot be run: empty, or longer than the context."""


class ConversationFullError(PromptError):
    """A conversation's next message that the model's context (or its search.max_length) cannot take after the turns
    before it. `problem` says so; the message adds what to do in the window, whose New chat starts a new conversation
    (the command line's chat, which ends there, and a scenario run, records.scenarios.run_scenario, say their
    own)."""

    def __init__(self, problem: str):
        super().__init__(f"{problem}: start a new conversation")
        self.problem = problem


class UnsupportedModelError(WorkbenchError):
    """A model our engine cannot run yet, e.g. an expert layout without kernels."""


# CUDA errors after which the process's GPU context is unusable (CUDA's "sticky" errors): every later call on that
# GPU fails too, so the user must know that only a restart gives the GPU back. CuPy names them as the runtime or the
# driver does; onnxruntime reports the runtime's number ("CUDA failure 700: ...").
_STICKY_CUDA_ERRORS = (
    ("cudaErrorIllegalAddress", "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA failure 700"),
    ("cudaErrorHardwareStackError", "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA failure 714"),
    ("cudaErrorIllegalInstruction", "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA failure 715"),
    ("cudaErrorMisalignedAddress", "CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA failure 716"),
    ("cudaErrorInvalidAddressSpace", "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA failure 717"),
    ("cudaErrorInvalidPc", "CUDA_ERROR_INVALID_PC", "CUDA failure 718"),
    ("cudaErrorLaunchFailure", "CUDA_ERROR_LAUNCH_FAILED", "CUDA failure 719"),
    ("cudaErrorECCUncorrectable", "CUDA_ERROR_ECC_UNCORRECTABLE", "CUDA failure 214"),
)
GPU_LOST = "the GPU cannot be used again in this process: restart MoE Workbench to use it (the CPU still works)"
# The GPU's memory ran out (not sticky: the GPU works on once memory is freed), as CuPy (its OutOfMemoryError), the
# runtime and the driver name it, and onnxruntime by the runtime's number.
_CUDA_OUT_OF_MEMORY = ("cudaErrorMemoryAllocation", "CUDA_ERROR_OUT_OF_MEMORY", "CUDA failure 2:")
GPU_OUT_OF_MEMORY = ("the GPU ran out of memory: lower the expert budget (device_expert_bytes) or free what other "
                     "processes hold on the GPU")
# mode=disabled puts every expert beside the dense part, where the expert budgets do not apply (planner.dense_cpu_words)
GPU_OUT_OF_MEMORY_DISABLED = ("the GPU ran out of memory: use mode=auto, which keeps the experts that do not fit on "
                              "the CPU, or free what other processes hold on the GPU")


# onnxruntime's C++ errors start with its status code and the source line and function that raised them:
# "[ONNXRuntimeError] : 1 : FAIL : /onnxruntime_src/onnxruntime/core/graph/model.cc:256 onnxruntime::Model::Model(
# onnx::ModelProto&&, ...) Unsupported model IR version: 99, ...". The user needs only the reason at the end.
_ORT_STATUS = re.compile(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ")
_ORT_SOURCE_LINE = re.compile(r"(?:Load model from \S+ failed:)?\s*/\S+\.(?:cc|cpp|h):\d+ .*?\)(?: const)? ")


def error_reason(exc: BaseException) -> str:
    """An exception's message on one line: its first line, or all of onnxruntime's (its later lines carry the
    details) without its status code and the source file and function that raised it."""
    text = str(exc).strip()
    if not _ORT_STATUS.match(text):
        return text.splitlines()[0] if text else type(exc).__name__
    reason = " ".join(_ORT_STATUS.sub("", text).split())
    return _ORT_SOURCE_LINE.sub(" ", reason, count=1).strip()


def gpu_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is the GPU running out of memory, as CuPy, the CUDA runtime and driver or onnxruntime say it: a
    state of the machine the user can change (a smaller budget, other processes), not a defect."""
    return type(exc).__name__ == "OutOfMemoryError" or any(name in str(exc) for name in _CUDA_OUT_OF_MEMORY)


def users_error(exc: BaseException) -> bool:
    """An error the user can act on, not a defect of ours: a WorkbenchError, or the GPU out of memory (a smaller
    budget, or memory other processes free, changes it)."""
    return isinstance(exc, WorkbenchError) or gpu_out_of_memory(exc)


def one_line(exc: BaseException, mode: str | None = None) -> str:
    """What the user is told of an exception, on one line: a WorkbenchError's message as it is, anything else as its
    type and first line, with what to do when the GPU's context is lost or its memory ran out, the latter as the
    offload `mode` the failing work ran under says it (where the caller knows it)."""
    if isinstance(exc, WorkbenchError):
        # one that wraps the card's memory running out where the mode is not known (DenseSegment.run) said the budget's
        return str(exc).replace(GPU_OUT_OF_MEMORY, GPU_OUT_OF_MEMORY_DISABLED) if mode == "disabled" else str(exc)
    text = f"{type(exc).__name__}: {error_reason(exc)}" if str(exc).strip() else type(exc).__name__
    if any(name in text for names in _STICKY_CUDA_ERRORS for name in names):
        text += f"; {GPU_LOST}"
    elif gpu_out_of_memory(exc):
        text += f"; {GPU_OUT_OF_MEMORY_DISABLED if mode == 'disabled' else GPU_OUT_OF_MEMORY}"
    return text
