// Decode v5 (1..8 tokens per expert): stream-K grouped dequant-GEMV on the tensor cores.
//
// v4 (decode.cu) gives each block R row tiles of one (expert, token-group) tile and splits K over the block's warps:
// at shape A, FC1 has 720 such blocks for ~528 resident ones (1.36 waves) and each warp streams ~23 k-tiles through
// a 3-in-flight pipeline. v5 flattens the whole projection into units (tile, row tile, k-tile) in memory order:
// within one expert's slot, unit u = rt * KT + kt is the u-th 512-byte (int4) weight tile, and (for block sizes
// < 64) its scale / zero-point chunks are the u-th chunks as well. A grid sized to the resident capacity of the GPU
// gives every warp one contiguous range of ceil(units / warps) units, streamed through a DEC5_STAGES-deep cp.async
// ring (weights, scales, zero points and the tile's activation fragments all travel through the ring, so nothing
// on the consumer side waits on a global load). No wave quantisation, one pipeline ramp per warp.
// A warp's range crosses row tiles (and tiles): at every row-tile end ("segment" end) the warp flushes its partial
// sums. FC2 (MODE 1): weighted atomicAdd into the fp32 output, as in v4. FC1 (MODE 0): a warp that covered the
// whole K of the row tile runs the activation epilogue from registers; otherwise the partials meet in an fp32
// scratch [tile][row tile][128] by atomicAdd, a per-(tile, row tile) counter of k-tiles done is bumped by an atomic
// with release semantics, and the warp that completes K reads the sums back with atomicExch(.., 0) (which also
// leaves the scratch zeroed for the next launch), resets the counter and runs the epilogue (bias, activation, bf16
// hi/lo activation rows for FC2; fp16 rows for the F16 kernels).
// Compile-time specialisation: BITS (4 / 8), NBT = scale blocks per 64-k tile (1: block >= 64 or one scale per
// row, applied per k-tile; 2: block 32; 4: block 16), ZP (zero points), MODE. Block scales are applied in fp32 on
// per-block accumulators, weights dequantise exactly to (q - z) in bf16, activations are bf16 hi + lo (two MMAs):
// the same arithmetic as v4 (only the order of the fp32 partial sums differs).
// F16 (kernels dec5h_*, fp16 activations): weights dequantise exactly to (q - z) in fp16 (1024 + q - (1024 + z):
// deq4_f16 / deq8_f16), the activations are fp16 as they come (x) or as FC1 rounds them (FC1 writes FC2's rows as
// fp16 into ahi, no lo half), ONE m16n8k16 f16 MMA per k-step with fp32 accumulation; block scales in fp32 as
// above. The ring stage keeps the same layout (the lo 32 bytes of an activation row slot stay unused).
// FC1 with pf2: when its range is done, each warp prefetches into L2 (prefetch.global.L2) the FC2 weights and
// scales of an equal share of FC2's units of the same tiles, so that FC2's bytes stream from HBM during FC1's tail
// and the launch gap (FC2 of 4 experts at shape A is ~21 MB, inside the 50 MB L2).

#define DEC5_STAGES 6
#define DEC5_TCAP 128  // tiles cached in shared memory (more are read from global memory)
#define DEC5_PCAP 512  // pair tokens cached in shared memory
#define DEC5_CACHE_BYTES (DEC5_TCAP * 16 + DEC5_PCAP * 4)

#define QM_D5_ARGS                                                                                                   \
    const u8 *__restrict__ W, long long wstride, int NT, int KT, const void *__restrict__ S, int sdt, int NB, int tsh, \
        const u8 *__restrict__ Z, const float *__restrict__ bias, int has_bias, int NP,                                \
        const int4 *__restrict__ tiles, const int *__restrict__ num_tiles, const int *__restrict__ pair_tok,           \
        const float *__restrict__ pair_w, int npairs, const u16 *__restrict__ bhi, const u16 *__restrict__ blo,        \
        int split, int KPB, int bcols, int act, int gated, float alpha, float beta, float limit, int has_limit,       \
        int n_out, u16 *__restrict__ ahi, u16 *__restrict__ alo, int KP2, float *__restrict__ out,                     \
        float *__restrict__ part, int *__restrict__ kdone, const u8 *__restrict__ W2, long long wstride2, int NT2,     \
        int KT2, const void *__restrict__ S2, int sdt2, int NB2, int tsh2, int nbt2, int pf2,                    \
        const int *__restrict__ cut
#define QM_D5_PASS                                                                                                  \
    W, wstride, NT, KT, S, sdt, NB, tsh, Z, bias, has_bias, NP, tiles, num_tiles, pair_tok, pair_w, npairs, bhi, blo, \
        split, KPB, bcols, act, gated, alpha, beta, limit, has_limit, n_out, ahi, alo, KP2, out, part, kdone, W2,      \
        wstride2, NT2, KT2, S2, sdt2, NB2, tsh2, nbt2, pf2, cut

// 16-byte copy global -> shared that allocates in L1 (the activation fragments, re-read by the SM's other warps)
static __device__ __forceinline__ void cp_async16_ca(u32 dst, const void* src) {
#if QM_TC
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
#endif
}

// atomicAdd with release semantics at GPU scope (MEMBAR.ALL.GPU before the atomic, no L1 invalidation)
static __device__ __forceinline__ int atom_add_release_gpu(int* p, int v) {
    int old;
    asm volatile("atom.release.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// L2 prefetch of the 128-byte lines of [p, p + n) by the lanes of a warp (fire and forget)
static __device__ __forceinline__ void l2_prefetch_range(const void* p, long long n, int lane) {
    const unsigned long long a1 = (unsigned long long)p + (unsigned long long)n;
    for (unsigned long long a = ((unsigned long long)p & ~127ull) + (unsigned long long)lane * 128ull; a < a1;
         a += 32ull * 128ull)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
}

// One FC1 activation into FC2's A-fragment layout: fp16 into hi (F16), or bf16 hi + the lo remainder
template <int F16>
static __device__ __forceinline__ void store_act(u16* __restrict__ hi, u16* __restrict__ lo, long long o, float a) {
    if (F16) {
        hi[o] = f2h(a);
    } else {
        const u16 h = f2bf(a);
        hi[o] = h;
        lo[o] = f2bf(a - bf2f(h));
    }
}

// Activation slot layout in a ring stage (256 bytes per B row slot; per lane t of the slot's 4, 4 chunks of 16 bytes:
// h0, h1 = hi k 0-7 / 8-15 of the lane's 16, l0, l1 = lo). Lane t's h0 at dec5_barea(slot, t), h1 at + DEC5_BX, l0
// at + DEC5_BL, l1 at + DEC5_BX + DEC5_BL: hi chunks at slot * 256 + t * 32 (+ 16), lo at + 128, so the 4 lanes of
// one slot hit 4 different bank quads (conflict-free for one token per tile, as in decode at T = 1; lanes of 8
// slots: 2 wavefronts per 128 B). The layout before (lane t's 64 bytes at slot * 256 + t * 64) put lanes t and t + 2
// on the same banks: a 2-way conflict on every activation LDS.128 / cp.async (ncu, fourteenth session: FC2's excess
// shared wavefronts 4 per unit -> 0).
#define DEC5_BX 16u
#define DEC5_BL 128u
// __syncwarp() as one WARPSYNC (the builtin adds a divergence check, BRA.DIV, per call); all lanes are converged
static __device__ __forceinline__ void dec5_syncwarp() {
#if QM_TC
    asm volatile("bar.warp.sync -1;" ::: "memory");
#endif
}
template <int V>
struct Dec5I {  // a compile-time int (no <type_traits> under NVRTC)
    static constexpr int value = V;
};
static __device__ __forceinline__ u32 dec5_barea(int slot, int t) {
    return (u32)(slot * 256 + t * 32);
}

template <int BITS, int NBT, int ZP, int MODE, int F16, int EARLY>
static __device__ __forceinline__ void dec5_impl(QM_D5_ARGS) {
#if QM_TC
    typedef QmW<BITS> TR;
    extern __shared__ __align__(16) unsigned char dsm5[];
    int4* stile = reinterpret_cast<int4*>(dsm5);
    int* sptok = reinterpret_cast<int*>(dsm5 + DEC5_TCAP * 16);
    // launched with PDL (dec5_cfg["pdl"]) this block may start before decode_prep / FC1 is done.
    // FC1 (MODE 0) waits here: everything below reads what decode_prep wrote; FC2 may start its blocks from here on.
    // FC2 (MODE 1) waits only before its first activation copy (the prologue below): until then it reads nothing but
    // decode_prep's tables (num_tiles, tiles, pair_tok) and the weights / scales / zero points, none of which FC1
    // writes. decode_prep is complete when any FC2 block starts: FC2 starts its blocks once every FC1 block has
    // executed QM_PDL_LAUNCH or exited, and every FC1 block executes QM_PDL_WAIT (which returns once decode_prep has
    // completed and its writes are visible) before its QM_PDL_LAUNCH, before anything else. The tables are read
    // with L2-coherent loads (__ldcg, ld.global.cg: L2 is the GPU's point of coherence, where decode_prep's writes
    // are) so that no L1 line of an earlier forward's tables, from a load of an earlier grid on this SM, can be hit
    // before the wait (griddepcontrol.wait is what makes the earlier grids' writes visible to this grid's other
    // loads). With pdl off (or no PDL before sm_90) FC2 starts after FC1 has completed and the order does not matter.
    // EARLY: the FC2 instances launched with PDL (dec5*_..._1p, GpuQMoE._dec5). FC2 launched plainly keeps main's
    // code exactly (dec5*_..._1): the split prologue cost plain launches 2-5% of a forward on an H200 (fourteenth
    // session), and GPUs before sm_90 have no PDL.
    constexpr bool early_fc2 = MODE == 1 && EARLY;
    if (!early_fc2) {
        QM_PDL_WAIT();
        QM_PDL_LAUNCH();
    }
    const int ntl = early_fc2 ? __ldcg(num_tiles) : *num_tiles;
    {
        const int nt_c = min(ntl, DEC5_TCAP), np_c = min(npairs, DEC5_PCAP);
        for (int i = threadIdx.x; i < nt_c; i += blockDim.x) stile[i] = early_fc2 ? __ldcg(tiles + i) : tiles[i];
        for (int i = threadIdx.x; i < np_c; i += blockDim.x) sptok[i] = early_fc2 ? __ldcg(pair_tok + i) : pair_tok[i];
    }
    __syncthreads();  // the only block-wide barrier: from here on warps are independent
    // (FC2 reads tiles beyond the cache before its PDL wait as well: L2-coherent, see above)
    auto tile_at = [&](int i) -> int4 {
        return i < DEC5_TCAP ? stile[i] : (early_fc2 ? __ldcg(tiles + i) : __ldg(tiles + i));
    };
    auto ptok_at = [&](int p) -> int { return p < DEC5_PCAP ? sptok[p] : __ldg(pair_tok + p); };

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;

    // a pair split with the CPU (route_split, kernels/cold_split.py): its intermediate rows [0, r), r = *cut > 0, are
    // the last tile's (FC1: its first row tiles, FC2: the first r / 64 k-tiles of each row tile); every other tile
    // whole. FC1's rows come first in a tile's units, so its units end earlier; FC2's tile has fewer k-tiles a row.
    const int cut_rows = (cut && ntl > 0) ? __ldcg(cut) : 0;
    const int last_ti = (MODE == 1 && cut_rows > 0) ? ntl - 1 : -1;  // FC2's tile of fewer k-tiles, if any
    const int kt_last = cut_rows >> 6;
    // this warp's units [u0, u1) of the flattened (tile, row tile, k-tile) space
    const long long per_tile = (long long)NT * KT;
    long long total = per_tile * ntl;
    if (cut_rows > 0)
        total -= MODE == 0 ? (long long)(NT - cut_rows / (gated ? 8 : 16)) * KT : (long long)NT * (KT - kt_last);
    const long long nwt = (long long)gridDim.x * nw;
    const long long chunk = (total + nwt - 1) / nwt;
    const long long u0 = ((long long)blockIdx.x * nw + warp) * chunk;
    if (u0 >= total) return;
    const long long u1 = min(total, u0 + chunk);

    const int ssz = (sdt == DT_F32) ? 4 : 2;
    const int SOFF = TR::TB;                              // scales: NBT blocks x 16 rows (fp32 size reserved)
    const int ZOFF = SOFF + NBT * 64;                     // zero points: NBT blocks x 16 rows
    // activation fragments: 4 x 64 bytes per B row slot (lane t of the slot's 4); slots = bcols: FC1 (MODE 0) one per
    // token (slot = token < T: columns of the same token share it), FC2 one per column
    const int BOFF = ZOFF + (ZP ? NBT * 16 : 0);
    const int STAGE = BOFF + bcols * 256;
    unsigned char* ring = dsm5 + DEC5_CACHE_BYTES + warp * DEC5_STAGES * STAGE;
    const u32 ringa = smem_u32(ring);
    const long long tstride = (long long)NT * NB * 16;  // scale / zero-point elements per slot

    // ---------------------------------------------------------------- producer (cp.async) cursor
    // The producer copies "runs" (consecutive k-tiles of one row tile): issue_unit() is the cp.asyncs of one unit
    // with one address computation per stream (source = row-tile base + p_kt * unit step) and ++p_kt. p_next() (once
    // per row tile) moves the cursor to the next row tile / tile and sizes the next run. Source offsets are those of
    // the v5 kernel before this restructuring (weights W + slot * wstride + (rt * KT + kt) * TB + lane * LB; scales
    // S + (slot * tstride + rt * NB * 16 + b0 * 16) * ssz + lane * 16; zero points likewise in bytes; activations
    // bhi / blo + tok * KPB + t * 16 + kt * 64), see tests/test_dec5_schedule_mirror.py.
    int p_ti, p_rt, p_kt;
    {
        const long long ti = (last_ti >= 0 && u0 >= per_tile * last_ti) ? last_ti : u0 / per_tile;
        const long long rem = u0 - ti * per_tile;
        const int kts = ti == last_ti ? kt_last : KT;
        p_ti = (int)ti;
        p_rt = (int)(rem / kts);
        p_kt = (int)(rem - (long long)p_rt * kts);
    }
    int p_KT = p_ti == last_ti ? kt_last : KT;  // k-tiles a row tile of the producer's tile
    int c_ti = p_ti, c_rt = p_rt;  // consumer cursor (same start)
    const int c_kt0 = p_kt;
    const int nu = (int)(u1 - u0);  // units of this warp (< 2^31: 2^31 units are >= 1 TiB of weights)
    int p_run = 0;                  // units left in the current run (p_kt .. p_kt + p_run - 1 of row tile p_rt)
    // per-lane source pointers at k-tile 0 of row tile p_rt: weights, the lane's scale / zero-point chunk at block
    // 0, the activation fragments
    const bool s_on = lane < NBT * ssz, z_on = ZP && lane < NBT;
    const long long s_rstep = (long long)NB * 16 * ssz, z_rstep = (long long)NB * 16;
    const int s16 = 16 * ssz;
    const u8* p_w = W;
    const unsigned char* p_s = (const unsigned char*)S;
    const u8* p_z = Z;
    const u16* p_bh = bhi;
    const u16* p_bl = blo;
    bool p_bon = false;
    u32 p_barea = 0;  // this lane's byte offset (h0 chunk) in the stage's activation area, see dec5_barea
    auto p_setup = [&]() {  // at (p_ti, p_rt), k-tile 0
        const int4 tl = tile_at(p_ti);
        p_KT = p_ti == last_ti ? kt_last : KT;
        p_w = W + (long long)tl.x * wstride + (long long)p_rt * KT * TR::TB + lane * TR::LB;
        const long long e = (long long)tl.x * tstride + (long long)p_rt * NB * 16;
        p_s = (const unsigned char*)S + e * ssz + lane * 16;
        p_z = Z + e + lane * 16;
        p_bon = g < tl.z;
        long long brow = 0;
        if (p_bon) {
            const int tok = MODE == 0 ? ptok_at(tl.y + g) : tl.y + g;
            brow = (long long)tok * KPB + t * 16;
            p_barea = dec5_barea(MODE == 0 ? tok : g, t);
        }
        p_bh = bhi + brow;
        p_bl = blo + brow;
    };
    p_setup();
    // the current run is done (p_run == 0) and rem > 0 units are left to copy: to the next row tile if the run ended
    // it, then the next run
    auto p_next = [&](int rem) {
        if (p_kt == p_KT) {
            p_kt = 0;
            p_w += (long long)KT * TR::TB;  // weights are contiguous over the row tiles of a tile
            p_s += s_rstep;
            p_z += z_rstep;
            if (++p_rt == NT) {
                p_rt = 0;
                ++p_ti;
                p_setup();
            }
        }
        p_run = min(p_KT - p_kt, rem);
    };
    // one unit at (p_ti, p_rt, p_kt) into stage address d (within the current run; the caller counts p_run)
    // (unsigned offsets: one IMAD.WIDE.U32 per source address; p_kt, b0 >= 0). PART (a Dec5I): 0 the whole unit,
    // 1 its weights, scales and zero points only, 2 its activation fragments only (FC2's prologue: 1 before the PDL
    // wait, 2 after it)
    auto issue_unit = [&](u32 d, auto PART) {
        constexpr int PT = decltype(PART)::value;
        const u32 kt = (u32)p_kt;
        if (PT != 2) {
#pragma unroll
            for (int q = 0; q < TR::LW; ++q)
                cp_async16(d + lane * TR::LB + q * 16, p_w + kt * (u32)TR::TB + q * 16, 16);
            const u32 b0 = (NBT == 1) ? (kt >> tsh) : kt * NBT;  // first scale block of the unit
            if (s_on) cp_async16(d + SOFF + lane * 16, p_s + b0 * (u32)s16, 16);
            if (z_on) cp_async16(d + ZOFF + lane * 16, p_z + b0 * 16u, 16);
        }
        if (PT != 1 && p_bon) {
            const u32 da = d + BOFF + p_barea, db = da + DEC5_BX;
            const u16* bh = p_bh + kt * 64u;
            cp_async16_ca(da, bh);
            cp_async16_ca(db, bh + 8);
            if (!F16 && split) {
                const u16* bl = p_bl + kt * 64u;
                cp_async16_ca(da + DEC5_BL, bl);
                cp_async16_ca(db + DEC5_BL, bl + 8);
            }
        }
        ++p_kt;
    };

    // ---------------------------------------------------------------- consumer state
    int c_slot, c_start, c_cnt, c_KT;
    u32 c_barea;
    auto c_setup = [&]() {
        const int4 tl = tile_at(c_ti);
        c_KT = c_ti == last_ti ? kt_last : KT;
        c_slot = tl.x;
        c_start = tl.y;
        c_cnt = tl.z;
        // lanes of columns g >= c_cnt read slot 0's fragments: they only reach the MMA's column g, which nothing
        // uses (flush and the epilogue skip columns >= c_cnt), and save the zeroing and a predicate per unit
        c_barea = g < c_cnt ? dec5_barea(MODE == 0 ? ptok_at(c_start + g) : g, t) : 0u;
    };
    c_setup();
    // the current segment: k-tiles [c_ka, c_kb) of row tile (c_ti, c_rt), c_run of them still to consume
    int c_ka = c_kt0;
    int c_kb = c_ka + min(c_KT - c_ka, nu);
    int c_run = c_kb - c_ka;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, blk[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    u32 zc[4];
    if (F16)
        set_hzd<BITS>(zc, 1 << (BITS - 1), 1 << (BITS - 1));
    else
        set_bz<BITS>(zc, 1 << (BITS - 1), 1 << (BITS - 1));
    const uint4 zero4 = make_uint4(0u, 0u, 0u, 0u);

    // end of a segment [ka, kb) of row tile (c_ti, c_rt): hand the partial sums on
    auto flush = [&](int ka, int kb) {
        const int rt = c_rt;
        float v[4] = {acc[0], acc[1], acc[2], acc[3]};
        float bg = 0.0f, bg8 = 0.0f;
        if (MODE == 1) {
            if (has_bias && ka == 0) {
                const float* bp = bias + (long long)c_slot * NP + rt * 16 + g;
                bg = __ldg(bp);
                bg8 = __ldg(bp + 8);
            }
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int n = rt * 16 + g + 8 * hh;
                if (n < n_out) {
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int col = 2 * t + c;
                        if (col < c_cnt) {
                            const int p = c_start + col;
                            atomicAdd(out + (long long)ptok_at(p) * n_out + n,
                                      __ldg(pair_w + p) * (v[hh * 2 + c] + (hh ? bg8 : bg)));
                        }
                    }
                }
            }
            return;
        }
        if (!(ka == 0 && kb == KT)) {
            const long long cidx = (long long)c_ti * NT + rt;
            float* pp = part + cidx * 128 + lane;
#pragma unroll
            for (int c = 0; c < 4; ++c)
                if (2 * t + (c & 1) < c_cnt) atomicAdd(pp + c * 32, v[c]);
            // release: the warp's partial sums (ordered before lane 0 by __syncwarp) before its counter update.
            // No acquire on the completing side: it reads the sums with atomics, performed at L2 after its counter
            // atomic saw every other warp's released update (an acquire fence / __threadfence also invalidates the
            // SM's L1, CCTL.IVALL, where the other warps keep their activation fragments).
            dec5_syncwarp();
            int old = 0;
            if (lane == 0) old = atom_add_release_gpu(kdone + cidx, kb - ka);
            old = __shfl_sync(0xffffffffu, old, 0);
            if (old + (kb - ka) != KT) return;  // another warp completes this row tile
#pragma unroll
            for (int c = 0; c < 4; ++c) v[c] = (2 * t + (c & 1) < c_cnt) ? atomicExch(pp + c * 32, 0.0f) : 0.0f;
            if (lane == 0) atomicExch(kdone + cidx, 0);
        }
        if (has_bias) {
            const float* bp = bias + (long long)c_slot * NP + rt * 16 + g;
            bg = __ldg(bp);
            bg8 = __ldg(bp + 8);
        }
        if (gated) {
            const int i = rt * 8 + g;  // merged tile: rows 0-7 gate, 8-15 up of outputs rt*8 .. rt*8+7
            if (i < n_out) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int col = 2 * t + c;
                    if (col < c_cnt) {
                        const float a = act_gated(act, v[c] + bg, v[2 + c] + bg8, alpha, beta, limit, has_limit);
                        store_act<F16>(ahi, alo, (long long)(c_start + col) * KP2 + frag_off(i), a);
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
                        if (col < c_cnt) {
                            const float a = act_one(act, v[hh * 2 + c] + (hh ? bg8 : bg));
                            store_act<F16>(ahi, alo, (long long)(c_start + col) * KP2 + frag_off(i), a);
                        }
                    }
                }
            }
        }
    };

    // SD: the scales' dtype as a compile-time constant (the loops below are instantiated per dtype, so that the
    // steady state does not test it per unit)
    auto consume = [&](u32 so, auto SD) {
        constexpr int SDT = decltype(SD)::value;
        const unsigned char* p = ring + so;
        uint4 wv[TR::LW];
#pragma unroll
        for (int q = 0; q < TR::LW; ++q) wv[q] = *reinterpret_cast<const uint4*>(p + lane * TR::LB + q * 16);
        uint4 l0 = zero4, l1 = zero4;
        const unsigned char* ba = p + BOFF + c_barea;
        const uint4 h0 = *reinterpret_cast<const uint4*>(ba);
        const uint4 h1 = *reinterpret_cast<const uint4*>(ba + DEC5_BX);
        if (!F16 && split) {
            l0 = *reinterpret_cast<const uint4*>(ba + DEC5_BL);
            l1 = *reinterpret_cast<const uint4*>(ba + DEC5_BX + DEC5_BL);
        }
        constexpr int SPB = 4 / NBT;  // k-steps per scale block
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int q = j / SPB;
            u32 z0 = zc[0], z1 = zc[1], z2 = zc[2], z3 = zc[3];
            if (ZP) {
                if (j % SPB == 0) {
                    const u32 zv = *reinterpret_cast<const u16*>(p + ZOFF + q * 16 + g * 2);
                    if (F16)
                        set_hzd<BITS>(zc, (int)(zv & 0xffu), (int)(zv >> 8));
                    else
                        set_bz<BITS>(zc, (int)(zv & 0xffu), (int)(zv >> 8));
                }
                z0 = zc[0];
                z1 = zc[1];
                z2 = zc[2];
                z3 = zc[3];
            }
            const uint4& hv = (j < 2) ? h0 : h1;
            const uint4& lv = (j < 2) ? l0 : l1;
            const u32 bhA = u4c(hv, (j & 1) * 2), bhB = u4c(hv, (j & 1) * 2 + 1);
            const u32 blA = u4c(lv, (j & 1) * 2), blB = u4c(lv, (j & 1) * 2 + 1);
            u32 a[4];
            if (F16) {
                // fp16: rows g / g+8 constants in z0 / z1 (set_hzd)
                if (BITS == 4) {
                    deq4_f16(u4c(wv[0], j), z0, z1, a);
                } else {
                    const uint4& w8 = wv[(j >> 1) & (TR::LW - 1)];
                    deq8_f16(u4c(w8, (j & 1) * 2), u4c(w8, (j & 1) * 2 + 1), z0, z1, a);
                }
            } else if (BITS == 4) {
                deq4_bf16(u4c(wv[0], j), z0, z1, a);
            } else {
                const uint4& w8 = wv[(j >> 1) & (TR::LW - 1)];
                const u32 w0 = u4c(w8, (j & 1) * 2), w1 = u4c(w8, (j & 1) * 2 + 1);
                a[0] = deq8pair_bf16(w0, 0x4140u, z0, z1);
                a[1] = deq8pair_bf16(w0, 0x4342u, z2, z3);
                a[2] = deq8pair_bf16(w1, 0x4140u, z0, z1);
                a[3] = deq8pair_bf16(w1, 0x4342u, z2, z3);
            }
            if (j % SPB == 0) {
#pragma unroll
                for (int c = 0; c < 4; ++c) blk[c] = 0.0f;
            }
            if (F16) {
                mma_f16(blk, a[0], a[1], a[2], a[3], bhA, bhB);
            } else {
                mma_bf16(blk, a[0], a[1], a[2], a[3], bhA, bhB);
                mma_bf16(blk, a[0], a[1], a[2], a[3], blA, blB);
            }
            if (j % SPB == SPB - 1) {
                const unsigned char* sp = p + SOFF + (q * 16 + g * 2) * ssz;
                float sx, sy;
                if (SDT == DT_F32) {
                    const float2 sv = *reinterpret_cast<const float2*>(sp);
                    sx = sv.x;
                    sy = sv.y;
                } else {
                    const u32 sv = *reinterpret_cast<const u32*>(sp);
                    if (SDT == DT_F16) {
                        sx = h2f((u16)(sv & 0xffffu));
                        sy = h2f((u16)(sv >> 16));
                    } else {
                        sx = __uint_as_float(sv << 16);
                        sy = __uint_as_float(sv & 0xffff0000u);
                    }
                }
                acc[0] = fmaf(sx, blk[0], acc[0]);
                acc[1] = fmaf(sx, blk[1], acc[1]);
                acc[2] = fmaf(sy, blk[2], acc[2]);
                acc[3] = fmaf(sy, blk[3], acc[3]);
            }
        }
    };
    // the end of the consumer's segment (c_run == 0), n units of the range left after it: flush, then the next
    // segment (the next row tile: a segment ends before KT only at the range's end)
    auto c_next = [&](int n) {
        flush(c_ka, c_kb);
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[c] = 0.0f;
        if (n > 0) {
            c_ka = 0;
            if (++c_rt == NT) {
                c_rt = 0;
                ++c_ti;
                c_setup();
            }
            c_kb = min(c_KT, n);
            c_run = c_kb;
        }
    };

    // stage byte offsets: consume at c_off, issue into the stage consumed one iteration earlier (p_off)
    const u32 RLAST = (u32)((DEC5_STAGES - 1) * STAGE);
    // prologue: the first DEC5_STAGES - 1 units (empty commit groups if the range is shorter), one commit group each
    if (early_fc2) {
        // FC2: their weights, scales and zero points before the PDL wait (not committed yet: they join group 0, so
        // the first wait_group covers all of them, issued at the same time), then, after the wait, the producer
        // cursor back at the range start (the consumer's cursor has not moved: c_ti, c_rt, c_kt0) and per unit its
        // activation fragments (FC1's output) and one commit group, as for FC1. Unit s's weights are in group 0,
        // its activations in group s: both complete when the consumer's wait_group lets it read unit s.
#pragma unroll
        for (int s = 0; s < DEC5_STAGES - 1; ++s) {
            if (s < nu) {
                if (p_run == 0) p_next(nu - s);
                issue_unit(ringa + (u32)(s * STAGE), Dec5I<1>());
                --p_run;
            }
        }
        QM_PDL_WAIT();
        QM_PDL_LAUNCH();
        p_ti = c_ti;
        p_rt = c_rt;
        p_kt = c_kt0;
        p_run = 0;
        p_setup();
#pragma unroll
        for (int s = 0; s < DEC5_STAGES - 1; ++s) {
            if (s < nu) {
                if (p_run == 0) p_next(nu - s);
                issue_unit(ringa + (u32)(s * STAGE), Dec5I<2>());
                --p_run;
            }
            cp_async_commit();
        }
    } else {
#pragma unroll
        for (int s = 0; s < DEC5_STAGES - 1; ++s) {
            if (s < nu) {
                if (p_run == 0) p_next(nu - s);
                issue_unit(ringa + (u32)(s * STAGE), Dec5I<0>());
                --p_run;
            }
            cp_async_commit();
        }
    }
    u32 p_off = RLAST;  // the stage of the unit issued last
    // n: units left to consume; n - (DEC5_STAGES - 1): units left to copy. Each pass runs cnt units without a check:
    // up to the end of the consumer's segment and of the producer's run (or, once nothing is left to copy, with an
    // empty commit group per unit, which keeps wait_group's count)
    // cnt units without a check: issuing (pr > 0: the producer's run covers them) or with empty commit groups
    // (the producer's stage p_off is always the one before the consumer's: c_off follows from it)
    auto steady = [&](int cnt, auto SD) {
        for (const int ke = p_kt + cnt; p_kt < ke;) {  // issue_unit() advances p_kt
            cp_async_wait<DEC5_STAGES - 2>();
            dec5_syncwarp();
            const u32 c_off = (p_off == RLAST) ? 0u : p_off + (u32)STAGE;
            issue_unit(ringa + p_off, Dec5I<0>());
            cp_async_commit();
            consume(c_off, SD);
            p_off = c_off;
        }
    };
    auto drain = [&](int cnt, auto SD) {
        for (int k = cnt; k > 0; --k) {
            cp_async_wait<DEC5_STAGES - 2>();
            dec5_syncwarp();
            const u32 c_off = (p_off == RLAST) ? 0u : p_off + (u32)STAGE;
            cp_async_commit();
            consume(c_off, SD);
            p_off = c_off;
        }
    };
    for (int n = nu; n > 0;) {
        const int pr = n - (DEC5_STAGES - 1);
        int cnt = c_run;
        if (pr > 0) {
            if (p_run == 0) p_next(pr);
            cnt = min(cnt, p_run);
            p_run -= cnt;
            if (sdt == DT_F32)
                steady(cnt, Dec5I<DT_F32>());
            else if (sdt == DT_F16)
                steady(cnt, Dec5I<DT_F16>());
            else
                steady(cnt, Dec5I<DT_BF16>());
        } else {
            if (sdt == DT_F32)
                drain(cnt, Dec5I<DT_F32>());
            else if (sdt == DT_F16)
                drain(cnt, Dec5I<DT_F16>());
            else
                drain(cnt, Dec5I<DT_BF16>());
        }
        n -= cnt;
        c_run -= cnt;
        if (c_run == 0) c_next(n);
    }
    cp_async_wait<0>();

    // FC1 (pf2): this warp's share of the FC2 weights and scales of the same tiles (the FC2 launch's unit split)
    // into L2, so that FC2's loads stream during FC1's tail and the launch gap and FC2 reads from L2
    if (MODE == 0 && pf2) {
        const long long per2 = (long long)NT2 * KT2;
        const long long total2 = per2 * (cut_rows > 0 ? ntl - 1 : ntl);  // not a split pair's tile (read in part)
        const long long chunk2 = (total2 + nwt - 1) / nwt;
        long long v0 = ((long long)blockIdx.x * nw + warp) * chunk2;
        const long long v1 = min(total2, v0 + chunk2);
        const int ssz2 = (sdt2 == DT_F32) ? 4 : 2;
        const long long tstride2 = (long long)NT2 * NB2 * 16;
        while (v0 < v1) {
            const long long ti = v0 / per2;
            const long long a = v0 - ti * per2, b = min(per2, v1 - ti * per2);  // units [a, b) of tile ti
            const long long slot = tile_at((int)ti).x;
            l2_prefetch_range(W2 + slot * wstride2 + a * TR::TB, (b - a) * TR::TB, lane);
            // scale elements from the first unit's chunk to the end of the last unit's ([row tile][block][16])
            const long long ra = a / KT2, rb = (b - 1) / KT2;
            const int ka = (int)(a - ra * KT2), kl = (int)(b - 1 - rb * KT2);
            const long long e0 = slot * tstride2 + (ra * NB2 + (nbt2 == 1 ? (ka >> tsh2) : ka * nbt2)) * 16;
            const long long e1 = slot * tstride2 + (rb * NB2 + (nbt2 == 1 ? (kl >> tsh2) : kl * nbt2) + nbt2) * 16;
            l2_prefetch_range((const unsigned char*)S2 + e0 * ssz2, (e1 - e0) * ssz2, lane);
            v0 = ti * per2 + b;
        }
    }
#endif
}

// dec5_<bits>_<nbt>_<zp>_<mode> (bf16 hi / lo activations), dec5h_<bits>_<nbt>_<zp>_<mode> (fp16 activations).
// B0 / B1 / H0 / H1: the minimum resident blocks per SM (__launch_bounds__) of dec5 mode 0 / 1 and dec5h mode 0 / 1:
// the blocks per SM that the registers of the kernels before the fast-loop restructuring allowed (ptxas, sm_90), so
// that the restructured kernels (whose hot loops keep more loop-invariant addresses in registers) do not lose
// occupancy to registers (ptxas then spills a few registers in the per-row-tile paths of some instances, never in
// the steady-state loops).
#define QM_D5_KERNEL(B, N, Z, M, BB, BH, SFX, EARLY)                                                      \
    extern "C" __global__ void __launch_bounds__(128, BB) dec5_##B##_##N##_##Z##_##M##SFX(QM_D5_ARGS) {      \
        dec5_impl<B, N, Z, M, 0, EARLY>(QM_D5_PASS);                                                       \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(128, BH) dec5h_##B##_##N##_##Z##_##M##SFX(QM_D5_ARGS) {     \
        dec5_impl<B, N, Z, M, 1, EARLY>(QM_D5_PASS);                                                       \
    }
// FC1 (mode 0), FC2 (mode 1) and FC2 launched with PDL (mode 1, suffix p: the early prologue)
#define QM_D5_KERNELS(B, N, Z, B0, B1, H0, H1) \
    QM_D5_KERNEL(B, N, Z, 0, B0, H0, , 0)      \
    QM_D5_KERNEL(B, N, Z, 1, B1, H1, , 0)      \
    QM_D5_KERNEL(B, N, Z, 1, B1, H1, p, 1)
QM_D5_KERNELS(4, 1, 0, 6, 7, 8, 9)
QM_D5_KERNELS(4, 2, 0, 6, 7, 7, 9)
QM_D5_KERNELS(4, 4, 0, 7, 6, 8, 8)
QM_D5_KERNELS(4, 1, 1, 5, 7, 6, 8)
QM_D5_KERNELS(4, 2, 1, 5, 7, 7, 8)
QM_D5_KERNELS(4, 4, 1, 6, 6, 5, 8)
QM_D5_KERNELS(8, 1, 0, 7, 5, 8, 9)
QM_D5_KERNELS(8, 2, 0, 6, 5, 8, 9)
QM_D5_KERNELS(8, 4, 0, 6, 6, 7, 8)
QM_D5_KERNELS(8, 1, 1, 5, 5, 6, 9)
QM_D5_KERNELS(8, 2, 1, 7, 5, 7, 8)
QM_D5_KERNELS(8, 4, 1, 5, 5, 5, 8)
