"""The bias epilogues of bf16.py's Triton gate/up and rows GEMM (HAS_BIAS: where the warp-specialized
ones do not run, e.g. Tuning(bf16_ws=False)) compile for sm_90a on a machine without a GPU, at the
plan's tiles for kimi-k2's and gpt-oss-120b's widths, without spills. The ws kernels' bias epilogues:
test_gemm_ws_compile.py. Values: test_biases.py (CPU), test_biases_gpu.py."""
import re

from sm90 import Const, compile_args, plan_at, ptxas_report, run_compiled_check

SHAPES = ((7168, 2048), (2880, 2880))  # (H, I)


def _i32(v):
    return "i32:16" if v % 16 == 0 else "i32"


def _report():
    from tabby.ops.gemm import bf16 as gemm

    from tabby.functional.config import Tuning

    for H, I in SHAPES:
        plan = plan_at(H, I, biases=True, tuning=Tuning(bf16_ws=False))
        gu, dn = plan.gemm[gemm.KIND_GATE_UP], plan.gemm[gemm.KIND_DOWN]
        assert gu.core == dn.core == gemm.CORE_TRITON and not plan.megakernel
        c = gu.config
        args = dict(xs_ptr="*bf16", stride_xm=_i32(H), wg_ptr="*bf16", wu_ptr="*bf16", stride_we=_i32(I * H),
                    stride_wn=_i32(H), h_ptr="*bf16", stride_hm=_i32(I), gu_ptr="*bf16", stride_gum=_i32(2 * I),
                    tile_expert_ptr="*i32", num_tiles_ptr="*i32", num_m="i32:16", H=Const(H), I=Const(I),
                    BM=Const(c.BM), BN=Const(c.BN), BK=Const(c.BK), GROUP_M=Const(c.GROUP_M),
                    EVEN_K=Const(H % c.BK == 0), SAVE_GU=Const(True), INTERPRET=Const(False), HAS_BIAS=Const(True),
                    bg_ptr="*bf16", bu_ptr="*bf16", stride_bias_e=_i32(I))
        k = compile_args(gemm.gate_up_swiglu_kernel, args, num_warps=c.num_warps, num_stages=c.num_stages)
        _line(f"gate_up/H{H}/I{I}", k)
        c = dn.config
        args = dict(a_ptr="*bf16", a2_ptr="*bf16", stride_am=_i32(I), b_ptr="*bf16", b2_ptr="*bf16",
                    stride_be=_i32(H * I), stride_be2=_i32(H * I), stride_bo=_i32(I), c_ptr="*bf16", stride_cm="i32",
                    row_src_ptr="*i32", dst_ptrs_ptr="*i64", TK="i32", stride_dm=_i32(H), tile_expert_ptr="*i32",
                    num_tiles_ptr="*i32", num_m="i32:16", N=Const(H), K=Const(I), K2=Const(0), BM=Const(c.BM),
                    BN=Const(c.BN), BK=Const(c.BK), GROUP_M=Const(c.GROUP_M), B_NK=Const(True),
                    TWO_PHASE=Const(False), EVEN_K=Const(I % c.BK == 0), PUSH=Const(True),
                    DST_DTYPE=Const(__import__("triton.language", fromlist=["bfloat16"]).bfloat16),
                    INTERPRET=Const(False), HAS_BIAS=Const(True), bias_ptr="*bf16", stride_bias_e=_i32(H))
        k = compile_args(gemm.rows_gemm_kernel, args, num_warps=c.num_warps, num_stages=c.num_stages)
        _line(f"down_push/H{H}/I{I}", k)


def _line(name, k):
    rep = ptxas_report(k)
    print(name, "spills", sum(int(n) for n in re.findall(r"(\d+) bytes spill", rep)))


def test_bias_epilogues_compile_for_sm90_without_spills():
    lines = run_compiled_check(__file__).splitlines()
    assert len(lines) == 2 * len(SHAPES), lines
    for line in lines:
        f = line.split()
        assert f[2] == "0", line


if __name__ == "__main__":
    _report()
