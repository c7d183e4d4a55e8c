"""What a server killed while it binds its push socket leaves in /dev/shm: the next server
clears it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ps_common import shm
from ps_server import shared_memory as server_shm
from ps_server.app import ParameterServer, ServerConfig

UNSUPPORTED = shm.supported()
pytestmark = pytest.mark.skipif(UNSUPPORTED is not None, reason=UNSUPPORTED or "")

WAIT_S = 30.0  # bound of every wait; never reached when the code is right

# A server process that is SIGKILLed (by itself, at a chosen point: deterministic) once its
# push socket is bound, as it sets the socket's mode, before it is renamed into place. It
# prints the socket's path first.
_KILLED_WHILE_BINDING = textwrap.dedent("""
    import os, signal, sys
    real_chmod = os.chmod

    def chmod(path, mode, *args, **kwargs):
        if str(path).startswith("/dev/shm/") and not str(path).endswith(".socket"):
            print(path, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_chmod(path, mode, *args, **kwargs)

    os.chmod = chmod
    from ps_server.app import ParameterServer, ServerConfig
    ParameterServer(ServerConfig(grace_s=0.5))
    print("not killed", flush=True)
""")


def test_a_server_killed_while_binding_its_push_socket_leaves_nothing_after_a_restart():
    """The next server started on the host removes what a SIGKILLed server left (README).
    A push socket is bound in a private directory and renamed into place; a server killed in
    between left that directory, whose name said nothing of its owner, for good."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WHILE_BINDING],
                             stdout=subprocess.PIPE, env=env, text=True)
    try:
        out, _ = child.communicate(timeout=WAIT_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(WAIT_S)
    assert child.returncode == -9, f"the server was not killed where meant ({out!r})"
    bound = Path(out.strip())
    # The socket, and the directory it was bound in where that is not /dev/shm itself.
    left = [bound] + ([bound.parent] if bound.parent != shm.DIRECTORY else [])
    try:
        assert bound.is_socket(), out
        with ParameterServer(ServerConfig(grace_s=0.5)):
            pass  # a server starting on this host clears what the dead one left
        server_shm.clear_dead()  # and so does every later look
        assert not [path for path in left if path.exists() or path.is_symlink()], (
            f"{left[-1]} (with the dead server's bound socket in it) is left in /dev/shm")
    finally:
        if left[-1] != bound:
            shutil.rmtree(left[-1], ignore_errors=True)
        shm.unlink(bound)
