"""Routed-row schedule (forward step 1), computed on the device: no host sync, deterministic.

Each rank reads every peer's ``topk_idx`` (int32 ``[T, k]`` global expert ids, addressed through
a pointer table) and lists, for its ``E_local`` local experts, the routed rows in a fixed order:
by local expert, then source rank, then token, then k. Each expert's segment is padded with ``-1``
rows up to a multiple of the tile height ``BM`` (``align`` > 1: of ``align`` tiles, so that an
expert's row tiles start at a multiple of ``align``: the forward megakernel hands out its row tiles
in groups, and an expert's tiles that fall into two groups read its weights from HBM twice; the
padding tiles, all ``-1``, are skipped).

Flat source id of an entry: ``src * (T*k) + t*k + kk``.

Two launches, both with grids fixed by the shapes (CUDA-graph capturable):

1. **count**  grid ``W * n_chunks``: program ``(src, chunk)`` loads ``CHUNK`` entries of ``src``'s
   ``topk_idx`` and writes the histogram of its local experts to ``counts[src, chunk, :]``; bad ids
   go to the error record. The last program to finish (a count in ``done``, acq_rel) then runs the
   **scan**: per expert, the exclusive prefix of ``counts`` in ``(src, chunk)`` order (``within``),
   plus ``expert_count`` and ``src_count``. (Folding the scan into the count launch saves a
   launch and its gap on the forward's critical path.)
2. **place**  grid ``W * n_chunks + n_fill``: every program derives the padded expert starts
   from ``expert_count`` (a cumsum of ``E_local`` values). Place programs ``(src, chunk)`` write
   the real rows: row = start[e] + within[src, chunk, e] + rank of the entry among same-expert
   entries earlier in the chunk (from a ``tl.sort`` of ``e * CHUNK + i``). Fill programs write
   ``tile_expert`` (-1 for a tile of padding rows only), ``-1`` to every padding row and every row
   past the end, and (program 0) ``expert_start`` / ``num_tiles``. Real rows and padding rows are
   disjoint, so no ordering is needed inside the launch.

Each role is a ``@triton.jit`` function taking its program id, so a persistent kernel can call
it; the ``_kernel`` wrappers and :func:`launch_schedule` are the standalone path.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .comm import _signal_peers
from .sync import ERR_BAD_EXPERT_ID, ERR_WAIT_PEER_READY, record_error, wait_geq

_ERR_BAD_EXPERT_ID = tl.constexpr(ERR_BAD_EXPERT_ID)
_ERR_WAIT_PEER_READY = tl.constexpr(ERR_WAIT_PEER_READY)
_INT32_MAX = tl.constexpr(2**31 - 1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def schedule_capacity(W: int, T: int, k: int, E_local: int, BM: int, align: int = 1) -> int:
    """Worst-case routed rows on one rank: every (token, k) of every rank, plus align*BM-1 padding per expert."""
    rows = W * T * k + E_local * (align * BM - 1)
    return max(1, _cdiv(rows, BM)) * BM


# ----------------------------------------------------------------------------------------------
# Device roles
# ----------------------------------------------------------------------------------------------


@triton.jit
def schedule_count_program(pid, idx_ptrs, counts_ptr, err_ptr, rank, N, W, E_local, n_chunks,
                           CHUNK: tl.constexpr, E_PAD: tl.constexpr, ALIGNED: tl.constexpr):
    """Histogram of local experts over ``CHUNK`` entries of one source rank.

    ``pid = src * n_chunks + chunk``; writes ``counts[src, chunk, 0:E_local]`` (int32, layout
    ``[W, n_chunks, E_local]``). Ids outside ``[0, W*E_local)`` are counted nowhere and the first
    one of the chunk is reported through ``record_error``.
    """
    src = pid // n_chunks
    chunk = pid - src * n_chunks
    base = tl.load(idx_ptrs + src).to(tl.pointer_type(tl.int32))
    if ALIGNED:
        base = tl.multiple_of(base, 16)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    inb = offs < N
    g = tl.load(base + offs, mask=inb, other=0)
    E = W * E_local
    bad = inb & ((g < 0) | (g >= E))
    e = g - rank * E_local
    local = inb & (~bad) & (e >= 0) & (e < E_local)
    hist = tl.histogram(tl.where(local, e, 0), E_PAD, mask=local)
    ev = tl.arange(0, E_PAD)
    tl.store(counts_ptr + pid * E_local + ev, hist, mask=ev < E_local)
    n_bad = tl.sum(bad.to(tl.int32), axis=0)
    if n_bad > 0:
        flat = src * N + offs
        first = tl.min(tl.where(bad, flat, _INT32_MAX), axis=0)
        seen = tl.sum(tl.where(flat == first, g, 0), axis=0)
        record_error(err_ptr, _ERR_BAD_EXPERT_ID, rank, first, E, seen, 0)


@triton.jit
def schedule_scan_program(counts_ptr, within_ptr, expert_count_ptr, src_count_ptr, W, E_local, n_chunks,
                          E_PAD: tl.constexpr, BC: tl.constexpr):
    """Per-expert exclusive prefix of ``counts`` in (src, chunk) order, every expert at once.

    Writes ``within[src, chunk, e]`` (rows of expert ``e`` before that chunk, from the start of
    the expert's segment), ``src_count[e, src]`` and ``expert_count[e]``. BC chunks per step.
    """
    e = tl.arange(0, E_PAD)
    em = e < E_local
    cr = tl.arange(0, BC)
    total = tl.zeros([E_PAD], dtype=tl.int32)
    # while loops: the interpreter (numpy 2) cannot take range() of a runtime scalar argument.
    s = 0
    while s < W:
        before = total
        c0 = 0
        while c0 < n_chunks:
            c = c0 + cr
            m = (c < n_chunks)[:, None] & em[None, :]
            off = (s * n_chunks + c)[:, None] * E_local + e[None, :]
            x = tl.load(counts_ptr + off, mask=m, other=0)
            inc = tl.cumsum(x, axis=0)
            tl.store(within_ptr + off, inc - x + total[None, :], mask=m)
            total += tl.sum(x, axis=0)
            c0 += BC
        tl.store(src_count_ptr + e * W + s, total - before, mask=em)
        s += 1
    tl.store(expert_count_ptr + e, total, mask=em)


@triton.jit
def schedule_expert_starts(expert_count_ptr, E_local, BM: tl.constexpr, E_PAD: tl.constexpr,
                           ALIGN_TILES: tl.constexpr = 1):
    """(ev, count, padded start, padded end) per local expert, as ``[E_PAD]`` vectors (0 past E_local);
    segments padded to a multiple of ALIGN_TILES row tiles."""
    SEG: tl.constexpr = BM * ALIGN_TILES
    ev = tl.arange(0, E_PAD)
    cnt = tl.load(expert_count_ptr + ev, mask=ev < E_local, other=0)
    padded = (cnt + (SEG - 1)) // SEG * SEG
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    return ev, cnt, starts, ends


@triton.jit
def schedule_place_program(pid, idx_ptrs, counts_ptr, within_ptr, expert_count_ptr, row_src_ptr,
                           row_of_src_ptr, rank, N, W, E_local, n_chunks, BM: tl.constexpr,
                           CHUNK: tl.constexpr, E_PAD: tl.constexpr, HAS_INV: tl.constexpr,
                           ALIGNED: tl.constexpr, ALIGN_TILES: tl.constexpr = 1, HAS_W: tl.constexpr = False,
                           w_ptrs=None, row_w_ptr=None):
    """Write ``row_src`` for the real rows served by ``CHUNK`` entries of one source rank.

    ``pid = src * n_chunks + chunk``. Needs ``counts`` (count) and ``within`` / ``expert_count``
    (scan). The chunk's entries are sorted by ``key = e * CHUNK + i`` (non-local ones last);
    an entry at sorted position ``p`` of expert ``e`` is the ``p - excl[e]``-th of its expert in
    the chunk, ``excl[e]`` being the chunk's local entries of experts below ``e``. With
    ``HAS_INV`` also writes ``row_of_src[flat]`` = row in this rank's routed buffer, or -1; with
    ``HAS_W`` also ``row_w[row]``, the entry's router weight (fp32, read through ``w_ptrs``, every
    rank's published weights [T*k]).
    """
    src = pid // n_chunks
    chunk = pid - src * n_chunks
    ev, cnt, starts, ends = schedule_expert_starts(expert_count_ptr, E_local, BM, E_PAD, ALIGN_TILES)
    emask = ev < E_local
    in_chunk = tl.load(counts_ptr + pid * E_local + ev, mask=emask, other=0)
    before_chunk = tl.load(within_ptr + pid * E_local + ev, mask=emask, other=0)
    # row = off[e] + sorted position
    off = starts + before_chunk - (tl.cumsum(in_chunk, axis=0) - in_chunk)
    base = tl.load(idx_ptrs + src).to(tl.pointer_type(tl.int32))
    if ALIGNED:
        base = tl.multiple_of(base, 16)
    ii = tl.arange(0, CHUNK)
    offs = chunk * CHUNK + ii
    inb = offs < N
    g = tl.load(base + offs, mask=inb, other=-1)
    e = g - rank * E_local
    local = inb & (g >= 0) & (g < W * E_local) & (e >= 0) & (e < E_local)
    skey = tl.sort(tl.where(local, e, E_PAD) * CHUNK + ii)
    se = skey // CHUNK
    si = skey - se * CHUNK
    slocal = se < E_PAD
    row = tl.gather(off, tl.where(slocal, se, 0), 0) + ii
    sflat = src * N + chunk * CHUNK + si
    tl.store(row_src_ptr + row, sflat, mask=slocal)
    if HAS_W:
        wsrc = tl.load(w_ptrs + src).to(tl.pointer_type(tl.float32))
        tl.store(row_w_ptr + row, tl.load(wsrc + chunk * CHUNK + si, mask=slocal, other=0.0), mask=slocal)
    if HAS_INV:
        tl.store(row_of_src_ptr + sflat, tl.where(slocal, row, -1), mask=chunk * CHUNK + si < N)


@triton.jit
def schedule_fill_program(fid, expert_count_ptr, expert_start_ptr, num_tiles_ptr, tile_expert_ptr,
                          row_src_ptr, E_local, n_tiles_max, BM: tl.constexpr, TPP: tl.constexpr,
                          E_PAD: tl.constexpr, ALIGN_TILES: tl.constexpr = 1, ORDER: tl.constexpr = False,
                          within_ptr=None, src_count_ptr=None, rank=0, W=1, n_chunks=1, tile_order_ptr=None,
                          local_tiles_ptr=None):
    """Tiles ``[fid*TPP, fid*TPP+TPP)``: ``tile_expert`` and ``-1`` in their padding rows.

    Program 0 also writes ``expert_start`` (``[E_local + 1]``) and ``num_tiles``. ORDER: also
    ``tile_order`` (``schedule_tile_order``) and (program 0) ``local_tiles``.
    """
    ev, cnt, starts, ends = schedule_expert_starts(expert_count_ptr, E_local, BM, E_PAD, ALIGN_TILES)
    total = tl.sum(ends - starts, axis=0)
    if fid == 0:
        tl.store(expert_start_ptr + ev, starts, mask=ev < E_local)
        tl.store(expert_start_ptr + E_local, total)
        tl.store(num_tiles_ptr, total // BM)
    tid = fid * TPP + tl.arange(0, TPP)
    tmask = tid < n_tiles_max
    r0 = tid * BM
    ends_m = tl.where(ev < E_local, ends, _INT32_MAX)
    # Expert of a tile: the number of segments that end at or before its first row.
    te = tl.sum((ends_m[None, :] <= r0[:, None]).to(tl.int32), axis=1)
    te = tl.where(r0 < total, te, -1)
    sel = ev[None, :] == te[:, None]
    real_end = tl.sum(tl.where(sel, (starts + cnt)[None, :], 0), axis=1)  # 0 for tiles past the end
    # a tile of padding rows only (ALIGN_TILES > 1) is marked unused (-1), as the tiles past the end
    tl.store(tile_expert_ptr + tid, tl.where(r0 < real_end, te, -1), mask=tmask)
    rows = r0[:, None] + tl.arange(0, BM)[None, :]
    pad = rows >= real_end[:, None]
    tl.store(row_src_ptr + rows, tl.full([TPP, BM], -1, tl.int32), mask=pad & tmask[:, None])
    if ORDER:
        schedule_tile_order(fid, tid, te, sel, ev, cnt, starts, ends, total, within_ptr, src_count_ptr, rank, W,
                            E_local, n_chunks, tile_order_ptr, local_tiles_ptr, BM)


@triton.jit
def _pick(sel, v):
    """Per tile, the value of ``v`` [E_PAD] at the tile's expert (``sel``: [tiles, E_PAD] one-hot; 0 if none)."""
    return tl.sum(tl.where(sel, v[None, :], 0), axis=1)


@triton.jit
def schedule_tile_order(fid, tid, te, sel, ev, cnt, starts, ends, total, within_ptr, src_count_ptr, rank, W,
                        E_local, n_chunks, tile_order_ptr, local_tiles_ptr, BM: tl.constexpr):
    """``tile_order[p]`` = the row tile handed out at position p of the forward megakernel's token
    pull (``MegaPlan.token_pull``): first every tile whose real rows all come from this rank
    (or that has none), expert by expert, then the others, expert by expert; ``local_tiles`` = how
    many come first. The others read rows pulled from their ranks, which arrive while the first
    ones compute. Closed form per expert, no scan over tiles: inside an expert's segment the rows
    sort by source rank, so this rank's rows are one range ``[lo, lo + cl)`` of it and the tiles
    holding other rows are those meeting ``[0, lo)`` (tiles ``[0, a1)``) or ``[lo + cl, cnt)``
    (tiles ``[b0, b1)``). ``tid``, ``te``, ``sel``: the fill program's tiles, their experts (-1 past
    the end) and its [tiles, experts] one-hot; ``ev .. total``: ``schedule_expert_starts``."""
    em = ev < E_local
    lo = tl.load(within_ptr + (rank * n_chunks) * E_local + ev, mask=em, other=0)  # rows before this rank's
    cl = tl.load(src_count_ptr + ev * W + rank, mask=em, other=0)
    a1 = (lo + BM - 1) // BM
    b0 = tl.maximum((lo + cl) // BM, a1)
    b1 = tl.where(lo + cl < cnt, (cnt + BM - 1) // BM, b0)
    n_rem = a1 + (b1 - b0)
    n_loc = (ends - starts) // BM - n_rem
    n_local = tl.sum(n_loc, axis=0)
    base_loc = tl.cumsum(n_loc, axis=0) - n_loc
    base_rem = n_local + tl.cumsum(n_rem, axis=0) - n_rem
    if fid == 0:
        tl.store(local_tiles_ptr, n_local)
    j = tid - _pick(sel, starts) // BM  # tile within its expert's segment
    ta1, tb0, tb1 = _pick(sel, a1), _pick(sel, b0), _pick(sel, b1)
    remote = (j < ta1) | ((j >= tb0) & (j < tb1))
    before = tl.minimum(j, ta1) + tl.maximum(tl.minimum(j, tb1) - tb0, 0)  # other-rank tiles before j
    pos = tl.where(remote, _pick(sel, base_rem) + before, _pick(sel, base_loc) + j - before)
    tl.store(tile_order_ptr + pos, tid, mask=(te >= 0) & (tid * BM < total))


# ----------------------------------------------------------------------------------------------
# Standalone kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _schedule_count_kernel(idx_ptrs, counts_ptr, err_ptr, rank, N, W, E_local, n_chunks,
                           within_ptr, expert_count_ptr, src_count_ptr, done_ptr,
                           my_flags, epoch_ptr, slot, wait_budget,
                           idx, w, idx_pub, w_pub, flag_ptrs,
                           CHUNK: tl.constexpr, E_PAD: tl.constexpr, ALIGNED: tl.constexpr, BC: tl.constexpr,
                           WAIT: tl.constexpr, PUBLISH: tl.constexpr):
    """count (one program per (src, chunk)), then the scan by the last program to finish.

    WAIT: a peer's chunk first waits for its routing to be published (its flag ``[slot, src]`` at
    the epoch). PUBLISH (with WAIT): this rank's chunks also publish its routing first (``idx`` ->
    ``idx_pub`` int32, ``w`` -> ``w_pub`` fp32) and the last of them starts the pass's epoch on every
    rank (``comm._signal_peers``); the pass's epoch is the stored one + 1 until the scan program
    stores it (every program has read it by then). Programs take this rank's chunks first, so that
    they never wait behind programs that wait for peers.
    """
    pid = tl.program_id(0)
    src = (rank + pid // n_chunks) % W  # this rank's chunks first
    chunk = pid % n_chunks
    vpid = src * n_chunks + chunk  # (src, chunk): the counts row
    epoch = tl.load(epoch_ptr)
    if PUBLISH:
        epoch += 1  # this launch starts the pass (stored by the scan program)
        if src == rank:
            offs = chunk * CHUNK + tl.arange(0, CHUNK)
            m = offs < N
            tl.store(idx_pub + offs, tl.load(idx + offs, mask=m).to(tl.int32), mask=m)
            tl.store(w_pub + offs, tl.load(w + offs, mask=m).to(tl.float32), mask=m)
            tl.debug_barrier()  # every thread's stores issued (and visible to this program's loads below)
            published = tl.atomic_add(done_ptr + 1, 1, sem="acq_rel", scope="gpu")
            if published == n_chunks - 1:  # every chunk of this rank's routing is in idx_pub / w_pub
                tl.store(done_ptr + 1, 0)
                _signal_peers(flag_ptrs, epoch, slot, rank, W)
    if WAIT:
        if src != rank:
            wait_geq(my_flags + slot * W + src, epoch, wait_budget, err_ptr, _ERR_WAIT_PEER_READY,
                     rank, slot * W + src, epoch, "sys")
        tl.debug_barrier()  # the polling thread's acquire orders every thread's loads after it
    schedule_count_program(vpid, idx_ptrs, counts_ptr, err_ptr, rank, N, W, E_local,
                           n_chunks, CHUNK, E_PAD, ALIGNED)
    tl.debug_barrier()  # every thread's counts stored
    # the last program to finish scans every program's counts (acq_rel: their stores before its loads)
    done = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        tl.store(done_ptr, 0)  # every program has counted: ready for the next call
        if PUBLISH:
            tl.store(epoch_ptr, epoch)
        schedule_scan_program(counts_ptr, within_ptr, expert_count_ptr, src_count_ptr, W, E_local, n_chunks,
                              E_PAD, BC)


@triton.jit
def _schedule_place_kernel(idx_ptrs, counts_ptr, within_ptr, expert_count_ptr, expert_start_ptr,
                           num_tiles_ptr, tile_expert_ptr, row_src_ptr, row_of_src_ptr, rank, N, W,
                           E_local, n_chunks, n_place, n_tiles_max, BM: tl.constexpr,
                           CHUNK: tl.constexpr, TPP: tl.constexpr, E_PAD: tl.constexpr,
                           HAS_INV: tl.constexpr, ALIGNED: tl.constexpr, ALIGN_TILES: tl.constexpr,
                           HAS_W: tl.constexpr, w_ptrs, row_w_ptr, ORDER: tl.constexpr, src_count_ptr,
                           tile_order_ptr, local_tiles_ptr):
    pid = tl.program_id(0)
    if pid < n_place:
        schedule_place_program(pid, idx_ptrs, counts_ptr, within_ptr, expert_count_ptr, row_src_ptr,
                               row_of_src_ptr, rank, N, W, E_local, n_chunks, BM, CHUNK, E_PAD,
                               HAS_INV, ALIGNED, ALIGN_TILES, HAS_W, w_ptrs, row_w_ptr)
    else:
        schedule_fill_program(pid - n_place, expert_count_ptr, expert_start_ptr, num_tiles_ptr,
                              tile_expert_ptr, row_src_ptr, E_local, n_tiles_max, BM, TPP, E_PAD, ALIGN_TILES,
                              ORDER, within_ptr, src_count_ptr, rank, W, n_chunks, tile_order_ptr, local_tiles_ptr)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def default_chunk(T: int, k: int) -> int:
    """Entries per count/place program: about 128 programs per source rank, 256..1024 entries."""
    return min(1024, max(256, _next_pow2(_cdiv(T * k, 128))))


@dataclass
class ScheduleBuffers:
    """Outputs and scratch of the schedule of one rank; allocated once, reused by every call.

    Outputs (all int32, fully rewritten by every call):
      row_src      [R_max]          flat source id served by each routed row, -1 for padding/unused
                                    (a tile's real rows are a prefix: row_src[i*BM] < 0 for a padding tile)
      tile_expert  [R_max // BM]    local expert of each BM-row tile, -1 past the end and for a tile of
                                    padding rows only (ALIGN_TILES > 1)
      expert_start [E_local + 1]    padded start row of each expert's segment; [E_local] = total rows
      expert_count [E_local]        real rows per local expert
      src_count    [E_local, W]     real rows of expert e from source rank s
      num_tiles    [1]              expert_start[E_local] // BM
      row_of_src   [W * T * k]      (only with ``inverse=True``) row serving each flat source id, or -1
      tile_order   [R_max // BM]    (only with ``order=True``) row tile at each position of the forward
                                    megakernel's token-pull order (``schedule_tile_order``); entries
                                    past num_tiles unwritten
      local_tiles  [1]              (only with ``order=True``) tiles with rows from this rank only,
                                    which come first in ``tile_order``
    Scratch: counts, within [W, n_chunks, E_local]; done [2] (zero between calls: the count
    launch's last programs reset them).
    """

    W: int
    T: int
    k: int
    E_local: int
    BM: int
    ALIGN_TILES: int  # expert segments padded to a multiple of this many row tiles
    CHUNK: int
    TPP: int
    n_chunks: int
    R_max: int
    row_src: torch.Tensor
    tile_expert: torch.Tensor
    expert_start: torch.Tensor
    expert_count: torch.Tensor
    src_count: torch.Tensor
    num_tiles: torch.Tensor
    counts: torch.Tensor
    within: torch.Tensor
    done: torch.Tensor
    row_of_src: Optional[torch.Tensor] = None
    tile_order: Optional[torch.Tensor] = None
    local_tiles: Optional[torch.Tensor] = None

    @property
    def n_tiles_max(self) -> int:
        return self.R_max // self.BM

    @property
    def E_PAD(self) -> int:
        return max(16, _next_pow2(self.E_local))

    def outputs(self) -> dict:
        out = {name: getattr(self, name) for name in
               ("row_src", "tile_expert", "expert_start", "expert_count", "src_count", "num_tiles")}
        for name in ("row_of_src", "tile_order", "local_tiles"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


def alloc_schedule(W: int, T: int, k: int, E_local: int, BM: int, device, chunk: Optional[int] = None,
                   fill_rows: int = 2048, inverse: bool = False, align: int = 1,
                   done: Optional[torch.Tensor] = None, order: bool = False) -> ScheduleBuffers:
    """Allocate the schedule's outputs and scratch for one rank (see :class:`ScheduleBuffers`).

    ``chunk``: entries per count/place program (power of two, default :func:`default_chunk`);
    ``fill_rows``: rows per fill program; ``inverse``: also produce ``row_of_src``; ``align``:
    expert segments padded to a multiple of ``align`` tiles (module docstring); ``done``: the count
    launch's int32 [2] counters, zero (a caller that allocates per call keeps one, to save a memset);
    ``order``: also produce ``tile_order`` and ``local_tiles``.
    """
    assert align >= 1, "align must be >= 1"
    assert W >= 1 and T >= 1 and k >= 1 and E_local >= 1
    assert BM >= 1 and BM & (BM - 1) == 0, "BM must be a power of two"
    CHUNK = default_chunk(T, k) if chunk is None else int(chunk)
    assert CHUNK >= 16 and CHUNK & (CHUNK - 1) == 0, "chunk must be a power of two >= 16"
    E_PAD = max(16, _next_pow2(E_local))
    assert (E_PAD + 1) * CHUNK < 2**31
    # tiles per fill program: at most fill_rows rows, and a [TPP, E_PAD] comparison of <= 2048
    TPP = max(1, min(_next_pow2(fill_rows) // BM, 2048 // E_PAD))
    N = T * k
    n_chunks = _cdiv(N, CHUNK)
    R_max = schedule_capacity(W, T, k, E_local, BM, align)
    i32 = dict(dtype=torch.int32, device=device)
    return ScheduleBuffers(
        W=W, T=T, k=k, E_local=E_local, BM=BM, ALIGN_TILES=align, CHUNK=CHUNK, TPP=TPP,
        n_chunks=n_chunks,
        R_max=R_max,
        row_src=torch.empty(R_max, **i32),
        tile_expert=torch.empty(R_max // BM, **i32),
        expert_start=torch.empty(E_local + 1, **i32),
        expert_count=torch.empty(E_local, **i32),
        src_count=torch.empty(E_local, W, **i32),
        num_tiles=torch.empty(1, **i32),
        counts=torch.empty(W, n_chunks, E_local, **i32),
        within=torch.empty(W, n_chunks, E_local, **i32),
        done=torch.zeros(2, **i32) if done is None else done,
        row_of_src=torch.empty(W * N, **i32) if inverse else None,
        tile_order=torch.empty(R_max // BM, **i32) if order else None,
        local_tiles=torch.empty(1, **i32) if order else None,
    )


def schedule_grids(bufs: ScheduleBuffers) -> dict:
    """Programs per launch (fixed by the shapes)."""
    n_place = bufs.W * bufs.n_chunks
    return {"count": n_place, "place": n_place + _cdiv(bufs.n_tiles_max, bufs.TPP)}


def launch_schedule(bufs: ScheduleBuffers, idx_ptrs: torch.Tensor, err: torch.Tensor, rank: int,
                    aligned: bool = True, num_warps_place: int = 4, ready=None, publish=None,
                    row_w=None) -> None:
    """Launch the schedule (2 kernels) into the current stream; no host synchronization.

    ``idx_ptrs``: int64 ``[W]`` addresses of every rank's int32 ``[T, k]`` topk_idx (contiguous;
    16-byte aligned unless ``aligned=False``). ``err``: int32 error record (``sync.ERR_WORDS``).
    ``ready``: None, or (my_flags, epoch, slot, wait_budget): the count programs of a peer's chunks
    first wait for its flag ``[slot, src]`` to reach the epoch, so no separate wait launch comes
    before the schedule. ``publish``: None, or (idx [T, k], w [T, k],
    idx_pub, w_pub, flag_ptrs) with ``ready``: the count programs of this rank's chunks publish its
    routing and signal it themselves (the epoch in ``ready`` is then the last pass's; the launch
    stores the new one), so no publish launch comes first either. Not under the interpreter, which
    runs one rank's launch at a time: a program waiting for a peer there would never return.
    ``row_w``: None, or (w_ptrs int64 [W], out fp32 [R_max]): the place launch also writes each real
    row's router weight, read from every rank's published weights through ``w_ptrs``.
    """
    W, E_local, N = bufs.W, bufs.E_local, bufs.T * bufs.k
    assert idx_ptrs.dtype == torch.int64 and idx_ptrs.numel() == W
    assert err.dtype == torch.int32
    assert 0 <= rank < W
    assert W * N + E_local * bufs.BM < 2**31, "flat ids and rows must fit in int32"
    E_PAD = bufs.E_PAD
    BC = max(1, 8192 // E_PAD)  # chunks per step of the scan
    grids = schedule_grids(bufs)
    n_place = grids["count"]
    inv = bufs.row_of_src if bufs.row_of_src is not None else bufs.row_src  # dummy when unused
    w_ptrs, w_out = (idx_ptrs, bufs.counts) if row_w is None else row_w  # (dummies when unused)
    if row_w is not None:
        assert w_ptrs.dtype == torch.int64 and w_ptrs.numel() == W
        assert w_out.dtype == torch.float32 and w_out.numel() >= bufs.R_max
    order = bufs.tile_order if bufs.tile_order is not None else bufs.counts
    local_tiles = bufs.local_tiles if bufs.local_tiles is not None else bufs.counts
    if ready is None:
        my_flags, epoch, slot, budget = bufs.counts, bufs.counts, 0, 0  # unused
    else:
        my_flags, epoch, slot, budget = ready
    if publish is None:
        idx = w = idx_pub = w_pub = bufs.counts  # unused
        flag_ptrs = idx_ptrs
    else:
        assert ready is not None, "publish needs ready (the flags and epoch)"
        idx, w, idx_pub, w_pub, flag_ptrs = publish
        assert idx.is_contiguous() and w.is_contiguous() and idx.numel() == w.numel() == N
        assert bufs.done.numel() >= 2, "publish needs a second done counter"
    _schedule_count_kernel[(grids["count"],)](
        idx_ptrs, bufs.counts, err, rank, N, W, E_local, bufs.n_chunks, bufs.within, bufs.expert_count,
        bufs.src_count, bufs.done, my_flags, epoch, slot, budget, idx, w, idx_pub, w_pub, flag_ptrs,
        CHUNK=bufs.CHUNK, E_PAD=E_PAD, ALIGNED=aligned, BC=BC, WAIT=ready is not None,
        PUBLISH=publish is not None, num_warps=4)
    _schedule_place_kernel[(grids["place"],)](
        idx_ptrs, bufs.counts, bufs.within, bufs.expert_count, bufs.expert_start, bufs.num_tiles,
        bufs.tile_expert, bufs.row_src, inv, rank, N, W, E_local, bufs.n_chunks, n_place,
        bufs.n_tiles_max, BM=bufs.BM, CHUNK=bufs.CHUNK, TPP=bufs.TPP, E_PAD=E_PAD,
        HAS_INV=bufs.row_of_src is not None, ALIGNED=aligned, ALIGN_TILES=bufs.ALIGN_TILES,
        HAS_W=row_w is not None, w_ptrs=w_ptrs, row_w_ptr=w_out, ORDER=bufs.tile_order is not None,
        src_count_ptr=bufs.src_count, tile_order_ptr=order, local_tiles_ptr=local_tiles,
        num_warps=num_warps_place)


# ----------------------------------------------------------------------------------------------
# Reference (test oracle)
# ----------------------------------------------------------------------------------------------


def schedule_reference(all_idx: torch.Tensor, rank: int, E_local: int, BM: int,
                       R_max: Optional[int] = None, align: int = 1) -> dict:
    """The schedule of ``rank`` in plain PyTorch (host sync fine). ``all_idx``: ``[W, T, k]`` ids.

    Ids outside ``[0, W*E_local)`` are routed nowhere. Returns int32 CPU tensors with the same
    names and shapes as :meth:`ScheduleBuffers.outputs` (``row_of_src`` included).
    """
    W, T, k = all_idx.shape
    N = T * k
    if R_max is None:
        R_max = schedule_capacity(W, T, k, E_local, BM, align)
    g = all_idx.reshape(W * N).to(torch.int64).cpu()
    e = g - rank * E_local
    local = (g >= 0) & (g < W * E_local) & (e >= 0) & (e < E_local)
    pos = torch.nonzero(local).squeeze(1)  # flat ids in increasing (src, t, kk) order
    el = e[pos]
    order = torch.sort(el, stable=True).indices
    pos_s, e_s = pos[order], el[order]
    count = torch.bincount(el, minlength=E_local)
    src_count = torch.bincount(el * W + pos // N, minlength=E_local * W).reshape(E_local, W)
    seg = BM * align
    padded = (count + seg - 1) // seg * seg
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    total = int(ends[-1])
    first_sorted = torch.cumsum(count, 0) - count  # index in e_s of each expert's first entry
    rows = starts[e_s] + torch.arange(e_s.numel()) - first_sorted[e_s]
    row_src = torch.full((R_max,), -1, dtype=torch.int64)
    row_src[rows] = pos_s
    n_tiles_max = R_max // BM
    r0 = torch.arange(n_tiles_max) * BM
    tile_expert = torch.searchsorted(ends, r0, right=True)
    real_end = (starts + count)[tile_expert.clamp(max=E_local - 1)]
    tile_expert = torch.where((r0 < total) & (r0 < real_end), tile_expert, torch.full_like(tile_expert, -1))
    row_of_src = torch.full((W * N,), -1, dtype=torch.int64)
    row_of_src[pos_s] = rows
    # token-pull order: tiles whose real rows are all this rank's (or none) first, each class in tile order
    n_tiles = total // BM
    src_of_row = torch.where(row_src >= 0, row_src // N, rank)[:n_tiles * BM].reshape(n_tiles, BM)
    remote = (src_of_row != rank).any(dim=1)
    tile_order = torch.full((n_tiles_max,), -1, dtype=torch.int64)
    tile_order[:n_tiles] = torch.cat([torch.nonzero(~remote).flatten(), torch.nonzero(remote).flatten()])
    i32 = torch.int32
    return {
        "row_src": row_src.to(i32),
        "tile_expert": tile_expert.to(i32),
        "expert_start": torch.cat([starts, ends[-1:]]).to(i32),
        "expert_count": count.to(i32),
        "src_count": src_count.to(i32),
        "num_tiles": torch.tensor([total // BM], dtype=i32),
        "row_of_src": row_of_src.to(i32),
        "tile_order": tile_order.to(i32),  # -1 past num_tiles (the kernel leaves those unwritten)
        "local_tiles": torch.tensor([int((~remote).sum())], dtype=i32),
    }
