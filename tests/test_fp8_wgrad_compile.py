"""The FP8 weight gradient compiles (sm_90a, on a machine without a GPU) to a pipelined loop.

Its operands are K-major (the rows, the GEMM's K, contiguous); a row mask along that contiguous
K would make every operand load byte-wise (128 ``LDG.E.U8`` per thread and K block) and keep the
pipeliner from turning them into async copies (one stage in shared memory whatever num_stages),
so the blocks inside an expert's segment are loaded unmasked. Checked here: the async copies
(num_stages - 1 in flight), the FP8 wgmma with both operands from shared memory, no byte loads,
no spills and no serialized wgmma (C7514 / C7515), at the benchmark's shapes, gpt-oss-120b's (2880:
partial output tiles) and an odd one; and with PADDED at the plan's Triton tiles
(``heuristics.fp8_wgrad``: the layer's launch off sm_90, every block in the loop).
"""
import re

from sm90 import Const, compile_args, ptxas_report, run_compiled_check

SHAPES = ((2048, 768), (768, 2048), (7168, 2048), (100, 70), (2880, 2880))  # (2880, 2880): gpt-oss-120b


def _report():
    from tabby.functional import heuristics
    from tabby.ops.gemm import fp8 as gemm_fp8
    from tabby.ops.gemm.bf16 import GemmConfig

    GENERAL = GemmConfig(BM=128, BN=128, BK=128, num_warps=8, num_stages=4, GROUP_M=8)  # the general form's

    for (M, N), padded in [(s, False) for s in SHAPES] + [(s, True) for s in SHAPES[:3]]:
        # the padded form as the layer launches it (the plan's Triton tiles)
        cfg = heuristics.fp8_wgrad(ws=False, programs=None).config if padded else GENERAL
        args = dict(at_ptr="*fp8e4nv", stride_at="i32:16", as_ptr="*fp32", stride_asr="i32:16", bt_ptr="*fp8e4nv",
                    stride_bt="i32:16", bs_ptr="*fp32", stride_bsr="i32:16", c_ptr="*bf16", stride_ce="i32:16",
                    stride_cm="i32:16", expert_start_ptr="*i32", expert_count_ptr="*i32", R="i32:16",
                    M=Const(M), N=Const(N), BM=Const(cfg.BM), BN=Const(cfg.BN), GROUP_M=Const(cfg.GROUP_M),
                    INTERPRET=Const(False), PADDED=Const(padded))
        k = compile_args(gemm_fp8.expert_wgrad_fp8_kernel, args, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        ttgir, ptx, rep = k.asm["ttgir"], k.asm["ptx"], ptxas_report(k)
        spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill", rep))
        print(f"{M}{'p' if padded else ''}", N, "async_copy", ttgir.count("ttg.async_copy_global_to_local"),
              "wgmma_e4m3", len(re.findall(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx)),
              "byte_loads", len(re.findall(r"ld\.global(\.\w+)*\.b8\b", ptx)),
              "spills", spills, "serialized", int("are serialized" in rep))


def test_expert_wgrad_fp8_pipelined():
    for line in run_compiled_check(__file__).splitlines():
        f = line.split()
        c = dict(zip(f[2::2], map(int, f[3::2])))
        assert c["async_copy"] >= 6, line  # A and B, 2-3 stages in flight (prologue and loop)
        assert c["wgmma_e4m3"] > 0 and c["byte_loads"] == 0, line
        assert c["spills"] == 0 and c["serialized"] == 0, line  # no wgmma serialization (C7514 / C7515)


if __name__ == "__main__":
    _report()
