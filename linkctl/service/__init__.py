"""Boot-time services: systemd units (Linux) and launchd daemons (macOS).

This module is the package's face: callers use ``from linkctl import service as svc``
and the names below. Behind it, one job each:
  render.py       pure: profile + host + paths -> {target path: file text}, from the
                  templates in linkctl/data/systemd/ and linkctl/data/launchd/
  preflight.py    what must exist in the root before anything is written
  install.py      install / uninstall into a root (``/`` is the real system), the manifest
  status.py       what is installed, intact, running
  transaction.py  the file steps, each undone if a later one fails or a signal comes
  base.py         the records (FileAction, UnitStatus) and the ServiceManager interface
  manager.py      manager_for(host): which implementation a host gets
  systemd.py / launchd.py  one module per manager behind that interface

Units, both roles (Linux):
  linkctl-link.service       oneshot: setup, then probe as the gate
  linkctl-responder.service  the probe responder the peer's gate measures against
  linkctl-serve.service      rpc host: rpc-server; head: llama-server (linkctl serve)
Daemons (macOS): com.linkctl.{link,probe,responder,serve}; launchd cannot order
jobs, so each retries (KeepAlive + ThrottleInterval) until what it needs is there.
"""

from __future__ import annotations

from linkctl.service.base import Action, FileAction, ServiceManager, UnitStatus
from linkctl.service.install import (
    BACKUP_SUFFIX,
    MANIFEST,
    ServiceResult,
    install,
    load_manifest,
    render,
    uninstall,
)
from linkctl.service.manager import manager_for
from linkctl.service.preflight import (
    Preflight,
    check_os,
    check_paths,
    default_linkctl_bin,
    default_llama_bin_dir,
    in_root,
    others_can_reach,
)
from linkctl.service.render import (
    DEFAULT_WAIT_CARRIER_S,
    ENV,
    LABEL_PREFIX,
    LAUNCHD_DIR,
    LAUNCHD_JOBS,
    LAUNCHD_LOG_DIR,
    PROFILE_DIR,
    STATE_DIR,
    SYSTEMD_UNITS,
    UNIT_DIR,
    ServicePaths,
    device_unit,
    label,
)
from linkctl.service.status import FileState, ServiceStatus, State, status
from linkctl.service.transaction import Interrupted

__all__ = [
    "BACKUP_SUFFIX",
    "DEFAULT_WAIT_CARRIER_S",
    "ENV",
    "LABEL_PREFIX",
    "LAUNCHD_DIR",
    "LAUNCHD_JOBS",
    "LAUNCHD_LOG_DIR",
    "MANIFEST",
    "PROFILE_DIR",
    "STATE_DIR",
    "SYSTEMD_UNITS",
    "UNIT_DIR",
    "Action",
    "FileAction",
    "FileState",
    "Interrupted",
    "Preflight",
    "ServiceManager",
    "ServicePaths",
    "ServiceResult",
    "ServiceStatus",
    "State",
    "UnitStatus",
    "check_os",
    "check_paths",
    "default_linkctl_bin",
    "default_llama_bin_dir",
    "device_unit",
    "in_root",
    "install",
    "label",
    "load_manifest",
    "manager_for",
    "others_can_reach",
    "render",
    "status",
    "uninstall",
]
