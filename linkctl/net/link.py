"""setup / teardown / status: the safety checks and the transaction around a backend.

Everything here works through the Backend interface, so the same checks
guard Linux and macOS. The promises: the default route is the same object
before and after; bad input changes nothing; a second setup does nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from linkctl.core.checks import Verdict
from linkctl.core.errors import ApplyError, CheckFailed, InputError
from linkctl.core.paths import state_dir, write_atomic
from linkctl.core.profile import HostSpec, Profile
from linkctl.net import arp
from linkctl.net.backend import Backend
from linkctl.net.netstate import Drift, LinkFacts, LinkStatus, Route
from linkctl.net.nic_checks import nic_checks
from linkctl.net.plan import Change, Effect, Kind, Plan, apply, rollback


@dataclass
class LinkResult:
    action: str  # "setup" or "teardown"
    profile: str
    host: str
    interface: str
    plan: Plan
    dry_run: bool
    applied: list[Change] = field(default_factory=list)
    elapsed_s: float = 0.0
    default_route: Route | None = None

    @property
    def nothing_to_do(self) -> bool:
        return self.plan.empty

    def as_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "profile": self.profile,
            "host": self.host,
            "interface": self.interface,
            "dry_run": self.dry_run,
            "nothing_to_do": self.nothing_to_do,
            "plan": self.plan.as_dict(),
            "applied": [c.as_dict() for c in self.applied],
            "elapsed_s": round(self.elapsed_s, 4),
            "default_route": self.default_route.as_dict() if self.default_route else None,
        }


# ---- which host am I ---------------------------------------------------------


def identify_host(profile: Profile, backend: Backend, name: str | None = None) -> HostSpec:
    """--host NAME (or LINKCTL_HOST), else the one host whose OS matches and interface exists."""
    name = name or os.environ.get("LINKCTL_HOST")
    if name:
        return profile.host(name)
    present = set(backend.interfaces())
    found = [h for h in profile.hosts if h.os == backend.os_name and h.interface in present]
    if len(found) == 1:
        return found[0]
    everyone = ", ".join(f"{h.name} ({h.os}, {h.interface})" for h in profile.hosts)
    if not found:
        raise InputError(
            f"no host of profile {profile.name!r} matches this machine "
            f"({backend.os_name}, interfaces: {', '.join(sorted(present))}); hosts: {everyone}",
            "pass --host NAME",
        )
    raise InputError(
        f"this machine matches several hosts of profile {profile.name!r}: "
        f"{', '.join(h.name for h in found)}",
        "pass --host NAME",
    )


# ---- safety checks -------------------------------------------------------------


def preflight(profile: Profile, host: HostSpec, backend: Backend) -> tuple[LinkFacts, Route | None]:
    """Every check that must pass before any change. Raises InputError, changes nothing."""
    facts = backend.link_facts(host.interface)  # missing interface -> lists the others
    routes = backend.routes()
    default = backend.default_route()
    if default and default.ifname == host.interface:
        raise InputError(
            f"hosts.interface {host.interface!r} carries the default route "
            f"(via {default.gateway}); configuring it could cut this machine off",
            "name the direct-link port, not the uplink, in the profile",
        )
    subnet = profile.link.subnet
    for r in routes:
        if r.is_default or r.ifname == host.interface:
            continue
        if r.network().overlaps(subnet):
            raise InputError(
                f"link.subnet {subnet} overlaps {r.dst} already routed through {r.ifname}",
                "pick a link subnet no other interface uses (e.g. 192.168.200.0/24)",
            )
    lo, hi = facts.min_mtu, facts.max_mtu
    if (lo and profile.link.mtu < lo) or (hi and profile.link.mtu > hi):
        raise InputError(
            f"link.mtu {profile.link.mtu} is outside what {host.interface} accepts ({lo}-{hi})",
            f"set link.mtu between {lo} and {hi}",
        )
    return facts, default


CARRIER_WAIT_S = 2.0


def wait_for_carrier(
    backend: Backend, ifname: str, timeout: float, *, required: bool = True
) -> LinkFacts:
    """Poll until ``ifname`` has carrier (autonegotiation takes a few seconds on real
    NICs). With ``required``, no carrier in time is an InputError."""
    deadline = time.monotonic() + timeout
    facts = backend.link_facts(ifname)
    while not facts.carrier and time.monotonic() < deadline:
        time.sleep(0.05)
        facts = backend.link_facts(ifname)
    if required and not facts.carrier:
        raise InputError(
            f"{ifname} has no carrier after {timeout:g} s",
            "check the cable and that the peer's port is up",
        )
    return facts


def wait_for_link_carrier(
    backend: Backend, ifname: str, timeout: float, *, log: Callable[[str], None] | None = None
) -> float | None:
    """The boot-time wait behind ``setup --wait-carrier``: launchd cannot order a job on
    an interface, so linkctl waits itself, bounded, saying so in one log line.

    Waits for ``ifname`` to exist (an adapter may register late), then, if it is
    administratively up, for carrier. Returns the seconds waited, or None when the port
    is down: carrier cannot be seen until setup brings it up (call again afterwards).
    Raises InputError when ``timeout`` runs out.
    """
    say = log or (lambda _m: None)
    t0 = time.monotonic()
    deadline = t0 + timeout
    said = False
    while True:
        try:
            facts = backend.link_facts(ifname)
            break
        except InputError:
            if time.monotonic() >= deadline:
                raise
            if not said:
                say(f"waiting up to {timeout:g} s for interface {ifname} to appear")
                said = True
            time.sleep(0.25)
    if facts.carrier:
        return time.monotonic() - t0
    if not facts.up:
        say(f"{ifname} is down: carrier shows only once setup brings it up")
        return None
    say(f"waiting up to {timeout:g} s for carrier on {ifname}")
    remaining = max(0.0, deadline - time.monotonic())
    try:
        wait_for_carrier(backend, ifname, remaining)
    except InputError:
        raise InputError(
            f"no carrier on {ifname} after {timeout:g} s (--wait-carrier)",
            "check the cable and that the peer's port is up",
        ) from None
    waited = time.monotonic() - t0
    say(f"carrier on {ifname} after {waited:.1f} s")
    return waited


def _check_address_free(host: HostSpec, facts: LinkFacts) -> None:
    own = (facts.mac or "").lower()
    macs = [m for m in arp.who_has(host.interface, host.ip) if m != own]
    if macs:
        raise InputError(
            f"hosts.address {host.ip} is already answered on the segment by {', '.join(macs)}",
            "give this host a free address, or find the device that holds it",
        )


def _verify_default(backend: Backend, before: Route | None) -> None:
    after = backend.default_route()
    if after != before:
        raise CheckFailed(
            f"the default route changed ({_route_text(before)} -> {_route_text(after)})",
            "nothing was kept; report this as a bug",
        )


def _route_text(r: Route | None) -> str:
    return f"{r.dst} via {r.gateway} dev {r.ifname}" if r else "none"


def _check_followed_up(
    backend: Backend, host: HostSpec, profile: Profile, peers: list[HostSpec]
) -> None:
    """After follow-up changes: the backend must find nothing more to do."""
    again = backend.plan_follow_up(host, profile.link, peers)
    if again.changes:
        raise CheckFailed(
            "still needed after the follow-up: " + "; ".join(c.summary for c in again.changes),
            "report this as a bug with `linkctl status --json`",
        )


# ---- setup record ----------------------------------------------------------------


def record_path(profile: Profile, host: HostSpec) -> Path:
    return state_dir() / "links" / f"{profile.name}--{host.name}.json"


def configured_interfaces() -> dict[str, str]:
    """Interfaces a setup record says linkctl configured: {interface: profile}."""
    out = {}
    for path in sorted((state_dir() / "links").glob("*.json")):
        try:
            d = json.loads(path.read_text())
            out[str(d["interface"])] = str(d["profile"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable: not proof that linkctl owns the port
    return out


def _load_record(path: Path) -> list[Change]:
    if not path.is_file():
        return []
    try:
        return [Change.from_dict(c) for c in json.loads(path.read_text())["applied"]]
    except (ValueError, KeyError, TypeError) as e:
        raise InputError(
            f"setup record {path} is unreadable: {e}", "remove it and re-run"
        ) from None


def _save_record(path: Path, profile: Profile, host: HostSpec, applied: list[Change]) -> None:
    write_atomic(
        path,
        json.dumps(
            {
                "profile": profile.name,
                "host": host.name,
                "interface": host.interface,
                "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "applied": [c.as_dict() for c in applied],
            },
            indent=2,
        ),
    )


# ---- the three verbs ---------------------------------------------------------------


def setup(
    profile: Profile, host: HostSpec, backend: Backend, *, dry_run: bool = False
) -> LinkResult:
    t0 = time.perf_counter()
    facts, default = preflight(profile, host, backend)
    plan = backend.plan_setup(profile.name, host, profile.link, facts)
    peers = profile.peers_of(host.name)
    result = LinkResult(
        "setup", profile.name, host.name, host.interface, plan, dry_run, default_route=default
    )
    path = record_path(profile, host)
    if plan.empty:
        # Configured already, but the OS may have dropped something since (macOS
        # comes back from a reboot without the subnet route of a router-less
        # service): the backend's follow-up finds it, and it is repaired and recorded.
        repair = backend.plan_follow_up(host, profile.link, peers)
        plan.notes.extend(repair.notes)
        plan.changes.extend(repair.changes)
        if not dry_run and not plan.empty:

            def verify_repair() -> None:
                _verify_default(backend, default)
                _check_followed_up(backend, host, profile, peers)

            result.applied = apply(plan, backend.execute, verify=verify_repair)
            _save_record(path, profile, host, _load_record(path) + result.applied)
        result.elapsed_s = time.perf_counter() - t0
        return result
    if dry_run:
        result.elapsed_s = time.perf_counter() - t0
        return result
    # The duplicate-address probe (RFC 5227) is needed when the plan puts an address
    # on the link, as each change declares (plan.Effect): setup plans only ever
    # configure the profile's address, never remove one.
    if plan.touches(Effect.ADDRESS) and facts.up and facts.carrier:
        _check_address_free(host, facts)

    def before(change: Change) -> None:
        # A link that was down can only be probed once it is up: probe just before
        # the address goes on, when an earlier change brought the link up (one that
        # brings the link up itself, an NM activation, cannot be probed before); a
        # hit rolls the link back down.
        if (
            change.has(Effect.ADDRESS)
            and not change.has(Effect.LINK)
            and not (facts.up and facts.carrier)
        ):
            now = wait_for_carrier(backend, host.interface, CARRIER_WAIT_S, required=False)
            if now.carrier:
                _check_address_free(host, now)
            else:
                plan.notes.append(
                    f"duplicate-address probe skipped: no carrier on {host.interface} within "
                    f"{CARRIER_WAIT_S:g} s (nobody on the segment can answer yet)"
                )

    follow_ups: list[Change] = []

    def verify() -> None:
        # The backend waits for the OS to take the changes, then plans what it left
        # undone (macOS: a missing subnet route). Those are applied here, inside the
        # transaction: a later failure undoes them first, then the plan.
        follow = backend.plan_follow_up(host, profile.link, peers)
        plan.notes.extend(follow.notes)
        follow_ups.extend(apply(follow, backend.execute))
        try:
            _verify_default(backend, default)
            now = backend.link_facts(host.interface)
            if not now.has_address(str(host.address)) or now.mtu != profile.link.mtu:
                raise CheckFailed(
                    f"after setup {host.interface} has {list(now.addresses)} MTU {now.mtu}, "
                    f"not {host.address} MTU {profile.link.mtu}",
                    "see `linkctl status`",
                )
            if follow.changes:
                _check_followed_up(backend, host, profile, peers)
        except BaseException as exc:
            failures = rollback(follow_ups, backend.execute)
            follow_ups.clear()
            if failures:
                raise ApplyError(
                    f"{exc}; undoing the follow-up left: {'; '.join(failures)}",
                    "inspect with `linkctl status` and fix by hand",
                ) from exc
            raise

    result.applied = [*apply(plan, backend.execute, before=before, verify=verify), *follow_ups]
    plan.changes.extend(follow_ups)
    _save_record(path, profile, host, _load_record(path) + result.applied)
    result.elapsed_s = time.perf_counter() - t0
    return result


def teardown(
    profile: Profile, host: HostSpec, backend: Backend, *, dry_run: bool = False
) -> LinkResult:
    """Undo exactly what setup recorded (restoring the previous MTU); without a record,
    remove the profile's address only."""
    t0 = time.perf_counter()
    facts = backend.link_facts(host.interface)
    default = backend.default_route()
    path = record_path(profile, host)
    recorded = _load_record(path)
    if recorded:
        # Each teardown step's undo is the setup change it reverses, so a
        # failed teardown rolls forward to the state it started from.
        steps = [dataclasses.replace(c.undo, undo=c) for c in reversed(recorded) if c.undo]
        plan = Plan(_still_needed(steps, facts))
    else:
        plan = backend.plan_teardown(profile.name, host, facts)
    result = LinkResult(
        "teardown", profile.name, host.name, host.interface, plan, dry_run, default_route=default
    )
    if not dry_run and not plan.empty:
        result.applied = apply(
            plan, backend.execute, verify=lambda: _verify_default(backend, default)
        )
    if not dry_run and path.exists():
        path.unlink()
    result.elapsed_s = time.perf_counter() - t0
    return result


def _still_needed(steps: list[Change], facts: LinkFacts) -> list[Change]:
    """Drop teardown steps whose effect is already there (e.g. address removed by hand)."""
    out = []
    for s in steps:
        if s.action is Kind.ADDR_DEL and not facts.has_address(
            f"{s.args['address']}/{s.args['prefixlen']}"
        ):
            continue
        if s.action is Kind.LINK_DOWN and not facts.up:
            continue
        if s.action is Kind.SET_MTU and facts.mtu == s.args["mtu"]:
            continue
        out.append(s)
    return out


def status(profile: Profile, host: HostSpec, backend: Backend) -> LinkStatus:
    """The link versus the profile. Drift comes from the NIC checks that probe and
    doctor apply too (linkctl.net.nic_checks), with each check's verdict as its severity."""
    facts = backend.link_facts(host.interface)
    default = backend.default_route()
    link = profile.link
    checks = nic_checks(facts, host, link)
    bad = {n: c.verdict for n, c in checks.items() if c.verdict in (Verdict.WARN, Verdict.FAIL)}
    drift: list[Drift] = []
    if "interface" in bad:
        if not facts.up:
            drift.append(Drift("up", True, False))
        if not facts.carrier:
            drift.append(Drift("carrier", True, False))
    if "mtu" in bad:
        drift.append(Drift("mtu", link.mtu, facts.mtu, bad["mtu"]))
    if not facts.has_address(str(host.address)):
        drift.append(Drift("address", str(host.address), list(facts.addresses)))
    # Shown beside a missing address too: the address check reports the worse of the two.
    extra = [a for a in facts.addresses if a != str(host.address)]
    if extra:
        drift.append(Drift("other_addresses", [], extra, Verdict.WARN))
    if "speed" in bad:
        drift.append(Drift("speed_mbps", link.expected_speed_mbps, facts.speed_mbps, bad["speed"]))
    if "duplex" in bad:
        drift.append(Drift("duplex", "full", facts.duplex, bad["duplex"]))
    if default and default.ifname == host.interface:
        drift.append(Drift("default_route", "not via the link", default.ifname))
    return LinkStatus(profile.name, host.name, backend.os_name, facts, default, drift)
