"""The files of deploy/, checked without a Docker engine or a Kubernetes cluster: every
Kubernetes manifest against the API's schemas (bundled by kubernetes-validate), the compose
file against the Compose specification (bundled by check-jsonschema), and every command line
in them against the argparse parser of the command it runs. (tests/system/test_docker_compose.py
runs the image and the compose file for real where a Docker engine is.)"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
import subprocess
import sys
from importlib import import_module
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "docker-compose.yml"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))

# The oldest and the newest release the manifests are checked against: 1.27 is the first with
# the kubelet's own gRPC probe (what paramserve.yaml's comment offers without TLS), 1.37 the
# newest kubernetes-validate 1.37 bundles.
KUBERNETES_VERSIONS = ("1.27.0", "1.37.0")
# Custom resources, whose schemas kubernetes-validate does not bundle: only their command
# lines are checked (below). Any other kind without a schema fails.
NOT_BUNDLED = {("kubeflow.org/v1", "TFJob")}

# Flags and subcommands that the deploy files use ahead of the commands. A command line
# using one is an expected failure until its command takes it; then the test fails until
# the entry is removed from here.
PENDING: dict[str, set[str]] = {}


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _name(doc: dict) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


# ---- Kubernetes ----------------------------------------------------------------------------

@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kubernetes_manifests_match_the_api_schemas(version):
    assert MANIFESTS
    errors, checked = [], 0
    for path in MANIFESTS:
        for doc in _documents(path):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
                checked += 1
            except kubernetes_validate.SchemaNotFoundError:
                if (doc["apiVersion"], doc["kind"]) not in NOT_BUNDLED:
                    errors.append(f"{path.name}: {_name(doc)}: no schema for "
                                  f"{doc['apiVersion']} {doc['kind']}")
            except kubernetes_validate.ValidationError as error:
                where = ".".join(str(p) for p in error.path)
                errors.append(f"{path.name}: {_name(doc)}: {where}: {error.message}")
    assert not errors, "\n".join(errors)
    assert checked


def test_kubernetes_check_rejects_a_misspelt_field():
    doc = next(d for d in _documents(DEPLOY / "k8s" / "paramserve.yaml")
               if d["kind"] == "Deployment")
    broken = copy.deepcopy(doc)
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[-1], strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def _pod_specs(node) -> list[dict]:
    """Every pod spec (a mapping with `containers`) anywhere in a document."""
    if isinstance(node, dict):
        found = [node] if isinstance(node.get("containers"), list) else []
        return found + [s for value in node.values() for s in _pod_specs(value)]
    if isinstance(node, list):
        return [s for value in node for s in _pod_specs(value)]
    return []


def _container_words(container: dict) -> list[str]:
    """The container's command line and its probes' commands, word by word."""
    words = [*container.get("command", []), *container.get("args", [])]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        words += ((container.get(probe) or {}).get("exec") or {}).get("command") or []
    return [str(w) for w in words]


def test_kubernetes_pods_read_files_of_the_secrets_and_claims_declared():
    """Every Secret and claim a pod mounts is declared, and every path a command names under
    a Secret's mount is one of that Secret's keys (a file the pod will have)."""
    docs = [d for path in MANIFESTS for d in _documents(path)]
    secrets = {d["metadata"]["name"]: {*d.get("data", {}), *d.get("stringData", {})}
               for d in docs if d["kind"] == "Secret"}
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    for doc in docs:
        for spec in _pod_specs(doc):
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            for container in spec["containers"]:
                secret_mounts = {}
                for mount in container.get("volumeMounts", []):
                    volume = volumes[mount["name"]]
                    if "secret" in volume:
                        assert volume["secret"]["secretName"] in secrets, _name(doc)
                        secret_mounts[mount["mountPath"]] = volume["secret"]["secretName"]
                    if "persistentVolumeClaim" in volume:
                        assert volume["persistentVolumeClaim"]["claimName"] in claims, _name(doc)
                for word in _container_words(container):
                    for path, secret in secret_mounts.items():
                        if word.startswith(path + "/"):
                            key = word[len(path) + 1:]
                            assert key in secrets[secret], f"{_name(doc)}: {word}: no key {key}"


# ---- Compose -------------------------------------------------------------------------------

def _check_compose(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
         str(path)], capture_output=True, text=True, check=False, timeout=60)


def test_compose_file_matches_the_compose_specification():
    result = _check_compose(COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_check_rejects_a_misspelt_key(tmp_path):
    compose = yaml.safe_load(COMPOSE.read_text())
    worker = compose["services"]["worker"]
    worker["comand"] = worker.pop("command")
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(yaml.safe_dump(compose))
    assert _check_compose(broken).returncode == 1


# ---- The image -----------------------------------------------------------------------------

def _packages() -> list[str]:
    include = re.search(r'include = \[([^\]]*)\]', (ROOT / "pyproject.toml").read_text())
    return re.findall(r'"(\w+)\*"', include.group(1))


def test_build_context_lets_through_what_the_dockerfile_copies():
    allowed = {line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    copied = {src for line in DOCKERFILE.read_text().splitlines() if line.startswith("COPY ")
              for src in line.split()[1:-1]}
    assert copied == allowed
    assert set(_packages()) <= copied


def test_dockerfile_base_is_a_build_argument_with_a_public_default():
    text = DOCKERFILE.read_text()
    base = re.search(r"^ARG BASE=(\S+)$", text, re.MULTILINE)
    assert base and re.fullmatch(r"python:3\.\d+-slim", base.group(1))
    assert re.search(r"^FROM \$\{BASE\}$", text, re.MULTILINE)


# ---- Command lines -------------------------------------------------------------------------

def _scripts() -> dict[str, str]:
    """Command name -> module, from [project.scripts]."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+) = "([\w.]+):\w+"$', section, re.MULTILINE))


SCRIPTS = _scripts()


def _command_lines() -> list[tuple[str, list[str]]]:
    """(where, argv) of every command line in deploy/ that runs one of our commands."""
    found: list[tuple[str, list]] = []
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("CMD "):
            found.append(("Dockerfile CMD", json.loads(line[len("CMD "):])))
    for name, service in yaml.safe_load(COMPOSE.read_text())["services"].items():
        found.append((f"docker-compose.yml {name}", service.get("command") or []))
        test = (service.get("healthcheck") or {}).get("test") or []
        if test[:1] == ["CMD"]:
            found.append((f"docker-compose.yml {name} healthcheck", test[1:]))
    for path in MANIFESTS:
        for doc in _documents(path):
            for spec in _pod_specs(doc):
                for container in spec["containers"] + spec.get("initContainers", []):
                    where = f"{path.name} {_name(doc)} {container['name']}"
                    found.append((where, [*container.get("command", []),
                                          *container.get("args", [])]))
                    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                        command = ((container.get(probe) or {}).get("exec") or {}).get("command")
                        if command:
                            found.append((f"{where} {probe}", command))
    return [(where, [str(a) for a in argv]) for where, argv in found
            if argv and argv[0] in SCRIPTS]


COMMAND_LINES = _command_lines()


def test_every_daemon_is_run_somewhere():
    assert {"ps-coordinator", "ps-server", "ps-worker"} <= {argv[0] for _, argv in COMMAND_LINES}


def _parse(program: str, args: list[str]) -> tuple[list[str] | None, str]:
    """(the options the command's parser does not know, "") or (None, its error)."""
    parser = import_module(SCRIPTS[program]).build_parser()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            _, extras = parser.parse_known_args(args)
        except SystemExit:
            return None, err.getvalue().strip()
    return [a.split("=", 1)[0] for a in extras if a.startswith("-")], ""


@pytest.mark.parametrize("where,argv", COMMAND_LINES, ids=[w for w, _ in COMMAND_LINES])
def test_deploy_command_lines_parse(where, argv):
    program, args = argv[0], argv[1:]
    pending = PENDING.get(program, set())
    pending_words = {p for p in pending if not p.startswith("-")} & set(args)
    unknown, error = _parse(program, args)
    if unknown is None:
        if pending_words:
            pytest.xfail(f"{program} has no {sorted(pending_words)} yet")
        pytest.fail(f"{where}: {' '.join(argv)}:\n{error}")
    assert not pending_words, (f"{program} takes {sorted(pending_words)} now: remove them "
                               "from PENDING")
    assert set(unknown) <= pending, f"{where}: {program} has no {sorted(set(unknown) - pending)}"
    arrived = {a for a in args if a in pending} - set(unknown)
    assert not arrived, f"{program} takes {sorted(arrived)} now: remove them from PENDING"
    if unknown:
        pytest.xfail(f"{program} has no {sorted(set(unknown))} yet")


def _daemon_environments() -> list[tuple[str, dict]]:
    """(where, environment) of every coordinator and server the deploy files run."""
    found = []
    for name, service in yaml.safe_load(COMPOSE.read_text())["services"].items():
        if (service.get("command") or [""])[0] in ("ps-coordinator", "ps-server"):
            found.append((f"docker-compose.yml {name}", service.get("environment") or {}))
    for path in MANIFESTS:
        for doc in _documents(path):
            for spec in _pod_specs(doc):
                for container in spec["containers"]:
                    argv = [*container.get("command", []), *container.get("args", [])]
                    if argv[:1] in (["ps-coordinator"], ["ps-server"]):
                        found.append((f"{path.name} {_name(doc)} {container['name']}",
                                      {e["name"]: e.get("value")
                                       for e in container.get("env") or []}))
    return found


def test_coordinators_and_servers_get_one_blas_thread():
    """They never multiply matrices; a BLAS library's thread per core of the host would
    count against its process limit for nothing (as ps-cluster, ps_worker.cluster)."""
    environments = _daemon_environments()
    assert {w.split()[0] for w, _ in environments} == {"docker-compose.yml", "paramserve.yaml",
                                                       "tfjob.yaml"}
    for where, environment in environments:
        for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            assert environment.get(variable) == "1", f"{where}: {variable}"
