"""kernels.gpu.pack_device without a GPU: pack_numpy (the index arithmetic of source/pack.cu's pack_expert, in NumPy,
reading the descriptor as the kernel does) on the staging buffer the host's copies fill gives byte for byte what
layout.pack gives; the descriptor's fields are the kernel's; plan_for sends the layouts pack_expert does not read to
layout.pack. The kernel itself runs against the host packing in tests/test_cuda_step.py (marker gpu)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kernels.gpu import layout as L
from kernels.gpu.pack_device import DESC_FIELDS, descriptor, pack_numpy, plan_for, stage_numpy
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
        fc1, fc2 = L.make_layouts(spec, t)
        plan1 = plan_for(spec, t, fc1)
        plans = (plan1, plan_for(spec, t, fc2, offset=plan1.nbytes))
        assert None not in plans
        desc = descriptor(plans, {"fc1": 0, "fc2": 0}, {"fc1": {}, "fc2": {}})
        for e in (0, 2):
            staged = stage_numpy(plans, e)
            for lay, row in zip((fc1, fc2), desc):
                want = L.pack(lay, *L.raw_sources(spec, t, lay, np.array([e])), xp=np)
                got = pack_numpy(row, staged, lay)
                assert sorted(got) == sorted(want)
                for key in want:
                    case = (zp, bias, np.dtype(dtype).name, H, I, act, fusion, lay.name, key)
                    assert got[key].dtype == want[key].dtype and got[key].tobytes() == want[key][0].tobytes(), case


def test_layouts_pack_expert_does_not_read_go_to_layout_pack():
    spec, t = _spec(bits=4, block_size=32, activation="swiglu", swiglu_fusion=0)  # FC3
    assert all(plan_for(spec, t, lay) is None for lay in L.make_layouts(spec, t))
    spec, t = _spec(bits=4, block_size=32, H=128, I=64)
    fc1, _ = L.make_layouts(spec, t)
    assert plan_for(spec, t, fc1) is not None
    t_strided = dict(t, fc1_experts_weights=np.asfortranarray(t["fc1_experts_weights"]))  # not C-contiguous
    assert plan_for(spec, t_strided, fc1) is None
    t_f64 = dict(t, fc1_scales=t["fc1_scales"].astype(np.float64))  # would need a conversion on the host
    assert plan_for(spec, t_f64, L.make_layouts(spec, t_f64)[0]) is None


def test_the_descriptor_fields_are_the_kernels_in_its_order():
    source = (Path(__file__).resolve().parents[1] / "kernels" / "gpu" / "source" / "pack.cu").read_text()
    enum = re.search(r"enum \{(.*?)\};", source, re.S).group(1)
    names = [n.strip() for n in enum.split(",") if n.strip()]
    assert names[-1] == "PK_NFIELDS"
    assert names[:-1] == ["PK_" + field.upper() for field in DESC_FIELDS]


def test_the_descriptor_says_where_each_slot_array_is_and_what_is_absent():
    spec, t = _spec(bits=4, block_size=32, H=128, I=64, zero_points=False, bias=True)
    fc1, fc2 = L.make_layouts(spec, t)
    plan1 = plan_for(spec, t, fc1)
    plans = (plan1, plan_for(spec, t, fc2, offset=plan1.nbytes))
    arrays = {"fc1": {"w": (1000, 10), "s": (2000, 20), "b": (3000, 30)}, "fc2": {"w": (4000, 40), "s": (5000, 50)}}
    desc = descriptor(plans, {"fc1": 111, "fc2": 222}, arrays)
    field = {name: i for i, name in enumerate(DESC_FIELDS)}
    assert desc[0, field["row_src"]] == 111 and desc[1, field["row_src"]] == 222
    assert (desc[0, field["dst_w"]], desc[0, field["str_w"]], desc[0, field["dst_b"]]) == (1000, 10, 3000)
    assert desc[1, field["dst_b"]] == 0 and desc[1, field["str_s"]] == 50  # no bias array given for FC2
    assert desc[0, field["src_z"]] == -1 and desc[0, field["src_w"]] == 0  # no zero points; FC1 staged first
    assert desc[1, field["src_w"]] == plan1.nbytes  # FC2 staged after FC1
    assert desc[0, field["items"]] == fc1.w_bytes + fc1.s_len + fc1.NP
    with pytest.raises(ValueError, match=r"fc1: pack_expert writes no slot array \['q'\]"):
        descriptor(plans, {"fc1": 111, "fc2": 222}, dict(arrays, fc1={"w": (1, 1), "q": (2, 2)}))
