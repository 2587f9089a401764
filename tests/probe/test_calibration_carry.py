"""A host's calibration reaches the other host of the pair: its responder's banner
carries the terms, the peer's probe stores them as that host's record. (End to end,
over real links and both hosts' boot units: tests/lab/test_up_down.py.)"""

from __future__ import annotations

import json

import pytest

from linkctl.core.records import (
    CalibrationFile,
    CalibrationRecord,
    calibration_of,
    calibration_path,
    dump,
)
from linkctl.probe.latency import ResponderUnavailable, banner_info
from linkctl.probe.report import ProbeReport, carry_calibration, save
from linkctl.probe.responder import Responder

DGX = CalibrationRecord.model_validate(
    {
        "host": "dgx",
        "measured_at": "2026-12-05T08:00:00Z",
        "build": "version: 7948 (b828e18c7)",
        "layer_us": 12.5,
        "effective_bandwidth_gbs": 180.0,
        "runs": [{"predicted_per_second": 40.0}],  # raw runs: not for the peer
    }
)


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("LINKCTL_STATE_DIR", str(tmp_path))
    return tmp_path


def banner_of(record: CalibrationRecord | None, host: str = "dgx") -> dict:
    r = Responder("198.18.100.2", 50070, 5201, iperf=False, host=host, calibration=lambda: record)
    return json.loads(json.dumps(r.banner()))  # as it crosses the wire


def probed(banner: dict, peer: str = "dgx") -> ProbeReport:
    rep = ProbeReport("dgx-mac", "mac", peer, "198.18.100.2")
    rep.latency.responder = banner_info(banner, peer)
    return rep


def test_banner_carries_the_terms_only():
    b = banner_of(DGX)
    assert b["host"] == "dgx" and b["service"] == "linkctl-responder"
    assert b["calibration"] == {
        "host": "dgx",
        "measured_at": "2026-12-05T08:00:00Z",
        "build": "version: 7948 (b828e18c7)",
        "layer_us": 12.5,
        "effective_bandwidth_gbs": 180.0,
    }
    assert "calibration" not in banner_of(None)


def test_probe_stores_the_peers_calibration_beside_its_own(state):
    mine = CalibrationRecord(host="mac", layer_us=8.0, effective_bandwidth_gbs=600.0)
    calibration_path().write_text(dump(CalibrationFile(hosts={"mac": mine})))
    rep = probed(banner_of(DGX))
    save(rep)
    kept = json.loads(calibration_path().read_text())["hosts"]
    assert set(kept) == {"mac", "dgx"}
    assert kept["mac"]["effective_bandwidth_gbs"] == 600.0
    assert calibration_of("dgx") == DGX.terms()
    # The same terms again change nothing (the file is not rewritten).
    before = calibration_path().stat().st_mtime_ns
    assert carry_calibration(rep) is None
    assert calibration_path().stat().st_mtime_ns == before


def test_a_banner_naming_another_host_is_not_stored(state):
    carry_calibration(probed(banner_of(DGX, host="dgx2")))
    assert not calibration_path().exists()


def test_a_calibration_this_linkctl_cannot_read_is_dropped_not_fatal(state):
    b = banner_of(DGX)
    b["calibration"] = {"layer_us": "fast"}
    info = banner_info(b, "dgx")
    assert info.calibration is None and info.host == "dgx"
    with pytest.raises(ResponderUnavailable, match="banner this linkctl cannot read"):
        banner_info({**b, "port": "x"}, "dgx")
