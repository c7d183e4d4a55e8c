"""deploy/docker-compose.yml without a Docker engine (tests/system/test_docker_compose.py
runs it in one where there is one): each compose service's exact command as a local process,
with only the service host names mapped to 127.0.0.1, the fixed ports mapped to free ones,
the named volumes' mount points mapped to directories of the test's own (shared by the
services, as a named volume is) and the secrets' files (/run/secrets/NAME) to files of the
test's own."""

from __future__ import annotations

import re
import secrets
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


def _localize(command: list[str], hosts: dict[str, str], ports: dict[str, int],
              mounts: dict[str, Path] | None = None) -> list[str]:
    """Map `service:port` to 127.0.0.1:free, `--port N` to this service's free port,
    `--metrics-port N` to 0 (any free port) and a volume's mount point (a key of `mounts`)
    to its local directory."""
    out = [sys.executable, "-m", ENTRY_MODULES[command[0]]]
    for i, arg in enumerate(command[1:], start=1):
        arg = str(arg)
        match = re.fullmatch(r"([\w-]+):(\d+)", arg)
        if match and match.group(1) in hosts:
            arg = f"127.0.0.1:{ports[match.group(1)]}"
        elif command[i - 1] == "--port":
            arg = str(ports[hosts["__self__"]])
        elif command[i - 1] == "--metrics-port":
            arg = "0"  # services share one host here: each takes a free port
        elif mounts and arg in mounts:
            arg = str(mounts[arg])
        out.append(arg)
    return out


def _mounts(service: dict, volumes_dir: Path) -> dict[str, Path]:
    """A service's named volumes (`name:/path`), each as a directory under `volumes_dir`, and
    its secrets (`/run/secrets/NAME`), each as the file `volumes_dir/secrets/NAME`."""
    mounts = {}
    for entry in service.get("volumes", []):
        name, target = entry.split(":")[:2]
        mounts[target] = volumes_dir / name
    for name in service.get("secrets", []):
        mounts[f"/run/secrets/{name}"] = volumes_dir / "secrets" / name
    return mounts


def _write_secrets(compose: dict, volumes_dir: Path) -> None:
    """A file for each of the compose file's secrets (the cluster's token)."""
    (volumes_dir / "secrets").mkdir()
    for name in compose.get("secrets") or {}:
        (volumes_dir / "secrets" / name).write_text(secrets.token_urlsafe(32) + "\n")


def _wait_listening(proc: subprocess.Popen, deadline: float) -> None:
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if " listening on " in line:
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"{proc.args} exited with {proc.returncode} before listening")
    raise AssertionError(f"{proc.args} did not start listening in time")


def test_compose_services_train_to_completion_as_local_processes(tmp_path):
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    ports = {name: _free_port() for name in services}
    procs: list[subprocess.Popen] = []
    _write_secrets(compose, tmp_path)
    try:
        order = ["coordinator", *[n for n in services if n.startswith("ps-")]]
        for name in order:
            hosts = {**{n: n for n in services}, "__self__": name}
            mounts = _mounts(services[name], tmp_path)
            assert {p.name for p in mounts.values() if p.parent == tmp_path} <= set(
                compose.get("volumes") or {})
            command = _localize(services[name]["command"], hosts, ports, mounts)
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    text=True)
            procs.append(proc)
            _wait_listening(proc, time.monotonic() + 30)
        worker_command = _localize(services["worker"]["command"], {**{n: n for n in services},
                                   "__self__": "worker"}, ports,
                                   _mounts(services["worker"], tmp_path))
        for i in range(services["worker"].get("scale", 1)):
            procs.append(subprocess.Popen([*worker_command, "--worker-id", f"worker-{i}"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 120
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert [p.returncode for p in procs] == [0] * len(procs)
        # The servers wrote their parts into the coordinator's volume: complete checkpoints.
        assert list(tmp_path.glob("checkpoints/ckpt-*/manifest.json"))
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


def _flag(command: list[str], flag: str) -> str | None:
    command = [str(a) for a in command]
    return command[command.index(flag) + 1] if flag in command else None


def test_compose_shares_one_checkpoint_volume_and_restarts_what_fails():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    coordinator = services["coordinator"]
    checkpoint_dir = _flag(coordinator["command"], "--checkpoint-dir")
    volume = next(v.split(":")[0] for v in coordinator["volumes"]
                  if v.split(":")[1] == checkpoint_dir)
    assert volume in compose["volumes"]
    servers = [n for n in services if n.startswith("ps-")]
    assert servers
    for name in servers:
        assert f"{volume}:{checkpoint_dir}" in services[name]["volumes"], name
    for name, service in services.items():
        # What fails is restarted (workers a bounded number of times: see the file).
        assert service["restart"].split(":")[0] == "on-failure", name


def test_kubernetes_servers_are_a_statefulset_sharing_the_coordinators_volume():
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "paramserve.yaml").read_text()))
    kinds = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    claim = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]

    def pod_spec(kind: str, name: str) -> dict:
        return kinds[(kind, name)]["spec"]["template"]["spec"]

    def mounted_claim(spec: dict) -> tuple[str, str]:
        """(the claim, where it is mounted) of the pod's one container."""
        (container,) = spec["containers"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        (mount,) = [m for m in container["volumeMounts"]
                    if "persistentVolumeClaim" in volumes[m["name"]]]
        return volumes[mount["name"]]["persistentVolumeClaim"]["claimName"], mount["mountPath"]

    coordinator, servers = pod_spec("Deployment", "ps-coordinator"), pod_spec(
        "StatefulSet", "ps-server")
    assert kinds[("Deployment", "ps-coordinator")]["spec"]["strategy"]["type"] == "Recreate"
    assert coordinator["restartPolicy"] == "Always"
    claim_name, path = mounted_claim(coordinator)
    assert claim_name == claim["metadata"]["name"]
    assert _flag(coordinator["containers"][0]["args"], "--checkpoint-dir") == path
    assert mounted_claim(servers) == (claim_name, path)
    # The server id comes from the pod name: stable across restarts of a StatefulSet pod.
    assert _flag(servers["containers"][0]["args"], "--server-id") == "$(POD_NAME)"


def test_prometheus_scrapes_every_compose_service_where_it_serves_metrics():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    scraped: dict[str, str] = {}  # service -> the port Prometheus scrapes it on
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.split(":")
                scraped[host] = port
        for dns in job.get("dns_sd_configs", []):
            for name in dns["names"]:
                scraped[name] = str(dns["port"])
    assert set(scraped) == set(services)
    for name, service in services.items():
        command = service["command"]
        assert _flag(command, "--metrics-port") == scraped[name], name
        # Reachable from another container: bound to every interface.
        host_flag = "--metrics-host" if command[0] == "ps-worker" else "--host"
        assert _flag(command, host_flag) == "0.0.0.0", name
