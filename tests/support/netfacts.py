"""A link's facts as a backend reports them, for checks that judge them."""

from __future__ import annotations

from linkctl.net.netstate import LinkFacts


def nic_facts(**kw) -> LinkFacts:
    """en0 as the shipped dgx-mac profile wants it, 10 Gbit/s full duplex, with ``kw`` changed."""
    base = dict(
        ifname="en0",
        up=True,
        carrier=True,
        mtu=9000,
        mac="aa:bb:cc:dd:ee:01",
        addresses=("192.168.100.1/24",),
        speed_mbps=10000,
        duplex="full",
    )
    base.update(kw)
    return LinkFacts(**base)
