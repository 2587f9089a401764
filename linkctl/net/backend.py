"""One public interface to the per-OS network backends.

Like psutil's ``_pslinux``/``_psosx``, each OS has one module behind this
interface (``linkctl.net.linux``, ``linkctl.net.macos``); callers ask for
``get_backend()`` and never branch on the platform themselves.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol

from linkctl.core.errors import InputError
from linkctl.core.profile import HostSpec, LinkSpec
from linkctl.core.runner import Runner, default_runner
from linkctl.net.netstate import LinkFacts, Route, TcpConn
from linkctl.net.plan import Change, Plan


class Backend(Protocol):
    os_name: str  # "linux" or "macos"
    runner: Runner

    def interfaces(self) -> list[str]:
        """Names of the interfaces that exist here."""

    def link_facts(self, ifname: str) -> LinkFacts:
        """State of one interface; InputError listing the others if it is missing."""

    def routes(self) -> list[Route]:
        """IPv4 routes of the main table (default route included)."""

    def default_route(self) -> Route | None:
        """The IPv4 default route, or None."""

    def tcp_connections(self, ends: list[str]) -> list[TcpConn]:
        """This network namespace's established TCP connections with either end at one
        of ``ends`` ("ip:port"), with the kernel's figures; [] where the OS does not
        give them."""

    def ping_argv(self, address: str, **kw: Any) -> list[str]:
        """argv for this OS's ping (linkctl.net.ping): size, count, timeout_s, interval_s,
        dont_fragment. The probe runs it through ``runner``."""

    def icmp_socket_groups(self) -> tuple[int, int] | None:
        """The groups (lowest, highest) this network namespace lets open datagram ICMP
        sockets (linkctl.net.echo), or None where any user may."""

    def plan_setup(self, profile: str, host: HostSpec, link: LinkSpec, facts: LinkFacts) -> Plan:
        """Changes that bring ``facts`` to what the profile wants; empty if nothing to do."""

    def plan_teardown(self, profile: str, host: HostSpec, facts: LinkFacts) -> Plan:
        """Changes that remove the profile's address when no setup record exists."""

    def plan_follow_up(self, host: HostSpec, link: LinkSpec, peers: list[HostSpec]) -> Plan:
        """Read-only, after setup's changes are in place (or when none were needed):
        wait for the OS to take them, then plan what it left undone for traffic to
        ``peers`` to leave through the link (macOS: a missing subnet route), each change
        with its undo; warnings go in notes. CheckFailed when the link cannot be right."""

    def execute(self, change: Change) -> None:
        """Carry out one change; raise InputError/ApplyError on failure."""


def current_os() -> str:
    if sys.platform.startswith("linux"):
        return "linux"
    if sys.platform == "darwin":
        return "macos"
    raise InputError(f"unsupported platform {sys.platform!r}", "run linkctl on Linux or macOS")


def get_backend(os_name: str | None = None, runner: Runner | None = None) -> Backend:
    """The backend for ``os_name`` (default: this machine's OS)."""
    os_name = os_name or current_os()
    runner = runner or default_runner()
    if os_name == "linux":
        from linkctl.net.linux import LinuxBackend

        return LinuxBackend(runner)
    if os_name == "macos":
        from linkctl.net.macos import MacBackend

        return MacBackend(runner)
    raise InputError(f"no backend for OS {os_name!r}", "use linux or macos")
