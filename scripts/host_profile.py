"""Where the host's time goes in the default layer's forward under autograd (as the bench times it).

    python scripts/host_profile.py --shape qwen3-30b-a3b --tokens 4096 --ep 2 [--calls 20]

Every rank first enqueues a long GPU sleep, then ``--calls`` forwards: the launch queue then never
drains, so the host's time per call is its own (no waiting on the GPU), measured plainly and then
again under cProfile (rank 0's top functions printed; cProfile inflates Python time). Where a
forward is short (qwen3-30b-a3b 4096), the host's time per call can reach the GPU's
(docs/performance.md, "Host overhead").
"""
import argparse
import cProfile
import io
import pstats
import time

import torch

from tabby_bench.launch import launch


def _host_ms(fwd, calls, sleep_cycles):
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)  # the GPU is busy while the host enqueues every call
    t0 = time.perf_counter()
    for _ in range(calls):
        fwd()
    ms = (time.perf_counter() - t0) / calls * 1e3
    torch.cuda.synchronize()
    return ms


def worker(rank, world, shape, T, calls, top):
    import torch.distributed as dist

    import tabby
    from tabby_bench.shapes import SHAPES, make_inputs

    dev = torch.device("cuda", torch.cuda.current_device())
    inp = make_inputs(SHAPES[shape], T, world, rank, dev)
    group = dist.group.WORLD if world > 1 else None

    def fwd():
        return tabby.moe(inp.x, inp.topk_idx, inp.topk_weights, inp.w_gate, inp.w_up, inp.w_down,
                         shared=inp.shared or None, group=group)

    for _ in range(10):
        fwd()
    sleep = int(2e9)  # ~1 s at ~1.9 GHz: longer than the host takes for the calls
    plain = [_host_ms(fwd, calls, sleep) for _ in range(3)]
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep)
    prof.enable()
    for _ in range(calls):
        fwd()
    prof.disable()
    torch.cuda.synchronize()
    tabby.check_errors()
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return dict(rank=rank, host_ms_per_call=plain, profile=out.getvalue() if rank == 0 else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ep", type=int, default=torch.cuda.device_count())
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    res = launch(worker, a.shape, a.tokens, a.calls, a.top, nprocs=a.ep)
    print(f"{a.shape} T={a.tokens} EP{a.ep}: host ms per forward (3 runs of {a.calls} calls, rank 0): "
          + ", ".join(f"{v:.3f}" for v in res["host_ms_per_call"]))
    print(res["profile"])


if __name__ == "__main__":
    main()
