"""Who can reach llama-server's API on the head, and what stops the rest.

llama-server has an API key option and nothing else (tools/server: --api-key-file);
rpc-server has no authentication at all and is bound to the link address
(linkctl.serve.plan). serve refuses to put the API beyond loopback and the link without
either a private key file or an explicit opt-out in the profile.
"""

from __future__ import annotations

import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from linkctl.core.errors import InputError
from linkctl.core.profile import Profile

Exposure = Literal["loopback", "link", "exposed"]
AuthMode = Literal["api-key", "unauthenticated", "not-needed"]


@dataclass(frozen=True)
class ServeAuth:
    """Who can reach llama-server's API, and what stops the rest."""

    exposure: Exposure  # "link": the head's link address
    mode: AuthMode  # "unauthenticated": allowed in the profile
    api_key_file: str | None = None
    keys: int = 0

    def summary(self) -> str:
        where = {
            "loopback": "loopback only",
            "link": "the link address only",
            "exposed": "beyond loopback and the link",
        }[self.exposure]
        if self.mode == "api-key":
            return (
                f"llama-server API on {where}: API key required "
                f"({self.keys} key(s) in {self.api_key_file})"
            )
        if self.mode == "unauthenticated":
            return (
                f"llama-server API on {where} WITHOUT authentication "
                "(serve.allow_unauthenticated = true)"
            )
        return f"llama-server API on {where}: no API key needed"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_api_keys(path: str, root: Path = Path("/")) -> list[str]:
    """The keys llama-server will load from ``path`` (--api-key-file), after checking the
    file is private. llama-server (common/arg.cpp, --api-key-file) reads it line by
    line, skips empty lines and lines starting with '#', and keeps the rest verbatim:
    a stray space or CR would become part of the key, and a file with no key line
    starts the server with no authentication at all. Both are refused here. ``root``:
    the file as it is inside an image that `service install --root` writes."""
    inside = "" if str(root) == "/" else f" in {root}"
    field = f"serve.api_key_file = {path!r}{inside}"
    make = f"create it: (umask 077; openssl rand -hex 32 > {path})"
    real = root / path.lstrip("/")
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise InputError(f"{field}: no such file", make) from None
    except OSError as e:
        raise InputError(f"{field}: cannot stat: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{field}: not a regular file", make)
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise InputError(
            f"{field}: mode {mode:04o} lets group or others read or change the keys",
            f"chmod 600 {path}",
        )
    try:
        text = real.read_bytes().decode()  # bytes: universal newlines would hide a CR
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{field}: cannot read: {e}", "make it readable by this user") from None
    keys = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line or line.startswith("#"):
            continue
        if line != line.strip():
            raise InputError(
                f"{field}: line {n} has leading or trailing whitespace (or a CR), which "
                "llama-server would keep as part of the key",
                "write one key per line, nothing else on it (Unix line endings)",
            )
        keys.append(line)
    if not keys:
        raise InputError(
            f"{field}: holds no key (only empty or '#' lines): llama-server would start "
            "without authentication",
            make.replace("create it", "put a key in it"),
        )
    return keys


def own_headers(profile: Profile) -> dict[str, str]:
    """What linkctl's own requests to the head's llama-server send (the watch, the
    canary): the first key of serve.api_key_file, or nothing when there is none."""
    f = profile.serve.api_key_file
    keys = read_api_keys(f) if f else []
    return {"Authorization": f"Bearer {keys[0]}"} if keys else {}


def serve_auth(profile: Profile, root: Path = Path("/")) -> ServeAuth:
    """How the head's llama-server is protected; InputError when it would listen beyond
    loopback and the link with neither an API key file nor an explicit opt-out.
    ``root``: where the key file is looked for (an image for `service install --root`)."""
    s = profile.serve
    if s.host.is_loopback:
        exposure: Exposure = "loopback"
    elif s.host == profile.head.address.ip:
        exposure = "link"
    else:
        exposure = "exposed"
    if s.api_key_file:
        keys = read_api_keys(s.api_key_file, root)
        return ServeAuth(exposure, "api-key", s.api_key_file, len(keys))
    if exposure != "exposed":
        return ServeAuth(exposure, "not-needed")
    if s.allow_unauthenticated:
        return ServeAuth(exposure, "unauthenticated")
    raise InputError(
        f"serve.host = {str(s.host)!r} puts llama-server's API beyond loopback and the link "
        "(anyone who reaches it can use the model), and the profile gives it no API key",
        "set serve.api_key_file to a mode-0600 file of keys (llama-server --api-key-file), "
        "or serve.allow_unauthenticated = true to serve it open on purpose",
    )
