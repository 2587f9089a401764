"""A Runner that replays recorded macOS command outputs, for the macOS backend tests.

Each argv maps to one recorded answer (tests/fixtures/macos/, see SOURCES.md
there). ``after`` switches answers once a given command has run, as the
machine's state would change (``-getinfo`` after ``-setmanual``). Every argv is
recorded in ``history``; an argv with no recorded answer is kept in
``unexpected`` and raises, so a test can never pass on a command it did not
expect (tests assert ``unexpected == []`` as well, since a transaction turns
the exception into an ApplyError).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from linkctl.core.errors import InputError
from linkctl.core.runner import DEFAULT_TIMEOUT, CommandFailed, Result, Runner
from linkctl.net.macos import MacBackend
from support.paths import FIXTURES as TEST_FIXTURES

FIXTURES = TEST_FIXTURES / "macos"

Argv = tuple[str, ...]


@dataclass(frozen=True)
class Reply:
    stdout: str = ""
    stderr: str = ""
    returncode: int = 0


def fx(name: str) -> str:
    return (FIXTURES / name).read_text()


def out(name: str, returncode: int = 0) -> Reply:
    """A recorded stdout."""
    return Reply(stdout=fx(name), returncode=returncode)


def err(name: str, returncode: int = 1) -> Reply:
    """A recorded stderr, with a failing exit status."""
    return Reply(stderr=fx(name), returncode=returncode)


class UnexpectedCommand(AssertionError):
    pass


def argv(cmd: str) -> Argv:
    """'networksetup -getinfo Ethernet' -> argv tuple (no argument here has spaces)."""
    return tuple(cmd.split())


@dataclass
class ReplayRunner(Runner):
    answers: dict[Argv, Reply] = field(default_factory=dict)
    after: dict[Argv, dict[Argv, Reply]] = field(default_factory=dict)
    tools: set[str] = field(
        default_factory=lambda: {"networksetup", "ifconfig", "route", "netstat"}
    )
    unexpected: list[Argv] = field(default_factory=list)

    def which(self, name: str) -> str | None:
        return f"/usr/sbin/{name}" if name in self.tools else None

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        check: bool = True,
        input: str | None = None,
    ) -> Result:
        argv = tuple(str(a) for a in argv)
        assert all(isinstance(a, str) for a in argv) and timeout > 0
        self.history.append(argv)
        if argv[0] not in self.tools:
            raise InputError(f"command not found: {argv[0]}", f"install {argv[0]}")
        reply = self.answers.get(argv)
        if reply is None:
            self.unexpected.append(argv)
            raise UnexpectedCommand(f"no recorded answer for {argv}")
        self.answers.update(self.after.get(argv, {}))
        result = Result(argv, reply.returncode, reply.stdout, reply.stderr)
        if check and not result.ok:
            raise CommandFailed(result)
        return result

    def commands(self) -> list[str]:
        """history as shell-like lines, for readable assertions."""
        return [" ".join(a) for a in self.history]

    def changes(self) -> list[str]:
        """Only the commands that change the machine."""
        return [c for c in self.commands() if _changes(c)]


def _changes(cmd: str) -> bool:
    words = cmd.split()
    if words[0] == "networksetup":
        return words[1].startswith("-set") or words[1].startswith("-order")
    if words[0] == "route":
        return any(w in ("add", "delete", "change") for w in words[1:3])
    return False


# ---- the Mac Studio scenario (SOURCES.md: which file answers which argv) -----------

PEER = "192.168.100.2"
SETMTU = "networksetup -setMTU en0 9000"
SETMANUAL = "networksetup -setmanual Ethernet 192.168.100.1 255.255.255.0"
SETDHCP = "networksetup -setdhcp Ethernet"
MTU_BACK = "networksetup -setMTU en0 1500"
ROUTE_ADD = "route -n add -net 192.168.100.0/24 -interface en0"
ROUTE_DEL = "route -n delete -net 192.168.100.0/24 -interface en0"

CONFIGURED = {
    argv("ifconfig en0"): out("ifconfig-en0-linkctl-10gbase-t-constructed.txt"),
    argv("networksetup -getinfo Ethernet"): out(
        "networksetup-getinfo-linkctl-manual-constructed.txt"
    ),
}


def mac_studio(
    *,
    before: str = "networksetup-getinfo-dhcp-no-address.txt",
    order: str = "networksetup-listnetworkserviceorder-wifi-first.txt",
    mtu_range: str = "networksetup-listvalidMTUrange-jumbo.txt",
    ifconfig: str = "ifconfig-en0-10gbase-t-mac-mini-m4.txt",
    peer_route: str = "route-n-get-peer-en0-constructed.txt",
    restore: str = SETDHCP,
) -> ReplayRunner:
    """The Mac Studio: Ethernet on en0 (10GBASE-T), Wi-Fi on en1 with the default route.
    ``restore`` is the command that puts ``before`` back."""
    restored = {
        argv("ifconfig en0"): out(ifconfig),
        argv("networksetup -getinfo Ethernet"): out(before),
    }
    ok = Reply()
    return ReplayRunner(
        answers={
            argv("networksetup -listallhardwareports"): out(
                "networksetup-listallhardwareports-ethernet-en0.txt"
            ),
            argv("networksetup -listnetworkserviceorder"): out(order),
            argv("ifconfig en0"): out(ifconfig),
            argv("ifconfig -a"): out("ifconfig-10gbase-t-mac-mini-m4.txt"),
            argv("networksetup -listvalidMTUrange en0"): out(mtu_range),
            argv("netstat -rn -f inet"): out("netstat-rn-inet-section-mac-studio.txt"),
            argv("route -n get default"): out("route-n-get-default-en1-constructed.txt"),
            argv("networksetup -getinfo Ethernet"): out(before),
            argv("networksetup -getMTU en0"): out("networksetup-getMTU.txt"),
            argv(f"route -n get {PEER}"): out(peer_route),
            argv(SETMTU): ok,
            argv(MTU_BACK): ok,
            argv(SETMANUAL): ok,
            argv(restore): ok,
            argv(ROUTE_ADD): ok,
            argv(ROUTE_DEL): ok,
        },
        after={
            argv(SETMTU): {
                argv("networksetup -getMTU en0"): out("networksetup-getMTU-9000-constructed.txt")
            },
            argv(MTU_BACK): {argv("networksetup -getMTU en0"): out("networksetup-getMTU.txt")},
            argv(SETMANUAL): CONFIGURED,
            argv(restore): restored,
            argv(ROUTE_ADD): {
                argv(f"route -n get {PEER}"): out("route-n-get-peer-en0-constructed.txt")
            },
            argv(ROUTE_DEL): {
                argv(f"route -n get {PEER}"): out("route-n-get-peer-via-wifi-constructed.txt")
            },
        },
    )


def configured(runner: ReplayRunner) -> ReplayRunner:
    """The machine as setup leaves it."""
    runner.answers.update(CONFIGURED)
    runner.answers[argv("networksetup -getMTU en0")] = out(
        "networksetup-getMTU-9000-constructed.txt"
    )
    return runner


def backend(runner: ReplayRunner, *, root: bool = True, settle: float = 5.0) -> MacBackend:
    return MacBackend(
        runner, euid=lambda: 0 if root else 501, sleep=lambda _s: None, settle_timeout=settle
    )
