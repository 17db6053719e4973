"""The launches every pass shares: signal and wait for the peers, publish and schedule, pull
routed rows, finish with the combine. Each takes the call's ``Plan`` (``plan.py``) and, for the
tools, an optional ``Probe`` (``probe.py``) whose stage timer marks the stage boundaries."""
from __future__ import annotations

import time

import torch
import triton

from ..ops import INTERPRET, comm, quantize, sync
from ..ops.combine import combine_k
from ..ops.schedule import alloc_schedule, launch_schedule
from .plan import Plan
from .probe import Probe, mark
from .workspace import BWD, BWD_DONE, FWD, FWD_DONE, FWD_READY, FWD_X_READY


def _signal(ws, slot, epoch_idx, bump):
    comm.signal_peers_kernel[(1,)](ws.ptrs["flags"], ws.epoch[epoch_idx:], slot, ws.rank, ws.world_size,
                                   BUMP=bump)


def _wait(ws, slot, epoch_idx, code, plan: Plan):
    if INTERPRET:  # CPU harness: poll from the host so other ranks' threads can run their kernels
        ready = torch.zeros(1, dtype=torch.int32)
        for _ in range(plan.wait_budget):
            comm.count_ready_kernel[(1,)](ws.flags, ws.epoch[epoch_idx:], slot, ws.world_size, ready)
            if int(ready) == ws.world_size:
                return
            time.sleep(1e-3)
        # Not ready: the bounded wait below records what was missing.
        comm.wait_peers_kernel[(1,)](ws.flags, ws.epoch[epoch_idx:], slot, ws.rank, ws.world_size,
                                     0, ws.err, code)
        return
    comm.wait_peers_kernel[(1,)](ws.flags, ws.epoch[epoch_idx:], slot, ws.rank, ws.world_size,
                                 plan.wait_budget, ws.err, code)


def signal_and_wait(ws, slot, epoch_idx, bump, code, plan: Plan):
    """``_signal`` then ``_wait``; on the GPU in one launch (``comm.signal_wait_peers_kernel``: a
    Triton launch costs the host ~30-50 us, which small shapes feel)."""
    if INTERPRET:  # the wait polls from the host (see _wait)
        _signal(ws, slot, epoch_idx, bump)
        _wait(ws, slot, epoch_idx, code, plan)
        return
    comm.signal_wait_peers_kernel[(1,)](ws.ptrs["flags"], ws.flags, ws.epoch[epoch_idx:], slot, ws.rank,
                                        ws.world_size, plan.wait_budget, ws.err, code, BUMP=bump)


def pull_routed_rows(plan: Plan, sched, src_ptrs, dst, TK, k, w_ptrs=None, ws_out=None, only_rank=None):
    """Rows of the schedule into dst [R, H] from every rank's [T, H] buffer (``src_ptrs``), with
    their router weights (``w_ptrs`` -> ``ws_out``); ``only_rank``: only the rows from that rank."""
    H = dst.shape[1]
    with_w = w_ptrs is not None
    comm.pull_rows_kernel[(plan.dispatch_programs,)](
        sched.row_src, sched.num_tiles, src_ptrs, dst, H, TK, k,
        w_ptrs if with_w else src_ptrs, ws_out if with_w else dst,
        BR=plan.dispatch_rows, BH=min(plan.dispatch_cols, triton.next_power_of_2(H)), WITH_WEIGHTS=with_w,
        TILE_ROWS=plan.tile_m, ROWS_16B=(H * dst.element_size()) % 16 == 0, ONLY_RANK=only_rank is not None,
        rank=only_rank or 0, num_warps=8)


def debug_check(ws, plan: Plan, t):
    """Debug mode: raise at once on a device error (a host sync), except while a CUDA graph is
    captured (a replay runs without the check; call ``check_errors`` after it)."""
    if plan.debug and not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
        ws.check_errors()


def _side_stream(ws, x):
    """The workspace's side stream for the forward's schedule (None on the CPU), at the device's
    highest stream priority, so that the block scheduler starts its small launches ahead of the x
    copy's pending blocks."""
    if not x.is_cuda:
        return None
    if ws.side_stream is None:
        ws.side_stream = torch.cuda.Stream(device=x.device, priority=torch.cuda.Stream.priority_range()[1])
    return ws.side_stream


def publish_and_schedule(ws, plan: Plan, x, topk_idx, topk_weights, E_local, in_kernel=False, on_main=None,
                          order=False, row_w=None, x_fp8=False, probe: Probe | None = None):
    """Publish this rank's inputs, wait for every peer's, build the routed-row schedule.

    The schedule needs only the routing, so x (T * H * 2 bytes, the bulk of the publish: ~30 us at
    qwen3-30b-a3b 16384) gets its own flag, FWD_X_READY, and on the GPU its
    copy runs on the current stream while a high-priority side stream signals FWD_READY (the pass's
    new epoch), waits for the peers' and builds the schedule. The current stream then joins the side
    stream, and signals and waits FWD_X_READY (the same epoch) before anything reads x_pub. The
    join also orders every later use of the schedule (allocated before the fork) after the side
    stream's work. x_pub may be overwritten here: peers stopped reading it before their DONE of the
    last pass, which this rank waited for.

    ``in_kernel`` (the megakernel): the schedule's count launch, on the side
    stream so that the x copy starts with it, publishes the routing, signals FWD_READY (the last of
    this rank's chunks) and waits for the peers' routing (``launch_schedule(publish=...)``; under
    the interpreter with several ranks the copies and signal/wait come first, as without it), and
    FWD_X_READY is left to the megakernel. ``on_main``: work for the current stream after the x copy, off the side stream's
    critical path (the megakernel's counter memset). ``order``: the schedule also lists its tiles in
    the token pull's order; ``row_w`` (fp32 [R_max]): the schedule also writes the rows' router weights.
    ``x_fp8``: x is published quantized per 1x128 (into xq_pub and xs_pub of an FP8 workspace)
    instead of copied into x_pub.
    """
    T, k = topk_idx.shape
    mark(probe, "fwd:start")
    # the count launch publishes the routing itself (not under the interpreter, where a program
    # waiting for another rank's would never return, unless there is no other rank)
    publish_in_count = in_kernel and (not INTERPRET or ws.world_size == 1)
    if not publish_in_count:
        ws.idx_pub.copy_(topk_idx)
        ws.w_pub.copy_(topk_weights)
    if ws.schedule_done is None:  # counters that the last program of a launch resets: zeroed once
        ws.schedule_done = torch.zeros(2, dtype=torch.int32, device=x.device)
    sched = alloc_schedule(ws.world_size, T, k, E_local, plan.tile_m, x.device, align=plan.align_tiles,
                           done=ws.schedule_done, order=order)
    side = _side_stream(ws, x)

    def schedule():
        if not publish_in_count:  # (in_kernel under the interpreter: the count programs' waits then pass)
            signal_and_wait(ws, FWD_READY, FWD, True, sync.ERR_WAIT_PEER_READY, plan)
        mark(probe, "fwd:publish+wait")
        ready = (ws.flags, ws.epoch[FWD:], FWD_READY, plan.wait_budget) if in_kernel else None
        publish = (topk_idx, topk_weights, ws.idx_pub, ws.w_pub, ws.ptrs["flags"]) if publish_in_count else None
        launch_schedule(sched, ws.ptrs["idx_pub"], ws.err, ws.rank, ready=ready, publish=publish,
                        row_w=None if row_w is None else (ws.ptrs["w_pub"], row_w))
        mark(probe, "fwd:schedule")

    if side is None:
        schedule()
    else:
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            schedule()
    if x_fp8:
        quantize.quantize_rows(x, out=ws.xq_pub.view(quantize.E4M3), scale_out=ws.xs_pub)
    else:
        ws.x_pub.copy_(x)
    if on_main is not None:
        on_main()
    if side is not None:
        main.wait_stream(side)
    if not in_kernel or INTERPRET:  # (the interpreter: signalled and polled here; the kernel's repeats it)
        signal_and_wait(ws, FWD_X_READY, FWD, False, sync.ERR_WAIT_PEER_READY, plan)
    mark(probe, "fwd:wait_x")
    return sched


def finish_forward(ws, plan: Plan, x, topk_weights, extra, in_kernel=False, probe: Probe | None = None):
    """Tell every peer its rows are pushed, wait for theirs, combine in k order (``in_kernel``: the
    megakernel signalled and waited already; under the interpreter the host polls here)."""
    T, k = topk_weights.shape
    if not in_kernel:
        signal_and_wait(ws, FWD_DONE, FWD, False, sync.ERR_WAIT_PEER_DONE, plan)
    elif INTERPRET:
        _wait(ws, FWD_DONE, FWD, sync.ERR_WAIT_PEER_DONE, plan)
    mark(probe, "fwd:signal+wait")
    y = combine_k(ws.y_in, T, k, w=topk_weights.float().contiguous(), extra=extra, dtype=x.dtype)
    mark(probe, "fwd:combine")
    debug_check(ws, plan, x)
    return y


def finish_backward(ws, plan: Plan, dy, T: int, k: int, probe: Probe | None = None):
    """Tell every peer its dx rows and router-weight gradients are pushed, wait for theirs, and
    return (dx: the k pushed rows of each token summed in k order, d topk_weights [T, k])."""
    signal_and_wait(ws, BWD_DONE, BWD, False, sync.ERR_WAIT_PEER_DONE, plan)
    mark(probe, "bwd:signal+wait")
    dx = combine_k(ws.dx_in, T, k, dtype=dy.dtype)
    dtopk = ws.dw_in.view(T, k).clone()
    mark(probe, "bwd:combine")
    debug_check(ws, plan, dy)
    return dx, dtopk

