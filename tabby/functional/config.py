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
    max_wait_iters:  polls before a spin-wait gives up and records an error (never hang).
    debug:           check the device error record after every pass (a host sync). Also TABBY_DEBUG=1.
    """

    tile_m: int = 128
    pull_rows: int = 32
    pull_cols: int = 512
    comm_programs: int = 132
    max_wait_iters: int = int(os.environ.get("TABBY_MAX_WAIT_ITERS", 1 << 24))
    debug: bool = os.environ.get("TABBY_DEBUG", "0") == "1"
