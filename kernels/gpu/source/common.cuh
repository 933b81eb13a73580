// Shared helpers for the QMoE GPU kernels (kernels/gpu/source/*.cu).
// No #include on purpose: the source is compiled by NVRTC (through CuPy) with no header search path.
// fp16 / bf16 values travel as raw 16-bit patterns (u16) and are converted with PTX or integer code.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

// activation dtypes (also scales)
#define DT_F32 0
#define DT_F16 1
#define DT_BF16 2

// activation kinds (match kernels/gpu/qmoe.py)
#define ACT_RELU 0
#define ACT_GELU 1
#define ACT_SILU 2
#define ACT_IDENTITY 3
#define ACT_SWIGLU 4

#define QM_NEG_INF __int_as_float(0xff800000)

// Programmatic dependent launch (sm_90+; kernels/gpu/launch_pdl.py): QM_PDL_WAIT blocks until the kernel before this
// one on the stream has completed and its writes are visible (a no-op when this kernel was launched without the
// attribute); QM_PDL_LAUNCH lets the next kernel, launched with it, start its blocks now. Nothing on older GPUs.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define QM_PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define QM_PDL_LAUNCH() asm volatile("griddepcontrol.launch_dependents;" :::)
#else
#define QM_PDL_WAIT() ((void)0)
#define QM_PDL_LAUNCH() ((void)0)
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define QM_TC 1
#else
#define QM_TC 0
#endif

static __device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

static __device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

static __device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }

// float -> bf16, round to nearest even (integer code: runs on every architecture)
static __device__ __forceinline__ u16 f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

static __device__ __forceinline__ float load_f(const void* p, long long i, int dt) {
    if (dt == DT_F32) return ((const float*)p)[i];
    if (dt == DT_F16) return h2f(((const u16*)p)[i]);
    return bf2f(((const u16*)p)[i]);
}

static __device__ __forceinline__ void store_f(void* p, long long i, int dt, float v) {
    if (dt == DT_F32) ((float*)p)[i] = v;
    else if (dt == DT_F16) ((u16*)p)[i] = f2h(v);
    else ((u16*)p)[i] = f2bf(v);
}

// two consecutive scale values (rows g and g+8 of a 16-row tile) as floats
static __device__ __forceinline__ float2 load_s2(const void* p, long long i, int dt) {
    if (dt == DT_F32) return *(const float2*)((const float*)p + i);
    u32 v = *(const u32*)((const u16*)p + i);
    if (dt == DT_F16) return make_float2(h2f((u16)(v & 0xffffu)), h2f((u16)(v >> 16)));
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}

static __device__ __forceinline__ u32 u4c(const uint4& v, int i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// ---------------------------------------------------------------------------------- activations
static __device__ __forceinline__ float act_one(int act, float g) {
    if (act == ACT_RELU) return fmaxf(g, 0.0f);
    if (act == ACT_GELU) return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    if (act == ACT_SILU) return g / (1.0f + expf(-g));
    return g;
}

// gated: swiglu(gate, up) or act(gate) * up (FC3 without swiglu)
static __device__ __forceinline__ float act_gated(int act, float g, float l, float alpha, float beta, float limit,
                                                  int has_limit) {
    if (act == ACT_SWIGLU) {
        if (has_limit) {
            g = fminf(g, limit);
            l = fminf(fmaxf(l, -limit), limit);
        }
        return g / (1.0f + expf(-alpha * g)) * (l + beta);
    }
    return act_one(act, g) * l;
}

// position of element k of one activation row in the B-fragment layout the decode kernels read:
// per 64-k tile, lane-group t (= (k % 8) / 2) owns 16 consecutive values ordered [k-step j][half h8][pair p]
static __device__ __forceinline__ int frag_off(int k) {
    int kk = k & 63, r = kk & 15;
    return (k & ~63) + (((r & 7) >> 1) << 4) + ((kk >> 4) << 2) + ((r >> 3) << 1) + (r & 1);
}

// ---------------------------------------------------------------------------------- PTX wrappers (sm_80+)
#define BF_ONE2 0x3F803F80u
#define BF_SIXTEEN2 0x41804180u
#define H_SIXTEENTH2 0x2C002C00u

static __device__ __forceinline__ u32 bfma2(u32 a, u32 b, u32 c) {
    u32 d = 0;
#if QM_TC
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#endif
    return d;
}

static __device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

static __device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// (lo, lo) and (hi, hi) of the fp16 pair v: ptxas folds these moves into the f16x2 instruction that reads them (the
// .H0_H0 / .H1_H1 operand selectors), where __byte_perm costs a PRMT each
static __device__ __forceinline__ void h2_bcast(u32 v, u32& lo2, u32& hi2) {
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; mov.b32 %0, {l, l}; mov.b32 %1, {h, h}; }"
        : "=r"(lo2), "=r"(hi2)
        : "r"(v));
}

static __device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// D += A(16x16, row) * B(16x8, col), bf16 inputs, fp32 accumulate
static __device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if QM_TC
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

static __device__ __forceinline__ void mma_f16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if QM_TC
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

static __device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

static __device__ __forceinline__ void ldmatrix_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
#if QM_TC
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
#else
    r0 = r1 = r2 = r3 = 0;
#endif
}

static __device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
#if QM_TC
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
#endif
}

static __device__ __forceinline__ void cp_async_commit() {
#if QM_TC
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
static __device__ __forceinline__ void cp_async_wait() {
#if QM_TC
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// ---------------------------------------------------------------------------------- dequantisation
// Weight layout (see kernels/gpu/layout.py): per 16-row x 64-k tile, lane (g = lane/4, t = lane%4) holds
// the A-fragment values of m16n8k16 for 4 k-steps j: rows g and g+8, k = 16j + 2t + {0,1} and +8.
// int4: one 32-bit word per k-step, nibble n = p*4 + h8*2 + hi (p: k parity, h8: +8 half, hi: row g+8).
// int8: two words per k-step, byte b = h8*4 + hi*2 + p.
// Results: a[0] = (row g, k 2t..2t+1), a[1] = (row g+8, same k), a[2] = (row g, k+8), a[3] = (row g+8, k+8).

// (a & m) | o in one LOP3 (the compiler otherwise splits it when both constants are immediates)
static __device__ __forceinline__ u32 and_or(u32 a, u32 m, u32 o) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(m), "r"(o));
    return d;
}

// bf16, exact (q - z): zg / zg8 = bf16x2 of -(128 + z) for rows g / g+8
static __device__ __forceinline__ void deq4_bf16(u32 w, u32 zg, u32 zg8, u32* a) {
    const u32 m = 0x000F000Fu, o = 0x43004300u;
    a[0] = bfma2(and_or(w, m, o), BF_ONE2, zg);
    a[1] = bfma2(and_or(w >> 4, m, o), BF_ONE2, zg8);
    a[2] = bfma2(and_or(w >> 8, m, o), BF_ONE2, zg);
    a[3] = bfma2(and_or(w >> 12, m, o), BF_ONE2, zg8);
}

// one bf16 pair of int8 codes (q - z), z = 16*zh + zl: zl2 / zh2 = bf16x2 of -(128 + zl) / -(128 + zh)
static __device__ __forceinline__ u32 deq8pair_bf16(u32 w, u32 sel, u32 zl2, u32 zh2) {
    const u32 m = 0x000F000Fu, o = 0x43004300u;
    u32 t = __byte_perm(w, 0u, sel);
    u32 lo = bfma2(and_or(t, m, o), BF_ONE2, zl2);
    u32 hi = bfma2(and_or(t >> 4, m, o), BF_ONE2, zh2);
    return bfma2(hi, BF_SIXTEEN2, lo);
}

// fp16 (q - z): zsub_g = fp16x2 of (1024 + z_g) (subtracted from 1024 + q),
// zfma_g8 = fp16x2 of -(64 + z_g8) (int4 high nibbles, scaled by 1/16)
static __device__ __forceinline__ void deq4_f16(u32 w, u32 zsub_g, u32 zfma_g8, u32* a) {
    const u32 lo = 0x000F000Fu, hi = 0x00F000F0u, o = 0x64006400u;
    a[0] = hsub2(and_or(w, lo, o), zsub_g);
    a[1] = hfma2(and_or(w, hi, o), H_SIXTEENTH2, zfma_g8);
    u32 w2 = w >> 8;
    a[2] = hsub2(and_or(w2, lo, o), zsub_g);
    a[3] = hfma2(and_or(w2, hi, o), H_SIXTEENTH2, zfma_g8);
}

// int8 fp16: zsub_g / zsub_g8 = fp16x2 of (1024 + z)
static __device__ __forceinline__ void deq8_f16(u32 w0, u32 w1, u32 zsub_g, u32 zsub_g8, u32* a) {
    a[0] = hsub2(__byte_perm(w0, 0x64646464u, 0x4140u), zsub_g);
    a[1] = hsub2(__byte_perm(w0, 0x64646464u, 0x4342u), zsub_g8);
    a[2] = hsub2(__byte_perm(w1, 0x64646464u, 0x4140u), zsub_g);
    a[3] = hsub2(__byte_perm(w1, 0x64646464u, 0x4342u), zsub_g8);
}

static __device__ __forceinline__ u32 pair16(u16 v) { return ((u32)v << 16) | (u32)v; }

// bf16 constants for the decode dequantisation of one row's zero point z (int4: 1 const, int8: 2)
static __device__ __forceinline__ u32 bz4(int z) { return pair16((u16)(0xC300u | (u32)z)); }
static __device__ __forceinline__ u32 bz8lo(int z) { return pair16((u16)(0xC300u | (u32)(z & 15))); }
static __device__ __forceinline__ u32 bz8hi(int z) { return pair16((u16)(0xC300u | (u32)(z >> 4))); }
// fp16 constants for the prefill dequantisation
static __device__ __forceinline__ u32 hzsub(int z) { return pair16((u16)(0x6400u | (u32)z)); }
static __device__ __forceinline__ u32 hzfma(int z) { return pair16(f2h(-(64.0f + (float)z))); }
