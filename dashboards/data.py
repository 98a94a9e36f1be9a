"""Data access for the SAGE dashboard: MLflow reads (cached) and the per-prompt tracker frames.

Everything here is plain functions of (tracking URI, run id, ...) so the pages stay thin and the pure parts
(gate-open bins, heatmap matrix, collapsed-prompt table) can be tested without Streamlit.

Caching policy
- experiment list / run search: ``st.cache_data(ttl=...)`` so a live run shows up without a restart;
- metric histories: ttl for RUNNING runs, no ttl for finished ones (the status is part of the choice);
- tracker files: one frame per run, aggregated with pyarrow from ``tracker/step_*.parquet`` and cached by
  ``(run_id, number of tracker files, their sizes and mtimes and the run's end)`` (``files_key``): a live run adds
  files, and a resumed run rewrites the steps it trains again under their names (live, or ended again), which
  changes the key; the listing and its stat calls are read again every LIVE_TTL seconds.
  Only the light columns are loaded for the whole run, each file's kept in memory (``_light_tables``, by file
  size and mtime), so a live run's new step reads one file; the heavy ones (completions, hints) are read for one
  prompt on demand, from just the step files that prompt appears in, and the problem texts from each prompt's
  first file only. A store read over the network (``mlflow server --serve-artifacts``) is copied file by file into
  $TMP/sage-dashboard/<run_id>/: only files missing there or of another size than the listing's are fetched.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, unquote, urlparse
from urllib.request import url2pathname

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import streamlit as st

REPO = Path(__file__).resolve().parents[1]
TRACKER_DIR = "tracker"
TRACKER_RE = re.compile(r"^step_(\d+)\.parquet$")
LIVE_TTL = 15  # seconds, for anything that can change while a run is live
SEARCH_TTL = 30

# tracker columns loaded for the whole run (small, numeric or short strings)
# the tracker's float columns, NaN where a step has no value (sage_core.tracker.FLOAT_COLUMNS: a test keeps them equal)
FLOAT_COLUMNS = ["base_pass_rate", "pass_rate", "acc_l1", "acc_l2", "acc_l3"]
LIGHT_COLUMNS = ["step", "prompt_id", "difficulty", "base_pass_rate", "base_state", "level", "max_level_tried",
                 "pass_rate", "acc_l1", "acc_l2", "acc_l3", "rescued", "hint_failed", "rollouts", "leak_l1",
                 "leak_l2", "leak_l3", "method"]
# tracker columns read per prompt (explorer)
DETAIL_COLUMNS = ["step", "prompt_id", "problem", "answer", "difficulty", "base_pass_rate", "base_state", "level",
                  "max_level_tried", "pass_rate", "rescued", "hint", "hint_l1", "hint_l2", "hint_l3", "acc_l1",
                  "acc_l2", "acc_l3", "leak_l1", "leak_l2", "leak_l3", "hint_failed", "rollouts", "completions",
                  "rewards", "method", "trained", "origin_id"]
BOOL_COLUMNS = ["rescued", "hint_failed", "leak_l1", "leak_l2", "leak_l3"]
DICT_COLUMNS = ["prompt_id", "base_state", "method"]  # strings: read as dictionaries, categorical in the frame
# the frame's types (a 3000-step x 256-prompt run: 36 MB; 48 MB as per-file Arrow tables) and what a null or a column
# an older tracker lacks becomes
LIGHT_TYPES = ({c: pa.int32() for c in ("step", "difficulty", "level", "max_level_tried", "rollouts")}
               | {c: pa.float32() for c in FLOAT_COLUMNS} | {c: pa.bool_() for c in BOOL_COLUMNS}
               | {c: pa.dictionary(pa.int32(), pa.string()) for c in DICT_COLUMNS})
LIGHT_FILL = {"step": 0, "difficulty": -1, "level": 0, "max_level_tried": 0, "rollouts": 0, "base_state": "na"} \
    | dict.fromkeys(BOOL_COLUMNS, False)
LIGHT_CACHE_FOLDERS = 8  # runs whose per-file light tables stay in memory between reruns
READ_THREADS = min(4, os.cpu_count() or 1)  # tracker files read at once (Arrow reads without the GIL)
FETCH_THREADS = 8  # tracker files downloaded at once from a tracking server
GATE_METRICS = ["sage/frac_all_zero", "sage/frac_all_one", "sage/frac_rescued", "sage/frac_open", "sage/adv_energy"]
METRIC_LABELS = {
    "sage/frac_all_zero": "collapsed all-0 (before hints)",
    "sage/frac_all_one": "collapsed all-1 (before hints)",
    "sage/frac_rescued": "rescued",  # by a hint, or a curation method's re-roll or swap
    "sage/frac_open": "open gate, trained (after hints)",
    "sage/adv_energy": "advantage energy",
    "sage/frac_collapsed": "collapsed before hints",
}
VARIANT_ORDER = ["GRPO", "SAGE-LIGHT", "SAGE (online)", "SAGE (fixed)", "SAGE (teacher)"]
VARIANT_COLORS = ["#7f7f7f", "#2ca02c", "#1f77b4", "#9467bd", "#ff7f0e"]

os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # an unreachable server: fail fast, show a message
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


# ----------------------------------------------------------------------------------------------------------------
# tracking store


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI``, else ``sqlite:///<SAGE_HOME>/mlflow.db`` (SAGE_HOME defaults to ``<repo>/.sage``).

    The rule of ``sage_core.tracking.tracking_uri`` (a test keeps them equal), written out here because importing
    that module pulls in transformers and torch (seconds per server start) and creates SAGE_HOME as a side effect;
    the dashboard only reads, and must not create anything when there is no store yet.
    """
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    home = Path(os.environ.get("SAGE_HOME") or REPO / ".sage").expanduser().resolve()
    return f"sqlite:///{home / 'mlflow.db'}"


def mlflow_ui_url() -> str:
    """Base URL of the MLflow UI: ``SAGE_MLFLOW_UI_URL``, else http://127.0.0.1:$MLFLOW_PORT (5000), as in
    ``sage_core.tracking.ui_url``."""
    url = os.environ.get("SAGE_MLFLOW_UI_URL")
    if url:
        return url.rstrip("/")
    return f"http://127.0.0.1:{os.environ.get('MLFLOW_PORT', '5000')}"


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (relative paths follow the working directory)."""
    if not uri.startswith("sqlite:"):
        return None
    rest = uri[len("sqlite:"):]
    if rest.startswith("///"):
        path = rest[3:]
    elif rest.startswith("//"):
        path = rest[2:]
    else:
        path = rest
    path = path.split("?", 1)[0]
    if path in ("", ":memory:"):
        return None
    return Path(unquote(path))


def shown_uri(uri: str) -> str:
    """`uri` as the pages show it, a user and password in it written *** (sage_core.tracking.shown_uri's rule: a
    test keeps them equal)."""
    return re.sub(r"(?<=//)[^/@?#]*@", "***@", uri)


def store_problem(uri: str) -> str | None:
    """A human message when the store cannot be read, without touching (or creating) it. None when it looks fine."""
    db = sqlite_path(uri)
    if db is not None:
        if not db.exists():
            return (f"No MLflow tracking store yet: `{db}` does not exist. Train something first "
                    "(`make demo`, or `sage train --preset tiny-cpu`), or point `MLFLOW_TRACKING_URI` at a store.")
        if db.is_dir():
            return f"`{db}` is a folder, not an MLflow sqlite database. Check `MLFLOW_TRACKING_URI`."
        return None
    scheme = urlparse(uri).scheme
    if scheme in ("", "file"):
        path = Path(url2pathname(urlparse(uri).path)) if scheme == "file" else Path(uri)
        if not path.exists():
            return f"No MLflow tracking store at `{path}`. Check `MLFLOW_TRACKING_URI`."
    return None


@st.cache_resource(show_spinner=False)
def client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


@st.cache_data(ttl=SEARCH_TTL, show_spinner=False)
def experiments(uri: str) -> pd.DataFrame:
    """Active experiments: experiment_id, name, last_update_time."""
    exps = client(uri).search_experiments(max_results=1000)
    rows = [{"experiment_id": e.experiment_id, "name": e.name, "last_update_time": e.last_update_time or 0}
            for e in exps if e.lifecycle_stage == "active"]
    return pd.DataFrame(rows, columns=["experiment_id", "name", "last_update_time"])


RESUMED_PREFIX = "sage.resumed."  # sage_core.tracking.RESUMED_PREFIX (a test keeps them equal)


def spec_params(params: dict[str, str], tags: dict[str, str]) -> dict[str, str]:
    """A run's params with the values it trains with: a run reopened with a resumable field changed (max_steps 1 -> 2)
    keeps its first param (MLflow params cannot change) and holds the new value in a tag `sage.resumed.<field>`, as
    ``sage_core.tracking.spec_values`` reads them."""
    out = dict(params)
    out.update({"sage." + k[len(RESUMED_PREFIX):]: v for k, v in tags.items()
                if k.startswith(RESUMED_PREFIX) and len(k) > len(RESUMED_PREFIX)})
    return out


RUN_COLUMNS = ["run_id", "run_name", "experiment_id", "status", "start_time", "end_time", "kind", "method",
               "hint_source", "model", "parent_run_id", "artifact_uri", "num_generations", "params", "metrics",
               "metric_steps", "last_step", "last_active", "ran_seconds"]
LAST_STEP_TAG = "sage.last_step"  # sage_core.tracking.LAST_STEP_TAG
REOPENED_TAG = "sage.reopened_at"  # sage_core.tracking.REOPENED_TAG (a test keeps them equal)
RAN_BEFORE_TAG = "sage.ran_seconds_before_reopening"  # sage_core.tracking.RAN_BEFORE_TAG (a test keeps them equal)
WALL_METRIC = "summary/wall_seconds"  # a training run's sessions' wall time (sage_core.train.TrainTime), at its end


def last_active(start_ms: int | None, end_ms: int | None, tags: dict[str, str]) -> pd.Timestamp:
    """When a run was last seen active: the latest of its start, its end and its last reopening (REOPENED_TAG), as
    sage_core.tracking.last_active reads it (a run reopened keeps its first start, and while RUNNING its earlier
    attempt's end), so that the Variant comparison page opens on the study `python -m flows.report` reports."""
    reopened = str(tags.get(REOPENED_TAG, ""))
    ms = max(start_ms or 0, end_ms or 0, int(reopened) if reopened.isdigit() else 0)
    return pd.to_datetime(ms, unit="ms", utc=True) if ms else pd.NaT


def ran_seconds(start_ms: int | None, end_ms: int | None, tags: dict[str, str],
                wall: tuple[float, int] | None = None) -> float:
    """The seconds an ended run ran (the runs page's minutes), NaN without an end (RUNNING). A run stopped and resumed
    later (the same MLflow run reopened: `sage train` resuming, a flow run again) keeps its first start, so its start
    to its end counts the time it was not running too: its attempts' spans are summed instead, as
    sage_core.tracking.ran_seconds does (a test keeps them equal), from the seconds it ran before its last reopening
    (RAN_BEFORE_TAG) and that reopening to its end. A run reopened by a version that did not record them: its training
    sessions' wall seconds (`wall`: summary/wall_seconds and when it was logged, ms; only if logged since the
    reopening, model loading and saving included, the evaluations of a flow not), else its start to its end."""
    if not end_ms or not start_ms:
        return float("nan")
    reopened = str(tags.get(REOPENED_TAG, ""))
    if not reopened.isdigit():  # never reopened: one span
        return (end_ms - start_ms) / 1000
    try:
        before = float(tags[RAN_BEFORE_TAG])
    except (KeyError, ValueError):
        before = float("nan")
    if np.isfinite(before) and end_ms >= int(reopened):
        return before + (end_ms - int(reopened)) / 1000
    if wall is not None and np.isfinite(wall[0]) and wall[1] >= int(reopened):
        return float(wall[0])
    return (end_ms - start_ms) / 1000


def _metrics_until(c, r, last: int | None) -> tuple[dict, dict]:
    """A run's latest metric values, as of step `last` where it has one: MLflow's latest is the highest step's, a
    killed attempt's point past the run's end (read again from the history only for those keys). Returns them and
    the step of each: which of several keys was logged last (a run resumed with another eval_k or eval_data holds
    the earlier attempt's eval keys too, their last points at earlier steps)."""
    metrics = dict(r.data.metrics)
    objs = getattr(r.data, "_metric_objs", None) or []  # each key's latest point, with its step
    steps = {m.key: m.step for m in objs}
    if last is None:
        return metrics, steps
    for m in objs:
        if m.step > last:
            kept = [x for x in c.get_metric_history(r.info.run_id, m.key) if x.step <= last]
            if kept:
                point = max(kept, key=lambda x: (x.step, x.timestamp))
                metrics[m.key], steps[m.key] = point.value, point.step
            else:
                metrics.pop(m.key, None)
                steps.pop(m.key, None)
    return metrics, steps


@st.cache_data(ttl=SEARCH_TTL, show_spinner=False)
def runs(uri: str, experiment_id: str) -> pd.DataFrame:
    """All active runs of an experiment, newest first, with the SAGE tags flattened; `end_time` NaT while a run is
    RUNNING (a resumed run's is its earlier attempt's)."""
    c = client(uri)
    found, token = [], None
    while True:
        page = c.search_runs([experiment_id], max_results=1000, order_by=["attributes.start_time DESC"],
                             page_token=token)
        found.extend(page)
        token = page.token
        if not token or len(found) >= 10000:
            break
    rows = []
    for r in found:
        t, p = r.data.tags, spec_params(r.data.params, r.data.tags)
        ng = p.get("sage.num_generations")
        study = t.get("sage.kind") == "study"  # its method tags are its base spec's; its variants are its children
        # an ended run's last step (steps past it: a killed attempt's, resumed with a lower max_steps)
        last = int(t[LAST_STEP_TAG]) if r.info.status != "RUNNING" and str(t.get(LAST_STEP_TAG, "")).isdigit() \
            else None
        metrics, steps = _metrics_until(c, r, last)
        end = r.info.end_time if r.info.status != "RUNNING" else None
        wall = next(((m.value, m.timestamp) for m in getattr(r.data, "_metric_objs", None) or []
                     if m.key == WALL_METRIC), None)
        rows.append({
            "run_id": r.info.run_id, "run_name": r.info.run_name or t.get("mlflow.runName", r.info.run_id[:8]),
            "experiment_id": r.info.experiment_id, "status": r.info.status,
            "start_time": pd.to_datetime(r.info.start_time, unit="ms", utc=True) if r.info.start_time else pd.NaT,
            # none while RUNNING: a run reopened (resumed) keeps its earlier attempt's end, which MLflow's
            # update_run cannot clear; its duration, and the caches keyed by its end, would be that attempt's
            "end_time": pd.to_datetime(r.info.end_time, unit="ms", utc=True)
            if r.info.end_time and r.info.status != "RUNNING" else pd.NaT,
            "kind": t.get("sage.kind", ""),
            "method": "study" if study else t.get("sage.method", p.get("sage.method", "")),
            "hint_source": "" if study else t.get("sage.hint_source", p.get("sage.hint_source", "")),
            "model": t.get("sage.model", p.get("sage.model", "")), "parent_run_id": t.get("mlflow.parentRunId", ""),
            "artifact_uri": r.info.artifact_uri, "num_generations": int(ng) if ng and str(ng).isdigit() else None,
            "params": p, "metrics": metrics, "metric_steps": steps,
            "last_step": last, "last_active": last_active(r.info.start_time, r.info.end_time, t),
            "ran_seconds": ran_seconds(r.info.start_time, end, t, wall),
        })
    df = pd.DataFrame(rows, columns=RUN_COLUMNS)
    for col in ("start_time", "end_time", "last_active"):  # a column of NaT only (every run still running) is
        # tz-aware too
        df[col] = pd.to_datetime(df[col], utc=True)
    return df


def _history(uri: str, run_id: str, keys: tuple[str, ...]) -> pd.DataFrame:
    c = client(uri)
    parts = []
    for key in keys:
        hist = c.get_metric_history(run_id, key)
        if hist:
            parts.append(pd.DataFrame({"run_id": run_id, "key": key, "step": [m.step for m in hist],
                                       "value": [m.value for m in hist], "timestamp": [m.timestamp for m in hist]}))
    if not parts:
        return pd.DataFrame(columns=["run_id", "key", "step", "value"])
    df = pd.concat(parts, ignore_index=True)
    # a metric re-logged at the same step (restarts): keep the last value
    df = df.sort_values("timestamp").drop_duplicates(["key", "step"], keep="last").drop(columns="timestamp")
    return df.sort_values(["key", "step"]).reset_index(drop=True)


@st.cache_data(ttl=LIVE_TTL, show_spinner=False)
def _history_live(uri: str, run_id: str, keys: tuple[str, ...]) -> pd.DataFrame:
    return _history(uri, run_id, keys)


@st.cache_data(show_spinner=False, max_entries=256)
def _history_done(uri: str, run_id: str, keys: tuple[str, ...], status: str, ended: str) -> pd.DataFrame:
    return _history(uri, run_id, keys)


def metric_history(uri: str, run_id: str, keys, status: str, end_time=None, last_step=None) -> pd.DataFrame:
    """Long frame run_id, key, step, value for the given metric keys. An ended run's history is read once per end:
    `end_time` (the runs frame's) is in the cache key, so a run resumed and ended again with the same status
    (a FINISHED run trained on with more max_steps) is read again. `last_step` (the runs frame's) leaves out the
    points past it: a killed attempt's steps that the run, resumed with a lower max_steps, never trained again."""
    keys = tuple(sorted(set(keys)))
    if status == "RUNNING" or status == "SCHEDULED":
        df = _history_live(uri, run_id, keys)
    else:
        df = _history_done(uri, run_id, keys, status, _end_key(end_time))
    if last_step is None or pd.isna(last_step):
        return df
    return df[df["step"] <= int(last_step)].reset_index(drop=True)


def _end_key(end_time) -> str:
    return "" if end_time is None or pd.isna(end_time) else str(end_time)


# ----------------------------------------------------------------------------------------------------------------
# artifacts


def local_artifact_dir(artifact_uri: str) -> Path | None:
    """The local folder of a run's artifacts when the URI is a local path, else None (server / object store)."""
    parsed = urlparse(artifact_uri)
    if parsed.scheme == "file":
        return Path(url2pathname(parsed.path))
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and os.name == "nt"):
        return Path(artifact_uri)
    return None


def _download(uri: str, run_id: str, artifact_path: str) -> Path:
    """One artifact (a file, or a folder with everything in it) under $TMP/sage-dashboard/<run_id>/."""
    import mlflow

    dst = Path(tempfile.gettempdir()) / "sage-dashboard" / run_id
    dst.mkdir(parents=True, exist_ok=True)
    final = dst / artifact_path
    # downloaded into a folder of this call's own, then each file renamed into place: MLflow writes a download in
    # place, and another session (or this one's other cached reader) may be reading or downloading the same files
    with tempfile.TemporaryDirectory(dir=dst, prefix=".dl-") as tmp:
        got = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=artifact_path, dst_path=tmp,
                                                       tracking_uri=uri))
        for f in [got] if got.is_file() else [p for p in got.rglob("*") if p.is_file()]:
            target = final if got.is_file() else final / f.relative_to(got)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(f, target)
    return final


def _fetch_files(uri: str, run_id: str, artifact_uri: str, folder: str, files: dict[str, int | None]) -> Path:
    """The local copy of some files of a run's artifact folder (``tracker``), under $TMP/sage-dashboard/<run_id>/,
    fetching only the files that are missing there or whose size is not the listed one (a resumed run rewrites the
    steps it trains again under the same names). ``files``: name -> size from the listing (None: unknown, fetched
    only when missing).

    Downloading a whole folder on every cache miss cost a 300-step run 900 requests to show one prompt. Each file is
    downloaded into a folder of this call's own, then renamed into place: another session may be reading or
    fetching the same files, and a reader sees a whole old file or a whole new one, never a part.
    """
    dst = Path(tempfile.gettempdir()) / "sage-dashboard" / run_id
    final = dst / folder
    final.mkdir(parents=True, exist_ok=True)
    stale = [n for n, size in files.items() if not _is_copy_of(final / n, size)]
    if not stale:
        return final
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    repo = get_artifact_repository(artifact_uri, tracking_uri=uri)
    with tempfile.TemporaryDirectory(dir=dst, prefix=".dl-") as tmp:

        def fetch(name: str) -> None:
            part = os.path.join(tmp, name)
            # one request per file: the repository's public download_artifacts first asks whether the path is a folder
            # (a private method of every MLflow artifact repository; the public one where a version lacks it)
            if hasattr(repo, "_download_file"):
                repo._download_file(f"{folder}/{name}", part)
            else:
                os.replace(repo.download_artifacts(f"{folder}/{name}", tmp), part)
            os.replace(part, final / name)

        with ThreadPoolExecutor(max_workers=min(FETCH_THREADS, len(stale))) as pool:
            for _ in pool.map(fetch, stale):  # re-raises the first failure
                pass
    return final


def _is_copy_of(path: Path, size: int | None) -> bool:
    """Whether the local copy exists and has the listed size (any size when the listing gives none)."""
    try:
        return path.stat().st_size == size or size is None
    except FileNotFoundError:
        return False


def _list_tracker(uri: str, run_id: str, artifact_uri: str) -> dict[str, int | None]:
    """The run's tracker files, sorted by step: name -> size (the listing's, for a store read over the network; None
    for a local one, read in place)."""
    local = local_artifact_dir(artifact_uri)
    if local is not None:
        d = local / TRACKER_DIR
        names = [n for n in os.listdir(d) if TRACKER_RE.match(n)] if d.is_dir() else []
        return dict.fromkeys(sorted(names))
    listing = {Path(f.path).name: f.file_size for f in client(uri).list_artifacts(run_id, TRACKER_DIR)
               if not f.is_dir}
    return {n: listing[n] for n in sorted(listing) if TRACKER_RE.match(n)}


@st.cache_data(ttl=LIVE_TTL, show_spinner=False)
def tracker_listing(uri: str, run_id: str, artifact_uri: str) -> list[tuple[str, int | None, int | None]]:
    """The run's tracker files, sorted by step, as (name, size, mtime in ns): a local store's from stat calls, a
    remote one's from the listing (its size; no mtime). What the per-prompt caches are keyed by (files_key)."""
    listing = _list_tracker(uri, run_id, artifact_uri)
    local = local_artifact_dir(artifact_uri)
    if local is None:
        return [(n, size, None) for n, size in listing.items()]
    out = []
    for n in listing:
        try:
            s = os.stat(local / TRACKER_DIR / n)
        except FileNotFoundError:  # gone since listed (a resume discarding steps past its checkpoint)
            continue
        out.append((n, s.st_size, s.st_mtime_ns))
    return out


def files_key(files, ended: str = "") -> str:
    """A cache key of tracker files as `tracker_listing` gives them (names, sizes, mtimes) and of the run's end
    (`ended`, _end_key): a live run adds files, and a resumed one rewrites the steps it trains again under their
    names (their number unchanged, its end not yet there: MLflow keeps the earlier attempt's), which changes it."""
    return ended + ":" + hashlib.sha256(repr(list(files)).encode()).hexdigest()[:16]


def _tracker_folder(uri: str, run_id: str, artifact_uri: str, files: dict[str, int | None]) -> Path:
    """A folder holding the given tracker files as the store has them: the run's own folder for a local store, else
    the download cache, brought up to date for these files only."""
    local = local_artifact_dir(artifact_uri)
    if local is not None:
        return local / TRACKER_DIR
    return _fetch_files(uri, run_id, artifact_uri, TRACKER_DIR, files)


def _run_files(uri: str, run_id: str, artifact_uri: str, n_files: int,
               pick: Callable[[list[str]], list[str]] | None = None) -> tuple[Path | None, list[str]]:
    """The run's first `n_files` tracker files (those `pick` chooses of them) and a local folder holding them (a
    remote store's fetched: only these, only where missing or resized); no folder where there are none."""
    listing = _list_tracker(uri, run_id, artifact_uri) if n_files else {}
    names = list(listing)[:n_files]
    names = pick(names) if pick is not None and names else names
    return (_tracker_folder(uri, run_id, artifact_uri, {n: listing[n] for n in names}) if names else None), names


def _read_tables(paths: list[Path], columns: list[str], prompt_id: str | None = None) -> pa.Table | None:
    tables = []
    for path in paths:
        names = pq.read_schema(path).names
        cols = [c for c in columns if c in names]
        filt = [("prompt_id", "=", prompt_id)] if prompt_id is not None else None
        t = pq.read_table(path, columns=cols, filters=filt)
        if t.num_rows:
            tables.append(t)
    if not tables:
        return None
    return pa.concat_tables(tables, promote_options="permissive")


def _defaults(df: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """Fill columns an older tracker did not write, so the pages can rely on the contract's columns; also their nulls
    in the integer columns, where an older file's rows are read together with a newer file's (as LIGHT_FILL)."""
    for col in columns:
        if col in df.columns:
            if col in ("level", "max_level_tried", "rollouts", "difficulty") and df[col].isna().any():
                df[col] = df[col].fillna(-1 if col == "difficulty" else 0).astype("int64")
            continue
        if col in BOOL_COLUMNS:
            df[col] = False
        elif col == "trained":  # written since dapo-filter's swapped-out prompts got rows: every older row was
            df[col] = True
        elif col in ("level", "max_level_tried", "rollouts", "difficulty"):
            df[col] = -1 if col == "difficulty" else 0
        elif col in FLOAT_COLUMNS:
            df[col] = np.nan
        elif col == "base_state":
            df[col] = "na"
        else:
            df[col] = None
    return df


# ---- the light columns, one table per tracker file, kept between reruns


class _LightCache:
    """The light table of each tracker file read lately, by folder and file name, with the file's (size, mtime) when
    read. A live run's new step reads one file, not the run's thousands again; a file rewritten under its name (a
    resumed run) has another size or mtime and is read again. The folders used least lately go past
    LIGHT_CACHE_FOLDERS."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.folders: OrderedDict[str, dict[str, tuple[tuple[int, int], pa.Table]]] = OrderedDict()

    def get(self, folder: Path, sigs: dict[str, tuple[int, int]]) -> dict[str, pa.Table]:
        with self.lock:
            have = self.folders.setdefault(str(folder), {})
            self.folders.move_to_end(str(folder))
            while len(self.folders) > LIGHT_CACHE_FOLDERS:
                self.folders.popitem(last=False)
            return {n: t for n, (sig, t) in have.items() if sigs.get(n) == sig}

    def put(self, folder: Path, read: dict[str, tuple[tuple[int, int], pa.Table]]) -> None:
        with self.lock:
            self.folders.setdefault(str(folder), {}).update(read)


@st.cache_resource(show_spinner=False)
def _light_cache() -> _LightCache:
    return _LightCache()


def _light_tables(folder: Path, names: list[str]) -> list[pa.Table]:
    """The light table of each named file of ``folder`` (in that order), reading only the files not cached as they
    are now."""
    sigs = {}
    for n in names:
        s = os.stat(folder / n)
        sigs[n] = (s.st_size, s.st_mtime_ns)  # taken before reading: a file changed meanwhile is read again next time
    cache = _light_cache()
    have = cache.get(folder, sigs)
    todo = [n for n in names if n not in have]
    if todo:
        with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(todo))) as pool:
            read = dict(zip(todo, pool.map(lambda n: _read_light(folder / n), todo)))
        cache.put(folder, {n: (sigs[n], t) for n, t in read.items()})
        have.update(read)
    return [have[n] for n in names]


def _read_light(path: Path) -> pa.Table:
    """One tracker file's light columns in the frame's types (LIGHT_TYPES), with the defaults of the columns an older
    tracker did not write. One open per file; the strings dictionary-encoded per file, so the frame's categories are
    built without a Python string per row (the cold frame peaked at ~10x its size with them). Not read_dictionary:
    it refuses a column the file lacks."""
    try:
        with pq.ParquetFile(path) as f:
            have = set(f.schema_arrow.names)  # schema_arrow is built again on each access
            table = f.read(columns=[c for c in LIGHT_COLUMNS if c in have], use_threads=False)
    except (OSError, pa.ArrowException) as e:
        raise OSError(f"cannot read the tracker file {path}: {e}") from e
    if "prompt_id" in table.column_names:  # in the frame's order: files come in step order, so no sort of the frame
        table = table.take(pc.sort_indices(table.column("prompt_id").cast(pa.string())))
    n = table.num_rows
    return pa.table({c: _light_column(table.column(c) if c in table.column_names else pa.nulls(n), c)
                     for c in LIGHT_COLUMNS})


def _light_column(col, name: str) -> pa.Array:
    """A column as LIGHT_TYPES[name], nulls as the frame has them (LIGHT_FILL; floats stay null: NaN in pandas). A
    value Arrow cannot cast (a string in a number column) becomes the column's fill value, as pandas' coercion did."""
    typ, fill = LIGHT_TYPES[name], LIGHT_FILL.get(name)
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if pa.types.is_dictionary(typ):
        if col.type != typ:
            col = pc.dictionary_encode(col.cast(pa.string()))
        if fill is not None and col.null_count:
            col = pc.dictionary_encode(pc.fill_null(col.cast(pa.string()), fill))
        return col
    try:
        out = col.cast(typ)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        s = col.to_pandas()
        s = s.fillna(False) if pa.types.is_boolean(typ) else pd.to_numeric(s, errors="coerce")
        s = s.astype(bool) if pa.types.is_boolean(typ) else s.fillna(np.nan if fill is None else fill)
        out = pa.array(s, from_pandas=True).cast(typ, safe=False)  # 2.5 -> 2, as astype did
    return pc.fill_null(out, pa.scalar(fill, typ)) if fill is not None and out.null_count else out


def _frame_of(tables: list[pa.Table]) -> pd.DataFrame:
    """The light tables of a run's files as one frame, sorted by (step, prompt_id); the string columns categorical
    with their categories sorted (the order in which pandas groups and sorts them)."""
    if not tables or not any(t.num_rows for t in tables):
        return _defaults(pd.DataFrame(), LIGHT_COLUMNS)
    df = pa.concat_tables(tables).to_pandas()
    for col in DICT_COLUMNS:
        df[col] = df[col].cat.reorder_categories(sorted(df[col].cat.categories))
    if _in_order(df):  # the usual case: a sort would only copy the frame (a third of the cold load's peak)
        return df
    return df.sort_values(["step", "prompt_id"], kind="stable").reset_index(drop=True)


def _in_order(df: pd.DataFrame) -> bool:
    """Whether the frame is sorted by (step, prompt_id) as read: each file's rows by prompt id, files by step."""
    step = df["step"].to_numpy()
    code = df["prompt_id"].cat.codes.to_numpy().astype(np.int64)
    code[code < 0] = np.iinfo(np.int64).max  # a missing id sorts last, as in sort_values
    return bool(np.all((step[1:] > step[:-1]) | ((step[1:] == step[:-1]) & (code[1:] >= code[:-1]))))


@st.cache_data(show_spinner="Reading the per-prompt tracker ...", max_entries=4)
def tracker_frame(uri: str, run_id: str, artifact_uri: str, n_files: int, files: str = "") -> pd.DataFrame:
    """The light tracker columns of every step of a run, one row per (step, prompt), as one frame.

    Cached by (run_id, n_files, files): `files` is the files' key (Context.files_key: their sizes and mtimes, and
    the run's end), so a new step file of a live run, or a step a resumed run trains again under its file's name,
    changes it. Few entries: a live run's earlier keys never come back, and a miss reads only the files not in the
    per-file cache (`_light_tables`).
    """
    folder, names = _run_files(uri, run_id, artifact_uri, n_files)
    if not names:
        return _defaults(pd.DataFrame(), LIGHT_COLUMNS)
    return _frame_of(_light_tables(folder, names))


@st.cache_data(show_spinner=False, max_entries=32)
def prompt_detail(uri: str, run_id: str, artifact_uri: str, n_files: int, prompt_id: str,
                  steps: tuple[int, ...], files: str = "") -> pd.DataFrame:
    """Every tracker row (all columns) of one prompt, reading (and fetching) only the step files it appears in.
    Cached by the files' key too, as tracker_frame: a resumed run rewrites the files of the steps it trains again."""
    def of_steps(names: list[str]) -> list[str]:
        by_step = {int(TRACKER_RE.match(n).group(1)): n for n in names}
        return [by_step[s] for s in steps if s in by_step] or names

    folder, wanted = _run_files(uri, run_id, artifact_uri, n_files, of_steps)
    table = _read_tables([folder / n for n in wanted], DETAIL_COLUMNS, prompt_id=str(prompt_id))
    if table is None:
        return _defaults(pd.DataFrame(), DETAIL_COLUMNS)
    return _defaults(table.to_pandas(), DETAIL_COLUMNS).sort_values("step").reset_index(drop=True)


@st.cache_data(show_spinner=False, max_entries=4)
def prompt_texts(uri: str, run_id: str, artifact_uri: str, n_files: int, files: str = "") -> pd.DataFrame:
    """prompt_id -> problem, answer (first time each prompt appears: its first file, its first row there); cached
    by the files' key too, as tracker_frame.

    The first file of each prompt comes from the light tables' prompt ids, so only those files are read for text
    (a 3000-step run of 10k prompts: about 50 files), not every file of the run.
    """
    empty = pd.DataFrame(columns=["prompt_id", "problem", "answer"])
    folder, names = _run_files(uri, run_id, artifact_uri, n_files)
    if not names:
        return empty
    tables = _light_tables(folder, names)
    ids = pa.chunked_array([c for t in tables for c in t.column("prompt_id").chunks], LIGHT_TYPES["prompt_id"])
    ids = ids.to_pandas()
    first = pd.DataFrame({"prompt_id": ids, "file": np.repeat(np.arange(len(tables)), [t.num_rows for t in tables])})
    first = first[first["prompt_id"].notna()].drop_duplicates("prompt_id")
    parts = []
    for i, group in first.groupby("file", sort=True):
        part = _texts_of(folder / names[i], list(group["prompt_id"].astype(str)))
        if part is not None and len(part):
            parts.append(part)
    if not parts:
        return empty
    df = pd.concat(parts, ignore_index=True)
    for col in ("problem", "answer"):
        if col not in df:
            df[col] = ""
    return df[["prompt_id", "problem", "answer"]]


def _texts_of(path: Path, prompt_ids: list[str]) -> pd.DataFrame | None:
    """The problem and answer of the given prompts in one tracker file (each prompt's first row in it)."""
    with pq.ParquetFile(path) as f:
        have = set(f.schema_arrow.names)
        cols = [c for c in ("prompt_id", "problem", "answer") if c in have]
        if "prompt_id" not in cols:
            return None
        t = f.read(columns=cols, use_threads=False)
    t = t.filter(pc.is_in(t.column("prompt_id").cast(pa.string()), value_set=pa.array(prompt_ids, pa.string())))
    part = t.to_pandas()
    part["prompt_id"] = part["prompt_id"].astype(str)
    return part.drop_duplicates("prompt_id")


@st.cache_data(ttl=LIVE_TTL, show_spinner=False, max_entries=64)
def artifact_parquet(uri: str, run_id: str, artifact_uri: str, path: str) -> pd.DataFrame | None:
    """A Parquet artifact of a run (``study/comparison.parquet``, ``eval/eval.parquet``) or None if absent."""
    local = local_artifact_dir(artifact_uri)
    try:
        if local is not None:
            f = local / path
            if not f.is_file():
                return None
        else:
            listing = {a.path for a in client(uri).list_artifacts(run_id, str(Path(path).parent))}
            if path not in listing:
                return None
            f = _download(uri, run_id, path)
        return pd.read_parquet(f)
    except Exception:  # noqa: BLE001 - a missing or unreadable artifact is "absent" for the pages
        return None


# ----------------------------------------------------------------------------------------------------------------
# pure computations (testable without Streamlit)


def gate_open_prob(p, G: int):
    """u(p) = 1 - (1-p)^G - p^G: the probability that a group of G rollouts is mixed (the gate is open)."""
    p = np.asarray(p, dtype=float)
    return 1.0 - (1.0 - p) ** G - p ** G


def gate_open_bins(frame: pd.DataFrame, G: int, n_bins: int = 10) -> pd.DataFrame:
    """Empirical gate-open rate per pass-rate bin, with the theory u(p) for comparison.

    A group is open when ``base_state == "mixed"``. Its pass rate p is estimated from the *other* no-hint groups of
    the same prompt (leave-one-out mean of ``base_pass_rate``), so a group's own outcome does not decide its bin
    (binning by the group's own rate would make every bin trivially 0 or 1). Groups of prompts seen only once, and
    groups without a no-hint rollout (``base_state == "na"``, sage-light) are left out.
    Columns: bin, p_lo, p_hi, p_mean, groups, open, open_rate, theory (mean of u(p) over the bin's groups).
    """
    cols = ["bin", "p_lo", "p_hi", "p_mean", "groups", "open", "open_rate", "theory"]
    if frame.empty:
        return pd.DataFrame(columns=cols)
    f = frame.loc[frame["base_state"].astype(str).isin(["all0", "all1", "mixed"]) & frame["base_pass_rate"].notna(),
                  ["prompt_id", "base_pass_rate", "base_state"]]
    if f.empty:
        return pd.DataFrame(columns=cols)
    pid = f["prompt_id"].astype(str)
    x = f["base_pass_rate"].astype(float)
    s = x.groupby(pid).transform("sum")
    n = x.groupby(pid).transform("count")
    keep = n >= 2
    p = ((s - x) / (n - 1)).where(keep).clip(0.0, 1.0)
    opened = (f["base_state"].astype(str) == "mixed")
    d = pd.DataFrame({"p": p, "open": opened}).dropna()
    if d.empty:
        return pd.DataFrame(columns=cols)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    d["bin"] = np.clip(np.digitize(d["p"], edges[1:-1], right=False), 0, n_bins - 1)
    d["u"] = gate_open_prob(d["p"], G)
    g = d.groupby("bin").agg(p_mean=("p", "mean"), groups=("open", "size"), open=("open", "sum"),
                             theory=("u", "mean")).reset_index()
    g["p_lo"] = edges[g["bin"]]
    g["p_hi"] = edges[g["bin"] + 1]
    g["open"] = g["open"].astype(int)
    g["open_rate"] = g["open"] / g["groups"]
    return g[cols]


def prompt_summary(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per prompt: difficulty, steps seen, mean pass rates, mean/max level trained, max level tried, collapse
    counts, never-solved."""
    if frame.empty:
        return pd.DataFrame(columns=["prompt_id", "difficulty", "steps", "pass_rate", "base_pass_rate", "mean_level",
                                     "max_level", "max_level_tried", "all0", "all1", "collapsed", "rescued",
                                     "hint_failed",
                                     "never_solved", "never_solved_no_hint"])
    f = frame.assign(
        _all0=frame["base_state"].astype(str) == "all0",
        _all1=frame["base_state"].astype(str) == "all1",
        _coll=collapsed_mask(frame),
        # solved: a correct rollout at all, the trained group's or a tried hint level's (as sage/never_solved)
        _solved=(frame["pass_rate"].fillna(0) > 0) | _any_level_solved(frame),
        # solved without a hint: a correct rollout in the first no-hint group, or in a group trained at level 0
        # (ada-seq's later rounds: the first group all-0, the pooled one not), as sage/never_solved_no_hint
        _solved_base=(frame["base_pass_rate"].fillna(0) > 0) | ((frame["level"] == 0)
                                                              & (frame["pass_rate"].fillna(0) > 0)),
    )
    g = f.groupby("prompt_id", observed=True)
    out = pd.DataFrame({
        "difficulty": g["difficulty"].max(),
        "steps": g["step"].size(),
        "pass_rate": g["pass_rate"].mean(),
        "base_pass_rate": g["base_pass_rate"].mean(),
        "mean_level": g["level"].mean(),
        "max_level": g["level"].max(),  # the highest level trained on
        "max_level_tried": g["max_level_tried"].max(),  # and searched (SAGE: tried, none rescued it: trained at 0)
        "all0": g["_all0"].sum(),
        "all1": g["_all1"].sum(),
        "collapsed": g["_coll"].sum(),
        "rescued": g["rescued"].sum(),
        "hint_failed": g["hint_failed"].sum(),
        "never_solved": ~g["_solved"].any(),
        "never_solved_no_hint": ~g["_solved_base"].any(),
    }).reset_index()
    out["prompt_id"] = out["prompt_id"].astype(str)
    return out


def _any_level_solved(frame: pd.DataFrame) -> pd.Series:
    levels = [frame[c].fillna(0) > 0 for c in ("acc_l1", "acc_l2", "acc_l3") if c in frame]
    return pd.concat(levels, axis=1).any(axis=1) if levels else pd.Series(False, index=frame.index)


def collapsed_mask(frame: pd.DataFrame) -> pd.Series:
    """Groups whose gate was closed: the no-hint group was all-0 or all-1. When the method hinted before rolling
    out (``base_state == "na"``, sage-light) the trained group's own pass rate decides (0 or 1)."""
    state = frame["base_state"].astype(str)
    na = state == "na"
    final = frame["pass_rate"].astype(float)
    return state.isin(["all0", "all1"]) | (na & ((final == 0) | (final == 1)))


SORTS = {
    "difficulty (hardest first)": (["difficulty", "pass_rate", "prompt_id"], [False, True, True]),
    "overall pass rate (lowest first)": (["pass_rate", "prompt_id"], [True, True]),
    "mean hint level (highest first)": (["mean_level", "pass_rate", "prompt_id"], [False, True, True]),
    "prompt id": (["prompt_id"], [True]),
}


def sort_prompts(summary: pd.DataFrame, how: str) -> pd.DataFrame:
    by, asc = SORTS[how]
    return summary.sort_values(by, ascending=asc, kind="stable", na_position="last").reset_index(drop=True)


def level_cells(frame: pd.DataFrame, prompt_ids: list[str], max_cols: int) -> tuple[pd.DataFrame, int]:
    """Heatmap cells for the given prompts: prompt_id, step_lo, step_hi, level (max level in the step bin),
    pass_rate (mean). Steps are binned into at most ``max_cols`` columns. Returns (cells, bin width)."""
    sub = frame.loc[frame["prompt_id"].isin(prompt_ids), ["prompt_id", "step", "level", "pass_rate", "base_state"]]
    if sub.empty:
        return pd.DataFrame(columns=["prompt_id", "step_lo", "step_hi", "level", "pass_rate"]), 1
    s_min, s_max = int(frame["step"].min()), int(frame["step"].max())
    width = max(1, int(np.ceil((s_max - s_min + 1) / max(1, max_cols))))
    sub = sub.assign(prompt_id=sub["prompt_id"].astype(str), step_lo=s_min + (sub["step"] - s_min) // width * width)
    cells = sub.groupby(["prompt_id", "step_lo"], observed=True).agg(
        level=("level", "max"), pass_rate=("pass_rate", "mean"), base_state=("base_state", "last")).reset_index()
    cells["step_hi"] = cells["step_lo"] + width
    cells["base_state"] = cells["base_state"].astype(str)
    return cells, width


def step_x(field: str = "step", title: str = "step"):
    """An integer step axis (no 1.5 ticks on short runs)."""
    import altair as alt

    return alt.X(f"{field}:Q", title=title, axis=alt.Axis(format="d", tickMinStep=1), scale=alt.Scale(nice=False))


def variant_label(method: str, hint_source: str) -> str:
    m = (method or "").lower()
    if m == "grpo":
        return "GRPO"
    if m == "sage-light":
        return "SAGE-LIGHT"
    if m == "sage":
        return f"SAGE ({hint_source or 'online'})"
    return (method or "?").upper()


def variant_color(order: list[str]):
    """A colour scale that keeps each variant's colour across charts (GRPO gray, SAGE-LIGHT green, ...); a label made
    unique by its run ("GRPO · grpo-s1", one per seed) has its variant's colour."""
    import altair as alt

    extra = ["#8c564b", "#e377c2", "#bcbd22", "#17becf", "#d62728"]
    colors = [VARIANT_COLORS[r] if (r := variant_rank(v)) < len(VARIANT_ORDER) else extra[i % len(extra)]
              for i, v in enumerate(order)]
    return alt.Scale(domain=list(order), range=colors)


def variant_rank(label: str) -> int:
    """The variant's place in VARIANT_ORDER (after them all when it is none of them), read without the run name the
    Variants page adds to tell runs of one variant apart ("GRPO · grpo-s1")."""
    base = str(label).split(" · ", 1)[0]
    return VARIANT_ORDER.index(base) if base in VARIANT_ORDER else len(VARIANT_ORDER)


def compare_url(run_ids: list[str], experiment_ids: list[str], base: str | None = None) -> str:
    """MLflow's compare page for the runs: ``#/compare-runs?runs=[...]&experiments=[...]`` (JSON, URL-encoded)."""
    base = (base or mlflow_ui_url()).rstrip("/")
    enc = lambda xs: quote(json.dumps(list(xs), separators=(",", ":")), safe="")
    return f"{base}/#/compare-runs?runs={enc(run_ids)}&experiments={enc(dict.fromkeys(experiment_ids))}"


def run_url(run_id: str, experiment_id: str, base: str | None = None) -> str:
    return f"{(base or mlflow_ui_url()).rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


# ----------------------------------------------------------------------------------------------------------------
# page context (filled by app.py, read by the pages)


@dataclass
class Context:
    uri: str
    experiment_id: str
    experiment_name: str
    runs: pd.DataFrame  # all runs of the experiment
    selected: list[str]  # run ids picked in the sidebar
    _files: dict[str, tuple[int, str]] = field(default_factory=dict, repr=False)  # tracker_state, per rerun

    def run(self, run_id: str) -> pd.Series:
        return self.runs.set_index("run_id").loc[run_id]

    def tracker_state(self, run_id: str) -> tuple[int, str]:
        """(number of the run's tracker files the pages read, their files_key): the files up to an ended run's last
        step (sorted last: [:n] leaves the others out), keyed by their sizes and mtimes and the run's end. Taken once
        per rerun (the context is built for each), so the frame and what the pages compute of it share one key."""
        if run_id not in self._files:
            r = self.run(run_id)
            listing = tracker_listing(self.uri, run_id, r["artifact_uri"])
            last = r.get("last_step")
            if last is not None and not pd.isna(last):
                listing = listing[:sum(int(TRACKER_RE.match(f[0]).group(1)) <= last for f in listing)]
            self._files[run_id] = (len(listing), files_key(listing, _end_key(r.get("end_time"))))
        return self._files[run_id]

    def files_key(self, run_id: str) -> str:
        """The key of what is computed from the run's tracker files, cached by (run id, number of files, this): a
        resumed run rewrites the steps it trains again under their names, live (its number of files unchanged, no
        new end) or ended again, and they are read again."""
        return self.tracker_state(run_id)[1]

    def label(self, run_id: str) -> str:
        r = self.run(run_id)
        parts = [r["run_name"], r["method"] + (f"/{r['hint_source']}" if r["hint_source"] else "")]
        return " · ".join(p for p in parts if p) + f" ({run_id[:8]})"


CTX_KEY = "_sage_ctx"


def context() -> Context:
    """The context app.py built for this rerun (pages call this)."""
    ctx = st.session_state.get(CTX_KEY)
    if ctx is None:  # a page run on its own (not through app.py)
        st.warning("Open the dashboard through `streamlit run dashboards/app.py`.")
        st.stop()
    return ctx


def pick_run(ctx: Context, key: str, predicate=None, label: str = "Run") -> str | None:
    """One run among the sidebar selection (or all runs when none selected) for single-run pages."""
    pool = ctx.selected or list(ctx.runs["run_id"])
    if predicate is not None:
        rows = ctx.runs.set_index("run_id")
        pool = [r for r in pool if predicate(rows.loc[r])] or [r for r in rows.index if predicate(rows.loc[r])]
    if not pool:
        return None
    return st.selectbox(label, pool, format_func=ctx.label, key=key)


def pick_run_with_tracker(ctx: Context, key: str) -> tuple[str, pd.DataFrame, int]:
    """For per-prompt pages: the picked run and its tracker frame, or an info message and st.stop()."""
    run_id = pick_run(ctx, key)
    if run_id is None:
        st.info("Pick a run in the sidebar.")
        st.stop()
    frame, n_files = tracker_for(ctx, run_id)
    if frame.empty:
        st.info("This run has no per-prompt tracker files (`tracker/step_*.parquet`).")
        st.stop()
    return run_id, frame, n_files


def tracker_for(ctx: Context, run_id: str) -> tuple[pd.DataFrame, int]:
    n, key = ctx.tracker_state(run_id)
    return tracker_frame(ctx.uri, run_id, ctx.run(run_id)["artifact_uri"], n, key), n
