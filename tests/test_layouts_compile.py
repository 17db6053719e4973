"""The Triton kernels of the transposed layouts (``validate.LAYOUTS``) and of ungated experts compile
for sm_90 at the plan's tiles for gpt-oss-120b's and qwen3-30b-a3b's widths, each within a CTA's
shared memory (a limit the interpreter does not see: a paired gate/up dgrad once overflowed it):
gpt-oss's interleaved weights' gate/up dgrad is one K-major phase of K = 2I (down's tiles) over dgu
interleaved by the down dgrad's epilogue (DGU_PAIRED). The ws kernels: test_gemm_ws_compile.py."""
import json
import sys

from sm90 import Const, compile_args, plan_at, run_compiled_check

SMEM_MAX = 232448  # an sm_90 CTA's shared memory (227 KB)
SHAPES = [(2880, 2880), (2048, 768)]


def _i32(v):
    return "i32:16" if v % 16 == 0 else "i32"


def _configs(H, I):
    from tabby.functional.config import Tuning
    from tabby.ops.gemm import bf16 as gemm

    plan = plan_at(H, I, megakernel=False, tuning=Tuning(bf16_ws=False))
    return {k: plan.gemm[k].config for k in (gemm.KIND_GATE_UP, gemm.KIND_GATE_UP_DGRAD, gemm.KIND_DGRAD_SWIGLU,
                                             gemm.KIND_DOWN)}


def gate_up(H, I, w_layout, act, bias_stride):
    from tabby.ops.gemm import bf16 as gemm

    cfg = _configs(H, I)[gemm.KIND_GATE_UP]
    args = dict(xs_ptr="*bf16", stride_xm=_i32(H), wg_ptr="*bf16", wu_ptr="*bf16", stride_we=_i32(2 * I * H),
                stride_wn=_i32(2 * I), h_ptr="*bf16", stride_hm=_i32(I), gu_ptr="*bf16", stride_gum=_i32(2 * I),
                tile_expert_ptr="*i32", num_tiles_ptr="*i32", num_m="i32:16", H=Const(H), I=Const(I),
                BM=Const(cfg.BM), BN=Const(cfg.BN), BK=Const(cfg.BK), GROUP_M=Const(cfg.GROUP_M),
                EVEN_K=Const(H % cfg.BK == 0), SAVE_GU=Const(True), INTERPRET=Const(False), ACT=Const(act),
                W_LAYOUT=Const(w_layout))
    if bias_stride:
        args.update(HAS_BIAS=Const(True), bg_ptr="*bf16", bu_ptr="*bf16", stride_bias_e=_i32(2 * I),
                    BIAS_STRIDE_N=Const(bias_stride))
    return compile_args(gemm.gate_up_swiglu_kernel, args, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def rows(H, I, kind, b_layout, two_phase, K=None):
    """rows_gemm_kernel as rows_gemm launches it: the gate/up dgrad (N = H, K = I a phase, push) or the
    down projection (N = H, K = I, push) with B as ``b_layout``, at ``kind``'s tiles (K: another depth)."""
    import triton.language as tl

    from tabby.ops.gemm import bf16 as gemm

    cfg = _configs(H, I)[kind]
    BK = cfg.BK
    K = K or I
    args = dict(a_ptr="*bf16", a2_ptr="*bf16", stride_am=_i32(2 * I), b_ptr="*bf16", b2_ptr="*bf16",
                stride_be=_i32(2 * I * H), stride_be2=_i32(2 * I * H), stride_bo=_i32(2 * I), c_ptr="*bf16",
                stride_cm="i32", row_src_ptr="*i32", dst_ptrs_ptr="*i64", TK="i32", stride_dm=_i32(H),
                tile_expert_ptr="*i32", num_tiles_ptr="*i32", num_m="i32:16", N=Const(H), K=Const(K),
                K2=Const(K if two_phase else 0), BM=Const(cfg.BM), BN=Const(cfg.BN), BK=Const(BK),
                GROUP_M=Const(cfg.GROUP_M), B_NK=Const(b_layout != "kn"), TWO_PHASE=Const(two_phase),
                EVEN_K=Const(K % BK == 0), PUSH=Const(True), DST_DTYPE=Const(tl.bfloat16), INTERPRET=Const(False))
    return compile_args(gemm.rows_gemm_kernel, args, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def down_dgrad(H, I, w_layout, act, dgu_paired=False):
    from tabby.ops.gemm import bf16 as gemm

    cfg = _configs(H, I)[gemm.KIND_DGRAD_SWIGLU]
    args = dict(dys_ptr="*bf16", stride_dym=_i32(H), wd_ptr="*bf16", stride_we=_i32(H * I),
                stride_wh=_i32(H if w_layout else I), gu_ptr="*bf16", stride_gum=_i32(2 * I), ws_ptr="*fp32",
                dgu_ptr="*bf16", stride_dgum=_i32(2 * I), hw_ptr="*bf16", stride_hwm=_i32(I), dwp_ptr="*fp32",
                stride_dwpm="i32", tile_expert_ptr="*i32", num_tiles_ptr="*i32", num_m="i32:16", H=Const(H),
                I=Const(I), BM=Const(cfg.BM), BN=Const(cfg.BN), BK=Const(cfg.BK), GROUP_M=Const(cfg.GROUP_M),
                EVEN_K=Const(H % cfg.BK == 0), EPI_SPLIT=Const(cfg.BN >= 32), INTERPRET=Const(False),
                ACT=Const(act), W_LAYOUT=Const(w_layout), DGU_PAIRED=Const(dgu_paired))
    return compile_args(gemm.down_dgrad_swiglu_kernel, args, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def kernels():
    """name -> a function compiling it (ACT 3: gpt-oss's, 5: relu2)."""
    from tabby.ops.gemm import bf16 as gemm

    out = {}
    for H, I in SHAPES:
        s = f"H{H}_I{I}"
        out[f"gate_up_kn_paired_bias_{s}"] = lambda H=H, I=I: gate_up(H, I, 2, 3, 2)
        out[f"gate_up_kn_bias_{s}"] = lambda H=H, I=I: gate_up(H, I, 1, 3, 1)
        out[f"gate_up_relu2_{s}"] = lambda H=H, I=I: gate_up(H, I, 0, 5, 0)
        out[f"gate_up_dgrad_paired_{s}"] = lambda H=H, I=I: rows(H, I, gemm.KIND_DOWN, "nk", False, K=2 * I)
        out[f"gate_up_dgrad_kn_{s}"] = lambda H=H, I=I: rows(H, I, gemm.KIND_GATE_UP_DGRAD, "nk", True)
        out[f"down_kn_{s}"] = lambda H=H, I=I: rows(H, I, gemm.KIND_DOWN, "kn", False)
        out[f"down_dgrad_kn_{s}"] = lambda H=H, I=I: down_dgrad(H, I, 1, 3)
        out[f"down_dgrad_relu2_{s}"] = lambda H=H, I=I: down_dgrad(H, I, 0, 5)
        out[f"down_dgrad_kn_paired_{s}"] = lambda H=H, I=I: down_dgrad(H, I, 1, 3, True)
    return out


def test_layout_and_ungated_kernels_compile_within_shared_memory():
    rows_ = [json.loads(line) for line in run_compiled_check(__file__).splitlines() if line.startswith("{")]
    assert len(rows_) == len(kernels()) == 18
    for r in rows_:
        assert r["shared"] <= SMEM_MAX, r


if __name__ == "__main__":
    for name, fn in kernels().items():
        k = fn()
        print(json.dumps(dict(name=name, shared=k.metadata.shared)), flush=True)
    sys.exit(0)
