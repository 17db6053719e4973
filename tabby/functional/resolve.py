"""What a call resolves before it runs: its group, its workspace and its plan.

``group`` arrives as None (one rank), a ``torch.distributed`` process group, a ``ThreadRank``
(simulated ranks) or the registered operator's string for one of those (``group_name``). The
workspace (``workspace.py``: symmetric buffers of one group and shape) and the plan
(``plan.make_plan``: every choice of one shape and config) are made once and cached; a new one
is made only after the memory check (``memory.py``) says the call fits.
"""
from __future__ import annotations

import logging
import os

import torch

from ..validate import MoEDims, MoEInputError, TabbyMemoryError
from .config import CONFIG_ENVIRONMENT, MoEConfig
from .memory import memory_report, memory_shortfall
from .plan import Plan, make_plan
from .threads import ThreadRank
from .workspace import WorkspaceKey, get_workspace, peek_workspace

log = logging.getLogger("tabby")

# --------------------------------------------------------------------------------------------
# Groups, and their strings for the registered operator
# --------------------------------------------------------------------------------------------

_THREAD_RANKS: dict[str, ThreadRank] = {}
_THREAD_PREFIX = "tabby.threads:"


def group_name(group) -> str:
    """The operator's ``group`` string: "" for one rank (None), a ``torch.distributed`` process
    group's ``group_name``, or a name registered here for a simulated rank (``ThreadRank``); a
    string is returned as it is."""
    if group is None:
        return ""
    if isinstance(group, str):
        return group
    if isinstance(group, ThreadRank):
        name = f"{_THREAD_PREFIX}{id(group.group)}:{group.rank}"
        _THREAD_RANKS[name] = group  # holds the group: its id stays unique while the name is used
        return name
    return group.group_name


def resolve_group(name: str):
    """The group a ``group_name`` string stands for (None for "")."""
    if name == "":
        return None
    if name.startswith(_THREAD_PREFIX):
        try:
            return _THREAD_RANKS[name]
        except KeyError:
            raise MoEInputError(f"unknown simulated-rank group {name!r} (not made by group_name in this "
                                f"process)") from None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def group_info(group):
    """(rank, world size, torch process group or None, thread group or None) of a group (or its
    string). ``group=None`` means one rank, as in ``moe_reference`` (even when a default group exists)."""
    if isinstance(group, str):
        group = resolve_group(group)
    if isinstance(group, ThreadRank):
        return group.rank, group.group.world_size, None, group.group
    if group is None:
        return 0, 1, None, None
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group), group, None


# --------------------------------------------------------------------------------------------
# Workspaces and plans
# --------------------------------------------------------------------------------------------


def plan_key(dims: MoEDims, config: MoEConfig, I_s: int, device) -> tuple:
    """The key of a plan: the shape, config, shared-expert width and device, and the environment
    variables the config defers to (``CONFIG_ENVIRONMENT``)."""
    return (dims, config, I_s, str(device)) + tuple(os.environ.get(v) for v in CONFIG_ENVIRONMENT)


def workspace_key(dims: MoEDims, world_size: int, x: torch.Tensor, config: MoEConfig) -> WorkspaceKey:
    """The key of the workspace a call uses: its shapes, dtype and device, and whether it carries the
    FP8 dispatch's buffers (any precision but bf16)."""
    return WorkspaceKey(dims.T, dims.H, dims.k, dims.E_local, dims.I, world_size, x.dtype, str(x.device),
                        fp8=config.precision != "bf16")


def workspace_and_plan(key: WorkspaceKey, dims: MoEDims, config: MoEConfig, I_s: int, device, rank, pg, tg,
                       differentiated: bool = True):
    """The cached workspace of this group and shape and its plan for ``config`` and ``I_s``.

    Where either is new, the memory the call needs is first compared with what the device has free
    (``memory.memory_shortfall``); a workspace is created only when every rank of the group agrees on
    the shapes and has the memory (``get_workspace``), so that no rank waits for a peer that gave up.
    The check counts the backward when the call is ``differentiated`` (the first call of a plan decides)."""
    ws = peek_workspace(key, rank, group=pg, thread_group=tg)
    if ws is not None:
        return ws, _plan_for(ws, dims, config, I_s, device, differentiated=differentiated)
    plan = make_plan(dims, config, device, I_s)
    shortfall = memory_shortfall(plan, device, new_workspace=key, differentiated=differentiated)
    ws = get_workspace(key, rank, group=pg, thread_group=tg, fits=shortfall is None, shortfall=shortfall,
                       join_timeout_s=config.resolved_max_wait_ms() / 1e3)
    return ws, _plan_for(ws, dims, config, I_s, device, plan)


def _plan_for(ws, dims: MoEDims, config: MoEConfig, I_s: int, device, plan: Plan | None = None,
              differentiated: bool = True) -> Plan:
    """The cached plan of ``ws`` for ``config`` and ``I_s``. A new one (``plan``: made already and
    its memory checked) is checked against the free device memory first (``TabbyMemoryError``)."""
    key = plan_key(dims, config, I_s, device)
    cached = ws.plans.get(key)
    if cached is not None:
        return cached
    if plan is None:
        plan = make_plan(dims, config, device, I_s)
        shortfall = memory_shortfall(plan, device, differentiated=differentiated)
        if shortfall is not None:
            raise TabbyMemoryError(shortfall)
    ws.plans[key] = plan
    if ws.rank == 0:
        log.info("%s", memory_report(plan))
    return plan


_PLANS_WITHOUT_WORKSPACE: dict = {}


def plan_without_workspace(dims: MoEDims, config: MoEConfig, device, I_s: int) -> Plan:
    """The plan a real call makes (``make_plan``), without a workspace: for the operator's fake
    (meta) implementations, which size the kept outputs from it (symbolic shapes: made each time)."""
    if not all(isinstance(getattr(dims, f), int) for f in dims.__dataclass_fields__):
        return make_plan(dims, config, device, I_s)
    key = plan_key(dims, config, I_s, device)
    plan = _PLANS_WITHOUT_WORKSPACE.get(key)
    if plan is None:
        plan = _PLANS_WITHOUT_WORKSPACE[key] = make_plan(dims, config, device, I_s)
    return plan
