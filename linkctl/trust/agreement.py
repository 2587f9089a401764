"""The pair secret made on both hosts at once by `linkctl pair`: an X25519 key
agreement (RFC 7748) whose public shares ride in the two announcements, and HKDF-SHA256
(RFC 5869) over the shared value, salted with both announcements' digest.

The shares are authenticated the way Bluetooth's numeric comparison authenticates
its ECDH (Core spec v5.3, Vol 3, Part H, 2.3.5.6.2): the pairing code both screens
show is computed over both announcements, shares included, so a third host that
swapped in shares of its own makes the two codes differ. The `cryptography` package
does the curve arithmetic and the HKDF.
"""

from __future__ import annotations

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from linkctl.core.errors import InputError
from linkctl.trust.secret import KEY_BYTES

SHARE_PATTERN = r"^[0-9a-f]{64}$"


class KeyShare:
    """This host's half: a fresh private key, used for one pairing and dropped."""

    def __init__(self) -> None:
        self._key = X25519PrivateKey.generate()

    @property
    def public(self) -> str:
        return self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()

    def secret(self, peer_public: str, transcript: bytes) -> bytes:
        """The pair secret: the same on both hosts for the same two announcements
        (``transcript``: their digest, in an order both hosts compute alike)."""
        try:
            shared = self._key.exchange(
                X25519PublicKey.from_public_bytes(bytes.fromhex(peer_public))
            )
        except ValueError as e:  # a low-order point gives an all-zero value: refused
            raise InputError(
                f"the peer's key share is unusable ({e})", "run pair again on both hosts"
            ) from None
        hkdf = HKDF(
            algorithm=hashes.SHA256(),
            length=KEY_BYTES,
            salt=transcript,
            info=b"linkctl pair secret v1",
        )
        return hkdf.derive(shared)
