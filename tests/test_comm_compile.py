"""The pull dispatch compiles (sm_90, on a machine without a GPU) to 16-byte vector loads/stores.

Rows reached through an address table lose their alignment when the address is cast to a
pointer; pull_rows_tile addresses them from a pointer argument instead. A regression would make
the dispatch move 2 bytes per load (seen in the PTX before the fix), which no CPU test notices.
"""
import re

from sm90 import compile_for_sm90, run_compiled_check

PATTERNS = ("ld.global.v4", "ld.global.b16", "st.global.v4", "st.global.b16")


def _ptx_counts():
    from tabby.ops import comm

    const = dict(BR=32, BH=512, WITH_WEIGHTS=True, TILE_ROWS=128, ROWS_16B=True)
    ptrs = {"row_src": "*i32", "num_tiles_ptr": "*i32", "src_ptrs": "*i64", "dst": "*bf16", "w_ptrs": "*i64",
            "ws_out": "*fp32"}
    ptx = compile_for_sm90(comm.pull_rows_kernel, const, ptrs, divisible=("H", "TK"), num_warps=8).asm["ptx"]
    for pat in PATTERNS:
        print(pat, len(re.findall(re.escape(pat) + r"\b", ptx)))


def test_pull_rows_vectorized():
    counts = {k: int(v) for k, v in (line.split() for line in run_compiled_check(__file__).splitlines())}
    assert counts["ld.global.v4"] > 0 and counts["st.global.v4"] > 0, counts
    assert counts["ld.global.b16"] == 0 and counts["st.global.b16"] == 0, counts


if __name__ == "__main__":
    _ptx_counts()
