"""What a user decides about the layer (``MoEConfig``), and the expert's overrides of what the
heuristics decide (``Tuning``).

Everything else (tile sizes, warps, ring and ticket order, TMA, the token pull...) is derived from
the layer's shape and the device by ``heuristics.py`` and fixed once per shape in a ``Plan``
(``plan.py``). A ``Tuning`` field left ``None`` keeps the heuristic's choice; a value that cannot
work raises ``tabby.MoEInputError`` when the plan is made, naming the field.
"""
from __future__ import annotations

import functools
import os
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Literal

from ..activation import SWIGLU, Activation
from ..validate import MoEInputError

# The environment variables a config defers to where its field is None (``MoEConfig.resolved_*``):
# read at each call, so they are part of the key of a plan (``resolve.plan_key``).
ENV_MAX_WAIT_MS, ENV_MAX_WAIT_POLLS, ENV_DEBUG = "TABBY_MAX_WAIT_MS", "TABBY_MAX_WAIT_POLLS", "TABBY_DEBUG"
CONFIG_ENVIRONMENT = (ENV_MAX_WAIT_MS, ENV_MAX_WAIT_POLLS, ENV_DEBUG)
_DEFAULT_MAX_WAIT_MS = 60_000.0
_DEFAULT_MAX_WAIT_POLLS = 1 << 24


def _check_positive(owner: str, name: str, value, allow_zero: bool = False):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise MoEInputError(f"{owner}({name}={value!r}): must be an int")
    if value < 0 or (value == 0 and not allow_zero):
        raise MoEInputError(f"{owner}({name}={value!r}): must be {'>= 0' if allow_zero else '> 0'}")


@dataclass(frozen=True)
class Tuning:
    """Overrides of the heuristics (``tabby/functional/heuristics.py``), for experts and the
    benchmark's variants; every field ``None`` (the default) lets the heuristic decide.

    Routed rows and the forward megakernel:
      tile_m         rows per routed row tile (each expert's rows padded to it)
      ring_rows      rows of the megakernel's ring (ring_rows // tile_m slots, at least 2)
      programs       the megakernel's persistent grid
      comm_programs  programs that only copy rows (0: copies are tickets any program takes)
      prefetch       row-tile groups the copies run ahead of gate/up, in [0, ring groups)
      down_lag       row-tile groups the down tiles run behind gate/up, in [1, ring groups)
      fill_split     copy tickets per row tile
      fill_stages    pipeline stages of a copy's column loop
      group_m        row tiles per group of the ticket order
      down_cols      column tiles per down ticket
      align_tiles    each expert's row tiles padded to a multiple of this
      num_warps      warps per megakernel program (4: two programs per SM, or 8)
      num_stages     pipeline depth of the megakernel's GEMM K loops
      tma            GEMM operands through tensor descriptors (TMA)
      local_rows     gate/up reads this rank's rows from x (needs tma)
      pull_tokens    a copy engine pulls every peer's x whole beside the kernel (needs local_rows)
    The sync-free path's dispatch:
      dispatch_rows, dispatch_cols   the block one program copies per step
      dispatch_programs              programs of the dispatch launch
    bf16:
      bf16_ws        gate/up and down of the separate launches (and gate/up recomputed in the
                     backward) on the warp-specialized kernels (``ops/gemm/bf16_ws.py``, sm_90, routed tiles a multiple
                     of 128 rows, H and I multiples of 8) where they run (True), or on the Triton
                     kernels everywhere (False)
    FP8 (``MoEConfig(precision="fp8" | "fp8-forward")``):
      fp8_ws         the GEMMs on the warp-specialized kernels (``ops/gemm/fp8_ws.py``, sm_90, routed
                     tiles a multiple of 128 rows) where they run (True), or on the Triton kernels
                     everywhere (False)
      fp8_dgrad      where the backward's dgrads read the weights transposed: "cached_transposes"
                     (held with the forward's copies: ``MoEConfig.cache_fp8_transposes=True``),
                     "transpose_in_kernel" (the forward's copies, each block transposed in shared
                     memory: sm_90's warp-specialized kernels), "transpose_per_call" (made by each
                     backward and dropped)

    Each field's type (its annotation) is what ``parse`` and ``describe`` read and write and what
    the checks of a made ``Tuning`` hold it to: adding a field is one edit.
    """

    tile_m: int | None = None
    ring_rows: int | None = None
    programs: int | None = None
    comm_programs: int | None = None
    prefetch: int | None = None
    down_lag: int | None = None
    fill_split: int | None = None
    fill_stages: int | None = None
    group_m: int | None = None
    down_cols: int | None = None
    align_tiles: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    tma: bool | None = None
    local_rows: bool | None = None
    pull_tokens: bool | None = None
    dispatch_rows: int | None = None
    dispatch_cols: int | None = None
    dispatch_programs: int | None = None
    bf16_ws: bool | None = None
    fp8_ws: bool | None = None
    fp8_dgrad: Literal["cached_transposes", "transpose_in_kernel", "transpose_per_call"] | None = None

    _ZERO_OK = ("comm_programs", "prefetch")  # the int fields that may be 0 (the others must be > 0)

    def __post_init__(self):
        for name, (kind, optional) in _field_types(type(self)).items():
            v = getattr(self, name)
            if v is None:
                continue
            if kind is int:
                _check_positive("Tuning", name, v, allow_zero=name in self._ZERO_OK)
            elif not _is_of(v, kind):
                raise MoEInputError(f"Tuning({name}={v!r}): must be {_kind_text(kind)} or None")

    @classmethod
    def parse(cls, text: str) -> "Tuning":
        """``"group_m=2,tma=0"`` -> ``Tuning(group_m=2, tma=False)`` (the tools' variant strings)."""
        return _parse(cls, text, ",")

    def describe(self) -> str:
        """The fields set, as ``parse`` reads them ("" for the defaults)."""
        return _describe(self, ",")


@dataclass(frozen=True)
class MoEConfig:
    """What a user decides about the layer.

    megakernel:        the forward's dispatch, expert GEMMs, push and shared expert in one persistent
                       launch (True), or the sync-free path of separate launches (False); None (the
                       default): the plan's choice (``Plan.megakernel``): the megakernel where the
                       precision has one (bf16), but at EP1 where the separate launches run the
                       warp-specialized GEMMs (sm_90: nothing to exchange, and those GEMMs faster).
    save_for_backward: a differentiated megakernel forward also keeps the routed rows, g | u and the
                       rows' router weights for the backward (True), or keeps only its ring and the
                       backward recomputes them (False: less memory, a slower backward).
    max_wait_ms:       GPU time a spin-wait may take before it records an error instead of hanging
                       (None: ``TABBY_MAX_WAIT_MS``, else 60 s; generous because a peer's first call
                       compiles kernels).
    max_wait_polls:    the same bound under the CPU interpreter, which has no clock (None:
                       ``TABBY_MAX_WAIT_POLLS``, else 2**24 polls).
    debug:             check the device error record after every pass, a host sync (None:
                       ``TABBY_DEBUG=1``).
    tuning:            overrides of the heuristics (``Tuning``), for experts.
    precision:         "bf16" (the default); "fp8": the routed experts' GEMMs in FP8, forward
                       and backward (E4M3, DeepSeek-V3's recipe: docs/fp8.md); "fp8-forward": the
                       forward's in FP8, the backward in bf16 at the FP8 forward's activations.
                       For now FP8 runs on the path of separate launches only (the default
                       for it; ``megakernel=True`` raises ``MoEInputError``) and needs H and I multiples
                       of 16 (a last 1x128 tile or 128x128 block may be partial, with its own
                       scale); "fp8" also a routed tile height ``Tuning.tile_m`` multiple of 128.
    cache_fp8_transposes: precision="fp8": hold the weights' transposed E4M3 copies, which the
                       backward's dgrads read, cached with the forward's copies and made with them
                       from one read of each weight (True, the default: one byte per parameter
                       more between steps: with bf16 weights and their gradients, 6 bytes a
                       parameter); or not (False): on sm_90 the dgrads then read the
                       forward's copies and transpose their blocks in shared memory (about 0.6-0.7x
                       the cached copies' speed), elsewhere each backward makes the transposes and
                       drops them.
    activation:        the routed experts' function between gate/up and down (``tabby.Activation``:
                       SwiGLU, the default; SwiGLU with clamps; gpt-oss's), in every path and precision.
    """

    megakernel: bool | None = None
    save_for_backward: bool = True
    max_wait_ms: float | None = None
    max_wait_polls: int | None = None
    debug: bool | None = None
    tuning: Tuning = field(default_factory=Tuning)
    precision: str = "bf16"
    cache_fp8_transposes: bool = True
    activation: Activation = SWIGLU

    def __post_init__(self):
        if self.precision not in ("bf16", "fp8", "fp8-forward"):
            raise MoEInputError(f"MoEConfig(precision={self.precision!r}): must be 'bf16', 'fp8' or 'fp8-forward'")
        if self.precision != "bf16" and self.megakernel is True:
            raise MoEInputError(f"MoEConfig(precision={self.precision!r}, megakernel=True): the forward megakernel "
                                "has no FP8 path yet; leave megakernel unset (or False): FP8 runs on the path of "
                                "separate launches")
        if self.megakernel is not None and not isinstance(self.megakernel, bool):
            raise MoEInputError(f"MoEConfig(megakernel={self.megakernel!r}): must be True, False or None")
        for name in ("save_for_backward", "cache_fp8_transposes"):
            if not isinstance(getattr(self, name), bool):
                raise MoEInputError(f"MoEConfig({name}={getattr(self, name)!r}): must be True or False")
        if self.debug is not None and not isinstance(self.debug, bool):
            raise MoEInputError(f"MoEConfig(debug={self.debug!r}): must be True, False or None")
        if self.max_wait_ms is not None and not (isinstance(self.max_wait_ms, (int, float))
                                                 and not isinstance(self.max_wait_ms, bool) and self.max_wait_ms > 0):
            raise MoEInputError(f"MoEConfig(max_wait_ms={self.max_wait_ms!r}): must be a positive number")
        _check_positive("MoEConfig", "max_wait_polls", self.max_wait_polls)
        if not isinstance(self.tuning, Tuning):
            raise MoEInputError(f"MoEConfig(tuning={self.tuning!r}): must be a tabby.Tuning")
        if not isinstance(self.activation, Activation):
            raise MoEInputError(f"MoEConfig(activation={self.activation!r}): must be a tabby.Activation")

    def resolved_max_wait_ms(self) -> float:
        if self.max_wait_ms is not None:
            return float(self.max_wait_ms)
        return float(_env_number(ENV_MAX_WAIT_MS, _DEFAULT_MAX_WAIT_MS))

    def resolved_max_wait_polls(self) -> int:
        if self.max_wait_polls is not None:
            return self.max_wait_polls
        return int(_env_number(ENV_MAX_WAIT_POLLS, _DEFAULT_MAX_WAIT_POLLS))

    def resolved_debug(self) -> bool:
        if self.debug is not None:
            return self.debug
        return os.environ.get(ENV_DEBUG, "0") == "1"


# --------------------------------------------------------------------------------------------
# Text forms, over the dataclasses' fields and their annotations
# --------------------------------------------------------------------------------------------
#
# A field's value is written ``name=value``: bool as 0 / 1, int and float as Python prints them,
# a str (or one of a Literal's strings) as it is, a nested dataclass (MoEConfig.tuning) as its
# own text ("a=1,b=2"), None as "None" (only where it is not the default). Fields equal to their
# default are left out; nested dataclasses come last (the order the operator's strings have
# always had). The annotations are read once, when this module is imported (``_KINDS``,
# ``_DEFAULTS``): writing a config's text is then plain attribute reads, which torch.compile traces
# (the operator writes its config string inside compiled code).

_KINDS: dict = {}  # dataclass -> {field name: (kind, optional)}
_DEFAULTS: dict = {}  # dataclass -> its default instance


def _field_types(cls) -> dict:
    """{field name: (kind, optional)} of a dataclass from its annotations: kind is bool, int,
    float, str, a Literal's tuple of strings or a dataclass; optional where None is allowed."""
    if cls in _KINDS:
        return _KINDS[cls]
    hints = typing.get_type_hints(cls)
    out = {}
    for f in fields(cls):
        t = hints[f.name]
        args = typing.get_args(t)
        optional = False
        if typing.get_origin(t) in (typing.Union, types.UnionType):
            optional = type(None) in args
            rest = [a for a in args if a is not type(None)]
            if len(rest) != 1:
                raise TypeError(f"{cls.__name__}.{f.name}: one type (or it and None) is supported, got {t}")
            t = rest[0]
        if typing.get_origin(t) is Literal:
            t = typing.get_args(t)
        elif not (t in (bool, int, float, str) or is_dataclass(t)):
            raise TypeError(f"{cls.__name__}.{f.name}: type {t} has no text form")
        out[f.name] = (t, optional)
    _KINDS[cls] = out
    return out


def _nested(kind) -> bool:
    return not isinstance(kind, tuple) and kind not in (bool, int, float, str)


def _is_of(v, kind) -> bool:
    if isinstance(kind, tuple):
        return v in kind
    if kind is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind is int:
        return isinstance(v, int) and not isinstance(v, bool)
    return isinstance(v, kind)


def _kind_text(kind) -> str:
    if isinstance(kind, tuple):
        return "one of " + ", ".join(map(repr, kind))
    return {bool: "True, False", int: "an int", float: "a number", str: "a string"}.get(kind, kind.__name__)


def _defaults(cls):
    """``cls()``: the values a text leaves out."""
    if cls not in _DEFAULTS:
        _DEFAULTS[cls] = cls()
    return _DEFAULTS[cls]


def _describe(obj, sep: str) -> str:
    """The fields of ``obj`` that differ from the defaults, ``name=value`` joined by ``sep``."""
    default = _defaults(type(obj))
    flat, nested = [], []
    for name, (kind, _) in _field_types(type(obj)).items():
        v = getattr(obj, name)
        if v == getattr(default, name):
            continue
        if _nested(kind):
            nested.append(f"{name}={_describe(v, ',')}")
        else:
            flat.append(f"{name}={int(v) if isinstance(v, bool) else v}")
    return sep.join(flat + nested)


def _parse_value(owner: str, name: str, text: str, kind, optional: bool):
    def bad(what):
        return MoEInputError(f"{owner}: {name}={text!r} must be {what}")

    if optional and text in ("None", "none"):
        return None
    if isinstance(kind, tuple):
        if text not in kind:
            raise bad(_kind_text(kind))
        return text
    if kind is bool:
        if text.lower() not in ("0", "1", "true", "false"):
            raise bad("0/1/true/false")
        return text.lower() in ("1", "true")
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            raise bad("an integer" if kind is int else "a number") from None
    if kind is str:
        return text
    return _parse(kind, text, ",")  # a nested dataclass


def _parse(cls, text: str, sep: str):
    """``cls`` made from ``_describe``'s text (``MoEInputError`` naming an unknown field or a bad value)."""
    kinds = _field_types(cls)
    kw = {}
    for item in filter(None, (s.strip() for s in text.split(sep))):
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or name not in kinds:
            raise MoEInputError(f"{cls.__name__}: {item!r} is not field=value with a field of {sorted(kinds)}")
        kw[name] = _parse_value(cls.__name__, name, value.strip(), *kinds[name])
    return cls(**kw)


def config_string(config: MoEConfig | None) -> str:
    """``MoEConfig`` -> the operator's ``config`` string: the fields that differ from the defaults,
    ``name=value`` joined by ";" (the tuning as ``Tuning.describe``); "" for the defaults or None."""
    if config is None:
        return ""
    if not isinstance(config, MoEConfig):
        raise MoEInputError(f"config must be a tabby.MoEConfig, got {type(config).__name__}")
    return _describe(config, ";")


@functools.lru_cache(maxsize=256)
def parse_config(text: str) -> MoEConfig:
    """The inverse of ``config_string`` (``MoEInputError`` naming an unknown field or a bad value)."""
    return _parse(MoEConfig, text, ";")


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise MoEInputError(f"environment variable {name}={raw!r} must be a number") from None
    if value <= 0:
        raise MoEInputError(f"environment variable {name}={raw!r} must be positive")
    return value


for _cls in (Tuning, Activation, MoEConfig):  # the annotations read once (see "Text forms" above)
    _field_types(_cls)
for _cls in (Tuning, Activation, MoEConfig):
    _defaults(_cls)
