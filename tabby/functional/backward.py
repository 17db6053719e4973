"""The backward pass (both forwards' saved state)."""
from __future__ import annotations


import torch

from ..ops import comm, sync
from ..ops.gemm import bf16 as gemm
from ..validate import LAYOUT_KN, LAYOUT_KN_PAIRED, LAYOUT_NK
from . import memory
from .memory import layer_buffers
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
    return _rows_for_wgrad(ws, plan, kept.sched, kept.xs, kept.x, kept.missing, TK, k)


def _rows_for_wgrad(ws, plan: Plan, sched, xs, x, missing, TK, k, out=None):
    """``routed_rows_for_wgrad`` on the kept tensors; the token pull's rows go into ``out`` when
    given (a dead [R_max, H] buffer), else a new one."""
    W, T, H = ws.world_size, x.shape[0], x.shape[1]
    if missing == "local":
        table = torch.full((W,), x.data_ptr(), dtype=torch.int64, device=x.device)
        pull_routed_rows(plan, sched, table, xs, TK, k, only_rank=ws.rank)
        return xs
    # rank src's rows at xs[src*T:], this rank's at x: an address table of local buffers
    # (built by device ops only: assigning an element from a Python int would sync with the host;
    # x is 16-byte aligned, as the copy's vectors need)
    src = torch.arange(W, dtype=torch.int64, device=x.device)
    table = torch.where(src == ws.rank, x.data_ptr(), src * (T * H * xs.element_size()) + xs.data_ptr())
    rows = layer_buffers(plan).empty("wgrad_rows", x.device) if out is None else out
    pull_routed_rows(plan, sched, table, rows, TK, k)
    return rows


def moe_backward(ws, plan: Plan, dy, saved, w_gate, w_up, w_down, probe: Probe | None = None, owned: bool = False,
                 biases=None):
    """Backward pass on one rank. Returns (dx, d topk_weights [T, k] fp32, dw_gate, dw_up, dw_down), and
    with ``biases`` (b_gate, b_up, b_down) their gradients as a sixth element (a tuple, the biases'
    dtype). A row's router-weight gradient then also takes dy . b_down[e] (its expert's output
    includes the bias); the biases' gradients are each expert's rows of dg, du and w dy summed in a
    fixed order (``gemm.expert_row_sums``). gpt-oss's interleaved weights (``fused_gate_up_grads``):
    dw_gate is gate_up_proj's whole gradient [E, H, 2I] and dw_up empty, d b_gate gate_up_proj_bias's
    [E, 2I] and d b_up empty (``split_gate_up_grads`` makes the halves' views).

    ``saved``: a ``KeptRows`` (xs, g/u and row weights kept; from ``moe_forward``, or
    ``moe_forward_mega`` with ``save``), or a ``MegaSaved`` from
    ``moe_forward_mega`` (only x and topk_weights kept): x and topk_weights are then published
    again with dy, under BWD_READY, and xs, the row weights and g, u are recomputed (pull +
    gate/up). Re-publishing x_pub / w_pub here is safe: a peer reads them only between this
    rank's READY signal of a pass and its own DONE signal of that pass, and this rank starts a
    pass only after every peer's DONE of its previous pass (the forward waited FWD_DONE, an
    earlier backward BWD_DONE); the next forward re-publishes x before its FWD_READY.

    ``owned``: nothing else holds the kept rows (the caller dropped its references; the autograd
    Functions of ``tabby.moe``, where a backward runs once): this pass takes the tensors out of
    ``saved`` (its fields are set to None), writes dg | du over g | u and frees each buffer once
    the last launch that reads it is queued, so that the weight gradients' outputs are allocated
    after the routed buffers they no longer need are freed. Otherwise (the registered operator,
    whose kept tensors are autograd's saved inputs) the kept rows are only read. Recomputed rows
    are always owned. The same launches and bits either way; only their buffers and the order of
    the two weight gradients differ. Nothing here reads anything back to the host.
    """
    recompute = isinstance(saved, MegaSaved)
    sched = saved.sched
    missing, x_kept = "", None
    if recompute:
        x_pub, w_pub = saved.x, saved.topk_weights
    else:
        xs, gu, row_w = saved.xs, saved.gu, saved.row_w
        missing, x_kept = saved.missing, saved.x
        if owned:  # the tensors are ours now: the dataclass lets go of them
            saved.xs = saved.gu = saved.row_w = saved.x = None
    del saved
    owned = owned or recompute
    T, H = dy.shape
    I = w_gate.shape[1]
    k, TK = sched.k, sched.T * sched.k
    mark(probe, "bwd:start")
    if recompute:
        ws.x_pub.copy_(x_pub)
        ws.w_pub.copy_(w_pub)
        del x_pub, w_pub
    ws.dy_pub.copy_(dy)
    signal_and_wait(ws, BWD_READY, BWD, True, sync.ERR_WAIT_PEER_READY, plan)
    mark(probe, "bwd:publish+wait")
    bufs = layer_buffers(plan)
    dev = dy.device
    if recompute:
        xs, row_w = bufs.empty("xs", dev), bufs.empty("row_w", dev)
        pull_routed_rows(plan, sched, ws.ptrs["x_pub"], xs, TK, k, ws.ptrs["w_pub"], row_w)
        _, gu = gemm.gate_up_swiglu(xs, w_gate, w_up, sched.tile_expert, sched.num_tiles, h=bufs.empty("h", dev),
                                    gu=bufs.empty("gu", dev), config=plan.gemm_config(gemm.KIND_GATE_UP),
                                    act=plan.activation, biases=biases[:2] if biases is not None else None)
        del _
        mark(probe, "bwd:recompute")
    R = sched.R_max
    halves_of_one = owned and _fused_halves(w_gate, w_up)  # (gate/up's gradient written whole: _gate_up_wgrad)
    tokens = missing == "tokens"
    gate_up_first = owned and memory.gate_up_wgrad_first(R, H, I, w_gate.shape[0], xs.shape[0] if tokens else 0)

    dys = bufs.empty("dys", dev)
    pull_routed_rows(plan, sched, ws.ptrs["dy_pub"], dys, TK, k)
    mark(probe, "bwd:dispatch_dy")
    # dg | du over g | u when they are ours: each tile reads its own g, u columns before it writes them
    # (not interleaved: gpt-oss's order, a tile's dg, du land on other tiles' g columns)
    paired = plan.dims.layout == LAYOUT_KN_PAIRED
    in_place = owned and not paired and gu.dtype == dys.dtype and gu.is_contiguous() and gu.shape == (R, 2 * I)
    dgu, hw, dw_part = gemm.down_dgrad_swiglu_bwd(dys, w_down, gu, row_w, sched.tile_expert, sched.num_tiles,
                                                  dgu=gu if in_place else bufs.empty("dgu", dev),
                                                  hw=bufs.empty("hw", dev), dw_part=bufs.empty("dw_part", dev),
                                                  config=plan.gemm_config(gemm.KIND_DGRAD_SWIGLU),
                                                  act=plan.activation, dgu_paired=paired)
    dbiases = None
    if biases is not None:
        dbiases = _bias_grads(biases, dgu, dys, row_w, sched, I, paired)
    del gu, row_w
    mark(probe, "bwd:down_dgrad+swiglu")
    gated = plan.activation.gated
    gemm.gate_up_dgrad_push(dgu, w_gate, w_up, sched.tile_expert, sched.num_tiles, sched.row_src,
                            ws.ptrs["dx_in"], TK, config=plan.gemm_config(gemm.KIND_GATE_UP_DGRAD), gated=gated,
                            dgu_paired=paired)
    mark(probe, "bwd:gate_up_dgrad+push")
    dw_rows = gemm.reduce_dw(dw_part, out=bufs.empty("dw_rows", dev))
    del dw_part
    if biases is not None:  # + dy . b_down[e] for each row: a bmm over the row tiles (a fixed order)
        BM = plan.tile_m
        b_tiles = biases[2][sched.tile_expert.clamp_min(0).long()]  # [tiles, H] (padding tiles: any expert's)
        dw_rows += torch.bmm(dys.view(-1, BM, H), b_tiles.unsqueeze(-1)).view(-1).float()
    comm.push_scalars_kernel[(64,)](dw_rows, sched.row_src, sched.num_tiles, ws.ptrs["dw_in"], TK,
                                    BR=256, TILE_ROWS=plan.tile_m)
    del dw_rows
    mark(probe, "bwd:router_grad")
    if gate_up_first:
        if missing:  # the routed rows the weight gradient reads, contiguous
            xs = _rows_for_wgrad(ws, plan, sched, xs, x_kept, missing, TK, k)  # (tokens: drops them)
            mark(probe, "bwd:routed_rows")
        dw_gate, dw_up = _gate_up_wgrad(plan, dgu, xs, sched, w_gate.dtype, halves_of_one)
        del dgu, xs
        dw_down = _down_wgrad(plan, dys, hw, sched, w_down.dtype)
        del dys, hw
    else:
        dw_down = _down_wgrad(plan, dys, hw, sched, w_down.dtype)
        del hw
        if missing:  # the token pull's rows gathered into dys's buffer (read by dW_down, queued before)
            xs = _rows_for_wgrad(ws, plan, sched, xs, x_kept, missing, TK, k,
                                 out=dys if missing == "tokens" else None)
            mark(probe, "bwd:routed_rows")
        del dys
        dw_gate, dw_up = _gate_up_wgrad(plan, dgu, xs, sched, w_gate.dtype, halves_of_one)
        del dgu, xs
    mark(probe, "bwd:wgrad")
    dx, dtopk = finish_backward(ws, plan, dy, T, k, probe)
    if biases is not None:
        return dx, dtopk, dw_gate, dw_up, dw_down, dbiases
    return dx, dtopk, dw_gate, dw_up, dw_down


def _gate_up_wgrad(plan: Plan, dgu, xs, sched, dtype, halves_of_one: bool = False):
    """(dW_gate, dW_up) [E, I, H], laid out as the weights (``weight_grad_layout``); an ungated
    activation's dW_gate is an empty tensor (no gate); gpt-oss's interleaved weights: (gate_up_proj's
    gradient [E, H, 2I] = xs^T dgu over dgu interleaved, in one launch; an empty tensor).
    ``halves_of_one`` (the weights the halves of one fused tensor, ``_fused_halves``; an owning call:
    its results may alias): the two the halves of one tensor laid out as that one, so that
    ``gate_up_halves``'s backward hands it over whole, without a copy (transposed: in one launch,
    xs^T [dg | du])."""
    I = dgu.shape[1] // 2
    kw = dict(out_dtype=dtype, config=plan.gemm_config(gemm.KIND_WGRAD_GATE_UP), programs=plan.wgrad_programs)
    if plan.dims.layout == LAYOUT_KN_PAIRED:
        return gemm.expert_wgrad(xs, dgu, sched.expert_start, sched.expert_count, **kw), dgu.new_empty(0, dtype=dtype)
    if halves_of_one and plan.activation.gated and plan.dims.layout == LAYOUT_KN:
        whole = gemm.expert_wgrad(xs, dgu, sched.expert_start, sched.expert_count, **kw)  # [E, H, 2I]
        return whole[..., :I].transpose(1, 2), whole[..., I:].transpose(1, 2)
    if plan.activation.gated and plan.dims.layout == LAYOUT_NK:  # both in one launch
        if halves_of_one:
            whole = dgu.new_empty((sched.expert_count.numel(), 2 * I, xs.shape[1]), dtype=dtype)
            kw.update(out_gate=whole[:, :I], out_up=whole[:, I:])
        return gemm.expert_wgrad_gate_up(dgu, xs, sched.expert_start, sched.expert_count, **kw)
    dw_up = _wgrad_as_laid_out(plan, dgu[:, I:], xs, sched, kw)
    dw_gate = _wgrad_as_laid_out(plan, dgu[:, :I], xs, sched, kw) if plan.activation.gated else dgu.new_empty(
        0, dtype=dtype)
    return dw_gate, dw_up


def _down_wgrad(plan: Plan, dys, hw, sched, dtype):
    """dW_down [E, H, I], laid out as w_down (``weight_grad_layout``)."""
    kw = dict(out_dtype=dtype, config=plan.gemm_config(gemm.KIND_WGRAD_DOWN), programs=plan.wgrad_programs)
    return _wgrad_as_laid_out(plan, dys, hw, sched, kw)


def _wgrad_as_laid_out(plan: Plan, a, b, sched, kw):
    """C[e] = a_e^T b_e in the weights' order: Tabby's layout as is; transposed weights as the
    transpose of b_e^T a_e (the operands swapped), which lies in their own order."""
    if plan.dims.layout == LAYOUT_NK:
        return gemm.expert_wgrad(a, b, sched.expert_start, sched.expert_count, **kw)
    return gemm.expert_wgrad(b, a, sched.expert_start, sched.expert_count, **kw).transpose(1, 2)


def _fused_halves(w_gate: torch.Tensor, w_up: torch.Tensor) -> bool:
    """w_gate and w_up [E, I, H] are the gate and up halves of one contiguous fused tensor: a gate_up
    [E, 2I, H] (gate rows first: transformers' plain families, ``nn.Experts(layout="fused")``) or,
    transposed, a gate_up_proj [E, H, 2I] (gate columns first: the OpenAI privacy filter's)."""
    E, I, H = w_gate.shape
    if w_up.stride() != w_gate.stride():
        return False
    if w_gate.stride() == (2 * I * H, H, 1):
        return w_up.data_ptr() == w_gate.data_ptr() + I * H * w_gate.element_size()
    return w_gate.stride() == (2 * I * H, 1, 2 * I) and w_up.data_ptr() == w_gate.data_ptr() + I * w_gate.element_size()


def fused_gate_up_grads(layout: str, precision: str) -> bool:
    """Whether the backward returns gate/up's weight and bias gradients fused (``moe_backward``): gpt-oss's
    interleaved weights in bf16, whose gradients then come out of one weight-gradient launch in the
    fused parameter's own order (FP8's backward gives every layout Tabby's contiguous shapes)."""
    return layout == LAYOUT_KN_PAIRED and precision == "bf16"


def split_gate_up_grads(dw_fused: torch.Tensor, db_fused: torch.Tensor | None):
    """(dW_gate, dW_up [E, I, H], d b_gate, d b_up [E, I]) as views of the fused gradients (gate_up_proj's
    [E, H, 2I] and gate_up_proj_bias's [E, 2I], g at even columns): what autograd passes back through
    the weights' views."""
    dwg, dwu = (dw_fused[..., j::2].transpose(1, 2) for j in (0, 1))
    dbg, dbu = (None, None) if db_fused is None else (db_fused[:, 0::2], db_fused[:, 1::2])
    return dwg, dwu, dbg, dbu


def weight_grad_layout(w: torch.Tensor, layout: str) -> torch.Tensor:
    """An empty tensor shaped and strided as the backward's gradient of the routed weight ``w`` (for
    the operator's fake implementation): contiguous in Tabby's layout; for the transposed ones the
    transpose of a contiguous [E, w.shape[2], w.shape[1]], which the fused parameter's gradient
    (autograd's ``stack`` / transpose) then reads in order."""
    if layout == LAYOUT_NK:
        return torch.empty(w.shape, dtype=w.dtype, device=w.device)
    E, A, B = w.shape
    return torch.empty((E, B, A), dtype=w.dtype, device=w.device).transpose(1, 2)


def _bias_grads(biases, dgu, dys, row_w, sched, I: int, paired: bool = False):
    """(d b_gate, d b_up, d b_down) in the biases' dtype: each expert's rows of dg, du and w * dy summed;
    ``paired`` (dgu interleaved): (gate_up_proj_bias's gradient [E, 2I], an empty tensor, d b_down)."""
    start, count = sched.expert_start, sched.expert_count
    dbd = gemm.expert_row_sums(dys, start, count, scale=row_w).to(biases[2].dtype)
    if paired:
        dbgu = gemm.expert_row_sums(dgu, start, count).to(biases[0].dtype)
        return dbgu, dgu.new_empty(0, dtype=biases[1].dtype), dbd
    dbg = gemm.expert_row_sums(dgu[:, :I], start, count)
    dbu = gemm.expert_row_sums(dgu[:, I:], start, count)
    return dbg.to(biases[0].dtype), dbu.to(biases[1].dtype), dbd
