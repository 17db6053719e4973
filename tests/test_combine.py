"""tabby/ops/combine.py under the interpreter: the k-order fp32 sum, for every block shape."""
import pytest
import torch

from tabby.ops.combine import combine_k


def _reference(rows, T, k, w, extra):
    """The same sum in the same order, in plain PyTorch: acc = sum_kk w * row (fp32, kk ascending).
    Kept in fp32: the interpreter's cast to bf16 rounds differently from torch's."""
    r = rows.view(T, k, -1).float()
    acc = torch.zeros(T, rows.shape[1])
    for kk in range(k):
        acc = acc + (r[:, kk] if w is None else w[:, kk, None] * r[:, kk])
    if extra is not None:
        acc = acc + extra.float()
    return acc


@pytest.mark.parametrize("with_w,with_extra", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("block,cols_fast", [((16, 256), False), ((16, 256), True), ((4, 32), True), ((2, 64), False), (None, True)])
def test_combine_is_the_k_order_sum(with_w, with_extra, block, cols_fast):
    g = torch.Generator().manual_seed(3)
    T, k, H = 37, 3, 80  # neither a multiple of the blocks
    rows = torch.randn(T * k, H, generator=g).to(torch.bfloat16)
    w = torch.rand(T, k, generator=g) if with_w else None
    extra = torch.randn(T, H, generator=g).to(torch.bfloat16) if with_extra else None
    got = combine_k(rows, T, k, w=w, extra=extra, dtype=torch.float32, block=block, cols_fast=cols_fast)
    assert torch.equal(got, _reference(rows, T, k, w, extra))
