"""A bench plugin: the layer with its routed bf16 GEMMs on bf16.py's Triton kernels, beside the rows
that run the plan's (the warp-specialized kernels on sm_90), for an A/B in one run:

    PYTHONPATH=.:scripts TABBY_BENCH_PLUGINS=bench_triton_gemms python -m tabby_bench bench \
        --impls floor,tabby,tabby-triton,tabby-sync-free,tabby-sync-free-triton ...

"tabby-triton" and "tabby-sync-free-triton": ``Tuning(bf16_ws=False)`` on the megakernel path and
the path of separate launches.
"""
import functools

import tabby
from tabby.functional.config import MoEConfig, Tuning
from tabby_bench.impls import register_layer

TRITON = Tuning(bf16_ws=False)
for name, megakernel in (("tabby-triton", True), ("tabby-sync-free-triton", False)):
    register_layer(name, functools.partial(tabby.moe, config=MoEConfig(megakernel=megakernel, tuning=TRITON)),
                   device_errors=tabby.check_errors, tuning=TRITON.describe(), in_default=False)
