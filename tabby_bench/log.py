"""The library's log ("tabby" logger) in the tools' output: its workspace and memory reports at INFO."""
from __future__ import annotations

import logging
import sys


def configure(info: bool = True) -> None:
    """Show the "tabby" logger on stderr, from INFO (``info``) or from WARNING; idempotent (spawned
    worker processes call it again: a logging setup does not cross a spawn)."""
    log = logging.getLogger("tabby")
    log.setLevel(logging.INFO if info else logging.WARNING)
    if not any(getattr(h, "_tabby_bench", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[tabby] %(message)s"))
        handler._tabby_bench = True
        log.addHandler(handler)
