// Decode (1..8 tokens per expert): grouped dequant-GEMV on the tensor cores.
//
// One launch covers every (expert, token-group) tile of the batch: blockIdx.y = tile (expert slot + up to 8 pairs),
// blockIdx.x = R row tiles of 16 weight rows, blockIdx.z = split of K (FC2 only; partial sums meet in atomicAdd);
// the block's warps split the tile's K further and reduce through shared memory. The weights are the A operand of
// mma.m16n8k16 (16 rows x 16 k), the 8 columns are the tile's tokens: every weight byte is read once per tile.
// Weights dequantise exactly to (q - z) in bf16; activations are split into bf16 hi + lo (two MMAs, ~2^-17
// relative), so results are fp32-accurate with fp32 accumulation. Scales are applied in fp32 on the accumulators
// (per row at the end; per block when a block accumulator is flushed).
// Memory pipeline: each warp streams its k-tiles through a DEC_STAGES-deep cp.async ring in shared memory (weights
// copied lane-by-lane in the global layout, scale / zero-point chunks by the first lanes), so 3 k-tiles per warp
// are in flight; the activations (a few KB, shared by all blocks) come from L1 / L2 one k-tile ahead.
// MODE 0 (FC1 / FC1+FC3 merged): epilogue = bias + activation, writes the activation (bf16 hi/lo, B-fragment layout)
// for FC2. MODE 1 (FC2): epilogue = bias, routing weight, atomicAdd into the fp32 output rows of the tokens.

template <int BITS>
struct QmW;
template <>
struct QmW<4> {
    static const int LW = 1;    // uint4 loads per lane per 64-k tile
    static const int TB = 512;  // bytes per 16 x 64 tile
    static const int LB = 16;   // bytes per lane per tile
};
template <>
struct QmW<8> {
    static const int LW = 2;
    static const int TB = 1024;
    static const int LB = 32;
};

// zero-point constants of rows g (z0) and g+8 (z1): int4 {g, g8, -, -}; int8 {lo g, hi g, lo g8, hi g8}
template <int BITS>
static __device__ __forceinline__ void set_bz(u32* zc, int z0, int z1) {
    if (BITS == 4) {
        zc[0] = bz4(z0);
        zc[1] = bz4(z1);
        zc[2] = zc[0];
        zc[3] = zc[1];
    } else {
        zc[0] = bz8lo(z0);
        zc[1] = bz8hi(z0);
        zc[2] = bz8lo(z1);
        zc[3] = bz8hi(z1);
    }
}

// fp16 decode (dec5h): zero-point constants of rows g (zc[0]) and g+8 (zc[1]); zc[2] / zc[3] copies.
// int4: deq4_f16's fp16x2 of (1024 + z_g) (subtracted from 1024 + q) and of -(64 + z_g8) (fma with the high nibble's
// 1024 + 16 q times 1/16: bits 0xD400 | z << 4, integer code); int8: (1024 + z) for both rows (deq8_f16)
static __device__ __forceinline__ u32 hz4fma(int z) { return pair16((u16)(0xD400u | ((u32)z << 4))); }
template <int BITS>
static __device__ __forceinline__ void set_hzd(u32* zc, int z0, int z1) {
    zc[0] = hzsub(z0);
    zc[1] = BITS == 4 ? hz4fma(z1) : hzsub(z1);
    zc[2] = zc[0];
    zc[3] = zc[1];
}

#define DEC_STAGES 4

#define QM_DEC_ARGS                                                                                             \
    const u8 *__restrict__ W, long long wstride, int NT, int KT, const void *__restrict__ S, int sdt, int NB,       \
        int bs_log2, const u8 *__restrict__ Z, int has_zp, const float *__restrict__ bias, int has_bias, int NP,   \
        const int4 *__restrict__ tiles, const int *__restrict__ num_tiles, const int *__restrict__ pair_tok,        \
        const float *__restrict__ pair_w, const u16 *__restrict__ bhi, const u16 *__restrict__ blo, int split,     \
        int KPB, int act, int gated, float alpha, float beta, float limit, int has_limit, int n_out,               \
        u16 *__restrict__ ahi, u16 *__restrict__ alo, int KP2, float *__restrict__ out
#define QM_DEC_PASS                                                                                             \
    W, wstride, NT, KT, S, sdt, NB, bs_log2, Z, has_zp, bias, has_bias, NP, tiles, num_tiles, pair_tok, pair_w, bhi, \
        blo, split, KPB, act, gated, alpha, beta, limit, has_limit, n_out, ahi, alo, KP2, out

template <int BITS, int R, int MODE>
static __device__ __forceinline__ void dec_gemv_impl(QM_DEC_ARGS) {
#if QM_TC
    typedef QmW<BITS> TR;
    extern __shared__ __align__(16) unsigned char dsm[];
    if ((int)blockIdx.y >= *num_tiles) return;
    const int4 tl = tiles[blockIdx.y];
    const int slot = tl.x, start = tl.y, cnt = tl.z;
    const int rt0 = blockIdx.x * R;
    if (rt0 >= NT) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const bool blockwise = bs_log2 >= 0;

    // k-tiles of this warp: whole scale blocks ("units"), split over gridDim.z, then over the block's warps
    const int ulog = bs_log2 > 6 ? bs_log2 - 6 : 0;
    const int nunits = (KT + (1 << ulog) - 1) >> ulog;
    const int upb = (nunits + (int)gridDim.z - 1) / (int)gridDim.z;
    const int ub0 = min(nunits, (int)blockIdx.z * upb);
    const int ub1 = min(nunits, ub0 + upb);
    const int upw = (ub1 - ub0 + nw - 1) / nw;
    const int uw0 = min(ub1, ub0 + warp * upw);
    const int uw1 = min(ub1, uw0 + upw);
    const int kt0 = min(KT, uw0 << ulog), kt1 = min(KT, uw1 << ulog);

    // B operand: column g = pair start + g (FC1: that pair's token row of x; FC2: the pair's activation row)
    const bool bval = g < cnt;
    long long brow = 0;
    if (bval) brow = (long long)(MODE == 0 ? pair_tok[start + g] : start + g) * KPB;
    const uint4* bhp = reinterpret_cast<const uint4*>(bhi + brow + t * 16);
    const uint4* blp = reinterpret_cast<const uint4*>(blo + brow + t * 16);

    const u8* Ws = W + (long long)slot * wstride;
    const long long sb = (long long)slot * NT * NB * 16;  // first scale / zero point of this slot

    float acc[R][4], blk[R][4];
    u32 zc[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            acc[r][c] = 0.0f;
            blk[r][c] = 0.0f;
        }
        int z0 = 1 << (BITS - 1), z1 = 1 << (BITS - 1);
        if (has_zp && !blockwise && rt0 + r < NT) {
            const u8* zp = Z + sb + (long long)(rt0 + r) * NB * 16 + g * 2;
            z0 = zp[0];
            z1 = zp[1];
        }
        set_bz<BITS>(zc[r], z0, z1);
    }

    const uint4 zero4 = make_uint4(0u, 0u, 0u, 0u);
    const int nbt = blockwise ? (bs_log2 >= 6 ? 1 : (64 >> bs_log2)) : 0;  // scale blocks per k-tile
    const int ssz = (sdt == DT_F32) ? 4 : 2;
    // k-steps per scale block within a tile: q = j >> qsh, block boundaries every (spm + 1) steps;
    // blocks of >= 128 span tiles: tpm + 1 tiles per block
    const int qsh = blockwise ? min(2, bs_log2 - 4) : 0;
    const int spm = blockwise ? (1 << min(2, bs_log2 - 4)) - 1 : 3;
    const int tpm = (blockwise && bs_log2 > 6) ? (1 << (bs_log2 - 6)) - 1 : 0;

    // Per-warp cp.async pipeline, DEC_STAGES deep. Stage = [R][TB] weights (each lane copies, and later reads, its
    // own 16 / 32 bytes: the same layout as global memory) + [R][256] scales + [R][64] zero points of the tile's
    // scale blocks (copied by the first lanes; read by all after __syncwarp).
    const int WSB = R * TR::TB + R * 320;  // bytes per warp-stage
    unsigned char* wp = dsm + warp * DEC_STAGES * WSB;
    const u32 wpa = smem_u32(wp);
    const u8* wsrc[R];
    bool wok[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        wok[r] = rt0 + r < NT;
        wsrc[r] = Ws + (wok[r] ? (long long)(rt0 + r) * KT * TR::TB + lane * TR::LB : 0);
    }
    // scale / zero-point chunk (16 bytes) copied by this lane, if any
    const int schunks = nbt * ssz;  // 16-byte chunks of scales per row tile and tile
    const int s_r = schunks ? lane / schunks : R;
    const bool s_on = blockwise && s_r < R && rt0 + s_r < NT;
    const unsigned char* ssrc = s_on ? (const unsigned char*)S + (sb + (long long)(rt0 + s_r) * NB * 16) * ssz +
                                           (lane % schunks) * 16
                                     : (const unsigned char*)S;
    const u32 sdst = (u32)(R * TR::TB + s_r * 256 + (schunks ? lane % schunks : 0) * 16);
    const int z_r = nbt ? lane / nbt : R;
    const bool z_on = blockwise && has_zp && z_r < R && rt0 + z_r < NT;
    const u8* zsrc = z_on ? Z + sb + (long long)(rt0 + z_r) * NB * 16 + (lane % nbt) * 16 : Z;
    const u32 zdst = (u32)(R * TR::TB + R * 256 + z_r * 64 + (nbt ? lane % nbt : 0) * 16);

    auto load = [&](int kt, int st) {
        const u32 d = wpa + (u32)(st * WSB);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int q = 0; q < TR::LW; ++q)
                cp_async16(d + r * TR::TB + lane * TR::LB + q * 16, wsrc[r] + (long long)kt * TR::TB + q * 16,
                           wok[r] ? 16 : 0);
        if (blockwise) {
            const int b0 = (kt << 6) >> bs_log2;
            if (s_on) cp_async16(d + sdst, ssrc + (long long)b0 * 16 * ssz, 16);
            if (z_on) cp_async16(d + zdst, zsrc + (long long)b0 * 16, 16);
        }
    };

    uint4 bh0 = zero4, bh1 = zero4, bl0 = zero4, bl1 = zero4;
    uint4 nh0 = zero4, nh1 = zero4, nl0 = zero4, nl1 = zero4;
    auto load_b = [&](int kt, uint4& h0, uint4& h1, uint4& l0, uint4& l1) {
        if (bval) {
            h0 = __ldg(bhp + kt * 8);
            h1 = __ldg(bhp + kt * 8 + 1);
            if (split) {
                l0 = __ldg(blp + kt * 8);
                l1 = __ldg(blp + kt * 8 + 1);
            }
        }
    };

    auto compute = [&](int kt, int st, const uint4& h0, const uint4& h1, const uint4& l0, const uint4& l1) {
        const unsigned char* p = wp + st * WSB;
        uint4 wv[R][TR::LW];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int q = 0; q < TR::LW; ++q)
                wv[r][q] = *reinterpret_cast<const uint4*>(p + r * TR::TB + lane * TR::LB + q * 16);
        // block accumulator boundaries; one row scale: the warp's whole k-range is one "block" (scale 1 here,
        // the row scale is applied after the cross-warp reduction)
        const bool tfirst = blockwise ? ((kt & tpm) == 0) : (kt == kt0);
        const bool tlast = blockwise ? (((kt + 1) & tpm) == 0) : (kt + 1 == kt1);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int q = j >> qsh;
            const bool first = tfirst && ((j & spm) == 0);
            const bool last = tlast && (((j + 1) & spm) == 0);
            const uint4& hv = (j < 2) ? h0 : h1;
            const uint4& lv = (j < 2) ? l0 : l1;
            const u32 bhA = u4c(hv, (j & 1) * 2), bhB = u4c(hv, (j & 1) * 2 + 1);
            const u32 blA = u4c(lv, (j & 1) * 2), blB = u4c(lv, (j & 1) * 2 + 1);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                u32 z0 = zc[r][0], z1 = zc[r][1], z2 = zc[r][2], z3 = zc[r][3];
                if (has_zp && blockwise) {
                    const u32 zv = *reinterpret_cast<const u16*>(p + R * TR::TB + R * 256 + r * 64 + q * 16 + g * 2);
                    u32 zz[4];
                    set_bz<BITS>(zz, (int)(zv & 0xffu), (int)(zv >> 8));
                    z0 = zz[0];
                    z1 = zz[1];
                    z2 = zz[2];
                    z3 = zz[3];
                }
                u32 a[4];
                if (BITS == 4) {
                    deq4_bf16(u4c(wv[r][0], j), z0, z1, a);
                } else {
                    const uint4& w8 = wv[r][(j >> 1) & (TR::LW - 1)];
                    const u32 w0 = u4c(w8, (j & 1) * 2), w1 = u4c(w8, (j & 1) * 2 + 1);
                    a[0] = deq8pair_bf16(w0, 0x4140u, z0, z1);
                    a[1] = deq8pair_bf16(w0, 0x4342u, z2, z3);
                    a[2] = deq8pair_bf16(w1, 0x4140u, z0, z1);
                    a[3] = deq8pair_bf16(w1, 0x4342u, z2, z3);
                }
                // unconditional MMAs (a conditional mma.sync costs a branch + WARPSYNC each): the block accumulator
                // is cleared by selects at a block start; lo is zero for bf16 activations
#pragma unroll
                for (int c = 0; c < 4; ++c) blk[r][c] = first ? 0.0f : blk[r][c];
                mma_bf16(blk[r], a[0], a[1], a[2], a[3], bhA, bhB);
                mma_bf16(blk[r], a[0], a[1], a[2], a[3], blA, blB);
            }
            if (last) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    float sx = 1.0f, sy = 1.0f;
                    if (blockwise) {
                        const unsigned char* sp = p + R * TR::TB + r * 256 + (q * 16 + g * 2) * ssz;
                        if (ssz == 4) {
                            const float2 v = *reinterpret_cast<const float2*>(sp);
                            sx = v.x;
                            sy = v.y;
                        } else {
                            const u32 v = *reinterpret_cast<const u32*>(sp);
                            if (sdt == DT_F16) {
                                sx = h2f((u16)(v & 0xffffu));
                                sy = h2f((u16)(v >> 16));
                            } else {
                                sx = __uint_as_float(v << 16);
                                sy = __uint_as_float(v & 0xffff0000u);
                            }
                        }
                    }
                    acc[r][0] = fmaf(sx, blk[r][0], acc[r][0]);
                    acc[r][1] = fmaf(sx, blk[r][1], acc[r][1]);
                    acc[r][2] = fmaf(sy, blk[r][2], acc[r][2]);
                    acc[r][3] = fmaf(sy, blk[r][3], acc[r][3]);
                }
            }
        }
    };

#pragma unroll
    for (int s = 0; s < DEC_STAGES - 1; ++s) {
        if (kt0 + s < kt1) load(kt0 + s, s);
        cp_async_commit();
    }
    if (kt0 < kt1) load_b(kt0, bh0, bh1, bl0, bl1);
    int st = 0;
    for (int kt = kt0; kt < kt1; ++kt) {
        cp_async_wait<DEC_STAGES - 2>();
        __syncwarp();
        {
            const int nk = kt + DEC_STAGES - 1;
            if (nk < kt1) load(nk, st == 0 ? DEC_STAGES - 1 : st - 1);
            cp_async_commit();
        }
        if (kt + 1 < kt1) load_b(kt + 1, nh0, nh1, nl0, nl1);
        compute(kt, st, bh0, bh1, bl0, bl1);
        bh0 = nh0;
        bh1 = nh1;
        bl0 = nl0;
        bl1 = nl1;
        st = (st == DEC_STAGES - 1) ? 0 : st + 1;
    }

    // reduce the warps' partial sums (area after the pipeline)
    float* red = reinterpret_cast<float*>(dsm + nw * DEC_STAGES * WSB);
    float* my = red + warp * (R * 128);
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) my[(r * 4 + c) * 32 + lane] = acc[r][c];
    __syncthreads();
    for (int r = warp; r < R; r += nw) {
        const int rt = rt0 + r;
        if (rt >= NT) break;
        float v[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            float s = 0.0f;
            for (int w = 0; w < nw; ++w) s += red[(w * R + r) * 128 + c * 32 + lane];
            v[c] = s;
        }
        if (!blockwise) {
            const float2 s = load_s2(S, sb + (long long)rt * NB * 16 + g * 2, sdt);
            v[0] *= s.x;
            v[1] *= s.x;
            v[2] *= s.y;
            v[3] *= s.y;
        }
        float bg = 0.0f, bg8 = 0.0f;
        if (has_bias && (MODE == 0 || blockIdx.z == 0)) {
            const float* bp = bias + (long long)slot * NP + rt * 16 + g;
            bg = bp[0];
            bg8 = bp[8];
        }
        if (MODE == 0) {
            if (gated) {
                const int i = rt * 8 + g;  // merged tile: rows 0-7 gate, 8-15 up of outputs rt*8 .. rt*8+7
                if (i < n_out) {
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int col = 2 * t + c;
                        if (col < cnt) {
                            const float a = act_gated(act, v[c] + bg, v[2 + c] + bg8, alpha, beta, limit, has_limit);
                            const long long o = (long long)(start + col) * KP2 + frag_off(i);
                            const u16 h = f2bf(a);
                            ahi[o] = h;
                            alo[o] = f2bf(a - bf2f(h));
                        }
                    }
                }
            } else {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int i = rt * 16 + g + 8 * hh;
                    if (i < n_out) {
#pragma unroll
                        for (int c = 0; c < 2; ++c) {
                            const int col = 2 * t + c;
                            if (col < cnt) {
                                const float a = act_one(act, v[hh * 2 + c] + (hh ? bg8 : bg));
                                const long long o = (long long)(start + col) * KP2 + frag_off(i);
                                const u16 h = f2bf(a);
                                ahi[o] = h;
                                alo[o] = f2bf(a - bf2f(h));
                            }
                        }
                    }
                }
            }
        } else {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int n = rt * 16 + g + 8 * hh;
                if (n < n_out) {
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int col = 2 * t + c;
                        if (col < cnt) {
                            const int p = start + col;
                            atomicAdd(out + (long long)pair_tok[p] * n_out + n,
                                      pair_w[p] * (v[hh * 2 + c] + (hh ? bg8 : bg)));
                        }
                    }
                }
            }
        }
    }
#endif
}

// Kernels with plain C names (the same names from NVRTC and from a prebuilt cubin): dec_gemv_<bits>_<R>_<mode>
#define QM_DEC_KERNEL(B, R, M) \
    extern "C" __global__ void __launch_bounds__(256) dec_gemv_##B##_##R##_##M(QM_DEC_ARGS) { dec_gemv_impl<B, R, M>(QM_DEC_PASS); }
QM_DEC_KERNEL(4, 1, 0)
QM_DEC_KERNEL(4, 2, 0)
QM_DEC_KERNEL(4, 1, 1)
QM_DEC_KERNEL(4, 2, 1)
QM_DEC_KERNEL(8, 1, 0)
QM_DEC_KERNEL(8, 2, 0)
QM_DEC_KERNEL(8, 1, 1)
QM_DEC_KERNEL(8, 2, 1)
