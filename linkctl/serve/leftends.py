"""The local ends of the head's RPC connections, kept so that an rpc-server still held
by one of them after llama-server went away (the outage outlasted the FIN: see
linkctl.net.halfopen) can be freed from here, without a restart on the rpc host."""

from __future__ import annotations

import threading

from linkctl.core.errors import InputError, Timeout
from linkctl.llama.rpc import RpcBusy
from linkctl.net.halfopen import reset_from

KEEP = 4  # ends kept per endpoint: llama-server holds one; these are the last few starts


class LeftEnds:
    def __init__(self) -> None:
        self._ends: dict[str, list[str]] = {}  # endpoint -> local ends, oldest first
        self._lock = threading.Lock()  # seen from the health poll, reset before a start

    def seen(self, local: str, endpoint: str) -> None:
        with self._lock:
            ends = self._ends.setdefault(endpoint, [])
            if local not in ends:
                ends.append(local)
                del ends[:-KEEP]

    def reset(self, error: InputError) -> list[str]:
        """After ``error`` from an endpoint check: where it says an endpoint accepted and
        did not answer (busy) or gave no answer, a SYN from every end llama-server left.
        An end is forgotten once the endpoint's listener answers a SYN from it (nothing
        is held there any more); one in use here, or unanswered (the link may still be
        out), is tried again next time. Returns "local -> endpoint" for each SYN sent."""
        if not isinstance(error, RpcBusy | Timeout):
            return []
        with self._lock:
            ends = {e: list(v) for e, v in self._ends.items()}
        sent = []
        for endpoint, locals_ in sorted(ends.items()):
            for local in locals_:
                outcome = reset_from(local, endpoint)
                if outcome != "in use":
                    sent.append(f"{local} -> {endpoint}")
                if outcome == "answered":
                    with self._lock:
                        if local in self._ends[endpoint]:
                            self._ends[endpoint].remove(local)
        return sent
