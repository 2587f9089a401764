"""The one way linkctl runs an external command.

argv lists only (never a shell string), a timeout on every call, output
captured. Backends take a ``Runner`` so tests can swap in one that replays
recorded outputs (macOS) while Linux tests run the real thing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from linkctl.core.errors import CommandNotFound, InputError, Timeout

DEFAULT_TIMEOUT = 30.0


@dataclass(frozen=True)
class Result:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class CommandFailed(InputError):
    def __init__(self, result: Result):
        self.result = result
        err = (result.stderr or result.stdout).strip().splitlines()
        detail = err[-1] if err else "no output"
        super().__init__(f"`{' '.join(result.argv)}` exited {result.returncode}: {detail}")


@dataclass
class Runner:
    """Runs commands for real. ``history`` records every argv, for dry-run and tests."""

    history: list[tuple[str, ...]] = field(default_factory=list)

    def which(self, name: str) -> str | None:
        return shutil.which(name)

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        check: bool = True,
        input: str | None = None,
        env: dict[str, str] | None = None,
    ) -> Result:
        argv = tuple(str(a) for a in argv)
        self.history.append(argv)
        try:
            proc = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=timeout,
                input=input,
                check=False,
                env=env,
            )
        except FileNotFoundError:
            raise CommandNotFound(argv[0], f"install {argv[0]} or put it on PATH") from None
        except subprocess.TimeoutExpired:
            raise Timeout(
                f"`{' '.join(argv)}` did not finish within {timeout:g} s",
                "check the device or service it talks to",
                seconds=timeout,
            ) from None
        result = Result(argv, proc.returncode, proc.stdout, proc.stderr)
        if check and not result.ok:
            raise CommandFailed(result)
        return result

    def spawn(
        self,
        argv: Sequence[str],
        *,
        stdout: Any = subprocess.DEVNULL,
        stderr: Any = subprocess.DEVNULL,
        stdin: Any = subprocess.DEVNULL,
        env: dict[str, str] | None = None,
        new_session: bool = False,
        cgroups: Sequence[str] = (),
        umask: int = -1,
        die_with_parent: bool = False,
    ) -> subprocess.Popen:
        """Start a long-running child (a server) and return it; the caller stops it.

        argv list only, recorded in ``history`` like ``run``. A missing binary is
        a CommandNotFound, not a traceback. ``cgroups``: cgroup directories the child
        joins before it runs ``argv`` (a container launcher's own cgroup). ``umask``: the
        child's (-1: this process's). ``die_with_parent``: on Linux the child gets SIGKILL
        when the thread that started it dies, even by SIGKILL (prctl PR_SET_PDEATHSIG),
        so a killed supervisor leaves no server holding its port.
        """
        argv = tuple(str(a) for a in argv)
        self.history.append(argv)

        arm = _pdeathsig() if die_with_parent else None

        def before_exec() -> None:
            for d in cgroups:
                with open(f"{d}/cgroup.procs", "w") as f:
                    f.write("0")  # 0: the writing process itself
            if arm is not None:
                arm()

        try:
            return subprocess.Popen(
                argv,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                env=env,
                start_new_session=new_session,
                preexec_fn=before_exec if cgroups or arm else None,
                umask=umask,
            )
        except FileNotFoundError:
            raise CommandNotFound(argv[0], f"install {argv[0]} or put it on PATH") from None


def _pdeathsig() -> Callable[[], None] | None:
    """What a forked child calls to get SIGKILL when its parent goes (Linux prctl(2)
    PR_SET_PDEATHSIG, option 1; if the parent went already, it dies now). Made in the
    parent: nothing is imported after fork. None where there is no such call (macOS)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def arm() -> None:
        prctl(1, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return arm


def foreground(argv: Sequence[str], *, env: dict[str, str] | None = None) -> int:
    """Run ``argv`` on this terminal (stdin, stdout and stderr passed through) until it
    exits, passing SIGTERM and SIGINT on to it, so that stopping the caller stops the
    command. Returns its exit status as a shell does: 128 + N when signal N ended it.

    A SIGINT from the terminal (Ctrl-C) already reached the command, which is in the
    terminal's foreground process group with the caller: it is not sent twice."""
    child: list[subprocess.Popen] = []
    early: list[int] = []  # a signal before the child exists: sent once it does

    def forward(signum: int, _frame: object) -> None:
        if signum == signal.SIGINT and _terminal_sends_sigint():
            return
        if not child:
            early.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            child[0].send_signal(signum)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        proc = default_runner().spawn(argv, stdin=None, stdout=None, stderr=None, env=env)
        child.append(proc)
        for sig in early:
            proc.send_signal(sig)
        code = proc.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def _terminal_sends_sigint() -> bool:
    """True when this process group is its terminal's foreground group (Ctrl-C there
    signals every process of the group)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError):  # no terminal, or stdin closed
        return False


def stop_process(
    proc: subprocess.Popen,
    timeout: float,
    *,
    kill_wait: float | None = None,
    say: Callable[[str], None] | None = None,
) -> int | None:
    """Stop a child ``spawn`` started: SIGTERM, wait up to ``timeout`` s, then SIGKILL
    and wait ``kill_wait`` s (None: until it is reaped). Returns its exit code.

    The pid only, never its process group: a child that forwards SIGTERM (linkctl's
    supervisors) stops its own children. ``say`` hears when SIGKILL was needed.
    A child that outlives SIGKILL's ``kill_wait`` raises subprocess.TimeoutExpired.
    """
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
            # A stopped process (SIGSTOP, a hung debugger) acts on SIGTERM only once it
            # runs again: SIGCONT after it, as systemd does (systemd.kill(5), KillSignal=).
            proc.send_signal(signal.SIGCONT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            if say:
                say(f"pid {proc.pid} ignored SIGTERM for {timeout:g} s; SIGKILL")
            proc.kill()
            proc.wait(kill_wait)
    return proc.returncode


class Children:
    """Servers started for a ``with`` block, each writing its output to a log file; every
    one stopped (by its own pid, newest first) when the block ends, however it ends."""

    def __init__(self, runner: Runner, stop_timeout: float = 10.0, kill_wait: float = 5.0):
        self.runner, self.stop_timeout, self.kill_wait = runner, stop_timeout, kill_wait
        self._procs: list[tuple[subprocess.Popen, IO[str]]] = []

    def spawn(self, argv: Sequence[str], log: Path) -> subprocess.Popen:
        fh = log.open("w")
        os.fchmod(fh.fileno(), 0o644)  # whatever the umask: users read the state's logs
        try:
            proc = self.runner.spawn(argv, stdout=fh, stderr=subprocess.STDOUT)
        except BaseException:
            fh.close()
            raise
        self._procs.append((proc, fh))
        return proc

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc, fh in reversed(self._procs):
            try:
                stop_process(proc, self.stop_timeout, kill_wait=self.kill_wait)
            finally:
                fh.close()


_default = Runner()


def default_runner() -> Runner:
    return _default
