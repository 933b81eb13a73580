"""CPU mirror of the dec5 kernels' unit schedule (kernels/gpu/source/decode5.cu, ``dec5_impl``).

A line-by-line Python transliteration of the restructured producer (``p_setup`` / ``p_next`` / ``issue_unit`` /
``issue``), consumer (``c_setup`` / the segment counters at the end of ``consume``) and main loop (prologue, steady
loop, tail loop) of one warp, checked against a plain enumeration of the units in (tile, row tile, k-tile) order:

* every unit is issued exactly once and consumed exactly once, in order, from the ring stage it was copied into,
  after its cp.async group is complete (``cp.async.wait_group DEC5_STAGES - 2``) and before the stage is reused;
* the producer's per-lane source offsets (weights, scales, zero points, activation rows) equal the formulas of the
  kernel before the restructuring (main's ``p_setup`` / ``issue``: the ``main_*`` functions below);
* flushes [ka, kb) exactly at row-tile ends and at the range end, with the consumer's (tile, row tile);
* split K: per (tile, row tile) the warps' segments add to KT and exactly one warp completes it (runs the epilogue);
* FC2 (MODE 1) before its PDL wait (``QM_PDL_WAIT``): the prologue issues the first units' weights, scales and zero
  points (not committed), reading only decode_prep's tables (L2-coherent loads) and the weights; after the wait it
  moves the producer back to the range start and issues each of those units' activation fragments (FC1's output)
  with one commit group per unit. Every weight and activation copy a consumer reads sits in a group it waited for;
  FC1 (MODE 0) waits before anything. ``test_dec5_mirror_catches_faults`` checks that the checks fail for a mirror
  with an activation copy before the wait, a commit before the unit's activations, or no cursor replay;
* the activation slot layout (``dec5_barea`` / ``DEC5_BX`` / ``DEC5_BL``): the producer writes each (slot, t, chunk)
  where the consumer reads it (lanes of columns >= the tile's count read slot 0's fragments, unused), and the chunks
  of distinct (slot, t, chunk) never overlap.
"""

from __future__ import annotations

import random

DEC5_STAGES = 6
DEC5_TCAP = 128  # #define DEC5_TCAP 128 (make_case lowers it at times, to reach the tables' global-memory path)
DEC5_PCAP = 512

# what each kernel may read before its PDL wait: FC2 (MODE 1) decode_prep's tables (only through L2-coherent loads)
# and the weights / scales / zero points; FC1 (MODE 0) nothing
TABLES = {"num_tiles", "tiles", "pair_tok", "cut"}  # (cut: route_split's, before decode_prep)
PRE_WAIT_OK = {1: TABLES | {"W", "S", "Z"}, 0: set()}


# ------------------------------------------------------------------------------------------------ decode5.cu helpers
DEC5_BX, DEC5_BL = 16, 128  # #define DEC5_BX 16u / #define DEC5_BL 128u


def dec5_barea(slot: int, t: int) -> int:
    # return (u32)(slot * 256 + t * 32);
    return slot * 256 + t * 32


def previous_barea(slot: int, t: int) -> int:
    """The layout before the fast loop (lane t's 64 bytes at slot * 256 + t * 64, lo at + 32): for comparison."""
    return (slot * 4 + t) * 64


# ------------------------------------------------------------- the kernel before the restructuring (main's formulas)
def main_sources(c, ti: int, rt: int, kt: int, lane: int) -> dict:
    """Source offsets (bytes from W / S / Z, elements from bhi / blo) of unit (ti, rt, kt) for ``lane``, as main's
    p_setup at the tile start plus its per-unit advances in issue() give them."""
    g, t = lane >> 2, lane & 3
    tl = c["tiles"][ti]
    TB, LB = c["TB"], c["LB"]
    # p_w = W + tl.x * wstride + (p_rt * KT + p_kt) * TR::TB + lane * TR::LB; p_w += TR::TB per unit
    w = tl[0] * c["wstride"] + (rt * c["KT"] + kt) * TB + lane * LB
    # e = tl.x * tstride + p_rt * NB * 16; p_s = S + e * ssz + lane * 16 (+ s_rstep per row tile); b0 * 16 * ssz
    e = tl[0] * c["tstride"] + rt * c["NB"] * 16
    b0 = (kt >> c["tsh"]) if c["NBT"] == 1 else kt * c["NBT"]
    s = e * c["ssz"] + lane * 16 + b0 * 16 * c["ssz"]
    z = e + lane * 16 + b0 * 16
    bon = g < tl[2]
    brow = 0
    if bon:
        tok = c["ptok"][tl[1] + g] if c["MODE"] == 0 else tl[1] + g
        brow = tok * c["KPB"] + t * 16
    # bh = p_bh + p_kt * 64; bl = p_bl + p_kt * 64
    return {"w": w, "s": s, "z": z, "bon": bon, "bh": brow + kt * 64}


# ---------------------------------------------------------------------------------- mirror of one warp of dec5_impl
def run_warp(c, wid: int, lane: int, fault: str | None = None):
    """Returns (issued, consumed, flushes, groups, (u0, u1), reads) of warp ``wid`` (blockIdx.x * nw + warp), or None
    if it has no units. issued: (unit (ti, rt, kt), stage offset, sources) in the order of the units' weight copies;
    consumed: ((ti, rt, kt), stage offset, activation reads, tile); flushes: (ti, rt, ka, kb); reads: (buffer, load
    kind, after the PDL wait) of the warp's global reads. ``fault`` (tests of the checks only): "act_before_wait"
    (FC2's prologue copies whole units before the wait), "commit_before_act" (after the wait, the commit before the
    unit's activations), "no_replay" (the producer cursor not moved back to the range start after the wait)."""
    NT, KT = c["NT"], c["KT"]
    NBT, tsh, ssz, NB, ZP, MODE = c["NBT"], c["tsh"], c["ssz"], c["NB"], c["ZP"], c["MODE"]
    TB, LB = c["TB"], c["LB"]
    TCAP = c.get("TCAP", DEC5_TCAP)
    g, t = lane >> 2, lane & 3
    tiles, ptok = c["tiles"], c["ptok"]
    BX, BL = DEC5_BX, DEC5_BL
    reads = []
    pdl = {"waited": False}

    def read(buf, how="ld"):  # a global load (or the source of a cp.async) of the warp
        reads.append((buf, how, pdl["waited"]))

    def pdl_wait():  # QM_PDL_WAIT(); QM_PDL_LAUNCH();
        assert not pdl["waited"]
        pdl["waited"] = True

    early_fc2 = MODE == 1 and c.get("pdl", 1) == 1  # constexpr bool early_fc2 = MODE == 1 && EARLY; (EARLY: pdl)
    if not early_fc2:  # if (!early_fc2) { QM_PDL_WAIT(); QM_PDL_LAUNCH(); }
        pdl_wait()
    cg = "cg" if MODE == 1 else "ld"  # MODE == 1 ? __ldcg(..) : ..
    read("num_tiles", cg)  # const int ntl = MODE == 1 ? __ldcg(num_tiles) : *num_tiles;
    ntl = c["ntl"]
    if ntl > 0:  # stile[i] = MODE == 1 ? __ldcg(tiles + i) : tiles[i] (i < min(ntl, DEC5_TCAP)), sptok likewise
        read("tiles", cg)
    if len(ptok) > 0:
        read("pair_tok", cg)

    def tile_at(i):  # i < DEC5_TCAP ? stile[i] : (MODE == 1 ? __ldcg(tiles + i) : __ldg(tiles + i))
        assert 0 <= i < c["ntl"], "a tile beyond num_tiles"
        if i >= TCAP:
            read("tiles", "cg" if MODE == 1 else "nc")
        return tiles[i]

    def ptok_at(p):  # p < DEC5_PCAP ? sptok[p] : __ldg(pair_tok + p)
        if p >= DEC5_PCAP:
            read("pair_tok", "nc")
        return ptok[p]

    # cut_rows = *cut (0 without a split pair); last_ti = MODE == 1 && cut_rows > 0 ? ntl - 1 : -1;
    # kt_last = cut_rows >> 6
    cut_rows = c.get("cut_rows", 0) if ntl > 0 else 0
    if cut_rows:
        read("cut", "cg")
    last_ti = ntl - 1 if MODE == 1 and cut_rows > 0 else -1
    kt_last = cut_rows >> 6
    # per_tile = NT * KT; total = per_tile * ntl (less the split pair's units); nwt = gridDim.x * nw;
    # chunk = ceil(total / nwt)
    per_tile = NT * KT
    total = per_tile * ntl
    if cut_rows > 0:
        total -= (NT - cut_rows // (8 if c["gated"] else 16)) * KT if MODE == 0 else NT * (KT - kt_last)
    nwt = c["grid"] * c["nw"]
    chunk = (total + nwt - 1) // nwt
    u0 = wid * chunk
    if u0 >= total:  # if (u0 >= total) return;
        return None
    u1 = min(total, u0 + chunk)
    STAGE = c["STAGE"]
    SOFF = TB
    ZOFF = SOFF + NBT * 64
    BOFF = ZOFF + (NBT * 16 if ZP else 0)
    tstride = NT * NB * 16

    st = {}  # the lambdas' captured state
    # ti = last_ti >= 0 && u0 >= per_tile * last_ti ? last_ti : u0 / per_tile; rem = u0 - ti * per_tile;
    # kts = ti == last_ti ? kt_last : KT; p_rt = rem / kts; p_kt = rem - p_rt * kts
    ti = last_ti if last_ti >= 0 and u0 >= per_tile * last_ti else u0 // per_tile
    rem = u0 - ti * per_tile
    kts = kt_last if ti == last_ti else KT
    st["p_ti"], st["p_rt"] = ti, rem // kts
    st["p_kt"] = rem - st["p_rt"] * kts
    st["p_KT"] = kt_last if st["p_ti"] == last_ti else KT  # int p_KT = ..
    st["c_ti"], st["c_rt"] = st["p_ti"], st["p_rt"]  # int c_ti = p_ti, c_rt = p_rt;
    c_kt0 = st["p_kt"]  # const int c_kt0 = p_kt;
    nu = u1 - u0  # const int nu = (int)(u1 - u0);
    st["p_run"] = 0  # int p_run = 0;
    s_on = lane < NBT * ssz  # const bool s_on = lane < NBT * ssz
    z_on = bool(ZP) and lane < NBT  # z_on = ZP && lane < NBT
    s_rstep, z_rstep = NB * 16 * ssz, NB * 16
    s16 = 16 * ssz

    def p_setup():  # auto p_setup = [&]() {  // at (p_ti, p_rt), k-tile 0
        tl = tile_at(st["p_ti"])
        st["p_KT"] = kt_last if st["p_ti"] == last_ti else KT  # p_KT = p_ti == last_ti ? kt_last : KT;
        st["p_w"] = tl[0] * c["wstride"] + st["p_rt"] * KT * TB + lane * LB
        e = tl[0] * tstride + st["p_rt"] * NB * 16
        st["p_s"] = e * ssz + lane * 16
        st["p_z"] = e + lane * 16
        st["p_bon"] = g < tl[2]
        brow = 0
        if st["p_bon"]:
            tok = ptok_at(tl[1] + g) if MODE == 0 else tl[1] + g
            brow = tok * c["KPB"] + t * 16
            st["p_barea"] = dec5_barea(tok if MODE == 0 else g, t)
        st["p_bh"] = brow
        st["p_bl"] = brow

    st["p_barea"] = 0
    p_setup()  # p_setup();

    def p_next(rem):  # auto p_next = [&](int rem) {
        if st["p_kt"] == st["p_KT"]:  # if (p_kt == p_KT) {
            st["p_kt"] = 0
            st["p_w"] += KT * TB  # p_w += (long long)KT * TR::TB;
            st["p_s"] += s_rstep
            st["p_z"] += z_rstep
            st["p_rt"] += 1
            if st["p_rt"] == NT:  # if (++p_rt == NT) {
                st["p_rt"] = 0
                st["p_ti"] += 1
                p_setup()
        assert rem > 0 and st["p_kt"] < st["p_KT"]
        st["p_run"] = min(st["p_KT"] - st["p_kt"], rem)  # p_run = min(p_KT - p_kt, rem);

    issued, consumed, flushes, groups = [], [], [], []
    by_unit = {}  # unit -> its entry of issued (the activation part of FC2's prologue completes it)
    # stage offset -> {"unit": the unit being copied into / held by the stage, "w" / "a": the commit group of its
    # weight (+ scale + zero-point) / activation copies, None while not committed}
    ring = {}
    state = {"ngroups": 0, "open": []}

    def copy_into(d, unit, kind):  # a cp.async of one part of ``unit`` into stage d (open until the next commit)
        if d in ring:
            assert ring[d]["unit"] == unit, "a ring stage overwritten before it was consumed"
            assert kind not in ring[d], "a part of a unit copied twice"
        else:
            ring[d] = {"unit": unit}
        ring[d][kind] = None
        state["open"].append((d, kind))

    def issue_unit(d, PT):  # auto issue_unit = [&](u32 d, auto PART) {  (PT: 0 all, 1 weights, 2 activations)
        kt = st["p_kt"]
        unit = (st["p_ti"], st["p_rt"], kt)
        if PT != 2:  # if (PT != 2) {
            src = {"w": st["p_w"] + kt * TB}  # cp_async16(d + lane * LB + q * 16, p_w + kt * TB + q * 16, 16)
            b0 = (kt >> tsh) if NBT == 1 else kt * NBT  # const u32 b0 = (NBT == 1) ? (kt >> tsh) : kt * NBT;
            src["s"] = st["p_s"] + b0 * s16 if s_on else None  # if (s_on) cp_async16(.., p_s + b0 * s16, 16);
            src["z"] = st["p_z"] + b0 * 16 if z_on else None  # if (z_on) cp_async16(.., p_z + b0 * 16u, 16);
            read("W")
            read("S")
            if ZP:
                read("Z")
            copy_into(d, unit, "w")
            assert unit not in by_unit
            by_unit[unit] = src
            issued.append((unit, d, src))
        if PT != 1:  # if (PT != 1 && p_bon) {  (lanes 0-3 always have p_bon: the warp reads the rows)
            src = by_unit.get(unit)
            assert src is not None and "bon" not in src, "activations of a unit whose weights were not issued"
            src["bon"] = st["p_bon"]
            if st["p_bon"]:
                # da = d + BOFF + p_barea; bh = p_bh + kt * 64u
                src["bh"] = st["p_bh"] + kt * 64
                src["bl"] = st["p_bl"] + kt * 64
                src["da"] = BOFF + st["p_barea"]
                src["db"] = src["da"] + BX  # db = da + DEC5_BX
                src["dla"], src["dlb"] = src["da"] + BL, src["db"] + BL
            read("bhi")  # FC2: FC1's output rows; FC1: decode_prep's x
            copy_into(d, unit, "a")
        st["p_kt"] += 1  # ++p_kt;

    def commit():  # cp_async_commit();
        gi = state["ngroups"]
        for d, kind in state["open"]:
            ring[d][kind] = gi
        state["open"] = []
        state["ngroups"] += 1
        groups.append(gi)

    def c_setup():  # auto c_setup = [&]() {
        tl = tile_at(st["c_ti"])
        st["c_KT"] = kt_last if st["c_ti"] == last_ti else KT  # c_KT = c_ti == last_ti ? kt_last : KT;
        st["c_slot"], st["c_start"], st["c_cnt"] = tl
        st["c_bon"] = g < st["c_cnt"]
        st["c_barea"] = dec5_barea(ptok_at(st["c_start"] + g) if MODE == 0 else g, t) if st["c_bon"] else 0

    c_setup()
    st["c_ka"] = c_kt0  # int c_ka = c_kt0;
    st["c_kb"] = st["c_ka"] + min(st["c_KT"] - st["c_ka"], nu)  # int c_kb = c_ka + min(c_KT - c_ka, nu);
    st["c_run"] = st["c_kb"] - st["c_ka"]  # int c_run = c_kb - c_ka;
    st["c_done"] = 0  # (test only: units of the segment consumed, for the k-tile of the next consume)

    def wait_group():  # cp_async_wait<DEC5_STAGES - 2>(): all but the newest DEC5_STAGES - 2 groups complete
        state["complete"] = state["ngroups"] - (DEC5_STAGES - 2)

    state["complete"] = 0

    def consume(so):  # auto consume = [&](u32 so, auto SD) {  (the per-unit part: no cursor logic left in it)
        kt = st["c_ka"] + st["c_done"]  # the k-tile this consume computes (test bookkeeping)
        st["c_done"] += 1
        unit = (st["c_ti"], st["c_rt"], kt)
        assert so in ring, "consumed an empty stage"
        held = ring.pop(so)
        assert held["unit"] == unit, (held, unit)
        for kind in ("w", "a"):  # every weight and activation byte read comes from a group the consumer waited for
            assert kind in held, f"consumed a unit whose {kind} copies were never issued"
            assert held[kind] is not None, f"consumed a unit whose {kind} copies are not committed"
            assert held[kind] < state["complete"], f"consumed a stage whose {kind} cp.async group may be pending"
        assert pdl["waited"], "consumed before the PDL wait"
        # ba = p + BOFF + c_barea: h0 at ba, h1 at ba + DEC5_BX, l0 at ba + DEC5_BL, l1 at ba + DEC5_BX + DEC5_BL
        ba = BOFF + st["c_barea"]
        bread = (ba, ba + BX, ba + BL, ba + BX + BL) if g < st["c_cnt"] else None
        consumed.append((unit, so, bread, (st["c_slot"], st["c_start"], st["c_cnt"])))

    def c_next(n):  # auto c_next = [&](int n) {
        flushes.append((st["c_ti"], st["c_rt"], st["c_ka"], st["c_kb"]))  # flush(c_ka, c_kb);
        read("pair_w" if MODE == 1 else "part")  # FC2: __ldg(pair_w + p), atomicAdd(out ..); FC1: the scratch
        assert st["c_done"] == st["c_kb"] - st["c_ka"]
        st["c_done"] = 0
        if n > 0:  # if (n > 0) {
            st["c_ka"] = 0
            st["c_rt"] += 1
            if st["c_rt"] == NT:  # if (++c_rt == NT) {
                st["c_rt"] = 0
                st["c_ti"] += 1
                c_setup()
            st["c_kb"] = min(st["c_KT"], n)  # c_kb = min(c_KT, n);
            st["c_run"] = st["c_kb"]  # c_run = c_kb;

    RLAST = (DEC5_STAGES - 1) * STAGE  # const u32 RLAST = (u32)((DEC5_STAGES - 1) * STAGE);
    if early_fc2:  # if (early_fc2) {
        for s in range(DEC5_STAGES - 1):  # for (int s = 0; s < DEC5_STAGES - 1; ++s) {
            if s < nu:  # if (s < nu) {
                if st["p_run"] == 0:  # if (p_run == 0) p_next(nu - s);
                    p_next(nu - s)
                issue_unit(s * STAGE, 0 if fault == "act_before_wait" else 1)  # issue_unit(.., Dec5I<1>());
                st["p_run"] -= 1  # --p_run;
        pdl_wait()  # QM_PDL_WAIT(); QM_PDL_LAUNCH();
        if fault not in ("no_replay", "act_before_wait"):  # (act_before_wait: main's prologue, wait moved down)
            # p_ti = c_ti; p_rt = c_rt; p_kt = c_kt0; p_run = 0; p_setup();
            st["p_ti"], st["p_rt"], st["p_kt"], st["p_run"] = st["c_ti"], st["c_rt"], c_kt0, 0
            p_setup()
        for s in range(DEC5_STAGES - 1):  # for (int s = 0; s < DEC5_STAGES - 1; ++s) {
            if fault == "commit_before_act":
                commit()
            if s < nu and fault != "act_before_wait":  # if (s < nu) {
                if st["p_run"] == 0:  # if (p_run == 0) p_next(nu - s);
                    p_next(nu - s)
                issue_unit(s * STAGE, 2)  # issue_unit(ringa + (u32)(s * STAGE), Dec5I<2>());
                st["p_run"] -= 1  # --p_run;
            if fault != "commit_before_act":
                commit()  # cp_async_commit();
    else:
        for s in range(DEC5_STAGES - 1):  # for (int s = 0; s < DEC5_STAGES - 1; ++s) {
            if s < nu:  # if (s < nu) {
                if st["p_run"] == 0:  # if (p_run == 0) p_next(nu - s);
                    p_next(nu - s)
                issue_unit(s * STAGE, 0)  # issue_unit(ringa + (u32)(s * STAGE), Dec5I<0>());
                st["p_run"] -= 1  # --p_run;
            commit()  # cp_async_commit();
    p_off = [RLAST]  # u32 p_off = RLAST;

    def steady(cnt):  # auto steady = [&](int cnt, auto SD) {
        ke = st["p_kt"] + cnt
        while st["p_kt"] < ke:  # for (const int ke = p_kt + cnt; p_kt < ke;) {
            wait_group()  # cp_async_wait<DEC5_STAGES - 2>(); dec5_syncwarp();
            c_off = 0 if p_off[0] == RLAST else p_off[0] + STAGE  # const u32 c_off = (p_off == RLAST) ? 0u : ..
            issue_unit(p_off[0], 0)  # issue_unit(ringa + p_off, Dec5I<0>());
            commit()  # cp_async_commit();
            consume(c_off)  # consume(c_off, SD);
            p_off[0] = c_off  # p_off = c_off;

    def drain(cnt):  # auto drain = [&](int cnt, auto SD) {
        for _ in range(cnt):  # for (int k = cnt; k > 0; --k) {
            wait_group()  # cp_async_wait<DEC5_STAGES - 2>(); dec5_syncwarp();
            c_off = 0 if p_off[0] == RLAST else p_off[0] + STAGE
            commit()  # cp_async_commit();
            consume(c_off)  # consume(c_off, SD);
            p_off[0] = c_off  # p_off = c_off;

    n = nu
    while n > 0:  # for (int n = nu; n > 0;) {
        pr = n - (DEC5_STAGES - 1)  # const int pr = n - (DEC5_STAGES - 1);
        cnt = st["c_run"]  # int cnt = c_run;
        assert cnt > 0
        if pr > 0:  # if (pr > 0) {
            if st["p_run"] == 0:  # if (p_run == 0) p_next(pr);
                p_next(pr)
            cnt = min(cnt, st["p_run"])  # cnt = min(cnt, p_run);
            st["p_run"] -= cnt  # p_run -= cnt;
            assert st["p_run"] <= pr - cnt
            steady(cnt)  # steady(cnt, Dec5I<..>());
        else:
            assert st["p_run"] == 0
            drain(cnt)  # drain(cnt, Dec5I<..>());
        n -= cnt  # n -= cnt;
        st["c_run"] -= cnt  # c_run -= cnt;
        if st["c_run"] == 0:  # if (c_run == 0) c_next(n);
            c_next(n)
    assert not ring and not state["open"]
    return issued, consumed, flushes, groups, (u0, u1), reads


# --------------------------------------------------------------------------------------------------- random cases
def make_case(rng: random.Random) -> dict:
    bits = rng.choice([4, 8])
    NBT = rng.choice([1, 2, 4])
    tsh = rng.choice([0, 1, 2, 30]) if NBT == 1 else 0
    KT = rng.choice([1, 2, 3, 5, 7, 9, 12])
    NT = rng.choice([1, 2, 3, 4, 6])
    ntl = rng.randint(1, 5)
    MODE = rng.choice([0, 1])
    ssz = rng.choice([2, 4])
    ZP = rng.choice([0, 1])
    if NBT == 1:
        NB = 1 if tsh == 30 else -(-KT // (1 << tsh))
    else:
        NB = KT * NBT - rng.choice([0, 1]) if KT * NBT > 1 else 1
    npairs = rng.randint(ntl, 3 * ntl + 8)
    T = rng.randint(1, 16)
    ptok = [rng.randrange(T) for _ in range(npairs)]
    tiles = []
    for _ in range(ntl):
        cnt = rng.randint(1, 8)
        start = rng.randrange(max(1, npairs - cnt + 1))
        tiles.append((rng.randrange(8), start, min(cnt, npairs - start)))
    bcols = (T if MODE == 0 else 8)
    TB, LB = (512, 16) if bits == 4 else (1024, 32)
    BOFF = TB + NBT * 64 + (NBT * 16 if ZP else 0)
    total = NT * KT * ntl
    mode = rng.random()
    if mode < 0.3:  # tiny ranges (1-3 units per warp)
        per = rng.randint(1, 3)
        nwt = -(-total // per)
    elif mode < 0.5:  # one warp (long range over all tiles)
        nwt = 1
    else:
        nwt = rng.randint(1, max(1, total))
    nw = rng.choice([1, 2, 4])
    grid = max(1, -(-nwt // nw))
    # a split pair's tile last (route_split's cut): FC1 its first row tiles, FC2 its first k-tiles of each row tile
    gated = rng.choice([0, 1])
    cut_rows = 0
    if rng.random() < 0.4:
        if MODE == 0 and NT > 1:
            cut_rows = rng.randint(1, NT - 1) * (8 if gated else 16)
        elif MODE == 1 and KT > 1:
            cut_rows = rng.randint(1, KT - 1) * 64
    return {"cut_rows": cut_rows, "gated": gated, "NT": NT, "KT": KT, "ntl": ntl, "NBT": NBT, "tsh": tsh, "ssz": ssz, "NB": NB, "ZP": ZP, "MODE": MODE,
            "TB": TB, "LB": LB, "tiles": tiles, "ptok": ptok, "KPB": KT * 64 + rng.choice([0, 64]),
            "wstride": NT * KT * TB + rng.choice([0, 512]), "tstride": NT * NB * 16, "grid": grid, "nw": nw,
            "STAGE": BOFF + bcols * 256, "bcols": bcols, "pdl": rng.choice([0, 1, 1]),
            "TCAP": DEC5_TCAP if rng.random() < 0.7 else rng.randint(1, 3)}  # tables beyond the cache: global loads


def check_reads(c, reads) -> None:
    """Before its PDL wait a warp reads only what PRE_WAIT_OK allows its kernel, decode_prep's tables only through
    L2-coherent loads; it waits before its first activation copy and before its flushes."""
    early_fc2 = c["MODE"] == 1 and c["pdl"] == 1  # FC2 launched with PDL reads tables and weights first
    assert any(not after for _, _, after in reads) == early_fc2
    for buf, how, after in reads:
        if not after:
            assert buf in PRE_WAIT_OK[c["MODE"]], f"{buf} read before the PDL wait (mode {c['MODE']})"
            if buf in TABLES:
                assert how == "cg", f"{buf} read before the PDL wait through L1 ({how})"
    assert any(buf == "bhi" and after for buf, _, after in reads)


def case_units(c) -> list:
    """Every unit (tile, row tile, k-tile) of a launch in memory order: the split pair's tile (the last, where
    c["cut_rows"] > 0) FC1's first row tiles only, FC2's first k-tiles of each row tile only."""
    NT, KT, ntl, cut_rows = c["NT"], c["KT"], c["ntl"], c.get("cut_rows", 0)
    units = []
    for ti in range(ntl):
        rows, kts = NT, KT
        if cut_rows and ti == ntl - 1:
            if c["MODE"] == 0:
                rows = cut_rows // (8 if c["gated"] else 16)
            else:
                kts = cut_rows >> 6
        units += [(ti, rt, kt) for rt in range(rows) for kt in range(kts)]
    return units


def check_case(c, rng: random.Random) -> None:
    units = case_units(c)
    kdone: dict = {}
    completers: dict = {}
    covered = []
    order = list(range(c["grid"] * c["nw"]))
    rng.shuffle(order)  # warps finish in any order: the split-K protocol must not care
    for wid in order:
        lane = rng.randrange(32)
        r = run_warp(c, wid, lane)
        if r is None:
            continue
        issued, consumed, flushes, groups, (u0, u1), reads = r
        check_reads(c, reads)
        ref = units[u0:u1]
        covered.extend(range(u0, u1))
        # issued / consumed exactly once each, in order
        assert [i[0] for i in issued] == ref
        assert [x[0] for x in consumed] == ref
        assert len(groups) == (DEC5_STAGES - 1) + len(ref)  # main: DEC5_STAGES - 1 + nu commit groups
        # stages: unit j of the range sits in stage j % DEC5_STAGES (main: issue(st - 1), consume(st))
        for j, (unit, d, src) in enumerate(issued):
            assert d == (j % DEC5_STAGES) * c["STAGE"]
            m = main_sources(c, *unit, lane)
            assert src["w"] == m["w"], (unit, src, m)
            if src["s"] is not None:
                assert src["s"] == m["s"], (unit, src, m)
            if src["z"] is not None:
                assert src["z"] == m["z"], (unit, src, m)
            assert src["bon"] == m["bon"]
            if src["bon"]:
                assert src["bh"] == m["bh"] and src["bl"] == m["bh"]
        for j, (unit, so, bread, tl) in enumerate(consumed):
            assert so == (j % DEC5_STAGES) * c["STAGE"]
            assert tl == c["tiles"][unit[0]]
            src = issued[j][2]
            assert (bread is not None) == src["bon"]
            if bread is not None:  # the consumer reads h0, h1, l0, l1 where the producer wrote them
                assert bread == (src["da"], src["db"], src["dla"], src["dlb"])
        # flushes exactly at the row-tile ends and the range end, with [ka, kb) of the segment
        segs = []
        for u, (ti, rt, kt) in zip(range(u0, u1), ref):
            if segs and tuple(segs[-1][:2]) == (ti, rt):
                segs[-1][3] = kt + 1
            else:
                segs.append([ti, rt, kt, kt + 1])
        assert [tuple(s) for s in segs] == flushes
        for ti, rt, ka, kb in flushes:
            kts = max(kt for u, r, kt in units if (u, r) == (ti, rt)) + 1  # KT, or the split pair's FC2 k-tiles
            assert 0 <= ka < kb <= kts
            if ka == 0 and kb == kts:
                completers[(ti, rt)] = completers.get((ti, rt), 0) + 1
                assert (ti, rt) not in kdone
                continue
            old = kdone.get((ti, rt), 0)  # atom_add_release_gpu(kdone + cidx, kb - ka)
            kdone[(ti, rt)] = old + (kb - ka)
            if old + (kb - ka) == kts:  # the warp that completes K runs the epilogue
                completers[(ti, rt)] = completers.get((ti, rt), 0) + 1
    assert sorted(covered) == list(range(len(units)))
    for ti, rt in sorted({(ti, rt) for ti, rt, _ in units}):
        kts = max(kt for u, r, kt in units if (u, r) == (ti, rt)) + 1
        assert completers.get((ti, rt), 0) == 1, (ti, rt)
        assert kdone.get((ti, rt), kts) == kts


def test_dec5_schedule_mirror_random():
    rng = random.Random(20261201)
    n = 0
    for _ in range(2200):
        c = make_case(rng)
        check_case(c, rng)
        n += 1
    assert n >= 2000


def test_dec5_mirror_catches_faults():
    """The checks above fail for FC2 prologues with an activation copy before the PDL wait, a commit group closed
    before its unit's activation copies, or no move of the producer cursor back to the range start after the wait;
    and they pass for the same cases without the fault."""
    rng = random.Random(7)
    cases = 0
    while cases < 60:
        c = make_case(rng)
        if c["MODE"] != 1 or not c["pdl"]:  # the split prologue: FC2 launched with PDL
            continue
        per_tile = c["NT"] * c["KT"]
        total = per_tile * c["ntl"]
        chunk = -(-total // (c["grid"] * c["nw"]))
        lane = rng.randrange(32)
        wid = 0  # warp 0 always has units
        assert chunk >= 1
        r = run_warp(c, wid, lane)
        check_reads(c, r[5])
        for fault in ("act_before_wait", "commit_before_act", "no_replay"):
            try:
                r = run_warp(c, wid, lane, fault)
                check_reads(c, r[5])
            except AssertionError:
                continue
            raise AssertionError(f"fault {fault} not caught: {c}")
        cases += 1


def _wavefronts(addrs: list[int]) -> int:
    """Shared-memory wavefronts of one 16-byte-per-lane load: per 4-byte bank, the number of distinct 16-byte
    chunks that touch it (a lower bound that the hardware meets for LDS.128)."""
    banks: dict = {}
    for a in set(addrs):
        for w in range(4):
            banks.setdefault((a // 4 + w) % 32, set()).add(a)
    return max(len(v) for v in banks.values())


def test_dec5_activation_layout_bijective():
    """Every (slot, t, chunk) of a stage's activation area has its own 16 bytes inside the slot's 256; one slot's h0 /
    h1 chunks (4 lanes) are read in one wavefront (the previous layout: two), and 8 slots in 8 (previous: 16; 4 is
    the minimum for 512 bytes)."""
    seen = set()
    for slot in range(64):
        for t in range(4):
            a = dec5_barea(slot, t)
            for o in (a, a + DEC5_BX, a + DEC5_BL, a + DEC5_BX + DEC5_BL):
                assert o % 16 == 0 and slot * 256 <= o < slot * 256 + 256
                assert o not in seen
                seen.add(o)
    assert len(seen) == 64 * 4 * 4
    for barea, one, eight in ((previous_barea, 2, 16), (dec5_barea, 1, 8)):
        for slot in range(8):
            assert _wavefronts([barea(slot, t) for t in range(4)]) == one
            assert _wavefronts([barea(slot, t) + DEC5_BX for t in range(4)]) == one
        assert _wavefronts([barea(s_, t) for s_ in range(8) for t in range(4)]) == eight
