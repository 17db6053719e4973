"""The compute-only floor: a rank's routed rows, already grouped by expert, through the experts.

What a perfect EP layer could not beat on one GPU: the rows this rank's experts receive (found
once, outside timing, by the ``torch-a2a`` routing), laid out grouped by local expert, run through
``torch._grouped_mm`` gate and up, ``silu(gate) * up``, ``torch._grouped_mm`` down (and its
backward), plus the shared expert on the rank's own tokens when the layer has one. No
communication, no permutation, no combine inside the timed region.

    p = prepare_floor(x, topk_idx, w_gate, w_up, w_down, shared, group)   # collective when EP > 1
    ys = floor_forward(p)                                # (y_grouped [M, H], y_shared [T, H] or None)
    errs = floor_errors(p, with_grads=True)              # vs fp32, one expert at a time
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tabby.reference import expert_segments, swiglu_mlp
from .torch_a2a import dispatch_rows, grouped_swiglu, route_plan, shared_swiglu


@dataclass
class FloorProblem:
    """Inputs of the floor on one rank. Leaves that require grad: xg, x (shared), the weights."""

    xg: torch.Tensor  # [M, H] routed rows grouped by local expert
    offs: torch.Tensor  # int32 [E_local] expert ends
    counts: list  # rows per local expert (host)
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    x: torch.Tensor | None = None  # [T, H] the rank's tokens, for the shared expert
    shared: tuple | None = None
    dyg: torch.Tensor | None = None  # [M, H] gradient fed to the routed rows
    dys: torch.Tensor | None = None  # [T, H] gradient fed to the shared expert

    def leaves(self):
        out = [self.xg, self.w_gate, self.w_up, self.w_down]
        if self.shared is not None:
            out += [self.x, *self.shared]
        return out


def prepare_floor(x, topk_idx, w_gate, w_up, w_down, shared=None, group=None, generator=None) -> FloorProblem:
    """Find this rank's routed rows (a collective over ``group``) and set up the floor's leaves.

    The weights become new leaves sharing storage with the given tensors (no copy: kimi-k2 at EP1
    has 34 GB of them); the grouped rows are a fresh tensor. Output gradients are random.
    """
    E_local = w_gate.shape[0]
    with torch.no_grad():
        plan = route_plan(topk_idx, E_local, group)
        xg = dispatch_rows(x[plan.tok], plan, group).contiguous()
    counts = [sum(c[e] for c in plan.counts) for e in range(E_local)]

    def leaf(t):
        return t.detach().requires_grad_(True)

    gen = dict(generator=generator) if generator is not None else {}
    p = FloorProblem(leaf(xg), plan.offs, counts, leaf(w_gate), leaf(w_up), leaf(w_down))
    p.dyg = torch.randn(xg.shape, device=xg.device, **gen).to(xg.dtype)
    if shared is not None:
        p.x, p.shared = leaf(x), tuple(leaf(w) for w in shared)
        p.dys = torch.randn(x.shape, device=x.device, **gen).to(x.dtype)
    return p


def floor_forward(p: FloorProblem):
    """(y_grouped [M, H], y_shared [T, H] or None) with autograd."""
    yg = grouped_swiglu(p.xg, p.offs, p.w_gate, p.w_up, p.w_down)
    ys = shared_swiglu(p.x, p.shared) if p.shared is not None else None
    return yg, ys


def floor_fwdbwd(p: FloorProblem):
    """Forward and backward; returns the gradients of :meth:`FloorProblem.leaves` (nothing accumulates)."""
    yg, ys = floor_forward(p)
    outs, grads = [yg], [p.dyg]
    if ys is not None:
        outs.append(ys)
        grads.append(p.dys)
    return torch.autograd.grad(outs, p.leaves(), grads)


def expert_fp32(rows, dy_rows, wg, wu, wd):
    """One expert in fp32 with autograd: (y, dx, dwg, dwu, dwd) for rows [m, H] and dy_rows [m, H]."""
    with torch.enable_grad():  # callers run under no_grad
        rows = rows.detach().float().requires_grad_(True)
        ws = [w.detach().float().requires_grad_(True) for w in (wg, wu, wd)]
        y = swiglu_mlp(rows, *ws)
        grads = torch.autograd.grad(y, [rows, *ws], dy_rows.float())
    return (y.detach(), *grads)


class ErrorSums:
    """Accumulate squared differences and squared reference norms per quantity (fp64, on the device)."""

    def __init__(self):
        self.num, self.den = {}, {}

    def add(self, name, got, ref):
        d = got.detach().double() - ref.detach().double()
        self.num[name] = self.num.get(name, 0) + (d * d).sum()
        self.den[name] = self.den.get(name, 0) + (ref.detach().double() ** 2).sum()

    def relative(self, reduce: bool = True, group=None):
        """{name: ||got - ref|| / ||ref||}; with ``reduce`` the sums are added over ``group`` (default:
        every rank) first, so every rank must have added the same names."""
        names = sorted(self.num)
        if not names:
            return {}
        v = torch.stack([self.num[n] for n in names] + [self.den[n] for n in names])
        if reduce:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.all_reduce(v, group=group)
        v = v.tolist()
        out = {}
        for i, n in enumerate(names):
            num, den = v[i], v[len(names) + i]
            out[n] = (num / den) ** 0.5 if den > 0 else (0.0 if num == 0 else float("inf"))
        return out


def floor_errors(p: FloorProblem, with_grads: bool, reduce: bool = True):
    """Relative Frobenius errors of the floor against fp32 on the same rows (sums added over all ranks).

    Forward: y_grouped vs :func:`tabby.reference.expert_segments` in fp32. With grads: dx_grouped,
    the weight gradients (and shared-expert ones), each expert upcast one at a time.
    """
    errs = ErrorSums()
    with torch.no_grad():
        yg, ys = floor_forward(p)
        ref = expert_segments(p.xg, p.counts, p.w_gate, p.w_up, p.w_down, torch.float32)
        n = sum(p.counts)
        errs.add("y", yg[:n], ref)
        del ref
        if ys is not None:
            errs.add("y_shared", ys, swiglu_mlp(p.x.float(), *(w.float() for w in p.shared)))
    if with_grads:
        g = floor_fwdbwd(p)
        dxg, dwg, dwu, dwd = g[:4]
        start = 0
        for e, m in enumerate(p.counts):
            rows, dy = p.xg[start:start + m], p.dyg[start:start + m]
            _, dx_r, dwg_r, dwu_r, dwd_r = expert_fp32(rows, dy, p.w_gate[e], p.w_up[e], p.w_down[e])
            errs.add("dx", dxg[start:start + m], dx_r)
            errs.add("dw_gate", dwg[e], dwg_r)
            errs.add("dw_up", dwu[e], dwu_r)
            errs.add("dw_down", dwd[e], dwd_r)
            start += m
        if p.shared is not None:
            _, dxs, dsg, dsu, dsd = expert_fp32(p.x, p.dys, *p.shared)
            for name, got, ref in (("dx_shared", g[4], dxs), ("dshared_gate", g[5], dsg),
                                   ("dshared_up", g[6], dsu), ("dshared_down", g[7], dsd)):
                errs.add(name, got, ref)
        del g
    return errs.relative(reduce=reduce)
