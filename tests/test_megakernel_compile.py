"""The forward megakernel compiles for Hopper (sm_90) on a machine without a GPU.

The interpreter runs the kernel's Python; it does not type-check it the way the compiler does
(e.g. a variable with different types in the branches of an ``if``). So each variant is compiled
through Triton's whole pipeline (see sm90.py; one subprocess compiles them all) at the qwen3-30b-a3b
shape, with the tiles the heuristics give 4- and 8-warp programs and the arguments the launcher
passes (``host.launch``).
"""
import json
import os
import sys
from typing import NamedTuple

import pytest

from sm90 import CompiledCheckServer, Const, compile_args, ptx_hash, ptxas_report, serve

H, I, IS, BM = 2048, 768, 256, 128


class Variant(NamedTuple):
    shared: bool = False  # a shared expert (I_s = 256)
    comm: int = 0  # comm programs
    tma: bool = False
    save: bool = False  # a differentiated forward keeps xs, g | u, row weights
    half: bool = True  # half tiles
    trace: bool = False  # ticket trace (measurement only)
    warps: int = 8  # 4: two programs per SM, narrower tiles, 3 stages
    dn_cols: int = 1  # column tiles per down ticket
    fill_stages: int = 1
    local_rows: bool = False
    tokens: bool = False  # the token pull

    def argv(self):
        return [str(int(v)) for v in self]

    @classmethod
    def from_argv(cls, argv):
        return cls(*(int(a) if isinstance(d, int) and not isinstance(d, bool) else bool(int(a))
                     for a, d in zip(argv, cls._field_defaults.values())))


def plan_of(v: Variant):
    """The MegaPlan of a variant at the qwen3-30b-a3b shape (32 ring slots in groups of 2, fills of
    4 parts, 512 columns per fill step)."""
    from tabby.ops.gemm.bf16 import GemmConfig
    from tabby.ops.megakernel import MegaPlan

    bn_gu, bn_dn, stages = (64, 128, 3) if v.warps == 4 else (128, 256, 4)
    gu = GemmConfig(BM=BM, BN=bn_gu, BK=64, num_warps=v.warps, num_stages=stages)
    dn = GemmConfig(BM=BM, BN=bn_dn, BK=64)
    return MegaPlan(H=H, I=I, I_s=IS if v.shared else 0, tile_m=BM, n_slots=32, group_m=2, prefetch=8, down_lag=2,
                    fill_split=4, fill_cols=512, fill_stages=v.fill_stages, programs=132 * 8 // v.warps,
                    comm_programs=v.comm, num_warps=v.warps, num_stages=stages, gate_up=gu, down=dn,
                    shared_gate_up=gu if v.shared else None, shared_down=dn if v.shared else None,
                    down_cols=v.dn_cols, tma=v.tma, half_tiles=v.half, local_rows=v.local_rows,
                    token_pull=v.tokens)


def compile_variant(v: Variant):
    """Compile the kernel as ``host.launch`` would launch ``plan_of(v)`` at EP2 (flag slots as the
    workspace's: x ready 4, DONE 1, token pull 5)."""
    from tabby.ops.megakernel import kernel as K
    from tabby.ops.megakernel.host import kernel_consts

    plan = plan_of(v)
    C = kernel_consts(plan, world_size=2, has_shared=v.shared, save=v.save, tokens=v.tokens, x_slot=4, done_slot=1,
                      x_pull_slot=5, done_wait=True, interpret=False)
    none = Const(None)
    if v.tma:  # host tensor descriptors: element type and block shape are part of the signature
        def desc(*block):
            return "tensordesc<bf16[%s]>" % ",".join(map(str, block))
        descs = K.Descs(desc(BM, 64), desc(1, C.BN_GU, 64), desc(1, C.BN_GU, 64), desc(BM, 64),
                        desc(1, C.BN_DN, 64), *([desc(BM, 64), desc(1, C.BN_GUS, 64), desc(1, C.BN_GUS, 64),
                                                 desc(BM, 64), desc(1, C.BN_DNS, 64)] if v.shared else [none] * 5),
                        *([desc(BM // 2, 64), desc(BM // 2, 64)] if v.half else [none] * 2))
    else:
        descs = K.Descs(*[none] * 12)
    args = dict(
        sync_args=K.SyncArgs("*i32", "*i32", "*i32", "i32", "i64"),  # the wait budget: 60 s of ns is no i32
        route=K.RouteArgs("*i32", "*i32", "*i32", "*i64", "*i64", "i32:16", "i32"),
        # strides multiples of 16, as the JIT specializes them at these shapes (the loads then pipeline)
        routed=K.RoutedArgs("*bf16", "*bf16", "*bf16", "*bf16", "i32:16", "i32:16", "*bf16", "i32:16", "i32:16"),
        shared=K.SharedArgs("*bf16", "i32", "*bf16", "*bf16", "*bf16", "*bf16", "*bf16", "*i32", "*i32", "i32"),
        order=K.OrderArgs("i32", "i32"),
        **dict(zip(DESC_PARAMS, descs)),
        saved=K.SavedArgs("*i64", "*fp32", "*bf16") if v.save else K.SavedArgs(none, none, none),
        trace="*i64" if v.trace else none,
        peers=K.PeerArgs("i32", "*i64", "*i32", "i32"),
        x_rows="*bf16",
        tokens=K.TokenArgs("*i32", "*i32", "i32") if v.tokens else K.TokenArgs(none, none, "i32"),
        C=Const(C), PROBE=Const(K.ProbeConsts(TRACE_EV=64 if v.trace else 0, ABLATE=0)))
    return compile_args(K.moe_fwd_megakernel, args, num_warps=v.warps, num_stages=plan.num_stages)


DESC_PARAMS = ("xs_desc", "wg_desc", "wu_desc", "h_desc", "wd_desc", "x_desc", "sg_desc", "su_desc", "hsh_desc",
               "sd_desc", "xs_half_desc", "h_half_desc")


def check_launcher(k):
    """Triton's CUDA launcher accepts the compiled kernel's signature: it expands each host tensor
    descriptor into its TMA map, which it finds only among the top-level arguments (a descriptor
    inside a tuple fails its count when the launcher is built, at the first launch on a GPU)."""
    from triton.backends.nvidia.driver import make_launcher

    src = k.src
    arg_idx = lambda x: (src.fn.arg_names.index(x),) if isinstance(x, str) else x  # noqa: E731
    constants = {arg_idx(i): v for i, v in src.constants.items()}
    make_launcher(constants, dict(src.signature), getattr(k.metadata, "tensordesc_meta", None))


def _check(v: Variant):
    k = compile_variant(v)
    assert "ptx" in k.asm and k.asm.get("cubin")
    check_launcher(k)
    per_sm = 8 // v.warps  # programs that must fit one SM
    assert k.metadata.shared * per_sm <= 232448, \
        f"{per_sm} x {k.metadata.shared} bytes of shared memory: more than an H100/H200 SM has"
    ttgir = k.asm["ttgir"]
    # every GEMM K loop is software-pipelined: async copies (cp.async or TMA) into shared memory
    n_async = ttgir.count("async_tma_copy_global_to_local" if v.tma else "async_copy_global_to_local")
    assert n_async > 0, "no pipelined loads"
    if v.tma:  # the GEMMs load through TMA: ordinary async copies are the fills', only when pipelined
        # (and, with local rows, the gate/up tiles' gathered A rows; with the token pull there are no fills)
        n_fill_async = ttgir.count("async_copy_global_to_local")
        assert (n_fill_async > 0) == (v.fill_stages > 1 or v.local_rows), \
            f"fill_stages={v.fill_stages}: {n_fill_async} async copies"
    # ptxas keeps the wgmma asynchronous (C7515 would serialize every one of them: docs/performance.md,
    # "Backward megakernel, first form")
    report = ptxas_report(k)
    assert "C7515" not in report and "are serialized" not in report, report
    print(f"ok {v} smem={k.metadata.shared} async={n_async} ptx={ptx_hash(k.asm['ptx'])}")


V = Variant
CASES = [  # the default variants' PTX is pinned below; these cover every other part of the kernel once
    V(), V(shared=True, comm=16, half=False, trace=True), V(shared=True, tma=True, save=True),
    V(tma=True, save=True, warps=4, dn_cols=2, trace=True),  # traced, as the tools run the TMA defaults
    V(shared=True, tma=True, save=True, dn_cols=2, fill_stages=3),
    V(shared=True, comm=16, tma=True, warps=4, fill_stages=3),
    V(tma=True, save=True, warps=4, dn_cols=2, fill_stages=3, local_rows=True),
    V(tma=True, warps=4, dn_cols=2, fill_stages=3, local_rows=True, tokens=True),
    V(shared=True, tma=True, save=True, dn_cols=2, local_rows=True, tokens=True),
]


@pytest.fixture(scope="module")
def compiled():
    """Compile checks of this file, one subprocess for all (``sm90.CompiledCheckServer``)."""
    server = CompiledCheckServer(__file__)
    yield server
    server.close()


@pytest.mark.parametrize("v", CASES, ids=[",".join(f"{k}={int(x)}" for k, x in c._asdict().items()
                                                   if x != Variant._field_defaults[k]) or "base" for c in CASES])
def test_megakernel_compiles_for_sm90(v, compiled):
    assert "ok" in compiled(*v.argv())


PTX_GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "megakernel_ptx.json")


def _pinned():
    with open(PTX_GOLDEN) as f:
        return json.load(f)


@pytest.mark.parametrize("name", sorted(_pinned()["variants"]))
def test_default_variants_keep_their_sm90_ptx(name, compiled):
    """The PTX of the default variants is the PTX the kernel compiled to before its code was split
    into protocol / tasks / kernel / host (golden/megakernel_ptx.json: sha256 of the instruction
    stream, ``sm90.normalize_ptx``): a change of the kernel's code shows here, even one that no test
    of its outputs sees (an ordering, a fence, a register-allocation change)."""
    import triton

    pinned = _pinned()
    if triton.__version__ != pinned["triton"]:
        pytest.skip(f"the pinned PTX is triton {pinned['triton']}'s; this is {triton.__version__}")
    entry = pinned["variants"][name]
    out = compiled(*Variant(**entry["variant"]).argv())
    got = out.split("ptx=")[1].split()[0]
    assert got == entry["sha256"], f"{name}: the kernel's sm_90 PTX changed"


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve(lambda argv: _check(Variant.from_argv(argv)))
    else:
        _check(Variant.from_argv(sys.argv[1:]))
