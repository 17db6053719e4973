"""Workspace: the symmetric buffers and flags of one (process group, layer shape), allocated once.

Symmetric buffers (every rank holds one copy; peers reach it through an address table):

    x_pub   [T, H]   bf16   this rank's tokens, published for the experts' pull dispatch
    xq_pub  [T, H]   E4M3   FP8 workspaces (key.fp8): the tokens quantized per 1x128, pulled
    xs_pub  [T, H/128] fp32   instead of x_pub by the FP8 forward, and their scales
    dyq_pub, dys_pub          the same of dy, pulled by the FP8 backward instead of dy_pub
    idx_pub [T, k]   int32  this rank's routing, read by every rank's schedule
    w_pub   [T, k]   fp32   router weights, pulled with the rows (the backward needs them)
    y_in    [T*k, H] bf16   expert outputs pushed here by the experts' ranks, row t*k + kk
    dy_pub  [T, H]   bf16   backward: upstream gradient, pulled by the experts
    dx_in   [T*k, H] bf16   backward: dx rows pushed back, row t*k + kk
    dw_in   [T*k]    fp32   backward: router-weight gradients pushed back
    flags   [6, W]   int32  flags[slot, src], set by rank src (slots below)

Signalling needs no memset between calls: ``epoch`` counts passes on the device (one counter
for forward, one for backward); a flag holds the epoch of the last signal and waits test
``flag >= epoch``. Every rank runs the same passes in the same order, so epochs agree.

Transports (how the buffers are made and the address tables found):
    * ``symm``   several GPUs: one ``torch.distributed._symmetric_memory`` allocation, rendezvous once;
    * ``local``  one rank (any device): plain tensors;
    * ``threads`` the CPU test harness: ranks are threads of one process sharing a ``ThreadGroup``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..ops import sync
from .threads import ThreadGroup

log = logging.getLogger("tabby")

# Flag slots. A forward signals FWD_READY when its routing (topk_idx, weights) is published and
# FWD_X_READY when x is, so that the x copy can overlap the schedule.
# FWD_X_PULL is no epoch: the megakernel's token pull (``Plan.mega.token_pull``) sets it to 1 on
# every peer with a stream write once x is published, and the peer's copy stream waits for 1 and resets it to 0
# (``streamops``: a stream wait compares with a host value, and the epoch lives on the device).
FWD_READY, FWD_DONE, BWD_READY, BWD_DONE, FWD_X_READY, FWD_X_PULL = range(6)
N_SLOTS = 6
# Epoch counters.
FWD, BWD = 0, 1


@dataclass(frozen=True)
class WorkspaceKey:
    T: int
    H: int
    k: int
    E_local: int
    I: int
    world_size: int
    dtype: torch.dtype
    device: str
    fp8: bool = False  # with the FP8 dispatch's buffers (xq_pub, xs_pub)


def _layout(key: WorkspaceKey):
    T, H, k, W = key.T, key.H, key.k, key.world_size
    nb = -(-H // 128)
    fp8 = [("xq_pub", (T, H), torch.uint8), ("xs_pub", (T, nb), torch.float32),
           ("dyq_pub", (T, H), torch.uint8), ("dys_pub", (T, nb), torch.float32)] if key.fp8 else []
    return [  # name, shape, dtype
        ("x_pub", (T, H), key.dtype),
        ("idx_pub", (T, k), torch.int32),
        ("w_pub", (T, k), torch.float32),
        ("y_in", (T * k, H), key.dtype),
        ("dy_pub", (T, H), key.dtype),
        ("dx_in", (T * k, H), key.dtype),
        ("dw_in", (T * k,), torch.float32),
        ("flags", (N_SLOTS, W), torch.int32),
    ] + fp8


def _offsets(layout):
    """Each buffer's byte offset in the symmetric allocation (256-byte aligned) and the total bytes."""
    offsets, total = {}, 0
    for name, shape, dtype in layout:
        total = (total + 255) // 256 * 256
        offsets[name] = total
        total += _numel(shape) * dtype.itemsize
    return offsets, (total + 255) // 256 * 256


def workspace_bytes(key: WorkspaceKey) -> int:
    """Bytes of the symmetric allocation of a workspace of ``key`` (what ``Workspace`` allocates)."""
    return _offsets(_layout(key))[1]


class Workspace:
    """Symmetric buffers, their address tables, epoch counters and the error record of one rank."""

    def __init__(self, key: WorkspaceKey, rank: int, group=None, thread_group: ThreadGroup | None = None):
        self.key, self.rank, self.world_size = key, rank, key.world_size
        device = torch.device(key.device)
        layout = _layout(key)
        offsets, total = _offsets(layout)
        self.symmetric_bytes = total
        if thread_group is not None:
            self.transport = "threads"
            self._raw = torch.zeros(total, dtype=torch.uint8, device=device)
            thread_group.raw[rank] = self._raw
            bases = thread_group.exchange(rank, self._raw.data_ptr())
            self._thread_group = thread_group
        elif key.world_size == 1:
            self.transport = "local"
            self._raw = torch.zeros(total, dtype=torch.uint8, device=device)
            bases = [self._raw.data_ptr()]
        else:
            import torch.distributed as dist
            import torch.distributed._symmetric_memory as symm_mem

            self.transport = "symm"
            self._raw = symm_mem.empty(total, dtype=torch.uint8, device=device)
            self._raw.zero_()  # flags start at epoch 0
            self._handle = symm_mem.rendezvous(self._raw, group.group_name if group is not None
                                               else dist.group.WORLD.group_name)
            bases = list(self._handle.buffer_ptrs)
            torch.cuda.synchronize(device)
            dist.barrier(group=group)  # nobody signals before every rank has zeroed its flags
        self.buffers: dict[str, torch.Tensor] = {}
        self.ptrs: dict[str, torch.Tensor] = {}
        self._layout = {name: (offsets[name], shape, dtype) for name, shape, dtype in layout}
        self._peer_views: dict = {}  # (name, src) -> a peer's buffer (peer_buffer)
        for name, shape, dtype in layout:
            off = offsets[name]
            view = self._raw[off:off + _numel(shape) * dtype.itemsize].view(dtype).view(shape)
            self.buffers[name] = view
            self.ptrs[name] = torch.tensor([b + off for b in bases], dtype=torch.int64, device=device)
        self.epoch = torch.zeros(2, dtype=torch.int32, device=device)
        self.err = torch.zeros(sync.ERR_WORDS, dtype=torch.int32, device=device)
        # Per-shape state made on first use and kept with the workspace (``free`` drops it):
        self.plans: dict = {}  # MoEConfig -> Plan (plan.make_plan)
        self.mega_buffers = None  # the megakernel's ring and counters (ops.megakernel.MegaBuffers)
        self.schedule_done = None  # int32 [2]: counters the schedule's last program resets
        self.side_stream = None  # high-priority stream of the forward's schedule (CUDA)
        self.pull_stream = None  # stream of the token pull's copies (CUDA)

    def free(self) -> None:
        """Drop the per-shape caches (plans, the megakernel's ring, streams); the symmetric buffers
        stay until the workspace itself is dropped (``tabby.free_workspaces``)."""
        self.plans.clear()
        self.mega_buffers = self.schedule_done = self.side_stream = self.pull_stream = None

    def nbytes(self) -> int:
        """Bytes this workspace holds on its device: symmetric buffers and cached buffers."""
        n = self.symmetric_bytes
        if self.mega_buffers is not None:
            n += self.mega_buffers.nbytes()
        return n

    def __getattr__(self, name):
        buffers = self.__dict__.get("buffers", {})
        if name in buffers:
            return buffers[name]
        raise AttributeError(name)

    def peer_buffer(self, name: str, src: int) -> torch.Tensor:
        """Rank ``src``'s copy of buffer ``name`` as a tensor on this rank's device (through NVLink
        for ``symm``; a copy engine can read it)."""
        if src == self.rank:
            return self.buffers[name]
        views = self._peer_views  # made once: every forward asks (host time)
        view = views.get((name, src))
        if view is None:
            off, shape, dtype = self._layout[name]
            nbytes = _numel(shape) * dtype.itemsize
            if self.transport == "threads":
                raw = self._thread_group.raw[src]
            else:
                raw = self._handle.get_buffer(src, (self.symmetric_bytes,), torch.uint8, 0)
            view = views[(name, src)] = raw[off:off + nbytes].view(dtype).view(shape)
        return view

    def check_errors(self) -> None:
        """Raise if a kernel recorded an error (a host sync); clears the record."""
        rec = self.err.tolist()
        if rec[0] == sync.ERR_NONE:
            return
        self.err.zero_()
        code, rank, index, expected, seen, epoch = rec[:6]
        what = sync.ERR_NAMES.get(code, f"error code {code}")
        if code == sync.ERR_BAD_EXPERT_ID:
            raise TabbyDeviceError(f"rank {rank}: expert id {seen} at flat position {index} of a rank's "
                                   f"topk_idx is outside [0, E={expected}); the call's output is invalid")
        raise TabbyDeviceError(f"rank {rank}: a bounded wait timed out ({what}): flag {index} expected >= "
                               f"{expected}, last saw {seen} (epoch {epoch}). A peer did not take part in the "
                               f"call, or ran a different sequence of MoE calls; outputs of this call are invalid. The "
                               f"ranks' pass counts may now differ: call tabby.free_workspaces() on every rank before "
                               f"the next call")


class TabbyDeviceError(RuntimeError):
    """An error recorded on the device (timed-out wait, bad expert id), raised on the host."""


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


_CACHE: dict = {}
_GROUPS: dict = {}  # the groups of _CACHE's keys, kept alive (see get_workspace)


def peek_workspace(key: WorkspaceKey, rank: int, group=None, thread_group=None) -> Workspace | None:
    """The cached workspace for this group and shape, or None (nothing is created)."""
    return _CACHE.get(_cache_key(key, rank, group, thread_group))


def _cache_key(key, rank, group, thread_group):
    return (key, id(group) if group is not None else None, id(thread_group) if thread_group else None, rank)


def get_workspace(key: WorkspaceKey, rank: int, group=None, thread_group=None, fits: bool = True,
                  shortfall: str | None = None, join_timeout_s: float | None = None) -> Workspace:
    """The cached workspace for this group and shape (created on first use, collectively).

    Creation first checks, collectively, that every rank has the same shapes and the memory for
    the call (``fits``; ``shortfall``: this rank's message if not), raising the same error on every
    rank otherwise. ``join_timeout_s``: how long simulated ranks wait for each other there (a
    process group waits as long as its own timeout)."""
    ck = _cache_key(key, rank, group, thread_group)
    # The cache holds the group objects too: an id is unique only while its object lives, and a
    # test's thread group, once collected, could hand its id (and its stale workspace, at a later
    # epoch) to the next one.
    _GROUPS[ck] = (group, thread_group)
    ws = _CACHE.get(ck)
    if ws is None:
        from ..validate import (MoEDims, TabbyMemoryError, check_group_agrees, compare_group_descriptors,
                                group_descriptor)

        dims = MoEDims(T=key.T, H=key.H, k=key.k, E_local=key.E_local, I=key.I, world_size=key.world_size,
                       I_shared=0)
        if thread_group is not None and key.world_size > 1:
            rows = _thread_group_gather(thread_group, rank, group_descriptor(dims, key.dtype, fits), join_timeout_s)
            compare_group_descriptors(rows, rank, shortfall)
        elif group is not None and key.world_size > 1:
            # Ranks that disagree on shapes would wait for each other forever: check once, here.
            check_group_agrees(dims, torch.empty(0, dtype=key.dtype, device=key.device), group, fits, shortfall)
        elif not fits:
            raise TabbyMemoryError(shortfall or "the layer's buffers do not fit in the free device memory")
        ws = Workspace(key, rank, group=group, thread_group=thread_group)
        _CACHE[ck] = ws
        if rank == 0:
            log.info("workspace for T=%d H=%d k=%d E_local=%d I=%d EP%d: %.1f MiB symmetric (%s)", key.T, key.H,
                     key.k, key.E_local, key.I, key.world_size, ws.symmetric_bytes / 2**20, ws.transport)
    return ws


def _thread_group_gather(tg: ThreadGroup, rank: int, value, timeout_s: float | None) -> list:
    """Every simulated rank's ``value`` in rank order (``ThreadGroup.exchange``, with a bound on the
    wait): a rank that does not join within ``timeout_s`` breaks the group's barrier, and every rank
    waiting in it raises ``TabbyDeviceError``; the group cannot be used after that."""
    import threading

    try:
        out = tg.exchange(rank, value, timeout_s)
    except threading.BrokenBarrierError:
        raise TabbyDeviceError(f"rank {rank}: a peer did not join the first call of this shape within "
                               f"{timeout_s} s (MoEConfig.max_wait_ms); the simulated group is broken") from None
    return out


def cached_workspaces() -> list[Workspace]:
    """The workspaces this process holds."""
    return list(_CACHE.values())


def free_workspaces() -> int:
    """Drop every cached workspace (symmetric buffers, rings, plans) of this process; returns the
    bytes released on the devices. Call it only when no pass is in flight: with several ranks,
    every rank must free, and the next call of a shape creates its workspace again (collectively)."""
    n = 0
    for ws in _CACHE.values():
        n += ws.nbytes()
        ws.free()
    _CACHE.clear()
    _GROUPS.clear()
    return n
