"""Prebuild the GPU kernels' cubin with nvcc: ``python -m kernels.gpu.build --arch 90``.

Optional: without a cubin the module is compiled by NVRTC (through CuPy) on first use and cached by CuPy.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess

from ._module import build_cubin, cubin_dir, nvcc_arch


def compute_capability(text: str) -> str:
    """--arch as the kernels look a cubin up: CuPy's compute capability, digits only ("90"); any other spelling
    would name a cubin no load asks for."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a compute capability as digits, e.g. 90 for 9.0 (sm_90a), "
                                         "89 for 8.9")
    return text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kernels.gpu.build", description=__doc__)
    ap.add_argument("--arch", action="append", default=None, type=compute_capability,
                    help="compute capability as digits, e.g. 90 (repeatable)")
    ap.add_argument("--nvcc", default="nvcc", help="the nvcc to run: a path or a command on PATH (default nvcc)")
    args = ap.parse_args(argv)
    if shutil.which(args.nvcc) is None:
        ap.error(f"nvcc not found: {args.nvcc} is not an executable file or a command on PATH; --nvcc PATH names "
                 "another; without a cubin the kernels are compiled by NVRTC at the first load")
    for cc in args.arch or ["90"]:
        try:
            print(build_cubin(cc, nvcc=args.nvcc))
        except subprocess.CalledProcessError as failed:
            ap.exit(1, f"{ap.prog}: error: {args.nvcc} exited with status {failed.returncode} building "
                       f"{nvcc_arch(cc)} (its messages are above)\n")
        except OSError as exc:  # the cubin folder cannot be made, or its source written
            ap.exit(1, f"{ap.prog}: error: cannot write the cubin to {cubin_dir()}: {exc.strerror} (QMOE_GPU_CUBIN_DIR "
                       "names another folder, which the kernels' loads then look in)\n")


if __name__ == "__main__":
    main()
