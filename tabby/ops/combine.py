"""Combine on the origin rank: sum a token's k pushed rows in k order, in fp32.

    out[t] = sum_{kk in 0..k-1} w[t, kk] * rows[t*k + kk]  (+ extra[t])

``w`` is optional (the backward's dx sums without weights). The fixed k order makes the result
independent of when each row arrived: bitwise deterministic.
"""
import triton
import triton.language as tl


@triton.jit
def combine_k_kernel(rows, w, extra, out, T, H, k: tl.constexpr,
                     HAS_W: tl.constexpr, HAS_EXTRA: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                     COLS_FAST: tl.constexpr = False):
    """Program (token block, column block); COLS_FAST: the column block is program id 0 (varies
    fastest in launch order), so the programs of one token block run side by side and read its
    rows whole."""
    if COLS_FAST:
        pid_t, pid_h = tl.program_id(1), tl.program_id(0)
    else:
        pid_t, pid_h = tl.program_id(0), tl.program_id(1)
    t = pid_t * BT + tl.arange(0, BT)
    cols = pid_h * BH + tl.arange(0, BH)
    mask = (t < T)[:, None] & (cols < H)[None, :]
    acc = tl.zeros((BT, BH), dtype=tl.float32)
    # unrolled (k is a compile-time constant): the k row loads of a program are in flight together
    for kk in tl.static_range(k):
        r = (t * k + kk).to(tl.int64)
        v = tl.load(rows + r[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            wv = tl.load(w + t * k + kk, mask=t < T, other=0.0)
            v = wv[:, None] * v
        acc += v
    if HAS_EXTRA:
        acc += tl.load(extra + t.to(tl.int64)[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out + t.to(tl.int64)[:, None] * H + cols[None, :], acc.to(out.dtype.element_ty), mask=mask)


def default_block(H: int) -> tuple[int, int]:
    """(tokens, columns) per program: up to 1024 columns of 4096 elements, as fast as a copy of the
    same bytes (docs/performance.md, "Combine")."""
    BH = min(1024, triton.next_power_of_2(max(H, 1)))
    return 4096 // BH, BH


def combine_k(rows, T, k, w=None, extra=None, out=None, dtype=None, block=None, cols_fast=True, num_warps=4):
    """rows [T*k, H] -> out [T, H]; w [T, k] fp32 or None; extra [T, H] or None.

    ``block``: (tokens, columns) per program (None: ``default_block(H)``); ``cols_fast``: column
    blocks adjacent in launch order (``combine_k_kernel``). The defaults are the measured ones;
    scripts/combine_bench.py times others (every choice gives the same bits: each output element
    sums its k rows in k order)."""
    H = rows.shape[1]
    if out is None:
        out = rows.new_empty((T, H), dtype=dtype or rows.dtype)
    BT, BH = block or default_block(H)
    grid = (triton.cdiv(T, BT), triton.cdiv(H, BH))
    if cols_fast and grid[0] <= 65535:  # the token blocks then count in grid dim 1 (at most 65535)
        grid = grid[::-1]
    else:
        cols_fast = False
    if T > 0:
        combine_k_kernel[grid](rows, w if w is not None else rows, extra if extra is not None else rows, out,
                               T, H, k, HAS_W=w is not None, HAS_EXTRA=extra is not None, BT=BT, BH=BH,
                               COLS_FAST=cols_fast, num_warps=num_warps)
    return out
