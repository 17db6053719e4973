"""The plan: every choice one layer call makes, computed once per shape and cached with the workspace.

``make_plan`` takes the shape (``MoEDims``), the user's ``MoEConfig`` (its ``Tuning`` overrides)
and the device, asks ``heuristics`` for whatever the tuning leaves open, and returns a frozen
``Plan``. The launches read the plan and decide nothing themselves. A tuning that cannot work
raises ``MoEInputError`` here, naming the field; nothing is switched off behind the user's back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import INTERPRET
from ..ops.gemm import bf16 as gemm
from ..ops.megakernel.plan import MegaPlan
from ..validate import MoEDims, MoEInputError
from . import heuristics
from .config import MoEConfig

_ROUTED_KINDS = (gemm.KIND_GATE_UP, gemm.KIND_DOWN, gemm.KIND_DGRAD_SWIGLU, gemm.KIND_GATE_UP_DGRAD)


@dataclass(frozen=True)
class Plan:
    dims: MoEDims
    I_s: int  # shared-expert width of the calls this plan serves (0: none)
    megakernel: bool
    save_for_backward: bool
    debug: bool
    wait_budget: int  # the bounded waits' budget: ns on the GPU, polls under the interpreter
    tile_m: int
    align_tiles: int  # each expert's row tiles padded to a multiple of this (the schedule)
    dispatch_rows: int  # the sync-free dispatch's block (rows x columns) and programs; the
    dispatch_cols: int  # backward's pulls use them on both paths
    dispatch_programs: int
    gemm: dict  # gemm.KIND_* -> GemmConfig of the standalone kernels (sync-free forward, backward)
    mega: MegaPlan | None  # the megakernel forward's launch (None: the sync-free path)
    precision: str = "bf16"  # MoEConfig.precision: the expert GEMMs' operands
    cache_fp8_transposes: bool = True  # MoEConfig.cache_fp8_transposes

    def gemm_config(self, kind: str) -> gemm.GemmConfig:
        return self.gemm[kind]


def _device_sms(device: torch.device) -> int | None:
    if INTERPRET or device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def make_plan(dims: MoEDims, config: MoEConfig, device: torch.device, I_s: int = 0, sms: int | None = None) -> Plan:
    """The plan of a call with these sizes (``I_s``: the shared expert's width, 0 without one) on
    ``device`` (``sms``: plan for a GPU of that many SMs instead, e.g. to inspect a plan on the CPU)."""
    t = config.tuning
    T, H, I, k, E_local, W = dims.T, dims.H, dims.I, dims.k, dims.E_local, dims.world_size
    tile_m = t.tile_m or heuristics.TILE_M
    wait_budget = config.resolved_max_wait_polls() if INTERPRET else int(config.resolved_max_wait_ms() * 1e6)
    gemms = {gemm.KIND_GATE_UP: heuristics.gemm_config(gemm.KIND_GATE_UP, I, H, tile_m),
             gemm.KIND_DOWN: heuristics.gemm_config(gemm.KIND_DOWN, H, I, tile_m),
             gemm.KIND_DGRAD_SWIGLU: heuristics.gemm_config(gemm.KIND_DGRAD_SWIGLU, I, H, tile_m),
             gemm.KIND_GATE_UP_DGRAD: heuristics.gemm_config(gemm.KIND_GATE_UP_DGRAD, H, 2 * I, tile_m)}
    dispatch_cols = t.dispatch_cols or heuristics.DISPATCH_COLS
    if dispatch_cols & (dispatch_cols - 1):
        raise MoEInputError(f"Tuning(dispatch_cols={dispatch_cols}): must be a power of two")
    mega = None
    groups = 1
    if config.megakernel:
        try:
            mega = _mega_plan(dims, config, sms if sms is not None else _device_sms(device), I_s, tile_m)
        except ValueError as e:
            raise MoEInputError(f"MoEConfig(megakernel=True) at T={T} H={H} I={I} k={k} E_local={E_local} "
                                f"EP{W}: {e}") from None
        groups = mega.group_m
    align = t.align_tiles or heuristics.align_tiles(config.megakernel, T, k, E_local, tile_m, groups)
    if not config.megakernel and t.align_tiles not in (None, 1):
        raise MoEInputError(f"Tuning(align_tiles={t.align_tiles}): the sync-free path does not pad experts; "
                            f"use it with megakernel=True")
    return Plan(dims=dims, I_s=I_s, megakernel=config.megakernel, save_for_backward=config.save_for_backward,
                debug=config.resolved_debug(), wait_budget=wait_budget, tile_m=tile_m, align_tiles=align,
                dispatch_rows=t.dispatch_rows or heuristics.DISPATCH_ROWS, dispatch_cols=dispatch_cols,
                dispatch_programs=t.dispatch_programs or heuristics.DISPATCH_PROGRAMS, gemm=gemms, mega=mega,
                precision=config.precision, cache_fp8_transposes=config.cache_fp8_transposes)


def _mega_plan(dims: MoEDims, config: MoEConfig, sms: int | None, I_s: int, tile_m: int) -> MegaPlan:
    t = config.tuning
    T, H, I, k, E_local, W = dims.T, dims.H, dims.I, dims.k, dims.E_local, dims.world_size
    if t.tma and not heuristics.tma_possible(H, I, I_s):
        raise ValueError(f"Tuning(tma=True): tensor descriptors need H, I and I_s multiples of 8 "
                         f"(H={H}, I={I}, I_s={I_s})")
    tma = t.tma if t.tma is not None else heuristics.use_tma(T, k, H, I, I_s)
    local_rows = t.local_rows if t.local_rows is not None else tma and H % 8 == 0
    comm = t.comm_programs or 0
    pull = t.pull_tokens if t.pull_tokens is not None else (
        heuristics.pull_tokens(T, k, E_local * W, tile_m) and local_rows and comm == 0)
    warps = t.num_warps or heuristics.num_warps(tma, I)
    stages = t.num_stages or heuristics.num_stages(warps)
    gu, dn, gus, dns = heuristics.mega_tiles(H, I, I_s, tile_m, warps, stages)
    n_slots = (t.ring_rows or heuristics.RING_ROWS) // tile_m
    group = t.group_m or heuristics.group_m(n_slots, H, I)
    if n_slots < 2 or n_slots % group or n_slots // group < 2:  # (MegaPlan names the field)
        n_groups = 1
    else:
        n_groups = n_slots // group
    grid = t.programs or heuristics.programs(sms, warps)
    if not 0 <= comm < grid:
        raise ValueError(f"Tuning(comm_programs={comm}): must be in [0, programs={grid})")
    fill_split = t.fill_split or heuristics.FILL_SPLIT
    n_down_cols = -(-H // dn.BN)
    dcols = heuristics.down_cols(I, n_down_cols, t.down_cols)
    fills = 0 if (comm or pull) else fill_split
    gate_ups, downs = -(-I // gu.BN), n_down_cols // dcols
    return MegaPlan(
        H=H, I=I, I_s=I_s, tile_m=tile_m, n_slots=n_slots, group_m=group,
        prefetch=t.prefetch if t.prefetch is not None else heuristics.prefetch(n_groups),
        down_lag=t.down_lag or heuristics.down_lag(n_groups, grid, comm, group, fills, gate_ups, downs),
        fill_split=fill_split, fill_cols=heuristics.fill_cols(H), fill_stages=t.fill_stages or heuristics.fill_stages(warps),
        programs=grid, comm_programs=comm, num_warps=warps, num_stages=stages,
        gate_up=gu, down=dn, shared_gate_up=gus, shared_down=dns, down_cols=dcols, tma=tma,
        half_tiles=heuristics.half_tiles(tile_m, INTERPRET), local_rows=local_rows, token_pull=pull)
