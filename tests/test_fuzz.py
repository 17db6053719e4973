"""Property-based fuzzing on the CPU (scripts/fuzz.py): cases drawn from seeds, each checked
against the reference in values and every gradient, on simulated ranks under the interpreter.

CI runs a fixed budget of seeds (``CI_SEEDS``, about a minute of CPU in all); the GPU stage runs
``scripts/fuzz.py --cases N --device cuda`` with a larger one. A failing case names its seed:
``python scripts/fuzz.py --seed S --device cpu`` runs it again.
"""
import dataclasses
import importlib.util
import json
import os
import sys

import pytest
import torch

_PATH = os.path.join(os.path.dirname(__file__), "..", "scripts", "fuzz.py")
_spec = importlib.util.spec_from_file_location("tabby_fuzz", _PATH)
fuzz = sys.modules["tabby_fuzz"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz)

CI_SEEDS = list(range(20))
CI_WORLDS = (1, 2)


@pytest.mark.parametrize("seed", CI_SEEDS)
def test_fuzz_case_matches_reference(seed):
    c = fuzz.draw_case(seed, worlds=CI_WORLDS)
    try:
        fuzz.run_case_simulated(c)
    except Exception as e:
        raise AssertionError(f"fuzz case {c} failed; reproduce: python scripts/fuzz.py --seed {seed} "
                             f"--device cpu --worlds {','.join(map(str, CI_WORLDS))}") from e


def test_ci_seeds_cover_every_kind_of_case():
    """The CI budget draws every property the fuzzer claims to vary (else a kind goes untested)."""
    cases = [fuzz.draw_case(s, worlds=CI_WORLDS) for s in CI_SEEDS]
    seen = lambda f: {f(c) for c in cases}  # noqa: E731
    assert {0, 1} <= seen(lambda c: c.T) and max(seen(lambda c: c.T)) > 8
    assert seen(lambda c: c.W) == {1, 2}
    assert seen(lambda c: c.route) == set(fuzz.ROUTES)
    assert seen(lambda c: c.megakernel) == {True, False} and seen(lambda c: c.shared) == {True, False}
    assert False in seen(lambda c: c.save_for_backward)
    assert {1e-3, 30.0} <= seen(lambda c: c.expert_scale) and {1e-3, 10.0, -1.0} <= seen(lambda c: c.router_scale)
    assert any(c.H % 8 for c in cases) and any(c.I % 8 for c in cases)
    assert any(c.T == 0 and c.W == 2 for c in cases)
    assert any(c.route == "empty_rank" and c.W == 2 for c in cases)
    assert any(c.k > c.W * c.E_local for c in cases if c.route in ("duplicates", "one_expert"))
    assert seen(lambda c: c.activation) == {"swiglu", "geglu", "relu2"} and seen(lambda c: c.biases) == {True, False}
    assert seen(lambda c: c.layout) == {"nk", fuzz.NK_FUSED, "kn", "kn-paired"}
    assert any(c.layout == fuzz.NK_FUSED and c.megakernel for c in cases)


def test_routings_are_what_they_claim():
    base = dict(seed=3, W=2, T=40, H=16, I=8, E_local=3, k=2, shared=False, expert_scale=1.0, router_scale=1.0,
                megakernel=True, save_for_backward=True, tile_m=16, ring_rows=32)
    routed = {}
    for route in fuzz.ROUTES:
        c = fuzz.Case(route=route, **base)
        _, idx, wts, *_ = fuzz.make_inputs(c)
        assert idx.shape == (80, 2) and wts.shape == (80, 2) and idx.min() >= 0 and idx.max() < 6
        routed[route] = idx
    assert (routed["one_expert"] == routed["one_expert"][0, 0]).all()
    ranks_used = {int(e) // 3 for e in routed["empty_rank"].flatten()}
    assert len(ranks_used) == 1  # the other rank's experts receive nothing
    assert (routed["duplicates"][:, 0] == routed["duplicates"][:, 1]).any()
    assert all(len(set(r.tolist())) == 2 for r in routed["uniform"]) and all(
        len(set(r.tolist())) == 2 for r in routed["zipf"])
    counts = torch.bincount(routed["zipf"].flatten(), minlength=6)
    assert counts.max() > 2 * counts.float().mean()  # skewed


def test_compare_catches_wrong_outputs():
    want = dict(y=torch.ones(3, 4), dx=torch.ones(3, 4))
    fuzz.compare(dict(y=torch.ones(3, 4), dx=torch.ones(3, 4) * 1.001), want)
    for got, msg in ((dict(y=torch.ones(3, 4), dx=torch.ones(3, 4) * 1.1), "dx: relative error"),
                     (dict(y=torch.ones(3, 4)), "dx: no gradient"),
                     (dict(y=torch.ones(2, 4), dx=torch.ones(3, 4)), "y: shape"),
                     (dict(y=torch.full((3, 4), float("nan")), dx=torch.ones(3, 4)), "y: non-finite")):
        with pytest.raises(AssertionError, match=msg):
            fuzz.compare(got, want)


@pytest.mark.parametrize("seed", [11])
def test_both_paths_are_bitwise_equal_on_fuzz_cases(seed):
    """The megakernel and the path of separate launches give bitwise the same y and gradients
    (docs/design.md, "Determinism"), here on drawn cases at EP2."""
    c = dataclasses.replace(fuzz.draw_case(seed, worlds=(2,)), T=9, W=2)
    inputs = fuzz.make_inputs(c)
    from tabby.functional.threads import run_ranks

    out = {}
    for mega in (True, False):
        cm = dataclasses.replace(c, megakernel=mega, ring_rows=2 * c.tile_m if mega else None)
        out[mega] = run_ranks(2, lambda r, g: fuzz.rank_results(cm, inputs, r, g, "cpu"))
    for r in range(2):
        for name, t in out[True][r].items():
            assert (t is None) == (out[False][r][name] is None), name
            if t is not None:
                assert torch.equal(t, out[False][r][name]), f"rank {r} {name} differs between the paths ({c})"


def test_command_line_writes_a_summary_and_names_a_failing_seed(tmp_path, monkeypatch, capsys):
    real = fuzz.run_case_simulated

    def run(c, device="cpu"):  # seed 4 made to fail: the layer's result is not checked here
        if c.seed == 4:
            raise AssertionError("y: relative error 0.5 > 0.02")
        return {"y": 0.0}

    monkeypatch.setattr(fuzz, "run_case_simulated", run)
    assert fuzz.main(["--cases", "3", "--first", "3", "--device", "cpu", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL seed=4" in out and "reproduce: python scripts/fuzz.py --seed 4 --device cpu --worlds 1,2" in out
    summary = json.loads((tmp_path / "fuzz-summary.json").read_text())
    assert summary["cases"] == 3 and summary["failed_seeds"] == [4] and summary["finished"]
    assert "reproduce" in (tmp_path / "fuzz.log").read_text()
    monkeypatch.setattr(fuzz, "run_case_simulated", real)
    assert fuzz.main(["--seed", "1", "--device", "cpu"]) == 0  # a real case through the command line


def _distributed_worker(rank, init_file, seeds, q):
    """One rank of ``run_case_distributed`` over gloo, with the EP reference as the layer (the
    harness's slicing, sums and agreement are what is checked; Tabby across processes needs GPUs)."""
    import torch.distributed as dist

    import tabby

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)

    def layer(x, idx, w, wg, wu, wd, shared=None, group=None, config=None, biases=None):
        return tabby.moe_reference(x, idx, w, wg, wu, wd, shared=shared, group=group, activation=config.activation,
                                   biases=biases)

    def spoiled(x, idx, w, wg, wu, wd, shared=None, group=None, config=None, biases=None):
        y = layer(x, idx, w, wg, wu, wd, shared=shared, group=group, config=config, biases=biases)
        return y * 1.5 if dist.get_rank() == 1 else y

    out = []
    try:
        for seed in seeds:
            c = fuzz.draw_case(seed, worlds=(2,))
            fuzz.run_case_distributed(c, torch.device("cpu"), layer=layer)
            out.append((seed, "ok"))
        try:
            fuzz.run_case_distributed(fuzz.draw_case(seeds[0], worlds=(2,)), torch.device("cpu"), layer=spoiled)
            out.append(("spoiled", "passed"))
        except AssertionError as e:
            out.append(("spoiled", str(e)))
    except Exception as e:  # noqa: BLE001
        out.append(("error", repr(e)))
    finally:
        dist.destroy_process_group()
    q.put((rank, out))


def test_distributed_harness_checks_each_rank_and_agrees():
    import tempfile

    import torch.multiprocessing as mp

    cases = {s: fuzz.draw_case(s, worlds=(2,)) for s in range(40)}
    seeds = [s for s, c in cases.items() if c.T > 0 and not c.shared][:2]
    seeds += [next(s for s, c in cases.items() if c.T > 0 and c.shared)]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_distributed_worker, args=(os.path.join(d, "init"), seeds, q), nprocs=2, join=True)
    res = dict(q.get() for _ in range(2))
    for r in range(2):
        assert res[r][:len(seeds)] == [(s, "ok") for s in seeds], res[r]
        what, msg = res[r][-1]
        assert what == "spoiled" and "rank 1: AssertionError: y: relative error" in msg, msg
