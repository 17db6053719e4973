"""Memory-ordering primitives: the only place Tabby's kernels touch flags.

Flags are int32 counters in GPU memory (symmetric memory when they cross GPUs). Producers
publish with a *release* atomic after their stores; consumers poll with an *acquire* atomic
(a plain ``tl.load`` in a loop is hoisted by the compiler and never sees the flag). Flags that
cross GPUs use scope ``"sys"``; flags inside one GPU ``"gpu"``.

Every wait is bounded: after a budget of GPU time (``%globaltimer`` nanoseconds; under the
interpreter, which has no clock, a number of polls), or as soon as this rank's error record holds
an earlier error, it gives up, writes what it waited for to the error record and returns, so a
lost signal becomes a clear host-side error instead of a hang.

Error record: int32 [ERR_WORDS] per rank, zero when healthy.
    [0] error code (first error wins; see ``ERR_*``)  [1] rank that waited  [2] flag index
    [3] expected value  [4] value last seen  [5] epoch
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from . import INTERPRET as _INTERPRET_HOST

_INTERPRET = tl.constexpr(_INTERPRET_HOST)

ERR_WORDS = 8

# What a timed-out wait was waiting for (word 0 of the error record).
ERR_NONE = 0
ERR_WAIT_PEER_READY = 1  # a peer's inputs (topk_idx, x or dy) to be published
ERR_WAIT_PEER_DONE = 2  # a peer to finish pushing its results into this rank's buffer
ERR_WAIT_TILE = 3  # a tile's producer inside this rank (dispatch -> GEMM, GEMM -> GEMM)
ERR_BAD_EXPERT_ID = 4  # an expert id outside [0, E) ([3] = E, [4] = the id)
ERR_WAIT_RING_SLOT = 5  # a ring slot to be retired

ERR_NAMES = {
    ERR_WAIT_PEER_READY: "waited for a peer to publish its inputs",
    ERR_WAIT_PEER_DONE: "waited for a peer to finish pushing results",
    ERR_WAIT_TILE: "waited for a tile's producer",
    ERR_BAD_EXPERT_ID: "expert id out of range",
    ERR_WAIT_RING_SLOT: "waited for a ring slot to be retired",
}


@triton.jit
def load_acquire(ptr, SCOPE: tl.constexpr):
    """Read a flag with acquire semantics (an atomic add of 0)."""
    return tl.atomic_add(ptr, 0, sem="acquire", scope=SCOPE)


@triton.jit
def store_release(ptr, value, SCOPE: tl.constexpr):
    """Publish ``value`` with release semantics: every earlier store of this program is visible first."""
    tl.debug_barrier()  # all threads of the program have issued their stores
    tl.atomic_xchg(ptr, value, sem="release", scope=SCOPE)


@triton.jit
def add_release(ptr, value, SCOPE: tl.constexpr):
    """Add to a counter with release semantics (after a barrier over the program's stores)."""
    tl.debug_barrier()
    tl.atomic_add(ptr, value, sem="release", scope=SCOPE)


@triton.jit
def add_reads_done(ptr, value, SCOPE: tl.constexpr):
    """Add to a counter that only says "this program has finished READING a buffer" (relaxed).

    For write-after-read signals (a ring slot may be overwritten): every read of the program has
    returned its value by the barrier (the values were consumed), so a later overwrite cannot
    change them, and no fence is needed. Unlike ``add_release`` this does not wait for the
    program's own stores (e.g. rows pushed over NVLink) to complete first.
    """
    tl.debug_barrier()
    tl.atomic_add(ptr, value, sem="relaxed", scope=SCOPE)


@triton.jit
def poll2(cnt_ptr, idx1, target1, idx2, target2, NW: tl.constexpr):
    """One round trip for a ticket's first polls: acquire reads of up to two counters, ok when
    ``cnt_ptr[idx1] >= target1`` and ``cnt_ptr[idx2] >= target2`` (an index < 0: no counter).
    If not ok the caller waits with ``wait_geq``.

    The two atomics are issued by lane 0 of two different warps (NW >= 2), so their round trips
    overlap (a scalar atomic is issued by one thread and broadcast: one round trip each). The
    reduction that broadcasts the result ends in a CTA barrier, which orders every thread's later
    reads after both acquires (as ``wait_geq`` plus its caller's barrier does).
    """
    lane = tl.arange(0, 32 * NW)
    on = ((lane == 0) & (idx1 >= 0)) | ((lane == 32) & (idx2 >= 0))
    idx = tl.where(lane < 32, idx1, idx2)
    seen = tl.atomic_add(cnt_ptr + tl.maximum(idx, 0), tl.zeros_like(lane), mask=on, sem="acquire", scope="gpu")
    short = ((lane == 0) & (idx1 >= 0) & (seen < target1)) | ((lane == 32) & (idx2 >= 0) & (seen < target2))
    return tl.max(short.to(tl.int32), axis=0) == 0


@triton.jit
def signal(cnt_ptr, idx, release):
    """Add 1 to ``cnt_ptr[idx]`` (idx < 0: nothing) from one thread, with release semantics
    (``release`` != 0: MEMBAR, then the add) or relaxed; the caller's CTA barrier comes first."""
    if idx >= 0:
        if release != 0:
            tl.atomic_add(cnt_ptr + idx, 1, sem="release", scope="gpu")
        else:
            tl.atomic_add(cnt_ptr + idx, 1, sem="relaxed", scope="gpu")


@triton.jit
def signal_take(cnt_ptr, idx, release, ticket_idx, NW: tl.constexpr):
    """End a ticket and take the program's next one: add 1 to ``cnt_ptr[idx]`` (idx < 0: no signal)
    with release semantics (``release`` != 0, as ``add_release``) or relaxed (as ``add_reads_done``),
    and add 1 to the ticket counter ``cnt_ptr[ticket_idx]`` (relaxed); returns the ticket's old value.

    The ticket atomic goes out from another warp than the signal (lane 64; NW >= 3) right after the
    barrier, so its round trip overlaps the release's fence instead of following it. The next
    ticket is then taken before this one's signal lands, which delays that signal by the fence
    only: deadlock-free, since the signal waits for nothing but this program's own stores.
    """
    tl.debug_barrier()  # every thread's stores issued (release) / reads returned (relaxed)
    lane = tl.arange(0, 32 * NW)
    got = tl.atomic_add(cnt_ptr + ticket_idx + tl.zeros_like(lane), tl.full(lane.shape, 1, tl.int32),
                        mask=lane == 64, sem="relaxed", scope="gpu")
    signal(cnt_ptr, idx, release)
    return tl.max(tl.where(lane == 64, got, -1), axis=0)


@triton.jit
def fence_proxy_async():
    """Order this thread's generic-proxy memory accesses with its async-proxy ones (TMA).

    Ring rows written with ordinary stores and read by tensor-descriptor (TMA) loads in another
    program cross proxies: the writer fences after its stores (before the release), the reader
    after its acquire (before the TMA loads). A no-op under the interpreter.
    """
    if not _INTERPRET:
        tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def record_error(err_ptr, code, rank, index, expected, seen, epoch):
    """Write the error record unless an earlier error is there (first error wins)."""
    old = tl.atomic_cas(err_ptr, 0, code, sem="relaxed", scope="gpu")
    if old == 0:
        tl.store(err_ptr + 1, rank)
        tl.store(err_ptr + 2, index)
        tl.store(err_ptr + 3, expected)
        tl.store(err_ptr + 4, seen)
        tl.store(err_ptr + 5, epoch)


@triton.jit
def wait_geq(ptr, target, budget, err_ptr, code, rank, index, epoch, SCOPE: tl.constexpr):
    """Spin until ``*ptr >= target`` (acquire); when ``budget`` runs out record an error and return.

    budget: nanoseconds of GPU time (polls under the interpreter). A time budget, not a poll
    count, so that the bound means the same on every GPU and tolerates a peer that starts late
    (e.g. still compiling its kernels on the first call). Returns the last value seen. Counters
    only grow, so ``>=`` tolerates producers running ahead.
    """
    seen = load_acquire(ptr, SCOPE)
    if _INTERPRET:
        start = 0
    else:
        start = globaltimer()
    spent = (start - start).to(tl.int64)
    stop = 0
    i = 0
    while (seen < target) & (spent < budget) & (stop == 0):
        seen = load_acquire(ptr, SCOPE)
        i += 1
        if _INTERPRET:
            spent = (spent + 1).to(tl.int64)
        if (i % 64) == 0:
            if not _INTERPRET:
                spent = (globaltimer() - start).to(tl.int64)
            # An earlier error on this rank already dooms the pass: give up at once instead of
            # letting every dependent wait run out its own budget one after another.
            if tl.load(err_ptr, volatile=True) != 0:
                stop = 1
    if seen < target:
        record_error(err_ptr, code, rank, index, target, seen, epoch)
    return seen
