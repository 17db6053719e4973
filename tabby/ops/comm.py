"""Communication roles: publish/wait on peer flags, pull rows from peers, push scalars to peers.

Peer buffers are reached through address tables: int64 tensors [W] whose entry ``r`` is the
address of rank r's copy of a symmetric buffer (its own entry included). On the GPU these are
symmetric-memory addresses; in the CPU test harness, the data pointers of CPU tensors.
"""
import triton
import triton.language as tl

from . import sync


@triton.jit
def _signal_peers(flag_ptrs, epoch, slot, rank, W):
    """Set flag ``[slot, rank]`` to ``epoch`` on every rank (release, system scope)."""
    for p in range(W):
        flags = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int32))
        sync.store_release(flags + slot * W + rank, epoch, SCOPE="sys")


@triton.jit
def _wait_peers(my_flags, epoch, slot, rank, W, wait_budget, err_ptr, code):
    """Wait until every rank has set flag ``[slot, src]`` of this rank to at least ``epoch`` (bounded)."""
    for src in range(W):
        sync.wait_geq(my_flags + slot * W + src, epoch, budget=wait_budget, err_ptr=err_ptr, code=code, rank=rank,
                      index=slot * W + src, epoch=epoch, SCOPE="sys")


@triton.jit
def _epoch(epoch_ptr, BUMP: tl.constexpr):
    """The pass's epoch; with ``BUMP`` incremented first (the first signal of a pass starts a new
    epoch; the later signals of the same pass reuse it)."""
    epoch = tl.load(epoch_ptr)
    if BUMP:
        epoch += 1
        tl.store(epoch_ptr, epoch)
    return epoch


@triton.jit
def signal_peers_kernel(flag_ptrs, epoch_ptr, slot, rank, W, BUMP: tl.constexpr):
    """Set flag ``[slot, rank]`` to the current epoch on every rank (release, system scope);
    ``BUMP``: increment the epoch first. One program."""
    _signal_peers(flag_ptrs, _epoch(epoch_ptr, BUMP), slot, rank, W)


@triton.jit
def wait_peers_kernel(my_flags, epoch_ptr, slot, rank, W, wait_budget, err_ptr, code):
    """Wait until every rank has set flag ``[slot, src]`` of this rank to at least the epoch."""
    _wait_peers(my_flags, tl.load(epoch_ptr), slot, rank, W, wait_budget, err_ptr, code)


@triton.jit
def signal_wait_peers_kernel(flag_ptrs, my_flags, epoch_ptr, slot, rank, W, wait_budget, err_ptr, code,
                             BUMP: tl.constexpr):
    """``signal_peers_kernel`` then ``wait_peers_kernel`` in one launch: every pass signals and
    waits two or three times, and each Triton launch costs host time, which small shapes feel."""
    epoch = _epoch(epoch_ptr, BUMP)
    _signal_peers(flag_ptrs, epoch, slot, rank, W)
    _wait_peers(my_flags, epoch, slot, rank, W, wait_budget, err_ptr, code)


@triton.jit
def count_ready_kernel(my_flags, epoch_ptr, slot, W, out):
    """out[0] = how many ranks have set flag ``[slot, src]`` to at least the epoch (one poll, no wait).

    The CPU harness polls with this from the host: the interpreter cannot run launches of
    several threads at once, so a wait there must not hold the interpreter.
    """
    epoch = tl.load(epoch_ptr)
    n = 0
    for src in range(W):
        n += (sync.load_acquire(my_flags + slot * W + src, SCOPE="sys") >= epoch).to(tl.int32)
    tl.store(out, n)


@triton.jit
def _copy_cols(src_row, dst_row, valid, h0, H, BH: tl.constexpr, KEEP: tl.constexpr = False, keep=0):
    """Columns h0 .. h0+BH of a block of rows: dst_row[r] <- src_row[r] (0 where not valid; KEEP:
    rows where ``keep`` is set are neither read nor written)."""
    cols = h0 + tl.arange(0, BH)
    cmask = cols < H
    if KEEP:
        v = tl.load(src_row[:, None] + cols[None, :], mask=(valid & ~keep)[:, None] & cmask[None, :], other=0.0)
        tl.store(dst_row[:, None] + cols[None, :], v, mask=(~keep)[:, None] & cmask[None, :])
    else:
        v = tl.load(src_row[:, None] + cols[None, :], mask=valid[:, None] & cmask[None, :], other=0.0)
        tl.store(dst_row[:, None] + cols[None, :], v, mask=cmask[None, :])


@triton.jit
def pull_rows_tile(tile, row_src, src_ptrs, dst, H, TK, k, w_ptrs, ws_out,
                   BR: tl.constexpr, BH: tl.constexpr, WITH_WEIGHTS: tl.constexpr, ROWS_16B: tl.constexpr,
                   STAGES: tl.constexpr = 1, W=1, WP: tl.constexpr = 0, SKIP_EMPTY: tl.constexpr = False,
                   SKIP_RANK: tl.constexpr = False, rank=0, ONLY_RANK: tl.constexpr = False):
    """Copy rows ``tile*BR ..`` of the routed buffer from their source ranks.

    Row r serves flat source id ``row_src[r] = src*TK + t*k + kk`` (-1: padding, written as zeros):
    ``dst[r] = rows_of(src)[t]`` where ``src_ptrs[src]`` is the address of rank src's [T, H]
    buffer. With WITH_WEIGHTS also ``ws_out[r] = weights_of(src)[t*k + kk]`` (fp32, 0 for padding).
    ROWS_16B: every source row starts 16-byte aligned (H * itemsize % 16 == 0; the buffers are).
    STAGES > 1: the column loop is software-pipelined (the loads of the next STAGES-1 column blocks
    go to shared memory as async copies while a block is stored), so more bytes are in flight than
    the registers of one block hold; 1: one block of loads, then its stores.
    WP > 0 (a power of two >= W, the number of ranks): the address tables are loaded whole, in the
    same round trip as ``row_src``, and each row picks its entry in registers; WP = 0: each row's
    entry is loaded after its ``row_src`` (one more dependent round trip).
    SKIP_EMPTY: a block of padding rows only (real rows are a prefix, so: its first row < 0) is not
    written at all. SKIP_RANK: rows from ``rank`` are neither read nor written (their weights
    are): the forward megakernel's gate/up tiles read them from x (its plan's ``local_rows``).
    ONLY_RANK: the other way round, only rows from ``rank`` are copied (the backward fills them in).
    """
    rows = tile * BR + tl.arange(0, BR)
    tab = src_ptrs  # placeholders when WP == 0 (each row's entry is loaded instead)
    wtab = w_ptrs
    if WP > 0:  # issued before row_src's load returns: independent of it
        ranks = tl.arange(0, WP)
        tab = tl.load(src_ptrs + ranks, mask=ranks < W, other=0)
        if WITH_WEIGHTS:
            wtab = tl.load(w_ptrs + ranks, mask=ranks < W, other=0)
    rs = tl.load(row_src + rows)
    if SKIP_EMPTY:
        if tl.max(rs, axis=0) >= 0:
            _pull_rows(rows, rs, src_ptrs, tab, dst, H, TK, k, w_ptrs, wtab, ws_out, BH=BH, WITH_WEIGHTS=WITH_WEIGHTS,
                       ROWS_16B=ROWS_16B, STAGES=STAGES, WP=WP, SKIP_RANK=SKIP_RANK, rank=rank, ONLY_RANK=ONLY_RANK)
    else:
        _pull_rows(rows, rs, src_ptrs, tab, dst, H, TK, k, w_ptrs, wtab, ws_out, BH=BH, WITH_WEIGHTS=WITH_WEIGHTS,
                   ROWS_16B=ROWS_16B, STAGES=STAGES, WP=WP, SKIP_RANK=SKIP_RANK, rank=rank, ONLY_RANK=ONLY_RANK)


@triton.jit
def _pull_rows(rows, rs, src_ptrs, tab, dst, H, TK, k, w_ptrs, wtab, ws_out, BH: tl.constexpr,
               WITH_WEIGHTS: tl.constexpr, ROWS_16B: tl.constexpr, STAGES: tl.constexpr, WP: tl.constexpr,
               SKIP_RANK: tl.constexpr = False, rank=0, ONLY_RANK: tl.constexpr = False):
    """``pull_rows_tile``'s copy of rows ``rows`` whose sources ``rs`` are loaded (tables: see there)."""
    valid = rs >= 0
    src = tl.where(valid, rs // TK, 0)
    tk = tl.where(valid, rs % TK, 0)
    tok = tk // k
    # Address each source row as an element offset from a pointer argument (the table itself,
    # cast): a pointer made by an int-to-pointer cast loses its alignment in the compiler's
    # analysis and the loads fall back to one element at a time (seen in the sm_90 PTX); this
    # way, with ROWS_16B, rows are read with 16-byte vectors.
    DT: tl.constexpr = dst.dtype.element_ty
    ESIZE: tl.constexpr = DT.primitive_bitwidth // 8
    if WP > 0:
        base = _pick(src, tab, WP)
    else:
        base = tl.load(src_ptrs + src)
    ref = src_ptrs.to(tl.pointer_type(DT), bitcast=True)
    row_off = (base - src_ptrs.to(tl.int64, bitcast=True)) // ESIZE + tok.to(tl.int64) * H
    if ROWS_16B:
        row_off = tl.multiple_of(row_off, 16 // ESIZE)
    src_row = ref + row_off
    dst_row = dst + rows.to(tl.int64) * H
    if WITH_WEIGHTS:  # loaded first, stored last: the weights' round trip overlaps the row copy
        if WP > 0:
            wbase = _pick(src, wtab, WP).to(tl.pointer_type(tl.float32))
        else:
            wbase = tl.load(w_ptrs + src).to(tl.pointer_type(tl.float32))
        wv = tl.load(wbase + tk, mask=valid, other=0.0)
    if SKIP_RANK or ONLY_RANK:
        if SKIP_RANK:
            keep = valid & (src == rank)  # rows left as they are
        else:
            keep = ~valid | (src != rank)
        if tl.sum((valid & ~keep).to(tl.int32), axis=0) > 0:  # some row to copy
            _copy_row_cols(src_row, dst_row, valid, H, BH=BH, STAGES=STAGES, KEEP=True, keep=keep)
    else:
        _copy_row_cols(src_row, dst_row, valid, H, BH=BH, STAGES=STAGES)
    if WITH_WEIGHTS:
        tl.store(ws_out + rows, wv)


@triton.jit
def _copy_row_cols(src_row, dst_row, valid, H, BH: tl.constexpr, STAGES: tl.constexpr, KEEP: tl.constexpr = False,
                   keep=0):
    """Every column of a block of rows, BH at a time (``_copy_cols``), software-pipelined with
    STAGES > 1."""
    if STAGES > 1:
        for h0 in tl.range(0, H, BH, num_stages=STAGES):
            _copy_cols(src_row, dst_row, valid, h0, H, BH=BH, KEEP=KEEP, keep=keep)
    else:
        for h0 in range(0, H, BH):
            _copy_cols(src_row, dst_row, valid, h0, H, BH=BH, KEEP=KEEP, keep=keep)


@triton.jit
def _pick(src, tab, WP: tl.constexpr):
    """tab[src] for each row (src [BR] int32 < WP, tab [WP] int64): a select in registers."""
    hit = src[:, None] == tl.arange(0, WP)[None, :]
    return tl.sum(tl.where(hit, tab[None, :], 0), axis=1)


@triton.jit
def pull_rows_kernel(row_src, num_tiles_ptr, src_ptrs, dst, H, TK, k, w_ptrs, ws_out,
                     BR: tl.constexpr, BH: tl.constexpr, WITH_WEIGHTS: tl.constexpr,
                     TILE_ROWS: tl.constexpr, ROWS_16B: tl.constexpr, ONLY_RANK: tl.constexpr = False, rank=0):
    """Persistent pull dispatch over the schedule's used rows (num_tiles * TILE_ROWS of them);
    ONLY_RANK: only the rows from ``rank`` (``pull_rows_tile``)."""
    n_rows = tl.load(num_tiles_ptr) * TILE_ROWS
    n_tiles = tl.cdiv(n_rows, BR)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        pull_rows_tile(tile, row_src, src_ptrs, dst, H, TK, k, w_ptrs, ws_out, BR=BR, BH=BH, WITH_WEIGHTS=WITH_WEIGHTS,
                       ROWS_16B=ROWS_16B, STAGES=1, W=1, WP=0, SKIP_EMPTY=False, SKIP_RANK=False, rank=rank,
                       ONLY_RANK=ONLY_RANK)


@triton.jit
def push_scalars_kernel(vals, row_src, num_tiles_ptr, dst_ptrs, TK, BR: tl.constexpr, TILE_ROWS: tl.constexpr):
    """``dst_of(src)[t*k + kk] = vals[r]`` for every used row r (fp32); padding rows are skipped."""
    n_rows = tl.load(num_tiles_ptr) * TILE_ROWS
    for r0 in range(tl.program_id(0) * BR, n_rows, tl.num_programs(0) * BR):
        rows = r0 + tl.arange(0, BR)
        rs = tl.load(row_src + rows, mask=rows < n_rows, other=-1)
        valid = rs >= 0
        src = tl.where(valid, rs // TK, 0)
        base = tl.load(dst_ptrs + src).to(tl.pointer_type(tl.float32))
        v = tl.load(vals + rows, mask=valid, other=0.0)
        tl.store(base + tl.where(valid, rs % TK, 0), v, mask=valid)
