"""Dashboard tests with streamlit.testing.v1.AppTest.

- `real_store`: a real MLflow database written by a tiny SAGE training run (sage_core.train.train with the
  sage_core.tracking callback, in a subprocess); the pages must show the numbers that run logged.
- `dashboard_store`: a contract-shaped store (tests/dashboard_fixtures.py) with a hint study, for the pages a
  2-step run cannot fill (variant comparison, never-solved prompts, sorting).
- a 2000 prompts x 200 steps tracker set: the per-prompt pages must stay responsive (render time printed).
- a missing / empty / unreadable store: a clear message, never a traceback, and no sqlite file created.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

try:
    from tests.dashboard_fixtures import EVAL_DURING, build_seed_study, dashboard_store, real_store, write_big_tracker
except ImportError:
    from dashboard_fixtures import EVAL_DURING, build_seed_study, dashboard_store, real_store, write_big_tracker  # noqa: F401

APP = str(Path(__file__).resolve().parents[1] / "dashboards" / "app.py")
PAGES = {"gate": "app_pages/gate.py", "levels": "app_pages/levels.py", "explorer": "app_pages/explorer.py",
         "variants": "app_pages/variants.py", "runs": "app_pages/runs.py"}


def _app(monkeypatch, uri: str | None, **env) -> AppTest:
    if uri is None:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return AppTest.from_file(APP, default_timeout=120)


def _ok(at: AppTest) -> AppTest:
    assert not at.exception, [e.value for e in at.exception]
    return at


def _metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def _frame(at: AppTest, column: str) -> pd.DataFrame:
    """The first dataframe on the page that has `column`."""
    for df in at.dataframe:
        if column in df.value.columns:
            return df.value
    raise AssertionError(f"no dataframe with column {column!r}: {[list(d.value.columns) for d in at.dataframe]}")


def _select_runs(at: AppTest, experiment_id: str, run_ids: list[str]) -> AppTest:
    return at.multiselect(key=f"runs::{experiment_id}").set_value(run_ids).run()


def _tracker(store: dict, run_id: str) -> pd.DataFrame:
    from mlflow.tracking import MlflowClient

    from dashboards.data import local_artifact_dir

    art = local_artifact_dir(MlflowClient(store["uri"]).get_run(run_id).info.artifact_uri)
    files = sorted((art / "tracker").glob("step_*.parquet"))
    assert files, f"no tracker files under {art}"
    return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)


def _charts(at: AppTest) -> list:
    return at.get("vega_lite_chart")


# ------------------------------------------------------------------------------------------------ the store


def test_tracking_uri_rule_is_sage_core_s(monkeypatch, tmp_path):
    from dashboards import data as D
    from sage_core import tracking

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    assert D.tracking_uri() == tracking.tracking_uri() == f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert D.tracking_uri() == tracking.tracking_uri() == "http://mlflow:5000"
    monkeypatch.setenv("SAGE_MLFLOW_UI_URL", "http://ui:5005/")
    assert D.mlflow_ui_url() == tracking.ui_url() == "http://ui:5005"


def test_a_tracking_uri_is_shown_without_its_user_and_password(monkeypatch, capsys):
    """A store URI with credentials (postgresql://u:p@db, https://token@host) was printed whole by `sage train`,
    the flows' logs and links and the dashboard's captions; they show it with the user and password written ***."""
    from dashboards import data as D
    from sage_core import tracking

    for uri, shown in (("postgresql://alice:s3cret@db:5432/mlflow", "postgresql://***@db:5432/mlflow"),
                       ("https://tok3n@mlflow.example/", "https://***@mlflow.example/"),
                       ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
                       ("sqlite:////home/me/.sage/mlflow.db", "sqlite:////home/me/.sage/mlflow.db"),
                       ("http://host/path?x=a@b", "http://host/path?x=a@b")):
        assert D.shown_uri(uri) == tracking.shown_uri(uri) == shown
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql://alice:s3cret@db:5432/mlflow")
    assert "s3cret" not in tracking.shown_uri()


def test_missing_store_shows_a_message_and_creates_nothing(monkeypatch, tmp_path):
    home = tmp_path / "no-such-home"
    at = _ok(_app(monkeypatch, None, SAGE_HOME=str(home)).run())
    assert at.warning and "No MLflow tracking store yet" in at.warning[0].value
    assert str(home / "mlflow.db") in at.warning[0].value
    for page in ("gate", "explorer"):
        _ok(at.switch_page(PAGES[page]).run())
        assert at.warning and "No MLflow tracking store yet" in at.warning[0].value
    assert not home.exists(), "the dashboard must not create SAGE_HOME or a sqlite DB"


def test_missing_sqlite_uri_and_unreadable_db(monkeypatch, tmp_path):
    db = tmp_path / "elsewhere" / "mlflow.db"
    at = _ok(_app(monkeypatch, f"sqlite:///{db}").run())
    assert at.warning and str(db) in at.warning[0].value
    assert not db.exists()

    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not a sqlite database" * 100)
    at = _ok(_app(monkeypatch, f"sqlite:///{bad}").run())
    assert at.error and "Cannot read the MLflow tracking store" in at.error[0].value


def test_empty_store_says_there_are_no_runs(monkeypatch, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()  # creates and migrates an empty store (the Default experiment)
    at = _ok(_app(monkeypatch, uri).run())
    assert at.info and "has no runs yet. Train something first (`make demo`" in at.info[0].value
    _ok(at.switch_page(PAGES["levels"]).run())
    assert at.info and "has no runs yet" in at.info[0].value


def test_runs_page_while_every_run_is_still_running(monkeypatch, tmp_path):
    """The first minutes of `make demo`: a study run and its first child, both RUNNING, nothing logged yet."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = MlflowClient(uri)
    exp = c.create_experiment("live")
    study = c.create_run(exp, run_name="study", tags={"sage.kind": "study"})
    child = c.create_run(exp, run_name="grpo", tags={"sage.kind": "train", "sage.method": "grpo",
                                                     "mlflow.parentRunId": study.info.run_id})
    at = _ok(_app(monkeypatch, uri).run())
    table = _frame(at, "run_id")
    assert set(table["run_id"]) == {study.info.run_id, child.info.run_id}
    assert set(table["status"]) == {"RUNNING"} and table["minutes"].isna().all()


def test_a_reopened_running_run_shows_no_end_of_its_earlier_attempt(monkeypatch, tmp_path):
    """A run resumed by a flow or `sage train` is RUNNING again, but MLflow keeps the end time of its earlier attempt
    (update_run cannot clear it): the runs page showed that attempt's duration as the live run's. A RUNNING run has
    no end in the runs frame, so no duration, as a run in its first attempt."""
    from mlflow.tracking import MlflowClient

    from dashboards import data as D

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = MlflowClient(uri)
    exp = c.create_experiment("reopened")
    rid = c.create_run(exp, run_name="grpo", tags={"sage.kind": "train", "sage.method": "grpo"},
                       start_time=1_700_000_000_000).info.run_id
    c.set_terminated(rid, "KILLED", end_time=1_700_000_600_000)  # the first attempt: 10 minutes
    c.update_run(rid, status="RUNNING")  # what tracking.open_run does to resume it
    assert c.get_run(rid).info.end_time == 1_700_000_600_000  # MLflow keeps it
    run = D.runs(uri, exp).set_index("run_id").loc[rid]
    assert run["status"] == "RUNNING" and pd.isna(run["end_time"])
    table = _frame(_ok(_app(monkeypatch, uri).run()), "run_id").set_index("run_id")
    assert table.loc[rid, "status"] == "RUNNING" and pd.isna(table.loc[rid, "minutes"])
    c.set_terminated(rid, "FINISHED", end_time=1_700_001_200_000)  # ended again: 20 minutes since its start
    D.runs.clear()
    table = _frame(_ok(_app(monkeypatch, uri).run()), "run_id").set_index("run_id")
    assert table.loc[rid, "minutes"] == 20.0


def test_minutes_of_a_run_resumed_hours_later_leave_out_the_time_it_was_stopped(monkeypatch, tmp_path):
    """A run trained for 30 minutes, stopped, and resumed 10 hours after its start (the same MLflow run reopened by
    tracking.open_run, as `sage train` and the flows do) for 20 more minutes ran 50 minutes: the runs page showed its
    start to its end, 10 h 20 min. Runs reopened by a version that recorded no spans fall back: their training
    sessions' wall time logged since the reopening (summary/wall_seconds), else their start to their end, as a run
    never reopened."""
    from mlflow.entities import Metric

    from dashboards import data as D
    from sage_core import tracking
    from sage_core.spec import RunSpec

    try:
        from tests.dashboard_fixtures import _experiment, _store
    except ImportError:
        from dashboard_fixtures import _experiment, _store

    uri, client = _store(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # tracking.open_run's store
    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    exp = _experiment(client, tmp_path, "resumed-later")
    minute, hour = 60_000, 3_600_000
    start = int(time.time() * 1000) - 10 * hour
    tags = {"sage.kind": "train", "sage.method": "grpo"}

    def stopped(name: str) -> str:  # trained 30 minutes from 10 hours ago, then stopped
        rid = client.create_run(exp, run_name=name, start_time=start, tags=tags).info.run_id
        client.set_terminated(rid, "KILLED", end_time=start + 30 * minute)
        return rid

    resumed = stopped("resumed")
    tracking.open_run(RunSpec(method="grpo"), "train", run_id=resumed)  # resumed now
    reopened = int(client.get_run(resumed).data.tags[tracking.REOPENED_TAG])
    assert reopened - start >= 10 * hour and D.RAN_BEFORE_TAG == tracking.RAN_BEFORE_TAG
    assert float(client.get_run(resumed).data.tags[tracking.RAN_BEFORE_TAG]) == 30 * 60
    client.set_terminated(resumed, "FINISHED", end_time=reopened + 20 * minute)

    old_wall, old_span = stopped("older, wall logged"), stopped("older, nothing logged")
    for rid in (old_wall, old_span):  # reopened by a version without the spans: the reopening tag only
        client.update_run(rid, "RUNNING")
        client.set_tag(rid, D.REOPENED_TAG, str(start + 9 * hour))
    client.log_batch(old_wall, metrics=[Metric(D.WALL_METRIC, 2400.0, start + 9 * hour + 12 * minute, 4)])
    client.log_batch(old_span, metrics=[Metric(D.WALL_METRIC, 1800.0, start + 31 * minute, 2)])  # the first attempt's
    for rid in (old_wall, old_span):
        client.set_terminated(rid, "FINISHED", end_time=start + 9 * hour + 15 * minute)
    never = client.create_run(exp, run_name="never reopened", start_time=start, tags=tags).info.run_id
    client.set_terminated(never, "FINISHED", end_time=start + 45 * minute)

    D.runs.clear()
    frame = D.runs(uri, exp).set_index("run_id")
    assert frame.loc[resumed, "ran_seconds"] == tracking.ran_seconds(client.get_run(resumed)) == 50 * 60
    table = _frame(_ok(_app(monkeypatch, uri).run()), "run_id").set_index("run_id")
    assert table.loc[resumed, "minutes"] == 50.0  # 30 + 20, not its start to its end
    assert (frame.loc[resumed, "end_time"] - frame.loc[resumed, "start_time"]).total_seconds() > 10 * 3600
    assert table.loc[old_wall, "minutes"] == 40.0  # its sessions' wall time, logged since its reopening
    assert table.loc[old_span, "minutes"] == 9 * 60 + 15.0  # a wall time of the attempt before: start to end
    assert table.loc[never, "minutes"] == 45.0


def test_a_run_resumed_and_ended_again_is_read_again(tmp_path):
    """A FINISHED run trained on (more max_steps) ends FINISHED again: its history and tracker are read again, not
    served from the cache of its first end."""
    from mlflow.tracking import MlflowClient

    from dashboards import data as D

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = MlflowClient(uri)
    rid = c.create_run(c.create_experiment("resumed")).info.run_id
    c.log_metric(rid, "reward", 0.1, step=1)
    c.set_terminated(rid, "FINISHED", end_time=1_000)
    exp = c.get_run(rid).info.experiment_id

    def row():
        D.runs.clear()  # the runs search is cached for seconds: the page's next rerun after that
        return D.runs(uri, exp).set_index("run_id").loc[rid]

    run = row()
    assert list(D.metric_history(uri, rid, ["reward"], run["status"], run["end_time"])["step"]) == [1]
    c.log_metric(rid, "reward", 0.2, step=2)  # the resumed run's steps, then its second end
    c.set_terminated(rid, "FINISHED", end_time=2_000)
    again = row()
    assert again["status"] == run["status"] and again["end_time"] != run["end_time"]
    assert list(D.metric_history(uri, rid, ["reward"], again["status"], again["end_time"])["step"]) == [1, 2]


def test_a_download_never_shows_a_partly_written_file(monkeypatch, tmp_path):
    """The tracker files of a store not readable in place are copied into $TMP/sage-dashboard/<run_id>/tracker/, a
    folder every session shares: a fetch (another session's, or another cached reader's) must never rewrite in place
    files a reader is reading. Here the run's files are rewritten (a resumed run trains its steps again), and a reader
    reads the folder halfway through every file the second fetch copies: it sees whole old files or whole new ones."""
    import tempfile

    from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

    from dashboards import data as D

    try:
        from tests.dashboard_fixtures import _experiment, _store, log_run
    except ImportError:
        from dashboard_fixtures import _experiment, _store, log_run

    uri, client = _store(tmp_path / "store")
    rid = log_run(client, _experiment(client, tmp_path / "store", "dl"), name="dl", method="sage", steps=3,
                  n_prompts=4)["run_id"]
    art = client.get_run(rid).info.artifact_uri
    source = D.local_artifact_dir(art) / "tracker"
    sizes = lambda: {f.name: f.stat().st_size for f in sorted(source.glob("step_*.parquet"))}
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    folder = D._fetch_files(uri, rid, art, "tracker", sizes())  # what a first reader fetched
    rows = lambda: D._read_tables(sorted(folder.glob("step_*.parquet")), ["step"]).num_rows
    assert rows() == 12
    for f in source.glob("step_*.parquet"):  # the resumed run's files: each step twice the rows, another size
        pd.concat([pd.read_parquet(f)] * 2).to_parquet(f, index=False)

    copy, reads = LocalArtifactRepository._download_file, []

    def copy_in_two_halves(self, remote_file_path, local_path):
        data = Path(self.artifact_dir, remote_file_path).read_bytes()
        Path(local_path).write_bytes(data[:len(data) // 2])
        try:
            reads.append(rows())
        except Exception as e:  # noqa: BLE001 - what the reader saw, asserted below
            reads.append(f"{type(e).__name__}: {e}")
        copy(self, remote_file_path, local_path)

    monkeypatch.setattr(LocalArtifactRepository, "_download_file", copy_in_two_halves)
    assert D._fetch_files(uri, rid, art, "tracker", sizes()) == folder  # a second fetch, while the first reader reads
    assert len(reads) == 3 and all(r in range(12, 25, 4) for r in reads), reads  # 4 rows a file, old or new
    assert rows() == 24 and [p.name for p in folder.parent.iterdir()] == ["tracker"]  # nothing left over
    reads.clear()
    assert D._fetch_files(uri, rid, art, "tracker", sizes()) == folder and reads == []  # all current: none fetched
    # a listing without sizes (a server that leaves file_size out): a file missing here is fetched all the same
    (folder / "step_000002.parquet").unlink()
    monkeypatch.setattr(LocalArtifactRepository, "_download_file", copy)
    assert D._fetch_files(uri, rid, art, "tracker", dict.fromkeys(sizes())) == folder and rows() == 24


def test_pages_stop_at_the_last_step_of_a_run_resumed_with_fewer_steps(monkeypatch, tmp_path):
    """A run killed after step 3, resumed to end at step 2 (a lower max_steps; the tag `sage.last_step`): MLflow
    keeps the killed attempt's step-3 metrics and tracker file, which the pages leave out."""
    from dashboards import data as D

    try:
        from tests.dashboard_fixtures import _experiment, _store, log_run
    except ImportError:
        from dashboard_fixtures import _experiment, _store, log_run

    uri, client = _store(tmp_path)
    exp = _experiment(client, tmp_path, "lower")
    run = log_run(client, exp, name="lower", method="sage", steps=3, n_prompts=8, seed=4)
    client.set_tag(run["run_id"], D.LAST_STEP_TAG, "2")
    collapsed = run["frame"].groupby("step")["base_state"].apply(lambda x: (x != "mixed").mean())
    assert f"{collapsed[:2].mean():.3f}" != f"{collapsed.mean():.3f}"  # step 3 would show

    at = _ok(_app(monkeypatch, uri).run())
    _select_runs(at, exp, [run["run_id"]])
    _ok(at.switch_page(PAGES["gate"]).run())
    assert _metrics(at)["Collapsed before hints"] == f"{collapsed[:2].mean():.3f}"  # the metric points
    _ok(at.switch_page(PAGES["levels"]).run())
    assert _metrics(at)["Steps"] == "2"  # the tracker files


def test_runs_page_shows_the_last_eval_of_a_run_resumed_with_another_eval_k(monkeypatch, tmp_path):
    """A run evaluated with eval_k=4 at step 2, resumed with eval_k=8 (and killed at step 6 before, a point past its
    end, sage.last_step 4): "no-hint eval (last)" is the avg@8 of step 4. It was the first key's in name order, the
    avg@4 of step 2 (reproduced with `sage train`: max_steps=2 eval_k=4, then max_steps=4 eval_k=8)."""
    from mlflow.entities import Metric

    from dashboards import data as D

    try:
        from tests.dashboard_fixtures import _experiment, _store
    except ImportError:
        from dashboard_fixtures import _experiment, _store

    uri, client = _store(tmp_path)
    exp = _experiment(client, tmp_path, "evalk")
    rid = client.create_run(exp, run_name="evalk", tags={"sage.kind": "train", "sage.method": "sage-light"}).info.run_id
    at4, at8 = "eval/during/synthetic-heldout/avg_at_4", "eval/during/synthetic-heldout/avg_at_8"
    client.log_batch(rid, metrics=[Metric(at4, 0.25, 1000, 2), Metric(at8, 0.5, 3000, 4), Metric(at8, 0.75, 2000, 6)])
    client.set_tag(rid, D.LAST_STEP_TAG, "4")
    client.set_terminated(rid, "FINISHED")
    at = _ok(_app(monkeypatch, uri).run())
    assert _frame(at, "run_id").set_index("run_id").loc[rid, "no-hint eval (last)"] == 0.5


def _killed_run_of_two_steps(tmp_path, experiment: str):
    """A sage run killed after step 2, every prompt all-0 without a hint and never solved at level 1: (store URI,
    client, run id, write(step, level, k), which writes a step's tracker file again: trained at `level`, k of 4
    rollouts solved)."""
    from dashboards import data as D

    try:
        from tests.dashboard_fixtures import _experiment, _store, make_prompts, tracker_step
    except ImportError:
        from dashboard_fixtures import _experiment, _store, make_prompts, tracker_step

    uri, client = _store(tmp_path)
    exp = _experiment(client, tmp_path, experiment)
    rid = client.create_run(exp, run_name="resumed", tags={"sage.kind": "train", "sage.method": "sage"}).info.run_id
    folder = D.local_artifact_dir(client.get_run(rid).info.artifact_uri) / "tracker"
    folder.mkdir(parents=True)
    prompts, rng = make_prompts(4), np.random.default_rng(0)

    def write(step: int, level: int, k: int) -> None:
        df = tracker_step(prompts, step, 4, "sage", rng)
        df["base_pass_rate"], df["base_state"], df["pass_rate"] = 0.0, "all0", k / 4
        df["level"], df["max_level_tried"], df["rescued"] = level, level, 0 < k < 4
        df["acc_l1"], df["acc_l2"], df["acc_l3"] = np.nan, np.nan, np.nan
        df["rewards"] = [[1.0] * k + [0.0] * (4 - k)] * len(df)
        df.to_parquet(folder / f"step_{step:06d}.parquet", index=False)

    for step in (1, 2):
        write(step, level=1, k=0)  # the killed attempt: hinted at level 1, never solved
    client.set_terminated(rid, "KILLED", end_time=1_700_000_000_000)
    return uri, client, rid, write


def test_per_prompt_pages_of_a_run_resumed_and_ended_again_show_its_new_files(monkeypatch, tmp_path):
    """A run killed after step 2, resumed from an earlier checkpoint, trains steps 1-2 again and ends: it rewrote
    their tracker files under the same names (the same number of files). The levels and explorer pages show the new
    files: their summaries and a prompt's detail are cached by the run's end too, not by its number of files alone."""
    from dashboards import data as D

    uri, client, rid, write = _killed_run_of_two_steps(tmp_path, "ended-again")
    at = _ok(_app(monkeypatch, uri).run())
    _ok(at.switch_page(PAGES["levels"]).run())
    assert _metrics(at)["Never solved"] == "4"
    _ok(at.switch_page(PAGES["explorer"]).run())
    assert _frame(at, "rescued")["rescued"].sum() == 0 and "trained on level **1**" in at.markdown[1].value

    for step in (1, 2):
        write(step, level=2, k=2)  # the resumed run's steps: rescued at level 2
    client.set_terminated(rid, "FINISHED", end_time=1_700_000_100_000)
    D.runs.clear()  # the runs search is cached for seconds: the page's next rerun after that
    _ok(at.switch_page(PAGES["levels"]).run())
    assert _metrics(at)["Never solved"] == "0"
    _ok(at.switch_page(PAGES["explorer"]).run())
    assert _metrics(at)["Rescued groups"] == "8" and _frame(at, "rescued")["rescued"].sum() == 8
    assert "trained on level **2**" in at.markdown[1].value


def test_per_prompt_pages_of_a_live_resumed_run_show_the_steps_it_trains_again(monkeypatch, tmp_path):
    """A run killed after step 2, resumed from its start, is RUNNING and trains steps 1-2 again: it rewrites their
    tracker files under the same names (the same number of files) and has no new end yet. The per-prompt pages
    showed the killed attempt's steps until the run passed step 2 (their caches were keyed by the number of files
    and the end): they show the rewritten files once the listing is read again (LIVE_TTL)."""
    from dashboards import data as D

    uri, client, rid, write = _killed_run_of_two_steps(tmp_path, "live-again")
    at = _ok(_app(monkeypatch, uri).run())
    _ok(at.switch_page(PAGES["levels"]).run())
    assert _metrics(at)["Never solved"] == "4"
    _ok(at.switch_page(PAGES["explorer"]).run())
    assert "trained on level **1**" in at.markdown[1].value

    client.update_run(rid, status="RUNNING")  # resumed from its start: live, no step trained again yet
    D.runs.clear()
    _ok(at.switch_page(PAGES["levels"]).run())
    assert _metrics(at)["Never solved"] == "4"
    _ok(at.switch_page(PAGES["explorer"]).run())
    assert "trained on level **1**" in at.markdown[1].value
    for step in (1, 2):
        write(step, level=2, k=2)  # the steps trained again: rescued at level 2
    D.tracker_listing.clear()  # the listing is read again LIVE_TTL seconds later
    _ok(at.switch_page(PAGES["levels"]).run())
    assert _metrics(at)["Never solved"] == "0"
    _ok(at.switch_page(PAGES["explorer"]).run())
    assert _metrics(at)["Rescued groups"] == "8" and _frame(at, "rescued")["rescued"].sum() == 8
    assert "trained on level **2**" in at.markdown[1].value


# ------------------------------------------------------------------------------------------------ a real run


def test_real_run_runs_page(monkeypatch, real_store):
    at = _ok(_app(monkeypatch, real_store["uri"], SAGE_MLFLOW_UI_URL="http://mlflow.test:5055").run())
    assert at.title[0].value == "Runs"
    table = _frame(at, "run_id")
    row = table[table["run_id"] == real_store["run_id"]].iloc[0]
    assert (row["method"], row["status"], row["model"], row["kind"]) == ("sage", "FINISHED", "tiny", "train")
    assert row["hint source"] == "online" and row["G"] == 4
    from mlflow.tracking import MlflowClient

    curve = MlflowClient(real_store["uri"]).get_metric_history(real_store["run_id"], EVAL_DURING)
    assert row["no-hint eval (last)"] == pytest.approx(max(curve, key=lambda m: m.step).value)
    assert at.session_state[f"runs::{real_store['experiment_id']}"] == [real_store["run_id"]]
    code = at.code[0].value
    assert code.startswith("http://mlflow.test:5055/#/compare-runs?runs=")
    assert real_store["run_id"] in code and f"%22{real_store['experiment_id']}%22" in code


def test_real_run_logs_its_eval_while_training_under_the_name_the_variants_page_plots(real_store):
    """eval_every=1 in the real run: each step's no-hint avg@4 and pass@4 of the held-out set are metrics of its
    MLflow run, named as the contract store's (EVAL_DURING) that the Variants page's learning curves show."""
    from mlflow.tracking import MlflowClient

    c = MlflowClient(real_store["uri"])
    avg = c.get_metric_history(real_store["run_id"], EVAL_DURING)
    passed = c.get_metric_history(real_store["run_id"], EVAL_DURING.replace("avg_at", "pass_at"))
    assert [m.step for m in avg] == [m.step for m in passed] == [1, 2]
    assert all(0 <= a.value <= p.value <= 1 for a, p in zip(avg, passed, strict=True))


def test_real_run_gate_page_shows_the_logged_means(monkeypatch, real_store):
    from mlflow.tracking import MlflowClient

    c = MlflowClient(real_store["uri"])
    rid = real_store["run_id"]
    logged = {k: [m.value for m in c.get_metric_history(rid, k)]
              for k in ("sage/frac_collapsed", "sage/frac_all_zero", "sage/frac_all_one", "sage/frac_rescued",
                        "sage/frac_open", "sage/adv_energy")}
    assert all(len(v) == 2 for v in logged.values()), logged  # max_steps=2: one value per step
    from dashboards.data import LAST_STEP_TAG  # set by the callback when training ends, read by the pages

    assert c.get_run(rid).data.tags[LAST_STEP_TAG] == str(real_store["global_step"])

    at = _ok(_app(monkeypatch, real_store["uri"]).run())
    _ok(at.switch_page(PAGES["gate"]).run())
    shown = _metrics(at)
    assert shown["Collapsed before hints"] == f"{np.mean(logged['sage/frac_collapsed']):.3f}"
    assert shown["All-0 groups"] == f"{np.mean(logged['sage/frac_all_zero']):.3f}"
    assert shown["All-1 groups"] == f"{np.mean(logged['sage/frac_all_one']):.3f}"
    assert shown["Rescued"] == f"{np.mean(logged['sage/frac_rescued']):.3f}"
    assert shown["Open after hints"] == f"{np.mean(logged['sage/frac_open']):.3f}"
    assert shown["Advantage energy"] == f"{np.mean(logged['sage/adv_energy']):.3f}"
    assert shown["Group size G"] == "4"
    # the gate-open rate is computed from the tracker files: check it against them
    tr = _tracker(real_store, rid)
    base = tr[tr["base_state"].isin(["all0", "all1", "mixed"])]
    seen_twice = base.groupby("prompt_id")["step"].transform("size") >= 2
    assert shown["Groups binned"] == str(int(seen_twice.sum()))
    rate = (base.loc[seen_twice, "base_state"] == "mixed").mean()
    assert shown["Empirical gate-open rate"] == f"{rate:.3f}"
    assert len(_charts(at)) >= 3


def test_real_run_explorer_lists_the_collapsed_prompts(monkeypatch, real_store):
    tr = _tracker(real_store, real_store["run_id"])
    collapsed = set(tr.loc[tr["base_state"] != "mixed", "prompt_id"])
    at = _ok(_app(monkeypatch, real_store["uri"]).run())
    _ok(at.switch_page(PAGES["explorer"]).run())
    if not collapsed:
        assert at.success and "No group collapsed" in at.success[0].value
        return
    table = _frame(at, "collapsed")
    assert set(table["prompt_id"]) == collapsed
    assert _metrics(at)["Prompts with a collapsed group"] == str(len(collapsed))
    assert _metrics(at)["Collapsed groups"] == str(int((tr["base_state"] != "mixed").sum()))
    # pick a prompt: its problem, the hints tried at the selected step, and the completions with rewards
    pid = min(collapsed)
    _ok(at.selectbox(key="explorer_prompt").set_value(pid).run())
    rows = tr[tr["prompt_id"] == pid].sort_values("step")
    assert any(t.value == rows["problem"].iloc[0] for t in at.text)
    step = int(at.selectbox(key=f"explorer_step::{pid}").value)
    rec = rows[rows["step"] == step].iloc[0]
    hints = _frame(at, "leak guard fired")
    for lvl in (1, 2, 3):
        h = hints[hints["level"] == lvl].iloc[0]
        want = rec[f"hint_l{lvl}"]
        assert (h["hint"] if h["tried"] else None) == (want if isinstance(want, str) else None)
        assert bool(h["leak guard fired"]) == bool(rec[f"leak_l{lvl}"])
    comps = _frame(at, "completion")
    assert list(comps["completion"]) == list(rec["completions"])
    assert list(comps["reward"]) == [float(r) for r in rec["rewards"]]


def test_real_run_levels_page(monkeypatch, real_store):
    tr = _tracker(real_store, real_store["run_id"])
    at = _ok(_app(monkeypatch, real_store["uri"]).run())
    _ok(at.switch_page(PAGES["levels"]).run())
    shown = _metrics(at)
    assert shown["Prompts"] == str(tr["prompt_id"].nunique())
    assert shown["Steps"] == str(tr["step"].nunique())
    never = (tr.groupby("prompt_id")["pass_rate"].max() == 0).sum()
    assert shown["Never solved"] == str(int(never))
    assert shown["Groups hinted"] == f"{(tr['level'] > 0).mean():.1%}"
    table = _frame(at, "never_solved")
    assert set(table["prompt_id"]) == set(tr["prompt_id"])
    assert len(_charts(at)) == 2  # level share per step, and the heatmap


# ------------------------------------------------------------------------------------------------ contract store


def test_gate_open_bins_use_the_other_groups_of_each_prompt(dashboard_store):
    from dashboards import data as D

    run = dashboard_store["sage"]
    fr, G = run["frame"], run["G"]
    bins = D.gate_open_bins(fr, G, n_bins=5)
    # independent computation: loop over groups
    rows = []
    for pid, g in fr.groupby("prompt_id"):
        for i, r in g.iterrows():
            others = g.drop(index=i)["base_pass_rate"].dropna()
            if len(others):
                rows.append((min(int(others.mean() * 5), 4), r["base_state"] == "mixed", others.mean()))
    ref = pd.DataFrame(rows, columns=["bin", "open", "p"]).groupby("bin").agg(
        groups=("open", "size"), open=("open", "sum"), p=("p", "mean"))
    assert list(bins["bin"]) == list(ref.index)
    assert list(bins["groups"]) == list(ref["groups"]) and list(bins["open"]) == list(ref["open"])
    np.testing.assert_allclose(bins["p_mean"], ref["p"])
    assert D.gate_open_prob(0.5, 4) == pytest.approx(1 - 2 * 0.5 ** 4)
    assert D.gate_open_prob(0.0, 8) == 0.0 and D.gate_open_prob(1.0, 8) == 0.0


def test_gate_page_asks_for_G_of_a_run_without_the_param_among_runs_with_it(monkeypatch, tmp_path):
    """A run with tracker files but no `sage.num_generations` (an older run, another tool's) in an experiment whose
    other runs have it: its G is NaN in the runs frame, and the page asks for it instead of failing on int(NaN)."""
    try:
        from tests.dashboard_fixtures import _store, build_store, make_prompts, tracker_step
    except ImportError:
        from dashboard_fixtures import _store, build_store, make_prompts, tracker_step
    info = build_store(tmp_path / "s")
    uri, client = _store(tmp_path / "s")
    rid = client.create_run(info["experiment_id"], run_name="no-params").info.run_id
    tdir = tmp_path / "tracker"
    tdir.mkdir()
    tracker_step(make_prompts(4), 1, 4, "sage", np.random.default_rng(0), "online", 1).to_parquet(
        tdir / "step_000001.parquet")
    client.log_artifacts(rid, str(tdir), "tracker")
    client.set_terminated(rid, "FINISHED")
    at = _ok(_app(monkeypatch, uri).run())
    _select_runs(at, info["experiment_id"], [rid])
    _ok(at.switch_page(PAGES["gate"]).run())
    assert at.number_input(key="gate_G").value == 8


def test_gate_page_overlays_selected_runs(monkeypatch, dashboard_store):
    s = dashboard_store
    at = _ok(_app(monkeypatch, s["uri"]).run())
    _select_runs(at, s["experiment_id"], [s["sage"]["run_id"], s["grpo"]["run_id"]])
    _ok(at.switch_page(PAGES["gate"]).run())
    summary = _frame(at, "collapsed before hints")
    assert len(summary) == 2
    for key in ("sage", "grpo"):
        fr = s[key]["frame"]
        per_step = fr.groupby("step")["base_state"].apply(lambda x: (x != "mixed").mean())
        got = summary.loc[summary["run"].str.contains(s[key]["run_id"][:8]), "collapsed before hints"].iloc[0]
        assert got == pytest.approx(per_step.mean())


def test_never_solved_without_a_hint_counts_as_the_tracker_does(tmp_path):
    """ada-seq: the first no-hint group of a prompt all-0, the pooled level-0 group it trained on not. The tracker
    counts the prompt solved without a hint (sage/never_solved_no_hint); so must the Levels page's summary."""
    from dashboards import data as D
    from sage_core.tracker import PromptTracker

    rows = [dict(step=1, prompt_id="a", difficulty=3, base_pass_rate=0.0, base_state="all0", level=0,
                 max_level_tried=0, pass_rate=0.5, acc_l1=None, acc_l2=None, acc_l3=None, rescued=True,
                 hint_failed=False, rollouts=12),
            dict(step=1, prompt_id="b", difficulty=3, base_pass_rate=0.0, base_state="all0", level=0,
                 max_level_tried=0, pass_rate=0.0, acc_l1=None, acc_l2=None, acc_l3=None, rescued=False,
                 hint_failed=False, rollouts=16)]
    tracker = PromptTracker(tmp_path, write=False)
    tracker.record(1, [dict(r) for r in rows])
    summary = D.prompt_summary(pd.DataFrame(rows)).set_index("prompt_id")
    assert summary["never_solved_no_hint"].mean() == pytest.approx(tracker.never_solved_no_hint())
    assert not summary.loc["a", "never_solved_no_hint"] and summary.loc["b", "never_solved_no_hint"]


def test_levels_page_sorting_and_never_solved(monkeypatch, dashboard_store):
    s = dashboard_store
    fr = s["sage"]["frame"]
    at = _ok(_app(monkeypatch, s["uri"]).run())
    _ok(at.switch_page(PAGES["levels"]).run())
    # never solved: no correct rollout at all, in the trained group or at a hint level tried (as sage/never_solved)
    best = fr[["pass_rate", "acc_l1", "acc_l2", "acc_l3"]].fillna(0).max(axis=1).groupby(fr["prompt_id"]).max()
    never = set(best.loc[lambda x: x == 0].index)
    assert _metrics(at)["Never solved"] == str(len(never))
    table = _frame(at, "never_solved")
    assert list(table["difficulty"]) == sorted(table["difficulty"], reverse=True)  # default: hardest first
    _ok(at.selectbox(key="levels_sort").set_value("overall pass rate (lowest first)").run())
    table = _frame(at, "never_solved")
    means = fr.groupby("prompt_id")["pass_rate"].mean()
    assert list(table["prompt_id"]) == sorted(means.index, key=lambda p: (means[p], p))
    assert set(table.loc[table["never_solved"], "prompt_id"]) == never
    if never:
        _ok(at.toggle(key="levels_never").set_value(True).run())
        assert set(_frame(at, "never_solved")["prompt_id"]) == never
    # another page and back: the page's picks are as they were (Streamlit drops an undrawn widget's value)
    _ok(at.switch_page(PAGES["gate"]).run())
    _ok(at.switch_page(PAGES["levels"]).run())
    assert at.selectbox(key="levels_sort").value == "overall pass rate (lowest first)"
    assert at.toggle(key="levels_never").value == bool(never)


def test_explorer_shows_hint_levels_and_leaks(monkeypatch, dashboard_store):
    s = dashboard_store
    fr = s["sage"]["frame"]
    leaky = fr[fr[["leak_l1", "leak_l2", "leak_l3"]].any(axis=1)]
    assert not leaky.empty, "the fixture should contain a leak"
    rec = leaky.iloc[0]
    at = _ok(_app(monkeypatch, s["uri"]).run())
    _ok(at.switch_page(PAGES["explorer"]).run())
    assert set(_frame(at, "collapsed")["prompt_id"]) == set(fr.loc[fr["base_state"] != "mixed", "prompt_id"])
    _ok(at.selectbox(key="explorer_prompt").set_value(rec["prompt_id"]).run())
    _ok(at.selectbox(key=f"explorer_step::{rec['prompt_id']}").set_value(int(rec["step"])).run())
    hints = _frame(at, "leak guard fired")
    for lvl in (1, 2, 3):
        h = hints[hints["level"] == lvl].iloc[0]
        assert bool(h["leak guard fired"]) == bool(rec[f"leak_l{lvl}"])
        acc = rec[f"acc_l{lvl}"]
        assert (h["accuracy"] is None or math.isnan(h["accuracy"])) if pd.isna(acc) else h["accuracy"] == acc
    assert any("leak guard fired" in m.value for m in at.markdown)
    _ok(at.segmented_control(key="explorer_filter").set_value("all-1 at least once").run())
    assert set(_frame(at, "collapsed")["prompt_id"]) == set(fr.loc[fr["base_state"] == "all1", "prompt_id"])


def test_explorer_says_a_swapped_out_prompt_was_not_trained(monkeypatch, tmp_path):
    """dapo-filter's tracker rows: the swapped-out prompt (trained False) and the one trained in its slot."""
    import json

    from mlflow.entities import Param

    try:
        from tests.dashboard_fixtures import _experiment, _spec_params, _store
    except ImportError:
        from dashboard_fixtures import _experiment, _spec_params, _store

    uri, client = _store(tmp_path)
    exp = _experiment(client, tmp_path, "dapo")
    rid = client.create_run(exp, run_name="dapo", tags={"sage.kind": "train", "sage.method": "dapo-filter"}).info.run_id
    client.log_batch(rid, params=[Param(k, v)
                                  for k, v in _spec_params(method="dapo-filter", num_generations=4).items()])
    base = {"step": 1, "problem": "q", "answer": "3", "difficulty": 2, "base_state": "all0", "level": 0,
            "max_level_tried": 0, "rescued": False, "hint": None, "hint_l1": None, "hint_l2": None, "hint_l3": None,
            "acc_l1": None, "acc_l2": None, "acc_l3": None, "leak_l1": False, "leak_l2": False, "leak_l3": False,
            "hint_failed": False, "rollouts": 4, "completions": ["x"] * 4, "method": "dapo-filter", "origin_id": "a"}
    rows = [{**base, "prompt_id": "a", "base_pass_rate": 0.0, "pass_rate": 0.0, "rewards": [0.0] * 4,
             "pilot_rewards": [0.0] * 4, "trained": False},
            {**base, "prompt_id": "b", "base_pass_rate": 0.0, "pass_rate": 0.0,  # the last swap: trained, no luck
             "rewards": [0.0] * 4, "pilot_rewards": [0.0] * 4, "trained": True}]
    (tmp_path / "tracker").mkdir()
    pd.DataFrame(rows).to_parquet(tmp_path / "tracker" / "step_000001.parquet", index=False)
    client.log_artifacts(rid, str(tmp_path / "tracker"), "tracker")
    (tmp_path / "spec.json").write_text(json.dumps({"method": "dapo-filter"}))
    client.set_terminated(rid, "FINISHED")
    at = _ok(_app(monkeypatch, uri).run())
    _ok(at.switch_page(PAGES["explorer"]).run())
    for pid, says in (("a", "swapped out"), ("b", "trained on level")):
        _ok(at.selectbox(key="explorer_prompt").set_value(pid).run())
        step_line = next(m.value for m in at.markdown if m.value.startswith("**Step 1**"))
        assert says in step_line, step_line


def test_explorer_shows_a_step_of_an_older_tracker_file_among_newer_ones(monkeypatch, tmp_path):
    """A run whose first tracker file lacks a column a newer file has (`max_level_tried`, as the light frame's test
    writes it): a prompt's rows read from both hold nulls there for the older file's; the explorer shows its step as
    the contract's default, not a ValueError (int of NaN)."""
    from dashboards import data as D

    try:
        from tests.dashboard_fixtures import _experiment, _store, make_prompts, tracker_step
    except ImportError:
        from dashboard_fixtures import _experiment, _store, make_prompts, tracker_step

    uri, client = _store(tmp_path)
    rid = client.create_run(_experiment(client, tmp_path, "older"), run_name="older").info.run_id
    folder = D.local_artifact_dir(client.get_run(rid).info.artifact_uri) / "tracker"
    folder.mkdir(parents=True)
    prompts, rng = make_prompts(2), np.random.default_rng(0)
    for step, drop in ((1, ["max_level_tried", "rollouts"]), (2, [])):
        df = tracker_step(prompts, step, 4, "grpo", rng)
        df["base_state"], df["base_pass_rate"], df["pass_rate"] = "all0", 0.0, 0.0
        df.drop(columns=drop).to_parquet(folder / f"step_{step:06d}.parquet", index=False)
    at = _ok(_app(monkeypatch, uri).run())
    _ok(at.switch_page(PAGES["explorer"]).run())
    _ok(at.selectbox(key="explorer_step::syn-00000").set_value(1).run())
    assert "(tried up to 0)" in at.markdown[1].value
    assert _frame(at, "rollouts")["rollouts"].tolist() == [0, 4]


def test_variants_page_compares_the_study(monkeypatch, dashboard_store):
    s = dashboard_store
    at = _ok(_app(monkeypatch, s["uri"]).run())
    _ok(at.switch_page(PAGES["variants"]).run())
    assert at.selectbox(key="variants_study").value == s["study"]["run_id"]
    # the study is tagged with its base spec's method (as the flow does); it reads as a study, not as that method
    assert at.selectbox(key="variants_study").options == [f"hint-study · study ({s['study']['run_id'][:8]})"]
    comp = _frame(at, "avg_at_k_after")
    assert list(comp["variant"]) == list(s["study"]["comparison"]["variant"])
    assert list(comp["avg_at_k_after"]) == list(s["study"]["comparison"]["avg_at_k_after"])
    ev = _frame(at, "after")
    assert sorted(ev["variant"]) == sorted(["GRPO", "SAGE-LIGHT", "SAGE (online)", "SAGE (fixed)", "SAGE (teacher)"])
    assert dict(zip(ev["variant"], ev["after"]))["SAGE (online)"] == pytest.approx(0.47)
    # the eval while training is a learning curve shown by default
    assert EVAL_DURING in at.multiselect(key="variants_metrics").value
    charts = _charts(at)
    assert len(charts) == 3  # comparison bars, learning curves, eval bars
    spec = charts[1].proto.spec
    for label in ("GRPO", "SAGE-LIGHT", "SAGE (online)", "SAGE (fixed)", "SAGE (teacher)"):
        assert label in spec


def test_variants_page_keeps_two_runs_of_one_name_apart(monkeypatch, tmp_path):
    """A study's variant trained twice under one run name (sage-teacher re-run with another teacher, or force=true):
    two rows in the eval table, never the mean of the two runs."""
    try:
        from tests.dashboard_fixtures import _experiment, _store, log_run
    except ImportError:
        from dashboard_fixtures import _experiment, _store, log_run

    uri, client = _store(tmp_path)
    exp = _experiment(client, tmp_path, "twice")
    parent = client.create_run(exp, run_name="hint-study", tags={"sage.kind": "study"}).info.run_id
    kw = dict(method="sage", hint_source="teacher", steps=2, n_prompts=4, parent=parent, tracker=False)
    a = log_run(client, exp, name="sage-teacher", seed=1, eval_after=0.4, **kw)["run_id"]
    b = log_run(client, exp, name="sage-teacher", seed=2, eval_after=0.6, **kw)["run_id"]
    client.set_terminated(parent, "FINISHED")
    at = _ok(_app(monkeypatch, uri).run())
    _ok(at.switch_page(PAGES["variants"]).run())
    table = _frame(at, "after")
    assert len(table) == 2 and sorted(table["after"]) == [0.4, 0.6]
    assert all(any(r[:8] in v for v in table["variant"]) for r in (a, b))


def test_variants_page_opens_on_the_study_last_active(monkeypatch, tmp_path):
    """The page opens on the study started, reopened or ended last, as `python -m flows.report` reports it
    (sage_core.tracking.last_active): a study run again reopens its own run, which keeps its first start, so by start
    time the page opened on another study, ended before the reopening."""
    try:
        from tests.dashboard_fixtures import _experiment, _store
    except ImportError:
        from dashboard_fixtures import _experiment, _store
    from dashboards import data as D
    from sage_core import tracking

    uri, client = _store(tmp_path)
    exp = _experiment(client, tmp_path, "studies")
    old = client.create_run(exp, run_name="first", start_time=1_000, tags={"sage.kind": "study"}).info.run_id
    client.set_terminated(old, "FINISHED", end_time=2_000)
    new = client.create_run(exp, run_name="second", start_time=3_000, tags={"sage.kind": "study"}).info.run_id
    client.set_terminated(new, "FINISHED", end_time=4_000)
    at = _ok(_app(monkeypatch, uri).run())
    _ok(at.switch_page(PAGES["variants"]).run())
    assert at.selectbox(key="variants_study").value == new
    client.update_run(old, "RUNNING")  # the first study run again: tracking.open_run reopens it
    client.set_tag(old, D.REOPENED_TAG, "5000")
    assert D.REOPENED_TAG == tracking.REOPENED_TAG
    for rid in (old, new):
        run = client.get_run(rid)
        assert D.last_active(run.info.start_time, run.info.end_time, run.data.tags) == pd.to_datetime(
            tracking.last_active(run), unit="ms", utc=True)
    D.runs.clear()
    at = _ok(_app(monkeypatch, uri).run())
    _ok(at.switch_page(PAGES["variants"]).run())
    assert at.selectbox(key="variants_study").value == old


def test_variants_eval_table_has_a_row_per_k(monkeypatch, tmp_path):
    """A run evaluated again with another eval_k has both k in eval/eval.parquet: one row each, never their mean."""
    try:
        from tests.dashboard_fixtures import _experiment, _store, log_run
    except ImportError:
        from dashboard_fixtures import _experiment, _store, log_run

    uri, client = _store(tmp_path)
    exp = _experiment(client, tmp_path, "evalk")
    rid = log_run(client, exp, name="grpo", method="grpo", steps=2, n_prompts=4, tracker=False)["run_id"]
    ev = pd.DataFrame({"benchmark": "synthetic-test", "when": ["before", "after", "before", "after"],
                       "k": [4, 4, 8, 8], "avg_at_k": [0.3, 0.4, 0.5, 0.6], "pass_at_k": [0.5, 0.6, 0.7, 0.8],
                       "n_prompts": 32})
    (tmp_path / "eval").mkdir()
    ev.to_parquet(tmp_path / "eval" / "eval.parquet", index=False)
    client.log_artifact(rid, str(tmp_path / "eval" / "eval.parquet"), "eval")
    at = _ok(_app(monkeypatch, uri).run())
    _select_runs(at, exp, [rid])
    _ok(at.switch_page(PAGES["variants"]).run())
    table = _frame(at, "after")
    assert list(zip(table["k"], table["variant"], table["before"], table["after"])) == [
        (4, "GRPO", 0.3, 0.4), (8, "GRPO", 0.5, 0.6)]
    pick = at.selectbox(key="variants_eval_k")  # the bar chart shows one k (two would stack into one bar)
    assert pick.options == ["4", "8"] and pick.value == 8


def test_variants_page_shows_a_study_over_seeds(monkeypatch, tmp_path):
    s = build_seed_study(tmp_path)
    at = _ok(_app(monkeypatch, s["uri"]).run())
    _ok(at.switch_page(PAGES["variants"]).run())
    assert at.selectbox(key="variants_study").value == s["run_id"]
    comp = _frame(at, "avg_at_k_after")
    assert list(zip(comp["variant"], comp["seed"])) == [("grpo", 0), ("sage-light", 0), ("grpo", 1),
                                                         ("sage-light", 1)]
    assert any(m.value == "Over 2 seeds" for m in at.subheader)
    summary = _frame(at, "vs_grpo").set_index("variant")
    # SAGE-LIGHT against GRPO of the same seed: +0.06 and +0.02
    assert summary.loc["sage-light", "vs_grpo"] == pytest.approx(0.04)
    assert (summary.loc["sage-light", "vs_grpo_min"], summary.loc["sage-light", "vs_grpo_max"]) == pytest.approx(
        (0.02, 0.06))
    assert summary.loc["sage-light", "seeds"] == 2 and math.isnan(summary.loc["grpo", "vs_grpo"])
    bars = _charts(at)[0].proto.spec
    assert '"xOffset"' in bars and '"seed"' in bars  # one bar per seed beside each other, not stacked
    assert "SAGE-LIGHT \u00b7" not in bars and "SAGE-LIGHT ·" not in bars  # seeds are not told apart by label


# ------------------------------------------------------------------------------------------------ scale


@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    t0 = time.perf_counter()
    info = write_big_tracker(tmp_path_factory.mktemp("big-store"), n_prompts=2000, steps=200, G=8)
    info["write_seconds"] = time.perf_counter() - t0
    return info


def test_2000_prompts_x_200_steps_stays_responsive(monkeypatch, big_store, capsys):
    s = big_store
    at = _ok(_app(monkeypatch, s["uri"]).run())
    timings = {}
    for name in ("levels", "gate", "explorer"):
        t0 = time.perf_counter()
        _ok(at.switch_page(PAGES[name]).run())
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        _ok(at.run())  # a rerun (any widget change): everything is served from the caches
        timings[name] = (cold, time.perf_counter() - t0)
    m = _metrics(at)
    assert m["Prompts with a collapsed group"] != "0"
    _ok(at.switch_page(PAGES["levels"]).run())
    assert _metrics(at)["Prompts"] == "2000" and _metrics(at)["Steps"] == "200"
    t0 = time.perf_counter()
    _ok(at.number_input(key="levels_page").set_value(7).run())  # paging the heatmap
    timings["levels page 7"] = (float("nan"), time.perf_counter() - t0)
    with capsys.disabled():
        print(f"\n[dashboard 2000x200] tracker written in {s['write_seconds']:.1f}s; render seconds (first, rerun): "
              + ", ".join(f"{k}=({c:.2f}, {w:.2f})" for k, (c, w) in timings.items()))
    assert all(w < 8.0 for _, w in timings.values()), timings  # cached reruns; generous for 2 shared CPU cores
    assert all(c < 60.0 for c, _ in timings.values() if not math.isnan(c)), timings


def test_prompt_summary_tells_a_hint_search_that_rescued_nothing_from_no_hint():
    """SAGE tried levels 1-3 on an all-0 prompt, none gave mixed rewards, the group trained unhinted: its max level
    trained is 0, its max level tried 3 (the summary said only 0, as for a prompt never hinted)."""
    from dashboards import data as D

    rows = [{"step": 1, "prompt_id": "searched", "difficulty": 3, "base_pass_rate": 0.0, "base_state": "all0",
             "level": 0, "max_level_tried": 3, "pass_rate": 0.0, "rescued": False, "hint_failed": False,
             "acc_l1": 0.0, "acc_l2": 0.0, "acc_l3": 0.0},
            {"step": 1, "prompt_id": "mixed", "difficulty": 1, "base_pass_rate": 0.5, "base_state": "mixed",
             "level": 0, "max_level_tried": 0, "pass_rate": 0.5, "rescued": False, "hint_failed": False,
             "acc_l1": float("nan"), "acc_l2": float("nan"), "acc_l3": float("nan")}]
    summary = D.prompt_summary(pd.DataFrame(rows)).set_index("prompt_id")
    assert summary.loc["searched", ["max_level", "max_level_tried"]].tolist() == [0, 3]
    assert summary.loc["mixed", ["max_level", "max_level_tried"]].tolist() == [0, 0]
    assert set(D.prompt_summary(pd.DataFrame(rows).iloc[:0]).columns) == set(summary.reset_index().columns)


def test_runs_of_one_variant_keep_its_colour_and_rank():
    """A seed study's Variants page labels runs 'GRPO · grpo-s0', 'GRPO · grpo-s1': each has GRPO's gray and rank
    (they got the spare colours, unlike the study bars above them)."""
    from dashboards import data as D

    order = ["GRPO · grpo-s0", "GRPO · grpo-s1", "SAGE-LIGHT · sage-light-s0", "custom"]
    scale = D.variant_color(order).to_dict()
    grey, green = D.VARIANT_COLORS[0], D.VARIANT_COLORS[1]
    assert scale["range"][:3] == [grey, grey, green] and scale["range"][3] not in D.VARIANT_COLORS
    assert [D.variant_rank(v) for v in order] == [0, 0, 1, len(D.VARIANT_ORDER)]


# ------------------------------------------------------------------------------------------------ reading less


class _Opens:
    """pyarrow.parquet as the dashboard calls it, recording the names of the files it opens."""

    def __init__(self):
        import pyarrow.parquet as pq

        self.pq, self.names = pq, []

    def __getattr__(self, name):
        real = getattr(self.pq, name)
        if name not in ("read_table", "read_schema", "ParquetFile", "read_metadata"):
            return real

        def opened(path, *args, **kwargs):
            self.names.append(Path(path).name)
            return real(path, *args, **kwargs)

        return opened

    def take(self) -> list[str]:
        names, self.names = sorted(set(self.names)), []
        return names


def _step_file(folder: Path, step: int, prompts: pd.DataFrame, rng, drop: tuple[str, ...] = ()) -> pd.DataFrame:
    """A tracker file of `prompts` at `step`; each problem text says its step (the dashboard shows the first)."""
    try:
        from tests.dashboard_fixtures import tracker_step
    except ImportError:
        from dashboard_fixtures import tracker_step

    df = tracker_step(prompts, step, 4, "sage", rng).drop(columns=list(drop))
    df["problem"] = df["problem"] + f" (step {step})"
    folder.mkdir(parents=True, exist_ok=True)
    df.to_parquet(folder / f"step_{step:06d}.parquet", index=False)
    return df


def _full_scan_frame(files: list[Path]) -> pd.DataFrame:
    """The light frame as pandas builds it from every file: what tracker_frame gave before it kept each file's
    table (columns an older file lacks: their defaults; strings categorical; ints int32; floats float32)."""
    from dashboards import data as D

    df = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    df = D._defaults(df[[c for c in D.LIGHT_COLUMNS if c in df]].copy(), D.LIGHT_COLUMNS)[D.LIGHT_COLUMNS]
    df["prompt_id"] = df["prompt_id"].astype(str).astype("category")
    df["base_state"] = df["base_state"].fillna("na").astype(str).astype("category")
    df["method"] = df["method"].astype("category")
    for col in ("level", "max_level_tried", "rollouts", "difficulty", "step"):
        df[col] = pd.to_numeric(df[col]).fillna(-1 if col == "difficulty" else 0).astype("int32")
    for col in ("rescued", "hint_failed", "leak_l1", "leak_l2", "leak_l3"):
        df[col] = df[col].fillna(False).astype(bool)
    for col in D.FLOAT_COLUMNS:
        df[col] = pd.to_numeric(df[col]).astype("float32")
    return df.sort_values(["step", "prompt_id"], kind="stable").reset_index(drop=True)


def _first_texts(files: list[Path]) -> pd.DataFrame:
    """prompt_id, problem, answer where each prompt first appears (file order, then row order): every file read."""
    df = pd.concat([pd.read_parquet(f, columns=["prompt_id", "problem", "answer"]) for f in files], ignore_index=True)
    return df.drop_duplicates("prompt_id").reset_index(drop=True)


def test_a_live_run_reads_only_its_new_and_rewritten_tracker_files(monkeypatch, tmp_path):
    """A live run adds a step file: the frame reads that file alone (not the run's every file again); a resumed run
    rewrites a step under its name (another size): that file alone is read again. The problem texts are read from
    the files where each prompt first appears, and are those of a scan of every file. An older file lacking
    columns reads as before (the contract's defaults)."""
    try:
        from tests.dashboard_fixtures import _experiment, _store, make_prompts
    except ImportError:
        from dashboard_fixtures import _experiment, _store, make_prompts

    from dashboards import data as D

    uri, client = _store(tmp_path / "store")
    rid = client.create_run(_experiment(client, tmp_path / "store", "live"), run_name="live").info.run_id
    art = client.get_run(rid).info.artifact_uri
    folder = D.local_artifact_dir(art) / "tracker"
    prompts, rng = make_prompts(12), np.random.default_rng(0)
    # prompts 0-5 first appear at step 1, 6-8 at step 2, 9-11 at step 4 (step 3 brings no new prompt)
    _step_file(folder, 1, prompts.iloc[:6], rng, drop=("leak_l1", "leak_l2", "leak_l3", "max_level_tried", "method"))
    _step_file(folder, 2, prompts.iloc[3:9], rng)
    _step_file(folder, 3, prompts.iloc[0:8:2], rng)
    opens = _Opens()
    monkeypatch.setattr(D, "pq", opens)
    files = lambda: sorted(folder.glob("step_*.parquet"))

    pd.testing.assert_frame_equal(D.tracker_frame(uri, rid, art, 3), _full_scan_frame(files()))
    assert opens.take() == [f.name for f in files()]
    _step_file(folder, 4, prompts.iloc[6:], rng)  # the live run's next step
    frame = D.tracker_frame(uri, rid, art, 4)
    assert opens.take() == ["step_000004.parquet"]
    pd.testing.assert_frame_equal(frame, _full_scan_frame(files()))

    texts = D.prompt_texts(uri, rid, art, 4)
    assert opens.take() == ["step_000001.parquet", "step_000002.parquet", "step_000004.parquet"]
    pd.testing.assert_frame_equal(texts, _first_texts(files()))
    assert texts.set_index("prompt_id").loc["syn-00009", "problem"].endswith("(step 4)")

    _step_file(folder, 2, prompts.iloc[3:10], rng)  # step 2 trained again by a resumed run: one prompt more
    frame = D.tracker_frame(uri, rid, art, 4, "ended again")
    assert opens.take() == ["step_000002.parquet"]
    pd.testing.assert_frame_equal(frame, _full_scan_frame(files()))
    assert (frame["step"] == 2).sum() == 7
    tables = D._light_tables(folder, [f.name for f in files()])  # files not in step order: the frame is sorted
    pd.testing.assert_frame_equal(D._frame_of(tables[::-1]), frame)


def _loopback_port() -> int:
    """A free loopback port in 18000-18999 (the range the tests' own servers use)."""
    import random
    import socket

    for port in random.sample(range(18000, 19000), 1000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port in 18000-18999")


@pytest.fixture(scope="module")
def artifact_server(tmp_path_factory):
    """`mlflow server --serve-artifacts` on loopback, as the docker stack runs it: the runs' artifact URIs are
    `mlflow-artifacts:/...`, which the dashboard cannot read in place and downloads."""
    import os
    import subprocess
    import sys

    from helpers import http_status, stop_group, wait_ready

    root = tmp_path_factory.mktemp("mlflow-server")
    port, log = _loopback_port(), root / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1", "--serve-artifacts",
                             "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                             "--artifacts-destination", str(root / "artifacts")],
                            env=env, start_new_session=True, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        wait_ready("mlflow server", lambda: http_status(f"http://127.0.0.1:{port}/health") == 200, proc, log, 240)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_group(proc)


def test_a_remote_store_fetches_only_the_tracker_files_it_lacks(monkeypatch, tmp_path, artifact_server):
    """Through a tracking server, each tracker file is downloaded once into the shared cache: one prompt's rows
    fetch the files it appears in, the frame the others, the problem texts none; a cache cleared (a restarted app)
    fetches nothing; a live run's new step fetches that file; a step rewritten under its name by a resumed run (the
    listing gives another size) is fetched again. The whole folder was downloaded on each cache miss before."""
    import tempfile

    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
    from mlflow.tracking import MlflowClient

    try:
        from tests.dashboard_fixtures import make_prompts
    except ImportError:
        from dashboard_fixtures import make_prompts

    from dashboards import data as D

    uri = artifact_server
    client = MlflowClient(uri)
    rid = client.create_run(client.create_experiment("remote")).info.run_id
    art = client.get_run(rid).info.artifact_uri
    assert D.local_artifact_dir(art) is None, art
    up = tmp_path / "up" / "tracker"
    prompts, rng = make_prompts(6), np.random.default_rng(1)

    def log_step(step: int, rows: pd.DataFrame) -> None:
        _step_file(up, step, rows, rng)
        client.log_artifact(rid, str(up / f"step_{step:06d}.parquet"), "tracker")

    for step, rows in ((1, prompts.iloc[:4]), (2, prompts.iloc[2:]), (3, prompts.iloc[[0, 1, 4, 5]])):
        log_step(step, rows)
    repo = type(get_artifact_repository(art, tracking_uri=uri))
    real, fetched = repo._download_file, []

    def counted(self, remote_file_path, local_path):
        fetched.append(Path(remote_file_path).name)
        return real(self, remote_file_path, local_path)

    monkeypatch.setattr(repo, "_download_file", counted)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    def took():  # the files fetched since the last call
        names = sorted(fetched)
        fetched.clear()
        return names

    detail = D.prompt_detail(uri, rid, art, 3, "syn-00000", (1, 3))
    assert took() == ["step_000001.parquet", "step_000003.parquet"]
    assert list(detail["step"]) == [1, 3] and detail["problem"].iloc[0].endswith("(step 1)")
    frame = D.tracker_frame(uri, rid, art, 3)
    assert took() == ["step_000002.parquet"]
    pd.testing.assert_frame_equal(frame, _full_scan_frame(sorted(up.glob("step_*.parquet"))))
    pd.testing.assert_frame_equal(D.prompt_texts(uri, rid, art, 3), _first_texts(sorted(up.glob("step_*.parquet"))))
    D.tracker_frame.clear()
    D.tracker_frame(uri, rid, art, 3)
    assert took() == []

    log_step(4, prompts.iloc[1:5])  # the live run's next step
    assert len(D.tracker_frame(uri, rid, art, 4)) == 16 and took() == ["step_000004.parquet"]
    log_step(2, prompts)  # step 2 trained again by a resumed run, under its name: all 6 prompts this time
    frame = D.tracker_frame(uri, rid, art, 4, "ended again")
    assert took() == ["step_000002.parquet"]
    assert (frame["step"] == 2).sum() == 6
    pd.testing.assert_frame_equal(frame, _full_scan_frame(sorted(up.glob("step_*.parquet"))))
    assert [p.name for p in (tmp_path / "tmp" / "sage-dashboard" / rid).iterdir()] == ["tracker"]  # nothing left
