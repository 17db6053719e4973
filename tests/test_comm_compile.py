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

    ptrs = {"row_src": "*i32", "num_tiles_ptr": "*i32", "src_ptrs": "*i64", "dst": "*bf16", "w_ptrs": "*i64",
            "ws_out": "*fp32"}
    # the dispatch (rows with their weights), and the backward's copy of this rank's rows (ONLY_RANK)
    for name, extra in (("pull", dict(WITH_WEIGHTS=True)), ("only_rank", dict(WITH_WEIGHTS=False, ONLY_RANK=True))):
        const = dict(BR=32, BH=512, TILE_ROWS=128, ROWS_16B=True, **extra)
        ptx = compile_for_sm90(comm.pull_rows_kernel, const, ptrs, divisible=("H", "TK"), num_warps=8).asm["ptx"]
        for pat in PATTERNS:
            print(name, pat, len(re.findall(re.escape(pat) + r"\b", ptx)))


def test_pull_rows_vectorized():
    out = run_compiled_check(__file__).splitlines()
    for name in ("pull", "only_rank"):
        counts = {k: int(v) for n, k, v in (line.split() for line in out) if n == name}
        assert counts["ld.global.v4"] > 0 and counts["st.global.v4"] > 0, (name, counts)
        assert counts["ld.global.b16"] == 0 and counts["st.global.b16"] == 0, (name, counts)


def _signal_wait_ptx():
    from tabby.ops import comm

    ptrs = {"flag_ptrs": "*i64", "my_flags": "*i32", "epoch_ptr": "*i32", "err_ptr": "*i32"}
    ptx = compile_for_sm90(comm.signal_wait_peers_kernel, dict(BUMP=True), ptrs, num_warps=1).asm["ptx"]
    # the order of the first release (the signal) and the first acquire (the peers' flags)
    rel = re.search(r"atom\.global\.sys\.release", ptx)
    acq = re.search(r"ld\.global\.sys\.acquire", ptx)
    print("release_sys", rel.start() if rel else -1)
    print("acquire_sys", acq.start() if acq else -1)


def test_signal_wait_signals_then_waits_at_system_scope():
    # signal_wait_peers_kernel (one launch for a signal and its wait): the peers' flags are set with
    # a system-scope release before this rank polls its own with system-scope acquires
    out = {k: int(v) for k, v in (line.split() for line in run_compiled_check(__file__, "signal_wait").splitlines())}
    assert 0 <= out["release_sys"] < out["acquire_sys"], out


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["signal_wait"]:
        _signal_wait_ptx()
    else:
        _ptx_counts()
