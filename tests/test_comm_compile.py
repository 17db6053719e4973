"""The pull dispatch compiles (sm_90, on a machine without a GPU) to 16-byte vector loads/stores.

Rows reached through an address table lose their alignment when the address is cast to a
pointer; pull_rows_tile addresses them from a pointer argument instead. A regression would make
the dispatch move 2 bytes per load (seen in the PTX before the fix), which no CPU test notices.
"""
import os
import re
import subprocess
import sys

import pytest


def _ptx_counts():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tabby.ops import comm

    fn = comm.pull_rows_kernel
    const = dict(BR=32, BH=512, WITH_WEIGHTS=True, TILE_ROWS=128, ROWS_16B=True)
    ptrs = {"row_src": "*i32", "num_tiles_ptr": "*i32", "src_ptrs": "*i64", "dst": "*bf16", "w_ptrs": "*i64",
            "ws_out": "*fp32"}
    sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in fn.arg_names}
    # As the JIT specializes them at run time: pointers 16-byte aligned, H and TK multiples of 16.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or n in ("H", "TK")}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8)).asm["ptx"]
    for pat in ("ld.global.v4", "ld.global.b16", "st.global.v4", "st.global.b16"):
        print(pat, len(re.findall(re.escape(pat) + r"\b", ptx)))


def test_pull_rows_vectorized():
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("triton has no NVIDIA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("no ptxas")
    assert r.returncode == 0, r.stderr[-3000:]
    counts = dict(line.split() for line in r.stdout.splitlines())
    counts = {k: int(v) for k, v in counts.items()}
    assert counts["ld.global.v4"] > 0 and counts["st.global.v4"] > 0, counts
    assert counts["ld.global.b16"] == 0 and counts["st.global.b16"] == 0, counts


if __name__ == "__main__":
    _ptx_counts()
