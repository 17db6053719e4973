"""Every choice the layer derives from its shape and the device: pure functions, one rule each.

Private to the library: ``plan.make_plan`` calls these where a ``Tuning`` field is ``None``. Each
rule says in one line why it holds; the measurements behind it are in docs/performance.md under
the heading named in its docstring (FP8: docs/fp8-measurements.md, "fp8-measurements: ..."). Shape
letters: T tokens per rank, H model width, I expert width, I_s shared-expert width, k experts per
token, E_local experts per rank, E all experts.
"""
from __future__ import annotations

import triton

from ..ops.gemm import bf16 as gemm
from ..ops.gemm.bf16 import GemmConfig
from ..ops.gemm.fp8 import CORE_TRITON, CORE_WS, Fp8Gemm
from ..validate import LAYOUT_NK

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


def gemm_config(kind: str, N: int, K: int, tile_m: int) -> GemmConfig:
    """The standalone bf16 GEMM kernels' tiles for ``kind`` (``gemm.KIND_GATE_UP``, ``KIND_DOWN``,
    ``KIND_DGRAD_SWIGLU``, ``KIND_GATE_UP_DGRAD``), output width N, depth K; routed row tiles are
    the schedule's (``tile_m``): 128 x 256 output tiles where N allows, 48 KB stages ("GEMM tiles")."""
    if kind == gemm.KIND_GATE_UP:  # two accumulators (g, u): A 128x64 + 2 x (128x64) B a stage, 3 stages 144 KB
        return GemmConfig(BM=tile_m, BN=128 if N > 64 else 64, BK=64, num_warps=8, num_stages=3, GROUP_M=8)
    if kind == gemm.KIND_DGRAD_SWIGLU:
        return GemmConfig(BM=tile_m, BN=128 if N > 64 else 64, BK=64, num_warps=8, num_stages=4, GROUP_M=8)
    if kind in (gemm.KIND_DOWN, gemm.KIND_GATE_UP_DGRAD):
        BN = 256 if N >= 256 else max(16, triton.next_power_of_2(N))
        return GemmConfig(BM=tile_m, BN=BN, BK=64, num_warps=8, num_stages=3 if BN == 256 else 4, GROUP_M=8)
    raise ValueError(f"unknown GEMM kind {kind!r}")


BF16_WS_ARCH = 90  # the warp-specialized kernels' wgmma and TMA: sm_90 only
# the kinds that run on the warp-specialized core, their tile width and ring depth: gate/up at
# 128 x 128 of h (g and u: 128 accumulator registers), down at 128 x 256 (a consumer's 64 x 256
# accumulator), both 4 stages; the down dgrad with its epilogue partition at 128 x 256 (dh_raw
# handed over in bf16: 64 KB beside 3 stages of 48 KB) where K = H is long enough to cover that
# partition's 256 columns (H100: 1.18-1.22x the 128-wide tile at H 6144-7168, 0.55-0.67x at H
# 2048-2880), else at 128 x 128 (the fp32 tile beside 4 stages of 32 KB). Only SwiGLU's and relu2's
# backward fit the wider tile's partition beside its 168-register consumers; the other kinds
# spill there (16-192 bytes: ptxas) and take the 128-wide tile. The gate/up dgrad stays on its
# Triton tiles ("Warp-specialized bf16 GEMMs", "Epilogue partitions")
BF16_WS_TILE_N = {gemm.KIND_GATE_UP: 128, gemm.KIND_DOWN: 256, gemm.KIND_DGRAD_SWIGLU: 256}
BF16_WS_STAGES = {gemm.KIND_GATE_UP: 4, gemm.KIND_DOWN: 4, gemm.KIND_DGRAD_SWIGLU: 3}
BF16_WS_DGRAD_NARROW = (128, 4)  # (tile width, stages)
BF16_WS_DGRAD_WIDE_MIN_K = 4096
BF16_WS_DGRAD_WIDE_ACTS = ("swiglu", "relu2")


def bf16_ws_possible(arch: int | None, tile_m: int, H: int, I: int, layout: str = LAYOUT_NK) -> bool:
    """The warp-specialized bf16 kernels run on sm_90 (not under the interpreter: ``arch`` None),
    with 128-row kernel tiles inside the schedule's and 16-byte rows for TMA (H, I multiples of 8);
    transposed weights with H and I multiples of 64 (their K blocks, rows of the weights, must not
    run into the next expert's)."""
    return (arch == BF16_WS_ARCH and tile_m % 128 == 0 and H % 8 == 0 and I % 8 == 0
            and (layout == LAYOUT_NK or (H % 64 == 0 and I % 64 == 0)))


def bf16_gemm(kind: str, N: int, K: int, tile_m: int, ws: bool, programs: int | None,
              act_kind: str = "swiglu") -> gemm.Bf16Gemm:
    """A routed bf16 GEMM's kernel: gate/up, down and the down dgrad on the warp-specialized core
    where it runs (faster than the Triton kernels: H100, gate/up 648-680 against 584-659 TFLOP/s,
    down 650-673 against 635-641; the down dgrad with its epilogue partition 1.05-1.24x the Triton
    kernel's), the gate/up dgrad on its Triton tiles ("Warp-specialized bf16 GEMMs", "Epilogue
    partitions")."""
    # (the down dgrad reads Wd [E, H, I] in K blocks of its rows: K = H a multiple of 64; the
    # transposed layouts' H already is, as the plan's ws demands)
    if not ws or kind not in BF16_WS_TILE_N or (kind == gemm.KIND_DGRAD_SWIGLU and K % 64):
        return gemm.Bf16Gemm(gemm.CORE_TRITON, gemm_config(kind, N, K, tile_m))
    tile_n, stages = BF16_WS_TILE_N[kind], BF16_WS_STAGES[kind]
    if kind == gemm.KIND_DGRAD_SWIGLU and (K < BF16_WS_DGRAD_WIDE_MIN_K or act_kind not in BF16_WS_DGRAD_WIDE_ACTS):
        tile_n, stages = BF16_WS_DGRAD_NARROW
    return gemm.Bf16Gemm(gemm.CORE_WS, GemmConfig(BM=tile_m, BN=tile_n, BK=64, num_warps=4, num_stages=stages,
                                                  GROUP_M=8), programs=programs)


def use_megakernel(precision: str, world_size: int, bf16_ws: bool) -> bool:
    """The forward's path where the config leaves it open: the megakernel where the precision has
    one (bf16), but at EP1 where the separate launches run the warp-specialized GEMMs: with nothing
    to exchange the megakernel hides nothing, and its GEMMs are the Triton tiles (one H100: separate
    launches 1.04-1.09x the megakernel's forward speed on three of four full shapes at EP1, 0.99x
    on qwen3.5-397b; 1.02-1.16x on the six @ep8 shares) ("Warp-specialized bf16 GEMMs")."""
    return precision == "bf16" and (world_size > 1 or not bf16_ws)


def wgrad_config(N: int) -> GemmConfig:
    """The bf16 weight gradients' tiles (output C[e] [M, N]; K is an expert's rows, so BK 32 at 4
    stages): 128 x 256 x 32 at 8 warps ("GEMM tiles", weight gradients)."""
    BN = 256 if N >= 256 else max(16, triton.next_power_of_2(N))
    return GemmConfig(BM=128, BN=BN, BK=32, num_warps=8, num_stages=4, GROUP_M=8)


# 48 KB a stage (performance.md, "Warp-specialized bf16 GEMMs": 3 stages faster at kimi-k2, slower at gpt-oss-120b)
BF16_WS_WGRAD_STAGES = 4


def wgrad_gemm(N: int, ws: bool, programs: int | None) -> gemm.Bf16Gemm:
    """The bf16 weight gradients' kernel: the warp-specialized one (128 x 256 tiles of C, K blocks
    of 64 rows) where it runs, else the Triton tiles of ``wgrad_config`` (the ws kernel 4-16% faster at the
    @ep8 shares measured: performance.md, "Warp-specialized bf16 GEMMs")."""
    if not ws:
        return gemm.Bf16Gemm(gemm.CORE_TRITON, wgrad_config(N))
    return gemm.Bf16Gemm(gemm.CORE_WS, GemmConfig(BM=128, BN=256, BK=64, num_warps=4, num_stages=BF16_WS_WGRAD_STAGES,
                                                  GROUP_M=8), programs=programs)


def wgrad_programs(sm_count: int | None) -> int:
    """The bf16 weight gradients' persistent grid: one program per SM ("GEMM tiles", "one program
    per SM"); under the interpreter (``sm_count`` None) 4, each walking several tiles."""
    return 4 if sm_count is None else sm_count


# ---- FP8 (docs/fp8-measurements.md; the kernels: ops/gemm/fp8.py, the warp-specialized ones fp8_ws.py)

FP8_WS_ARCH = 90  # the warp-specialized kernels' wgmma and TMA: sm_90 only
FP8_GATE_UP_TMA_BM = 64  # Triton gate/up's kernel tile with TMA: 128 rows spill (fp8-measurements: "The first run")
FP8_GATE_UP_TMA_STAGES = 5  # 40 KB a stage, 200 KB: the fastest measured ("The first run")
FP8_GATE_UP_PTR_STAGES = 3  # the pointer loop's 48 KB stages: 5 would not fit ("The first run")
FP8_WS_STAGES = 4  # the ws 128 x 128 ring (32 KB a stage); 5, 6 no faster ("The warp-specialized rows GEMM landed")
FP8_WS_GATE_UP_STAGES = 3  # the ws gate/up ring (48 KB a stage); 4 no faster ("Cached weight transposes")
FP8_WS_WGRAD_STAGES = 3  # each of the ws weight gradient's two rings ("The weight gradient as two pipelines")
FP8_WS_BT_LAG = 1  # a raw block transposed one producer step after its load; 2, 3 no faster ("The dgrads transposing")


def fp8_ws_possible(arch: int | None, tile_m: int, H: int, I: int) -> bool:
    """The warp-specialized FP8 kernels run on sm_90 (not under the interpreter: ``arch`` None),
    on routed tiles a multiple of their 128 rows, with 16-byte TMA row strides (H, I multiples of 16)."""
    return arch == FP8_WS_ARCH and tile_m % 128 == 0 and H % 16 == 0 and I % 16 == 0


def fp8_wide_stages(K: int) -> int:
    """The ws 128 x 256 rows kernel's ring (48 KB a stage): 4 where K is short (K 768: 670 against
    620 TFLOP/s at 3), 3 from K 1024 (K 2048: 1123 against 1020) ("Cached weight transposes")."""
    return 4 if K < 1024 else 3


def fp8_gate_up(H: int, tile_m: int, ws: bool, programs: int | None) -> Fp8Gemm:
    """Gate/up: the ws kernel (128 x 128 tiles of h, 3-stage ring) where it runs; else the Triton
    kernel through TMA at 64-row kernel tiles inside the schedule's (needs H a multiple of 16:
    16-byte rows), or its pointer loop at the schedule's tile (fp8-measurements: "The first run")."""
    if ws:
        return Fp8Gemm(CORE_WS, GemmConfig(BM=128, BN=128, BK=128, num_warps=4, num_stages=FP8_WS_GATE_UP_STAGES,
                                           GROUP_M=8), programs=programs)
    tma = H % 16 == 0
    BM = FP8_GATE_UP_TMA_BM if tma and tile_m % FP8_GATE_UP_TMA_BM == 0 else tile_m
    return Fp8Gemm(CORE_TRITON, GemmConfig(BM=BM, BN=128, BK=128, num_warps=8, GROUP_M=8 * (tile_m // BM),
                                           num_stages=FP8_GATE_UP_TMA_STAGES if tma else FP8_GATE_UP_PTR_STAGES),
                   tma=tma)


def fp8_rows(N: int, K: int, tile_m: int, ws: bool, programs: int | None) -> Fp8Gemm:
    """The rows GEMM (the forward's down, the gate/up dgrad from held or made transposes): the ws
    kernel at 128 x 256 tiles ("Cached weight transposes"); else Triton's 128 x 128 at 8 warps, 4
    stages: K runs many blocks, two warpgroups on a tile feed more MMAs a load ("The first run")."""
    if ws:
        return Fp8Gemm(CORE_WS, GemmConfig(BM=128, BN=256, BK=128, num_warps=4, num_stages=fp8_wide_stages(K),
                                           GROUP_M=8), programs=programs)
    BN = 128 if N >= 128 else max(16, triton.next_power_of_2(N))
    return Fp8Gemm(CORE_TRITON, GemmConfig(BM=tile_m, BN=BN, BK=128, num_warps=8, num_stages=4, GROUP_M=8))


def fp8_down_dgrad(tile_m: int, ws: bool, programs: int | None, in_kernel: bool = False) -> Fp8Gemm:
    """The down dgrad (SwiGLU backward in the epilogue, 128 columns of I a tile): the ws kernel at
    128 x 128 (at 128 x 256 the epilogue spills), a 4-stage ring ("The warp-specialized rows GEMM
    landed"); ``in_kernel``: its B blocks transposed by the producer, lag 1 ("The dgrads
    transposing"); else Triton's rows loop at 4 stages ("The first run")."""
    if ws:
        return Fp8Gemm(CORE_WS, GemmConfig(BM=128, BN=128, BK=128, num_warps=4, num_stages=FP8_WS_STAGES, GROUP_M=8),
                       lag=FP8_WS_BT_LAG if in_kernel else 0, programs=programs)
    return Fp8Gemm(CORE_TRITON, GemmConfig(BM=tile_m, BN=128, BK=128, num_warps=8, num_stages=4, GROUP_M=8))


def fp8_gate_up_dgrad(H: int, K: int, tile_m: int, ws: bool, programs: int | None, in_kernel: bool) -> Fp8Gemm:
    """The gate/up dgrad (K = 2Ip): the rows GEMM's (``fp8_rows``), or reading the forward's copies
    transposed in the kernel (``in_kernel``): the ws kernel at 128 x 128, a 4-stage ring, lag 1
    ("The dgrads transposing")."""
    if in_kernel:
        return Fp8Gemm(CORE_WS, GemmConfig(BM=128, BN=128, BK=128, num_warps=4, num_stages=FP8_WS_STAGES, GROUP_M=8),
                       lag=FP8_WS_BT_LAG, programs=programs)
    return fp8_rows(H, K, tile_m, ws, programs)


def fp8_wgrad(ws: bool, programs: int | None) -> Fp8Gemm:
    """The padded weight gradients: the ws kernel's two pipelines of 128 x 128 tiles, 3-stage rings
    ("The weight gradient as two pipelines"); else Triton's 128 x 64 at 4 warps, 3 stages: K is an
    expert's few blocks, two programs an SM hide each other's fill and store ("Weight-gradient tiles")."""
    if ws:
        return Fp8Gemm(CORE_WS, GemmConfig(BM=128, BN=128, BK=128, num_warps=4, num_stages=FP8_WS_WGRAD_STAGES,
                                           GROUP_M=8), programs=programs)
    return Fp8Gemm(CORE_TRITON, GemmConfig(BM=128, BN=64, BK=128, num_warps=4, num_stages=3, GROUP_M=8))


def fp8_dgrad(cache_transposes: bool, ws: bool) -> str:
    """Where the dgrads read the weights transposed: the held transposes where the config holds
    them; else the forward's copies transposed in the kernel on sm_90 (0.6-0.7x the held copies'
    speed, faster than making them), else transposes made per backward ("deepseek-v4-pro's experts
    where the transposes fit", "The dgrads transposing")."""
    if cache_transposes:
        return "cached_transposes"
    return "transpose_in_kernel" if ws else "transpose_per_call"


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
