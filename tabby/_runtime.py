"""Where Tabby's kernels run: compiled for the GPU, or under Triton's interpreter on CPU tensors.

Triton chooses between the two when a function is decorated with ``@triton.jit`` (it reads
``triton.knobs.runtime.interpret``, i.e. ``TRITON_INTERPRET``, at decoration time), and
``import triton`` itself decorates the functions of ``triton.language`` (``tl.sum``,
``tl.zeros``, ...). So the choice is made here, when ``tabby`` is imported and before any of its
kernels is defined (``tabby/__init__.py`` imports this module first):

- ``TRITON_INTERPRET`` set, or ``triton.knobs.runtime.interpret`` assigned: the user's choice holds;
- otherwise, no usable GPU (``torch.cuda.is_available()`` is False): the interpreter, by setting
  ``TRITON_INTERPRET=1`` for this process (and its children);
- otherwise: compiled kernels.

Under the interpreter, if ``triton`` was imported while it was off, the functions of
``triton.language`` were decorated for the compiler and no interpreted kernel could call them;
they are re-made as interpreted functions.

``INTERPRET`` records the result; ``tabby.ops`` re-exports it for the kernels' host code.
Under the interpreter, :func:`_patch_interpreter_index` also fixes one numpy 2.4 incompatibility
of Triton 3.6's interpreter (see there).
"""
from __future__ import annotations

import logging
import os
import sys
import types

import torch

from .validate import MoEInputError

logger = logging.getLogger("tabby")

_ENV = "TRITON_INTERPRET"


def _user_choice() -> bool:
    """Whether the user chose compiled or interpreted kernels (environment or triton.knobs)."""
    if _ENV in os.environ:
        return True
    triton = sys.modules.get("triton")
    knobs = getattr(triton, "knobs", None)
    return knobs is not None and "interpret" in vars(knobs.runtime)


def _reinterpret_loaded_triton() -> int:
    """Re-make the ``@triton.jit`` functions of an already imported ``triton.language`` as
    interpreted functions; returns how many were replaced.

    They live as attributes of the ``triton.language`` modules and as methods of ``tl.tensor``
    (``x.sum()``); jit functions call one another through their module's globals, so replacing
    the attributes replaces the calls too. Each function is replaced by one object everywhere.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    made: dict[int, tuple[JITFunction, InterpretedFunction]] = {}  # the old object kept: ids stay unique

    def swap(namespace_owner, namespace: dict) -> None:
        for name, value in list(namespace.items()):
            if isinstance(value, JITFunction):
                if id(value) not in made:
                    made[id(value)] = (value, InterpretedFunction(value.fn))
                setattr(namespace_owner, name, made[id(value)][1])

    for mod_name, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType):
            continue
        if mod_name != "triton.language" and not mod_name.startswith("triton.language."):
            continue
        swap(module, vars(module))
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__.startswith("triton.language"):
                swap(value, vars(value))
    return len(made)


def _select_interpreter() -> bool:
    selected = not _user_choice() and not torch.cuda.is_available()
    if selected:
        os.environ[_ENV] = "1"
    import triton

    interpret = bool(triton.knobs.runtime.interpret)
    # triton imported before the interpreter was on: its library cannot run in interpreted kernels
    replaced = _reinterpret_loaded_triton() if interpret else 0
    if selected:
        logger.info("no usable GPU: Tabby's kernels run under Triton's interpreter on CPU tensors "
                    "(%s=1 set for this process)", _ENV)
    if replaced:
        logger.info("triton was imported before the interpreter was selected: %d triton.language "
                    "functions re-made as interpreted functions", replaced)
    return interpret


def _scalar_index(self) -> int:
    return int(self.handle.data.item())


def _patch_interpreter_index() -> None:
    """Make ``range(n)`` over a runtime scalar ``n`` work under the interpreter with numpy >= 2.4.

    Triton 3.6's interpreter holds every scalar as a 1-element array of shape (1,) and, for the
    duration of each interpreted call, gives ``tl.tensor`` the method
    ``__index__ = lambda self: int(self.handle.data)`` (triton/runtime/interpreter.py:888, in
    ``_patch_lang_tensor``). numpy 2.4 refuses ``int()`` of an array with ndim > 0 (deprecated
    since numpy 1.25, which warns on every call), so a kernel loop over a runtime bound, such as
    ``for p in range(W)``, fails with "only 0-dimensional arrays can be converted to Python
    scalars". This wraps ``_patch_lang_tensor`` so that, after Triton installs its methods (in
    the same scope, undone after the call), ``__index__`` converts through ``.item()``, which
    gives the same integer for any 1-element array on every numpy version. Only under the
    interpreter; where ``_patch_lang_tensor`` does not exist (another Triton), nothing is done.
    """
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "tabby_scalar_index", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _scalar_index)

    patch_lang_tensor.tabby_scalar_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor


INTERPRET: bool = _select_interpreter()
if INTERPRET:
    _patch_interpreter_index()


def check_device(device: torch.device) -> None:
    """Raise :class:`MoEInputError` when Tabby's kernels cannot run on tensors of ``device``."""
    if device.type != "cpu" or INTERPRET:
        return
    if torch.cuda.is_available():
        raise MoEInputError(
            "tabby.moe got CPU tensors, but its kernels are compiled for the GPU in this process: "
            "move the tensors to the GPU (x.cuda(), ...), or, to run on the CPU under Triton's "
            f"interpreter (slow; meant for tests), set {_ENV}=1 before importing tabby or triton")
    raise MoEInputError(
        f"tabby.moe got CPU tensors, no GPU is usable and {_ENV}={os.environ.get(_ENV)!r} turned "
        f"Triton's interpreter off: unset {_ENV} (tabby then selects the interpreter) or set it to 1, "
        "before importing tabby or triton")
