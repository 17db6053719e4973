"""`tabby tune`'s variant parsing (the timing itself needs a GPU)."""
import pytest

from tabby import cli
from tabby.tune import DEFAULT_VARIANTS, parse_variant


def test_parse_variant():
    assert parse_variant("mega:C=16,R=4096") == ("mega", {"fwd_comm_programs": 16, "ring_rows": 4096})
    assert parse_variant("sync-free") == ("sync-free", {})
    assert parse_variant("mega:A=1") == ("mega", {"fwd_ablate": 1})
    assert parse_variant("mega:T=1,Y=64") == ("mega", {"fwd_tma": 1, "tile_m": 64})
    assert parse_variant("sync-free:Y=64") == ("sync-free", {"tile_m": 64})
    assert parse_variant("mega:E=1,J=3") == ("mega", {"fwd_align_tiles": 1, "fwd_fill_stages": 3})
    assert parse_variant("mega:X=0,G=0,O=0") == ("mega", {"fwd_ticket_ahead": 0, "fwd_poll_together": 0,
                                                        "overlap_publish": 0})
    assert parse_variant("mega:F=0,I=0") == ("mega", {"fwd_fill_table": 0, "fwd_tile_ready": 0})
    assert parse_variant("mega:H=0") == ("mega", {"fwd_peer_flags": 0})
    assert parse_variant("mega:LR=1") == ("mega", {"fwd_local_rows": 1})
    for v in DEFAULT_VARIANTS:
        parse_variant(v)


@pytest.mark.parametrize("bad", ["mega:Q=1,Oops=2", "mega:h=1", "mega:C=x", "fast", "floor:C=1", "floor:Y=64",
                                 "sync-free:M=2"])
def test_bad_variants_are_rejected(bad):
    with pytest.raises(ValueError):
        parse_variant(bad)


def test_cli_rejects_bad_variant(capsys):
    with pytest.raises(SystemExit):
        cli.main(["tune", "--variants", "mega:h=1"])
    assert "bad knob" in capsys.readouterr().err


def test_tune_needs_a_gpu(monkeypatch):
    import torch

    from tabby import tune

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a GPU"):
        tune.run(["qwen3-30b-a3b"], [16], [1], ["sync-free"])


def _res(rows):
    return dict(shape="s", tokens_per_gpu=1, ep=2, rows=[dict(variant=v, ms=ms, check=c) for v, ms, c in rows])


def test_best_mega_variant_by_geometric_mean_over_runs():
    from tabby.tune import best_mega_variant

    a = _res([("sync-free", 10.0, True), ("mega", 9.0, True), ("mega:M=2", 6.0, True), ("mega:A=1", 1.0, None),
              ("mega:B=128", 5.0, False)])  # ablations and wrong outputs never win
    b = _res([("sync-free", 10.0, True), ("mega", 9.0, True), ("mega:M=2", 12.0, True), ("mega:A=1", 1.0, None),
              ("mega:B=128", 5.0, True)])
    assert best_mega_variant([a]) == "M=2"
    assert best_mega_variant([a, b]) == "M=2"  # 0.6 * 1.2 = 0.72 < 0.9 * 0.9 = 0.81
    c = _res([("sync-free", 10.0, True), ("mega", 9.0, True), ("mega:M=2", None, None)])  # M=2 failed here
    assert best_mega_variant([a, b, c]) == ""  # plain "mega" (the defaults) is the only one that ran everywhere
    assert best_mega_variant([_res([("sync-free", 10.0, True), ("mega:A=2", 1.0, None)])]) is None


def test_bench_mega_variant_from_the_environment(monkeypatch):
    from tabby import bench

    monkeypatch.setenv("TABBY_MEGA_VARIANT", "M=2,B=128")
    bench.register_tabby()
    cfg = bench.IMPLS["tabby"].fn.keywords["config"]
    assert cfg.megakernel and cfg.fwd_group_m == 2 and cfg.fwd_down_bn == 128
    assert not bench.IMPLS["tabby-sync-free"].fn.keywords["config"].megakernel
    monkeypatch.setenv("TABBY_MEGA_VARIANT", "h=1")
    bench.register_tabby()
    with pytest.raises(RuntimeError, match="TABBY_MEGA_VARIANT"):
        bench.IMPLS["tabby"].prepare(None, None)
    monkeypatch.delenv("TABBY_MEGA_VARIANT")
    bench.register_tabby()
    from tabby.functional.config import MoEConfig

    # no knobs: tabby.moe with its default config, which is the megakernel
    assert not getattr(bench.IMPLS["tabby"].fn, "keywords", None) and MoEConfig().megakernel


def test_trace_variant_summarizes_and_draws_a_real_trace(tmp_path, monkeypatch):
    # --trace's helper on a CPU run of the megakernel (interpreted: clocks read 0, so only the
    # ticket counts mean anything): summary and timeline from the trace the launch left
    import torch

    import tabby
    from tabby import tune
    from tabby.functional.config import MoEConfig
    from tabby.shapes import TINY, make_routing, make_weights

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    g = torch.Generator().manual_seed(0)
    T = 12
    x = torch.randn(T, TINY.H, generator=g).bfloat16()
    idx, wts = make_routing(T, TINY.E, TINY.k, generator=g)
    ws, sh = make_weights(TINY, TINY.E, generator=g)
    cfg = MoEConfig(tile_m=16, megakernel=True, fwd_programs=2, ring_rows=64)

    def run(c):
        with torch.no_grad():
            return tabby.moe(x, idx, wts, *ws, shared=sh, config=c)

    plot = tmp_path / "trace.png"
    s = tune._trace_variant(run, cfg, 64, str(plot), "tiny")
    assert s["programs"] == 2 and s["tickets"] > 0 and s["kinds"]["gate/up"]["n"] > 0
    assert s["kinds"]["shared gate/up"]["n"] > 0
    assert plot.read_bytes()[:4] == b"\x89PNG"
