"""`linkctl pair`, in order: the cable's interface, this host's facts, discovery of the
one peer, the code both screens show, agreement (both hosts compute the profile and
compare digests), the profile written, then setup and probe on the new link, and the
`linkctl up` line for each host.

Nothing is written before both hosts confirmed the same profile; every refusal before
that is an InputError (exit 2) with nothing changed.
"""

from __future__ import annotations

import difflib
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from linkctl.core.errors import CheckFailed, InputError
from linkctl.core.log import Say
from linkctl.core.runner import Runner
from linkctl.net.backend import Backend
from linkctl.net.netstate import LinkFacts
from linkctl.pair import agree, iface
from linkctl.pair.announce import Announcement, Local, Wants, announcement, host_name
from linkctl.pair.wire import PORT, Channel, Message
from linkctl.trust import secret
from linkctl.trust.agreement import KeyShare
from linkctl.trust.secret import PairSecret

ANNOUNCE_EVERY_S = 1.0
SETTLE_S = 2.0  # after the first peer, listen this long for a second one
NOTE_EVERY_S = 10.0
CONFIRM_GRACE_S = 3.0


@dataclass(frozen=True)
class PairOptions:
    interface: str | None = None
    name: str | None = None
    subnet: str | None = None
    head: str | None = None
    host: str | None = None  # this host's name in the profile (default: its host name)
    model: str | None = None  # serve.model: the model's path on the head
    write: Path | None = None
    llama_bin_dir: str | None = None
    window_s: float = 120.0
    setup: bool = True
    dry_run: bool = False
    port: int = PORT


@dataclass
class PairResult:
    interface: str
    me: dict[str, Any]
    peer: dict[str, Any]
    code: str
    profile_name: str
    head: str
    head_why: str
    profile_text: str
    profile_path: str | None = None  # None: a dry run
    diff: str = ""  # against the profile that was there, if any
    setup: str | None = None
    probe_ok: bool | None = None
    up_lines: list[str] = field(default_factory=list)
    dry_run: bool = False
    key_fingerprint: str = ""  # the pair secret's (linkctl key show), the same on both

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- this host -----------------------------------------------------------------------


def catalog_key(accelerator: str, keys: Iterable[str] | None = None) -> str | None:
    """The device catalog's key for a vendor name ("Apple M2 Ultra" -> m2-ultra,
    "NVIDIA GB10" -> gb10), or None when the catalog (``keys``: default, read) has no
    such device."""
    from linkctl.estimate.catalog import load_spec

    keys = set(load_spec() if keys is None else keys)
    words = [w for w in accelerator.lower().split() if w not in ("apple", "nvidia", "geforce")]
    for n in range(len(words), 0, -1):
        for joiner in ("-", ""):
            if (key := joiner.join(words[:n])) in keys:
                return key
    return None


def gather(backend: Backend, facts: LinkFacts, opts: PairOptions, runner: Runner) -> Local:
    from linkctl.estimate.catalog import load_spec
    from linkctl.host import machine_facts
    from linkctl.llama.bins import find_bins, local_rpc_protocol

    m = machine_facts(backend.os_name, runner)
    spec = load_spec()
    # No accelerator: llama.cpp runs on the CPU, the catalog's "cpu" terms.
    device = catalog_key(m.accelerator, spec) if m.accelerator else "cpu"
    usable = m.usable_gb
    if device:  # the share llama.cpp can use (the OS keeps some of unified memory)
        usable = round(usable * float(spec[device]["usable_fraction"]), 1)
    bins = find_bins(opts.llama_bin_dir, runner)
    proto: tuple[int, ...] = ()
    if bins.rpc_server:
        try:
            proto = local_rpc_protocol(bins, runner)
        except InputError:
            proto = ()  # a build that does not answer HELLO: nothing to compare
    return Local(
        host=host_name(opts.host or m.hostname),
        os=backend.os_name,
        interface=facts.ifname,
        mac=facts.mac,
        accelerator=m.accelerator,
        device=device,
        memory_gb=m.memory_gb,
        usable_gb=usable,
        llama_build=bins.llama_server.version if bins.llama_server else None,
        rpc_protocol=proto,
        max_mtu=facts.max_mtu or facts.mtu,
        speed_mbps=facts.speed_mbps,
        networks=tuple(iface.used_networks(backend, facts.ifname)),
    )


def check_options(opts: PairOptions) -> None:
    """Bad input refused before anything is sent (exit 2), by the field and the fix."""
    import re

    from linkctl.core.profile import HOST_NAME_PATTERN, PROFILE_NAME_PATTERN

    if opts.subnet:
        agree.parse_subnet(opts.subnet)
    if opts.name and not re.fullmatch(PROFILE_NAME_PATTERN, opts.name):
        raise InputError(
            f"--name {opts.name!r}: not a profile name", "use a-z, 0-9, _ . - (41 at most)"
        )
    for flag, v in (("--host", opts.host), ("--head", opts.head)):
        if v and not re.fullmatch(HOST_NAME_PATTERN, v):
            raise InputError(
                f"{flag} {v!r}: not a host name", "a letter, then a-z, 0-9, - (16 at most)"
            )
    if opts.model is not None and not opts.model.startswith("/"):
        raise InputError(
            f"--model {opts.model!r}: not an absolute path",
            "give the model's absolute path on the head (boot services do not run in your cwd)",
        )
    if not 1 <= opts.window_s <= 3600:
        raise InputError(f"--window {opts.window_s:g}: out of range", "give 1 to 3600 seconds")


# ---- the exchange --------------------------------------------------------------------


class Exchange:
    """Discovery and confirmation with the one peer, on one channel."""

    def __init__(self, ch: Channel, me: Announcement, backend: Backend, deadline: float, say: Say):
        self.ch, self.me, self.backend, self.deadline, self.say = ch, me, backend, deadline, say
        self.peers: dict[str, Message] = {}  # by source address: the newest message

    def _carrier(self) -> None:
        if not self.backend.link_facts(self.ch.ifname).carrier:
            raise InputError(
                f"{self.ch.ifname} lost its carrier during pairing",
                "check the cable and both ports, then run pair again on both hosts",
            )

    def _heard(self, msg: Message) -> None:
        """Every message names its sender; more than one sender, a sender that started
        over (a new nonce), or a decline is a refusal."""
        if msg.ann.nonce == self.me.nonce:
            return
        if msg.kind == "decline":
            raise InputError(
                f"{msg.ann.host} declined the pairing: {msg.reason or 'no reason given'}",
                "run pair again on both hosts",
            )
        old = self.peers.get(msg.source)
        if old is not None and old.ann.nonce != msg.ann.nonce:
            raise InputError(
                f"{msg.ann.host} ({msg.source}) started pairing again while this host paired",
                "stop linkctl pair on both hosts, then run it again on both",
            )
        if old is None:
            self.ch.send(Message("hello", self.me), to=msg.source)
        self.peers[msg.source] = msg
        if len(self.peers) > 1:
            who = ", ".join(f"{m.ann.host} ({src})" for src, m in self.peers.items())
            raise InputError(
                f"{len(self.peers)} hosts are pairing on {self.ch.ifname}: {who}",
                "pair exactly two hosts: stop linkctl pair on the others (a switch "
                "segment: pair two at a time, or write the profile by hand)",
            )

    def _timeout(self, what: str) -> InputError:
        return InputError(
            f"{what} within the window",
            "run `sudo linkctl pair` on both hosts within --window seconds of each other",
        )

    def discover(self) -> Message:
        start = time.monotonic()
        next_send = next_note = start
        settle: float | None = None
        while True:
            now = time.monotonic()
            if now >= next_send:
                self._carrier()
                self.ch.send(Message("hello", self.me))
                next_send = now + ANNOUNCE_EVERY_S
            if self.peers and settle is not None and now >= settle:
                return next(iter(self.peers.values()))
            if now >= self.deadline:
                raise self._timeout(
                    f"no other host announced itself on {self.ch.ifname} (this host, "
                    f"{self.me.host}, did; the other side is missing)"
                )
            if now >= next_note and not self.peers:
                self.say(
                    f"waiting for the other host on {self.ch.ifname} ({now - start:.0f} s of "
                    f"{self.deadline - start:.0f} s): run `sudo linkctl pair` there"
                )
                next_note = now + NOTE_EVERY_S
            msg = self.ch.receive(min(next_send, self.deadline, settle or self.deadline))
            if msg is not None:
                self._heard(msg)
                if settle is None and self.peers:
                    settle = time.monotonic() + SETTLE_S

    def confirm(self, peer: Message, digest: str) -> None:
        """Both sides' confirm of the same digest. Done when the peer's confirm says it
        has this host's, or when the peer, having confirmed, has gone on (its "done",
        or silence past CONFIRM_GRACE_S: it leaves only with this host's confirm, and a
        refusal there sends a decline)."""
        src = peer.source
        got = False
        last_heard = time.monotonic()
        next_send = last_heard
        while True:
            now = time.monotonic()
            if now >= self.deadline:
                raise self._timeout(
                    f"{peer.ann.host} did not confirm the pairing (was the code accepted there?)"
                )
            if got and now - last_heard > CONFIRM_GRACE_S:
                return
            if now >= next_send:
                self._carrier()
                self.ch.send(Message("confirm", self.me, digest=digest, seen=got), to=src)
                next_send = now + ANNOUNCE_EVERY_S / 2
            msg = self.ch.receive(min(next_send, self.deadline))
            if msg is None or msg.ann.nonce == self.me.nonce:
                continue
            self._heard(msg)  # a third host, a restart or a decline: refused
            last_heard = time.monotonic()
            if msg.kind == "confirm":
                if msg.digest != digest:
                    raise InputError(
                        f"{peer.ann.host} agreed to another profile (digest {msg.digest[:12]}, "
                        f"this host {digest[:12]})",
                        "give both hosts the same --name/--subnet/--head/--model (or on one only)",
                    )
                got = True
                if msg.seen:
                    # The peer has this host's confirm; tell it this host has its, then go.
                    for _ in range(2):
                        self.ch.send(Message("confirm", self.me, digest=digest, seen=True), to=src)
                    return
            elif msg.kind == "done" and got:
                return

    def decline(self, peer: Message, reason: str) -> None:
        for _ in range(3):
            self.ch.send(Message("decline", self.me, reason=reason), to=peer.source)

    def finish(self, peer: Message, within: float, say: Say) -> None:
        """After this host's probe: say done, and wait for the peer's (whose probe may
        still need this host's responder). Past the write, a bad datagram only ends the
        wait early: it changes nothing here."""
        end = time.monotonic() + within
        next_send = 0.0
        while time.monotonic() < end:
            if time.monotonic() >= next_send:
                self.ch.send(Message("done", self.me), to=peer.source)
                next_send = time.monotonic() + ANNOUNCE_EVERY_S
            try:
                msg = self.ch.receive(min(next_send, end))
            except InputError as e:
                say(f"stopped waiting for {peer.ann.host}: {e.message}")
                return
            if msg and msg.ann.nonce == peer.ann.nonce and msg.kind == "done":
                for _ in range(2):
                    self.ch.send(Message("done", self.me), to=peer.source)
                return
        say(f"{peer.ann.host} did not say it finished probing within {within:g} s")


# ---- the stages ----------------------------------------------------------------------


def pair(
    opts: PairOptions,
    backend: Backend,
    *,
    say: Say,
    confirm: Callable[[str, Announcement], bool] | None,
    runner: Runner,
) -> PairResult:
    """``confirm(code, peer)``: asks the person; None: --yes."""
    from linkctl import __version__

    check_options(opts)
    facts = iface.choose(backend, opts.interface)
    say(f"interface: {facts.ifname} ({facts.kind}, carrier up, MAC {facts.mac or 'unknown'})")
    local = gather(backend, facts, opts, runner)
    wants = Wants(
        name=opts.name,
        subnet=opts.subnet,
        head=opts.head,
        model=opts.model,
        dry_run=opts.dry_run,
        setup=opts.setup,
    )
    share = KeyShare()
    me = announcement(local, wants, __version__, share.public)
    say(
        f"this host: {me.host}, {me.accelerator or 'no accelerator (CPU)'} "
        f"({me.device or 'not in the catalog'}), {me.usable_gb:g} GiB usable, "
        f"llama.cpp {me.llama_build or 'not found'}"
    )
    if me.device is None:
        say(
            f"note: {me.accelerator} is not in the device catalog: set hosts.device in the "
            "profile by hand (linkctl/data/devices.toml), calibration and estimate need it"
        )
    deadline = time.monotonic() + opts.window_s
    with Channel(facts.ifname, opts.port) as ch:
        ex = Exchange(ch, me, backend, deadline, say)
        say(f"announcing on {facts.ifname} (IPv6 link-local, UDP {opts.port}) ...")
        peer = ex.discover()
        p = peer.ann
        say(f"peer: {p.host} ({p.accelerator or p.os}) at {peer.source}, MAC {p.mac}")
        try:
            agree.check_peer(me, p, peer.sent - time.time())
            prof, why = agree.profile(me, p)
            text = agree.render(prof)
            shown = agree.code(me, p)
            say(
                f"proposed: profile {prof.name}, subnet {prof.link.subnet}, head "
                f"{prof.head.name} ({why}), MTU {prof.link.mtu}"
            )
            say(f"pairing code: {shown} (the other screen shows the same code)")
            if confirm is not None and not confirm(shown, p):
                raise InputError(
                    f"pairing with {p.host} not confirmed here", "run pair again on both"
                )
            ex.confirm(peer, agree.digest(text, me, p))
        except InputError as e:
            ex.decline(peer, f"{me.host}: {e.message}")
            raise
        say(f"agreed: profile {prof.name}, {prof.head.name} is the head")
        res = PairResult(
            facts.ifname,
            me.model_dump(mode="json"),
            p.model_dump(mode="json"),
            shown,
            prof.name,
            prof.head.name,
            why,
            text,
            dry_run=opts.dry_run,
        )
        res.up_lines = [
            f"on {h.name}: sudo linkctl up --profile {prof.name} --host {h.name}"
            for h in prof.hosts
        ]
        pair_key = PairSecret(share.secret(p.key_share, agree.transcript(me, p)), "pair")
        res.key_fingerprint = pair_key.fingerprint
        if opts.dry_run:
            return res
        path = opts.write or _profile_path(prof.name)
        res.profile_path, res.diff = str(path), write_profile(path, text)
        say(f"profile: wrote {path}" + (" (changed, diff below)" if res.diff else ""))
        key_file = secret.store(prof.name, pair_key.key)
        say(f"pair secret: wrote {key_file} (fingerprint {pair_key.fingerprint}, the same there)")
        if opts.setup:
            _setup_and_probe(prof, me, peer, backend, ex, res, say, opts.window_s)
    return res


def _profile_path(name: str) -> Path:
    from linkctl.core.paths import SYSTEM_PROFILE_DIR

    return SYSTEM_PROFILE_DIR / f"{name}.toml"


def write_profile(path: Path, text: str) -> str:
    """Write ``text`` (atomically, 0644) and check it loads; the diff from what was there."""
    from linkctl.core.profile import load_profile

    old = path.read_text() if path.is_file() else None
    diff = (
        "".join(
            difflib.unified_diff(
                (old or "").splitlines(True), text.splitlines(True), f"{path} (before)", str(path)
            )
        )
        if old not in (None, text)
        else ""
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    load_profile(str(path))  # `linkctl profile check`'s own loader
    return diff


def _setup_and_probe(
    prof: Any,
    me: Announcement,
    peer: Message,
    backend: Backend,
    ex: Exchange,
    res: PairResult,
    say: Say,
    window_s: float,
) -> None:
    from linkctl.net import link
    from linkctl.probe import run_probe
    from linkctl.probe.report import save
    from linkctl.probe.responder import Responder

    host, other = prof.host(me.host), prof.host(peer.ann.host)
    r = link.setup(prof, host, backend)
    res.setup = "nothing to do" if r.nothing_to_do else "; ".join(c.summary for c in r.plan.changes)
    say(f"setup: {res.setup}")
    spec = prof.probe
    responder = Responder(
        host.ip,
        spec.responder_port,
        spec.iperf_port,
        runner=backend.runner,
        host=host.name,
        secret=secret.load(prof.name),
    )
    responder.start()
    try:
        budget = max(60.0, window_s)  # the peer's probe may take as long
        end = time.monotonic() + budget
        said = ""
        while True:
            report = run_probe(prof, host, other, backend)
            if report.ok or time.monotonic() > end:
                break
            if report.why_not() != said:
                said = report.why_not()
                say(f"probe -> {other.name}: {said} (retrying while it sets up)")
            time.sleep(2.0)
        path = save(report)
        res.probe_ok = report.ok
        say(f"probe -> {other.name}: {'PASS' if report.ok else 'FAIL'} ({path})")
        ex.finish(peer, budget + 30.0, say)
    finally:
        responder.stop()
    if not report.ok:
        raise CheckFailed(
            f"the profile is written, but the probe of {other.name} failed: {report.why_not()}",
            "fix what the probe says, then `sudo linkctl probe --profile "
            f"{prof.name}` on both hosts",
        )
