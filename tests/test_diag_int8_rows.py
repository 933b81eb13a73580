"""benchmarks/diag_int8_rows.py: the int8-activation row loop (an experiment) against exact dot products."""
import numpy as np
import pytest

from benchmarks import diag_int8_rows as rows

pytestmark = pytest.mark.skipif(not rows.has_vnni(), reason="needs AVX-512 VNNI")


def _matrices(codes, count=2, n=8, seed=3):
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 256, size=(count, n, codes // 2), dtype=np.uint8)
    sc = rng.uniform(0.5, 1.5, size=(count, n, codes // rows.BLOCK)).astype(np.float32)
    return w, sc


@pytest.mark.parametrize("codes", [2048, 768, 128])
def test_the_int8_loop_equals_the_exact_dot_with_the_rounded_activations(codes):
    """Codes minus the zero point, times the block scales, against the activations as rounded to int8 per block: the
    loop's integer sums are exact, so only float32 rounding is left; matrix 1 is read at its own offset."""
    w, sc = _matrices(codes)
    x = np.random.default_rng(4).standard_normal(codes).astype(np.float32)
    xe, xo, zinit, xscale, xq = rows.quantise_activations(x)
    out = np.empty(w.shape[1], np.float32)
    rows.int8_rows(w, sc, 1, xe, xo, zinit, xscale, out)
    exact = rows.dequantised(w, sc, 1).astype(np.float64) @ xq.astype(np.float64)
    np.testing.assert_allclose(out, exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())
    # rounding to 8 bits moves the result against the float activations, by well under 1% of the largest dot
    true = rows.dequantised(w, sc, 1).astype(np.float64) @ x.astype(np.float64)
    assert 1e-5 < np.abs(out - true).max() / np.abs(true).max() < 1e-2


def test_activations_round_per_block_and_the_lanes_carry_the_zero_points_sums():
    x = np.zeros(rows.CODES, np.float32)
    x[:32] = np.linspace(-2.0, 2.0, 32)  # block 0; every other block is zero
    xe, xo, zinit, xscale, xq = rows.quantise_activations(x)
    assert xscale[:4] == pytest.approx([2.0 / 127] * 4) and xe[0] == -127 and xo[15] == 127
    np.testing.assert_allclose(xq[:32], x[:32], atol=2.0 / 127 / 2 + 1e-7)
    lane0 = int(xe[:4].astype(int).sum() + xo[:4].astype(int).sum())
    assert zinit[0] == -rows.ZERO * lane0 and not zinit[4:].any()
