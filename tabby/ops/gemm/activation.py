"""The experts' activation in the GEMM epilogues: ``h = act(g, u)`` and its backward, one constexpr
variant per kind of ``tabby.activation`` (ACT = ``Activation.code``, the kind's index in
``tabby.activation.KINDS``, a constexpr; LIMIT, ALPHA its floats, constexprs of the Triton kernels and
fp32 arguments of the Gluon kernels' shared epilogue).

Both are layout-free elementwise ``triton.jit`` functions, so the Triton kernels, the megakernel's
tiles and the Gluon kernels call the same code. ACT 0 (plain SwiGLU) is the expression the
epilogues always had, operation for operation: its code and bits are unchanged
(tests/test_activation_ptx_pinned.py). Clamps follow ``torch.clamp``: the gradient passes where
the input lies within the bounds (bounds included) and is zero where the clamp clipped.
"""
import triton
import triton.language as tl

ACT_SWIGLU: tl.constexpr = tl.constexpr(0)  # silu(g) * u
ACT_SWIGLU_CLAMP: tl.constexpr = tl.constexpr(1)  # silu(min(g, L)) * clamp(u, -L, L)
ACT_SWIGLU_CLAMP_OUT: tl.constexpr = tl.constexpr(2)  # min(silu(g), L) * clamp(u, -L, L)
ACT_GPT_OSS: tl.constexpr = tl.constexpr(3)  # (clamp(u, -L, L) + 1) * gc * sigmoid(alpha gc), gc = min(g, L)
ACT_GEGLU: tl.constexpr = tl.constexpr(4)  # gelu_tanh(g) * u = g * sigmoid(2c (g + 0.044715 g^3)) * u, c = sqrt(2/pi)
ACT_RELU2: tl.constexpr = tl.constexpr(5)  # relu(u)^2: no gate (g not read, dg not made)
GELU_2C: tl.constexpr = tl.constexpr(1.5957691216057308)  # 2 sqrt(2/pi): 0.5 (1 + tanh(z)) = sigmoid(2z)
GELU_A: tl.constexpr = tl.constexpr(0.044715)


@triton.jit
def _clamp_sym(u, LIMIT):
    return tl.minimum(tl.maximum(u, -LIMIT), LIMIT)


@triton.jit
def act_fwd(g, u, ACT: tl.constexpr, LIMIT, ALPHA):
    """h = act(g, u), fp32 in and out."""
    if ACT == ACT_SWIGLU:
        h = g * tl.sigmoid(g) * u
    elif ACT == ACT_SWIGLU_CLAMP:
        gc = tl.minimum(g, LIMIT)
        h = gc * tl.sigmoid(gc) * _clamp_sym(u, LIMIT)
    elif ACT == ACT_SWIGLU_CLAMP_OUT:
        h = tl.minimum(g * tl.sigmoid(g), LIMIT) * _clamp_sym(u, LIMIT)
    elif ACT == ACT_GPT_OSS:
        gc = tl.minimum(g, LIMIT)
        h = (_clamp_sym(u, LIMIT) + 1.0) * (gc * tl.sigmoid(ALPHA * gc))
    elif ACT == ACT_RELU2:
        r = tl.maximum(u, 0.0)
        h = r * r
    else:
        h = g * tl.sigmoid(GELU_2C * (g + GELU_A * g * g * g)) * u
    return h


@triton.jit
def act_grads(g, u, dh, ACT: tl.constexpr, LIMIT, ALPHA):
    """(dg, du): the gradients of g and u given dh = dL/dh (fp32). Beside ``act_fwd`` of the same
    g, u the compiler computes the shared terms once (the sigmoid, silu)."""
    if ACT == ACT_SWIGLU:
        sg = tl.sigmoid(g)
        dg = dh * u * sg * (1.0 + g * (1.0 - sg))
        du = dh * (g * sg)
    elif ACT == ACT_SWIGLU_CLAMP:
        gc = tl.minimum(g, LIMIT)
        sg = tl.sigmoid(gc)
        dg = tl.where(g <= LIMIT, dh * _clamp_sym(u, LIMIT) * sg * (1.0 + gc * (1.0 - sg)), 0.0)
        du = tl.where(tl.abs(u) <= LIMIT, dh * (gc * sg), 0.0)
    elif ACT == ACT_SWIGLU_CLAMP_OUT:
        sg = tl.sigmoid(g)
        silu = g * sg
        dg = tl.where(silu <= LIMIT, dh * _clamp_sym(u, LIMIT) * sg * (1.0 + g * (1.0 - sg)), 0.0)
        du = tl.where(tl.abs(u) <= LIMIT, dh * tl.minimum(silu, LIMIT), 0.0)
    elif ACT == ACT_GPT_OSS:
        gc = tl.minimum(g, LIMIT)
        sa = tl.sigmoid(ALPHA * gc)
        dg = tl.where(g <= LIMIT, dh * (_clamp_sym(u, LIMIT) + 1.0) * sa * (1.0 + ALPHA * gc * (1.0 - sa)), 0.0)
        du = tl.where(tl.abs(u) <= LIMIT, dh * (gc * sa), 0.0)
    elif ACT == ACT_RELU2:  # (dg: zeros, not stored)
        dg = dh * 0.0
        du = dh * (2.0 * tl.maximum(u, 0.0))
    else:
        s = tl.sigmoid(GELU_2C * (g + GELU_A * g * g * g))
        dg = dh * u * (s + g * s * (1.0 - s) * GELU_2C * (1.0 + 3.0 * GELU_A * g * g))
        du = dh * (g * s)
    return dg, du
