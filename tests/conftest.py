"""Without a GPU, Triton kernels run under the interpreter on CPU tensors.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined, so it is set here,
before the test modules import ``tabby.ops``; fast_interpreter.py makes the interpreter faster
(not different). Also: the tools' command line sets up the "tabby" logger; every test leaves it as
it found it.
"""
import logging
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

    import fast_interpreter  # the interpreter's speed only (fast_interpreter.py)

    fast_interpreter.install()

requires_gpu = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _restore_tabby_log():
    """The tools' command line sets up the "tabby" logger; later tests see it as it was."""
    log = logging.getLogger("tabby")
    saved = log.level, list(log.handlers)
    yield
    log.setLevel(saved[0])
    log.handlers[:] = saved[1]
