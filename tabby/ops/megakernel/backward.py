"""The backward megakernel: the dy pull, the down dgrad with the SwiGLU backward, the gate/up
dgrad with its dx push, the router-weight gradient and the three weight gradients in ONE
persistent launch, its tasks ordered by counters in GPU memory at tile granularity.

It replaces the launches between the backward's publish (dy published, every peer's BWD_READY
waited for) and its finish (BWD_DONE, the combine of dx), which stay as they are. Its operands
are the sync-free backward's (``gemm.py``'s layout contract): the routed rows xs [R, H], g | u
[R, 2I] and the rows' router weights, kept by the forward or recomputed before the launch; the
buffers it writes are full-size (dys [R, H], dgu [R, 2I], hw [R, I]), as the sync-free backward's.

Tasks and the counters that order them (int32, zeroed before the launch; ``bwd_counter_layout``)::

    fill(i, part)    copies R/FS dy rows of row tile i from their origins     signals filled[i]
    dgrad(i, n)      dh column tile n of row tile i: dys @ Wd[e], SwiGLU       waits filled[i] >= FS
                     backward, dgu, hw, router-weight partials                 signals dg_done[i], ex_done[e]
    xgrad(i, n)      dx column tile n of row tile i: dg @ Wg[e] + du @ Wu[e],  waits dg_done[i] >= NI
                     rows pushed to their origins; n = 0 also reduces and
                     pushes the tile's router-weight gradients
    wgrad(e, tile)   one output tile of dW_down[e] = dys^T hw, then of         waits ex_done[e] >=
                     dW_gate[e] = dg^T xs and dW_up[e] = du^T xs                NI * cdiv(rows of e, BM)

Ticket order: one global sequence in which every producer precedes its consumers. The row tiles
go in groups of GM; stage s = 0, 1, .. holds [fills of group s] [dgrads of group s - P] [xgrads
of group s - P - L] (the last two column-major: column tile outer, the group's row tiles inner,
so that the row tiles of one expert read a weight block at about the same time), a group outside
[0, NG) giving empty tickets; then every wgrad ticket, expert by expert. Programs take tickets
from one atomic counter, so a program only ever waits on a ticket already taken by a running
program: deadlock-free, even when not every program of the grid is resident. Under the
interpreter the programs run one after another: program 0 takes every ticket, in order.

An expert's weight gradients are each computed by one program per output tile over the expert's
rows in row order: the same fixed order as the standalone ``gemm.expert_wgrad``, whatever the
timing, so the results are bitwise those of the sync-free backward with the same tiles.

Only the row tiles of the schedule's rows are worked on (``i < num_tiles``): tickets past them
are empty and nothing waits for them. ``ex_done[e]`` counts the dgrad tickets of the tiles with
``tile_expert[i] == e``: tiles holding at least one real row of e (a tile of padding rows only has
-1), cdiv(rows of e, BM) of them.

Memory ordering: as the forward megakernel (``kernel.py``): a wait is an acquire poll
(``sync.wait_geq``, scope gpu) then a CTA barrier; a signal a CTA barrier after the task's stores
then a release add. The wgrad tickets read dys (filled before the dgrad they wait for) through the
chain fill -> release -> acquire (dgrad) -> release -> acquire (wgrad), which orders them
(release/acquire is cumulative). The pushed dx rows and router-weight gradients are published to
the peers by the BWD_DONE signal after the launch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import INTERPRET, comm, gemm, sync
from ..gemm import GemmConfig

_ERR_WAIT_TILE = tl.constexpr(sync.ERR_WAIT_TILE)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class BwdPlan:
    """Every choice one backward-megakernel launch makes, fixed before it."""

    H: int
    I: int
    tile_m: int  # the schedule's row-tile height (the dgrad / xgrad tiles' BM)
    group_m: int  # row tiles per group of the ticket order
    prefetch: int  # groups the fills run ahead of the dgrads (P >= 0)
    xgrad_lag: int  # groups the xgrads run behind the dgrads (L >= 1)
    fill_split: int  # fill tickets per row tile (tile_m // fill_split rows each, a power of two)
    fill_cols: int  # columns one fill step copies (a power of two >= 8)
    programs: int  # the persistent grid
    num_warps: int
    num_stages: int  # software-pipeline depth of every K loop of the launch
    dgrad: GemmConfig  # down dgrad + SwiGLU backward tiles (BM = tile_m)
    xgrad: GemmConfig  # gate/up dgrad + push tiles (BM = tile_m)
    wgrad_down: GemmConfig  # dW_down output tiles (BM x BN, BK rows per step)
    wgrad_gate_up: GemmConfig  # dW_gate and dW_up output tiles (same BM and BK as wgrad_down)

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"Tuning({field}=...): {why}")

        rows = self.tile_m // max(self.fill_split, 1)
        if self.fill_split < 1 or self.tile_m % self.fill_split or rows & (rows - 1):
            bad("fill_split", f"{self.fill_split} must divide tile_m={self.tile_m} into a power-of-two number of rows")
        if self.fill_cols < 8 or self.fill_cols & (self.fill_cols - 1):
            bad("fill_cols", f"{self.fill_cols} must be a power of two >= 8")
        if self.group_m < 1:
            bad("group_m", f"{self.group_m} must be >= 1")
        if self.prefetch < 0 or self.xgrad_lag < 1:
            bad("prefetch", f"prefetch {self.prefetch} must be >= 0 and the xgrad lag {self.xgrad_lag} >= 1")
        if self.dgrad.BM != self.tile_m or self.xgrad.BM != self.tile_m:
            bad("tile_m", "the dgrad and xgrad tiles must be tile_m rows high")
        if (self.wgrad_down.BM, self.wgrad_down.BK) != (self.wgrad_gate_up.BM, self.wgrad_gate_up.BK):
            bad("wgrad", "the weight gradients' tiles must share BM and BK")
        if self.programs < 1 or self.num_warps not in (4, 8):
            bad("programs", f"programs={self.programs} must be >= 1 and num_warps={self.num_warps} 4 or 8")


@dataclass(frozen=True)
class BwdCounters:
    """Indices into the launch's counter array."""

    ticket: int
    filled: int  # [n_tiles]
    dg_done: int  # [n_tiles]
    ex_done: int  # [E_local]
    total: int


def bwd_counter_layout(n_tiles: int, E_local: int) -> BwdCounters:
    return BwdCounters(ticket=0, filled=1, dg_done=1 + n_tiles, ex_done=1 + 2 * n_tiles,
                       total=1 + 2 * n_tiles + E_local)


@dataclass(frozen=True)
class BwdOrder:
    """The ticket counts of a launch (``ticket_order_host`` lists the sequence)."""

    n_tiles: int  # NM: the schedule's most row tiles
    n_groups: int  # NG = cdiv(NM, GM)
    fills: int  # SF = GM * FS per stage
    dgrads: int  # SD = GM * NI
    xgrads: int  # SX = GM * NX
    stages: int  # NG + P + L
    wgrad_down: int  # output tiles of dW_down [H, I]
    wgrad_gate: int  # output tiles of dW_gate [I, H] (and as many of dW_up)

    @property
    def routed(self) -> int:
        return self.stages * (self.fills + self.dgrads + self.xgrads)

    def per_expert(self) -> int:
        return self.wgrad_down + 2 * self.wgrad_gate


def bwd_order(plan: BwdPlan, n_tiles: int) -> BwdOrder:
    GM, H, I = plan.group_m, plan.H, plan.I
    NG = _cdiv(n_tiles, GM)
    wd, wg = plan.wgrad_down, plan.wgrad_gate_up
    return BwdOrder(n_tiles=n_tiles, n_groups=NG, fills=GM * plan.fill_split, dgrads=GM * _cdiv(I, plan.dgrad.BN),
                    xgrads=GM * _cdiv(H, plan.xgrad.BN), stages=NG + plan.prefetch + plan.xgrad_lag,
                    wgrad_down=_cdiv(H, wd.BM) * _cdiv(I, wd.BN), wgrad_gate=_cdiv(I, wg.BM) * _cdiv(H, wg.BN))


def ticket_order_host(plan: BwdPlan, n_tiles: int, E_local: int) -> list:
    """The launch's ticket sequence in Python: (kind, a, b) per ticket, kind one of "fill" (tile,
    part), "dgrad" / "xgrad" (tile, column tile), "wgrad" (expert, tile of the expert's three
    gradients), "empty"; the tests check the kernel's decode and the order's invariants on it."""
    o = bwd_order(plan, n_tiles)
    GM, FS, P, L = plan.group_m, plan.fill_split, plan.prefetch, plan.xgrad_lag
    seq = []
    for s in range(o.stages):
        for r in range(o.fills):
            i = s * GM + r // FS
            seq.append(("fill", i, r % FS) if s < o.n_groups and i < n_tiles else ("empty", 0, 0))
        for kind, g, count in (("dgrad", s - P, o.dgrads), ("xgrad", s - P - L, o.xgrads)):
            for r in range(count):
                i = g * GM + r % GM
                seq.append((kind, i, r // GM) if 0 <= g < o.n_groups and i < n_tiles else ("empty", 0, 0))
    for e in range(E_local):
        seq.extend(("wgrad", e, j) for j in range(o.per_expert()))
    return seq


@triton.jit
def _router_grad_push(i, dwp, stride_dwp, row_src, dw_ptrs, TK, NI, BM: tl.constexpr, NI_P2: tl.constexpr):
    """Row tile i's router-weight gradients (the sum of its NI partials, ``gemm.reduce_dw_tile``'s
    fixed-shape reduction) pushed to their origins: ``dw_of(src)[t*k + kk]``; padding rows skipped."""
    rows = i * BM + tl.arange(0, BM)
    cols = tl.arange(0, NI_P2)
    x = tl.load(dwp + rows[:, None] * stride_dwp + cols[None, :], mask=(cols < NI)[None, :], other=0.0)
    v = tl.sum(x, axis=1)
    rs = tl.load(row_src + rows)
    valid = rs >= 0
    base = tl.load(dw_ptrs + tl.where(valid, rs // TK, 0)).to(tl.pointer_type(tl.float32))
    tl.store(base + tl.where(valid, rs % TK, 0), v, mask=valid)


@triton.jit
def _wait(counters, idx, target, wait_budget, err, rank, epoch):
    sync.wait_geq(counters + idx, target, budget=wait_budget, err_ptr=err, code=_ERR_WAIT_TILE, rank=rank,
                  index=idx, epoch=epoch, SCOPE="gpu")
    tl.debug_barrier()


@triton.jit
def moe_bwd_megakernel(
        counters, err, epoch_ptr, rank, wait_budget,
        row_src, tile_expert, num_tiles_ptr, expert_count, expert_start, TK, k, W,
        dy_ptrs, dys, xs, stride_xs, gu, row_w, dgu, hw, dwp, stride_dwp,
        w_gate, w_up, stride_wg, stride_wu, stride_wi, w_down, stride_wde, stride_wdh,
        dx_ptrs, dw_ptrs, dw_gate, dw_up, dw_down,
        NM, E_local,
        H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, GM: tl.constexpr, FS: tl.constexpr,
        P: tl.constexpr, L: tl.constexpr, BH: tl.constexpr, WP: tl.constexpr,
        BN_D: tl.constexpr, BK_D: tl.constexpr, BN_X: tl.constexpr, BK_X: tl.constexpr,
        BM_W: tl.constexpr, BN_WD: tl.constexpr, BN_WG: tl.constexpr, BK_W: tl.constexpr, NI_P2: tl.constexpr,
        INTERPRET: tl.constexpr):
    NI: tl.constexpr = (I + BN_D - 1) // BN_D
    NX: tl.constexpr = (H + BN_X - 1) // BN_X
    SF: tl.constexpr = GM * FS
    SD: tl.constexpr = GM * NI
    SX: tl.constexpr = GM * NX
    SS: tl.constexpr = SF + SD + SX
    NN_D: tl.constexpr = (I + BN_WD - 1) // BN_WD
    NN_G: tl.constexpr = (H + BN_WG - 1) // BN_WG
    WD: tl.constexpr = ((H + BM_W - 1) // BM_W) * NN_D  # tiles of dW_down [H, I]
    WG: tl.constexpr = ((I + BM_W - 1) // BM_W) * NN_G  # of dW_gate [I, H], as many of dW_up
    PER_E: tl.constexpr = WD + 2 * WG
    C_FILLED = 1
    C_DG = 1 + NM
    C_EX = 1 + 2 * NM
    NG = (NM + GM - 1) // GM
    routed = (NG + P + L) * SS
    total = routed + E_local * PER_E
    num_tiles = tl.load(num_tiles_ptr)
    epoch = tl.load(epoch_ptr)
    t = tl.atomic_add(counters, 1, sem="relaxed", scope="gpu")
    while t < total:
        if t < routed:
            s = t // SS
            r = t % SS
            if r < SF:  # fill(i, part)
                i = s * GM + r // FS
                if (s < NG) & (i < num_tiles):
                    part = r % FS
                    comm.pull_rows_tile(tile=i * FS + part, row_src=row_src, src_ptrs=dy_ptrs, dst=dys, H=H, TK=TK,
                                        k=k, w_ptrs=dy_ptrs, ws_out=row_w, BR=BM // FS, BH=BH, WITH_WEIGHTS=False,
                                        ROWS_16B=(H % 8) == 0, STAGES=1, W=W, WP=WP)
                    sync.add_release(counters + C_FILLED + i, 1, "gpu")
            elif r < SF + SD:  # dgrad(i, n)
                g = s - P
                r2 = r - SF
                i = g * GM + r2 % GM
                if (g >= 0) & (g < NG) & (i < num_tiles):
                    _wait(counters, C_FILLED + i, FS, wait_budget, err, rank, epoch)
                    gemm.down_dgrad_swiglu_tile(i, r2 // GM, dys, H, w_down, stride_wde, stride_wdh, gu, 2 * I, row_w,
                                                dgu, 2 * I, hw, I, dwp, stride_dwp, tile_expert, num_tiles_ptr,
                                                H=H, I=I, BM=BM, BN=BN_D, BK=BK_D, EVEN_K=(H % BK_D) == 0,
                                                EPI_SPLIT=BN_D >= 32, INTERPRET=INTERPRET)
                    e = tl.load(tile_expert + i)
                    tl.debug_barrier()
                    tl.atomic_add(counters + C_DG + i, 1, sem="release", scope="gpu")
                    if e >= 0:
                        tl.atomic_add(counters + C_EX + e, 1, sem="release", scope="gpu")
            else:  # xgrad(i, n)
                g = s - P - L
                r3 = r - SF - SD
                i = g * GM + r3 % GM
                if (g >= 0) & (g < NG) & (i < num_tiles):
                    n = r3 // GM
                    _wait(counters, C_DG + i, NI, wait_budget, err, rank, epoch)
                    gemm.rows_gemm_tile(pid_m=i, pid_n=n, a_desc=None, b_desc=None, a_ptr=dgu, a2_ptr=dgu + I,
                                        stride_am=2 * I, b_ptr=w_gate, b2_ptr=w_up, stride_be=stride_wg,
                                        stride_be2=stride_wu, stride_bo=stride_wi, c_ptr=dgu, stride_cm=0, row_src_ptr=row_src,
                                        dst_ptrs_ptr=dx_ptrs, TK=TK, stride_dm=H, tile_expert_ptr=tile_expert,
                                        num_tiles_ptr=num_tiles_ptr, N=H, K=I, K2=I, BM=BM, BN=BN_X, BK=BK_X,
                                        B_NK=False, TWO_PHASE=True, EVEN_K=(I % BK_X) == 0, PUSH=True,
                                        DST_DTYPE=tl.bfloat16, USE_TMA=False, INTERPRET=INTERPRET)
                    if n == 0:
                        _router_grad_push(i, dwp, stride_dwp, row_src, dw_ptrs, TK, NI, BM, NI_P2)
        else:  # wgrad(e, j)
            w = t - routed
            e = w // PER_E
            j = w % PER_E
            cnt = tl.load(expert_count + e)
            _wait(counters, C_EX + e, NI * ((cnt + BM - 1) // BM), wait_budget, err, rank, epoch)
            if j < WD:
                gemm.expert_wgrad_tile(e, j // NN_D, j % NN_D, dys, H, hw, I, dw_down, H * I, I, expert_start,
                                       expert_count, M=H, N=I, BM=BM_W, BN=BN_WD, BK=BK_W, INTERPRET=INTERPRET)
            else:
                j2 = (j - WD) % WG
                if j - WD < WG:
                    gemm.expert_wgrad_tile(e, j2 // NN_G, j2 % NN_G, dgu, 2 * I, xs, stride_xs, dw_gate, I * H, H,
                                           expert_start, expert_count, M=I, N=H, BM=BM_W, BN=BN_WG, BK=BK_W,
                                           INTERPRET=INTERPRET)
                else:
                    gemm.expert_wgrad_tile(e, j2 // NN_G, j2 % NN_G, dgu + I, 2 * I, xs, stride_xs, dw_up, I * H, H,
                                           expert_start, expert_count, M=I, N=H, BM=BM_W, BN=BN_WG, BK=BK_W,
                                           INTERPRET=INTERPRET)
        t = tl.atomic_add(counters, 1, sem="relaxed", scope="gpu")


def launch_backward(plan: BwdPlan, sched, *, dy_ptrs, xs, gu, row_w, w_gate, w_up, w_down, dx_ptrs, dw_ptrs,
                    TK: int, k: int, world_size: int, err, epoch, rank: int, wait_budget: int):
    """One rank's backward megakernel. ``sched``: the forward's ``ScheduleBuffers``; ``dy_ptrs`` /
    ``dx_ptrs`` / ``dw_ptrs``: int64 [W] addresses of every rank's dy_pub [T, H], dx_in [T*k, H] and
    dw_in [T*k] (published and waited for by the caller); ``xs`` [R, H] the routed rows, ``gu`` [R, 2I]
    g | u and ``row_w`` fp32 [R] the rows' router weights, as the forward kept them (or recomputed).
    Returns (dw_gate, dw_up, dw_down): the weight gradients; dx rows and router-weight gradients
    are pushed."""
    E_local, I, H = w_gate.shape
    R = sched.R_max
    BM = plan.tile_m
    if sched.BM != BM or R % BM:
        raise ValueError(f"the schedule's row tiles ({sched.BM}) are not the plan's tile_m ({BM})")
    for name, t, shape in (("xs", xs, (R, H)), ("gu", gu, (R, 2 * I)), ("row_w", row_w, (R,))):
        if tuple(t.shape) != shape:
            raise ValueError(f"backward megakernel: {name} has shape {tuple(t.shape)}, expected {shape}")
    if not gu.is_contiguous() or row_w.dtype != torch.float32 or xs.stride(1) != 1:
        raise ValueError("backward megakernel: gu must be contiguous, row_w fp32, xs of unit column stride")
    if w_up.shape != w_gate.shape or tuple(w_down.shape) != (E_local, H, I) or \
            any(w.stride(2) != 1 for w in (w_gate, w_up, w_down)) or w_up.stride(1) != w_gate.stride(1):
        raise ValueError("backward megakernel: weights [E, I, H] (w_gate and w_up of one row stride) and "
                         "[E, H, I], each of unit column stride")
    NM = R // BM
    lay = bwd_counter_layout(NM, E_local)
    dev = gu.device
    # one guard word before the counters, always 0 (as the forward megakernel's)
    counters = torch.zeros(lay.total + 1, dtype=torch.int32, device=dev)[1:]
    dys = gu.new_empty((R, H))
    dgu = gu.new_empty((R, 2 * I))
    hw = gu.new_empty((R, I))
    NI = _cdiv(I, plan.dgrad.BN)
    dwp = torch.empty(R, NI, dtype=torch.float32, device=dev)
    dw_gate = torch.empty(w_gate.shape, dtype=w_gate.dtype, device=dev)
    dw_up = torch.empty(w_up.shape, dtype=w_up.dtype, device=dev)
    dw_down = torch.empty(w_down.shape, dtype=w_down.dtype, device=dev)
    moe_bwd_megakernel[(plan.programs,)](
        counters, err, epoch, rank, wait_budget,
        sched.row_src, sched.tile_expert, sched.num_tiles, sched.expert_count, sched.expert_start, TK, k, world_size,
        dy_ptrs, dys, xs, xs.stride(0), gu, row_w, dgu, hw, dwp, dwp.stride(0),
        w_gate, w_up, w_gate.stride(0), w_up.stride(0), w_gate.stride(1), w_down, w_down.stride(0),
        w_down.stride(1), dx_ptrs, dw_ptrs, dw_gate, dw_up, dw_down,
        NM, E_local,
        H=H, I=I, BM=BM, GM=plan.group_m, FS=plan.fill_split, P=plan.prefetch, L=plan.xgrad_lag,
        BH=plan.fill_cols, WP=max(2, triton.next_power_of_2(world_size)),
        BN_D=plan.dgrad.BN, BK_D=plan.dgrad.BK, BN_X=plan.xgrad.BN, BK_X=plan.xgrad.BK,
        BM_W=plan.wgrad_down.BM, BN_WD=plan.wgrad_down.BN, BN_WG=plan.wgrad_gate_up.BN,
        BK_W=plan.wgrad_down.BK, NI_P2=max(2, triton.next_power_of_2(NI)),
        INTERPRET=INTERPRET, num_warps=plan.num_warps, num_stages=plan.num_stages)
    return dw_gate, dw_up, dw_down
