// Routing (CUDA semantics), grouping of (token, expert) pairs into per-expert tiles, activation conversions.

#define QM_FULL 0xffffffffu
#define QM_NO_ID 0x7fffffff

// One warp routes one token: p = softmax(z) over all E, top-k by z (ties: lower index first),
// w = p[idx] (or router_weights[idx]), divided by their sum when normalize. E <= 1024.
static __device__ void route_token_warp(const void* logits, int ldt, const void* rw, int rwdt, int E, int k,
                                        int normalize, int tok, int* ids, float* wts) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)tok * E;
    float z[32];  // this lane's logits: experts lane + 32 i (E <= 1024), loaded once
    float m = QM_NEG_INF;
    const int per = (E + 31) >> 5;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        z[i] = QM_NEG_INF;
        if (i >= per) continue;
        const int e = lane + (i << 5);
        if (e < E) {
            z[i] = load_f(logits, row + e, ldt);
            m = fmaxf(m, z[i]);
        }
    }
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(QM_FULL, m, o));
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        if (i >= per) break;
        if (lane + (i << 5) < E) s += expf(z[i] - m);
    }
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(QM_FULL, s, o);
    u32 taken = 0u;
    float wsum = 0.0f;
    for (int j = 0; j < k; ++j) {
        float bv = QM_NEG_INF;
        int bi = QM_NO_ID;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            if (i >= per) break;
            const int e = lane + (i << 5);
            if (e < E && !((taken >> i) & 1u) && (bi == QM_NO_ID || z[i] > bv)) {  // e grows: ties keep lower
                bv = z[i];
                bi = e;
            }
        }
        for (int o = 16; o; o >>= 1) {
            float ov = __shfl_xor_sync(QM_FULL, bv, o);
            int oi = __shfl_xor_sync(QM_FULL, bi, o);
            bool better = (oi != QM_NO_ID) && (bi == QM_NO_ID || ov > bv || (ov == bv && oi < bi));
            if (better) {
                bv = ov;
                bi = oi;
            }
        }
        int id = (bi == QM_NO_ID) ? -1 : bi;
        if (id >= 0 && (id & 31) == lane) taken |= 1u << (id >> 5);
        float w = 0.0f;
        if (id >= 0) w = rw ? load_f(rw, row + id, rwdt) : expf(bv - m) / s;
        wsum += w;
        if (lane == 0) {
            ids[j] = id;
            wts[j] = w;
        }
    }
    if (normalize && wsum != 0.0f && lane == 0)
        for (int j = 0; j < k; ++j) wts[j] = wts[j] / wsum;
}

// Routing key of a logit: a larger float gets a larger key; -0 counts as +0 and NaN gets 0 (below -inf: ranked
// after every number, as numpy's argsort of -z). route_key_value inverts it (key 0 -> NaN).
static __device__ __forceinline__ u32 route_key(float z) {
    if (z != z) return 0u;
    const u32 b = __float_as_uint(z == 0.0f ? 0.0f : z);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
static __device__ __forceinline__ float route_key_value(u32 key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// The whole block routes T tokens, with the same results as route_token_warp (k <= E, T * k <= 64), in a short
// chain: one warp walking k rounds of arg-max was decode_prep's critical path (~8 µs at E = 128, k = 8 on an H200).
// Every expert's rank in its token's order (larger logit first, ties: lower index first) is counted by q lanes at
// once over the T * E keys in shared memory; the experts of rank < k are the top k, in order. Then one warp per
// token computes the weights. Also copies slot_map into smap[0, E) for build_tiles_warp. skey: T * E keys, ssel:
// T * k. Ends with the block synchronised.
static __device__ void route_rank_block(const void* logits, int ldt, const void* rw, int rwdt, int E, int k,
                                        int normalize, int T, const int* slot_map, int* smap, int* sids, float* sw,
                                        u32* skey, u32* ssel) {
    const int nth = blockDim.x, TE = T * E;
    // loops kept rolled: a launch runs this code once, from a cold instruction cache (NOTES-gpu-kernels.md)
#pragma unroll 1
    for (int i = threadIdx.x; i < TE; i += nth) skey[i] = route_key(load_f(logits, i, ldt));
#pragma unroll 1
    for (int e = threadIdx.x; e < E; e += nth) smap[e] = slot_map[e];
    __syncthreads();
    int lq = 0;  // q = 2^lq lanes per expert: the block's threads spread over the T * E experts, at most a warp each
    while (lq < 5 && (TE << (lq + 1)) <= nth) ++lq;
    const int q = 1 << lq;
    for (int g0 = 0; g0 < (TE << lq); g0 += nth) {  // the same trip count in every lane: all take part in the shuffles
        const int g = g0 + threadIdx.x, el = g >> lq, sub = g & (q - 1);
        const bool valid = el < TE;
        const int tok = valid ? el / E : 0, e = valid ? el - tok * E : 0;
        const u32* row = skey + tok * E;
        const u32 mine = row[e];
        // c: the experts before e: a larger key, or the same key at a lower index (keys <= 0xff800000: no wrap)
        int c = 0;
        if ((E & ((4 << lq) - 1)) == 0) {  // lane sub compares keys [sub * n, sub * n + n), 4 a 16-byte load
            const int n = E >> lq, j0 = sub * n;
            const uint4* r4 = reinterpret_cast<const uint4*>(row + j0);  // skey is 16-byte aligned, E % 4 == 0
#pragma unroll 4
            for (int i = 0; i < (n >> 2); ++i) {
                const uint4 v = r4[i];
                const int j = j0 + 4 * i;
                c += (v.x >= mine + (u32)(j >= e)) + (v.y >= mine + (u32)(j + 1 >= e)) +
                     (v.z >= mine + (u32)(j + 2 >= e)) + (v.w >= mine + (u32)(j + 3 >= e));
            }
        } else {
            for (int j = sub; j < E; j += q) c += row[j] >= mine + (u32)(j >= e);
        }
        for (int o = 1; o < q; o <<= 1) c += __shfl_xor_sync(QM_FULL, c, o);
        if (valid && sub == 0 && c < k) {
            sids[tok * k + c] = e;
            ssel[tok * k + c] = mine;
        }
    }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    for (int tok = threadIdx.x >> 5; tok < T; tok += nth >> 5) {
        const float m = route_key_value(ssel[tok * k]);  // rank 0: the largest logit
        float s = 1.0f;  // softmax's denominator; it cancels out when the weights are normalized
        if (!rw && !normalize) {
            s = 0.0f;
            for (int e = lane; e < E; e += 32) s += expf(route_key_value(skey[tok * E + e]) - m);
            for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(QM_FULL, s, o);
        }
        float w[2], wsum = 0.0f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // k <= 64
            const int j = lane + 32 * h;
            w[h] = 0.0f;
            if (j < k)
                w[h] = rw ? load_f(rw, (long long)tok * E + sids[tok * k + j], rwdt)
                          : expf(route_key_value(ssel[tok * k + j]) - m) / s;
            wsum += w[h];
        }
        if (normalize)
            for (int o = 16; o; o >>= 1) wsum += __shfl_xor_sync(QM_FULL, wsum, o);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = lane + 32 * h;
            if (j < k) sw[tok * k + j] = (normalize && wsum != 0.0f) ? w[h] / wsum : w[h];
        }
    }
    __syncthreads();
}

extern "C" __global__ void route_topk(const void* logits, int ldt, const void* rw, int rwdt, int has_rw, int T, int E,
                                      int k, int normalize, int* ids, float* wts) {
    const int tok = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (tok >= T) return;
    route_token_warp(logits, ldt, has_rw ? rw : (const void*)0, rwdt, E, k, normalize, tok, ids + (long long)tok * k,
                     wts + (long long)tok * k);
}

// Decode routing for a layer whose cold experts are shared between the GPU (host tier reads) and the CPU at once
// (the engine's "both" decode path). One block routes T tokens as route_token_warp / route_rank_block do, then for
// each token counts its cold pairs c (expert in no slot: slot_map[e] < 0 or >= cold_from) and gives the CPU the last
// cpu_take[c] of them in rank order (the smallest weights). ids / wts [T, k] (device) get every pair the GPU
// computes, -1 for the CPU's; the host's block `pub` gets every routed id (pub_ids), which of them the CPU takes
// (pub_cpu, 0/1), all weights (pub_w) and x's bytes (pub_x), then, after a system-scope fence, the flag at pub[0]
// set to ++*seq: the host spins on it instead of synchronising a stream (no event, no copy, works inside a CUDA
// graph). kernels/cold_split.py is the NumPy reference. smem: 4 (E + 2 T k) bytes, with rank routing also 4 (T E +
// T k) + 16 from the next 16-byte boundary.
// split_rows (null: none; T = 1 only): with r = split_rows[c] > 0 the GPU's last cold pair in rank order is split:
// pub_cpu r + 1 (the CPU computes its intermediate rows from r), its id and weight moved to the last of ids / wts
// (the decode kernels' last tile) and *cut = r (the rows of that tile the decode kernels compute); else *cut = 0.
extern "C" __global__ void route_split(const void* logits, int ldt, const void* rw, int rwdt, int has_rw, int T,
                                       int E, int k, int normalize, const int* slot_map, int cold_from,
                                       const int* cpu_take, int* ids, float* wts, unsigned char* pub, int ids_at,
                                       int cpu_at, int w_at, int x_at, const void* x, int x_bytes, unsigned* seq,
                                       int rank_route, const int* split_rows, int* cut) {
    extern __shared__ int sm_split[];
    int* smap = sm_split;
    int* sids = smap + E;
    float* sw = reinterpret_cast<float*>(sids + T * k);
    unsigned long long started = 0;
    if (threadIdx.x == 0) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(started));
    // x to the host first: the posted writes travel while the block routes
    if ((x_bytes & 3) == 0 && (((size_t)x | (size_t)(pub + x_at)) & 3) == 0) {
        const u32* src = (const u32*)x;
        u32* dst = (u32*)(pub + x_at);
        for (int i = threadIdx.x; i < (x_bytes >> 2); i += blockDim.x) dst[i] = src[i];
    } else {
        for (int i = threadIdx.x; i < x_bytes; i += blockDim.x) pub[x_at + i] = ((const unsigned char*)x)[i];
    }
    const void* rwp = has_rw ? rw : (const void*)0;
    if (rank_route) {  // T k <= 64, k <= E, T E <= 4096 (the host checks)
        u32* skey = reinterpret_cast<u32*>(sm_split + ((E + 2 * T * k + 3) & ~3));
        route_rank_block(logits, ldt, rwp, rwdt, E, k, normalize, T, slot_map, smap, sids, sw, skey, skey + T * E);
    } else {
        for (int e = threadIdx.x; e < E; e += blockDim.x) smap[e] = slot_map[e];
        for (int tok = threadIdx.x >> 5; tok < T; tok += blockDim.x >> 5)
            route_token_warp(logits, ldt, rwp, rwdt, E, k, normalize, tok, sids + tok * k, sw + tok * k);
        __syncthreads();
    }
    int* pids = reinterpret_cast<int*>(pub + ids_at);
    int* pcpu = reinterpret_cast<int*>(pub + cpu_at);
    float* pw = reinterpret_cast<float*>(pub + w_at);
    for (int tok = threadIdx.x; tok < T; tok += blockDim.x) {
        const int* tid = sids + tok * k;
        int c = 0;
        for (int j = 0; j < k; ++j) {
            const int e = tid[j];
            const int s = e >= 0 ? smap[e] : 0;
            c += e >= 0 && (s < 0 || s >= cold_from);
        }
        int n = cpu_take[c];
        int rows = (split_rows && T == 1) ? split_rows[c] : 0;  // > 0: the next cold pair after the CPU's is split
        int split_j = -1;
        for (int j = k - 1; j >= 0; --j) {  // the last cold pairs in rank order go to the CPU
            const int i = tok * k + j, e = tid[j];
            const int s = e >= 0 ? smap[e] : 0;
            const bool cold = e >= 0 && (s < 0 || s >= cold_from);
            const bool on_cpu = cold && n > 0;
            const bool split = cold && !on_cpu && rows > 0 && s >= 0;
            n -= on_cpu;
            if (split) {
                split_j = j;
                rows = -rows;  // taken (negative: its value kept for the pub and the cut)
            }
            ids[i] = on_cpu ? -1 : e;
            wts[i] = sw[i];
            pids[i] = e;
            pcpu[i] = split ? 1 - rows : on_cpu;
            pw[i] = sw[i];
        }
        if (cut) {
            if (split_j >= 0 && split_j != k - 1) {  // the split pair last: the decode kernels' last tile
                const int a = tok * k + split_j, b = tok * k + k - 1;
                const int ea = ids[a];
                const float wa = wts[a];
                ids[a] = ids[b];
                wts[a] = wts[b];
                ids[b] = ea;
                wts[b] = wa;
            }
            *cut = split_j >= 0 ? -rows : 0;
        }
    }
    __threadfence_system();  // this thread's writes to the host before the flag
    __syncthreads();
    if (threadIdx.x == 0) {
        // the GPU's clock at this launch's start and end, beside the flag (PublishedRouting.gpu_times: where a "both"
        // layer's time between the host's gate and the next routing goes, benchmarks/diag_worker_parts.py)
        unsigned long long now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        volatile unsigned long long* times = reinterpret_cast<volatile unsigned long long*>(pub + 8);
        times[0] = started;
        times[1] = now;
        __threadfence_system();
        const unsigned s = *seq + 1u;
        *seq = s;
        *reinterpret_cast<volatile unsigned*>(pub) = s;
    }
}

// Prefix sums of the per-expert pair counts cnt[0, E) (experts not in a slot count 0) into the experts' first pair
// off[e] and first tile toff[e] (ceil(count / TM) tiles an expert), by the block's first warp; the total tiles, at
// most max_tiles, into *num_tiles. The caller synchronises before and after.
static __device__ void tile_offsets(const int* cnt, int E, int TM, int* off, int* toff, int* num_tiles,
                                    int max_tiles) {
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    const int per = (E + 31) >> 5;
    const int b = lane * per;
    int ls = 0, lt = 0;
    for (int q = 0; q < per; ++q) {
        int e = b + q;
        if (e < E) {
            int c = cnt[e];
            ls += c;
            lt += (c + TM - 1) / TM;
        }
    }
    int s = ls, st = lt;
    for (int o = 1; o < 32; o <<= 1) {
        int v = __shfl_up_sync(QM_FULL, s, o);
        int vt = __shfl_up_sync(QM_FULL, st, o);
        if (lane >= o) {
            s += v;
            st += vt;
        }
    }
    int run = s - ls, runt = st - lt;
    for (int q = 0; q < per; ++q) {
        int e = b + q;
        if (e < E) {
            int c = cnt[e];
            off[e] = run;
            toff[e] = runt;
            run += c;
            runt += (c + TM - 1) / TM;
        }
    }
    if (lane == 31) *num_tiles = min(st, max_tiles);
}

// The tiles {slot, first pair, pairs (<= TM), expert} of every expert with pairs, from tile_offsets' tables.
static __device__ void write_tiles(const int* cnt, const int* off, const int* toff, const int* slot_map, int E,
                                   int TM, int4* tiles, int max_tiles) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int c = cnt[e];
        if (c > 0) {
            int sl = slot_map[e];
            for (int m = 0; m * TM < c; ++m) {
                int ti = toff[e] + m;
                if (ti < max_tiles) tiles[ti] = make_int4(sl, off[e] + m * TM, min(TM, c - m * TM), e);
            }
        }
    }
}

// Groups the P = T*kk (token, expert) pairs by expert: pair_tok / pair_w in expert order, and tiles
// {slot, first pair, pairs (<= TM), expert} for every resident expert hit. One block; smem 4*E ints.
static __device__ void build_tiles_block(const int* ids, const float* wts, int P, int kk, const int* slot_map, int E,
                                         int TM, int* pair_tok, float* pair_w, int4* tiles, int* num_tiles,
                                         int max_tiles, int* sm) {
    int* cnt = sm;
    int* fill = sm + E;
    int* off = sm + 2 * E;
    int* toff = sm + 3 * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        cnt[e] = 0;
        fill[e] = 0;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < P; i += blockDim.x) {
        int e = ids[i];
        if (e >= 0 && e < E && slot_map[e] >= 0) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    tile_offsets(cnt, E, TM, off, toff, num_tiles, max_tiles);
    __syncthreads();
    for (int i = threadIdx.x; i < P; i += blockDim.x) {
        int e = ids[i];
        if (e >= 0 && e < E && slot_map[e] >= 0) {
            int pos = off[e] + atomicAdd(&fill[e], 1);
            pair_tok[pos] = i / kk;
            pair_w[pos] = wts[i];
        }
    }
    write_tiles(cnt, off, toff, slot_map, E, TM, tiles, max_tiles);
}

// The same grouping by one warp, for P <= 64 pairs and TM >= the largest count of one expert would need... any
// count is fine: an expert with c pairs gets ceil(c / TM) tiles. No shared arrays over E, one barrier-free pass.
static __device__ void build_tiles_warp(const int* ids, const float* wts, int P, int kk, const int* slot_map, int E,
                                        int TM, int* pair_tok, float* pair_w, int4* tiles, int* num_tiles,
                                        int max_tiles, int* soff) {
    const int lane = threadIdx.x & 31;
    int e_[2], sl_[2], rank_[2], cnt_[2], first_[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int i = lane + 32 * h;
        int e = i < P ? ids[i] : -1;
        int sl = (e >= 0 && e < E) ? slot_map[e] : -1;
        if (sl < 0) e = -1;
        e_[h] = e;
        sl_[h] = sl;
        rank_[h] = 0;
        cnt_[h] = 0;
        first_[h] = i;
    }
    for (int j = 0; j < P; ++j) {
        const int ej = ids[j];  // broadcast read
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int i = lane + 32 * h;
            if (e_[h] >= 0 && ej == e_[h]) {
                cnt_[h] += 1;
                if (j < i) rank_[h] += 1;
                if (j < first_[h]) first_[h] = j;
            }
        }
    }
    // per expert (its first pair): tiles and pairs, prefix-summed in pair order over the 64 slots
    int nt_[2], np_[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const bool is_first = e_[h] >= 0 && first_[h] == lane + 32 * h;
        nt_[h] = is_first ? (cnt_[h] + TM - 1) / TM : 0;
        np_[h] = is_first ? cnt_[h] : 0;
    }
    int t0 = nt_[0], p0 = np_[0];
    for (int o = 1; o < 32; o <<= 1) {
        const int vt = __shfl_up_sync(QM_FULL, t0, o), vp = __shfl_up_sync(QM_FULL, p0, o);
        if (lane >= o) {
            t0 += vt;
            p0 += vp;
        }
    }
    const int tot_t0 = __shfl_sync(QM_FULL, t0, 31), tot_p0 = __shfl_sync(QM_FULL, p0, 31);
    int t1 = nt_[1], p1 = np_[1];
    for (int o = 1; o < 32; o <<= 1) {
        const int vt = __shfl_up_sync(QM_FULL, t1, o), vp = __shfl_up_sync(QM_FULL, p1, o);
        if (lane >= o) {
            t1 += vt;
            p1 += vp;
        }
    }
    const int tstart[2] = {t0 - nt_[0], tot_t0 + t1 - nt_[1]};
    const int pstart[2] = {p0 - np_[0], tot_p0 + p1 - np_[1]};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (np_[h] > 0) {
            soff[lane + 32 * h] = pstart[h];
            for (int m = 0; m * TM < np_[h]; ++m) {
                const int ti = tstart[h] + m;
                if (ti < max_tiles) tiles[ti] = make_int4(sl_[h], pstart[h] + m * TM, min(TM, np_[h] - m * TM), e_[h]);
            }
        }
    }
    __syncwarp();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int i = lane + 32 * h;
        if (e_[h] >= 0) {
            const int pos = soff[first_[h]] + rank_[h];
            pair_tok[pos] = i / kk;
            pair_w[pos] = wts[i];
        }
    }
    if (lane == 31) *num_tiles = min(tot_t0 + t1, max_tiles);
}

extern "C" __global__ void build_tiles(const int* ids, const float* wts, int P, int kk, const int* slot_map, int E,
                                       int TM, int* pair_tok, float* pair_w, int4* tiles, int* num_tiles,
                                       int max_tiles) {
    extern __shared__ int sm_tiles[];
    build_tiles_block(ids, wts, P, kk, slot_map, E, TM, pair_tok, pair_w, tiles, num_tiles, max_tiles, sm_tiles);
}

// Decode preparation in one launch: block 0 routes (route_mode 1; the top-k ids also go to ids [T, kk], in rank
// order, for the host) and groups the pairs; the other blocks (every block when there is only one) convert x [T, H]
// into the bf16 hi/lo B-fragment layout [T, KP] (xf16 = 1: into fp16 in xhi only, for the dec5h kernels; fp16 x is
// copied as it is) and zero the fp32 accumulator when asked.
extern "C" __global__ void decode_prep(int route_mode, const void* logits, int ldt, const void* rw, int rwdt,
                                       int has_rw, int E, int k, int normalize, int* ids, float* wts, int T, int kk,
                                       const int* slot_map, int TM, int* pair_tok, float* pair_w, int4* tiles,
                                       int* num_tiles, int max_tiles, const void* x, int xdt, int H, int KP,
                                       u16* xhi, u16* xlo, int xf16, float* zero_out, long long zero_n,
                                       int rank_route) {
    // shared: 4 E ints (block grouping), T * kk ids, T * kk weights, 64 ints (warp grouping); with rank_route also
    // T * E + T * kk keys (route_rank_block) from the next 16-byte boundary
    extern __shared__ int sm_prep[];
    QM_PDL_LAUNCH();  // FC1, launched with PDL, may start its blocks now; they wait for this kernel to complete
    if (blockIdx.x == 0) {
        int* sids = sm_prep + 4 * E;
        float* sw = reinterpret_cast<float*>(sids + T * kk);
        const bool warp_group = T * kk <= 64;
        if (rank_route) {  // route_mode, warp_group and k <= E (the host checks)
            u32* skey = reinterpret_cast<u32*>(sm_prep + ((4 * E + 2 * T * kk + 64 + 3) & ~3));  // 16-byte aligned
            route_rank_block(logits, ldt, has_rw ? rw : (const void*)0, rwdt, E, k, normalize, T, slot_map, sm_prep,
                             sids, sw, skey, skey + T * E);
        } else {
            // warp grouping (<= 64 pairs): the expert -> slot map is copied into sm_prep[0, E) (unused by that path)
            // by the warps that do not route, while the routing warps run, so that the grouping does not wait on a
            // global load after the routing; when every warp routes, the copy follows the routing
            const int nwarps = blockDim.x >> 5;
            const int rwarps = route_mode ? min(T, nwarps) : 0;
            if (warp_group && rwarps < nwarps)
                for (int e = threadIdx.x - rwarps * 32; e >= 0 && e < E; e += blockDim.x - rwarps * 32)
                    sm_prep[e] = slot_map[e];
            if (route_mode) {
                for (int tok = threadIdx.x >> 5; tok < T; tok += nwarps)
                    route_token_warp(logits, ldt, has_rw ? rw : (const void*)0, rwdt, E, k, normalize, tok,
                                     sids + tok * k, sw + tok * k);
            } else {
                for (int i = threadIdx.x; i < T * kk; i += blockDim.x) {
                    sids[i] = ids[i];
                    sw[i] = wts[i];
                }
            }
            if (warp_group && rwarps == nwarps)
                for (int e = threadIdx.x; e < E; e += blockDim.x) sm_prep[e] = slot_map[e];
            __syncthreads();
        }
        if (route_mode) {  // the routing to ids for the host's statistics; warp 0 groups the pairs meanwhile
            const int first = warp_group ? 32 : 0;
            for (int i = threadIdx.x - first; i >= 0 && i < T * kk; i += blockDim.x - first) ids[i] = sids[i];
        }
        if (warp_group) {
            if (threadIdx.x < 32)
                build_tiles_warp(sids, sw, T * kk, kk, sm_prep, E, TM, pair_tok, pair_w, tiles, num_tiles,
                                 max_tiles, reinterpret_cast<int*>(sw + T * kk));
        } else {
            build_tiles_block(sids, sw, T * kk, kk, slot_map, E, TM, pair_tok, pair_w, tiles, num_tiles, max_tiles,
                              sm_prep);
        }
    }
    // with more than one block, block 0 only routes and groups (its serial chain is the critical path) and
    // blocks 1.. convert x and zero the output
    if (gridDim.x > 1 && blockIdx.x == 0) return;
    const int nbk = gridDim.x > 1 ? gridDim.x - 1 : 1, bk = gridDim.x > 1 ? blockIdx.x - 1 : 0;
    // int indices: decode_prep takes at most decode_max_tokens rows (no 64-bit division in this code)
    const int cpr = KP >> 3;  // 8-value chunks per row
    const int nch = T * cpr, stride = nbk * blockDim.x;
    // fp16 x into the fp16 fragment layout: one 16-byte load a chunk
    const bool vec16 = xf16 && xdt == DT_F16 && (H & 7) == 0 && ((size_t)x & 15) == 0;
    for (int c = bk * blockDim.x + threadIdx.x; c < nch; c += stride) {
        const int n = c / cpr, k0 = (c - n * cpr) << 3;
        u16* hrow = xhi + n * KP;
        if (vec16) {
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (k0 < H) v = *reinterpret_cast<const uint4*>((const u16*)x + n * H + k0);
            *(u32*)(hrow + frag_off(k0)) = v.x;
            *(u32*)(hrow + frag_off(k0 + 2)) = v.y;
            *(u32*)(hrow + frag_off(k0 + 4)) = v.z;
            *(u32*)(hrow + frag_off(k0 + 6)) = v.w;
            continue;
        }
        if (xf16) {
#pragma unroll
            for (int p = 0; p < 8; p += 2) {
                const int kx = k0 + p, i = n * H + kx;
                u16 h0 = 0, h1 = 0;
                if (xdt == DT_F16) {
                    if (kx < H) h0 = ((const u16*)x)[i];
                    if (kx + 1 < H) h1 = ((const u16*)x)[i + 1];
                } else {
                    if (kx < H) h0 = f2h(load_f(x, i, xdt));
                    if (kx + 1 < H) h1 = f2h(load_f(x, i + 1, xdt));
                }
                *(u32*)(hrow + frag_off(kx)) = (u32)h0 | ((u32)h1 << 16);
            }
            continue;
        }
#pragma unroll
        for (int p = 0; p < 8; p += 2) {
            const int kx = k0 + p;
            float v0 = kx < H ? load_f(x, n * H + kx, xdt) : 0.0f;
            float v1 = kx + 1 < H ? load_f(x, n * H + kx + 1, xdt) : 0.0f;
            u16 h0 = f2bf(v0), h1 = f2bf(v1);
            u16 l0 = f2bf(v0 - bf2f(h0)), l1 = f2bf(v1 - bf2f(h1));
            const int o = n * KP + frag_off(kx);
            *(u32*)(xhi + o) = (u32)h0 | ((u32)h1 << 16);
            *(u32*)(xlo + o) = (u32)l0 | ((u32)l1 << 16);
        }
    }
    for (int i = bk * blockDim.x + threadIdx.x; i < (int)zero_n; i += stride) zero_out[i] = 0.0f;  // T * H
}

// prefill_prep's grouping, by the last routing block to finish: the experts' offsets from the counts the routing
// blocks left, each pair at its expert's offset plus its rank, the tiles; then counts set back to zero for the next
// launch. Reads what other blocks wrote through L2 (__ldcg), PREP_BATCH pairs a thread at once so that their loads
// overlap; the slot map from shared memory. smem 4 E ints.
#define PREP_BATCH 8
static __device__ void prefill_group(const int* ids, const float* wts, const int* ranks, int* counts, int P, int kk,
                                     const int* slot_map, int E, int TM, int* pair_tok, float* pair_w, int4* tiles,
                                     int* num_tiles, int max_tiles, int* sm) {
    int* cnt = sm;
    int* off = sm + E;
    int* toff = sm + 2 * E;
    int* smap = sm + 3 * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        cnt[e] = __ldcg(counts + e);
        smap[e] = slot_map[e];
    }
    __syncthreads();
    tile_offsets(cnt, E, TM, off, toff, num_tiles, max_tiles);
    __syncthreads();
    for (int i0 = threadIdx.x; i0 < P; i0 += PREP_BATCH * blockDim.x) {
        int e[PREP_BATCH], r[PREP_BATCH];
        float w[PREP_BATCH];
#pragma unroll
        for (int b = 0; b < PREP_BATCH; ++b) {
            const int i = i0 + b * blockDim.x;
            e[b] = i < P ? __ldcg(ids + i) : -1;
            r[b] = i < P ? __ldcg(ranks + i) : 0;
            w[b] = i < P ? __ldcg(wts + i) : 0.0f;
        }
#pragma unroll
        for (int b = 0; b < PREP_BATCH; ++b) {
            const int i = i0 + b * blockDim.x;
            if (e[b] >= 0 && e[b] < E && smap[e[b]] >= 0) {
                const int pos = off[e[b]] + r[b];
                pair_tok[pos] = i / kk;
                pair_w[pos] = w[b];
            }
        }
    }
    write_tiles(cnt, off, toff, smap, E, TM, tiles, max_tiles);
    for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
}

static __device__ __forceinline__ u32 pack_h2(float lo, float hi) { return (u32)f2h(lo) | ((u32)f2h(hi) << 16); }

#define PREP_THREADS 512
#define PREP_TOKENS (PREP_THREADS / 32)  // tokens per routing block: one a warp

// The tensor-core prefill's preparation in one launch (route_topk, build_tiles, to_f16_pad and the output's memset
// before it). Blocks [0, nrb) take PREP_TOKENS tokens each: a warp routes its token (route_mode 1; else the ids are
// given) and ranks each of the token's pairs among its expert's pairs with an atomic on counts[e] (experts in a slot
// only). The last routing block to finish (a ticket, as in CUDA's threadFenceReduction sample) groups the pairs
// (prefill_group) and sets the ticket back to zero. Blocks [nrb, grid) convert x [T, H] (any activation dtype) into
// fp16 [T, KP], zero padded, and zero the fp32 output's first zero_n values. counts [E] and the ticket are zero on
// entry and left zero. T * KP < 2^34 (the host checks). smem 4 E ints.
extern "C" __global__ void __launch_bounds__(PREP_THREADS)
prefill_prep(int route_mode, const void* logits, int ldt, const void* rw, int rwdt, int has_rw, int E, int k,
             int normalize, int* ids, float* wts, int T, int kk, const int* slot_map, int TM, int* ranks, int* counts,
             int* ticket, int nrb, int* pair_tok, float* pair_w, int4* tiles, int* num_tiles, int max_tiles,
             const void* x, int xdt, int H, int KP, u16* x16, float* zero_out, long long zero_n) {
    extern __shared__ int sm_pprep[];
    __shared__ int last_block;
    if (blockIdx.x < nrb) {
        const int lane = threadIdx.x & 31;
        const int tok = blockIdx.x * PREP_TOKENS + (threadIdx.x >> 5);
        if (tok < T) {
            const int i0 = tok * kk;
            if (route_mode) {
                route_token_warp(logits, ldt, has_rw ? rw : (const void*)0, rwdt, E, k, normalize, tok, ids + i0,
                                 wts + i0);
                __syncwarp();  // lane 0 wrote the token's ids
            }
            for (int j = lane; j < kk; j += 32) {
                const int e = ids[i0 + j];
                if (e >= 0 && e < E && slot_map[e] >= 0) ranks[i0 + j] = atomicAdd(counts + e, 1);
            }
        }
        __threadfence();  // this thread's ids, weights and ranks are visible device-wide before the ticket is taken
        __syncthreads();
        if (threadIdx.x == 0) last_block = atomicAdd(ticket, 1) == nrb - 1;
        __syncthreads();
        if (!last_block) return;
        prefill_group(ids, wts, ranks, counts, T * kk, kk, slot_map, E, TM, pair_tok, pair_w, tiles, num_tiles,
                      max_tiles, sm_pprep);
        if (threadIdx.x == 0) *ticket = 0;
        return;
    }
    const int nbk = gridDim.x - nrb, stride = nbk * PREP_THREADS;
    const int cpr = KP >> 3;  // 8-value chunks per row: one 16-byte store each
    const int nch = T * cpr;
    // whole 16-byte loads where the rows allow: fp16 one, fp32 two
    const bool vec = (xdt == DT_F16 || xdt == DT_F32) && (H & 7) == 0 && ((size_t)x & 15) == 0;
    for (int c = (blockIdx.x - nrb) * PREP_THREADS + threadIdx.x; c < nch; c += stride) {
        const int n = c / cpr, k0 = (c - n * cpr) << 3;
        const long long src = (long long)n * H + k0;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (vec) {
            if (k0 < H && xdt == DT_F16) {
                v = *reinterpret_cast<const uint4*>((const u16*)x + src);
            } else if (k0 < H) {
                const float4 a = reinterpret_cast<const float4*>((const float*)x + src)[0];
                const float4 b = reinterpret_cast<const float4*>((const float*)x + src)[1];
                v = make_uint4(pack_h2(a.x, a.y), pack_h2(a.z, a.w), pack_h2(b.x, b.y), pack_h2(b.z, b.w));
            }
        } else {
            u32 h[4];
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                const int kx = k0 + 2 * p;
                u16 h0 = 0, h1 = 0;
                if (kx < H) h0 = xdt == DT_F16 ? ((const u16*)x)[src + 2 * p] : f2h(load_f(x, src + 2 * p, xdt));
                if (kx + 1 < H)
                    h1 = xdt == DT_F16 ? ((const u16*)x)[src + 2 * p + 1] : f2h(load_f(x, src + 2 * p + 1, xdt));
                h[p] = (u32)h0 | ((u32)h1 << 16);
            }
            v = make_uint4(h[0], h[1], h[2], h[3]);
        }
        *reinterpret_cast<uint4*>(x16 + (long long)n * KP + k0) = v;
    }
    // the output: 16-byte stores where it is aligned, then the rest one value at a time
    const long long first = (long long)(blockIdx.x - nrb) * PREP_THREADS + threadIdx.x;
    const long long n4 = ((size_t)zero_out & 15) == 0 ? zero_n >> 2 : 0;
    for (long long i = first; i < n4; i += stride) reinterpret_cast<float4*>(zero_out)[i] = make_float4(0, 0, 0, 0);
    for (long long i = 4 * n4 + first; i < zero_n; i += stride) zero_out[i] = 0.0f;
}

extern "C" __global__ void to_f32(const void* x, int xdt, long long n, float* out) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = load_f(x, i, xdt);
}

extern "C" __global__ void from_f32(const float* in, void* out, int dt, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        store_f(out, i, dt, in[i]);
}
