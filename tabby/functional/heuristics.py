"""Every choice the layer derives from its shape and the device: pure functions, one rule each.

Private to the library: ``plan.make_plan`` calls these where a ``Tuning`` field is ``None``. Each
rule says in one line why it holds; the measurements behind it are in docs/performance.md under
the heading named in its docstring. Shape letters: T tokens per rank, H model width, I expert
width, I_s shared-expert width, k experts per token, E_local experts per rank, E all experts.
"""
from __future__ import annotations

import triton

from ..ops.gemm import bf16 as gemm

TILE_M = 128  # rows per routed row tile: the GEMMs' BM (docs/performance.md "GEMM tiles")
RING_ROWS = 4096  # megakernel ring: 32 slots of 128 rows, far enough ahead to hide a pull ("Ring size")
FILL_SPLIT = 4  # copy tickets per row tile: more programs pull one tile at once ("Fills and dispatch")
FILL_COLS = 512  # columns per copy step; wider measured no faster ("Measured no better")
DISPATCH_ROWS, DISPATCH_COLS, DISPATCH_PROGRAMS = 32, 512, 132  # the sync-free dispatch ("Fills and dispatch")
CPU_PROGRAMS = 3  # the interpreter's grid (per 8 warps)

TMA_MIN_FLOP = 5e11  # below it the descriptors' host time shows ("TMA loads")
FOUR_WARPS_MAX_I = 768  # two 4-warp programs per SM pay off up to this expert width ("Four-warp programs")
TWO_DOWN_COLS_MAX_I = 1024  # down tickets of two column tiles up to this K ("Down tickets of two column tiles")
GROUP_2_MAX_HI = 2 * 2**20  # small experts (H * I up to this) group 2 row tiles, not 4 ("Row-tile groups")
ALIGN_MAX_TILES = 4  # pad experts to 2 row tiles where they average at most this many ("Expert alignment")
PULL_TOKENS_MIN_TILES = 4  # pull whole tokens where experts get this many tiles per rank ("Token pull")


def gemm_config(kind: str, N: int, K: int, tile_m: int) -> gemm.GemmConfig:
    """The standalone GEMM kernels' tiles for ``kind`` (``gemm.KIND_*``), output width N, depth K;
    routed row tiles are the schedule's (``tile_m``). Tile sizes per kind: "GEMM tiles"."""
    return gemm.default_config(kind, N, K, BM=tile_m)


def use_tma(T: int, k: int, H: int, I: int, I_s: int) -> bool:
    """TMA operand loads where the rank's routed forward is large enough to hide the host time of
    the descriptors ("TMA loads"), and every row stride is a multiple of 16 bytes (bf16: 8)."""
    return 6 * T * k * H * I >= TMA_MIN_FLOP and tma_possible(H, I, I_s)


def tma_possible(H: int, I: int, I_s: int) -> bool:
    """Tensor descriptors need 16-byte row strides: H, I and I_s multiples of 8 (bf16)."""
    return H % 8 == 0 and I % 8 == 0 and I_s % 8 == 0


def num_warps(tma: bool, I: int) -> int:
    """Two 4-warp programs per SM where the down tile's K (I) is short: a second program covers
    one's pipeline fill and push epilogue ("Four-warp programs"); needs the TMA loads' registers."""
    return 4 if tma and I <= FOUR_WARPS_MAX_I else 8


def num_stages(warps: int) -> int:
    """K-loop pipeline depth: 4 with 8 warps (192 KB of shared memory), 3 with 4 warps so that two
    programs fit an SM ("Four-warp programs")."""
    return 3 if warps == 4 else 4


def fill_stages(warps: int) -> int:
    """A copy's column loop pipelined through shared memory with 4-warp programs; 8-warp programs'
    GEMMs leave no shared memory for it ("Fill pipeline")."""
    return 3 if warps == 4 else 1


def programs(sm_count: int | None, warps: int) -> int:
    """The persistent grid: a program per SM, two with 4-warp programs (``sm_count`` None: the
    interpreter, whose programs run one after another: a few exercise the ticket order)."""
    return (CPU_PROGRAMS if sm_count is None else sm_count) * (8 // warps)


def mega_tiles(H: int, I: int, I_s: int, tile_m: int, warps: int, stages: int):
    """The megakernel's (routed gate/up, routed down, shared gate/up, shared down) tiles: the
    standalone kernels' tiles, narrowed to 64 / 128 columns with 4 warps so that the accumulators
    fit 128 threads; the shared ones None without a shared expert. The routed gate/up config
    carries the launch's stages and warps."""
    gu, dn = gemm_config(gemm.KIND_GATE_UP, I, H, tile_m), gemm_config(gemm.KIND_DOWN, H, I, tile_m)
    gu_bn = min(gu.BN, 64) if warps == 4 else None
    dn_bn = min(dn.BN, 128) if warps == 4 else None

    def narrowed(c, BN):
        return c if BN is None else c.with_(BN=BN)

    gu = narrowed(gu, gu_bn).with_(num_stages=stages, num_warps=warps)
    gus = narrowed(gemm_config(gemm.KIND_GATE_UP, I_s, H, tile_m), gu_bn) if I_s else None
    dns = narrowed(gemm_config(gemm.KIND_DOWN, H, I_s, tile_m), dn_bn) if I_s else None
    return gu, narrowed(dn, dn_bn), gus, dns


def down_cols(I: int, n_cols: int, wanted: int | None = None) -> int:
    """Column tiles per down ticket: 2 where the down GEMM's K (I) is short, so a ticket's wait and
    pipeline fill are paid once per two tiles ("Down tickets of two column tiles"); at most
    ``wanted`` when given; the largest count up to that which divides the ``n_cols`` column tiles."""
    want = wanted if wanted is not None else (2 if I <= TWO_DOWN_COLS_MAX_I else 1)
    return max(c for c in range(1, min(want, n_cols) + 1) if n_cols % c == 0)


def group_m(n_slots: int, H: int, I: int) -> int:
    """Row tiles per group of the ticket order: 4 (the row tiles of an expert read each weight block
    together, once from HBM), 2 for small experts whose tickets are short ("Row-tile groups"); the
    largest of those that leaves at least two ring groups."""
    max_group = 2 if H * I <= GROUP_2_MAX_HI else 4
    return next((g for g in (4, 2, 1) if g <= max_group and n_slots % g == 0 and n_slots // g >= 2), 1)


def align_tiles(megakernel: bool, T: int, k: int, E_local: int, tile_m: int, groups: int) -> int:
    """Each expert's row tiles padded to a multiple of 2 where experts average few tiles and the
    ticket order groups row tiles, so an expert's tiles never straddle two groups and read its
    weights from HBM twice ("Expert alignment"); 1 otherwise and on the sync-free path."""
    if not megakernel:
        return 1
    few_tiles = T * k <= ALIGN_MAX_TILES * tile_m * E_local
    return 2 if groups >= 2 and few_tiles else 1


def pull_tokens(T: int, k: int, E: int, tile_m: int) -> bool:
    """The token pull where experts get many row tiles from each source rank: most tiles then hold
    one rank's rows, and this rank's tiles, handed out first, cover the copy ("Token pull")."""
    return T * k >= PULL_TOKENS_MIN_TILES * tile_m * E


def prefetch(n_groups: int) -> int:
    """Copies run half the ring ahead of gate/up ("Ring size")."""
    return n_groups // 2


def down_lag(n_groups: int, grid: int, comm_programs: int, group: int, fills: int, gate_ups: int,
             downs: int) -> int:
    """Down tickets handed out one group after the groups the grid works on at once, so the
    programs taking them rarely wait for their gate/up tiles ("Ring size")."""
    per_group = group * (fills + gate_ups + downs)
    return min(n_groups - 1, -(-(grid - comm_programs) // per_group) + 1)


def half_tiles(tile_m: int, interpret: bool) -> bool:
    """A row tile whose real rows fit in tile_m / 2 computed at half height: a dot needs 16 rows on
    the GPU ("Half tiles")."""
    return tile_m % 2 == 0 and (tile_m >= 32 or interpret)


def fill_cols(H: int) -> int:
    """Columns one copy step moves: FILL_COLS, or H rounded up to a power of two if narrower."""
    return min(FILL_COLS, triton.next_power_of_2(H))
