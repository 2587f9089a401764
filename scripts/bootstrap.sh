#!/usr/bin/env bash
# One entry point for a fresh Debian/Ubuntu machine, run as root from a clean clone:
#
#   bash scripts/bootstrap.sh demo    install everything, then run `linkctl lab demo`
#   bash scripts/bootstrap.sh test    install everything, then run the whole test suite
#   bash scripts/bootstrap.sh install install only
#
# Installs the Debian packages, a virtualenv in .venv with linkctl and its PyPI
# dependencies, and builds llama.cpp's ggml-rpc-server + llama-server (cached by
# version under /var/cache/linkctl, so only the first run pays for the build).
set -euo pipefail

mode="${1:-install}"
shift || true
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

if [ "$(id -u)" != 0 ]; then
  echo "bootstrap: run as root (network namespaces, packages): sudo bash scripts/bootstrap.sh $mode" >&2
  exit 2
fi

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
apt_install() {
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# iperf3/sockperf: probe and its benchmark; iproute2: the lab's `ip netns exec`;
# cmake/g++: the llama.cpp build; systemd: systemd-analyze for the unit tests.
# systemd-container (systemd-nspawn) + mmdebstrap: tests/test_boot.py boots the hosts as
# containers with systemd as PID 1 (without recommends: libnss-mymachines would edit
# /etc/nsswitch.conf, and nothing here needs it).
apt_pkgs=(python3 python3-venv python3-pip iperf3 sockperf iproute2 iputils-ping cmake g++ make
  systemd ca-certificates curl systemd-container mmdebstrap)
missing=()
for p in "${apt_pkgs[@]}"; do
  installed "$p" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "bootstrap: apt-get install ${missing[*]}" >&2
  apt_install "${missing[@]}"
fi

# network-manager: the tests run a private NetworkManager inside a lab namespace (on
# its own D-Bus bus). Installed here without starting or enabling its service, so it
# never takes over this machine's network; skipped where it is already installed.
if ! installed network-manager; then
  echo "bootstrap: apt-get install network-manager (service neither started nor enabled)" >&2
  own_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    own_policy=1
  fi
  apt_install network-manager || rc=$?
  [ "$own_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
  [ "${rc:-0}" = 0 ] || exit "$rc"
  if command -v systemctl >/dev/null; then
    systemctl disable NetworkManager.service NetworkManager-wait-online.service \
      NetworkManager-dispatcher.service >/dev/null 2>&1 || true
  fi
fi

py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'

# The CPU build: the lab and the tests run it (CUDA and Metal are for the real hosts).
bin="$(PYTHON=.venv/bin/python bash scripts/build-llama.sh --backend cpu)"
export LINKCTL_LLAMA_BIN="$bin"
export PATH="$repo/.venv/bin:$PATH"

case "$mode" in
  install) echo "bootstrap: installed; llama.cpp binaries in $bin" ;;
  demo) exec .venv/bin/linkctl lab demo "$@" ;;
  test) exec .venv/bin/python -m pytest -ra -q "$@" ;;
  *) echo "bootstrap: unknown mode '$mode' (use demo, test or install)" >&2; exit 2 ;;
esac
