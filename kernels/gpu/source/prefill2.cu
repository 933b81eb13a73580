// Prefill v2: grouped GEMM over (expert, BM-token tile) pairs, the weight tile dequantised ONCE per block into shared
// memory (fp16, block scales folded in as in v1) and read by every warp with ldmatrix as the B operand.
//
// v1 (prefill.cu) has each warp dequantise its own 32 weight rows in registers for the block's 32 tokens: one 16 x 16
// fragment dequantised (~17 instructions) per 8 MMAs, ~10 instructions per MMA in all (issue-bound). Here a block is
// 8 warps over 128 weight rows (8 row tiles of 16) x BM tokens (64 or 128): warp w dequantises row tile w of the next
// k-tile (the lane's 16 / 32 raw bytes, the layout's own fragment order) into a double-buffered fp16 tile
// [128 rows][64 k] (XOR-swizzled 16-byte chunks, as the activation tile), while the warps compute on the current
// one: warp (wn = w & 3, wm = w >> 2) owns weight rows wn * 32 .. + 32 (2 row tiles, 4 n8 blocks) and the token m16
// tiles wm, wm + 2, ... of the block's BM: 8 MMAs per (m16 tile, k-step) for 1 A and 2 B ldmatrix. Each dequantised
// value now serves BM tokens instead of 32 (BM = 64: 2.5 instead of ~4.3 dequantisation instructions per MMA).
// Token m16 tiles past the tile's count are skipped (warp-uniform): a 64-token tile of a 20-token expert costs two
// m16 tiles of MMAs, not four.
//
// Pipeline (one __syncthreads per k-tile): cp.async ring of PF2 stages (activation tile, raw weight tiles, fp16 block
// scales, zero points; v1's loaders); iteration kt waits for stage kt + 1, issues stage kt + ST - 1, dequantises
// k-tile kt + 1 into B buffer (kt + 1) & 1 and runs the MMAs of k-tile kt on buffer kt & 1.
// Epilogues, arguments and arithmetic are v1's (same fp16 dequantisation and scale folding: the same products; only
// the fp32 summation is the same too: one accumulator chain per output over k in the same order), so v2 == v1 up to
// nothing but the MMA's internal order.
//
// Shared memory (bytes): ST x (BM * 128 + 8 * TB + 1024 + 512) + 2 x 16384. int4, BM 64, 4 stages: 88,064 (2 blocks
// of 256 threads per SM). BM 128 uses 3 stages: 98,816.

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define QM_STMATRIX 1
#else
#define QM_STMATRIX 0
#endif

// stmatrix x4 (sm_90): lane l gives the row address of row l % 8 of matrix l / 8; register i = matrix i in the
// ldmatrix fragment layout (lane 4 r + c holds row r, columns 2c, 2c + 1)
static __device__ __forceinline__ void stmatrix_x4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
#if QM_STMATRIX
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(r0), "r"(r1),
                 "r"(r2), "r"(r3)
                 : "memory");
#endif
}

// fp16x2 (lo, lo) / (hi, hi) of v: plain PTX moves that ptxas can fold into the HMUL2 operand's half selectors
static __device__ __forceinline__ u32 h2lo(u32 v) {
    u32 d;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; mov.b32 %0, {l, l}; }" : "=r"(d) : "r"(v));
    return d;
}
static __device__ __forceinline__ u32 h2hi(u32 v) {
    u32 d;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; mov.b32 %0, {h, h}; }" : "=r"(d) : "r"(v));
    return d;
}

static __device__ __forceinline__ void sts32(u32 addr, u32 v) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// the dequantised weight tile [128 rows][64 k] fp16, chunk c of row r at chunk c ^ (r & 7)
#define PF2_BTILE 16384

template <int BITS, int BM>
struct Pf2Smem {
    static const int A = BM * 128;
    static const int W = 8 * QmW<BITS>::TB;
    static const int S = 8 * 128;  // fp16 block scales: <= 4 blocks x 16 rows x 2 bytes per row tile
    static const int Z = 8 * 64;
    static const int STAGE = A + W + S + Z;
    static const int ST = BM >= 128 ? 3 : 4;  // pipeline stages
    static const int BOFF = ST * STAGE;       // the two B tiles after the ring
    static const int TOTAL = BOFF + 2 * PF2_BTILE;
};

// the MMAs of one k-tile for the warp's first N m16 token tiles (of MTW): per k-step j, B fragments of the warp's
// 4 n8 blocks (x4 per row tile r: (rows 0-7, k lo), (rows 0-7, k hi), (rows 8-15, k lo), (rows 8-15, k hi)), then per
// m16 tile mi (token rows (wm + 2 mi) * 16 ..: 4096 bytes apart) one A ldmatrix and 4 MMAs
template <int N, int MTW>
static __device__ __forceinline__ void pf2_mma(float (&acc)[MTW][4][4], u32 abase, u32 bbase, const u32 (&aoff)[4],
                                               const u32 (&boff)[4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        u32 b[2][4];
#pragma unroll
        for (int r = 0; r < 2; ++r) ldmatrix_x4(bbase + boff[j] + r * 2048, b[r][0], b[r][1], b[r][2], b[r][3]);
#pragma unroll
        for (int mi = 0; mi < N; ++mi) {
            u32 a0, a1, a2, a3;
            ldmatrix_x4(abase + aoff[j] + mi * 4096, a0, a1, a2, a3);
#pragma unroll
            for (int ni = 0; ni < 4; ++ni)
                mma_f16(acc[mi][ni], a0, a1, a2, a3, b[ni >> 1][(ni & 1) * 2], b[ni >> 1][(ni & 1) * 2 + 1]);
        }
    }
}

template <int BITS, int BM, int MODE, int STM>
static __device__ __forceinline__ void pf2_gemm_impl(QM_PF_ARGS) {
#if QM_TC
    typedef QmW<BITS> TR;
    typedef Pf2Smem<BITS, BM> SM;
    constexpr int ST = SM::ST;
    constexpr int NTH = 256;
    constexpr int MTW = BM / 32;           // m16 token tiles per warp (of BM / 16 in the block)
    constexpr int CPT = BM * 8 / NTH;      // 16-byte A chunks per thread per stage
    constexpr int WCH = SM::W / 16 / NTH;  // 16-byte weight chunks per thread per stage
    extern __shared__ __align__(128) unsigned char pf_smem[];
    if ((int)blockIdx.y >= *num_tiles) return;
    const int4 tl = tiles[blockIdx.y];
    const int slot = tl.x, start = tl.y, cnt = tl.z;
    const int rtb = blockIdx.x * 8;
    if (rtb >= NT) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wn = warp & 3, wm = warp >> 2;
    const int rtw = rtb + wn * 2;  // the warp's first row tile (MMAs, epilogue)
    const bool deq_on = rtb + warp < NT;  // warp dequantises row tile rtb + warp
    const bool blockwise = bs_log2 >= 0;
    const int nbt = blockwise ? (bs_log2 >= 6 ? 1 : (64 >> bs_log2)) : 0;
    const int ssz = 2;  // block scales arrive as fp16 (GpuQMoE passes an fp16 copy); per-row scales use sdt
    const u32 sbase = smem_u32(pf_smem);
    const u8* Ws = W + (long long)slot * wstride;
    const long long sb = (long long)slot * NT * NB * 16;

    // A tile loader: chunk c = row m (c / 8), 16-byte column cc (c % 8), stored at column cc ^ (m % 8)
    const u16* asrc[CPT];
    int asz[CPT];
    u32 adst[CPT];
#pragma unroll
    for (int i = 0; i < CPT; ++i) {
        const int c = threadIdx.x + i * NTH;
        const int m = c >> 3, cc = c & 7;
        const bool ok = m < cnt;
        long long row = 0;
        if (ok) row = (MODE == 0) ? (long long)pair_tok[start + m] : (long long)(start + m);
        asrc[i] = A + row * KPA + cc * 8;
        asz[i] = ok ? 16 : 0;
        adst[i] = (u32)((m * 64 + ((cc ^ (m & 7)) << 3)) * 2);
    }
    const u8* wsrc[WCH];
    bool wok[WCH];
    u32 wdst[WCH];
#pragma unroll
    for (int i = 0; i < WCH; ++i) {
        const int c = threadIdx.x + i * NTH;
        const int lt = c / (TR::TB / 16), off = (c % (TR::TB / 16)) * 16;
        wok[i] = rtb + lt < NT;
        wsrc[i] = Ws + (wok[i] ? (long long)(rtb + lt) * KT * TR::TB + off : 0);
        wdst[i] = (u32)(SM::A + lt * TR::TB + off);
    }
    const int per = nbt * ssz;  // 16-byte chunks of scales per row tile and k-tile
    const int s_lt = per ? (int)threadIdx.x / per : 8;
    const bool s_on = blockwise && s_lt < 8 && rtb + s_lt < NT;
    const unsigned char* ssrc =
        s_on ? (const unsigned char*)S + (sb + (long long)(rtb + s_lt) * NB * 16) * ssz + (threadIdx.x % per) * 16
             : (const unsigned char*)S;
    const u32 sdst = (u32)(SM::A + SM::W + s_lt * 128 + (per ? threadIdx.x % per : 0) * 16);
    const int z_lt = nbt ? (int)threadIdx.x / nbt : 8;
    const bool z_on = blockwise && has_zp && z_lt < 8 && rtb + z_lt < NT;
    const u8* zsrc = z_on ? Z + sb + (long long)(rtb + z_lt) * NB * 16 + (threadIdx.x % nbt) * 16 : Z;
    const u32 zdst = (u32)(SM::A + SM::W + SM::S + z_lt * 64 + (nbt ? threadIdx.x % nbt : 0) * 16);

    auto load_stage = [&](int kt, int st) {
        const u32 base = sbase + (u32)(st * SM::STAGE);
#pragma unroll
        for (int i = 0; i < CPT; ++i) cp_async16(base + adst[i], asrc[i] + kt * 64, asz[i]);
#pragma unroll
        for (int i = 0; i < WCH; ++i) cp_async16(base + wdst[i], wsrc[i] + kt * TR::TB, wok[i] ? 16 : 0);
        if (blockwise) {
            const int b0 = (kt << 6) >> bs_log2;
            if (s_on) cp_async16(base + sdst, ssrc + (long long)b0 * 16 * ssz, 16);
            if (z_on) cp_async16(base + zdst, zsrc + (long long)b0 * 16, 16);
        }
    };

    // per-row zero points of the dequantised row tile (rows g, g + 8)
    u32 zc[2];
    {
        int z0 = 1 << (BITS - 1), z1 = 1 << (BITS - 1);
        if (has_zp && !blockwise && deq_on) {
            const u8* zp = Z + sb + (long long)(rtb + warp) * NB * 16 + g * 2;
            z0 = zp[0];
            z1 = zp[1];
        }
        set_hz<BITS>(zc, z0, z1);
    }

    // Shared-memory offsets, loop-invariant. In a 128-byte row of the A or B tile, k-step j's 16-byte chunks are
    // 2j and 2j + 1, stored at chunk ^ (row & 7): the offset of k-step j is k-step 0's XOR (j << 5) (row part in bits
    // >= 7, chunk in bits 4-6; the stage / buffer offsets added later are multiples of 512).
    const int l7 = lane & 7;
    u32 aoff[4], boff[4], soff[4], soff2[4];
    {
        const u32 a0 = (u32)((wm * 16 + (lane & 15)) * 128 + (((lane >> 4) ^ l7) << 4));
        const u32 b0 = (u32)(SM::BOFF + (wn * 32 + l7 + ((lane >> 4) << 3)) * 128 + ((((lane >> 3) & 1) ^ l7) << 4));
        // dequantised stores: stmatrix (lane: row l7 (+8 for matrices 1, 3), chunk 2j (+1 for matrices 2, 3)) or
        // st.shared (rows g / g + 8 at +1024: soff = chunk 2j, soff2 = chunk 2j + 1, word t)
        const u32 s0 = STM ? (u32)(SM::BOFF + (warp * 16 + l7 + ((lane >> 3) & 1) * 8) * 128 + (((lane >> 4) ^ l7) << 4))
                           : (u32)(SM::BOFF + (warp * 16 + g) * 128 + (g << 4) + 4 * t);
        const u32 s1 = (u32)(SM::BOFF + (warp * 16 + g) * 128 + ((1 ^ g) << 4) + 4 * t);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            aoff[j] = a0 ^ (u32)(j << 5);
            boff[j] = b0 ^ (u32)(j << 5);
            soff[j] = s0 ^ (u32)(j << 5);
            soff2[j] = s1 ^ (u32)(j << 5);
        }
    }
    const int qsh = (!blockwise || bs_log2 >= 6) ? 8 : bs_log2 - 4;  // scale block of k-step j: j >> qsh
    const u32 w_off = (u32)(SM::A + warp * TR::TB + lane * TR::LB);
    const u32 sc_off = (u32)(SM::A + SM::W + warp * 128 + g * 4);
    const u32 zp_off = (u32)(SM::A + SM::W + SM::S + warp * 64 + g * 2);

    // dequantise the k-tile in ring stage st into B buffer bb: the warp's row tile, the lane's fragment values
    auto dequant = [&](int st, int bb) {
        if (!deq_on) return;
        const unsigned char* sp = pf_smem + st * SM::STAGE;
        const u32 bbase = sbase + (u32)(bb * PF2_BTILE);
        uint4 wv[TR::LW];
#pragma unroll
        for (int q = 0; q < TR::LW; ++q) wv[q] = *reinterpret_cast<const uint4*>(sp + w_off + q * 16);
        // the block scales of rows g, g + 8 for k-step j: block j >> qsh of the k-tile (qsh 8: one block, 1: block 32,
        // 0: block 16); the four 32-byte block slots read unconditionally (the stage's scale area is 128 bytes per
        // row tile), then selected
        u32 sv[4] = {0u, 0u, 0u, 0u};
        if (blockwise) {
#pragma unroll
            for (int q = 0; q < 4; ++q) sv[q] = *reinterpret_cast<const u32*>(sp + sc_off + q * 32);
            if (qsh != 0) {
                sv[3] = qsh == 1 ? sv[1] : sv[0];
                sv[2] = qsh == 1 ? sv[1] : sv[0];
                sv[1] = sv[0];
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int q = j >> qsh;
            u32 z2[2] = {zc[0], zc[1]};
            if (has_zp && blockwise) {
                const u32 zv = *reinterpret_cast<const u16*>(sp + zp_off + q * 16);
                set_hz<BITS>(z2, (int)(zv & 0xffu), (int)((zv >> 8) & 0xffu));
            }
            u32 bf[4];
            if (BITS == 4) {
                deq4_f16(u4c(wv[0], j), z2[0], z2[1], bf);
            } else {
                const uint4& w8 = wv[(j >> 1) & (TR::LW - 1)];
                deq8_f16(u4c(w8, (j & 1) * 2), u4c(w8, (j & 1) * 2 + 1), z2[0], z2[1], bf);
            }
            if (blockwise) {
                const u32 s0 = h2lo(sv[j]), s1 = h2hi(sv[j]);
                bf[0] = hmul2(bf[0], s0);
                bf[1] = hmul2(bf[1], s1);
                bf[2] = hmul2(bf[2], s0);
                bf[3] = hmul2(bf[3], s1);
            }
            // bf[0] = (row g, k 16j + 2t), bf[1] = (row g + 8, same k), bf[2] = (row g, k + 8), bf[3] = (row g + 8, k + 8)
            if (STM) {
                stmatrix_x4(bbase + soff[j], bf[0], bf[1], bf[2], bf[3]);
            } else {
                sts32(bbase + soff[j], bf[0]);
                sts32(bbase + soff[j] + 1024, bf[1]);
                sts32(bbase + soff2[j], bf[2]);
                sts32(bbase + soff2[j] + 1024, bf[3]);
            }
        }
    };

    // m16 token tiles of this warp that hold tokens: wm + 2 mi for mi < nmt (warp-uniform)
    const int mt_all = (cnt + 15) >> 4;
    const int nmt = mt_all > wm ? (mt_all - wm + 1) >> 1 : 0;
    const bool mma_on = nmt > 0 && rtw < NT;

    float acc[MTW][4][4];
#pragma unroll
    for (int mi = 0; mi < MTW; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[mi][ni][c] = 0.0f;

#pragma unroll
    for (int s = 0; s < ST - 1; ++s) {
        if (s < KT) load_stage(s, s);
        cp_async_commit();
    }
    cp_async_wait<ST - 2>();  // stage 0
    __syncthreads();
    dequant(0, 0);
    int s_rd = 0;  // kt % ST
    for (int kt = 0; kt < KT; ++kt) {
        // stage kt + 1 landed (groups committed: stages 0 .. kt + ST - 2); B buffer kt & 1 complete; every warp is done
        // with k-tile kt - 1 (its ring stage and B buffer (kt + 1) & 1)
        cp_async_wait<ST - 3>();
        __syncthreads();
        const int s_nx = s_rd + 1 == ST ? 0 : s_rd + 1;
        {
            const int nk = kt + ST - 1;
            if (nk < KT) load_stage(nk, s_rd == 0 ? ST - 1 : s_rd - 1);
            cp_async_commit();
        }
        if (kt + 1 < KT) dequant(s_nx, (kt + 1) & 1);
        if (mma_on) {
            const u32 abase = sbase + (u32)(s_rd * SM::STAGE);
            const u32 bbase = sbase + (u32)((kt & 1) * PF2_BTILE);
            if (nmt >= MTW)
                pf2_mma<MTW, MTW>(acc, abase, bbase, aoff, boff);
            else if (nmt == 1)
                pf2_mma<1, MTW>(acc, abase, bbase, aoff, boff);
            else if (nmt == 2)
                pf2_mma<(MTW > 2 ? 2 : 1), MTW>(acc, abase, bbase, aoff, boff);
            else
                pf2_mma<(MTW > 3 ? 3 : 1), MTW>(acc, abase, bbase, aoff, boff);
        }
        s_rd = s_nx;
    }
    cp_async_wait<0>();  // nothing useful is left in flight; do not exit with copies pending

    // epilogue (v1's): acc[mi][ni][hr * 2 + c] = token row (wm + 2 mi) * 16 + g + 8 hr, weight row
    // (ni & 1) * 8 + 2t + c of row tile rtw + (ni >> 1)
    if (!mma_on) return;
#pragma unroll
    for (int mi = 0; mi < MTW; ++mi)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int m = (wm + 2 * mi) * 16 + g + 8 * hr;
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

// pf2_<bits>_<BM>_<mode>[_s]: 256 threads; dynamic shared memory Pf2Smem<bits, BM>::TOTAL bytes. The _s kernels store
// the dequantised tile with 4-byte st.shared instead of stmatrix (sm_90; on older GPUs both are the st.shared form).
#define QM_PF2_KERNEL(B, BM, M)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256, 2) pf2_##B##_##BM##_##M(QM_PF_ARGS) {                         \
        pf2_gemm_impl<B, BM, M, QM_STMATRIX>(QM_PF_PASS);                                                          \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(256, 2) pf2_##B##_##BM##_##M##_s(QM_PF_ARGS) {                     \
        pf2_gemm_impl<B, BM, M, 0>(QM_PF_PASS);                                                                    \
    }
QM_PF2_KERNEL(4, 64, 0)
QM_PF2_KERNEL(4, 64, 1)
QM_PF2_KERNEL(8, 64, 0)
QM_PF2_KERNEL(8, 64, 1)
QM_PF2_KERNEL(4, 128, 0)
QM_PF2_KERNEL(4, 128, 1)
QM_PF2_KERNEL(8, 128, 0)
QM_PF2_KERNEL(8, 128, 1)
