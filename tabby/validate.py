"""Input validation shared by every implementation of the MoE layer.

Every implementation (reference, anchors, Tabby kernels) takes the same arguments:

    x             [T, H]            activations (bf16 for the kernels; any float for the reference)
    topk_idx      [T, k]            int32/int64 global expert ids in [0, E_local * world_size)
    topk_weights  [T, k]            float router weights
    w_gate, w_up  [E_local, I, H]   nn.Linear layout (out x in), same dtype as x
    w_down        [E_local, H, I]   (the three as they lie in memory: one of ``LAYOUTS``, below;
                                    ungated experts: ``tabby.moe`` and the reference take w_gate None)
    shared        None or (w_gate_s [I_s, H], w_up_s [I_s, H], w_down_s [H, I_s])

Errors are raised as :class:`MoEInputError` with a message naming the argument and the shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class MoEInputError(ValueError):
    """Bad input to an MoE layer: wrong shape, dtype, device, expert id or group."""


class TabbyMemoryError(MoEInputError):
    """The layer's buffers for this shape do not fit in the device memory that is free; raised
    before anything is allocated, with the GiB needed and free and the settings that lower it."""


@dataclass(frozen=True)
class MoEDims:
    T: int  # tokens on this rank
    H: int  # hidden size
    k: int  # experts per token
    E_local: int  # experts on this rank
    I: int  # expert intermediate size
    world_size: int  # ranks in the expert-parallel group
    I_shared: int  # shared-expert intermediate size, 0 without one
    biases: bool = False  # the routed experts have biases (b_gate, b_up [E_local, I], b_down [E_local, H])
    layout: str = "nk"  # how the weights lie in memory (``weights_layout``)

    @property
    def E(self) -> int:
        return self.E_local * self.world_size


_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise MoEInputError(msg)


# How the routed weights (w_gate, w_up [E_local, I, H], w_down [E_local, H, I], as given) lie in
# memory. Each is read in place; the kernels choose their loads by it.
LAYOUT_NK = "nk"  # Tabby's (and nn.Linear's): unit stride along H for w_gate / w_up, along I for w_down
LAYOUT_KN = "kn"  # transposed, as views of gate_up_proj [E, H, 2I] (gate columns first) and down_proj [E, I, H]
LAYOUT_KN_PAIRED = "kn-paired"  # transposed with g and u interleaved along I (gpt-oss's gate_up_proj [E, H, 2I],
#                                 gate at even columns): w_up starts one element after w_gate, both of stride 2
LAYOUTS = (LAYOUT_NK, LAYOUT_KN, LAYOUT_KN_PAIRED)


def weights_layout(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> str | None:
    """The layout (``LAYOUTS``) of the routed weights as given (views included), or None if they are in
    none of them. w_gate and w_up always have equal strides."""
    layout = gate_up_layout(w_gate, w_up)
    down_nk = w_down.stride(-1) == 1
    if layout == LAYOUT_NK:
        return layout if down_nk else None
    return layout if layout is not None and not down_nk and w_down.stride(1) == 1 else None


def gate_up_layout(w_gate: torch.Tensor, w_up: torch.Tensor) -> str | None:
    """``weights_layout`` of w_gate and w_up alone."""
    if w_gate.stride() != w_up.stride():
        return None
    if w_gate.stride(-1) == 1:
        return LAYOUT_NK
    if w_gate.stride(1) == 1:
        return LAYOUT_KN
    if w_gate.stride(1) == 2 and _next_element(w_gate, w_up):
        return LAYOUT_KN_PAIRED
    return None


def _next_element(a: torch.Tensor, b: torch.Tensor) -> bool:
    """b starts one element after a (in a's memory). While tracing (fake or meta tensors: no data
    pointers, and the compiler's lowering gives each input its own storage) taken as true: the real
    call checks it."""
    if a.device.type == "meta" or _is_fake(a):
        return True
    return b.data_ptr() == a.data_ptr() + a.element_size()


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def check_inputs(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None, world_size: int = 1,
                 check_ids: bool = True, dtypes=_FLOATS, biases=None) -> MoEDims:
    """Check shapes, dtypes and devices; with ``check_ids`` also the expert-id range (a host sync).

    Returns the layer's dimensions. ``dtypes`` lists the activation/weight dtypes accepted.
    ``biases``: None or the routed experts' (b_gate [E_local, I], b_up [E_local, I], b_down [E_local, H]).
    """
    tensors = dict(x=x, topk_idx=topk_idx, topk_weights=topk_weights, w_gate=w_gate, w_up=w_up, w_down=w_down)
    for name, t in tensors.items():
        _need(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _need(x.dim() == 2, f"x must be [T, H], got shape {tuple(x.shape)}")
    T, H = x.shape
    _need(x.dtype in dtypes, f"x has dtype {x.dtype}; supported: {', '.join(map(str, dtypes))}")
    _need(topk_idx.dim() == 2 and topk_idx.shape[0] == T,
          f"topk_idx must be [T={T}, k], got shape {tuple(topk_idx.shape)}")
    k = topk_idx.shape[1]
    _need(k >= 1, "topk_idx must have at least one column (k >= 1)")
    _need(topk_idx.dtype in _INTS, f"topk_idx must be int32 or int64, got {topk_idx.dtype}")
    _need(tuple(topk_weights.shape) == (T, k),
          f"topk_weights must be [T={T}, k={k}] like topk_idx, got shape {tuple(topk_weights.shape)}")
    _need(topk_weights.dtype.is_floating_point, f"topk_weights must be floating point, got {topk_weights.dtype}")
    _need(w_gate.dim() == 3, f"w_gate must be [E_local, I, H], got shape {tuple(w_gate.shape)}")
    E_local, I, Hg = w_gate.shape
    _need(E_local >= 1, "w_gate has no experts (E_local = 0)")
    _need(Hg == H, f"w_gate is [E_local, I, H] with H={Hg}, but x has H={H}")
    _need(tuple(w_up.shape) == (E_local, I, H),
          f"w_up must be [E_local={E_local}, I={I}, H={H}] like w_gate, got {tuple(w_up.shape)}")
    _need(tuple(w_down.shape) == (E_local, H, I),
          f"w_down must be [E_local={E_local}, H={H}, I={I}], got {tuple(w_down.shape)}")
    for name in ("w_gate", "w_up", "w_down"):
        _need(tensors[name].dtype == x.dtype, f"{name} has dtype {tensors[name].dtype} but x has {x.dtype}")
    I_s = 0
    if shared is not None:
        _need(isinstance(shared, (tuple, list)) and len(shared) == 3,
              "shared must be None or a tuple (w_gate_s [I_s, H], w_up_s [I_s, H], w_down_s [H, I_s])")
        sg, su, sd = shared
        for name, t in (("shared w_gate_s", sg), ("shared w_up_s", su), ("shared w_down_s", sd)):
            _need(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor")
            _need(t.dtype == x.dtype, f"{name} has dtype {t.dtype} but x has {x.dtype}")
            tensors[name] = t
        _need(sg.dim() == 2 and sg.shape[1] == H, f"shared w_gate_s must be [I_s, H={H}], got {tuple(sg.shape)}")
        I_s = sg.shape[0]
        _need(tuple(su.shape) == (I_s, H), f"shared w_up_s must be [I_s={I_s}, H={H}], got {tuple(su.shape)}")
        _need(tuple(sd.shape) == (H, I_s), f"shared w_down_s must be [H={H}, I_s={I_s}], got {tuple(sd.shape)}")
    layout = weights_layout(w_gate, w_up, w_down)
    _need(layout is not None,
          f"the routed weights lie in memory in none of Tabby's layouts (strides w_gate {w_gate.stride()}, "
          f"w_up {w_up.stride()}, w_down {w_down.stride()}): w_gate, w_up [E_local, I, H] and w_down [E_local, "
          f"H, I] with unit last strides (nk); or all three transposed views, of gate_up_proj [E, H, 2I] (gate "
          f"columns first, or g and u interleaved as gpt-oss stores them) and down_proj [E, I, H] (kn, "
          f"kn-paired); w_gate and w_up with equal strides. Call .contiguous() on them for the first")
    devices = {name: t.device for name, t in tensors.items()}
    _need(len(set(devices.values())) == 1,
          "all tensors must be on one device, got " + ", ".join(f"{n}: {d}" for n, d in devices.items()))
    if biases is not None:
        _need(isinstance(biases, (tuple, list)) and len(biases) == 3
              and all(isinstance(b, torch.Tensor) for b in biases),
              "biases must be None or a tuple (b_gate [E_local, I], b_up [E_local, I], b_down [E_local, H])")
        for name, b, want in (("b_gate", biases[0], (E_local, I)), ("b_up", biases[1], (E_local, I)),
                              ("b_down", biases[2], (E_local, H))):
            _need(tuple(b.shape) == want, f"{name} must be {list(want)}, got {tuple(b.shape)}")
            _need(b.stride(-1) == 1 or (name != "b_down" and b.stride(-1) == 2),
                  f"{name} must have a unit last stride (b_gate and b_up: or 2, g and u interleaved), "
                  f"got strides {b.stride()}")
            _need(b.dtype == w_gate.dtype, f"{name} must be {w_gate.dtype} (the weights' dtype), got {b.dtype}")
            _need(b.device == x.device, f"{name} must be on {x.device}, got {b.device}")
        _need(biases[0].stride() == biases[1].stride(), f"b_gate and b_up must have equal strides, got "
                                                        f"{biases[0].stride()} and {biases[1].stride()}")
    dims = MoEDims(T=T, H=H, k=k, E_local=E_local, I=I, world_size=world_size, I_shared=I_s,
                   biases=biases is not None, layout=layout)
    if check_ids and topk_idx.numel() > 0:
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        _need(lo >= 0 and hi < dims.E,
              f"topk_idx holds expert ids in [{lo}, {hi}], outside [0, E={dims.E}) "
              f"(E = E_local {E_local} x world size {world_size})")
    return dims


_DTYPE_CODES = {torch.float64: 1, torch.float32: 2, torch.float16: 3, torch.bfloat16: 4,
                torch.float8_e4m3fn: 5}


GROUP_FIELDS = ("T", "H", "k", "E_local", "I", "I_shared", "dtype", "fits")


def group_descriptor(dims: MoEDims, dtype: torch.dtype, fits: bool = True) -> list[int]:
    """What every rank of a group must agree on (``GROUP_FIELDS``), as ints; ``fits``: this rank
    has the device memory for the call's buffers (``tabby.functional.moe``'s memory check)."""
    return [dims.T, dims.H, dims.k, dims.E_local, dims.I, dims.I_shared, _DTYPE_CODES.get(dtype, 0), int(fits)]


def compare_group_descriptors(rows: list[list[int]], rank: int, shortfall: str | None = None) -> None:
    """Raise the same error on every rank when the ranks' descriptors (``group_descriptor``, one per
    rank in rank order) differ: ``MoEInputError`` when shapes or dtype differ, else
    ``TabbyMemoryError`` when a rank lacks memory (``shortfall``: this rank's own message)."""
    shapes = [r[:-1] for r in rows]
    if any(r != shapes[0] for r in shapes):
        table = "; ".join(f"rank {i}: " + ", ".join(f"{n}={v}" for n, v in zip(GROUP_FIELDS, r))
                          for i, r in enumerate(shapes))
        raise MoEInputError(f"ranks of the expert-parallel group disagree on the layer's shapes: {table}")
    short = [i for i, r in enumerate(rows) if not r[-1]]
    if short:
        if rows[rank][-1] or shortfall is None:
            raise TabbyMemoryError(f"rank(s) {short} of the expert-parallel group lack the device memory for this "
                                   f"layer's buffers (their error says how much); no rank allocated them")
        raise TabbyMemoryError(shortfall)


def check_group_agrees(dims: MoEDims, x: torch.Tensor, group, fits: bool = True, shortfall: str | None = None) -> None:
    """Raise on every rank if the ranks of ``group`` disagree on shapes or dtype, or (``fits``
    False on some rank) one of them lacks memory: one small all_gather."""
    import torch.distributed as dist

    dev = x.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor(group_descriptor(dims, x.dtype, fits), dtype=torch.int64, device=dev)
    world = dist.get_world_size(group)
    allv = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(allv, mine, group=group)
    compare_group_descriptors([v.tolist() for v in allv], dist.get_rank(group), shortfall)
