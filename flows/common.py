"""Pieces shared by the flows: run folders, the train/evaluate tasks, Prefect progress, and result rows.

Heavy imports (torch, transformers via sage_core.train/evaluate) happen inside the tasks, so importing the flows
(serve, `prefect deploy`, tests) stays fast.

Reliability:
- `train_task` retries transient failures; every attempt calls `train(..., resume=True)` on the same output dir
  (so it continues from the last `checkpoint-*`) and logs into the same MLflow run (its id is kept in
  `<output_dir>/mlflow_run_id`).
- Results are cached by Prefect on their inputs (spec, output dir, MLflow run id, code version): a flow re-run
  after a crash in evaluation does not train again. MLflow is the source of truth for "finished" (tag
  `sage.complete`), so the skip logic also holds when the Prefect database is new.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pandas as pd
from prefect import get_run_logger, task
from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE
from transformers import TrainerCallback

from sage_core import tracking
from sage_core.data import heldout_name, slug
from sage_core.spec import RunSpec, recorded_spec

SUMMARY_KEYS = ("never_solved", "never_solved_no_hint", "frac_collapsed", "frac_rescued", "rollouts", "rescued",
                "prompts_seen", "reward", "train_seconds", "gen_tokens", "train_tokens", "open_groups")
NOT_TRANSIENT = (ValueError, TypeError, KeyError, ImportError, NotImplementedError, AssertionError,
                 FileNotFoundError)


# ----------------------------------------------------------------------------------------------- paths
def runs_root() -> Path:
    return tracking.sage_home() / "runs"


def experiment_dir(experiment: str) -> Path:
    """`<SAGE_HOME>/runs/<slug of experiment>`, with a hash of the name after it where the name is not its own slug
    (capitals, `_`, spaces): two experiments of one slug ("sage_v2", "sage-v2") do not share run folders, where
    the folder's `mlflow_run_id` would reopen the other experiment's run."""
    name = slug(experiment)
    if name != experiment:
        name += "-" + hashlib.sha256(experiment.encode()).hexdigest()[:8]
    return runs_root() / name


def experiment_folder(experiment: str, name: str) -> Path:
    """`experiment_dir(experiment) / name`, or the folder a version before the hash gave it (`<slug>/name`) where only
    that one is there and its `mlflow_run_id` names a run of this experiment: a run or study started before resumes
    there (a new folder would start it over, its MLflow run left as it was)."""
    new, old = experiment_dir(experiment) / name, runs_root() / slug(experiment) / name
    if old == new or new.exists() or not (rid := tracking.read_run_id(old)):
        return new
    try:
        was = tracking.run_experiment_name(rid)
    except Exception:  # noqa: BLE001 - a run no longer there, a store not reachable: the new folder
        return new
    return old if was == experiment else new


def run_dir(experiment: str, label: str, spec: RunSpec, fresh: bool = False) -> Path:
    """`<SAGE_HOME>/runs/<experiment>/<label>-<spec_key>` (experiment_dir): the same spec resumes in the same folder.
    `fresh` adds a timestamp and this process's id (force a new run: two started in one second get two)."""
    name = f"{slug(label)}-{spec.key()}"
    if fresh:
        name += time.strftime("-%Y%m%d-%H%M%S") + f"-{os.getpid()}"
        return experiment_dir(experiment) / name
    return experiment_folder(experiment, name)


def folder_for(experiment: str, label: str, spec: RunSpec, force: bool = False) -> Path:
    """The folder a flow trains `spec` in: run_dir's, where that spec resumes; a new one (fresh) with `force`, or
    where the folder holds a run whose spec.json records another spec (resumed there by hand with, say, max_steps
    changed: resuming it under this spec would report that run's model, trained for other steps, as this one's)."""
    out = run_dir(experiment, label, spec, fresh=force)
    recorded = recorded_spec(out)
    if recorded is None:  # none (a new folder), or unreadable: sage train's own check decides
        return out
    # the URL of the vLLM server a launch starts is written into the spec it records: not another spec
    recorded = recorded.model_copy(update={"vllm_server_base_url": spec.vllm_server_base_url})
    return run_dir(experiment, label, spec, fresh=True) if recorded.key() != spec.key() else out


def end_status(error: BaseException) -> str:
    """The MLflow status of a run a flow ends by `error`: KILLED when it was stopped (Ctrl-C; a flow run cancelled
    in Prefect, or its worker shut down, reaches the flow as TerminationSignal), FAILED otherwise."""
    from prefect.exceptions import ExternalSignal

    return "KILLED" if isinstance(error, ExternalSignal) else tracking.end_status(error)


def end_run(run_id: str, error: BaseException, logger) -> None:
    """End MLflow run `run_id` by `error` (end_status), in the `except` that raises `error` next: a store still
    locked after tracking's retries (TrackingError) is a warning, and the flow run fails with `error` (an eval table
    the same lock refused says where its rows are kept), not with that."""
    try:
        tracking.finish_run(run_id, end_status(error))
    except tracking.TrackingError as why:
        logger.warning("%s", why)


@contextlib.contextmanager
def run_folder_lock(out: Path, label: str, logger):
    """Hold an exclusive lock on run folder `out` (`.<name>.lock` beside it) while this flow run trains there: a
    second flow run of the same spec (serve --limit > 1, several workers on one SAGE_HOME) waits for the first
    instead of training into the same folder and MLflow run at once. The kernel drops it when the process dies."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("%s: %s is being trained by another flow run; waiting for it", label, out)
            fcntl.flock(fh, fcntl.LOCK_EX)
        except OSError as e:  # a file system that does not lock files (as sage_core.spec.run_folder_lock): unheld
            logger.warning("%s: %s is not held against a second flow run: its file system does not lock files (%s)",
                           label, out, e.strerror or e)
        yield


def code_version() -> str:
    return tracking.git_commit()


# ----------------------------------------------------------------------------------------------- benchmarks
def default_benchmarks(spec: RunSpec) -> dict[str, Any]:
    """The held-out no-hint eval set of a spec (`sage_core.data.eval_rows`) as {name: rows}."""
    from sage_core.data import eval_rows

    rows = eval_rows(spec)
    rows = rows.to_list() if hasattr(rows, "to_list") else list(rows)
    return {heldout_name(spec): rows}


def resolve_benchmarks(spec: RunSpec, benchmarks: dict[str, str] | None) -> dict[str, Any]:
    """User benchmark files {name: path} read into rows, else the spec's held-out set. The rows are formatted as the
    spec's training rows (the spec's model decides the system turn) and, being the eval task's inputs, key its
    cache by their content: a file changed under the same name is evaluated again."""
    from sage_core.data import load_benchmark, system_prompt_for

    if not benchmarks:
        return default_benchmarks(spec)
    tracking.check_benchmark_names(benchmarks)  # before any eval: their MLflow metrics would overwrite each other
    out: dict[str, Any] = {}
    for name, path in benchmarks.items():
        p = Path(path).expanduser()
        if not p.is_absolute():
            p = tracking.REPO_ROOT / p if (tracking.REPO_ROOT / p).exists() else p.resolve()
        if not p.exists():
            raise FileNotFoundError(f"benchmark {name!r}: {path} does not exist")
        out[name] = load_benchmark(str(p), system_prompt=system_prompt_for(spec)).to_list()
    return out


# ----------------------------------------------------------------------------------------------- progress
class PrefectProgressCallback(TrainerCallback):
    """Training progress in the Prefect UI: a log line per logged step and a progress artifact."""

    def __init__(self, total_steps: int, label: str, every: int = 1):
        self.total = max(1, total_steps)
        self.label = label
        self.every = max(1, every)
        self.artifact_id = None
        self.logger = get_run_logger()

    def _progress(self, step: int) -> float:
        return round(min(100.0, 100.0 * step / self.total), 1)

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        try:
            from prefect.artifacts import create_progress_artifact

            self.artifact_id = create_progress_artifact(self._progress(state.global_step),
                                                        description=f"training {self.label}")
        except Exception as e:  # noqa: BLE001 - progress is cosmetic
            self.logger.debug("no progress artifact: %s", e)
        self.logger.info("training %s: step %d/%d", self.label, state.global_step, self.total)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or state.global_step % self.every:
            return
        keys = ("reward", "sage/frac_collapsed", "sage/frac_rescued", "sage/rollouts", "loss")
        shown = " ".join(f"{k}={logs[k]:.3g}" for k in keys if isinstance(logs.get(k), (int, float)))
        if not shown:
            return
        self.logger.info("%s step %d/%d %s", self.label, state.global_step, self.total, shown)
        if self.artifact_id is not None:
            try:
                from prefect.artifacts import update_progress_artifact

                update_progress_artifact(self.artifact_id, self._progress(state.global_step))
            except Exception:  # noqa: BLE001
                pass

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.artifact_id is not None:
            try:
                from prefect.artifacts import update_progress_artifact

                update_progress_artifact(self.artifact_id, 100.0)
            except Exception:  # noqa: BLE001
                pass


# ----------------------------------------------------------------------------------------------- tasks
def is_transient(task, task_run, state) -> bool:
    """Retry unless the failure is a programming/configuration error that a retry cannot fix."""
    try:
        state.result()
    except NOT_TRANSIENT:
        return False
    except Exception:  # noqa: BLE001
        return True
    return True


def wants_accelerate(spec: RunSpec, launcher: str) -> bool:
    if launcher == "accelerate":
        return True
    if launcher == "local":
        return False
    return bool(spec.use_vllm)  # the GPU presets


def _train_local(spec: RunSpec, out: Path, run_id: str, label: str) -> dict[str, Any]:
    from sage_core.train import train

    cb = tracking.MlflowTrackingCallback(run_id=run_id, output_dir=out)
    total = spec.max_steps * getattr(spec, "updates_per_generation", 1)
    result = train(spec, out, callbacks=[cb, PrefectProgressCallback(total, label)], resume=True)
    if cb.checkpoint_logged is None and Path(result.checkpoint_dir).is_dir():
        tracking.log_checkpoint(result.checkpoint_dir, run_id)
    return {"checkpoint_dir": str(result.checkpoint_dir), "global_step": int(result.global_step),
            "wall_seconds": float(result.wall_seconds), "summary": dict(result.summary)}


def _train_accelerate(spec: RunSpec, out: Path, run_id: str) -> dict[str, Any]:
    """GPU presets: `accelerate launch` (sage_core.launch); the ranks log live when their `sage train` picks up
    `$SAGE_MLFLOW_RUN_ID` (tracking.make_callback); otherwise the history is logged here afterwards."""
    logger = get_run_logger()
    try:
        from sage_core import launch as launcher
    except ImportError as e:  # pragma: no cover - launch.py ships with sage_core
        raise NotImplementedError(f"GPU launch needs sage_core.launch: {e}") from e
    if not launcher.visible_gpus():
        raise RuntimeError(f"spec {spec.model} uses vLLM / accelerate but no GPU is visible on this worker")
    env = {**os.environ, "SAGE_MLFLOW_RUN_ID": run_id, "SAGE_OUTPUT_DIR": str(out),
           "MLFLOW_TRACKING_URI": tracking.tracking_uri(), "SAGE_HOME": str(tracking.sage_home())}
    t0 = time.perf_counter()
    res = launcher.launch(spec, out, log=logger.info, env=env, check=True, mlflow_run_id=run_id)
    wall = time.perf_counter() - t0
    result = res.result or {}
    ckpt = Path(result.get("checkpoint_dir") or out / "final")

    def log() -> None:
        if "reward" not in tracking.client().get_run(run_id).data.metrics and result.get("log_history"):
            tracking.log_history(result["log_history"], run_id)
        tracking.MlflowTrackingCallback(run_id=run_id, output_dir=out).upload_tracker_files()
        if ckpt.is_dir() and not tracking.has_artifact(run_id, "checkpoint"):
            tracking.log_checkpoint(ckpt, run_id)

    tracking.retry_locked(log, run_id, "the training's history, tracker files and model", lambda: f"they are in {out}, "
                          "and the same training run again (it trains nothing more) logs them")
    summary = dict(result.get("summary") or {})
    return {"checkpoint_dir": str(ckpt), "global_step": int(result.get("global_step") or 0),
            "wall_seconds": float(result.get("wall_seconds") or wall), "summary": summary}


@task(name="train", retries=2, retry_delay_seconds=[5, 30], retry_condition_fn=is_transient,
      cache_policy=INPUTS + TASK_SOURCE, persist_result=True, task_run_name="train-{label}")
def train_task(spec: RunSpec, output_dir: str, run_id: str, label: str, launcher: str = "auto",
               code: str = "") -> dict[str, Any]:
    """Train (or continue training) `spec` in `output_dir`, logging into MLflow run `run_id`."""
    logger = get_run_logger()
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    from sage_core.train import last_checkpoint

    ckpt = last_checkpoint(out)
    logger.info("train %s (%s, hints %s) -> %s%s", label, spec.method, spec.hint_source, out,
                f", resuming from {ckpt.name}" if ckpt is not None else "")
    tracking.client().update_run(run_id, status="RUNNING")
    if wants_accelerate(spec, launcher):
        res = _train_accelerate(spec, out, run_id)
    else:
        res = _train_local(spec, out, run_id, label)
    summary = {k: v for k, v in res["summary"].items() if isinstance(v, (int, float))}
    summary["wall_seconds"] = res["wall_seconds"]
    summary["global_step"] = res["global_step"]
    tracking.log_summary(summary, run_id, step=res["global_step"])
    logger.info("trained %s: %d steps in %.1fs; %s", label, res["global_step"], res["wall_seconds"],
                ", ".join(f"{k}={summary[k]:.3g}" for k in SUMMARY_KEYS if k in summary))
    res["summary"] = summary
    return res


def model_files(model_ref: str, gguf_file: str | None = None) -> str:
    """What the model's name leaves out, for the eval cache's key: each file of a local model (its folder, or its
    file) by path, size and mtime (stat calls, nothing read), 'tiny' and 'smollm2' as the files they load; the commit
    the hub cache resolves an HF id to now; '' where neither is known (a model not cached yet). A model folder
    written again under its path (another export, a rebuilt tiny model) scored its old 'before' for 7 days."""
    from sage_core.models import ModelNotFound, smollm2_gguf, tiny_model_cached

    if model_ref == "tiny":
        path = tiny_model_cached()
    elif model_ref == "smollm2":
        try:
            path = smollm2_gguf()
        except ModelNotFound:
            return ""
    else:
        path = Path(model_ref).expanduser()
    if path is not None and path.exists():
        files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
        if gguf_file and path.is_dir():
            files = [f for f in files if f.name == gguf_file or f.suffix.lower() != ".gguf"]
        stats = [(str(f.relative_to(path)) if path.is_dir() else f.name, st.st_size, st.st_mtime_ns)
                 for f in files for st in [f.stat()]]
        return hashlib.sha256(repr(stats).encode()).hexdigest()[:16]
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(model_ref, "config.json")
    except Exception:  # noqa: BLE001 - not a hub id ('org/name' with odd characters): nothing known of it
        return ""
    return Path(hit).parent.name if isinstance(hit, str) else ""  # .../snapshots/<commit>/config.json


@task(name="evaluate", retries=1, retry_delay_seconds=10, retry_condition_fn=is_transient,
      cache_policy=(INPUTS - "label") + TASK_SOURCE, persist_result=True, cache_expiration=timedelta(days=7),
      task_run_name="evaluate-{label}")
def evaluate_task(model_ref: str, benchmarks: dict[str, Any], k: int, temperature: float, top_p: float,
                  max_new_tokens: int, use_vllm: bool, seed: int = 0, gguf_file: str | None = None,
                  label: str = "model", code: str = "", files: str = "") -> list[dict]:
    """No-hint avg@k / pass@k of `model_ref` on each benchmark (rows: benchmark, k, avg_at_k, pass_at_k, n_prompts).
    Cached by every input but `label`: the model's name and its `files` (model_files), the benchmarks' rows, the
    sampling settings and the code's version."""
    from sage_core.evaluate import evaluate

    logger = get_run_logger()
    t0 = time.perf_counter()
    kw: dict[str, Any] = {"seed": seed}
    if gguf_file:
        kw["gguf_file"] = gguf_file
    df = evaluate(model_ref, benchmarks, k=k, temperature=temperature, top_p=top_p,
                  max_new_tokens=max_new_tokens, use_vllm=use_vllm, **kw)
    rows = df.to_dict(orient="records")
    for r in rows:
        logger.info("eval %s on %s: avg@%d=%.3f pass@%d=%.3f (%d prompts)", label, r["benchmark"], int(r["k"]),
                    r["avg_at_k"], int(r["k"]), r["pass_at_k"], int(r["n_prompts"]))
    logger.info("evaluated %s in %.1fs", label, time.perf_counter() - t0)
    return rows


def eval_settings(spec: RunSpec) -> dict[str, Any]:
    return dict(k=spec.eval_k, temperature=spec.eval_temperature, top_p=spec.eval_top_p,
                max_new_tokens=spec.max_completion_length, use_vllm=spec.use_vllm, seed=spec.seed)


def benchmark_hash(rows: list[dict]) -> str:
    """A hash of a benchmark's rows as they are scored (a file's content as read, or the held-out set's rows): the
    eval table's `benchmark_hash`, which tells two files of one name and one number of rows apart."""
    text = json.dumps(rows, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def eval_table(rows: list[dict], spec: RunSpec, benchmarks: dict[str, Any]) -> pd.DataFrame:
    """Eval rows as logged into a run's eval.parquet: with the sampling settings they were taken at (temperature,
    top_p; k and n_prompts are columns already) and the hash of the rows of the benchmark scored (`benchmarks`, the
    rows given to the evaluation: benchmark_hash), so that a before/after pair can be checked to share them and a
    benchmark file changed under its name is scored again (train_flow.missing_evals)."""
    hashes = {str(name): benchmark_hash(b) for name, b in benchmarks.items()}
    df = pd.DataFrame(rows).assign(temperature=spec.eval_temperature, top_p=spec.eval_top_p)
    return df.assign(benchmark_hash=df["benchmark"].astype(str).map(hashes)) if "benchmark" in df.columns else df


def run_eval(model_ref: str, benchmarks: dict[str, Any], spec: RunSpec, label: str, cache: bool,
             gguf_file: str | None = None) -> list[dict]:
    """Evaluate through the task; `cache=False` for models that may change under the same name (checkpoints). A
    cached result is one of the same model files (model_files), benchmark rows and settings."""
    if cache:
        t, files = evaluate_task, model_files(model_ref, gguf_file)
    else:
        t, files = evaluate_task.with_options(cache_policy=NO_CACHE, persist_result=False), ""
    return t(model_ref, benchmarks, label=label, code=code_version(), gguf_file=gguf_file, files=files,
             **eval_settings(spec))


# ----------------------------------------------------------------------------------------------- result rows
def _nan(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def eval_means(eval_df, when: str, k: int | None = None, benchmarks=None) -> tuple[float, float]:
    """(mean avg@k, mean pass@k) over benchmarks for `when`, at `k` where the table has rows at k, of `benchmarks`
    (names) where it has rows of them (a run evaluated on others by an earlier call); where it has both 'before' and
    'after' rows there, over the benchmarks that have both (a pair compares the same benchmarks)."""
    if eval_df is None or len(eval_df) == 0:
        return float("nan"), float("nan")
    if benchmarks is not None and eval_df["benchmark"].isin(list(benchmarks)).any():
        eval_df = eval_df[eval_df["benchmark"].isin(list(benchmarks))]
    if k is not None and (eval_df["k"] == k).any():
        eval_df = eval_df[eval_df["k"] == k]
    d = eval_df[eval_df["when"] == when]
    paired = set(eval_df.loc[eval_df["when"] == "before", "benchmark"]) & set(
        eval_df.loc[eval_df["when"] == "after", "benchmark"])
    if paired:
        d = d[d["benchmark"].isin(paired)]
    if len(d) == 0:
        return float("nan"), float("nan")
    return float(d["avg_at_k"].mean()), float(d["pass_at_k"].mean())


def row_from_run(run_id: str, benchmarks=None) -> dict[str, Any]:
    """One result row of a training run, read back from MLflow (the same for fresh and skipped runs); its evals
    averaged over `benchmarks` (names: the ones this call asked for), else over all it has."""
    run = tracking.client().get_run(run_id)
    m, t, p = run.data.metrics, run.data.tags, tracking.spec_values(run)  # a resumed run: its current fields
    k = int(p.get("sage.eval_k", "0") or 0) or None
    ev = tracking.load_eval(run_id)
    before_avg, before_pass = eval_means(ev, "before", k, benchmarks)
    after_avg, after_pass = eval_means(ev, "after", k, benchmarks)
    row: dict[str, Any] = {
        "variant": t.get("sage.variant") or t.get("mlflow.runName", run_id[:8]),
        "method": t.get("sage.method"),
        "hint_source": t.get("sage.hint_source"),
        "seed": int(p["sage.seed"]) if p.get("sage.seed", "").lstrip("-").isdigit() else None,
        "k": k,
        "avg_at_k_before": before_avg,
        "avg_at_k_after": after_avg,
        "pass_at_k_before": before_pass,
        "pass_at_k_after": after_pass,
    }
    for key in SUMMARY_KEYS + ("wall_seconds", "global_step"):
        row[key] = _nan(m.get(f"summary/{key}"))
    row.update(run_id=run_id, experiment_id=run.info.experiment_id, status=run.info.status,
               complete=tracking.is_complete(run), spec_key=t.get("sage.spec_key"))
    return row


def finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not math.isnan(v)
