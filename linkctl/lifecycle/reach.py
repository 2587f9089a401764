"""What serves on this host once it is up, how to tell it answers, and how to reach it:
the last line `linkctl up` prints (the URL, whether an API key is needed, a curl that
works from this host)."""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass
from typing import Any

from linkctl.core.profile import HostSpec, Profile

# llama-server's OpenAI-compatible chat endpoint (tools/server/README.md, "POST
# /v1/chat/completions"); /health answers 200 once the model is loaded.
CHAT_PATH = "/v1/chat/completions"
FIRST_REQUEST = '{"messages":[{"role":"user","content":"Say hello."}],"max_tokens":32}'


@dataclass(frozen=True)
class Reach:
    role: str  # "head" / "rpc"
    what: str  # llama-server / ggml-rpc-server, and for whom
    endpoint: str  # host:port it listens on
    url: str | None = None  # head: the API's base URL
    api_key_file: str | None = None  # head: the key a client must send (None: none needed)
    curl: str | None = None  # head: one request that works from this host

    def line(self) -> str:
        if self.url is None:
            return f"serving: {self.what} on {self.endpoint}"
        key = (
            f"API key required (a key line of {self.api_key_file})"
            if self.api_key_file
            else "no API key needed"
        )
        return f"serving: {self.what} at {self.url}, {key}; try: {self.curl}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def reach(profile: Profile, host: HostSpec) -> Reach:
    if host.role == "rpc":
        return Reach(
            "rpc",
            f"ggml-rpc-server for {profile.head.name} (its llama-server serves the API: "
            f"run `sudo linkctl up` there)",
            host.rpc_endpoint,
        )
    s = profile.serve
    # A wildcard listen address is reached through loopback from this host.
    client_host = "127.0.0.1" if s.host.is_unspecified else str(s.host)
    url = f"http://{client_host}:{s.port}"
    rpc = ", ".join(h.rpc_endpoint for h in profile.rpc_hosts)
    auth = ""
    if s.api_key_file:
        # shlex keeps the key's path one word; the key is read at run time, never printed.
        # The first key line (llama-server skips empty and '#' lines: serve/auth.py).
        key = f"sudo grep -m1 -v -e '^#' -e '^$' {shlex.quote(s.api_key_file)}"
        auth = f' -H "Authorization: Bearer $({key})"'
    curl = (
        f"curl -s {url}{CHAT_PATH} -H 'Content-Type: application/json'{auth} -d '{FIRST_REQUEST}'"
    )
    return Reach(
        "head",
        f"llama-server (split over {rpc})",
        f"{s.host}:{s.port}",
        url=url,
        api_key_file=s.api_key_file,
        curl=curl,
    )
