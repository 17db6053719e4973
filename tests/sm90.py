"""Compile a Triton kernel for Hopper (sm_90) on a machine without a GPU.

The interpreter runs a kernel's Python but neither type-checks it like the compiler nor shows the
code it becomes; Triton's whole pipeline (TTIR, TTGIR, PTX, ptxas) runs without a GPU when the
target is named. Tests call :func:`run_compiled_check` which runs their own file as a script in
a subprocess without TRITON_INTERPRET (set for the whole test process by conftest.py).
"""
import os
import subprocess
import sys

import pytest

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def compile_for_sm90(fn, constexprs: dict, ptr_types: dict, divisible=(), **options):
    """``triton.compile`` of ``fn`` for sm_90: pointers 16-byte aligned and the integer arguments
    named in ``divisible`` multiples of 16, as the JIT specializes them at run time; other
    arguments i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: "constexpr" if n in constexprs else ptr_types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or n in divisible}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def run_compiled_check(script: str, *args: str) -> str:
    """Run ``script`` (a test file's ``__main__``) without the interpreter; returns its stdout.

    Skips when this triton has no NVIDIA backend or no ptxas.
    """
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("triton has no NVIDIA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.dirname(os.path.abspath(__file__)), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, os.path.abspath(script), *args], env=env, capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("no ptxas")
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout
