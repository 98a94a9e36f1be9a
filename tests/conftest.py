"""Shared test setup (keep it small).

- Offline Hugging Face env (set at import time, before anything imports transformers/TRL).
- `sage_home` (session, autouse): SAGE_HOME -> a fresh per-session dir under pytest's tmp dir, so tests never
  touch the repo's .sage; SAGE_MODEL_CACHE -> $SAGE_TEST_CACHE when set (reused across runs: fast local reruns),
  else <that SAGE_HOME>/cache (the tiny model is then built once per session).
- `tiny_model_dir` (session): the warm-started tiny model dir (built on first use, about 3-4 minutes on 2 cores).
  Load your own copy from it (`load_policy("tiny")` or `from_pretrained(tiny_model_dir)`): never share a mutable
  model object between tests.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def sage_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("sage-home")
    saved = {k: os.environ.get(k) for k in ("SAGE_HOME", "SAGE_MODEL_CACHE")}
    os.environ["SAGE_HOME"] = str(home)
    os.environ["SAGE_MODEL_CACHE"] = os.environ.get("SAGE_TEST_CACHE") or str(home / "cache")
    yield home
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def tiny_model_dir(sage_home):
    from sage_core.models import tiny_model_path

    return tiny_model_path()
