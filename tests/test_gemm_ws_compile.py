"""The warp-specialized bf16 GEMMs (tabby/ops/gemm/bf16_ws.py) compile for sm_90a, on a machine
without a GPU, to the structure they were written for: the rows GEMM (the down projection) for each
epilogue (stored, pushed) at 128 x 256 and 128 x 128 tiles, with a bias and on a transposed B, and
gate/up in every weight layout (Tabby's, transposed, gpt-oss's interleaved), with biases, gated or
not: warp-specialized (setmaxnreg), no serialized wgmma (ptxas's C7514 / C7515), no spills, one
wgmma group kept in flight (wait 1; gate/up's pair: wait 2), shared memory within a CTA's, and the
stores in 16-byte vectors. Values: test_gemm_ws_gpu.py, test_layouts_gpu.py, test_biases_gpu.py."""
import re

from sm90 import Const, compile_args, ptxas_report, run_compiled_check

SMEM_MAX = 232448  # an sm_90 CTA's shared memory (227 KB)


def _line(name, k):
    ptx, rep = k.asm["ptx"], ptxas_report(k)
    print(name, "wgmma", len(re.findall(r"wgmma\.mma_async\S*\.bf16\.bf16", ptx)),
          "wait1", len(re.findall(r"wgmma\.wait_group\.sync\.aligned 1;", ptx)),
          "wait2", len(re.findall(r"wgmma\.wait_group\.sync\.aligned 2;", ptx)),
          "v4_stores", len(re.findall(r"st\.global(\.\w+)*\.v4", ptx)), "shared", k.metadata.shared,
          "spills", sum(int(n) for n in re.findall(r"(\d+) bytes spill", rep)),
          "serialized", int("are serialized" in rep), "warp_specialized", int("setmaxnreg" in ptx))


def _report():
    from triton.experimental.gluon import language as gl

    from tabby.ops.gemm import bf16_ws as ws

    def desc(block):
        return f"tensordesc<bf16[{block[0]},{block[1]}],{gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)!r}>"

    epis = {ws.EPI_STORE.value: ("*bf16", "i32:16"), ws.EPI_PUSH.value: ("*i32", "*i64", "i32", "i32:16", "*bf16")}
    # (epilogue, tile_n, stages, B transposed, bias): the down projection stored (the local path) and pushed
    for epilogue, tile_n, stages, kn, bias in ((ws.EPI_STORE.value, 256, 4, False, False),
                                               (ws.EPI_PUSH.value, 256, 4, False, False),
                                               (ws.EPI_PUSH.value, 256, 3, False, False),
                                               (ws.EPI_STORE.value, 128, 4, False, False),
                                               (ws.EPI_PUSH.value, 256, 4, True, True),
                                               (ws.EPI_PUSH.value, 256, 4, False, True)):
        args = dict(a_desc=desc([64, 64]), b_desc=desc([64, tile_n] if kn else [tile_n, 64]), epi=epis[epilogue],
                    tile_expert_ptr="*i32", num_tiles_ptr="*i32", num_m="i32", N="i32:16", b_pitch="i32:16", NK="i32",
                    TILE_N=Const(tile_n), STAGES=Const(stages), GROUP_M=Const(8), SCHED_BM=Const(128),
                    EPILOGUE=Const(epilogue), B_KN=Const(kn))
        if bias:
            args.update(HAS_BIAS=Const(True), bias_ptr="*bf16", stride_bias_e="i32")
        _line(f"rows/epilogue{epilogue}/tile{tile_n}/stages{stages}/kn{int(kn)}/bias{int(bias)}",
              compile_args(ws.rows_gemm_ws_kernel, args, num_warps=4))
    blocks = {0: [128, 64], 1: [64, 128], 2: [64, 256]}  # W_LAYOUT -> the weights' boxes
    # (stages, W_LAYOUT, gated, biases, ACT): plain SwiGLU; gpt-oss's experts transposed and as stored
    # (interleaved, biases of column stride 2); SwiGLU with biases; relu2 (ungated)
    for stages, lay, gated, bias, act in ((3, 0, True, False, 0), (4, 0, True, False, 0), (4, 1, True, True, 3),
                                          (4, 2, True, True, 3), (4, 0, True, True, 0), (4, 0, False, False, 5),
                                          (4, 1, False, False, 5)):
        args = dict(a_desc=desc([64, 64]), wg_desc=desc(blocks[lay]), wu_desc=desc(blocks[lay]), h_ptr="*bf16",
                    stride_hm="i32:16", gu_ptr="*bf16", stride_gum="i32:16", tile_expert_ptr="*i32",
                    num_tiles_ptr="*i32", num_m="i32", I="i32:16", w_pitch="i32:16", NK="i32", STAGES=Const(stages),
                    GROUP_M=Const(8), SCHED_BM=Const(128), SAVE_GU=Const(True), ACT=Const(act),
                    LIMIT=Const(7.0 if act == 3 else 0.0), ALPHA=Const(1.702 if act == 3 else 0.0),
                    W_LAYOUT=Const(lay), GATED=Const(gated))
        if bias:
            args.update(HAS_BIAS=Const(True), bg_ptr="*bf16", bu_ptr="*bf16", stride_bias_e="i32",
                        BIAS_STRIDE_N=Const(2 if lay == 2 else 1))
        pair = gated and lay != 2  # g's and u's wgmma a block
        _line(f"gate_up{'_pair' if pair else ''}/stages{stages}/layout{lay}/gated{int(gated)}/bias{int(bias)}/act{act}",
              compile_args(ws.gate_up_swiglu_ws_kernel, args, num_warps=4))
    # gate/up with its epilogue partition (3 stages beside the 64 KB handoff): SwiGLU; gpt-oss's
    # transposed and interleaved (two 128-column products) with biases; relu2
    for lay, gated, bias, act in ((0, True, False, 0), (0, True, False, 3), (1, True, True, 3), (2, True, True, 3),
                                 (0, False, False, 5)):
        args = dict(a_desc=desc([64, 64]), wg_desc=desc(blocks[lay]), wu_desc=desc(blocks[lay]), h_ptr="*bf16",
                    stride_hm="i32:16", gu_ptr="*bf16", stride_gum="i32:16", tile_expert_ptr="*i32",
                    num_tiles_ptr="*i32", num_m="i32", I="i32:16", w_pitch="i32:16", NK="i32", STAGES=Const(3),
                    GROUP_M=Const(8), SCHED_BM=Const(128), SAVE_GU=Const(True), EPI_COLS=Const(16),
                    CONSUMER_REGS=Const(168), ACT=Const(act), LIMIT=Const(7.0 if act == 3 else 0.0),
                    ALPHA=Const(1.702 if act == 3 else 0.0), W_LAYOUT=Const(lay), GATED=Const(gated))
        if bias:
            args.update(HAS_BIAS=Const(True), bg_ptr="*bf16", bu_ptr="*bf16", stride_bias_e="i32",
                        BIAS_STRIDE_N=Const(2 if lay == 2 else 1))
        _line(f"gate_up{'_pair' if gated else ''}_handoff/stages3/layout{lay}/gated{int(gated)}/bias{int(bias)}"
              f"/act{act}",
              compile_args(ws.gate_up_handoff_ws_kernel, args, num_warps=4))
    for pairs, stages in ((1, 4), (2, 4), (2, 3)):
        args = dict(a0_desc=desc([64, 64]), a1_desc=desc([64, 64]), b_desc=desc([64, 256]), c0_ptr="*bf16",
                    c1_ptr="*bf16", stride_ce="i32:16", stride_cm="i32:16", expert_start_ptr="*i32",
                    expert_count_ptr="*i32", E="i32", M="i32:16", N="i32:16", NUM_PAIRS=Const(pairs),
                    STAGES=Const(stages), GROUP_M=Const(8))
        _line(f"wgrad/pairs{pairs}/stages{stages}", compile_args(ws.expert_wgrad_ws_kernel, args, num_warps=4))
    # the down dgrad with its epilogue partition: (tile_n, stages, B read N-major (Wd [E, H, I]),
    # slice, ACT, dg/du interleaved), the slices as the launcher picks them: SwiGLU; gpt-oss's on a
    # transposed down_proj, dg, du interleaved too (at 128 columns only: at 256 its backward spills
    # beside the consumers' 168 registers); relu2 (ungated)
    # (and each width with the epilogue's g, u prefetched)
    for tile_n, stages, kn, cols, act, paired, pf in (
            (128, 4, True, 32, 0, False, False), (128, 4, False, 8, 3, False, False),
            (128, 4, False, 8, 3, True, False), (256, 3, True, 16, 0, False, False),
            (256, 3, False, 16, 0, False, False), (256, 3, True, 16, 5, False, False),
            (128, 4, True, 32, 0, False, True), (256, 3, True, 16, 0, False, True)):
        args = dict(a_desc=desc([64, 64]), b_desc=desc([64, tile_n] if kn else [tile_n, 64]), gu_ptr="*bf16",
                    stride_gum="i32:16", ws_ptr="*fp32", dgu_ptr="*bf16", stride_dgum="i32:16", hw_ptr="*bf16",
                    stride_hwm="i32:16", dwp_ptr="*fp32", stride_dwpm="i32", tile_expert_ptr="*i32",
                    num_tiles_ptr="*i32", num_m="i32", I="i32:16", b_pitch="i32:16", NK="i32", STAGES=Const(stages),
                    GROUP_M=Const(8), SCHED_BM=Const(128), B_KN=Const(kn), EPI_COLS=Const(cols),
                    CONSUMER_REGS=Const(120 if tile_n == 128 else 168), TILE_N=Const(tile_n), ACT=Const(act),
                    LIMIT=Const(7.0 if act == 3 else 0.0), ALPHA=Const(1.702 if act == 3 else 0.0),
                    DGU_PAIRED=Const(paired), PREFETCH=Const(pf))
        _line(f"dgrad{'_pair' if tile_n == 256 else ''}/tile{tile_n}/stages{stages}/kn{int(kn)}/cols{cols}/act{act}"
              f"/paired{int(paired)}/prefetch{int(pf)}", compile_args(ws.down_dgrad_ws_kernel, args, num_warps=4))


def test_warp_specialized_bf16_gemms_compile():
    lines = run_compiled_check(__file__).splitlines()
    assert len(lines) == 29, lines
    for line in lines:
        f = line.split()
        c = dict(zip(f[1::2], map(int, f[2::2])))
        assert c["warp_specialized"] == 1 and c["spills"] == 0 and c["serialized"] == 0, line
        assert c["shared"] <= SMEM_MAX, line
        if f[0].startswith(("gate_up_pair", "dgrad_pair")):  # two wgmmas a block, the previous pair waited for
            assert c["wgmma"] >= 4 and c["wait2"] >= 2 and c["v4_stores"] > 0, line
        else:  # a block's wgmma per consumer, the one before it waited for
            assert c["wgmma"] >= 2 and c["wait1"] >= 2 and c["v4_stores"] > 0, line


if __name__ == "__main__":
    _report()
