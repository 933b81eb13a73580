"""Loading the CUDA module: a prebuilt cubin for this source and architecture if one exists, else NVRTC via CuPy.

The kernels have plain C names (``dec_gemv_4_2_0`` ...), so both ways expose the same functions. Prebuilt cubins
(``python -m kernels.gpu.build --arch 90``, needs nvcc) live in ``kernels/gpu/_build/`` (or ``$QMOE_GPU_CUBIN_DIR``)
and are keyed by a hash of the source text; a stale cubin is never used.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent / "source"
SOURCES = ("common.cuh", "route.cu", "decode.cu", "decode5.cu", "prefill.cu", "fma.cu", "pack.cu", "merge.cu")
NVRTC_OPTIONS = ("--std=c++17",)

_modules: dict = {}
_wgmma: dict = {}


def source_text() -> str:
    return "\n".join((SOURCE_DIR / name).read_text() for name in SOURCES)


def source_hash() -> str:
    return hashlib.sha256(source_text().encode()).hexdigest()[:16]


def cubin_dir() -> Path:
    return Path(os.environ.get("QMOE_GPU_CUBIN_DIR") or (Path(__file__).resolve().parent / "_build"))


def cubin_path(cc: str) -> Path:
    return cubin_dir() / f"qmoe-sm{cc}-{source_hash()}.cubin"


def nvcc_arch(cc: str) -> str:
    """nvcc's target for compute capability ``cc``: sm_90a on 9.0, whose arch-specific instructions (wgmma: the
    pf_gemmw prefill kernels) a plain sm_90 build leaves out; a cubin for sm_90a loads on 9.0 devices only, which is
    what a cubin named for sm90 is loaded on."""
    return f"sm_{cc}a" if cc == "90" else f"sm_{cc}"


def build_cubin(cc: str, nvcc: str = "nvcc") -> Path:
    """Compile the source with nvcc for ``nvcc_arch(cc)`` into the cubin directory (same options as the NVRTC path)."""
    out = cubin_path(cc)
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(".cu")
    src.write_text(source_text())
    try:
        subprocess.run([nvcc, f"-arch={nvcc_arch(cc)}", *NVRTC_OPTIONS, "-cubin", "-o", str(out), str(src)],
                       check=True)
    finally:
        src.unlink(missing_ok=True)
    return out


def load_module(cc: str):
    """(cupy.RawModule, "cubin" | "nvrtc") for compute capability ``cc`` (e.g. "90"); cached per process."""
    import cupy

    key = (cc, source_hash())
    if key not in _modules:
        path = cubin_path(cc)
        mod = None
        if path.is_file() and os.environ.get("QMOE_GPU_NO_CUBIN") != "1":
            try:
                mod = cupy.RawModule(path=str(path))
                mod.get_function("route_topk")  # loads the module: fails here if the driver refuses the cubin
                _modules[key] = (mod, "cubin")
            except Exception:  # noqa: BLE001 - fall back to compiling the source
                mod = None
        if mod is None:
            _modules[key] = (cupy.RawModule(code=source_text(), options=NVRTC_OPTIONS), "nvrtc")
    return _modules[key]


def has_wgmma(cc: str) -> bool:
    """Whether the module loaded for ``cc`` holds working wgmma kernels (pf_gemmw), asked of the module itself: only
    a cubin built for sm_90a does (NVRTC through CuPy compiles for compute_90, where they trap). Cached per process."""
    import cupy

    mod, _ = load_module(cc)
    key = (cc, source_hash())
    if key not in _wgmma:
        flag = cupy.zeros(1, cupy.int32)
        mod.get_function("qm_features")((1,), (1,), (flag,))
        _wgmma[key] = bool(int(flag.get()[0]))
    return _wgmma[key]
