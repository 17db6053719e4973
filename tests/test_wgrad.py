"""Tests of the bf16 weight gradients: ``gemm.expert_wgrad`` and ``gemm.expert_wgrad_gate_up``
(one persistent kernel, ``gemm.expert_wgrad_kernel``, one program per SM).

Values against plain torch fp32 (bf16 tolerance) with ragged experts, empty ones, one expert
holding every row, row counts that are not multiples of the K step and output sizes that are not
multiples of the tile; and determinism: the output is bitwise the same for any number of programs
and on every run. Without CUDA the kernel runs in the Triton interpreter on CPU tensors (tiny
tiles). Its sm_90a code is checked on the CPU too (tests/sm90.py): `python tests/test_wgrad.py`
prints the numbers that test_compiled_sm90 checks.
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

from tabby.functional import heuristics  # noqa: E402
from tabby.ops.gemm import bf16 as gemm  # noqa: E402
from tabby.ops.gemm.bf16 import GemmConfig  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CFG = GemmConfig(BM=16, BN=32, BK=16, num_warps=4, num_stages=2, GROUP_M=2)
CFG_K32 = GemmConfig(BM=32, BN=16, BK=32, num_warps=4, num_stages=2, GROUP_M=1)

COUNTS = {
    "mixed": [5, 0, 23, 16, 1, 0],  # ragged, empty, two K steps of 16, exactly one, one row; ends empty
    "one_expert": [0, 0, 37, 0],  # every row on one expert
    "no_rows": [0, 0, 0],  # zeros everywhere
}


def segments(counts, pad=16):
    """expert_start (each segment padded to ``pad`` rows, as the schedule pads them) and expert_count
    on the device, and the buffer's rows R (the segments and one spare padded tile)."""
    start = [0]
    for c in counts:
        start.append(start[-1] + (c + pad - 1) // pad * pad)
    return (torch.tensor(start, dtype=torch.int32, device=DEV), torch.tensor(counts, dtype=torch.int32, device=DEV),
            start[-1] + pad)


def rows(R, n, seed, stride=None):
    """Random bf16 [R, n] (a column slice of a wider buffer when ``stride``), nonzero in the padding rows
    too: the kernel must read only each expert's first expert_count rows."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(R, stride or n, generator=g) * 2).to(torch.bfloat16).to(DEV)[:, :n]


def reference(a, b, es, ec):
    """[E, M, N] fp32: C[e] = A_seg^T @ B_seg in plain torch."""
    a, b = a.float().cpu(), b.float().cpu()
    out = torch.zeros(ec.numel(), a.shape[1], b.shape[1])
    for e, (s, c) in enumerate(zip(es.tolist(), ec.tolist())):
        out[e] = a[s:s + c].T @ b[s:s + c]
    return out


def check_values(out, ref, counts):
    out = out.float().cpu()
    assert not out.isnan().any(), "every output element is written"
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.all(out[e] == 0), f"expert {e} has no rows: zero gradient"
        else:
            err = ((out[e] - ref[e]).norm() / ref[e].norm()).item()
            assert err < 1e-2, (e, c, err)


def nan_out(E, M, N, dtype):
    return torch.full((E, M, N), float("nan"), dtype=dtype, device=DEV)


@pytest.mark.parametrize("name", list(COUNTS))
def test_expert_wgrad_values(name):
    counts = COUNTS[name]
    es, ec, R = segments(counts)
    E = len(counts)
    for (M, N), cfg, dt in (((37, 21), CFG, torch.bfloat16), ((48, 40), CFG_K32, torch.float32)):
        a, b = rows(R, M, 1, stride=M + 3), rows(R, N, 2)
        out = gemm.expert_wgrad(a, b, es, ec, out=nan_out(E, M, N, dt), config=cfg, programs=4)
        check_values(out, reference(a, b, es, ec), counts)


def test_expert_wgrad_gate_up_values():
    """dW_gate and dW_up from the two column halves of dgu (row stride 2I) in one launch: the values,
    and bitwise what expert_wgrad gives for each half alone (the same tiles and K steps)."""
    counts = COUNTS["mixed"]
    es, ec, R = segments(counts)
    E, I, H = len(counts), 21, 37
    dgu, xs = rows(R, 2 * I, 3), rows(R, H, 4, stride=H + 5)
    dwg, dwu = gemm.expert_wgrad_gate_up(dgu, xs, es, ec, out_gate=nan_out(E, I, H, torch.float32),
                                         out_up=nan_out(E, I, H, torch.float32), config=CFG, programs=4)
    check_values(dwg, reference(dgu[:, :I], xs, es, ec), counts)
    check_values(dwu, reference(dgu[:, I:], xs, es, ec), counts)
    for half, want in ((slice(None, I), dwg), (slice(I, None), dwu)):
        assert torch.equal(gemm.expert_wgrad(dgu[:, half], xs, es, ec, out_dtype=torch.float32, config=CFG, programs=4),
                           want)
    # the plan's tiles (128 x N: heuristics.wgrad_config) and bf16 outputs
    dwg, dwu = gemm.expert_wgrad_gate_up(dgu, xs, es, ec, config=heuristics.wgrad_config(H), programs=4)
    check_values(dwg, reference(dgu[:, :I], xs, es, ec), counts)
    check_values(dwu, reference(dgu[:, I:], xs, es, ec), counts)


@pytest.mark.parametrize("launcher", ["down", "gate_up"])
def test_bitwise_for_any_grid(launcher):
    """The same bits from 1, 3 and 7 programs, each run twice (fp32 outputs, where a different order of
    any sum would show): each output tile is one program's, its K steps in order."""
    counts = [40, 0, 3, 33, 17, 1, 0, 16]
    es, ec, R = segments(counts)
    E, M, N = len(counts), 37, 21
    a, a2, b = rows(R, M, 5), rows(R, M, 6), rows(R, N, 7)
    dgu = torch.cat([a, a2], 1)

    def run(p):  # p programs: the launchers take the plan's grid as given
        if launcher == "down":
            return (gemm.expert_wgrad(a, b, es, ec, out=nan_out(E, M, N, torch.float32), config=CFG, programs=p),)
        return gemm.expert_wgrad_gate_up(dgu, b, es, ec, out_gate=nan_out(E, M, N, torch.float32),
                                         out_up=nan_out(E, M, N, torch.float32), config=CFG, programs=p)

    first = run(1)
    check_values(first[0], reference(a, b, es, ec), counts)
    for p in (3, 7, 1, 3, 7):
        got = run(p)
        assert all(torch.equal(g, f) for g, f in zip(got, first)), f"{p} programs"


@triton.jit
def _steps_of_kernel(cnt_ptr, out_ptr, E, per_e, BK: tl.constexpr, NE_P2: tl.constexpr):
    tl.store(out_ptr + tl.program_id(0),
             gemm._wgrad_steps_of(tl.program_id(0), tl.num_programs(0), per_e, cnt_ptr, E, BK, NE_P2))


def test_steps_of_counts_every_step():
    """The persistent loop's trip count: of program p of P, the K steps of tiles p, p + P, ...,
    max(cdiv(rows, BK), 1) each (a step fewer leaves a tile unstored, one more reads past the tiles)."""
    counts = [0, 1, 16, 17, 40, 0, 3]
    for per_e, P in ((1, 3), (5, 4), (6, 13), (3, 64)):
        out = torch.zeros(P, dtype=torch.int32, device=DEV)
        _steps_of_kernel[(P,)](torch.tensor(counts, dtype=torch.int32, device=DEV), out, len(counts), per_e,
                               BK=16, NE_P2=8)
        want = [0] * P
        for t in range(len(counts) * per_e):
            want[t % P] += max(-(-counts[t // per_e] // 16), 1)
        assert out.cpu().tolist() == want, (per_e, P)


# --------------------------------------------------------------------------------------------
# The compiled kernel (sm_90a, on the CPU): `python tests/test_wgrad.py` prints its numbers
# --------------------------------------------------------------------------------------------

# kimi-k2 (H 7168, I 2048, E 384) at the plan's tiles (heuristics.wgrad_config): dW_down (expert_wgrad(dys, hw):
# M=H, N=I) and dW_gate | dW_up (expert_wgrad_gate_up: M=I, N=H, two pairs)
COMPILED = (("down", 7168, 2048, 1), ("gate_up", 2048, 7168, 2))


def _compiled_numbers():
    res = {}
    for name, M, N, pairs in COMPILED:
        c = heuristics.wgrad_config(N)
        P, I16 = "*bf16", "i32:16"
        args = {"a_ptr": P, "a2_ptr": P, "stride_ar": I16, "b_ptr": P, "stride_br": I16, "c_ptr": P, "c2_ptr": P,
                "stride_ce": I16, "stride_cm": I16, "expert_start_ptr": "*i32", "expert_count_ptr": "*i32", "E": "i32",
                "M": Const(M), "N": Const(N), "NUM_PAIRS": Const(pairs), "BM": Const(c.BM), "BN": Const(c.BN),
                "BK": Const(c.BK), "GROUP_M": Const(c.GROUP_M), "NE_P2": Const(512), "INTERPRET": Const(False)}
        kern = compile_args(gemm.expert_wgrad_kernel, args, num_warps=c.num_warps, num_stages=c.num_stages)
        rep = ptxas_report(kern)
        ttgir, ptx = kern.asm["ttgir"], kern.asm["ptx"]
        loop = ttgir[ttgir.index("scf.for"):]
        res[name] = {
            "config": [c.BM, c.BN, c.BK, c.num_warps, c.num_stages],
            "regs": int(re.search(r"Used (\d+) registers", rep).group(1)),
            "spill": int(re.search(r"(\d+) bytes spill stores", rep).group(1))
            + int(re.search(r"(\d+) bytes spill loads", rep).group(1)),
            "c7515": "C7515" in rep or "serialized" in rep,
            "smem": kern.metadata.shared,
            # the wait right after the loop's wgmma (the store's wait for all of them is under its `if`)
            "wait_after_dot": int(re.search(r"warp_group_dot .*\n.*warp_group_dot_wait.*pendings = (\d+)",
                                            loop).group(1)),
            "cp_async_sizes": sorted({int(x, 0) for x in re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], "
                                                                    r"\[[^]]*\], (\w+)", ptx)}),
        }
    print(json.dumps(res))


def test_compiled_sm90():
    res = json.loads(run_compiled_check(__file__).strip().splitlines()[-1])
    assert set(res) == {"down", "gate_up"}, res
    for name, r in res.items():
        assert r["config"] == [128, 256, 32, 8, 4], (name, r)  # the measured tiles (docs/performance.md)
        assert r["regs"] <= 255 and r["spill"] == 0 and not r["c7515"], (name, r)
        assert r["wait_after_dot"] == 1, (name, r)  # one wgmma in flight in the K steps
        assert r["cp_async_sizes"] == [16], (name, r)  # 128-bit cp.async only
        assert r["smem"] <= 232448, (name, r)


if __name__ == "__main__":
    sys.exit(_compiled_numbers())
