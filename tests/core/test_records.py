"""linkctl.core.records: the typed hand-off records and where they are stored."""

from __future__ import annotations

import json
import os

import pytest

from linkctl.core.errors import InputError
from linkctl.core.records import (
    SCHEMA_VERSION,
    CalibrationRecord,
    LatencyPart,
    MtuPart,
    NicPart,
    ProbeRecord,
    RouteStatus,
    ServeStatus,
    ThroughputRun,
    calibration_path,
    dump,
    latest_probe,
    latest_probe_path,
    load_calibrations,
    load_probe,
    load_route_status,
    load_status,
    probe_path,
    save_calibration,
    status_path,
)
from linkctl.probe.latency import stats_us
from linkctl.probe.report import ProbeReport, save


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("LINKCTL_STATE_DIR", str(tmp_path))
    return tmp_path


def _report(peer: str = "dgx", time: str = "2026-01-01T00:00:00+00:00") -> ProbeReport:
    r = ProbeReport("dgx-mac", "mac", peer, "198.18.0.2", time=time)
    r.add("mtu", "PASS", 9000, 9000)
    r.nic = NicPart(speed_mbps=10000, mtu=9000, rx_bytes=5)
    r.mtu = MtuPart(df_ok=True, path_mtu_at_least=9000)
    r.latency = LatencyPart(tcp={"1": stats_us([100, 120, 300]), "32768": stats_us([400, 500])})
    r.throughput = {
        "fwd_p1": ThroughputRun(gbps=9.4, retransmits=3, direction="fwd", streams=1),
        "rev_p1": "skipped: --no-throughput",  # type: ignore[dict-item]  # a reader meets it
    }
    return r


def test_probe_round_trip_keeps_the_json_and_types_it(state):
    r = _report()
    path = save(r)
    assert path == probe_path("dgx-mac", "mac", "dgx")
    on_disk = json.loads(path.read_text())
    # The file holds what `probe --json` prints (to_json), plus nothing lost.
    assert on_disk == json.loads(json.dumps(r.to_json(), default=str))
    assert on_disk["schema_version"] == SCHEMA_VERSION
    rec = load_probe(path)
    assert rec == load_probe(latest_probe_path())
    assert rec.nic.speed_mbps == 10000 and rec.nic.model_extra == {"rx_bytes": 5}
    assert rec.latency.tcp["1"].p50_us == r.latency.tcp["1"].p50_us
    assert rec.latency.smallest() == (r.latency.tcp["1"].p50_us, "tcp 1-byte p50")
    assert rec.first_throughput() == (9.4, "fwd_p1")
    assert rec.throughput["rev_p1"] == "skipped: --no-throughput"
    assert set(rec.runs()) == {"fwd_p1"}
    assert ProbeRecord.model_validate_json(dump(rec)) == rec


def test_probe_file_without_schema_version_reads_as_version_1(state):
    d = _report().to_json()
    del d["schema_version"]
    p = state / "old.json"
    p.write_text(json.dumps(d))
    assert load_probe(p).schema_version == 1


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"schema_version": 99, "profile": "p"}', "schema_version 99, this linkctl reads 1"),
        ('{"latency": {"tcp": []}}', "not a linkctl probe report (latency.tcp: Input should"),
        ("[1, 2]", "not a linkctl probe report (not a JSON object)"),
        ("not json", "is unreadable"),
    ],
)
def test_foreign_probe_file_is_a_one_line_input_error(state, text, words):
    p = state / "x.json"
    p.write_text(text)
    with pytest.raises(InputError) as e:
        load_probe(p)
    assert words in e.value.message and str(p) in e.value.message
    assert "\n" not in e.value.message
    assert e.value.exit_code == 2


def test_latest_probe_picks_newest_for_profile_and_peer(state):
    save(_report("dgx", "2026-01-01T00:00:00+00:00"))
    newer = _report("dgx", "2026-01-02T00:00:00+00:00")
    newer.profile = "dgx-mac"
    newer.host = "other"  # another file name, same profile and peer
    save(newer)
    save(_report("mac2", "2026-01-03T00:00:00+00:00"))
    (state / "probe" / "junk.json").write_text('{"schema_version": 7}')
    t, path, rec = latest_probe("dgx-mac", "dgx")
    assert path.name == "dgx-mac--other--dgx.json" and rec.host == "other"
    assert t == rec.timestamp
    # By address when the peer name differs; none for another profile.
    assert latest_probe("dgx-mac", "renamed", "198.18.0.2") is not None
    assert latest_probe("dgx-mac", "renamed") is None
    assert latest_probe("other-profile", "dgx") is None


def test_calibration_round_trip_and_merge(state):
    save_calibration("dgx", CalibrationRecord(effective_bandwidth_gbs=200.0, layer_us=5.0))
    save_calibration("mac", CalibrationRecord.model_validate({"layer_us": 1.0, "runs": [1]}))
    data = json.loads(calibration_path().read_text())
    assert data["schema_version"] == SCHEMA_VERSION and set(data["hosts"]) == {"dgx", "mac"}
    cals = load_calibrations()
    assert cals["dgx"].effective_bandwidth_gbs == 200.0
    assert cals["mac"].model_extra == {"runs": [1]}
    extra = state / "from-dgx.json"
    extra.write_text(json.dumps({"hosts": {"dgx": {"layer_us": 9.0}}}))
    assert load_calibrations([extra])["dgx"].layer_us == 9.0
    with pytest.raises(InputError, match="no such file"):
        load_calibrations([state / "missing.json"])


def test_foreign_calibration_file_changes_nothing_and_says_so(state):
    p = calibration_path()
    p.write_text('{"schema_version": 2, "hosts": {}}')
    with pytest.raises(InputError, match="schema_version 2, this linkctl reads 1"):
        load_calibrations()
    assert p.read_text() == '{"schema_version": 2, "hosts": {}}'


def test_serve_status_round_trip(state):
    st = ServeStatus(name="llama-server", pid=os.getpid(), argv=["x"], state="ready")
    p = status_path("head")
    assert p == state / "serve" / "head.json"
    assert status_path("rpc", root=state / "h") == state / "h" / "serve" / "rpc.json"
    p.parent.mkdir(parents=True)
    p.write_text(dump(st))
    assert load_status(p) == st
    p.write_text('{"state": "ready"}')
    with pytest.raises(InputError, match="not a linkctl serve status"):
        load_status(p)


UNREADABLE_CALIBRATIONS = [
    ("not json {", "is unreadable"),
    ('{"schema_version": 2, "hosts": {}}', "schema_version 2, this linkctl reads 1"),
    ('{"hosts": {"dgx": [1, 2]}}', "not a linkctl calibration file (hosts.dgx:"),
    ("[1, 2]", "not a linkctl calibration file (not a JSON object)"),
]


def _tree(root) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize(("text", "words"), UNREADABLE_CALIBRATIONS)
def test_save_calibration_refuses_a_file_it_cannot_read_and_changes_nothing(state, text, words):
    p = calibration_path()
    p.write_text(text)
    os.utime(p, ns=(1_000_000_000, 1_000_000_000))  # an mtime a rewrite could not keep
    before = _tree(state)
    with pytest.raises(InputError) as e:
        save_calibration("dgx", CalibrationRecord(layer_us=5.0))
    line = e.value.line()
    assert words in line and str(p) in line and "calibrate will not replace it" in line
    assert f"mv {p} {p}.old" in line and "\n" not in line
    assert e.value.exit_code == 2
    assert _tree(state) == before  # same bytes, same mtime, no temporary file left


def test_calibrate_refuses_before_measuring_and_writes_nothing(state, tmp_path_factory):
    """The CLI, real run and dry run: exit 2, one line naming the file, no servers
    started, no generated model or log written (the state dir is byte-for-byte as it was)."""
    from linkctl.gguf.tiny import TinySpec, write_tiny_llama
    from support.cli import error_lines, linkctl

    model = write_tiny_llama(tmp_path_factory.mktemp("m") / "t.gguf", TinySpec())["path"]
    p = calibration_path()
    p.write_text('{"schema_version": 99, "hosts": {"mac": {}}}')
    os.utime(p, ns=(1_000_000_000, 1_000_000_000))
    before = _tree(state)
    env = {**os.environ, "LINKCTL_STATE_DIR": str(state)}
    for extra in ([], ["--dry-run"], ["--json"]):
        r = linkctl("calibrate", "--host", "dgx", "--model", model, *extra, env=env)
        assert r.returncode == 2, r.stderr
        assert r.stdout == ""
        lines = error_lines(r.stderr)
        assert len(lines) == 1 and str(p) in lines[0] and "schema_version 99" in lines[0]
        assert "move it aside" in lines[0]
        assert _tree(state) == before
        assert sorted(x.name for x in state.iterdir()) == ["calibration.json"]


def test_route_status_round_trip(state):
    p = status_path("route")
    p.parent.mkdir(parents=True, exist_ok=True)
    st = RouteStatus(listen="127.0.0.1:9999", threshold_tokens=512, threshold_source="default")
    p.write_text(dump(st, exclude_unset=False))
    assert json.loads(p.read_text())["state"] == "ready"
    assert load_route_status(p) == st
    p.write_text('{"state": "ready"}')  # no listen address, no threshold
    with pytest.raises(InputError, match="not a linkctl route status"):
        load_route_status(p)
