"""Plain SwiGLU compiles to the code it had before the experts' activation became a property of the
layer (tabby/activation.py): the sm_90 PTX of every kernel with an activation epilogue, at the
benchmark's shapes (H 2048 / I 768 and H 7168 / I 2048) and the plan's tiles, is pinned in
golden/activation_ptx.json (sha256 of ``sm90.normalize_ptx``), the activation arguments left at
their defaults ("swiglu"). The FP8 Triton kernels and the megakernel are pinned by their own tests
(test_fp8_ptx_pinned.py, test_megakernel_compile.py). A deliberate change re-pins with
``python tests/test_activation_ptx_pinned.py --pin`` (TRITON_INTERPRET=0, the tests directory and
the repository on PYTHONPATH)."""
import os
import sys

from sm90 import Const, check_pinned, compile_args, pin_main, plan_at

PTX_GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "activation_ptx.json")
SHAPES = ((2048, 768), (7168, 2048))  # (H, I)


def _i32(v):
    return "i32:16" if v % 16 == 0 else "i32"


def _bf16_plan(H, I):
    """An sm_90 plan's bf16 kernels (Triton cores: ``bf16_ws=False``) at (H, I)."""
    from tabby.functional.config import Tuning

    return plan_at(H, I, megakernel=False, tuning=Tuning(bf16_ws=False))


def _gate_up(H, I):
    from tabby.ops.gemm import bf16 as gemm

    cfg = _bf16_plan(H, I).gemm[gemm.KIND_GATE_UP].config
    args = dict(xs_ptr="*bf16", stride_xm=_i32(H), wg_ptr="*bf16", wu_ptr="*bf16", stride_we=_i32(I * H),
                stride_wn=_i32(H), h_ptr="*bf16", stride_hm=_i32(I), gu_ptr="*bf16", stride_gum=_i32(2 * I),
                tile_expert_ptr="*i32", num_tiles_ptr="*i32", num_m="i32:16", H=Const(H), I=Const(I),
                BM=Const(cfg.BM), BN=Const(cfg.BN), BK=Const(cfg.BK), GROUP_M=Const(cfg.GROUP_M),
                EVEN_K=Const(H % cfg.BK == 0), SAVE_GU=Const(True), INTERPRET=Const(False))
    return compile_args(gemm.gate_up_swiglu_kernel, args, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _down_dgrad(H, I):
    from tabby.ops.gemm import bf16 as gemm

    cfg = _bf16_plan(H, I).gemm[gemm.KIND_DGRAD_SWIGLU].config
    args = dict(dys_ptr="*bf16", stride_dym=_i32(H), wd_ptr="*bf16", stride_we=_i32(H * I), stride_wh=_i32(I),
                gu_ptr="*bf16", stride_gum=_i32(2 * I), ws_ptr="*fp32", dgu_ptr="*bf16", stride_dgum=_i32(2 * I),
                hw_ptr="*bf16", stride_hwm=_i32(I), dwp_ptr="*fp32", stride_dwpm="i32", tile_expert_ptr="*i32",
                num_tiles_ptr="*i32", num_m="i32:16", H=Const(H), I=Const(I), BM=Const(cfg.BM), BN=Const(cfg.BN),
                BK=Const(cfg.BK), GROUP_M=Const(cfg.GROUP_M), EVEN_K=Const(H % cfg.BK == 0),
                EPI_SPLIT=Const(cfg.BN >= 32), INTERPRET=Const(False))
    return compile_args(gemm.down_dgrad_swiglu_kernel, args, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _gate_up_ws(stages):
    from triton.experimental.gluon import language as gl

    from tabby.ops.gemm import bf16_ws as ws

    def desc(block):
        return f"tensordesc<bf16[{block[0]},{block[1]}],{gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)!r}>"

    args = dict(a_desc=desc([64, 64]), wg_desc=desc([128, 64]), wu_desc=desc([128, 64]), h_ptr="*bf16",
                stride_hm="i32:16", gu_ptr="*bf16", stride_gum="i32:16", tile_expert_ptr="*i32",
                num_tiles_ptr="*i32", num_m="i32", I="i32:16", w_pitch="i32:16", NK="i32", STAGES=Const(stages), GROUP_M=Const(8),
                SCHED_BM=Const(128), SAVE_GU=Const(True))
    return compile_args(ws.gate_up_swiglu_ws_kernel, args, num_warps=4)


def _fp8_layouts():
    from triton.experimental.gluon import language as gl

    from tabby.ops.gemm import fp8_ws as ws

    return (gl.NVMMASharedLayout.get_default_for([ws.HALF, 128], gl.float8e4nv),
            gl.NVMMASharedLayout.get_default_for([ws.BN, 128], gl.float8e4nv))


def _gate_up_fp8_ws(nk):
    from test_fp8_gemm_ws_compile import gate_up_args

    from tabby.ops.gemm import fp8_ws as ws

    return compile_args(ws.gate_up_swiglu_fp8_ws_kernel, gate_up_args(nk), num_warps=4)


_SWIGLU_BWD_EPI = ("*bf16", "i32:16", "*fp32", "*bf16", "i32:16", "*bf16", "i32:16", "*fp32", "i32", "fp32",
                   "fp32")


def _down_dgrad_fp8_ws(nk):
    from tabby.functional import heuristics as hx
    from tabby.ops.gemm import fp8_ws as ws

    a_layout, b_layout = _fp8_layouts()
    cfg = hx.fp8_down_dgrad(128, ws=True, programs=None).config
    args = dict(a_desc=f"tensordesc<fp8e4nv[{ws.HALF},128],{a_layout!r}>", as_ptr="*fp32", stride_asm="i32",
                b_desc=f"tensordesc<fp8e4nv[{ws.BN},128],{b_layout!r}>", bs_ptr="*fp32", stride_bse="i32",
                stride_bsn="i32", epi=_SWIGLU_BWD_EPI, tile_expert_ptr="*i32", num_tiles_ptr="*i32",
                num_m="i32", N="i32:16", NK=Const(nk), STAGES=Const(cfg.num_stages), GROUP_M=Const(8),
                SCHED_BM=Const(128), EPILOGUE=Const(ws.EPI_SWIGLU_BWD.value))
    return compile_args(ws.rows_gemm_fp8_ws_kernel, args, num_warps=4)


def _down_dgrad_fp8_ws_bt(nk):
    from tabby.functional import heuristics as hx
    from tabby.ops.gemm import fp8_ws as ws

    a_layout, b_layout = _fp8_layouts()
    bt = hx.fp8_down_dgrad(128, ws=True, programs=None, in_kernel=True)
    args = dict(a_desc=f"tensordesc<fp8e4nv[{ws.HALF},128],{a_layout!r}>", as_ptr="*fp32", stride_asm="i32",
                b0_desc=f"tensordesc<fp8e4nv[{ws.BN},128],{b_layout!r}>",
                b1_desc=f"tensordesc<fp8e4nv[{ws.BN},128],{b_layout!r}>", bs_ptr="*fp32", stride_bse="i32",
                stride_bsn="i32", epi=_SWIGLU_BWD_EPI, tile_expert_ptr="*i32", num_tiles_ptr="*i32",
                num_m="i32", N="i32:16", KR="i32", NK=Const(nk), NK0=Const(nk),
                STAGES=Const(bt.config.num_stages), LAG=Const(bt.lag), GROUP_M=Const(8), SCHED_BM=Const(128),
                EPILOGUE=Const(ws.EPI_SWIGLU_BWD.value))
    return compile_args(ws.rows_gemm_fp8_ws_bt_kernel, args, num_warps=4)


def kernels():
    """name -> a function compiling that kernel at its plain-SwiGLU defaults."""
    out = {}
    for H, I in SHAPES:
        out[f"bf16_gate_up_H{H}_I{I}"] = lambda H=H, I=I: _gate_up(H, I)
        out[f"bf16_down_dgrad_H{H}_I{I}"] = lambda H=H, I=I: _down_dgrad(H, I)
        nk = H // 128
        out[f"fp8_ws_gate_up_nk{nk}"] = lambda nk=nk: _gate_up_fp8_ws(nk)
        out[f"fp8_ws_down_dgrad_nk{nk}"] = lambda nk=nk: _down_dgrad_fp8_ws(nk)
    out["fp8_ws_down_dgrad_bt_nk56"] = lambda: _down_dgrad_fp8_ws_bt(56)
    out["bf16_ws_gate_up_stages4"] = lambda: _gate_up_ws(4)
    return out


def test_plain_swiglu_keeps_its_sm90_ptx():
    check_pinned(__file__, PTX_GOLDEN, "plain SwiGLU")


if __name__ == "__main__":
    pin_main(kernels, PTX_GOLDEN, sys.argv[1:])
