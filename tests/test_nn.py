"""tabby.nn: Experts (both layouts), the router, MoE (shared expert, gated shared expert, load
balancing), skipped sentinel ids and the weight converters, against tabby.moe_reference and plain
PyTorch; values and gradients, one rank and two simulated ranks."""
import pytest
import torch
import torch.nn.functional as F

import tabby
from tabby.functional.config import MoEConfig, Tuning
from tabby.functional.threads import run_ranks
from tabby.nn import MoE, Experts, convert, expert_load, route, skip_invalid_ids, split_gate_up

# Small tiles and dispatch blocks: the interpreter's time goes with the padded rows and programs.
CFG = MoEConfig(megakernel=False, tuning=Tuning(tile_m=16, dispatch_rows=16, dispatch_cols=64, dispatch_programs=4))
TOL = 2e-2  # bf16 against the fp32 reference
T, H, I, E, K = 16, 64, 32, 8, 2


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def rand(*shape, scale=None, gen=None):
    t = torch.randn(*shape, generator=gen)
    return (t / (shape[-1] ** 0.5 if scale is None else scale)).to(torch.bfloat16)


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def reference_grads(x, idx, w, wg, wu, wd, dy, shared=None):
    """y and the gradients of x, w, wg, wu, wd (and the shared weights) by tabby.moe_reference."""
    leaves = [leaf(t) for t in (x, w, wg, wu, wd)]
    sh = [leaf(t) for t in shared] if shared is not None else None
    y = tabby.moe_reference(leaves[0], idx, leaves[1], *leaves[2:], shared=sh)
    y.backward(dy)
    return y, [t.grad for t in leaves] + ([t.grad for t in sh] if sh else [])


def test_fused_layout_passes_views():
    ex = Experts(E, H, I, layout="fused")
    g, u, d = ex.weights()
    base = ex.gate_up_proj
    assert g.data_ptr() == base.data_ptr() and u.data_ptr() == base.data_ptr() + I * H * base.element_size()
    assert g.stride() == u.stride() == (2 * I * H, H, 1) and d is ex.down_proj
    assert torch.equal(g, base[:, :I]) and torch.equal(u, base[:, I:])
    sg, su = split_gate_up(base)
    assert sg.data_ptr() == g.data_ptr() and su.data_ptr() == u.data_ptr()


def test_experts_both_layouts_against_reference():
    gen = torch.Generator().manual_seed(1)
    x, dy = rand(T, H, gen=gen), rand(T, H, scale=1.0, gen=gen)
    vals, idx = torch.randn(T, E, generator=gen).topk(K, dim=1)
    w = vals.softmax(dim=1)
    wg, wu, wd = rand(E, I, H, gen=gen), rand(E, I, H, gen=gen), rand(E, H, I, gen=gen)
    y_ref, g_ref = reference_grads(x, idx, w, wg, wu, wd, dy)

    fused = Experts(E, H, I, layout="fused", config=CFG)
    sep = Experts(E, H, I, layout="separate", config=CFG)
    fused.load_state_dict(convert.tabby_to_transformers({"w_gate": wg, "w_up": wu, "w_down": wd}))
    sep.load_state_dict({"w_gate": wg, "w_up": wu, "w_down": wd})
    out = {}
    for name, m in (("fused", fused), ("separate", sep)):
        xl, wl = leaf(x), leaf(w)
        y = m(xl, idx, wl)
        y.backward(dy)
        out[name] = (y, xl.grad, wl.grad, *convert.transformers_to_tabby(
            {"gate_up_proj": m.gate_up_proj.grad, "down_proj": m.down_proj.grad} if name == "fused" else
            convert.tabby_to_transformers({"w_gate": m.w_gate.grad, "w_up": m.w_up.grad,
                                           "w_down": m.w_down.grad})).values())
    for a, b in zip(out["fused"], out["separate"]):  # the same kernels on the same numbers
        assert torch.equal(a, b)
    for name, got, want in zip(("y", "dx", "dw", "dwg", "dwu", "dwd"), out["fused"], (y_ref, *g_ref)):
        assert rel(got, want) < TOL, name


def test_experts_leading_dims_and_fp32_input():
    ex = Experts(E, H, I, layout="separate", config=CFG)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, T // 2, H, generator=gen)  # fp32 input: Tabby computes in bf16, returns fp32
    vals, idx = torch.randn(2, T // 2, E, generator=gen).topk(K, dim=-1)
    with torch.no_grad():
        y = ex(x, idx, vals.softmax(-1))
    ref = tabby.moe_reference(x.reshape(T, H).bfloat16(), idx.reshape(T, K), vals.softmax(-1).reshape(T, K),
                              ex.w_gate, ex.w_up, ex.w_down)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert rel(y.reshape(T, H), ref) < TOL


def test_sentinel_ids_contribute_nothing():
    gen = torch.Generator().manual_seed(3)
    x, dy = rand(T, H, gen=gen), rand(T, H, scale=1.0, gen=gen)
    vals, idx = torch.randn(T, E, generator=gen).topk(K, dim=1)
    w = vals.softmax(dim=1)
    bad = torch.zeros(T, K, dtype=torch.bool)
    bad[::3, 0] = True
    bad[1::4, 1] = True
    idx_s = idx.masked_fill(bad, E)  # transformers' EP sentinel
    idx_s[5, 1] = -1
    bad[5, 1] = True
    ex = Experts(E, H, I, layout="fused", config=CFG)
    xl, wl = leaf(x), leaf(w)
    y = ex(xl, idx_s, wl)
    y.backward(dy)
    wg, wu = split_gate_up(ex.gate_up_proj.detach())
    # the reference: the same slots with weight 0 (their expert ids are any valid ones)
    y_ref, (gx, gw, gg, gu, gd) = reference_grads(x, idx.masked_fill(bad, 0), w.masked_fill(bad, 0), wg, wu,
                                                  ex.down_proj.detach(), dy)
    assert rel(y, y_ref) < TOL and rel(xl.grad, gx) < TOL
    assert torch.all(wl.grad[bad] == 0) and rel(wl.grad[~bad], gw[~bad]) < TOL
    assert rel(ex.gate_up_proj.grad, torch.cat([gg, gu], dim=1)) < TOL and rel(ex.down_proj.grad, gd) < TOL
    # the mapping itself: valid ids kept, sentinels to this rank's experts with weight 0
    i2, w2 = skip_invalid_ids(idx_s, w, num_experts=E, first_local=E // 2, num_local=E // 2)  # rank 1 of 2
    assert torch.equal(i2[~bad], idx_s[~bad]) and torch.all((i2[bad] >= E // 2) & (i2[bad] < E))
    assert torch.equal(w2[bad], torch.zeros(int(bad.sum()))) and torch.equal(w2[~bad], w[~bad])


def _naive_route(logits, k, score_func, norm, scale, n_group, topk_group, bias):
    """Token by token, in plain Python loops."""
    idx_out, w_out = [], []
    for row in logits.float():
        s = row.softmax(-1) if score_func == "softmax" else row.sigmoid()
        c = s + (bias if bias is not None else 0)
        allowed = list(range(len(s)))
        if n_group:
            size = len(s) // n_group
            gs = [sorted(c[g * size:(g + 1) * size].tolist())[-2:] for g in range(n_group)]
            best = sorted(range(n_group), key=lambda g: -sum(gs[g]))[:topk_group]
            allowed = [e for e in allowed if e // size in best]
        chosen = sorted(allowed, key=lambda e: -c[e].item())[:k]
        w = s[chosen]
        if norm:
            w = w / w.sum()
        idx_out.append(chosen)
        w_out.append(w * scale)
    return torch.tensor(idx_out), torch.stack(w_out)


@pytest.mark.parametrize("score_func,norm,scale,groups,with_bias", [
    ("softmax", False, 1.0, None, False),
    ("softmax", True, 1.0, None, False),
    ("sigmoid", True, 2.5, (4, 2), True),
    ("sigmoid", False, 1.0, None, True),
])
def test_route_against_naive(score_func, norm, scale, groups, with_bias):
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(12, 16, generator=gen)
    bias = torch.randn(16, generator=gen) * 0.1 if with_bias else None
    n_group, topk_group = groups or (None, None)
    idx, w, _ = route(logits, 4, score_func=score_func, norm_topk_prob=norm, routed_scaling_factor=scale,
                      n_group=n_group, topk_group=topk_group, expert_bias=bias)
    nidx, nw = _naive_route(logits, 4, score_func, norm, scale, n_group, topk_group, bias)
    order = idx.sort(dim=1)
    norder = nidx.sort(dim=1)
    assert torch.equal(order.values, norder.values)
    assert torch.allclose(w.gather(1, order.indices), nw.gather(1, norder.indices), atol=1e-6)
    assert torch.equal(expert_load(idx, 16), torch.bincount(idx.flatten(), minlength=16).float())


def _plain_moe(m: MoE, x):
    """The MoE layer in plain PyTorch (fp32), from the module's own parameters."""
    x = x.float()
    idx, w, _ = route(F.linear(x, m.gate.weight.float()), m.top_k, score_func=m.score_func,
                      norm_topk_prob=m.norm_topk_prob, routed_scaling_factor=m.routed_scaling_factor,
                      n_group=m.n_group, topk_group=m.topk_group, expert_bias=m.expert_bias)
    wg, wu, wd = (t.float() for t in m.experts.weights())
    y = torch.zeros_like(x)
    for j in range(m.top_k):
        e = idx[:, j]
        h = F.silu(torch.einsum("th,tih->ti", x, wg[e])) * torch.einsum("th,tih->ti", x, wu[e])
        y = y + w[:, j:j + 1] * torch.einsum("ti,thi->th", h, wd[e])
    if m.shared_intermediate:
        sg, su, sd = (t.float() for t in m.shared_weights())
        ys = F.linear(F.silu(F.linear(x, sg)) * F.linear(x, su), sd)
        if m.shared_expert_gate is not None:
            ys = torch.sigmoid(F.linear(x, m.shared_expert_gate.weight.float())) * ys
        y = y + ys
    return y


@pytest.mark.parametrize("kind", ["qwen2", "deepseek"])
def test_moe_module_against_plain_pytorch(kind):
    torch.manual_seed(5)
    if kind == "qwen2":  # softmax, shared expert behind a sigmoid gate, aux loss
        m = MoE(H, I, E, K, score_func="softmax", norm_topk_prob=False, shared_intermediate=48, shared_gate=True,
                aux_loss_coef=0.01, layout="fused", config=CFG)
    else:  # sigmoid, groups, bias, scaling, shared expert inside Tabby's kernel
        m = MoE(H, I, E, K, score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, n_group=4,
                topk_group=2, load_balance_speed=1e-3, shared_intermediate=48, layout="separate", config=CFG)
        m.expert_bias.copy_(torch.randn(E) * 0.05)
    x = torch.randn(T, H).bfloat16()
    dy = torch.randn(T, H).bfloat16()
    xl = leaf(x)
    y, stats = m(xl)
    y.backward(dy)
    got = [xl.grad] + [p.grad for p in m.parameters()]
    params = list(m.parameters())
    for p in params:
        p.grad = None
    xr = leaf(x)
    y_ref = _plain_moe(m, xr)
    y_ref.backward(dy.float())
    want = [xr.grad] + [p.grad for p in params]
    assert rel(y, y_ref) < TOL
    names = ["x"] + [n for n, _ in m.named_parameters()]
    for name, g, r in zip(names, got, want):
        if name == "gate.weight":  # through the weights' bf16 rounding: looser
            assert rel(g, r) < 5e-2, name
        else:
            assert rel(g, r) < TOL, name
    assert torch.equal(stats.load, expert_load(route(F.linear(x.float(), m.gate.weight), K,
                                                     score_func=m.score_func, n_group=m.n_group,
                                                     topk_group=m.topk_group,
                                                     expert_bias=m.expert_bias)[0], E))
    assert stats.load.sum().item() == T * K
    if kind == "qwen2":
        assert stats.aux_loss is not None and stats.aux_loss.requires_grad and stats.expert_bias is None
    else:
        assert stats.aux_loss is None and stats.expert_bias is m.expert_bias
        # the training forward accumulated the load; update_bias moves towards balance and resets it
        assert torch.equal(m.tokens_per_expert, stats.load)
        before = m.expert_bias.clone()
        m.update_bias()
        load = stats.load
        assert torch.allclose(m.expert_bias - before, 1e-3 * torch.sign(load.mean() - load), atol=1e-7)
        assert torch.all(m.tokens_per_expert == 0)


def test_update_bias_centered():
    m = MoE(H, I, E, K, load_balance_speed=0.01, config=CFG)
    load = torch.tensor([5.0, 1, 1, 1, 0, 0, 0, 8])
    m.update_bias(load=load, center=True)
    step = 0.01 * torch.sign(load.mean() - load)
    assert torch.allclose(m.expert_bias, step - step.mean())


@pytest.mark.parametrize("W", [1, 2, 4])
def test_converters_round_trip_any_rank(W):
    gen = torch.Generator().manual_seed(6)
    Et = 8
    hf = {"gate_up_proj": torch.randn(Et, 2 * I, H, generator=gen), "down_proj": torch.randn(Et, H, I, generator=gen)}
    tt = convert.tabby_to_torchtitan(convert.transformers_to_tabby(hf))
    assert set(tt) == {"w1_EFD", "w2_EDF", "w3_EFD"}
    assert torch.equal(tt["w1_EFD"], hf["gate_up_proj"][:, :I]) and torch.equal(tt["w3_EFD"], hf["gate_up_proj"][:, I:])
    assert torch.equal(tt["w2_EDF"], hf["down_proj"])
    for layout in ("separate", "fused"):
        shards_hf = [convert.transformers_to_tabby(hf, r, W, layout=layout) for r in range(W)]
        shards_tt = [convert.torchtitan_to_tabby(tt, r, W, layout=layout) for r in range(W)]
        for a, b in zip(shards_hf, shards_tt):
            assert all(torch.equal(a[k], b[k]) for k in a)
            assert next(iter(a.values())).shape[0] == Et // W
        back = convert.gather([convert.tabby_to_transformers(s) for s in shards_hf])
        assert all(torch.equal(back[k], hf[k]) for k in hf)
        back_tt = convert.gather([convert.tabby_to_torchtitan(s) for s in shards_tt])
        assert all(torch.equal(back_tt[k], tt[k]) for k in tt)
    old = convert.tabby_to_torchtitan(convert.transformers_to_tabby(hf), old_names=True)
    assert set(old) == {"w1", "w2", "w3"}
    assert torch.equal(convert.torchtitan_to_tabby(old)["w_up"], hf["gate_up_proj"][:, I:])
    with pytest.raises(tabby.MoEInputError):
        convert.transformers_to_tabby(hf, 0, 3)


def test_moe_two_simulated_ranks_against_reference():
    """MoE with its experts sharded over 2 ranks (weights from one transformers checkpoint through
    the converters): every rank's y and the gathered expert gradients match one process running
    the reference on all tokens."""
    W, Tr = 2, 8
    gen = torch.Generator().manual_seed(7)
    hf = {"gate_up_proj": rand(E, 2 * I, H, gen=gen), "down_proj": rand(E, H, I, gen=gen)}
    gate_w = torch.randn(E, H, generator=gen) * 0.1
    x = rand(W * Tr, H, scale=1.0, gen=gen)
    dy = rand(W * Tr, H, scale=1.0, gen=gen)

    def rank_fn(r, group):
        m = MoE(H, I, E, K, norm_topk_prob=True, layout="fused", group=group, config=CFG)
        m.experts.load_state_dict(convert.transformers_to_tabby(hf, r, W, layout="fused"))
        with torch.no_grad():
            m.gate.weight.copy_(gate_w)
        xr = leaf(x[r * Tr:(r + 1) * Tr])
        y, _ = m(xr)
        y.backward(dy[r * Tr:(r + 1) * Tr])
        return y.detach(), xr.grad, {"gate_up_proj": m.experts.gate_up_proj.grad, "down_proj": m.experts.down_proj.grad}

    outs = run_ranks(W, rank_fn)
    idx, w, _ = route(F.linear(x.float(), gate_w), K, norm_topk_prob=True)
    wg, wu = split_gate_up(hf["gate_up_proj"])
    y_ref, (gx, _, gg, gu, gd) = reference_grads(x, idx, w, wg, wu, hf["down_proj"], dy)
    assert rel(torch.cat([o[0] for o in outs]), y_ref) < TOL
    # dx through the experts only (the router's share of dx comes via the weights: checked above)
    grads = convert.gather([o[2] for o in outs])
    assert rel(grads["gate_up_proj"], torch.cat([gg, gu], dim=1)) < TOL
    assert rel(grads["down_proj"], gd) < TOL


@pytest.mark.parametrize("dim,concatenated", [(1, True), (2, True), (2, False)],
                         ids=["fused-rows", "transposed", "interleaved"])
def test_gate_up_halves_backward_hands_a_whole_gradient_over_without_a_copy(dim, concatenated):
    """gate_up_halves' backward: where the two gradients are the halves of one tensor laid out as the
    fused weight (what the layer's eager backward writes for fused halves and gpt-oss's interleaved
    weights), the fused weight's gradient is that very tensor (its storage); otherwise a stack, equal
    to unbind's."""
    from tabby.nn.experts import _halves, gate_up_halves

    made = {}

    class Writer(torch.autograd.Function):  # a backward writing both gradients into one tensor, as the layer's
        @staticmethod
        def forward(ctx, g, u):
            return g.sum() + u.sum()

        @staticmethod
        def backward(ctx, dy):
            whole = torch.arange(3 * 8 * 10, dtype=torch.float32).reshape(3, 8, 10).clone()  # (not a view)
            made["ptr"] = whole.data_ptr()
            return _halves(whole, dim, concatenated)

    t = torch.randn(3, 8, 10, requires_grad=True)
    Writer.apply(*gate_up_halves(t, dim, concatenated)).backward()
    assert t.grad.data_ptr() == made["ptr"]
    assert torch.equal(t.grad, torch.arange(3 * 8 * 10, dtype=torch.float32).reshape(3, 8, 10))
    t2 = torch.randn(3, 8, 10, requires_grad=True)
    g, u = gate_up_halves(t2, dim, concatenated)
    a, b = torch.randn_like(g), torch.randn_like(u)
    (g * a + u * b).sum().backward()
    t3 = t2.detach().clone().requires_grad_(True)
    g3, u3 = (t3.unflatten(dim, (2, t3.shape[dim] // 2)).unbind(dim) if concatenated else
              t3.unflatten(dim, (t3.shape[dim] // 2, 2)).unbind(dim + 1))
    (g3 * a + u3 * b).sum().backward()
    assert torch.equal(t2.grad, t3.grad)
