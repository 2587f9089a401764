"""Pure parsers for the macOS commands the macOS backend runs.

One function per command output, each returning typed dataclasses and never
raising on text it does not recognise: unknown lines are skipped, unknown
media spellings give ``speed_mbps=None``. Formats are those of the recorded
real outputs in tests/fixtures/macos/ (see SOURCES.md there).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

# ---- networksetup --------------------------------------------------------------


def networksetup_error(text: str) -> str | None:
    """The error line networksetup printed, or None.

    networksetup reports many failures on stdout with exit status 0, e.g.
    ``** Error: The parameters were not valid.`` or
    ``Foo is not a recognized network service.``
    """
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("** Error") or ln.startswith("Error:"):
            # The line before often names the culprit ("X is not a recognized ...").
            i = lines.index(ln)
            return f"{lines[i - 1]} {ln}" if i and "not a recognized" in lines[i - 1] else ln
    for ln in lines:
        if "is not a recognized network service" in ln:
            return ln
    return None


@dataclass(frozen=True)
class HardwarePort:
    name: str  # "Ethernet", "Thunderbolt Ethernet Slot 1" ...
    device: str  # "en0"
    mac: str | None  # None when networksetup prints N/A (or the publisher redacted it)


def parse_hardware_ports(text: str) -> list[HardwarePort]:
    """``networksetup -listallhardwareports``: blocks of Hardware Port / Device /
    Ethernet Address, then a "VLAN Configurations" trailer (ignored)."""
    ports: list[HardwarePort] = []
    cur: dict[str, str] = {}

    def flush() -> None:
        if "Hardware Port" in cur and "Device" in cur:
            mac = cur.get("Ethernet Address", "").strip()
            ok = re.fullmatch(r"([0-9A-Fa-f]{1,2}:){5}[0-9A-Fa-f]{1,2}", mac)
            ports.append(
                HardwarePort(cur["Hardware Port"], cur["Device"], mac.lower() if ok else None)
            )
        cur.clear()

    for line in text.splitlines():
        if line.startswith("VLAN Configurations"):
            break
        if not line.strip():
            flush()
            continue
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("Hardware Port", "Device", "Ethernet Address"):
            if key.strip() == "Hardware Port":
                flush()
            cur[key.strip()] = value.strip()
    flush()
    return ports


def port_kind(port_name: str) -> str:
    """wired/wifi/other from a hardware port's name as networksetup prints it
    ("Wi-Fi" since 10.7, "AirPort" before; "Thunderbolt Bridge" is a bridge of the
    Thunderbolt ports, "Bluetooth PAN" and "iPhone USB" are not cables to a peer)."""
    low = port_name.lower()
    if "wi-fi" in low or "airport" in low:
        return "wifi"
    if any(w in low for w in ("bridge", "bluetooth", "iphone", "vpn", "vlan")):
        return "other"
    return "wired"


@dataclass(frozen=True)
class NetworkService:
    name: str  # may hold spaces and parentheses: "VPN (L2TP)", "USB 10/100/1000 LAN"
    hardware_port: str
    device: str  # "" for services without a device (VPNs)
    enabled: bool
    position: int  # 1-based place in the service order (disabled services too)


_SERVICE_LINE = re.compile(r"^\*?\((\d+|\*)\)\s+(.+?)\s*$")
_PORT_LINE = re.compile(r"^\(Hardware Port: (.*), Device: ([^,()]*)\)\s*$")


def parse_service_order(text: str) -> list[NetworkService]:
    """``networksetup -listnetworkserviceorder``: "(N) Name" (or "(*) Name" when the
    service is disabled) followed by "(Hardware Port: P, Device: D)"."""
    out: list[NetworkService] = []
    pending: tuple[str, bool] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        port = _PORT_LINE.match(line)
        if port and pending:
            name, enabled = pending
            out.append(
                NetworkService(name, port.group(1), port.group(2).strip(), enabled, len(out) + 1)
            )
            pending = None
            continue
        svc = _SERVICE_LINE.match(line)
        if svc and not line.startswith("(Hardware Port:"):
            enabled = svc.group(1) != "*" and not line.startswith("*")
            pending = (svc.group(2), enabled)
    return out


IPV4_METHODS = {
    "DHCP Configuration": "dhcp",
    "Manual Configuration": "manual",
    "BOOTP Configuration": "bootp",
    "Manually Using DHCP Router Configuration": "manual-dhcp-router",
}


@dataclass(frozen=True)
class ServiceInfo:
    """``networksetup -getinfo SERVICE``.

    ``method`` is one of dhcp, manual, bootp, manual-dhcp-router; None when the
    output has no IPv4 configuration line at all (IPv4 off: an IPv6-only
    service); ``header`` keeps an unrecognised "... Configuration" line.
    """

    method: str | None
    header: str | None
    ip: str | None
    mask: str | None
    router: str | None
    client_id: str | None
    ipv6: str | None  # "Automatic", "Off", "Manual" ...
    ipv6_address: str | None
    ether: str | None


def _value(v: str) -> str | None:
    v = v.strip()
    return None if v.lower() in ("", "none", "(null)", "n/a") else v


def parse_getinfo(text: str) -> ServiceInfo:
    fields: dict[str, str | None] = {}
    header = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if header is None and line.endswith("Configuration") and ":" not in line:
            header = line
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), _value(value))
    ether = next(
        (v for k, v in fields.items() if k.endswith(" ID") or k == "Ethernet Address"), None
    )
    return ServiceInfo(
        method=IPV4_METHODS.get(header or ""),
        header=header,
        ip=fields.get("IP address"),
        mask=fields.get("Subnet mask"),
        router=fields.get("Router"),
        client_id=fields.get("Client ID"),
        ipv6=fields.get("IPv6"),
        ipv6_address=fields.get("IPv6 IP address"),
        ether=ether,
    )


@dataclass(frozen=True)
class MtuSetting:
    active: int
    configured: int | None  # "Current Setting"


def parse_get_mtu(text: str) -> MtuSetting | None:
    """``networksetup -getMTU DEVICE``: "Active MTU: 1500 (Current Setting: 1500)"."""
    m = re.search(r"Active MTU:\s*(\d+)(?:\s*\(Current Setting:\s*(\d+)\))?", text)
    if not m:
        return None
    return MtuSetting(int(m.group(1)), int(m.group(2)) if m.group(2) else None)


@dataclass(frozen=True)
class MtuRange:
    min: int
    max: int


def parse_mtu_range(text: str) -> MtuRange | None:
    """``networksetup -listvalidMTUrange DEVICE``: "Valid MTU Range: 1280-1500"."""
    m = re.search(r"Valid MTU Range:\s*(\d+)\s*-\s*(\d+)", text)
    return MtuRange(int(m.group(1)), int(m.group(2))) if m else None


# ---- ifconfig -------------------------------------------------------------------


@dataclass(frozen=True)
class Media:
    raw: str  # everything after "media: "
    subtype: str | None  # the active subtype, e.g. "10Gbase-T", "1000baseT"
    options: tuple[str, ...]  # e.g. ("full-duplex", "flow-control")
    speed_mbps: int | None  # None for unknown spellings, "none", "<unknown type>"
    duplex: str | None  # "full", "half" or None


_SPEED = re.compile(r"^(\d+(?:\.\d+)?)\s*([GM]?)base", re.IGNORECASE)


def media_speed(subtype: str | None) -> int | None:
    """Mb/s from an ifmedia subtype: 10Gbase-T -> 10000, 1000baseT -> 1000,
    2500Base-T -> 2500, 5GBase-T -> 5000; anything else -> None."""
    m = _SPEED.match(subtype or "")
    if not m:
        return None
    n = float(m.group(1)) * (1000 if m.group(2).upper() == "G" else 1)
    return int(n) if n > 0 else None


def parse_media(raw: str) -> Media:
    """An ifconfig media line after "media: ".

    The active media is in parentheses when the setting is autoselect:
    ``autoselect (10Gbase-T <full-duplex,flow-control>)``; a fixed setting is
    printed alone: ``10Gbase-T <full-duplex>``. ``autoselect`` alone,
    ``autoselect <full-duplex>``, ``none`` and ``<unknown type>`` say nothing
    about the speed.
    """
    raw = raw.strip()
    active = raw
    m = re.search(r"\((.*)\)\s*$", raw)
    if m:
        active = m.group(1).strip()
    elif raw.startswith("autoselect"):
        active = ""
    opts: tuple[str, ...] = ()
    om = re.search(r"<([^<>]*)>\s*$", active)
    if om:
        opts = tuple(o.strip() for o in om.group(1).split(",") if o.strip())
        active = active[: om.start()].strip()
    subtype = active or None
    if subtype in ("none", "autoselect"):
        subtype = None
    duplex = "full" if "full-duplex" in opts else "half" if "half-duplex" in opts else None
    if "unknown type" in opts:
        opts = ()
    return Media(raw, subtype, opts, media_speed(subtype), duplex)


@dataclass(frozen=True)
class IfconfigInterface:
    name: str
    flags: tuple[str, ...]
    mtu: int
    ether: str | None
    inet: tuple[str, ...]  # IPv4 CIDRs, e.g. "192.168.100.1/24"
    inet6: tuple[str, ...]
    media: Media | None
    status: str | None  # "active", "inactive" or None (no status line, e.g. lo0)

    @property
    def up(self) -> bool:
        return "UP" in self.flags

    @property
    def carrier(self) -> bool:
        if self.status is not None:
            return self.status == "active"
        return "RUNNING" in self.flags


_IF_HEAD = re.compile(r"^(\S+?): flags=[0-9a-fA-F]+<([^>]*)>(?:.*?\bmtu (\d+))?")


def _netmask_prefix(mask: str) -> int:
    if mask.lower().startswith("0x"):
        return bin(int(mask, 16)).count("1")
    return ipaddress.IPv4Network(f"0.0.0.0/{mask}").prefixlen


def parse_ifconfig(text: str) -> dict[str, IfconfigInterface]:
    """``ifconfig IFACE`` or ``ifconfig -a``: one block per interface, keyed by name.
    Indentation may be tabs or spaces; nested lines (bridge members) are skipped."""
    out: dict[str, IfconfigInterface] = {}
    cur: dict | None = None

    def flush() -> None:
        if cur is not None:
            out[cur["name"]] = IfconfigInterface(
                cur["name"],
                cur["flags"],
                cur["mtu"],
                cur["ether"],
                tuple(cur["inet"]),
                tuple(cur["inet6"]),
                cur["media"],
                cur["status"],
            )

    for line in text.splitlines():
        head = _IF_HEAD.match(line)
        if head and not line[:1].isspace():
            flush()
            cur = {
                "name": head.group(1),
                "flags": tuple(f for f in head.group(2).split(",") if f),
                "mtu": int(head.group(3) or 0),
                "ether": None,
                "inet": [],
                "inet6": [],
                "media": None,
                "status": None,
            }
            continue
        if cur is None or not line[:1].isspace():
            continue
        words = line.split()
        if not words:
            continue
        key = words[0]
        if key == "ether" and len(words) > 1:
            cur["ether"] = words[1].lower()
        elif key == "inet" and len(words) > 1:
            addr, prefix = words[1], 32
            if "netmask" in words and words.index("netmask") + 1 < len(words):
                try:
                    prefix = _netmask_prefix(words[words.index("netmask") + 1])
                except ValueError:
                    prefix = 32
            cur["inet"].append(f"{addr}/{prefix}")
        elif key == "inet6" and len(words) > 1:
            cur["inet6"].append(words[1])
        elif key == "media:":
            cur["media"] = parse_media(line.split("media:", 1)[1])
        elif key == "status:" and len(words) > 1:
            cur["status"] = words[1]
    flush()
    return out


# ---- route / netstat ------------------------------------------------------------


@dataclass(frozen=True)
class RouteGet:
    """``route -n get TARGET``. ``destination``/``mask`` are "default" for the default route."""

    route_to: str
    destination: str
    mask: str | None
    gateway: str | None
    interface: str | None
    flags: tuple[str, ...]
    mtu: int | None


def parse_route_get(text: str) -> RouteGet | None:
    """None when route found nothing ("route: writing to routing socket: not in table")
    or printed no interface line."""
    fields: dict[str, str] = {}
    lines = text.splitlines()
    mtu = None
    for i, line in enumerate(lines):
        key, sep, value = line.partition(":")
        if sep and key.strip() in (
            "route to",
            "destination",
            "mask",
            "gateway",
            "interface",
            "flags",
        ):
            fields[key.strip()] = value.strip()
        elif line.split()[:1] == ["recvpipe"] and i + 1 < len(lines):
            cols, vals = line.split(), lines[i + 1].split()
            if "mtu" in cols and cols.index("mtu") < len(vals):
                try:
                    mtu = int(vals[cols.index("mtu")])
                except ValueError:
                    mtu = None
    if "interface" not in fields:
        return None
    flags = tuple(f for f in fields.get("flags", "").strip("<>").split(",") if f)
    return RouteGet(
        route_to=fields.get("route to", ""),
        destination=fields.get("destination", ""),
        mask=fields.get("mask"),
        gateway=fields.get("gateway"),
        interface=fields["interface"],
        flags=flags,
        mtu=mtu,
    )


@dataclass(frozen=True)
class NetstatRoute:
    destination: str  # as printed: "default", "192.168.0", "224.0.0/4", "192.168.0.1"
    dst: str  # as a CIDR: "0.0.0.0/0", "192.168.0.0/24", "224.0.0.0/4", "192.168.0.1/32"
    gateway: str  # an address, "link#5" or a MAC
    flags: str
    netif: str | None
    expire: str | None


def netstat_dst(destination: str) -> str | None:
    """netstat's shortened IPv4 destinations as CIDRs; None if not IPv4.

    BSD netstat drops trailing zero octets and prints "/bits" only when the mask
    differs from the one the remaining octets imply: "127" is 127.0.0.0/8,
    "192.168.0" is /24, "0/1" is 0.0.0.0/1, and four octets without "/" a host.
    """
    if destination == "default":
        return "0.0.0.0/0"
    net, _, bits = destination.partition("/")
    octets = net.split(".")
    if not 1 <= len(octets) <= 4 or not all(o.isdigit() for o in octets):
        return None
    prefix = int(bits) if bits.isdigit() else 8 * len(octets)
    try:
        return str(
            ipaddress.IPv4Network(
                f"{'.'.join(octets + ['0'] * (4 - len(octets)))}/{prefix}", strict=False
            )
        )
    except ValueError:
        return None


def parse_netstat_inet(text: str) -> list[NetstatRoute]:
    """The "Internet:" section of ``netstat -rn -f inet`` (or of ``netstat -rn``).

    Columns are found from the header, which differs between releases (older:
    Refs/Use, some with Mtu; newer: Flags Netif Expire only). Expire may be
    blank or "!".
    """
    out: list[NetstatRoute] = []
    cols: list[str] | None = None
    in_inet = "Internet:" not in text  # a bare table without section titles
    for line in text.splitlines():
        s = line.strip()
        if s == "Internet:":
            in_inet = True
            continue
        if s.endswith(":") and s != "Internet:" and s.startswith("Internet"):
            in_inet = False
            cols = None
            continue
        if not in_inet or not s:
            continue
        words = s.split()
        if words[0] == "Destination":
            cols = words
            continue
        if cols is None or len(words) < 3:
            continue
        dst = netstat_dst(words[0])
        if dst is None:
            continue
        ni = cols.index("Netif") if "Netif" in cols else None
        netif = words[ni] if ni is not None and ni < len(words) else None
        expire = words[ni + 1] if ni is not None and ni + 1 < len(words) else None
        out.append(NetstatRoute(words[0], dst, words[1], words[2], netif, expire))
    return out
