"""linkctl.serve.leftends.LeftEnds's bookkeeping, without a network: which ends it keeps,
hands on to serve's status and reads back from it, and which errors make it send
anything (the SYN itself: tests/net/test_halfopen.py, the pair:
tests/serve/test_outage.py)."""

from __future__ import annotations

from linkctl.core.errors import ConnectionRefused, InputError, RpcProtocolMismatch
from linkctl.serve.leftends import KEEP, LeftEnds

EP = "198.18.100.2:50052"


def test_it_keeps_the_newest_ends_per_endpoint_once_each():
    left = LeftEnds()
    for port in range(40000, 40000 + KEEP + 2):
        left.seen(f"198.18.100.1:{port}", EP)
        left.seen(f"198.18.100.1:{port}", EP)  # every health poll sees it again
    left.seen("198.18.100.1:41000", "198.18.100.3:50052")
    assert left._ends[EP] == [f"198.18.100.1:{p}" for p in range(40002, 40000 + KEEP + 2)]
    assert left._ends["198.18.100.3:50052"] == ["198.18.100.1:41000"]


def test_only_a_busy_or_silent_endpoint_sends_anything():
    left = LeftEnds()
    left.seen("198.18.100.1:40000", EP)
    refused = ConnectionRefused("connection refused", "start it", host="198.18.100.2", port=50052)
    mismatch = RpcProtocolMismatch("another protocol", "build one release", local=(3, 0, 0),
                                   remote=(2, 0, 0))  # fmt: skip
    for e in (refused, mismatch, InputError("bad", "fix")):
        assert left.reset(e) == []  # nothing listens, or not ours to free: nothing sent
    assert left._ends[EP] == ["198.18.100.1:40000"]


def test_a_repeat_of_the_same_syns_is_not_news():
    left = LeftEnds()
    a, b = ["198.18.100.1:40000 -> " + EP], ["198.18.100.1:40001 -> " + EP]
    assert left.news(a) and not left.news(a) and left.news(b) and left.news(a)


def test_kept_ends_come_back_trimmed_and_changes_are_handed_on():
    kept = {EP: [f"198.18.100.1:{p}" for p in range(40000, 40000 + KEEP + 1)]}
    left = LeftEnds(kept)
    assert left.ends() == {EP: kept[EP][-KEEP:]}
    handed: list[dict] = []
    left.on_change = handed.append
    left.seen(kept[EP][-1], EP)  # already kept: nothing new to keep
    assert handed == []
    left.seen("198.18.100.1:41000", EP)
    assert handed == [{EP: [*kept[EP][-KEEP + 1 :], "198.18.100.1:41000"]}]


def test_the_last_serves_ends_are_read_for_this_profiles_endpoints_only(tmp_path):
    from linkctl.core.records import ServeStatus, dump
    from linkctl.serve.run import _kept_ends

    path = tmp_path / "head.json"
    assert _kept_ends(path, [EP]) == {}  # no status yet
    st = ServeStatus(name="llama-server", pid=1, argv=[])
    st.rpc_ends = {EP: ["198.18.100.1:40000"], "198.18.100.9:50052": ["198.18.100.1:40001"]}
    path.write_text(dump(st, exclude_unset=False))
    assert _kept_ends(path, [EP]) == {EP: ["198.18.100.1:40000"]}
    path.write_text("{not json")
    assert _kept_ends(path, [EP]) == {}  # unreadable: nothing kept, serve goes on


def test_a_hand_edited_end_is_left_alone_not_a_crash():
    from linkctl.llama.rpc import RpcBusy

    left = LeftEnds({EP: ["not-an-end", "198.18.100.1:99999"]})
    busy = RpcBusy("accepted, no HELLO", endpoint=EP)
    assert left.reset(busy) == []  # neither can be bound: nothing sent, nothing raised
