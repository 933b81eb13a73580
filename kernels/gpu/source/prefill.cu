// Prefill: grouped GEMM over (expert, token-group) tiles on the tensor cores (mma.sync m16n8k16, fp16 in, fp32 acc).
//
// blockIdx.y = tile (expert slot + up to BM pairs of that expert), blockIdx.x = 128 weight rows (4 warps x 2 row
// tiles of 16). The tile's activation rows (gathered by token for FC1, the pairs' own rows for FC2) are copied into
// shared memory with cp.async (double buffered, XOR-swizzled 16-byte chunks, read by ldmatrix) and form the A
// operand; each warp reads its weight fragments straight from global memory in the kernel layout (the same layout as
// decode: one 16-byte load per lane per 16 x 64 tile for int4), dequantises them in registers to fp16 B fragments
// (per-block scales folded in fp16; per-row scales applied in fp32 in the epilogue) and issues BM/16 x 4 MMAs per
// k-step. Epilogues as in decode: FC1 = bias + activation -> fp16 activation rows for FC2; FC2 = bias, routing
// weight, atomicAdd into the fp32 output.

template <int BITS>
static __device__ __forceinline__ void set_hz(u32* zc, int z0, int z1) {
    zc[0] = hzsub(z0);
    zc[1] = (BITS == 4) ? hzfma(z1) : hzsub(z1);
}

#define QM_PF_ARGS                                                                                              \
    const u8 *__restrict__ W, long long wstride, int NT, int KT, const void *__restrict__ S, int sdt, int NB,       \
        int bs_log2, const u8 *__restrict__ Z, int has_zp, const float *__restrict__ bias, int has_bias, int NP,   \
        const int4 *__restrict__ tiles, const int *__restrict__ num_tiles, const int *__restrict__ pair_tok,        \
        const float *__restrict__ pair_w, const u16 *__restrict__ A, int KPA, int act, int gated, float alpha,     \
        float beta, float limit, int has_limit, int n_out, u16 *__restrict__ a_out, int KP2, float *__restrict__ out
#define QM_PF_PASS                                                                                              \
    W, wstride, NT, KT, S, sdt, NB, bs_log2, Z, has_zp, bias, has_bias, NP, tiles, num_tiles, pair_tok, pair_w, A,   \
        KPA, act, gated, alpha, beta, limit, has_limit, n_out, a_out, KP2, out

template <int BITS, int BM, int MODE>
static __device__ __forceinline__ void pf_gemm_impl(QM_PF_ARGS) {
#if QM_TC
    typedef QmW<BITS> TR;
    constexpr int MT = BM / 16;   // m16 tiles of tokens
    constexpr int CPT = BM / 16;  // 16-byte chunks of the A tile per thread (BM rows x 8 chunks / 128 threads)
    __shared__ __align__(128) u16 As[2 * BM * 64];
    if ((int)blockIdx.y >= *num_tiles) return;
    const int4 tl = tiles[blockIdx.y];
    const int slot = tl.x, start = tl.y, cnt = tl.z;
    const int rtb = blockIdx.x * 8;
    if (rtb >= NT) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int rtw = rtb + warp * 2;
    const bool blockwise = bs_log2 >= 0;

    // A tile loader: chunk c = row m (c / 8), 16-byte column cc (c % 8), stored at column cc ^ (m % 8)
    const u32 as0 = smem_u32(As);
    const u16* src[CPT];
    int ssz[CPT];
    u32 dst[CPT];
#pragma unroll
    for (int i = 0; i < CPT; ++i) {
        const int c = threadIdx.x + i * 128;
        const int m = c >> 3, cc = c & 7;
        const bool ok = m < cnt;
        long long row = 0;
        if (ok) row = (MODE == 0) ? (long long)pair_tok[start + m] : (long long)(start + m);
        src[i] = A + row * KPA + cc * 8;
        ssz[i] = ok ? 16 : 0;
        dst[i] = (u32)((m * 64 + ((cc ^ (m & 7)) << 3)) * 2);
    }
    auto load_a = [&](int kt, int buf) {
#pragma unroll
        for (int i = 0; i < CPT; ++i) cp_async16(as0 + (u32)(buf * BM * 128) + dst[i], src[i] + kt * 64, ssz[i]);
    };

    const u8* Ws = W + (long long)slot * wstride;
    const long long sb = (long long)slot * NT * NB * 16;
    const uint4 zero4 = make_uint4(0u, 0u, 0u, 0u);
    uint4 wc[2][TR::LW], wn[2][TR::LW];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int q = 0; q < TR::LW; ++q) {
            wc[r][q] = zero4;
            wn[r][q] = zero4;
        }
    auto load_w = [&](int kt, uint4(&wd)[2][TR::LW]) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (rtw + r < NT) {
                const uint4* p =
                    reinterpret_cast<const uint4*>(Ws + ((long long)(rtw + r) * KT + kt) * TR::TB + lane * TR::LB);
#pragma unroll
                for (int q = 0; q < TR::LW; ++q) wd[r][q] = __ldg(p + q);
            }
        }
    };

    u32 zc[2][2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        int z0 = 1 << (BITS - 1), z1 = 1 << (BITS - 1);
        if (has_zp && !blockwise && rtw + r < NT) {
            const u8* zp = Z + sb + (long long)(rtw + r) * NB * 16 + g * 2;
            z0 = zp[0];
            z1 = zp[1];
        }
        set_hz<BITS>(zc[r], z0, z1);
    }

    float acc[MT][4][4];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[mi][ni][c] = 0.0f;

    const int nbt = blockwise ? (bs_log2 >= 6 ? 1 : (64 >> bs_log2)) : 0;

    load_a(0, 0);
    cp_async_commit();
    load_w(0, wc);
    for (int kt = 0; kt < KT; ++kt) {
        if (kt + 1 < KT) {
            load_a(kt + 1, (kt + 1) & 1);
            load_w(kt + 1, wn);
        }
        cp_async_commit();
        // per-block scales (fp16, folded into the weights) and zero points of this k-tile
        u32 sg[2][4], sg8[2][4], zr[2][4];
        const int b0 = blockwise ? ((kt << 6) >> bs_log2) : 0;
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                sg[r][q] = 0u;
                sg8[r][q] = 0u;
                zr[r][q] = 0u;
                if (q < nbt && rtw + r < NT) {
                    const long long si = sb + ((long long)(rtw + r) * NB + b0 + q) * 16 + g * 2;
                    const float2 s = load_s2(S, si, sdt);
                    sg[r][q] = pair16(f2h(s.x));
                    sg8[r][q] = pair16(f2h(s.y));
                    if (has_zp) zr[r][q] = *(const u16*)(Z + si);
                }
            }
        cp_async_wait1();
        __syncthreads();
        const u32 abase = as0 + (u32)((kt & 1) * BM * 128);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int q = (!blockwise || bs_log2 >= 6) ? 0 : (j >> (bs_log2 - 4));
            u32 bf[2][4];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                u32 z2[2] = {zc[r][0], zc[r][1]};
                if (has_zp && blockwise) {
                    const u32 zv = sel4u(zr[r], q);
                    set_hz<BITS>(z2, (int)(zv & 0xffu), (int)((zv >> 8) & 0xffu));
                }
                if (BITS == 4) {
                    deq4_f16(u4c(wc[r][0], j), z2[0], z2[1], bf[r]);
                } else {
                    const uint4& wv = wc[r][(j >> 1) & (TR::LW - 1)];
                    deq8_f16(u4c(wv, (j & 1) * 2), u4c(wv, (j & 1) * 2 + 1), z2[0], z2[1], bf[r]);
                }
                if (blockwise) {
                    const u32 s0 = sel4u(sg[r], q), s1 = sel4u(sg8[r], q);
                    bf[r][0] = hmul2(bf[r][0], s0);
                    bf[r][1] = hmul2(bf[r][1], s1);
                    bf[r][2] = hmul2(bf[r][2], s0);
                    bf[r][3] = hmul2(bf[r][3], s1);
                }
            }
#pragma unroll
            for (int mi = 0; mi < MT; ++mi) {
                const int row = mi * 16 + (lane & 15);
                const int ch = j * 2 + (lane >> 4);
                u32 a0, a1, a2, a3;
                ldmatrix_x4(abase + (u32)((row * 64 + ((ch ^ (row & 7)) << 3)) * 2), a0, a1, a2, a3);
#pragma unroll
                for (int ni = 0; ni < 4; ++ni)
                    mma_f16(acc[mi][ni], a0, a1, a2, a3, bf[ni >> 1][ni & 1], bf[ni >> 1][(ni & 1) + 2]);
            }
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int q = 0; q < TR::LW; ++q) wc[r][q] = wn[r][q];
    }

    // epilogue: acc[mi][ni][hr * 2 + c] = token row mi*16 + g + 8*hr, weight row (ni & 1) * 8 + 2t + c of row tile
    // rtw + (ni >> 1)
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int m = mi * 16 + g + 8 * hr;
            if (m >= cnt) continue;
            const int p = start + m;
            int tok = 0;
            float pw = 0.0f;
            if (MODE == 1) {
                tok = pair_tok[p];
                pw = pair_w[p];
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int rt = rtw + r;
                if (rt >= NT) continue;
                const long long srow = sb + (long long)rt * NB * 16;  // per-row scales (NB == 1)
                const float* bp = bias + (long long)slot * NP + rt * 16;
                if (MODE == 0 && gated) {
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int gg = 2 * t + c;
                        const int i = rt * 8 + gg;
                        if (i >= n_out) continue;
                        float gv = acc[mi][r * 2][hr * 2 + c], uv = acc[mi][r * 2 + 1][hr * 2 + c];
                        if (!blockwise) {
                            gv *= load_f(S, srow + gg * 2, sdt);
                            uv *= load_f(S, srow + gg * 2 + 1, sdt);
                        }
                        if (has_bias) {
                            gv += bp[gg];
                            uv += bp[8 + gg];
                        }
                        a_out[(long long)p * KP2 + i] = f2h(act_gated(act, gv, uv, alpha, beta, limit, has_limit));
                    }
                } else {
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                        for (int c = 0; c < 2; ++c) {
                            const int row16 = hh * 8 + 2 * t + c;
                            const int n = rt * 16 + row16;
                            if (n >= n_out) continue;
                            float v = acc[mi][r * 2 + hh][hr * 2 + c];
                            if (!blockwise) v *= load_f(S, srow + (row16 & 7) * 2 + (row16 >> 3), sdt);
                            if (has_bias) v += bp[row16];
                            if (MODE == 0)
                                a_out[(long long)p * KP2 + n] = f2h(act_one(act, v));
                            else
                                atomicAdd(out + (long long)tok * n_out + n, pw * v);
                        }
                }
            }
        }
#endif
}

// pf_gemm_<bits>_<BM>_<mode>
#define QM_PF_KERNEL(B, BM, M) \
    extern "C" __global__ void __launch_bounds__(128) pf_gemm_##B##_##BM##_##M(QM_PF_ARGS) { pf_gemm_impl<B, BM, M>(QM_PF_PASS); }
QM_PF_KERNEL(4, 32, 0)
QM_PF_KERNEL(4, 64, 0)
QM_PF_KERNEL(4, 32, 1)
QM_PF_KERNEL(4, 64, 1)
QM_PF_KERNEL(8, 32, 0)
QM_PF_KERNEL(8, 64, 0)
QM_PF_KERNEL(8, 32, 1)
QM_PF_KERNEL(8, 64, 1)
