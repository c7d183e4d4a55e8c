"""A cluster launched as a TF_CONFIG launcher (Kubeflow's TFJob) launches it: real
ps-coordinator, ps-server and ps-worker processes given no address flag, each with nothing
but its TF_CONFIG, train to completion; deploy/k8s/tfjob.yaml's exact commands do too,
given the TF_CONFIG the training operator would give them (host names mapped to 127.0.0.1,
ports to free ones, the Secret and the volume to directories of the test's own); and a bad
TF_CONFIG stops each command with a usage error naming it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from child_processes import EXIT_S
from ps_common.tf_config import TF_CONFIG_ENV
from test_training import Observer, assert_exit_0, coordinator_summary, job_over, wait_for

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
TFJOB = ROOT / "deploy" / "k8s" / "tfjob.yaml"
MODULES = {"ps-coordinator": "ps_server.coordinator.cli", "ps-server": "ps_server.cli",
           "ps-worker": "ps_worker.cli"}
ADDRESS_FLAGS = {"--host", "--port", "--coordinator", "--advertise-address"}
JOB_S = 60.0  # a job of these tests ends within this


def free_addresses(n: int) -> list[str]:
    """n distinct 127.0.0.1:PORT the OS had free a moment ago (another process may take one
    before the test binds it: a small race, accepted)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [f"127.0.0.1:{s.getsockname()[1]}" for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(cluster: dict[str, list[str]], task_type: str, index: int) -> str:
    """TF_CONFIG as the training operator writes it."""
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index},
                       "environment": "cloud"})


def test_processes_given_only_tf_config_train_to_completion(launch, monkeypatch):
    chief, ps0, ps1, worker0, worker1 = free_addresses(5)
    cluster = {"chief": [chief], "ps": [ps0, ps1], "worker": [worker0, worker1]}

    def start(task_type: str, index: int, module: str, *job_args: str):
        monkeypatch.setenv(TF_CONFIG_ENV, tf_config(cluster, task_type, index))
        return launch(f"{task_type}-{index}", module, *job_args)  # the child copies the env

    coordinator = start("chief", 0, "ps_server.coordinator.cli",
                        "--epochs", "2", "--tasks-per-epoch", "2")
    assert coordinator.address() == chief
    observer = Observer(chief)  # holds the coordinator up until the final status is read
    try:
        servers = [start("ps", i, "ps_server.cli") for i in range(2)]
        assert [s.address() for s in servers] == [ps0, ps1]  # bound on loopback entries
        workers = [start("worker", i, "ps_worker.cli") for i in range(2)]
        status = wait_for(observer, job_over, "the job to end", timeout=JOB_S,
                          watch=(coordinator, *servers))
        assert status["job"]["state"] == "done", status
        assert status["job"]["tasks_done"] == status["job"]["tasks_total"]
        # Each server registered under ps-INDEX at its TF_CONFIG entry, and the coordinator
        # waited for both before placing: both hold shards.
        assert {v["id"]: v["address"] for v in status["servers"]} == {"ps-0": ps0, "ps-1": ps1}
        assert all(v["shards"] > 0 for v in status["servers"]), status["servers"]
        assert {"worker-0", "worker-1"} <= {w["id"] for w in status["workers"]}
        observer.release()
    finally:
        observer.close()
    assert_exit_0([coordinator, *servers, *workers])
    assert coordinator_summary(coordinator)["state"] == "done"


def _container(replica: dict) -> dict:
    (container,) = replica["template"]["spec"]["containers"]
    return container


def _localize(args: list[str], mounts: dict[str, Path]) -> list[str]:
    """A container's args with mounted paths mapped to the test's directories, and a GPU
    worker's `--device cuda` run on the CPU (the pods ask for a GPU; this machine may have
    none, and the job is the same)."""
    out = []
    for arg in map(str, args):
        for mount_path, local in mounts.items():
            if arg == mount_path or arg.startswith(mount_path + "/"):
                arg = str(local) + arg[len(mount_path):]
        if out and out[-1] == "--device" and arg == "cuda":
            arg = "cpu"
        out.append(arg)
    return out


def _mounts(replica: dict, tmp_path: Path, token: str) -> dict[str, Path]:
    """Each volume mount of the replica's container as a directory of the test: the Secret's
    holds the token, a claim's is shared by every replica that mounts it."""
    spec = replica["template"]["spec"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts = {}
    for mount in _container(replica).get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "secret" in volume:
            local = tmp_path / "secrets" / volume["secret"]["secretName"]
            local.mkdir(parents=True, exist_ok=True)
            (local / "token").write_text(token + "\n")
        else:
            local = tmp_path / "claims" / volume["persistentVolumeClaim"]["claimName"]
            local.mkdir(parents=True, exist_ok=True)
        mounts[mount["mountPath"]] = local
    return mounts


def test_the_tfjob_manifest_trains_to_completion_as_local_processes(launch, monkeypatch,
                                                                   tmp_path):
    docs = list(yaml.safe_load_all(TFJOB.read_text()))
    (tfjob,) = [d for d in docs if d["kind"] == "TFJob"]
    assert tfjob["apiVersion"] == "kubeflow.org/v1"
    replicas = tfjob["spec"]["tfReplicaSpecs"]
    assert set(replicas) == {"Chief", "PS", "Worker"}
    commands = {"Chief": "ps-coordinator", "PS": "ps-server", "Worker": "ps-worker"}
    for name, replica in replicas.items():
        container = _container(replica)
        # The operator reads the port of the container named "tensorflow".
        assert container["name"] == "tensorflow", name
        assert container["args"][0] == commands[name], name
        assert not ADDRESS_FLAGS & set(map(str, container["args"])), name
        assert "--token-file" in container["args"], name

    counts = {name: replica.get("replicas", 1) for name, replica in replicas.items()}
    addresses = iter(free_addresses(sum(counts.values())))
    cluster = {name.lower(): [next(addresses) for _ in range(counts[name])]
               for name in ("Chief", "PS", "Worker")}
    token = "tfjob-test-token"
    procs = {}
    for name in ("Chief", "PS", "Worker"):
        container = _container(replicas[name])
        args = _localize(container["args"][1:], _mounts(replicas[name], tmp_path, token))
        for index in range(counts[name]):
            monkeypatch.setenv(TF_CONFIG_ENV, tf_config(cluster, name.lower(), index))
            proc = launch(f"{name.lower()}-{index}", MODULES[container["args"][0]], *args)
            procs[proc.name] = proc
            if name != "Worker":
                assert proc.address() == cluster[name.lower()][index]
    coordinator = procs["chief-0"]
    assert coordinator.wait(JOB_S) == 0, coordinator.logs()
    assert coordinator_summary(coordinator)["state"] == "done"
    assert_exit_0(list(procs.values()))
    # The servers wrote their parts of checkpoints into the claim they share with the chief.
    assert list((tmp_path / "claims").glob("*/ckpt-*/manifest.json"))
    assert not [p.name for p in procs.values() if token in p.logs()]


@pytest.mark.parametrize("module,text", [
    ("ps_server.cli", tf_config({"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}, "chief", 0)),
    ("ps_server.coordinator.cli", "{not json"),
    ("ps_worker.cli", tf_config({"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"],
                                 "worker": ["127.0.0.1:3"]}, "worker", 1)),
], ids=["server-given-the-chiefs", "coordinator-not-json", "worker-index-out-of-range"])
def test_a_bad_tf_config_stops_the_command_with_a_usage_error_naming_it(module, text):
    done = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True,
                          timeout=EXIT_S, stdin=subprocess.DEVNULL,
                          env={**os.environ, TF_CONFIG_ENV: text})
    assert done.returncode == 2, done
    assert TF_CONFIG_ENV in done.stderr and "Traceback" not in done.stderr
    assert "listening on" not in done.stdout
