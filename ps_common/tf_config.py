"""TF_CONFIG: TensorFlow's description of a cluster, as launchers that speak it (Kubeflow's
TFJob above all) give it to every process in the environment variable of that name:

    {"cluster": {"chief": ["job-chief-0.ns.svc:2222"],
                 "ps": ["job-ps-0.ns.svc:2222", "job-ps-1.ns.svc:2222"],
                 "worker": ["job-worker-0.ns.svc:2222", "job-worker-1.ns.svc:2222"]},
     "task": {"type": "ps", "index": 1}}

paramserve reads it as: `cluster.chief` is the coordinator, `cluster.ps` the parameter
servers, `cluster.worker` the workers; `task.type` and `task.index` say which entry this
process is. `master` (TFJob's older name for the chief) is read as `chief`. Other keys
(`environment`, `rpc_layer`, an `evaluator` list) are ignored; a process whose task.type is
`evaluator` is refused (paramserve's workers evaluate after each epoch: there is no
evaluator process to run).

Binding: a process listens on the port of its own entry. Its interface is the entry's host
when that is a loopback address (a cluster on one machine stays on loopback), and all
interfaces (0.0.0.0) otherwise: an entry names the address others reach the process at (a
Service's DNS name), which in a container is not an address of its own, or resolves only
once the pod is ready. A server advertises its entry to the coordinator as its address.

Pure: parses text and returns values; the commands read the environment (cli.py) and
decide whether TF_CONFIG applies (only when no address flag was given)."""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from typing import Any

TF_CONFIG_ENV = "TF_CONFIG"
ALL_INTERFACES = "0.0.0.0"

# The command that runs each task type, and the task type each command runs.
COORDINATOR, SERVER, WORKER = "ps-coordinator", "ps-server", "ps-worker"
TASK_TYPE_OF = {COORDINATOR: "chief", SERVER: "ps", WORKER: "worker"}
COMMAND_OF = {task_type: command for command, task_type in TASK_TYPE_OF.items()}
_ALIASES = {"master": "chief"}  # TFJob's Master replicas: the chief under an older name


class TFConfigError(ValueError):
    """TF_CONFIG is malformed or is not for this command; the message starts with TF_CONFIG
    and names the field at fault."""

    def __init__(self, problem: str):
        super().__init__(f"{TF_CONFIG_ENV}: {problem}")


@dataclass(frozen=True)
class ClusterSpec:
    """A validated TF_CONFIG: every address is HOST:PORT."""

    chief: str  # the coordinator's address
    ps: tuple[str, ...]  # the parameter servers' addresses, at least one
    worker: tuple[str, ...]  # the workers' addresses (may be empty)
    task_type: str  # chief, ps or worker (master is read as chief)
    task_index: int  # within its type's list

    def addresses(self, task_type: str) -> tuple[str, ...]:
        return (self.chief,) if task_type == "chief" else getattr(self, task_type)

    @property
    def address(self) -> str:
        """This task's own entry."""
        return self.addresses(self.task_type)[self.task_index]


@dataclass(frozen=True)
class Task:
    """What one command takes from TF_CONFIG."""

    command: str
    index: int
    address: str  # its own entry: others reach it here
    coordinator: str  # cluster.chief[0]
    servers: int  # len(cluster.ps)
    workers: int  # len(cluster.worker)

    @property
    def name(self) -> str:
        """A stable id for this task: `ps-1`, `worker-0`, `chief-0` (the same after a
        restart, as TFJob restarts a replica under the same index)."""
        return f"{TASK_TYPE_OF[self.command]}-{self.index}"

    @property
    def bind_host(self) -> str:
        return bind_host(self.address)

    @property
    def port(self) -> int:
        return split_address(self.address)[1]

    def describe(self) -> str:
        return (f"{TF_CONFIG_ENV}: task {TASK_TYPE_OF[self.command]} {self.index} at "
                f"{self.address}, coordinator {self.coordinator}, {self.servers} server(s), "
                f"{self.workers} worker(s)")


def split_address(address: str) -> tuple[str, int]:
    """'host:2222' -> ('host', 2222); '[::1]:2222' -> ('::1', 2222). ValueError if it is not
    HOST:PORT with a port in 1..65535."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        # '::1:2222' would bind, but what it advertises is no address gRPC can dial.
        raise ValueError(f"{address!r} is not HOST:PORT: an IPv6 host goes in brackets, "
                         "as in [::1]:2222")
    if (not sep or not host or not (port.isascii() and port.isdigit())
            or not 0 < int(port) < 65536):
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_host(address: str) -> str:
    """The interface a process whose entry is `address` listens on (see the module doc)."""
    host, _ = split_address(address)
    return host if is_loopback(host) else ALL_INTERFACES


def parse(text: str) -> ClusterSpec:
    """The cluster TF_CONFIG's `text` describes; TFConfigError naming the field at fault."""
    try:
        config = json.loads(text)
    except ValueError as error:
        raise TFConfigError(f"not valid JSON ({error})") from None
    except RecursionError:
        raise TFConfigError("not valid JSON (nested too deeply)") from None
    if not isinstance(config, dict):
        raise TFConfigError("must be a JSON object with 'cluster' and 'task'")
    cluster = config.get("cluster")
    if cluster is None:
        if "sparseCluster" in config:
            raise TFConfigError("has a 'sparseCluster' (TFJob's enableDynamicWorker), which "
                                "paramserve does not read: give the whole 'cluster'")
        raise TFConfigError("has no 'cluster'")
    if not isinstance(cluster, dict):
        raise TFConfigError("'cluster' must map task types to lists of HOST:PORT")
    if "chief" in cluster and "master" in cluster:
        raise TFConfigError("cluster has both 'chief' and 'master': give one coordinator")
    chief = _addresses(cluster, "chief" if "chief" in cluster else "master")
    if len(chief) != 1:
        raise TFConfigError(f"cluster.chief must hold exactly one HOST:PORT (the "
                            f"coordinator), not {len(chief)}")
    ps = _addresses(cluster, "ps")
    if not ps:
        raise TFConfigError("cluster.ps must name at least one parameter server")
    worker = _addresses(cluster, "worker", required=False)
    task_type, task_index = _task(config.get("task"))
    spec = ClusterSpec(chief=chief[0], ps=ps, worker=worker, task_type=task_type,
                       task_index=task_index)
    entries = spec.addresses(task_type)
    if task_index >= len(entries):
        raise TFConfigError(f"task.index {task_index} is out of range: cluster.{task_type} "
                            f"has {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}")
    return spec


def task_for(command: str, text: str) -> Task:
    """What `command` (ps-coordinator, ps-server or ps-worker) takes from TF_CONFIG's
    `text`; TFConfigError when it is malformed or its task is not this command's."""
    spec = parse(text)
    wanted = TASK_TYPE_OF[command]
    if spec.task_type != wanted:
        raise TFConfigError(f"task.type {spec.task_type!r} is not for {command}, which runs "
                            f"the {wanted!r} task; run {COMMAND_OF[spec.task_type]} for it")
    return Task(command=command, index=spec.task_index, address=spec.address,
                coordinator=spec.chief, servers=len(spec.ps), workers=len(spec.worker))


def _addresses(cluster: dict, key: str, *, required: bool = True) -> tuple[str, ...]:
    name = "chief" if key == "master" else key
    if key not in cluster:
        if required:
            raise TFConfigError(f"has no cluster.{name}" + (
                " (the coordinator's HOST:PORT)" if name == "chief" else ""))
        return ()
    entries = cluster[key]
    if not isinstance(entries, list):
        raise TFConfigError(f"cluster.{key} must be a list of HOST:PORT, not {entries!r}")
    for i, entry in enumerate(entries):
        if not isinstance(entry, str):
            raise TFConfigError(f"cluster.{key}[{i}] {entry!r} is not HOST:PORT")
        try:
            split_address(entry)
        except ValueError as error:
            raise TFConfigError(f"cluster.{key}[{i}] {error}") from None
    return tuple(entries)


def _task(task: Any) -> tuple[str, int]:
    if task is None:
        raise TFConfigError("has no 'task' (which entry of the cluster this process is)")
    if not isinstance(task, dict):
        raise TFConfigError(f"'task' must be an object with 'type' and 'index', not {task!r}")
    task_type = task.get("type")
    if not isinstance(task_type, str) or not task_type:
        raise TFConfigError(f"task.type must be chief, ps or worker, not {task_type!r}")
    task_type = _ALIASES.get(task_type.lower(), task_type.lower())
    if task_type == "evaluator":
        raise TFConfigError("task.type 'evaluator': paramserve has no evaluator process (its "
                            "workers evaluate after each epoch); leave out the Evaluator "
                            "replicas")
    if task_type not in COMMAND_OF:
        raise TFConfigError(f"task.type {task['type']!r} is not chief, ps or worker")
    index = task.get("index", 0)  # TensorFlow's default
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise TFConfigError(f"task.index must be an integer >= 0, not {index!r}")
    return task_type, index
