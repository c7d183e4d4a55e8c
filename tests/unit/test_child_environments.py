"""The BLAS threads ps-cluster gives its children: workers split the cores, the coordinator
and servers get one each, and a value the user set is always kept."""

import pytest

from ps_worker.cluster import BLAS_THREAD_VARIABLES, daemon_environment, worker_environment


@pytest.fixture
def unset_blas(monkeypatch):
    for name in BLAS_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_daemons_get_one_blas_thread_whatever_the_core_count(unset_blas):
    unset_blas.setattr("os.cpu_count", lambda: 64)
    env = daemon_environment()
    assert {env[name] for name in BLAS_THREAD_VARIABLES} == {"1"}


def test_workers_split_the_cores(unset_blas):
    unset_blas.setattr("os.cpu_count", lambda: 64)
    assert worker_environment(4)["OPENBLAS_NUM_THREADS"] == "16"
    assert worker_environment(100)["OPENBLAS_NUM_THREADS"] == "1"


@pytest.mark.parametrize("environment", [daemon_environment, lambda: worker_environment(2)])
def test_a_thread_count_the_user_set_is_kept(unset_blas, environment):
    unset_blas.setenv("OPENBLAS_NUM_THREADS", "3")
    unset_blas.setenv("PARAMSERVE_SOMETHING_ELSE", "kept")
    env = environment()
    assert env["OPENBLAS_NUM_THREADS"] == "3"
    assert env["PARAMSERVE_SOMETHING_ELSE"] == "kept"
