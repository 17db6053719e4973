"""Configuration of the Tabby layer."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class MoEConfig:
    """Knobs of the Tabby layer. The defaults are meant to be good without tuning.

    tile_m:          rows per tile of the routed buffer; each expert's segment is padded to it.
    pull_rows/cols:  the block one dispatch program copies per step (rows x columns).
    comm_programs:   programs of the pull-dispatch launch.
    max_wait_ms:     GPU time a spin-wait may take before it gives up and records an error (never
                     hang). Generous, because a peer may start late (its first call compiles kernels).
                     Also TABBY_MAX_WAIT_MS.
    max_wait_iters:  the same bound under the CPU interpreter, which has no clock: polls.
    debug:           check the device error record after every pass (a host sync). Also TABBY_DEBUG=1.
    megakernel:      forward through ONE persistent launch (ops/megakernel_fwd.py: pull dispatch into a
                     ring, gate/up, down + push, shared expert; tile-level counters) instead of the
                     dispatch / gate_up / down_push launches; the backward then recomputes xs and g, u.
                     Off by default until measured on a GPU.
    ring_rows:       rows of the megakernel's ring (xs and h); ring_rows // tile_m slots, at least 2.
                     2048 = 16 slots of 128 rows: with 132 programs and, on qwen3-30b-a3b, 6 gate/up +
                     8 down column tiles per row tile, about 10 row tiles are in flight at once; the rest
                     lets the pull run ahead. Costs ring_rows * (H + I) * 2 bytes (11.5 MB there).
    fwd_comm_programs: programs of the megakernel that only pull rows (0: fills are tickets of the
                     compute order, taken by any program).
    fwd_programs:    the megakernel's persistent grid (None: the device's SM count; 3 on the CPU).
    fwd_prefetch:    merged mode: fills run this many row tiles ahead of gate/up in the ticket order,
                     in [0, ring slots) (None: half the slots).
    fwd_ablate:      measurement only (`tabby tune`), makes the output WRONG: 1 skips the megakernel's
                     row copies, 2 its routed GEMM math (waits and signals stay).
    """

    tile_m: int = 128
    pull_rows: int = 32
    pull_cols: int = 512
    comm_programs: int = 132
    max_wait_ms: float = float(os.environ.get("TABBY_MAX_WAIT_MS", 60_000))
    max_wait_iters: int = int(os.environ.get("TABBY_MAX_WAIT_ITERS", 1 << 24))
    debug: bool = os.environ.get("TABBY_DEBUG", "0") == "1"
    megakernel: bool = False
    ring_rows: int = 2048
    fwd_comm_programs: int = 0
    fwd_programs: int | None = None
    fwd_prefetch: int | None = None
    fwd_ablate: int = 0

    def wait_budget(self) -> int:
        """The budget argument of the kernels' bounded waits (``ops.sync.wait_geq``)."""
        from ..ops import INTERPRET

        return self.max_wait_iters if INTERPRET else int(self.max_wait_ms * 1e6)
