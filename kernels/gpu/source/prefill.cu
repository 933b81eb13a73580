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

// shared memory of one pipeline stage: the A tile (BM tokens x 64 k, fp16, swizzled), the raw weight tiles of the
// block's 8 row tiles, their scales (up to 4 blocks x 16 rows, fp32 or 16-bit) and zero points
template <int BITS, int BM>
struct PfSmem {
    static const int A = BM * 128;
    static const int W = 8 * QmW<BITS>::TB;
    static const int S = 8 * 256;
    static const int Z = 8 * 64;
    static const int STAGE = A + W + S + Z;
    static const int STAGE_WG = (STAGE + 1023) & ~1023;  // pf_gemmw: each stage's A tile on a 1024-byte boundary
};
#define PF_STAGES 4

// pf_gemmw (sm_90a): the weights are wgmma's A operand, dequantised in registers (the fragments pf_gemm feeds to
// mma.sync as B are exactly wgmma's register A fragments: rows g / g+8 of each warp's 16 rows, k 2t.. / 2t+8..), the
// tile's tokens its B operand (N = BM) read by the tensor cores straight from the swizzled A tile in shared memory:
// pf_gemm's 16-byte chunk XOR (row % 8) layout is wgmma's 128-byte swizzle, K-major, 8-row atoms 1024 bytes apart.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QM_WG 1
#else
#define QM_WG 0
#endif

static __device__ __forceinline__ unsigned long long wg_desc(u32 saddr) {
    // start address >> 4, leading byte offset 16 (unused with the swizzle), stride byte offset 1024, 128-byte swizzle
    return (unsigned long long)((saddr & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

static __device__ __forceinline__ void wg_fence() {
#if QM_WG
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

static __device__ __forceinline__ void wg_commit_wait_all() {
#if QM_WG
    asm volatile("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}

// shared memory written by cp.async (generic proxy) made visible to wgmma's reads (async proxy)
static __device__ __forceinline__ void fence_proxy_async() {
#if QM_WG
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// d (64 x N, fp32; BM / 2 per thread) += a (64 x 16 fp16, registers) * B (16 x N, shared memory, descriptor); the
// scale-d predicate is 1 (accumulate). The accumulators are listed as asm operands, 8 at a time (QM_ACC8).
template <int N>
static __device__ __forceinline__ void wg_mma_rs(float* d, const u32* a, unsigned long long desc);

#define QM_ACC8(i) \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
        "+f"(d[i + 7])

template <>
__device__ __forceinline__ void wg_mma_rs<32>(float* d, const u32* a, unsigned long long desc) {
#if QM_WG
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : QM_ACC8(0), QM_ACC8(8)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
#else
    __trap();
#endif
}
template <>
__device__ __forceinline__ void wg_mma_rs<48>(float* d, const u32* a, unsigned long long desc) {
#if QM_WG
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n48k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23"
        "}, {%24, %25, %26, %27}, %28, p, 1, 1, 0;\n}\n"
        : QM_ACC8(0), QM_ACC8(8), QM_ACC8(16)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
#else
    __trap();
#endif
}
template <>
__device__ __forceinline__ void wg_mma_rs<64>(float* d, const u32* a, unsigned long long desc) {
#if QM_WG
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : QM_ACC8(0), QM_ACC8(8), QM_ACC8(16), QM_ACC8(24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
#else
    __trap();
#endif
}

// the token and routing weight of pair p where the epilogue needs them (FC2: MODE 1)
template <int MODE>
static __device__ __forceinline__ void pf_pair(const int* pair_tok, const float* pair_w, int p, int& tok, float& pw) {
    tok = 0;
    pw = 0.0f;
    if (MODE == 1) {
        tok = pair_tok[p];
        pw = pair_w[p];
    }
}

// one ungated output of a tile: FC1 (MODE 0) its activation, as fp16, at a_out[a_at]; FC2 the pair's weighted value
// added into out[o_at]
template <int MODE>
static __device__ __forceinline__ void pf_emit(float v, int act, u16* a_out, long long a_at, float* out, long long o_at,
                                               float pw) {
    if (MODE == 0)
        a_out[a_at] = f2h(act_one(act, v));
    else
        atomicAdd(out + o_at, pw * v);
}

// FC2's wgmma epilogue: this lane's features n0 + g and n0 + g + 8 of one pair's token, weighted and added into out.
// Lane ^ 4 holds features g ^ 1 of the same token, so one shuffle gives each lane two adjacent features, added with
// one v2 reduction on sm_90 (half the L2 reductions of one atomicAdd a value). Every lane of the warp must call it;
// p < 0 marks a lane whose token is past the tile's count.
static __device__ __forceinline__ void pf_add_pair(float v0, float v1, float b0, float b1, int p, const int* pair_tok,
                                                   const float* pair_w, int n0, int g, int n_out, float* out) {
    int tok = 0;
    float pw = 0.0f;
    if (p >= 0) {
        tok = pair_tok[p];
        pw = pair_w[p];
    }
    v0 = pw * (v0 + b0);
    v1 = pw * (v1 + b1);
    const bool odd = g & 1;
    const float got = __shfl_xor_sync(QM_FULL, odd ? v0 : v1, 4);
    if (p < 0) return;
    const int n = n0 + (odd ? g + 7 : g);
    const float lo = odd ? got : v0, hi = odd ? v1 : got;
    float* at = out + (long long)tok * n_out + n;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (n + 1 < n_out && ((size_t)at & 7) == 0) {
        asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(at), "f"(lo), "f"(hi) : "memory");
        return;
    }
#endif
    if (n < n_out) atomicAdd(at, lo);
    if (n + 1 < n_out) atomicAdd(at + 1, hi);
}

// SP: compiled for the common case only (int4, block 32, no zero point; the pf_gemmc kernels, GpuQMoE._pf_name)
// WG: pf_gemmw (wgmma; with SP only)
template <int BITS, int BM, int MODE, bool SP = false, bool WG = false>
static __device__ __forceinline__ void pf_gemm_impl(QM_PF_ARGS) {
#if QM_TC
    typedef QmW<BITS> TR;
    typedef PfSmem<BITS, BM> SM;
    constexpr int STG = WG ? SM::STAGE_WG : SM::STAGE;  // bytes per pipeline stage
    constexpr int MT = BM / 16;                   // m16 tiles of tokens
    constexpr int CPT = BM / 16;                  // 16-byte A chunks per thread per stage
    constexpr int WCH = SM::W / 16 / 128;         // 16-byte weight chunks per thread per stage
    extern __shared__ __align__(128) unsigned char pf_smem[];
    if ((int)blockIdx.y >= *num_tiles) return;
    const int4 tl = tiles[blockIdx.y];
    const int slot = tl.x, start = tl.y, cnt = tl.z;
    const int rtb = blockIdx.x * 8;
    if (rtb >= NT) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int rtw = rtb + warp * 2;
    const bool blockwise = SP ? true : bs_log2 >= 0;
    if (SP) {
        bs_log2 = 5;
        has_zp = 0;
    }
    const int nbt = blockwise ? (bs_log2 >= 6 ? 1 : (64 >> bs_log2)) : 0;
    const int ssz = 2;  // block scales arrive as fp16 (GpuQMoE passes an fp16 copy); per-row scales use sdt
    const u32 sraw = smem_u32(pf_smem);
    const u32 sbase = WG ? ((sraw + 1023u) & ~1023u) : sraw;  // pf_gemmw: launched with 1024 bytes to spare
    unsigned char* const smem0 = pf_smem + (sbase - sraw);
    const u8* Ws = W + (long long)slot * wstride;
    const long long sb = (long long)slot * NT * NB * 16;

    // A tile loader: chunk c = row m (c / 8), 16-byte column cc (c % 8), stored at column cc ^ (m % 8)
    const u16* asrc[CPT];
    int asz[CPT];
    u32 adst[CPT];
#pragma unroll
    for (int i = 0; i < CPT; ++i) {
        const int c = threadIdx.x + i * 128;
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
        const int c = threadIdx.x + i * 128;
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
    const u32 sdst = (u32)(SM::A + SM::W + s_lt * 256 + (per ? threadIdx.x % per : 0) * 16);
    const int z_lt = nbt ? (int)threadIdx.x / nbt : 8;
    const bool z_on = blockwise && has_zp && z_lt < 8 && rtb + z_lt < NT;
    const u8* zsrc = z_on ? Z + sb + (long long)(rtb + z_lt) * NB * 16 + (threadIdx.x % nbt) * 16 : Z;
    const u32 zdst = (u32)(SM::A + SM::W + SM::S + z_lt * 64 + (nbt ? threadIdx.x % nbt : 0) * 16);

    auto load_stage = [&](int kt, int st) {
        const u32 base = sbase + (u32)(st * STG);
#pragma unroll
        for (int i = 0; i < CPT; ++i) cp_async16(base + adst[i], asrc[i] + kt * 64, asz[i]);
#pragma unroll
        for (int i = 0; i < WCH; ++i) cp_async16(base + wdst[i], wsrc[i] + (long long)kt * TR::TB, wok[i] ? 16 : 0);
        if (blockwise) {
            const int b0 = (kt << 6) >> bs_log2;
            if (s_on) cp_async16(base + sdst, ssrc + (long long)b0 * 16 * ssz, 16);
            if (z_on) cp_async16(base + zdst, zsrc + (long long)b0 * 16, 16);
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

    // mma.sync: acc[mi][ni] = token rows mi*16.., weight rows (ni & 1) * 8.. of row tile rtw + (ni >> 1);
    // wgmma: accw[r] = this warp's 16 rows of row tile rtw + r x the BM tokens (see the epilogue)
    float acc[MT][4][4];
    float accw[WG ? 2 : 1][WG ? BM / 2 : 1];
    if constexpr (WG) {
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int i = 0; i < BM / 2; ++i) accw[r][i] = 0.0f;
    } else {
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
            for (int ni = 0; ni < 4; ++ni)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[mi][ni][c] = 0.0f;
    }

#pragma unroll
    for (int s = 0; s < PF_STAGES - 1; ++s) {
        if (s < KT) load_stage(s, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<PF_STAGES - 2>();
        __syncthreads();
        if constexpr (WG) fence_proxy_async();
        {
            const int nk = kt + PF_STAGES - 1;
            if (nk < KT) load_stage(nk, nk % PF_STAGES);
            cp_async_commit();
        }
        const int st = kt % PF_STAGES;
        const unsigned char* sp = smem0 + st * STG;
        const u32 abase = sbase + (u32)(st * STG);
        const unsigned long long desc = wg_desc(abase);
        uint4 wv[2][TR::LW];
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int q = 0; q < TR::LW; ++q)
                wv[r][q] = *reinterpret_cast<const uint4*>(sp + SM::A + (warp * 2 + r) * TR::TB + lane * TR::LB + q * 16);
        // SP: the k-step's two block scales per row tile as fp16x2 broadcasts of rows g / g+8, read once: the MMA
        // asm's memory clobbers would otherwise have them read again for every k16 step j
        u32 ssp[SP ? 2 : 1][2][2];
        if constexpr (SP) {
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int qq = 0; qq < 2; ++qq) {
                    const u32 v = *reinterpret_cast<const u32*>(sp + SM::A + SM::W + (warp * 2 + r) * 256 +
                                                                (qq * 16 + g * 2) * 2);
                    h2_bcast(v, ssp[r][qq][0], ssp[r][qq][1]);
                }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int q = (!blockwise || bs_log2 >= 6) ? 0 : (j >> (bs_log2 - 4));
            // wgmma reads its A registers asynchronously (until the wait below): one set per k-step j
            u32 bfj[WG ? 4 : 1][2][4];
            u32(&bf)[2][4] = bfj[WG ? j : 0];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                u32 z2[2] = {zc[r][0], zc[r][1]};
                if (has_zp && blockwise) {
                    const u32 zv = *reinterpret_cast<const u16*>(sp + SM::A + SM::W + SM::S + (warp * 2 + r) * 64 +
                                                                 q * 16 + g * 2);
                    set_hz<BITS>(z2, (int)(zv & 0xffu), (int)((zv >> 8) & 0xffu));
                }
                if (BITS == 4) {
                    deq4_f16(u4c(wv[r][0], j), z2[0], z2[1], bf[r]);
                } else {
                    const uint4& w8 = wv[r][(j >> 1) & (TR::LW - 1)];
                    deq8_f16(u4c(w8, (j & 1) * 2), u4c(w8, (j & 1) * 2 + 1), z2[0], z2[1], bf[r]);
                }
                if (blockwise) {
                    u32 s0, s1;
                    if constexpr (SP) {
                        s0 = ssp[r][j >> 1][0];
                        s1 = ssp[r][j >> 1][1];
                    } else {
                        const u32 v = *reinterpret_cast<const u32*>(sp + SM::A + SM::W + (warp * 2 + r) * 256 +
                                                                    (q * 16 + g * 2) * 2);
                        h2_bcast(v, s0, s1);
                    }
                    bf[r][0] = hmul2(bf[r][0], s0);
                    bf[r][1] = hmul2(bf[r][1], s1);
                    bf[r][2] = hmul2(bf[r][2], s0);
                    bf[r][3] = hmul2(bf[r][3], s1);
                }
            }
            if constexpr (WG) {
                wg_fence();
                // k-step j: 16 k = 32 bytes into each token's 128-byte row (the swizzle applies to the address)
                wg_mma_rs<BM>(accw[0], bf[0], desc + (unsigned long long)(j * 2));
                wg_mma_rs<BM>(accw[1], bf[1], desc + (unsigned long long)(j * 2));
            } else {
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
        }
        if constexpr (WG) wg_commit_wait_all();  // before the next k-step's barrier lets this stage be refilled
    }

    if constexpr (WG) {
        // accw[r][i * 4 + hr * 2 + c] = weight row g + 8 hr of row tile rtw + r, token m = 8 i + 2 t + c (SP: block
        // scales already folded in; gated FC1: row g is the gate and g + 8 the up projection of output rt * 8 + g)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int rt = rtw + r;
            if (rt >= NT) continue;
            const float* bp = bias + (long long)slot * NP + rt * 16;
#pragma unroll
            for (int i = 0; i < BM / 8; ++i)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int m = 8 * i + 2 * t + c;
                    const float* d = &accw[r][i * 4];
                    if (MODE == 1) {  // every lane, so that the lane pairs' shuffle has the whole warp
                        pf_add_pair(d[c], d[2 + c], has_bias ? bp[g] : 0.0f, has_bias ? bp[8 + g] : 0.0f,
                                    m < cnt ? start + m : -1, pair_tok, pair_w, rt * 16, g, n_out, out);
                        continue;
                    }
                    if (m >= cnt) continue;
                    const int p = start + m;
                    if (MODE == 0 && gated) {
                        const int o = rt * 8 + g;
                        if (o >= n_out) continue;
                        float gv = d[c], uv = d[2 + c];
                        if (has_bias) {
                            gv += bp[g];
                            uv += bp[8 + g];
                        }
                        a_out[(long long)p * KP2 + o] = f2h(act_gated(act, gv, uv, alpha, beta, limit, has_limit));
                        continue;
                    }
                    int tok;
                    float pw;
                    pf_pair<MODE>(pair_tok, pair_w, p, tok, pw);
#pragma unroll
                    for (int hr = 0; hr < 2; ++hr) {
                        const int n = rt * 16 + g + 8 * hr;
                        if (n >= n_out) continue;
                        float v = d[hr * 2 + c];
                        if (has_bias) v += bp[g + 8 * hr];
                        pf_emit<MODE>(v, act, a_out, (long long)p * KP2 + n, out, (long long)tok * n_out + n, pw);
                    }
                }
        }
    } else {
        // epilogue: acc[mi][ni][hr * 2 + c] = token row mi*16 + g + 8*hr, weight row (ni & 1) * 8 + 2t + c of row tile
        // rtw + (ni >> 1)
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int m = mi * 16 + g + 8 * hr;
                if (m >= cnt) continue;
                const int p = start + m;
                int tok;
                float pw;
                pf_pair<MODE>(pair_tok, pair_w, p, tok, pw);
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
                                pf_emit<MODE>(v, act, a_out, (long long)p * KP2 + n, out, (long long)tok * n_out + n,
                                              pw);
                            }
                    }
                }
            }
    }
#endif
}

// pf_gemm_<bits>_<BM>_<mode>; dynamic shared memory PF_STAGES * PfSmem<bits, BM>::STAGE bytes
#define QM_PF_KERNEL(B, BM, M) \
    extern "C" __global__ void __launch_bounds__(128) pf_gemm_##B##_##BM##_##M(QM_PF_ARGS) { pf_gemm_impl<B, BM, M>(QM_PF_PASS); }
QM_PF_KERNEL(4, 32, 0)
QM_PF_KERNEL(4, 48, 0)
QM_PF_KERNEL(4, 48, 1)
QM_PF_KERNEL(8, 48, 0)
QM_PF_KERNEL(8, 48, 1)
QM_PF_KERNEL(4, 64, 0)
QM_PF_KERNEL(4, 32, 1)
QM_PF_KERNEL(4, 64, 1)
QM_PF_KERNEL(8, 32, 0)
QM_PF_KERNEL(8, 64, 0)
QM_PF_KERNEL(8, 32, 1)
QM_PF_KERNEL(8, 64, 1)
QM_PF_KERNEL(4, 128, 0)
QM_PF_KERNEL(4, 128, 1)
QM_PF_KERNEL(8, 128, 0)
QM_PF_KERNEL(8, 128, 1)
// pf_gemmc_4_<BM>_<mode>: the common case (int4, block 32, no zero point) compiled for it
#define QM_PFC_KERNEL(BM, M) \
    extern "C" __global__ void __launch_bounds__(128) pf_gemmc_4_##BM##_##M(QM_PF_ARGS) { pf_gemm_impl<4, BM, M, true>(QM_PF_PASS); }
QM_PFC_KERNEL(32, 0)
QM_PFC_KERNEL(32, 1)
QM_PFC_KERNEL(48, 0)
QM_PFC_KERNEL(48, 1)
QM_PFC_KERNEL(64, 0)
QM_PFC_KERNEL(64, 1)
// pf_gemmw_4_<BM>_<mode>: pf_gemmc on wgmma (sm_90a builds; elsewhere they trap and GpuQMoE never picks them);
// dynamic shared memory PF_STAGES * PfSmem<4, BM>::STAGE_WG + 1024 bytes
#define QM_PFW_KERNEL(BM, M)                                                                                  \
    extern "C" __global__ void __launch_bounds__(128) pf_gemmw_4_##BM##_##M(QM_PF_ARGS) {                    \
        pf_gemm_impl<4, BM, M, true, true>(QM_PF_PASS);                                                       \
    }
QM_PFW_KERNEL(32, 0)
QM_PFW_KERNEL(32, 1)
QM_PFW_KERNEL(48, 0)
QM_PFW_KERNEL(48, 1)
QM_PFW_KERNEL(64, 0)
QM_PFW_KERNEL(64, 1)

// out[0] = 1 where this module was built with wgmma (nvcc -arch=sm_90a: kernels/gpu/_module.py), else 0
extern "C" __global__ void qm_features(int* out) { out[0] = QM_WG; }
