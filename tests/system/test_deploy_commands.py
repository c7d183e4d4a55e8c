"""deploy/docker-compose.yml cannot run here (no Docker engine), so this runs the closest
real thing: each compose service's exact command as a local process, with only the service
host names mapped to 127.0.0.1 and the fixed ports mapped to free ones."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
ENTRY_MODULES = {
    "ps-coordinator": "ps_server.coordinator.cli",
    "ps-server": "ps_server.cli",
    "ps-worker": "ps_worker.cli",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _localize(command: list[str], hosts: dict[str, str], ports: dict[str, int]) -> list[str]:
    """Map `service:port` to 127.0.0.1:free and `--port N` to this service's free port."""
    out = [sys.executable, "-m", ENTRY_MODULES[command[0]]]
    for i, arg in enumerate(command[1:], start=1):
        arg = str(arg)
        match = re.fullmatch(r"([\w-]+):(\d+)", arg)
        if match and match.group(1) in hosts:
            arg = f"127.0.0.1:{ports[match.group(1)]}"
        elif command[i - 1] == "--port":
            arg = str(ports[hosts["__self__"]])
        out.append(arg)
    return out


def _wait_listening(proc: subprocess.Popen, deadline: float) -> None:
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if " listening on " in line:
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"{proc.args} exited with {proc.returncode} before listening")
    raise AssertionError(f"{proc.args} did not start listening in time")


def test_compose_services_train_to_completion_as_local_processes():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    ports = {name: _free_port() for name in services}
    procs: list[subprocess.Popen] = []
    try:
        order = ["coordinator", *[n for n in services if n.startswith("ps-")]]
        for name in order:
            hosts = {**{n: n for n in services}, "__self__": name}
            command = _localize(services[name]["command"], hosts, ports)
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    text=True)
            procs.append(proc)
            _wait_listening(proc, time.monotonic() + 30)
        worker_command = _localize(services["worker"]["command"], {**{n: n for n in services},
                                   "__self__": "worker"}, ports)
        for i in range(2):  # `--scale worker=2`
            procs.append(subprocess.Popen([*worker_command, "--worker-id", f"worker-{i}"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 120
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert [p.returncode for p in procs] == [0] * len(procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_dockerfile_copies_every_package():
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.search(r'include = \[([^\]]*)\]', pyproject).group(1)
    for package in re.findall(r'"(\w+)\*"', packages):
        assert re.search(rf"^COPY {package} {package}$", dockerfile, re.M), package
