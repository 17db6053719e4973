"""The memory check against the allocator (GPU): for bench shapes (one rank's share of EP8, the
buffers at their worst-case size, 16384 tokens) and each precision, the bytes one differentiated
call allocates beyond what was there before it (``torch.cuda.max_memory_allocated``) against the
description's (``memory.memory_needs``): what the forward holds for the backward plus the larger
pass's transients, plus the call's outputs (y, dx, the router-weight and weight gradients). The
check sums a pass's transients (an upper bound: the passes free buffers as they go), so the
measured peak is at most the check's: within a quarter of it in bf16, within half in FP8 (whose
backward's many quantized operands are freed one after another)."""
import pytest
import torch

import tabby
from tabby.functional import memory
from tabby.functional.moe import moe_with_probe
from tabby.functional.probe import Probe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = {"qwen3-30b-a3b@ep8": (2048, 768, 16, 8), "deepseek-v4-pro@ep8": (7168, 3072, 48, 6)}  # H, I, E_local, k
T = 16384


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("config", [tabby.MoEConfig(megakernel=True), tabby.MoEConfig(megakernel=False),
                                    tabby.MoEConfig(precision="fp8")], ids=["megakernel", "separate", "fp8"])
def test_the_check_bounds_what_a_call_allocates(shape, config):
    H, I, E, k = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(T, H, device="cuda", generator=g) / 4).bfloat16().requires_grad_(True)
    idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(64)]).repeat(T // 64, 1)
    w = torch.rand(T, k, device="cuda", generator=g).softmax(-1).requires_grad_(True)
    ws = [(torch.randn(E, I, H, device="cuda", generator=g) / H ** 0.5).bfloat16().requires_grad_(True),
          (torch.randn(E, I, H, device="cuda", generator=g) / H ** 0.5).bfloat16().requires_grad_(True),
          (torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5).bfloat16().requires_grad_(True)]
    dy = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    probe = Probe()

    def call():
        for t in (x, w, *ws):
            t.grad = None
        moe_with_probe(x, idx, w, *ws, config=config, probe=probe).backward(dy)

    call()  # the workspace, the ring and the FP8 weight copies (fixed weights) made once
    torch.cuda.synchronize()
    for t in (x, w, *ws):
        t.grad = None
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    needs = memory.memory_needs(probe.plan)
    outputs = sum(t.numel() * t.element_size() for t in (x, w, *ws)) + T * H * 2  # the gradients and y
    check = needs.kept + max(needs.forward, needs.backward) + outputs
    eager = needs.kept + max(needs.forward, needs.backward_owned) + outputs
    print(f"\n{shape} {config.precision} megakernel={config.megakernel}: measured {measured / 2**20:.1f} MiB, "
          f"the check's {check / 2**20:.1f} MiB (the eager backward's {eager / 2**20:.1f} MiB; kept "
          f"{needs.kept / 2**20:.1f}, forward {needs.forward / 2**20:.1f}, backward {needs.backward / 2**20:.1f} / "
          f"{needs.backward_owned / 2**20:.1f}, outputs {outputs / 2**20:.1f})")
    assert measured <= check
    # the bf16 passes' transients live together at their high point; the FP8 backward quantizes its
    # operands one after another and frees each after its GEMM, which the sum counts at once
    assert measured >= (0.75 if config.precision == "bf16" else 0.5) * eager
    tabby.free_workspaces()
