"""MLflow tracking for SAGE runs: URIs, experiments, runs, `sage.*` params, and a Trainer callback.

Layout (docs/architecture.md, "MLflow layout"):
- tracking URI: `MLFLOW_TRACKING_URI`, else `sqlite:///<SAGE_HOME>/mlflow.db` (absolute path, so every process,
  whatever its working directory, writes the same store). `SAGE_HOME` defaults to `<repo>/.sage`.
- experiments are created with an explicit artifact location `<SAGE_HOME>/mlartifacts/<name>` (file URI) when the
  store is local, so the dashboard and the MLflow UI find artifacts without a server.
- run tags `sage.kind`, `sage.method`, `sage.hint_source`, `sage.model`, `sage.spec_key`, `git.commit`,
  `prefect.flow_run_id`; params `sage.<field>` for every RunSpec field; `spec.json` artifact.
- `MlflowTrackingCallback` logs the Trainer's numeric logs as metrics (step = global_step), uploads the per-prompt
  tracker files `tracker/step_*.parquet` (each once) and, at the end, the final checkpoint under `checkpoint/`.

Runs are addressed by id through `MlflowClient`, so logging works from any thread (Prefect tasks) and from the
process `accelerate launch` starts. A run is "complete" when its status is FINISHED and its tag `sage.complete`
is `true` (set by `finish_run`; reset to `false` whenever the run is reopened); a crashed run keeps its id in
`<output_dir>/mlflow_run_id` and is resumed.

A run reopened with another spec (a resumable field changed, e.g. max_steps 1 -> 2: sage_core.spec.RESUMABLE_FIELDS)
is made to describe what it trains: its `sage.spec_key` (and the other spec tags) and `spec.json` become the new
spec's, and as MLflow params cannot change once logged, each field whose value differs from its param `sage.<field>`
gets a tag `sage.resumed.<field>` = the new value (`spec_values` reads a run's fields with these applied).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import numbers
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote

from transformers import TrainerCallback

from .atomic import atomic_path, write_text_atomic

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    from mlflow.entities import Run

    from .spec import RunSpec

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_EXPERIMENT = "sage"
RUN_ID_FILE = "mlflow_run_id"
PENDING_FILE = "mlflow_pending.json"  # in an output dir: metric batches MLflow refused, sent by the next attempt
# a write of a run's results a locked sqlite store refuses is tried again for this many seconds in all (5, 10, 20, 40 s
# apart, beyond MLflow's own 20 s wait in each try): $SAGE_MLFLOW_LOCK_RETRY_SECONDS, 0 for one try (retry_locked).
# That wait is MLflow's `PRAGMA busy_timeout = 20000`, run at the start of each of its sessions (make_managed_session
# in mlflow.store.db.utils): it overrides a `?timeout=` in the URI, and no MLFLOW_SQLALCHEMYSTORE_* setting reaches it
LOCK_RETRY_ENV, LOCK_RETRY_SECONDS = "SAGE_MLFLOW_LOCK_RETRY_SECONDS", 75.0
UNLOGGED_DIR = "unlogged"  # <SAGE_HOME>/unlogged/<run id>/: results a store locked past the retries did not take
COMPLETE_TAG = "sage.complete"
# a token open_run tags the run it creates with: a try after a refused create_run (committed or not) finds that run
OPEN_TOKEN_TAG = "sage.open_token"
LAST_STEP_TAG = "sage.last_step"  # the step the run's model was trained to (set when training ends)
RESUMED_PREFIX = "sage.resumed."  # + field: the value of a field changed when the run was reopened
# when the run was last reopened (ms since the epoch, as MLflow's times): its start time stays the first attempt's
REOPENED_TAG = "sage.reopened_at"
# the seconds the run ran before its last reopening (its attempts' spans, not the time it was stopped): ran_seconds
RAN_BEFORE_TAG = "sage.ran_seconds_before_reopening"
SPEC_TAGS = ("sage.method", "sage.hint_source", "sage.model", "sage.spec_key")  # from the spec
EVAL_ARTIFACT = "eval/eval.parquet"
DROPPED_PROMPTS = "dropped_prompts.json"  # rows over max_prompt_length, left out of training (sage_core.train)
EVAL_COLUMNS = ["benchmark", "when", "k", "avg_at_k", "pass_at_k", "n_prompts"]
# checkpoint files that are training state, not the model: never uploaded under checkpoint/
_CHECKPOINT_SKIP = re.compile(r"^(optimizer\.pt|scheduler\.pt|scaler\.pt|rng_state.*\.pth|training_args\.bin)$")
_METRIC_BAD_CHARS = re.compile(r"[^0-9A-Za-z_\-\.\ :/]")
T = TypeVar("T")


# ----------------------------------------------------------------------------------------------- locations
def sage_home() -> Path:
    """`SAGE_HOME` (absolute), default `<repo>/.sage`; created on first use."""
    home = Path(os.environ.get("SAGE_HOME") or REPO_ROOT / ".sage").expanduser().resolve()
    home.mkdir(parents=True, exist_ok=True)
    return home


def tracking_uri() -> str:
    """`MLFLOW_TRACKING_URI` if set, else the absolute sqlite store `<SAGE_HOME>/mlflow.db`."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{sage_home() / 'mlflow.db'}"  # sqlite:////abs/path: four slashes = absolute


def shown_uri(uri: str | None = None) -> str:
    """The tracking URI (tracking_uri() by default) as logs and pages show it: a user and password in it
    (postgresql://u:p@db/mlflow, https://token@host) written ***, as they are no one's to read there."""
    return re.sub(r"(?<=//)[^/@?#]*@", "***@", uri or tracking_uri())


def artifact_root() -> Path:
    return sage_home() / "mlartifacts"


def is_local_store(uri: str | None = None) -> bool:
    """True when the tracking store is a database or path (not an MLflow server), so we choose artifact paths."""
    uri = uri or tracking_uri()
    return not re.match(r"^(https?|databricks|uc)(:|$)", uri)


def configure() -> str:
    """Point the fluent MLflow API at `tracking_uri()`; returns the URI."""
    import mlflow

    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    return uri


def client():
    from mlflow import MlflowClient

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # no tqdm bars in Prefect logs
    return MlflowClient(tracking_uri())


def _path_safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "default"


def get_or_create_experiment(name: str = DEFAULT_EXPERIMENT) -> str:
    """The id of experiment `name`, created (artifact location `<SAGE_HOME>/mlartifacts/<name>`) if missing."""
    from mlflow.exceptions import MlflowException

    c = client()
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            c.restore_experiment(exp.experiment_id)
        return exp.experiment_id
    location = (artifact_root() / _path_safe(name)).as_uri() if is_local_store() else None
    try:
        return c.create_experiment(name, artifact_location=location)
    except MlflowException:  # created concurrently by another process
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


# ----------------------------------------------------------------------------------------------- tags/params
def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def prefect_flow_run_id() -> str | None:
    """The id of the Prefect flow run we are in (only looked up when prefect is already imported)."""
    if "prefect" not in sys.modules:
        return os.environ.get("PREFECT__FLOW_RUN_ID")
    try:
        from prefect.runtime import flow_run

        return flow_run.get_id()
    except Exception:  # pragma: no cover - never let tracking break a run
        return None


def spec_params(spec: RunSpec) -> dict[str, str]:
    """`sage.<field>` -> value (as MLflow stores it) for every RunSpec field."""
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    return {f"sage.{k}": str(v)[:MAX_PARAM_VAL_LENGTH] for k, v in spec.model_dump().items()}


def run_tags(spec: RunSpec, kind: str, extra: Mapping[str, Any] | None = None) -> dict[str, str]:
    tags = {
        "sage.kind": kind,
        "sage.method": spec.method,
        "sage.hint_source": spec.hint_source if spec.uses_hints else "none",
        "sage.model": spec.model,
        "sage.spec_key": spec.key(),
        "git.commit": git_commit(),
    }
    frid = prefect_flow_run_id()
    if frid:
        tags["prefect.flow_run_id"] = frid
    tags.update({k: str(v) for k, v in (extra or {}).items() if v is not None})
    return tags


# ----------------------------------------------------------------------------------------------- runs
def open_run(spec: RunSpec, kind: str, experiment: str = DEFAULT_EXPERIMENT, run_name: str | None = None,
             parent_run_id: str | None = None, run_id: str | None = None,
             tags: Mapping[str, Any] | None = None) -> str:
    """Create a run (tags, `sage.*` params, spec.json), or reopen `run_id` (status RUNNING again). Returns its id.

    Nothing is made "active" in the fluent API: use the returned id (or `start_run` for the fluent form). A locked
    sqlite store is waited for (retry_locked), each try taking up where the last stopped: a run a refused try created
    is found by its OPEN_TOKEN_TAG, not made twice, and a reopened run is counted and timed once. A lock that
    outlasts the tries is a TrackingError naming the store, raised before anything is trained.
    """
    done: dict[str, Any] = {}  # what the tries so far did: the run read, the run created
    token = uuid.uuid4().hex

    def keep() -> str:
        made = f" (run {done['rid']}, created, is left unfinished)" if "rid" in done else ""
        return f"nothing is trained yet{made}: run the same command again once the store is free"

    return retry_locked(lambda: _open_run(spec, kind, experiment, run_name, parent_run_id, run_id, tags, token,
                                          done),
                        run_id or f"(new, experiment {experiment!r})", "its reopening" if run_id else "its creation",
                        keep)


def _open_run(spec: RunSpec, kind: str, experiment: str, run_name: str | None, parent_run_id: str | None,
              run_id: str | None, tags: Mapping[str, Any] | None, token: str, done: dict[str, Any]) -> str:
    """One try of open_run; `done` holds what earlier tries did, so that trying again repeats no count or run."""
    from mlflow.entities import Param, RunTag
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import MAX_PARAMS_TAGS_PER_BATCH

    c = client()
    if run_id:
        if "run" not in done:  # read once: a retry sets the tags the first try meant to (its resumed count, its time)
            try:
                done["run"] = c.get_run(run_id)
            except MlflowException as e:
                if _store_locked(e):
                    raise
                done["run"] = None
            done["reopened"] = str(int(time.time() * 1000))
        run = done["run"]
        if run is not None and run.info.lifecycle_stage != "deleted":
            c.update_run(run_id, status="RUNNING")
            # complete again only when this attempt finishes
            reopen = {COMPLETE_TAG: "false", "sage.resumed": str(int(run.data.tags.get("sage.resumed", "0")) + 1)}
            frid = prefect_flow_run_id()
            if frid:
                reopen["prefect.flow_run_id"] = frid
            ran = ran_seconds(run)  # up to this reopening; none where an earlier one did not record it
            if ran is not None:
                reopen[RAN_BEFORE_TAG] = f"{ran:.3f}"
            reopen[REOPENED_TAG] = done["reopened"]  # last_active
            c.log_batch(run_id, tags=[RunTag(k, v) for k, v in reopen.items()])
            if LAST_STEP_TAG in run.data.tags:  # set again when this attempt ends (killed: at the step it reached)
                _delete_tag(run_id, LAST_STEP_TAG)
            _respec_run(run, spec, kind)
            return run_id
        if not done.get("warned"):
            log.warning("MLflow run %s not found in %s; starting a new run", run_id, shown_uri())
            done["warned"] = True

    exp_id = get_or_create_experiment(experiment)
    if "rid" not in done and done.get("creating"):  # a refused create_run may have committed all the same
        made = find_runs(experiment, extra_filter=f"tags.`{OPEN_TOKEN_TAG}` = '{token}'")
        if made:
            done["rid"] = made[0].info.run_id
    if "rid" not in done:
        all_tags = {**run_tags(spec, kind, tags), OPEN_TOKEN_TAG: token}
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        if run_name:
            all_tags["mlflow.runName"] = run_name
        all_tags.setdefault("mlflow.source.git.commit", all_tags["git.commit"])
        done["creating"] = True
        done["rid"] = c.create_run(exp_id, run_name=run_name, tags=all_tags).info.run_id
    rid = done["rid"]
    params = [Param(k, v) for k, v in spec_params(spec).items()]  # logged again by a retry: the same values
    for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
        c.log_batch(rid, params=params[i:i + MAX_PARAMS_TAGS_PER_BATCH], tags=[] if i else [RunTag(COMPLETE_TAG,
                                                                                               "false")])
    c.log_dict(rid, spec.model_dump(), "spec.json")
    return rid


def _delete_tag(run_id: str, key: str) -> None:
    """Delete tag `key` of run `run_id`, which a try a locked store refused after it may have deleted already."""
    from mlflow.exceptions import MlflowException

    try:
        client().delete_tag(run_id, key)
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise


def spec_values(run: Run) -> dict[str, str]:
    """`sage.<field>` -> the value the run trains with, as MLflow stores it: its param `sage.<field>`, or its tag
    `sage.resumed.<field>` where the run was reopened with that field changed (a logged param cannot change)."""
    values = {k: v for k, v in run.data.params.items() if k.startswith("sage.")}
    values.update({"sage." + k[len(RESUMED_PREFIX):]: v for k, v in run.data.tags.items()
                   if k.startswith(RESUMED_PREFIX) and len(k) > len(RESUMED_PREFIX)})
    return values


def _respec_run(run: Run, spec: RunSpec, kind: str) -> list[str]:
    """Make reopened `run` describe `spec` when it was opened (created or last reopened) with another one: the spec
    tags (`sage.spec_key`, ...), `spec.json`, a tag `sage.resumed.<field>` for each field whose param differs from
    `spec` (dropped when the field is back to its param's value) and params for fields the run has none of.
    Returns the changed fields as `field old -> new`; an unchanged spec changes nothing."""
    from mlflow.entities import Param, RunTag
    from mlflow.utils.validation import MAX_PARAMS_TAGS_PER_BATCH

    tags, params = run.data.tags, run.data.params
    current, new = spec_values(run), spec_params(spec)
    changed = [f"{k[len('sage.'):]} {current.get(k, '?')} -> {v}" for k, v in new.items() if current.get(k) != v]
    if tags.get("sage.spec_key") == spec.key() and not changed:  # fields left out of the key may still differ
        return []
    rid = run.info.run_id
    set_tags = {k: v for k, v in run_tags(spec, kind).items() if k in SPEC_TAGS}
    add_params: list[Param] = []
    drop: list[str] = []
    for k, v in new.items():
        tag = RESUMED_PREFIX + k[len("sage."):]
        if k not in params:  # a field added to RunSpec after the run was created
            add_params.append(Param(k, v))
        elif params[k] != v:
            set_tags[tag] = v
        elif tag in tags:  # back to the value it was created with
            drop.append(tag)
    items = [RunTag(k, v) for k, v in set_tags.items()]
    c = client()
    for i in range(0, max(len(items), len(add_params)), MAX_PARAMS_TAGS_PER_BATCH):
        c.log_batch(rid, params=add_params[i:i + MAX_PARAMS_TAGS_PER_BATCH],
                    tags=items[i:i + MAX_PARAMS_TAGS_PER_BATCH])
    for tag in drop:
        _delete_tag(rid, tag)
    c.log_dict(rid, spec.model_dump(), "spec.json")
    log.info("MLflow run %s reopened with another spec (%s -> %s): %s", rid, tags.get("sage.spec_key"),
             spec.key(), "; ".join(changed) or "no field changed")
    return changed


def end_status(error: BaseException) -> str:
    """The MLflow status of a run ended by `error`: KILLED when it was stopped (Ctrl-C's KeyboardInterrupt, or
    SIGTERM, which `sage train` and `sage launch` raise as sage_core.cli.Terminated, a KeyboardInterrupt), FAILED
    otherwise."""
    return "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"


def finish_run(run_id: str, status: str = "FINISHED", complete: bool | None = None) -> None:
    """Terminate a run; `complete` (default: status == FINISHED) marks it done so it is skipped on re-runs. Tried
    again while a locked store refuses it (retry_locked)."""
    if complete is None:
        complete = status == "FINISHED"

    def end() -> None:
        c = client()
        c.set_tag(run_id, COMPLETE_TAG, "true" if complete else "false")
        c.set_terminated(run_id, status=status)

    retry_locked(end, run_id, f"its end ({status})",
                 lambda: "the run is left as it was: the same command run again reopens and ends it")


@contextlib.contextmanager
def start_run(spec: RunSpec, kind: str, experiment: str = DEFAULT_EXPERIMENT, run_name: str | None = None,
              parent_run_id: str | None = None, run_id: str | None = None,
              tags: Mapping[str, Any] | None = None) -> Iterator[Run]:
    """Context manager: create (or resume `run_id`) a run and make it the fluent active run.

    Yields the `mlflow.entities.Run`. On exit the run is FINISHED (and marked complete), or FAILED on an
    exception (KILLED on KeyboardInterrupt) and can be resumed by id.
    """
    import mlflow

    configure()
    rid = open_run(spec, kind, experiment, run_name, parent_run_id, run_id, tags)
    active = mlflow.active_run()
    mlflow.start_run(run_id=rid, nested=active is not None)
    status = "FINISHED"
    try:
        yield client().get_run(rid)
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    except BaseException:
        status = "FAILED"
        raise
    finally:
        run = mlflow.active_run()
        if run is not None and run.info.run_id == rid:
            mlflow.end_run(status=status)
        client().set_tag(rid, COMPLETE_TAG, "true" if status == "FINISHED" else "false")


def active_run_id(run_id: str | None = None) -> str:
    if run_id:
        return run_id
    import mlflow

    run = mlflow.active_run()
    if run is None:
        raise RuntimeError("no MLflow run id given and no active run")
    return run.info.run_id


def read_run_id(output_dir: str | Path) -> str | None:
    p = Path(output_dir) / RUN_ID_FILE
    if p.is_file():
        rid = p.read_text().strip()
        return rid or None
    return None


def write_run_id(output_dir: str | Path, run_id: str) -> None:
    p = Path(output_dir)
    p.mkdir(parents=True, exist_ok=True)
    write_text_atomic(p / RUN_ID_FILE, run_id + "\n")


def run_experiment_name(run_id: str) -> str:
    """The name of the experiment MLflow run `run_id` is in."""
    c = client()
    return c.get_experiment(c.get_run(run_id).info.experiment_id).name


def resume_or_create_run(spec: RunSpec, kind: str, output_dir: str | Path,
                         experiment: str | None = DEFAULT_EXPERIMENT, run_name: str | None = None,
                         parent_run_id: str | None = None,
                         tags: Mapping[str, Any] | None = None) -> tuple[str, bool]:
    """The run recorded in `<output_dir>/mlflow_run_id` reopened (after a crash), or a new one recorded there, in
    `experiment` (None: DEFAULT_EXPERIMENT). A reopened run stays in the experiment it was created in (MLflow cannot
    move a run): where that is not `experiment` (when one is given) a warning says so.

    Returns (run_id, resumed).
    """
    previous = read_run_id(output_dir)
    rid = open_run(spec, kind, experiment or DEFAULT_EXPERIMENT, run_name, parent_run_id, run_id=previous, tags=tags)
    if rid != previous:
        write_run_id(output_dir, rid)
    elif experiment is not None and (name := run_experiment_name(rid)) != experiment:
        log.warning("MLflow run %s, resumed from %s, is in experiment %r, not %r: a resumed run logs into the "
                    "run it started (MLflow cannot move a run to another experiment); for a run in %r, train in "
                    "another output dir (or start over: --no-resume)", rid, output_dir, name, experiment,
                    experiment)
    return rid, rid == previous


def is_complete(run: Run) -> bool:
    return run.info.status == "FINISHED" and run.data.tags.get(COMPLETE_TAG) == "true"


def last_active(run: Run) -> int:
    """When `run` was last seen active (ms since the epoch): the latest of its start, its end and its last reopening
    (REOPENED_TAG). A run reopened keeps its first start, and while RUNNING still carries the end of its earlier
    attempt (MLflow cannot clear it): ranked by those, a study run again was outranked by one that ended after that
    attempt. Not 'now' for a RUNNING run: a process killed outright (SIGKILL, `make down` mid-flow) leaves its run
    RUNNING for good, and it would outrank every run after it. A run reopened by a version without the tag: its
    earlier end, the latest time known of it."""
    reopened = run.data.tags.get(REOPENED_TAG, "")
    return max(run.info.start_time or 0, run.info.end_time or 0, int(reopened) if reopened.isdigit() else 0)


def ran_seconds(run: Run) -> float | None:
    """The seconds `run` ran up to its latest end: its attempts' spans (its start, and each reopening, to the end that
    followed) summed. A run stopped and resumed later keeps its first start, so its start to its end counts the time
    it was not running too. An attempt that recorded no end (killed outright: left RUNNING, or ended without one)
    counts to its last metric point, if it logged any (each key's latest point, with its time). None when unknown:
    the run was reopened by a version that did not record RAN_BEFORE_TAG. The dashboard's runs page reads the tags
    with the same rule (dashboards.data.ran_seconds)."""
    tags = run.data.tags
    reopened = str(tags.get(REOPENED_TAG, ""))
    if reopened.isdigit():
        try:
            before = float(tags[RAN_BEFORE_TAG])
        except (KeyError, ValueError):
            return None
        if not math.isfinite(before):
            return None
        opened = int(reopened)
    else:
        before, opened = 0.0, run.info.start_time or 0
    end = run.info.end_time
    if run.info.status == "RUNNING" or not end or end < opened:
        end = max((m.timestamp for m in getattr(run.data, "_metric_objs", None) or []), default=opened)
    return before + max(0, end - opened) / 1000


def find_runs(experiment: str = DEFAULT_EXPERIMENT, *, spec_key: str | None = None, kind: str | None = None,
              parent_run_id: str | None = None, complete: bool | None = None,
              extra_filter: str | None = None) -> list[Run]:
    """Runs of `experiment` matching the given tags, newest first."""
    c = client()
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return []
    clauses = []
    if spec_key:
        clauses.append(f"tags.`sage.spec_key` = '{spec_key}'")
    if kind:
        clauses.append(f"tags.`sage.kind` = '{kind}'")
    if parent_run_id:
        clauses.append(f"tags.`mlflow.parentRunId` = '{parent_run_id}'")
    if complete:
        clauses.append(f"tags.`{COMPLETE_TAG}` = 'true' and attributes.status = 'FINISHED'")
    if extra_filter:
        clauses.append(extra_filter)
    runs = c.search_runs([exp.experiment_id], filter_string=" and ".join(clauses), max_results=1000,
                         order_by=["attributes.start_time DESC"])
    if complete is False:
        runs = [r for r in runs if not is_complete(r)]
    return list(runs)


def find_finished_run(spec_key: str, experiment: str = DEFAULT_EXPERIMENT, kind: str = "train",
                      parent_run_id: str | None = None) -> Run | None:
    """The newest complete run of this spec (FINISHED and tagged `sage.complete=true`), or None."""
    runs = find_runs(experiment, spec_key=spec_key, kind=kind, parent_run_id=parent_run_id, complete=True)
    return runs[0] if runs else None


# ----------------------------------------------------------------------------------------------- logging helpers
def sanitize_metric_name(name: str) -> str:
    """What transformers' MLflowCallback does: characters MLflow refuses become `_`."""
    return _METRIC_BAD_CHARS.sub("_", str(name))


def numeric_metrics(values: Mapping[str, Any]) -> dict[str, float]:
    """Numeric entries (python/numpy numbers, 0-d tensors and arrays) as floats with sanitised names."""
    out: dict[str, float] = {}
    for k, v in values.items():
        if hasattr(v, "numel") and callable(v.numel):  # torch tensor
            if v.numel() != 1:
                continue
            v = v.item()
        elif hasattr(v, "ndim") and getattr(v, "ndim", None) == 0 and hasattr(v, "item"):  # numpy scalar/0-d
            v = v.item()
        if not isinstance(v, numbers.Real):  # bools are Real (0/1); strings, lists, None are skipped
            continue
        out[sanitize_metric_name(k)] = float(v)
    return out


def log_metrics(metrics: Mapping[str, Any], step: int | None = None, run_id: str | None = None,
                timestamp: int | None = None) -> None:
    """`metrics` (numeric entries: numeric_metrics) at `step`; `timestamp` (ms) default now."""
    from mlflow.entities import Metric
    from mlflow.utils.validation import MAX_METRICS_PER_BATCH

    rid = active_run_id(run_id)
    ts = int(time.time() * 1000) if timestamp is None else timestamp
    ms = [Metric(k, v, ts, int(step or 0)) for k, v in numeric_metrics(metrics).items()]
    c = client()
    for i in range(0, len(ms), MAX_METRICS_PER_BATCH):
        c.log_batch(rid, metrics=ms[i:i + MAX_METRICS_PER_BATCH])


def log_summary(summary: Mapping[str, Any], run_id: str | None = None, step: int | None = None,
                prefix: str = "summary/") -> None:
    """Final numbers of a run (TrainResult.summary, wall-clock) as metrics `summary/<key>`; a store locked past the
    retries (retry_locked) leaves them in `<SAGE_HOME>/unlogged/<run id>/`."""
    rid = active_run_id(run_id)
    metrics = numeric_metrics({f"{prefix}{k}": v for k, v in summary.items()})

    def keep() -> str:
        with atomic_path(path := unlogged_path(rid, "summary.json")) as tmp:
            tmp.write_text(json.dumps({"metrics": metrics, "step": step}))
        return f"it is kept in {path}, and the same training run again (it trains nothing more) logs it"

    retry_locked(lambda: log_metrics(metrics, step=step, run_id=rid), rid, "its summary", keep)


def _download(run_id: str, artifact_path: str, dst: str) -> Path | None:
    from mlflow.exceptions import MlflowException

    try:
        return Path(client().download_artifacts(run_id, artifact_path, dst))
    except (MlflowException, OSError):
        return None


def load_eval(run_id: str) -> pd.DataFrame | None:
    """The run's `eval/eval.parquet`, or None."""
    import pandas as pd

    with tempfile.TemporaryDirectory() as tmp:
        p = _download(run_id, EVAL_ARTIFACT, tmp)
        if p is None or not p.is_file():
            return None
        return pd.read_parquet(p)


def _eval_table_to_merge(run_id: str) -> pd.DataFrame | None:
    """The run's eval table, or None where the run has none. Unlike load_eval, a table that is there but does not
    download (a store failing for a moment) raises: taken for none, log_eval would write the new rows over it."""
    import pandas as pd

    if Path(EVAL_ARTIFACT).name not in {Path(a.path).name for a in client().list_artifacts(
            run_id, str(Path(EVAL_ARTIFACT).parent))}:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        return pd.read_parquet(client().download_artifacts(run_id, EVAL_ARTIFACT, tmp))


def eval_metric_name(benchmark: str) -> str:
    """A benchmark's name as its eval metrics spell it (`eval/<when>/<name>/...`): every character MLflow refuses in
    a metric name, and the / that would nest it, is written _, as is a name of dots only (MLflow refuses . and ..)."""
    name = re.sub(r"[^\w.\- :]", "_", str(benchmark))
    return "_" * len(name) if set(name) <= {"."} else name


def check_benchmark_names(names) -> None:
    """Raises ValueError where two benchmark names would log the same eval metrics (eval_metric_name): one would
    overwrite the other's in MLflow, while eval.parquet kept both."""
    seen: dict[str, str] = {}
    for name in map(str, names):
        other = seen.setdefault(eval_metric_name(name), name)
        if other != name:
            raise ValueError(f"benchmarks {other!r} and {name!r} would log the same eval metrics "
                             f"(eval/<when>/{eval_metric_name(name)}/...): rename one")


def log_eval(df: pd.DataFrame, when: str, run_id: str | None = None) -> pd.DataFrame:
    """Merge `df` (benchmark, k, avg_at_k, pass_at_k, n_prompts) as `when` (before|after) into the run's
    `eval/eval.parquet` (re-logging the same (benchmark, when, k) replaces it) and log metrics
    `eval/<when>/<benchmark>/avg_at_<k>` and `.../pass_at_<k>` (step 0). Returns the merged table. A store locked
    past the retries (retry_locked) leaves the rows in `<SAGE_HOME>/unlogged/<run id>/`, the error says how to log
    them."""
    import pandas as pd

    if when not in ("before", "after"):
        raise ValueError(f"when must be 'before' or 'after', got {when!r}")
    rid = active_run_id(run_id)
    new = df.copy()
    new["when"] = when
    missing = [c for c in EVAL_COLUMNS if c not in new.columns]
    if missing:
        raise ValueError(f"eval table lacks columns {missing}")
    new = new[EVAL_COLUMNS + [c for c in new.columns if c not in EVAL_COLUMNS]]

    def log() -> pd.DataFrame:
        old = _eval_table_to_merge(rid)
        merged = new if old is None else pd.concat([old, new], ignore_index=True)
        merged = merged.drop_duplicates(subset=["benchmark", "when", "k"], keep="last").reset_index(drop=True)
        check_benchmark_names(merged["benchmark"].unique())  # also against an earlier call's names: before logging
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "eval.parquet"
            merged.to_parquet(path, index=False)
            client().log_artifact(rid, str(path), "eval")
        metrics: dict[str, float] = {}
        for row in new.itertuples(index=False):
            name = eval_metric_name(row.benchmark)
            metrics[f"eval/{when}/{name}/avg_at_{int(row.k)}"] = row.avg_at_k
            metrics[f"eval/{when}/{name}/pass_at_{int(row.k)}"] = row.pass_at_k
        log_metrics(metrics, step=0, run_id=rid)
        return merged

    def keep() -> str:  # the evaluation's rows (minutes of work) on disk, and how they are logged again
        with atomic_path(path := unlogged_path(rid, f"eval-{when}.parquet")) as tmp:
            new.to_parquet(tmp, index=False)
        return (f"its {len(new)} rows are kept in {path}; log them once the store is free: python -c \"import "
                f"pandas; from sage_core import tracking; tracking.log_eval(pandas.read_parquet('{path}'), '{when}', "
                f"'{rid}')\"")

    return retry_locked(log, rid, f"its '{when}' eval table", keep)


def log_checkpoint(path: str | Path, run_id: str | None = None, artifact_path: str = "checkpoint") -> int:
    """Upload a model directory (skipping optimizer/scheduler/RNG state) under `checkpoint/`. Returns #files."""
    rid = active_run_id(run_id)
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {root} does not exist")
    files = [f for f in sorted(root.rglob("*")) if f.is_file() and not _CHECKPOINT_SKIP.match(f.name)
             and not any(part.startswith("global_step") for part in f.relative_to(root).parts[:-1])]

    def upload() -> None:
        c = client()
        for f in files:
            c.log_artifact(rid, str(f), "/".join([artifact_path, *f.relative_to(root).parts[:-1]]))

    retry_locked(upload, rid, f"its model ({root})", lambda: f"upload it once the store is free: python -c \"from "
                 f"sage_core import tracking; tracking.log_checkpoint('{root}', '{rid}', '{artifact_path}')\"")
    return len(files)


def has_artifact(run_id: str, path: str) -> bool:
    from mlflow.exceptions import MlflowException

    parent, _, name = path.rstrip("/").rpartition("/")
    try:
        return any(a.path.rstrip("/").rpartition("/")[2] == name for a in client().list_artifacts(run_id, parent
                                                                                                 or None))
    except MlflowException:
        return False


def log_table(df: pd.DataFrame, artifact_stem: str, run_id: str | None = None, markdown: bool = True) -> None:
    """`<stem>.parquet`, `<stem>.csv` and (optionally) `<stem>.md` artifacts, e.g. `study/comparison`."""
    rid = active_run_id(run_id)
    sub, _, name = artifact_stem.rpartition("/")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / name
        df.to_parquet(base.with_suffix(".parquet"), index=False)
        df.to_csv(base.with_suffix(".csv"), index=False)
        if markdown:
            base.with_suffix(".md").write_text(to_markdown(df) + "\n")
        c = client()
        for suffix in (".parquet", ".csv", ".md") if markdown else (".parquet", ".csv"):
            c.log_artifact(rid, str(base.with_suffix(suffix)), sub or None)


def to_markdown(df: pd.DataFrame, floatfmt: str = ".3f") -> str:
    """A GitHub-style table without the optional `tabulate` dependency."""
    cols = [str(c) for c in df.columns]

    def whole(c) -> bool:  # float columns holding counts (rollouts, steps) print as integers
        vals = [v for v in df[c] if isinstance(v, float) and not math.isnan(v)]
        return bool(vals) and all(v.is_integer() and abs(v) >= 1 or v == 0 for v in vals) and any(vals)

    ints = {c for c in df.columns if whole(c)}

    def fmt(v: Any, as_int: bool) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return ""
        if isinstance(v, float):
            return str(int(v)) if as_int else format(v, floatfmt)
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for row in df.itertuples(index=False):
        lines.append("| " + " | ".join(fmt(v, c in ints) for v, c in zip(row, df.columns)) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- UI links
def ui_url() -> str:
    """Base URL of the MLflow UI (`make up` starts it on 127.0.0.1:$MLFLOW_PORT)."""
    url = os.environ.get("SAGE_MLFLOW_UI_URL")
    if url:
        return url.rstrip("/")
    return f"http://127.0.0.1:{os.environ.get('MLFLOW_PORT', '5000')}"


def run_url(run_id: str, experiment_id: str | None = None) -> str:
    if experiment_id is None:
        experiment_id = client().get_run(run_id).info.experiment_id
    return f"{ui_url()}/#/experiments/{experiment_id}/runs/{run_id}"


def compare_url(run_ids: Sequence[str], experiment_id: str) -> str:
    runs = quote(json.dumps(list(run_ids)), safe="")
    exps = quote(json.dumps([experiment_id]), safe="")
    return f"{ui_url()}/#/compare-runs?runs={runs}&experiments={exps}"


# ----------------------------------------------------------------------------------------------- callback
class TrackingError(RuntimeError):
    """The MLflow store refused a run's results (its last logs once its model was saved, or, locked past
    retry_locked's tries, its summary, an eval table, its end): nothing is lost (PENDING_FILE keeps the metrics, an
    eval table is written under <SAGE_HOME>/unlogged/), the message says where they are and how they are sent."""


def _store_locked(error: BaseException | None) -> bool:
    """True where `error` is, or was caused by, a sqlite store's lock (SQLITE_BUSY, SQLITE_LOCKED: 'database is
    locked', another process or rank writing the same mlflow.db), as MLflow's MlflowException or SQLAlchemy's
    OperationalError wrap it."""
    import sqlite3

    for _ in range(8):  # the chain is MlflowException <- SQLAlchemy's OperationalError <- sqlite3's
        if error is None:
            break
        if isinstance(error, sqlite3.OperationalError):
            code = getattr(error, "sqlite_errorcode", None)  # Python 3.11+; the message before
            return (code & 0xFF) in (5, 6) if code is not None else "locked" in str(error)
        error = getattr(error, "orig", None) or error.__cause__ or error.__context__
    return False


def _error_line(error: BaseException) -> str:
    """`Type: first line of the message` (MLflow's errors from a database carry the SQL on the lines after)."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"


class _StoreLockedFilter(logging.Filter):
    """Drops MLflow's ERROR record with the whole traceback (mlflow.store.db.utils, make_managed_session, logs one for
    each write a locked sqlite store refuses) where the thread that installed it logged it: that caller keeps what was
    refused and warns once. Any other error, and other threads' records, go through."""

    def __init__(self):
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread or not (record.exc_info and _store_locked(record.exc_info[1]))


@contextlib.contextmanager
def _quiet_store_locked() -> Iterator[None]:
    """Around writes whose refusal the caller keeps and warns about (MlflowTrackingCallback): no MLflow traceback for
    a locked sqlite store."""
    mlflow_log, quiet = logging.getLogger("mlflow.store.db.utils"), _StoreLockedFilter()
    mlflow_log.addFilter(quiet)
    try:
        yield
    finally:
        mlflow_log.removeFilter(quiet)


_retrying = threading.local()  # .on: this thread is inside retry_locked


def _lock_waits() -> list[float]:
    """The waits between retry_locked's tries: LOCK_RETRY_SECONDS (or $SAGE_MLFLOW_LOCK_RETRY_SECONDS) in 4,
    each twice the one before."""
    raw = os.environ.get(LOCK_RETRY_ENV) or str(LOCK_RETRY_SECONDS)
    try:
        total = float(raw)
    except ValueError:
        total = math.nan
    if not (math.isfinite(total) and total >= 0):  # said, not raised: the write it came with has results to log
        log.warning("%s=%r is not a number of seconds (>= 0): %g taken", LOCK_RETRY_ENV, raw, LOCK_RETRY_SECONDS)
        total = LOCK_RETRY_SECONDS
    return [total * 2**i / 15 for i in range(4)] if total else []


def unlogged_path(run_id: str, name: str) -> Path:
    """A new file `<SAGE_HOME>/unlogged/<run id>/<time>-<name>` for results a locked store refused (retry_locked)."""
    folder = sage_home() / UNLOGGED_DIR / _path_safe(run_id)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"


def retry_locked(write: Callable[[], T], run_id: str, what: str, keep: Callable[[], str] | None = None) -> T:
    """`write()`, a write of run `run_id` made once (its opening, its summary, an eval table, its end), tried again
    while a locked sqlite store refuses it (_store_locked: another flow or rank writing mlflow.db; MLflow waits its
    20 s busy timeout, then gives up): 4 more tries, 5, 10, 20 and 40 s apart (_lock_waits), each said in one
    warning, MLflow's traceback of the lock left out. Any other error is raised at once, as it was. A lock that
    outlasts the tries raises TrackingError naming the store, with what `keep()` says: where it kept `what` on disk
    and how it is logged again (or that nothing is lost yet); without `keep`, the lock's error (the caller keeps what
    was refused). A write made inside another's retries is tried once: the outer one tries the whole again."""
    if getattr(_retrying, "on", False):
        return write()
    waits, start = _lock_waits(), time.monotonic()
    _retrying.on = True
    try:
        for tried, wait in enumerate([*waits, None], 1):
            try:
                with _quiet_store_locked():
                    return write()
            except Exception as e:
                if not _store_locked(e):
                    raise
                if wait is None:
                    if keep is None:
                        raise
                    try:
                        kept = keep()
                    except OSError as why:
                        kept = f"it could not be kept on disk either ({why})"
                    raise TrackingError(f"MLflow run {run_id}: the store {shown_uri()} stayed locked through {tried} "
                                        f"tries in {time.monotonic() - start:.0f} s ({_error_line(e)}): {what} is "
                                        f"not logged; {kept}") from e
                log.warning("MLflow run %s: the store %s is locked (%s): %s is tried again in %.3g s", run_id,
                            shown_uri(), _error_line(e), what, wait)
                time.sleep(wait)
    finally:
        _retrying.on = False


class MlflowTrackingCallback(TrainerCallback):
    """Trainer callback: metrics per step, tracker Parquet files, final checkpoint, all into one MLflow run.

    `run_id` defaults to the fluent active run at `on_train_begin`. With no run id and no active run but a
    `spec`, the callback opens the run itself (`resume_or_create_run` on the trainer's output_dir, so a resumed
    training continues the same run) and finishes it at `on_train_end` (the `sage train --mlflow` case).
    Only the main process logs. Tracker files (`<output_dir>/tracker/step_*.parquet`) are uploaded once each; on a
    resumed run the files already in the run's `tracker/` artifacts are not uploaded again, except those of steps
    after the checkpoint it resumes from (trained again, so uploaded again).
    """

    def __init__(self, run_id: str | None = None, output_dir: str | Path | None = None,
                 log_checkpoint: bool = True, tracker_subdir: str = "tracker", spec: RunSpec | None = None,
                 experiment: str | None = None):
        self.run_id = run_id
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.log_checkpoint = log_checkpoint
        self.tracker_subdir = tracker_subdir
        self.spec = spec
        # None: none asked for (a new run goes to DEFAULT_EXPERIMENT, a reopened one is not warned about)
        self.experiment = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or None
        self.uploaded: set[str] = set()
        self.pending: list[tuple[dict[str, float], int, int]] = []  # (metrics, step, ms) MLflow did not take yet
        self.checkpoint_logged: Path | None = None
        self.owns_run = False
        # the global step this attempt reached (the main process's hooks); None: no Trainer hook ran (train's done
        # path, which trains nothing)
        self.step: int | None = None
        self._ready = False

    # -- internals
    def _setup(self, args=None) -> None:
        if self._ready:
            return
        if self.output_dir is None and args is not None:
            self.output_dir = Path(args.output_dir)
        if self.run_id is None:
            import mlflow

            if mlflow.active_run() is None and self.spec is not None:
                self.run_id, _ = resume_or_create_run(self.spec, "train", self.output_dir, self.experiment)
                self.owns_run = True
        self.run_id = active_run_id(self.run_id)
        self.pending = self._kept_pending() + self.pending
        try:
            self.uploaded = {Path(a.path).name for a in client().list_artifacts(self.run_id, self.tracker_subdir)}
        except Exception:  # noqa: BLE001 - an unreadable artifact store only means re-uploading
            self.uploaded = set()
        self._ready = True

    def upload_tracker_files(self) -> list[str]:
        """Upload tracker files not uploaded yet; returns their names."""
        from .tracker import step_of

        self._setup()
        tdir = (self.output_dir or Path(".")) / self.tracker_subdir
        if not tdir.is_dir():
            return []
        new = sorted(p for p in tdir.iterdir() if step_of(p.name) is not None and p.name not in self.uploaded)
        c = client()
        for p in new:
            c.log_artifact(self.run_id, str(p), self.tracker_subdir)
            self.uploaded.add(p.name)
        return [p.name for p in new]

    def log_dropped_prompts(self) -> int:
        """The rows left out for being longer than max_prompt_length (`<output_dir>/dropped_prompts.json`, written
        by sage_core.train): the file as an artifact and their count as the tag `sage.prompts_dropped`."""
        path = (self.output_dir or Path(".")) / DROPPED_PROMPTS
        if not path.is_file():
            return 0
        n = len(json.loads(path.read_text()).get("dropped", []))

        def log() -> None:
            client().log_artifact(self.run_id, str(path))
            client().set_tag(self.run_id, "sage.prompts_dropped", str(n))

        retry_locked(log, self.run_id, f"the {n} prompts left out for length",
                     lambda: f"{path} has them, and the same training run again logs them")
        return n

    def _pending_path(self) -> Path | None:
        return self.output_dir / PENDING_FILE if self.output_dir is not None else None

    def _kept_pending(self) -> list[tuple[dict[str, float], int, int]]:
        """The metric batches an earlier attempt of this run could not log (PENDING_FILE; [] for another run's)."""
        try:
            kept = json.loads(self._pending_path().read_text())
        except (AttributeError, OSError, ValueError):
            return []
        return [(m, int(step), int(ts)) for m, step, ts in kept["pending"]] if kept.get("run_id") == self.run_id else []

    def _keep_pending(self) -> None:
        """`pending` in PENDING_FILE (replaced whole; removed when empty): a process that ends before MLflow takes
        them (killed, or ended by the store's error) lost them, and the steps they are of, up to its checkpoint, are
        not trained again: the next attempt in this output dir sends them."""
        if (path := self._pending_path()) is None:
            return
        try:
            if not self.pending:
                path.unlink(missing_ok=True)
                return
            tmp = path.with_name(f".{PENDING_FILE}.{os.getpid()}")
            tmp.write_text(json.dumps({"run_id": self.run_id, "pending": self.pending}))
            tmp.replace(path)
        except OSError as e:
            log.warning("%s could not be written (%s): %d metric batches MLflow refused are kept in memory only",
                        path, e, len(self.pending))

    def flush(self) -> None:
        """Log the metrics MLflow refused so far (in order; each batch dropped from `pending` once logged)."""
        while self.pending:
            metrics, step, ts = self.pending[0]
            log_metrics(metrics, step=step, run_id=self.run_id, timestamp=ts)
            self.pending.pop(0)

    def _while_training(self, logs: Mapping[str, Any] | None = None, step: int = 0) -> None:
        """Metrics of a step (kept until logged) and the new tracker files, sent while training: an MLflow store
        that fails for a while (a server restarting, a locked sqlite file) is warned about and caught up with at the
        next step, not allowed to end the training (the steps since the last checkpoint would be lost)."""
        from mlflow.exceptions import MlflowException

        self.step = int(step or 0)
        if logs and (metrics := numeric_metrics(logs)):
            self.pending.append((metrics, int(step or 0), int(time.time() * 1000)))
        try:
            with _quiet_store_locked():
                self.flush()
                self._keep_pending()
                self.upload_tracker_files()
        except (MlflowException, OSError) as e:
            self._keep_pending()
            kept = f" (kept in {self._pending_path()})" if self.pending and self.output_dir is not None else ""
            log.warning("MLflow run %s: the store %s refused the logs of step %s (%s); %d metric batches%s and the "
                        "tracker files not uploaded yet are sent again at the next step", self.run_id, shown_uri(),
                        step, _error_line(e), len(self.pending), kept)

    # -- TrainerCallback
    def on_train_begin(self, args, state, control, **kwargs):
        from .tracker import step_of

        if state.is_world_process_zero:
            self._setup(args)
            self.step = state.global_step
            # a resumed run trains the steps after its checkpoint again: their files are uploaded again when
            # written (the run's copies, from before a kill, belong to the discarded trajectory)
            self.uploaded = {n for n in self.uploaded if (step_of(n) or 0) <= state.global_step}
            # and so are the metrics an earlier attempt kept of them (PENDING_FILE)
            self.pending = [p for p in self.pending if p[1] <= state.global_step]
            self.log_dropped_prompts()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero:
            return
        self._setup(args)
        self._while_training(logs, state.global_step)

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._setup(args)
            self._while_training(step=state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self._setup(args)
        self._while_training(step=state.global_step)

    def log_final_model(self, final: Path, global_step: int) -> None:
        """After training (sage_core.train calls it on the main process, once final/ is saved): the model trained,
        final/, as the run's `checkpoint/` with its step in the tag `sage.checkpoint_step`; a run this callback
        opened is finished. (The last checkpoint-N is not that model where a rollout budget stopped training
        between saves, nor for LoRA, whose checkpoints hold the adapter.) A run with nothing left to train calls no
        Trainer hook first: its output dir is final/'s folder, and tracker files not in the MLflow run yet go up;
        final/ goes up unless the run has it already (its `sage.checkpoint_step` is this step: a finished run entered
        again, whose model is not copied to the artifact store once more)."""
        from mlflow.exceptions import MlflowException

        if self.output_dir is None:  # no on_train_begin gave it (sage_core.train's done path trains nothing)
            self.output_dir = Path(final).parent
        self._setup()
        try:
            retry_locked(lambda: self._log_final_model(final, global_step), self.run_id, "the run's last logs")
        except (MlflowException, OSError) as e:  # the metrics it refused were lost with the process, for good (a
            self._keep_pending()  # finished run trains no step again): kept for the next attempt
            raise TrackingError(
                f"MLflow run {self.run_id}: the store {shown_uri()} refused the run's last logs "
                f"({_error_line(e)}); the model is trained and saved in {final}"
                + (f", and the {len(self.pending)} metric batches not logged are kept in {self._pending_path()}"
                   if self.pending else "") + ": run the same training again (it trains nothing more) to send "
                "them") from e

    def _log_final_model(self, final: Path, global_step: int) -> None:
        # the run's last step: metric points and tracker/ files past it are a killed attempt's, never trained again
        # (resumed with a lower max_steps or rollout_budget); MLflow cannot delete them, the dashboard leaves them out
        client().set_tag(self.run_id, LAST_STEP_TAG, str(global_step))
        if self.log_checkpoint and Path(final).is_dir():
            trained_now = self.step is not None  # a Trainer hook ran: not a finished run entered again
            if trained_now or client().get_run(self.run_id).data.tags.get("sage.checkpoint_step") != str(global_step):
                if self.checkpoint_logged != Path(final):  # not by a try a locked store refused after it
                    log_checkpoint(final, self.run_id)
                    self.checkpoint_logged = Path(final)
                client().set_tag(self.run_id, "sage.checkpoint_step", str(global_step))
            self.checkpoint_logged = Path(final)
        # what MLflow refused while training, and the tracker files it lacks (all of them, where nothing trained
        # now), once the model is saved (an error here loses no training)
        self.flush()
        self._keep_pending()
        self.upload_tracker_files()
        if self.owns_run:
            finish_run(self.run_id)

    def end_run(self, error: BaseException) -> None:
        """Training ended by `error` (sage_core.train calls it): a run this callback opened is ended KILLED where it
        was stopped, FAILED otherwise (end_status), not left RUNNING with no end time; a run the caller gave is the
        caller's to end. Only the process that opened it (the main one) ends it. Either way the run's last step
        (`sage.last_step`) is the one this attempt reached: steps past it in the run are an earlier attempt's, of a
        trajectory this one, resumed from an earlier checkpoint, left (not this run's model, nor trained again)."""
        if self.run_id is None:
            return

        def end() -> None:
            try:
                if self.step is not None:  # the main process, once training began
                    client().set_tag(self.run_id, LAST_STEP_TAG, str(self.step))
            finally:  # a store that refuses the tag still has the run ended
                if self.owns_run:
                    finish_run(self.run_id, status=end_status(error))

        retry_locked(end, self.run_id, f"its end (step {self.step})",
                     lambda: "the run is left as it was: the same training run again reopens and ends it")


def make_callback(spec: RunSpec | None = None, experiment: str | None = None, run_id: str | None = None,
                  output_dir: str | Path | None = None, log_checkpoint: bool | None = None
                  ) -> MlflowTrackingCallback:
    """The callback for `sage train --mlflow` and for the ranks `accelerate launch` starts from a flow.

    The run is, in order: `run_id`, `$SAGE_MLFLOW_RUN_ID` (set by the flows), the active run, or one the callback
    opens for `spec` in `experiment` (and finishes at the end of training).
    """
    if log_checkpoint is None:
        log_checkpoint = os.environ.get("SAGE_MLFLOW_LOG_CHECKPOINT", "1") != "0"
    return MlflowTrackingCallback(run_id=run_id or os.environ.get("SAGE_MLFLOW_RUN_ID") or None,
                                  output_dir=output_dir or os.environ.get("SAGE_OUTPUT_DIR") or None,
                                  log_checkpoint=log_checkpoint, spec=spec, experiment=experiment)


def log_history(history: Sequence[Mapping[str, Any]], run_id: str | None = None) -> int:
    """Log a Trainer `log_history` after the fact (runs whose ranks could not log live). Returns #entries."""
    n = 0
    for entry in history:
        step = entry.get("step")
        metrics = {k: v for k, v in entry.items() if k != "step"}
        if metrics:
            log_metrics(metrics, step=int(step or 0), run_id=run_id)
            n += 1
    return n


def callback_from_env() -> MlflowTrackingCallback | None:
    """A callback for the run in `$SAGE_MLFLOW_RUN_ID` (set by the flows for `accelerate launch`), else None."""
    if not os.environ.get("SAGE_MLFLOW_RUN_ID"):
        return None
    return make_callback()
