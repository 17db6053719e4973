"""Compile a Triton kernel for Hopper (sm_90) on a machine without a GPU.

The interpreter runs a kernel's Python but neither type-checks it like the compiler nor shows the
code it becomes; Triton's whole pipeline (TTIR, TTGIR, PTX, ptxas) runs without a GPU when the
target is named. Tests call :func:`run_compiled_check` which runs their own file as a script in
a subprocess with TRITON_INTERPRET=0 (tabby would otherwise pick the interpreter on a machine
without a GPU, and conftest.py sets it to 1 for the test process).
"""
import hashlib
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


class Const:
    """A compile-time constant argument (or tuple element) of ``compile_args``."""

    def __init__(self, value):
        self.value = value


def compile_args(fn, args: dict, **options):
    """``triton.compile`` of ``fn`` for sm_90 with its arguments described by ``args``: parameter
    name -> a leaf or a (named) tuple of leaves, as the JIT would specialize them at run time. A
    leaf is ``Const(value)``, or a type string ('*bf16', 'i32', 'i64', 'tensordesc<bf16[128,64]>')
    where pointers are 16-byte aligned and an integer written 'i32:16' is a multiple of 16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = {}, {}, {}

    def leaf(path, spec):
        if isinstance(spec, Const):
            constexprs[path] = spec.value
            return "constexpr"
        ty, _, div = spec.partition(":")
        if ty.startswith("*") or div == "16":
            attrs[path] = [["tt.divisibility", 16]]
        return ty

    def walk(path, spec):
        if isinstance(spec, tuple):
            vals = [walk(path + (j,), s) for j, s in enumerate(spec)]
            return type(spec)(*vals) if hasattr(spec, "_fields") else tuple(vals)
        return leaf(path, spec)

    for i, name in enumerate(fn.arg_names):
        signature[name] = walk((i,), args.get(name, "i32"))
    src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_for_sm90(fn, constexprs: dict, ptr_types: dict, divisible=(), **options):
    """``compile_args`` with flat arguments: ``constexprs`` by name, the types of the others in
    ``ptr_types`` (default i32), the integers named in ``divisible`` multiples of 16."""
    args = {n: Const(v) for n, v in constexprs.items()}
    args.update({n: t for n, t in ptr_types.items() if n not in constexprs})
    args.update({n: "i32:16" for n in divisible if n not in args})
    return compile_args(fn, args, **options)


def normalize_ptx(ptx: str) -> str:
    """The kernel's instruction stream without what legitimately changes when only the source's
    layout does: the .param list of the entry (parameters renamed P0, P1, ... in the order the body
    first uses them), debug line info (.loc, .file, the debug sections and their $L__tmp / func
    labels) and comments."""
    out, names, body = [], {}, False
    for line in ptx.splitlines():
        s = line.split("//")[0].rstrip()
        st = s.strip()
        if st.startswith(".file") or st.startswith(".section"):
            break
        if not st:
            continue
        if not body:
            if st == "{":
                body = True
            elif ".param" in st or st.startswith(".visible .entry") or st == ")":
                continue
        if st.startswith(".loc") or re.fullmatch(r"\$L__(tmp|func_begin|func_end)\d+:", st):
            continue
        out.append(re.sub(r"\b\w+_param_\d+\b", lambda m: names.setdefault(m.group(0), f"P{len(names)}"), s))
    return "\n".join(out) + "\n"


def ptx_hash(ptx: str) -> str:
    return hashlib.sha256(normalize_ptx(ptx).encode()).hexdigest()


def run_compiled_check(script: str, *args: str) -> str:
    """Run ``script`` (a test file's ``__main__``) without the interpreter; returns its stdout.

    Skips when this triton has no NVIDIA backend or no ptxas.
    """
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("triton has no NVIDIA backend here")
    env = dict(os.environ, TRITON_INTERPRET="0")  # compiled kernels, though this machine has no GPU
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.dirname(os.path.abspath(__file__)), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, os.path.abspath(script), *args], env=env, capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("no ptxas")
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout
