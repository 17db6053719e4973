"""Audit the default bf16 forward and backward kernels' compiled code for sm_90a, on the CPU.

For each kernel, with the configs ``plan.make_plan`` picks (132 SMs, EP1, 16384 tokens) and the
weight-gradient launchers' ``default_config``: warps, stages, registers, spills, shared memory and
CTAs per SM, ptxas notes (C7515), TTGIR ``warp_group_dot_wait {pendings}`` and pipelined shared
buffers (stages x tile), and in the SASS: HGMMA shapes, ``WARPGROUP.DEPBAR.LE gsb0, 0xN``, load
widths (LDG / LDGSTS / UTMALDG), store widths (STG), fp32->bf16 packs (F2FP), and the inner K loop
(the innermost backward branch around an HGMMA): its instructions, HGMMAs and loads per iteration.
The loop finder is a heuristic (backward branches); in the megakernel it also reports the ticket
loops around a K loop. Each K loop's common path (one K step, forward branches inside the loop taken)
is counted too: in the weight gradient's persistent loop over (tile, K step) (``expert_wgrad_kernel``)
the loop's LDG (the next tile's expert start/count) and its gsb0 0x0 wait (the store's) lie off that
path, in the new-tile block and the epilogue.

    cd /work/wt-audit && TRITON_INTERPRET=0 PYTHONPATH=. /work/main/.venv/bin/python \
        scripts/sass_audit.py [kimi-k2 qwen3-30b-a3b ...] [--dump DIR] [--only SUBSTR] [--wgrad BM,BN,BK,W,S]

--only: kernels whose name contains SUBSTR; --wgrad: the weight gradients with that config instead of
the launchers' default; --dump: SASS / TTGIR / PTX of each kernel into DIR. Ends with a markdown table.

No GPU needed (Triton's whole pipeline runs when the target is named; tests/sm90.py).
"""
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests")]

from sm90 import Const, compile_args

P, I32, I16 = "*bf16", "i32", "i32:16"
SM_REGS, SM_SMEM, SM_THREADS = 65536, 232448, 2048  # H100/H200 per SM


def _nvbin(tool):
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def ptxas_v(ptx):
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as d:
        src, out = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", src, "-o", out], capture_output=True, check=False,
                           text=True)
    return r.stdout + r.stderr


def sass(cubin: bytes):
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.cubin")
        with open(p, "wb") as f:
            f.write(cubin)
        r = subprocess.run([_nvbin("cuobjdump"), "-sass", p], capture_output=True, text=True, check=False)
    return r.stdout


_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def instructions(s):
    """[(address, text)] of the SASS listing."""
    return [(int(a, 16), t.strip()) for a, t in _INS.findall(s)]


def loops(ins):
    """Backward branches: (start, end) address ranges of loops, innermost first (shortest)."""
    out = []
    for a, t in ins:
        re.search(r"\bBRA\b.*?`?\(?\.L_x_\d+\)?|BRA\s+(0x[0-9a-f]+)", t)
        tgt = re.search(r"BRA(?:\.\w+)*\s+(?:`\()?(?:\.L_x_\d+|0x([0-9a-f]+))", t)
        if tgt and tgt.group(1):
            b = int(tgt.group(1), 16)
            if b <= a:
                out.append((b, a))
    return sorted(set(out), key=lambda r: r[1] - r[0])


def hist(pattern, text):
    return dict(sorted(collections.Counter(re.findall(pattern, text)).items()))


def k_loops(ins):
    """The loops with an HGMMA inside and no inner loop with one: per loop its stats."""
    ls = loops(ins)
    hg = [a for a, t in ins if t.split()[0].startswith("HGMMA") or " HGMMA" in t]
    res = []
    for b, e in ls:
        if not any(b <= a <= e for a in hg):
            continue
        if any(b <= b2 and e2 <= e and (b2, e2) != (b, e) and any(b2 <= a <= e2 for a in hg) for b2, e2 in res):
            continue
        body = [t for a, t in ins if b <= a <= e]
        txt = "\n".join(body)
        res.append((b, e))
        yield {"span": (hex(b), hex(e)), "n": len(body), "hgmma": len(re.findall(r"HGMMA\.", txt)),
                   "ldgsts": hist(r"LDGSTS(\.[\w.]+)", txt), "ldg": hist(r"\bLDG(\.[\w.]+)", txt),
                   "tma": len(re.findall(r"UTMALDG", txt)), "depbar": hist(r"DEPBAR\.LE gsb0, (0x\w+)", txt),
                   "ldgdepbar": len(re.findall(r"LDGDEPBAR", txt)), "bar": len(re.findall(r"\bBAR\.SYNC|\bBAR\b", txt)),
                   "syncs": len(re.findall(r"SYNCS\.", txt))}


def steady_path(ins, span):
    """The instructions of one K step on its common path through a K loop (``span``, from ``k_loops``):
    from the loop's start to its back branch, taking every forward branch that stays in the loop (the
    weight gradient's new-tile block and epilogue are skipped by such branches; a plain K loop has none)."""
    b, e = (int(x, 16) for x in span)
    at = {a: i for i, (a, _) in enumerate(ins)}
    i, path = at[b], []
    while i < len(ins):
        a, t = ins[i]
        path.append(t)
        if a == e:
            break
        m = re.search(r"^(?:@!?U?P\d+ )?BRA (0x[0-9a-f]+)", t)
        if m and a < int(m.group(1), 16) <= e:
            i = at[int(m.group(1), 16)]
            continue
        i += 1
    return [t for t in path if not t.startswith("NOP")]


def analyse(name, k, warps, stages, tiles, dump=None):
    rep = ptxas_v(k.asm["ptx"])
    regs = int(re.search(r"Used (\d+) registers", rep).group(1))
    spill_st = int(re.search(r"(\d+) bytes spill stores", rep).group(1))
    spill_ld = int(re.search(r"(\d+) bytes spill loads", rep).group(1))
    smem = k.metadata.shared
    regs_alloc = -(-regs * 32 // 256) * 256 * warps
    by_regs, by_smem = SM_REGS // regs_alloc, (SM_SMEM // (smem + 1024) if smem else 32)
    ctas = min(by_regs, by_smem, SM_THREADS // (32 * warps))
    ttgir = k.asm["ttgir"]
    waits = hist(r"warp_group_dot_wait[^\n]*pendings = (\d+)", ttgir)
    bufs = hist(r"ttg\.local_alloc[^\n]*?!ttg\.memdesc<([\dx]+)x(?:bf16|f16|i8|f8E4M3FN)", ttgir)
    s = sass(k.asm["cubin"])
    ins = instructions(s)
    c7515 = "C7515" in rep or "serialized" in rep
    print(f"== {name}")
    print(f"   tiles {tiles}; warps {warps}, stages {stages}")
    print(f"   regs {regs}, spill st/ld {spill_st}/{spill_ld} B, smem {smem} B -> CTAs/SM {ctas} "
          f"(regs {by_regs}, smem {by_smem}); C7515 {c7515}")
    print(f"   TTGIR dot_wait pendings {waits}; smem buffers {bufs}; "
          f"async_copy {ttgir.count('async_copy_global_to_local')}, tma_copy {ttgir.count('async_tma_copy_global_to_local')}")
    hg = hist(r"HGMMA\.(\w+)\.F32\.BF16", s)
    dep = hist(r"DEPBAR\.LE gsb0, (0x\w+)", s)
    ldgsts, ldg = hist(r"LDGSTS(\.[\w.]+)", s), hist(r"\bLDG(\.[\w.]+)", s)
    stg, sts = hist(r"\bSTG(\.[\w.]+)", s), hist(r"\bSTS(\.[\w.]*)", s)
    n_tma, n_tmast, n_f2fp = len(re.findall("UTMALDG", s)), len(re.findall("UTMASTG", s)), len(re.findall("F2FP", s))
    print(f"   SASS HGMMA {hg} DEPBAR gsb0 {dep}")
    print(f"   SASS loads LDGSTS {ldgsts} LDG {ldg} UTMALDG {n_tma}")
    print(f"   SASS stores STG {stg} STS {sts} UTMASTG {n_tmast} F2FP {n_f2fp}")
    for L in k_loops(ins):
        print(f"   K loop {L['span']}: {L['n']} instr, HGMMA {L['hgmma']}, LDGSTS {L['ldgsts']}, LDG {L['ldg']}, "
              f"UTMALDG {L['tma']}, DEPBAR {L['depbar']}, LDGDEPBAR {L['ldgdepbar']}, BAR {L['bar']}, "
              f"SYNCS {L['syncs']}")
        sp = steady_path(ins, L["span"])
        txt = "\n".join(sp)
        n_hg, n_ldg = len(re.findall(r"HGMMA\.", txt)), len(re.findall(r"\bLDG\.", txt))
        sts, dep = hist(r"LDGSTS(\.[\w.]+)", txt), hist(r"DEPBAR\.LE gsb0, (0x\w+)", txt)
        print(f"     its common path (forward branches in the loop taken): {len(sp)} instr, HGMMA {n_hg}, "
              f"LDGSTS {sts}, LDG {n_ldg}, DEPBAR gsb0 {dep}")
    for line in rep.splitlines():
        if "warning" in line.lower() or "info    : C" in line:
            print("   ptxas:", line.strip())
    if dump:
        tag = re.sub(r"\W+", "_", name).strip("_")
        for ext, txt in (("sass", s), ("ttgir", ttgir), ("ptx", k.asm["ptx"])):
            with open(os.path.join(dump, f"{tag}.{ext}"), "w") as f:
                f.write(txt)
    ks = list(k_loops(ins))
    loop_ld = ",".join(sorted({f"LDGSTS{w}" for L in ks for w in L["ldgsts"]} | {f"LDG{w}" for L in ks for w in L["ldg"]}
                              | ({"UTMALDG"} if any(L["tma"] for L in ks) else set()))) or "-"
    loop_dep = ",".join(sorted({d for L in ks for d in L["depbar"]})) or "-"
    if not ks and hg:  # K loops of compile-time trip count fully unrolled: the whole kernel's
        loop_ld = "unrolled: " + ",".join(f"LDGSTS{w}" for w in ldgsts)
        loop_dep = "unrolled: " + ",".join(dep)
    ROWS.append((name, tiles.split(";")[0][:34], f"{warps}/{stages}", regs, spill_st, smem // 1024, ctas, loop_ld,
                 "/".join(sorted(waits)) or "-", loop_dep, "C7515" if c7515 else "ok",
                 ",".join(f"STG{w}" for w in stg) or "-"))
    return {"regs": regs, "spill": spill_st, "smem": smem, "ctas": ctas, "c7515": c7515, "waits": waits, "sass": s}


ROWS = []


def print_table():
    head = ("kernel", "tiles", "warps/stages", "regs", "spill B", "smem KB", "CTA/SM", "K-loop loads",
            "dot_wait pend", "K-loop gsb0", "ptxas", "stores")
    print("\n| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in ROWS:
        print("| " + " | ".join(map(str, r)) + " |")


def plan_of(shape, T=16384):
    import torch

    from tabby.functional.config import MoEConfig
    from tabby.functional.plan import make_plan
    from tabby.validate import MoEDims
    from tabby_bench.shapes import SHAPES
    s = SHAPES[shape]
    d = MoEDims(T=T, H=s.H, k=s.k, E_local=s.E, I=s.I, world_size=1, I_shared=s.I_shared)
    return make_plan(d, MoEConfig(megakernel=True), torch.device("cuda"), sms=132)


def forward_mega(plan):
    """The forward megakernel as host.launch compiles it for a differentiated call (save) at EP1."""
    from tabby.ops.megakernel import kernel as K
    from tabby.ops.megakernel.host import kernel_consts
    mp = plan.mega
    BM = mp.tile_m
    C = kernel_consts(mp, world_size=1, has_shared=False, save=True, tokens=mp.token_pull, x_slot=4, done_slot=1,
                      x_pull_slot=5, done_wait=True, interpret=False)
    none = Const(None)

    def desc(*block):
        return "tensordesc<bf16[{}]>".format(",".join(map(str, block)))
    if mp.tma:
        descs = K.Descs(desc(BM, 64), desc(1, C.BN_GU, 64), desc(1, C.BN_GU, 64), desc(BM, 64),
                        desc(1, C.BN_DN, 64), *[none] * 5,
                        *([desc(BM // 2, 64), desc(BM // 2, 64)] if mp.half_tiles else [none] * 2))
    else:
        descs = K.Descs(*[none] * 12)
    names = ("xs_desc", "wg_desc", "wu_desc", "h_desc", "wd_desc", "x_desc", "sg_desc", "su_desc", "hsh_desc",
             "sd_desc", "xs_half_desc", "h_half_desc")
    args = dict(
        sync_args=K.SyncArgs("*i32", "*i32", "*i32", "i32", "i64"),
        route=K.RouteArgs("*i32", "*i32", "*i32", "*i64", "*i64", I16, "i32"),
        routed=K.RoutedArgs(P, P, P, P, I16, I16, P, I16, I16),
        shared=K.SharedArgs(P, "i32", P, P, P, P, P, "*i32", "*i32", "i32"),
        order=K.OrderArgs("i32", "i32"), **dict(zip(names, descs)),
        saved=K.SavedArgs("*i64", "*fp32", P), trace=none,
        peers=K.PeerArgs("i32", "*i64", "*i32", "i32"), x_rows=P,
        tokens=K.TokenArgs("*i32", "*i32", "i32") if mp.token_pull else K.TokenArgs(none, none, "i32"),
        C=Const(C), PROBE=Const(K.ProbeConsts(TRACE_EV=0, ABLATE=0)))
    tiles = (f"gate/up {BM}x2x{mp.gate_up.BN}x{mp.gate_up.BK}, down {BM}x{mp.down.BN}x{mp.down.BK} "
             f"x{mp.down_cols} cols, tma={mp.tma}, local_rows={mp.local_rows}, token_pull={mp.token_pull}")
    return K.moe_fwd_megakernel, args, mp.num_warps, mp.num_stages, tiles


def backward(plan, H, I, E, wgrad_cfg=None):
    """The separate backward's kernels with the configs the plan and launchers give them."""
    from tabby.ops import comm
    from tabby.ops.gemm import bf16 as gemm
    def tiles(kind):  # the Triton tiles (the routed kinds' plan entry is a gemm.Bf16Gemm)
        c = plan.gemm_config(kind)
        return c.config if isinstance(c, gemm.Bf16Gemm) else c

    dg = tiles(gemm.KIND_DGRAD_SWIGLU)
    xg = tiles(gemm.KIND_GATE_UP_DGRAD)
    wd = wgrad_cfg or tiles(gemm.KIND_WGRAD_DOWN)  # expert_wgrad(dys, hw): M=H, N=I
    wgu = wgrad_cfg or tiles(gemm.KIND_WGRAD_GATE_UP)  # gate_up: M=I, N=H
    out = [("down_dgrad_swiglu", gemm.down_dgrad_swiglu_kernel, {
        "dys_ptr": P, "stride_dym": I16, "wd_ptr": P, "stride_we": I16, "stride_wh": I16, "gu_ptr": P, "stride_gum": I16, "ws_ptr": "*fp32",
        "dgu_ptr": P, "stride_dgum": I16, "hw_ptr": P, "stride_hwm": I16, "dwp_ptr": "*fp32", "stride_dwpm": I32,
        "tile_expert_ptr": "*i32", "num_tiles_ptr": "*i32", "num_m": I32, "H": Const(H), "I": Const(I), "BM": Const(dg.BM),
        "BN": Const(dg.BN), "BK": Const(dg.BK), "GROUP_M": Const(dg.GROUP_M), "EVEN_K": Const(H % dg.BK == 0),
        "EPI_SPLIT": Const(dg.BN >= 32), "INTERPRET": Const(False)}, dg),
        ("gate_up_dgrad_push", gemm.rows_gemm_kernel, {
            "a_ptr": P, "a2_ptr": P, "stride_am": I16, "b_ptr": P, "b2_ptr": P, "stride_be": I16, "stride_be2": I16, "stride_bo": I16,
            "c_ptr": P, "stride_cm": I32, "row_src_ptr": "*i32", "dst_ptrs_ptr": "*i64", "TK": I16, "stride_dm": I16,
            "tile_expert_ptr": "*i32", "num_tiles_ptr": "*i32", "num_m": I32, "N": Const(H), "K": Const(I), "K2": Const(I),
            "BM": Const(xg.BM), "BN": Const(xg.BN), "BK": Const(xg.BK), "GROUP_M": Const(xg.GROUP_M), "B_NK": Const(False),
            "TWO_PHASE": Const(True), "EVEN_K": Const(I % xg.BK == 0), "PUSH": Const(True),
            "DST_DTYPE": Const(gemm.tl.bfloat16), "INTERPRET": Const(False)}, xg)]
    for nm, M, N, pairs, c in (("expert_wgrad dW_down M=H N=I", H, I, 1, wd),
                               ("expert_wgrad_gate_up M=I N=H", I, H, 2, wgu)):
        out.append((nm, gemm.expert_wgrad_kernel, {
            "a_ptr": P, "a2_ptr": P, "stride_ar": I16, "b_ptr": P, "stride_br": I16, "c_ptr": P, "c2_ptr": P, "stride_ce": I16,
            "stride_cm": I16, "expert_start_ptr": "*i32", "expert_count_ptr": "*i32", "E": I32, "M": Const(M), "N": Const(N),
            "NUM_PAIRS": Const(pairs), "BM": Const(c.BM), "BN": Const(c.BN), "BK": Const(c.BK), "GROUP_M": Const(c.GROUP_M),
            "NE_P2": Const(max(2, 1 << (E - 1).bit_length())), "INTERPRET": Const(False)}, c))
    out.append(("pull_rows (dy dispatch)", comm.pull_rows_kernel, {
        "row_src": "*i32", "num_tiles_ptr": "*i32", "src_ptrs": "*i64", "dst": P, "H": I16, "TK": I16, "k": I32,
        "w_ptrs": "*i64", "ws_out": P, "BR": Const(plan.dispatch_rows),
        "BH": Const(min(plan.dispatch_cols, 1 << (H - 1).bit_length())), "WITH_WEIGHTS": Const(False),
        "TILE_ROWS": Const(plan.tile_m), "ROWS_16B": Const(True), "ONLY_RANK": Const(False), "rank": I32}, None))
    return out


def combines(plan, H, k):
    """The combine of the forward (weighted, y) and of the backward (dx), with their default blocks."""
    from tabby.ops import combine
    BT, BH = combine.default_block(H)
    out = []
    for nm, has_w in (("fwd combine (y)", True), ("bwd combine (dx)", False)):
        out.append((nm, combine.combine_k_kernel, {
            "rows": P, "w": "*fp32", "extra": P, "out": P, "T": I32, "H": I16 if H % 16 == 0 else I32, "k": Const(k),
            "HAS_W": Const(has_w), "HAS_EXTRA": Const(False), "BT": Const(BT), "BH": Const(BH), "COLS_FAST": Const(True)},
            f"{BT}x{BH} copy"))
    return out


def main(argv):
    dump, only, wgrad = None, None, None
    if "--dump" in argv:
        j = argv.index("--dump")
        dump = argv[j + 1]
        argv = argv[:j] + argv[j + 2:]
        os.makedirs(dump, exist_ok=True)
    if "--only" in argv:
        j = argv.index("--only")
        only = argv[j + 1]
        argv = argv[:j] + argv[j + 2:]
    if "--wgrad" in argv:  # --wgrad BM,BN,BK,warps,stages: audit the weight gradient with that config
        from tabby.ops.gemm.bf16 import GemmConfig
        j = argv.index("--wgrad")
        bm, bn, bk, w, st = map(int, argv[j + 1].split(","))
        wgrad = GemmConfig(BM=bm, BN=bn, BK=bk, num_warps=w, num_stages=st)
        argv = argv[:j] + argv[j + 2:]
    from tabby_bench.shapes import SHAPES
    for shape in argv or ["kimi-k2", "qwen3-30b-a3b"]:
        s = SHAPES[shape]
        plan = plan_of(shape)
        print(f"######## {shape}: H={s.H} I={s.I} E={s.E} k={s.k}, 16384 tokens, EP1")
        jobs = []
        if plan.mega is not None:
            fn, args, w, st, tiles = forward_mega(plan)
            jobs.append(("fwd megakernel", fn, args, w, st, tiles))
        for nm, fn, args, c in backward(plan, s.H, s.I, s.E, wgrad):
            w, st = (c.num_warps, c.num_stages) if c else (4, 1)
            jobs.append(("bwd " + nm, fn, args, w, st, f"{c.BM}x{c.BN}x{c.BK}" if c else "copy"))
        for nm, fn, args, tiles in combines(plan, s.H, s.k):
            jobs.append((nm, fn, args, 4, 1, tiles))
        for nm, fn, args, w, st, tiles in jobs:
            if only and only not in nm:
                continue
            k = compile_args(fn, args, num_warps=w, num_stages=st)
            analyse(f"{shape} {nm}", k, w, st, tiles, dump)
    print_table()


if __name__ == "__main__":
    main(sys.argv[1:])
