// One expert's stored rows -> its slot arrays in the kernel layout (kernels/gpu/layout.py), both projections in one
// launch: the fast path of GpuQMoE.upload_expert_device (kernels/gpu/pack_device.py; pack_numpy there is this index
// math in NumPy, checked against layout.pack on the CPU). The host copies the expert's stored tensors as they are into
// one staging buffer and launches pack_expert with a descriptor per projection (made once per GpuQMoE); one thread
// per output item, grid-stride: per projection, items [0, w_bytes) are weight bytes, then s_len scale entries (s, h,
// z), then NP biases; projection 0's items come first. The same launch points the expert -> slot map at the slot.
// Padding rows (row_src < 0) take source row 0 times zero, as layout.pack's mask multiplication gives them.

// Descriptor fields, int64 each, PK_NFIELDS per projection: pack_device.DESC_FIELDS names them in this order (a CPU
// test compares the two lists). SRC_*: byte offsets into the staging buffer (-1: absent); DST_*: the slot arrays'
// addresses at slot 0 (0: the layout has none), STR_*: their bytes per slot.
enum {
    PK_BITS, PK_K, PK_KT, PK_WROW, PK_NB, PK_NBS, PK_SSZ, PK_SDT, PK_ZROW, PK_HAS_ZP, PK_HAS_H, PK_BDT, PK_NP,
    PK_W_BYTES, PK_S_LEN, PK_ITEMS, PK_ROW_SRC,
    PK_SRC_W, PK_SRC_S, PK_SRC_Z, PK_SRC_B,
    PK_DST_W, PK_DST_S, PK_DST_H, PK_DST_Z, PK_DST_B,
    PK_STR_W, PK_STR_S, PK_STR_H, PK_STR_Z, PK_STR_B,
    PK_NFIELDS
};

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

// item i of one projection, described by d (in shared memory)
static __device__ __forceinline__ void pk_item(const long long* d, const u8* staged, int slot, long long i) {
    const int bits = (int)d[PK_BITS];
    const long long w_bytes = d[PK_W_BYTES], s_len = d[PK_S_LEN];
    const int* row_src = (const int*)d[PK_ROW_SRC];
    if (i < w_bytes) {
        u8* w = (u8*)(d[PK_DST_W] + slot * d[PK_STR_W]);
        w[i] = pk_weight_byte(staged + d[PK_SRC_W], row_src, i, bits, (int)d[PK_K], (int)d[PK_KT], (int)d[PK_WROW]);
    } else if (i < w_bytes + s_len) {
        const int has_h = (int)d[PK_HAS_H], has_zp = (int)d[PK_HAS_ZP];
        void* s = (void*)(d[PK_DST_S] + slot * d[PK_STR_S]);
        u16* h = has_h ? (u16*)(d[PK_DST_H] + slot * d[PK_STR_H]) : (u16*)0;
        u8* z = has_zp ? (u8*)(d[PK_DST_Z] + slot * d[PK_STR_Z]) : (u8*)0;
        const u8* zsrc = has_zp ? staged + d[PK_SRC_Z] : (const u8*)0;
        pk_scale(i - w_bytes, row_src, (int)d[PK_NB], (int)d[PK_NBS], staged + d[PK_SRC_S], (int)d[PK_SSZ],
                 (int)d[PK_SDT], s, h, has_h, zsrc, (int)d[PK_ZROW], bits, z, has_zp);
    } else {
        const int r = (int)(i - w_bytes - s_len), src = row_src[r];
        const float v = load_f(staged + d[PK_SRC_B], src < 0 ? 0 : src, (int)d[PK_BDT]);
        ((float*)(d[PK_DST_B] + slot * d[PK_STR_B]))[r] = src < 0 ? v * 0.0f : v;
    }
}

// desc: 2 x PK_NFIELDS int64 (FC1, FC2); staged: the expert's stored tensors; e goes into `slot`, whose expert
// `old` (-1: none) leaves the expert -> slot map: for row host0 + old where the slots have a host tier (host0 >= 0:
// kernels/gpu/host_tier.py), else -1
extern "C" __global__ void pack_expert(const long long* __restrict__ desc, const u8* __restrict__ staged, int slot,
                                       int* __restrict__ slot_map, int e, int old, int host0) {
    __shared__ long long sd[2 * PK_NFIELDS];
    for (int f = threadIdx.x; f < 2 * PK_NFIELDS; f += blockDim.x) sd[f] = desc[f];
    __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        if (old >= 0 && old != e) slot_map[old] = host0 >= 0 ? host0 + old : -1;
        slot_map[e] = slot;
    }
    const long long n0 = sd[PK_ITEMS], n = n0 + sd[PK_NFIELDS + PK_ITEMS];
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        if (i < n0) pk_item(sd, staged, slot, i);
        else pk_item(sd + PK_NFIELDS, staged, slot, i - n0);
    }
}
