"""Every benchmark script still runs end to end: each is started as a real process with
`--quick` (tiny sizes and durations through every step and value check of the script; ports
chosen by the OS) and must exit 0 with, as its last line, one JSON object holding its
figures. The figures themselves are not checked (a quick run measures nothing); the values
each script verifies are (values read back, checkpoint content, no lost push).

py-spy is optional for the two profiles: the py-spy runs are skipped without it, the /proc
runs are not."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
RUN_TIMEOUT_S = 120.0  # a quick run takes seconds; this only bounds a hung one
STOP_TIMEOUT_S = 30.0  # after SIGTERM, the script stops every process it started
pytestmark = [pytest.mark.system,
              pytest.mark.timeout(2 * (RUN_TIMEOUT_S + 2 * STOP_TIMEOUT_S) + 30)]  # a retry
CONTEXT_KEYS = {"benchmark", "quick", "date", "commit", "machine", "argv", "loadavg_1m"}
needs_py_spy = pytest.mark.skipif(shutil.which("py-spy") is None,
                                  reason="py-spy is not installed (pip install py-spy)")


# A process that cannot create a thread (pthread_create: EAGAIN, the machine is out of them)
# aborts inside grpcio's C core. That says nothing about the script, so such a run is tried
# once more; a script that leaks threads fails the second run too.
OUT_OF_THREADS = "pthread_create failed"


def _run(script: str, args: tuple[str, ...]) -> tuple[int, str, str]:
    """One bounded run: past RUN_TIMEOUT_S the script gets SIGTERM (on which it stops its
    children), then SIGKILL (its children get SIGTERM from the kernel when it dies)."""
    proc = subprocess.Popen([sys.executable, str(BENCHMARKS / script), "--quick", *args],
                            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate(timeout=STOP_TIMEOUT_S)
        pytest.fail(f"{script} --quick did not finish within {RUN_TIMEOUT_S:g} s:\n"
                    f"{out[-3000:]}\n{err[-3000:]}")
    return proc.returncode, out, err


def run_quick(script: str, *args: str) -> dict:
    """Run `benchmarks/<script> --quick *args`; assert exit 0; return its last line's JSON."""
    returncode, out, err = _run(script, args)
    if returncode != 0 and OUT_OF_THREADS in out + err:
        print(f"{script} --quick: a process ran out of threads; trying once more:\n"
              f"{err[-3000:]}", file=sys.stderr)
        returncode, out, err = _run(script, args)
    assert returncode == 0, f"{script} exited {returncode}:\n{out[-3000:]}\n{err[-3000:]}"
    lines = out.strip().splitlines()
    assert lines, f"{script} printed nothing:\n{err[-3000:]}"
    record = json.loads(lines[-1])
    assert CONTEXT_KEYS <= record.keys()
    assert record["quick"] is True
    return record


def test_w1_dense_mlp():
    r = run_quick("w1_dense_mlp.py")
    assert {"steps_per_s", "per_worker_steps_per_s", "worker_steps_per_s",
            "compute_only_steps_per_s", "per_worker_ratio", "total_ratio", "cpu_ms_per_step",
            "compute_only_cpu_ms_per_step", "server_peak_rss_bytes", "steps"} <= r.keys()
    assert r["steps"] > 0 and set(r["worker_steps_per_s"]) == {"w0", "w1"}
    assert set(r["cpu_ms_per_step_by_process"]) == {"coordinator", "s0", "s1", "w0", "w1"}


def test_w1_dense_mlp_over_grpc_beside_its_floor():
    r = run_quick("w1_dense_mlp.py", "--no-shm")
    assert r["path"] == "grpc" and r["steps"] > 0
    floor = r["floor"]
    assert floor["workload"] == "w1" and floor["steps"] > 0 and r["ratio_to_floor"] > 0
    assert set(floor["cpu_ms_per_step_by_process"]) == {"s0", "s1", "w0", "w1"}


def test_w2_big_dense_timed():
    r = run_quick("w2_big_dense.py")
    assert {"paramserve", "baseline", "ratio", "server_peak_rss_bytes",
            "client_peak_rss_bytes"} <= r.keys()
    assert r["mode"] == "timed" and r["paramserve"]["values_ok"] is True
    assert r["paramserve"]["round_trips"] >= 2 and r["baseline"]["round_trips"] >= 2


def test_w2_big_dense_once():
    r = run_quick("w2_big_dense.py", "--once")
    assert r["mode"] == "once" and r["paramserve"]["ok"] is True
    assert {"pull_s", "push_s", "verify_pull_s"} <= r["paramserve"].keys()


def test_w3_sparse_embedding():
    r = run_quick("w3_sparse_embedding.py")
    assert {"steps_per_s", "unique_rows_per_s", "slice_steps_per_s", "worker_steps_per_s",
            "unique_ids_per_step_median", "baseline", "ratio_to_baseline",
            "cpu_ms_per_step_by_role", "server_peak_rss_bytes", "table_bytes",
            "target_steps_per_s", "path"} <= r.keys()
    assert r["values_ok"] is True and r["path"] == "shm" and r["steps"] > 0
    assert set(r["worker_steps_per_s"]) == {"w0", "w1"}
    assert set(r["cpu_ms_per_step_by_process"]) == {"coordinator", "s0", "s1", "w0", "w1"}
    assert set(r["cpu_ms_per_step_by_role"]) == {"coordinator", "servers", "workers"}
    assert r["baseline"]["steps"] > 0 and 0 < r["unique_ids_per_step_median"] <= r["batch"]


def test_w3_sparse_embedding_over_grpc_beside_its_floor():
    r = run_quick("w3_sparse_embedding.py", "--no-shm")
    assert r["values_ok"] is True and r["path"] == "grpc" and r["steps"] > 0
    floor = r["floor"]
    assert floor["workload"] == "w3" and floor["steps"] > 0 and r["ratio_to_floor"] > 0
    assert floor["unique_rows_per_s"] > 0
    assert set(floor["cpu_ms_per_step_by_process"]) == {"s0", "s1", "w0", "w1"}
    assert set(floor["cpu_ms_per_step_by_role"]) == {"servers", "workers"}


def test_w4_latency():
    r = run_quick("w4_latency.py")
    assert {"paramserve", "bare_unary", "bare_unary_stream", "ratio_p50", "ratio_p99"} <= r.keys()
    assert all(r[k]["count"] == 50 for k in ("paramserve", "bare_unary", "bare_unary_stream"))


@pytest.mark.parametrize("path", [(), ("--no-shm",)], ids=["shm", "grpc"])
def test_w1_data_path(path):
    r = run_quick("w1_data_path.py", *path)
    assert r["path"] == ("grpc" if path else "shm") and r["steps"] == 5
    assert r["paramserve"]["data_paths"] == [r["path"]]
    assert {"client", "s0", "s1"} == r["paramserve"]["cpu_ms_per_step_by_process"].keys()


def test_bare_grpc():
    r = run_quick("bare_grpc.py")
    assert {"transfer", "transfer_no_copy", "echo_us", "server_peak_rss_bytes"} <= r.keys()
    assert r["transfer"]["round_trips"] >= 1 and {"p50", "p99"} <= r["echo_us"].keys()


def test_checkpoint():
    r = run_quick("checkpoint.py")
    assert {"max_push_during_checkpoint_s", "checkpoint_idle_s", "plain_write_fsync_s",
            "peak_rss_increase_bytes", "rounds", "check"} <= r.keys()
    assert r["check"]["ok"] is True and len(r["rounds"]) == 2
    assert all(round_["trace"] for round_ in r["rounds"])  # the server's steps were timed


def test_coordinator_scale():
    r = run_quick("coordinator_scale.py")
    assert {"first", "last", "ratio_lease_complete", "ratio_snapshot", "tasks"} <= r.keys()
    assert r["tasks"] == r["epochs"] * (r["tasks_per_epoch"] + 1)


def test_repro_duplicate_assign():
    r = run_quick("repro_duplicate_assign.py")
    assert r["lost"] is False and r["later"] == [0.75] * 4


def test_w5_scale():
    r = run_quick("w5_scale.py")
    assert {"configs", "compute_only", "seconds", "warmup"} <= r.keys()
    configs = {(c["servers"], c["workers"]): c for c in r["configs"]}
    assert set(configs) == {(2, 1), (2, 2)}
    for (servers, workers), c in configs.items():
        assert c["steps"] > 0 and len(c["worker_steps_per_s"]) == workers
        assert set(c["cpu_ms_per_step_by_role"]) == {"coordinator", "servers", "workers"}
        assert len(c["cpu_ms_per_step_by_process"]) == 1 + servers + workers
        assert {"compute_only_steps_per_s", "ratio", "per_worker_ratio"} <= c.keys()
        assert str(c["blas_threads"]) in r["compute_only"]


def _check_profile_w1(r: dict) -> None:
    assert {"steps", "steps_per_s", "cpu_ms_per_step", "cpu_ms_per_step_by_role",
            "cpu_ms_per_step_by_thread_kind", "processes", "compute_only"} <= r.keys()
    assert r["steps"] > 0 and set(r["processes"]) == {"coordinator", "s0", "s1", "w0", "w1"}
    for process in r["processes"].values():
        assert {"user_ms", "sys_ms", "cpu_ms", "by_thread_kind_ms"} <= process.keys()


def test_profile_w1_proc_only():
    r = run_quick("profile_w1.py", "--no-py-spy")
    _check_profile_w1(r)
    assert r["profiled_with"] == "none"


@needs_py_spy
def test_profile_w1_with_py_spy():
    r = run_quick("profile_w1.py")
    _check_profile_w1(r)
    assert r["profiled_with"] == "py-spy"
    assert all("py_spy" in process for process in r["processes"].values())


def _check_profile_w2(r: dict) -> None:
    assert {"round_trips", "wall_ms_per_round_trip", "client_cpu", "server_cpu"} <= r.keys()
    assert r["round_trips"] == 2


def test_profile_w2_proc_only():
    r = run_quick("profile_w2.py", "--no-py-spy")
    _check_profile_w2(r)
    assert r["profiled_with"] == "none"


@needs_py_spy
def test_profile_w2_with_py_spy():
    r = run_quick("profile_w2.py")
    _check_profile_w2(r)
    assert r["profiled_with"] == "py-spy" and {"client_py_spy", "server_py_spy"} <= r.keys()
