// One expert's stored rows -> its slot arrays in the kernel layout (kernels/gpu/layout.py), for one projection:
// the fast path of GpuQMoE.upload_expert_device (kernels/gpu/pack_device.py; pack_numpy there is this index math in
// NumPy, checked against layout.pack on the CPU). One thread per output item, grid-stride: items [0, w_bytes) are
// weight bytes, then s_len scale entries (s, h, z), then NP biases.
// Padding rows (row_src < 0) take source row 0 times zero, as layout.pack's mask multiplication gives them.

// code `i` (flat, in codes) of packed rows: int4 low nibble = even index
static __device__ __forceinline__ u32 pk_code(const u8* raw, long long i, int bits) {
    if (bits == 8) return raw[i];
    return (raw[i >> 1] >> ((i & 1) * 4)) & 0xFu;
}

// code of layout row r, column col of the padded matrix (0 for padding rows and col >= K)
static __device__ __forceinline__ u32 pk_wcode(const u8* w, const int* row_src, int r, int col, int K, int wrow,
                                               int bits) {
    const int src = row_src[r];
    if (src < 0 || col >= K) return 0;
    return pk_code(w, (long long)src * wrow * (8 / bits) + col, bits);
}

static __device__ __forceinline__ u8 pk_weight_byte(const u8* w, const int* row_src, long long i, int bits, int K,
                                                    int KT, int wrow) {
    if (bits == 4) {  // byte order (tile, kt, g, t, j, p, h8): low nibble row g, high nibble row g + 8
        const int h8 = i & 1, p = (i >> 1) & 1, j = (i >> 2) & 3, t = (i >> 4) & 3, g = (i >> 6) & 7;
        const long long rest = i >> 9;
        const int kt = (int)(rest % KT), r = (int)(rest / KT) * 16 + g;
        const int col = kt * 64 + j * 16 + h8 * 8 + t * 2 + p;
        return (u8)(pk_wcode(w, row_src, r, col, K, wrow, 4) | (pk_wcode(w, row_src, r + 8, col, K, wrow, 4) << 4));
    }
    // int8: byte order (tile, kt, g, t, j, h8, hi, p)
    const int p = i & 1, hi = (i >> 1) & 1, h8 = (i >> 2) & 1, j = (i >> 3) & 3, t = (i >> 5) & 3, g = (i >> 7) & 7;
    const long long rest = i >> 10;
    const int kt = (int)(rest % KT), r = (int)(rest / KT) * 16 + hi * 8 + g;
    return (u8)pk_wcode(w, row_src, r, kt * 64 + j * 16 + h8 * 8 + t * 2 + p, K, wrow, 8);
}

// stored value (as bits) times zero, in the value's type: +-0 (NaN stays NaN); bf16 travels as u16 (integer)
static __device__ __forceinline__ u32 pk_times_zero(u32 v, int dt) {
    if (dt == DT_F32) return __float_as_uint(__uint_as_float(v) * 0.0f);
    if (dt == DT_F16) return f2h(h2f((u16)v) * 0.0f);
    return 0;
}

// Scale entry q, order (tile, block, g, hi): s (4- or 2-byte words), h (fp16 copy), z (zero-point code)
static __device__ __forceinline__ void pk_scale(long long q, const int* row_src, int NB, int nb, const void* ssrc,
                                                int ssz, int sdt, void* s, u16* h, int has_h, const u8* zsrc,
                                                int zrow, int bits, u8* z, int has_zp) {
    const int hi = q & 1, g = (q >> 1) & 7;
    const long long rest = q >> 4;
    const int blk = (int)(rest % NB), r = (int)(rest / NB) * 16 + hi * 8 + g;
    const int src = row_src[r], sr = src < 0 ? 0 : src;
    u32 sv = 0, zv = 0;
    if (blk < nb) {  // blocks past the stored ones are zero
        const long long si = (long long)sr * nb + blk;
        sv = ssz == 4 ? ((const u32*)ssrc)[si] : ((const u16*)ssrc)[si];
        if (src < 0) sv = pk_times_zero(sv, sdt);
        if (has_zp && src >= 0) zv = pk_code(zsrc, (long long)sr * zrow + blk, bits);
    }
    if (ssz == 4) ((u32*)s)[q] = sv;
    else ((u16*)s)[q] = (u16)sv;
    if (has_h) h[q] = f2h(sdt == DT_F32 ? __uint_as_float(sv) : bf2f((u16)sv));
    if (has_zp) z[q] = (u8)zv;
}

extern "C" __global__ void pack_slot(const u8* __restrict__ wsrc, const void* __restrict__ ssrc,
                                     const u8* __restrict__ zsrc, const void* __restrict__ bsrc,
                                     const int* __restrict__ row_src, int bits, int K, int KT, int wrow, int NB,
                                     int nb, int ssz, int sdt, int zrow, int has_zp, int has_h, int bdt, int NP,
                                     long long w_bytes, long long s_len, u8* __restrict__ w, void* __restrict__ s,
                                     u16* __restrict__ h, u8* __restrict__ z, float* __restrict__ b) {
    const long long n_items = w_bytes + s_len + (bdt >= 0 ? NP : 0);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n_items;
         i += (long long)gridDim.x * blockDim.x) {
        if (i < w_bytes) {
            w[i] = pk_weight_byte(wsrc, row_src, i, bits, K, KT, wrow);
        } else if (i < w_bytes + s_len) {
            pk_scale(i - w_bytes, row_src, NB, nb, ssrc, ssz, sdt, s, h, has_h, zsrc, zrow, bits, z, has_zp);
        } else {
            const int r = (int)(i - w_bytes - s_len), src = row_src[r];
            const float v = load_f(bsrc, src < 0 ? 0 : src, bdt);
            b[r] = src < 0 ? v * 0.0f : v;
        }
    }
}
