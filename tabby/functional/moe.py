"""The sync-free expert-parallel MoE layer: forward, backward and the autograd Function.

Each pass is a short sequence of launches on the current stream, none of which reads anything
back to the host (so a forward + backward can be captured in a CUDA graph):

forward, on every rank
    publish      copy topk_idx, topk_weights into the symmetric buffers
    signal+wait  FWD_READY to all; every peer's (its routing is readable)   | on a high-priority side
    schedule     every rank's topk_idx -> routed-row table of the local       | stream, while the current
                 experts (ops/schedule.py)                                     | one copies x into x_pub
    signal+wait  join the side stream; FWD_X_READY (every peer's x is readable)
    dispatch     pull x rows (and router weights) from their source ranks into xs   (ops/comm.py)
    gate/up      h = silu(xs Wg^T) * (xs Wu^T); g, u saved for the backward          (ops/gemm.py)
    down         rows of h Wd^T pushed to the origin's y_in[t*k + kk]                (ops/gemm.py)
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

With ``MoEConfig(megakernel=True)`` (the default) the forward runs dispatch, gate/up, down +
push and the shared expert in ONE persistent launch over a ring of ``ring_rows`` rows
(ops/megakernel_fwd.py; ``moe_forward_mega``). When a backward will follow
(``fwd_save_for_backward``, on by default) the kernel also fills xs, g | u and the row weights as
above and the backward is the same; otherwise nothing of the ring is kept, and the backward
publishes x and topk_weights again with dy and recomputes xs, the row weights and g, u (pull +
gate/up), then runs the same launches as above. The shared expert then lives inside the Function
(``_TabbyMoEMega``), whose backward recomputes it with the same torch ops for its gradients.
With ``fwd_peer_flags`` (the default) the megakernel forward's flags are set and waited for inside
its kernels: the schedule's count launch publishes this rank's routing, the last of its chunks
signals FWD_READY, and the peers' chunks wait for theirs; the megakernel signals FWD_X_READY at its
start and waits for the peers' before its first ticket, and its last program signals FWD_DONE and
waits for the peers'; the combine follows in stream order. No launch on the forward's critical path
only copies or signals. (Under the interpreter a kernel cannot wait for another rank's launch, so
there, with several ranks, the routing copies and signal/wait launches of ``fwd_peer_flags=False``
and host polls of the x-ready and DONE flags come between the launches.)
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from ..ops import INTERPRET, comm, gemm, megakernel_fwd, streamops, sync
from ..ops.combine import combine_k
from ..ops.schedule import alloc_schedule, launch_schedule, schedule_capacity
from ..validate import MoEInputError, check_inputs
from .config import MoEConfig
from .workspace import (BWD, BWD_DONE, BWD_READY, FWD, FWD_DONE, FWD_READY, FWD_X_PULL, FWD_X_READY, ThreadGroup,
                        WorkspaceKey, get_workspace)


@dataclass(frozen=True)
class ThreadRank:
    """The ``group`` argument in the CPU test harness: rank ``rank`` of a ``ThreadGroup``."""

    group: ThreadGroup
    rank: int


def _group_info(group):
    """(rank, world size, torch process group or None, thread group or None).

    ``group=None`` means one rank, as in ``moe_reference`` (even when a default group exists).
    """
    if isinstance(group, ThreadRank):
        return group.rank, group.group.world_size, None, group.group
    if group is None:
        return 0, 1, None, None
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group), group, None


# Stage timing (tabby profile): None, or an object with .mark(name) called at stage boundaries.
STAGE_TIMER = None


def _stage(name):
    if STAGE_TIMER is not None:
        STAGE_TIMER.mark(name)


def _signal(ws, slot, epoch_idx, bump):
    comm.signal_peers_kernel[(1,)](ws.ptrs["flags"], ws.epoch[epoch_idx:], slot, ws.rank, ws.world_size,
                                   BUMP=bump)


def _wait(ws, slot, epoch_idx, code, cfg):
    if INTERPRET:  # CPU harness: poll from the host so other ranks' threads can run their kernels
        ready = torch.zeros(1, dtype=torch.int32)
        for _ in range(cfg.max_wait_iters):
            comm.count_ready_kernel[(1,)](ws.flags, ws.epoch[epoch_idx:], slot, ws.world_size, ready)
            if int(ready) == ws.world_size:
                return
            time.sleep(1e-3)
        # Not ready: the bounded wait below records what was missing.
        comm.wait_peers_kernel[(1,)](ws.flags, ws.epoch[epoch_idx:], slot, ws.rank, ws.world_size,
                                     0, ws.err, code)
        return
    comm.wait_peers_kernel[(1,)](ws.flags, ws.epoch[epoch_idx:], slot, ws.rank, ws.world_size,
                                 cfg.wait_budget(), ws.err, code)


def _signal_wait(ws, slot, epoch_idx, bump, code, cfg):
    """``_signal`` then ``_wait``; on the GPU in one launch (``comm.signal_wait_peers_kernel``: a
    Triton launch costs the host ~30-50 us, which small shapes feel)."""
    if INTERPRET:  # the wait polls from the host (see _wait)
        _signal(ws, slot, epoch_idx, bump)
        _wait(ws, slot, epoch_idx, code, cfg)
        return
    comm.signal_wait_peers_kernel[(1,)](ws.ptrs["flags"], ws.flags, ws.epoch[epoch_idx:], slot, ws.rank,
                                        ws.world_size, cfg.wait_budget(), ws.err, code, BUMP=bump)


def _pull_rows(cfg, sched, src_ptrs, dst, TK, k, w_ptrs=None, ws_out=None, only_rank=None):
    """Rows of the schedule into dst [R, H] from every rank's [T, H] buffer (``src_ptrs``), with
    their router weights (``w_ptrs`` -> ``ws_out``); ``only_rank``: only the rows from that rank."""
    H = dst.shape[1]
    with_w = w_ptrs is not None
    comm.pull_rows_kernel[(cfg.comm_programs,)](
        sched.row_src, sched.num_tiles, src_ptrs, dst, H, TK, k,
        w_ptrs if with_w else src_ptrs, ws_out if with_w else dst,
        BR=cfg.pull_rows, BH=min(cfg.pull_cols, triton.next_power_of_2(H)), WITH_WEIGHTS=with_w,
        TILE_ROWS=cfg.tile_m, ROWS_16B=(H * dst.element_size()) % 16 == 0, ONLY_RANK=only_rank is not None,
        rank=only_rank or 0, num_warps=8)


def _gemm_cfg(cfg: MoEConfig, kind, N, K):
    """The GEMM config of ``kind``: row tiles are the schedule's tiles (cfg.tile_m)."""
    return gemm.default_config(kind, N, K, BM=cfg.tile_m)


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


def _debug_check(ws, cfg: MoEConfig, t):
    """Debug mode: raise at once on a device error (a host sync), except while a CUDA graph is
    captured (a replay runs without the check; call ``check_errors`` after it)."""
    if cfg.debug and not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
        ws.check_errors()


def _side_stream(ws, cfg: MoEConfig, x):
    """The workspace's side stream for the forward's schedule (None: no overlap), at the device's
    highest stream priority, so that the block scheduler starts its small launches ahead of the x
    copy's pending blocks."""
    if not (cfg.overlap_publish and x.is_cuda):
        return None
    side = ws.__dict__.get("_side_stream")
    if side is None:
        side = ws.__dict__["_side_stream"] = torch.cuda.Stream(device=x.device,
                                                               priority=torch.cuda.Stream.priority_range()[1])
    return side


def _publish_and_schedule(ws, cfg: MoEConfig, x, topk_idx, topk_weights, E_local, in_kernel=False, on_main=None,
                          order=False, row_w=None):
    """Publish this rank's inputs, wait for every peer's, build the routed-row schedule.

    The schedule needs only the routing, so x (T * H * 2 bytes, the bulk of the publish: ~30 us at
    qwen3-30b-a3b 16384) gets its own flag, FWD_X_READY, and with ``MoEConfig.overlap_publish`` its
    copy runs on the current stream while a high-priority side stream signals FWD_READY (the pass's
    new epoch), waits for the peers' and builds the schedule. The current stream then joins the side
    stream, and signals and waits FWD_X_READY (the same epoch) before anything reads x_pub. The
    join also orders every later use of the schedule (allocated before the fork) after the side
    stream's work. x_pub may be overwritten here: peers stopped reading it before their DONE of the
    last pass, which this rank waited for.

    ``in_kernel`` (``fwd_peer_flags``, the megakernel): the schedule's count launch, on the side
    stream so that the x copy starts with it, publishes the routing, signals FWD_READY (the last of
    this rank's chunks) and waits for the peers' routing (``launch_schedule(publish=...)``; under
    the interpreter with several ranks the copies and signal/wait come first, as without it), and
    FWD_X_READY is left to the megakernel. ``on_main``: work for the current stream after the x copy, off the side stream's
    critical path (the megakernel's counter memset). ``order``: the schedule also lists its tiles in
    the token pull's order; ``row_w`` (fp32 [R_max]): the schedule also writes the rows' router weights.
    """
    T, k = topk_idx.shape
    _stage("fwd:start")
    # the count launch publishes the routing itself (not under the interpreter, where a program
    # waiting for another rank's would never return, unless there is no other rank)
    publish_in_count = in_kernel and (not INTERPRET or ws.world_size == 1)
    if not publish_in_count:
        ws.idx_pub.copy_(topk_idx)
        ws.w_pub.copy_(topk_weights)
    done = ws.__dict__.get("_schedule_done")
    if done is None:  # counters that the last program of a launch resets: zeroed once
        done = ws.__dict__["_schedule_done"] = torch.zeros(2, dtype=torch.int32, device=x.device)
    sched = alloc_schedule(ws.world_size, T, k, E_local, cfg.tile_m, x.device, align=cfg.align_tiles(T, k, E_local),
                           done=done, order=order)
    side = _side_stream(ws, cfg, x)

    def schedule():
        if not publish_in_count:  # (in_kernel under the interpreter: the count programs' waits then pass)
            _signal_wait(ws, FWD_READY, FWD, True, sync.ERR_WAIT_PEER_READY, cfg)
        _stage("fwd:publish+wait")
        ready = (ws.flags, ws.epoch[FWD:], FWD_READY, cfg.wait_budget()) if in_kernel else None
        publish = (topk_idx, topk_weights, ws.idx_pub, ws.w_pub, ws.ptrs["flags"]) if publish_in_count else None
        launch_schedule(sched, ws.ptrs["idx_pub"], ws.err, ws.rank, ready=ready, publish=publish,
                        row_w=None if row_w is None else (ws.ptrs["w_pub"], row_w))
        _stage("fwd:schedule")

    if side is None:
        schedule()
    else:
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            schedule()
    ws.x_pub.copy_(x)
    if on_main is not None:
        on_main()
    if side is not None:
        main.wait_stream(side)
    if not in_kernel or INTERPRET:  # (the interpreter: signalled and polled here; the kernel's repeats it)
        _signal_wait(ws, FWD_X_READY, FWD, False, sync.ERR_WAIT_PEER_READY, cfg)
    _stage("fwd:wait_x")
    return sched


def _finish_forward(ws, cfg: MoEConfig, x, topk_weights, extra, in_kernel=False):
    """Tell every peer its rows are pushed, wait for theirs, combine in k order (``in_kernel``: the
    megakernel signalled and waited already; under the interpreter the host polls here)."""
    T, k = topk_weights.shape
    if not in_kernel:
        _signal_wait(ws, FWD_DONE, FWD, False, sync.ERR_WAIT_PEER_DONE, cfg)
    elif INTERPRET:
        _wait(ws, FWD_DONE, FWD, sync.ERR_WAIT_PEER_DONE, cfg)
    _stage("fwd:signal+wait")
    y = combine_k(ws.y_in, T, k, w=topk_weights.float().contiguous(), extra=extra, dtype=x.dtype)
    _stage("fwd:combine")
    _debug_check(ws, cfg, x)
    return y


def moe_forward(ws, cfg: MoEConfig, x, topk_idx, topk_weights, w_gate, w_up, w_down, extra=None):
    """Forward pass on one rank. Returns (y [T, H], saved) where saved feeds ``moe_backward``."""
    T, H = x.shape
    I, TK = w_gate.shape[1], topk_idx.numel()
    sched = _publish_and_schedule(ws, cfg, x, topk_idx, topk_weights, w_gate.shape[0])
    xs = x.new_empty((sched.R_max, H))
    row_w = torch.empty(sched.R_max, dtype=torch.float32, device=x.device)
    _pull_rows(cfg, sched, ws.ptrs["x_pub"], xs, TK, sched.k, ws.ptrs["w_pub"], row_w)
    _stage("fwd:dispatch")
    h, gu = gemm.gate_up_swiglu(xs, w_gate, w_up, sched.tile_expert, sched.num_tiles, save_gu=True,
                                config=_gemm_cfg(cfg, gemm.KIND_GATE_UP, I, H))
    _stage("fwd:gate_up")
    gemm.down_push(h, w_down, sched.tile_expert, sched.num_tiles, sched.row_src, ws.ptrs["y_in"], TK,
                   config=_gemm_cfg(cfg, gemm.KIND_DOWN, H, I))
    _stage("fwd:down+push")
    return _finish_forward(ws, cfg, x, topk_weights, extra), KeptRows(sched, xs, gu, row_w)


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


@dataclass
class KeptRows:
    """What a forward keeps for the backward when it keeps the routed rows: the schedule, xs
    [R_max, H], g | u [R_max, 2I] and the rows' router weights [R_max] fp32. ``missing``: "" (xs
    whole), "local" (``fwd_local_rows``: xs lacks this rank's rows, the backward copies them in
    from x) or "tokens" (``fwd_pull_tokens``: xs is every rank's tokens [W*T, H], the backward
    gathers the rows from them and x). ``x``: the layer's input as the forward's gate/up read it
    (contiguous, 16-byte aligned), when something is missing."""

    sched: object
    xs: torch.Tensor
    gu: torch.Tensor
    row_w: torch.Tensor
    missing: str = ""
    x: torch.Tensor | None = None


@dataclass
class MegaSaved:
    """What the megakernel forward keeps for the backward: the schedule, x and the router weights."""

    sched: object
    x: torch.Tensor
    topk_weights: torch.Tensor


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


def _routed_rows_for_wgrad(ws, cfg, kept: KeptRows, TK, k):
    """The routed rows [R, H] of a forward that kept them partly (``fwd_local_rows``: xs without this
    rank's rows, filled in here from x) or not at all (``fwd_pull_tokens``: xs is every rank's
    tokens [W*T, H], rows gathered from them and x into a new buffer); local copies only.

    Why copies and not a weight gradient that gathers its rows: that kernel (built in session 12,
    since removed) made forward+backward 14-26% slower at every shape of the session-13 matrix but
    the host-bound qwen3-30b-a3b 4096, where the copy of this rank's rows had cost 0-3.4% (session
    12's matrix against session 11's)."""
    sched, xs, x = kept.sched, kept.xs, kept.x
    W, T, H = ws.world_size, x.shape[0], x.shape[1]
    if kept.missing == "local":
        table = torch.full((W,), x.data_ptr(), dtype=torch.int64, device=x.device)
        _pull_rows(cfg, sched, table, xs, TK, k, only_rank=ws.rank)
        return xs
    # rank src's rows at xs[src*T:], this rank's at x: an address table of local buffers
    # (built by device ops only: session 14's GPU sync check found a host sync in this backward when
    # the table had an element assigned from a Python int; x is 16-byte aligned, as the copy's vectors need)
    src = torch.arange(W, dtype=torch.int64, device=x.device)
    table = torch.where(src == ws.rank, x.data_ptr(), src * (T * H * xs.element_size()) + xs.data_ptr())
    rows = xs.new_empty((sched.R_max, H))
    _pull_rows(cfg, sched, table, rows, TK, k)
    return rows


def moe_backward(ws, cfg: MoEConfig, dy, saved, w_gate, w_up, w_down):
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
    I = w_gate.shape[1]
    _stage("bwd:start")
    if recompute:
        ws.x_pub.copy_(saved.x)
        ws.w_pub.copy_(saved.topk_weights)
    ws.dy_pub.copy_(dy)
    _signal_wait(ws, BWD_READY, BWD, True, sync.ERR_WAIT_PEER_READY, cfg)
    _stage("bwd:publish+wait")
    if recompute:
        xs = dy.new_empty((sched.R_max, H))
        row_w = torch.empty(sched.R_max, dtype=torch.float32, device=dy.device)
        _pull_rows(cfg, sched, ws.ptrs["x_pub"], xs, TK, k, ws.ptrs["w_pub"], row_w)
        _, gu = gemm.gate_up_swiglu(xs, w_gate, w_up, sched.tile_expert, sched.num_tiles, save_gu=True,
                                    config=_gemm_cfg(cfg, gemm.KIND_GATE_UP, I, H))
        _stage("bwd:recompute")

    dys = dy.new_empty((sched.R_max, H))
    _pull_rows(cfg, sched, ws.ptrs["dy_pub"], dys, TK, k)
    _stage("bwd:dispatch_dy")
    dgu, hw, dw_part = gemm.down_dgrad_swiglu_bwd(dys, w_down, gu, row_w, sched.tile_expert, sched.num_tiles,
                                                  config=_gemm_cfg(cfg, gemm.KIND_DGRAD_SWIGLU, I, H))
    _stage("bwd:down_dgrad+swiglu")
    gemm.gate_up_dgrad_push(dgu, w_gate, w_up, sched.tile_expert, sched.num_tiles, sched.row_src,
                            ws.ptrs["dx_in"], TK, config=_gemm_cfg(cfg, gemm.KIND_GATE_UP_DGRAD, H, 2 * I))
    _stage("bwd:gate_up_dgrad+push")
    dw_rows = gemm.reduce_dw(dw_part)
    comm.push_scalars_kernel[(64,)](dw_rows, sched.row_src, sched.num_tiles, ws.ptrs["dw_in"], TK,
                                    BR=256, TILE_ROWS=cfg.tile_m)
    _stage("bwd:router_grad")
    dw_down = gemm.expert_wgrad(dys, hw, sched.expert_start, sched.expert_count, out_dtype=w_down.dtype)
    if not recompute and saved.missing:  # the routed rows the weight gradient reads, contiguous
        xs = _routed_rows_for_wgrad(ws, cfg, saved, TK, k)
        _stage("bwd:routed_rows")
    dw_gate, dw_up = gemm.expert_wgrad_gate_up(dgu, xs, sched.expert_start, sched.expert_count,
                                               out_dtype=w_gate.dtype)
    _stage("bwd:wgrad")
    _signal_wait(ws, BWD_DONE, BWD, False, sync.ERR_WAIT_PEER_DONE, cfg)
    _stage("bwd:signal+wait")
    dx = combine_k(ws.dx_in, T, k, dtype=dy.dtype)
    dtopk = ws.dw_in.view(T, k).clone()
    _stage("bwd:combine")
    _debug_check(ws, cfg, dy)
    return dx, dtopk, dw_gate, dw_up, dw_down


class _TabbyMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, w_gate, w_up, w_down, extra, ws, cfg):
        y, saved = moe_forward(ws, cfg, x, topk_idx, topk_weights, w_gate, w_up, w_down, extra)
        ctx.ws, ctx.cfg, ctx.saved = ws, cfg, saved
        ctx.w_dtype = topk_weights.dtype
        ctx.has_extra = extra is not None
        ctx.save_for_backward(w_gate, w_up, w_down)
        return y

    @staticmethod
    def backward(ctx, dy):
        w_gate, w_up, w_down = ctx.saved_tensors
        dx, dtopk, dwg, dwu, dwd = moe_backward(ctx.ws, ctx.cfg, dy.contiguous(), ctx.saved, w_gate, w_up, w_down)
        ctx.saved = None
        return (dx, None, dtopk.to(ctx.w_dtype), dwg, dwu, dwd, dy if ctx.has_extra else None, None, None)


class _TabbyMoEMega(torch.autograd.Function):
    """The megakernel forward. The shared expert runs inside the kernel, so its gradients are made
    here: recomputed in the backward with the same torch ops the default path differentiates."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, w_gate, w_up, w_down, s_gate, s_up, s_down, ws, cfg, save):
        shared = (s_gate, s_up, s_down) if s_gate is not None else None
        y, saved = moe_forward_mega(ws, cfg, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, save)
        ctx.ws, ctx.cfg, ctx.saved = ws, cfg, saved
        ctx.w_dtype = topk_weights.dtype
        ctx.save_for_backward(w_gate, w_up, w_down, x, topk_weights, s_gate, s_up, s_down)
        return y

    @staticmethod
    def backward(ctx, dy):
        w_gate, w_up, w_down, x, topk_weights, s_gate, s_up, s_down = ctx.saved_tensors
        dy = dy.contiguous()
        saved = ctx.saved
        if isinstance(saved, MegaSaved):  # x and topk_weights came back through save_for_backward
            saved = MegaSaved(saved.sched, x, topk_weights)
        dx, dtopk, dwg, dwu, dwd = moe_backward(ctx.ws, ctx.cfg, dy, saved, w_gate, w_up, w_down)
        ctx.saved = None
        dsg = dsu = dsd = None
        if s_gate is not None:
            with torch.enable_grad():
                xd = x.detach().requires_grad_(True)
                sg, su, sd = (t.detach().requires_grad_(True) for t in (s_gate, s_up, s_down))
                out = (F.silu(xd @ sg.t()) * (xd @ su.t())) @ sd.t()
                dxs, dsg, dsu, dsd = torch.autograd.grad(out, (xd, sg, su, sd), dy)
            dx = dx + dxs
        return (dx, None, dtopk.to(ctx.w_dtype), dwg, dwu, dwd, dsg, dsu, dsd, None, None, None)


def moe(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None, group=None, config: MoEConfig | None = None):
    """Tabby's MoE layer (same arguments as ``tabby.moe_reference``; see tabby/validate.py).

    x [T, H] bf16; topk_idx [T, k] int; topk_weights [T, k] float; w_gate, w_up [E_local, I, H],
    w_down [E_local, H, I] bf16; shared None or (w_gate_s [I_s, H], w_up_s [I_s, H], w_down_s [H, I_s]).
    ``group``: the expert-parallel process group (None: one rank). Returns y [T, H] bf16.
    No host synchronization: expert ids are checked on the device and reported by
    ``check_errors`` (or at once with ``config.debug``).
    """
    cfg = config or MoEConfig()
    rank, W, pg, tg = _group_info(group)
    dims = check_inputs(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, world_size=W,
                        check_ids=False, dtypes=(torch.bfloat16,))
    if W > 1 and tg is None and x.device.type != "cuda":
        raise MoEInputError("Tabby across processes needs CUDA tensors (GPU symmetric memory); on the CPU "
                            "run one rank, or the thread harness of tests/harness.py")
    if dims.T == 0:
        raise MoEInputError("x has no tokens (T = 0)")
    key = WorkspaceKey(dims.T, dims.H, dims.k, dims.E_local, dims.I, W, x.dtype, str(x.device))
    if cfg.overlap_publish not in (False, True):
        raise MoEInputError(f"MoEConfig: overlap_publish={cfg.overlap_publish!r} must be True or False")
    if cfg.megakernel:
        try:
            megakernel_fwd.check_order(cfg.ring_rows // cfg.tile_m, cfg.tile_m, cfg.group_m(dims.H, dims.I),
                                       cfg.fwd_prefetch, cfg.fwd_down_lag, cfg.fwd_fill_split,
                                       cfg.fwd_pull_cols or cfg.pull_cols)
            if cfg.fwd_fill_stages is not None and cfg.fwd_fill_stages < 1:
                raise ValueError(f"fwd_fill_stages={cfg.fwd_fill_stages} must be >= 1")
            if cfg.fwd_align_tiles is not None and cfg.fwd_align_tiles < 1:
                raise ValueError(f"fwd_align_tiles={cfg.fwd_align_tiles} must be >= 1")
            if cfg.fwd_down_cols is not None:
                megakernel_fwd.down_col_tiles(1, cfg.fwd_down_cols)  # raises on a bad value
            if cfg.fwd_num_warps not in (None, 4, 8):
                raise ValueError(f"fwd_num_warps={cfg.fwd_num_warps} must be 4 or 8 (one or two warpgroups)")
        except ValueError as e:
            raise MoEInputError(f"MoEConfig(megakernel=True): {e}") from None
    ws = get_workspace(key, rank, group=pg, thread_group=tg)
    if rank == 0 and tg is None and not getattr(ws, "memory_reported", False):
        ws.memory_reported = True
        print("[tabby] " + memory_report(dims, cfg), flush=True)
    if cfg.megakernel:
        sh = tuple(w.contiguous() for w in shared) if shared is not None else (None, None, None)
        # keep what the backward needs only when there will be one
        save = cfg.fwd_save_for_backward and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, topk_weights, w_gate, w_up, w_down, *sh))
        return _TabbyMoEMega.apply(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous(), w_gate, w_up,
                                   w_down, *sh, ws, cfg, save)
    extra = None
    if shared is not None:
        sg, su, sd = shared
        extra = (F.silu(x @ sg.t()) * (x @ su.t())) @ sd.t()
    return _TabbyMoE.apply(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous(), w_gate, w_up,
                           w_down, extra, ws, cfg)


def memory_report(dims, cfg: MoEConfig) -> str:
    """Worst-case routed-buffer sizes (every (token, k) of every rank to this rank), known at setup."""
    from ..ops.schedule import schedule_capacity

    R = schedule_capacity(dims.world_size, dims.T, dims.k, dims.E_local, cfg.tile_m,
                          cfg.align_tiles(dims.T, dims.k, dims.E_local))
    H, I, MiB = dims.H, dims.I, 2 ** 20
    kept = R * (2 * H + 4 * I + 4 + 4)  # xs, g|u, row weight, row_src: kept per layer for the backward
    fwd = R * 2 * I  # h
    bwd = R * (2 * H + 4 * I + 2 * I + 4 * 2 + 4 * triton.cdiv(I, 64))  # dys, dg|du, hw, dw rows, dw partials
    if cfg.token_pull_on(dims.T, dims.k, H, I, dims.E_local * dims.world_size):  # the tokens kept, not xs
        kept += dims.world_size * dims.T * 2 * H - R * 2 * H
        bwd += R * 2 * H  # the routed rows gathered from them for the weight gradient
    ring = cfg.ring_rows * 2 * (H + I)
    mode = (f"megakernel forward keeps only the schedule and a {ring / MiB:.1f} MiB ring; its backward "
            f"recomputes the routed rows" if cfg.megakernel and not cfg.fwd_save_for_backward else
            f"megakernel ring {ring / MiB:.1f} MiB; a differentiated forward keeps {kept / MiB:.1f} MiB per layer "
            f"for the backward (without autograd: only the ring)" if cfg.megakernel else
            f"kept per layer for the backward {kept / MiB:.1f} MiB, forward transient {fwd / MiB:.1f} MiB")
    return (f"routed rows sized for the worst case: R_max={R} rows; {mode}; backward transient "
            f"{(bwd + (kept if cfg.megakernel and not cfg.fwd_save_for_backward else 0)) / MiB:.1f} MiB")


def check_errors():
    """Raise ``TabbyDeviceError`` if any cached workspace of this process recorded an error (host sync)."""
    from .workspace import _CACHE

    for ws in list(_CACHE.values()):
        ws.check_errors()
