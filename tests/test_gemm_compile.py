"""The weight-gradient kernel's gathered rows (``local_rows``) compile for Hopper (sm_90) with the
same software pipeline as contiguous rows: as many 16-byte async copies in flight (see sm90.py)."""
import re

from sm90 import compile_for_sm90, run_compiled_check


def _async_copies():
    from tabby.ops import gemm

    cfg = gemm.default_config(gemm.KIND_WGRAD, 2048, None, M=768)  # qwen3-30b-a3b: dW_gate/up [E, 768, 2048]
    ptrs = {n: "*bf16" for n in ("a_ptr", "a2_ptr", "b_ptr", "c_ptr", "c2_ptr", "x_ptr")}
    ptrs.update(expert_start_ptr="*i32", expert_count_ptr="*i32", row_src_ptr="*i32")
    for gather in (False, True):
        const = dict(M=768, N=2048, NUM_PAIRS=2, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M,
                     INTERPRET=False, B_GATHER=gather)
        if not gather:
            const.update(row_src_ptr=None, x_ptr=None, TK=1, k=1, rank=0)
        ptx = compile_for_sm90(gemm.expert_wgrad_kernel, const, ptrs,
                               divisible=("stride_ar", "stride_br", "stride_ce", "stride_cm"),
                               num_warps=cfg.num_warps, num_stages=cfg.num_stages).asm["ptx"]
        print(int(gather), len(re.findall(r"cp\.async\.cg\.shared\.global \[[^\]]*\], \[[^\]]*\], 0x10", ptx)))


def test_gathered_wgrad_keeps_its_pipeline():
    # Loading row_src in the step that uses it left one step of B loads in flight instead of
    # num_stages - 1 (6 16-byte copies in the prologue against 18): the kernel loads it a step ahead.
    n = dict(line.split() for line in run_compiled_check(__file__).splitlines())
    assert int(n["0"]) > 0 and n["1"] == n["0"], n


if __name__ == "__main__":
    _async_copies()
