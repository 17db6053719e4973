"""scripts/gpu_case_groups.py: the FP8 layer's GPU cases grouped by the shape whose kernels they
compile (scripts/device_run.sh fp8-layer-tests runs one process a group)."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["tests/test_fp8_cases_gpu.py", "tests/test_fp8_layer_gpu.py"]


def test_every_case_is_in_one_group_of_its_shape():
    collect = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *FILES],
                             cwd=REPO, capture_output=True, text=True)
    ids = [line for line in collect.stdout.splitlines() if "::" in line]
    assert len(ids) >= 19, collect.stdout[-2000:]
    out = subprocess.run([sys.executable, "scripts/gpu_case_groups.py"], cwd=REPO, input="\n".join(ids),
                         capture_output=True, text=True, check=True).stdout
    groups = [line.split() for line in out.splitlines()]
    assert sorted(i for g in groups for i in g) == sorted(ids)  # each case once
    by_id = {i: n for n, g in enumerate(groups) for i in g}
    # the bench shape qwen3-30b-a3b and the odd cases share H 2048, I 768 with test_fp8_layer_gpu's first shape
    assert (by_id["tests/test_fp8_cases_gpu.py::test_fp8_layer_gpu_cases[odd-T]"]
            == by_id["tests/test_fp8_cases_gpu.py::test_fp8_layer_gpu_cases[qwen3-30b-a3b]"]
            == by_id["tests/test_fp8_layer_gpu.py::test_fp8_layer_gpu[2048-768-16-8-1024-fp8]"])
    assert (by_id["tests/test_fp8_cases_gpu.py::test_fp8_layer_gpu_cases[gpt-oss-120b]"]
            == by_id["tests/test_fp8_layer_gpu.py::test_fp8_layer_gpu[2880-2880-8-4-512-bf16]"])
    assert by_id["tests/test_fp8_cases_gpu.py::test_fp8_layer_gpu_cases[kimi-k2]"] != by_id[
        "tests/test_fp8_cases_gpu.py::test_fp8_layer_gpu_cases[glm-5]"]
    assert len(groups) == 8
