"""The forward megakernel: dispatch, gate/up + SwiGLU, down + push and the shared expert in one
persistent launch (see ``kernel.py`` for the protocol's overview)."""
