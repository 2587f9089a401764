"""A stop flag that a signal handler may set: SIGTERM/SIGINT to a clean stop.

``threading.Event.set()`` takes the Event's lock, and a Python signal handler runs on
the main thread between two bytecodes. When the main thread is itself in
``Event.wait()`` it holds that lock for a few bytecodes around every timed wait; a
signal landing there makes the handler's ``set()`` wait forever for a lock its own
thread holds, and every later SIGTERM does the same (the shape of cpython#126434,
reported for multiprocessing.Event). CI saw it as a delay proxy that ignored SIGTERM;
a loop of ``Event.wait(0)`` hangs in about half of runs here (tests/test_stopflag.py).

StopFlag takes no lock: ``set()`` stores a bool and writes one byte to a pipe,
``wait()`` selects on that pipe, so it wakes whichever thread set it.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A signal the kernel hands to another thread runs its Python handler only when the main
# thread next runs bytecode: wait() returns to Python this often to let it.
_POLL_S = 0.2


class StopFlag:
    """threading.Event's set / is_set / wait, safe to set from a signal handler."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._set = False
        self.signum: int | None = None  # the signal that set it, if one did

    def set(self) -> None:
        if not self._set:
            self._set = True
            with contextlib.suppress(BlockingIOError):
                os.write(self._w, b"x")  # never drained: every later wait() returns at once

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; False if ``timeout`` seconds went by first."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self._set:
            left = _POLL_S if end is None else min(_POLL_S, end - time.monotonic())
            if left <= 0:
                break
            select.select([self._r], [], [], left)
        return self._set

    def close(self) -> None:
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """A StopFlag that SIGTERM and SIGINT set within the block; the old handlers come
    back afterwards and the flag is closed (its is_set() and signum stay readable)."""
    flag = StopFlag()

    def handler(signum: int, _frame: object) -> None:
        flag.signum = signum
        flag.set()

    old = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield flag
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        flag.close()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block SIGTERM raises KeyboardInterrupt, as Ctrl-C does, so a command
    that must undo what it did on the way out (`linkctl up`, the boot lab) unwinds for
    either; the old handler comes back afterwards."""

    def on_term(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
