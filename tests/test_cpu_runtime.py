"""Tabby on CPU tensors as a user meets it: no TRITON_INTERPRET set, any numpy, triton imported first or not.

The scripts run in fresh interpreters (the choice of compiled or interpreted kernels is made at
import) with no visible GPU, so these tests run on GPU machines too.
"""
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import triton
import triton.language as tl

from tabby.ops import INTERPRET

# A tiny layer, checked against the reference layer: the README's quickstart at a small size.
_MOE = """
import torch
import tabby
torch.manual_seed(0)
T, H, k, E, I = 8, 64, 2, 4, 32
x = torch.randn(T, H).bfloat16()
topk_idx = torch.randint(0, E, (T, k))
topk_weights = torch.rand(T, k).softmax(-1)
w_gate, w_up = ((torch.randn(E, I, H) / 8).bfloat16() for _ in range(2))
w_down = (torch.randn(E, H, I) / 8).bfloat16()
y = tabby.moe(x, topk_idx, topk_weights, w_gate, w_up, w_down, config=tabby.MoEConfig(megakernel=MEGAKERNEL))
ref = tabby.moe_reference(x.float(), topk_idx, topk_weights, w_gate.float(), w_up.float(), w_down.float())
err = ((y.float() - ref).norm() / ref.norm()).item()
assert err < 2e-2, err
print("OK", err)
"""


def _run(script: str, **env_overrides) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no usable GPU, as on a CPU machine
    env.update(env_overrides)
    # numpy >= 2.4 refuses int() of a 1-element array; older numpy only warns: make it an error
    cmd = [sys.executable, "-W", "error:Conversion of an array with ndim > 0:DeprecationWarning",
           "-c", textwrap.dedent(script)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


def test_moe_on_cpu_tensors_without_triton_interpret():
    """``import tabby`` selects the interpreter by itself, says so once (logger "tabby", INFO),
    and the megakernel path matches the reference."""
    proc = _run("import logging, os\nlogging.basicConfig(level=logging.INFO)\n"
                + _MOE.replace("MEGAKERNEL", "True")
                + "assert os.environ['TRITON_INTERPRET'] == '1' and tabby.ops.INTERPRET\n")
    _ok(proc)
    assert proc.stderr.count("run under Triton's interpreter") == 1, proc.stderr


def test_moe_on_cpu_tensors_with_triton_imported_first():
    """triton imported before tabby, so its library (tl.sum, tl.zeros, ...) was decorated for the
    compiler: tabby re-makes it for the interpreter and the layer runs."""
    _ok(_run("import triton, triton.language as tl\n" + _MOE.replace("MEGAKERNEL", "False")))


def test_user_choice_of_compiled_kernels_is_kept():
    """TRITON_INTERPRET=0 set by the user: tabby leaves it, and CPU tensors get an error that says
    what to do instead of Triton's "0 active drivers"."""
    proc = _run("""
        import os, torch, tabby
        from tabby.ops import INTERPRET, check_device
        assert os.environ["TRITON_INTERPRET"] == "0" and not INTERPRET
        check_device(torch.device("cuda"))
        try:
            check_device(torch.device("cpu"))
        except tabby.MoEInputError as e:
            assert "TRITON_INTERPRET" in str(e), e
            print("OK")
        """, TRITON_INTERPRET="0")
    _ok(proc)


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's scalars; kernels are compiled here")
def test_loop_over_a_runtime_bound_under_the_interpreter():
    """``for i in range(n)`` with a runtime ``n`` converts a 1-element array to an int; it must not
    go through int(array), which numpy >= 2.4 refuses."""

    @triton.jit
    def _count(out_ptr, n):
        acc = tl.zeros([1], dtype=tl.int32)
        for _ in range(n):
            acc += 1
        tl.store(out_ptr + tl.arange(0, 1), acc)

    out = torch.zeros(1, dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Conversion of an array with ndim > 0", category=DeprecationWarning)
        _count[(1,)](out, 5)
    assert out.item() == 5
