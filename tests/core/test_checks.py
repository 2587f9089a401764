"""One check vocabulary: status, probe and doctor judge the same NIC facts with the
same rules (linkctl.core.checks), so for any facts their verdicts agree."""

from __future__ import annotations

import pytest

from linkctl import doctor
from linkctl.core.checks import Check, Verdict
from linkctl.core.profile import load_profile
from linkctl.net import link
from linkctl.net.netstate import LinkFacts, Route
from linkctl.net.nic_checks import nic_checks
from linkctl.probe.nic import check_nic
from linkctl.probe.report import ProbeReport
from support.netfacts import nic_facts

PROF = load_profile("dgx-mac")[0]
HOST = PROF.host("mac")


class FactsBackend:
    os_name = "macos"

    def __init__(self, facts: LinkFacts):
        self.facts = facts

    def link_facts(self, ifname: str) -> LinkFacts:
        return self.facts

    def default_route(self) -> Route:
        return Route("0.0.0.0/0", "10.0.0.1", "en1")


# facts -> {check: verdict} that all three must show (status as drift severity).
CASES = {
    "as profiled": ({}, {"speed": "PASS", "duplex": "PASS", "mtu": "PASS", "address": "PASS"}),
    "1 Gbit/s": ({"speed_mbps": 1000}, {"speed": "WARN"}),
    "speed unknown": ({"speed_mbps": None}, {"speed": "WARN"}),
    "half duplex": ({"duplex": "half"}, {"duplex": "FAIL"}),
    "wrong mtu": ({"mtu": 1500}, {"mtu": "FAIL"}),
    "extra address": ({"addresses": ("192.168.100.1/24", "10.9.9.9/8")}, {"address": "WARN"}),
    "no address": ({"addresses": ()}, {"address": "FAIL"}),
    "no carrier": ({"carrier": False}, {"interface": "FAIL"}),
    "down": ({"up": False, "carrier": False}, {"interface": "FAIL"}),
}
DRIFT = {"speed": "speed_mbps", "duplex": "duplex", "mtu": "mtu", "address": "address"}


@pytest.mark.parametrize("case", list(CASES))
def test_status_probe_and_doctor_agree(case):
    change, want = CASES[case]
    facts = nic_facts(**change)  # en0 as profiled, 10 Gbit/s full duplex, then the change
    backend = FactsBackend(facts)
    shared = nic_checks(facts, HOST, PROF.link)
    assert all(type(c) is Check and type(c.verdict) is Verdict for c in shared.values())
    assert {n: shared[n].verdict for n in want} == want

    res = doctor.DoctorResult()
    doctor.check_link(res, PROF, HOST, backend)
    assert {n: res.get(n).verdict for n in want} == want

    report = ProbeReport(PROF.name, "mac", "dgx", "192.168.100.2")
    check_nic(report, PROF, HOST, backend)
    probe = {("interface" if c.name == "carrier" else c.name): c.verdict for c in report.checks}
    assert {n: probe[n] for n in want} == want  # the probe stops after a failed interface

    st = link.status(PROF, HOST, backend)
    drift = {d.field: d.severity for d in st.drift}
    for name, verdict in want.items():
        if name == "interface":
            assert drift["carrier"] == "FAIL" and st.ok is False
        elif name == "address" and verdict == "WARN":
            assert drift == {"other_addresses": "WARN"}
        elif verdict == "PASS":
            assert DRIFT[name] not in drift
        else:
            assert drift[DRIFT[name]] == verdict
    # Exit codes follow: status and probe fail exactly when some check FAILs.
    failed = any(c.verdict is Verdict.FAIL for c in shared.values())
    assert st.ok is not failed and (report.exit_code == 1) is failed
