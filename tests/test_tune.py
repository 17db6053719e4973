"""`tabby tune`'s variants (Tuning text) and its ticket-trace helper (the timing itself needs a GPU)."""

import pytest
import torch

from tabby.functional.config import MoEConfig, Tuning
from tabby_bench import cli
from tabby_bench.tune import DEFAULT_VARIANTS, best_mega_variant, parse_variant


def test_parse_variant():
    v = parse_variant("mega:group_m=2,tma=0")
    assert v.kind == "mega" and v.config == MoEConfig(megakernel=True, tuning=Tuning(group_m=2, tma=False)) and v.ablate == 0
    assert v.tuning_text == "group_m=2,tma=0"
    v = parse_variant("sync-free:dispatch_rows=64")
    assert v.config == MoEConfig(megakernel=False, tuning=Tuning(dispatch_rows=64))
    v = parse_variant("mega:ablate=1,ring_rows=8192")
    assert v.ablate == 1 and v.config.tuning == Tuning(ring_rows=8192)
    assert parse_variant("mega:save_for_backward=0").config == MoEConfig(megakernel=True, save_for_backward=False)
    assert parse_variant("floor").config is None and parse_variant("mega").config == MoEConfig(megakernel=True)
    for v in DEFAULT_VARIANTS:
        parse_variant(v)


@pytest.mark.parametrize("bad", ["mega:tile_ready=0", "mega:group_m=x", "mega:M=2", "fast", "floor:tile_m=64",
                                 "sync-free:ablate=1", "mega:ablate=-1", "mega:tma=2"])
def test_bad_variants_are_rejected(bad):
    with pytest.raises(ValueError):
        parse_variant(bad)


def test_cli_rejects_bad_variant(capsys):
    with pytest.raises(SystemExit):
        cli.main(["tune", "--variants", "mega:early_ticket=1"])
    assert "early_ticket" in capsys.readouterr().err


def test_tune_needs_a_gpu(monkeypatch):
    from tabby_bench import tune

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a GPU"):
        tune.run(["qwen3-30b-a3b"], [16], [1], ["sync-free"])


def _res(rows):
    return dict(shape="s", tokens_per_gpu=1, ep=2, rows=[dict(variant=v, ms=ms, check=c) for v, ms, c in rows])


def test_best_mega_variant_by_geometric_mean_over_runs():
    a = _res([("sync-free", 10.0, True), ("mega", 9.0, True), ("mega:group_m=2", 6.0, True),
              ("mega:ablate=1", 1.0, None), ("mega:tma=0", 5.0, False), ("mega:save_for_backward=0", 2.0, True)])
    b = _res([("sync-free", 10.0, True), ("mega", 9.0, True), ("mega:group_m=2", 12.0, True),
              ("mega:ablate=1", 1.0, None), ("mega:tma=0", 5.0, True), ("mega:save_for_backward=0", 2.0, True)])
    # ablations, wrong outputs and a config outside Tuning never win
    assert best_mega_variant([a]) == "group_m=2"
    assert best_mega_variant([a, b]) == "group_m=2"  # 0.6 * 1.2 = 0.72 < 0.9 * 0.9 = 0.81
    c = _res([("sync-free", 10.0, True), ("mega", 9.0, True), ("mega:group_m=2", None, None)])  # failed here
    assert best_mega_variant([a, b, c]) == ""  # plain "mega" (the defaults) is the only one that ran everywhere
    assert best_mega_variant([_res([("sync-free", 10.0, True), ("mega:ablate=2", 1.0, None)])]) is None


def test_trace_variant_summarizes_and_draws_a_real_trace(tmp_path):
    # --trace's helper on a CPU run of the megakernel (interpreted: clocks read 0, so only the
    # ticket counts mean anything): summary and timeline from the trace the probe brings back
    from tabby.functional.moe import moe_with_probe
    from tabby_bench import tune
    from tabby_bench.shapes import TINY, make_routing, make_weights

    g = torch.Generator().manual_seed(0)
    T = 12
    x = torch.randn(T, TINY.H, generator=g).bfloat16()
    idx, wts = make_routing(T, TINY.E, TINY.k, generator=g)
    ws, sh = make_weights(TINY, TINY.E, generator=g)
    cfg = MoEConfig(tuning=Tuning(tile_m=16, programs=2, ring_rows=64))

    def run(probe):
        with torch.no_grad():
            return moe_with_probe(x, idx, wts, *ws, shared=sh, config=cfg, probe=probe)

    plot = tmp_path / "trace.png"
    s = tune._trace_variant(run, 64, 0, str(plot), "tiny")
    assert s["programs"] == 2 and s["tickets"] > 0 and s["kinds"]["gate/up"]["n"] > 0
    assert s["kinds"]["shared gate/up"]["n"] > 0
    assert plot.read_bytes()[:4] == b"\x89PNG"
