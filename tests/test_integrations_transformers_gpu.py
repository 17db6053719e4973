"""transformers' MoE families through the "tabby" experts backend on a GPU, at widths where the plan
takes the warp-specialized GEMMs (H 256, I 128: multiples of 64; 8 experts; 512 tokens; the default
config's tiles of 128 rows): every family of test_integrations_transformers_families.py against
transformers' own eager experts, output and every gradient. The plain families' weights are the two
halves of one gate_up_proj [E, 2I, H], which the ws gate/up read at the wrong rows before a67fc09
(each half's experts 2I rows apart: bf16_ws._pitch); gpt-oss's and the privacy filter's transposed,
interleaved weights and biases, and Nemotron-H's ungated experts, run there too."""
import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

import test_integrations_transformers_families as fam  # noqa: E402

import tabby.integrations.transformers as tabby_hf  # noqa: E402
from tabby.functional.config import MoEConfig  # noqa: E402

SIZES = dict(H=256, I=128, E=8, T=512)
_WIDTH_KEYS = ("moe_intermediate_size", "intermediate_size")
_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


@pytest.fixture(scope="module", autouse=True)
def registered():
    tabby_hf.register(MoEConfig())
    yield


@pytest.mark.parametrize("family", list(fam.FAMILIES))
def test_family_on_the_ws_gemms_like_transformers_eager(family, monkeypatch):
    for name, value in SIZES.items():
        monkeypatch.setattr(fam, name, value)
    config_name, kw, cls_name, ctor, act = fam.FAMILIES[family]
    kw = {k: SIZES["I"] if k in _WIDTH_KEYS else SIZES["E"] if k in _EXPERT_KEYS else v for k, v in kw.items()}
    eager = fam._experts(family, config_name, kw, cls_name, ctor, "eager").cuda()
    ours = copy.deepcopy(eager)
    if hasattr(ours, "has_gate"):
        ours.config = copy.deepcopy(eager.config)
        ours.config._experts_implementation = "tabby"
    else:
        tabby_hf.attach(ours)
    assert tabby_hf._supported(ours) is None and tabby_hf.detect_activation(ours) == act
    x, idx, w, dy = (t.cuda() for t in fam._inputs())
    want = fam._run(eager, x, idx, w, dy)
    got = fam._run(ours, x, idx, w, dy)
    names = ["y", "d hidden", "d routing weights", "d gate_up_proj", "d down_proj", "d gate_up_proj_bias",
             "d down_proj_bias"]
    errs = {n: fam.rel(a.float().cpu(), b.float().cpu()) for n, a, b in zip(names, got, want)}
    print(f"GPU {family}: {errs}")
    assert len(got) == len(want) and all(e < fam.TOL for e in errs.values()), errs
