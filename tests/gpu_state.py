"""What a gpu test leaves behind that the next one would share: the CUDA devices it opened (conftest's
_gpu_state_released calls release_gpu_state after each gpu test)."""

from __future__ import annotations

import gc
import sys


def release_gpu_state() -> None:
    """Every CUDA device a test opened closed for CuPy's memory pool: the pool is the process's, and its limit is none
    while any open device has none (cuda_device._cap_pool), so an earlier test's device still open held a later test
    to no cap (test_cuda_mem_limit_is_a_clean_error failed so in a whole-file run; alone it passed). Devices left in a
    reference cycle (a model's, a caught error's traceback) are collected; one still referenced after that (the
    traceback pytest keeps of a failed test) gives its cap up. Collects only where a device is open: most gpu tests
    open none, and a collection each would add minutes to the GPU run."""
    cuda_device = sys.modules.get("engine.offload.cuda_device")
    if cuda_device is None or not any(cuda_device._pool_caps.values()):
        return
    gc.collect()
    if any(cuda_device._pool_caps.values()):
        for obj in gc.get_objects():
            if issubclass(type(obj), cuda_device.CudaDevice):  # (isinstance raises on a dead weakref.proxy)
                obj.forget_cap()
