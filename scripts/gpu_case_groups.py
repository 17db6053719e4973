#!/usr/bin/env python3
"""Group the FP8 layer's GPU test cases (pytest ids on stdin) by the shape whose kernels they
compile, H and I: one line per group, its ids separated by spaces, largest groups first.

A case compiles the FP8 kernels of its H and I (their K-block counts are compile-time
constants); cases of one shape in one process compile them once, where one process per case
compiles them once per case, all at once on the same cores."""
import re
import sys

sys.path.insert(0, "tests")
from harness import GPU_CASES  # noqa: E402


# the unparametrized cases' shapes (test_fp8_layer_gpu.py)
SHAPES = {"test_fp8_layer_gpu_no_host_sync_and_graph_replay": "1024x512"}


def shape_key(test_id: str) -> str:
    name = test_id.split("::")[-1]
    if name in SHAPES:
        return SHAPES[name]
    param = re.search(r"\[(.*)\]$", test_id)
    if param and "test_fp8_layer_gpu_cases" in test_id and param.group(1) in GPU_CASES:
        _, H, I, *_ = GPU_CASES[param.group(1)]
        return f"{H}x{I}"
    if param and re.match(r"\d+-\d+-", param.group(1)):  # test_fp8_layer_gpu[H-I-E-k-T-backward]
        H, I = param.group(1).split("-")[:2]
        return f"{H}x{I}"
    return test_id  # a case of its own


def main() -> None:
    groups: dict = {}
    for line in sys.stdin:
        test_id = line.strip()
        if "::" in test_id:
            groups.setdefault(shape_key(test_id), []).append(test_id)
    for ids in sorted(groups.values(), key=len, reverse=True):
        print(" ".join(ids))


if __name__ == "__main__":
    main()
