"""linkctl verify: the comparison and placement logic, then the real llama.cpp pair in the
lab (rpc-server in dgx's namespace, llama-server on the head): a clean split passes, a
split whose weights or activations are corrupted in transit fails, and a profile in
which the model does not fit the head compares against another split."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from linkctl.llama.invocation import ServerInvocation
from linkctl.serve.logprobs import TOLERANCES, Step, compare, parse_probs, position_diff
from linkctl.serve.placement import Device, another_split, model_buffers, parse_list_devices

SAME, MIXED = TOLERANCES["same"], TOLERANCES["mixed"]


def steps(tokens, shift=0.0, n=24):
    """A greedy run: token t chosen with logprob -0.5, runners-up below it."""
    out = []
    for i in range(n):
        t = tokens[i] if i < len(tokens) else 7
        top = {t: -0.5 + shift, 100 + i: -1.5 + shift, 200 + i: -2.0}
        out.append(Step(t, -0.5 + shift, top, chr(65 + t % 26)))
    return out


def test_identical_runs_pass_at_zero():
    ref = steps(list(range(24)))
    r = compare("p", ref, steps(list(range(24))), SAME)
    assert r.verdict == "PASS" and r.max_logprob_diff == 0 and r.first_divergence is None
    assert r.agreed == r.compared == 24


def test_same_backends_fail_on_small_logprob_noise_that_mixed_backends_accept():
    ref, got = steps(list(range(24))), steps(list(range(24)), shift=0.03)
    assert compare("p", ref, got, SAME).verdict == "FAIL"
    r = compare("p", ref, got, MIXED)
    assert r.verdict == "WARN" and math.isclose(r.max_logprob_diff, 0.03, abs_tol=1e-9)
    assert compare("p", ref, steps(list(range(24)), shift=0.005), MIXED).verdict == "PASS"
    assert compare("p", ref, steps(list(range(24)), shift=0.2), MIXED).verdict == "FAIL"


def test_token_divergence_early_fails_late_only_warns_for_mixed():
    ref = steps(list(range(24)))
    early = compare("p", ref, steps([*range(3), 99, *range(4, 24)]), MIXED)
    assert early.verdict == "FAIL" and early.first_divergence == 3 and early.compared == 4
    assert "reference token 3" in early.detail and "split token 99" in early.detail
    # A near tie at position 20 the two backends break differently.
    ref[20] = Step(20, -0.70, {20: -0.70, 120: -0.71, 220: -2.0})
    got = steps(list(range(24)))
    got[20] = Step(120, -0.70, {120: -0.70, 20: -0.705, 220: -2.0})
    late = compare("p", ref, got, MIXED)
    assert late.verdict == "WARN" and late.first_divergence == 20, late.detail
    assert compare("p", ref, got, SAME).verdict == "FAIL"
    # A late divergence far outside the noise bound is still a FAIL.
    assert compare("p", ref, steps([*range(20), 99, *range(21, 24)]), MIXED).verdict == "FAIL"


def test_non_finite_and_short_runs_fail():
    ref = steps(list(range(24)))
    got = steps(list(range(24)))
    got[5] = Step(5, math.nan, {5: math.nan})
    r = compare("p", ref, got, MIXED)
    assert (
        r.verdict == "FAIL" and "non-finite" in r.detail and r.as_dict()["max_logprob_diff"] is None
    )
    assert compare("p", ref, steps(list(range(10)), n=10), MIXED).verdict == "FAIL"


def test_position_diff_bounds_tokens_missing_from_the_other_top_k():
    a = Step(1, -0.1, {1: -0.1, 2: -1.0, 3: -2.0})
    b = Step(1, -0.1, {1: -0.1, 2: -1.0, 4: -1.2})  # token 3 fell out, 4 came in
    # 4 is at -1.2 in b and at most -2.0 (a's floor) in a: at least 0.8 apart
    assert math.isclose(position_diff(a, b), 0.8)
    assert position_diff(a, a) == 0


def test_parse_probs_reads_llama_server_shape_and_nulls():
    body = {
        "content": "ab",
        "completion_probabilities": [
            {
                "id": 68,
                "token": "a",
                "bytes": [97],
                "logprob": -0.25,
                "top_logprobs": [{"id": 68, "token": "a", "bytes": [97], "logprob": -0.25}],
            },
            {"id": 69, "token": "b", "logprob": None, "top_logprobs": []},
            {"id": 70, "token": "c", "logprob": -3.4028234663852886e38, "top_logprobs": []},
        ],
    }
    s = parse_probs(body)
    assert s[0].token == 68 and s[0].top == {68: -0.25} and s[0].text == "a"
    assert math.isnan(s[1].logprob)
    assert s[2].logprob == -math.inf  # log(0) arrives as the lowest float
    from linkctl.core.errors import CheckFailed

    with pytest.raises(CheckFailed, match="without completion_probabilities"):
        parse_probs({"content": "x"})


def test_list_devices_and_model_buffers_parsing():
    text = (
        "Available devices:\n  RPC0: 198.18.100.2:50052 (23975 MiB, 20000 MiB free)\n"
        "  Metal: Apple M2 Ultra (196608 MiB, 180000 MiB free)\n"
    )
    d = parse_list_devices(text)
    assert [x.name for x in d] == ["RPC0", "Metal"] and d[1].free_mib == 180000
    log = (
        "load_tensors:   CPU_Mapped model buffer size =     0.13 MiB\n"
        "load_tensors: RPC0[198.18.100.2:50052] model buffer size =     4.85 MiB\n"
    )
    assert model_buffers(log) == {"CPU_Mapped": 0.13, "RPC0[198.18.100.2:50052]": 4.85}


def test_another_split_moves_layers_and_says_where():
    base = ServerInvocation("llama-server", "m.gguf", rpc=("h:1",), ngl=99)
    # One split device (CPU-only head): the boundary moves by -ngl.
    inv, ref, split = another_split(base, 6, [Device("RPC0", "h:1", 1000)])
    assert inv.ngl == 4 and inv.changed(ngl=99) == base
    assert split == "slots 0-6 on RPC0 (slot 6 = output layer)"
    assert ref == "slots 0-2 on head CPU, slots 3-6 on RPC0 (slot 6 = output layer)"
    # Two split devices: a different -ts.
    devs = [Device("RPC0", "h:1", 1000), Device("Metal", "M2", 1000)]
    inv, ref, split = another_split(base, 6, devs)
    assert inv.tensor_split and inv.changed(tensor_split=None) == base and ref != split
    from linkctl.core.errors import InputError

    with pytest.raises(InputError, match="no layer on a split device"):
        another_split(base.changed(ngl=0), 6, devs)


def test_bad_input_exits_2_and_writes_nothing(tmp_path):
    import os

    from support.cli import linkctl

    env = dict(os.environ, LINKCTL_STATE_DIR=str(tmp_path / "state"))
    r = linkctl("verify", "--host", "mac", "--reference", "nope", "--dry-run", env=env)
    assert r.returncode == 2 and "--reference 'nope'" in r.stderr, r.stderr
    r = linkctl("verify", "--host", "dgx", env=env)
    assert r.returncode == 2 and "verify runs on the head (mac)" in r.stderr, r.stderr
    r = linkctl("verify", "--host", "mac", "--model", str(tmp_path / "no.gguf"), env=env)
    assert r.returncode == 2 and "no such file" in r.stderr, r.stderr
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").rglob("*.gguf"))


# ---- the real pair in the lab ----------------------------------------------------------

PROXY_PORT = 50053


def _proxy(lab, ip: str, stats: Path, *corrupt: str) -> subprocess.Popen:
    """The delay proxy (no delay) in dgx's namespace, in front of its rpc-server."""
    p = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            lab.netns("dgx"),
            sys.executable,
            "-m",
            "linkctl.lab.delayproxy",
            "--listen",
            f"{ip}:{PROXY_PORT}",
            "--target",
            f"{ip}:50052",
            "--stats-file",
            str(stats),
            *corrupt,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with_ns = ["ip", "netns", "exec", lab.netns("mac")]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # listening, seen from the head
        r = subprocess.run(
            [*with_ns, sys.executable, "-c", _PORT_OPEN, ip, str(PROXY_PORT)],
            capture_output=True,
        )
        if r.returncode == 0:
            return p
        time.sleep(0.2)
    p.kill()
    raise AssertionError(f"proxy not listening: {p.stderr.read() if p.stderr else ''}")


_PORT_OPEN = (
    "import socket, sys; s = socket.socket(); s.settimeout(0.5); "
    "sys.exit(s.connect_ex((sys.argv[1], int(sys.argv[2]))))"
)


def _stop(p: subprocess.Popen) -> dict:
    p.terminate()
    out, _ = p.communicate(timeout=15)
    return json.loads(out.strip().splitlines()[-1])


def _rpc_serving(lab, rpc_srv, ip: str, timeout: float = 60.0) -> None:
    """Wait until rpc-server answers HELLO from the head: a client that went away can take
    it down (the supervisor restarts it, printed here), and the next step needs it serving."""
    probe = f"from linkctl.llama import rpc; rpc.hello({ip!r}, 50052, timeout=1.0)"
    deadline = time.monotonic() + timeout
    while (r := lab.exec("mac", sys.executable, "-c", probe)).returncode != 0:
        assert time.monotonic() < deadline, f"rpc-server not serving: {r.stderr[-500:]}"
        time.sleep(0.5)
    st = rpc_srv.status()
    print(f"RPC-SERVER serving: starts {st.get('starts')}, last reason {st.get('last_reason')}")


def _verify(lab, *args: str) -> tuple[int, dict, str]:
    t0 = time.monotonic()
    r = lab.run("mac", "verify", "--json", *args, timeout=600)
    wall = time.monotonic() - t0
    assert r.stdout.strip().startswith("{"), r.stdout[-2000:] + r.stderr[-3000:]
    rep = json.loads(r.stdout)
    print(
        f"\nVERIFY {' '.join(args) or '(default)'}: exit {r.returncode}, {wall:.1f} s wall: "
        f"{rep['summary']}"
    )
    return r.returncode, rep, r.stderr


def _profile(
    lab, tmp_path: Path, name: str, port: int | None = None, head_gb=None, verify=False
) -> str:
    import tomli_w

    data = tomllib.loads(Path(lab.profile_path).read_text())
    # No probe report in this test: llama.cpp's own split, not the estimate's.
    data["serve"]["split"] = "llama"
    if verify:
        data["serve"]["verify"] = True
    for h in data["hosts"]:
        if h["role"] == "rpc" and port:
            h.setdefault("rpc", {})["port"] = port
        if h["role"] == "head" and head_gb:
            h["memory_gb"] = head_gb
    path = tmp_path / f"{name}.toml"
    path.write_text(tomli_w.dumps(data))
    return str(path)


@pytest.mark.netns
@pytest.mark.llama
def test_verify_lab_pair_clean_corrupted_and_split_reference(make_lab, tmp_path):
    from support.llama_util import need_llama
    from support.serve_lab import Serve

    need_llama()
    lab = make_lab("dgx-mac")
    for h in ("dgx", "mac"):
        r = lab.run(h, "setup")
        assert r.returncode == 0, r.stderr
    ip = lab.host("dgx")["address"].split("/")[0]
    rpc_srv = Serve(lab, "dgx", "rpc", [], tmp_path / "dgx.log")
    try:
        rpc_srv.wait(lambda s: s["state"] == "ready", 60, "rpc-server ready")

        base = _profile(lab, tmp_path, "base")
        # Dry run: the plan, nothing started or contacted.
        r = lab.run("mac", "verify", "--profile", base, "--dry-run")
        assert r.returncode == 0 and "reference  head alone" in r.stdout, r.stdout + r.stderr

        # 1. Clean split, the head alone as reference: identical CPU backends agree exactly.
        code, rep, err = _verify(lab, "--profile", base, "--backends", "same")
        assert code == 0 and rep["verdict"] == "PASS", rep["lines"]
        assert rep["reference"]["kind"] == "head alone"
        assert all(p["agreed"] == p["positions"] == 24 for p in rep["prompts"]), rep["prompts"]
        assert max(p["max_logprob_diff"] for p in rep["prompts"]) <= 1e-4
        # The split really put the weights on the rpc-server.
        assert any(k.startswith("RPC0[") for k in rep["split"]["buffers_mib"]), rep["split"]
        assert not any(k.startswith("RPC") for k in rep["reference"]["buffers_mib"])
        assert "reference (head alone): loading the model" in err and "split: prompt 3/3" in err
        # The lab profile makes every device the CPU: the default tolerance is 'same' too.
        code, rep, _ = _verify(lab, "--profile", base)
        assert code == 0 and rep["tolerance"]["name"] == "same", rep["lines"]
        assert rep["backends_why"] == "every host computes on cpu"

        # 2. Weights corrupted on their way to the rpc-server: FAIL.
        via_proxy = _profile(lab, tmp_path, "proxy", port=PROXY_PORT)
        for target, rate in (("weights", "1e-5"), ("get_tensor", "1e-3")):
            stats = tmp_path / f"stats-{target}.json"
            proxy = _proxy(lab, ip, stats, "--corrupt", target, "--corrupt-rate", rate)
            try:
                code, rep, _ = _verify(lab, "--profile", via_proxy)
            finally:
                final = _stop(proxy)
            assert final["corruption"]["bits_flipped"] > 0, final
            assert code == 1 and rep["verdict"] == "FAIL", (target, rep["lines"])
            assert rep["reference"]["kind"] == "head alone"
            print(f"CORRUPT {target} at {rate}/bit: {final['corruption']}")

        # serve --verify on the head refuses a corrupted split before llama-server starts.
        model = rep["model"]
        proxy = _proxy(
            lab, ip, tmp_path / "g.json", "--corrupt", "get_tensor", "--corrupt-rate", "1e-3"
        )
        try:
            r = lab.run(
                "mac", "serve", "--profile", via_proxy, "--skip-probe", "--verify", "--model", model
            )
        finally:
            _stop(proxy)
        assert r.returncode == 1 and "verify failed, not serving" in r.stderr, r.stderr[-3000:]
        assert "supervising" not in r.stderr

        # The same proxy without corruption: PASS (the proxy itself changes nothing).
        stats = tmp_path / "stats-clean.json"
        proxy = _proxy(lab, ip, stats)
        try:
            code, rep, _ = _verify(lab, "--profile", via_proxy)
        finally:
            final = _stop(proxy)
        assert "corruption" not in final and final["rpc_commands"].get("SET_TENSOR", 0) > 0
        assert code == 0 and rep["verdict"] == "PASS", rep["lines"]

        # serve.verify = true in the profile: the head verifies, then serves.
        gated = _profile(lab, tmp_path, "gated", verify=True)
        head = Serve(
            lab,
            "mac",
            "head",
            ["--profile", gated, "--skip-probe", "--model", model],
            tmp_path / "mac.log",
        )
        try:
            head.wait(lambda s: s["state"] == "ready", 120, "llama-server ready after verify")
            assert "verify PASS: top-1 agreement 72/72" in head.text(), head.text()[-3000:]
        finally:
            head.stop()
        _rpc_serving(lab, rpc_srv, ip)

        # 3. The profile makes the model too big for the head: another split is the
        # reference (here: fewer layers offloaded, the rest on the head's CPU).
        small = _profile(lab, tmp_path, "small-head", head_gb=0.01)
        code, rep, _ = _verify(lab, "--profile", small)
        assert code == 0 and rep["verdict"] == "PASS", rep["lines"]
        assert rep["reference"]["kind"] == "split"
        assert "does not fit the head" in rep["reference_why"]
        assert "head CPU" in rep["reference"]["assignment"]
        assert rep["reference"]["assignment"] != rep["split"]["assignment"]
        ref_b, split_b = rep["reference"]["buffers_mib"], rep["split"]["buffers_mib"]
        rpc_key = next(k for k in split_b if k.startswith("RPC0["))
        assert ref_b[rpc_key] < split_b[rpc_key], (ref_b, split_b)
        # ... and it catches corruption too, with both placements behind the proxy.
        small_proxy = _profile(lab, tmp_path, "small-proxy", port=PROXY_PORT, head_gb=0.01)
        proxy = _proxy(
            lab, ip, tmp_path / "s.json", "--corrupt", "get_tensor", "--corrupt-rate", "1e-3"
        )
        try:
            code, rep, _ = _verify(lab, "--profile", small_proxy)
        finally:
            _stop(proxy)
        assert code == 1 and rep["reference"]["kind"] == "split", rep["lines"]
    finally:
        rpc_srv.stop()
