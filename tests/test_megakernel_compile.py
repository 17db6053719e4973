"""The forward megakernel compiles for Hopper (sm_90) on a machine without a GPU.

The interpreter runs the kernel's Python; it does not type-check it the way the compiler does
(e.g. a variable with different types in the branches of an ``if``). So each variant is compiled
through Triton's whole pipeline (see sm90.py) at the qwen3-30b-a3b shape with the default tiles.
"""
import sys

import pytest

from sm90 import compile_for_sm90, run_compiled_check

H, I, IS, BM = 2048, 768, 256, 128


DESCS = ["xs_desc", "wg_desc", "wu_desc", "h_desc", "wd_desc", "x_desc", "sg_desc", "su_desc", "hsh_desc", "sd_desc",
         "xs_half_desc", "h_half_desc"]


def _compile(has_shared: bool, comm: int, bn_dn: int = 256, tma: bool = False, save: bool = False, half: bool = True,
             trace: bool = False, warps: int = 8, dn_cols: int = 1, fill_stages: int = 1, ahead: bool = True,
             poll2: bool = True, wp: int = 2, tile_ready: bool = True, peers: bool = True, local_a: bool = False,
             early: bool = False, tokens: bool = False):
    from tabby.ops import megakernel_fwd as mk

    # 4 warps (MoEConfig.mega_warps): two programs per SM, 64-column gate/up tiles, 3 stages
    bn_gu, bn_gus, bn_dns, stages = (64, 64, 128, 3) if warps == 4 else (128, 128, 256, 4)
    const = dict(NS=32, FS=4, GM=2, ABLATE=0, COMM=comm, HAS_SHARED=has_shared, H=H, I=I, IS=IS if has_shared else 0, BM=BM, BH=512,
                 BN_GU=bn_gu, BK_GU=64, BN_DN=bn_dn, BK_DN=64, BN_GUS=bn_gus, BK_GUS=64, BN_DNS=bn_dns, BK_DNS=64,
                 INTERPRET=False, TMA=tma, SAVE=save, HALF=half, TRACE_EV=64 if trace else 0, DN_COLS=dn_cols,
                 FILL_STAGES=fill_stages, AHEAD=ahead, NW=warps, POLL2=poll2, WP=wp, TILE_READY=tile_ready,
                 PEERS=peers, X_SLOT=4, DONE_SLOT=1, DONE_WAIT=peers, LOCAL_A=local_a, EARLY=early, TOKENS=tokens,
                 X_PULL=5)
    ptrs = {n: "*i32" for n in ["cnt_ptr", "err_ptr", "epoch_ptr", "row_src", "tile_expert", "num_tiles",
                                "sh_tiles", "sh_n"]}
    ptrs.update({n: "*i64" for n in ["x_ptrs", "y_ptrs"]})
    if save:  # what a differentiated forward keeps: router-weight table, row weights, g | u
        ptrs.update(w_ptrs="*i64", row_w="*fp32", gu_save="*bf16")
    else:
        const.update(w_ptrs=None, row_w=None, gu_save=None)
    ptrs["wait_budget"] = "i64"  # nanoseconds: 60 s does not fit an i32
    ptrs.update(flag_ptrs="*i64", my_flags="*i32")  # fwd_peer_flags: every rank's flags, this rank's
    ptrs["x_rows"] = "*bf16"  # fwd_local_rows: the layer's input
    if tokens:  # fwd_pull_tokens: the schedule's tile order, its count of local tiles, the pull's counter
        ptrs.update(tile_order="*i32", local_tiles="*i32", pull_idx="i32")
    else:
        const.update(tile_order=None, local_tiles=None)
    if trace:  # fwd_trace_events: the ticket trace (clock64 and globaltimer reads)
        ptrs["trace"] = "*i64"
    else:
        const["trace"] = None
    ptrs.update({n: "*bf16" for n in ["xs_ring", "h_ring", "w_gate", "w_up", "w_down", "x", "s_gate", "s_up",
                                      "s_down", "h_sh", "extra"]})
    if tma:  # host tensor descriptors: element type and block shape are part of the signature
        blocks = [[BM, 64], [1, bn_gu, 64], [1, bn_gu, 64], [BM, 64], [1, bn_dn, 64],
                  [BM, 64], [1, bn_gus, 64], [1, bn_gus, 64], [BM, 64], [1, bn_dns, 64], [BM // 2, 64], [BM // 2, 64]]
        ptrs.update({n: "tensordesc<bf16[%s]>" % ",".join(map(str, b)) for n, b in zip(DESCS, blocks)})
        if not half:  # as the launcher passes them: no half-tile descriptors
            for n in DESCS[10:]:
                del ptrs[n]
                const[n] = None
    else:
        const.update({n: None for n in DESCS})
    # strides multiples of 16, as the JIT specializes them at these shapes (the loads then pipeline)
    k = compile_for_sm90(mk.moe_fwd_megakernel, const, ptrs, divisible=("wg_e", "wg_n", "wd_e", "wd_n", "TK"),
                         num_warps=warps, num_stages=stages)  # MoEConfig.fwd_num_stages
    assert "ptx" in k.asm and k.asm.get("cubin")
    per_sm = 8 // warps  # programs that must fit one SM
    assert k.metadata.shared * per_sm <= 232448, \
        f"{per_sm} x {k.metadata.shared} bytes of shared memory: more than an H100/H200 SM has"
    ttgir = k.asm["ttgir"]
    # every GEMM K loop is software-pipelined: async copies (cp.async or TMA) into shared memory
    n_async = ttgir.count("async_tma_copy_global_to_local" if tma else "async_copy_global_to_local")
    assert n_async > 0, "no pipelined loads"
    if tma:  # the GEMMs load through TMA: ordinary async copies are the fills', only when pipelined
        # (and, with local_a, the gate/up tiles' gathered A rows; with tokens there are no fills)
        n_fill_async = ttgir.count("async_copy_global_to_local")
        assert (n_fill_async > 0) == (fill_stages > 1 or local_a), f"fill_stages={fill_stages}: {n_fill_async} async copies"
    print(f"ok shared={has_shared} comm={comm} bn_dn={bn_dn} tma={tma} save={save} half={half} "
          f"trace={trace} warps={warps} dn_cols={dn_cols} fill_stages={fill_stages} ahead={ahead} poll2={poll2} "
          f"wp={wp} tile_ready={tile_ready} peers={peers} local_a={local_a} early={early} tokens={tokens} "
          f"smem={k.metadata.shared} async={n_async}")


_DEFAULT_TICKETS = (True, True)  # fwd_ticket_ahead, fwd_poll_together
_CASES = [c + _DEFAULT_TICKETS for c in [
    (False, 0, 256, False, False, True, False, 8, 1, 1), (True, 0, 256, False, True, True, True, 8, 1, 1),
    (True, 16, 256, False, False, False, True, 8, 1, 1), (False, 0, 128, False, False, True, False, 8, 2, 1),
    (True, 0, 256, True, True, True, False, 8, 1, 1), (False, 0, 256, True, False, False, False, 8, 1, 1),
    (True, 0, 128, True, True, True, False, 4, 1, 1), (True, 16, 128, True, False, True, False, 4, 1, 1),
    (True, 0, 256, True, True, True, False, 8, 4, 1), (False, 0, 128, True, True, True, False, 4, 4, 1),
    (False, 0, 128, True, True, True, True, 4, 2, 1),  # traced, as `tabby tune --trace` runs the TMA defaults
    # pipelined fills (fwd_fill_stages) at qwen3-30b-a3b's 4-warp and qwen3.5-397b's 8-warp configs
    (False, 0, 128, True, True, True, False, 4, 2, 3), (True, 0, 256, True, True, True, False, 8, 2, 3),
    (True, 16, 128, True, False, True, False, 4, 1, 3)]] + [
    # the next ticket taken after the release, each wait polling on its own (fwd_ticket_ahead /
    # fwd_poll_together False), at both warp counts
    (False, 0, 128, True, True, True, False, 4, 2, 3, False, False),
    (True, 0, 256, True, True, True, False, 8, 2, 1, False, False)] + [
    # fills that load each row's table entry after its source, counting per ring slot
    # (fwd_fill_table / fwd_tile_ready False), at qwen3-30b-a3b's differentiated 4-warp config
    (False, 0, 128, True, True, True, False, 4, 2, 3, True, True, 0, False)] + [
    # the pass's flags in signal/wait launches around the kernel (fwd_peer_flags False), at
    # qwen3-30b-a3b's differentiated 4-warp config and qwen3.5-397b's 8-warp one
    (False, 0, 128, True, True, True, False, 4, 2, 3, True, True, 2, True, False),
    (True, 0, 256, True, True, True, False, 8, 2, 1, True, True, 2, True, False)] + [
    # gate/up reading this rank's rows from x (fwd_local_rows), at qwen3-30b-a3b's differentiated
    # 4-warp config and ring-only, and qwen3.5-397b's 8-warp one
    (False, 0, 128, True, True, True, False, 4, 2, 3, True, True, 2, True, True, True),
    (False, 0, 128, True, False, True, False, 4, 2, 3, True, True, 2, True, True, True),
    (True, 0, 256, True, True, True, False, 8, 2, 1, True, True, 2, True, True, True)] + [
    # the next ticket taken before a GEMM's epilogue (fwd_early_ticket), at qwen3-30b-a3b's
    # differentiated 4-warp config and qwen3.5-397b's 8-warp one (shared expert), and traced
    (False, 0, 128, True, True, True, False, 4, 2, 3, True, True, 2, True, True, True, True),
    (True, 0, 256, True, True, True, False, 8, 2, 1, True, True, 2, True, True, True, True),
    (False, 0, 128, True, True, True, True, 4, 2, 3, True, True, 2, True, True, True, True)] + [
    # the peers' x pulled whole, no fills (fwd_pull_tokens), at qwen3-30b-a3b's differentiated 4-warp
    # config, ring-only, with the early ticket, and qwen3.5-397b's 8-warp one (shared expert)
    (False, 0, 128, True, True, True, False, 4, 2, 3, True, True, 2, True, True, True, False, True),
    (False, 0, 128, True, False, True, False, 4, 2, 3, True, True, 2, True, True, True, False, True),
    (False, 0, 128, True, True, True, False, 4, 2, 3, True, True, 2, True, True, True, True, True),
    (True, 0, 256, True, True, True, False, 8, 2, 1, True, True, 2, True, True, True, False, True)]


_CASES = [c + (2, True) if len(c) == 12 else c for c in _CASES]  # default: EP2 tables, per-tile fill counters
_CASES = [c + (True,) if len(c) == 14 else c for c in _CASES]  # default: flags set and waited in the kernel
_CASES = [c + (False,) if len(c) == 15 else c for c in _CASES]  # default: local rows filled like the others
_CASES = [c + (False,) if len(c) == 16 else c for c in _CASES]  # default: the next ticket taken at the end
_CASES = [c + (False,) if len(c) == 17 else c for c in _CASES]  # default: rows filled by fill tickets


@pytest.mark.parametrize("has_shared,comm,bn_dn,tma,save,half,trace,warps,dn_cols,fill_stages,ahead,poll2,wp,"
                         "tile_ready,peers,local_a,early,tokens", _CASES)
def test_megakernel_compiles_for_sm90(has_shared, comm, bn_dn, tma, save, half, trace, warps, dn_cols, fill_stages,
                                      ahead, poll2, wp, tile_ready, peers, local_a, early, tokens):
    args = (has_shared, comm, bn_dn, tma, save, half, trace, warps, dn_cols, fill_stages, ahead, poll2, wp, tile_ready,
            peers, local_a, early, tokens)
    assert "ok" in run_compiled_check(__file__, *(str(int(v)) for v in args))


if __name__ == "__main__":
    _compile(*(int(a) if i in (1, 2, 7, 8, 9, 12) else bool(int(a)) for i, a in enumerate(sys.argv[1:19])))
