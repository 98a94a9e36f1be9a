"""Shared test setup (keep it small).

- Offline Hugging Face env (set at import time, before anything imports transformers/TRL).
- `sage_home` (session, autouse): SAGE_HOME -> a fresh per-session dir under pytest's tmp dir, so tests never
  touch the repo's .sage; SAGE_MODEL_CACHE -> $SAGE_TEST_CACHE when set (reused across runs: fast local reruns),
  else <that SAGE_HOME>/cache (the tiny model is then built once per session).
- `tiny_model_dir` (session): the warm-started tiny model dir (about 3 minutes on 2 cores to build). Load your own
  copy from it (`load_policy("tiny")` or `from_pretrained(tiny_model_dir)`): never share a mutable model object
  between tests. A test or fixture that needs the tiny model must ask for this fixture: where the model is not
  cached yet, `sage_home` starts building it in a background process and the tests that ask for it run last
  (`pytest_collection_modifyitems`), so the others run while it builds.
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
import os
import subprocess
import sys

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
    saved = {k: os.environ.get(k) for k in ("SAGE_HOME", "SAGE_MODEL_CACHE")}
    os.environ["SAGE_HOME"] = str(home)
    os.environ["SAGE_MODEL_CACHE"] = os.environ.get("SAGE_TEST_CACHE") or str(home / "cache")
    builder = _start_tiny_build(home / "tiny-build.log") if _TINY_NEEDED else None
    if builder is not None:  # the tests beside the build compute on one thread, until tiny_model_dir gives it back
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
