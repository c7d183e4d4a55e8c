"""deploy/Dockerfile and deploy/docker-compose.yml in a real Docker engine: build the image,
bring the compose cluster up and wait until its job is over, then check the job's outcome.
Skipped where no engine answers `docker info`, the docker or compose command is missing, or
no base image can be had (below).

PARAMSERVE_BASE_IMAGE, if set, is the Dockerfile's BASE (default: the Dockerfile's own, which
is pulled from a registry); deploy/build-base-image.sh makes one from Debian's packages alone,
for an engine that reaches no registry."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.docker, pytest.mark.system]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
IMAGE = "paramserve:test"
BUILD_TIMEOUT_S = 900  # a first build downloads the dependencies
UP_TIMEOUT_S = 300
DOWN_TIMEOUT_S = 180
ENGINE_TIMEOUT_S = 60


def _compose_command() -> list[str]:
    """`docker compose` (v2) or `docker-compose` (v1), or skip: no engine, no compose."""
    if shutil.which("docker") is None:
        pytest.skip("no docker command")
    try:
        if subprocess.run(["docker", "info"], capture_output=True, check=False,
                          timeout=ENGINE_TIMEOUT_S).returncode != 0:
            pytest.skip("no Docker engine answers `docker info`")
        for command in (["docker", "compose"], ["docker-compose"]):
            if shutil.which(command[0]) and subprocess.run(
                    [*command, "version"], capture_output=True, check=False,
                    timeout=ENGINE_TIMEOUT_S).returncode == 0:
                return command
    except subprocess.TimeoutExpired as error:
        pytest.skip(f"the Docker engine did not answer {error.cmd} in {error.timeout} s")
    pytest.skip("neither `docker compose` nor `docker-compose` is installed")


def _need_default_base() -> None:
    """Skip unless the Dockerfile's default BASE is here or can be pulled: an engine that
    reaches no registry needs PARAMSERVE_BASE_IMAGE."""
    base = re.search(r"^ARG BASE=(\S+)", (ROOT / "deploy" / "Dockerfile").read_text(),
                     re.M).group(1)
    try:
        if _run(["docker", "image", "inspect", base], ENGINE_TIMEOUT_S).returncode == 0:
            return
        pulled = _run(["docker", "pull", base], ENGINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pulled = None
    if pulled is None or pulled.returncode != 0:
        pytest.skip(f"the Dockerfile's base image {base} cannot be pulled here (no registry?): "
                    "set PARAMSERVE_BASE_IMAGE to one deploy/build-base-image.sh made")


def _run(command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          check=False, **kwargs)


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _flag(command: list, flag: str) -> str:
    command = [str(a) for a in command]
    return command[command.index(flag) + 1]


@pytest.mark.timeout(BUILD_TIMEOUT_S + UP_TIMEOUT_S + 2 * DOWN_TIMEOUT_S)
def test_compose_cluster_trains_to_completion_in_docker(tmp_path):
    compose_command = _compose_command()
    build = ["docker", "build", "--network", "host", "-f", "deploy/Dockerfile", "-t", IMAGE]
    base = os.environ.get("PARAMSERVE_BASE_IMAGE")
    if base:
        build += ["--build-arg", f"BASE={base}"]
    else:
        _need_default_base()
    built = _run([*build, "."], BUILD_TIMEOUT_S)
    assert built.returncode == 0, (
        f"{' '.join(build)} failed (without an image registry, set PARAMSERVE_BASE_IMAGE to "
        f"an image deploy/build-base-image.sh made):\n{_tail(built.stdout + built.stderr)}")

    token = tmp_path / "token"
    token.write_text(uuid.uuid4().hex + "\n")
    token.chmod(0o644)  # compose mounts it as it is; the image's user is not root
    env = {**os.environ, "PARAMSERVE_IMAGE": IMAGE, "PARAMSERVE_TOKEN_FILE": str(token),
           "PARAMSERVE_COORDINATOR_PORT": "0"}  # any free host port
    compose = [*compose_command, "-p", f"paramserve-test-{uuid.uuid4().hex[:8]}",
               "-f", str(COMPOSE)]
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    log = tmp_path / "compose-up.log"
    try:
        with log.open("w") as out:
            up = subprocess.Popen([*compose, "up", "--no-build", "--no-color"], cwd=ROOT,
                                  env=env, stdout=out, stderr=subprocess.STDOUT)
            try:
                up.wait(timeout=UP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                up.terminate()
                up.wait(DOWN_TIMEOUT_S)
                pytest.fail(f"the cluster was still up after {UP_TIMEOUT_S} s:\n"
                            f"{_tail(log.read_text())}")
        output = log.read_text()
        assert up.returncode == 0, _tail(output)

        # Every container ran once and exited 0: the job ended everything by itself.
        ids = _run([*compose, "ps", "-a", "-q"], ENGINE_TIMEOUT_S, env=env).stdout.split()
        service_exit_restarts = ('{{index .Config.Labels "com.docker.compose.service"}} '
                                 '{{.State.ExitCode}} {{.RestartCount}}')
        inspected = _run(["docker", "inspect", "--format", service_exit_restarts, *ids],
                         ENGINE_TIMEOUT_S)
        assert inspected.returncode == 0, inspected.stderr
        states = sorted(tuple(line.split()) for line in inspected.stdout.splitlines())
        expected = sorted((name, "0", "0") for name, service in services.items()
                          for _ in range(service.get("scale", 1)))
        assert states == expected, _tail(output)

        # The coordinator's summary: the job is done, every epoch, no worker lost.
        finished = re.search(r"ps-coordinator finished: (\{.*\})", output)
        assert finished, _tail(output)
        summary = json.loads(finished.group(1))
        assert summary["state"] == "done"
        assert summary["epochs"] == int(_flag(services["coordinator"]["command"], "--epochs"))
        assert summary["steps"] > 0 and summary["workers_dead"] == []
        print(finished.group(0))

        # Both servers wrote their parts of the final checkpoint into the shared volume.
        checkpoint_dir = _flag(services["coordinator"]["command"], "--checkpoint-dir")
        newest_files = ("import json, sys; from pathlib import Path; ckpt = max(Path("
                        "sys.argv[1]).glob('ckpt-*/manifest.json')).parent; print(json.dumps("
                        "sorted(p.name for p in ckpt.iterdir())))")
        listed = _run([*compose, "run", "--rm", "--no-deps", "-T", "coordinator", "python",
                       "-c", newest_files, checkpoint_dir], ENGINE_TIMEOUT_S, env=env)
        assert listed.returncode == 0, listed.stdout + listed.stderr
        files = json.loads(listed.stdout.strip().splitlines()[-1])
        servers = [name for name in services if name.startswith("ps-")]
        assert "manifest.json" in files
        assert {f"{name}.safetensors" for name in servers} <= set(files)
    finally:
        down = _run([*compose, "down", "-v", "--remove-orphans", "--timeout", "10"],
                    DOWN_TIMEOUT_S, env=env)
    assert down.returncode == 0, down.stdout + down.stderr
