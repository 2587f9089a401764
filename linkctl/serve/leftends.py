"""The local ends of the head's RPC connections, kept so that an rpc-server still held
by one of them after llama-server went away (the outage outlasted the FIN: see
linkctl.net.halfopen) can be freed from here, without a restart on the rpc host. They
are kept in serve's status too, so a serve started again (a crash, a reboot of the head
while the link was out) frees what the last one left. Everything here runs on the
supervisor's thread (its health poll and its starts), or before it starts."""

from __future__ import annotations

from collections.abc import Callable

from linkctl.core.errors import InputError
from linkctl.llama.rpc import RpcBusy, RpcConnectTimeout
from linkctl.net.halfopen import reset_from

KEEP = 4  # ends kept per endpoint: llama-server holds one; these are the last few starts


class LeftEnds:
    def __init__(self, kept: dict[str, list[str]] | None = None) -> None:
        # endpoint -> local ends, oldest first (``kept``: the last serve's)
        self._ends = {e: list(v[-KEEP:]) for e, v in (kept or {}).items()}
        self._said: list[str] = []  # the last SYNs reported: a repeat is not logged again
        self.on_change: Callable[[dict[str, list[str]]], None] | None = None  # to keep them

    def ends(self) -> dict[str, list[str]]:
        return {e: list(v) for e, v in self._ends.items() if v}

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.ends())

    def seen(self, local: str, endpoint: str) -> None:
        ends = self._ends.setdefault(endpoint, [])
        if local not in ends:
            ends.append(local)
            del ends[:-KEEP]
            self._changed()

    def reset(self, error: InputError) -> list[str]:
        """After ``error`` from an endpoint check: where that endpoint accepted and did
        not answer HELLO (held by a client) or did not answer the connect at all (its
        accept queue full behind that client, or the link still out), a SYN from every
        end llama-server left with it. An end is forgotten once the endpoint's listener
        answers a SYN from it (nothing is held there any more); one in use here, or
        whose SYN got no answer, is tried again next time. Returns "local -> endpoint"
        for each SYN that left."""
        if not isinstance(error, RpcBusy | RpcConnectTimeout):
            return []
        endpoint = error.endpoint
        sent = []
        for local in list(self._ends.get(endpoint, [])):
            outcome = reset_from(local, endpoint)
            if outcome in ("sent", "answered"):
                sent.append(f"{local} -> {endpoint}")
            if outcome == "answered":
                self._ends[endpoint].remove(local)
                self._changed()
        return sent

    def news(self, sent: list[str]) -> bool:
        """Whether ``sent`` differs from the last SYNs reported: one log line per
        change, not one per health poll while an endpoint stays held."""
        new, self._said = sent != self._said, sent
        return new
