"""The backward pass (both forwards' saved state)."""
from __future__ import annotations


import torch

from ..ops import comm, gemm, sync
from .workspace import BWD, BWD_READY
from .forward import KeptRows, MegaSaved
from .plan import Plan
from .probe import Probe, mark
from .steps import finish_backward, pull_routed_rows, signal_and_wait


def routed_rows_for_wgrad(ws, plan: Plan, kept: KeptRows, TK, k):
    """The routed rows [R, H] of a forward that kept them partly (local rows: xs without this rank's
    rows, filled in here from x) or not at all (the token pull: xs is every rank's tokens
    [W*T, H], rows gathered from them and x into a new buffer); local copies only. A copy, not a
    weight gradient that gathers its own rows: that measured slower (docs/performance.md, "Local
    rows")."""
    sched, xs, x = kept.sched, kept.xs, kept.x
    W, T, H = ws.world_size, x.shape[0], x.shape[1]
    if kept.missing == "local":
        table = torch.full((W,), x.data_ptr(), dtype=torch.int64, device=x.device)
        pull_routed_rows(plan, sched, table, xs, TK, k, only_rank=ws.rank)
        return xs
    # rank src's rows at xs[src*T:], this rank's at x: an address table of local buffers
    # (built by device ops only: assigning an element from a Python int would sync with the host;
    # x is 16-byte aligned, as the copy's vectors need)
    src = torch.arange(W, dtype=torch.int64, device=x.device)
    table = torch.where(src == ws.rank, x.data_ptr(), src * (T * H * xs.element_size()) + xs.data_ptr())
    rows = xs.new_empty((sched.R_max, H))
    pull_routed_rows(plan, sched, table, rows, TK, k)
    return rows


def moe_backward(ws, plan: Plan, dy, saved, w_gate, w_up, w_down, probe: Probe | None = None):
    """Backward pass on one rank. Returns (dx, d topk_weights [T, k] fp32, dw_gate, dw_up, dw_down).

    ``saved``: a ``KeptRows`` (xs, g/u and row weights kept; from ``moe_forward``, or
    ``moe_forward_mega`` with ``save``), or a ``MegaSaved`` from
    ``moe_forward_mega`` (only x and topk_weights kept): x and topk_weights are then published
    again with dy, under BWD_READY, and xs, the row weights and g, u are recomputed (pull +
    gate/up). Re-publishing x_pub / w_pub here is safe: a peer reads them only between this
    rank's READY signal of a pass and its own DONE signal of that pass, and this rank starts a
    pass only after every peer's DONE of its previous pass (the forward waited FWD_DONE, an
    earlier backward BWD_DONE); the next forward re-publishes x before its FWD_READY.
    """
    recompute = isinstance(saved, MegaSaved)
    sched = saved.sched
    if not recompute:
        xs, gu, row_w = saved.xs, saved.gu, saved.row_w
    T, H = dy.shape
    k, TK = sched.k, sched.T * sched.k
    mark(probe, "bwd:start")
    if recompute:
        ws.x_pub.copy_(saved.x)
        ws.w_pub.copy_(saved.topk_weights)
    ws.dy_pub.copy_(dy)
    signal_and_wait(ws, BWD_READY, BWD, True, sync.ERR_WAIT_PEER_READY, plan)
    mark(probe, "bwd:publish+wait")
    if recompute:
        xs = dy.new_empty((sched.R_max, H))
        row_w = torch.empty(sched.R_max, dtype=torch.float32, device=dy.device)
        pull_routed_rows(plan, sched, ws.ptrs["x_pub"], xs, TK, k, ws.ptrs["w_pub"], row_w)
        _, gu = gemm.gate_up_swiglu(xs, w_gate, w_up, sched.tile_expert, sched.num_tiles, save_gu=True,
                                    config=plan.gemm_config(gemm.KIND_GATE_UP))
        mark(probe, "bwd:recompute")

    dys = dy.new_empty((sched.R_max, H))
    pull_routed_rows(plan, sched, ws.ptrs["dy_pub"], dys, TK, k)
    mark(probe, "bwd:dispatch_dy")
    dgu, hw, dw_part = gemm.down_dgrad_swiglu_bwd(dys, w_down, gu, row_w, sched.tile_expert, sched.num_tiles,
                                                  config=plan.gemm_config(gemm.KIND_DGRAD_SWIGLU))
    mark(probe, "bwd:down_dgrad+swiglu")
    gemm.gate_up_dgrad_push(dgu, w_gate, w_up, sched.tile_expert, sched.num_tiles, sched.row_src,
                            ws.ptrs["dx_in"], TK, config=plan.gemm_config(gemm.KIND_GATE_UP_DGRAD))
    mark(probe, "bwd:gate_up_dgrad+push")
    dw_rows = gemm.reduce_dw(dw_part)
    comm.push_scalars_kernel[(64,)](dw_rows, sched.row_src, sched.num_tiles, ws.ptrs["dw_in"], TK,
                                    BR=256, TILE_ROWS=plan.tile_m)
    mark(probe, "bwd:router_grad")
    dw_down = gemm.expert_wgrad(dys, hw, sched.expert_start, sched.expert_count, out_dtype=w_down.dtype)
    if not recompute and saved.missing:  # the routed rows the weight gradient reads, contiguous
        xs = routed_rows_for_wgrad(ws, plan, saved, TK, k)
        mark(probe, "bwd:routed_rows")
    dw_gate, dw_up = gemm.expert_wgrad_gate_up(dgu, xs, sched.expert_start, sched.expert_count,
                                               out_dtype=w_gate.dtype)
    mark(probe, "bwd:wgrad")
    dx, dtopk = finish_backward(ws, plan, dy, T, k, probe)
    return dx, dtopk, dw_gate, dw_up, dw_down

