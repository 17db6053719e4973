"""The routed experts' GEMM kernels, one module per operand precision and core:

    bf16.py    the bf16 kernels (the separate launches' gate/up, down, dgrads, weight gradient;
               the tiles the megakernel's tasks reuse), and ``GemmConfig``
    bf16_ws.py the warp-specialized bf16 cores (Gluon: a TMA producer warp, two wgmma consumers,
               persistent), which the plan's ``Bf16Gemm`` names on sm_90
    fp8.py     the FP8 kernels (1x128 / 128x128 scales, fp32 promotion per 128 of K)
    fp8_ws.py  the warp-specialized FP8 cores (Gluon: a TMA producer warp, two wgmma consumers)
"""
