"""``tabby train`` on the CPU: the generated corpus is what its docstring says (deterministic, its
entropy the best achievable loss, learnable from the last two tokens), the FLOP count matches a
hand count, and a tiny Qwen3-MoE suite runs both backends, with the two deterministic Tabby runs
equal bit for bit, the first losses equal to bf16 rounding, and the JSON, table and chart written.

Needs transformers 5.x; skipped without it. The GPU suite is the device script's ``train`` stage."""
import dataclasses
import json
import math
import os

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")

from tabby_bench import cli, train


def test_corpus_is_deterministic_and_its_entropy_is_reachable():
    a, h = train.make_corpus(vocab=64, n_tokens=40000, seq_len=400, seed=7, branching=8, orders=4)
    b, _ = train.make_corpus(vocab=64, n_tokens=40000, seq_len=400, seed=7, branching=8, orders=4)
    c, _ = train.make_corpus(vocab=64, n_tokens=40000, seq_len=400, seed=8, branching=8, orders=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (100, 400) and a.min() >= 0 and a.max() < 64
    p = 1 / torch.arange(1, 9, dtype=torch.float64)
    p /= p.sum()
    assert h == pytest.approx(float(-(p * p.log()).sum()))
    # the empirical entropy of the next token given (token before last mod 4, last token) is the
    # stated entropy rate (a model of the last two tokens can reach it) ...
    ctx = ((a[:, :-2] % 4) * 64 + a[:, 1:-1]).reshape(-1)
    nxt = a[:, 2:].reshape(-1)
    joint = torch.zeros(4 * 64, 64, dtype=torch.float64).index_put_((ctx, nxt), torch.ones(nxt.numel(),
                                                                    dtype=torch.float64), accumulate=True)
    cond = joint / joint.sum(1, keepdim=True).clamp_min(1)
    h2 = float(-(joint * cond.clamp_min(1e-300).log()).sum() / joint.sum())
    assert abs(h2 - h) < 0.05
    # ... and the last token alone leaves more (the order of the candidates is unknown)
    j1 = joint.view(4, 64, 64).sum(0)
    h1 = float(-(j1 * (j1 / j1.sum(1, keepdim=True).clamp_min(1)).clamp_min(1e-300).log()).sum() / j1.sum())
    assert h1 > h2 + 0.1 and h1 < math.log(64) - 1.0


def test_flops_per_token_by_hand():
    spec = train.MODELS["tiny-qwen3-moe"]
    model = train.build_model(spec, "grouped_mm", 0, torch.device("cpu"))
    f = spec.fields
    H, L, I, E, k = f["hidden_size"], f["num_hidden_layers"], f["moe_intermediate_size"], f["num_experts"], \
        f["num_experts_per_tok"]
    hd, nh, nkv, V = f["head_dim"], f["num_attention_heads"], f["num_key_value_heads"], f["vocab_size"]
    attn = H * hd * (nh + 2 * nkv) + nh * hd * H + 2 * hd  # q, k, v, o and the q/k norms
    per_layer = attn + 2 * H + H * E + k * 3 * H * I  # two norms, router, k experts
    active = L * per_layer + H + V * H  # final norm, lm head (the embedding is a lookup)
    assert train.flops_per_token(model, spec, seq_len=32) == pytest.approx(6 * active + 6 * L * nh * hd * 32)


def test_tiny_suite(tmp_path, monkeypatch):
    tiny = train.MODELS["tiny-qwen3-moe"]  # one layer: the interpreter's time goes with Tabby's calls
    monkeypatch.setitem(train.MODELS, "tiny-qwen3-moe", dataclasses.replace(
        tiny, fields=dict(tiny.fields, num_hidden_layers=1)))
    cfg = train.TrainConfig(models=["tiny-qwen3-moe"], modes=["eager"], steps=2, tokens=32, seq_len=16,
                            warmup_steps=1, log_every=1, out=str(tmp_path), tag="t", tabby_config=train.CPU_TABBY_CONFIG)
    result = train.run(cfg)
    runs = result["runs"]
    assert [(r["backend"], r["seed"], r["deterministic"]) for r in runs] == [
        ("grouped_mm", 0, False), ("tabby", 0, False), ("tabby", 0, True), ("tabby", 0, True),
        ("grouped_mm", 0, False), ("grouped_mm", 1, False)]
    assert all(r["error"] is None and len(r["loss"]) == 2 and len(r["grad_norm"]) == 2 for r in runs)
    assert all(math.isfinite(x) for r in runs for x in r["loss"] + r["grad_norm"])
    c = result["comparison"]["tiny-qwen3-moe"]
    assert c["bitwise_repeat"] is True
    assert c["first_loss"]["rel_diff"] < 1e-2
    assert runs[0]["loss"][0] != runs[5]["loss"][0]  # another init seed: another model
    assert "baseline_repeat_spread" in c and "rounding_spread" in c and "baseline_seed_spread" in c
    assert not result["failed"]
    assert {os.path.splitext(p)[1] for p in result["files"]} == {".json", ".md", ".png"}
    with open(result["files"][0]) as fh:
        saved = json.load(fh)
    assert saved["format"] == "tabby-train/1" and saved["git_commit"] and saved["flops_per_token"]["tiny-qwen3-moe"]
    with open(result["files"][1]) as fh:
        table = fh.read()
    assert table.count("| tiny-qwen3-moe |") == 6


def test_cli_rejects_bad_options(capsys):
    parser = cli.build_parser()
    for argv in (["train", "--models", "nope"], ["train", "--experts", "x"], ["train", "--modes", "graph"],
                 ["train", "--tokens", "100", "--seq-len", "32"], ["train", "--tabby-config", "bogus=1"]):
        with pytest.raises(SystemExit):
            cli.train_config(parser.parse_args(argv), parser, gpus=0)
    assert "unknown model" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["tiny-deepseek-v4", "tiny-gpt-oss"])
def test_tiny_families_train_like_grouped_mm(model, tmp_path):
    """A tiny DeepSeek-V4 (clamped SwiGLU experts) and a tiny gpt-oss (transposed weights read in
    place, interleaved gate/up, biases, its clamped gate): the transformers backend finds each one's
    activation and runs its experts on Tabby (no fallback); Tabby's first loss equals grouped_mm's,
    both runs finite."""
    import tabby.integrations.transformers as tabby_hf

    tabby_hf.register()
    built = train.build_model(train.MODELS[model], "tabby", 0, torch.device("cpu"))
    assert all(tabby_hf._supported(m) is None for m in tabby_hf.experts_modules(built))
    cfg = train.TrainConfig(models=[model], modes=["eager"], steps=2, tokens=32, seq_len=16,
                            warmup_steps=1, log_every=1, out=str(tmp_path), tag=model, repeat=False,
                            tabby_config=train.CPU_TABBY_CONFIG)
    result = train.run(cfg)
    runs = result["runs"]
    assert {r["backend"] for r in runs} == {"grouped_mm", "tabby"} and not result["failed"]
    assert all(r["error"] is None and all(math.isfinite(x) for x in r["loss"]) for r in runs)
    assert result["comparison"][model]["first_loss"]["rel_diff"] < 1e-3
