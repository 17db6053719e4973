"""torch.ops.tabby.moe, the layer's one implementation: every entry (tabby.moe, the operator eager and
compiled, tabby.nn.Experts) bitwise equal, torch.library.opcheck, torch.compile(fullgraph=True) of a
block that calls it (one graph holding the operator; the same bits as eager), the recompute path,
the eager backward's ownership of the kept rows, and the group/config strings. On the GPU where there is one (the
same checks of the compiled kernels), else on the CPU under the interpreter."""
import pytest
import torch
import torch.nn.functional as F

from torch._dynamo.backends.debugging import aot_eager

import tabby
from tabby.functional import custom_op as co
from tabby.functional.config import config_string, parse_config
from tabby.functional.config import MoEConfig, Tuning
from tabby.functional.threads import ThreadGroup, ThreadRank
from tabby.nn import Experts

CFG = MoEConfig(megakernel=False, tuning=Tuning(tile_m=16, dispatch_rows=16, dispatch_cols=64, dispatch_programs=4))
# The megakernel with a short ring and few programs: the interpreter's time goes with the tickets.
MEGA = MoEConfig(tuning=Tuning(ring_rows=256, programs=2, dispatch_programs=4))
T, H, I, E, K, I_S = 16, 64, 32, 8, 2, 48
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def problem(seed, shared=True):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(torch.bfloat16)  # noqa: E731
    vals, idx = torch.randn(T, E, generator=g).topk(K, dim=1)
    sh = (r(I_S, H), r(I_S, H), r(H, I_S)) if shared else None
    return on_device((r(T, H), idx, vals.softmax(dim=1), (r(E, I, H), r(E, I, H), r(E, H, I)), sh, r(T, H)))


def on_device(prob):
    """The problem's tensors on DEVICE (made on the CPU from one generator: the same values either way)."""
    return tuple(t.to(DEVICE) if isinstance(t, torch.Tensor) else None if t is None else tuple(u.to(DEVICE) for u in t)
                 for t in prob)


def run(fn, prob, config, **kw):
    """y and every gradient of one forward + backward through ``fn`` (tabby.moe's signature)."""
    x, idx, w, ws, sh, dy = prob
    leaves = [t.clone().requires_grad_(True) for t in (x, w, *ws)]
    sl = [t.clone().requires_grad_(True) for t in sh] if sh is not None else None
    y = fn(leaves[0], idx, leaves[1], *leaves[2:], shared=sl, config=config, **kw)
    y.backward(dy)
    return [y] + [t.grad for t in leaves] + ([t.grad for t in sl] if sl else [])


@pytest.mark.parametrize("config", [
    None, MoEConfig(megakernel=False), CFG, MoEConfig(precision="fp8", megakernel=False),
    MoEConfig(save_for_backward=False, debug=True, max_wait_ms=5.5),
    MoEConfig(tuning=Tuning(group_m=2, tma=False, pull_tokens=True), max_wait_polls=100),
])
def test_config_string_round_trip(config):
    text = config_string(config)
    assert parse_config(text) == (config or MoEConfig())
    assert config_string(None) == "" and config_string(MoEConfig()) == ""


def test_config_string_carries_every_field():
    """Each MoEConfig field set away from its default comes back from the string (none dropped)."""
    import dataclasses

    changed = {"megakernel": False, "save_for_backward": False, "max_wait_ms": 7.0, "max_wait_polls": 9,
               "debug": True, "tuning": Tuning(tile_m=32), "precision": "fp8", "cache_fp8_transposes": False,
               "activation": tabby.Activation("gpt-oss", limit=7.0, alpha=1.702)}
    assert set(changed) == {f.name for f in dataclasses.fields(MoEConfig)}
    config = MoEConfig(**changed)
    assert parse_config(config_string(config)) == config


def test_no_tokens():
    """T = 0 through tabby.moe (what tabby.nn and the integrations call): an empty y, an empty dx and
    zero weight gradients."""
    x, idx, w, ws, sh, _ = problem(3)
    prob = (x[:0], idx[:0], w[:0], ws, sh, x[:0])
    got = run(tabby.moe, prob, CFG)
    assert got[0].shape == (0, H) and got[1].shape == (0, H) and got[2].shape == (0, K)
    assert all(not g.any() for g in got[3:])


def _fp8_problem(shared):
    g = torch.Generator().manual_seed(5)
    Tq, Hq, Iq, Eq = 8, 128, 128, 2
    r = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(torch.bfloat16)  # noqa: E731
    vals, idx = torch.randn(Tq, Eq, generator=g).topk(1, dim=1)
    sh = (r(48, Hq), r(48, Hq), r(Hq, 48)) if shared else None
    return on_device((r(Tq, Hq), idx, vals.softmax(dim=1), (r(Eq, Iq, Hq), r(Eq, Iq, Hq), r(Eq, Hq, Iq)), sh,
                      r(Tq, Hq)))


FP8 = MoEConfig(precision="fp8", megakernel=False)


def _entries(config):
    """Every way a user reaches the layer, each taking tabby.moe's arguments: tabby.moe (eager: its
    backward owns the kept rows), the operator called directly (its backward operator reads them),
    tabby.moe compiled with fullgraph=True (one graph holding the operator), tabby.nn.Experts."""
    graphs = []

    def counting_aot_eager(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    def operator(x, idx, w, wg, wu, wd, shared=None, config=None):
        sh = tuple(shared) if shared is not None else (None, None, None)
        return torch.ops.tabby.moe(x, idx, w, wg, wu, wd, *sh, "", config_string(config), True)[0]

    def experts(x, idx, w, wg, wu, wd, shared=None, config=None):
        module = Experts(wg.shape[0], wg.shape[2], wg.shape[1], layout="separate", config=config, skip_invalid=False,
                         device=x.device)
        # the module run with the leaves as its parameters: their gradients reach the leaves
        return torch.func.functional_call(module, {"w_gate": wg, "w_up": wu, "w_down": wd}, (x, idx, w),
                                          {"shared": shared})

    compiled = torch.compile(lambda *a, **kw: tabby.moe(*a, **kw), fullgraph=True, backend=counting_aot_eager)
    return {"tabby.moe": tabby.moe, "torch.ops.tabby.moe": operator, "compiled": compiled, "nn.Experts": experts}, \
        graphs


@pytest.mark.parametrize("name,config,shared", [("megakernel", MEGA, True), ("separate", CFG, True),
                                                ("separate-no-shared", CFG, False), ("fp8", FP8, True),
                                                ("fp8-forward", MoEConfig(precision="fp8-forward",
                                                                          megakernel=False), False)])
def test_every_entry_gives_the_same_bits(name, config, shared):
    """tabby.moe, torch.ops.tabby.moe (eager and compiled) and tabby.nn.Experts on the same inputs:
    bitwise equal y and every gradient (the shared expert's too), both paths and FP8."""
    prob = _fp8_problem(shared) if config.precision != "bf16" else problem(5, shared=shared)
    entries, graphs = _entries(config)
    results = {entry: run(fn, prob, config) for entry, fn in entries.items()}
    want = results["tabby.moe"]
    for entry, got in results.items():
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (entry, i)
    assert len(graphs) == 1
    assert any(n.target in (torch.ops.tabby.moe, torch.ops.tabby.moe.default) for n in graphs[0].graph.nodes)
    x, idx, w, ws, sh, _ = prob
    ref = (tabby.moe_reference if config.precision == "bf16" else tabby.moe_reference_fp8)(x, idx, w, *ws, shared=sh)
    assert ((want[0].float() - ref.float()).norm() / ref.float().norm()) < 2e-2
    if config.precision != "bf16":
        bf16 = run(tabby.moe, prob, CFG)
        assert not torch.equal(want[0], bf16[0])  # FP8 was used, not dropped from the config
    torch._dynamo.reset()


def test_the_eager_backward_owns_the_kept_rows(monkeypatch):
    """tabby.moe's eager backward takes the kept rows from autograd (``owned``: freed as it goes) and
    runs once; under other saved-tensor hooks (checkpointing, offloading) it leaves them alone."""
    seen = []
    real = co._backward_pass
    monkeypatch.setattr(co, "_backward_pass", lambda *a, **kw: seen.append(kw["owned"]) or real(*a, **kw))
    x, idx, w, ws, _, dy = problem(6, shared=False)
    xl = x.clone().requires_grad_(True)
    y = tabby.moe(xl, idx, w, *ws, config=CFG)
    y.backward(dy, retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        y.backward(dy)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        y = tabby.moe(x.clone().requires_grad_(True), idx, w, *ws, config=CFG)
    y.backward(dy)
    assert seen == [True, False]


def test_opcheck_fp8():
    """The FP8 operator's schema, fake kernels (E4M3 kept rows and their scales) and autograd."""
    x, idx, w, ws, sh, _ = _fp8_problem(True)
    args = (x, idx, w.requires_grad_(), *(t.requires_grad_() for t in ws), *(t.requires_grad_() for t in sh), "",
            config_string(MoEConfig(precision="fp8", megakernel=False)), True)
    # (opcheck's test_aot_dispatch_dynamic sums every output, and torch has no sum of E4M3 tensors;
    # compiling forward and backward through AOT dispatch is test_fp8_through_the_operator's)
    with co.zero_padding():
        result = torch.library.opcheck(torch.ops.tabby.moe.default, args, test_utils=(
            "test_schema", "test_autograd_registration", "test_faketensor"))
    assert set(result.values()) == {"SUCCESS"}, result


def test_memory_check_through_the_operator(monkeypatch):
    """The operator makes its workspace and plan as tabby.moe does: after the memory check."""
    from tabby.functional import memory

    monkeypatch.setattr(memory, "free_device_bytes", lambda device: 1024)
    x, idx, w, ws, _, _ = problem(4, shared=False)
    big = torch.cat([x] * 5)  # a shape no earlier test made a workspace for
    with pytest.raises(tabby.TabbyMemoryError, match="needs"):
        tabby.moe(big, torch.cat([idx] * 5), torch.cat([w] * 5), *ws, config=CFG)


def test_group_names():
    from tabby.functional import resolve as co

    assert co.group_name(None) == "" and co.resolve_group("") is None
    tg = ThreadGroup(2)
    ranks = [ThreadRank(tg, 0), ThreadRank(tg, 1)]
    names = [co.group_name(r) for r in ranks]
    assert names[0] != names[1] and [co.resolve_group(n) for n in names] == ranks
    with pytest.raises(tabby.MoEInputError):
        co.resolve_group("tabby.threads:0:0")


def test_sync_free_path_and_recompute():
    """The path of separate launches, through the operator with save=False (the forward keeps no
    routed rows, the backward recomputes them): the bits of tabby.moe (which keeps them); the same
    without grad."""
    prob = problem(1, shared=False)
    want = run(tabby.moe, prob, CFG)

    x, idx, w, ws, _, dy = prob
    cstr = config_string(CFG)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, *ws)]
    out = torch.ops.tabby.moe(leaves[0], idx, leaves[1], *leaves[2:], None, None, None, "", cstr, False)
    assert all(t.numel() == 0 for t in out[6:])  # nothing kept: the backward recomputes the rows
    out[0].backward(dy)
    for i, (a, b) in enumerate(zip([out[0]] + [t.grad for t in leaves], want)):
        assert torch.equal(a, b), i
    with torch.no_grad():
        y = tabby.moe(x, idx, w, *ws, config=CFG)
    assert torch.equal(y, want[0])


def test_opcheck():
    x, idx, w, ws, sh, _ = problem(2)
    args = (x, idx, w.requires_grad_(), *(t.requires_grad_() for t in ws), *(t.requires_grad_() for t in sh), "",
            config_string(CFG), True)
    with co.zero_padding():  # opcheck compares every output, the kept buffers' padding rows too
        result = torch.library.opcheck(torch.ops.tabby.moe.default, args, test_utils=(
            "test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    assert set(result.values()) == {"SUCCESS"}, result


class Block(torch.nn.Module):
    """A residual MoE block: norm, router (softmax top-k), Tabby's experts."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(H, dtype=torch.bfloat16)
        self.router = torch.nn.Linear(H, E, bias=False, dtype=torch.bfloat16)
        self.experts = Experts(E, H, I, layout="fused", config=CFG)
        self.to(DEVICE)

    def forward(self, x):
        h = self.norm(x)
        w, idx = F.softmax(self.router(h).float(), dim=-1).topk(K, dim=-1)
        return x + self.experts(h, idx, w / w.sum(-1, keepdim=True))


def test_compile_fullgraph_no_graph_break():
    torch.manual_seed(3)
    block = Block()
    x = torch.randn(2, T // 2, H).bfloat16().to(DEVICE)

    def step(fn):
        xl = x.clone().requires_grad_(True)
        y = fn(xl)
        y.float().square().sum().backward()
        grads = [xl.grad] + [p.grad.clone() for p in block.parameters()]
        block.zero_grad(set_to_none=True)
        return [y.detach()] + grads

    want = step(block)
    graphs = []

    def counting_aot_eager(gm, example_inputs):  # fullgraph=True raises on a graph break; count too
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    got = step(torch.compile(block, fullgraph=True, backend=counting_aot_eager))
    assert len(graphs) == 1
    assert any(n.target in (torch.ops.tabby.moe, torch.ops.tabby.moe.default) for n in graphs[0].graph.nodes)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i
    torch._dynamo.reset()


def test_selective_checkpointing_names_the_op():
    """Selective activation checkpointing with a policy that saves torch.ops.tabby.moe: the
    recomputation in the backward reruns the rest of the block but not Tabby's forward, and the
    gradients are the same bits."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.tabby.moe.default:
                Count.calls += 1
            return func(*args, **(kwargs or {}))

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.tabby.moe.default else CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(4)
    block = Block()
    x = torch.randn(T, H).bfloat16().to(DEVICE)

    def step(checkpointed):
        xl = x.clone().requires_grad_(True)
        with Count():
            if checkpointed:
                y = checkpoint(block, xl, use_reentrant=False,
                               context_fn=lambda: create_selective_checkpoint_contexts(policy))
            else:
                y = block(xl)
            y.float().square().sum().backward()
        grads = [y.detach(), xl.grad] + [p.grad.clone() for p in block.parameters()]
        block.zero_grad(set_to_none=True)
        return grads

    want = step(False)
    Count.calls = 0
    got = step(True)
    assert Count.calls == 1  # saved, not recomputed
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i
