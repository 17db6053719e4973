"""Every buffer one layer call allocates, described once; the memory check reads the description.

``layer_buffers(plan)`` lists each buffer of one call of a plan on one rank: its name, shape, dtype
and lifetime. The passes allocate their buffers through it (``Buffers.empty``), so the shapes they
allocate and the sizes the check counts cannot disagree; tests/test_memory_check.py records the
allocations of real calls and compares them with the description.

Lifetimes:
    shape     made once per shape and kept with the workspace (the megakernel's ring and counters)
    weights   the FP8 copies of the weights, cached while the weights live (per weight version)
    held      made by the forward and kept until its backward: the schedule and, where the forward
              keeps them, the routed rows, g | u and the rows' router weights
    forward   made and dropped by the forward
    backward  made and dropped by the backward

Sizes are the worst case: every (token, k) of every rank routed to this rank's experts (``R``
rows, ``schedule_capacity``); the routed buffers are allocated at that size. The symmetric
buffers of the workspace are ``workspace.workspace_bytes``'s.

Two forms of the backward: the eager one (``owned``: dg | du written over g | u, the weight
gradients in the order that peaks lower) and the operator's under ``torch.compile`` (the kept
rows only read: dg | du a buffer of its own). A buffer that only one form makes says which
(``Buffer.form``); the check counts the larger form.

``memory_needs`` sums the description per lifetime; ``memory_shortfall`` compares it with the free
device memory before a new workspace or plan is made (``resolve.workspace_and_plan``), and
``memory_report`` describes it.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import triton

from ..ops.megakernel.protocol import counter_layout
from ..ops.schedule import schedule_capacity
from .plan import CACHED_TRANSPOSES, TRANSPOSE_PER_CALL, Plan
from .workspace import WorkspaceKey, workspace_bytes

LIFETIMES = ("shape", "weights", "held", "forward", "backward")
E4M3 = torch.float8_e4m3fn
FP8_BLOCK = 128


@dataclass(frozen=True)
class Buffer:
    name: str
    shape: tuple
    dtype: torch.dtype
    lifetime: str  # one of LIFETIMES
    what: str
    form: str = ""  # backward buffers of one form only: "owned" (eager) or "operator"; "" both
    without_grad: bool = False  # a held buffer that a forward without autograd makes too (and drops)
    made_by: str = ""  # "": the passes, through ``Buffers.empty``; else the ops function that allocates it

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class Buffers:
    """The buffers of one call of a plan, by name (``layer_buffers``)."""

    def __init__(self, items):
        self.items = {b.name: b for b in items}

    def __getitem__(self, name: str) -> Buffer:
        return self.items[name]

    def __contains__(self, name: str) -> bool:
        return name in self.items

    def empty(self, name: str, device) -> torch.Tensor:
        """An uninitialized tensor of the buffer ``name`` (what the passes allocate)."""
        b = self.items[name]
        t = torch.empty(b.shape, dtype=b.dtype, device=device)
        if _recorder is not None:
            _recorder.append(b)
        return t

    def nbytes(self, lifetime: str, form: str = "", without_grad: bool = False, made_by: str | None = None) -> int:
        """Bytes of the buffers of ``lifetime`` (of the backward's ``form``, where given; only those a
        forward without autograd makes too, with ``without_grad``; only those ``made_by``, where given)."""
        return sum(b.nbytes for b in self.items.values()
                   if b.lifetime == lifetime and (not form or b.form in ("", form))
                   and (b.without_grad or not without_grad) and (made_by is None or b.made_by == made_by))


_recorder: list | None = None


class recording:
    """Context manager for tests: the buffers ``Buffers.empty`` allocates inside it, in order."""

    def __enter__(self):
        global _recorder
        self._before, _recorder = _recorder, []
        return _recorder

    def __exit__(self, *exc):
        global _recorder
        _recorder = self._before


_CACHE: dict = {}  # id(plan) -> (a weak reference to the plan, its Buffers); an entry leaves with its plan


def layer_buffers(plan: Plan) -> Buffers:
    """Every buffer of one call of ``plan`` on one rank (cached while the plan lives)."""
    key = id(plan)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is plan:
        return hit[1]
    out = Buffers(_describe(plan))
    _CACHE[key] = (weakref.ref(plan, lambda _, key=key: _CACHE.pop(key, None)), out)
    return out


def gate_up_k(I: int) -> int:
    """Columns of each half of the FP8 gate/up dgrad's K: I rounded up to a multiple of 128."""
    return triton.cdiv(I, FP8_BLOCK) * FP8_BLOCK


def gate_up_wgrad_first(R, H, I, E_local, tokens_rows=0):
    """The order of the two weight gradients that peaks lower when the backward owns the kept rows
    (``moe_backward``'s ``owned``): gate/up first (then xs and dg | du are freed before dW_down is
    allocated) or down first (dys and hw freed before dW_gate, dW_up). Bytes at each order's high
    points, from the shapes alone (no host sync); ``tokens_rows``: the token pull's kept tokens
    (W*T), 0 otherwise. Both orders give the same bits."""
    rows_h, gu, hw, dw = R * H * 2, R * 4 * I, R * I * 2, E_local * H * I * 2
    tok = tokens_rows * H * 2
    down_first = max(gu + (tok or rows_h) + rows_h + hw + dw, gu + rows_h + 3 * dw)
    gate_up_first = max(gu + tok + 2 * rows_h + hw, gu + 2 * rows_h + hw + 2 * dw, rows_h + hw + 3 * dw)
    return gate_up_first <= down_first


def fp8_transposes_bytes(d) -> int:
    """The cached transposed E4M3 weight copies of ``cache_fp8_transposes``: W_down^T and
    [W_gate^T | W_up^T] with each half padded (``gate_up_k``), one byte a value."""
    return d.E_local * d.H * (d.I + 2 * gate_up_k(d.I))


def _describe(plan: Plan) -> list:
    d = plan.dims
    R = schedule_capacity(d.world_size, d.T, d.k, d.E_local, plan.tile_m, plan.align_tiles)
    T, H, I, W, E = d.T, d.H, d.I, d.world_size, d.E_local
    BM = plan.tile_m
    mega = plan.mega
    bf16, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    cdiv = triton.cdiv
    out = []

    def add(name, shape, dtype, lifetime, what, form="", without_grad=False, made_by=""):
        out.append(Buffer(name, tuple(shape), dtype, lifetime, what, form, without_grad, made_by))

    def rows_fp8(name, rows, C, lifetime, what, **kw):  # E4M3 rows and an fp32 scale per 1x128 tile
        add(name, (rows, C), E4M3, lifetime, what, **kw)
        add(name + "_scale", (rows, cdiv(C, FP8_BLOCK)), f32, lifetime, what + ": 1x128 scales", **kw)

    def cols_fp8(name, C, lifetime, what):  # transposed E4M3 [C, R] and an fp32 scale per 128x1 tile
        add(name, (C, R), E4M3, lifetime, what)
        add(name + "_scale", (cdiv(R, FP8_BLOCK), C), f32, lifetime, what + ": 128x1 scales")

    # per shape: the megakernel's ring, the shared expert's rows and the counters (ops.megakernel.alloc)
    if mega is not None:
        n_sh = cdiv(T, BM) if mega.I_s else 0
        ring = dict(made_by="ops.megakernel.alloc")
        add("ring_xs", (mega.ring_rows, H), bf16, "shape", "the ring's routed rows", **ring)
        add("ring_h", (mega.ring_rows, I), bf16, "shape", "the ring's h rows", **ring)
        if mega.I_s:
            add("shared_h", (n_sh * BM, mega.I_s), bf16, "shape", "the shared expert's h", **ring)
            add("shared_out", (n_sh * BM, H), bf16, "shape", "the shared expert's output", **ring)
        add("counters", (counter_layout(mega.n_slots, n_sh, R // BM).total + 1,), i32, "shape", "the ring's counters",
            **ring)
        add("shared_tiles", (max(n_sh, 1) + 1,), i32, "shape", "the shared expert's tile list and count", **ring)

    # weights: the FP8 copies, E4M3 with a scale per 128x128 block
    fp8 = plan.precision != "bf16"
    if fp8:
        nI, nH = cdiv(I, FP8_BLOCK), cdiv(H, FP8_BLOCK)
        cache = dict(made_by="functional.fp8 (the weight cache)")
        for name, (n, k) in (("w_gate_fp8", (I, H)), ("w_up_fp8", (I, H)), ("w_down_fp8", (H, I))):
            add(name, (E, n, k), E4M3, "weights", "a weight's E4M3 copy", **cache)
            add(name + "_scale", (E, cdiv(n, FP8_BLOCK), cdiv(k, FP8_BLOCK)), f32, "weights", "its block scales",
                **cache)
        t_life = {CACHED_TRANSPOSES: "weights", TRANSPOSE_PER_CALL: "backward"}.get(plan.fp8.dgrad)
        if t_life is not None:  # (TRANSPOSE_IN_KERNEL: the dgrads read the forward's copies, no transposes)
            Ip = gate_up_k(I)
            add("w_down_t_fp8", (E, I, H), E4M3, t_life, "W_down^T in E4M3 (the down dgrad's B)", **cache)
            add("w_down_t_fp8_scale", (E, nI, nH), f32, t_life, "its block scales", **cache)
            add("w_gate_up_t_fp8", (E, H, 2 * Ip), E4M3, t_life, "[W_gate^T | W_up^T] (the gate/up dgrad's B)",
                **cache)
            add("w_gate_up_t_fp8_scale", (E, nH, 2 * Ip // FP8_BLOCK), f32, t_life, "its block scales", **cache)

    # held: the schedule, and the routed rows a differentiated forward keeps for its backward
    add("row_src", (R,), i32, "held", "each routed row's source (the schedule)", made_by="ops.schedule")
    recompute = mega is not None and not plan.save_for_backward
    kept = "backward" if recompute else "held"  # recomputed by the backward where nothing is kept
    separate = mega is None  # the path of separate launches pulls the rows (and row weights) without autograd too
    if plan.precision == "fp8":
        rows_fp8("xs_fp8", R, H, kept, "the routed rows in E4M3", without_grad=separate)
    elif mega is not None and mega.token_pull and not recompute:  # pulled whole by every forward
        add("tokens", (W * T, H), bf16, "held", "every rank's tokens (the token pull)", without_grad=True)
    else:
        if mega is not None and mega.token_pull:
            add("tokens", (W * T, H), bf16, "forward", "every rank's tokens (the token pull)")
        add("xs", (R, H), bf16, kept, "the routed rows", without_grad=separate)
    add("gu", (R, 2 * I), bf16, kept, "g | u", without_grad=separate and not fp8)
    add("row_w", (R,), f32, kept, "the rows' router weights", without_grad=separate)
    if recompute:
        add("h", (R, I), bf16, "backward", "h, made again with g | u")

    # forward transients
    if mega is None:
        if fp8:
            if plan.precision == "fp8-forward":
                rows_fp8("xs_fp8", R, H, "forward", "the routed rows quantized")
            rows_fp8("h_fp8", R, I, "forward", "h in E4M3")
        else:
            add("h", (R, I), bf16, "forward", "h = silu(g) * u")

    # backward transients
    if plan.precision == "fp8":
        Ip = gate_up_k(I)
        rows_fp8("dys_fp8", R, H, "backward", "the dy rows in E4M3")
        add("dgu", (R, 2 * I), bf16, "backward", "dg | du")
        add("hw", (R, I), bf16, "backward", "the rows' router weight times h")
        rows_fp8("dgu_fp8", R, 2 * Ip, "backward", "dg | du per 1x128 (each half padded)")
        cols_fp8("dgu_t_fp8", 2 * I, "backward", "dg | du per 128x1")
        cols_fp8("dys_t_fp8", H, "backward", "the dy rows per 128x1")
        cols_fp8("hw_t_fp8", I, "backward", "hw per 128x1")
        cols_fp8("xs_t_fp8", H, "backward", "the routed rows per 128x1")
    else:
        add("dys", (R, H), bf16, "backward", "the dy rows")
        add("dgu", (R, 2 * I), bf16, "backward", "dg | du (the eager backward writes it over g | u)", form="operator")
        add("hw", (R, I), bf16, "backward", "the rows' router weight times h")
        if mega is not None and mega.token_pull and not recompute and gate_up_wgrad_first(R, H, I, E, W * T):
            add("wgrad_rows", (R, H), bf16, "backward", "the routed rows gathered from the tokens", form="owned")
    dgrad_bn = plan.fp8.down_dgrad.config.BN if plan.precision == "fp8" else plan.gemm_config("dgrad_swiglu").config.BN
    add("dw_part", (R, cdiv(I, dgrad_bn)), f32, "backward", "partial router-weight gradients")
    add("dw_rows", (R,), f32, "backward", "the router-weight gradients of the rows")
    return out


@dataclass(frozen=True)
class MemoryNeeds:
    """Worst-case bytes of one call of a plan on one rank, per lifetime (``layer_buffers``)."""

    R_max: int  # routed rows the buffers are sized for
    kept: int  # what a differentiated forward keeps for the backward (per layer)
    forward: int  # the forward's transients
    backward: int  # the backward's transients, its larger form (with the rows it recomputes)
    ring: int  # per shape: the megakernel's ring, shared-expert rows and counters (0 on the sync-free path)
    recompute: bool  # the megakernel keeps nothing: its backward recomputes the routed rows
    fp8_weights: int = 0  # the FP8 copies of the layer's weights, cached while the weights live
    backward_owned: int = 0  # the eager backward's transients (tabby.moe's: it frees the kept rows as it goes)
    forward_without_grad: int = 0  # a forward without autograd: its transients and the held buffers it makes

    def held(self) -> int:
        """Bytes a differentiated call holds from its forward to its backward: the ring, the routed
        rows (unless the backward recomputes them) and the weights' FP8 copies."""
        return self.ring + self.kept + self.fp8_weights

    def peak(self, differentiated: bool = True) -> int:
        """Bytes of one call at its high point: without autograd the per-shape buffers and the
        forward's transients; differentiated, what it holds and the larger of the passes' transients."""
        if not differentiated:
            return self.ring + self.fp8_weights + self.forward_without_grad
        return self.held() + max(self.forward, self.backward)


def memory_needs(plan: Plan) -> MemoryNeeds:
    """The worst-case bytes of a plan (``MemoryNeeds``), summed from ``layer_buffers``."""
    b = layer_buffers(plan)
    R = b["row_src"].shape[0]
    held = b.nbytes("held")
    backward = max(b.nbytes("backward", "owned"), b.nbytes("backward", "operator"))
    return MemoryNeeds(R_max=R, kept=held, forward=b.nbytes("forward"), backward=backward, ring=b.nbytes("shape"),
                       recompute=plan.mega is not None and not plan.save_for_backward,
                       fp8_weights=b.nbytes("weights"), backward_owned=b.nbytes("backward", "owned"),
                       forward_without_grad=b.nbytes("forward") + b.nbytes("held", without_grad=True))


def memory_report(plan: Plan) -> str:
    """Worst-case routed-buffer sizes of a plan (every (token, k) of every rank to this rank)."""
    d = plan.dims
    n = memory_needs(plan)
    MiB = 2 ** 20
    if plan.mega is None:
        mode = (f"kept per layer for the backward {n.kept / MiB:.1f} MiB, forward transient "
                f"{n.forward / MiB:.1f} MiB")
    else:
        mode = (f"megakernel forward keeps only the schedule and a {n.ring / MiB:.1f} MiB ring; its backward "
                f"recomputes the routed rows" if n.recompute else
                f"megakernel ring {n.ring / MiB:.1f} MiB; a differentiated forward keeps {n.kept / MiB:.1f} MiB per "
                f"layer for the backward (without autograd: the ring"
                f"{'' if not n.forward_without_grad else f' and {n.forward_without_grad / MiB:.1f} MiB for the forward'})")
    copies = ""
    if n.fp8_weights:
        what = "with their transposes" if plan.precision == "fp8" and plan.cache_fp8_transposes else "forward's only"
        copies = f"; the weights' E4M3 copies ({what}) {n.fp8_weights / MiB:.1f} MiB, held while the weights live"
    return (f"T={d.T} H={d.H} I={d.I} k={d.k} E_local={d.E_local} EP{d.world_size}: routed rows sized for the worst "
            f"case: R_max={n.R_max} rows; {mode}; backward transient {n.backward / MiB:.1f} MiB (tabby.moe's eager "
            f"backward, which frees the kept rows as it goes: {n.backward_owned / MiB:.1f} MiB){copies}")


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation on ``device`` can use: free in the driver plus what PyTorch's caching
    allocator holds unused; None where it is not known (CPU tensors) or not to be asked (while a
    CUDA graph is captured): no check."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def memory_shortfall(plan: Plan, device, new_workspace: WorkspaceKey | None = None,
                     differentiated: bool = True) -> str | None:
    """None if one call of ``plan`` fits in the free memory of ``device`` (``free_device_bytes``),
    else the message of the ``TabbyMemoryError`` to raise: GiB needed and free, and what lowers it.
    ``new_workspace``: the key of a workspace the call would also create (its symmetric buffers);
    ``differentiated``: the call's backward counts too (``MemoryNeeds.peak``)."""
    free = free_device_bytes(torch.device(device))
    if free is None:
        return None
    n = memory_needs(plan)
    sym = workspace_bytes(new_workspace) if new_workspace is not None else 0
    need = sym + n.peak(differentiated)
    if need <= free:
        return None
    d, GiB = plan.dims, 2 ** 30
    ways = [(f"fewer tokens per call (the routed rows are sized for every token of every rank: T={d.T} x k={d.k} "
             f"x EP{d.world_size})")]
    if differentiated and plan.mega is not None and plan.save_for_backward:
        ways.append(f"MoEConfig(save_for_backward=False) (each layer then holds only its ring between its forward "
                    f"and backward, {n.kept / GiB:.2f} GiB less per layer, where other layers' kept rows take "
                    f"the memory; the backward recomputes the rows)")
    if differentiated and plan.mega is None:
        ways.append("MoEConfig(megakernel=True, save_for_backward=False) (each layer holds only a ring between its "
                    "forward and backward)")
    if plan.precision == "fp8" and plan.cache_fp8_transposes:
        ways.append(f"MoEConfig(cache_fp8_transposes=False) (the weights' transposed E4M3 copies not held, "
                    f"{fp8_transposes_bytes(d) / GiB:.2f} GiB less: the dgrads read the forward's copies transposed, slower)")
    if plan.mega is not None:
        ways.append(f"a smaller ring, Tuning(ring_rows=...) (now {plan.mega.ring_rows} rows, {n.ring / GiB:.2f} GiB)")
    ways.append("tabby.free_workspaces() to release the buffers of shapes no longer used")
    parts = (f"held from forward to backward {n.held() / GiB:.2f} GiB (ring {n.ring / GiB:.2f}), transient "
             f"{max(n.forward, n.backward) / GiB:.2f} GiB" if differentiated else
             f"ring {n.ring / GiB:.2f} GiB, transient {n.forward / GiB:.2f} GiB")
    return (f"tabby.moe at T={d.T} H={d.H} I={d.I} k={d.k} E_local={d.E_local} EP{d.world_size} on {device} needs "
            f"{need / GiB:.2f} GiB for a {'differentiated ' if differentiated else ''}call (worst case, "
            f"R_max={n.R_max} routed rows: {parts}, symmetric buffers {sym / GiB:.2f} GiB) but {free / GiB:.2f} GiB "
            f"are free. To lower it: " + "; ".join(ways))
