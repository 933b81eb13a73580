"""kernels.gpu.pack_device without a GPU: pack_numpy (the index arithmetic of source/pack.cu's pack_slot, in NumPy)
gives byte for byte what layout.pack gives, and plan_for sends the layouts pack_slot does not read to layout.pack.
The kernel itself runs against the host packing in tests/test_cuda_step.py (marker gpu)."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from kernels.gpu import layout as L
from kernels.gpu.pack_device import pack_numpy, plan_for
from kernels.qmoe_spec import QMoESpec
from tests.qmoe_oracle import make_case

SIZES = ((128, 64), (96, 40), (192, 96), (80, 36))  # (H, I): padded k, padded rows, padded gated outputs
ACTIVATIONS = (("swiglu", 1), ("swiglu", 2), ("relu", 0))


def _spec(**kw):
    attrs, t, x, _ = make_case(E=3, T=1, **kw)
    t = {k: v for k, v in t.items() if v is not None}
    return QMoESpec.from_tensors("test/QMoE", "QMoE", attrs, t, x.shape), t


@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("block_size", (0, 16, 32, 64))
def test_the_kernels_index_math_packs_as_layout_pack(bits, block_size):
    cases = itertools.product((False, True), (False, True), (np.float32, np.float16, ml_dtypes.bfloat16), SIZES,
                              ACTIVATIONS)
    for seed, (zp, bias, dtype, (H, I), (act, fusion)) in enumerate(cases):
        if block_size and (H % block_size or I % block_size):
            continue
        spec, t = _spec(seed=seed, H=H, I=I, bits=bits, block_size=block_size, zero_points=zp, bias=bias,
                        dtype=dtype, activation=act, swiglu_fusion=fusion)
        for lay in L.make_layouts(spec, t):
            plan = plan_for(spec, t, lay)
            assert plan is not None, lay.name
            for e in (0, 2):
                want = L.pack(lay, *L.raw_sources(spec, t, lay, np.array([e])), xp=np)
                got = pack_numpy(plan, e)
                assert sorted(got) == sorted(want)
                for key in want:
                    case = (zp, bias, np.dtype(dtype).name, H, I, act, fusion, lay.name, key)
                    assert got[key].dtype == want[key].dtype and got[key].tobytes() == want[key][0].tobytes(), case


def test_layouts_pack_slot_does_not_read_go_to_layout_pack():
    spec, t = _spec(bits=4, block_size=32, activation="swiglu", swiglu_fusion=0)  # FC3
    assert all(plan_for(spec, t, lay) is None for lay in L.make_layouts(spec, t))
    spec, t = _spec(bits=4, block_size=32, H=128, I=64)
    fc1, _ = L.make_layouts(spec, t)
    assert plan_for(spec, t, fc1) is not None
    t_strided = dict(t, fc1_experts_weights=np.asfortranarray(t["fc1_experts_weights"]))  # not C-contiguous
    assert plan_for(spec, t_strided, fc1) is None
    t_f64 = dict(t, fc1_scales=t["fc1_scales"].astype(np.float64))  # would need a conversion on the host
    assert plan_for(spec, t_f64, L.make_layouts(spec, t_f64)[0]) is None
