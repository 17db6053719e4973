"""`tabby tune`'s variant parsing (the timing itself needs a GPU)."""
import pytest

from tabby import cli
from tabby.tune import DEFAULT_VARIANTS, parse_variant


def test_parse_variant():
    assert parse_variant("mega:C=16,R=4096") == ("mega", {"fwd_comm_programs": 16, "ring_rows": 4096})
    assert parse_variant("sync-free") == ("sync-free", {})
    assert parse_variant("mega:A=1") == ("mega", {"fwd_ablate": 1})
    for v in DEFAULT_VARIANTS:
        parse_variant(v)


@pytest.mark.parametrize("bad", ["mega:Q=1", "mega:C=x", "fast", "floor:C=1"])
def test_bad_variants_are_rejected(bad):
    with pytest.raises(ValueError):
        parse_variant(bad)


def test_cli_rejects_bad_variant(capsys):
    with pytest.raises(SystemExit):
        cli.main(["tune", "--variants", "mega:Q=1"])
    assert "bad knob" in capsys.readouterr().err


def test_tune_needs_a_gpu(monkeypatch):
    import torch

    from tabby import tune

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a GPU"):
        tune.run(["qwen3-30b-a3b"], [16], [1], ["sync-free"])
