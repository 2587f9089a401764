"""Pure rendering: profile + host + paths in, {absolute target path: file text} out, from
the templates shipped in ``linkctl/data/systemd/`` and ``linkctl/data/launchd/``. No I/O
beyond reading those templates; which renderer a host gets is its manager's choice
(``linkctl.service.manager.manager_for``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape as xml_escape

from linkctl.core.errors import InputError
from linkctl.core.paths import SYSTEM_PROFILE_DIR, SYSTEM_STATE_DIR, shipped
from linkctl.core.profile import HostSpec, Profile
from linkctl.trust.secret import key_path

UNIT_DIR = "/etc/systemd/system"
# `linkctl up --no-boot`: where each manager takes services it runs now but forgets at
# the next boot (systemd.unit(5): /run/systemd/system, "runtime units"; launchd loads
# only /Library/LaunchDaemons at boot, and macOS empties /var/run then).
RUNTIME_UNIT_DIR = "/run/systemd/system"
LAUNCHD_DIR = "/Library/LaunchDaemons"
LAUNCHD_RUNTIME_DIR = "/var/run/linkctl/launchd"
LAUNCHD_LOG_DIR = "/Library/Logs"
PROFILE_DIR = str(SYSTEM_PROFILE_DIR)
STATE_DIR = str(SYSTEM_STATE_DIR)
# The serve unit's own StateDirectory= (it runs as a throwaway user, not root).
SERVE_STATE_DIR = "/var/lib/linkctl-serve"
SYSTEMD_UNITS = ("linkctl-link.service", "linkctl-responder.service", "linkctl-serve.service")
LAUNCHD_JOBS = ("link", "probe", "responder", "serve")
LABEL_PREFIX = "com.linkctl."
DEFAULT_WAIT_CARRIER_S = 120.0
# launchd's PATH is /usr/bin:/bin:/usr/sbin:/sbin; iperf3 comes from Homebrew.
LAUNCHD_PATH = "/opt/homebrew/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
# The head's serve unit sets the state directory of its re-probe with env(1).
ENV = "/usr/bin/env"
GENERATED = "Rendered by `linkctl service install`; edit the template, not this file."


def template_dir(kind: str) -> Path:
    """The shipped systemd/ or launchd/ templates (package data, linkctl/data/)."""
    d = shipped(kind)
    if not d.is_dir():
        raise InputError(
            f"service templates not found at {d}",
            "reinstall linkctl: the package is missing its data files",
        )
    return d


def label(job: str) -> str:
    return LABEL_PREFIX + job


@dataclass(frozen=True)
class ServicePaths:
    """Where things are on the machine the services run on (absolute paths there)."""

    linkctl_bin: str
    llama_bin_dir: str
    profile_path: str
    # Text to install at profile_path; None when the profile already lives there.
    profile_text: str | None = None
    state_dir: str = STATE_DIR
    wait_carrier_s: float = DEFAULT_WAIT_CARRIER_S
    # Linux: None = DynamicUser; "root" = root without capabilities; else User=NAME.
    # macOS: None/"root" = root; else UserName=NAME.
    serve_user: str | None = None
    # False: run now, not at boot (`linkctl up --no-boot`): the files go where the
    # manager forgets them at the next boot.
    boot: bool = True
    # How old the head's probe report may be when serve (re)starts: older, its serve
    # unit probes again first (linkctl.serve.run.PROBE_MAX_AGE_S).
    probe_max_age_s: float = 24 * 3600


def unit_dir(paths: ServicePaths) -> str:
    return UNIT_DIR if paths.boot else RUNTIME_UNIT_DIR


def launchd_dir(paths: ServicePaths) -> str:
    return LAUNCHD_DIR if paths.boot else LAUNCHD_RUNTIME_DIR


_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")


def fill(template: str, values: dict[str, str], name: str = "template") -> str:
    """Replace {name} placeholders; an unknown one is a template bug, said plainly."""
    missing = sorted(set(_PLACEHOLDER.findall(template)) - values.keys())
    if missing:
        raise InputError(f"{name}: unknown placeholder(s) {', '.join(missing)}")
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def device_unit(ifname: str) -> str:
    """systemd's device unit for a network interface, escaped like `systemd-escape --path`."""
    out = []
    for ch in ifname:
        if ch.isascii() and (ch.isalnum() or ch in ":_."):
            out.append(ch)
        else:
            out.append("".join(f"\\x{b:02x}" for b in ch.encode()))
    return f"sys-subsystem-net-devices-{''.join(out)}.device"


_SAFE_ARG = re.compile(r"^[A-Za-z0-9_@+=:,./-]+$")


def systemd_quote(arg: str) -> str:
    """One argv element for ExecStart= (specifiers and variables escaped)."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if _SAFE_ARG.fullmatch(arg):
        return arg
    quoted = arg.replace("\\", "\\\\").replace('"', '\\"')
    # A control character (a newline would end the directive) as a C escape, which
    # systemd.syntax(7) reads inside quotes.
    quoted = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in quoted)
    return f'"{quoted}"'


def systemd_cmd(argv: list[str]) -> str:
    return " ".join(systemd_quote(a) for a in argv)


def _argv(paths: ServicePaths, verb: str, host: HostSpec, *extra: str) -> list[str]:
    return [paths.linkctl_bin, verb, "--profile", paths.profile_path, "--host", host.name, *extra]


def _wait(paths: ServicePaths) -> str:
    return f"{paths.wait_carrier_s:g}"


def commands(host: HostSpec, paths: ServicePaths) -> dict[str, list[str]]:
    """The argv each service runs, by job name (link = setup, probe = the gate)."""
    return {
        "link": _argv(paths, "setup", host, "--wait-carrier", _wait(paths)),
        "probe": _argv(paths, "probe", host),
        "responder": _argv(paths, "responder", host),
        "serve": _argv(paths, "serve", host),
    }


def _ip_filter(profile: Profile, host: HostSpec, kind: str) -> str:
    # The profile's hosts by address, not the whole subnet: another machine on a shared
    # segment reaches none of these services (rpc-server has no authentication).
    peers = " ".join(f"{h.address.ip}/32" for h in profile.hosts)
    allow = f"IPAddressDeny=any\nIPAddressAllow=localhost {peers}"
    if kind == "serve" and host.role == "head" and not profile.serve.host.is_loopback:
        return (
            f"# No IP filter: llama-server's API listens on {profile.serve.host}, outside the link."
        )
    return "# Traffic only with the profile's hosts over the link (and loopback).\n" + allow


def _reprobe(profile: Profile, host: HostSpec, paths: ServicePaths) -> str:
    """The head's serve unit: probe again before a start when the report has aged.
    "+": this one command runs as root with CAP_NET_RAW (the probe's ARP), outside the
    sandbox (systemd.service(5), ExecStart= prefixes); serve itself stays unprivileged.
    It writes where the link unit's probe writes; serve reads that through the bind."""
    if host.role != "head":
        return "# An rpc host serves without a probe gate: nothing to probe before a start."
    argv = [
        ENV,
        f"LINKCTL_STATE_DIR={paths.state_dir}",
        *_argv(paths, "probe", host, "--max-age", f"{paths.probe_max_age_s:g}"),
    ]
    return (
        "# A restart after the probe report has aged (a crash a day later) probes again\n"
        "# first instead of refusing; a failing probe fails the start, and Restart= retries.\n"
        f"ExecStartPre=+{systemd_cmd(argv)}"
    )


def _identity(paths: ServicePaths) -> str:
    user = paths.serve_user
    if user is None:
        return (
            "# A throwaway user, allocated at start (no account to create or remove).\n"
            "DynamicUser=yes"
        )
    if user == "root":
        return (
            "# Root without any capability: the interpreter or a binary is not readable by\n"
            "# other users, so a dedicated user could not run it (see `linkctl service status`).\n"
            "User=root"
        )
    return f"User={user}"


def render_systemd(profile: Profile, host: HostSpec, paths: ServicePaths) -> dict[str, str]:
    cmds = commands(host, paths)
    serve_what = (
        f"rpc-server on {host.rpc_endpoint}"
        if host.role == "rpc"
        else f"llama-server on {profile.serve.host}:{profile.serve.port} "
        f"with rpc {', '.join(h.rpc_endpoint for h in profile.rpc_hosts)}"
    )
    common = {
        "generated": GENERATED,
        "profile": profile.name,
        "host": host.name,
        "iface": host.interface,
        "address": str(host.address),
        "device_unit": device_unit(host.interface),
        "state_dir": paths.state_dir,
        # A path, not an argv word: only specifiers need escaping (systemd.unit(5)).
        "pair_key": str(key_path(profile.name, Path(paths.state_dir))).replace("%", "%%"),
    }
    values = {
        "linkctl-link.service": {
            **common,
            "setup_cmd": systemd_cmd(cmds["link"]),
            "probe_cmd": systemd_cmd(cmds["probe"]),
            "ip_filter": _ip_filter(profile, host, "link"),
        },
        "linkctl-responder.service": {
            **common,
            "responder_cmd": systemd_cmd(cmds["responder"]),
            "identity": _identity(paths),
            "ip_filter": _ip_filter(profile, host, "responder"),
        },
        "linkctl-serve.service": {
            **common,
            "serve_what": serve_what,
            "serve_cmd": systemd_cmd(cmds["serve"]),
            "reprobe": _reprobe(profile, host, paths),
            "serve_state_dir": SERVE_STATE_DIR,
            "cache_dir": "/var/cache/linkctl-serve",
            "llama_bin_dir": systemd_quote(paths.llama_bin_dir),
            "identity": _identity(paths),
            "ip_filter": _ip_filter(profile, host, "serve"),
        },
    }
    tdir = template_dir("systemd")
    out = {}
    for unit in SYSTEMD_UNITS:
        text = (tdir / f"{unit}.in").read_text()
        out[f"{unit_dir(paths)}/{unit}"] = fill(text, values[unit], f"systemd/{unit}.in")
    return out


LAUNCHD_JOB_SPEC = {
    # job: (what, KeepAlive, ThrottleInterval, ProcessType)
    "link": ("the direct link (setup, after waiting for carrier)", "on-failure", 30, "Background"),
    "probe": ("the probe gate (retried until it passes)", "on-failure", 30, "Background"),
    "responder": ("the probe responder", "always", 5, "Background"),
    "serve": ("linkctl serve", "always", 30, "Interactive"),
}


def _plist_strings(items: list[str], indent: str = "\t\t") -> str:
    return "\n".join(f"{indent}<string>{xml_escape(a)}</string>" for a in items)


def _plist_env(env: dict[str, str]) -> str:
    return "\n".join(
        f"\t\t<key>{xml_escape(k)}</key>\n\t\t<string>{xml_escape(v)}</string>"
        for k, v in env.items()
    )


def render_launchd(profile: Profile, host: HostSpec, paths: ServicePaths) -> dict[str, str]:
    cmds = commands(host, paths)
    text = (template_dir("launchd") / "com.linkctl.daemon.plist.in").read_text()
    out = {}
    for job in LAUNCHD_JOBS:
        what, keep, throttle, ptype = LAUNCHD_JOB_SPEC[job]
        env = {"PATH": LAUNCHD_PATH, "LINKCTL_STATE_DIR": paths.state_dir}
        if job == "serve":
            env["LINKCTL_LLAMA_BIN"] = paths.llama_bin_dir
        user = ""
        if job == "serve" and paths.serve_user not in (None, "root"):
            user = f"\t<key>UserName</key>\n\t<string>{xml_escape(paths.serve_user)}</string>\n"
        keep_alive = (
            "\t<true/>"
            if keep == "always"
            else "\t<dict>\n\t\t<key>SuccessfulExit</key>\n\t\t<false/>\n\t</dict>"
        )
        values = {
            "generated": GENERATED.replace("`", ""),
            "what": what,
            "profile": xml_escape(profile.name),
            "host": xml_escape(host.name),
            "label": label(job),
            "program_arguments": _plist_strings(cmds[job]),
            "environment": _plist_env(env),
            "user_name": user,
            "keep_alive": keep_alive,
            "throttle": str(throttle),
            "process_type": ptype,
            # launchd's Umask is decimal: 63 = 077 (serve, responder: their files are
            # their own), 18 = 022 (link, probe: reports every user reads).
            "umask": "63" if job in ("serve", "responder") else "18",
            "log_path": f"{LAUNCHD_LOG_DIR}/linkctl-{job}.log",
        }
        out[f"{launchd_dir(paths)}/{label(job)}.plist"] = fill(
            text, values, "launchd plist template"
        )
    return out
