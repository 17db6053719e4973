"""``tabby.moe`` as registered PyTorch operators, for ``torch.compile``, CUDA graphs and selective
activation checkpointing.

Two operators, both opaque to the compiler:

    torch.ops.tabby.moe(x, topk_idx, topk_weights, w_gate, w_up, w_down,
                        shared_gate?, shared_up?, shared_down?, group: str, config: str, save: bool)
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
``register_autograd`` wires them together: the forward's ``setup_context`` saves the inputs and
the kept outputs, the backward calls ``moe_backward``.

Non-tensor state travels as strings and is resolved again on each call: the process group as its
name (``torch.distributed`` group name; "" for one rank; simulated ranks get a name registered
here), the config as ``config_string(MoEConfig)`` (parsed once per string). The workspace and
the plan are the cached ones of ``tabby.moe`` (found from the group and the shapes), and the plan
decides the kept tensors' shapes, which is how the fake (meta) implementations size their outputs
without running anything.

``save``: keep the routed rows for the backward (the wrapper ``moe`` passes True when grad mode is
on and an input requires grad, as ``tabby.moe`` decides). Without it, the megakernel forward keeps
only its schedule and the backward recomputes the routed rows (as ``MoEConfig(save_for_backward=
False)`` does); the result is the same either way.

The shared expert's gradients are computed inside ``moe_backward`` with explicit formulas: the
operations autograd runs for ``(silu(x W_g^T) * (x W_u^T)) W_d^T``, in the same order, so y and
every gradient are ``tabby.moe``'s bits on the megakernel path (the default). On the path of
separate launches ``tabby.moe`` differentiates the shared expert outside its autograd Function,
and dx (only dx) then differs from the operator's in the rounding of its three-term sum.

Limits:
  * no double backward (``moe_backward`` has no autograd formula);
  * with the megakernel's local rows (GPU, TMA) the kept ``xs`` lacks this rank's rows; ``tabby.moe``
    copies them in at the start of the weight gradient, the operator at the end of the forward
    (the same copy, moved so that the backward mutates none of its inputs);
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

import functools
import os
from dataclasses import fields

import torch
import torch.nn.functional as F

from ..ops.schedule import ScheduleBuffers, default_chunk, schedule_capacity
from ..validate import MoEDims, MoEInputError, check_inputs
from .backward import routed_rows_for_wgrad, moe_backward
from .config import MoEConfig, Tuning
from .forward import KeptRows, MegaSaved, moe_forward
from .forward_mega import moe_forward_mega
from .fp8 import fp8_passes, moe_backward_fp8
from .moe import group_info, workspace_and_plan, workspace_key
from .moe import moe as moe_function
from .plan import Plan, make_plan
from .threads import ThreadRank

__all__ = ["moe", "zero_padding", "group_name", "config_string", "parse_config", "resolve_group"]

# --------------------------------------------------------------------------------------------
# Non-tensor arguments as strings
# --------------------------------------------------------------------------------------------

_THREAD_RANKS: dict[str, ThreadRank] = {}
_THREAD_PREFIX = "tabby.threads:"


def group_name(group) -> str:
    """The operator's ``group`` string: "" for one rank (None), a ``torch.distributed`` process
    group's ``group_name``, or a name registered here for a simulated rank (``ThreadRank``)."""
    if group is None:
        return ""
    if isinstance(group, ThreadRank):
        name = f"{_THREAD_PREFIX}{id(group.group)}:{group.rank}"
        _THREAD_RANKS[name] = group  # holds the group: its id stays unique while the name is used
        return name
    return group.group_name


def resolve_group(name: str):
    """The group a ``group_name`` string stands for (None for "")."""
    if name == "":
        return None
    if name.startswith(_THREAD_PREFIX):
        try:
            return _THREAD_RANKS[name]
        except KeyError:
            raise MoEInputError(f"unknown simulated-rank group {name!r} (not made by group_name in this "
                                f"process)") from None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


_CONFIG_FIELDS = tuple(f.name for f in fields(MoEConfig) if f.name != "tuning")
_DEFAULT_CONFIG = MoEConfig()


def config_string(config: MoEConfig | None) -> str:
    """``MoEConfig`` -> the operator's ``config`` string: the fields that differ from the defaults,
    ``name=value`` joined by ";" (the tuning as ``Tuning.describe``); "" for the defaults."""
    if config is None:
        return ""
    if not isinstance(config, MoEConfig):
        raise MoEInputError(f"config must be a tabby.MoEConfig, got {type(config).__name__}")
    parts = []
    for name in _CONFIG_FIELDS:
        v = getattr(config, name)
        if v != getattr(_DEFAULT_CONFIG, name):
            parts.append(f"{name}={int(v) if isinstance(v, bool) else v}")
    tuning = config.tuning.describe()
    if tuning:
        parts.append(f"tuning={tuning}")
    return ";".join(parts)


@functools.lru_cache(maxsize=256)
def parse_config(text: str) -> MoEConfig:
    """The inverse of ``config_string``."""
    kw = {}
    for item in filter(None, text.split(";")):
        name, sep, value = item.partition("=")
        if not sep or name not in _CONFIG_FIELDS + ("tuning",):
            raise MoEInputError(f"config string: {item!r} is not field=value with a field of MoEConfig")
        if name == "tuning":
            kw[name] = Tuning.parse(value)
        elif name in ("megakernel", "save_for_backward", "debug", "cache_fp8_transposes"):
            kw[name] = value == "1"
        elif name == "max_wait_ms":
            kw[name] = float(value)
        elif name == "precision":
            kw[name] = value
        else:
            kw[name] = int(value)
    return MoEConfig(**kw)


# --------------------------------------------------------------------------------------------
# Shapes and plans
# --------------------------------------------------------------------------------------------


def _is_static(*values) -> bool:
    return all(isinstance(v, int) for v in values)


_FAKE_PLANS: dict = {}


def _fake_plan(dims: MoEDims, config: MoEConfig, device, I_s) -> Plan:
    """The plan a real call makes (``make_plan``), without a workspace: for the fake kernels."""
    if not _is_static(*(getattr(dims, f.name) for f in fields(dims))):
        return make_plan(dims, config, device, I_s)
    key = (dims, config, str(device), I_s, os.environ.get("TABBY_MAX_WAIT_MS"),
           os.environ.get("TABBY_MAX_WAIT_POLLS"), os.environ.get("TABBY_DEBUG"))
    plan = _FAKE_PLANS.get(key)
    if plan is None:
        plan = _FAKE_PLANS[key] = make_plan(dims, config, device, I_s)
    return plan


def _keeps_rows(plan: Plan, save: bool) -> bool:
    """Whether the forward keeps the routed rows (else the backward recomputes them)."""
    return save and (plan.save_for_backward or not plan.megakernel)


def _missing(plan: Plan) -> str:
    """``KeptRows.missing`` of this plan's forward."""
    if plan.mega is not None and plan.mega.token_pull:
        return "tokens"
    if plan.mega is not None and plan.mega.local_rows:
        return "local"
    return ""


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


def _shared(s_gate, s_up, s_down):
    return None if s_gate is None else (s_gate, s_up, s_down)


def _dims(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, W) -> MoEDims:
    return check_inputs(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, world_size=W, check_ids=False,
                        dtypes=(torch.bfloat16,))


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x contiguous and 16-byte aligned (the megakernel's row gathers and TMA loads read it; the
    backward gets the same values again from the same rule)."""
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    return x


def _setup(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group: str, config: str, save: bool):
    """(workspace, plan, dims) of a real call, as ``tabby.moe`` finds them (a new workspace or plan
    only after the memory check; ``save``: the call is differentiated)."""
    cfg = parse_config(config)
    rank, W, pg, tg = group_info(resolve_group(group))
    dims = _dims(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, W)
    if W > 1 and tg is None and x.device.type != "cuda":
        raise MoEInputError("Tabby across processes needs CUDA tensors (GPU symmetric memory)")
    if dims.T == 0:  # (the wrapper ``moe`` sends T = 0 to tabby.moe)
        raise MoEInputError("torch.ops.tabby.moe needs tokens (T = 0); tabby.functional.custom_op.moe takes T = 0")
    ws, plan = workspace_and_plan(workspace_key(dims, W, x, cfg), dims, cfg, dims.I_shared, x.device, rank, pg, tg,
                                  differentiated=save)
    return ws, plan, dims


# --------------------------------------------------------------------------------------------
# The forward operator
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("tabby::moe", mutates_args=())
def _moe_op(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
            w_up: torch.Tensor, w_down: torch.Tensor, shared_gate: torch.Tensor | None,
            shared_up: torch.Tensor | None, shared_down: torch.Tensor | None, group: str, config: str,
            save: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                 torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    shared = _shared(shared_gate, shared_up, shared_down)
    ws, plan, dims = _setup(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group, config, save)
    x = _aligned(x)
    topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
    if shared is not None:
        shared = tuple(w.contiguous() for w in shared)
    keep = _keeps_rows(plan, save)
    if plan.megakernel:
        y, saved = moe_forward_mega(ws, plan, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, keep)
    else:
        extra = None
        if shared is not None:
            sg, su, sd = shared
            extra = (F.silu(x @ sg.t()) * (x @ su.t())) @ sd.t()
        forward = moe_forward if plan.precision == "bf16" else fp8_passes(dims, plan, plan.precision, keep)[0]
        y, saved = forward(ws, plan, x, topk_idx, topk_weights, w_gate, w_up, w_down, extra)
    s = saved.sched
    x_scale = torch.empty(0, dtype=torch.float32, device=x.device)
    if keep:
        if saved.missing == "local":  # this rank's rows into xs now, so that the backward changes no input
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
              save):
    shared = _shared(shared_gate, shared_up, shared_down)
    _, W, _, _ = group_info(resolve_group(group))
    dims = _dims(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, W)
    plan = _fake_plan(dims, parse_config(config), x.device, dims.I_shared)
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


def _shared_backward(dy, x, sg, su, sd):
    """Gradients of ``(silu(x sg^T) * (x su^T)) sd^T`` for the upstream ``dy``: the operations
    autograd's formulas run (mm, mul, silu_backward), so the result matches autograd's."""
    g = x.mm(sg.t())
    a = F.silu(g)
    u = x.mm(su.t())
    h = a * u
    dh = dy.mm(sd)
    dsd = dy.t().mm(h)
    da, du = dh * u, dh * a
    dg = torch.ops.aten.silu_backward(da, g)
    dsg, dsu = dg.t().mm(x), du.t().mm(x)
    dx = du.mm(su) + dg.mm(sg)
    return dx, dsg, dsu, dsd


@torch.library.custom_op("tabby::moe_backward", mutates_args=())
def _moe_backward_op(dy: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                     w_up: torch.Tensor, w_down: torch.Tensor, shared_gate: torch.Tensor | None,
                     shared_up: torch.Tensor | None, shared_down: torch.Tensor | None, row_src: torch.Tensor,
                     tile_expert: torch.Tensor, expert_start: torch.Tensor, expert_count: torch.Tensor,
                     num_tiles: torch.Tensor, xs: torch.Tensor, gu: torch.Tensor, row_w: torch.Tensor,
                     x_scale: torch.Tensor, group: str, config: str,
                     save: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                          torch.Tensor, torch.Tensor, torch.Tensor]:
    shared = _shared(shared_gate, shared_up, shared_down)
    T, k = topk_weights.shape
    # topk_idx is not needed any more: the schedule holds the routing; a placeholder of its shape
    idx = torch.empty((T, k), dtype=torch.int32, device=x.device)
    ws, plan, dims = _setup(x, idx, topk_weights, w_gate, w_up, w_down, shared, group, config, True)
    x = _aligned(x)
    topk_weights_c = topk_weights.contiguous()
    sched = ScheduleBuffers(W=dims.world_size, T=T, k=k, E_local=dims.E_local, BM=plan.tile_m,
                            ALIGN_TILES=plan.align_tiles, CHUNK=default_chunk(T, k), TPP=0, n_chunks=0,
                            R_max=row_src.numel(), row_src=row_src, tile_expert=tile_expert,
                            expert_start=expert_start, expert_count=expert_count, src_count=None,
                            num_tiles=num_tiles, counts=None, within=None, done=None)
    if _keeps_rows(plan, save):
        missing = "tokens" if _missing(plan) == "tokens" else ""  # (the forward completed local rows)
        saved = KeptRows(sched, xs, gu, row_w, missing, x if missing else None,
                         x_scale=x_scale if plan.precision == "fp8" else None)
    else:
        saved = MegaSaved(sched, x, topk_weights_c)
    backward = moe_backward_fp8 if plan.precision == "fp8" else moe_backward
    dx, dtopk, dwg, dwu, dwd = backward(ws, plan, dy.contiguous(), saved, w_gate, w_up, w_down)
    if shared is None:
        dsg, dsu, dsd = (dy.new_empty(0) for _ in range(3))  # (outputs must not alias each other)
    else:
        dxs, dsg, dsu, dsd = _shared_backward(dy.contiguous(), x, *(w.contiguous() for w in shared))
        dx = dx + dxs
    return dx, dtopk.to(topk_weights.dtype), dwg, dwu, dwd, dsg, dsu, dsd


@_moe_backward_op.register_fake
def _moe_backward_fake(dy, x, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, row_src,
                       tile_expert, expert_start, expert_count, num_tiles, xs, gu, row_w, x_scale, group, config, save):
    def like(t):
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)

    if shared_gate is None:
        dsg, dsu, dsd = (dy.new_empty(0) for _ in range(3))
    else:
        dsg, dsu, dsd = like(shared_gate), like(shared_up), like(shared_down)
    return like(x), like(topk_weights), like(w_gate), like(w_up), like(w_down), dsg, dsu, dsd


# --------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output):
    x, _, topk_weights, w_gate, w_up, w_down, sg, su, sd, group, config, save = inputs
    kept = output[1:]
    ctx.save_for_backward(x, topk_weights, w_gate, w_up, w_down, sg, su, sd, *kept)
    ctx.mark_non_differentiable(*kept)
    # no zero gradients made for the kept outputs (xs and g | u as big as the routed rows: autograd
    # would otherwise allocate them for every backward, unread)
    ctx.set_materialize_grads(False)
    ctx.tabby_args = (group, config, save)


def _backward(ctx, dy, *_kept_grads):
    x, topk_weights, w_gate, w_up, w_down, sg, su, sd, *kept = ctx.saved_tensors
    group, config, save = ctx.tabby_args
    if dy is None:  # (gradients are not materialized: y's is None only if nothing reached it)
        dy = torch.zeros((x.shape[0], w_down.shape[1]), dtype=x.dtype, device=x.device)
    dx, dtw, dwg, dwu, dwd, dsg, dsu, dsd = torch.ops.tabby.moe_backward(
        dy, x, topk_weights, w_gate, w_up, w_down, sg, su, sd, *kept, group, config, save)
    if sg is None:
        dsg = dsu = dsd = None
    return dx, None, dtw, dwg, dwu, dwd, dsg, dsu, dsd, None, None, None


_moe_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# The wrapper
# --------------------------------------------------------------------------------------------


@torch.compiler.assume_constant_result
def _group_string(group) -> str:
    return group_name(group)


def moe(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None, group=None, config: MoEConfig | None = None):
    """``tabby.moe`` through the registered operator ``torch.ops.tabby.moe``: the same arguments,
    the same result and gradients, and ``torch.compile(fullgraph=True)`` traces it without a graph
    break (``group``: None, a process group or a ``ThreadRank``; converted to its name).

    A rank with no tokens (T = 0: an empty result, zero weight gradients) goes to ``tabby.moe``
    itself instead, with the same result."""
    if shared is not None:
        if not (isinstance(shared, (tuple, list)) and len(shared) == 3):
            raise MoEInputError("shared must be None or a tuple (w_gate_s [I_s, H], w_up_s [I_s, H], "
                                "w_down_s [H, I_s])")
        sg, su, sd = shared
    else:
        sg = su = sd = None
    save = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, topk_weights, w_gate, w_up, w_down, sg, su, sd))
    gname = group if isinstance(group, str) else _group_string(group)
    cstr = config if isinstance(config, str) else config_string(config)
    if x.shape[0] == 0:
        return moe_function(x, topk_idx, topk_weights, w_gate, w_up, w_down, None if sg is None else (sg, su, sd),
                            group=resolve_group(gname), config=parse_config(cstr))
    out = torch.ops.tabby.moe(x, topk_idx, topk_weights, w_gate, w_up, w_down, sg, su, sd, gname, cstr, save)
    return out[0]
