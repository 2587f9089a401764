"""The demo's probe step: why a run did not pass, in words with figures, and one more
run when it did not (the lab shares this machine's CPUs). The probe's own output is
replayed from tests/fixtures/probe (the report `linkctl probe --json` printed, as a list of
one, in those cases);
the lab run itself is tests/test_demo.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from linkctl.core.errors import CheckFailed
from linkctl.core.runner import Result
from linkctl.lab.demo_steps import Probe, ProbeOutcome
from support.paths import FIXTURES

FIX = FIXTURES / "probe"


def report(name: str) -> dict:
    return json.loads((FIX / f"{name}.json").read_text())


def fixture(name: str) -> str:
    """What `linkctl probe --peer P --json` prints: a list of one report (the fixture)."""
    return json.dumps([report(name)])


class Ctx:
    """What Probe uses of the demo's context, answering with recorded probe outputs."""

    def __init__(self, tmp: Path, answers: list[tuple[int, str, str]]):
        self.tmp, self.answers, self.said = tmp, list(answers), []
        self.prof_path = tmp / "lab.toml"

    def log(self, name: str) -> Path:
        return self.tmp / name

    def say(self, msg: str) -> None:
        self.said.append(msg)

    def run_in(self, host: str, argv: list[str], log: Path, timeout: float) -> Result:
        assert argv[:2] == ["linkctl", "probe"] and "--json" in argv
        rc, out, err = self.answers.pop(0)
        log.write_text(out + err)
        return Result(argv, rc, out, err)


def tail_failed() -> str:
    d = report("clean")
    for c in d["checks"]:
        if c["name"] == "tcp rtt 1 B":
            c["verdict"], c["value"] = "FAIL", 7310.0
    d["exit_code"], d["ok"] = 1, False
    return json.dumps([d])


COULD_NOT_RUN, FAILED = ProbeOutcome.COULD_NOT_RUN, ProbeOutcome.FAILED


@pytest.mark.parametrize(
    "answer, outcome, why",
    [
        ((2, fixture("iperf-busy"), ""), COULD_NOT_RUN, "iperf3 server on 192.168.100.2:5201"),
        ((1, fixture("mtu-mismatch"), ""), FAILED, "path mtu (1500 vs limit 9000)"),
        ((1, tail_failed(), ""), FAILED, "tcp rtt 1 B (7310 vs limit 500)"),
        ((-9, "", ""), COULD_NOT_RUN, "no output (exit -9)"),
        ((2, "", "linkctl: error: no such host\n"), COULD_NOT_RUN, "linkctl: error: no such"),
    ],
)
def test_why_a_probe_did_not_pass(tmp_path, answer, outcome, why):
    got = Probe("mac", "dgx").attempt(Ctx(tmp_path, [answer]), tmp_path / "p.log")
    assert got.outcome is outcome and got.why.startswith(why), got
    assert str(got) == f"{outcome.value}: {got.why}"


def test_a_passing_attempt_has_no_reason(tmp_path):
    got = Probe("mac", "dgx").attempt(Ctx(tmp_path, [(0, fixture("clean"), "")]), tmp_path / "p")
    assert got.outcome is ProbeOutcome.PASSED and got.why == "" and got.record is not None


def test_a_passing_probe_runs_once(tmp_path):
    ctx = Ctx(tmp_path, [(0, fixture("clean"), "")])
    r = Probe("mac", "dgx").probe(ctx)
    assert r.ok and r.first_run is None and not ctx.said and not ctx.answers


def test_a_failed_probe_runs_once_more_and_the_first_reason_is_kept(tmp_path):
    ctx = Ctx(tmp_path, [(1, tail_failed(), ""), (0, fixture("clean"), "")])
    r = Probe("mac", "dgx").probe(ctx)
    assert r.ok and r.first_run == "failed: tcp rtt 1 B (7310 vs limit 500)"
    assert "probing once more" in ctx.said[0] and "7310" in ctx.said[0]
    log = (tmp_path / "mac-probe-dgx.log").read_text()
    assert log.count('"checks"') == 2 and "--- second run ---" in log


def test_two_failures_stop_the_demo_with_the_reason(tmp_path):
    stopped = (2, fixture("iperf-busy"), "")
    with pytest.raises(CheckFailed, match=r"could not run: iperf3 server .* busy"):
        Probe("mac", "dgx").probe(Ctx(tmp_path, [stopped, stopped]))
    failed = (1, tail_failed(), "")
    r = Probe("mac", "dgx").probe(Ctx(tmp_path, [failed, failed]))
    assert not r.ok and r.failed == "tcp rtt 1 B (7310 vs limit 500)"
