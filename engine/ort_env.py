"""onnxruntime session options shared by every session the engine creates.

All sessions use one process-wide intra-op thread pool, so the number of threads does not grow
with the number of dense segments (a 48-layer model has 49 of them).
"""

from __future__ import annotations

import os
from importlib import metadata

import onnxruntime as ort
from onnxruntime.capi import _pybind_state

from engine.errors import WorkbenchError

_ORT_TYPES = {
    "tensor(float)": 1, "tensor(uint8)": 2, "tensor(int8)": 3, "tensor(uint16)": 4, "tensor(int16)": 5,
    "tensor(int32)": 6, "tensor(int64)": 7, "tensor(string)": 8, "tensor(bool)": 9, "tensor(float16)": 10,
    "tensor(double)": 11, "tensor(uint32)": 12, "tensor(uint64)": 13, "tensor(bfloat16)": 16,
}

_configured_threads: int | None = None


def cpu_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def installed_onnxruntime_builds() -> list[str]:
    """The onnxruntime distributions installed; more than one means they overwrite each other's module."""
    names = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino")
    found = []
    for name in names:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return found


def require_single_build(builds: list[str]) -> None:
    if len(builds) > 1:
        raise WorkbenchError(f"several onnxruntime builds are installed ({', '.join(builds)}); they share one "
                             "module and break each other: uninstall all but one (make install picks the right one)")


def configure_global_threads(threads: int | None = None) -> None:
    """Set the process-wide pool size once, before the first session is created."""
    global _configured_threads
    if _configured_threads is None:
        require_single_build(installed_onnxruntime_builds())
        _configured_threads = threads or cpu_threads()
        _pybind_state.set_global_thread_pool_sizes(_configured_threads, 1)


def session_options(external_data_folder: str | None = None) -> ort.SessionOptions:
    configure_global_threads()
    options = ort.SessionOptions()
    options.use_per_session_threads = False
    options.log_severity_level = 3
    if external_data_folder:
        # Sub-models are built in memory; their dense initializers still point into the model's data file.
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", external_data_folder)
    return options


def elem_type(ort_type: str) -> int:
    """onnxruntime's 'tensor(float)' as ONNX's TensorProto element type."""
    return _ORT_TYPES[ort_type]
