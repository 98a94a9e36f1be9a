"""End to end, the way a user runs it: a real `prefect server start` on a free loopback port (the session's, from
tests/conftest.py), `python -m flows.serve` serving sage-train/tiny-cpu, `prefect deployment run ... --watch` from the
CLI, and the finished run found with `MlflowClient.search_runs` in a temp sqlite store. Bad parameters are refused at
creation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import http_status, stop_group, wait_ready

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TINY = ["--param", "max_steps=2", "--param", "num_prompts=4", "--param", "num_generations=4",
        "--param", "prompts_per_step=2", "--param", "eval_num_prompts=4", "--param", "eval_k=2"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, prefect_server, tiny_model_dir):
    """(env, tracking_uri, serve log): the sage-train/tiny-cpu deployment served from this repo against the
    session's real Prefect server (tests/conftest.py)."""
    root = tmp_path_factory.mktemp("e2e")
    api = prefect_server["api"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(PREFECT_HOME=str(root / "prefect"), PREFECT_API_URL=api, PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_RUNNER_POLL_FREQUENCY="2", PREFECT_CLI_COLORS="false", SAGE_HOME=str(root / "sage"),
               MLFLOW_TRACKING_URI=f"sqlite:///{root / 'mlflow.db'}", COLUMNS="250",
               SAGE_MODEL_CACHE=os.environ.get("SAGE_MODEL_CACHE", str(Path(tiny_model_dir).parent)))
    serve_log = root / "serve.log"
    serve = subprocess.Popen([sys.executable, "-m", "flows.serve", "--only", "sage-train", "--preset", "tiny-cpu"],
                             env=env, cwd=REPO, start_new_session=True, stdout=serve_log.open("w"),
                             stderr=subprocess.STDOUT)
    try:
        wait_ready("flows.serve", lambda: http_status(f"{api}/deployments/name/sage-train/tiny-cpu") == 200, serve,
                   serve_log, 180)
        yield env, env["MLFLOW_TRACKING_URI"], serve_log
    finally:
        stop_group(serve)


def _cli(env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "prefect"), *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_bad_parameter_is_rejected_with_the_field_name(served):
    env, _, _ = served
    for param, field in [("num_generations=1", "num_generations"), ("method=bogus", "method")]:
        r = _cli(env, "deployment", "run", "sage-train/tiny-cpu", "--param", param, timeout=120)
        out = r.stdout + r.stderr
        assert r.returncode != 0, out
        assert "Validation failed" in out and f"'{field}'" in out, out
    r = _cli(env, "deployment", "run", "sage-train/tiny-cpu", "--params", json.dumps({"spec": {"max_stepz": 2}}),
             timeout=120)
    assert r.returncode != 0 and "max_stepz" in r.stdout + r.stderr


def test_deployment_run_from_cli_logs_to_mlflow(served):
    from mlflow import MlflowClient

    env, uri, serve_log = served
    t0 = time.monotonic()
    r = _cli(env, "deployment", "run", "sage-train/tiny-cpu", *TINY, "--param", "experiment=e2e",
             "--param", "method=sage-light", "--param", "eval_every=1", "--watch", "--watch-timeout", "900",
             timeout=960)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out + "\n--- serve log ---\n" + serve_log.read_text()[-4000:]
    assert "COMPLETED" in out.upper(), out
    wall = time.monotonic() - t0

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("e2e")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`sage.kind` = 'train'")
    assert len(runs) == 1, runs
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.tags["sage.complete"] == "true"
    assert run.data.tags["sage.method"] == "sage-light" and run.data.tags["prefect.flow_run_id"]
    assert run.data.params["sage.max_steps"] == "2" and run.data.params["sage.num_generations"] == "4"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward")] == [1, 2]
    for key in ("sage/frac_collapsed", "summary/wall_seconds", "eval/before/synthetic-heldout/avg_at_2",
                "eval/after/synthetic-heldout/pass_at_2", "summary/eval_seconds"):
        assert key in run.data.metrics, sorted(run.data.metrics)
    # eval_every=1, a flow parameter like any RunSpec field: the no-hint curve of the held-out set, step by step
    during = client.get_metric_history(run.info.run_id, "eval/during/synthetic-heldout/avg_at_2")
    assert [m.step for m in during] == [1, 2] and all(0 <= m.value <= 1 for m in during)
    assert run.data.params["sage.eval_every"] == "1"
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"spec.json", "tracker", "eval", "checkpoint"} <= arts
    print(f"deployment run wall-clock {wall:.0f}s")
