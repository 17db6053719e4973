"""Run a function on every rank of a process group.

    launch(fn, *args)                  # one process per GPU (or the ranks torchrun started)
    launch(fn, *args, nprocs=2, cpu=True)   # 2 CPU processes over gloo (tests)

``fn(rank, world_size, *args)`` runs with the default process group initialized (NCCL on GPUs,
gloo on CPU) and, on GPUs, ``torch.cuda.set_device(local_rank)`` done. Under torchrun (the
environment has RANK and WORLD_SIZE) the process group is initialized from the environment and
``fn`` runs in the calling process. Otherwise the processes are spawned here, on 127.0.0.1 and a
free port; an exception in any child is raised in the parent as :class:`LaunchError` carrying
the traceback of the rank that failed first (its peers usually fail next, in a collective),
and the other children are terminated.

NVLink multicast stays off: the variables below are set (``setdefault``) at import, before any
process group or NVSHMEM initialization, and spawned children inherit them.
"""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from datetime import timedelta

# Multicast (NVLS) can take a shared host's GPUs out of service; never let NCCL, PyTorch's
# symmetric memory or NVSHMEM use it (docs/design.md).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _k, _v in SAFE_ENV.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402  (after the environment is fixed)
import torch.distributed as dist  # noqa: E402

DEFAULT_TIMEOUT = timedelta(minutes=10)


class LaunchError(RuntimeError):
    """A spawned rank raised or died; the message holds its rank and traceback."""


def under_torchrun() -> bool:
    """True when the environment already describes this process's rank (torchrun, SLURM wrappers)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, local_rank: int, backend: str, init_method: str | None, timeout) -> None:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    kwargs = dict(backend=backend, rank=rank, world_size=world, timeout=timeout)
    if init_method is not None:
        kwargs["init_method"] = init_method
    dist.init_process_group(**kwargs)


def _note_failure(tmp: str, rank: int) -> None:
    # The traceback with a timestamp, taken before the process group goes away: when one rank
    # fails its peers fail next in a collective, and the parent names the first.
    with open(os.path.join(tmp, f"error-{rank}.txt"), "w") as f:
        f.write(f"{time.time()!r}\n{traceback.format_exc()}")


def _child(local_rank, fn, world, port, backend, args, tmp, timeout):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank))
    try:
        _init(local_rank, world, local_rank, backend, f"tcp://127.0.0.1:{port}", timeout)
    except BaseException:
        _note_failure(tmp, local_rank)
        raise
    try:
        result = fn(local_rank, world, *args)
    except BaseException:
        _note_failure(tmp, local_rank)
        raise
    finally:
        dist.destroy_process_group()
    if local_rank == 0:
        with open(os.path.join(tmp, "rank0.pkl"), "wb") as f:
            pickle.dump(result, f)


def _first_failure(tmp: str, fallback: str) -> str:
    found = []
    for name in os.listdir(tmp):
        if name.startswith("error-"):
            with open(os.path.join(tmp, name)) as f:
                stamp, _, tb = f.read().partition("\n")
            found.append((float(stamp), int(name[6:-4]), tb))
    if not found:
        return fallback
    found.sort()
    _, rank, tb = found[0]
    others = sorted(r for _, r, _ in found[1:])
    also = f" (then rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} failed too)" if others else ""
    return f"rank {rank} failed first{also}:\n{tb}"


def launch(fn, *args, nprocs: int | None = None, cpu: bool | None = None, timeout=DEFAULT_TIMEOUT):
    """Run ``fn(rank, world_size, *args)`` on every rank; return rank 0's result (this rank's under torchrun).

    ``cpu``: None picks NCCL when CUDA is available, else gloo; True forces gloo on the CPU.
    ``nprocs``: processes to spawn (default: the number of GPUs; required with gloo). ``fn`` and
    ``args`` must be picklable (a module-level function) because children are spawned, not forked.
    """
    if cpu is None:
        cpu = not torch.cuda.is_available()
    backend = "gloo" if cpu else "nccl"
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if not dist.is_initialized():
            _init(rank, world, int(os.environ.get("LOCAL_RANK", rank)), backend, None, timeout)
        return fn(rank, world, *args)
    if nprocs is None:
        if cpu:
            raise ValueError("launch(cpu=True) needs nprocs (how many gloo processes to spawn)")
        nprocs = torch.cuda.device_count()
    if nprocs < 1:
        raise ValueError(f"launch needs at least one process, got nprocs={nprocs}")
    if not cpu and nprocs > torch.cuda.device_count():
        raise ValueError(f"asked for {nprocs} GPU processes but only {torch.cuda.device_count()} GPUs are visible")
    import torch.multiprocessing as mp

    for attempt in range(3):
        with tempfile.TemporaryDirectory(prefix="tabby-launch-") as tmp:
            try:
                mp.spawn(_child, args=(fn, nprocs, free_port(), backend, args, tmp, timeout), nprocs=nprocs,
                         join=True)
            except mp.ProcessRaisedException as e:
                msg = _first_failure(tmp, f"rank {e.error_index} (pid {e.error_pid}) raised:\n{e.msg}")
            except mp.ProcessExitedException as e:
                msg = _first_failure(tmp, f"rank {e.error_index} (pid {e.error_pid}) died: {e.msg}")
            else:
                result_path = os.path.join(tmp, "rank0.pkl")
                if not os.path.exists(result_path):
                    return None
                with open(result_path, "rb") as f:
                    return pickle.load(f)
        # The free port can be taken between free_port() and the store binding it: try another.
        if not (attempt < 2 and "init_process_group" in msg and "EADDRINUSE" in msg):
            raise LaunchError(msg)
