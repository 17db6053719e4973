"""The forward through the megakernel (ops/megakernel_fwd.py)."""
from __future__ import annotations


import torch

from ..ops import INTERPRET, gemm, megakernel_fwd, streamops
from ..ops.schedule import schedule_capacity
from .config import MoEConfig
from .workspace import (FWD, FWD_DONE, FWD_X_PULL, FWD_X_READY)
from .forward import KeptRows, MegaSaved
from .steps import _finish_forward, _gemm_cfg, _publish_and_schedule, _stage


def _mega_cfgs(cfg: MoEConfig, H, I, I_s, warps: int = 8):
    """The megakernel's tile configs for programs of ``warps`` warps: (routed gate/up, routed down,
    shared gate/up, shared down), the shared ones None without a shared expert (I_s = 0).

    The standalone configs (8 warps) or 64 / 128 columns (4 warps: accumulators that fit 128
    threads), or ``cfg.fwd_gate_up_bn`` / ``cfg.fwd_down_bn`` columns (narrower tiles shrink the
    accumulators, the fused kernel's register pressure, at the cost of more tiles). The shared
    expert's tiles are narrowed to the same widths (the same accumulator limit applies). The kernel
    launches with the routed gate/up config's stages and warps."""
    gu, dn = _gemm_cfg(cfg, gemm.KIND_GATE_UP, I, H), _gemm_cfg(cfg, gemm.KIND_DOWN, H, I)
    four = warps == 4
    gu_bn = cfg.fwd_gate_up_bn or (min(gu.BN, 64) if four else None)
    dn_bn = cfg.fwd_down_bn or (min(dn.BN, 128) if four else None)

    def narrowed(c, BN):
        return c if BN is None else c.with_(BN=BN)

    stages = cfg.fwd_num_stages or (3 if four else 4)
    gu = narrowed(gu, gu_bn).with_(num_stages=stages, num_warps=warps)
    gus = narrowed(_gemm_cfg(cfg, gemm.KIND_GATE_UP, I_s, H), gu_bn) if I_s else None
    dns = narrowed(_gemm_cfg(cfg, gemm.KIND_DOWN, H, I_s), dn_bn) if I_s else None
    return gu, narrowed(dn, dn_bn), gus, dns



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



def _mega_buffers(ws, cfg: MoEConfig, T, H, I, I_s, dtype, device, n_tiles):
    """The megakernel's per-rank ring, counters (``n_tiles`` per-tile fill counters: the schedule's
    most tiles) and shared-expert buffers, cached with the workspace."""
    cache = ws.__dict__.setdefault("_mega", {})
    key = (cfg.tile_m, cfg.ring_rows, I_s, n_tiles)
    mb = cache.get(key)
    if mb is None:
        mb = megakernel_fwd.alloc_mega(T, H, I, I_s, cfg.tile_m, cfg.ring_rows, dtype, device, n_tiles)
        cache[key] = mb
    return mb


def moe_forward_mega(ws, cfg: MoEConfig, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None,
                     save=False):
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
    n_tiles = schedule_capacity(ws.world_size, T, k, E_local, cfg.tile_m, cfg.align_tiles(T, k, E_local)) // cfg.tile_m
    mb = _mega_buffers(ws, cfg, T, H, I, I_s, x.dtype, x.device, n_tiles)
    in_kernel = cfg.fwd_peer_flags
    tma = cfg.use_tma(T, topk_idx.shape[1], H, I)
    # the token pull: gate/up gathers rows from x and the peers' x copied whole (no fills). Every
    # rank must take part (the peers' copies wait for this rank's flag), so an x that gate/up cannot
    # gather from (contiguous, 16-byte aligned) is copied, not a reason to fall back alone.
    tokens = cfg.token_pull_on(T, k, H, I, E_local * ws.world_size)
    if tokens and (not x.is_contiguous() or x.data_ptr() % 16):
        x = x.clone(memory_format=torch.contiguous_format)
    row_w = None
    if save and tokens:  # written by the schedule (there are no fills)
        row_w = torch.empty(n_tiles * cfg.tile_m, dtype=torch.float32, device=x.device)  # the schedule's R_max
    sched = _publish_and_schedule(ws, cfg, x, topk_idx, topk_weights, E_local, in_kernel,
                                  on_main=mb.counters.zero_, order=tokens, row_w=row_w)
    assert sched.n_tiles_max == n_tiles
    pull_stream = None
    if tokens:  # (queued before the launch: see _pull_tokens)
        pulled = megakernel_fwd.counter_layout(mb.n_slots, mb.n_sh, mb.n_tiles)["pulled"]
        xt, pull_stream = _pull_tokens(ws, x, mb.counters, pulled)
    warps = cfg.mega_warps(T, topk_idx.shape[1], H, I)
    programs = cfg.fwd_programs or megakernel_fwd.default_programs(x.device) * (8 // warps)
    gu_cfg, dn_cfg, gus_cfg, dns_cfg = _mega_cfgs(cfg, H, I, I_s, warps)
    trace = None
    if cfg.fwd_trace_events > 0:
        trace = torch.zeros(programs, megakernel_fwd.TRACE_HEAD.value + 4 * cfg.fwd_trace_events, dtype=torch.int64,
                            device=x.device)
    kept = None
    if save:
        kept = (None if tokens else x.new_empty((sched.R_max, H)), x.new_empty((sched.R_max, 2 * I)),
                row_w if tokens else torch.empty(sched.R_max, dtype=torch.float32, device=x.device))
    local_a = megakernel_fwd.launch_fwd_megakernel(
        mb, sched, ws.ptrs["x_pub"], ws.ptrs["y_in"], ws.err, ws.epoch[FWD:], ws.rank, cfg.wait_budget(),
        w_gate, w_up, w_down, x=x, shared=shared,
        gu_cfg=gu_cfg, dn_cfg=dn_cfg, gus_cfg=gus_cfg, dns_cfg=dns_cfg,
        programs=programs, comm_programs=cfg.fwd_comm_programs, prefetch=cfg.fwd_prefetch,
        pull_cols=cfg.fwd_pull_cols or cfg.pull_cols, ablate=cfg.fwd_ablate, lag=cfg.fwd_down_lag, fill_split=cfg.fwd_fill_split,
        group_m=cfg.group_m(H, I), tma=tma, save=kept, w_ptrs=ws.ptrs["w_pub"],
        half_tiles=cfg.fwd_half_tiles, trace=trace, down_cols=cfg.down_cols(I), fill_stages=cfg.fill_stages(warps),
        ticket_ahead=cfg.fwd_ticket_ahead, poll_together=cfg.fwd_poll_together, fill_table=cfg.fwd_fill_table,
        tile_ready=cfg.fwd_tile_ready, zero_counters=False,
        peers=(ws.ptrs["flags"], ws.flags, FWD_X_READY, FWD_DONE, not INTERPRET) if in_kernel else None,
        local_rows=cfg.fwd_local_rows, early_ticket=cfg.fwd_early_ticket,
        tokens=(xt, FWD_X_PULL) if tokens else None)
    if pull_stream is not None:  # the copies are done when the kernel is (its last program waited): join
        torch.cuda.current_stream(x.device).wait_stream(pull_stream)
    if trace is not None:
        megakernel_fwd.LAST_TRACE = megakernel_fwd.LAST_TRACE_BY_RANK[ws.rank] = trace
    _stage("fwd:megakernel")
    y = _finish_forward(ws, cfg, x, topk_weights, mb.extra[:T] if I_s else None, in_kernel)
    if save:
        xs, gu, row_w = kept
        if tokens:
            return y, KeptRows(sched, xt, gu, row_w, "tokens", x)
        return y, KeptRows(sched, xs, gu, row_w, "local", x) if local_a else KeptRows(sched, xs, gu, row_w)
    return y, MegaSaved(sched, x, topk_weights)

