"""The warp-specialized FP8 rows GEMM (tabby/ops/gemm/fp8_ws.py) compiles for sm_90a, on a machine
without a GPU, to the structure it was written for, for each epilogue (store, push, SwiGLU
backward): no serialized wgmma (ptxas's C7514 / C7515: every wgmma would wait for the one
before, and one warpgroup's promotion could no longer run under the other's MMA), no spills, each
block's wgmma waited for at once (wait 0) rather than overlapped within a warpgroup, and the
stores and pushes in 16-byte vectors; and the warp-specialized gate/up and weight gradient alike, and
the dgrads that transpose the forward copies' blocks in the kernel (32-bit stores). Its values:
test_fp8_gemm_ws_gpu.py."""
import re

from sm90 import Const, compile_args, ptxas_report, run_compiled_check


def _line(name, k, **more):
    """One line of counts for the test: FP8 wgmmas, nonzero waits, 16-byte stores, spilled bytes,
    ptxas's serialization note, warp specialization (setmaxnreg), and ``more``."""
    ptx, rep = k.asm["ptx"], ptxas_report(k)
    print(name, *(f"{n} {v}" for n, v in more.items()), "wgmma_e4m3", len(re.findall(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx)),
          "wait_nonzero", len(re.findall(r"wgmma\.wait_group\.sync\.aligned [1-9]", ptx)),
          "v4_stores", len(re.findall(r"st\.global(\.\w+)*\.v4", ptx)),
          "tma_stores", len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)),
          "shared", k.metadata.shared,
          "spills", sum(int(n) for n in re.findall(r"(\d+) bytes spill", rep)),
          "serialized", int("are serialized" in rep), "warp_specialized", int("setmaxnreg" in ptx))


def gate_up_args(nk: int) -> dict:
    """``compile_args``'s arguments of the warp-specialized FP8 gate/up at ``nk`` K blocks, the plan's
    ring depth (test_activation_ptx_pinned.py pins this kernel too)."""
    from triton.experimental.gluon import language as gl

    from tabby.functional import heuristics as hx
    from tabby.ops.gemm import fp8_ws as ws

    a_layout = gl.NVMMASharedLayout.get_default_for([ws.HALF, 128], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([ws.BN, 128], gl.float8e4nv)
    return dict(a_desc=f"tensordesc<fp8e4nv[{ws.HALF},128],{a_layout!r}>", as_ptr="*fp32", stride_asm="i32",
                w_desc_g=f"tensordesc<fp8e4nv[{ws.BN},128],{b_layout!r}>",
                w_desc_u=f"tensordesc<fp8e4nv[{ws.BN},128],{b_layout!r}>", gs_ptr="*fp32", us_ptr="*fp32",
                stride_wse="i32", stride_wsn="i32", hq_ptr="*fp8e4nv", stride_hm="i32:16", hs_ptr="*fp32",
                stride_hsm="i32", gu_ptr="*bf16", stride_gum="i32:16", tile_expert_ptr="*i32",
                num_tiles_ptr="*i32", num_m="i32", I="i32:16", NK=Const(nk),
                STAGES=Const(hx.fp8_gate_up(2048, 128, ws=True, programs=None).config.num_stages),
                GROUP_M=Const(8), SCHED_BM=Const(128), SAVE_GU=Const(True))


def _report():
    from triton.experimental.gluon import language as gl

    from tabby.functional import heuristics as hx
    from tabby.ops.gemm import fp8_ws as ws

    a_layout = gl.NVMMASharedLayout.get_default_for([ws.HALF, 128], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([ws.BN, 128], gl.float8e4nv)
    epis = {ws.EPI_STORE.value: ("*bf16", "i32:16"),
            ws.EPI_PUSH.value: ("*i32", "*i64", "i32", "i32:16", "*bf16"),
            ws.EPI_SWIGLU_BWD.value: ("*bf16", "i32:16", "*fp32", "*bf16", "i32:16", "*bf16", "i32:16", "*fp32",
                                      "i32", "fp32", "fp32")}
    # (epilogue, kernel, (NK, STAGES) cases): the stored and pushed rows at 128 x 256 (the plan's ring
    # depth, heuristics.fp8_wide_stages: 4 at qwen3-30b-a3b's down, K 768), the SwiGLU backward at
    # 128 x 128; kimi-k2's K 2048 and gpt-oss-120b's 2880 (a partial last block)
    down_dgrad = hx.fp8_down_dgrad(128, ws=True, programs=None).config
    wide_cases = ((6, 4), (16, 3), (23, 3))
    runs = [(ws.EPI_STORE.value, "tile256", ws.rows_gemm_fp8_ws_wide_kernel, wide_cases),
            (ws.EPI_PUSH.value, "tile256", ws.rows_gemm_fp8_ws_wide_kernel, wide_cases),
            (ws.EPI_SWIGLU_BWD.value, "tile128", ws.rows_gemm_fp8_ws_kernel,
             ((16, down_dgrad.num_stages), (23, down_dgrad.num_stages)))]
    for epilogue, tile, kernel, cases in runs:
        for nk, stages in cases:
            if tile == "tile256":  # the plan's rows GEMM at this K
                planned = hx.fp8_rows(2048, nk * 128, 128, ws=True, programs=None).config
                assert (planned.BN, planned.num_stages) == (256, stages)
            else:
                assert down_dgrad.BN == 128
            args = dict(a_desc=f"tensordesc<fp8e4nv[{ws.HALF},128],{a_layout!r}>", as_ptr="*fp32", stride_asm="i32",
                        b_desc=f"tensordesc<fp8e4nv[{ws.BN},128],{b_layout!r}>", bs_ptr="*fp32", stride_bse="i32",
                        stride_bsn="i32", epi=epis[epilogue], tile_expert_ptr="*i32", num_tiles_ptr="*i32",
                        num_m="i32", N="i32:16", NK=Const(nk), STAGES=Const(stages), GROUP_M=Const(8),
                        SCHED_BM=Const(128), EPILOGUE=Const(epilogue))
            _line(f"{tile}/epilogue{epilogue}/nk{nk}", compile_args(kernel, args, num_warps=4))
    for nk in (16, 56, 23):  # gate/up at H 2048, 7168 and 2880 (a partial last block)
        _line(f"gate_up/nk{nk}", compile_args(ws.gate_up_swiglu_fp8_ws_kernel, gate_up_args(nk), num_warps=4))
    # the down dgrad with its epilogue partition (ws_common.dgrad_epilogue): SwiGLU at kimi-k2's K
    # (7168) and gpt-oss-120b's (2880, a partial last block), gpt-oss's backward (8-column slices),
    # g, u prefetched; as the launcher picks: consumers at 168 registers, 16-column slices (32 spill
    # in the partition), 4 stages beside the 64 KB handoff
    for nk, act, cols, pf in ((56, 0, 16, False), (23, 0, 16, False), (23, 3, 8, False), (56, 0, 16, True)):
        args = dict(a_desc=f"tensordesc<fp8e4nv[{ws.HALF},128],{a_layout!r}>", as_ptr="*fp32", stride_asm="i32",
                    b_desc=f"tensordesc<fp8e4nv[{ws.BN},128],{b_layout!r}>", bs_ptr="*fp32", stride_bse="i32",
                    stride_bsn="i32", gu_ptr="*bf16", stride_gum="i32:16", ws_ptr="*fp32", dgu_ptr="*bf16",
                    stride_dgum="i32:16", hw_ptr="*bf16", stride_hwm="i32:16", dwp_ptr="*fp32", stride_dwpm="i32",
                    tile_expert_ptr="*i32", num_tiles_ptr="*i32", num_m="i32", I="i32:16", NK=Const(nk),
                    STAGES=Const(4), GROUP_M=Const(8), SCHED_BM=Const(128), EPI_COLS=Const(cols),
                    CONSUMER_REGS=Const(168), ACT=Const(act), LIMIT=Const(7.0 if act == 3 else 0.0),
                    ALPHA=Const(1.702 if act == 3 else 0.0), PREFETCH=Const(pf))
        _line(f"dgrad_partition/nk{nk}/act{act}/cols{cols}/prefetch{int(pf)}",
              compile_args(ws.down_dgrad_fp8_ws_kernel, args, num_warps=4))
    b_half = gl.NVMMASharedLayout.get_default_for([ws.BN, 128], gl.float8e4nv)
    c_layout = gl.NVMMASharedLayout.get_default_for([1, 64, 64], gl.bfloat16)
    for M, N in ((7168, 2048), (2048, 7168), (2880, 2880)):  # kimi-k2's dW_down and dW_gate, gpt-oss-120b's
        args = dict(a_desc=f"tensordesc<fp8e4nv[{ws.HALF},128],{a_layout!r}>", as_ptr="*fp32", stride_asr="i32",
                    b_desc=f"tensordesc<fp8e4nv[{ws.BN},128],{b_half!r}>", bs_ptr="*fp32", stride_bsr="i32",
                    c_desc=f"tensordesc<bf16[1,64,64],{c_layout!r}>", expert_start_ptr="*i32",
                    expert_count_ptr="*i32", E="i32", M="i32:16", N="i32:16",
                    STAGES=Const(hx.fp8_wgrad(ws=True, programs=None).config.num_stages),
                    GROUP_M=Const(8))
        _line(f"wgrad/{M}x{N}", compile_args(ws.expert_wgrad_fp8_ws_kernel, args, num_warps=4))
    # the dgrads reading the forward copies transposed: deepseek-v4-pro's down (K = H 7168, the
    # SwiGLU backward) and gate/up (two parts of 24 blocks, pushed)
    bt = hx.fp8_down_dgrad(128, ws=True, programs=None, in_kernel=True)
    assert bt == hx.fp8_gate_up_dgrad(7168, 6144, 128, ws=True, programs=None, in_kernel=True)
    for epilogue, nk, nk0 in ((ws.EPI_SWIGLU_BWD.value, 56, 56), (ws.EPI_PUSH.value, 48, 24)):
        args = dict(a_desc=f"tensordesc<fp8e4nv[{ws.HALF},128],{a_layout!r}>", as_ptr="*fp32", stride_asm="i32",
                    b0_desc=f"tensordesc<fp8e4nv[{ws.BN},128],{b_layout!r}>",
                    b1_desc=f"tensordesc<fp8e4nv[{ws.BN},128],{b_layout!r}>", bs_ptr="*fp32", stride_bse="i32",
                    stride_bsn="i32", epi=epis[epilogue], tile_expert_ptr="*i32", num_tiles_ptr="*i32",
                    num_m="i32", N="i32:16", KR="i32", NK=Const(nk), NK0=Const(nk0),
                    STAGES=Const(bt.config.num_stages), LAG=Const(bt.lag), GROUP_M=Const(8), SCHED_BM=Const(128),
                    EPILOGUE=Const(epilogue))
        k = compile_args(ws.rows_gemm_fp8_ws_bt_kernel, args, num_warps=4)
        ptx = k.asm["ptx"]
        _line(f"bt/epilogue{epilogue}", k, transposes=ptx.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16"),
              word_stores=ptx.count("st.shared.b32"), byte_stores=len(re.findall(r"st\.shared(\.v\d)?\.b8", ptx)))


def test_warp_specialized_rows_gemm_compiles_unserialized():
    lines = run_compiled_check(__file__).splitlines()
    assert len(lines) == 20, lines
    for line in lines:
        f = line.split()
        c = dict(zip(f[1::2], map(int, f[2::2])))
        assert c["wgmma_e4m3"] >= 8 and c["warp_specialized"] == 1, line  # 4 per block, two consumers
        assert c["spills"] == 0 and c["serialized"] == 0 and c["wait_nonzero"] == 0, line
        assert c["shared"] <= 232448, line  # an sm_90 CTA's shared memory (227 KB)
        if f[0].startswith("bt/"):
            # the transposing producer: per 128 x 128 block (once in the loop, once per lag block after
            # it) 8 ldmatrix.x4 a warp in (the push's epilogue uses more) and 32 word stores a thread out,
            # no byte crossing shared memory alone
            from tabby.functional.heuristics import FP8_WS_BT_LAG

            copies = 1 + FP8_WS_BT_LAG
            assert c["transposes"] >= 8 * copies and c["byte_stores"] == 0, line
            assert c["word_stores"] == 32 * copies, line
        if f[0].startswith("wgrad"):  # the weight gradient stores by TMA (4 boxes a tile and consumer)
            assert c["tma_stores"] >= 4 and c["v4_stores"] == 0, line
        elif "epilogue2" not in f[0] and not f[0].startswith("dgrad_partition"):  # (the backward: its own layouts)
            assert c["v4_stores"] > 0, line


if __name__ == "__main__":
    _report()
