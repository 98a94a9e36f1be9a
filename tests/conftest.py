"""Shared test setup (keep it small).

- Offline Hugging Face env (set at import time, before anything imports transformers/TRL).
- `sage_home` (session, autouse): SAGE_HOME -> a fresh per-session dir under pytest's tmp dir, so tests never
  touch the repo's .sage; SAGE_MODEL_CACHE -> $SAGE_TEST_CACHE when set (reused across runs: fast local reruns),
  else <that SAGE_HOME>/cache (the tiny model is then built once per session; under pytest-xdist the workers share
  one, beside their own temporary folders).
- `tiny_model_dir` (session): the warm-started tiny model dir (about 3 minutes on 2 cores to build). Load your own
  copy from it (`load_policy("tiny")` or `from_pretrained(tiny_model_dir)`): never share a mutable model object
  between tests. A test or fixture that needs the tiny model must ask for this fixture: where the model is not
  cached yet, `sage_home` starts building it in a background process and the tests that ask for it run last
  (`pytest_collection_modifyitems`), so the others run while it builds.
- pytest-xdist (`make test`: `-n 2 --dist loadscope`): each worker computes on its share of the cores (torch's
  threads and OMP_NUM_THREADS for the processes its tests start) and runs whole groups, a module's tests without the
  tiny model or with it (`pytest_xdist_make_scheduler`): module fixtures start once, and every group without it goes
  out before any with it. Session fixtures start once a worker (the prefect server: on each worker that runs a test
  of test_flows.py or test_e2e_prefect.py).
- `prefect_server` (session): a real `prefect server start` on a free loopback port with its own PREFECT_HOME and
  sqlite database, shared by the tests that talk to Prefect (a fresh server spends about 20 s creating its
  database): {"api": its API URL, "log": its log file}.
- One full garbage collection as each test module begins, then `gc.freeze()` (`pytest_runtest_setup`): HF's Trainer
  runs `gc.collect()` at every `train()` (accelerate's `free_memory`), and over a whole session's heap (every
  library imported, every module's leftovers) that took 1-2 s a call, more than the tiny model's training itself:
  test_trainer.py took 175 s in the suite against 94 s alone. Frozen objects are left out of collections, and a
  collection at a module's start frees the garbage its predecessor left before the rest is frozen. What is frozen is
  what was live then: libraries' state and session fixtures, which live to the session's end anyway. (Unfreezing
  at each module's start instead cost a 2 s collection there, 100 s a session.)
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
# a teacher endpoint nobody serves fails its start-up check at once (600 s of polling otherwise; tests that test the
# wait set it themselves)
os.environ["SAGE_TEACHER_STARTUP_WAIT"] = "0"

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def sage_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("sage-home")
    saved = {k: os.environ.get(k) for k in ("SAGE_HOME", "SAGE_MODEL_CACHE", "OMP_NUM_THREADS")}
    os.environ["SAGE_HOME"] = str(home)
    # pytest-xdist's workers share one cache: each worker's temporary root is a folder of the session's
    shared = tmp_path_factory.getbasetemp().parent if _WORKER else home
    os.environ["SAGE_MODEL_CACHE"] = os.environ.get("SAGE_TEST_CACHE") or str(shared / "cache")
    builder = _start_tiny_build(home / "tiny-build.log") if _TINY_NEEDED and _WORKER in ("", "gw0") else None
    if _WORKER:  # one of pytest-xdist's workers (make test starts one a core): the cores shared out between them,
        import torch  # the processes its tests start included

        threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    elif builder is not None:  # the tests beside the build compute on one thread, until tiny_model_dir gives it back
        import torch

        _THREADS_BEFORE_BUILD.append(torch.get_num_threads())
        torch.set_num_threads(1)
    yield home
    if builder is not None and builder.poll() is None:
        builder.terminate()
        builder.wait()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def tiny_model_dir(sage_home):
    from sage_core.models import tiny_model_path

    path = tiny_model_path()
    if _THREADS_BEFORE_BUILD:
        import torch

        torch.set_num_threads(_THREADS_BEFORE_BUILD.pop())
    return path


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    from helpers import free_port, http_status, stop_group, wait_ready

    root = tmp_path_factory.mktemp("prefect-server")
    port, log = free_port(), root / "server.log"
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(PREFECT_HOME=str(root / "home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "prefect"), "server", "start",
                             "--host", "127.0.0.1", "--port", str(port), "--analytics-off"], env=env,
                            start_new_session=True, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        wait_ready("prefect server", lambda: http_status(f"{api}/health") == 200, proc, log, 240)
        yield {"api": api, "log": log}
    finally:
        stop_group(proc)


def _start_tiny_build(log) -> subprocess.Popen | None:
    """Start building the tiny model in a background process where it is not cached yet (None where it is). It
    holds the build lock, so `tiny_model_path()` in a test waits for it and then loads what it wrote; if it fails,
    that call builds the model itself and says what went wrong."""
    from sage_core.models import tiny_model_cached

    if tiny_model_cached():
        return None
    with open(log, "w") as out:  # stopped at the session's end (SIGTERM -> SystemExit: its temporary folder goes)
        return subprocess.Popen([sys.executable, "-c", _BUILD], stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ))


_BUILD = """import signal, sys
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
from sage_core.models import tiny_model_path
tiny_model_path()
"""
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1"... under pytest-xdist, else ""
_TINY_NEEDED = False  # whether a collected test needs the tiny model (no background build otherwise)
_THREADS_BEFORE_BUILD: list[int] = []  # this process's torch threads before the background build began


def _needs_tiny_model(item) -> bool:
    return "tiny_model_dir" in getattr(item, "fixturenames", ())


_FROZEN_AT: list[str] = []  # the module whose first test froze the heap


def pytest_runtest_setup(item):
    module = item.nodeid.split("::")[0]
    if _FROZEN_AT[-1:] != [module]:
        _FROZEN_AT[:] = [module]
        gc.collect()
        gc.freeze()


def pytest_collection_modifyitems(config, items):
    """The tests that need the tiny model run last, in file order, so that the others run while it builds. A
    module-scoped fixture that tests on both sides use starts twice (the cheap tokenizer fixtures do; the servers'
    and the model's fixtures are on one side)."""
    global _TINY_NEEDED
    items.sort(key=_needs_tiny_model)
    _TINY_NEEDED = bool(items) and _needs_tiny_model(items[-1])
    if _WORKER:
        _group_for_workers(items)


# pytest-xdist (make test: `-n 2 --dist loadscope`). Each worker runs whole groups: one test module's tests that do
# not need the tiny model, or those that do. A group runs on one worker, so its module-scoped fixtures start once.
# The groups go out in the order the workers' collection gives: those that do not need the tiny model first (the
# build takes a core meanwhile; gw0 starts it), and on each side the longest first, so that the workers end
# together (_LONG_FIRST: the modules that took longest, 20 s to 90 s a side, on 2 cores in one process).
# xdist's own `--dist loadgroup` reads groups from the test ids, which pytest 9.2 no longer lets a plugin change:
# here gw0 writes each test's group to a file and the controller's scheduler (pytest_xdist_make_scheduler) reads it.
_LONG_FIRST = ("test_flows", "test_dashboard", "test_trainer", "test_multiprocess", "test_e2e_prefect", "test_cli",
               "test_launch", "test_dashboard_browser", "test_hints", "test_services", "test_context")
_GROUPS_FILE = "SAGE_TEST_GROUPS_FILE"  # the variable naming the file; set by the controller for its workers


def _group_for_workers(items) -> None:
    def group(item) -> tuple[bool, int, str]:
        module = item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
        return _needs_tiny_model(item), _LONG_FIRST.index(module) if module in _LONG_FIRST else len(_LONG_FIRST), module

    items.sort(key=group)  # stable: a group's tests keep their file order
    if _WORKER == "gw0" and os.environ.get(_GROUPS_FILE):  # written before gw0 reports its collection
        names = {}
        for item in items:
            tiny, _, module = group(item)
            names[item.nodeid] = module + (" +tiny" if tiny else "")
        with open(os.environ[_GROUPS_FILE], "w") as f:
            json.dump(names, f)


def pytest_configure(config):
    if not _WORKER and getattr(config.option, "dist", "no") == "loadscope":  # the controller, before its workers
        fd, path = tempfile.mkstemp(prefix="sage-test-groups-", suffix=".json")
        os.close(fd)
        os.environ[_GROUPS_FILE] = path


def pytest_unconfigure(config):
    if not _WORKER and os.environ.get(_GROUPS_FILE):
        Path(os.environ.pop(_GROUPS_FILE)).unlink(missing_ok=True)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own; optional: xdist is not in every venv
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        """Scopes are the groups gw0 wrote (a test it did not name: its module), in gw0's order."""

        names: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.names is None:  # read once every worker has reported its collection
                with open(os.environ[_GROUPS_FILE]) as f:
                    self.names = json.loads(f.read() or "{}")
            return self.names.get(nodeid) or super()._split_scope(nodeid)

    config.option.loadscopereorder = False
    return Groups(config, log)
