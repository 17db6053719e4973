"""The forward through the megakernel (ops/megakernel_fwd.py)."""
from __future__ import annotations


import torch

from ..ops import INTERPRET, megakernel_fwd, streamops
from ..ops.schedule import schedule_capacity
from .plan import Plan
from .probe import Probe, mark
from .workspace import (FWD, FWD_DONE, FWD_X_PULL, FWD_X_READY)
from .forward import KeptRows, MegaSaved
from .steps import _finish_forward, _publish_and_schedule


def _pull_tokens(ws, x, counters, pulled_idx):
    """The token pull (``MoEConfig.fwd_pull_tokens``): every peer's x_pub copied whole into
    xt [W*T, H] (rows src*T ..; this rank's own rows stay unused) by a copy engine, beside the
    megakernel, then ``counters[pulled_idx]`` set to 1. Call it after the publish (x_pub written on
    the current stream) and before the megakernel's launch. Returns (xt, stream): the copy's side
    stream, which the current stream joins after the launch (None when already done).

    On the GPU (``streamops``: no SM taken, the kernel holds them all): the current stream sets
    this rank's FWD_X_PULL flag on every peer (this rank's x_pub is published: the write is fenced
    after the copy before it). A side stream forked from here (after the counters' memset) then,
    for each peer, waits for that peer's flag, copies, resets the flag to 0 (the peer sets it again
    only after this rank's DONE, which waits for ``pulled``) and finally writes the counter.
    Nothing here waits for a kernel: the flags come from the peers' streams, queued before their
    launches. So however the driver maps the side stream onto hardware queues (a stream wait
    blocks its queue), the copy can delay this rank's launch but not deadlock with it. The copy
    from the peer's symmetric memory runs on a copy engine beside the kernel (inferred: it was
    right with the copies queued after the launch, session 13; a copy of this GPU's own memory is
    a kernel on the SMs, scripts/diag_copy_engine.py). Session 14's wrong results were not the
    copy but a stray wait on counter -1 (``megakernel_fwd._wait``, fixed in session 15). Under
    the interpreter (the peers' x_pub already waited for by the host) the copies run here.
    """
    T, H = x.shape
    W, rank = ws.world_size, ws.rank
    xt = x.new_empty((W * T, H))
    peers = [src for src in range(W) if src != rank]
    if INTERPRET or not x.is_cuda:
        for src in peers:
            xt[src * T:(src + 1) * T].copy_(ws.peer_buffer("x_pub", src))
        counters[pulled_idx] = 1
        return xt, None
    main = torch.cuda.current_stream(x.device)
    for dst in peers:  # "my x_pub is published", on every peer
        streamops.write(main, ws.peer_buffer("flags", dst)[FWD_X_PULL, rank].data_ptr(), 1)
    stream = ws.__dict__.get("_pull_stream")
    if stream is None:
        stream = ws.__dict__["_pull_stream"] = torch.cuda.Stream(device=x.device)
    stream.wait_stream(main)
    with torch.cuda.stream(stream):
        for src in peers:
            flag = ws.flags[FWD_X_PULL, src].data_ptr()
            streamops.wait_geq(stream, flag, 1)
            xt[src * T:(src + 1) * T].copy_(ws.peer_buffer("x_pub", src))
            streamops.write(stream, flag, 0)
        streamops.write(stream, counters[pulled_idx].data_ptr(), 1)
    return xt, stream



def _mega_buffers(ws, mega, T, dtype, device, n_tiles):
    """The megakernel's per-rank ring, counters (``n_tiles`` per-tile fill counters: the schedule's
    most tiles) and shared-expert buffers, kept with the workspace."""
    mb = ws.mega_buffers
    if mb is None or (mb.n_slots, mb.n_tiles, mb.h_sh is None, 0 if mb.h_sh is None else mb.h_sh.shape[1]) != (
            mega.n_slots, n_tiles, mega.I_s == 0, mega.I_s):
        mb = ws.mega_buffers = megakernel_fwd.alloc_mega(T, mega.H, mega.I, mega.I_s, mega.tile_m, mega.ring_rows,
                                                         dtype, device, n_tiles)
    return mb


def moe_forward_mega(ws, plan: Plan, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None,
                     save=False, probe: Probe | None = None):
    """Forward pass on one rank through the forward megakernel (``cfg.megakernel``).

    Same launches as ``moe_forward`` before (publish, wait, schedule) and after (signal, wait,
    combine), or with ``fwd_peer_flags`` none of the copies and signal/wait launches (module docstring); dispatch, gate/up, down +
    push and the shared expert run in ONE persistent launch
    over a ring of ``cfg.ring_rows`` rows. Returns (y, saved): with ``save`` the kernel also
    fills xs, g | u and the row weights as ``moe_forward`` does and ``saved`` is a ``KeptRows``
    (xs partly, or the tokens instead, with local rows or the token pull: ``KeptRows.missing``);
    otherwise a MegaSaved (nothing of the ring is kept; the backward recomputes xs and g, u).
    """
    T, H = x.shape
    I = w_gate.shape[1]
    I_s = shared[0].shape[0] if shared is not None else 0
    k, E_local = topk_idx.shape[1], w_gate.shape[0]
    mega = plan.mega
    n_tiles = schedule_capacity(ws.world_size, T, k, E_local, plan.tile_m, plan.align_tiles) // plan.tile_m
    mb = _mega_buffers(ws, mega, T, x.dtype, x.device, n_tiles)
    in_kernel = True
    tma = mega.tma
    # the token pull: gate/up gathers rows from x and the peers' x copied whole (no fills). Every
    # rank must take part (the peers' copies wait for this rank's flag), so an x that gate/up cannot
    # gather from (contiguous, 16-byte aligned) is copied, not a reason to fall back alone.
    tokens = mega.token_pull
    if tokens and (not x.is_contiguous() or x.data_ptr() % 16):
        x = x.clone(memory_format=torch.contiguous_format)
    row_w = None
    if save and tokens:  # written by the schedule (there are no fills)
        row_w = torch.empty(n_tiles * plan.tile_m, dtype=torch.float32, device=x.device)  # the schedule's R_max
    sched = _publish_and_schedule(ws, plan, x, topk_idx, topk_weights, E_local, in_kernel,
                                  on_main=mb.counters.zero_, order=tokens, row_w=row_w, probe=probe)
    assert sched.n_tiles_max == n_tiles
    pull_stream = None
    if tokens:  # (queued before the launch: see _pull_tokens)
        pulled = megakernel_fwd.counter_layout(mb.n_slots, mb.n_sh, mb.n_tiles)["pulled"]
        xt, pull_stream = _pull_tokens(ws, x, mb.counters, pulled)
    programs = mega.programs
    gu_cfg, dn_cfg, gus_cfg, dns_cfg = mega.gate_up, mega.down, mega.shared_gate_up, mega.shared_down
    trace = None
    if probe is not None and probe.trace_events > 0:
        trace = torch.zeros(programs, megakernel_fwd.TRACE_HEAD.value + 4 * probe.trace_events, dtype=torch.int64,
                            device=x.device)
    kept = None
    if save:
        kept = (None if tokens else x.new_empty((sched.R_max, H)), x.new_empty((sched.R_max, 2 * I)),
                row_w if tokens else torch.empty(sched.R_max, dtype=torch.float32, device=x.device))
    local_a = megakernel_fwd.launch_fwd_megakernel(
        mb, sched, ws.ptrs["x_pub"], ws.ptrs["y_in"], ws.err, ws.epoch[FWD:], ws.rank, plan.wait_budget,
        w_gate, w_up, w_down, x=x, shared=shared,
        gu_cfg=gu_cfg, dn_cfg=dn_cfg, gus_cfg=gus_cfg, dns_cfg=dns_cfg,
        programs=programs, comm_programs=mega.comm_programs, prefetch=mega.prefetch,
        pull_cols=mega.fill_cols, ablate=probe.ablate if probe is not None else 0, lag=mega.down_lag,
        fill_split=mega.fill_split, group_m=mega.group_m, tma=tma, save=kept, w_ptrs=ws.ptrs["w_pub"],
        half_tiles=mega.half_tiles, trace=trace, down_cols=mega.down_cols, fill_stages=mega.fill_stages,
        zero_counters=False,
        peers=(ws.ptrs["flags"], ws.flags, FWD_X_READY, FWD_DONE, not INTERPRET) if in_kernel else None,
        local_rows=mega.local_rows,
        tokens=(xt, FWD_X_PULL) if tokens else None)
    if pull_stream is not None:  # the copies are done when the kernel is (its last program waited): join
        torch.cuda.current_stream(x.device).wait_stream(pull_stream)
    if probe is not None:
        probe.trace = trace
    mark(probe, "fwd:megakernel")
    y = _finish_forward(ws, plan, x, topk_weights, mb.extra[:T] if I_s else None, in_kernel, probe=probe)
    if save:
        xs, gu, row_w = kept
        if tokens:
            return y, KeptRows(sched, xt, gu, row_w, "tokens", x)
        return y, KeptRows(sched, xs, gu, row_w, "local", x) if local_a else KeptRows(sched, xs, gu, row_w)
    return y, MegaSaved(sched, x, topk_weights)

