"""GPU tests of the anchors against the fp32 reference (skipped without CUDA; EP2 needs two GPUs).

Sizes are qwen3-30b-a3b's (H 2048, I 768, top-8) with fewer tokens; E 128 gives 64 experts per
rank at EP2 (torch-symm regroups 16 chunks of 4), E 16 gives 8 (its direct torchtitan layout).
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from tabby_bench.bench import ep_group
from tabby_bench.check import TOLERANCE
from tabby_bench.impls import IMPLS
from tabby_bench.launch import launch
from tabby_bench.shapes import Shape, make_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

QWEN_LIKE = Shape("qwen3-30b-a3b-small", 128, 2048, 768, 8)
FEW_EXPERTS = Shape("few-experts", 16, 2048, 768, 8, I_shared=512)
T = 2048
TOL = TOLERANCE["bf16"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check(rank, world, impl_name, shape, tokens):
    """Every rank: build inputs, run the benchmark's correctness check; rank 0 returns the errors."""
    inp = make_inputs(shape, tokens, world, rank, torch.device("cuda", rank))
    group = ep_group(world, rank, world)
    return IMPLS[impl_name].prepare(inp, group).check(with_grads=True)


def _assert_close(errs):
    assert errs and all(v < TOL for v in errs.values()), errs


@pytest.mark.parametrize("impl", ["torch-a2a", "torch-symm", "floor"])
@pytest.mark.parametrize("shape", [QWEN_LIKE, FEW_EXPERTS], ids=lambda s: s.name)
def test_anchor_one_gpu(impl, shape):
    _assert_close(_check(0, 1, impl, shape, T))


@two_gpus
@pytest.mark.parametrize("impl", ["torch-a2a", "torch-symm", "floor"])
@pytest.mark.parametrize("shape", [QWEN_LIKE, FEW_EXPERTS], ids=lambda s: s.name)
def test_anchor_ep2(impl, shape):
    # Spawned per test: torch-symm fixes its processes' symmetric-memory backend to NVSHMEM.
    _assert_close(launch(_check, impl, shape, T, nprocs=2))


def _symm_twice(rank, world):
    """Two calls in a row on cached buffers, then a different T: results must not depend on stale data."""
    outs = []
    for tokens in (T, T, T // 2):
        inp = make_inputs(QWEN_LIKE, tokens, world, rank, torch.device("cuda", rank))
        outs.append(IMPLS["torch-symm"].prepare(inp, torch.distributed.group.WORLD).check(with_grads=True))
    return outs


@two_gpus
def test_torch_symm_reuses_buffers():
    for errs in launch(_symm_twice, nprocs=2):
        _assert_close(errs)


def test_move_rows_kernel_matches_torch():
    from tabby_bench.anchors.torch_symm import move_rows

    dev = torch.device("cuda")
    src = torch.randn(300, 2880, device=dev).to(torch.bfloat16)
    idx = torch.randperm(300, device=dev)
    n = torch.tensor([211], device=dev)
    dst = torch.zeros(300, 2880, device=dev, dtype=torch.bfloat16)
    move_rows(src, dst, idx, n, scatter=False)
    assert torch.equal(dst[:211], src[idx[:211]]) and not dst[211:].any()
    dst.zero_()
    move_rows(src, dst, idx, n, scatter=True)
    want = torch.zeros_like(dst)
    want[idx[:211]] = src[:211]
    assert torch.equal(dst, want)


def test_bench_command_on_gpu(tmp_path):
    out = tmp_path / "res"
    proc = subprocess.run([sys.executable, "-m", "tabby_bench", "bench", "--shapes", "qwen3-30b-a3b", "--tokens",
                           "2048", "--warmup", "1", "--iters", "3", "--impls", "floor,torch-a2a,torch-symm,tabby",
                           "--out", str(out), "--tag", "test", "--history", str(tmp_path / "history.jsonl")],
                          capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (path,) = glob.glob(str(out / "*-test-*.json"))
    res = json.load(open(path))
    assert res["gpu_count"] == torch.cuda.device_count() and res["dense_matmul_tflops"] > 100
    recs = {(r["impl"], r["pass"]): r for r in res["records"]}
    for (impl, p), r in recs.items():
        assert r["correct"] is True and r["ms"] > 0 and r["tflops"] > 0, r
    assert recs["floor", "fwd"]["ratio_to_floor"] == pytest.approx(1.0)
    assert os.path.exists(path[:-5] + ".png") and os.path.exists(path[:-5] + ".md")
    history = (tmp_path / "history.jsonl").read_text().splitlines()
    assert len(history) == len(res["records"]) and json.loads(history[0])["commit"]
