"""deploy/: the compose file's and the Kubernetes manifests' command lines, run
through the commands' own parsers and code, or as local processes, with every mounted
Secret, volume and claim made a local file or directory (a token file, the certificates
deploy/k8s/secrets.yaml says to make, a checkpoint directory), the service names mapped to
127.0.0.1 on OS-chosen ports. No cluster, no Docker engine.

- Restart policies and a job that fails (compose's coordinator and workers, the TFJob's
  Chief): a coordinator restarted on a failed job's state reports it again and exits 0, and
  workers are restarted a bounded number of times, so that the cluster ends (`docker
  compose up` returns; the TFJob fails).
- The coordinator of deploy/k8s/paramserve.yaml must not place the job's variables before
  every server of the StatefulSet has registered (the TFJob's, told by TF_CONFIG, does not).
- A worker container that asks Kubernetes for a GPU must train on it, in the image the
  README builds under the name the manifests run (no CuPy in it).
- A server's memory bounds (--memory-budget and the checkpoint copies' --checkpoint-memory,
  defaulted from the memory the container sees) must fit in the memory its pod requests."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ps_common.certs import make_certs
from ps_common.clock import FakeClock
from ps_common.errors import NotReady
from ps_server import cli as server_cli
from ps_server import memory
from ps_server.coordinator import cli as coordinator_cli
from ps_server.coordinator.state import CoordinatorState
from ps_worker import backend as worker_backend
from ps_worker import cli as worker_cli
from ps_worker.data import load_dataset
from ps_worker.models.registry import build_model
from ps_worker.runtime import variable_specs

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
TFJOB = ROOT / "deploy" / "k8s" / "tfjob.yaml"
MODULES = {"ps-coordinator": "ps_server.coordinator.cli", "ps-worker": "ps_worker.cli"}
BROKEN_MODEL = "no_such_module_of_these_tests:Model"
RUN_S = 90.0  # bound of every process run here (each ends by itself within seconds)
RESTARTS_CHECKED = 5  # restarts simulated before concluding the policy never stops
# A restart policy that still restarts after this many is taken for one without a bound.
UNBOUNDED_RESTARTS = 1000
K8S = ROOT / "deploy" / "k8s"
GiB = 1 << 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local(argv: list, paths: dict[str, str], *, port: int | None = None,
           coordinator: str | None = None) -> list[str]:
    """The command as a local process: `--port` and a service's HOST:PORT to ours, metrics on
    any free port of loopback, mounted paths to ours, a worker on the CPU, and the job's
    model to one that does not import."""
    out = [sys.executable, "-m", MODULES[argv[0]]]
    previous = ""
    for word in (str(w) for w in argv[1:]):
        if previous == "--port" and port is not None:
            word = str(port)
        elif previous in ("--host", "--metrics-host"):
            word = "127.0.0.1"
        elif previous == "--metrics-port":
            word = "0"
        elif previous == "--coordinator" and coordinator is not None:
            word = coordinator
        elif previous == "--model":
            word = BROKEN_MODEL
        elif previous == "--device":
            word = "cpu"  # this machine's; the job fails before any step either way
        for path, local in paths.items():
            if word == path or word.startswith(path + "/"):
                word = local + word[len(path):]
        out.append(word)
        previous = word if word.startswith("--") else ""
    return out


def _run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_S,
                          stdin=subprocess.DEVNULL, check=False)


def _fail_a_job_then_restart(coordinator: list[str], env: dict[str, str], worker: list[str],
                             worker_env: dict[str, str], restarts) -> tuple[list[int], bool]:
    """Run the coordinator and one worker until the job has failed, then restart the
    coordinator while `restarts(exit_code, restarts_so_far)` says its policy would, at most
    RESTARTS_CHECKED times. Returns the coordinator's exit codes and whether the policy would
    restart it yet again."""
    proc = subprocess.Popen(coordinator, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    try:
        worked = _run(worker, worker_env)  # waits for the coordinator with backoff
        # The worker told the coordinator that the job cannot run (else nothing ends it).
        assert worked.returncode == 1, worked.stdout + worked.stderr
        assert BROKEN_MODEL in worked.stderr, worked.stderr
        out, _ = proc.communicate(timeout=RUN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(RUN_S)
    assert '"state": "failed"' in out, out
    codes = [proc.returncode]
    while restarts(codes[-1], len(codes) - 1) and len(codes) - 1 < RESTARTS_CHECKED:
        again = _run(coordinator, env)
        assert "resumed the job" in again.stdout + again.stderr, again.stdout + again.stderr
        codes.append(again.returncode)
    return codes, restarts(codes[-1], len(codes) - 1)


def _compose_restarts(service: dict):
    """Docker's decision to restart a container of `service` that exited with `code` after
    `restarts` restarts (`restart:` or compose's deploy.restart_policy)."""
    policy = (service.get("deploy") or {}).get("restart_policy")
    if policy is not None:
        condition, limit = policy.get("condition", "any"), policy.get("max_attempts")
    else:
        restart = str(service.get("restart", "no"))
        name, _, count = restart.partition(":")
        condition = {"on-failure": "on-failure", "always": "any",
                     "unless-stopped": "any"}.get(name, "none")
        limit = int(count) if count else None

    def restarts_it(code: int, restarts: int) -> bool:
        if condition == "none" or (condition == "on-failure" and code == 0):
            return False
        return limit is None or restarts < limit
    return restarts_it


def test_compose_services_of_a_failed_job_are_not_restarted_forever(tmp_path):
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    token = tmp_path / "token"
    token.write_text("a-compose-token\n")
    paths = {"/run/secrets/token": str(token), "/checkpoints": str(tmp_path / "checkpoints")}
    port = _free_port()
    coordinator = _local(services["coordinator"]["command"], paths, port=port)
    worker = _local(services["worker"]["command"], paths, coordinator=f"127.0.0.1:{port}")
    codes, again = _fail_a_job_then_restart(
        coordinator, dict(os.environ), [*worker, "--worker-id", "worker-1"], dict(os.environ),
        _compose_restarts(services["coordinator"]))
    assert codes[0] == 1
    assert not again, (
        f"the compose coordinator exits {codes} on a failed job's state, and "
        f"`restart: {services['coordinator'].get('restart')}` restarts it again after "
        f"{len(codes) - 1} restarts, and after every one: `docker compose up` never returns")
    # The workers exit 1 too (the model does not load); restarted once the coordinator is
    # gone, each exits 1 again after --coordinator-timeout (shortened here: only the wait).
    restarted = _run([*worker, "--worker-id", "worker-1", "--coordinator-timeout", "0.5"],
                     dict(os.environ))
    assert restarted.returncode == 1, restarted.stdout + restarted.stderr
    worker_restarts = _compose_restarts(services["worker"])
    assert not all(worker_restarts(1, n) for n in range(UNBOUNDED_RESTARTS)), (
        f"a worker of a failed job exits 1 at every restart, and `restart: "
        f"{services['worker'].get('restart')}` restarts it forever")


def _tfjob_restarts(tfjob: dict, replica: str):
    """The training operator's (and kubelet's) decision for a replica's pod that exited with
    `code` after `restarts` restarts: OnFailure/Always restart in place until
    runPolicy.backoffLimit (none: no limit); ExitCode only for retryable codes (>= 128)."""
    policy = tfjob["spec"]["tfReplicaSpecs"][replica].get("restartPolicy", "Never")
    limit = (tfjob["spec"].get("runPolicy") or {}).get("backoffLimit")

    def restarts_it(code: int, restarts: int) -> bool:
        retry = {"Always": True, "OnFailure": code != 0,
                 "ExitCode": code >= 128}.get(policy, False)
        return retry and (limit is None or restarts < limit)
    return restarts_it


def test_tfjob_chief_of_a_failed_job_is_not_restarted_forever(tmp_path):
    tfjob = next(d for d in yaml.safe_load_all(TFJOB.read_text())
                 if d and d["kind"] == "TFJob")
    replicas = tfjob["spec"]["tfReplicaSpecs"]
    token = tmp_path / "token"
    token.write_text("a-tfjob-token\n")
    paths = {"/var/run/secrets/paramserve": str(tmp_path),
             "/checkpoints": str(tmp_path / "checkpoints")}
    chief = f"127.0.0.1:{_free_port()}"
    cluster = {"chief": [chief],
               "ps": [f"127.0.0.1:{_free_port()}" for _ in range(replicas["PS"]["replicas"])],
               "worker": [f"127.0.0.1:{_free_port()}"
                          for _ in range(replicas["Worker"]["replicas"])]}

    def command(replica: str) -> list[str]:
        return _local(replicas[replica]["template"]["spec"]["containers"][0]["args"], paths)

    def env(task: str) -> dict[str, str]:
        return {**os.environ, "TF_CONFIG": json.dumps(
            {"cluster": cluster, "task": {"type": task, "index": 0}})}

    codes, again = _fail_a_job_then_restart(command("Chief"), env("chief"), command("Worker"),
                                            env("worker"), _tfjob_restarts(tfjob, "Chief"))
    assert codes[0] == 1
    assert not again, (
        f"the TFJob's Chief exits {codes} on a failed job's state, and restartPolicy "
        f"{replicas['Chief']['restartPolicy']} without runPolicy.backoffLimit restarts it "
        f"again after {len(codes) - 1} restarts, and after every one: the TFJob never fails")


@pytest.mark.parametrize("code,restarted", [(0, False), (137, True)])
def test_a_crashed_coordinator_is_still_restarted(code, restarted):
    """What the files must keep (README: a crashed coordinator comes back and resumes the
    job), read through the two models above: a crash (SIGKILL, 137) is restarted, a clean
    exit is not."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    tfjob = next(d for d in yaml.safe_load_all(TFJOB.read_text())
                 if d and d["kind"] == "TFJob")
    assert _compose_restarts(services["coordinator"])(code, 0) is restarted
    assert _tfjob_restarts(tfjob, "Chief")(code, 0) is restarted


# ---- the Kubernetes manifests through the commands' parsers ----------------------------

def _documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _manifest(kind: str, name: str) -> dict:
    return next(d for d in _documents(K8S / "paramserve.yaml")
                if d["kind"] == kind and d["metadata"]["name"] == name)


def _tfjob() -> dict:
    return next(d for d in _documents(K8S / "tfjob.yaml") if d["kind"] == "TFJob")


def _cert_hosts() -> list[str]:
    """The --hosts of the `ps-ctl make-certs` command secrets.yaml says to run."""
    text = (K8S / "secrets.yaml").read_text()
    return re.search(r"make-certs --out certs --hosts \\\n#\s+(\S+)", text).group(1).split(",")


def _local_args(pod: dict, container: dict, tmp: Path, env: dict[str, str]) -> list[str]:
    """The container's command line (without the program), every path under a mounted
    Secret or claim replaced by a local one: the token Secret a file holding a token, the
    TLS Secret the certificates secrets.yaml makes, a claim a directory. $(VAR) as the
    kubelet expands it from `env`."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts: dict[str, Path] = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "secret" in volume:
            local = tmp / "secrets" / volume["secret"]["secretName"]
            if not local.exists():
                if "tls" in volume["secret"]["secretName"]:
                    make_certs(local, _cert_hosts())
                else:
                    local.mkdir(parents=True)
                    (local / "token").write_text("a-cluster-token\n")
        else:
            local = tmp / "claims" / volume["persistentVolumeClaim"]["claimName"]
            local.mkdir(parents=True, exist_ok=True)
        mounts[mount["mountPath"]] = local
    args = []
    for word in [*container.get("command", []), *container.get("args", [])][1:]:
        word = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], str(word))
        for path, local in mounts.items():
            if word == path or word.startswith(path + "/"):
                word = str(local) + word[len(path):]
        args.append(word)
    return args


def _quantity(text: str) -> int:
    """A Kubernetes memory quantity ("8Gi", "512Mi", "8G") in bytes."""
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|K|M|G|T)?", str(text))
    units = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
             "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    return int(match.group(1)) * units[match.group(2)]


# ---- the coordinator waits for every server of the StatefulSet --------------------------

def test_k8s_coordinator_places_nothing_before_every_statefulset_server_registered(tmp_path):
    """paramserve.yaml starts the coordinator, the servers (podManagementPolicy: Parallel)
    and the worker Job at once. A worker declares the job's variables as soon as it has
    registered; a server pod scheduled later (an image pull, a node scaled up, the RWX
    volume attached) would find every variable already placed on the other one, for the
    whole job (a placed shard never moves). The TFJob's coordinator waits for every server
    (--expect-servers from TF_CONFIG); this one must wait for the StatefulSet's replicas."""
    deployment = _manifest("Deployment", "ps-coordinator")
    statefulset = _manifest("StatefulSet", "ps-server")
    replicas = statefulset["spec"]["replicas"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    parser = coordinator_cli.build_parser()
    args = parser.parse_args(_local_args(pod, container, tmp_path, {}))
    config, task = coordinator_cli.config_and_task(parser, args, environ={})
    assert task is None and config.job is not None

    # The coordinator's state as Coordinator builds it from that config, on a fake clock.
    clock = FakeClock()
    state = CoordinatorState(
        clock, heartbeat_timeout_s=config.heartbeat_timeout_s,
        split_threshold_bytes=config.split_threshold_bytes,
        server_timeout_s=config.server_timeout_s,
        reinitialize_lost=config.reinitialize_lost_shards,
        recovery_grace_s=config.recovery_grace_s, expected_servers=config.expected_servers)
    clock.advance(config.recovery_grace_s + 1.0)  # a new cluster: past the recovery grace

    # What every worker declares for this job.
    job = config.job
    dataset = load_dataset(job.data, seed=job.seed)
    model = build_model(job.model, num_features=dataset.num_features,
                        num_classes=dataset.num_classes, hidden=job.hidden,
                        field_sizes=dataset.field_sizes)
    specs = variable_specs(model, job)
    assert len(specs) >= 2

    budget = server_cli.build_parser().parse_args(
        [str(a) for a in statefulset["spec"]["template"]["spec"]["containers"][0]["args"][1:]]
    ).memory_budget
    state.register_server("ps-server-0", "ps-server-0.ps-server:50061", budget)
    with pytest.raises(NotReady):  # 1 of the StatefulSet's 2 servers is up
        placed = state.declare(specs)
        pytest.fail(f"expected servers {config.expected_servers} of {replicas}: the job's "
                    f"variables were placed on "
                    f"{sorted({s.server_id for n in placed.shards for s in placed.shards_of(n)})} "
                    "alone, before ps-server-1 registered")
    for i in range(1, replicas):
        state.register_server(f"ps-server-{i}", f"ps-server-{i}.ps-server:50061", budget)
    placed = state.declare(specs)
    holders = {s.server_id for name in placed.shards for s in placed.shards_of(name)}
    assert holders == {f"ps-server-{i}" for i in range(replicas)}


def test_tfjob_coordinator_waits_for_every_ps_replica(tmp_path):
    """The same check for the TFJob: TF_CONFIG gives --expect-servers (the behaviour
    paramserve.yaml is held to above)."""
    tfjob = _tfjob()
    chief = tfjob["spec"]["tfReplicaSpecs"]["Chief"]["template"]["spec"]
    ps_replicas = tfjob["spec"]["tfReplicaSpecs"]["PS"]["replicas"]
    tf_config = {"cluster": {"chief": ["paramserve-chief-0.default.svc:2222"],
                             "ps": [f"paramserve-ps-{i}.default.svc:2222"
                                    for i in range(ps_replicas)]},
                 "task": {"type": "chief", "index": 0}}
    parser = coordinator_cli.build_parser()
    args = parser.parse_args(_local_args(chief, chief["containers"][0], tmp_path, {}))
    config, task = coordinator_cli.config_and_task(
        parser, args, environ={"TF_CONFIG": json.dumps(tf_config)})
    assert task is not None
    assert config.expected_servers == ps_replicas == 2


# ---- GPU workers ---------------------------------------------------------------------------

def _gpu_workers() -> list[tuple[str, dict, dict, dict]]:
    """(where, pod spec, container, environment) of every worker container that asks
    Kubernetes for a GPU."""
    found = []
    job = _manifest("Job", "ps-worker")
    pod = job["spec"]["template"]["spec"]
    found.append(("paramserve.yaml Job/ps-worker", pod, pod["containers"][0], {}))
    tfjob = _tfjob()["spec"]["tfReplicaSpecs"]
    pod = tfjob["Worker"]["template"]["spec"]
    tf_config = {"cluster": {"chief": ["paramserve-chief-0.default.svc:2222"],
                             "ps": ["paramserve-ps-0.default.svc:2222"],
                             "worker": ["paramserve-worker-0.default.svc:2222"]},
                 "task": {"type": "worker", "index": 0}}
    found.append(("tfjob.yaml Worker", pod, pod["containers"][0],
                  {"TF_CONFIG": json.dumps(tf_config)}))
    return [f for f in found
            if (f[2].get("resources") or {}).get("limits", {}).get("nvidia.com/gpu")]


def test_the_manifests_image_is_built_without_cupy():
    """What the next test assumes: the manifests run `paramserve:latest`, which the README
    builds with the Dockerfile's default EXTRAS (none: no CuPy, on python:3.11-slim)."""
    readme = (ROOT / "README.md").read_text()
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.search(r'^ARG EXTRAS=""$', dockerfile, re.M)
    builds = re.findall(r"docker build [^\n]*(?:\\\n[^\n]*)*-t paramserve:latest", readme)
    assert builds and all("EXTRAS" not in b for b in builds)
    workers = _gpu_workers()
    assert len(workers) == 2
    assert {c["image"] for _, _, c, _ in workers} == {"paramserve:latest"}


@pytest.mark.parametrize("where", [w for w, _, _, _ in _gpu_workers()])
def test_a_worker_that_requests_a_gpu_does_not_train_on_the_cpu(where, tmp_path, monkeypatch):
    """Each worker pod holds a GPU (`nvidia.com/gpu: 1`). In an image without CuPy (the
    README's `paramserve:latest`), `--device auto` would train with NumPy on the CPU,
    logging it at INFO, every GPU of the job held and idle: a worker asked to use a GPU
    uses it or fails (`--device cuda`: BackendUnavailable, exit 1, naming paramserve[gpu])."""
    _, pod, container, env = next(w for w in _gpu_workers() if w[0] == where)
    parser = worker_cli.build_parser()
    args = parser.parse_args(_local_args(pod, container, tmp_path, env))
    config = worker_cli.config_from_args(parser, args, environ=env)
    # The image: no CuPy (what `import cupy` does where it is not installed).
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.delitem(sys.modules, "ps_worker._cupy_backend", raising=False)
    said: list[str] = []
    try:
        chosen = worker_backend.select_backend(config.device, log=said.append,
                                               local_rank=config.local_rank)
    except worker_backend.BackendUnavailable:
        return  # refuses to run without its GPU: the pod fails visibly
    assert not isinstance(chosen, worker_backend.NumpyBackend), (
        f"{where}: --device {config.device} in a pod holding a GPU trains on the CPU: "
        f"{said}")


# ---- server memory vs the pod's request ------------------------------------------------------

def _servers() -> list[tuple[str, dict, dict, dict]]:
    statefulset = _manifest("StatefulSet", "ps-server")
    pod = statefulset["spec"]["template"]["spec"]
    found = [("paramserve.yaml StatefulSet/ps-server", pod, pod["containers"][0],
              {"POD_NAME": "ps-server-0"})]
    tfjob = _tfjob()["spec"]["tfReplicaSpecs"]
    pod = tfjob["PS"]["template"]["spec"]
    tf_config = {"cluster": {"chief": ["paramserve-chief-0.default.svc:2222"],
                             "ps": ["paramserve-ps-0.default.svc:2222"]},
                 "task": {"type": "ps", "index": 0}}
    found.append(("tfjob.yaml PS", pod, pod["containers"][0],
                  {"TF_CONFIG": json.dumps(tf_config)}))
    return found


@pytest.mark.parametrize("node_gib", [16, 64, 256])
@pytest.mark.parametrize("where", [w for w, _, _, _ in _servers()])
def test_a_servers_memory_bounds_fit_in_its_pods_request(where, node_gib, tmp_path,
                                                         monkeypatch):
    """A server pod requests 8Gi and runs with --memory-budget 6GiB; without a memory limit
    the container would see the node's memory, and --checkpoint-memory would default to
    15% of the node's (9.6 GiB on 64 GiB): a server holding its 6 GiB could grow past its
    request while a checkpoint copies the shards pushed to, and be the first pod evicted
    under memory pressure. Its budget and the checkpoint bound together fit in the request
    on any node."""
    _, pod, container, env = next(s for s in _servers() if s[0] == where)
    parser = server_cli.build_parser()
    environ = {k: v for k, v in env.items() if k == "TF_CONFIG"}
    config = server_cli.config_from_args(
        parser, parser.parse_args(_local_args(pod, container, tmp_path, env)), environ)
    resources = container.get("resources") or {}
    request = _quantity(resources["requests"]["memory"])
    limit = (resources.get("limits") or {}).get("memory")
    seen = node_gib * GiB if limit is None else min(node_gib * GiB, _quantity(limit))
    monkeypatch.setattr(memory, "machine_memory_bytes", lambda: seen)
    budget = (memory.default_memory_budget() if config.memory_budget_bytes is None
              else config.memory_budget_bytes)
    checkpoint = (memory.default_checkpoint_memory() if config.checkpoint_memory_bytes is None
                  else config.checkpoint_memory_bytes)
    assert budget + checkpoint <= request, (
        f"{where} on a {node_gib} GiB node: budget {budget / GiB:.1f} GiB + checkpoint "
        f"copies {checkpoint / GiB:.1f} GiB > the {request / GiB:.1f} GiB it requests")
