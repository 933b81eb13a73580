"""Prebuild the GPU kernels' cubin with nvcc: ``python -m kernels.gpu.build --arch 90``.

Optional: without a cubin the module is compiled by NVRTC (through CuPy) on first use and cached by CuPy.
"""
from __future__ import annotations

import argparse

from ._module import build_cubin


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", action="append", default=None, help="compute capability, e.g. 90 (repeatable)")
    ap.add_argument("--nvcc", default="nvcc")
    args = ap.parse_args(argv)
    for cc in args.arch or ["90"]:
        print(build_cubin(cc, nvcc=args.nvcc))


if __name__ == "__main__":
    main()
