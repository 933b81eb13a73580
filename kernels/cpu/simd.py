"""Hand-written SIMD inner loops (LLVM IR through numba intrinsics) for the quantised GEMV.

Numba promotes small integer arithmetic to 64 bits, which makes LLVM unpack int4/int8 weights
eight lanes at a time; the loop over one quantisation block is also too short for the loop
vectoriser. These intrinsics spell the row dot product out with explicit vector types instead:
per chunk of 16 (or 8) packed bytes: zero-extend, split nibbles, convert to float, subtract the
zero point, multiply with the activations, scale, and accumulate in two vector accumulators.

``qrow_int4_16``, ``qrow_int4_8``, ``qrow_int8_16``: float32 dot product of one quantised weight
row with one activation row::

    qrow(w, woff, nchunk, cshift, sc, soff, skind, zf, zoff, xa, xb, xoff, xs, xsoff) -> float32

    w      uint8 array (any shape, C-contiguous); woff: byte offset of the row's first chunk
    nchunk number of whole chunks to process
    cshift block index of chunk i = i >> cshift (chunks per block = 2**cshift)
    sc     scales (float32 array, or uint16 array holding fp16 / bf16 bits); soff: element offset
           of the row's first scale; skind: 0 float32, 1 fp16 bits, 2 bf16 bits
    zf     float32 array of zero points; zoff: element offset of the row's first block's zero point
    xa, xb float32 activations; int4: xa = even k, xb = odd k (deinterleaved, indexed by byte);
           int8: xa = x (xb ignored); xoff: element offset of the row start in xa / xb
    xs     float32 per-chunk sums of the activations (xs[xsoff + i] = sum of the x values chunk i
           multiplies); the zero point is applied as - scale * z * xs (folded out of the inner loop)
Result: sum over chunks of scale[b] * sum_j (q_j - z_b) * x_j.

``dqrow_*``: dequantise the same chunks of one row into a float32 array (prefill path)::

    dqrow(w, woff, nchunk, cshift, sc, soff, skind, zf, zoff, out, ooff) -> None

Chunk i is written to out[ooff + i*V : ooff + (i+1)*V] (V values per chunk). For int4 the chunk's
low nibbles (even k) come first, then its high nibbles (odd k): a per-chunk permutation of k that
the caller applies to the activations as well (see ``kernels.cpu.qmoe.k_permutation``).

``load_scale(sc, idx, skind)``: one scale as float32 (float32 array or fp16/bf16 bits in uint16).
"""
from __future__ import annotations

import llvmlite.ir as ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["qrow_int4_16", "qrow_int4_8", "qrow_int8_16", "dqrow_int4_16", "dqrow_int4_8", "dqrow_int8_16",
           "load_scale"]

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I16 = ir.IntType(16)
_I8 = ir.IntType(8)
_I64 = ir.IntType(64)
_FAST = ("fast",)


def _fast(instr):
    instr.flags.extend(_FAST)
    return instr


def _splat(builder, value, n):
    vt = ir.VectorType(value.type, n)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _hsum(builder, v, n):
    """Horizontal sum of a <n x float> vector by halving shuffles."""
    while n > 1:
        h = n // 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h), list(range(h))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h), list(range(h, n))))
        v = _fast(builder.fadd(lo, hi))
        n = h
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _load_scale(builder, sc_ptr, idx, sc_is_f32, skind):
    p = builder.gep(sc_ptr, [idx])
    if sc_is_f32:
        return builder.load(p)
    raw = builder.load(p)  # i16
    as_half = builder.fpext(builder.bitcast(raw, ir.HalfType()), _F32)
    as_bf16 = builder.bitcast(builder.shl(builder.zext(raw, _I32), ir.Constant(_I32, 16)), _F32)
    is_bf = builder.icmp_signed("==", skind, ir.Constant(skind.type, 2))
    return builder.select(is_bf, as_bf16, as_half)


def _make_qrow(bits: int, chunk: int):
    nvals = chunk  # lanes per float vector (int4: two vectors lo/hi of `chunk` lanes each)

    def codegen(context, builder, sig, args):
        (w, woff, nchunk, cshift, sc, soff, skind, zf, zoff, xa, xb, xoff, xs, xsoff) = args
        (w_t, _, _, _, sc_t, _, _, zf_t, _, xa_t, xb_t, _, xs_t, _) = sig.args
        w_ptr = context.make_array(w_t)(context, builder, value=w).data
        sc_ptr = context.make_array(sc_t)(context, builder, value=sc).data
        zf_ptr = context.make_array(zf_t)(context, builder, value=zf).data
        xa_ptr = context.make_array(xa_t)(context, builder, value=xa).data
        xb_ptr = context.make_array(xb_t)(context, builder, value=xb).data
        xs_ptr = context.make_array(xs_t)(context, builder, value=xs).data
        sc_is_f32 = sc_t.dtype == types.float32

        wvec_t = ir.VectorType(_I8, chunk)
        fvec_t = ir.VectorType(_F32, nvals)
        ivec_t = ir.VectorType(_I32, nvals)
        zero_v = ir.Constant(fvec_t, [0.0] * nvals)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(fvec_t, [fvec_t] * 3),
                                             f"llvm.fma.v{nvals}f32")
        acc0 = cgutils.alloca_once_value(builder, zero_v)
        acc1 = cgutils.alloca_once_value(builder, zero_v)
        corr0 = cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0))
        corr1 = cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0))
        fma1 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")

        def one_chunk(i, acc_slot, corr):
            wp = builder.gep(w_ptr, [builder.add(woff, builder.mul(i, ir.Constant(_I64, chunk)))])
            wv = builder.load(builder.bitcast(wp, wvec_t.as_pointer()), align=1)
            wi = builder.zext(wv, ivec_t)
            b = builder.ashr(i, cshift)
            s = _load_scale(builder, sc_ptr, builder.add(soff, b), sc_is_f32, skind)
            z = builder.load(builder.gep(zf_ptr, [builder.add(zoff, b)]))
            xsum = builder.load(builder.gep(xs_ptr, [builder.add(xsoff, i)]))
            # zero point folded out: sum_j (q_j - z) x_j = sum_j q_j x_j - z * sum_j x_j
            builder.store(builder.call(fma1, [s, _fast(builder.fmul(z, xsum)), builder.load(corr)]), corr)
            xo = builder.add(xoff, builder.mul(i, ir.Constant(_I64, nvals)))
            xav = builder.load(builder.bitcast(builder.gep(xa_ptr, [xo]), fvec_t.as_pointer()), align=4)
            if bits == 4:
                lo = builder.sitofp(builder.and_(wi, ir.Constant(ivec_t, [15] * nvals)), fvec_t)
                hi = builder.sitofp(builder.lshr(wi, ir.Constant(ivec_t, [4] * nvals)), fvec_t)
                xbv = builder.load(builder.bitcast(builder.gep(xb_ptr, [xo]), fvec_t.as_pointer()), align=4)
                t = builder.call(fma, [hi, xbv, _fast(builder.fmul(lo, xav))])
            else:
                t = _fast(builder.fmul(builder.sitofp(wi, fvec_t), xav))
            acc = builder.load(acc_slot)
            builder.store(builder.call(fma, [_splat(builder, s, nvals), t, acc]), acc_slot)

        half = builder.ashr(nchunk, ir.Constant(_I64, 1))
        with cgutils.for_range(builder, half) as loop:
            i0 = builder.shl(loop.index, ir.Constant(_I64, 1))
            one_chunk(i0, acc0, corr0)
            one_chunk(builder.add(i0, ir.Constant(_I64, 1)), acc1, corr1)
        odd = builder.icmp_signed("!=", builder.and_(nchunk, ir.Constant(_I64, 1)), ir.Constant(_I64, 0))
        with builder.if_then(odd):
            one_chunk(builder.sub(nchunk, ir.Constant(_I64, 1)), acc0, corr0)
        total = _fast(builder.fadd(builder.load(acc0), builder.load(acc1)))
        corr = _fast(builder.fadd(builder.load(corr0), builder.load(corr1)))
        return _fast(builder.fsub(_hsum(builder, total, nvals), corr))

    def qrow(typingctx, w, woff, nchunk, cshift, sc, soff, skind, zf, zoff, xa, xb, xoff, xs, xsoff):
        ints = (woff, nchunk, cshift, soff, skind, zoff, xoff, xsoff)
        if not all(isinstance(t, types.Integer) for t in ints):
            return None
        sig = types.float32(w, types.int64, types.int64, types.int64, sc, types.int64, types.int64,
                            zf, types.int64, xa, xb, types.int64, xs, types.int64)
        return sig, codegen

    qrow.__name__ = f"qrow_int{bits}_{chunk}"
    return intrinsic(qrow)


qrow_int4_16 = _make_qrow(4, 16)
qrow_int4_8 = _make_qrow(4, 8)
qrow_int8_16 = _make_qrow(8, 16)


def _make_dqrow(bits: int, chunk: int):
    nvals = chunk

    def codegen(context, builder, sig, args):
        (w, woff, nchunk, cshift, sc, soff, skind, zf, zoff, out, ooff) = args
        (w_t, _, _, _, sc_t, _, _, zf_t, _, out_t, _) = sig.args
        w_ptr = context.make_array(w_t)(context, builder, value=w).data
        sc_ptr = context.make_array(sc_t)(context, builder, value=sc).data
        zf_ptr = context.make_array(zf_t)(context, builder, value=zf).data
        o_ptr = context.make_array(out_t)(context, builder, value=out).data
        sc_is_f32 = sc_t.dtype == types.float32
        wvec_t = ir.VectorType(_I8, chunk)
        fvec_t = ir.VectorType(_F32, nvals)
        ivec_t = ir.VectorType(_I32, nvals)
        per_chunk = nvals * (2 if bits == 4 else 1)
        with cgutils.for_range(builder, nchunk) as loop:
            i = loop.index
            wp = builder.gep(w_ptr, [builder.add(woff, builder.mul(i, ir.Constant(_I64, chunk)))])
            wi = builder.zext(builder.load(builder.bitcast(wp, wvec_t.as_pointer()), align=1), ivec_t)
            b = builder.ashr(i, cshift)
            s = _splat(builder, _load_scale(builder, sc_ptr, builder.add(soff, b), sc_is_f32, skind), nvals)
            zv = _splat(builder, builder.load(builder.gep(zf_ptr, [builder.add(zoff, b)])), nvals)
            base = builder.add(ooff, builder.mul(i, ir.Constant(_I64, per_chunk)))
            if bits == 4:
                lo = builder.sitofp(builder.and_(wi, ir.Constant(ivec_t, [15] * nvals)), fvec_t)
                hi = builder.sitofp(builder.lshr(wi, ir.Constant(ivec_t, [4] * nvals)), fvec_t)
                vals = [(lo, 0), (hi, nvals)]
            else:
                vals = [(builder.sitofp(wi, fvec_t), 0)]
            for v, off in vals:
                r = _fast(builder.fmul(_fast(builder.fsub(v, zv)), s))
                p = builder.gep(o_ptr, [builder.add(base, ir.Constant(_I64, off))])
                builder.store(r, builder.bitcast(p, fvec_t.as_pointer()), align=4)
        return context.get_dummy_value()

    def dqrow(typingctx, w, woff, nchunk, cshift, sc, soff, skind, zf, zoff, out, ooff):
        ints = (woff, nchunk, cshift, soff, skind, zoff, ooff)
        if not all(isinstance(t, types.Integer) for t in ints):
            return None
        sig = types.none(w, types.int64, types.int64, types.int64, sc, types.int64, types.int64,
                         zf, types.int64, out, types.int64)
        return sig, codegen

    dqrow.__name__ = f"dqrow_int{bits}_{chunk}"
    return intrinsic(dqrow)


dqrow_int4_16 = _make_dqrow(4, 16)
dqrow_int4_8 = _make_dqrow(4, 8)
dqrow_int8_16 = _make_dqrow(8, 16)


@intrinsic
def load_scale(typingctx, sc, idx, skind):
    if not (isinstance(idx, types.Integer) and isinstance(skind, types.Integer)):
        return None
    sig = types.float32(sc, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        sc_v, idx_v, skind_v = args
        sc_ptr = context.make_array(signature.args[0])(context, builder, value=sc_v).data
        return _load_scale(builder, sc_ptr, idx_v, signature.args[0].dtype == types.float32, skind_v)

    return sig, codegen


# ----------------------------------------------------------------------------- GEMM micro-kernel
def _make_microkernel(nr: int, mv: int):
    """C^T tile [nr, 16*mv] = W panel [nr, kc] (row stride ldw) times X^T [kc, 16*mv] (row stride ldx).

    mk(wp, woff, ldw, xt, xoff, ldx, kc, ct, coff) -> None; the tile is stored (overwritten) at
    ct[coff + r*16*mv + c]. Accumulators live in nr*mv vector registers; per k one vector load per
    16 columns of X^T and one broadcast per W row.
    """
    lanes = 16

    def codegen(context, builder, sig, args):
        (wp, woff, ldw, xt, xoff, ldx, kc, ct, coff) = args
        (wp_t, _, _, xt_t, _, _, _, ct_t, _) = sig.args
        w_ptr = context.make_array(wp_t)(context, builder, value=wp).data
        x_ptr = context.make_array(xt_t)(context, builder, value=xt).data
        c_ptr = context.make_array(ct_t)(context, builder, value=ct).data
        fvec_t = ir.VectorType(_F32, lanes)
        zero_v = ir.Constant(fvec_t, [0.0] * lanes)
        accs = [[cgutils.alloca_once_value(builder, zero_v) for _ in range(mv)] for _ in range(nr)]
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(fvec_t, [fvec_t] * 3),
                                             "llvm.fma.v16f32")
        with cgutils.for_range(builder, kc) as loop:
            k = loop.index
            xrow = builder.add(xoff, builder.mul(k, ldx))
            xv = []
            for j in range(mv):
                p = builder.gep(x_ptr, [builder.add(xrow, ir.Constant(_I64, lanes * j))])
                xv.append(builder.load(builder.bitcast(p, fvec_t.as_pointer()), align=4))
            for r in range(nr):
                wpos = builder.add(builder.add(woff, builder.mul(ir.Constant(_I64, r), ldw)), k)
                sv = _splat(builder, builder.load(builder.gep(w_ptr, [wpos])), lanes)
                for j in range(mv):
                    a = builder.load(accs[r][j])
                    builder.store(builder.call(fma, [sv, xv[j], a]), accs[r][j])
        for r in range(nr):
            for j in range(mv):
                p = builder.gep(c_ptr, [builder.add(coff, ir.Constant(_I64, r * lanes * mv + lanes * j))])
                builder.store(builder.load(accs[r][j]), builder.bitcast(p, fvec_t.as_pointer()), align=4)
        return context.get_dummy_value()

    def mk(typingctx, wp, woff, ldw, xt, xoff, ldx, kc, ct, coff):
        if not all(isinstance(t, types.Integer) for t in (woff, ldw, xoff, ldx, kc, coff)):
            return None
        sig = types.none(wp, types.int64, types.int64, xt, types.int64, types.int64, types.int64, ct, types.int64)
        return sig, codegen

    mk.__name__ = f"microkernel_{nr}x{16 * mv}"
    return intrinsic(mk)


MK_NR = 6
microkernel_6x32 = _make_microkernel(MK_NR, 2)
microkernel_6x16 = _make_microkernel(MK_NR, 1)


# ----------------------------------------------------------------------------- batched GEMM / GEMV helpers
def _make_microkernel_acc(nr: int, mv: int):
    """C tile [nr, 16*mv] (+)= W panel [nr, kc] (row stride ldw) times X panel [kc, 16*mv] (row stride ldx).

    mk(wp, woff, ldw, xp, xoff, ldx, kc, c, coff, ldc, load_c) -> None: the tile lives at
    c[coff + r*ldc + j] (row stride ldc); load_c != 0 adds to it, 0 overwrites it. Used with k-blocked
    panels: the X panel (kc x 32 floats) stays in L1 while the W panels of a task stream past it.
    """
    lanes = 16

    def codegen(context, builder, sig, args):
        (wp, woff, ldw, xt, xoff, ldx, kc, ct, coff, ldc, load_c) = args
        (wp_t, _, _, xt_t, _, _, _, ct_t, _, _, _) = sig.args
        w_ptr = context.make_array(wp_t)(context, builder, value=wp).data
        x_ptr = context.make_array(xt_t)(context, builder, value=xt).data
        c_ptr = context.make_array(ct_t)(context, builder, value=ct).data
        fvec_t = ir.VectorType(_F32, lanes)
        zero_v = ir.Constant(fvec_t, [0.0] * lanes)

        def cptr(r, j):
            off = builder.add(builder.add(coff, builder.mul(ir.Constant(_I64, r), ldc)), ir.Constant(_I64, lanes * j))
            return builder.bitcast(builder.gep(c_ptr, [off]), fvec_t.as_pointer())

        accs = [[cgutils.alloca_once_value(builder, zero_v) for _ in range(mv)] for _ in range(nr)]
        do_load = builder.icmp_signed("!=", load_c, ir.Constant(load_c.type, 0))
        with builder.if_then(do_load):
            for r in range(nr):
                for j in range(mv):
                    builder.store(builder.load(cptr(r, j), align=4), accs[r][j])
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(fvec_t, [fvec_t] * 3),
                                             "llvm.fma.v16f32")
        with cgutils.for_range(builder, kc) as loop:
            k = loop.index
            xrow = builder.add(xoff, builder.mul(k, ldx))
            xv = []
            for j in range(mv):
                p = builder.gep(x_ptr, [builder.add(xrow, ir.Constant(_I64, lanes * j))])
                xv.append(builder.load(builder.bitcast(p, fvec_t.as_pointer()), align=4))
            for r in range(nr):
                wpos = builder.add(builder.add(woff, builder.mul(ir.Constant(_I64, r), ldw)), k)
                sv = _splat(builder, builder.load(builder.gep(w_ptr, [wpos])), lanes)
                for j in range(mv):
                    a = builder.load(accs[r][j])
                    builder.store(builder.call(fma, [sv, xv[j], a]), accs[r][j])
        for r in range(nr):
            for j in range(mv):
                builder.store(builder.load(accs[r][j]), cptr(r, j), align=4)
        return context.get_dummy_value()

    def mk(typingctx, wp, woff, ldw, xt, xoff, ldx, kc, ct, coff, ldc, load_c):
        if not all(isinstance(t, types.Integer) for t in (woff, ldw, xoff, ldx, kc, coff, ldc, load_c)):
            return None
        sig = types.none(wp, types.int64, types.int64, xt, types.int64, types.int64, types.int64, ct, types.int64,
                         types.int64, types.int64)
        return sig, codegen

    mk.__name__ = f"microkernel_acc_{nr}x{16 * mv}"
    return intrinsic(mk)


microkernel_acc_6x32 = _make_microkernel_acc(MK_NR, 2)
microkernel_acc_6x16 = _make_microkernel_acc(MK_NR, 1)


@intrinsic
def atomic_fetch_add(typingctx, arr, idx, val):
    """old = arr[idx]; arr[idx] += val, atomically (int64 array): a task counter shared by the threads."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and isinstance(idx, types.Integer)
            and isinstance(val, types.Integer)):
        return None
    sig = types.int64(arr, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        a, i, v = args
        ptr = builder.gep(context.make_array(signature.args[0])(context, builder, value=a).data, [i])
        return builder.atomic_rmw("add", ptr, v, "seq_cst")

    return sig, codegen


@intrinsic
def prefetch_bytes(typingctx, arr, byte_off, nbytes):
    """Software prefetch (read, into all cache levels) of the cache lines of arr's bytes
    [byte_off, byte_off + nbytes), clipped to the array's extent; nothing is loaded architecturally."""
    if not (isinstance(arr, types.Array) and isinstance(byte_off, types.Integer) and isinstance(nbytes, types.Integer)):
        return None
    sig = types.none(arr, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        a, off, nb = args
        ary = context.make_array(signature.args[0])(context, builder, value=a)
        i8p = ir.IntType(8).as_pointer()
        base = builder.bitcast(ary.data, i8p)
        total = builder.mul(ary.nitems, ir.Constant(_I64, context.get_abi_sizeof(
            context.get_data_type(signature.args[0].dtype))))
        end = builder.add(off, nb)
        end = builder.select(builder.icmp_signed(">", end, total), total, end)
        pf = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
                                            "llvm.prefetch.p0i8")
        cur = cgutils.alloca_once_value(builder, off)
        cond_bb = builder.append_basic_block("pf.cond")
        body_bb = builder.append_basic_block("pf.body")
        done_bb = builder.append_basic_block("pf.done")
        builder.branch(cond_bb)
        builder.position_at_end(cond_bb)
        c = builder.load(cur)
        builder.cbranch(builder.icmp_signed("<", c, end), body_bb, done_bb)
        builder.position_at_end(body_bb)
        builder.call(pf, [builder.gep(base, [c]), ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        builder.store(builder.add(c, ir.Constant(_I64, 64)), cur)
        builder.branch(cond_bb)
        builder.position_at_end(done_bb)
        return context.get_dummy_value()

    return sig, codegen


# ----------------------------------------------------------------------------- int4 via a 16-entry table
def _target_has_avx512f() -> bool:
    """Whether the code Numba generates here may use AVX-512F (same feature source as Numba's codegen)."""
    try:
        from numba.core import config
        from numba.core.codegen import get_host_cpu_features

        feats = config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features()
        return "+avx512f" in feats.split(",")
    except Exception:
        return False


HAS_AVX512F = _target_has_avx512f()


def _int4_indices(builder, wv, ivec_t):
    """16 packed bytes -> (low-nibble, high-nibble) lane indices as <16 x i32>. Only the low 4 bits of each
    index are meaningful (vpermps ignores the rest): the high nibbles come from a 16-bit shift, whose
    spill-over from the neighbouring byte lands in bits 4..7."""
    lo = builder.zext(wv, ivec_t)
    w16 = builder.bitcast(wv, ir.VectorType(_I16, 8))
    sh = builder.lshr(w16, ir.Constant(ir.VectorType(_I16, 8), [4] * 8))
    hi = builder.zext(builder.bitcast(sh, ir.VectorType(_I8, 16)), ivec_t)
    return lo, hi


def _make_qrow_lut(z_per_block: bool):
    """int4, 16-byte chunks: same contract as qrow_int4_16, but the nibbles become floats through a
    16-entry table (vpermps) holding (q - z) * scale: per 32 weights one table multiply, two permutes and
    two FMAs, instead of mask / shift / two int->float conversions / multiply and a folded zero point.
    z_per_block False: zf[zoff] is the row's one zero point (zero-point modes 0 and 1); True: zf[zoff + b]
    per block. xs / xsoff are not used. Without AVX-512F this is qrow_int4_16 (the folded-zero-point code).
    """
    if not HAS_AVX512F:
        return qrow_int4_16
    nvals = 16

    def codegen(context, builder, sig, args):
        (w, woff, nchunk, cshift, sc, soff, skind, zf, zoff, xa, xb, xoff, xs, xsoff) = args
        (w_t, _, _, _, sc_t, _, _, zf_t, _, xa_t, xb_t, _, xs_t, _) = sig.args
        w_ptr = context.make_array(w_t)(context, builder, value=w).data
        sc_ptr = context.make_array(sc_t)(context, builder, value=sc).data
        zf_ptr = context.make_array(zf_t)(context, builder, value=zf).data
        xa_ptr = context.make_array(xa_t)(context, builder, value=xa).data
        xb_ptr = context.make_array(xb_t)(context, builder, value=xb).data
        sc_is_f32 = sc_t.dtype == types.float32
        wvec_t = ir.VectorType(_I8, 16)
        fvec_t = ir.VectorType(_F32, nvals)
        ivec_t = ir.VectorType(_I32, nvals)
        zero_v = ir.Constant(fvec_t, [0.0] * nvals)
        iota = ir.Constant(fvec_t, [float(i) for i in range(nvals)])
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(fvec_t, [fvec_t] * 3),
                                             "llvm.fma.v16f32")
        perm = cgutils.get_or_insert_function(builder.module, ir.FunctionType(fvec_t, [fvec_t, ivec_t]),
                                              "llvm.x86.avx512.permvar.sf.512")
        accs = [cgutils.alloca_once_value(builder, zero_v) for _ in range(4)]
        if not z_per_block:
            zrow = builder.load(builder.gep(zf_ptr, [zoff]))
            tbl0 = _fast(builder.fsub(iota, _splat(builder, zrow, nvals)))

        def one_chunk(i, acc_lo, acc_hi):
            wp = builder.gep(w_ptr, [builder.add(woff, builder.mul(i, ir.Constant(_I64, 16)))])
            wv = builder.load(builder.bitcast(wp, wvec_t.as_pointer()), align=1)
            lo_i, hi_i = _int4_indices(builder, wv, ivec_t)
            b = builder.ashr(i, cshift)
            s = _splat(builder, _load_scale(builder, sc_ptr, builder.add(soff, b), sc_is_f32, skind), nvals)
            if z_per_block:
                z = builder.load(builder.gep(zf_ptr, [builder.add(zoff, b)]))
                t0 = _fast(builder.fsub(iota, _splat(builder, z, nvals)))
            else:
                t0 = tbl0
            tbl = _fast(builder.fmul(t0, s))
            lo = builder.call(perm, [tbl, lo_i])
            hi = builder.call(perm, [tbl, hi_i])
            xo = builder.add(xoff, builder.mul(i, ir.Constant(_I64, nvals)))
            xav = builder.load(builder.bitcast(builder.gep(xa_ptr, [xo]), fvec_t.as_pointer()), align=4)
            xbv = builder.load(builder.bitcast(builder.gep(xb_ptr, [xo]), fvec_t.as_pointer()), align=4)
            builder.store(builder.call(fma, [lo, xav, builder.load(acc_lo)]), acc_lo)
            builder.store(builder.call(fma, [hi, xbv, builder.load(acc_hi)]), acc_hi)

        half = builder.ashr(nchunk, ir.Constant(_I64, 1))
        with cgutils.for_range(builder, half) as loop:
            i0 = builder.shl(loop.index, ir.Constant(_I64, 1))
            one_chunk(i0, accs[0], accs[1])
            one_chunk(builder.add(i0, ir.Constant(_I64, 1)), accs[2], accs[3])
        odd = builder.icmp_signed("!=", builder.and_(nchunk, ir.Constant(_I64, 1)), ir.Constant(_I64, 0))
        with builder.if_then(odd):
            one_chunk(builder.sub(nchunk, ir.Constant(_I64, 1)), accs[0], accs[1])
        t01 = _fast(builder.fadd(builder.load(accs[0]), builder.load(accs[1])))
        t23 = _fast(builder.fadd(builder.load(accs[2]), builder.load(accs[3])))
        return _hsum(builder, _fast(builder.fadd(t01, t23)), nvals)

    def qrow(typingctx, w, woff, nchunk, cshift, sc, soff, skind, zf, zoff, xa, xb, xoff, xs, xsoff):
        ints = (woff, nchunk, cshift, soff, skind, zoff, xoff, xsoff)
        if not all(isinstance(t, types.Integer) for t in ints):
            return None
        sig = types.float32(w, types.int64, types.int64, types.int64, sc, types.int64, types.int64,
                            zf, types.int64, xa, xb, types.int64, xs, types.int64)
        return sig, codegen

    qrow.__name__ = f"qrow_int4_16_lut_{'zblk' if z_per_block else 'zrow'}"
    return intrinsic(qrow)


qrow_int4_16_lut_zrow = _make_qrow_lut(False)
qrow_int4_16_lut_zblk = _make_qrow_lut(True)


def _make_dqrow_lut():
    """dqrow_int4_16 through the (q - z) * scale table (AVX-512F); otherwise dqrow_int4_16 itself."""
    if not HAS_AVX512F:
        return dqrow_int4_16
    nvals = 16

    def codegen(context, builder, sig, args):
        (w, woff, nchunk, cshift, sc, soff, skind, zf, zoff, out, ooff) = args
        (w_t, _, _, _, sc_t, _, _, zf_t, _, out_t, _) = sig.args
        w_ptr = context.make_array(w_t)(context, builder, value=w).data
        sc_ptr = context.make_array(sc_t)(context, builder, value=sc).data
        zf_ptr = context.make_array(zf_t)(context, builder, value=zf).data
        o_ptr = context.make_array(out_t)(context, builder, value=out).data
        sc_is_f32 = sc_t.dtype == types.float32
        wvec_t = ir.VectorType(_I8, 16)
        fvec_t = ir.VectorType(_F32, nvals)
        ivec_t = ir.VectorType(_I32, nvals)
        iota = ir.Constant(fvec_t, [float(i) for i in range(nvals)])
        perm = cgutils.get_or_insert_function(builder.module, ir.FunctionType(fvec_t, [fvec_t, ivec_t]),
                                              "llvm.x86.avx512.permvar.sf.512")
        with cgutils.for_range(builder, nchunk) as loop:
            i = loop.index
            wp = builder.gep(w_ptr, [builder.add(woff, builder.mul(i, ir.Constant(_I64, 16)))])
            lo_i, hi_i = _int4_indices(builder, builder.load(builder.bitcast(wp, wvec_t.as_pointer()), align=1),
                                       ivec_t)
            b = builder.ashr(i, cshift)
            s = _splat(builder, _load_scale(builder, sc_ptr, builder.add(soff, b), sc_is_f32, skind), nvals)
            z = _splat(builder, builder.load(builder.gep(zf_ptr, [builder.add(zoff, b)])), nvals)
            tbl = _fast(builder.fmul(_fast(builder.fsub(iota, z)), s))
            base = builder.add(ooff, builder.mul(i, ir.Constant(_I64, 2 * nvals)))
            for idx, off in ((lo_i, 0), (hi_i, nvals)):
                p = builder.gep(o_ptr, [builder.add(base, ir.Constant(_I64, off))])
                builder.store(builder.call(perm, [tbl, idx]), builder.bitcast(p, fvec_t.as_pointer()), align=4)
        return context.get_dummy_value()

    def dqrow(typingctx, w, woff, nchunk, cshift, sc, soff, skind, zf, zoff, out, ooff):
        ints = (woff, nchunk, cshift, soff, skind, zoff, ooff)
        if not all(isinstance(t, types.Integer) for t in ints):
            return None
        sig = types.none(w, types.int64, types.int64, types.int64, sc, types.int64, types.int64,
                         zf, types.int64, out, types.int64)
        return sig, codegen

    dqrow.__name__ = "dqrow_int4_16_lut"
    return intrinsic(dqrow)


dqrow_int4_16_lut = _make_dqrow_lut()
