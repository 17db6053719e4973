"""The plan: every choice one layer call makes, computed once per shape and cached with the workspace.

``make_plan`` takes the shape (``MoEDims``), the user's ``MoEConfig`` (its ``Tuning`` overrides)
and the device, asks ``heuristics`` for whatever the tuning leaves open, and returns a frozen
``Plan``. The launches read the plan and decide nothing themselves: which kernel runs each GEMM,
at which tiles, stages and grid, is here (``Plan.describe()`` lists them). A tuning that cannot
work raises ``MoEInputError`` here, naming the field; nothing is switched off behind the user's
back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..activation import SWIGLU, Activation
from ..ops import INTERPRET
from ..ops.gemm import bf16 as gemm
from ..ops.gemm import fp8 as gemm_fp8
from ..ops.gemm.fp8 import Fp8Gemm
from ..ops.megakernel import kernel as mega_kernel
from ..ops.megakernel.plan import MegaPlan
from ..ops.quantize import BLOCK
from ..validate import LAYOUT_KN_PAIRED, LAYOUT_NK, MoEDims, MoEInputError
from . import heuristics
from .config import MoEConfig

_ROUTED_KINDS = (gemm.KIND_GATE_UP, gemm.KIND_DOWN, gemm.KIND_DGRAD_SWIGLU, gemm.KIND_GATE_UP_DGRAD)

CACHED_TRANSPOSES = "cached_transposes"  # the dgrads read the weights' transposes held with the forward's copies
TRANSPOSE_IN_KERNEL = "transpose_in_kernel"  # ... read the forward's copies, each block transposed in the kernel
TRANSPOSE_PER_CALL = "transpose_per_call"  # ... read transposes each backward makes and drops


_DGRAD_TEXT = {CACHED_TRANSPOSES: "the weights' held transposes",
               TRANSPOSE_IN_KERNEL: "the forward's copies, transposed in the kernel",
               TRANSPOSE_PER_CALL: "transposes made for the call"}


@dataclass(frozen=True)
class Fp8Plan:
    """The FP8 GEMMs' kernels (``precision`` "fp8" or "fp8-forward"): each an ``Fp8Gemm`` (core
    "ws" or "triton", tiles, stages, grid). The backward's are None with a bf16 backward
    ("fp8-forward": ``Plan.gemm``'s kernels run it)."""
    gate_up: Fp8Gemm  # gate/up + SwiGLU + h's 1x128 quantization
    down: Fp8Gemm  # down, rows pushed to their origin
    dgrad: str | None = None  # where the dgrads read the weights transposed: CACHED_TRANSPOSES, TRANSPOSE_*
    down_dgrad: Fp8Gemm | None = None  # down dgrad + SwiGLU backward
    gate_up_dgrad: Fp8Gemm | None = None  # gate/up dgrad (K = 2Ip), rows pushed to their origin
    wgrad: Fp8Gemm | None = None  # the three padded weight gradients (dW_down, dW_gate, dW_up)


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
    gemm: dict  # the bf16 standalone kernels (sync-free forward, backward): the routed kinds' gemm.Bf16Gemm,
    # the weight gradients' GemmConfig (gemm.KIND_*)
    mega: MegaPlan | None  # the megakernel forward's launch (None: the sync-free path)
    precision: str = "bf16"  # MoEConfig.precision: the expert GEMMs' operands
    cache_fp8_transposes: bool = True  # MoEConfig.cache_fp8_transposes
    wgrad_programs: int = 4  # the bf16 weight gradients' persistent grid
    fp8: Fp8Plan | None = None  # the FP8 GEMMs' kernels (None: precision "bf16")
    activation: Activation = SWIGLU  # MoEConfig.activation: every gate/up epilogue and its backward

    def gemm_config(self, kind: str) -> gemm.Bf16Gemm | gemm.GemmConfig:
        return self.gemm[kind]

    def describe(self) -> str:
        """Every kernel a call of this plan runs, one a line, with its tiles, warps, stages and grid."""
        d = self.dims
        path = "the forward megakernel" if self.mega is not None else "the path of separate launches"
        weights = f"weights {d.layout}" + (", biases" if d.biases else "") + (
            "" if self.activation.gated else ", no gate")
        lines = [f"Plan: T={d.T} H={d.H} I={d.I} k={d.k} E_local={d.E_local} EP{d.world_size} I_s={self.I_s}, "
                 f"precision {self.precision}, activation {self.activation}, {weights}, {path}",
                 f"  routed tiles of {self.tile_m} rows, experts padded to {self.align_tiles} tile(s); dispatch "
                 f"{self.dispatch_rows} x {self.dispatch_cols} by {self.dispatch_programs} programs"]
        g = self.gemm
        lines.append("  forward:")
        if self.mega is not None:
            lines += ["    " + line for line in _describe_mega(self.mega)]
        elif self.fp8 is not None:
            lines += [_fp8_line("gate/up + SwiGLU", "gate_up", self.fp8.gate_up),
                      _fp8_line("down + push", "rows", self.fp8.down)]
        else:
            lines += [_line("gate/up + SwiGLU", "gate_up", g[gemm.KIND_GATE_UP]),
                      _line("down + push", "rows", g[gemm.KIND_DOWN])]
        f = self.fp8
        if f is not None and f.dgrad is not None:
            lines.append(f"  backward (FP8; the dgrads read {_DGRAD_TEXT[f.dgrad]}):")
            lines += [_fp8_line("down dgrad + SwiGLU bwd", "down_dgrad", f.down_dgrad),
                      _fp8_line("gate/up dgrad + push", "rows", f.gate_up_dgrad),
                      _fp8_line("dW_down, dW_gate, dW_up", "wgrad", f.wgrad)]
        else:
            lines.append("  backward (bf16):")
            if self.mega is not None and not self.save_for_backward:
                lines.append(_line("gate/up (recomputed)", "gate_up", g[gemm.KIND_GATE_UP]))
            lines += [_line("down dgrad + SwiGLU bwd", "down_dgrad", g[gemm.KIND_DGRAD_SWIGLU]),
                      _line("gate/up dgrad + push", "rows", g[gemm.KIND_GATE_UP_DGRAD]),
                      _line("dW_down", "wgrad", g[gemm.KIND_WGRAD_DOWN], self._wgrad_grid(gemm.KIND_WGRAD_DOWN)),
                      _line("dW_gate | dW_up", "wgrad", g[gemm.KIND_WGRAD_GATE_UP],
                            self._wgrad_grid(gemm.KIND_WGRAD_GATE_UP))]
        return "\n".join(lines)

    __str__ = describe

    def _wgrad_grid(self, kind: str) -> str:
        """The Triton weight gradients' persistent grid (a ws kernel's line names its own)."""
        k = self.gemm[kind]
        return "" if isinstance(k, gemm.Bf16Gemm) and k.core == gemm.CORE_WS else f", {self.wgrad_programs} programs"


def _tiles(c: gemm.GemmConfig) -> str:
    return (f"{c.BM}x{c.BN}x{c.BK} tiles, {c.num_warps} warps, {c.num_stages} stages, GROUP_M {c.GROUP_M}")


_BF16_KERNELS = {"gate_up": ("gate_up_swiglu_kernel", "gate_up_swiglu_ws_kernel"),
                 "rows": ("rows_gemm_kernel", "rows_gemm_ws_kernel"),
                 "down_dgrad": ("down_dgrad_swiglu_kernel", "down_dgrad_ws_kernel"),
                 "wgrad": ("expert_wgrad_kernel", "expert_wgrad_ws_kernel")}


def _line(name: str, role: str, k, more: str = "") -> str:
    """A bf16 kernel's line: ``k`` a ``gemm.Bf16Gemm`` or the Triton tiles (``GemmConfig``)."""
    if isinstance(k, gemm.GemmConfig):
        k = gemm.Bf16Gemm(gemm.CORE_TRITON, k)
    ws = k.core == gemm.CORE_WS
    if ws:
        more += f", {k.programs or 'one per SM'} programs"
    return f"    {name:<24} {_BF16_KERNELS[role][ws]:<30} {k.core:<7} {_tiles(k.config)}{more}"


def _fp8_line(name: str, role: str, k: Fp8Gemm) -> str:
    more = ""
    if k.core == gemm_fp8.CORE_WS:
        more = f", lag {k.lag}" if k.lag else ""
        more += f", {k.programs or 'one per SM'} programs"
    elif k.tma:
        more = ", TMA"
    return f"    {name:<24} {gemm_fp8.kernel_name(k, role):<30} {k.core:<7} {_tiles(k.config)}{more}"


def _describe_mega(m: MegaPlan) -> list:
    c = m.gate_up
    out = [f"{mega_kernel.moe_fwd_megakernel.__name__}: {m.programs} programs ({m.comm_programs} copy-only) of "
           f"{m.num_warps} warps, {m.num_stages} stages; ring {m.n_slots} slots of {m.tile_m} rows in groups of "
           f"{m.group_m}, prefetch {m.prefetch}, down lag {m.down_lag}",
           f"  gate/up {c.BM}x{c.BN}x{c.BK}, down {m.down.BM}x{m.down.BN}x{m.down.BK} ({m.down_cols} column tile(s) "
           f"a ticket); TMA {m.tma}, local rows {m.local_rows}, token pull {m.token_pull}, half tiles {m.half_tiles}",
           f"  fills: {m.fill_split} a tile, {m.fill_cols} columns a step, {m.fill_stages} stage(s)"]
    if m.shared_gate_up is not None:
        s, sd = m.shared_gate_up, m.shared_down
        out.append(f"  shared expert: gate/up {s.BM}x{s.BN}x{s.BK}, down {sd.BM}x{sd.BN}x{sd.BK}")
    return out


def _device_sms(device: torch.device) -> int | None:
    if INTERPRET or device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def _device_arch(device: torch.device) -> int | None:
    """The GPU's compute capability as 90 for sm_90; None under the interpreter or off CUDA."""
    if INTERPRET or device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _ws_core(field: str, requested: bool | None, possible: bool, arch: int | None, tile_m: int, H: int, I: int,
             multiple: int) -> bool:
    """Whether a precision's GEMMs run on the warp-specialized kernels: where they can unless the
    ``Tuning`` field says otherwise; asked for where they cannot, an error naming the field."""
    if requested and not possible:
        kind = "bf16" if field.startswith("bf16") else "FP8"
        raise MoEInputError(f"Tuning({field}=True): the warp-specialized {kind} kernels need sm_90 (this plan's device: "
                            f"{'sm_%d' % arch if arch else 'none: the CPU or the interpreter'}), routed tiles a "
                            f"multiple of 128 rows (tile_m={tile_m}) and H, I multiples of {multiple} (H={H}, I={I})")
    return possible if requested is None else requested


def separate_launches_conflicts(config: MoEConfig, biases: bool, layout: str) -> dict:
    """What of ``config`` experts with biases, weights in a transposed layout or an ungated activation
    cannot take, as {field: the value they can}: they run on the path of separate launches (the
    megakernel's tiles have neither the bias epilogues nor the transposed loads), biases and ungated
    experts in bf16 only (FP8 quantizes the weights from wherever they lie, once a version). Empty
    where nothing conflicts (``make_plan`` raises otherwise; the transformers backend adapts)."""
    ungated = not config.activation.gated
    if not (biases or layout != LAYOUT_NK or ungated):
        return {}
    out = {}
    if config.megakernel:
        out["megakernel"] = None
    if config.precision != "bf16" and (biases or ungated):
        out["precision"] = "bf16"
    return out


def make_plan(dims: MoEDims, config: MoEConfig, device: torch.device, I_s: int = 0, sms: int | None = None,
              arch: int | None = None) -> Plan:
    """The plan of a call with these sizes (``I_s``: the shared expert's width, 0 without one) on
    ``device`` (``sms``, ``arch``: plan for a GPU of that many SMs, of that compute capability (90:
    sm_90) instead, e.g. to inspect a plan on the CPU)."""
    t = config.tuning
    T, H, I, k, E_local, W = dims.T, dims.H, dims.I, dims.k, dims.E_local, dims.world_size
    tile_m = t.tile_m or heuristics.TILE_M
    sm_count = sms if sms is not None else _device_sms(device)
    wait_budget = config.resolved_max_wait_polls() if INTERPRET else int(config.resolved_max_wait_ms() * 1e6)
    arch = arch if arch is not None else _device_arch(device)
    ungated = not config.activation.gated
    if ungated and dims.biases:
        raise MoEInputError(f"Activation({config.activation.kind!r}) (ungated experts) takes no biases for now")
    separate = dims.biases or dims.layout != LAYOUT_NK or ungated  # not on the megakernel's tiles
    if separate and separate_launches_conflicts(config, dims.biases, dims.layout):
        what = ("experts with biases" if dims.biases else f"ungated experts ({config.activation.kind})" if ungated
                else f"weights in the {dims.layout!r} layout")
        raise MoEInputError(f"{what} run on the path of separate launches (biases, ungated experts: in bf16) for "
                            f"now: MoEConfig(precision={config.precision!r}, megakernel={config.megakernel}) cannot "
                            f"take them")
    ws_multiple = 8 if dims.layout == LAYOUT_NK else 64
    ws = _ws_core("bf16_ws", t.bf16_ws, heuristics.bf16_ws_possible(arch, tile_m, H, I, dims.layout), arch, tile_m,
                  H, I, ws_multiple)
    gemms = {kind: heuristics.bf16_gemm(kind, N, K, tile_m, ws, sm_count, config.activation.kind)
             for kind, N, K in ((gemm.KIND_GATE_UP, I, H), (gemm.KIND_DOWN, H, I), (gemm.KIND_DGRAD_SWIGLU, I, H),
                                (gemm.KIND_GATE_UP_DGRAD, H, 2 * I))}
    if dims.layout == LAYOUT_KN_PAIRED:  # its gate/up dgrad: one K-major phase over gate_up_proj as it lies, as down's
        gemms[gemm.KIND_GATE_UP_DGRAD] = heuristics.bf16_gemm(gemm.KIND_DOWN, H, 2 * I, tile_m, ws, sm_count)
    gemms |= {gemm.KIND_WGRAD_DOWN: heuristics.wgrad_gemm(I, ws, sm_count),
             gemm.KIND_WGRAD_GATE_UP: heuristics.wgrad_gemm(H, ws, sm_count)}
    dispatch_cols = t.dispatch_cols or heuristics.DISPATCH_COLS
    if dispatch_cols & (dispatch_cols - 1):
        raise MoEInputError(f"Tuning(dispatch_cols={dispatch_cols}): must be a power of two")
    megakernel = config.megakernel
    if megakernel is None:
        megakernel = heuristics.use_megakernel(config.precision, W, ws) and not separate
    mega = None
    groups = 1
    if megakernel:
        try:
            mega = _mega_plan(dims, config, sm_count, I_s, tile_m)
        except ValueError as e:
            raise MoEInputError(f"the forward megakernel (MoEConfig(megakernel={config.megakernel})) at T={T} H={H} "
                                f"I={I} k={k} E_local={E_local} EP{W}: {e}") from None
        groups = mega.group_m
    align = t.align_tiles or heuristics.align_tiles(megakernel, T, k, E_local, tile_m, groups)
    if not megakernel and t.align_tiles not in (None, 1):
        raise MoEInputError(f"Tuning(align_tiles={t.align_tiles}): the sync-free path does not pad experts; "
                            f"use it with megakernel=True")
    return Plan(dims=dims, I_s=I_s, megakernel=megakernel, save_for_backward=config.save_for_backward,
                debug=config.resolved_debug(), wait_budget=wait_budget, tile_m=tile_m, align_tiles=align,
                dispatch_rows=t.dispatch_rows or heuristics.DISPATCH_ROWS, dispatch_cols=dispatch_cols,
                dispatch_programs=t.dispatch_programs or heuristics.DISPATCH_PROGRAMS, gemm=gemms, mega=mega,
                precision=config.precision, cache_fp8_transposes=config.cache_fp8_transposes,
                wgrad_programs=heuristics.wgrad_programs(sm_count),
                fp8=None if config.precision == "bf16" else _fp8_plan(dims, config, tile_m, sm_count, arch),
                activation=config.activation)


def _fp8_plan(dims: MoEDims, config: MoEConfig, tile_m: int, sms: int | None, arch: int | None) -> Fp8Plan:
    t = config.tuning
    H, I = dims.H, dims.I
    ws = _ws_core("fp8_ws", t.fp8_ws, heuristics.fp8_ws_possible(arch, tile_m, H, I), arch, tile_m, H, I, 16)
    gate_up, down = heuristics.fp8_gate_up(H, tile_m, ws, sms), heuristics.fp8_rows(H, I, tile_m, ws, sms)
    if config.precision != "fp8":  # "fp8-forward": the bf16 backward of Plan.gemm
        return Fp8Plan(gate_up=gate_up, down=down)
    cache = config.cache_fp8_transposes
    dgrad = t.fp8_dgrad or heuristics.fp8_dgrad(cache, ws)
    if (dgrad == CACHED_TRANSPOSES) != cache:
        raise MoEInputError(f"Tuning(fp8_dgrad={dgrad!r}) with MoEConfig(cache_fp8_transposes={cache}): the dgrads "
                            f"read the held transposes exactly when the config holds them ({CACHED_TRANSPOSES!r} "
                            f"with cache_fp8_transposes=True, the others with False)")
    if dgrad == TRANSPOSE_IN_KERNEL and not ws:
        raise MoEInputError(f"Tuning(fp8_dgrad={dgrad!r}): the dgrads transpose the forward's copies in the "
                            f"warp-specialized kernels only (sm_90, Tuning.fp8_ws not False, tile_m a multiple of 128, "
                            f"H and I multiples of 16)")
    in_kernel = dgrad == TRANSPOSE_IN_KERNEL
    gate_up_k = 2 * triton.cdiv(I, BLOCK) * BLOCK  # [dg | du]'s K: each half padded to a whole block
    return Fp8Plan(gate_up=gate_up, down=down, dgrad=dgrad,
                   down_dgrad=heuristics.fp8_down_dgrad(tile_m, ws, sms, in_kernel),
                   gate_up_dgrad=heuristics.fp8_gate_up_dgrad(H, gate_up_k, tile_m, ws, sms, in_kernel),
                   wgrad=heuristics.fp8_wgrad(ws, sms))


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
        half_tiles=heuristics.half_tiles(tile_m, INTERPRET), local_rows=local_rows, token_pull=pull,
        activation=config.activation)
