"""llama-server's API beyond loopback and the link: serve needs an API key file (mode
0600, passed as --api-key-file) or an explicit serve.allow_unauthenticated; doctor says
which. In the lab, the real llama-server refuses a request without the key (401) and
answers one with it."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tomli_w

from linkctl import doctor
from linkctl.core.errors import InputError
from linkctl.core.profile import parse_profile
from linkctl.llama.bins import LlamaBins
from linkctl.serve import auth as sa
from linkctl.serve import plan as sv
from support.cli import error_lines, linkctl
from support.llama_util import need_llama
from support.paths import PROFILES
from support.serve_lab import Serve
from support.service_kit import LINKCTL, LLAMA, make_target

BASE = tomllib.loads((PROFILES / "dgx-mac.toml").read_text())
KEY = "k3y-0f-the-test-" + "a" * 16
BINS = LlamaBins(None, None, [])


def profile(**serve):
    data = json.loads(json.dumps(BASE))
    data["serve"] |= serve
    return parse_profile(data)


def key_file(tmp_path: Path, text: str = f"# the head's key\n{KEY}\n", mode: int = 0o600) -> str:
    p = tmp_path / "api-keys"
    p.write_text(text)
    p.chmod(mode)
    return str(p)


# ---- the rule -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host,exposure", [("127.0.0.1", "loopback"), ("192.168.100.1", "link")]
)  # 192.168.100.1 is the head's link address in dgx-mac
def test_loopback_and_the_link_need_no_key(host, exposure):
    auth = sa.serve_auth(profile(host=host))
    assert (auth.exposure, auth.mode) == (exposure, "not-needed")
    plan = sv.build_plan(profile(host=host), profile().head, BINS, model="/m.gguf")
    assert "--api-key-file" not in plan.head.argv() and plan.auth.mode == "not-needed"


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.68.50"])  # everywhere; the Wi-Fi LAN
def test_beyond_the_link_without_a_key_is_refused(host):
    prof = profile(host=host)
    with pytest.raises(InputError) as e:
        sv.build_plan(prof, prof.head, BINS, model="/m.gguf")
    assert e.value.exit_code == 2
    assert f"serve.host = {host!r}" in e.value.message
    assert "serve.api_key_file" in e.value.fix and "allow_unauthenticated" in e.value.fix
    # The rpc host's plan does not depend on the head's API.
    assert sv.build_plan(prof, prof.host("dgx"), BINS).auth is None


def test_explicit_opt_out_serves_open_and_says_so():
    prof = profile(host="0.0.0.0", allow_unauthenticated=True)
    plan = sv.build_plan(prof, prof.head, BINS, model="/m.gguf")
    assert plan.auth.mode == "unauthenticated" and "--api-key-file" not in plan.head.argv()
    assert any("WITHOUT authentication" in n for n in plan.notes)


def test_a_key_file_is_passed_as_api_key_file(tmp_path):
    path = key_file(tmp_path)
    prof = profile(host="0.0.0.0", api_key_file=path)
    plan = sv.build_plan(prof, prof.head, BINS, model="/m.gguf")
    i = plan.head.argv().index("--api-key-file")
    assert plan.head.argv()[i + 1] == path
    assert plan.auth == sa.ServeAuth("exposed", "api-key", path, 1)


@pytest.mark.parametrize(
    "text,mode,want",
    [
        (None, 0o600, "no such file"),
        (f"{KEY}\n", 0o644, "mode 0644 lets group or others"),
        (f"{KEY}\n", 0o640, "mode 0640"),
        (f"{KEY}\n", 0o602, "mode 0602"),
        ("# only a comment\n\n", 0o600, "holds no key"),
        ("", 0o600, "holds no key"),
        (f"{KEY}\r\n", 0o600, "line 1 has leading or trailing whitespace"),
        (f"# c\n {KEY}\n", 0o600, "line 2 has leading or trailing whitespace"),
    ],
)
def test_bad_key_files_are_refused(tmp_path, text, mode, want):
    path = str(tmp_path / "missing") if text is None else key_file(tmp_path, text, mode)
    prof = profile(host="0.0.0.0", api_key_file=path)
    with pytest.raises(InputError) as e:
        sa.serve_auth(prof)
    assert e.value.exit_code == 2 and want in e.value.message, e.value.message
    assert e.value.message.startswith(f"serve.api_key_file = {path!r}")


def test_a_directory_is_not_a_key_file(tmp_path):
    with pytest.raises(InputError, match="not a regular file"):
        sa.read_api_keys(str(tmp_path))


def test_relative_key_file_path_is_a_profile_error():
    with pytest.raises(InputError) as e:
        profile(api_key_file="keys.txt")
    assert "serve.api_key_file = 'keys.txt'" in e.value.message
    assert "absolute path" in e.value.message


def test_serve_refuses_from_the_cli_and_starts_nothing(tmp_path):
    data = json.loads(json.dumps(BASE))
    data["serve"]["host"] = "0.0.0.0"
    p = tmp_path / "open.toml"
    p.write_text(tomli_w.dumps(data))
    before = sorted(tmp_path.rglob("*"))
    for extra in (["--dry-run"], []):
        r = linkctl("serve", "--profile", str(p), "--host", "mac", *extra)
        assert r.returncode == 2, r.stderr
        err = r.stderr.strip()
        assert len(error_lines(err)) == 1 and "Traceback" not in err
        assert "serve.host = '0.0.0.0'" in err and "serve.api_key_file" in err
    assert sorted(tmp_path.rglob("*")) == before


# ---- doctor -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "serve,verdict,value",
    [
        ({}, "PASS", "not-needed"),
        ({"host": "0.0.0.0"}, "FAIL", None),
        ({"host": "0.0.0.0", "allow_unauthenticated": True}, "WARN", "unauthenticated"),
        ({"host": "0.0.0.0", "api_key_file": "KEYS"}, "PASS", "api-key"),
        ({"host": "0.0.0.0", "api_key_file": "KEYS644"}, "FAIL", None),
    ],
)
def test_doctor_reports_which(tmp_path, serve, verdict, value):
    good = key_file(tmp_path)
    bad = tmp_path / "keys644"
    bad.write_text(KEY + "\n")
    bad.chmod(0o644)
    subst = {"KEYS": good, "KEYS644": str(bad)}
    serve = {k: subst.get(v, v) if isinstance(v, str) else v for k, v in serve.items()}
    prof = profile(**serve)
    res = doctor.DoctorResult()
    doctor.check_serve_auth(res, prof, prof.head)
    (line,) = res.lines
    assert (line.name, line.verdict, line.value) == ("serve auth", verdict, value)
    assert (line.fix is None) == (verdict == "PASS")
    res = doctor.DoctorResult()
    doctor.check_serve_auth(res, prof, prof.host("dgx"))
    assert res.lines == []  # the rpc host serves no API


# ---- the real llama-server in the lab -----------------------------------------------------

REQUEST = r"""
import json, sys, urllib.error, urllib.request
url, key = sys.argv[1], sys.argv[2]
out = {}
ask = {"prompt": "hi", "n_predict": 4, "ignore_eos": True}
for name, path, headers, body in [
    ("health", "/health", {}, None),
    ("no key", "/completion", {}, ask),
    ("wrong key", "/completion", {"Authorization": "Bearer nope"}, ask),
    ("key", "/completion", {"Authorization": "Bearer " + key}, ask),
    ("x-api-key", "/v1/models", {"X-Api-Key": key}, None),
]:
    data = json.dumps(body).encode() if body else None
    req = urllib.request.Request(url + path, data, {"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            out[name] = [r.status, json.loads(r.read() or b"{}")]
    except urllib.error.HTTPError as e:
        out[name] = [e.code, json.loads(e.read() or b"{}")]
print(json.dumps(out))
"""


@pytest.mark.netns
@pytest.mark.llama
def test_real_llama_server_refuses_without_the_key_and_answers_with_it(make_lab, tmp_path):
    need_llama()
    lab = make_lab("dgx-mac")
    from linkctl.gguf.tiny import TinySpec, write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny.gguf", TinySpec(n_layer=2, n_embd=64, n_ff=128))
    for h in ("dgx", "mac"):
        r = lab.run(h, "setup")
        assert r.returncode == 0, r.stderr
    data = tomllib.loads(Path(lab.profile_path).read_text())
    keys = key_file(tmp_path)
    data["serve"] |= {"ctx": 256, "host": "0.0.0.0", "api_key_file": keys}
    prof = tmp_path / "exposed.toml"
    prof.write_text(tomli_w.dumps(data))
    head_ip = lab.host("mac")["address"].split("/")[0]

    rpc = Serve(lab, "dgx", "rpc", ["--profile", str(prof)], tmp_path / "dgx.log")
    head = None
    try:
        rpc.wait(lambda s: s["state"] == "ready", 60, "rpc-server ready")
        args = ["--profile", str(prof), "--model", model["path"], "--skip-probe"]
        head = Serve(lab, "mac", "head", [*args, "--split", "llama"], tmp_path / "mac.log")
        head.wait(lambda s: s["state"] == "ready", 120, "llama-server ready")
        # From the rpc host, over the link, to the head's 0.0.0.0 listener.
        r = lab.exec("dgx", sys.executable, "-c", REQUEST, f"http://{head_ip}:9999", KEY)
        assert r.returncode == 0, r.stderr[-2000:]
        got = json.loads(r.stdout)
    finally:
        if head:
            head.stop()
        rpc.stop()
    assert got["health"][0] == 200  # public in llama.cpp (tools/server/server-http.cpp)
    for refused in ("no key", "wrong key"):
        assert got[refused][0] == 401, got
        assert got[refused][1]["error"]["type"] == "authentication_error"
    assert got["key"][0] == 200 and got["key"][1]["tokens_predicted"] == 4, got
    assert got["x-api-key"][0] == 200, got


# ---- boot services ------------------------------------------------------------------------


def _install(root: Path, prof: Path, host: str) -> subprocess.CompletedProcess:
    return linkctl(
        "service", "install", "--profile", str(prof), "--host", host, "--root", str(root),
        "--linkctl-bin", LINKCTL, "--llama-bin-dir", LLAMA, "--json",
    )  # fmt: skip


@pytest.mark.parametrize("head_os", ["macos", "linux"])
def test_service_install_refuses_an_open_api_and_reads_the_key_in_the_root(tmp_path, head_os):
    """The serve service would refuse at every boot: install refuses first (exit 2,
    nothing written), and checks the key file where the target will have it."""
    data = json.loads(json.dumps(BASE))
    data["serve"]["host"] = "0.0.0.0"
    for h in data["hosts"]:
        if h["role"] == "head":
            h["os"] = head_os
    prof = tmp_path / "open.toml"
    prof.write_text(tomli_w.dumps(data))
    root = make_target(tmp_path / "root")
    before = sorted(root.rglob("*"))
    r = _install(root, prof, "mac")
    assert r.returncode == 2 and "serve.api_key_file" in r.stderr, r.stderr
    assert sorted(root.rglob("*")) == before
    # A key file named in the profile is looked for inside the root, mode checked there.
    data["serve"]["api_key_file"] = "/etc/linkctl/llama-api-keys"
    prof.write_text(tomli_w.dumps(data))
    r = _install(root, prof, "mac")
    assert r.returncode == 2 and f"'/etc/linkctl/llama-api-keys' in {root}: no such" in r.stderr
    keys = root / "etc/linkctl/llama-api-keys"
    keys.parent.mkdir(parents=True)
    keys.write_text(KEY + "\n")
    keys.chmod(0o644)
    r = _install(root, prof, "mac")
    assert r.returncode == 2 and "mode 0644" in r.stderr
    keys.chmod(0o600)
    r = _install(root, prof, "mac")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    if head_os == "linux":  # DynamicUser could not read a 0600 file
        assert res["serve_user"] == "root"
        assert any("llama-server reads /etc/linkctl/llama-api-keys" in n for n in res["notes"])


# ---- serve.mode = "disaggregated": route listens on serve.host -----------------------------


def test_disaggregated_mode_follows_the_same_rule(tmp_path):
    from linkctl.disagg import plan as disagg

    keys = key_file(tmp_path)
    prof = profile(mode="disaggregated", host="0.0.0.0", api_key_file=keys)
    plan = disagg.build_plan(prof, prof.head, "llama-server", "/m.gguf")
    # The decode server checks the users' keys; the prefill server only the key derived
    # from the pair secret (linkctl.disagg.plan.prefill_key_path), which route alone sends.
    argv = plan.decode.argv()
    assert argv[argv.index("--api-key-file") + 1] == keys
    argv = plan.prefill.argv()
    assert argv[argv.index("--api-key-file") + 1].endswith("/serve/prefill-api-key")
    data = json.loads(json.dumps(BASE))
    data["serve"] |= {"mode": "disaggregated", "host": "0.0.0.0"}
    p = tmp_path / "open.toml"
    p.write_text(tomli_w.dumps(data))
    r = linkctl("serve", "--profile", str(p), "--host", "mac", "--dry-run")
    assert r.returncode == 2 and "serve.api_key_file" in r.stderr, r.stderr
    # The prefill host checks the key file its llama-server will read.
    data["serve"]["api_key_file"] = str(tmp_path / "missing")
    p.write_text(tomli_w.dumps(data))
    r = linkctl("serve", "--profile", str(p), "--host", "dgx", "--dry-run")
    assert r.returncode == 2 and "no such file" in r.stderr, r.stderr
