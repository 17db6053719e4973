"""The plan: what the heuristics choose at the benchmark shapes and at each rule's edge, what a
Tuning override may and may not ask for, and that a plan is made once per shape and config."""
import dataclasses

import pytest
import torch

from tabby.activation import Activation
from tabby.functional import config, heuristics
from tabby.functional.config import MoEConfig, Tuning, config_string, parse_config
from tabby.functional.plan import make_plan
from tabby.ops.gemm import bf16 as gemm
from tabby.validate import MoEDims, MoEInputError

# name: (experts, H, I, k)
SHAPES = {"kimi-k2": (384, 7168, 2048, 8), "glm-5": (256, 6144, 2048, 8), "qwen3.5-397b": (512, 4096, 1024, 10),
          "deepseek-v4-pro": (384, 7168, 3072, 6), "qwen3-30b-a3b": (128, 2048, 768, 8),
          "gpt-oss-120b": (128, 2880, 2880, 4)}


def _plan(shape, T, W=2, sms=132, I_s=0, **tuning):
    E, H, I, k = SHAPES[shape] if isinstance(shape, str) else shape
    dims = MoEDims(T=T, H=H, k=k, E_local=E // W, I=I, world_size=W, I_shared=I_s)
    return make_plan(dims, MoEConfig(tuning=Tuning(**tuning)), torch.device("cpu"), I_s=I_s, sms=sms)


# (shape, T): (tma, warps, group_m, down_cols, align_tiles, token_pull, fill_stages) at EP2 (the choices
# the layer made at these shapes before its heuristics moved into one module: the move changed none)
EXPECTED = {
    ("kimi-k2", 4096): (True, 8, 4, 1, 2, False, 1), ("kimi-k2", 16384): (True, 8, 4, 1, 1, False, 1),
    ("glm-5", 4096): (True, 8, 4, 1, 2, False, 1), ("glm-5", 16384): (True, 8, 4, 1, 1, True, 1),
    ("qwen3.5-397b", 4096): (True, 8, 4, 2, 2, False, 1), ("qwen3.5-397b", 16384): (True, 8, 4, 2, 1, False, 1),
    ("deepseek-v4-pro", 4096): (True, 8, 4, 1, 2, False, 1), ("deepseek-v4-pro", 16384): (True, 8, 4, 1, 2, False, 1),
    ("qwen3-30b-a3b", 4096): (False, 8, 2, 2, 2, False, 1), ("qwen3-30b-a3b", 16384): (True, 4, 2, 2, 1, True, 3),
    ("gpt-oss-120b", 4096): (True, 8, 4, 1, 2, False, 1), ("gpt-oss-120b", 16384): (True, 8, 4, 1, 1, True, 1),
}


@pytest.mark.parametrize("shape,T", list(EXPECTED))
def test_plans_of_the_benchmark_shapes(shape, T):
    p = _plan(shape, T)
    m = p.mega
    assert (m.tma, m.num_warps, m.group_m, m.down_cols, p.align_tiles, m.token_pull, m.fill_stages) == EXPECTED[shape, T]
    assert m.local_rows == m.tma and m.half_tiles and m.n_slots == 32 and m.prefetch == m.n_groups // 2
    assert m.programs == 132 * (8 // m.num_warps) and 1 <= m.down_lag < m.n_groups
    assert (m.gate_up.BN, m.down.BN) == ((64, 128) if m.num_warps == 4 else (128, 256))


def test_tma_from_the_routed_flop_threshold():
    assert 6 * 4096 * 8 * 2048 * 768 < heuristics.TMA_MIN_FLOP <= 6 * 4096 * 4 * 2880 * 2880
    assert not heuristics.use_tma(4096, 8, 2048, 768, 0) and heuristics.use_tma(16384, 8, 2048, 768, 0)
    assert not heuristics.use_tma(16384, 8, 2044, 768, 0)  # a row stride that is no multiple of 16 bytes


def test_small_experts_group_two_row_tiles_and_the_rule_s_edge():
    assert heuristics.group_m(32, 1024, 2048) == 2 and heuristics.group_m(32, 1024, 2049) == 4
    assert heuristics.group_m(2, 2048, 768) == 1  # two slots: one group of 2 would be the whole ring


def test_experts_aligned_to_two_tiles_only_where_they_average_few_tiles():
    assert heuristics.align_tiles(True, 64, 8, 1, 128, 4) == 2 and heuristics.align_tiles(True, 65, 8, 1, 128, 4) == 1
    assert heuristics.align_tiles(True, 64, 8, 1, 128, 1) == 1  # no row-tile groups
    assert heuristics.align_tiles(False, 64, 8, 1, 128, 4) == 1  # the sync-free path pads nothing


def test_down_tickets_of_two_column_tiles_for_short_expert_widths():
    assert [heuristics.down_cols(I, 8) for I in (768, 1024, 2048, 2880)] == [2, 2, 1, 1]
    assert heuristics.down_cols(768, 3) == 1 and heuristics.down_cols(768, 4, wanted=3) == 2


def test_token_pull_from_the_tiles_per_source_rank():
    E = 64
    edge = heuristics.PULL_TOKENS_MIN_TILES * heuristics.TILE_M * E
    assert heuristics.pull_tokens(edge, 1, E, 128) and not heuristics.pull_tokens(edge - 1, 1, E, 128)
    assert _plan("qwen3-30b-a3b", 16384, pull_tokens=False).mega.token_pull is False
    assert _plan("qwen3.5-397b", 4096, pull_tokens=True).mega.token_pull is True
    assert not _plan("qwen3-30b-a3b", 16384, comm_programs=2).mega.token_pull  # needs every program computing
    assert not _plan("qwen3-30b-a3b", 16384, tma=False).mega.token_pull  # needs the local rows' TMA


@pytest.mark.parametrize("tuning,field", [
    (dict(num_warps=6), "num_warps"), (dict(group_m=3), "group_m"), (dict(ring_rows=128), "ring_rows"),
    (dict(prefetch=16), "prefetch"), (dict(down_lag=0), "down_lag"), (dict(fill_split=3), "fill_split"),
    (dict(tma=False, local_rows=True), "local_rows"), (dict(comm_programs=2, pull_tokens=True), "pull_tokens"),
    (dict(comm_programs=600), "comm_programs"),
])
def test_an_impossible_tuning_is_refused_naming_its_field(tuning, field):
    with pytest.raises(MoEInputError, match=field):
        _plan("qwen3-30b-a3b", 16384, **tuning)


def test_tma_asked_for_where_strides_forbid_it_is_refused():
    with pytest.raises(MoEInputError, match="tma"):
        _plan((128, 2044, 768, 8), 4096, tma=True)
    assert not _plan((128, 2044, 768, 8), 16384).mega.tma  # the heuristic plans without


def test_config_and_tuning_check_their_fields_when_built():
    for bad in (dict(tile_m=0), dict(num_warps="4"), dict(tma=1), dict(prefetch=-1)):
        with pytest.raises(MoEInputError):
            Tuning(**bad)
    for bad in (dict(megakernel=1), dict(debug="yes"), dict(max_wait_ms=0), dict(tuning={"tile_m": 64})):
        with pytest.raises(MoEInputError):
            MoEConfig(**bad)
    t = Tuning.parse("group_m=2, tma=0,ring_rows=2048")
    assert t == Tuning(group_m=2, tma=False, ring_rows=2048) and Tuning.parse(t.describe()) == t
    with pytest.raises(MoEInputError, match="early_ticket"):
        Tuning.parse("early_ticket=1")


def _other_value(owner, f):
    """A value of field ``f`` other than its default, of the field's annotated type."""
    kind, _ = config._field_types(owner)[f.name]
    default = getattr(owner(), f.name)
    if f.name == "precision":
        return "fp8-forward"
    if isinstance(kind, tuple):  # a Literal's strings
        return next(v for v in kind if v != default)
    if kind is bool:
        return not default if default is not None else True
    if kind is Tuning:
        return Tuning(tile_m=64, tma=False)
    if kind is Activation:
        return Activation("gpt-oss", limit=7.0, alpha=1.702)
    return {int: 3, float: 2.5}[kind]


@pytest.mark.parametrize("owner", [MoEConfig, Tuning])
def test_every_field_round_trips_through_its_text(owner):
    """Each field of MoEConfig and Tuning set away from its default comes back from the text
    (``config_string`` / ``parse_config``, ``Tuning.describe`` / ``parse``), alone and all at once;
    the defaults' text is ""."""
    write, read = (config_string, parse_config) if owner is MoEConfig else (Tuning.describe, Tuning.parse)
    assert write(owner()) == "" and read("") == owner()
    every = {}
    for f in dataclasses.fields(owner):
        value = _other_value(owner, f)
        made = owner(**{f.name: value})
        text = write(made)
        assert f"{f.name}=" in text and read(text) == made, (f.name, text)
        if not (owner is MoEConfig and f.name == "megakernel"):  # (True with precision="fp8-forward" is refused)
            every[f.name] = value
    made = owner(**every)
    assert read(write(made)) == made
    assert config_string(None) == ""


def test_the_operator_s_strings_read_as_before():
    """Strings written by the operator's earlier ``config_string`` (bools as 0/1, the tuning last,
    nested "a=1,b=2") read as they did."""
    assert parse_config("megakernel=0;precision=fp8") == MoEConfig(precision="fp8", megakernel=False)
    text = "megakernel=0;max_wait_ms=5000.0;debug=1;precision=fp8;cache_fp8_transposes=0;tuning=tile_m=256,tma=0"
    cfg = MoEConfig(megakernel=False, max_wait_ms=5000.0, debug=True, precision="fp8", cache_fp8_transposes=False,
                    tuning=Tuning(tile_m=256, tma=False))
    assert parse_config(text) == cfg and config_string(cfg) == text
    assert config_string(MoEConfig(save_for_backward=False, tuning=Tuning(group_m=2, pull_tokens=True))) == \
        "save_for_backward=0;tuning=group_m=2,pull_tokens=1"


def test_a_config_s_text_is_written_inside_compiled_code():
    """The operator writes its config string where torch.compile traces (fullgraph): the text form
    reads no annotations then (they are read once, at import)."""
    cfg = MoEConfig(precision="fp8", cache_fp8_transposes=False,
                    tuning=Tuning(tile_m=256, tma=False, fp8_dgrad="transpose_per_call"))
    f = torch.compile(lambda x, c: x * len(config_string(c)), fullgraph=True, backend="eager")
    assert f(torch.ones(2), cfg).tolist() == [len(config_string(cfg))] * 2


@pytest.mark.parametrize("text,field", [
    ("early_ticket=1", "early_ticket"), ("precision", "precision"), ("debug=yes", "debug"),
    ("max_wait_polls=lots", "max_wait_polls"), ("max_wait_ms=soon", "max_wait_ms"), ("precision=fp16", "precision"),
    ("tuning=tile_m=0", "tile_m"), ("tuning=tma=2", "tma"), ("tuning=fp8_dgrad=copy", "fp8_dgrad"),
    ("tuning=group=2", "group"),
])
def test_a_bad_config_text_is_refused_naming_its_field(text, field):
    with pytest.raises(MoEInputError, match=field):
        parse_config(text)
    with pytest.raises(MoEInputError, match="MoEConfig"):
        config_string("megakernel=0")


def test_environment_read_when_a_plan_is_made(monkeypatch):
    dims = MoEDims(T=8, H=32, k=2, E_local=2, I=16, world_size=1, I_shared=0)
    monkeypatch.setenv("TABBY_MAX_WAIT_POLLS", "77")
    monkeypatch.setenv("TABBY_DEBUG", "1")
    p = make_plan(dims, MoEConfig(), torch.device("cpu"))
    assert p.wait_budget == 77 and p.debug
    monkeypatch.delenv("TABBY_DEBUG")
    assert not make_plan(dims, MoEConfig(), torch.device("cpu")).debug
    assert make_plan(dims, MoEConfig(max_wait_polls=5, debug=True), torch.device("cpu")).wait_budget == 5


def test_a_plan_is_made_once_per_shape_and_config_and_freed_on_request():
    import tabby
    from tabby.functional.probe import Probe
    from tabby.functional.moe import moe_with_probe
    from tabby.functional.workspace import cached_workspaces, free_workspaces

    g = torch.Generator().manual_seed(0)
    T, H, I, E, k = 6, 32, 16, 2, 2
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.randint(0, E, (T, k), generator=g)
    w = torch.softmax(torch.randn(T, k, generator=g), 1)
    experts = [torch.randn(E, I, H, generator=g).bfloat16() / 8, torch.randn(E, I, H, generator=g).bfloat16() / 8,
               torch.randn(E, H, I, generator=g).bfloat16() / 8]
    cfg = MoEConfig(tuning=Tuning(tile_m=16, ring_rows=32, programs=3))
    probes = [Probe(), Probe()]
    with torch.no_grad():
        ys = [moe_with_probe(x, idx, w, *experts, config=cfg, probe=p) for p in probes]
        other = Probe()
        moe_with_probe(x, idx, w, *experts, config=dataclasses.replace(cfg, megakernel=False), probe=other)
    assert torch.equal(ys[0], ys[1]) and probes[0].plan is probes[1].plan and other.plan is not probes[0].plan
    assert probes[0].plan.mega is not None and other.plan.mega is None
    assert any(ws.mega_buffers is not None for ws in cached_workspaces())
    assert free_workspaces() > 0 and not cached_workspaces()
    with torch.no_grad():
        assert torch.equal(tabby.moe(x, idx, w, *experts, config=cfg), ys[0])  # made again, same answer


# --------------------------------------------------------------------------------------------
# The kernels of a plan: every GEMM's kernel, tiles and stages chosen here, and named by describe()
# --------------------------------------------------------------------------------------------

def _fp8_plan(shape, precision="fp8", arch=90, cache=True, **tuning):
    E, H, I, k = SHAPES[shape]
    dims = MoEDims(T=16384, H=H, k=k, E_local=E // 2, I=I, world_size=2, I_shared=0)
    config = MoEConfig(precision=precision, cache_fp8_transposes=cache, tuning=Tuning(**tuning))
    return make_plan(dims, config, torch.device("cpu"), sms=132, arch=arch)


def test_fp8_plans_on_sm90_run_the_warp_specialized_kernels_and_name_them():
    p = _fp8_plan("kimi-k2")
    f = p.fp8
    assert {g.core for g in (f.gate_up, f.down, f.down_dgrad, f.gate_up_dgrad, f.wgrad)} == {"ws"}
    assert f.dgrad == "cached_transposes" and not f.down_dgrad.lag and not f.gate_up_dgrad.lag
    # ring depths: gate/up 3, the 128 x 256 rows kernel 3 from K 1024 (4 below), the SwiGLU backward 4 at
    # 128 x 128, each weight-gradient pipeline 3; one program per SM
    assert (f.gate_up.config.num_stages, f.down.config.num_stages, f.down_dgrad.config.num_stages,
            f.wgrad.config.num_stages) == (3, 3, 4, 3)
    assert (f.down.config.BN, f.gate_up_dgrad.config.BN, f.down_dgrad.config.BN) == (256, 256, 128)
    assert f.gate_up.programs == 132
    assert _fp8_plan("qwen3-30b-a3b").fp8.down.config.num_stages == 4  # down's K = I = 768
    text = p.describe()
    assert str(p) == text
    for name in ("gate_up_swiglu_fp8_ws_kernel", "rows_gemm_fp8_ws_wide_kernel", "rows_gemm_fp8_ws_kernel",
                 "expert_wgrad_fp8_ws_kernel", "128x256x128 tiles, 4 warps, 3 stages", "held transposes"):
        assert name in text, (name, text)
    # without held transposes the dgrads transpose the forward's copies in the kernel
    u = _fp8_plan("kimi-k2", cache=False).fp8
    assert u.dgrad == "transpose_in_kernel" and u.down_dgrad.lag == u.gate_up_dgrad.lag == 1
    assert "rows_gemm_fp8_ws_bt_kernel" in _fp8_plan("kimi-k2", cache=False).describe()


def test_fp8_plans_off_sm90_run_the_triton_kernels():
    """The interpreter (or another GPU): the Triton kernels, gate/up through TMA at 64-row kernel
    tiles, the transposes made per call where none are held."""
    p = _fp8_plan("glm-5", arch=None, cache=False)
    f = p.fp8
    assert {g.core for g in (f.gate_up, f.down, f.down_dgrad, f.gate_up_dgrad, f.wgrad)} == {"triton"}
    assert f.gate_up.tma and f.gate_up.config.BM == 64 and f.gate_up.config.GROUP_M == 16
    assert f.gate_up.config.num_stages == 5 and f.down.config.num_stages == 4 and f.dgrad == "transpose_per_call"
    assert (f.wgrad.config.BN, f.wgrad.config.num_warps) == (64, 4)
    text = p.describe()
    for name in ("gate_up_swiglu_fp8_kernel", "rows_gemm_fp8_kernel", "down_dgrad_swiglu_fp8_kernel",
                 "expert_wgrad_fp8_kernel", "64x128x128 tiles, 8 warps, 5 stages, GROUP_M 16, TMA"):
        assert name in text, (name, text)
    # an FP8 forward with a bf16 backward: the bf16 kernels of Plan.gemm run the backward
    fwd = _fp8_plan("glm-5", precision="fp8-forward", arch=None)
    assert fwd.fp8.dgrad is None and fwd.fp8.wgrad is None and "down_dgrad_swiglu_kernel" in fwd.describe()


def test_bf16_plans_choose_the_core():
    """Gate/up, down and the down dgrad on the warp-specialized kernels on sm_90, at the heuristics'
    tiles (the down dgrad narrower at short K and for gpt-oss's), the gate/up dgrad on its Triton
    tiles; the Triton
    kernels everywhere elsewhere or with
    Tuning(bf16_ws=False); Tuning(bf16_ws=True) where they cannot run is an error naming the field;
    the plan's description names the kernels."""
    routed = (gemm.KIND_GATE_UP, gemm.KIND_DOWN, gemm.KIND_DGRAD_SWIGLU, gemm.KIND_GATE_UP_DGRAD)
    E, H, I, k = SHAPES["kimi-k2"]
    dims = MoEDims(T=16384, H=H, k=k, E_local=E // 8, I=I, world_size=1, I_shared=0)
    p = make_plan(dims, MoEConfig(megakernel=False), torch.device("cpu"), sms=132, arch=90)
    for kind in (gemm.KIND_GATE_UP, gemm.KIND_DOWN, gemm.KIND_DGRAD_SWIGLU):
        g = p.gemm[kind]
        assert g.core == gemm.CORE_WS and g.config.BN == heuristics.BF16_WS_TILE_N[kind], kind
        assert g.config.num_stages == heuristics.BF16_WS_STAGES[kind] and g.programs == 132
    kind, N, K = gemm.KIND_GATE_UP_DGRAD, H, 2 * I
    assert p.gemm[kind] == gemm.Bf16Gemm(gemm.CORE_TRITON, heuristics.gemm_config(kind, N, K, p.tile_m)), kind
    for act in (Activation("gpt-oss", limit=7.0, alpha=1.702), Activation("swiglu-clamp", limit=10.0)):
        narrow = make_plan(dims, MoEConfig(megakernel=False, activation=act), torch.device("cpu"), sms=132,
                           arch=90).gemm[gemm.KIND_DGRAD_SWIGLU]
        assert narrow.core == gemm.CORE_WS
        assert (narrow.config.BN, narrow.config.num_stages) == heuristics.BF16_WS_DGRAD_NARROW, act
    short = make_plan(MoEDims(T=16384, H=2048, k=8, E_local=16, I=768, world_size=1, I_shared=0), MoEConfig(
        megakernel=False), torch.device("cpu"), sms=132, arch=90).gemm[gemm.KIND_DGRAD_SWIGLU]
    assert short.core == gemm.CORE_WS and (short.config.BN, short.config.num_stages) == heuristics.BF16_WS_DGRAD_NARROW
    odd_h = MoEDims(T=16384, H=2880 + 8, k=k, E_local=8, I=I, world_size=1, I_shared=0)  # H not a multiple of 64
    assert make_plan(odd_h, MoEConfig(megakernel=False), torch.device("cpu"), sms=132,
                     arch=90).gemm[gemm.KIND_DGRAD_SWIGLU].core == gemm.CORE_TRITON
    for kind in (gemm.KIND_WGRAD_DOWN, gemm.KIND_WGRAD_GATE_UP):
        assert p.gemm[kind].core == gemm.CORE_WS and p.gemm[kind].config.num_stages == heuristics.BF16_WS_WGRAD_STAGES
    assert "expert_wgrad_ws_kernel" in p.describe()
    text = p.describe()
    assert "gate_up_swiglu_ws_kernel" in text and "rows_gemm_ws_kernel" in text and "ws " in text, text
    assert "down_dgrad_ws_kernel" in text, text
    for arch, tuning in ((None, Tuning()), (90, Tuning(bf16_ws=False)), (80, Tuning())):
        p = make_plan(dims, MoEConfig(megakernel=False, tuning=tuning), torch.device("cpu"), sms=132, arch=arch)
        assert {p.gemm[kind].core for kind in routed} == {gemm.CORE_TRITON}
        assert "rows_gemm_ws_kernel" not in p.describe()
    with pytest.raises(MoEInputError, match="bf16_ws"):
        make_plan(dims, MoEConfig(tuning=Tuning(bf16_ws=True)), torch.device("cpu"), sms=132, arch=None)
    odd = MoEDims(T=64, H=100, k=2, E_local=4, I=36, world_size=1, I_shared=0)  # H not a multiple of 8
    assert make_plan(odd, MoEConfig(megakernel=False), torch.device("cpu"), sms=132,
                     arch=90).gemm[gemm.KIND_DOWN].core == gemm.CORE_TRITON


@pytest.mark.parametrize("W", [1, 8])
def test_biases_layouts_and_ungated_experts_take_the_ws_core_on_separate_launches(W):
    """Experts with biases, weights as transformers stores them ("kn", "kn-paired") and ungated ones
    run gate/up, down and the weight gradients on the warp-specialized kernels on sm_90 (never the
    megakernel, whose tiles have neither); transposed weights with H or I not a multiple of 64 on
    the Triton kernels."""
    E, H, I, k = SHAPES["gpt-oss-120b"]
    ws_kinds = (gemm.KIND_GATE_UP, gemm.KIND_DOWN, gemm.KIND_WGRAD_DOWN, gemm.KIND_WGRAD_GATE_UP)
    cases = [(dict(biases=True), Activation("gpt-oss", limit=7.0, alpha=1.702)),
             (dict(layout="kn"), Activation()), (dict(layout="kn-paired", biases=True), Activation()),
             (dict(), Activation("relu2"))]
    for extra, act in cases:
        dims = MoEDims(T=16384, H=H, k=k, E_local=E // 8, I=I, world_size=W, I_shared=0, **extra)
        p = make_plan(dims, MoEConfig(activation=act), torch.device("cpu"), sms=132, arch=90)
        assert p.mega is None and {p.gemm[kind].core for kind in ws_kinds} == {gemm.CORE_WS}, (extra, act)
        assert "gate_up_swiglu_ws_kernel" in p.describe()
    for H_odd, I_odd in ((H + 8, I), (H, I + 8)):
        dims = MoEDims(T=16384, H=H_odd, k=k, E_local=E // 8, I=I_odd, world_size=W, I_shared=0, layout="kn")
        p = make_plan(dims, MoEConfig(), torch.device("cpu"), sms=132, arch=90)
        assert {p.gemm[kind].core for kind in ws_kinds} == {gemm.CORE_TRITON}
        with pytest.raises(MoEInputError, match="multiples of 64"):
            make_plan(dims, MoEConfig(tuning=Tuning(bf16_ws=True)), torch.device("cpu"), sms=132, arch=90)


def test_bf16_plans_name_the_megakernel_and_the_backward_s_kernels():
    p = _plan("kimi-k2", 4096)
    assert p.fp8 is None and p.wgrad_programs == 132
    assert p.gemm_config(gemm.KIND_WGRAD_DOWN).config.BN == 256 and p.gemm_config(gemm.KIND_WGRAD_GATE_UP).config.BK == 32
    text = p.describe()
    for name in ("moe_fwd_megakernel", "132 programs", "down_dgrad_swiglu_kernel", "rows_gemm_kernel",
                 "expert_wgrad_kernel", "128x256x32 tiles"):
        assert name in text, (name, text)
    dims = MoEDims(T=8, H=32, k=2, E_local=2, I=16, world_size=1, I_shared=0)
    assert make_plan(dims, MoEConfig(), torch.device("cpu")).wgrad_programs == heuristics.wgrad_programs(None) == 4


@pytest.mark.parametrize("kw,field", [
    (dict(arch=None, fp8_ws=True), "fp8_ws"),  # no sm_90
    (dict(fp8_ws=True, tile_m=64, precision="fp8-forward"), "fp8_ws"),  # tiles of 64 rows
    (dict(fp8_dgrad="transpose_in_kernel"), "fp8_dgrad"),  # held transposes: the dgrads read them
    (dict(cache=False, fp8_dgrad="cached_transposes"), "fp8_dgrad"),  # none held
    (dict(cache=False, arch=None, fp8_dgrad="transpose_in_kernel"), "fp8_dgrad"),  # needs sm_90's kernels
    (dict(cache=False, fp8_ws=False, fp8_dgrad="transpose_in_kernel"), "fp8_dgrad"),
])
def test_an_fp8_tuning_that_cannot_work_is_refused_naming_its_field(kw, field):
    with pytest.raises(MoEInputError, match=field):
        _fp8_plan("qwen3-30b-a3b", **kw)


def test_fp8_tuning_overrides():
    f = _fp8_plan("qwen3-30b-a3b", fp8_ws=False).fp8  # sm_90, the Triton kernels asked for
    assert {g.core for g in (f.gate_up, f.down, f.down_dgrad, f.gate_up_dgrad, f.wgrad)} == {"triton"}
    f = _fp8_plan("qwen3-30b-a3b", cache=False, fp8_dgrad="transpose_per_call").fp8
    assert f.dgrad == "transpose_per_call" and f.down_dgrad.core == "ws" and not f.down_dgrad.lag
    assert _fp8_plan("qwen3-30b-a3b", cache=False, fp8_ws=False).fp8.dgrad == "transpose_per_call"
    assert _fp8_plan("qwen3-30b-a3b", tile_m=64, precision="fp8-forward").fp8.gate_up.core == "triton"


def test_the_plan_chooses_the_forward_path():
    """MoEConfig(megakernel=None): the megakernel for bf16 but at EP1 where the separate launches
    run the warp-specialized GEMMs (sm_90); FP8 the separate launches; an explicit choice holds."""
    E, H, I, k = SHAPES["glm-5"]
    cpu = torch.device("cpu")
    for W, arch, tuning, precision, want in ((1, 90, Tuning(), "bf16", False), (8, 90, Tuning(), "bf16", True),
                                             (1, 90, Tuning(bf16_ws=False), "bf16", True),
                                             (1, None, Tuning(), "bf16", True), (2, 90, Tuning(), "fp8", False),
                                             (1, 90, Tuning(), "fp8", False)):
        dims = MoEDims(T=4096, H=H, k=k, E_local=E // W, I=I, world_size=W, I_shared=0)
        p = make_plan(dims, MoEConfig(precision=precision, tuning=tuning), cpu, sms=132, arch=arch)
        assert p.megakernel is want and (p.mega is not None) is want, (W, arch, tuning, precision)
        assert heuristics.use_megakernel(precision, W, tuning.bf16_ws is not False and arch == 90) is want
    dims = MoEDims(T=4096, H=H, k=k, E_local=E, I=I, world_size=1, I_shared=0)
    for explicit in (True, False):
        p = make_plan(dims, MoEConfig(megakernel=explicit), cpu, sms=132, arch=90)
        assert p.megakernel is explicit
