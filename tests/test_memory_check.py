"""The memory check before a shape's buffers: what the layer needs (``memory_needs``, the worst
case of ``memory_report``) against what the device has free (``free_device_bytes``, monkeypatched
here: on the CPU there is no check). A call that cannot fit raises ``tabby.TabbyMemoryError`` (an
``MoEInputError``) before anything is allocated, saying how many GiB are needed and free and which
settings lower it; at EP > 1 every rank raises, so that no rank waits for one that gave up.
"""
import re
import threading

import pytest
import torch

import tabby
from tabby import MoEConfig, MoEInputError, TabbyMemoryError, Tuning
from tabby.functional import memory
from tabby.functional.plan import make_plan
from tabby.functional.threads import run_ranks
from tabby.functional.workspace import WorkspaceKey, cached_workspaces, workspace_bytes
from tabby.validate import MoEDims

GiB = 2 ** 30


def _args(T, H, I, E_local, k, W=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.randint(E_local * W, (T, k), generator=g)
    wts = torch.rand(T, k, generator=g)
    ws = [torch.zeros(E_local, I, H, dtype=torch.bfloat16), torch.zeros(E_local, I, H, dtype=torch.bfloat16),
          torch.zeros(E_local, H, I, dtype=torch.bfloat16)]
    return x, idx, wts, *ws


def test_cpu_has_no_free_memory_query():
    assert memory.free_device_bytes(torch.device("cpu")) is None


def test_needs_agree_with_the_report_and_the_settings_lower_them():
    d = MoEDims(T=16384, H=2048, k=8, E_local=64, I=768, world_size=2, I_shared=0)
    plan = lambda **kw: make_plan(d, MoEConfig(**kw), torch.device("cpu"))  # noqa: E731
    keep = memory.memory_needs(plan(tuning=Tuning(ring_rows=2048, pull_tokens=False)))
    assert f"keeps {keep.kept / 2**20:.1f} MiB" in memory.memory_report(plan(tuning=Tuning(ring_rows=2048,
                                                                                             pull_tokens=False)))
    recompute = memory.memory_needs(plan(save_for_backward=False, tuning=Tuning(ring_rows=2048, pull_tokens=False)))
    assert recompute.recompute and not keep.recompute
    # one layer's peak is the same but for h, made again with g | u (the check sums a pass's transients: an
    # upper bound), held from forward to backward less: the ring and the schedule (row_src: 4 bytes a row)
    assert recompute.peak() == keep.peak() + keep.R_max * 768 * 2
    assert recompute.held() == keep.ring + 4 * keep.R_max < keep.held()
    assert keep.peak(differentiated=False) == keep.ring < keep.peak()
    separate = memory.memory_needs(plan(megakernel=False))
    assert separate.ring == 0 and separate.peak() == separate.kept + max(separate.forward, separate.backward)
    half = memory.memory_needs(make_plan(MoEDims(T=8192, H=2048, k=8, E_local=64, I=768, world_size=2, I_shared=0),
                                          MoEConfig(megakernel=False), torch.device("cpu")))
    assert half.peak() < 0.6 * separate.peak()  # fewer tokens per call


@pytest.mark.parametrize("mega", [True, False], ids=["megakernel", "separate"])
def test_a_call_that_cannot_fit_raises_before_allocating(mega, monkeypatch):
    T, H, I, E_local, k = 4096, 512, 256, 4, 8
    cfg = MoEConfig(megakernel=mega)
    free = int(0.05 * GiB)
    monkeypatch.setattr(memory, "free_device_bytes", lambda device: free)
    before = len(cached_workspaces())
    x, idx, wts, *ws = _args(T, H, I, E_local, k)
    with pytest.raises(TabbyMemoryError) as info:
        tabby.moe(x, idx, wts, *(w.requires_grad_(True) for w in ws), config=cfg)
    assert isinstance(info.value, MoEInputError)
    assert len(cached_workspaces()) == before  # nothing allocated
    msg = str(info.value)
    plan = make_plan(MoEDims(T=T, H=H, k=k, E_local=E_local, I=I, world_size=1, I_shared=0), cfg,
                     torch.device("cpu"))
    need = memory.memory_needs(plan).peak(differentiated=True) + workspace_bytes(
        WorkspaceKey(T, H, k, E_local, I, 1, torch.bfloat16, "cpu"))
    assert f"needs {need / GiB:.2f} GiB" in msg and f"but {free / GiB:.2f} GiB are free" in msg
    assert "fewer tokens per call" in msg
    assert ("MoEConfig(save_for_backward=False)" in msg) == mega
    assert ("MoEConfig(megakernel=True, save_for_backward=False)" in msg) == (not mega)
    gib = [float(v) for v in re.findall(r"needs ([0-9.]+) GiB", msg)]
    assert gib and gib[0] > free / GiB


def test_a_call_that_fits_runs_and_the_check_is_made_once_per_shape(monkeypatch):
    calls = []

    def free(device):
        calls.append(device)
        return 64 * GiB

    monkeypatch.setattr(memory, "free_device_bytes", free)
    args = _args(5, 24, 16, 2, 2, seed=1)
    cfg = MoEConfig(megakernel=False, tuning=Tuning(tile_m=16, dispatch_rows=16, dispatch_cols=64,
                                                    dispatch_programs=4))
    tabby.free_workspaces()
    with torch.no_grad():
        y = tabby.moe(*args, config=cfg)
        tabby.moe(*args, config=cfg)
    assert len(calls) == 1
    assert (y.float() - tabby.moe_reference(*args).float()).norm() <= 2e-2 * tabby.moe_reference(*args).float().norm()


def test_at_ep2_a_rank_without_memory_makes_every_rank_raise(monkeypatch):
    who = threading.local()
    monkeypatch.setattr(memory, "free_device_bytes", lambda device: 1024 if who.rank == 1 else 64 * GiB)
    T, H, I, E_local, k = 64, 64, 32, 2, 4
    cfg = MoEConfig(megakernel=False, max_wait_ms=20000.0)

    def rank_fn(r, group):
        who.rank = r
        try:
            with torch.no_grad():
                tabby.moe(*_args(T, H, I, E_local, k, W=2, seed=r), group=group, config=cfg)
        except TabbyMemoryError as e:
            return str(e)
        return None

    before = len(cached_workspaces())
    msg0, msg1 = run_ranks(2, rank_fn, timeout=120)
    assert msg1 is not None and "needs" in msg1 and "GiB are free" in msg1
    assert msg0 is not None and "rank(s) [1] of the expert-parallel group lack the device memory" in msg0
    assert len(cached_workspaces()) == before


def test_a_call_without_autograd_needs_only_the_forward(monkeypatch):
    """Free memory between the forward's need and a differentiated call's: a call under no_grad runs,
    a differentiated one raises (the first call of a plan decides, so the workspaces are freed between)."""
    T, H, I, E_local, k = 40, 32, 16, 2, 2
    cfg = MoEConfig(megakernel=False, tuning=Tuning(tile_m=16, dispatch_rows=16, dispatch_cols=64,
                                                    dispatch_programs=4))
    plan = make_plan(MoEDims(T=T, H=H, k=k, E_local=E_local, I=I, world_size=1, I_shared=0), cfg,
                     torch.device("cpu"))
    needs = memory.memory_needs(plan)
    sym = workspace_bytes(WorkspaceKey(T, H, k, E_local, I, 1, torch.bfloat16, "cpu"))
    assert needs.peak(differentiated=False) < needs.peak()
    monkeypatch.setattr(memory, "free_device_bytes", lambda device: sym + needs.peak(differentiated=False))
    x, idx, wts, *ws = _args(T, H, I, E_local, k, seed=2)
    tabby.free_workspaces()
    with torch.no_grad():
        tabby.moe(x, idx, wts, *ws, config=cfg)
    tabby.free_workspaces()
    with pytest.raises(TabbyMemoryError, match="for a differentiated call"):
        tabby.moe(x.requires_grad_(True), idx, wts, *ws, config=cfg)


def _rows(R, C):  # E4M3 rows [R, C] and an fp32 scale per 1x128 tile (a partial last one too)
    return R * (C + 4 * -(-C // 128))


def _cols(R, C):  # transposed E4M3 [C, R] and an fp32 scale per 128x1 tile
    return C * R + 4 * C * -(-R // 128)


def _blocks(E, N, K):  # an E4M3 weight [E, N, K] and an fp32 scale per 128x128 block
    return E * N * K + 4 * E * -(-N // 128) * -(-K // 128)


@pytest.mark.parametrize("H,I", [(1024, 512), (2880, 2880)], ids=["multiples-of-128", "partial-tiles"])
def test_fp8_buffers_are_counted(H, I):
    """precision="fp8": E4M3 rows (with a scale per 1x128 tile, partial ones too) kept instead of bf16,
    h in E4M3, the FP8 backward's quantized operands, and the weights' FP8 copies (kept while the
    weights live) with, by default, their transposes ([W_gate^T | W_up^T] with each half padded to
    a multiple of 128: gpt-oss-120b's 2880 to 2944)."""
    dims = MoEDims(T=1024, H=H, k=4, E_local=8, I=I, world_size=1, I_shared=0)

    def needs(precision, **kw):
        return memory.memory_needs(make_plan(dims, MoEConfig(megakernel=False, precision=precision, **kw),
                                              torch.device("cpu")))

    need = {p: needs(p) for p in ("bf16", "fp8-forward", "fp8")}
    made = needs("fp8", cache_fp8_transposes=False)
    R, E, Ip = need["bf16"].R_max, 8, -(-I // 128) * 128
    assert need["fp8"].R_max == R and need["bf16"].fp8_weights == 0
    assert need["bf16"].forward == R * 2 * I
    assert need["fp8"].forward == _rows(R, I)  # h in E4M3; the rows are kept
    assert need["fp8-forward"].forward == _rows(R, H) + _rows(R, I)  # the bf16 rows quantized, and h
    assert need["fp8"].kept == need["bf16"].kept - R * 2 * H + _rows(R, H)  # the rows kept in E4M3
    assert need["fp8-forward"].kept == need["bf16"].kept  # its bf16 backward keeps bf16 rows
    assert need["fp8-forward"].backward == need["bf16"].backward
    # dy rows pulled in E4M3 (never bf16); dg | du per 1x128 (halves padded); the 128x1 forms
    assert need["fp8"].backward == (need["bf16"].backward - R * 2 * H + _rows(R, H) + _rows(R, 2 * Ip)
                                    + _cols(R, 2 * I) + 2 * _cols(R, H) + _cols(R, I))
    copies = _blocks(E, I, H) * 2 + _blocks(E, H, I)
    transposes = _blocks(E, I, H) + _blocks(E, H, 2 * Ip)
    assert need["fp8-forward"].fp8_weights == made.fp8_weights == copies
    assert need["fp8"].fp8_weights == copies + transposes
    assert made.backward == need["fp8"].backward + transposes  # made (and dropped) in each backward
    assert need["fp8"].peak() > need["fp8-forward"].peak() > need["bf16"].peak()
    report = memory.memory_report(make_plan(dims, MoEConfig(megakernel=False, precision="fp8"), torch.device("cpu")))
    assert f"E4M3 copies (with their transposes) {(copies + transposes) / 2**20:.1f} MiB" in report
    assert "E4M3" not in memory.memory_report(make_plan(dims, MoEConfig(megakernel=False), torch.device("cpu")))


@pytest.mark.parametrize("held", [True, False], ids=["transposes-held", "one-copy"])
def test_fp8_shortfall_names_the_transposes_it_holds(held, monkeypatch):
    """An FP8 call that holds its weights' transposes (the default) and does not fit says how much
    not holding them gives back; one that does not hold them has nothing to give back there."""
    T, H, I, E_local, k = 4096, 512, 256, 4, 8
    cfg = MoEConfig(precision="fp8", cache_fp8_transposes=held)
    monkeypatch.setattr(memory, "free_device_bytes", lambda device: int(0.05 * GiB))
    x, idx, wts, *ws = _args(T, H, I, E_local, k)
    with pytest.raises(TabbyMemoryError) as info:
        tabby.moe(x, idx, wts, *(w.requires_grad_(True) for w in ws), config=cfg)
    msg = str(info.value)
    assert ("MoEConfig(cache_fp8_transposes=False)" in msg) == held
    d = MoEDims(T=T, H=H, k=k, E_local=E_local, I=I, world_size=1, I_shared=0)
    with_t, without = (memory.memory_needs(make_plan(d, MoEConfig(precision="fp8", cache_fp8_transposes=h),
                                                      torch.device("cpu"))) for h in (True, False))
    if held:  # the GiB it names are what the held copies add to the need
        assert f"{(with_t.fp8_weights - without.fp8_weights) / GiB:.2f} GiB less" in msg


_SMALL = dict(tile_m=16, dispatch_rows=16, dispatch_cols=64, dispatch_programs=4)


@pytest.mark.parametrize("cfg", [
    MoEConfig(megakernel=False, tuning=Tuning(**_SMALL)),
    MoEConfig(tuning=Tuning(**_SMALL, ring_rows=64, programs=3)),
    MoEConfig(save_for_backward=False, tuning=Tuning(**_SMALL, ring_rows=64, programs=3)),
    MoEConfig(tuning=Tuning(**_SMALL, ring_rows=64, programs=3, tma=True, pull_tokens=True)),
    MoEConfig(precision="fp8"), MoEConfig(precision="fp8", cache_fp8_transposes=False),
    MoEConfig(precision="fp8-forward"),
], ids=["separate", "megakernel", "megakernel-recompute", "token-pull", "fp8", "fp8-one-copy", "fp8-forward"])
@pytest.mark.parametrize("shared", [False, True], ids=["", "shared"])
def test_the_layer_allocates_what_the_check_counts(cfg, shared):
    """One differentiated call of each path: the buffers the passes allocate (``Buffers.empty``, in
    order) are the description's, and their bytes are the memory check's (held, forward transients
    and the eager backward's transients); the buffers ops allocate are the sizes described too
    (the megakernel's ring, the schedule)."""
    from tabby.functional.moe import moe_with_probe
    from tabby.functional.probe import Probe

    T, H, I, E, k = (16, 64, 32, 8, 2) if cfg.precision == "bf16" else (8, 128, 144, 2, 1)
    x, idx, wts, *ws = _args(T, H, I, E, k, seed=3)
    ws = [w + 0.01 for w in ws]
    if cfg.precision != "bf16":
        from tabby.functional import fp8

        fp8.clear_weight_cache()
    sh = [torch.randn(48, H).bfloat16() / 8, torch.randn(48, H).bfloat16() / 8,
          torch.randn(H, 48).bfloat16() / 8] if shared else None
    leaves = [t.requires_grad_(True) for t in (x, *ws)]
    probe = Probe()
    moe_with_probe(leaves[0], idx, wts, *leaves[1:], shared=sh, config=cfg, probe=probe).sum().backward()
    with memory.recording() as made:
        moe_with_probe(leaves[0], idx, wts, *leaves[1:], shared=sh, config=cfg, probe=probe).sum().backward()
    bufs = memory.layer_buffers(probe.plan)
    needs = memory.memory_needs(probe.plan)
    assert all(bufs[b.name] is b for b in made)
    assert len({b.name for b in made}) == len(made)  # each once
    described = [b for b in bufs.items.values() if not b.made_by and b.lifetime in ("held", "forward", "backward")
                 and b.form in ("", "owned")]
    assert sorted(b.name for b in made) == sorted(b.name for b in described)
    # the rest of the call's bytes: the schedule's row_src, and transposes a backward makes through the
    # weight cache (off sm_90 with cache_fp8_transposes=False)
    by_ops = sum(b.nbytes for b in bufs.items.values()
                 if b.made_by and b.lifetime in ("held", "forward", "backward") and b.form in ("", "owned"))
    assert sum(b.nbytes for b in made) + by_ops == needs.kept + needs.forward + needs.backward_owned
    if cfg.precision != "bf16":  # the weights' FP8 copies (and transposes) the cache holds
        from tabby.functional import fp8

        held = sum(t.untyped_storage().nbytes() for _, _, value in fp8._weight_cache.values() for t in
                   (value if isinstance(value, tuple) else (value,)) if isinstance(t, torch.Tensor))
        assert held == needs.fp8_weights
    ws_ = [w for w in cached_workspaces() if w.plans and probe.plan in w.plans.values()][0]
    if probe.plan.mega is not None:
        mb = ws_.mega_buffers
        ring = [mb.counters, mb.xs_ring, mb.h_ring, mb.h_sh, mb.extra, mb.sh_tiles, mb.sh_n]
        assert sum(t.untyped_storage().nbytes() for t in ring if t is not None) == needs.ring
    assert bufs["row_src"].shape[0] == needs.R_max


@pytest.mark.parametrize("shape", ["kimi-k2", "glm-5", "qwen3.5-397b", "deepseek-v4-pro", "qwen3-30b-a3b",
                                   "gpt-oss-120b", "kimi-k2@ep8", "qwen3-30b-a3b@ep8"])
@pytest.mark.parametrize("config", [MoEConfig(), MoEConfig(megakernel=False), MoEConfig(precision="fp8"),
                                    MoEConfig(precision="fp8", cache_fp8_transposes=False)],
                         ids=["megakernel", "separate", "fp8", "fp8-one-copy"])
def test_bench_shapes_plans_and_their_buffers(shape, config):
    """Each bench shape's plan for an H100 (132 SMs, sm_90) at 16384 tokens: the check's figures are
    the description's sums; the buffers ops allocate are the sizes described (the megakernel's, made
    on the meta device; the schedule's worst case); every transient a pass allocates through the
    description is there; and the plan names its kernels."""
    from tabby.functional.memory import layer_buffers
    from tabby.ops import megakernel
    from tabby.ops.schedule import schedule_capacity
    from tabby_bench.shapes import shape_named

    s = shape_named(shape)
    d = MoEDims(T=16384, H=s.H, k=s.k, E_local=s.E, I=s.I, world_size=1, I_shared=s.I_shared)
    plan = make_plan(d, config, torch.device("cpu"), s.I_shared, sms=132, arch=90)
    bufs, needs = layer_buffers(plan), memory.memory_needs(plan)
    R = schedule_capacity(1, d.T, d.k, d.E_local, plan.tile_m, plan.align_tiles)
    assert needs.R_max == R == bufs["row_src"].shape[0]
    assert needs.kept == bufs.nbytes("held") and needs.ring == bufs.nbytes("shape")
    assert needs.fp8_weights == bufs.nbytes("weights") and needs.forward == bufs.nbytes("forward")
    assert needs.backward == max(bufs.nbytes("backward", "owned"), bufs.nbytes("backward", "operator"))
    if plan.mega is not None:
        mb = megakernel.alloc(plan.mega, d.T, R // plan.tile_m, torch.bfloat16, torch.device("meta"))
        ring = [mb.counters, mb.xs_ring, mb.h_ring, mb.h_sh, mb.extra, mb.sh_tiles, mb.sh_n]
        assert sum(t.untyped_storage().nbytes() for t in ring if t is not None) == needs.ring
    names = {"xs", "gu", "row_w", "dys", "hw", "dw_part", "dw_rows"} if config.precision == "bf16" else {
        "xs_fp8", "xs_fp8_scale", "h_fp8", "h_fp8_scale", "gu", "row_w", "dys_fp8", "dys_fp8_scale", "dgu", "hw",
        "dw_part", "dw_rows", "dgu_fp8", "dgu_fp8_scale", "dgu_t_fp8", "dgu_t_fp8_scale", "dys_t_fp8", "hw_t_fp8",
        "xs_t_fp8"}
    if plan.mega is not None and plan.mega.token_pull:
        names = (names - {"xs"}) | {"tokens"}
    assert names <= set(bufs.items)
    assert "w_down_t_fp8" not in bufs or config.precision == "fp8"
    text = plan.describe()
    assert "gate" in text and "down" in text
