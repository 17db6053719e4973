"""Compile a Triton kernel for Hopper (sm_90) on a machine without a GPU.

The interpreter runs a kernel's Python but neither type-checks it like the compiler nor shows the
code it becomes; Triton's whole pipeline (TTIR, TTGIR, PTX, ptxas) runs without a GPU when the
target is named. Tests call :func:`run_compiled_check` which runs their own file as a script in
a subprocess with TRITON_INTERPRET=0 (tabby would otherwise pick the interpreter on a machine
without a GPU, and conftest.py sets it to 1 for the test process); a file of many such checks
runs them in one subprocess (:class:`CompiledCheckServer`), which imports torch and Triton once.
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
    leaf is ``Const(value)``, or a type string ('*bf16', 'i32', 'i64', 'tensordesc<bf16[128,64]>'; a
    Gluon kernel's descriptors name their shared layout: 'tensordesc<fp8e4nv[64,128],NVMMASharedLayout(...)>')
    where pointers are 16-byte aligned and an integer written 'i32:16' is a multiple of 16. A constexpr
    parameter not in ``args`` takes its default (as at a launch), any other an 'i32'."""
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

    import inspect

    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        spec = args.get(name)
        if spec is None:  # a constexpr left out takes its default, as at a launch; anything else an i32
            spec = Const(param.default) if param.is_constexpr and param.default is not inspect.Parameter.empty \
                else "i32"
        signature[name] = walk((i,), spec)
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
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


def serve(check) -> None:
    """The script side of :class:`CompiledCheckServer`: reads JSON argument lists on stdin, one a
    line, and answers each with a JSON line on stdout: what ``check(args)`` printed, or its error.
    The Python start and the imports (most of a compile check's time) are paid once."""
    import contextlib
    import io
    import json
    import traceback

    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else written to stdout (a compiler's messages) goes to stderr
    for line in sys.stdin:
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                check(json.loads(line))
            err = None
        except BaseException:  # noqa: BLE001 - reported to the test that asked
            err = traceback.format_exc()
        reply.write(json.dumps({"out": out.getvalue(), "err": err}) + "\n")
        reply.flush()


class CompiledCheckServer:
    """``run_compiled_check`` for many argument lists in one subprocess: ``script`` (a test file)
    run with ``--serve`` calls :func:`serve` in its ``__main__``; ``server(*args)`` returns what
    ``run_compiled_check(script, *args)`` would (stdout), fails with the error, or skips alike."""

    def __init__(self, script: str, timeout: float = 600):
        import tempfile

        self.script, self.timeout, self.proc = os.path.abspath(script), timeout, None
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed by close()

    def __call__(self, *args: str) -> str:
        import json
        import queue
        import threading

        try:
            import triton.backends.nvidia  # noqa: F401
        except ImportError:
            pytest.skip("triton has no NVIDIA backend here")
        if self.proc is None or self.proc.poll() is not None:
            env = dict(os.environ, TRITON_INTERPRET="0")  # compiled kernels, though this machine has no GPU
            env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.dirname(os.path.abspath(__file__)),
                                                 env.get("PYTHONPATH", "")])
            self.proc = subprocess.Popen([sys.executable, self.script, "--serve"], env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        self.proc.stdin.write(json.dumps(list(args)) + "\n")
        self.proc.stdin.flush()
        answer = queue.Queue()
        threading.Thread(target=lambda: answer.put(self.proc.stdout.readline()), daemon=True).start()
        try:
            line = answer.get(timeout=self.timeout)
        except queue.Empty:
            self._stop()
            raise AssertionError(f"{os.path.basename(self.script)} {' '.join(args)}: no answer in {self.timeout} s")
        if not line:
            self.stderr.seek(0)
            raise AssertionError(f"the compile server stopped: {self.stderr.read()[-4000:]}")
        r = json.loads(line)
        if r["err"] is not None:
            if "ptxas" in r["err"] and "not found" in r["err"]:
                pytest.skip("no ptxas")
            raise AssertionError(r["err"][-4000:])
        return r["out"]

    def _stop(self):
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def close(self):
        self._stop()
        self.stderr.close()


def ptxas_report(kernel) -> str:
    """ptxas's own report (``-v``) on the kernel's PTX for sm_90a. It prints performance notes that
    Triton does not surface, e.g. C7515, "wgmma.mma_async instructions are serialized", under which
    every wgmma of the kernel waits for the one before."""
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        src, out = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(kernel.asm["ptx"])
        r = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", src, "-o", out], capture_output=True,
                           text=True)
    return r.stdout + r.stderr


def check_pinned(script: str, golden: str, what: str) -> None:
    """A pin test's body: the sha256 of each kernel's normalized PTX that ``script`` prints for the
    names in ``golden`` (JSON: triton version, kernels) must equal the pinned ones; skips on another
    triton."""
    import json

    import triton

    with open(golden) as f:
        pinned = json.load(f)
    if triton.__version__ != pinned["triton"]:
        pytest.skip(f"the pinned PTX is triton {pinned['triton']}'s; this is {triton.__version__}")
    got = dict(line.split() for line in run_compiled_check(script, *sorted(pinned["kernels"])).splitlines())
    changed = sorted(n for n, h in pinned["kernels"].items() if got.get(n) != h)
    assert not changed, f"the sm_90 PTX of {what} changed in: {changed}"


def pin_main(kernels, golden: str, argv) -> None:
    """A pin test's ``__main__``: ``--pin`` writes ``golden`` from every kernel of ``kernels()`` (name ->
    a function compiling it); otherwise prints ``name hash`` for the names in ``argv``."""
    import json

    import triton

    if list(argv) == ["--pin"]:
        ks = kernels()
        entry = {"triton": triton.__version__, "normalization": "tests/sm90.py normalize_ptx",
                 "kernels": {name: ptx_hash(ks[name]().asm["ptx"]) for name in sorted(ks)}}
        with open(golden, "w") as f:
            json.dump(entry, f, indent=1)
            f.write("\n")
    else:
        ks = kernels()
        for name in argv:
            print(name, ptx_hash(ks[name]().asm["ptx"]), flush=True)


def plan_at(H: int, I: int, biases: bool = False, **config):
    """The plan an sm_90 GPU makes for a layer of width H, expert width I (T 4096, k 8, 8 local
    experts, EP1) with ``MoEConfig(**config)``: the pinned and compile-checked kernels' tiles."""
    import torch

    from tabby.functional.config import MoEConfig
    from tabby.functional.plan import make_plan
    from tabby.validate import MoEDims

    dims = MoEDims(T=4096, H=H, k=8, E_local=8, I=I, world_size=1, I_shared=0, biases=biases)
    return make_plan(dims, MoEConfig(**config), torch.device("cpu"), arch=90)
