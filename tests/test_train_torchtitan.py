"""``tabby train`` on a torchtitan model (tabby_bench/train.py): torchtitan 0.3.0's Qwen3-MoE,
its own experts (``GroupedExperts``: torch._grouped_mm) against Tabby's through the override (or
torchtitan 0.2.x's, through ``tabby.integrations.torchtitan02``, where that release is installed),
on the CPU with the tiny model (causal SDPA: flex attention has no backward on the CPU). Skipped
where torchtitan is not installed."""
import dataclasses
import math

import pytest
import torch

pytest.importorskip("torchtitan")

from tabby_bench import train  # noqa: E402


@pytest.fixture(autouse=True)
def cpu_histc(monkeypatch):
    """torchtitan 0.2.x's router counts tokens with torch.histc on int64 ids, which the CPU does not
    implement: there the ids are counted as floats (the same counts). (0.3.0 does not call it.)"""
    if not torch.cuda.is_available() and train.torchtitan_legacy():
        real = torch.histc
        monkeypatch.setattr(torch, "histc", lambda t, *a, **k: real(t.float(), *a, **k).to(t.dtype))


def test_the_override_keeps_the_parameters_and_the_flops_count():
    spec = train.MODELS["tiny-torchtitan-qwen3-moe"]
    base = train.build_model(spec, "grouped_mm", 0, torch.device("cpu"))
    tabby = train.build_model(spec, "tabby", 0, torch.device("cpu"), train.CPU_TABBY_CONFIG)
    a, b = base.state_dict(), tabby.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)  # same keys, same init
    assert type(train.experts_of(tabby)[0]).__name__ == "GroupedExperts"
    assert len(train.moe_blocks(tabby)) == spec.fields["n_layers"]
    f = spec.fields
    H, L, I, E, k, V = f["dim"], f["n_layers"], f["moe_hidden_dim"], f["num_experts"], f["top_k"], f["vocab_size"]
    hd, nh, nkv = f["head_dim"], f["n_heads"], f["n_kv_heads"]
    attn = H * hd * (nh + 2 * nkv) + nh * hd * H + 2 * hd  # fused q, k, v; o; the q/k norms
    per_layer = attn + 2 * H + H * E + k * 3 * H * I  # two norms, router, k experts
    active = L * per_layer + H + V * H  # final norm, lm head (the embedding is a lookup)
    assert train.flops_per_token(base, spec, seq_len=32) == pytest.approx(6 * active + 6 * L * nh * hd * 32)


def test_tiny_torchtitan_suite(tmp_path, monkeypatch):
    tiny = train.MODELS["tiny-torchtitan-qwen3-moe"]  # one layer: the interpreter's time goes with Tabby's calls
    monkeypatch.setitem(train.MODELS, tiny.name, dataclasses.replace(tiny, fields=dict(tiny.fields, n_layers=1)))
    cfg = train.TrainConfig(models=[tiny.name], modes=["eager"], steps=2, tokens=32, seq_len=16, warmup_steps=1,
                            log_every=1, out=str(tmp_path), tag="t", tabby_config=train.CPU_TABBY_CONFIG)
    result = train.run(cfg)
    runs = result["runs"]
    assert all(r["error"] is None and len(r["loss"]) == 2 for r in runs), [r["error"] for r in runs]
    assert all(math.isfinite(x) for r in runs for x in r["loss"] + r["grad_norm"])
    c = result["comparison"][tiny.name]
    assert c["bitwise_repeat"] is True
    assert c["first_loss"]["rel_diff"] < 1e-2
    assert not result["failed"]
