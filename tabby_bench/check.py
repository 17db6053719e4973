"""The benchmark's correctness check: an implementation against the fp32 reference, memory-frugal.

Relative Frobenius errors per quantity (``y``, ``dx``, ``dtopk_weights``, the weight gradients),
summed over all ranks before the division; an implementation is correct where every one is at
most :data:`TOLERANCE` of its precision (bf16; the FP8 rows' E4M3 operands, 3 bits of mantissa,
put their errors against fp32 at 4-7e-2 on the benchmark shapes).
"""
from __future__ import annotations

import torch

from tabby.reference import combine_k, moe_reference

from .anchors.floor import ErrorSums, expert_fp32
from .anchors.torch_a2a import dispatch_rows, return_rows, route_plan
from .shapes import Inputs

TOLERANCE = {"bf16": 2e-2, "fp8": 8e-2}
DTYPES = {"bf16": torch.bfloat16}


def forward_only(errors: dict) -> dict:
    """The forward's errors of a fwd+bwd check (gradients are the names starting with 'd')."""
    return {k: v for k, v in errors.items() if not k.startswith("d")}


def within(errors: dict, tolerance: float) -> bool:
    return bool(errors) and all(v <= tolerance for v in errors.values())


def layer_errors(fn, inp: Inputs, group, with_grads: bool) -> dict:
    """Relative errors of ``fn`` (moe_reference's signature) against fp32, summed over all ranks.

    The forward is compared with :func:`moe_reference` itself (run without autograd). The
    gradients come from a per-expert fp32 computation that upcasts one expert at a time (autograd
    through moe_reference would keep fp32 copies of every expert: 68 GB for kimi-k2 at EP1): the
    rows are routed like torch-a2a routes them and each expert's output is cross-checked against
    moe_reference's forward, so a routing mistake cannot hide.
    """
    y = fn(*inp.args(), group=group)
    grads = (torch.autograd.grad(y, inp.leaves(), inp.dy, allow_unused=True, materialize_grads=True)
             if with_grads else None)
    y = y.detach()
    errs = ErrorSums()
    with torch.no_grad():
        y_ref = moe_reference(*(t.detach() if t is not None else None for t in inp.args()[:6]),
                              shared=tuple(w.detach() for w in inp.shared) if inp.shared else None, group=group)
        errs.add("y", y, y_ref)
        if with_grads:
            _reference_grads(inp, grads, group, errs, y_ref)
    del y, grads, y_ref
    return errs.relative()


def _reference_grads(inp: Inputs, grads, group, errs: ErrorSums, y_ref) -> None:
    x, idx, tw, wg, wu, wd = (t.detach() for t in inp.args()[:6])
    T, k = idx.shape
    H = x.shape[1]
    plan = route_plan(idx, wg.shape[0], group)
    xg = dispatch_rows(x[plan.tok], plan, group)
    dyg = dispatch_rows(inp.dy[plan.tok], plan, group)
    wsg = dispatch_rows(tw.reshape(-1)[plan.perm].float()[:, None].contiguous(), plan, group)[:, 0]
    M = xg.shape[0]
    yg = torch.empty(M, H, dtype=torch.float32, device=x.device)
    dxg = torch.empty_like(yg)
    dtwg = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    start = 0
    for e, m in enumerate(plan.offs.tolist()):
        sl = slice(start, m)
        ye, dxe, dwge, dwue, dwde = expert_fp32(xg[sl], wsg[sl, None] * dyg[sl].float(), wg[e], wu[e], wd[e])
        yg[sl], dxg[sl] = ye, dxe
        dtwg[sl, 0] = (dyg[sl].float() * ye).sum(1)
        errs.add("dw_gate", grads[2][e], dwge)
        errs.add("dw_up", grads[3][e], dwue)
        errs.add("dw_down", grads[4][e], dwde)
        start = m
    del xg, dyg, wsg

    def back(rows_grouped, width):
        rows = return_rows(rows_grouped, plan, group)
        rep = torch.empty(T * k, width, dtype=rows.dtype, device=rows.device)
        rep[plan.perm] = rows
        return rep.view(T, k, width)

    y_f32 = combine_k(back(yg, H), tw, torch.float32)  # sum_k w * y_e in k order
    del yg
    dx = back(dxg, H).sum(1)
    del dxg
    errs.add("dtopk_weights", grads[1], back(dtwg, 1)[..., 0])
    if inp.shared is not None:
        sh = tuple(w.detach() for w in inp.shared)
        ys, dxs, dsg, dsu, dsd = expert_fp32(x, inp.dy, *sh)
        y_f32 = y_f32 + ys
        dx = dx + dxs
        for name, g, r in (("dshared_gate", grads[5], dsg), ("dshared_up", grads[6], dsu),
                           ("dshared_down", grads[7], dsd)):
            errs.add(name, g, r)
    errs.add("dx", grads[0], dx)
    # Self-check: the per-expert path must reproduce moe_reference's forward (bf16-rounded there).
    drift = ((y_f32 - y_ref.float()).norm() / y_ref.float().norm().clamp_min(1e-30)).item()
    if not drift < 1e-2:
        raise RuntimeError(f"reference self-check failed: per-expert fp32 forward differs from moe_reference by "
                           f"{drift:.3g} (relative); the gradient reference cannot be trusted")
