"""The forward through the megakernel (``tabby.ops.megakernel``): the schedule's launches, one
persistent launch for dispatch, gate/up, down + push and the shared expert, then the combine."""
from __future__ import annotations

import torch

from ..ops import INTERPRET, megakernel, streamops
from ..ops.schedule import schedule_capacity
from .forward import KeptRows, MegaSaved
from .memory import layer_buffers
from .plan import Plan
from .probe import Probe, mark
from .steps import finish_forward, publish_and_schedule
from .workspace import FWD, FWD_DONE, FWD_X_PULL, FWD_X_READY


def _pull_tokens(ws, plan: Plan, x, counters, pulled_idx):
    """The token pull (``MegaPlan.token_pull``): every peer's x_pub copied whole into xt [W*T, H]
    (rows src*T ..; this rank's own rows stay unused) by a copy engine, beside the megakernel, then
    ``counters[pulled_idx]`` set to 1. Call it after the publish (x_pub written on the current
    stream) and before the megakernel's launch. Returns (xt, stream): the copy's side stream, which
    the current stream joins after the launch (None when already done).

    On the GPU (``streamops``: no SM taken, the kernel holds them all): the current stream sets
    this rank's FWD_X_PULL flag on every peer (this rank's x_pub is published: the write is fenced
    after the copy before it). A side stream forked from here (after the counters' memset) then,
    for each peer, waits for that peer's flag, copies, resets the flag to 0 (the peer sets it again
    only after this rank's DONE, which waits for ``pulled``) and finally writes the counter.
    Nothing here waits for a kernel: the flags come from the peers' streams, queued before their
    launches. So however the driver maps the side stream onto hardware queues (a stream wait
    blocks its queue), the copy can delay this rank's launch but not deadlock with it. A copy from
    a peer's symmetric memory runs on a copy engine beside the kernel (a copy of this GPU's own
    memory would be a kernel on the SMs; docs/performance.md, "Token pull"). Under the interpreter (the
    peers' x_pub already waited for by the host) the copies run here.
    """
    T = x.shape[0]
    W, rank = ws.world_size, ws.rank
    xt = layer_buffers(plan).empty("tokens", x.device)
    peers = [src for src in range(W) if src != rank]
    if INTERPRET or not x.is_cuda:
        for src in peers:
            xt[src * T:(src + 1) * T].copy_(ws.peer_buffer("x_pub", src))
        counters[pulled_idx] = 1
        return xt, None
    main = torch.cuda.current_stream(x.device)
    for dst in peers:  # "my x_pub is published", on every peer
        streamops.write(main, ws.peer_buffer("flags", dst)[FWD_X_PULL, rank].data_ptr(), 1)
    if ws.pull_stream is None:
        ws.pull_stream = torch.cuda.Stream(device=x.device)
    stream = ws.pull_stream
    stream.wait_stream(main)
    with torch.cuda.stream(stream):
        for src in peers:
            flag = ws.flags[FWD_X_PULL, src].data_ptr()
            streamops.wait_geq(stream, flag, 1)
            xt[src * T:(src + 1) * T].copy_(ws.peer_buffer("x_pub", src))
            streamops.write(stream, flag, 0)
        streamops.write(stream, counters[pulled_idx].data_ptr(), 1)
    return xt, stream


def moe_forward_mega(ws, plan: Plan, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None,
                     save=False, probe: Probe | None = None):
    """Forward pass on one rank through the forward megakernel (``plan.mega``).

    The schedule's launches before the kernel publish the routing and x (the pass's flags are set
    and waited for inside the kernels); dispatch, gate/up, down + push and the shared expert run in
    ONE persistent launch over a ring of ``plan.mega.ring_rows`` rows; the combine follows. Returns
    (y, saved): with ``save`` the kernel also fills xs, g | u and the row weights as the sync-free
    forward does and ``saved`` is a ``KeptRows`` (xs without this rank's rows with local rows, the
    tokens instead with the token pull: ``KeptRows.missing``); otherwise a ``MegaSaved`` (nothing of
    the ring is kept; the backward recomputes xs and g, u).
    """
    mega = plan.mega
    T = x.shape[0]
    k, E_local = topk_idx.shape[1], w_gate.shape[0]
    n_tiles = schedule_capacity(ws.world_size, T, k, E_local, plan.tile_m, plan.align_tiles) // plan.tile_m
    mb = ws.mega_buffers
    if mb is None or not mb.fits(mega, T, n_tiles):
        mb = ws.mega_buffers = megakernel.alloc(mega, T, n_tiles, x.dtype, x.device)
    # Local rows and the token pull gather A rows from x, and TMA loads the shared expert's: an x
    # they cannot read (not contiguous, not 16-byte aligned) is copied. Every rank takes part in the
    # token pull (the peers' copies wait for this rank's flag), so it is never dropped on one rank.
    if (mega.local_rows or (mega.tma and shared is not None)) and (not x.is_contiguous() or x.data_ptr() % 16):
        x = x.clone(memory_format=torch.contiguous_format)
    tokens = mega.token_pull
    row_w = None
    bufs = layer_buffers(plan)
    if save and tokens:  # written by the schedule (there are no fills)
        row_w = bufs.empty("row_w", x.device)
    sched = publish_and_schedule(ws, plan, x, topk_idx, topk_weights, E_local, in_kernel=True,
                                  on_main=mb.counters.zero_, order=tokens, row_w=row_w, probe=probe)
    pull_stream = xt = None
    if tokens:  # (queued before the launch: see _pull_tokens)
        xt, pull_stream = _pull_tokens(ws, plan, x, mb.counters, mb.layout.pulled)
    mprobe = None
    if probe is not None:
        trace = None
        if probe.trace_events > 0:
            trace = torch.zeros(mega.programs, megakernel.TRACE_HEAD.value + 4 * probe.trace_events,
                                dtype=torch.int64, device=x.device)
        mprobe = megakernel.MegaProbe(trace=trace, ablate=probe.ablate)
    kept = None
    if save:
        kept = megakernel.Kept(xs=None if tokens else bufs.empty("xs", x.device), gu=bufs.empty("gu", x.device),
                               row_w=row_w if tokens else bufs.empty("row_w", x.device))
    peers = megakernel.Peers(x_ptrs=ws.ptrs["x_pub"], y_ptrs=ws.ptrs["y_in"], w_ptrs=ws.ptrs["w_pub"],
                             flag_ptrs=ws.ptrs["flags"], my_flags=ws.flags, x_slot=FWD_X_READY, done_slot=FWD_DONE,
                             x_pull_slot=FWD_X_PULL, done_wait=not INTERPRET)
    megakernel.launch(mega, mb, sched, x=x, w_gate=w_gate, w_up=w_up, w_down=w_down, shared=shared, peers=peers,
                      err=ws.err, epoch=ws.epoch[FWD:], rank=ws.rank, wait_budget=plan.wait_budget, kept=kept,
                      tokens=xt, probe=mprobe, zero_counters=False)
    if pull_stream is not None:  # the copies are done when the kernel is (its last program waited): join
        torch.cuda.current_stream(x.device).wait_stream(pull_stream)
    if mprobe is not None:
        probe.trace = mprobe.trace
    mark(probe, "fwd:megakernel")
    y = finish_forward(ws, plan, x, topk_weights, mb.extra[:T] if shared is not None else None, in_kernel=True,
                        probe=probe)
    if save:
        if tokens:
            return y, KeptRows(sched, xt, kept.gu, kept.row_w, "tokens", x)
        if mega.local_rows:
            return y, KeptRows(sched, kept.xs, kept.gu, kept.row_w, "local", x)
        return y, KeptRows(sched, kept.xs, kept.gu, kept.row_w)
    return y, MegaSaved(sched, x, topk_weights)
