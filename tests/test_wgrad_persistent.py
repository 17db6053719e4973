"""The persistent weight gradient (``expert_wgrad(..., persistent=True)``, measurement only for now).

It must give BITWISE the results of the default kernel (same tiles, same K steps in the same order):
checked here under the interpreter on random inputs (ragged, empty and one-row experts, many experts,
odd sizes, every output dtype the callers use, both launchers, any number of programs), and its sm_90a
code checked on the CPU (tests/sm90.py): registers, no spills, no serialized wgmma, one wgmma in
flight in the flattened loop, 16-byte cp.async.
"""
import json
import os
import re
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from sm90 import Const, compile_args, ptxas_report, run_compiled_check  # noqa: E402
from tabby.ops.gemm import _wgrad_tiles_of  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
COUNTS = {
    "mixed": [5, 0, 23, 16],  # ragged, empty, several K steps, exactly one K step (BK 16)
    "edges": [1, 0, 0, 17, 15, 1, 32, 0],  # one-row experts, empties in a row, BK +- 1, 2 BK; ends empty
    "many": None,  # 21 experts of 0..40 rows (a few empty)
}


def counts_of(name):
    if COUNTS[name] is not None:
        return COUNTS[name]
    g = torch.Generator().manual_seed(5)
    c = torch.randint(0, 41, (21,), generator=g)
    c[torch.randperm(21, generator=g)[:4]] = 0
    return c.tolist()


def segments(counts, pad=16, extra=1, seed=0):
    """expert_start (segments padded to ``pad`` rows) and expert_count, and the rows they span."""
    start = [0]
    for c in counts:
        start.append(start[-1] + (c + pad - 1) // pad * pad)
    R = start[-1] + extra * pad
    return (torch.tensor(start, dtype=torch.int32, device=DEV), torch.tensor(counts, dtype=torch.int32, device=DEV), R)


def rows(R, n, seed, stride=None):
    """Random bf16 [R, n] (a column slice of a wider buffer when ``stride``), garbage in unused rows too."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(R, stride or n, generator=g) * 2).to(torch.bfloat16).to(DEV)
    return x[:, :n]


def _cfg(BN=32, BK=16, GROUP_M=2):
    from tabby.ops.gemm import GemmConfig
    return GemmConfig(BM=16, BN=BN, BK=BK, num_warps=4, num_stages=2, GROUP_M=GROUP_M)


@pytest.mark.parametrize("name", list(COUNTS))
def test_expert_wgrad_bitwise(name):
    from tabby.ops import gemm

    counts = counts_of(name)
    es, ec, R = segments(counts)
    M, N = (37, 21) if name == "many" else (48, 40)  # odd sizes: partial row and column tiles
    a, b = rows(R, M, 1, stride=M + 3), rows(R, N, 2)
    cfg = _cfg(GROUP_M=3 if name == "edges" else 2)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        ref = gemm.expert_wgrad(a, b, es, ec, out_dtype=dt, config=cfg)
        programs = (1, 3, 7, 10 ** 4) if dt == torch.bfloat16 else (5,)
        for p in programs:
            out = torch.full((len(counts), M, N), float("nan"), dtype=dt, device=DEV)
            gemm.expert_wgrad(a, b, es, ec, out=out, config=cfg, persistent=True, programs=p)
            assert torch.equal(out, ref), (name, dt, p)
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.all(ref[e] == 0)


def test_expert_wgrad_gate_up_bitwise():
    from tabby.ops import gemm

    counts = counts_of("edges")
    es, ec, R = segments(counts)
    I, H = 40, 48
    dgu, xs = rows(R, 2 * I, 3), rows(R, H, 4)
    for cfg in (_cfg(), _cfg(BN=16, BK=32, GROUP_M=1)):
        ref = gemm.expert_wgrad_gate_up(dgu, xs, es, ec, config=cfg)
        for p in (2, 9):
            got = gemm.expert_wgrad_gate_up(dgu, xs, es, ec, config=cfg, persistent=True, programs=p)
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (cfg, p)
    # fp32 output, through out_gate / out_up
    ref = gemm.expert_wgrad_gate_up(dgu, xs, es, ec, out_dtype=torch.float32, config=_cfg())
    og = torch.full((len(counts), I, H), float("nan"), device=DEV)
    ou = torch.full((len(counts), I, H), float("nan"), device=DEV)
    gemm.expert_wgrad_gate_up(dgu, xs, es, ec, out_gate=og, out_up=ou, config=_cfg(), persistent=True, programs=4)
    assert torch.equal(og, ref[0]) and torch.equal(ou, ref[1])


def test_no_experts_and_no_rows():
    from tabby.ops import gemm

    es, ec, R = segments([0, 0, 0])
    a, b = rows(R, 24, 5), rows(R, 40, 6)
    out = gemm.expert_wgrad(a, b, es, ec, config=_cfg(), persistent=True, programs=4)
    assert out.shape == (3, 24, 40) and torch.all(out == 0)


@triton.jit
def _tiles_of_kernel(cnt_ptr, out_ptr, E, per_e, BK: tl.constexpr, NE_P2: tl.constexpr):
    tl.store(out_ptr + tl.program_id(0),
             _wgrad_tiles_of(tl.program_id(0), tl.num_programs(0), per_e, cnt_ptr, E, BK, NE_P2))


def test_tiles_of_counts_every_step():
    """The flattened loop's trip count: every tile of the program, max(cdiv(rows, BK), 1) steps each."""
    counts = [0, 1, 16, 17, 40, 0, 3]
    for per_e, P in ((1, 3), (5, 4), (6, 13), (3, 64)):
        out = torch.zeros(P, dtype=torch.int32, device=DEV)
        _tiles_of_kernel[(P,)](torch.tensor(counts, dtype=torch.int32, device=DEV), out, len(counts), per_e, BK=16, NE_P2=8)
        want = [0] * P
        for t in range(len(counts) * per_e):
            want[t % P] += max(-(-counts[t // per_e] // 16), 1)
        assert out.cpu().tolist() == want, (per_e, P)


# --------------------------------------------------------------------------------------------
# The compiled kernel (sm_90a, on the CPU): `python tests/test_wgrad_persistent.py` prints its numbers
# --------------------------------------------------------------------------------------------

# kimi-k2 (H 7168, I 2048, E 384): dW_down (M=H, N=I) and dW_gate|up (M=I, N=H, two pairs) at the
# launchers' default tiles, and the 4-warp tiles that let two programs share an SM
COMPILED = (("down", 7168, 2048, 1, (128, 256, 32, 8, 4)), ("gate_up", 2048, 7168, 2, (128, 256, 32, 8, 4)),
            ("gate_up_4w", 2048, 7168, 2, (128, 128, 32, 4, 4)))


def _compiled_numbers():
    from tabby.ops import gemm

    res = {}
    for name, M, N, pairs, (bm, bn, bk, w, st) in COMPILED:
        P, I16 = "*bf16", "i32:16"
        args = {"a_ptr": P, "a2_ptr": P, "stride_ar": I16, "b_ptr": P, "stride_br": I16, "c_ptr": P, "c2_ptr": P,
                "stride_ce": I16, "stride_cm": I16, "expert_start_ptr": "*i32", "expert_count_ptr": "*i32", "E": "i32",
                "M": Const(M), "N": Const(N), "NUM_PAIRS": Const(pairs), "BM": Const(bm), "BN": Const(bn),
                "BK": Const(bk), "GROUP_M": Const(8), "NE_P2": Const(512), "INTERPRET": Const(False)}
        kern = compile_args(gemm.expert_wgrad_persistent_kernel, args, num_warps=w, num_stages=st)
        rep = ptxas_report(kern)
        ttgir, ptx = kern.asm["ttgir"], kern.asm["ptx"]
        loop = ttgir[ttgir.index("scf.for"):]
        res[name] = {
            "regs": int(re.search(r"Used (\d+) registers", rep).group(1)),
            "spill": int(re.search(r"(\d+) bytes spill stores", rep).group(1))
            + int(re.search(r"(\d+) bytes spill loads", rep).group(1)),
            "c7515": "C7515" in rep or "serialized" in rep,
            "smem": kern.metadata.shared,
            # the wait right after the flattened loop's wgmma, and the waits in the loop
            "wait_after_dot": int(re.search(r"warp_group_dot .*\n.*warp_group_dot_wait.*pendings = (\d+)", loop).group(1)),
            "cp_async_sizes": sorted({int(x, 0) for x in re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], "
                                                                    r"\[[^]]*\], (\w+)", ptx)}),
        }
    print(json.dumps(res))


def test_compiled_sm90():
    res = json.loads(run_compiled_check(__file__).strip().splitlines()[-1])
    for name, r in res.items():
        assert r["regs"] <= 255 and r["spill"] == 0 and not r["c7515"], (name, r)
        assert r["wait_after_dot"] == 1, (name, r)  # one wgmma in flight in the K steps
        assert r["cp_async_sizes"] == [16], (name, r)  # 128-bit cp.async only
    assert res["gate_up_4w"]["regs"] <= 255 and res["gate_up_4w"]["smem"] <= 232448 // 2 - 1024, res  # 2 CTAs/SM


if __name__ == "__main__":
    sys.exit(_compiled_numbers())
