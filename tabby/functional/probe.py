"""Measurement hooks for the tools (``tabby_bench``): an explicit argument of
``tabby.functional.moe.moe_with_probe``, never part of ``MoEConfig`` and never a global."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Probe:
    """stage_timer:  an object with ``mark(name)``, called at the boundaries of each pass's stages
                  (``tabby profile``).
    trace_events: the megakernel records up to this many tickets per program (kind and cycle stamps;
                  layout ``tabby.ops.megakernel.protocol.TRACE_HEAD``) into ``trace`` (0: off).
    ablate:       the megakernel skips work, for measurement only: the output is then WRONG. Bit 1
                  skips the row copies, 2 the routed GEMM math, 4 pushes every row to this rank's
                  own buffer; every wait and signal stays.
    trace, plan:  set by the call: the trace tensor (int64 [programs, TRACE_HEAD + 4 * events]) and
                  the ``Plan`` the call ran with.
    """

    stage_timer: object | None = None
    trace_events: int = 0
    ablate: int = 0
    trace: torch.Tensor | None = None
    plan: object | None = None


def mark(probe: Probe | None, name: str) -> None:
    """``probe.mark(name)`` when there is a probe."""
    if probe is not None and probe.stage_timer is not None:
        probe.stage_timer.mark(name)
