"""Prefill/decode disaggregation, the workers' side (the gateway pairs the two: services/gateway/routing/pd.py).

The protocol: the gateway sends one request to a prefill worker and, with the same transfer id, to a
decode worker. The decode worker's engine reserves slots for what its tree lacks and tells its receiver;
the prefill worker's engine opens the transfer while it computes the prompt (KvHeader -> KvAccept(start)),
then pushes the KV of [start, prompt_len) as one message right behind the pass that completes it and the
first token after it (KvDone -> KvAck). The decode side scatters the pages into its pool and decodes; the
prefill side ends the request with its KV kept in its tree.

Modules, engine thread first: `stages` (the request queues by PD stage), `sides` (the engine's prefill and
decode halves, the stages described), `kv_pages` (pool <-> one token-major buffer); then the worker's event
loop: `kv_push` (prefill), `kv_receive` (decode), over `ucx` (the transfer itself and its message flow).
UCX (ucxx) is an optional install (`.[pd]`): only PD workers import it, and only through `require_ucx`
first, so a missing wheel is a clear message."""
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
