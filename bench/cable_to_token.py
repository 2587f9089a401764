#!/usr/bin/env python3
"""bench/cable_to_token: from a plugged cable to the first token, in the lab.

Run as root from the repo, once llama.cpp is built (scripts/build-llama.sh):

    .venv/bin/python bench/cable_to_token.py [--rounds 2]

Two booted containers (systemd as PID 1, the boot harness of tests/lab) on the dgx-mac
lab's namespaces, with no profile of their own and no address on the cable; then, as
their owner would type it:
  plug     both ends of the cable up (what a plugged port with a carrier does)
  pair     `linkctl pair --yes --head mac --model M` on both at once: discovery over
           IPv6 link-local, agreement, the profile written, setup and probe
  up       `linkctl up --profile cable` on both at once: calibration (none yet),
           the boot units, the probe gate, serve
  token    the first completion through the head's llama-server
The time of each stage, the total, and the target beside it (3 minutes, issue 27).
The head is named (--head mac): both containers share one machine's memory, and the
lab binds the model into the mac container. Lab traffic stays on 198.18.0.0/15.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the boot harness's helpers (support.boot_kit)

from linkctl.core.profile import load_profile  # noqa: E402
from linkctl.gguf.tiny import TinySpec, write_tiny_llama  # noqa: E402
from linkctl.lab import boot, rootfs  # noqa: E402
from linkctl.lab.rootfs import VENV  # noqa: E402
from support import boot_kit as kit  # noqa: E402

TARGET_S = 180.0
SUBNET = "198.18.100.0/30"
NAME = "cable"


def both(bl: boot.BootLab, args: dict[str, list[str]], timeout: float) -> dict:
    with ThreadPoolExecutor(2) as ex:
        futs = {
            h: ex.submit(
                bl.containers[h].exec,
                [f"{VENV}/bin/linkctl", *a],
                check=False,
                timeout=timeout,
            )
            for h, a in args.items()
        }
        out = {h: f.result() for h, f in futs.items()}
    for h, r in out.items():
        if r.returncode != 0:
            raise SystemExit(f"{h}: `linkctl {' '.join(args[h])}` exited {r.returncode}:\n"
                             f"{r.stderr[-3000:]}")  # fmt: skip
    return out


def one_round(image: rootfs.Image, model: Path) -> dict[str, float]:
    profile, _ = load_profile("dgx-mac")
    llama = boot.llama_dir()
    if llama is None:
        raise SystemExit("llama.cpp is not built: bash scripts/build-llama.sh")
    times: dict[str, float] = {}
    bl = boot.BootLab(profile, "c" + uuid.uuid4().hex[:7], image, llama, model, log=lambda _m: None)
    with bl:  # boots both containers; removes everything at the end
        for c in bl.containers.values():
            kit.settled(c)
        t0 = time.monotonic()
        for h in profile.hosts:
            bl.containers[h.name].exec(["ip", "link", "set", h.interface, "up"])
        times["plug"] = time.monotonic() - t0
        t = time.monotonic()
        model_in = f"{boot.MODEL_DIR}/{model.name}"
        pair = ["pair", "--yes", "--subnet", SUBNET, "--name", NAME, "--head", "mac",
                "--model", model_in]  # fmt: skip
        both(bl, {h: [*pair, "--host", h] for h in bl.containers}, 300)
        times["pair"] = time.monotonic() - t
        t = time.monotonic()
        both(bl, {h: ["up", "--profile", NAME, "--host", h] for h in bl.containers}, 600)
        times["up"] = time.monotonic() - t
        t = time.monotonic()
        port = profile.serve.port
        kit.wait_for(
            lambda: kit.completion(bl.containers["mac"], port), 120, "the first completion", 0.2
        )
        times["token"] = time.monotonic() - t
        times["total"] = time.monotonic() - t0
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (namespaces, containers): sudo .venv/bin/python ...")
    t = time.monotonic()
    image = rootfs.prepare()
    print(f"image ready in {time.monotonic() - t:.1f} s (cached after the first run)")
    d = Path(tempfile.mkdtemp(prefix="linkctl-bench-model-"))
    model = d / "tiny.gguf"
    write_tiny_llama(model, TinySpec(n_layer=4, n_embd=128, n_ff=256))
    os.chmod(d, 0o755)
    os.chmod(model, 0o644)
    rounds = []
    try:
        for i in range(a.rounds):
            r = one_round(image, model)
            rounds.append(r)
            print(f"round {i + 1}: " + ", ".join(f"{k} {v:.1f} s" for k, v in r.items()))
    finally:
        image.discard()
    print(f"\n{'stage':8} {'median s':>9} {'min-max s':>13}")
    for k in rounds[0]:
        xs = [r[k] for r in rounds]
        print(f"{k:8} {statistics.median(xs):9.1f} {min(xs):6.1f}-{max(xs):<6.1f}")
    med = statistics.median(r["total"] for r in rounds)
    verdict = "within" if med <= TARGET_S else "over"
    print(
        f"\ncable to first token: {med:.1f} s median vs target {TARGET_S:.0f} s: "
        f"ratio {med / TARGET_S:.2f} ({verdict} the target)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
