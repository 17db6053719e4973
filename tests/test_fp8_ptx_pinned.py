"""The FP8 kernels' sm_90 PTX at the benchmark's shapes (H 2048 / I 768 and H 7168 / I 2048, every
dimension a multiple of 128) is pinned: golden/fp8_ptx.json holds the sha256 of each kernel's
normalized instruction stream (``sm90.normalize_ptx``), as the layer launches it: the tiles of
the plan's Triton core (``make_plan(...).fp8`` with ``Tuning(fp8_ws=False)``, which sm_90 takes
for the warp-specialized kernels otherwise: tests/test_fp8_gemm_ws_compile.py).

Shapes with H or I not a multiple of 128 take other constexpr specializations (a masked last K
block, a partial last N tile); this pins that those paths add nothing to the code generated for
the measured shapes. A deliberate change of these kernels re-pins with
``python tests/test_fp8_ptx_pinned.py --pin`` (TRITON_INTERPRET=0, the tests directory and the
repository on PYTHONPATH).
"""
import os
import sys

from sm90 import Const, check_pinned, compile_args, pin_main, plan_at

PTX_GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "fp8_ptx.json")
SHAPES = ((2048, 768), (7168, 2048))  # (H, I)


def _i32(v):
    return "i32:16" if v % 16 == 0 else "i32"


def _plan(H, I):
    """The FP8 plan's Triton kernels at (H, I): an sm_90 plan with the warp-specialized core off."""
    from tabby.functional.config import Tuning

    return plan_at(H, I, precision="fp8", tuning=Tuning(fp8_ws=False)).fp8


def _quantize_rows(K):
    from tabby.ops import quantize

    args = dict(x_ptr="*bf16", stride_xm=_i32(K), q_ptr="*fp8e4nv", stride_qm=_i32(K), s_ptr="*fp32",
                stride_sm=_i32(-(-K // 128)), M="i32", num_tiles_ptr="*i32", K=Const(K), BR=Const(32),
                TILE_ROWS=Const(128), GATED=Const(True), INTERPRET=Const(False))
    return compile_args(quantize.quantize_rows_kernel, args, num_warps=4)


def _gate_up(H, I):
    from tabby.ops.gemm import fp8 as gemm_fp8

    k = _plan(H, I).gate_up
    cfg = k.config
    assert k.core == "triton" and k.tma
    BM, nk, ni = cfg.BM, -(-H // 128), -(-I // 128)
    args = dict(a_ptr="*fp8e4nv", stride_am=_i32(H), as_ptr="*fp32", stride_asm=_i32(nk), wg_ptr="*fp8e4nv",
                wu_ptr="*fp8e4nv", stride_we=_i32(I * H), stride_wn=_i32(H), gs_ptr="*fp32", us_ptr="*fp32",
                stride_wse=_i32(ni * nk), stride_wsn=_i32(nk), hq_ptr="*fp8e4nv", stride_hm=_i32(I), hs_ptr="*fp32",
                stride_hsm=_i32(ni), gu_ptr="*bf16", stride_gum=_i32(2 * I), tile_expert_ptr="*i32",
                num_tiles_ptr="*i32", num_m="i32:16", H=Const(H), I=Const(I), BM=Const(BM),
                GROUP_M=Const(cfg.GROUP_M), EVEN_K=Const(H % 128 == 0), SAVE_GU=Const(True),
                INTERPRET=Const(False), USE_TMA=Const(True), a_desc=f"tensordesc<fp8e4nv[{BM},128]>",
                wg_desc="tensordesc<fp8e4nv[1,128,128]>", wu_desc="tensordesc<fp8e4nv[1,128,128]>",
                SUB_M=Const(128 // BM))
    return compile_args(gemm_fp8.gate_up_swiglu_fp8_kernel, args, num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages)


def _rows_push(N, K, gemm):
    """rows_gemm_fp8 pushing bf16 rows: the forward's down (N = H, K = I) and the gate/up dgrad
    (N = H, K = 2I)."""
    import triton.language as tl

    from tabby.ops.gemm import fp8 as gemm_fp8

    H, I = (N, K) if gemm == "down" else (N, K // 2)
    cfg = getattr(_plan(H, I), gemm).config
    nk, nn = -(-K // 128), -(-N // 128)
    args = dict(a_ptr="*fp8e4nv", stride_am=_i32(K), as_ptr="*fp32", stride_asm=_i32(nk), b_ptr="*fp8e4nv",
                stride_be=_i32(N * K), stride_bn=_i32(K), bs_ptr="*fp32", stride_bse=_i32(nn * nk),
                stride_bsn=_i32(nk), c_ptr="*fp8e4nv", stride_cm="i32:16", row_src_ptr="*i32", dst_ptrs_ptr="*i64",
                TK="i32", stride_dm=_i32(N), tile_expert_ptr="*i32", num_tiles_ptr="*i32", num_m="i32:16",
                N=Const(N), K=Const(K), BM=Const(cfg.BM), BN=Const(cfg.BN), GROUP_M=Const(cfg.GROUP_M),
                EVEN_K=Const(K % 128 == 0), PUSH=Const(True), DST_DTYPE=Const(tl.bfloat16))
    return compile_args(gemm_fp8.rows_gemm_fp8_kernel, args, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _down_dgrad(H, I):
    from tabby.ops.gemm import fp8 as gemm_fp8

    cfg = _plan(H, I).down_dgrad.config
    nk, ni = -(-H // 128), -(-I // 128)
    args = dict(a_ptr="*fp8e4nv", stride_am=_i32(H), as_ptr="*fp32", stride_asm=_i32(nk), b_ptr="*fp8e4nv",
                stride_be=_i32(I * H), stride_bn=_i32(H), bs_ptr="*fp32", stride_bse=_i32(ni * nk),
                stride_bsn=_i32(nk), gu_ptr="*bf16", stride_gum=_i32(2 * I), ws_ptr="*fp32", dgu_ptr="*bf16",
                stride_dgum=_i32(2 * I), hw_ptr="*bf16", stride_hwm=_i32(I), dwp_ptr="*fp32", stride_dwpm=_i32(ni),
                tile_expert_ptr="*i32", num_tiles_ptr="*i32", num_m="i32:16", H=Const(H), I=Const(I),
                BM=Const(cfg.BM), BN=Const(cfg.BN), GROUP_M=Const(cfg.GROUP_M), EVEN_K=Const(H % 128 == 0))
    return compile_args(gemm_fp8.down_dgrad_swiglu_fp8_kernel, args, num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages)


def _wgrad(M, N):
    from tabby.ops.gemm import fp8 as gemm_fp8

    cfg = _plan(max(M, N), min(M, N)).wgrad.config
    args = dict(at_ptr="*fp8e4nv", stride_at="i32:16", as_ptr="*fp32", stride_asr="i32:16", bt_ptr="*fp8e4nv",
                stride_bt="i32:16", bs_ptr="*fp32", stride_bsr="i32:16", c_ptr="*bf16", stride_ce="i32:16",
                stride_cm="i32:16", expert_start_ptr="*i32", expert_count_ptr="*i32", R="i32:16",
                M=Const(M), N=Const(N), BM=Const(cfg.BM), BN=Const(cfg.BN), GROUP_M=Const(cfg.GROUP_M),
                INTERPRET=Const(False), PADDED=Const(True))  # the layer's: its routed rows, padded segments
    return compile_args(gemm_fp8.expert_wgrad_fp8_kernel, args, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def kernels():
    """name -> a function compiling that kernel (the layer's launches at the benchmark's shapes)."""
    out = {}
    for H, I in SHAPES:
        for K in sorted({H, 2 * I}):
            out[f"quantize_rows_K{K}"] = lambda K=K: _quantize_rows(K)
        out[f"gate_up_H{H}_I{I}"] = lambda H=H, I=I: _gate_up(H, I)
        out[f"down_push_H{H}_I{I}"] = lambda H=H, I=I: _rows_push(H, I, "down")
        out[f"gate_up_dgrad_push_H{H}_I{I}"] = lambda H=H, I=I: _rows_push(H, 2 * I, "gate_up_dgrad")
        out[f"down_dgrad_H{H}_I{I}"] = lambda H=H, I=I: _down_dgrad(H, I)
        out[f"wgrad_down_H{H}_I{I}"] = lambda H=H, I=I: _wgrad(H, I)
        out[f"wgrad_gate_up_H{H}_I{I}"] = lambda H=H, I=I: _wgrad(I, H)
    return out


def test_fp8_kernels_keep_their_sm90_ptx_at_the_benchmark_shapes():
    check_pinned(__file__, PTX_GOLDEN, "these FP8 kernels at the benchmark's shapes")


if __name__ == "__main__":
    pin_main(kernels, PTX_GOLDEN, sys.argv[1:])
