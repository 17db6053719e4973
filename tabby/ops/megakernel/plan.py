"""``MegaPlan``: every choice one forward-megakernel launch makes, fixed before the launch.

``tabby.functional.plan.make_plan`` builds it once per layer shape (from the heuristics and the
user's ``Tuning``); the launcher takes it as it is and switches nothing off. An impossible
combination is refused here, when the plan is made, with the ``Tuning`` field at fault named.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...activation import SWIGLU, Activation
from ..gemm.bf16 import GemmConfig


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class MegaPlan:
    H: int  # model width
    I: int  # routed expert width
    I_s: int  # shared expert width (0: none)
    tile_m: int  # rows per routed row tile: the schedule's tile height
    n_slots: int  # ring slots of tile_m rows
    group_m: int  # row tiles per group of the ticket order (divides n_slots into >= 2 groups)
    prefetch: int  # groups the fills run ahead of gate/up, in [0, n_groups)
    down_lag: int  # groups the down tiles run behind gate/up, in [1, n_groups)
    fill_split: int  # fill tickets per row tile, tile_m // fill_split rows each (a power of two)
    fill_cols: int  # columns one fill step copies (a power of two >= 8)
    fill_stages: int  # pipeline stages of a fill's column loop (1: none)
    programs: int  # the persistent grid
    comm_programs: int  # programs that only fill (0: fills are tickets of the compute order)
    num_warps: int  # warps per program: 4 (two programs per SM) or 8
    num_stages: int  # software-pipeline depth of the GEMM K loops
    gate_up: GemmConfig  # routed gate/up tiles (BM = tile_m)
    down: GemmConfig  # routed down tiles (BM = tile_m)
    shared_gate_up: GemmConfig | None  # shared-expert tiles (None without a shared expert)
    shared_down: GemmConfig | None
    down_cols: int  # column tiles per down ticket (divides the down column tiles)
    tma: bool  # GEMM operands through tensor descriptors
    half_tiles: bool  # a row tile whose real rows fit in tile_m / 2 is computed at half height
    local_rows: bool  # gate/up reads this rank's rows from x; fills copy only the peers' (needs tma)
    token_pull: bool  # a copy engine pulls every peer's x whole beside the kernel; no fills
    activation: Activation = SWIGLU  # the routed experts' (the shared expert's is SwiGLU)

    @property
    def n_groups(self) -> int:
        return self.n_slots // self.group_m

    @property
    def ring_rows(self) -> int:
        return self.n_slots * self.tile_m

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"Tuning({field}=...): {why}")

        if self.n_slots < 2:
            bad("ring_rows", f"the forward megakernel needs at least two ring slots of tile_m={self.tile_m} rows, "
                             f"got {self.n_slots}")
        if self.group_m < 1 or self.n_slots % self.group_m or self.n_slots // self.group_m < 2:
            bad("group_m", f"{self.group_m} must divide the {self.n_slots} ring slots into at least two groups")
        if not 0 <= self.prefetch < self.n_groups:
            bad("prefetch", f"{self.prefetch} must be in [0, ring groups={self.n_groups})")
        if not 1 <= self.down_lag < self.n_groups:
            bad("down_lag", f"{self.down_lag} must be in [1, ring groups={self.n_groups}): gate/up of a group waits "
                            f"for the downs of the group {self.n_groups} earlier, which must come first in the order")
        rows = self.tile_m // max(self.fill_split, 1)
        if self.fill_split < 1 or self.tile_m % self.fill_split or rows & (rows - 1):
            bad("fill_split", f"{self.fill_split} must divide tile_m={self.tile_m} into a power-of-two number of rows")
        if self.fill_cols < 8 or self.fill_cols & (self.fill_cols - 1):
            bad("fill_cols", f"{self.fill_cols} must be a power of two >= 8")
        if self.fill_stages < 1:
            bad("fill_stages", f"{self.fill_stages} must be >= 1")
        if self.num_warps not in (4, 8):
            bad("num_warps", f"{self.num_warps} must be 4 or 8 (one or two warpgroups)")
        if not 0 <= self.comm_programs < self.programs:
            bad("comm_programs", f"{self.comm_programs} must be in [0, programs={self.programs})")
        if self.gate_up.BM != self.tile_m or self.down.BM != self.tile_m:
            bad("tile_m", "the routed GEMM tiles must be tile_m rows high")
        if (self.I_s > 0) != (self.shared_gate_up is not None and self.shared_down is not None):
            raise ValueError("MegaPlan: shared-expert tiles exactly when there is a shared expert")
        n_cols = _cdiv(self.H, self.down.BN)
        if self.down_cols < 1 or n_cols % self.down_cols:
            bad("down_cols", f"{self.down_cols} must divide the {n_cols} down column tiles of a row tile")
        if self.local_rows and not (self.tma and self.H % 8 == 0):
            bad("local_rows", "gate/up gathers this rank's rows through pointers beside TMA weight loads: it needs "
                              "tma=True and H % 8 == 0")
        if self.token_pull and not (self.local_rows and self.comm_programs == 0):
            bad("pull_tokens", "the token pull gathers every A row like local_rows: it needs local_rows (tma, "
                               "H % 8 == 0) and comm_programs=0")
