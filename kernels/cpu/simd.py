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

``load_scale(sc, idx, skind)``: one scale as float32 (float32 array or fp16/bf16 bits in uint16; for a
uint8 array of fp8 scale codes, the code itself: callers decode it through a table).

The table kernels (``_make_qrow_tbl`` / ``_make_dqrow_tbl``) serve int4, fp4 (MXFP4 / NVFP4 E2M1 codes) and
int2 rows: per 16 packed bytes the codes index a 16-entry float table (vpermps) that already holds
(code value) * block scale.
"""
from __future__ import annotations

from types import SimpleNamespace

import llvmlite.ir as ir
from numba import njit, types
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
    """Horizontal sum of a <n x float> vector by halving shuffles, in exactly this order: without fast-math flags, so
    that LLVM cannot reassociate it differently in different kernels (on a Xeon that LLVM tunes for as Rocket Lake it
    did, and the two-row kernel's dots differed from the one-row kernel's in the last bits). The row kernels' sums of
    their accumulators before it are strict for the same reason."""
    while n > 1:
        h = n // 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h), list(range(h))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h), list(range(h, n))))
        v = builder.fadd(lo, hi)
        n = h
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _load_scale(builder, sc_ptr, idx, sc_is_f32, skind):
    p = builder.gep(sc_ptr, [idx])
    if sc_is_f32:
        return builder.load(p)
    raw = builder.load(p)  # i16 (fp16 / bf16 bits), or i8: an fp8 scale code, returned as its value 0..255
    if raw.type == _I8:  # (the table kernels decode it through their scale table)
        return builder.uitofp(raw, _F32)
    as_half = builder.fpext(builder.bitcast(raw, ir.HalfType()), _F32)
    as_bf16 = builder.bitcast(builder.shl(builder.zext(raw, _I32), ir.Constant(_I32, 16)), _F32)
    is_bf = builder.icmp_signed("==", skind, ir.Constant(skind.type, 2))
    return builder.select(is_bf, as_bf16, as_half)


#: Blocks of one row whose 16-bit scales the row kernels convert up front (a stack buffer of this many floats);
#: kernels/cpu/qmoe.py keeps the scales of projections with more blocks per row in float32.
MAX_ROW_BLOCKS = 1024


def _row_scales_f32(builder, sc_ptr, soff, skind, nblk):
    """Scales soff .. soff + nblk - 1 (fp16 or bf16 bits, skind 1 / 2) as float32 in a stack buffer of
    MAX_ROW_BLOCKS, eight at a time (one vcvtph2ps, or a widen and shift for bf16), the rest one by one. Converted
    one per chunk instead, with the fp16 / bf16 choice made each time, a one-expert int4 decode call with fp16 scales
    took 1.4-1.6x its time with float32 ones on the dev VM; converted once per row, the same time."""
    buf = cgutils.alloca_once(builder, _F32, size=ir.Constant(_I64, MAX_ROW_BLOCKS))
    i16x8, i32x8, f32x8 = ir.VectorType(_I16, 8), ir.VectorType(_I32, 8), ir.VectorType(_F32, 8)
    is_bf = builder.icmp_signed("==", skind, ir.Constant(skind.type, 2))
    groups = builder.ashr(nblk, ir.Constant(_I64, 3))
    with cgutils.for_range(builder, groups) as loop:
        b0 = builder.shl(loop.index, ir.Constant(_I64, 3))
        raw = builder.load(builder.bitcast(builder.gep(sc_ptr, [builder.add(soff, b0)]), i16x8.as_pointer()), align=1)
        as_half = builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), 8)), f32x8)
        as_bf16 = builder.bitcast(builder.shl(builder.zext(raw, i32x8), ir.Constant(i32x8, [16] * 8)), f32x8)
        builder.store(builder.select(is_bf, as_bf16, as_half),
                      builder.bitcast(builder.gep(buf, [b0]), f32x8.as_pointer()), align=4)
    start = builder.shl(groups, ir.Constant(_I64, 3))
    with cgutils.for_range(builder, builder.sub(nblk, start)) as loop:
        b = builder.add(start, loop.index)
        builder.store(_load_scale(builder, sc_ptr, builder.add(soff, b), False, skind), builder.gep(buf, [b]))
    return buf


def _block_scales(builder, sc_ptr, sc_t, soff, skind, nblk):
    """A row's block scales as float32, b -> block b's (the row's first at soff): 16-bit ones (fp16 / bf16 bits)
    converted up front for its nblk blocks (_row_scales_f32), float32 ones read where they are. Emit before the
    row's chunk loop."""
    if sc_t.dtype == types.uint16:
        buf = _row_scales_f32(builder, sc_ptr, soff, skind, nblk)
        return lambda b: builder.load(builder.gep(buf, [b]))
    is_f32 = sc_t.dtype == types.float32
    return lambda b: _load_scale(builder, sc_ptr, builder.add(soff, b), is_f32, skind)


def _row_blocks(builder, nchunk, cshift):
    """Blocks that chunks 0 .. nchunk - 1 fall in when chunk i is in block i >> cshift (0 for no chunk)."""
    one = ir.Constant(_I64, 1)
    return builder.add(builder.ashr(builder.sub(nchunk, one), cshift), one)


def _qrow_intrinsic(codegen, name: str):
    """A GEMV row kernel's intrinsic (every layout shares the signature): (w, woff, nchunk, cshift, sc, soff,
    skind, zf, zoff, xa, xb, xoff, xs, xsoff) -> float32, the integer arguments int64."""
    def qrow(typingctx, w, woff, nchunk, cshift, sc, soff, skind, zf, zoff, xa, xb, xoff, xs, xsoff):
        ints = (woff, nchunk, cshift, soff, skind, zoff, xoff, xsoff)
        if not all(isinstance(t, types.Integer) for t in ints):
            return None
        sig = types.float32(w, types.int64, types.int64, types.int64, sc, types.int64, types.int64,
                            zf, types.int64, xa, xb, types.int64, xs, types.int64)
        return sig, codegen

    qrow.__name__ = name
    return intrinsic(qrow)


def _dqrow_intrinsic(codegen, name: str):
    """A row dequantiser's intrinsic (every layout shares the signature): (w, woff, nchunk, cshift, sc, soff,
    skind, zf, zoff, out, ooff) -> None, the integer arguments int64."""
    def dqrow(typingctx, w, woff, nchunk, cshift, sc, soff, skind, zf, zoff, out, ooff):
        ints = (woff, nchunk, cshift, soff, skind, zoff, ooff)
        if not all(isinstance(t, types.Integer) for t in ints):
            return None
        sig = types.none(w, types.int64, types.int64, types.int64, sc, types.int64, types.int64,
                         zf, types.int64, out, types.int64)
        return sig, codegen

    dqrow.__name__ = name
    return intrinsic(dqrow)


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

        block_scale = _block_scales(builder, sc_ptr, sc_t, soff, skind, _row_blocks(builder, nchunk, cshift))

        def one_chunk(i, acc_slot, corr):
            wp = builder.gep(w_ptr, [builder.add(woff, builder.mul(i, ir.Constant(_I64, chunk)))])
            wv = builder.load(builder.bitcast(wp, wvec_t.as_pointer()), align=1)
            wi = builder.zext(wv, ivec_t)
            b = builder.ashr(i, cshift)
            s = block_scale(b)
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

    return _qrow_intrinsic(codegen, f"qrow_int{bits}_{chunk}")


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
        wvec_t = ir.VectorType(_I8, chunk)
        fvec_t = ir.VectorType(_F32, nvals)
        ivec_t = ir.VectorType(_I32, nvals)
        per_chunk = nvals * (2 if bits == 4 else 1)
        block_scale = _block_scales(builder, sc_ptr, sc_t, soff, skind, _row_blocks(builder, nchunk, cshift))
        with cgutils.for_range(builder, nchunk) as loop:
            i = loop.index
            wp = builder.gep(w_ptr, [builder.add(woff, builder.mul(i, ir.Constant(_I64, chunk)))])
            wi = builder.zext(builder.load(builder.bitcast(wp, wvec_t.as_pointer()), align=1), ivec_t)
            b = builder.ashr(i, cshift)
            s = _splat(builder, block_scale(b), nvals)
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

    return _dqrow_intrinsic(codegen, f"dqrow_int{bits}_{chunk}")


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
MK_NR = 6  # W rows of a register tile


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


# ----------------------------------------------------------------------------- batched GEMM / GEMV helpers

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
def atomic_load(typingctx, arr, idx):
    """arr[idx] read atomically with acquire order (int64 array): a flag another thread publishes with
    atomic_fetch_add; a plain load could be hoisted out of a wait loop."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and isinstance(idx, types.Integer)):
        return None
    sig = types.int64(arr, types.int64)

    def codegen(context, builder, signature, args):
        a, i = args
        ptr = builder.gep(context.make_array(signature.args[0])(context, builder, value=a).data, [i])
        return builder.load_atomic(ptr, "acquire", 8)

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


# ----------------------------------------------------------------------------- table kernels (int4 / fp4 / int2)
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

if HAS_AVX512F:  # the table kernels' inline assembly (scale pairs) needs the native assembly parser
    import llvmlite.binding as _llvm

    _llvm.initialize_native_asmparser()
#: per-expert record of the "table" code mode (fp4): 16 code values, then 256 block-scale values
TBL_RECORD = 16 + 256


def _int4_indices(builder, wv, ivec_t, dshift=True):
    """16 packed bytes -> (low-nibble, high-nibble) lane indices as <16 x i32>. Only the low 4 bits of each
    index are meaningful (vpermps ignores the rest). With AVX-512F the high nibbles are the zero-extended
    bytes shifted right by 4 as dwords (one shuffle-port uop less per chunk: 8-10% in a cache-resident
    micro-benchmark on Zen 5); otherwise a 16-bit shift, whose spill-over from the neighbouring byte lands
    in bits 4..7, and a second zero-extend."""
    lo = builder.zext(wv, ivec_t)
    if HAS_AVX512F and dshift:
        return lo, builder.lshr(lo, ir.Constant(ivec_t, [4] * 16))
    w16 = builder.bitcast(wv, ir.VectorType(_I16, 8))
    sh = builder.lshr(w16, ir.Constant(ir.VectorType(_I16, 8), [4] * 8))
    hi = builder.zext(builder.bitcast(sh, ir.VectorType(_I8, 16)), ivec_t)
    return lo, hi


def _int2_indices(builder, wv, ivec_t):
    """16 packed bytes -> 4 lane-index vectors: byte >> 0, 2, 4, 6. Low 2 bits = code slot s of each byte;
    bits 2..3 hold the next code, which the replicated table (entry j depends on j & 3 only) ignores."""
    b = builder.zext(wv, ivec_t)
    return [b] + [builder.lshr(b, ir.Constant(ivec_t, [2 * s] * 16)) for s in (1, 2, 3)]


def _lookup(builder, tbl, idx):
    """tbl[idx & 15] per lane (<16 x float>, <16 x i32>): one vpermps with AVX-512F; otherwise lane by lane."""
    fvec_t = ir.VectorType(_F32, 16)
    if HAS_AVX512F:
        perm = cgutils.get_or_insert_function(builder.module, ir.FunctionType(fvec_t, [fvec_t, ir.VectorType(_I32, 16)]),
                                              "llvm.x86.avx512.permvar.sf.512")
        return builder.call(perm, [tbl, idx])
    idx = builder.and_(idx, ir.Constant(ir.VectorType(_I32, 16), [15] * 16))
    out = ir.Constant(fvec_t, ir.Undefined)
    for lane in range(16):
        j = builder.extract_element(idx, ir.Constant(_I32, lane))
        out = builder.insert_element(out, builder.extract_element(tbl, j), ir.Constant(_I32, lane))
    return out


_LOW8 = ir.Constant(ir.VectorType(ir.IntType(1), 16), [1] * 8 + [0] * 8)


def _lookup2(builder, ta, tb, idx):
    """Lanes 0..7 from table ta, lanes 8..15 from tb (a 16-byte chunk over two 8-byte blocks)."""
    return builder.select(_LOW8, _lookup(builder, ta, idx), _lookup(builder, tb, idx))


_QUAD = ir.Constant(ir.VectorType(_I32, 16), [lane >> 2 for lane in range(16)])


def _quad_lanes(builder, v4):
    """<4 x float> (one value per 4-byte block of a 16-byte chunk) -> <16 x float>: value b in lanes 4b..4b+3."""
    return builder.shuffle_vector(v4, ir.Constant(v4.type, ir.Undefined), _QUAD)


def _load_scales4(builder, sc_ptr, idx, sc_is_f32, skind):
    """Scales idx..idx+3 as <4 x float>: one vector load (float32, or fp16 / bf16 bits converted as in
    _load_scale; a uint8 array gives the codes' values, as _load_scale does)."""
    f4 = ir.VectorType(_F32, 4)
    p = builder.gep(sc_ptr, [idx])
    if sc_is_f32:
        return builder.load(builder.bitcast(p, f4.as_pointer()), align=4)
    raw_t = ir.VectorType(p.type.pointee, 4)
    raw = builder.load(builder.bitcast(p, raw_t.as_pointer()), align=1)
    if p.type.pointee == _I8:
        return builder.uitofp(raw, f4)
    as_half = builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), 4)), f4)
    as_bf16 = builder.bitcast(builder.shl(builder.zext(raw, ir.VectorType(_I32, 4)), ir.Constant(ir.VectorType(_I32, 4),
                                                                                                [16] * 4)), f4)
    is_bf = builder.icmp_signed("==", skind, ir.Constant(skind.type, 2))
    return builder.select(is_bf, as_bf16, as_half)


def _row_pointers(context, builder, sig, args):
    """Data pointers of a row intrinsic's weight, scale and zero-point arrays (its arguments 0, 4 and 7)."""
    return tuple(context.make_array(sig.args[i])(context, builder, value=args[i]).data for i in (0, 4, 7))


def _table_parts(context, builder, sig, args, code, slots, bpc, dshift=True, spair="perm"):
    """Shared prologue of the table kernels (see _make_qrow_tbl): chunk -> its lookups, chunk -> the per-lane
    block scales / zero points of the multi-block chunks, and (fp8 scale pairs) 4 chunks -> their scale codes.
    With 16-bit scales and one or two blocks a chunk (bpc 1 / 2), the row's scales are converted here, once."""
    (w, woff, nchunk, cshift, sc, soff, skind, zf, zoff) = args[:9]
    sc_t = sig.args[4]
    w_ptr, sc_ptr, zf_ptr = _row_pointers(context, builder, sig, args)
    fvec_t = ir.VectorType(_F32, 16)
    sc_u8 = sc_t.dtype == types.uint8
    block_scale = None  # bpc 1: chunk i in block i >> cshift; bpc 2: chunk i over blocks 2i, 2i + 1
    if not sc_u8 and bpc in (1, 2):
        nblk = _row_blocks(builder, nchunk, cshift) if bpc == 1 else builder.shl(nchunk, ir.Constant(_I64, 1))
        block_scale = _block_scales(builder, sc_ptr, sc_t, soff, skind, nblk)
    iota = ir.Constant(fvec_t, [float(j if slots == 2 else j & 3) for j in range(16)])
    if code == "zrow":
        base0 = _fast(builder.fsub(iota, _splat(builder, builder.load(builder.gep(zf_ptr, [zoff])), 16)))
    elif code == "table":
        base0 = builder.load(builder.bitcast(builder.gep(zf_ptr, [zoff]), fvec_t.as_pointer()), align=4)
    else:  # zblk: the zero points are applied per block
        base0 = iota

    def scale(b):
        if sc_u8:  # fp8 code -> the record's 256-entry scale table (global scale folded in)
            c = builder.zext(builder.load(builder.gep(sc_ptr, [builder.add(soff, b)])), _I64)
            return builder.load(builder.gep(zf_ptr, [builder.add(builder.add(zoff, ir.Constant(_I64, 16)), c)]))
        if block_scale is not None:
            return block_scale(b)
        return _load_scale(builder, sc_ptr, builder.add(soff, b), sc_t.dtype == types.float32, skind)

    def table(b):
        if code == "zblk":
            base = _fast(builder.fsub(iota, _splat(builder, builder.load(builder.gep(zf_ptr, [builder.add(zoff, b)])), 16)))
        else:
            base = base0
        return _fast(builder.fmul(base, _splat(builder, scale(b), 16)))

    def chunk_values(i, bpc):
        """Lookups of chunk i: `slots` vectors of 16 floats (slot s = code s of each of the 16 bytes); bpc 0:
        unscaled (the row's base table; lane_scales gives the blocks' scales); bpc 4: four 4-byte blocks (lanes
        4b..4b+3 from block 4i + b), scaled per lane."""
        wp = builder.gep(w_ptr, [builder.add(woff, builder.mul(i, ir.Constant(_I64, 16)))])
        wv = builder.load(builder.bitcast(wp, ir.VectorType(_I8, 16).as_pointer()), align=1)
        ivec_t = ir.VectorType(_I32, 16)
        idxs = _int4_indices(builder, wv, ivec_t, dshift) if slots == 2 else _int2_indices(builder, wv, ivec_t)
        if bpc == 0:
            return [_lookup(builder, base0, ix) for ix in idxs]
        if bpc == 4:
            vals = [_lookup(builder, base0, ix) for ix in idxs]
            if code == "zblk":
                z = lane_zeros(i)
                vals = [_fast(builder.fsub(v, z)) for v in vals]
            s = lane_scales(i, 4)
            return [_fast(builder.fmul(v, s)) for v in vals]
        if bpc == 1:
            t = table(builder.ashr(i, cshift))
            return [_lookup(builder, t, ix) for ix in idxs]
        b0 = builder.shl(i, ir.Constant(_I64, 1))
        ta, tb = table(b0), table(builder.add(b0, ir.Constant(_I64, 1)))
        return [_lookup2(builder, ta, tb, ix) for ix in idxs]

    def lane_zeros(i):
        """<16 x float>: the zero points of blocks 4i..4i+3 (bpc 4), each in its 4 lanes."""
        p = builder.gep(zf_ptr, [builder.add(zoff, builder.shl(i, ir.Constant(_I64, 2)))])
        return _quad_lanes(builder, builder.load(builder.bitcast(p, ir.VectorType(_F32, 4).as_pointer()), align=4))

    def pair_codes4(i0):
        """The fp8 scale codes of chunks i0..i0+3 by one 64-bit load (chunk i0 + c: bits 16c..16c+15), or None
        where lane_scales does not read codes in pairs."""
        if not (sc_u8 and HAS_AVX512F and spair == "asm"):
            return None
        cp = builder.gep(sc_ptr, [builder.add(soff, builder.shl(i0, ir.Constant(_I64, 1)))])
        return builder.load(builder.bitcast(cp, _I64.as_pointer()), align=1)

    def lane_scales(i, bpc, cw=None):
        """<16 x float>: each lane's block scale. bpc 2: block 2i in lanes 0..7, 2i + 1 in lanes 8..15 (cw: the
        pair's codes in bits 0..15, from pair_codes4); bpc 4: blocks 4i..4i+3 by one vector load of the four scales,
        each in its 4 lanes."""
        if bpc == 4:
            b0 = builder.shl(i, ir.Constant(_I64, 2))
            return _quad_lanes(builder, _load_scales4(builder, sc_ptr, builder.add(soff, b0),
                                                      sc_t.dtype == types.float32, skind))
        b0 = builder.shl(i, ir.Constant(_I64, 1))
        if sc_u8 and HAS_AVX512F and spair == "asm":
            # both codes by one 16-bit load; the two table entries broadcast straight from memory, the second
            # merged into lanes 8..15 under a mask (load-port broadcasts + one blend: no shuffle-port uop; LLVM
            # would turn a select of two splats into scalar loads + vpermt2ps)
            if cw is None:
                cp = builder.bitcast(builder.gep(sc_ptr, [builder.add(soff, b0)]), _I16.as_pointer())
                cw = builder.zext(builder.load(cp, align=1), _I64)
            tp = builder.gep(zf_ptr, [builder.add(zoff, ir.Constant(_I64, 16))])
            pa = builder.gep(tp, [builder.and_(cw, ir.Constant(_I64, 255))])
            pb = builder.gep(tp, [builder.and_(builder.lshr(cw, ir.Constant(_I64, 8)), ir.Constant(_I64, 255))])
            fty = ir.FunctionType(fvec_t, [_I16, pa.type, pb.type])
            return builder.asm(fty, "vbroadcastss ($2), $0\n\tvbroadcastss ($3), $0 {$1}", "=&v,^Yk,r,r",
                               [ir.Constant(_I16, 0xFF00), pa, pb], False)
        return builder.select(_LOW8, _splat(builder, scale(b0), 16),
                              _splat(builder, scale(builder.add(b0, ir.Constant(_I64, 1))), 16))

    return chunk_values, lane_scales, lane_zeros, pair_codes4


#: Bytes ahead of the chunk being read that the table kernels prefetch, one prefetch per loop iteration. On the
#: H200 machine's Xeon this steady stream (instead of whole rows prefetched a few rows ahead, in bursts of up to
#: 23 cache lines) made the int4 decode kernel 1.42x faster at shape A (0.66 against 0.94 ms, 16 threads, cold
#: experts) and 1.05-1.14x at shape B (NOTES-cpu-kernels.md, "Prefetch in the row loop").
ROW_PREFETCH_AHEAD = 4096
#: llvm.prefetch's locality for those prefetches: 3 = into every cache level (prefetcht0). 0 (prefetchnta, so that the
#: rows, read once a token, would not replace the host's working set) made the engine's CPU kernel slower on the
#: H200 machine's Xeon: 531-546 against 428 µs a layer at 0% resident (RESULTS.md, nineteenth session).
ROW_PREFETCH_LOCALITY = 3


def _row_prefetcher(context, builder, sig, args, woffs):
    """chunk i -> prefetch the weight bytes ROW_PREFETCH_AHEAD past chunk i of each row starting at an offset in
    woffs (a prefetch never faults, past the array's end too); sig / args: a one-row intrinsic's."""
    i8p = _I8.as_pointer()
    w_bytes = builder.bitcast(_row_pointers(context, builder, sig, args)[0], i8p)
    pf = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
                                        "llvm.prefetch.p0i8")

    def prefetch_ahead(i):
        for woff in woffs:
            off = builder.add(builder.add(woff, builder.shl(i, ir.Constant(_I64, 4))),
                              ir.Constant(_I64, ROW_PREFETCH_AHEAD))
            builder.call(pf, [builder.gep(w_bytes, [off]), ir.Constant(_I32, 0),
                              ir.Constant(_I32, ROW_PREFETCH_LOCALITY), ir.Constant(_I32, 1)])

    return prefetch_ahead


def _make_qrow_tbl(slots: int, code: str, bpc: int, dshift=True, spair="asm", unroll4=True):
    """Dot product of one quantised row with one activation row through a 16-entry table (vpermps).

    Same contract as qrow_int4_16 (w, woff, nchunk, cshift, sc, soff, skind, zf, zoff, xa, xb, xoff, xs, xsoff),
    per chunk of 16 packed bytes: slots 2 (int4 / fp4 nibbles: xa = even k, xb = odd k) or 4 (int2: code s of
    each byte; the four slot streams in xa, slot s at xa[xoff + s * xsoff + ...]; xb unused). xs is not used.
    code: 'zrow' table (q - zf[zoff]) * scale; 'zblk' (q - zf[zoff + b]) * scale; 'table' zf[zoff : zoff + 16]
    * scale (fp4: the E2M1 values), and uint8 scales are codes into zf[zoff + 16 : zoff + 272] (a TBL_RECORD).
    bpc: blocks per chunk, 1 (block b = i >> cshift), 2 (8-byte blocks 2i, 2i + 1: two tables, lanes 0..7
    from the first) or 4 (int2 block 16: 4-byte blocks 4i + b in lanes 4b..4b+3; with zblk a fifth stream at
    xa[xoff + 4 * xsoff + ...] holds each byte's sum of its 4 activations, the zero point is applied as
    - z * that). Per chunk: one table multiply (two when bpc = 2), `slots` permutes and FMAs; the multi-block
    forms of one per-row table look up unscaled values and apply the lanes' scales once, after the slot sums.
    Each loop iteration prefetches the weight bytes ROW_PREFETCH_AHEAD ahead (the callers prefetch only the scales:
    kernels._prefetch_row).
    """
    scale_after = bpc == 4 or bpc == 2 and code != "zblk"

    def codegen(context, builder, sig, args):
        chunk_values, lane_scales, lane_zeros, pair_codes4 = _table_parts(context, builder, sig, args, code, slots,
                                                                          bpc, dshift, spair)
        nchunk, xa, xb, xoff, xsoff = args[2], args[9], args[10], args[11], args[13]
        xa_ptr = context.make_array(sig.args[9])(context, builder, value=xa).data
        xb_ptr = context.make_array(sig.args[10])(context, builder, value=xb).data
        fvec_t = ir.VectorType(_F32, 16)
        zero_v = ir.Constant(fvec_t, [0.0] * 16)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(fvec_t, [fvec_t] * 3), "llvm.fma.v16f32")
        accs = [cgutils.alloca_once_value(builder, zero_v) for _ in range(2 * slots)]
        prefetch_ahead = _row_prefetcher(context, builder, sig, args, (args[1],))

        def xload(i, s):
            o = builder.add(xoff, builder.mul(i, ir.Constant(_I64, 16)))
            if slots == 2:
                ptr = builder.gep(xa_ptr if s == 0 else xb_ptr, [o])
            else:
                ptr = builder.gep(xa_ptr, [builder.add(o, builder.mul(ir.Constant(_I64, s), xsoff))])
            return builder.load(builder.bitcast(ptr, fvec_t.as_pointer()), align=4)

        def one_chunk(i, acc_set, cw=None):
            if scale_after:
                # one per-row base table: unscaled lookups, sum over the slots, then one FMA with the lanes' block
                # scales (two blocks: 6 vector ops for int4 / fp4 instead of 10 with two scaled tables)
                vals = chunk_values(i, 0)
                t = _fast(builder.fmul(vals[0], xload(i, 0)))
                for s in range(1, slots):
                    t = builder.call(fma, [vals[s], xload(i, s), t])
                if code == "zblk":  # sum_s (q_s - z) x_s = sum_s q_s x_s - z * (the lane's sum of its x)
                    t = _fast(builder.fsub(t, _fast(builder.fmul(lane_zeros(i), xload(i, slots)))))
                builder.store(builder.call(fma, [lane_scales(i, bpc, cw), t, builder.load(acc_set[0])]), acc_set[0])
                return
            for s, v in enumerate(chunk_values(i, bpc)):
                builder.store(builder.call(fma, [v, xload(i, s), builder.load(acc_set[s])]), acc_set[s])

        if scale_after and unroll4:
            # scale-after form: one accumulator per chunk of a group of 4 (the FMA into the accumulator is the
            # only loop-carried dependency: 4 chains instead of 2)
            quad = builder.ashr(nchunk, ir.Constant(_I64, 2))
            with cgutils.for_range(builder, quad) as loop:
                i0 = builder.shl(loop.index, ir.Constant(_I64, 2))
                prefetch_ahead(i0)
                q = pair_codes4(i0) if bpc == 2 else None  # the 4 chunks' scale codes by one load
                for c in range(4):
                    cw = None if q is None else builder.lshr(q, ir.Constant(_I64, 16 * c))
                    one_chunk(builder.add(i0, ir.Constant(_I64, c)), accs[c:], cw)
            start = builder.shl(quad, ir.Constant(_I64, 2))
            with cgutils.for_range(builder, builder.sub(nchunk, start)) as loop:
                one_chunk(builder.add(start, loop.index), accs)
        else:
            half = builder.ashr(nchunk, ir.Constant(_I64, 1))
            with cgutils.for_range(builder, half) as loop:
                i0 = builder.shl(loop.index, ir.Constant(_I64, 1))
                prefetch_ahead(i0)  # (twice per cache line: the second finds the line in flight; as measured)
                one_chunk(i0, accs[:slots])
                one_chunk(builder.add(i0, ir.Constant(_I64, 1)), accs[slots:])
            odd = builder.icmp_signed("!=", builder.and_(nchunk, ir.Constant(_I64, 1)), ir.Constant(_I64, 0))
            with builder.if_then(odd):
                one_chunk(builder.sub(nchunk, ir.Constant(_I64, 1)), accs[:slots])
        vals = [builder.load(a) for a in accs]
        while len(vals) > 1:
            vals = [builder.fadd(vals[j], vals[j + 1]) for j in range(0, len(vals), 2)]
        return _hsum(builder, vals[0], 16)

    return _qrow_intrinsic(codegen, f"qrow_tbl{slots}_{code}_{bpc}")


def _row_args(values, row: int):
    """One row's arguments of a two-row intrinsic (w, woff, woff2, nchunk, cshift, sc, soff, soff2, skind, zf, zf2,
    zoff, xa, xb, xoff, xs, xsoff), in the one-row intrinsics' order (w, woff, nchunk, cshift, sc, soff, skind, zf,
    zoff, xa, xb, xoff, xs, xsoff); `values` are the arguments or their types."""
    v = values
    return (v[0], v[1 + row], v[3], v[4], v[5], v[6 + row], v[8], v[9 + row], *v[11:])


def _make_qrow2_int4(code: str):
    """Dot products of two int4 rows (16-byte chunks, one block a chunk) with one activation row: what two calls of
    _make_qrow_tbl(2, code, 1)'s kernel return, bit for bit (each row's accumulators and their sums in the same
    order), with the activation loads and the loop shared. Arguments: (w, woff, woff2, nchunk, cshift, sc, soff,
    soff2, skind, zf, zf2, zoff, xa, xb, xoff, xs, xsoff), each row its own weight, scale and zero-point offsets /
    arrays; returns (row 1's dot, row 2's dot)."""
    def codegen(context, builder, sig, args):
        row_sig = [SimpleNamespace(args=_row_args(sig.args, r)) for r in (0, 1)]  # what _table_parts reads of sig
        row_args = [_row_args(args, r) for r in (0, 1)]
        chunk_values = [_table_parts(context, builder, row_sig[r], row_args[r], code, 2, 1)[0] for r in (0, 1)]
        nchunk, xa, xb, xoff = args[3], args[12], args[13], args[14]
        xa_ptr = context.make_array(sig.args[12])(context, builder, value=xa).data
        xb_ptr = context.make_array(sig.args[13])(context, builder, value=xb).data
        fvec_t = ir.VectorType(_F32, 16)
        zero_v = ir.Constant(fvec_t, [0.0] * 16)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(fvec_t, [fvec_t] * 3), "llvm.fma.v16f32")
        accs = [[cgutils.alloca_once_value(builder, zero_v) for _ in range(4)] for _ in (0, 1)]
        prefetch_ahead = _row_prefetcher(context, builder, row_sig[0], row_args[0], (args[1], args[2]))

        def xload(i, s):
            ptr = builder.gep(xa_ptr if s == 0 else xb_ptr, [builder.add(xoff, builder.mul(i, ir.Constant(_I64, 16)))])
            return builder.load(builder.bitcast(ptr, fvec_t.as_pointer()), align=4)

        def one_chunk(i, first):
            xs = [xload(i, 0), xload(i, 1)]
            for r in (0, 1):
                for s, v in enumerate(chunk_values[r](i, 1)):
                    acc = accs[r][first + s]
                    builder.store(builder.call(fma, [v, xs[s], builder.load(acc)]), acc)

        half = builder.ashr(nchunk, ir.Constant(_I64, 1))
        with cgutils.for_range(builder, half) as loop:
            i0 = builder.shl(loop.index, ir.Constant(_I64, 1))
            prefetch_ahead(i0)
            one_chunk(i0, 0)
            one_chunk(builder.add(i0, ir.Constant(_I64, 1)), 2)
        odd = builder.icmp_signed("!=", builder.and_(nchunk, ir.Constant(_I64, 1)), ir.Constant(_I64, 0))
        with builder.if_then(odd):
            one_chunk(builder.sub(nchunk, ir.Constant(_I64, 1)), 0)
        dots = []
        for r in (0, 1):
            vals = [builder.load(a) for a in accs[r]]
            while len(vals) > 1:
                vals = [builder.fadd(vals[j], vals[j + 1]) for j in range(0, len(vals), 2)]
            dots.append(_hsum(builder, vals[0], 16))
        return context.make_tuple(builder, sig.return_type, dots)

    def qrow2(typingctx, w, woff, woff2, nchunk, cshift, sc, soff, soff2, skind, zf, zf2, zoff, xa, xb, xoff, xs,
              xsoff):
        ints = (woff, woff2, nchunk, cshift, soff, soff2, skind, zoff, xoff, xsoff)
        if not all(isinstance(t, types.Integer) for t in ints) or zf != zf2:
            return None
        i64 = types.int64
        sig = types.UniTuple(types.float32, 2)(w, i64, i64, i64, i64, sc, i64, i64, i64, zf, zf2, i64, xa, xb, i64,
                                               xs, i64)
        return sig, codegen

    qrow2.__name__ = f"qrow2_int4_16_lut_{code}"
    return intrinsic(qrow2)


def _qrow2_by_rows(qrow):
    """A two-row intrinsic's contract (see _make_qrow2_int4) by two calls of the one-row kernel `qrow`."""
    @njit(inline="always", error_model="numpy")
    def qrow2(w, woff, woff2, nchunk, cshift, sc, soff, soff2, skind, zf, zf2, zoff, xa, xb, xoff, xs, xsoff):
        return (qrow(w, woff, nchunk, cshift, sc, soff, skind, zf, zoff, xa, xb, xoff, xs, xsoff),
                qrow(w, woff2, nchunk, cshift, sc, soff2, skind, zf2, zoff, xa, xb, xoff, xs, xsoff))

    return qrow2


def _make_dqrow_tbl(slots: int, code: str, bpc: int):
    """Dequantise chunks of one row through the table (see _make_qrow_tbl for slots / code / bpc); same contract
    as dqrow_int4_16: chunk i -> out[ooff + i*16*slots ...], its slot-0 values first, then slot 1, ..."""
    def codegen(context, builder, sig, args):
        chunk_values = _table_parts(context, builder, sig, args, code, slots, bpc)[0]
        nchunk, out, ooff = args[2], args[9], args[10]
        o_ptr = context.make_array(sig.args[9])(context, builder, value=out).data
        fvec_t = ir.VectorType(_F32, 16)
        with cgutils.for_range(builder, nchunk) as loop:
            i = loop.index
            base = builder.add(ooff, builder.mul(i, ir.Constant(_I64, 16 * slots)))
            for s, v in enumerate(chunk_values(i, bpc)):
                p = builder.gep(o_ptr, [builder.add(base, ir.Constant(_I64, 16 * s))])
                builder.store(v, builder.bitcast(p, fvec_t.as_pointer()), align=4)
        return context.get_dummy_value()

    return _dqrow_intrinsic(codegen, f"dqrow_tbl{slots}_{code}_{bpc}")


# int4 (zero points per row / per block): without AVX-512F the convert-based kernels (folded zero point)
qrow_int4_16_lut_zrow = _make_qrow_tbl(2, "zrow", 1) if HAS_AVX512F else qrow_int4_16
qrow_int4_16_lut_zblk = _make_qrow_tbl(2, "zblk", 1) if HAS_AVX512F else qrow_int4_16
dqrow_int4_16_lut = _make_dqrow_tbl(2, "zblk", 1) if HAS_AVX512F else dqrow_int4_16
# two int4 rows with one activation row (FC1's gate and up rows, FC2's rows in pairs); without AVX-512F, two calls
# of the one-row kernel
qrow2_int4_16_lut_zrow = _make_qrow2_int4("zrow") if HAS_AVX512F else _qrow2_by_rows(qrow_int4_16)
qrow2_int4_16_lut_zblk = _make_qrow2_int4("zblk") if HAS_AVX512F else _qrow2_by_rows(qrow_int4_16)
# fp4 (E2M1 codes through the record's code table; uint8 block scales through its scale table):
# MXFP4 block 32 = one 16-byte chunk per block, NVFP4 block 16 = two blocks per chunk
qrow_fp4_1 = _make_qrow_tbl(2, "table", 1)
qrow_fp4_2 = _make_qrow_tbl(2, "table", 2)
dqrow_fp4_1 = _make_dqrow_tbl(2, "table", 1)
dqrow_fp4_2 = _make_dqrow_tbl(2, "table", 2)
# int2 (4 codes per byte): zero point per row / per block, one, two or four (block 16) blocks per chunk
qrow_int2_zrow_1 = _make_qrow_tbl(4, "zrow", 1)
qrow_int2_zrow_2 = _make_qrow_tbl(4, "zrow", 2)
qrow_int2_zrow_4 = _make_qrow_tbl(4, "zrow", 4)
qrow_int2_zblk_1 = _make_qrow_tbl(4, "zblk", 1)
qrow_int2_zblk_2 = _make_qrow_tbl(4, "zblk", 2)
qrow_int2_zblk_4 = _make_qrow_tbl(4, "zblk", 4)
dqrow_int2_1 = _make_dqrow_tbl(4, "zblk", 1)
dqrow_int2_2 = _make_dqrow_tbl(4, "zblk", 2)
dqrow_int2_4 = _make_dqrow_tbl(4, "zblk", 4)


# ----------------------------------------------------------------------------- int3 (bit stream, 8 codes per 3 bytes)
# A chunk is 24 packed bytes = 8 groups of 3 bytes = 64 codes. One byte permute (vpermb with AVX512-VBMI) puts
# group g's 24 bits into dword lanes g and 8 + g; code c of the group is then bits 3c.. of lane g (c < 4) or of
# lane 8 + g shifted by 12 (c >= 4): slot s = 0..3 is one variable shift (vpsrlvd) by 3s (lanes 0..7) / 12 + 3s
# (lanes 8..15) and a lookup in a 16-entry table replicated over j & 7 (bits 3.. of the index are ignored).
# Per chunk: 1 load, 1 byte permute, 4 shifts, 4 vpermps, 4 FMAs + the scale FMA: about int4's work per code.
# Lane l of slot s holds code k = 64 i + 8 (l & 7) + 4 (l >> 3) + s of chunk i (see kernels.int3_position).
INT3_CHUNK = 24
_INT3_SHIFTS = [[3 * s] * 8 + [12 + 3 * s] * 8 for s in range(4)]
_INT3_BYTES = [3 * (l & 7) + min(b, 2) for l in range(16) for b in range(4)]  # byte 3 of a lane: don't care
_LOW4OF8 = ir.Constant(ir.VectorType(ir.IntType(1), 16), [1 if (l & 7) < 4 else 0 for l in range(16)])


def _int3_parts(context, builder, sig, args, zblk: bool, bpc: int):
    """Prologue of the int3 kernels: chunk -> 4 unscaled slot vectors, chunk -> lane scales / zero points."""
    (w, woff, nchunk, cshift, sc, soff, skind, zf, zoff) = args[:9]
    sc_t = sig.args[4]
    w_ptr, sc_ptr, zf_ptr = _row_pointers(context, builder, sig, args)
    fvec_t = ir.VectorType(_F32, 16)
    ivec_t = ir.VectorType(_I32, 16)
    iota = ir.Constant(fvec_t, [float(j & 7) for j in range(16)])
    if zblk:
        base = iota
    else:  # one zero point per row, folded into the table
        base = _fast(builder.fsub(iota, _splat(builder, builder.load(builder.gep(zf_ptr, [zoff])), 16)))

    def slots(i):
        wp = builder.gep(w_ptr, [builder.add(woff, builder.mul(i, ir.Constant(_I64, INT3_CHUNK)))])
        # a 24-byte load (LLVM: 16 + 8 bytes and an insert). Tried: one masked 32-byte load (vmovdqu8 {k}{z}, no
        # fault past the array's end): as fast from L1, 3.5x slower streaming from DRAM on Zen 5
        wv = builder.load(builder.bitcast(wp, ir.VectorType(_I8, INT3_CHUNK).as_pointer()), align=1)
        wb = builder.shuffle_vector(wv, ir.Constant(wv.type, ir.Undefined),
                                    ir.Constant(ir.VectorType(_I32, 64), _INT3_BYTES))
        d = builder.bitcast(wb, ivec_t)
        return [_lookup(builder, base, builder.lshr(d, ir.Constant(ivec_t, sh))) for sh in _INT3_SHIFTS]

    def lanes(i, getter):
        """<16 x float>: getter(block) of each lane's block (bpc 2: blocks 2i (lanes with l & 7 < 4), 2i + 1)."""
        if bpc == 2:
            b0 = builder.shl(i, ir.Constant(_I64, 1))
            if getter is scale and sc_t.dtype == types.float32 and HAS_AVX512F:
                # the two scales broadcast from memory, the second merged into lanes 4..7, 12..15 under a mask
                # (load-port uops; LLVM would turn the select of two splats into a vpermt2ps)
                pa = builder.gep(sc_ptr, [builder.add(soff, b0)])
                pb = builder.gep(pa, [ir.Constant(_I64, 1)])
                fty = ir.FunctionType(fvec_t, [_I16, pa.type, pb.type])
                return builder.asm(fty, "vbroadcastss ($2), $0\n\tvbroadcastss ($3), $0 {$1}", "=&v,^Yk,r,r",
                                   [ir.Constant(_I16, 0xF0F0), pa, pb], False)
            return builder.select(_LOW4OF8, _splat(builder, getter(b0), 16),
                                  _splat(builder, getter(builder.add(b0, ir.Constant(_I64, 1))), 16))
        return _splat(builder, getter(builder.ashr(i, cshift)), 16)

    def scale(b):
        return _load_scale(builder, sc_ptr, builder.add(soff, b), sc_t.dtype == types.float32, skind)

    def zpoint(b):
        return builder.load(builder.gep(zf_ptr, [builder.add(zoff, b)]))

    return slots, (lambda i: lanes(i, scale)), (lambda i: lanes(i, zpoint))


def _make_qrow_int3(zblk: bool, bpc: int):
    """Dot product of one int3 row with one activation row; same contract as the table kernels (_make_qrow_tbl)
    with 24-byte chunks: the four slot streams in xa (slot s at xa[xoff + s * xsoff + 16 i + lane]), and with
    zblk (per-block zero points zf[zoff + b]) a fifth stream at xa[xoff + 4 * xsoff + ...] holding each lane's
    sum of its 4 activations (the zero point is applied as - z * that). bpc 2: block 32 (two blocks per chunk),
    1: block = i >> cshift (64 << cshift codes; per-row scales with cshift 62). xb, xs unused."""
    def codegen(context, builder, sig, args):
        slots, scales, zpoints = _int3_parts(context, builder, sig, args, zblk, bpc)
        nchunk, xa, xoff, xsoff = args[2], args[9], args[11], args[13]
        xa_ptr = context.make_array(sig.args[9])(context, builder, value=xa).data
        fvec_t = ir.VectorType(_F32, 16)
        zero_v = ir.Constant(fvec_t, [0.0] * 16)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(fvec_t, [fvec_t] * 3), "llvm.fma.v16f32")
        accs = [cgutils.alloca_once_value(builder, zero_v) for _ in range(2)]

        def xload(i, s):
            o = builder.add(builder.add(xoff, builder.mul(i, ir.Constant(_I64, 16))),
                            builder.mul(ir.Constant(_I64, s), xsoff))
            return builder.load(builder.bitcast(builder.gep(xa_ptr, [o]), fvec_t.as_pointer()), align=4)

        def one_chunk(i, acc):
            v = slots(i)
            t = _fast(builder.fmul(v[0], xload(i, 0)))
            for s in range(1, 4):
                t = builder.call(fma, [v[s], xload(i, s), t])
            if zblk:
                t = _fast(builder.fsub(t, _fast(builder.fmul(zpoints(i), xload(i, 4)))))
            builder.store(builder.call(fma, [scales(i), t, builder.load(acc)]), acc)

        half = builder.ashr(nchunk, ir.Constant(_I64, 1))
        with cgutils.for_range(builder, half) as loop:
            i0 = builder.shl(loop.index, ir.Constant(_I64, 1))
            one_chunk(i0, accs[0])
            one_chunk(builder.add(i0, ir.Constant(_I64, 1)), accs[1])
        odd = builder.icmp_signed("!=", builder.and_(nchunk, ir.Constant(_I64, 1)), ir.Constant(_I64, 0))
        with builder.if_then(odd):
            one_chunk(builder.sub(nchunk, ir.Constant(_I64, 1)), accs[0])
        return _hsum(builder, _fast(builder.fadd(builder.load(accs[0]), builder.load(accs[1]))), 16)

    return _qrow_intrinsic(codegen, f"qrow_int3_{'zblk' if zblk else 'zrow'}_{bpc}")


def _make_dqrow_int3(zblk: bool, bpc: int):
    """Dequantise int3 chunks of one row (contract of dqrow_int4_16, 24-byte chunks): chunk i -> out[ooff + 64 i
    + 16 s + lane] (slot s, lane as in the GEMV; kernels.int3_position gives the k of each position)."""
    def codegen(context, builder, sig, args):
        slots, scales, zpoints = _int3_parts(context, builder, sig, args, zblk, bpc)
        nchunk, out, ooff = args[2], args[9], args[10]
        o_ptr = context.make_array(sig.args[9])(context, builder, value=out).data
        fvec_t = ir.VectorType(_F32, 16)
        with cgutils.for_range(builder, nchunk) as loop:
            i = loop.index
            base = builder.add(ooff, builder.mul(i, ir.Constant(_I64, 64)))
            sv = scales(i)
            zv = zpoints(i) if zblk else None
            for s, v in enumerate(slots(i)):
                if zblk:
                    v = _fast(builder.fsub(v, zv))
                p = builder.gep(o_ptr, [builder.add(base, ir.Constant(_I64, 16 * s))])
                builder.store(_fast(builder.fmul(v, sv)), builder.bitcast(p, fvec_t.as_pointer()), align=4)
        return context.get_dummy_value()

    return _dqrow_intrinsic(codegen, f"dqrow_int3_{'zblk' if zblk else 'zrow'}_{bpc}")


qrow_int3_zrow_1 = _make_qrow_int3(False, 1)
qrow_int3_zrow_2 = _make_qrow_int3(False, 2)
qrow_int3_zblk_1 = _make_qrow_int3(True, 1)
qrow_int3_zblk_2 = _make_qrow_int3(True, 2)
dqrow_int3_zrow_1 = _make_dqrow_int3(False, 1)
dqrow_int3_zrow_2 = _make_dqrow_int3(False, 2)
dqrow_int3_zblk_1 = _make_dqrow_int3(True, 1)
dqrow_int3_zblk_2 = _make_dqrow_int3(True, 2)
