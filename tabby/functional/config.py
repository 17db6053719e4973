"""What a user decides about the layer (``MoEConfig``), and the expert's overrides of what the
heuristics decide (``Tuning``).

Everything else (tile sizes, warps, ring and ticket order, TMA, the token pull...) is derived from
the layer's shape and the device by ``heuristics.py`` and fixed once per shape in a ``Plan``
(``plan.py``). A ``Tuning`` field left ``None`` keeps the heuristic's choice; a value that cannot
work raises ``tabby.MoEInputError`` when the plan is made, naming the field.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from ..validate import MoEInputError

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

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("tma", "local_rows", "pull_tokens"):
                if v is not None and not isinstance(v, bool):
                    raise MoEInputError(f"Tuning({f.name}={v!r}): must be True, False or None")
            else:
                _check_positive("Tuning", f.name, v, allow_zero=f.name in ("comm_programs", "prefetch"))

    @classmethod
    def parse(cls, text: str) -> "Tuning":
        """``"group_m=2,tma=0"`` -> ``Tuning(group_m=2, tma=False)`` (the tools' variant strings)."""
        kw = {}
        names = {f.name: f for f in fields(cls)}
        for item in filter(None, (s.strip() for s in text.split(","))):
            name, sep, value = item.partition("=")
            name = name.strip()
            if not sep or name not in names:
                raise MoEInputError(f"Tuning: {item!r} is not field=value with a field of {sorted(names)}")
            value = value.strip()
            if name in ("tma", "local_rows", "pull_tokens"):
                if value.lower() not in ("0", "1", "true", "false"):
                    raise MoEInputError(f"Tuning: {name}={value!r} must be 0/1/true/false")
                kw[name] = value.lower() in ("1", "true")
            else:
                try:
                    kw[name] = int(value)
                except ValueError:
                    raise MoEInputError(f"Tuning: {name}={value!r} must be an integer") from None
        return cls(**kw)

    def describe(self) -> str:
        """The fields set, as ``parse`` reads them ("" for the defaults)."""
        return ",".join(f"{f.name}={int(v) if isinstance(v, bool) else v}" for f in fields(self)
                        if (v := getattr(self, f.name)) is not None)


@dataclass(frozen=True)
class MoEConfig:
    """What a user decides about the layer.

    megakernel:        the forward's dispatch, expert GEMMs, push and shared expert in one persistent
                       launch (True), or the sync-free path of separate launches (False); None (the
                       default): the megakernel where the precision has one (bf16), else the path
                       of separate launches. Resolved when the config is made: a made config's
                       ``megakernel`` is True or False.
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
    """

    megakernel: bool | None = None
    save_for_backward: bool = True
    max_wait_ms: float | None = None
    max_wait_polls: int | None = None
    debug: bool | None = None
    tuning: Tuning = field(default_factory=Tuning)
    precision: str = "bf16"
    cache_fp8_transposes: bool = True

    def __post_init__(self):
        if self.precision not in ("bf16", "fp8", "fp8-forward"):
            raise MoEInputError(f"MoEConfig(precision={self.precision!r}): must be 'bf16', 'fp8' or 'fp8-forward'")
        if self.megakernel is None:  # frozen: set once, here, before anything reads it
            object.__setattr__(self, "megakernel", self.precision == "bf16")
        if self.precision != "bf16" and self.megakernel is True:
            raise MoEInputError(f"MoEConfig(precision={self.precision!r}, megakernel=True): the forward megakernel "
                                "has no FP8 path yet; leave megakernel unset (or False): FP8 runs on the path of "
                                "separate launches")
        for name in ("megakernel", "save_for_backward", "cache_fp8_transposes"):
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

    def resolved_max_wait_ms(self) -> float:
        if self.max_wait_ms is not None:
            return float(self.max_wait_ms)
        return float(_env_number("TABBY_MAX_WAIT_MS", _DEFAULT_MAX_WAIT_MS))

    def resolved_max_wait_polls(self) -> int:
        if self.max_wait_polls is not None:
            return self.max_wait_polls
        return int(_env_number("TABBY_MAX_WAIT_POLLS", _DEFAULT_MAX_WAIT_POLLS))

    def resolved_debug(self) -> bool:
        if self.debug is not None:
            return self.debug
        return os.environ.get("TABBY_DEBUG", "0") == "1"


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
