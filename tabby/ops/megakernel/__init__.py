"""The forward megakernel: dispatch, gate/up + SwiGLU, down + push and the shared expert in one
persistent launch (``kernel.py`` describes the ring and its protocol).

    plan.py      MegaPlan: every choice of a launch, fixed before it
    protocol.py  counter layout, ticket order, waits and signals (pure functions, host mirrors)
    tasks.py     what one ticket does: fill, routed gate/up or down, shared expert
    kernel.py    the kernel and its argument tuples
    host.py      per-rank buffers and the launcher
"""
from .host import Kept, MegaBuffers, MegaProbe, Peers, alloc, kernel_consts, launch
from .plan import MegaPlan
from .protocol import TRACE_HEAD, TRACE_KINDS, CounterLayout, counter_layout

__all__ = ["MegaPlan", "MegaBuffers", "MegaProbe", "Peers", "Kept", "alloc", "launch", "kernel_consts",
           "counter_layout", "CounterLayout", "TRACE_HEAD", "TRACE_KINDS"]
