"""StopFlag: SIGTERM always stops a process whose main thread waits on it.

The CI failure it fixes: a delay proxy whose handler called threading.Event.set() while
its main thread looped on Event.wait() ignored SIGTERM for good. The stress case below
hangs a threading.Event in about half of runs on this machine, so it is run against
Event too, to show it catches the fault it guards against.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from linkctl.core.stopflag import StopFlag, stop_on_signals

# The main thread spins on wait(0) (it is inside wait() nearly all the time, so the
# signal lands there); a thread sends SIGTERM to the process after 50 ms.
SPIN = r"""
import os, signal, sys, threading, time
from linkctl.core.stopflag import stop_on_signals
def kill():
    time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)
if sys.argv[1] == "event":
    flag = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: flag.set())
    threading.Thread(target=kill, daemon=True).start()
    while not flag.wait(0):
        pass
else:
    with stop_on_signals() as flag:
        threading.Thread(target=kill, daemon=True).start()
        while not flag.wait(0):
            pass
print("stopped")
"""

# The signal goes to a thread that is not the main one (the kernel may pick any);
# the main thread waits with no timeout.
OTHER_THREAD = r"""
import signal, threading, time
from linkctl.core.stopflag import stop_on_signals
with stop_on_signals() as flag:
    t = threading.Thread(target=time.sleep, args=(5,), daemon=True)
    t.start()
    threading.Timer(0.05, signal.pthread_kill, (t.ident, signal.SIGTERM)).start()
    t0 = time.monotonic()
    assert flag.wait() and flag.signum == signal.SIGTERM
    print(round(time.monotonic() - t0, 3))
"""


def _hangs(kind: str, timeout: float) -> bool:
    p = subprocess.Popen([sys.executable, "-c", SPIN, kind], stdout=subprocess.PIPE, text=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()  # a hung one ignores SIGTERM for good
        p.communicate()
        return True
    assert p.returncode == 0 and out.strip() == "stopped", (p.returncode, out)
    return False


def test_sigterm_while_spinning_on_the_flag_always_stops():
    hung = [i for i in range(15) if _hangs("stopflag", timeout=10)]
    assert not hung, f"runs {hung} of 15 ignored SIGTERM"


def test_the_same_spin_on_threading_event_hangs():
    """The control: the stress case does catch a lock taken in the handler."""
    assert any(_hangs("event", timeout=3) for _ in range(30)), "no hang in 30 runs"


def test_a_signal_taken_by_another_thread_still_wakes_the_main_thread():
    r = subprocess.run(
        [sys.executable, "-c", OTHER_THREAD], capture_output=True, text=True, timeout=20
    )
    assert r.returncode == 0, r.stderr
    assert float(r.stdout) < 2.0  # the poll is 0.2 s; 5 s would mean it waited for the sleeper


def test_set_from_another_thread_wakes_a_waiter_and_timeouts_hold():
    flag = StopFlag()
    try:
        t0 = time.monotonic()
        assert flag.wait(0.3) is False
        assert time.monotonic() - t0 >= 0.29
        threading.Timer(0.05, flag.set).start()
        assert flag.wait(10) is True
        assert time.monotonic() - t0 < 5
        assert flag.is_set() and flag.wait(0) and flag.signum is None
    finally:
        flag.close()


def test_stop_on_signals_restores_the_old_handlers():
    import signal

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with stop_on_signals() as flag:
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
        signal.raise_signal(signal.SIGINT)
        assert flag.wait(5) and flag.signum == signal.SIGINT
    assert {s: signal.getsignal(s) for s in before} == before
