"""fast_interpreter.py changes the interpreter's speed, not its results: the numpy xor_sum is the
interpreter's own element-by-element reduction, bit for bit, and kernels that call jit functions
(of their module and of triton.language) give the same results launch after launch, with the
language restored after each."""
import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's")


@pytest.mark.parametrize("np_dtype,dtype", [(np.int8, tl.int8), (np.int16, tl.int16), (np.int32, tl.int32),
                                            (np.int64, tl.int64), (np.uint32, tl.uint32)])
def test_xor_sum_is_the_generic_reduction(np_dtype, dtype):
    from triton.runtime import interpreter

    rng = np.random.default_rng(0)
    info = np.iinfo(np_dtype)
    scope = interpreter._patch_lang(_twice.fn)  # the language as inside a launch (the combine runs in it)
    try:
        for shape in ([2] * 5, [4, 8], [16], [2, 4, 2]):
            data = rng.integers(info.min, info.max, size=shape, dtype=np_dtype, endpoint=True)
            for axis in [None, *range(len(shape))]:
                for keep in (False, True):
                    ops = interpreter.ReduceOps(axis, tl.standard._xor_combine, keep)
                    x = ops.to_tensor(data, dtype)
                    fast, = ops.apply((x,))
                    slow, = ops.generic_reduce((x,))
                    assert fast.type == slow.type, (shape, axis, keep)
                    assert fast.handle.data.dtype == slow.handle.data.dtype
                    assert np.array_equal(fast.handle.data, slow.handle.data), (shape, axis, keep)
    finally:
        scope.restore()


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _sort_kernel(x_ptr, out_ptr, xs_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, _twice(tl.sort(x)))
    tl.store(xs_ptr, tl.xor_sum(x, axis=0))


def test_kernels_calling_jit_functions_are_right_launch_after_launch():
    load = tl.load
    for seed, N in ((0, 256), (1, 32), (2, 256)):
        x = torch.randint(-2**31, 2**31 - 1, (N,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
        out, xs = torch.empty_like(x), torch.zeros(1, dtype=torch.int32)
        _sort_kernel[(1,)](x, out, xs, N=N)
        assert torch.equal(out, x.sort().values * 2)
        assert int(xs) == int(np.bitwise_xor.reduce(x.numpy()))
        assert tl.load is load  # the launch's patch of the language is undone
