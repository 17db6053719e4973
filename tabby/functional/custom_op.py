"""The layer's one implementation: two registered PyTorch operators and their autograd.

``tabby.moe`` (``moe.py``), ``tabby.nn``, the transformers and torchtitan backends, the bench and
``tabby train`` all call ``torch.ops.tabby.moe``; there is no other forward or backward of the
layer. Both operators are opaque to the compiler:

    torch.ops.tabby.moe(x, topk_idx, topk_weights, w_gate, w_up, w_down,
                        shared_gate?, shared_up?, shared_down?, group: str, config: str, save: bool,
                        owned: bool = False)
        -> (y, row_src, tile_expert, expert_start, expert_count, num_tiles, xs, gu, row_w, x_scale)
    torch.ops.tabby.moe_backward(dy, x, topk_weights, w_gate, w_up, w_down, shared_gate?, shared_up?,
                                 shared_down?, row_src, tile_expert, expert_start, expert_count,
                                 num_tiles, xs, gu, row_w, x_scale, group: str, config: str, save: bool)
        -> (dx, d topk_weights, dw_gate, dw_up, dw_down, dw_gate_s, dw_up_s, dw_down_s)

The forward returns, besides y, everything its backward needs as tensors: the routed-row schedule
(row_src, tile_expert, expert_start, expert_count, num_tiles) and the kept routed rows (xs,
g | u, the rows' router weights; empty ``[0, ...]`` tensors when the forward keeps nothing and the
backward recomputes them). ``precision="fp8"`` keeps xs in E4M3 with its 1x128 scales
``x_scale`` [R, ceil(H/128)] (``fp8.py``); every other precision returns ``x_scale`` empty.
Nothing passes between the two through Python objects, so the pair works the same in eager mode,
in a compiled graph (the kept tensors are ordinary saved activations) and inside a captured CUDA
graph, and neither reads anything back to the host.

Non-tensor state travels as strings and is resolved again on each call: the process group as its
name (``resolve.group_name``), the config as ``config_string(MoEConfig)`` (parsed once per
string). The workspace and the plan are the cached ones of the group and shape
(``resolve.workspace_and_plan``), and the plan decides the kept tensors' shapes, which is how the
fake (meta) implementations size their outputs without running anything.

``save``: keep the routed rows for the backward (the wrapper passes True when grad mode is on and
an input requires grad). Without it, the megakernel forward keeps only its schedule and the
backward recomputes the routed rows (as ``MoEConfig(save_for_backward=False)`` does); the result
is the same either way.

The eager backward owns what its forward kept. Called eagerly (and where no saved-tensor hooks of
checkpointing or offloading are active), the wrapper (``moe.moe``) passes ``owned``: autograd's
context then holds the kept outputs as a list, not as saved tensors (they are non-differentiable
outputs: no reference cycle), the forward leaves the megakernel's local rows to the backward, and
the backward takes the list and runs ``backward.moe_backward`` with ``owned`` (dg | du written over
g | u, each routed buffer freed once its last launch is queued), as the rows' only holder.
Compiled, or called as ``torch.ops.tabby.moe`` directly, the kept tensors are saved activations
and the backward operator only reads them. The same launches and bits either way
(tests/test_custom_op.py: every entry bitwise equal).

The shared expert: inside the megakernel's launch, else ``shared_expert_forward`` in plain PyTorch
(its output enters the combine); its gradients are ``shared_expert_backward``'s explicit formulas
(the operations autograd runs for the forward's, in the same order) on both paths.

Limits:
  * no double backward (``moe_backward`` has no autograd formula); an eager backward runs once
    (``retain_graph=True`` then raises when the graph is walked again);
  * the kept tensors' padding rows (and the unused tail of the worst-case buffers) are left
    uninitialized, so two calls give different bits there (``zero_padding`` zeroes them, for
    ``opcheck``, which compares every output);
  * the operators have side effects the compiler does not see (the workspace's symmetric buffers
    and flags): every rank must run the same calls in the same order, which the same compiled
    graph on every rank does; a graph that calls the op twice on identical inputs may be
    deduplicated (on every rank alike);
  * selective activation checkpointing can name ``torch.ops.tabby.moe.default``; recomputing it
    (instead of saving its outputs) runs the whole forward again, communication included.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from ..ops.schedule import ScheduleBuffers, default_chunk, schedule_capacity
from ..validate import LAYOUT_NK, MoEDims, MoEInputError, check_inputs, weights_layout
from .backward import (fused_gate_up_grads, moe_backward, routed_rows_for_wgrad, split_gate_up_grads,
                       weight_grad_layout)
from .config import parse_config
from .forward import KeptRows, MegaSaved, moe_forward
from .forward_mega import moe_forward_mega
from .fp8 import fp8_passes, moe_backward_fp8
from .plan import Plan
from .probe import Probe
from .resolve import group_info, plan_without_workspace, workspace_and_plan, workspace_key

# --------------------------------------------------------------------------------------------
# What the calls share
# --------------------------------------------------------------------------------------------


def _shared(s_gate, s_up, s_down):
    return None if s_gate is None else (s_gate, s_up, s_down)


def _dims(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, W, biases=None) -> MoEDims:
    return check_inputs(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, world_size=W, check_ids=False,
                        dtypes=(torch.bfloat16,), biases=biases)


def _biases(b_gate, b_up, b_down):
    return None if b_gate is None else (b_gate, b_up, b_down)


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x contiguous and 16-byte aligned (the megakernel's row gathers and TMA loads read it; the
    backward gets the same values again from the same rule)."""
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    return x


def _keeps_rows(plan: Plan, save: bool) -> bool:
    """Whether the forward keeps the routed rows (else the backward recomputes them)."""
    return save and (plan.save_for_backward or not plan.megakernel)


def _missing(plan: Plan) -> str:
    """``KeptRows.missing`` of this plan's forward, where it copies its local rows at its end."""
    if plan.mega is not None and plan.mega.token_pull:
        return "tokens"
    if plan.mega is not None and plan.mega.local_rows:
        return "local"
    return ""


def _setup(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group: str, config: str, save: bool,
           biases=None):
    """(workspace, plan, dims) of a real call (a new workspace or plan only after the memory check;
    ``save``: the call is differentiated)."""
    cfg = parse_config(config)
    rank, W, pg, tg = group_info(group)
    dims = _dims(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, W, biases)
    if W > 1 and tg is None and x.device.type != "cuda":
        raise MoEInputError("Tabby across processes needs CUDA tensors (GPU symmetric memory); on the CPU "
                            "run one rank, or simulated ranks (tabby.functional.threads.run_ranks)")
    if dims.T == 0:  # (the wrapper ``moe.moe`` takes T = 0 itself)
        raise MoEInputError("torch.ops.tabby.moe needs tokens (T = 0); tabby.moe takes T = 0")
    ws, plan = workspace_and_plan(workspace_key(dims, W, x, cfg), dims, cfg, dims.I_shared, x.device, rank, pg, tg,
                                  differentiated=save)
    return ws, plan, dims


def shared_expert_forward(x, s_gate, s_up, s_down):
    """The shared expert in plain PyTorch, ``(silu(x s_gate^T) * (x s_up^T)) s_down^T`` (the path of
    separate launches; the megakernel runs it in its launch)."""
    return (F.silu(x @ s_gate.t()) * (x @ s_up.t())) @ s_down.t()


def shared_expert_backward(dy, x, s_gate, s_up, s_down):
    """Gradients (dx, d s_gate, d s_up, d s_down) of ``shared_expert_forward`` for the upstream
    ``dy``: the operations autograd's formulas run (mm, mul, silu_backward), in their order."""
    g = x.mm(s_gate.t())
    a = F.silu(g)
    u = x.mm(s_up.t())
    h = a * u
    dh = dy.mm(s_down)
    dsd = dy.t().mm(h)
    da, du = dh * u, dh * a
    dg = torch.ops.aten.silu_backward(da, g)
    dsg, dsu = dg.t().mm(x), du.t().mm(x)
    dx = du.mm(s_up) + dg.mm(s_gate)
    return dx, dsg, dsu, dsd


# --------------------------------------------------------------------------------------------
# Measurement hooks (the tools' ``moe_with_probe``): eager calls only, never part of the op's schema
# --------------------------------------------------------------------------------------------

_PROBE = threading.local()


class probing:
    """Context manager: the calls of this thread inside it run with ``probe`` (``Probe``: stage
    timer, ticket trace, ablations), and so do their backwards."""

    def __init__(self, probe: Probe | None):
        self.probe = probe

    def __enter__(self):
        self._before, _PROBE.value = getattr(_PROBE, "value", None), self.probe

    def __exit__(self, *exc):
        _PROBE.value = self._before


def _current_probe() -> Probe | None:
    return getattr(_PROBE, "value", None)


_zero_padding = False


class zero_padding:
    """Context manager for tests: the forward operator zeroes the rows of its kept tensors that
    hold no routed row (padding and the unused tail of the worst-case buffers), which otherwise
    hold whatever the allocator left there and differ from call to call (no kernel reads them).
    ``torch.library.opcheck`` compares every output of two calls, so it needs this; it costs a
    pass over the kept buffers."""

    def __enter__(self):
        global _zero_padding
        self._before, _zero_padding = _zero_padding, True

    def __exit__(self, *exc):
        global _zero_padding
        _zero_padding = self._before


def _zero_padding_rows(row_src, xs, gu, row_w, x_scale, rank, T, tokens):
    pad = row_src < 0
    gu.masked_fill_(pad[:, None], 0)
    row_w.masked_fill_(pad, 0)
    if x_scale.numel():
        x_scale.masked_fill_(pad[:, None], 0)
    if xs.dtype == torch.float8_e4m3fn:  # (E4M3 has no fill: its bytes, 0 is +0.0)
        xs = xs.view(torch.uint8)
    if tokens:  # every rank's tokens; this rank's own block is not copied
        xs[rank * T:(rank + 1) * T].zero_()
    else:
        xs.masked_fill_(pad[:, None], 0)


# --------------------------------------------------------------------------------------------
# The forward operator
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("tabby::moe", mutates_args=())
def _moe_op(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
            w_up: torch.Tensor, w_down: torch.Tensor, shared_gate: torch.Tensor | None,
            shared_up: torch.Tensor | None, shared_down: torch.Tensor | None, group: str, config: str,
            save: bool, owned: bool = False, b_gate: torch.Tensor | None = None, b_up: torch.Tensor | None = None,
            b_down: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                         torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                         torch.Tensor, torch.Tensor]:
    shared = _shared(shared_gate, shared_up, shared_down)
    biases = _biases(b_gate, b_up, b_down)
    ws, plan, dims = _setup(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group, config, save, biases)
    probe = _current_probe()
    if probe is not None:
        probe.plan = plan
    x = _aligned(x)
    topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
    if shared is not None:
        shared = tuple(w.contiguous() for w in shared)
    keep = _keeps_rows(plan, save)
    if plan.megakernel:
        y, saved = moe_forward_mega(ws, plan, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, keep,
                                    probe=probe)
    else:
        extra = shared_expert_forward(x, *shared) if shared is not None else None
        forward = moe_forward if plan.precision == "bf16" else fp8_passes(dims, plan, plan.precision, keep)[0]
        kw = dict(biases=biases) if biases is not None else {}  # (the plan ran biases on the bf16 forward only)
        y, saved = forward(ws, plan, x, topk_idx, topk_weights, w_gate, w_up, w_down, extra, probe=probe, **kw)
    s = saved.sched
    x_scale = torch.empty(0, dtype=torch.float32, device=x.device)
    if keep:
        if saved.missing == "local" and not owned:  # this rank's rows into xs now (an owning backward copies them)
            routed_rows_for_wgrad(ws, plan, saved, dims.T * dims.k, dims.k)
        xs, gu, row_w = saved.xs, saved.gu, saved.row_w
        if saved.x_scale is not None:
            x_scale = saved.x_scale
        if _zero_padding:
            _zero_padding_rows(s.row_src, xs, gu, row_w, x_scale, ws.rank, dims.T, saved.missing == "tokens")
    else:
        xs, gu = x.new_empty((0, dims.H)), x.new_empty((0, 2 * dims.I))
        row_w = torch.empty(0, dtype=torch.float32, device=x.device)
    return y, s.row_src, s.tile_expert, s.expert_start, s.expert_count, s.num_tiles, xs, gu, row_w, x_scale


@_moe_op.register_fake
def _moe_fake(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, group, config,
              save, owned=False, b_gate=None, b_up=None, b_down=None):
    shared = _shared(shared_gate, shared_up, shared_down)
    _, W, _, _ = group_info(group)
    dims = _dims(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, W, _biases(b_gate, b_up, b_down))
    plan = plan_without_workspace(dims, parse_config(config), x.device, dims.I_shared)
    T, H, I, E_local = dims.T, dims.H, dims.I, dims.E_local
    R = schedule_capacity(W, T, dims.k, E_local, plan.tile_m, plan.align_tiles)
    i32 = dict(dtype=torch.int32, device=x.device)
    x_scale = x.new_empty(0, dtype=torch.float32)
    if _keeps_rows(plan, save):
        xs = x.new_empty((W * T, H) if _missing(plan) == "tokens" else (R, H))
        gu, row_w = x.new_empty((R, 2 * I)), x.new_empty(R, dtype=torch.float32)
        if plan.precision == "fp8":  # E4M3 rows and their 1x128 scales
            xs = x.new_empty((R, H), dtype=torch.float8_e4m3fn)
            x_scale = x.new_empty((R, -(-H // 128)), dtype=torch.float32)
    else:
        xs, gu, row_w = x.new_empty((0, H)), x.new_empty((0, 2 * I)), x.new_empty(0, dtype=torch.float32)
    return (x.new_empty((T, H)), torch.empty(R, **i32), torch.empty(R // plan.tile_m, **i32),
            torch.empty(E_local + 1, **i32), torch.empty(E_local, **i32), torch.empty(1, **i32), xs, gu, row_w,
            x_scale)


# --------------------------------------------------------------------------------------------
# The backward operator
# --------------------------------------------------------------------------------------------


def _backward_pass(dy, x, topk_weights, w_gate, w_up, w_down, shared, sched_tensors, kept: list, group: str,
                   config: str, save: bool, owned: bool, probe: Probe | None, biases=None):
    """The backward of one forward. ``kept``: the list [xs, gu, row_w, x_scale] of the forward's kept
    outputs; with ``owned`` (nothing else holds them) it is emptied, and the pass frees each buffer
    as it goes (``backward.moe_backward``'s ``owned``; the megakernel's local rows are then copied into
    xs here); otherwise the tensors are only read (the forward copied the local rows in)."""
    T, k = topk_weights.shape
    # topk_idx is not needed any more: the schedule holds the routing; a placeholder of its shape
    idx = torch.empty((T, k), dtype=torch.int32, device=x.device)
    ws, plan, dims = _setup(x, idx, topk_weights, w_gate, w_up, w_down, shared, group, config, True, biases)
    x = _aligned(x)
    row_src, tile_expert, expert_start, expert_count, num_tiles = sched_tensors
    sched = ScheduleBuffers(W=dims.world_size, T=T, k=k, E_local=dims.E_local, BM=plan.tile_m,
                            ALIGN_TILES=plan.align_tiles, CHUNK=default_chunk(T, k), TPP=0, n_chunks=0,
                            R_max=row_src.numel(), row_src=row_src, tile_expert=tile_expert,
                            expert_start=expert_start, expert_count=expert_count, src_count=None,
                            num_tiles=num_tiles, counts=None, within=None, done=None)
    if _keeps_rows(plan, save):
        missing = _missing(plan)
        if missing == "local" and not owned:
            missing = ""  # (the forward copied them in)
        xs, gu, row_w, x_scale = kept
        if owned:
            kept.clear()
        saved = KeptRows(sched, xs, gu, row_w, missing, x if missing else None,
                         x_scale=x_scale if plan.precision == "fp8" else None)
        del xs, gu, row_w, x_scale
    else:
        kept.clear()
        saved = MegaSaved(sched, x, topk_weights.contiguous())
    if biases is not None:  # (the plan ran biases on the bf16 passes only)
        dx, dtopk, dwg, dwu, dwd, dbiases = moe_backward(ws, plan, dy.contiguous(), saved, w_gate, w_up, w_down,
                                                         probe=probe, owned=owned, biases=biases)
    elif plan.precision == "fp8":
        dx, dtopk, dwg, dwu, dwd = moe_backward_fp8(ws, plan, dy.contiguous(), saved, w_gate, w_up, w_down,
                                                    probe=probe, owned=owned)
        dbiases = None
    else:
        dx, dtopk, dwg, dwu, dwd = moe_backward(ws, plan, dy.contiguous(), saved, w_gate, w_up, w_down, probe=probe,
                                                owned=owned)
        dbiases = None
    if fused_gate_up_grads(dims.layout, plan.precision):  # gate_up_proj's gradients whole: the halves' views
        dwg, dwu, dbg, dbu = split_gate_up_grads(dwg, dbiases[0] if dbiases else None)
        if not owned:  # the operator's outputs, which may not alias one another: copies, as its fake lays them out
            dwg, dwu = (weight_grad_layout(w, dims.layout).copy_(g) for w, g in ((w_gate, dwg), (w_up, dwu)))
            dbg, dbu = (None, None) if dbg is None else (dbg.clone(), dbu.clone())
        if dbiases:
            dbiases = (dbg, dbu, dbiases[2])
    if dbiases is None:
        dbiases = tuple(dy.new_empty(0) for _ in range(3))  # (outputs must not alias each other)
    del saved
    if shared is None:
        dsg, dsu, dsd = (dy.new_empty(0) for _ in range(3))  # (outputs must not alias each other)
    else:
        dxs, dsg, dsu, dsd = shared_expert_backward(dy.contiguous(), x, *(w.contiguous() for w in shared))
        dx = dx + dxs
    return (dx, dtopk.to(topk_weights.dtype), dwg, dwu, dwd, dsg, dsu, dsd, *dbiases)


@torch.library.custom_op("tabby::moe_backward", mutates_args=())
def _moe_backward_op(dy: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                     w_up: torch.Tensor, w_down: torch.Tensor, shared_gate: torch.Tensor | None,
                     shared_up: torch.Tensor | None, shared_down: torch.Tensor | None, row_src: torch.Tensor,
                     tile_expert: torch.Tensor, expert_start: torch.Tensor, expert_count: torch.Tensor,
                     num_tiles: torch.Tensor, xs: torch.Tensor, gu: torch.Tensor, row_w: torch.Tensor,
                     x_scale: torch.Tensor, group: str, config: str, save: bool,
                     b_gate: torch.Tensor | None = None, b_up: torch.Tensor | None = None,
                     b_down: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor, torch.Tensor]:
    return _backward_pass(dy, x, topk_weights, w_gate, w_up, w_down, _shared(shared_gate, shared_up, shared_down),
                          (row_src, tile_expert, expert_start, expert_count, num_tiles), [xs, gu, row_w, x_scale],
                          group, config, save, owned=False, probe=None, biases=_biases(b_gate, b_up, b_down))


@_moe_backward_op.register_fake
def _moe_backward_fake(dy, x, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, row_src,
                       tile_expert, expert_start, expert_count, num_tiles, xs, gu, row_w, x_scale, group, config, save,
                       b_gate=None, b_up=None, b_down=None):
    def like(t):
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)

    if shared_gate is None:
        dsg, dsu, dsd = (dy.new_empty(0) for _ in range(3))
    else:
        dsg, dsu, dsd = like(shared_gate), like(shared_up), like(shared_down)
    if b_gate is None:
        dbg, dbu, dbd = (dy.new_empty(0) for _ in range(3))
    else:
        dbg, dbu, dbd = like(b_gate), like(b_up), like(b_down)
    cfg = parse_config(config)  # (the bf16 backward gives transposed weights transposed gradients; FP8's are contiguous)
    layout = weights_layout(w_gate, w_up, w_down) if cfg.precision == "bf16" else LAYOUT_NK
    dwg = weight_grad_layout(w_gate, layout) if cfg.activation.gated else dy.new_empty(0)
    return (like(x), like(topk_weights), dwg, weight_grad_layout(w_up, layout), weight_grad_layout(w_down, layout),
            dsg, dsu, dsd, dbg, dbu, dbd)


# --------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    x, _, topk_weights, w_gate, w_up, w_down, sg, su, sd, group, config, save, owned, bg, bu, bd = inputs
    kept = output[1:]
    ctx.mark_non_differentiable(*kept)
    # no zero gradients made for the kept outputs (xs and g | u as big as the routed rows: autograd
    # would otherwise allocate them for every backward, unread)
    ctx.set_materialize_grads(False)
    ctx.tabby_args = (group, config, save)
    if owned:  # the eager wrapper's call: the backward takes the list and is their only holder
        ctx.save_for_backward(x, topk_weights, w_gate, w_up, w_down, sg, su, sd, bg, bu, bd)
        ctx.tabby_kept = list(kept)
        ctx.tabby_probe = _current_probe()
    else:
        ctx.save_for_backward(x, topk_weights, w_gate, w_up, w_down, sg, su, sd, bg, bu, bd, *kept)
        ctx.tabby_kept = None


def _backward(ctx, dy, *_kept_grads):
    x, topk_weights, w_gate, w_up, w_down, sg, su, sd, bg, bu, bd, *kept = ctx.saved_tensors
    group, config, save = ctx.tabby_args
    if dy is None:  # (gradients are not materialized: y's is None only if nothing reached it)
        dy = torch.zeros((x.shape[0], w_down.shape[1]), dtype=x.dtype, device=x.device)
    if ctx.tabby_kept is not None:  # the eager wrapper's call: this backward owns the kept rows
        if not ctx.tabby_kept:
            raise RuntimeError("tabby.moe: this call's backward ran already and freed what its forward kept "
                               "(an eager backward runs once: retain_graph=True is not supported)")
        kept, ctx.tabby_kept = ctx.tabby_kept, []
        sched, rows = kept[:5], kept[5:]
        del kept
        grads = _backward_pass(dy, x, topk_weights, w_gate, w_up, w_down, _shared(sg, su, sd), sched, rows,
                               group, config, save, owned=True, probe=ctx.tabby_probe, biases=_biases(bg, bu, bd))
    else:
        grads = torch.ops.tabby.moe_backward(dy, x, topk_weights, w_gate, w_up, w_down, sg, su, sd, *kept, group,
                                             config, save, bg, bu, bd)
    dx, dtw, dwg, dwu, dwd, dsg, dsu, dsd, dbg, dbu, dbd = grads
    if not parse_config(config).activation.gated:  # (w_gate is w_up, unread: no gradient)
        dwg = None
    if sg is None:
        dsg = dsu = dsd = None
    if bg is None:
        dbg = dbu = dbd = None
    return dx, None, dtw, dwg, dwu, dwd, dsg, dsu, dsd, None, None, None, None, dbg, dbu, dbd


_moe_op.register_autograd(_backward, setup_context=_setup_context)


def _owning_call_possible() -> bool:
    """An eager call whose backward may own the kept rows: not traced by the compiler, and no
    saved-tensor hooks active (checkpointing or offloading would not see rows held by the context)."""
    return (not torch.compiler.is_compiling() and torch._C._autograd._saved_tensors_hooks_is_enabled()
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is None)


def run_operator(x, topk_idx, topk_weights, w_gate, w_up, w_down, sg, su, sd, group: str, config: str, save: bool,
                 biases=None):
    """``torch.ops.tabby.moe``'s y; differentiated and eager (``_owning_call_possible``), a call whose
    backward owns the kept rows."""
    owned = save and _owning_call_possible()
    bg, bu, bd = biases if biases is not None else (None, None, None)
    return torch.ops.tabby.moe(x, topk_idx, topk_weights, w_gate, w_up, w_down, sg, su, sd, group, config, save,
                               owned, bg, bu, bd)[0]

