"""The pair secret: 32 random bytes both hosts of a profile hold, 0600, root-owned.

Kept at state_dir()/keys/<profile>.key (this module owns that place) as one line of
hex. A service started by systemd reads it from $CREDENTIALS_DIRECTORY/pair-key
instead (the unit's LoadCredential=): a DynamicUser cannot read the root-only file,
and no other local user can read either copy. Made by `linkctl pair` (both hosts
derive it from one key agreement) or `linkctl key new` on one host and `linkctl key
set` on the other; the lab writes one for the hosts it creates.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from linkctl.core.errors import InputError
from linkctl.core.paths import private_dir, state_dir, write_atomic

KEY_BYTES = 32
CREDENTIAL = "pair-key"  # the name LoadCredential= gives it in the serve units
_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class PairSecret:
    key: bytes
    where: str  # the file it came from, for messages

    @property
    def fingerprint(self) -> str:
        """What both hosts show to compare copies (not the key: a hash of it)."""
        h = hashlib.sha256(b"linkctl pair-key fingerprint\n" + self.key).hexdigest()
        return f"{h[:4]}-{h[4:8]}-{h[8:12]}"

    def derive(self, purpose: str) -> bytes:
        """A key for one purpose (the prefill server's API key), independent of the
        others: HMAC-SHA256 of the purpose under the pair secret."""
        import hmac

        return hmac.new(self.key, b"linkctl derive\n" + purpose.encode(), "sha256").digest()


def key_path(profile: str, state: Path | None = None) -> Path:
    """Where the secret is kept: under ``state`` (a lab host's, a container's
    /var/lib/linkctl), else this host's state_dir()."""
    return (state or state_dir()) / "keys" / f"{profile}.key"


def generate() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def parse(text: str, where: str) -> bytes:
    """The key from its one-line hex form; anything else is refused by name."""
    t = text.strip().lower()
    if not _HEX.fullmatch(t):
        raise InputError(
            f"pair secret in {where} is not {KEY_BYTES * 2} hex digits",
            "copy it again from the peer: sudo linkctl key show --export",
        )
    return bytes.fromhex(t)


def store(profile: str, key: bytes, state: Path | None = None) -> Path:
    """Write the key 0600 in a 0700 directory, atomically."""
    path = key_path(profile, state)
    private_dir(path.parent)
    write_atomic(path, key.hex() + "\n", mode=0o600)
    return path


def _credential() -> Path | None:
    d = os.environ.get("CREDENTIALS_DIRECTORY")
    p = Path(d) / CREDENTIAL if d else None
    return p if p is not None and p.is_file() else None


def load(profile: str, state: Path | None = None) -> PairSecret:
    """This host's copy of the profile's secret (or the one under ``state``), or a
    one-line refusal saying how to get one. A file others can read is refused: it no
    longer proves anything."""
    path = (None if state else _credential()) or key_path(profile, state)
    try:
        st = path.stat()
        text = path.read_text()
    except FileNotFoundError:
        raise InputError(
            f"no pair secret for profile {profile} at {path}",
            f"run `sudo linkctl pair` on both hosts, or `sudo linkctl key new --profile "
            f"{profile}` here and `sudo linkctl key set --profile {profile}` on the peer",
        ) from None
    except PermissionError:
        raise InputError(
            f"cannot read the pair secret {path}: only root (or the service's credential) may",
            "run the command with sudo",
        ) from None
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise InputError(
            f"pair secret {path} has mode {mode:04o}: other users can read it",
            f"chmod 600 {path}, then replace the secret on both hosts (`linkctl key new`)",
        )
    return PairSecret(parse(text, str(path)), str(path))


def exists(profile: str) -> bool:
    return _credential() is not None or key_path(profile).is_file()
