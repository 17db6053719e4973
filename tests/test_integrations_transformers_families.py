"""transformers' MoE families through the "tabby" experts backend: for each family whose experts
are not plain SwiGLU (clamped SwiGLU: DeepSeek-V4, GLM-5-next, HY-V4, Step-3.7; gpt-oss's gate:
MiniMax-M3-VL; GeGLU: Gemma 4, DiffusionGemma) and three plain ones (Qwen3-MoE, Mixtral,
DeepSeek-V3), a tiny config of the real transformers class, its experts module run by transformers'
own eager experts and by Tabby: output and every gradient (hidden states, routing weights,
gate_up_proj, down_proj, and the biases where there are some) compared, and the family reported as
running on Tabby with the activation its gate computes. gpt-oss and the OpenAI privacy filter
(transposed weights, biases; gpt-oss's gate and up interleaved) run on Tabby too, their weights read
in place, and Nemotron-H's ungated experts (relu(up x)^2). No family of transformers 5.17 falls back;
experts whose activation is none of Tabby's (a Nemotron-H with SiLU) fall back to transformers'
grouped_mm, with the reason.

The inputs put every g and u on a grid of 1/8 (x in {-1, 0, 1}, gate_up_proj in {-2..2} / 8: exact
in bf16) and the clamp limits at 17/16, off the grid: a clamp's gradient jumps at its limit, and no
value lies within rounding of it, so transformers' bf16 gate and Tabby's fp32 epilogue clip the
same entries."""
import copy
import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

import tabby.integrations.transformers as tabby_hf  # noqa: E402
from tabby.activation import Activation  # noqa: E402
from tabby.functional.config import MoEConfig, Tuning  # noqa: E402

CFG = MoEConfig(megakernel=False, tuning=Tuning(tile_m=16, dispatch_rows=16, dispatch_cols=64, dispatch_programs=4))
TOL = 3e-2  # bf16 (transformers computes the gate in bf16, Tabby in fp32)
LIMIT = 1.0625
H, I, E, K, T = 64, 32, 4, 2, 24


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# family: (config class, config kwargs, experts class, extra ctor kwargs, the activation Tabby must find)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(moe_intermediate_size=I, num_experts=E), "Qwen3MoeExperts", {},
                  Activation()),
    "mixtral": ("MixtralConfig", dict(intermediate_size=I, num_local_experts=E), "MixtralExperts", {}, Activation()),
    "deepseek_v3": ("DeepseekV3Config", dict(moe_intermediate_size=I, n_routed_experts=E), "DeepseekV3Experts", {},
                    Activation()),
    "deepseek_v4": ("DeepseekV4Config", dict(moe_intermediate_size=I, n_routed_experts=E, swiglu_limit=LIMIT),
                    "DeepseekV4Experts", {}, Activation("swiglu-clamp", limit=LIMIT)),
    "glm5_next": ("Glm5NextTextConfig", dict(moe_intermediate_size=I, n_routed_experts=E, swiglu_limit=LIMIT),
                  "Glm5NextTextExperts", {}, Activation("swiglu-clamp", limit=LIMIT)),
    "hy_v4": ("HYV4Config", dict(moe_intermediate_size=I, n_routed_experts=E, swiglu_limit=LIMIT), "HYV4Experts", {},
              Activation("swiglu-clamp", limit=LIMIT)),
    "step3p7": ("Step3p7TextConfig", dict(moe_intermediate_size=I, n_routed_experts=E), "Step3p7Experts",
                dict(swiglu_limit=LIMIT), Activation("swiglu-clamp-out", limit=LIMIT)),
    "minimax_m3_vl": ("MiniMaxM3VLTextConfig", dict(intermediate_size=I, num_local_experts=E, swiglu_limit=LIMIT,
                                                    swiglu_alpha=1.702),
                      "MiniMaxM3VLExperts", {}, Activation("gpt-oss", limit=LIMIT, alpha=1.702)),
    "gemma4": ("Gemma4TextConfig", dict(moe_intermediate_size=I, num_experts=E), "Gemma4TextExperts", {},
               Activation("geglu")),
    "diffusion_gemma": ("DiffusionGemmaTextConfig", dict(moe_intermediate_size=I, num_experts=E),
                        "DiffusionGemmaTextExperts", {}, Activation("geglu")),
    # transposed weights (gate_up_proj [E, H, 2I], down_proj [E, I, H]) with biases; gpt-oss's gate and
    # up columns interleaved, the privacy filter's concatenated. Their limit is an attribute (7 in
    # transformers), set to LIMIT here (``_experts``).
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=I, num_local_experts=E), "GptOssExperts", {},
                Activation("gpt-oss", limit=LIMIT, alpha=1.702)),
    "openai_privacy_filter": ("OpenAIPrivacyFilterConfig", dict(intermediate_size=I, num_local_experts=E),
                              "OpenAIPrivacyFilterExperts", {}, Activation("gpt-oss", limit=LIMIT, alpha=1.702)),
    # no gate: up_proj [E, I, H], down(relu(up x)^2)
    "nemotron_h": ("NemotronHConfig", dict(moe_intermediate_size=I, n_routed_experts=E), "NemotronHExperts", {},
                   Activation("relu2")),
}
# family: (config class, config kwargs, experts class, why Tabby falls back)
# (no family of transformers 5.17 falls back; a Nemotron-H whose act_fn is none of Tabby's does)
FALLBACKS = {
    "nemotron_h": ("NemotronHConfig", dict(moe_intermediate_size=I, n_routed_experts=E, mlp_hidden_act="silu"),
                   "NemotronHExperts", "an ungated activation that is none of Tabby's"),
}


@pytest.fixture(scope="module", autouse=True)
def registered():
    tabby_hf.register(CFG)
    yield


def _experts(family, config_name, kw, cls_name, ctor, implementation):
    cfg_mod = importlib.import_module(f"transformers.models.{family}")
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cfg = getattr(cfg_mod, config_name)(hidden_size=H, **kw)
    cfg._experts_implementation = implementation
    ex = getattr(mod, cls_name)(cfg, **ctor)
    if isinstance(getattr(ex, "limit", None), float):  # (gpt-oss's: an attribute, not from the config)
        ex.limit = LIMIT
    g = torch.Generator().manual_seed(len(family))
    with torch.no_grad():
        for name, p in ex.named_parameters():
            if name.startswith("gate_up_proj"):  # g, u on the grid of 1/8 (module docstring), biases too
                p.copy_(torch.randint(-2, 3, p.shape, generator=g) / 8)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return ex.to(torch.bfloat16)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-1, 2, (T, H), generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[:4] = 0  # an expert with many rows beside others
    w = torch.softmax(torch.randn(T, K, generator=g), -1).to(torch.bfloat16)
    dy = torch.randn(T, H, generator=g).to(torch.bfloat16)
    return x, idx, w, dy


def _run(ex, x, idx, w, dy):
    xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = ex(xs, idx, ws)
    y.backward(dy)
    biases = [p.grad for p in (getattr(ex, "gate_up_proj_bias", None), getattr(ex, "down_proj_bias", None))
              if p is not None]
    up = ex.gate_up_proj if hasattr(ex, "gate_up_proj") else ex.up_proj
    return [y.detach(), xs.grad, ws.grad, up.grad, ex.down_proj.grad, *biases]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_runs_on_tabby_like_transformers_eager(family):
    config_name, kw, cls_name, ctor, act = FAMILIES[family]
    eager = _experts(family, config_name, kw, cls_name, ctor, "eager")
    ours = copy.deepcopy(eager)
    if hasattr(ours, "has_gate"):  # chooses its forward through experts_implementation
        ours.config = copy.deepcopy(eager.config)
        ours.config._experts_implementation = "tabby"
    else:  # not decorated (Step-3.7): its own loop, routed through Tabby by attach
        tabby_hf.attach(ours)
    assert tabby_hf._supported(ours) is None  # runs on Tabby, no fallback
    assert tabby_hf.detect_activation(ours) == act
    x, idx, w, dy = _inputs()
    want = _run(eager, x, idx, w, dy)
    got = _run(ours, x, idx, w, dy)
    names = ["y", "d hidden", "d routing weights", "d gate_up_proj", "d down_proj", "d gate_up_proj_bias",
             "d down_proj_bias"]
    assert len(got) == len(want) == (7 if getattr(ours, "has_bias", False) else 5)
    errs = {n: rel(a, b) for n, a, b in zip(names, got, want)}
    assert all(e < TOL for e in errs.values()), errs
    if act.kind == "relu2":  # relu clipped some entries here
        assert (x.float() @ eager.up_proj[0].float().t() < 0).any()
    if act.limit is not None:  # the clamps clipped some entries here
        w_gate = tabby_hf.expert_weights(eager)[0]
        g = (x.float() @ w_gate[0].float().t())
        assert (g.abs() > LIMIT).any()


@pytest.mark.parametrize("family", list(FALLBACKS))
def test_family_falls_back_with_its_reason(family, caplog):
    config_name, kw, cls_name, why = FALLBACKS[family]
    ex = _experts(family, config_name, kw, cls_name, {}, "tabby")
    reason = tabby_hf._supported(ex)
    assert reason is not None and why in reason, reason
    x, idx, w, _ = _inputs()
    with torch.no_grad(), caplog.at_level("WARNING", logger="tabby"):
        y = ex(x, idx, w)
        ref = transformers.integrations.moe.grouped_mm_experts_forward(ex, x, idx, w)
    assert torch.equal(y, ref)


def test_gpt_oss_gate_is_recognized_with_transformers_limit():
    """gpt-oss's gate (interleaved gate/up columns) with the limit transformers gives it (7)."""
    config_name, kw, cls_name, _, _ = FAMILIES["gpt_oss"]
    ex = _experts("gpt_oss", config_name, kw, cls_name, {}, "tabby")
    ex.limit = 7.0
    assert tabby_hf.detect_activation(ex) == Activation("gpt-oss", limit=7.0, alpha=1.702)


@pytest.mark.parametrize("family", ["gpt_oss", "openai_privacy_filter"])
def test_transposed_families_read_their_weights_in_place(family):
    """The weights Tabby gets are views of the module's parameters (no copy per call), in the layout
    the kernels read: gpt-oss's interleaved "kn-paired", the privacy filter's "kn"."""
    from tabby.validate import weights_layout

    config_name, kw, cls_name, ctor, _ = FAMILIES[family]
    ex = _experts(family, config_name, kw, cls_name, ctor, "tabby")
    w_gate, w_up, w_down, biases = tabby_hf.expert_weights(ex)
    assert weights_layout(w_gate, w_up, w_down) == ("kn-paired" if family == "gpt_oss" else "kn")
    for view, param in ((w_gate, ex.gate_up_proj), (w_up, ex.gate_up_proj), (w_down, ex.down_proj),
                        (biases[0], ex.gate_up_proj_bias), (biases[2], ex.down_proj_bias)):
        assert view.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()


@pytest.mark.parametrize("family", ["deepseek_v4", "gpt_oss"])
def test_compiled_fullgraph_is_eager_bitwise(family):
    """A clamped family (and gpt-oss: its weights' views and their layout traced) under
    torch.compile(fullgraph=True), compiled before any eager call (the gate is detected at trace time,
    a constant of the graph): the same bits as the eager Tabby call."""
    config_name, kw, cls_name, ctor, _ = FAMILIES[family]
    ex = _experts(family, config_name, kw, cls_name, ctor, "tabby")
    x, idx, w, _ = _inputs(1)
    with torch.no_grad():
        compiled = torch.compile(ex, fullgraph=True)(x, idx, w)
        assert torch.equal(compiled, ex(x, idx, w))


def test_gpt_oss_under_an_fp8_config_runs_bf16_with_a_warning(caplog):
    """A model-wide FP8 (or megakernel) config reaches experts with biases: they run on the path that
    takes them (bf16, separate launches) and the backend says so, once; the same bits as a bf16 config."""
    config_name, kw, cls_name, ctor, _ = FAMILIES["gpt_oss"]
    ex = _experts("gpt_oss", config_name, kw, cls_name, ctor, "tabby")
    x, idx, w, _ = _inputs()
    tabby_hf._warned.clear()
    with torch.no_grad():
        want = ex(x, idx, w)
        for cfg in (MoEConfig(precision="fp8", tuning=CFG.tuning), MoEConfig(megakernel=True, tuning=CFG.tuning)):
            ex.tabby_config_string = tabby_hf.layer.config_string(cfg)
            with caplog.at_level("WARNING", logger="tabby"):
                assert torch.equal(ex(x, idx, w), want)
            tabby_hf._warned.clear()
    said = [r.message for r in caplog.records]
    assert any("precision='fp8' (bf16 instead)" in m for m in said) and any("megakernel=True" in m for m in said), said


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "openai_privacy_filter"])
def test_fused_weights_get_their_gradient_whole(family):
    """The gate and up halves the backend passes are recognized as the halves of one fused
    gate_up_proj (``backward._fused_halves``): the layer's eager backward then writes its gradient
    whole, handed to gate_up_proj without autograd's stack copy (test_nn.py checks the hand-over)."""
    from tabby.functional.backward import _fused_halves

    config_name, kw, cls_name, ctor, _ = FAMILIES[family]
    ex = _experts(family, config_name, kw, cls_name, ctor, "tabby")
    w_gate, w_up, _, _ = tabby_hf.expert_weights(ex)
    assert _fused_halves(w_gate, w_up)
    assert not _fused_halves(w_gate, w_up.clone())
