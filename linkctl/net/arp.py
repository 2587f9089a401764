"""ARP on the link with scapy: who answers for an address, and with which MAC.

Used by setup (RFC 5227 duplicate-address probe: sender IP 0.0.0.0, so the
probe itself claims nothing) and by probe (the peer's reply and MAC).
scapy is imported here only, because it costs most of a second.
"""

from __future__ import annotations

from linkctl.core.errors import InputError, PermissionDenied


def who_has(
    ifname: str, target: str, *, src_ip: str = "0.0.0.0", timeout: float = 0.25, tries: int = 2
) -> list[str]:
    """MACs that answered an ARP request for ``target`` on ``ifname`` (empty: nobody)."""
    try:
        from scapy.config import conf
        from scapy.layers.l2 import ARP, Ether
        from scapy.sendrecv import srp
    except ImportError as e:  # pragma: no cover - scapy is a dependency
        raise InputError(f"scapy is not importable: {e}", "pip install scapy") from None
    conf.verb = 0
    try:
        from scapy.arch import get_if_hwaddr

        mac = get_if_hwaddr(ifname)
        pkt = Ether(dst="ff:ff:ff:ff:ff:ff", src=mac) / ARP(
            op=1, hwsrc=mac, psrc=src_ip, pdst=target
        )
        macs: list[str] = []
        for _ in range(tries):
            answered, _unans = srp(pkt, iface=ifname, timeout=timeout, verbose=0)
            macs = sorted({rcv[ARP].hwsrc.lower() for _snd, rcv in answered})
            if macs:
                break
        return macs
    except PermissionError:  # raw AF_PACKET sockets need CAP_NET_RAW (packet(7))
        raise PermissionDenied(
            "no permission for raw sockets (ARP)", "run as root or grant CAP_NET_RAW"
        ) from None
    except OSError as e:
        raise InputError(f"ARP on {ifname} failed: {e}", "check the interface is up") from None
