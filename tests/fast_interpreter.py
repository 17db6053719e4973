"""Two changes to the speed (only) of Triton's interpreter, which runs every kernel of the CPU tests.

1. ``tl.xor_sum``: the interpreter hands sums, minima and maxima to numpy but reduces with any
   other combine function one element at a time in Python; ``tl.sort`` does an xor_sum per
   compare-and-swap step, and the schedule's place kernel sorts a chunk of 256 entries per source
   rank on every forward (about half of the suite's time went there). The same reduction by numpy:
   xor is exact and associative, so the bits are the same (``test_fast_interpreter.py``).
2. The language patch of device-function calls: the interpreter patches ``triton.language`` (every
   builtin of ``tl``, ``tl.core``, ``tl.math``, ``tl.tensor``, found by ``inspect.getmembers``) at
   the start of a launch, and again at every call of a ``@triton.jit`` function inside it, although
   nothing is restored before the launch ends (a third of a megakernel's interpreted time). Here a
   call whose modules were patched already in this launch skips the repeat; the launch's own patch
   and its restore at the end are unchanged.

What the kernels compute, and what the interpreter checks, is untouched. ``install()`` is
idempotent; conftest.py calls it when TRITON_INTERPRET=1.
"""
import threading


def _fast_xor_sum(interpreter):
    import numpy as np
    import triton.language as tl

    ops = interpreter.ReduceOps
    generic = ops.apply_impl

    def apply_impl(self, input):
        if self.combine_fn == tl.standard._xor_combine and len(input) == 1:
            data, axis = input[0].handle.data, self.axis
            if axis is None:  # as generic_reduce: over the flattened tensor (kept as [1])
                data, axis = data.reshape(-1), 0
            return self.to_tensor(np.bitwise_xor.reduce(data, axis=axis, keepdims=self.keep_dims), input[0].dtype)
        return generic(self, input)

    ops.apply_impl = apply_impl


def _patch_once_per_launch(interpreter):
    import inspect

    import triton.language as tl

    patch_lang = interpreter._patch_lang
    grid_call = interpreter.GridExecutor.__call__
    local = threading.local()  # (launches of several threads are serialized: tabby.functional.threads)
    langs_of = {}

    def langs(fn):
        key = langs_of.get(fn)
        if key is None:  # as _patch_lang finds them: the triton.language modules fn sees
            key = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                           if inspect.ismodule(v) and v in (tl, tl.core))
        return key

    def patch_lang_once(fn):
        done = getattr(local, "done", None)
        if done is None:  # not inside a launch
            return patch_lang(fn)
        key = langs(fn)
        if key in done:  # patched earlier in this launch; nothing restored since
            return interpreter._LangPatchScope()
        scope = patch_lang(fn)
        done.add(key)
        return scope

    def call(self, *args, **kwargs):
        outer = getattr(local, "done", None)
        local.done = set()  # the launch's own patch (restored when it ends) is the first
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            local.done = outer

    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = call


def install():
    from triton.runtime import interpreter

    if getattr(interpreter, "_tabby_tests_fast", False):
        return
    _fast_xor_sum(interpreter)
    _patch_once_per_launch(interpreter)
    interpreter._tabby_tests_fast = True
