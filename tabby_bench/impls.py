"""The implementations the benchmark measures, by name (:data:`IMPLS`).

An implementation's ``prepare(inputs, group)`` runs outside timing and returns an object with
``run_fwd()``, ``run_fwdbwd()`` and ``check(with_grads) -> {name: relative error}``.

Registered here: ``floor`` (the compute-only floor), the anchors ``torch-a2a`` and ``torch-symm``,
``tabby`` (``tabby.moe``, the forward megakernel) and ``tabby-sync-free`` (the path of separate
launches); outside the default set, the FP8 rows ``torch-fp8`` (anchor), ``tabby-fp8`` and
``tabby-fp8-one-copy`` (its weights' transposes never held).
:func:`register_tabby` registers both Tabby rows again with a ``Tuning`` (the bench's ``--tuning``).
Modules named in the environment variable TABBY_BENCH_PLUGINS are imported and may
:func:`register` more (spawned workers import this module afresh, so a registration must happen
when some module is imported).

By default every timed call of a layer starts from a new weight version (``LayerRun``; the
bench's ``--weights fixed`` keeps one): as in a training step with one forward per optimizer
step, a layer that derives something from its weights pays for it on every call. For the FP8 rows that is quantizing the weights: ``torch-fp8`` does it on
every call anyway; ``tabby-fp8`` caches its FP8 copies per weight version and so makes them again.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

import tabby
from tabby.functional.config import MoEConfig, Tuning

from .anchors.floor import floor_errors, floor_forward, floor_fwdbwd, prepare_floor
from .anchors.torch_a2a import moe_torch_a2a
from .anchors.torch_fp8 import moe_torch_fp8, quantize_mode
from .anchors.torchao_fp8 import moe_torchao_fp8, torchao_version
from .anchors.torch_symm import moe_torch_symm
from .check import layer_errors
from .shapes import Inputs


def new_weight_version(inp: Inputs) -> None:
    """Mark the weights as changed in place, without touching their values (no kernel): each one's
    ``_version`` goes up as after an optimizer step, so a layer that keeps what it derives from a
    weight version (Tabby's FP8 copies, ``tabby/functional/fp8.py``) derives it again."""
    for w in inp.weights():
        torch.autograd.graph.increment_version(w)


class LayerRun:
    """A prepared layer implementation: ``fn(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group=)``.

    Each timed call (``run_fwd``, ``run_fwdbwd``) starts from a new weight version
    (:func:`new_weight_version`; unless ``new_weights`` is False), as a training step with one forward per optimizer step does:
    every row pays for whatever it derives from the weights (the FP8 rows: quantizing them) on
    every call. ``check`` calls the layer once, on the weights as they are."""

    new_weights = True  # the bench's ``--weights new``; False: one weight version over the timed calls

    def __init__(self, fn, inp: Inputs, group, device_errors=None):
        self.fn, self.inp, self.group, self.device_errors = fn, inp, group, device_errors

    def run_fwd(self):
        if self.new_weights:
            new_weight_version(self.inp)
        self.fn(*self.inp.args(), group=self.group)  # graph built, then dropped

    def run_fwdbwd(self):
        if self.new_weights:
            new_weight_version(self.inp)
        y = self.fn(*self.inp.args(), group=self.group)
        torch.autograd.grad(y, self.inp.leaves(), self.inp.dy, allow_unused=True)  # returned, not accumulated

    def check(self, with_grads: bool) -> dict:
        errors = layer_errors(self.fn, self.inp, self.group, with_grads)
        self.raise_device_errors()
        return errors

    def raise_device_errors(self) -> None:
        """Raise what the layer recorded on the device (a timed-out bounded wait, a bad expert id):
        its outputs, and any time measured with it, are invalid (a wait that gave up returns early)."""
        if self.device_errors is not None:
            self.device_errors()


@dataclass
class LayerImpl:
    """An implementation with moe_reference's signature."""

    name: str
    fn: object
    anchor: bool = False
    supports_cpu: bool = True
    isolate: bool = False  # run in worker processes of its own
    in_default: bool = True
    device_errors: object = None  # raises if the layer recorded an error on the device (host sync)
    tuning: str = ""  # the tabby.Tuning it runs with, as Tuning.describe() writes it
    precision: str = "bf16"  # of its GEMMs' operands: the check's tolerance (check.TOLERANCE)
    note: object = None  # () -> str: how it ran in this process, recorded as each record's "note"

    def prepare(self, inp: Inputs, group):
        return LayerRun(self.fn, inp, group, self.device_errors)


class FloorRun:
    def __init__(self, problem):
        self.p = problem

    def run_fwd(self):
        floor_forward(self.p)

    def run_fwdbwd(self):
        floor_fwdbwd(self.p)

    def check(self, with_grads: bool) -> dict:
        return floor_errors(self.p, with_grads)


@dataclass
class FloorImpl:
    """The compute-only floor; its routing (a collective) happens in prepare, outside timing."""

    name: str = "floor"
    anchor: bool = False
    supports_cpu: bool = True
    isolate: bool = False
    in_default: bool = True
    tuning: str = ""

    def prepare(self, inp: Inputs, group):
        return FloorRun(prepare_floor(inp.x, inp.topk_idx, inp.w_gate, inp.w_up, inp.w_down, inp.shared, group,
                                      generator=inp.generator))


@dataclass
class BrokenImpl:
    """Stands for an implementation that could not be set up, so the failure shows up in the results."""

    name: str
    reason: str
    anchor: bool = False
    supports_cpu: bool = True
    isolate: bool = False
    in_default: bool = True
    tuning: str = ""

    def prepare(self, inp, group):
        raise RuntimeError(self.reason)


IMPLS: dict = {}


def register(impl) -> None:
    """Add (or replace) an implementation under ``impl.name``."""
    IMPLS[impl.name] = impl


def register_layer(name: str, fn, **kw) -> None:
    """Register a function with moe_reference's signature (``group=`` keyword) as ``name``."""
    register(LayerImpl(name, fn, **kw))


# Tabby's FP8 layer holds its weights in E4M3 in both orientations between steps (the default,
# ``cache_fp8_transposes``): 6 bytes a parameter with the bf16 weights and their gradients. Where
# that passes this share of the GPU's memory (deepseek-v4-pro at EP1 on one H200: 152 GB) the row
# makes the transposes in each backward instead, and its note says so.
FP8_HOLD_SHARE = 0.8
_FP8_CONFIGS = {hold: MoEConfig(precision="fp8", cache_fp8_transposes=hold) for hold in (True, False)}
_fp8_held = [True]


def fp8_transposes_fit(x, *weights) -> bool:
    """Whether the weights, their gradients and both E4M3 orientations (6 bytes a parameter) fit
    in FP8_HOLD_SHARE of x's GPU."""
    room = torch.cuda.get_device_properties(x.device).total_memory if x.is_cuda else float("inf")
    return 6 * sum(w.numel() for w in weights) <= FP8_HOLD_SHARE * room


def tabby_fp8(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None, group=None):
    """``tabby.moe`` with precision="fp8", its weight transposes cached where they fit (FP8_HOLD_SHARE)."""
    _fp8_held[-1] = hold = fp8_transposes_fit(x, w_gate, w_up, w_down)
    return tabby.moe(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=shared, group=group,
                     config=_FP8_CONFIGS[hold])


def tabby_fp8_one_copy(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None, group=None):
    """``tabby.moe`` with precision="fp8" and one E4M3 copy of each weight (its transposes never held)."""
    return tabby.moe(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=shared, group=group,
                     config=_FP8_CONFIGS[False])


def register_tabby(tuning: Tuning | None = None) -> None:
    """Register "tabby" (the default config: the forward megakernel) and "tabby-sync-free" (the path of
    separate launches), both with ``tuning`` (None: the heuristics decide everything)."""
    tuning = tuning or Tuning()
    for name, megakernel in (("tabby", True), ("tabby-sync-free", False)):
        config = MoEConfig(megakernel=megakernel, tuning=tuning)
        register_layer(name, functools.partial(tabby.moe, config=config), device_errors=tabby.check_errors,
                       tuning=tuning.describe())


def load_plugins() -> None:
    """Import the modules named in TABBY_BENCH_PLUGINS (comma list); they call :func:`register`."""
    import importlib

    for name in filter(None, (n.strip() for n in os.environ.get("TABBY_BENCH_PLUGINS", "").split(","))):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 -- show up as a failed implementation, not a crash
            register(BrokenImpl(name, f"importing plugin {name} failed: {type(e).__name__}: {e}"))


register(FloorImpl())
register_layer("torch-a2a", moe_torch_a2a, anchor=True)
register_layer("torch-symm", moe_torch_symm, anchor=True, supports_cpu=False, isolate=True)
register_tabby()
# FP8 rows, outside the default matrix (checked at the FP8 tolerance): torch-a2a with
# torch._scaled_grouped_mm (quantization fused by torch.compile), and Tabby's FP8 layer (the path
# of separate launches); with new weight versions (the default) both quantize the weights on
# every timed call (LayerRun)
register_layer("torch-fp8", moe_torch_fp8, anchor=True, supports_cpu=False, in_default=False, precision="fp8",
               note=lambda: f"quantization {quantize_mode()}")
# torchao's FP8 MoE training GEMM (rowwise, its Triton quantization), where torchao imports
register_layer("torchao-fp8", moe_torchao_fp8, anchor=True, supports_cpu=False, in_default=False, precision="fp8",
               note=lambda: f"torchao {torchao_version()}")
register_layer("tabby-fp8", tabby_fp8, device_errors=tabby.check_errors, in_default=False, precision="fp8",
               note=lambda: "weight transposes " + ("cached" if _fp8_held[-1] else
                                                    "not held: the dgrads read the forward copies transposed"))
# Tabby's FP8 layer holding one E4M3 copy of each weight (cache_fp8_transposes=False) on every shape: beside
# tabby-fp8, what holding the transposes buys where they fit
register_layer("tabby-fp8-one-copy", tabby_fp8_one_copy, device_errors=tabby.check_errors, in_default=False,
               precision="fp8", note=lambda: "one E4M3 copy of each weight: the dgrads read it transposed")
load_plugins()


def default_impls() -> list:
    return [n for n, impl in IMPLS.items() if getattr(impl, "in_default", True)]
