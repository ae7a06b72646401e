"""KV transfer between prefill and decode workers. UCX (ucxx) is an optional install (`.[pd]`): only PD
workers import it, and only through `require_ucx` first, so a missing wheel is a clear message."""
from __future__ import annotations

import importlib.util

PD_INSTALL_HINT = 'pip install -e ".[pd]"'


def ucx_available() -> bool:
    try:
        return importlib.util.find_spec("ucxx") is not None
    except (ImportError, ValueError):
        return False


def require_ucx(what: str = "the PD topology") -> None:
    """Raise a RuntimeError naming the install command when ucxx is missing."""
    if not ucx_available():
        raise RuntimeError(f"{what} moves KV pages over UCX, which is not installed: {PD_INSTALL_HINT} "
                           "(the ucxx and RMM wheels)")
