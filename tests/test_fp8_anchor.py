"""The FP8 rows of the benchmark: the ``torch-fp8`` anchor (torch._scaled_grouped_mm, rowwise
scales) and ``tabby-fp8``, checked by the benchmark's own check against the fp32 reference with an
FP8 tolerance (values and every gradient). GPU only; without one, torch-fp8 refuses clearly."""
from __future__ import annotations

import pytest
import torch

import tabby
from tabby_bench.anchors.torch_fp8 import moe_torch_fp8, unavailable_reason
from tabby_bench.impls import IMPLS
from tabby_bench.shapes import Shape, make_inputs

# E4M3 against fp32: a few per cent (tabby's FP8 layer: ~5-7e-2 on random inputs; rowwise
# scales over a whole row of K are coarser than 1x128 tiles)
FP8_TOL = 1e-1
QWEN_LIKE = Shape("qwen3-30b-a3b-small", 128, 2048, 768, 8)
FEW_EXPERTS = Shape("few-experts", 16, 1024, 512, 4, I_shared=256)
# gpt-oss-120b's widths, H = I = 2880 (22.5 x 128: partial last tiles), with fewer experts
GPT_OSS_LIKE = Shape("gpt-oss-120b-small", 32, 2880, 2880, 4)


def test_torch_fp8_refuses_clearly_where_it_cannot_run():
    reason = unavailable_reason()
    if reason is None:
        pytest.skip("torch-fp8 can run here")
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    w = torch.zeros(2, 32, 32, dtype=torch.bfloat16)
    with pytest.raises(tabby.MoEInputError, match="torch-fp8"):
        moe_torch_fp8(x, torch.zeros(4, 1, dtype=torch.int64), torch.ones(4, 1), w, w, w)


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"torch-fp8: {unavailable_reason()}")
@pytest.mark.parametrize("impl", ["torch-fp8", "tabby-fp8"])
@pytest.mark.parametrize("shape", [QWEN_LIKE, FEW_EXPERTS, GPT_OSS_LIKE], ids=lambda s: s.name)
def test_fp8_rows_one_gpu(impl, shape):
    inp = make_inputs(shape, 2048, 1, 0, torch.device("cuda", 0))
    errs = IMPLS[impl].prepare(inp, None).check(with_grads=True)
    print(f"FP8 row {impl} {shape.name} T=2048 errors against fp32: {({k: round(v, 4) for k, v in errs.items()})}")
    assert errs and all(v < FP8_TOL for v in errs.values()), errs
    # and it is FP8: further from fp32 than bf16 is
    assert errs["y"] > 1e-2, errs
