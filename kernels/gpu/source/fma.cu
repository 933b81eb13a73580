// Portable fallback (any CUDA architecture, no tensor cores): plain fp32 FMA, one warp per output row.
// Reads the same slot layout as the tensor-core kernels through an element accessor; exact fp32 dequantisation
// ((q - z) * s), fp32 activations. Slow, but the reference-accurate path for GPUs older than sm_80.

static __device__ __forceinline__ float wq(const u8* Ws, int KT, int bits, int row, int k, const void* S, long long sb,
                                           int sdt, int NB, int bs_log2, const u8* Z, int has_zp) {
    const int rt = row >> 4, rr = row & 15, hi = rr >> 3, g = rr & 7;
    const int kt = k >> 6, kk = k & 63, j = kk >> 4, r = kk & 15, h8 = r >> 3, t = (r & 7) >> 1, p = r & 1;
    const int lane = g * 4 + t;
    int q;
    if (bits == 4) {
        const long long o = ((long long)rt * KT + kt) * 512 + lane * 16 + j * 4;
        const int n = p * 4 + h8 * 2 + hi;
        const u32 b = Ws[o + (n >> 1)];
        q = (int)((n & 1) ? (b >> 4) : (b & 15u));
    } else {
        const long long o = ((long long)rt * KT + kt) * 1024 + lane * 32 + j * 8;
        q = (int)Ws[o + h8 * 4 + hi * 2 + p];
    }
    const int blk = bs_log2 >= 0 ? (k >> bs_log2) : 0;
    const long long si = sb + ((long long)rt * NB + blk) * 16 + g * 2 + hi;
    const int z = has_zp ? (int)Z[si] : (1 << (bits - 1));
    return (float)(q - z) * load_f(S, si, sdt);
}

// FC1 (+FC3): warp = output i of the intermediate; a_out[pair, i] = act(...) in fp32 [P, n_out]
extern "C" __global__ void fma_fc1(const u8* W, long long wstride, int NT, int KT, int bits, const void* S, int sdt,
                                   int NB, int bs_log2, const u8* Z, int has_zp, const float* bias, int has_bias,
                                   int NP, const int4* tiles, const int* num_tiles, const int* pair_tok,
                                   const float* x, int K, int act, int gated, float alpha, float beta, float limit,
                                   int has_limit, int n_out, float* a_out) {
    if ((int)blockIdx.y >= *num_tiles) return;
    const int4 tl = tiles[blockIdx.y];
    const int slot = tl.x, start = tl.y, cnt = tl.z;
    const int lane = threadIdx.x & 31;
    const int i = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (i >= n_out) return;
    const int rg = gated ? ((i >> 3) << 4) + (i & 7) : i;
    const int ru = rg + 8;
    const u8* Ws = W + (long long)slot * wstride;
    const long long sb = (long long)slot * NT * NB * 16;
    for (int c0 = 0; c0 < cnt; c0 += 8) {
        const int nc = min(8, cnt - c0);
        float ag[8], au[8];
        const float* xr[8];
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            ag[n] = 0.0f;
            au[n] = 0.0f;
            xr[n] = x + (long long)pair_tok[start + c0 + min(n, nc - 1)] * K;
        }
        for (int k = lane; k < K; k += 32) {
            const float wg = wq(Ws, KT, bits, rg, k, S, sb, sdt, NB, bs_log2, Z, has_zp);
            const float wu = gated ? wq(Ws, KT, bits, ru, k, S, sb, sdt, NB, bs_log2, Z, has_zp) : 0.0f;
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                const float xv = xr[n][k];
                ag[n] = fmaf(wg, xv, ag[n]);
                au[n] = fmaf(wu, xv, au[n]);
            }
        }
#pragma unroll
        for (int n = 0; n < 8; ++n)
            for (int o = 16; o; o >>= 1) {
                ag[n] += __shfl_xor_sync(0xffffffffu, ag[n], o);
                au[n] += __shfl_xor_sync(0xffffffffu, au[n], o);
            }
        if (lane == 0) {
            const float bgv = has_bias ? bias[(long long)slot * NP + rg] : 0.0f;
            const float buv = (has_bias && gated) ? bias[(long long)slot * NP + ru] : 0.0f;
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                if (n < nc) {
                    const float a = gated ? act_gated(act, ag[n] + bgv, au[n] + buv, alpha, beta, limit, has_limit)
                                          : act_one(act, ag[n] + bgv);
                    a_out[(long long)(start + c0 + n) * n_out + i] = a;
                }
            }
        }
    }
}

// FC2: warp = output row n; out[token, n] += w * (FC2(a) + b)
extern "C" __global__ void fma_fc2(const u8* W, long long wstride, int NT, int KT, int bits, const void* S, int sdt,
                                   int NB, int bs_log2, const u8* Z, int has_zp, const float* bias, int has_bias,
                                   int NP, const int4* tiles, const int* num_tiles, const int* pair_tok,
                                   const float* pair_w, const float* a, int K, int n_out, float* out) {
    if ((int)blockIdx.y >= *num_tiles) return;
    const int4 tl = tiles[blockIdx.y];
    const int slot = tl.x, start = tl.y, cnt = tl.z;
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (n >= n_out) return;
    const u8* Ws = W + (long long)slot * wstride;
    const long long sb = (long long)slot * NT * NB * 16;
    for (int c0 = 0; c0 < cnt; c0 += 8) {
        const int nc = min(8, cnt - c0);
        float s[8];
#pragma unroll
        for (int m = 0; m < 8; ++m) s[m] = 0.0f;
        for (int k = lane; k < K; k += 32) {
            const float w = wq(Ws, KT, bits, n, k, S, sb, sdt, NB, bs_log2, Z, has_zp);
#pragma unroll
            for (int m = 0; m < 8; ++m) s[m] = fmaf(w, a[(long long)(start + c0 + min(m, nc - 1)) * K + k], s[m]);
        }
#pragma unroll
        for (int m = 0; m < 8; ++m)
            for (int o = 16; o; o >>= 1) s[m] += __shfl_xor_sync(0xffffffffu, s[m], o);
        if (lane == 0) {
            const float b = has_bias ? bias[(long long)slot * NP + n] : 0.0f;
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                if (m < nc) {
                    const int p = start + c0 + m;
                    atomicAdd(out + (long long)pair_tok[p] * n_out + n, pair_w[p] * (s[m] + b));
                }
            }
        }
    }
}
