"""The `kubetron` client commands as a user runs them against the tests' control plane (the installed entry
points, the cluster admin's kubeconfig): tests/operator/test_cli_on_kube.py and the stories that read
`kubetron status`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def kubetron(kube, *args: str, exe: str = "kubetron", timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / exe), *args], capture_output=True, text=True, timeout=timeout,
                          env=user_env(kube))


def user_env(kube) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
    env["KUBECONFIG"] = str(kube.cp._cert_kubeconfig("admin"))  # the cluster admin's kubeconfig
    return env
