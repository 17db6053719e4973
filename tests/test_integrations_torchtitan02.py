"""torchtitan 0.2.x (the releases that import with torch 2.11) with Tabby's routed experts
(``tabby.integrations.torchtitan02``): a ``MoE`` block of torchtitan's own, its forward through Tabby
against its own (for-loop experts), output and every gradient, the load-balancing count kept;
``score_before_experts`` and expert parallelism refused. Runs where torchtitan 0.2.x imports (the CI
installs 0.3.0, whose integration test_integrations_torchtitan.py checks; this file then skips)."""
import copy

import pytest
import torch

torchtitan = pytest.importorskip("torchtitan")
if not str(getattr(torchtitan, "__version__", "")).startswith("0.2"):
    pytest.skip(f"torchtitan {getattr(torchtitan, '__version__', '?')} is not 0.2.x", allow_module_level=True)

from torchtitan.models.moe import MoE, MoEArgs  # noqa: E402

import tabby.integrations.torchtitan02 as tabby_tt02  # noqa: E402
from tabby.functional.config import MoEConfig, Tuning  # noqa: E402
from tabby.functional.moe import config_string  # noqa: E402
from tabby.validate import MoEInputError  # noqa: E402

CUDA = torch.cuda.is_available()
CFG = "" if CUDA else config_string(MoEConfig(megakernel=False, tuning=Tuning(tile_m=16, dispatch_rows=16,
                                                                                dispatch_cols=64, dispatch_programs=4)))


@pytest.fixture(autouse=True)
def cpu_histc(monkeypatch):
    """torchtitan 0.2.x's router counts tokens with torch.histc on int64 ids, which the CPU does not
    implement: there the ids are counted as floats (the same counts)."""
    if not CUDA:
        real = torch.histc
        monkeypatch.setattr(torch, "histc", lambda t, *a, **k: real(t.float(), *a, **k).to(t.dtype))


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _block(shared: int, before: bool = False, dim=64, hidden=32, E=8, k=2):
    args = MoEArgs(num_experts=E, num_shared_experts=shared, top_k=k, score_func="softmax", route_norm=True,
                   score_before_experts=before, use_grouped_mm=False)
    torch.manual_seed(0)
    m = MoE(args, dim=dim, hidden_dim=hidden)
    with torch.no_grad():
        m.init_weights(0.05, torch.device("cpu"))
    dev = "cuda" if CUDA else "cpu"
    return m.to(device=dev, dtype=torch.bfloat16)


@pytest.mark.parametrize("shared", [0, 1])
def test_moe_block_on_tabby_matches_torchtitan(shared):
    ref = _block(shared)
    ours = tabby_tt02.apply(copy.deepcopy(ref), CFG)
    dev = next(ref.parameters()).device
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 12, 64, generator=g).to(dev, torch.bfloat16)
    dy = torch.randn(2, 12, 64, generator=g).to(dev, torch.bfloat16)
    outs = []
    for m in (ref, ours):
        xs = x.clone().requires_grad_(True)
        y = m(xs)
        y.backward(dy)
        outs.append([y.detach(), xs.grad] + [p.grad for _, p in sorted(m.named_parameters())]
                    + [m.tokens_per_expert.clone()])
    names = ["y", "dx"] + [n for n, _ in sorted(ref.named_parameters())] + ["tokens_per_expert"]
    errs = {n: rel(a, b) for n, a, b in zip(names, outs[1], outs[0])}
    assert all(e < 3e-2 for e in errs.values()), errs
    assert torch.equal(outs[0][-1], outs[1][-1])  # the same routing counted


def test_refusals():
    with pytest.raises(MoEInputError, match="score_before_experts"):
        tabby_tt02.apply(_block(0, before=True))
    with pytest.raises(MoEInputError, match="no torchtitan"):
        tabby_tt02.apply(torch.nn.Linear(2, 2))
