"""The sync-free forward, and what a forward keeps for the backward.

Each pass is a short sequence of launches on the current stream, none of which reads anything
back to the host (so a forward + backward can be captured in a CUDA graph):

forward, on every rank
    publish      copy topk_idx, topk_weights into the symmetric buffers
    signal+wait  FWD_READY to all; every peer's (its routing is readable)   | on a high-priority side
    schedule     every rank's topk_idx -> routed-row table of the local       | stream, while the current
                 experts (ops/schedule.py)                                     | one copies x into x_pub
    signal+wait  join the side stream; FWD_X_READY (every peer's x is readable)
    dispatch     pull x rows (and router weights) from their source ranks into xs   (ops/comm.py)
    gate/up      h = silu(xs Wg^T) * (xs Wu^T); g, u saved for the backward          (ops/gemm/bf16.py)
    down         rows of h Wd^T pushed to the origin's y_in[t*k + kk]                (ops/gemm/bf16.py)
    signal+wait  FWD_DONE to every rank; then every peer's FWD_DONE (each pair is one launch)
    combine      y[t] = sum_kk w[t,kk] y_in[t*k+kk] (fp32, k order) + shared[t]     (ops/combine.py)

backward, mirrored: publish dy; pull dy rows; down dgrad with the SwiGLU backward and the
router-weight gradient <dy, y_e>; gate/up dgrad whose rows are pushed to the origin's dx_in;
router-weight gradients pushed to dw_in; per-expert weight gradients (one program per output
tile over the expert's whole row range); signal and wait; dx summed over k in k order.

Saved for the backward (per call, from PyTorch's caching allocator): the schedule, the
dispatched rows xs [R, H], g and u [R, 2I] and the router weight of each row: nothing is
recomputed, at the cost of (H + 2I) * 2 bytes per routed row. The shared expert is plain
PyTorch outside the Function (its output enters the combine as ``extra``).

The megakernel forward (``forward_mega.py``, the default) runs dispatch, gate/up, down + push and
the shared expert in one persistent launch, and sets and waits for the pass's flags inside its
kernels instead of the signal+wait launches above. When a backward will follow and
``MoEConfig.save_for_backward`` holds, it keeps what this forward keeps (``KeptRows``), and the
backward is the same; otherwise it keeps only x and the router weights (``MegaSaved``) and the
backward recomputes the routed rows and g, u first.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.gemm import bf16 as gemm
from .memory import layer_buffers
from .plan import Plan
from .probe import Probe, mark
from .steps import finish_forward, publish_and_schedule, pull_routed_rows


def moe_forward(ws, plan: Plan, x, topk_idx, topk_weights, w_gate, w_up, w_down, extra=None,
                probe: Probe | None = None, biases=None):
    """Forward pass on one rank. Returns (y [T, H], saved) where saved feeds ``moe_backward``.
    ``biases``: None or (b_gate, b_up, b_down): added in the gate/up and down epilogues."""
    T, H = x.shape
    TK = topk_idx.numel()
    sched = publish_and_schedule(ws, plan, x, topk_idx, topk_weights, w_gate.shape[0], probe=probe)
    bufs = layer_buffers(plan)
    xs, row_w = bufs.empty("xs", x.device), bufs.empty("row_w", x.device)
    pull_routed_rows(plan, sched, ws.ptrs["x_pub"], xs, TK, sched.k, ws.ptrs["w_pub"], row_w)
    mark(probe, "fwd:dispatch")
    h, gu = gemm.gate_up_swiglu(xs, w_gate, w_up, sched.tile_expert, sched.num_tiles, h=bufs.empty("h", x.device),
                                gu=bufs.empty("gu", x.device), config=plan.gemm_config(gemm.KIND_GATE_UP),
                                act=plan.activation, biases=biases[:2] if biases is not None else None)
    mark(probe, "fwd:gate_up")
    gemm.down_push(h, w_down, sched.tile_expert, sched.num_tiles, sched.row_src, ws.ptrs["y_in"], TK,
                   config=plan.gemm_config(gemm.KIND_DOWN), bias=biases[2] if biases is not None else None)
    mark(probe, "fwd:down+push")
    return finish_forward(ws, plan, x, topk_weights, extra, probe=probe), KeptRows(sched, xs, gu, row_w)


@dataclass
class KeptRows:
    """What a forward keeps for the backward when it keeps the routed rows: the schedule, xs
    [R_max, H], g | u [R_max, 2I] and the rows' router weights [R_max] fp32. ``missing``: "" (xs
    whole), "local" (local rows: xs lacks this rank's rows, the backward copies them in
    from x) or "tokens" (the token pull: xs is every rank's tokens [W*T, H], the backward
    gathers the rows from them and x). ``x``: the layer's input as the forward's gate/up read it
    (contiguous, 16-byte aligned), when something is missing."""

    sched: object
    xs: torch.Tensor
    gu: torch.Tensor
    row_w: torch.Tensor
    missing: str = ""
    x: torch.Tensor | None = None
    x_scale: torch.Tensor | None = None  # the FP8 forward's: xs is E4M3 per 1x128 with these scales [R_max, H/128]


@dataclass
class MegaSaved:
    """What the megakernel forward keeps for the backward: the schedule, x and the router weights."""

    sched: object
    x: torch.Tensor
    topk_weights: torch.Tensor

