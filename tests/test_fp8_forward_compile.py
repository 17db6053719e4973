"""The FP8 forward GEMMs' loops (and the down dgrad's), compiled for sm_90a on a machine without a GPU.

Rows GEMM (= down: N = H, K = I) and down dgrad (N = I, K = H), at the benchmark's shapes, an
N that is not a multiple of 128, and gpt-oss-120b's H = I = 2880 (a partial last K block: its
masked loads stay 16-byte async copies, the mask being constant over 64 columns), default
configs: each K block of 128 is one ``warp_group_dot``
(``QGMMA.64x128x32.F32.E4M3.E4M3``) fed by 16-byte async copies (``num_stages - 1`` in flight,
no byte loads), promoted right after its dot; no wgmma serialization (C7514 / C7515), and no
spills at the benchmark's shapes (N 200, K 384 is three K blocks, all peeled by the pipeliner,
with the B addresses taken modulo N: not a layer shape, no spill bound claimed there).

Gate/up at its default (TMA loads of A, Wg and Wu, 64-row kernel tiles at 8 warps, 5 stages;
at H = I = 2880 the same loop, TMA filling the partial blocks with zeros):
no per-thread load addresses, each warpgroup a 64 x 64 quarter of g and of u (32 registers per
tile), so no spills and registers to spare; its stages fit in sm_90's 227 KB of shared memory;
part of g's promotion is issued while g's QGMMAs run. Its pointer loop, for H that is not a
multiple of 16 (no tensor descriptor), is checked to compile to FP8 wgmma within shared memory
at its stage count.
"""
import os
import re
import subprocess
import sys
import tempfile

from sm90 import Const, compile_args, ptxas_report, run_compiled_check

SMEM_SM90 = 232448  # bytes of shared memory a block may take on sm_90 (227 KB)


def _i32(v):
    return "i32:16" if v % 16 == 0 else "i32"


def _rows(N, K):
    from tabby.functional import heuristics
    from tabby.ops.gemm import fp8 as gemm_fp8

    cfg = heuristics.fp8_rows(N, K, 128, ws=False, programs=None).config
    args = dict(a_ptr="*fp8e4nv", stride_am=_i32(K), as_ptr="*fp32", stride_asm=_i32(-(-K // 128)),
                b_ptr="*fp8e4nv", stride_be=_i32(N * K), stride_bn=_i32(K), bs_ptr="*fp32",
                stride_bse=_i32(-(-N // 128) * -(-K // 128)), stride_bsn=_i32(-(-K // 128)), c_ptr="*bf16",
                stride_cm=_i32(N), row_src_ptr="*i32", dst_ptrs_ptr="*i64", TK="i32", stride_dm="i32",
                tile_expert_ptr="*i32", num_tiles_ptr="*i32", num_m="i32:16", N=Const(N), K=Const(K),
                BM=Const(cfg.BM), BN=Const(cfg.BN), GROUP_M=Const(cfg.GROUP_M), EVEN_K=Const(K % 128 == 0),
                PUSH=Const(False), DST_DTYPE=Const(None))
    return compile_args(gemm_fp8.rows_gemm_fp8_kernel, args, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _dgrad(H, I):
    from tabby.functional import heuristics
    from tabby.ops.gemm import fp8 as gemm_fp8

    cfg = heuristics.fp8_down_dgrad(128, ws=False, programs=None).config
    nk, ni = -(-H // 128), -(-I // 128)
    args = dict(a_ptr="*fp8e4nv", stride_am=_i32(H), as_ptr="*fp32", stride_asm=_i32(nk), b_ptr="*fp8e4nv",
                stride_be=_i32(I * H), stride_bn=_i32(H), bs_ptr="*fp32", stride_bse=_i32(ni * nk),
                stride_bsn=_i32(nk), gu_ptr="*bf16", stride_gum=_i32(2 * I), ws_ptr="*fp32", dgu_ptr="*bf16",
                stride_dgum=_i32(2 * I), hw_ptr="*bf16", stride_hwm=_i32(I), dwp_ptr="*fp32",
                stride_dwpm=_i32(ni), tile_expert_ptr="*i32", num_tiles_ptr="*i32", num_m="i32:16",
                H=Const(H), I=Const(I), BM=Const(cfg.BM), BN=Const(cfg.BN), GROUP_M=Const(cfg.GROUP_M),
                EVEN_K=Const(H % 128 == 0))
    return compile_args(gemm_fp8.down_dgrad_swiglu_fp8_kernel, args, num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages)


def _gate_up(H, I):
    """The kernel as gate_up_swiglu_fp8 launches it at the plan's Triton choice: TMA at
    FP8_GATE_UP_TMA_BM rows where H allows a tensor descriptor, else the pointer loop at the
    schedule's tile."""
    from tabby.functional import heuristics
    from tabby.ops.gemm import fp8 as gemm_fp8

    kernel = heuristics.fp8_gate_up(H, 128, ws=False, programs=None)
    cfg, tma = kernel.config, kernel.tma
    BM = cfg.BM
    nk, ni = -(-H // 128), -(-I // 128)
    args = dict(a_ptr="*fp8e4nv", stride_am=_i32(H), as_ptr="*fp32", stride_asm=_i32(nk), wg_ptr="*fp8e4nv",
                wu_ptr="*fp8e4nv", stride_we=_i32(I * H), stride_wn=_i32(H), gs_ptr="*fp32", us_ptr="*fp32",
                stride_wse=_i32(ni * nk), stride_wsn=_i32(nk), hq_ptr="*fp8e4nv",
                stride_hm=_i32(I), hs_ptr="*fp32", stride_hsm=_i32(ni), gu_ptr="*bf16", stride_gum=_i32(2 * I),
                tile_expert_ptr="*i32", num_tiles_ptr="*i32", num_m="i32:16", H=Const(H), I=Const(I), BM=Const(BM),
                GROUP_M=Const(cfg.GROUP_M), EVEN_K=Const(H % 128 == 0), SAVE_GU=Const(True),
                INTERPRET=Const(False), USE_TMA=Const(tma),
                a_desc=f"tensordesc<fp8e4nv[{BM},128]>" if tma else Const(None),
                wg_desc="tensordesc<fp8e4nv[1,128,128]>" if tma else Const(None),
                wu_desc="tensordesc<fp8e4nv[1,128,128]>" if tma else Const(None), SUB_M=Const(128 // BM))
    return compile_args(gemm_fp8.gate_up_swiglu_fp8_kernel, args, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _sass(k):
    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.cubin")
        with open(p, "wb") as f:
            f.write(k.asm["cubin"])
        return subprocess.run([tool, "-sass", p], capture_output=True, text=True, check=True).stdout


def _ffma_under_mma(sass):
    """FFMA issued while one of the warpgroup's QGMMAs is outstanding (after a QGMMA, before the
    next wait), however the QGMMAs and the FFMA interleave."""
    n, busy = 0, False
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([\w.]+)", line)
        if not m:
            continue
        op = m.group(1)
        if op.startswith("QGMMA"):
            busy = True
        elif op.startswith("WARPGROUP.DEPBAR"):
            busy = False
        elif op == "FFMA" and busy:
            n += 1
    return n


def _report(k, name):
    ttgir, ptx, rep = k.asm["ttgir"], k.asm["ptx"], ptxas_report(k)
    sass = _sass(k)
    print(name, "async_copy", ttgir.count("ttg.async_copy_global_to_local"), "tma_loads", sass.count("UTMALDG"),
          "qgmma", len(re.findall(r"QGMMA\.64x\d+x32\.F32\.E4M3\.E4M3", sass)),
          "byte_loads", len(re.findall(r"ld\.global(\.\w+)*\.b8\b", ptx)),
          "ffma_under_mma", _ffma_under_mma(sass), "smem", k.metadata.shared,
          "spills", sum(int(n) for n in re.findall(r"(\d+) bytes spill", rep)),
          "c7515", int("C7515" in rep), "serialized", int("are serialized" in rep),
          "regs", max(int(n) for n in re.findall(r"Used (\d+) registers", rep)))


def _main():
    # (2880, 2880): gpt-oss-120b's down (N = H, K = I, a partial last K block of 64 and N tile of 64)
    # and its gate/up dgrad (K = 2 * 2944, each half padded: whole K blocks)
    for N, K in ((2048, 768), (7168, 2048), (200, 384), (2880, 2880), (2880, 5888)):
        _report(_rows(N, K), f"rows_N{N}_K{K}")
    for H, I in ((2048, 768), (7168, 2048), (2880, 2880)):
        _report(_dgrad(H, I), f"dgrad_H{H}_I{I}")
    for H, I in ((2048, 768), (7168, 2048), (2880, 2880)):
        _report(_gate_up(H, I), f"gate_up_H{H}_I{I}")
    _report(_gate_up(2040, 768), "gate_up_ptr_H2040_I768")


def _parse(out):
    res = {}
    for line in out.splitlines():
        f = line.split()
        res[f[0]] = dict(zip(f[1::2], map(int, f[2::2])))
    return res


def test_fp8_forward_loops():
    res = _parse(run_compiled_check(__file__))
    assert len(res) == 12, res
    for name, c in res.items():
        assert c["qgmma"] > 0 and c["smem"] <= SMEM_SM90, (name, c)
        assert c["c7515"] == 0 and c["serialized"] == 0, (name, c)  # no wgmma serialization (C7514 / C7515)
        if name.startswith("gate_up_ptr"):
            continue  # rows of H bytes, not 16-byte aligned: byte loads, and no spill bound claimed
        assert c["byte_loads"] == 0, (name, c)
        assert c["spills"] == 0 or name == "rows_N200_K384", (name, c)
        if name.startswith("gate_up"):
            # TMA loads (A, Wg, Wu: no per-thread addresses), two 64 x 64 quarters per warpgroup
            assert c["tma_loads"] >= 3 and c["async_copy"] == 0, (name, c)
            assert c["regs"] <= 200, (name, c)
            assert c["ffma_under_mma"] >= 8, (name, c)  # part of g's promotion while g's MMA runs
        else:
            assert c["async_copy"] >= 6, (name, c)  # A and B, num_stages - 1 in flight (prologue and loop)


if __name__ == "__main__":
    sys.exit(_main())
