"""Helpers shared by test modules (not fixtures: those live in conftest.py).

- `metric(trainer, key)`: a logged metric's values, one per step that logged it.
- `run_two_ranks(out, method, overrides, ...)`: tests/mp_train.py under torchrun on 2 CPU processes (gloo, a free
  loopback port); returns the finished process and each rank's state file. `run_jobs_on_two_ranks` runs several
  such jobs (`two_rank_job`) in one launch.
- `global_metrics(history)`: a rank's log history without its own timings, which is what both ranks must agree on.
- Servers started by tests: `free_port()` (a free loopback port), `http_status(url)` (0 when nothing answers),
  `wait_ready(what, ok, proc, log, timeout)` (fails the test with the log's tail if the process exits or stays
  unready), `stop_group(proc)` (SIGTERM, then SIGKILL, to the process group of a process started in a new session).
- `store_held(home, release_after)`: the sqlite MLflow store of SAGE_HOME `home` locked by a second connection (another
  flow or rank writing it), with MLflow's 20 s wait for a lock cut to 0.2 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

HERE = Path(__file__).parent


def metric(trainer, key: str) -> list:
    return [h[key] for h in trainer.state.log_history if key in h]


def run_two_ranks(out: Path, method: str, overrides: dict | None = None, *, ctx_limit: int | None = None,
                  bucket_overhead: tuple[int, int] | None = None, expect_ok: bool = True, timeout: int = 600):
    """One job of tests/mp_train.py on 2 ranks: (finished process, rank 0's state, rank 1's state).
    `ctx_limit`: the trainer's generation context limit on both ranks (as vLLM's max_model_len would set it).
    `bucket_overhead`: each rank's sage_bucket_overhead (how readily its loss forward splits into length buckets).
    With expect_ok=False the finished process is returned whatever its exit code, with no state files."""
    proc, states = run_jobs_on_two_ranks([two_rank_job(out, method, overrides, ctx_limit=ctx_limit,
                                                       bucket_overhead=bucket_overhead)],
                                         expect_ok=expect_ok, timeout=timeout)
    return (proc, *states[0]) if expect_ok else (proc, None, None)


def two_rank_job(out: Path, method: str, overrides: dict | None = None, *, ctx_limit: int | None = None,
                 bucket_overhead: tuple[int, int] | None = None, train: bool = False) -> dict:
    """`train`: run the job through sage_core.train.train (resumed from the folder's last checkpoint, as `sage train`
    resumes), not on a trainer built afresh."""
    return {"out": str(out), "method": method, "overrides": overrides or {}, "ctx_limit": ctx_limit,
            "bucket_overhead": list(bucket_overhead) if bucket_overhead else None, "train": train}


def run_jobs_on_two_ranks(jobs: list[dict], *, expect_ok: bool = True, timeout: int = 600):
    """tests/mp_train.py's jobs (two_rank_job), one after another in one torchrun launch of 2 CPU processes (gloo, a
    free loopback port): (finished process, [(rank 0's state, rank 1's state) per job]). On a timeout (a hang) the
    whole process group is killed, ranks included, not only torchrun. With expect_ok=False the process is returned
    whatever its exit code, with no states."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(HERE.parent),
           "MP_JOBS": json.dumps(jobs)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(HERE / "mp_train.py")]
    proc = _run_group(cmd, env, timeout)
    if not expect_ok:
        return proc, None
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, [tuple(json.loads((Path(j["out"]) / f"state_rank{r}.json").read_text()) for r in (0, 1))
                  for j in jobs]


def _run_group(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run that, when it times out or pytest-timeout interrupts the test, kills the whole process tree:
    torchrun starts each rank in a session of its own, and killing torchrun alone left the ranks waiting in a
    collective."""
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except BaseException:
            with contextlib.suppress(psutil.NoSuchProcess):
                for child in psutil.Process(p.pid).children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        child.kill()
            p.kill()
            raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def global_metrics(history: list[dict]) -> list[dict]:
    """Timings are each process's own; everything else is computed on gathered groups."""
    return [{k: v for k, v in h.items() if not k.endswith("_seconds")} for h in history]


def lora_checkpoint(base_model, spec, out: Path, std: float) -> dict:
    """Save LoRA adapters (spec's lora settings) on `base_model` to `out`, with B drawn from N(0, std) instead of
    peft's zeros so that merging them changes the weights. Returns the adapter tensors by parameter name."""
    import torch
    from peft import get_peft_model

    from sage_core.lora import peft_config

    torch.manual_seed(0)
    model = get_peft_model(base_model, peft_config(spec))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=std)
    model.save_pretrained(out)
    return {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}


# ---------------------------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except (urllib.error.URLError, OSError):
        return 0


def wait_ready(what: str, ok, proc: subprocess.Popen, log: Path, timeout: float) -> float:
    """Poll `ok()` each second until it holds (returns the seconds waited); fail the test with the last lines of
    `log` if `proc` exits first or `timeout` passes."""
    import pytest

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if ok():
            return time.monotonic() - t0
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(1)
    pytest.fail(f"{what} not ready after {timeout}s:\n{log.read_text()[-3000:]}")


def stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def store_held(home: Path, release_after: float | None = None):
    """The sqlite store `<home>/mlflow.db` held by a second connection (`BEGIN EXCLUSIVE`: another flow or rank
    writing it) until the block ends, or for `release_after` seconds of it. MLflow waits 20 s for a locked store in
    each session (PRAGMA busy_timeout); cut to 0.2 s while the block runs."""
    import re
    import sqlite3
    import threading

    from sqlalchemy import event

    from sage_core import tracking

    def short_wait(conn, cursor, statement, parameters, context, executemany):
        return re.sub(r"busy_timeout = \d+", "busy_timeout = 200", statement), parameters

    engine = tracking.client()._tracking_client.store.engine
    event.listen(engine, "before_cursor_execute", short_wait, retval=True)
    db = sqlite3.connect(home / "mlflow.db", isolation_level=None, check_same_thread=False)
    release = threading.Timer(release_after or 0, db.close)  # closing it ends its transaction: the lock goes
    try:
        db.execute("BEGIN EXCLUSIVE")
        if release_after is not None:
            release.start()
        yield
    finally:
        release.cancel()
        if release.is_alive():
            release.join()
        db.close()
        event.remove(engine, "before_cursor_execute", short_wait)
