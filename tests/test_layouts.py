"""Expert weights in the transposed layouts, read in place (``validate.weights_layout``): "kn" (views of
gate_up_proj [E, H, 2I] with the gate columns first and down_proj [E, I, H], the OpenAI privacy
filter's) and "kn-paired" (gate and up columns interleaved, gpt-oss's). The layer against
``tabby.moe_reference`` on the same views, values and the gradients of the fused parameters (and of
the biases, laid out alike), on the CPU (kernels interpreted, ranks as threads): EP1 and EP2, odd
widths, an expert without rows, every row on one expert; bitwise repeat; the views' storage is the
parameters' (no copy); layouts that are none of these refused by name. The GPU cases:
test_layouts_gpu.py."""
import pytest
import torch
from harness import make_problem, rel_err, run_ranks

import tabby
from tabby.activation import Activation
from tabby.functional.config import MoEConfig, Tuning
from tabby.validate import MoEInputError, weights_layout

CUDA = torch.cuda.is_available()
cpu_only = pytest.mark.skipif(CUDA, reason="CPU harness (interpreted kernels, simulated ranks)")
SMALL = dict(tile_m=16, dispatch_rows=16, dispatch_cols=64, dispatch_programs=4)
GPT_OSS = Activation("gpt-oss", limit=7.0, alpha=1.702)


NK_FUSED = "nk-fused"  # Tabby's layout as halves of one gate_up [E, 2I, H] (transformers' plain families): "nk"


def fused(ws, bs, layout):
    """(gate_up [E, H, 2I], down [E, I, H], gate_up_bias [E, 2I], down_bias [E, H]) holding Tabby's
    (w_gate, w_up, w_down) and (b_gate, b_up, b_down) in ``layout`` ("kn": gate columns first;
    "kn-paired": g and u interleaved; ``NK_FUSED``: gate_up [E, 2I, H], gate rows first, and down
    [E, H, I])."""
    wg, wu, wd = ws
    bg, bu, bd = bs
    if layout == NK_FUSED:
        return torch.cat([wg, wu], 1), wd.clone(), torch.cat([bg, bu], 1), bd.clone()
    if layout == "kn":
        gate_up, bias = torch.cat([wg, wu], 1), torch.cat([bg, bu], 1)
    else:
        gate_up, bias = torch.stack([wg, wu], 2).flatten(1, 2), torch.stack([bg, bu], 2).flatten(1, 2)
    return gate_up.transpose(1, 2).contiguous(), wd.transpose(1, 2).contiguous(), bias.contiguous(), bd.clone()


def views(gate_up, down, bias, down_bias, layout):
    """Tabby's (w_gate, w_up, w_down) and biases as views of the fused tensors (no copy)."""
    if layout == NK_FUSED:
        I = gate_up.shape[1] // 2
        return tuple(gate_up.unflatten(1, (2, I)).unbind(1)) + (down,), tuple(bias.unflatten(1, (2, I)).unbind(1)) + (
            down_bias,)
    E, H, I2 = gate_up.shape
    I = I2 // 2
    if layout == "kn":
        g, u = gate_up.unflatten(2, (2, I)).unbind(2)
        b_g, b_u = bias.unflatten(1, (2, I)).unbind(1)
    else:
        g, u = gate_up.unflatten(2, (I, 2)).unbind(3)
        b_g, b_u = bias.unflatten(1, (I, 2)).unbind(2)
    return (g.transpose(1, 2), u.transpose(1, 2), down.transpose(1, 2)), (b_g, b_u, down_bias)


def problem(W, T, H, I, E_local, k, seed, route="random", empty_expert=True):
    x, idx, wts, ws, _, dy = make_problem(W, T, H, I, E_local, k, seed=seed, route=route)
    if empty_expert:
        idx = torch.where(idx == 1, 2, idx)  # expert 1: no rows
    g = torch.Generator().manual_seed(seed + 1)
    bs = tuple((torch.randn(W * E_local, n, generator=g) * 0.5).bfloat16() for n in (I, I, H))
    return x, idx, wts, ws, bs, dy


def run_layer(prob, layout, cfg, W, biases=True):
    """Every rank's tabby.moe on views of its share of the fused tensors: [y, dx, d topk_weights,
    d gate_up, d down, (d gate_up_bias, d down_bias)], the ranks' rows / experts concatenated."""
    x, idx, wts, ws, bs, dy = prob
    T, E_local = x.shape[0] // W, ws[0].shape[0] // W
    params = fused(ws, bs, layout)

    def rank_fn(r, group):
        rows, ex = slice(r * T, (r + 1) * T), slice(r * E_local, (r + 1) * E_local)
        lv = [t[rows].clone().requires_grad_(True) for t in (x, wts)]
        lv += [t[ex].clone().requires_grad_(True) for t in (params if biases else params[:2])]
        w3, b3 = views(*lv[2:4], *(lv[4:] if biases else params[2:]), layout)
        assert weights_layout(*w3) == layout
        y = tabby.moe(lv[0], idx[rows], lv[1], *w3, group=group, config=cfg, biases=b3 if biases else None)
        y.backward(dy[rows])
        return [y.detach()] + [t.grad for t in lv]

    res = run_ranks(W, rank_fn)
    return [torch.cat([r[i] for r in res]).float() for i in range(len(res[0]))]


def run_reference(prob, layout, act=None, biases=True):
    x, idx, wts, ws, bs, dy = prob
    params = fused(ws, bs, layout)
    lv = [t.float().requires_grad_(True) for t in (x, wts, *(params if biases else params[:2]))]
    w3, b3 = views(*lv[2:4], *(lv[4:] if biases else [p.float() for p in params[2:]]), layout)
    y = tabby.moe_reference(lv[0], idx, lv[1], *w3, activation=act, biases=b3 if biases else None)
    y.backward(dy.float())
    return [y.detach()] + [t.grad for t in lv]


def compare(got, want, tol=2e-2):
    names = ["y", "dx", "d topk_weights", "d gate_up", "d down", "d gate_up_bias", "d down_bias"]
    assert len(got) == len(want)
    errs = {n: rel_err(a, b) for n, a, b in zip(names, got, want)}
    assert all(e < tol for e in errs.values()), errs
    return errs


@cpu_only
@pytest.mark.parametrize("layout", ["kn", "kn-paired"])
@pytest.mark.parametrize("W,act,biases", [(1, None, False), (1, GPT_OSS, True), (2, GPT_OSS, True),
                                          (2, None, True)], ids=["ep1-swiglu", "ep1-gpt-oss-biases",
                                                                 "ep2-gpt-oss-biases", "ep2-swiglu-biases"])
def test_transposed_layouts_match_the_reference(layout, W, act, biases):
    # odd widths: H 40 (not a multiple of the K block), I 20 (2I = 40 columns interleaved)
    prob = problem(W, 9, 40, 20, 3 if W == 1 else 2, 2, seed=3 + W)
    cfg = MoEConfig(tuning=Tuning(**SMALL), **({} if act is None else dict(activation=act)))
    compare(run_layer(prob, layout, cfg, W, biases), run_reference(prob, layout, act, biases))


@cpu_only
@pytest.mark.parametrize("layout", ["kn", "kn-paired"])
def test_every_row_on_one_expert(layout):
    prob = problem(1, 16, 32, 24, 3, 2, seed=8, route="one_expert", empty_expert=False)
    cfg = MoEConfig(tuning=Tuning(**SMALL), activation=GPT_OSS)
    compare(run_layer(prob, layout, cfg, 1), run_reference(prob, layout, GPT_OSS))


@cpu_only
def test_bitwise_repeatable():
    prob = problem(1, 9, 32, 24, 3, 2, seed=5)
    cfg = MoEConfig(tuning=Tuning(**SMALL), activation=GPT_OSS)
    a, b = run_layer(prob, "kn-paired", cfg, 1), run_layer(prob, "kn-paired", cfg, 1)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_layouts_are_recognized_and_others_refused():
    E, H, I = 2, 16, 8
    gate_up, down = torch.zeros(E, H, 2 * I, dtype=torch.bfloat16), torch.zeros(E, I, H, dtype=torch.bfloat16)
    bias, down_bias = torch.zeros(E, 2 * I, dtype=torch.bfloat16), torch.zeros(E, H, dtype=torch.bfloat16)
    for layout in ("kn", "kn-paired"):
        w3, _ = views(gate_up, down, bias, down_bias, layout)
        assert weights_layout(*w3) == layout
        assert all(w.untyped_storage().data_ptr() in (gate_up.untyped_storage().data_ptr(),
                                                      down.untyped_storage().data_ptr()) for w in w3)
    w3, _ = views(gate_up, down, bias, down_bias, "kn")
    assert weights_layout(*(w.contiguous() for w in w3)) == "nk"
    x = torch.zeros(4, H, dtype=torch.bfloat16)
    idx, wts = torch.zeros(4, 1, dtype=torch.int64), torch.ones(4, 1)
    with pytest.raises(MoEInputError, match="none of Tabby's layouts"):  # transposed gate/up, plain down
        tabby.moe(x, idx, wts, w3[0], w3[1], w3[2].contiguous())
    g, u = gate_up.unflatten(2, (I, 2)).unbind(3)
    with pytest.raises(MoEInputError, match="none of Tabby's layouts"):  # g and u of different tensors
        tabby.moe(x, idx, wts, g.transpose(1, 2), u.clone().transpose(1, 2), w3[2])


@cpu_only
def test_transposed_weights_refuse_the_megakernel():
    prob = problem(1, 9, 32, 24, 3, 2, seed=5)
    with pytest.raises(RuntimeError, match="'kn-paired' layout run on the path of separate launches"):
        run_layer(prob, "kn-paired", MoEConfig(tuning=Tuning(**SMALL), megakernel=True), 1,
                  biases=False)  # (a rank's MoEInputError)


@cpu_only
@pytest.mark.parametrize("layout", ["kn", "kn-paired"])
def test_fp8_quantizes_transposed_weights_as_tabby_layout(layout):
    """FP8 reads the weights once a version, into its E4M3 copies, from wherever they lie: the same bits
    as the same experts in Tabby's layout, every output and gradient (the weights' laid out alike)."""
    prob = problem(1, 9, 256, 128, 3, 2, seed=3)
    cfg = MoEConfig(tuning=Tuning(**dict(SMALL, tile_m=128)), precision="fp8", activation=GPT_OSS)
    got = run_layer(prob, layout, cfg, 1, biases=False)
    x, idx, wts, ws, bs, dy = prob

    def rank_fn(r, group):
        lv = [t.clone().requires_grad_(True) for t in (x, wts, *ws)]
        y = tabby.moe(lv[0], idx, lv[1], *lv[2:], group=group, config=cfg)
        y.backward(dy)
        return [y.detach()] + [t.grad for t in lv]

    y, dx, dw, dwg, dwu, dwd = run_ranks(1, rank_fn)[0]
    d_gate_up, d_down = fused((dwg, dwu, dwd), bs, layout)[:2]
    assert all(torch.equal(a, b.float()) for a, b in zip(got, (y, dx, dw, d_gate_up, d_down)))


@cpu_only
@pytest.mark.parametrize("layout", ["kn", "kn-paired"])
def test_compiled_training_step_is_eager_bitwise(layout):
    """A training step on the fused parameters under torch.compile(fullgraph=True): every gradient
    equals the eager step's bit for bit."""
    prob = problem(1, 9, 32, 24, 3, 2, seed=6)
    x, idx, wts, ws, bs, dy = prob
    cfg = MoEConfig(tuning=Tuning(**SMALL), activation=GPT_OSS)

    def step(x, wts, gate_up, down, bias, down_bias):
        w3, b3 = views(gate_up, down, bias, down_bias, layout)
        y = tabby.moe(x, idx, wts, *w3, config=cfg, biases=b3)
        return (y.float() * dy.float()).sum()

    outs = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        lv = [t.clone().requires_grad_(True) for t in (x, wts, *fused(ws, bs, layout))]
        fn(*lv).backward()
        outs.append([t.grad for t in lv])
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@cpu_only
@pytest.mark.parametrize("layout", ["nk", "kn", "kn-paired"])
def test_backward_operator_fake_has_the_real_strides(layout):
    """The backward operator's fake (meta) gradients have the real ones' shapes and strides: the
    weight gradients of transposed weights are transposed tensors (``backward.weight_grad_layout``,
    what the fused parameters' gradients read in order), Tabby's layout's contiguous."""
    from tabby.functional import custom_op
    from tabby.functional.moe import config_string

    x, idx, wts, ws, bs, dy = problem(1, 9, 32, 24, 3, 2, seed=7)
    if layout == "nk":
        w3, b3 = ws, bs
    else:
        w3, b3 = views(*fused(ws, bs, layout), layout)
    cstr = config_string(MoEConfig(tuning=Tuning(**SMALL)))
    out = torch.ops.tabby.moe(x, idx, wts, *w3, None, None, None, "", cstr, True, False, *b3)
    args = (dy, x, wts, *w3, None, None, None, *out[1:], "", cstr, True, *b3)
    real = torch.ops.tabby.moe_backward(*args)
    fake = custom_op._moe_backward_fake(*args)
    assert [(t.shape, t.stride()) for t in real] == [(t.shape, t.stride()) for t in fake]
    assert real[2].is_contiguous() == (layout == "nk")


def test_the_plan_names_the_layout_and_its_path():
    from tabby.functional.plan import make_plan
    from tabby.validate import MoEDims

    for layout, biases in (("kn", False), ("kn-paired", True)):
        # (qwen3-30b-a3b's widths: H and I multiples of 64, the transposed weights on the ws GEMMs)
        dims = MoEDims(T=16384, H=2048, k=8, E_local=16, I=768, world_size=1, I_shared=0, biases=biases,
                       layout=layout)
        plan = make_plan(dims, MoEConfig(activation=GPT_OSS), torch.device("cpu"), sms=132, arch=90)
        text = plan.describe()
        assert f"weights {layout}" in text and ("biases" in text) == biases, text
        assert plan.mega is None and plan.gemm["gate_up"].core == "ws" and "gate_up_swiglu_ws_kernel" in text, text
    plan = make_plan(MoEDims(T=16384, H=2048, k=8, E_local=16, I=768, world_size=2, I_shared=0),
                     MoEConfig(activation=Activation("relu2")), torch.device("cpu"), sms=132, arch=90)
    assert "no gate" in plan.describe() and plan.mega is None and plan.gemm["gate_up"].core == "ws"
    plain = make_plan(MoEDims(T=16384, H=2048, k=8, E_local=16, I=768, world_size=1, I_shared=0), MoEConfig(),
                      torch.device("cpu"), sms=132, arch=90)
    assert "ws" in {k.core for k in plain.gemm.values() if hasattr(k, "core")} and "weights nk" in plain.describe()


@pytest.mark.parametrize("interleaved", [True, False], ids=["gpt-oss", "privacy-filter"])
@pytest.mark.parametrize("W", [1, 2])
def test_gpt_oss_converters_round_trip_and_run_alike(interleaved, W):
    """``tabby.nn.convert.gpt_oss_to_tabby`` (Tabby's layout made once, with the biases) and back,
    exactly, for any rank; the converted experts loaded into ``tabby.nn.Experts(bias=True)`` compute
    what the layer computes on the fused tensors read in place."""
    from tabby.nn import Experts, convert

    layout = "kn-paired" if interleaved else "kn"
    x, idx, wts, ws, bs, _ = problem(1, 9, 32, 24, 4, 2, seed=12)
    gate_up, down, bias, down_bias = fused(ws, bs, layout)
    state = dict(gate_up_proj=gate_up, down_proj=down, gate_up_proj_bias=bias, down_proj_bias=down_bias)
    for tabby_layout in ("separate", "fused"):
        shards = [convert.gpt_oss_to_tabby(state, r, W, tabby_layout, interleaved) for r in range(W)]
        back = convert.gather([convert.tabby_to_gpt_oss(s, interleaved) for s in shards])
        assert all(torch.equal(back[k], state[k]) for k in state)
    mine = convert.gpt_oss_to_tabby(state, interleaved=interleaved)
    assert all(torch.equal(mine[k], t) for k, t in zip(("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"),
                                                         (*ws, *bs)))
    if CUDA:
        return
    cfg = MoEConfig(tuning=Tuning(**SMALL), activation=GPT_OSS)
    ex = Experts(4, 32, 24, layout="fused", bias=True, config=cfg, dtype=torch.bfloat16)
    ex.load_state_dict(convert.gpt_oss_to_tabby(state, layout="fused", interleaved=interleaved))
    w3, b3 = views(gate_up, down, bias, down_bias, layout)
    in_place = tabby.moe(x, idx, wts, *w3, config=cfg, biases=b3)
    assert rel_err(ex(x, idx, wts).float(), in_place.float()) < 1e-2


def test_ws_descriptors_find_each_expert_where_it_lies():
    """The warp-specialized GEMMs see a 3-D weight as rows of its descriptor, expert e's from row
    e * pitch (bf16_ws._pitch): I for Tabby's contiguous weights, 2I for a half of a fused gate_up_proj
    [E, 2I, H] (the rows between are the other half's), H for the transposed layouts' [E, H, I] views
    of gate_up_proj [E, H, 2I] (either order); None where an expert does not start on a row."""
    from tabby.nn.experts import gate_up_halves
    from tabby.ops.gemm.bf16_ws import _pitch

    E, I, H = 3, 24, 40
    w = torch.zeros(E, I, H)
    assert _pitch(w) == I
    g, u = gate_up_halves(torch.zeros(E, 2 * I, H), 1)
    assert _pitch(g) == _pitch(u) == 2 * I
    kn = gate_up_halves(torch.zeros(E, H, 2 * I), 2)  # as the kernel reads them: [E, H, I], rows of H
    assert _pitch(kn[0]) == _pitch(kn[1]) == H
    g = gate_up_halves(torch.zeros(E, H, 2 * I), 2, concatenated=False)[0]  # interleaved: read whole from g's
    assert _pitch(g.as_strided((E, H, 2 * I), (g.stride(0), g.stride(1), 1))) == H
    assert _pitch(torch.zeros(E, H, I).transpose(1, 2)) is None  # unit stride along the rows: not rows of B
    odd = torch.zeros(E * (I * H + 3)).as_strided((E, I, H), (I * H + 3, H, 1))
    assert _pitch(odd) is None  # experts I * H + 3 elements apart: not on a row
