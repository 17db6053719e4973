"""The entry points ``moe`` (``tabby.moe``) and ``moe_with_probe``.

Every call goes through the registered operator ``torch.ops.tabby.moe`` (``custom_op.py``: the
layer's one forward and one backward), whoever makes it: ``tabby.moe``, ``tabby.nn.Experts``, the
transformers and torchtitan backends, the bench and ``tabby train``. A call checks its inputs,
turns its group and config into the operator's strings, and runs the operator; the operator finds
the workspace and plan of its group and shape (``resolve.py``) and runs the plan's forward
(``forward_mega.py``, the megakernel, by default; ``forward.py`` or ``fp8.py`` on the path of
separate launches) and, later, ``backward.py`` / ``fp8.py``'s backward.
"""
from __future__ import annotations

import torch

from ..ops import check_device
from ..validate import MoEInputError, check_inputs
from .config import MoEConfig, config_string, parse_config
from .custom_op import probing, run_operator
from .probe import Probe
from .resolve import group_info, group_name, workspace_key
from .workspace import TabbyDeviceError, cached_workspaces, get_workspace


def moe(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None, group=None, config: MoEConfig | None = None,
        biases=None):
    """Tabby's MoE layer (same arguments as ``tabby.moe_reference``; see tabby/validate.py).

    x [T, H] bf16; topk_idx [T, k] int; topk_weights [T, k] float; w_gate, w_up [E_local, I, H],
    w_down [E_local, H, I] bf16; shared None or (w_gate_s [I_s, H], w_up_s [I_s, H], w_down_s [H, I_s]).
    ``group``: the expert-parallel process group (None: one rank; a ``ThreadRank`` for simulated
    ranks; or its operator string, ``resolve.group_name``). ``config``: a ``MoEConfig`` (or its
    string, ``config_string``). Returns y [T, H] bf16. No host synchronization: expert ids are
    checked on the device and reported by ``check_errors`` (or at once with ``config.debug``).
    ``torch.compile(fullgraph=True)`` traces it without a graph break.
    ``biases``: None or the routed experts' (b_gate [E_local, I], b_up [E_local, I], b_down [E_local, H]),
    bf16: g + b_gate, u + b_up before the activation, b_down added to each expert's output before the
    router weight; bf16 on the path of separate launches for now (the plan's choice with them).
    ``w_gate=None``: ungated experts, for an ungated activation (``Activation("relu2")``: down(relu(up
    x)^2)); the operator then gets w_up in w_gate's place, unread, and gives it no gradient.
    """
    ungated = w_gate is None
    if ungated:
        w_gate = w_up
    if shared is not None:
        if not (isinstance(shared, (tuple, list)) and len(shared) == 3):
            raise MoEInputError("shared must be None or a tuple (w_gate_s [I_s, H], w_up_s [I_s, H], "
                                "w_down_s [H, I_s])")
        sg, su, sd = shared
    else:
        sg = su = sd = None
    gname = group if isinstance(group, str) else _group_string(group)
    if isinstance(config, str):
        cstr = config
    elif config is None or isinstance(config, MoEConfig):
        cstr = config_string(config)  # (traced under torch.compile: plain reads of the config's fields)
    else:
        raise MoEInputError(f"config must be a tabby.MoEConfig, got {type(config).__name__}")
    if not torch.compiler.is_compiling():  # (the operator checks again; here the errors name tabby.moe's arguments)
        _, W, _, _ = group_info(gname)
        check_inputs(x, topk_idx, topk_weights, w_gate, w_up, w_down, _shared_tuple(sg, su, sd), world_size=W,
                     check_ids=False, dtypes=(torch.bfloat16,), biases=biases)
        check_device(x.device)
        act = parse_config(cstr).activation
        if ungated == act.gated:
            raise MoEInputError(f"MoEConfig(activation={act}): " + ("needs w_gate" if act.gated else
                                                                    "ungated experts: w_gate must be None"))
    biases = tuple(biases) if biases is not None else None
    save = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, topk_weights, w_gate, w_up, w_down, sg, su, sd, *(biases or ())))
    if x.shape[0] == 0:
        return _no_tokens(x, topk_idx, topk_weights, w_gate, w_up, w_down, _shared_tuple(sg, su, sd), gname,
                          parse_config(cstr), biases)
    return run_operator(x, topk_idx, topk_weights, w_gate, w_up, w_down, sg, su, sd, gname, cstr, save, biases)


def moe_with_probe(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None, group=None,
                   config: MoEConfig | None = None, *, probe: Probe):
    """``moe`` with measurement hooks (``Probe``: stage timer, ticket trace, ablations), for the tools:
    eager calls only; the probe serves the call's forward and its backward."""
    with probing(probe):
        return moe(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group, config)


@torch.compiler.assume_constant_result
def _group_string(group) -> str:
    return group_name(group)


def _shared_tuple(sg, su, sd):
    return None if sg is None else (sg, su, sd)


class _EmptyMoE(torch.autograd.Function):
    """The layer on a rank with no tokens (T = 0): y [0, H]; dx [0, H], router-weight gradients
    [0, k] and zero weight gradients (no token reaches an expert when every rank has T = 0, which
    the group's shape agreement requires)."""

    @staticmethod
    def forward(ctx, x, topk_weights, w_gate, w_up, w_down, s_gate, s_up, s_down, b_gate, b_up, b_down):
        ctx.like = (x, topk_weights, w_gate, w_up, w_down, s_gate, s_up, s_down, b_gate, b_up, b_down)
        return x.new_empty((0, x.shape[1]))

    @staticmethod
    def backward(ctx, dy):
        grads = tuple(None if t is None else torch.zeros_like(t) for t in ctx.like)
        ctx.like = None
        return grads


def _no_tokens(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group: str, config: MoEConfig, biases=None):
    """A call with T = 0: the inputs checked, the group's shape agreement taken part in (made once per
    shape: a peer with tokens is reported), an empty y."""
    rank, W, pg, tg = group_info(group)
    dims = check_inputs(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, world_size=W,
                        check_ids=False, dtypes=(torch.bfloat16,), biases=biases)
    check_device(x.device)
    if W > 1:
        get_workspace(workspace_key(dims, W, x, config), rank, group=pg, thread_group=tg,
                      join_timeout_s=config.resolved_max_wait_ms() / 1e3)
    sh = tuple(shared) if shared is not None else (None, None, None)
    return _EmptyMoE.apply(x, topk_weights, w_gate, w_up, w_down, *sh, *(biases or (None, None, None)))


def check_errors():
    """Raise ``TabbyDeviceError`` if any cached workspace of this process recorded an error (host
    sync). Every record is read and cleared; the error names each one."""
    found = []
    for ws in cached_workspaces():
        try:
            ws.check_errors()
        except TabbyDeviceError as e:
            found.append(str(e))
    if found:
        raise TabbyDeviceError("; ".join(found))
