"""The forward megakernel's host side: its per-rank buffers and the launcher.

``launch`` runs one rank's forward megakernel as its ``MegaPlan`` says. It decides nothing from
shapes and switches nothing off: an operand that the plan cannot use (a TMA operand not 16-byte
aligned, an x that local rows cannot gather from, buffers of another plan) is a ``ValueError``
naming it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import INTERPRET
from ..gemm.bf16 import tma_aligned
from .kernel import (Descs, MegaConsts, OrderArgs, PeerArgs, ProbeConsts, RouteArgs, RoutedArgs, SavedArgs,
                     SharedArgs, SyncArgs, TokenArgs, moe_fwd_megakernel)
from .plan import MegaPlan
from .protocol import TRACE_HEAD, counter_layout


@dataclass
class MegaBuffers:
    """One rank's buffers of the forward megakernel (local, not symmetric), made once per plan."""

    n_slots: int
    tile_m: int
    n_sh: int  # the shared expert's x row tiles (0: no shared expert)
    n_tiles: int  # per-tile fill counters (the schedule's most row tiles)
    counters: torch.Tensor  # int32 [counter_layout(...).total]
    xs_ring: torch.Tensor  # [n_slots * tile_m, H]
    h_ring: torch.Tensor  # [n_slots * tile_m, I]
    h_sh: torch.Tensor | None  # [n_sh * tile_m, I_s]
    extra: torch.Tensor | None  # [n_sh * tile_m, H]: the shared expert's output (rows >= T unused)
    sh_tiles: torch.Tensor  # int32 [max(n_sh, 1)] zeros: the shared expert is "expert 0" of every x row tile
    sh_n: torch.Tensor  # int32 [1] = n_sh

    @property
    def layout(self):
        return counter_layout(self.n_slots, self.n_sh, self.n_tiles)

    def fits(self, plan: MegaPlan, T: int, n_tiles: int) -> bool:
        """Whether these buffers serve ``plan`` for T tokens and a schedule of ``n_tiles`` row tiles."""
        n_sh = triton.cdiv(T, plan.tile_m) if plan.I_s else 0
        return ((self.n_slots, self.tile_m, self.n_sh, self.n_tiles) == (plan.n_slots, plan.tile_m, n_sh, n_tiles)
                and tuple(self.xs_ring.shape) == (plan.ring_rows, plan.H)
                and tuple(self.h_ring.shape) == (plan.ring_rows, plan.I)
                and (self.h_sh is None) == (plan.I_s == 0)
                and (self.h_sh is None or self.h_sh.shape[1] == plan.I_s))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.counters, self.xs_ring, self.h_ring, self.h_sh,
                                                          self.extra, self.sh_tiles, self.sh_n) if t is not None)


def alloc(plan: MegaPlan, T: int, n_tiles: int, dtype: torch.dtype, device) -> MegaBuffers:
    """The buffers of ``plan`` for T tokens per rank and a schedule of at most ``n_tiles`` row tiles."""
    BM = plan.tile_m
    n_sh = triton.cdiv(T, BM) if plan.I_s else 0
    lay = counter_layout(plan.n_slots, n_sh, n_tiles)
    i32 = dict(dtype=torch.int32, device=device)
    return MegaBuffers(
        n_slots=plan.n_slots, tile_m=BM, n_sh=n_sh, n_tiles=n_tiles,
        # one guard word before the counters, always 0: a wait that did read index -1 (the protocol's
        # "no wait") would time out with an error record instead of reading another allocation
        counters=torch.zeros(lay.total + 1, **i32)[1:],
        xs_ring=torch.empty(plan.ring_rows, plan.H, dtype=dtype, device=device),
        h_ring=torch.empty(plan.ring_rows, plan.I, dtype=dtype, device=device),
        h_sh=torch.empty(n_sh * BM, plan.I_s, dtype=dtype, device=device) if plan.I_s else None,
        extra=torch.empty(n_sh * BM, plan.H, dtype=dtype, device=device) if plan.I_s else None,
        sh_tiles=torch.zeros(max(n_sh, 1), **i32),
        sh_n=torch.full((1,), n_sh, **i32),
    )


class Peers(NamedTuple):
    """Every rank's buffers and this rank's flags, as the workspace holds them."""
    x_ptrs: torch.Tensor  # int64 [W]: every rank's x_pub [T, H]
    y_ptrs: torch.Tensor  # int64 [W]: every rank's y_in [T*k, H]
    w_ptrs: torch.Tensor  # int64 [W]: every rank's w_pub [T, k] (router weights)
    flag_ptrs: torch.Tensor  # int64 [W]: every rank's flags [slots, W]
    my_flags: torch.Tensor  # int32 [slots, W]: this rank's
    x_slot: int  # flag slot: this rank's x is published
    done_slot: int  # flag slot: this rank's rows are pushed to their origins
    x_pull_slot: int  # flag slot of the token pull's copy streams (set to 1, not an epoch)
    done_wait: bool  # the kernel waits for every rank's DONE (False under the interpreter: the
    # ranks' launches run one after another there, and the host polls instead)


class Kept(NamedTuple):
    """What a differentiated forward keeps for the backward (full-size, R = the schedule's rows)."""
    xs: torch.Tensor | None  # [R, H] the routed rows (None with the token pull: the tokens are kept)
    gu: torch.Tensor  # [R, 2I] g | u
    row_w: torch.Tensor  # fp32 [R]: each row's router weight (with the token pull: written by the schedule)


@dataclass
class MegaProbe:
    """Instrumentation of one launch (measurement only). ``trace``: None, or an int64 [programs,
    TRACE_HEAD + 4 * events] tensor the kernel records its first ``events`` tickets per program
    into. ``ablate``: bit 1 skips the fills' row copies, 2 the routed GEMM math, 4 pushes every row
    into this rank's own buffer; every wait and signal stays, but the output is WRONG."""

    trace: torch.Tensor | None = None
    ablate: int = 0


def kernel_consts(plan: MegaPlan, *, world_size: int, has_shared: bool, save: bool, tokens: bool, x_slot: int,
                  done_slot: int, x_pull_slot: int, done_wait: bool, interpret: bool = INTERPRET) -> MegaConsts:
    """The kernel's compile-time constants for ``plan`` (and the protocol's counts derived from it)."""
    gu, dn = plan.gate_up, plan.down
    gus, dns = (plan.shared_gate_up, plan.shared_down) if has_shared else (gu, dn)  # placeholders without
    I_s = plan.I_s if has_shared else 0
    cdiv = triton.cdiv
    act, limit, alpha = plan.activation.constexprs()
    return MegaConsts(
        NS=plan.n_slots, FS=plan.fill_split, GM=plan.group_m, COMM=plan.comm_programs, HAS_SHARED=has_shared,
        H=plan.H, I=plan.I, IS=I_s, BM=plan.tile_m, BH=plan.fill_cols,
        BN_GU=gu.BN, BK_GU=gu.BK, BN_DN=dn.BN, BK_DN=dn.BK, BN_GUS=gus.BN, BK_GUS=gus.BK, BN_DNS=dns.BN,
        BK_DNS=dns.BK, TMA=plan.tma, SAVE=save, HALF=plan.half_tiles, DN_COLS=plan.down_cols,
        FILL_STAGES=plan.fill_stages, NW=plan.num_warps, WP=triton.next_power_of_2(world_size), X_SLOT=x_slot,
        DONE_SLOT=done_slot, X_PULL=x_pull_slot, DONE_WAIT=done_wait, LOCAL_A=plan.local_rows, TOKENS=tokens,
        INTERPRET=interpret,
        G=cdiv(plan.I, gu.BN), D=cdiv(plan.H, dn.BN) // plan.down_cols, GS=cdiv(I_s, gus.BN),
        DS=cdiv(plan.H, dns.BN), F=0 if (plan.comm_programs > 0 or tokens) else plan.fill_split,
        TR=save and not tokens, SH_GU=counter_layout(plan.n_slots, 0).sh_gu, ACT=act, LIMIT=limit, ALPHA=alpha)


def _desc(t: torch.Tensor, block) -> TensorDescriptor:
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))


def _check_tma(name: str, t: torch.Tensor) -> None:
    """Raise unless a tensor descriptor can address ``t`` (``gemm.tma_aligned``)."""
    if not tma_aligned(t):
        raise ValueError(f"the plan loads through TMA, but {name} (strides {tuple(t.stride())}, address "
                         f"{t.data_ptr():#x}) is not 16-byte aligned with a unit last stride")


def launch(plan: MegaPlan, bufs: MegaBuffers, sched, *, x: torch.Tensor, w_gate: torch.Tensor,
           w_up: torch.Tensor, w_down: torch.Tensor, shared=None, peers: Peers, err: torch.Tensor,
           epoch: torch.Tensor, rank: int, wait_budget: int, kept: Kept | None = None,
           tokens: torch.Tensor | None = None, probe: MegaProbe | None = None, zero_counters: bool = True) -> None:
    """Run the forward megakernel of ``plan`` on one rank.

    sched: the schedule (row_src, tile_expert, num_tiles, k, T; with the token pull also its tile
    order); x [T, H]: this rank's input (the shared expert's and local rows' A rows); weights as in
    ``tabby.moe``; shared: None or (w_gate_s, w_up_s, w_down_s), whose output lands in
    ``bufs.extra[:T]``; err, epoch: this rank's error record and the pass's epoch (int32 device
    tensors). ``kept``: what a differentiated forward keeps (None: nothing). ``tokens``: with the
    token pull, xt [W*T, H] that receives every peer's x beside the kernel (the caller queues the
    copies and the write of the ``pulled`` counter). ``zero_counters=False``: the caller zeroed the
    counters before the launch (the flags and DONE rely on it).
    """
    E, I, H = w_gate.shape
    BM = plan.tile_m
    if (H, I) != (plan.H, plan.I) or sched.BM != BM:
        raise ValueError(f"the plan is for H={plan.H}, I={plan.I}, tile_m={BM}; got weights of H={H}, I={I} and a "
                         f"schedule of {sched.BM}-row tiles")
    if w_up.shape != w_gate.shape or w_up.stride() != w_gate.stride() or w_down.shape != (E, H, I):
        raise ValueError("w_up must have w_gate's shape and strides, w_down [E, H, I]")
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if w.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last stride")
    if not bufs.fits(plan, sched.T, sched.n_tiles_max):
        raise ValueError("the megakernel's buffers were made for another plan or shape (host.alloc)")
    has_sh = shared is not None
    if has_sh != (plan.I_s > 0) or (has_sh and shared[0].shape[0] != plan.I_s):
        raise ValueError(f"the plan is for a shared expert of width {plan.I_s}; got "
                         f"{shared[0].shape[0] if has_sh else 'none'}")
    if plan.token_pull != (tokens is not None):
        raise ValueError("the token pull's tokens xt are given exactly when the plan pulls tokens")
    if tokens is not None and sched.tile_order is None:
        raise ValueError("the token pull needs a schedule with a tile order (alloc_schedule(order=True))")
    W = peers.x_ptrs.numel()
    T, k = sched.T, sched.k
    if x.shape != (T, H):
        raise ValueError(f"x must be [T={T}, H={H}], got {tuple(x.shape)}")
    if INTERPRET and plan.comm_programs > 0 and int(sched.num_tiles) > plan.n_slots:  # CPU tensors: no device sync
        raise ValueError(f"under the interpreter, comm programs need a ring that holds every tile "
                         f"({int(sched.num_tiles)} tiles, {plan.n_slots} slots): programs run one after another, "
                         f"so the comm program would wait forever for a slot")
    xs = tokens if tokens is not None else (kept.xs if kept is not None else bufs.xs_ring)
    R = sched.row_src.numel()
    if tokens is not None and (tuple(tokens.shape) != (W * T, H) or not tokens.is_contiguous()):
        raise ValueError(f"the tokens xt must be a contiguous [W*T={W * T}, H={H}] tensor")
    if kept is not None:
        if kept.gu.shape != (R, 2 * I) or not kept.gu.is_contiguous():
            raise ValueError(f"kept g | u must be a contiguous [R={R}, 2I={2 * I}] tensor")
        if kept.row_w.shape != (R,) or kept.row_w.dtype != torch.float32:
            raise ValueError(f"kept row weights must be fp32 [R={R}]")
        if tokens is None and (kept.xs is None or kept.xs.shape != (R, H) or not kept.xs.is_contiguous()):
            raise ValueError(f"kept xs must be a contiguous [R={R}, H={H}] tensor")
    if plan.local_rows and (not x.is_contiguous() or x.data_ptr() % 16 or xs.data_ptr() % 16):
        raise ValueError("the plan gathers local rows from x (local_rows): x must be contiguous and 16-byte "
                         "aligned (the caller copies it otherwise), and so must the routed-row buffer")
    if has_sh:
        sg, su, sd = shared
        for name, w in (("shared w_gate", sg), ("shared w_up", su), ("shared w_down", sd)):
            if not w.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        if not x.is_contiguous():
            raise ValueError("x must be contiguous (the shared expert reads its rows)")
    trace = probe.trace if probe is not None else None
    ablate = probe.ablate if probe is not None else 0
    if trace is not None and (trace.dtype != torch.int64 or trace.shape[0] != plan.programs
                              or trace.shape[1] <= TRACE_HEAD.value or (trace.shape[1] - TRACE_HEAD.value) % 4):
        raise ValueError(f"a trace must be int64 [programs={plan.programs}, TRACE_HEAD + 4 * events]")

    descs = Descs(*[None] * 12)
    if plan.tma:
        operands = [("the routed rows", xs), ("the ring h", bufs.h_ring), ("w_gate", w_gate), ("w_up", w_up),
                    ("w_down", w_down)]
        if has_sh:
            operands += [("x", x), ("shared w_gate", sg), ("shared w_up", su), ("shared w_down", sd)]
        for name, t in operands:
            _check_tma(name, t)
        gu, dn = plan.gate_up, plan.down
        descs = descs._replace(xs=_desc(xs, [BM, gu.BK]), w_gate=_desc(w_gate, [1, gu.BN, gu.BK]),
                               w_up=_desc(w_up, [1, gu.BN, gu.BK]), h=_desc(bufs.h_ring, [BM, dn.BK]),
                               w_down=_desc(w_down, [1, dn.BN, dn.BK]))
        if has_sh:  # the shared expert is "expert 0" of [1, ...] weight views
            gus, dns = plan.shared_gate_up, plan.shared_down
            descs = descs._replace(x=_desc(x, [BM, gus.BK]), s_gate=_desc(sg.unsqueeze(0), [1, gus.BN, gus.BK]),
                                   s_up=_desc(su.unsqueeze(0), [1, gus.BN, gus.BK]),
                                   h_sh=_desc(bufs.h_sh, [BM, dns.BK]),
                                   s_down=_desc(sd.unsqueeze(0), [1, dns.BN, dns.BK]))
        if plan.half_tiles:
            descs = descs._replace(xs_half=_desc(xs, [BM // 2, gu.BK]), h_half=_desc(bufs.h_ring, [BM // 2, dn.BK]))

    if zero_counters:
        bufs.counters.zero_()
    lay = bufs.layout
    y_ptrs = peers.y_ptrs
    if ablate & 4:  # measurement only: every pushed row lands in this rank's own buffer (no NVLink)
        y_ptrs = y_ptrs[rank].expand(y_ptrs.numel()).contiguous()
    # placeholders where a part is absent (never read: its code is not compiled)
    if has_sh:
        shared_args = SharedArgs(x, T, sg, su, sd, bufs.h_sh, bufs.extra, bufs.sh_tiles, bufs.sh_n, bufs.n_sh)
    else:
        shared_args = SharedArgs(x, T, w_gate, w_gate, w_gate, bufs.h_ring, bufs.h_ring, bufs.sh_tiles, bufs.sh_n,
                                 bufs.n_sh)
    saved = SavedArgs(peers.w_ptrs, kept.row_w, kept.gu) if kept is not None else SavedArgs(None, None, None)
    consts = kernel_consts(plan, world_size=W, has_shared=has_sh, save=kept is not None, tokens=tokens is not None,
                           x_slot=peers.x_slot, done_slot=peers.done_slot, x_pull_slot=peers.x_pull_slot,
                           done_wait=peers.done_wait)
    probe_consts = ProbeConsts(TRACE_EV=0 if trace is None else (trace.shape[1] - TRACE_HEAD.value) // 4,
                               ABLATE=ablate)
    # Comm programs need every program resident (compute programs wait on them): a cooperative
    # launch fails instead of hanging when the grid does not fit. The merged ticket order needs no
    # co-residency: a program waits only on tickets already taken.
    launch_kw = dict(launch_cooperative_grid=True) if plan.comm_programs > 0 and not INTERPRET else {}
    moe_fwd_megakernel[(plan.programs,)](
        SyncArgs(bufs.counters, err, epoch, rank, wait_budget),
        RouteArgs(sched.row_src, sched.tile_expert, sched.num_tiles, peers.x_ptrs, y_ptrs, T * k, k),
        RoutedArgs(xs, bufs.h_ring, w_gate, w_up, w_gate.stride(0), w_gate.stride(1), w_down, w_down.stride(0),
                   w_down.stride(1)),
        shared_args,
        OrderArgs(plan.prefetch, plan.down_lag),
        *descs,  # top-level arguments: the launcher expands no descriptor inside a tuple
        saved,
        trace,
        PeerArgs(W, peers.flag_ptrs, peers.my_flags, lay.programs_done),
        x,
        TokenArgs(sched.tile_order, sched.local_tiles, lay.pulled) if tokens is not None
        else TokenArgs(None, None, lay.pulled),
        C=consts, PROBE=probe_consts, num_warps=plan.num_warps, num_stages=plan.num_stages, **launch_kw)
