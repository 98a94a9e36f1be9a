"""sage_core.tracking against a real sqlite MLflow store (one store per module: migrations take seconds)."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from helpers import store_held
from transformers import TrainerControl, TrainerState

from sage_core import tracking
from sage_core.spec import RunSpec


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    home = tmp_path_factory.mktemp("sage_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SAGE_HOME", str(home))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.delenv("SAGE_MLFLOW_RUN_ID", raising=False)
        yield home
    import mlflow

    while mlflow.active_run():
        mlflow.end_run()


def test_tracking_uri_default_is_absolute_sqlite(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SAGE_HOME", "rel/home")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = tracking.tracking_uri()
    assert uri == f"sqlite:///{tmp_path / 'rel/home/mlflow.db'}"
    assert uri.startswith("sqlite:////")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert tracking.tracking_uri() == "http://127.0.0.1:5999"
    assert not tracking.is_local_store()


def test_open_run_tags_params_spec_and_resume(store, tmp_path):
    spec = RunSpec(method="sage-light", max_steps=3)
    out = tmp_path / "out"
    rid, resumed = tracking.resume_or_create_run(spec, "train", out, experiment="t-open", run_name="light")
    assert not resumed and (out / "mlflow_run_id").read_text().strip() == rid
    c = tracking.client()
    run = c.get_run(rid)
    exp = c.get_experiment(run.info.experiment_id)
    assert exp.name == "t-open"
    assert exp.artifact_location == (store / "mlartifacts" / "t-open").as_uri()
    t = run.data.tags
    assert t["sage.kind"] == "train" and t["sage.method"] == "sage-light" and t["sage.hint_source"] == "online"
    assert t["sage.model"] == "tiny" and t["sage.spec_key"] == spec.key() and t["mlflow.runName"] == "light"
    assert t["git.commit"] and t[tracking.COMPLETE_TAG] == "false"
    assert set(run.data.params) == {f"sage.{k}" for k in RunSpec.model_fields}
    assert run.data.params["sage.max_steps"] == "3" and run.data.params["sage.teacher"] == "None"
    assert json.loads(Path(c.download_artifacts(rid, "spec.json", str(tmp_path))).read_text()) == spec.model_dump()

    # crash: the run is left FAILED; the next attempt reopens the same run id
    tracking.finish_run(rid, "FAILED")
    assert tracking.find_finished_run(spec.key(), "t-open") is None
    rid2, resumed = tracking.resume_or_create_run(spec, "train", out, experiment="t-open")
    assert (rid2, resumed) == (rid, True)
    run = c.get_run(rid)
    assert run.info.status == "RUNNING" and run.data.tags["sage.resumed"] == "1"
    tracking.finish_run(rid)
    assert tracking.find_finished_run(spec.key(), "t-open").info.run_id == rid
    # a stale id (other store) starts a new run instead of failing
    (out / "mlflow_run_id").write_text("0" * 32)
    rid3, resumed = tracking.resume_or_create_run(spec, "train", out, experiment="t-open")
    assert not resumed and rid3 != rid and tracking.read_run_id(out) == rid3


def test_a_reopened_run_records_the_time_its_attempts_ran(store, tmp_path):
    """Each reopening records the seconds the run ran before it (RAN_BEFORE_TAG; ran_seconds sums them with the
    span since): a run keeps its first start, so its start to its end counts the time it was stopped. An attempt
    killed outright (left RUNNING, no end) counts to its last metric point."""
    from mlflow.entities import Metric

    spec = RunSpec(method="grpo", max_steps=2)
    out = tmp_path / "out"
    rid, _ = tracking.resume_or_create_run(spec, "train", out, experiment="t-ran")
    c = tracking.client()
    start = c.get_run(rid).info.start_time
    c.log_batch(rid, metrics=[Metric("reward", 0.5, start + 600_000, 1)])  # then killed outright: RUNNING still
    assert tracking.resume_or_create_run(spec, "train", out, experiment="t-ran") == (rid, True)
    run = c.get_run(rid)
    assert float(run.data.tags[tracking.RAN_BEFORE_TAG]) == 600.0
    reopened = int(run.data.tags[tracking.REOPENED_TAG])
    c.set_terminated(rid, "KILLED", end_time=reopened + 60_000)  # stopped a minute after the reopening
    assert tracking.ran_seconds(c.get_run(rid)) == 660.0
    tracking.resume_or_create_run(spec, "train", out, experiment="t-ran")
    assert float(c.get_run(rid).data.tags[tracking.RAN_BEFORE_TAG]) == 660.0
    # reopened by a version that recorded no spans: unknown, and not recorded at the next reopening either
    c.delete_tag(rid, tracking.RAN_BEFORE_TAG)
    tracking.finish_run(rid)
    assert tracking.ran_seconds(c.get_run(rid)) is None
    tracking.resume_or_create_run(spec, "train", out, experiment="t-ran")
    assert tracking.RAN_BEFORE_TAG not in c.get_run(rid).data.tags


def test_a_run_resumed_with_another_experiment_says_where_it_logs(store, tmp_path, caplog):
    """`sage train --mlflow --experiment B` resuming an output dir whose run is in experiment A reopens that run, in A
    (MLflow cannot move a run): a warning names both, where nothing said the experiment asked for was not used. No
    experiment given (None): no warning, and a new run goes to the default experiment."""
    out = tmp_path / "out"
    rid, _ = tracking.resume_or_create_run(RunSpec(), "train", out, experiment="t-exp-a")
    with caplog.at_level("WARNING", logger="sage_core.tracking"):
        assert tracking.resume_or_create_run(RunSpec(), "train", out, experiment="t-exp-b") == (rid, True)
    assert "'t-exp-a', not 't-exp-b'" in caplog.text
    assert tracking.client().get_experiment_by_name("t-exp-b") is None  # nothing was made there
    caplog.clear()
    with caplog.at_level("WARNING", logger="sage_core.tracking"):
        assert tracking.resume_or_create_run(RunSpec(), "train", out, experiment=None) == (rid, True)
        new, resumed = tracking.resume_or_create_run(RunSpec(), "train", tmp_path / "other", experiment=None)
    assert not caplog.text and not resumed
    c = tracking.client()
    assert c.get_experiment(c.get_run(new).info.experiment_id).name == tracking.DEFAULT_EXPERIMENT
    # a callback given no experiment asks for none: reopening the run in t-exp-a is not warned about
    caplog.clear()
    with caplog.at_level("WARNING", logger="sage_core.tracking"):
        cb = tracking.make_callback(RunSpec(), output_dir=out)
        cb.on_train_begin(SimpleNamespace(output_dir=str(out)), _state(0), TrainerControl())
    assert cb.run_id == rid and not caplog.text


def test_run_resumed_with_a_changed_spec_describes_the_new_spec(store, tmp_path):
    """A finished 1-step run resumed with max_steps=2 (a resumable field) in its output dir: the same MLflow run now
    describes the 2-step spec (spec key, spec.json, `sage.resumed.max_steps`; the param cannot change) and is not
    complete while it trains, so only the 2-step spec finds it once it has finished."""
    one, two = RunSpec(max_steps=1), RunSpec(max_steps=2)
    out, exp = tmp_path / "out", "t-respec"
    rid, _ = tracking.resume_or_create_run(one, "train", out, experiment=exp)
    tracking.finish_run(rid)
    assert tracking.find_finished_run(one.key(), exp).info.run_id == rid

    assert tracking.resume_or_create_run(two, "train", out, experiment=exp) == (rid, True)
    c = tracking.client()
    run = c.get_run(rid)
    t = run.data.tags
    assert run.info.status == "RUNNING" and t[tracking.COMPLETE_TAG] == "false" and not tracking.is_complete(run)
    assert t["sage.spec_key"] == two.key() and t["sage.resumed"] == "1" and t["sage.resumed.max_steps"] == "2"
    assert not [k for k in t if k.startswith("sage.resumed.") and k != "sage.resumed.max_steps"]
    assert run.data.params["sage.max_steps"] == "1"  # MLflow params cannot change once logged
    assert tracking.spec_values(run) == tracking.spec_params(two)
    got = json.loads(Path(c.download_artifacts(rid, "spec.json", str(tmp_path / "dl1"))).read_text())
    assert got == two.model_dump()
    assert tracking.find_finished_run(one.key(), exp) is None and tracking.find_finished_run(two.key(), exp) is None
    tracking.finish_run(rid)
    assert tracking.find_finished_run(two.key(), exp).info.run_id == rid
    assert tracking.find_finished_run(one.key(), exp) is None

    # resumed again: unchanged spec changes nothing but the attempt count; another change moves the tags along
    tracking.resume_or_create_run(two, "train", out, experiment=exp)
    t = c.get_run(rid).data.tags
    assert t["sage.spec_key"] == two.key() and t["sage.resumed.max_steps"] == "2" and t["sage.resumed"] == "2"
    three = RunSpec(max_steps=3, eval_k=2)
    tracking.resume_or_create_run(three, "train", out, experiment=exp)
    run = c.get_run(rid)
    assert run.data.tags["sage.resumed.max_steps"] == "3" and run.data.tags["sage.resumed.eval_k"] == "2"
    assert run.data.tags["sage.spec_key"] == three.key() and tracking.spec_values(run) == tracking.spec_params(three)
    # the dashboard, which reads runs without importing sage_core.tracking, shows the same values
    from dashboards import data as D
    from sage_core.tracker import FLOAT_COLUMNS

    assert D.RESUMED_PREFIX == tracking.RESUMED_PREFIX and D.FLOAT_COLUMNS == FLOAT_COLUMNS
    shown = D.spec_params(run.data.params, run.data.tags)
    assert shown["sage.max_steps"] == "3" and shown["sage.eval_k"] == "2"
    assert {k: v for k, v in shown.items() if k.startswith("sage.")} == tracking.spec_values(run)
    # a field left out of the spec key (eval_every) changed on resume is recorded all the same
    evals = three.model_copy(update={"eval_every": 2})
    assert evals.key() == three.key()
    tracking.resume_or_create_run(evals, "train", out, experiment=exp)
    run = c.get_run(rid)
    assert run.data.tags["sage.resumed.eval_every"] == "2" and tracking.spec_values(run) == tracking.spec_params(evals)
    got = json.loads(Path(c.download_artifacts(rid, "spec.json", str(tmp_path / "dl3"))).read_text())
    assert got["eval_every"] == 2
    # back to the created spec's values: the tags that explained the params go
    tracking.resume_or_create_run(one, "train", out, experiment=exp)
    run = c.get_run(rid)
    assert not [k for k in run.data.tags if k.startswith("sage.resumed.")]
    assert run.data.tags["sage.spec_key"] == one.key() and run.data.tags["sage.resumed"] == "5"
    got = json.loads(Path(c.download_artifacts(rid, "spec.json", str(tmp_path / "dl2"))).read_text())
    assert got == one.model_dump()


def test_start_run_parent_child_and_status(store):
    import mlflow

    base = RunSpec()
    with tracking.start_run(base, "study", experiment="t-study", run_name="study") as parent:
        pid = parent.info.run_id
        assert mlflow.active_run().info.run_id == pid
        with tracking.start_run(RunSpec(method="grpo"), "train", experiment="t-study", run_name="grpo",
                                parent_run_id=pid) as child:
            assert mlflow.active_run().info.run_id == child.info.run_id
        with pytest.raises(RuntimeError):
            with tracking.start_run(RunSpec(method="sage"), "train", experiment="t-study",
                                    parent_run_id=pid):
                raise RuntimeError("boom")
        assert mlflow.active_run().info.run_id == pid
    assert mlflow.active_run() is None
    c = tracking.client()
    kids = tracking.find_runs("t-study", kind="train", parent_run_id=pid)
    assert {r.data.tags["sage.method"] for r in kids} == {"grpo", "sage"}
    status = {r.data.tags["sage.method"]: (r.info.status, tracking.is_complete(r)) for r in kids}
    assert status == {"grpo": ("FINISHED", True), "sage": ("FAILED", False)}
    assert kids[0].data.tags["sage.hint_source"] in ("online", "none")
    assert c.get_run(child.info.run_id).data.tags["sage.hint_source"] == "none"  # grpo uses no hints
    assert tracking.find_finished_run(RunSpec(method="grpo").key(), "t-study", parent_run_id=pid) is not None
    assert tracking.find_finished_run(RunSpec(method="sage").key(), "t-study") is None


def _state(step: int) -> TrainerState:
    s = TrainerState()
    s.global_step = step
    return s


def _started_callback(tmp_path, spec: RunSpec, experiment: str):
    """(tracker dir, run id, args, control, callback): a new run's callback, its training begun at step 0."""
    out = tmp_path / "train"
    tdir = out / "tracker"
    tdir.mkdir(parents=True)
    rid = tracking.open_run(spec, "train", experiment=experiment)
    args, ctl = SimpleNamespace(output_dir=str(out)), TrainerControl()
    cb = tracking.MlflowTrackingCallback(run_id=rid, output_dir=out, log_checkpoint=False)
    cb.on_train_begin(args, _state(0), ctl)
    return tdir, rid, args, ctl, cb


def test_callback_metrics_tracker_files_and_checkpoint(store, tmp_path):
    spec = RunSpec(max_steps=2)
    out = tmp_path / "train"
    tdir = out / "tracker"
    tdir.mkdir(parents=True)
    rid = tracking.open_run(spec, "train", experiment="t-cb")
    args = SimpleNamespace(output_dir=str(out))
    cb = tracking.MlflowTrackingCallback(run_id=rid)
    ctl = TrainerControl()
    cb.on_train_begin(args, _state(0), ctl)
    pd.DataFrame({"step": [1], "prompt_id": ["p0"]}).to_parquet(tdir / "step_000001.parquet")
    (tdir / "notes.txt").write_text("not a tracker file")
    import numpy as np
    import torch

    cb.on_log(args, _state(1), ctl, logs={"reward": 0.5, "sage/frac_collapsed": np.float32(0.25),
                                          "loss(x)": torch.tensor(1.5), "epoch": 1, "flag": True,
                                          "text": "skip", "vec": torch.zeros(3), "none": None})
    pd.DataFrame({"step": [2], "prompt_id": ["p0"]}).to_parquet(tdir / "step_000002.parquet")
    cb.on_log(args, _state(2), ctl, logs={"reward": 0.75})
    cb.on_log(args, _state(2), ctl, logs={})  # nothing new: no re-upload
    ck = out / "checkpoint-2"
    ck.mkdir()
    for name in ("model.safetensors", "config.json", "tokenizer.json", "optimizer.pt", "scheduler.pt",
                 "rng_state.pth", "trainer_state.json"):
        (ck / name).write_text(name)
    (out / "checkpoint-1").mkdir()
    cb.on_train_end(args, _state(2), ctl)
    assert not [a for a in tracking.client().list_artifacts(rid) if a.path == "checkpoint"]  # not a checkpoint-N
    final = out / "final"  # the model train() saved after training: the run's checkpoint/
    final.mkdir()
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        (final / name).write_text(name)
    cb.log_final_model(final, 3)

    c = tracking.client()
    hist = c.get_metric_history(rid, "reward")
    assert [(m.step, m.value) for m in hist] == [(1, 0.5), (2, 0.75)]
    run = c.get_run(rid)
    assert run.data.metrics["sage/frac_collapsed"] == 0.25
    assert run.data.metrics["loss_x_"] == 1.5 and run.data.metrics["flag"] == 1.0
    assert not {"text", "vec", "none"} & set(run.data.metrics)
    assert sorted(a.path for a in c.list_artifacts(rid, "tracker")) == ["tracker/step_000001.parquet",
                                                                       "tracker/step_000002.parquet"]
    assert sorted(Path(a.path).name for a in c.list_artifacts(rid, "checkpoint")) == [
        "config.json", "model.safetensors", "tokenizer.json"]
    assert cb.checkpoint_logged == final and run.data.tags["sage.checkpoint_step"] == "3"

    # a resumed run: a new callback knows which tracker files the run already has
    cb2 = tracking.MlflowTrackingCallback(run_id=rid, output_dir=out, log_checkpoint=False)
    cb2.on_train_begin(args, _state(2), ctl)
    assert cb2.uploaded == {"step_000001.parquet", "step_000002.parquet"}
    pd.DataFrame({"step": [3], "prompt_id": ["p0"]}).to_parquet(tdir / "step_000003.parquet")
    assert cb2.upload_tracker_files() == ["step_000003.parquet"]
    # other ranks never log
    s = _state(3)
    s.is_world_process_zero = False
    tracking.MlflowTrackingCallback(run_id=rid).on_log(args, s, ctl, logs={"only_rank0": 1.0})
    assert "only_rank0" not in c.get_run(rid).data.metrics


def test_resumed_callback_uploads_again_the_steps_trained_again(store, tmp_path):
    """A run killed after step 2's tracker file was uploaded, resumed from checkpoint-1: step 2 is trained again
    and its new file replaces the killed run's in the MLflow run."""
    tdir, rid, args, ctl, cb = _started_callback(tmp_path, RunSpec(max_steps=2), "t-cb-resume")
    for step in (1, 2):
        pd.DataFrame({"step": [step], "prompt_id": ["killed"]}).to_parquet(tdir / f"step_{step:06d}.parquet")
        cb.on_log(args, _state(step), ctl, logs={"reward": 0.0})
    resumed = tracking.MlflowTrackingCallback(run_id=rid, output_dir=tdir.parent, log_checkpoint=False)
    resumed.on_train_begin(args, _state(1), ctl)
    assert resumed.uploaded == {"step_000001.parquet"}
    pd.DataFrame({"step": [2], "prompt_id": ["resumed"]}).to_parquet(tdir / "step_000002.parquet")
    resumed.on_log(args, _state(2), ctl, logs={"reward": 1.0})
    got = tracking.client().download_artifacts(rid, "tracker/step_000002.parquet", str(tmp_path / "dl"))
    assert pd.read_parquet(got).prompt_id.tolist() == ["resumed"]



def _three_steps_then_killed(out, exp: str, prompt_id: str, told: bool = False):
    """A run of max_steps 4 in `exp` that logged steps 1-3 (a tracker file each, prompt `prompt_id`) and was killed;
    `told`: its callback was told (end_run), as sage_core.train tells it. Returns the tracker folder, the Trainer
    args and control, the run id and the callback."""
    tdir = out / "tracker"
    tdir.mkdir(parents=True)
    args, ctl = SimpleNamespace(output_dir=str(out)), TrainerControl()
    rid, _ = tracking.resume_or_create_run(RunSpec(max_steps=4), "train", out, experiment=exp)
    cb = tracking.MlflowTrackingCallback(run_id=rid, output_dir=out, log_checkpoint=False)
    cb.on_train_begin(args, _state(0), ctl)
    for step in (1, 2, 3):
        pd.DataFrame({"step": [step], "prompt_id": [prompt_id]}).to_parquet(tdir / f"step_{step:06d}.parquet")
        cb.on_log(args, _state(step), ctl, logs={"reward": 0.0})
    if told:
        cb.end_run(KeyboardInterrupt())
    tracking.finish_run(rid, "KILLED")
    return tdir, args, ctl, rid, cb


def _resumed_from_step_one_to_two(out, exp: str, spec: RunSpec, prompt_id: str):
    """The run of _three_steps_then_killed resumed from checkpoint-1 with `spec` (the tracker discards the later
    steps' files), its step 2 logged (prompt `prompt_id`, reward 1): its callback."""
    tdir, args, ctl = out / "tracker", SimpleNamespace(output_dir=str(out)), TrainerControl()
    for step in (2, 3):
        (tdir / f"step_{step:06d}.parquet").unlink()
    rid, resumed = tracking.resume_or_create_run(spec, "train", out, experiment=exp)
    assert resumed
    cb = tracking.MlflowTrackingCallback(run_id=rid, output_dir=out, log_checkpoint=False)
    cb.on_train_begin(args, _state(1), ctl)
    pd.DataFrame({"step": [2], "prompt_id": [prompt_id]}).to_parquet(tdir / "step_000002.parquet")
    cb.on_log(args, _state(2), ctl, logs={"reward": 1.0})
    return cb

def test_a_run_resumed_with_fewer_steps_ends_at_its_last_step(store, tmp_path):
    """Killed after step 3, resumed from checkpoint-1 with max_steps=2: MLflow keeps the killed attempt's step-3
    metric point and tracker file (it cannot delete them); the tag `sage.last_step`, set when training ends, says
    where the run ends, and the dashboard's curves and tracker frame stop there. A reopened run has no last step
    until that attempt ends."""
    from dashboards import data as D

    out, exp = tmp_path / "train", "t-last-step"
    tdir, args, ctl, rid, _ = _three_steps_then_killed(out, exp, "killed")
    resumed = _resumed_from_step_one_to_two(out, exp, RunSpec(max_steps=2), "resumed")
    resumed.on_train_end(args, _state(2), ctl)
    resumed.log_final_model(out / "final", 2)
    tracking.finish_run(rid)

    c = tracking.client()
    assert sorted({m.step for m in c.get_metric_history(rid, "reward")}) == [1, 2, 3]
    assert len(c.list_artifacts(rid, "tracker")) == 3
    assert c.get_run(rid).data.tags[tracking.LAST_STEP_TAG] == "2"
    assert D.LAST_STEP_TAG == tracking.LAST_STEP_TAG  # the dashboard reads runs without importing sage_core

    uri, exp_id = tracking.tracking_uri(), c.get_run(rid).info.experiment_id

    def shown() -> tuple[list[int], list[str]]:
        D.runs.clear()
        runs = D.runs(uri, exp_id)
        row = runs.set_index("run_id").loc[rid]
        hist = D.metric_history(uri, rid, ["reward"], row["status"], row["end_time"], row["last_step"])
        frame, _ = D.tracker_for(D.Context(uri, exp_id, exp, runs, [rid]), rid)
        return list(hist["step"]), list(frame["prompt_id"])

    assert shown() == ([1, 2], ["killed", "resumed"])
    # the runs page's latest values are the run's last step's (MLflow's latest is the killed attempt's step 3)
    assert c.get_run(rid).data.metrics["reward"] == 0.0
    assert D.runs(uri, exp_id).set_index("run_id").loc[rid, "metrics"]["reward"] == 1.0
    # reopened (trained on with more max_steps) and killed again: every step it logged counts
    tracking.resume_or_create_run(RunSpec(max_steps=4), "train", out, experiment=exp)
    assert tracking.LAST_STEP_TAG not in c.get_run(rid).data.tags
    tracking.finish_run(rid, "KILLED")
    assert shown() == ([1, 2, 3], ["killed", "resumed", "killed"])


def test_a_run_resumed_from_an_earlier_checkpoint_and_stopped_again_ends_at_the_step_it_reached(store, tmp_path):
    """Killed at step 3, resumed from checkpoint-1 and killed again at step 2: the run's step 3 (metric point,
    tracker file) is the first attempt's, of a trajectory the run left. The callback tells the run where this
    attempt stopped (`sage.last_step`), so the dashboard leaves step 3 out as it does for a finished run; it showed
    it (and its reward as the run's latest) as the run's own."""
    from dashboards import data as D

    out, exp = tmp_path / "train", "t-last-step-killed"
    tdir, args, ctl, rid, _ = _three_steps_then_killed(out, exp, "first", told=True)
    resumed = _resumed_from_step_one_to_two(out, exp, RunSpec(max_steps=4), "second")
    resumed.end_run(KeyboardInterrupt())
    tracking.finish_run(rid, "KILLED")

    c = tracking.client()
    assert c.get_run(rid).data.tags[tracking.LAST_STEP_TAG] == "2"
    uri, exp_id = tracking.tracking_uri(), c.get_run(rid).info.experiment_id
    D.runs.clear()
    runs = D.runs(uri, exp_id)
    row = runs.set_index("run_id").loc[rid]
    hist = D.metric_history(uri, rid, ["reward"], row["status"], row["end_time"], row["last_step"])
    frame, _ = D.tracker_for(D.Context(uri, exp_id, exp, runs, [rid]), rid)
    assert list(hist["step"]) == [1, 2] and list(frame["prompt_id"]) == ["first", "second"]
    assert row["metrics"]["reward"] == 1.0


def test_an_mlflow_store_failing_for_a_while_does_not_end_the_training(store, tmp_path, monkeypatch):
    """The callback logged each step synchronously and let MLflow's error through: a store that failed once (a
    server restarting for longer than the client retries, a locked sqlite file) ended the training, losing every
    step since the last checkpoint. The step's metrics and tracker file are kept and sent at the next step."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    tdir, rid, args, ctl, cb = _started_callback(tmp_path, RunSpec(max_steps=3), "t-outage")
    down = {"now": False}

    def failing(real, error):
        def call(self, *a, **k):
            if down["now"]:
                raise error
            return real(self, *a, **k)
        return call

    monkeypatch.setattr(MlflowClient, "log_batch", failing(MlflowClient.log_batch, MlflowException(
        "API request to endpoint /api/2.0/mlflow/runs/log-batch failed")))
    monkeypatch.setattr(MlflowClient, "log_artifact", failing(MlflowClient.log_artifact, OSError("unreachable")))
    for step in (1, 2, 3):
        down["now"] = step == 2
        pd.DataFrame({"step": [step], "prompt_id": ["p"]}).to_parquet(tdir / f"step_{step:06d}.parquet")
        cb.on_log(args, _state(step), ctl, logs={"reward": float(step)})  # step 2: no exception
    hist = tracking.client().get_metric_history(rid, "reward")
    assert sorted((m.step, m.value) for m in hist) == [(1, 1.0), (2, 2.0), (3, 3.0)] and not cb.pending
    assert len(tracking.client().list_artifacts(rid, "tracker")) == 3


def test_metrics_the_store_refused_at_the_end_are_kept_for_the_next_attempt(store, tmp_path, monkeypatch):
    """A store still refusing when training ended (a locked sqlite file, reproduced with a second process holding
    it) lost the metrics it had refused for good: they lived in the process, which then failed with MLflow's
    traceback, and the run entered again trains nothing (the step was checkpointed). They are kept in the output
    dir's mlflow_pending.json, the error says so, and the next attempt's callback sends them; a resumed attempt
    drops those of steps after its checkpoint (trained, and logged, again)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    tdir, rid, args, ctl, cb = _started_callback(tmp_path, RunSpec(max_steps=2), "t-pending")
    down = {"now": False}
    for name in ("log_batch", "set_tag"):
        def call(self, *a, _real=getattr(MlflowClient, name), **k):
            if down["now"]:
                raise MlflowException("(sqlite3.OperationalError) database is locked\n[SQL: SELECT runs.run_uuid]")
            return _real(self, *a, **k)
        monkeypatch.setattr(MlflowClient, name, call)
    for step in (1, 2):
        down["now"] = step == 2
        cb.on_log(args, _state(step), ctl, logs={"reward": float(step)})
    kept = tdir.parent / tracking.PENDING_FILE
    with pytest.raises(tracking.TrackingError, match=rf"MLflow run {rid}: the store .* refused the run's last logs "
                       r"\(MlflowException: \(sqlite3.OperationalError\) database is locked\); the model is trained "
                       rf"and saved in .*final, and the 1 metric batches not logged are kept in {kept}: run the same"):
        cb.log_final_model(tdir.parent / "final", 2)
    down["now"] = False
    history = lambda: sorted((m.step, m.value) for m in tracking.client().get_metric_history(rid, "reward"))  # noqa: E731
    assert history() == [(1, 1.0)] and kept.is_file()
    again = tracking.MlflowTrackingCallback(run_id=rid, output_dir=tdir.parent, log_checkpoint=False)
    again.log_final_model(tdir.parent / "final", 2)  # the run entered again: done, nothing trained
    assert history() == [(1, 1.0), (2, 2.0)] and not kept.exists()
    # kept metrics of a step after the checkpoint a resume starts from are the killed attempt's: not sent
    kept.write_text(json.dumps({"run_id": rid, "pending": [[{"reward": 9.0}, 1, 0], [{"reward": 9.0}, 3, 0]]}))
    resumed = tracking.MlflowTrackingCallback(run_id=rid, output_dir=tdir.parent, log_checkpoint=False)
    resumed.on_train_begin(args, _state(2), ctl)
    resumed.on_log(args, _state(3), ctl, logs={"reward": 3.0})
    assert history() == [(1, 1.0), (1, 9.0), (2, 2.0), (3, 3.0)] and not kept.exists()
    # another run's kept metrics are not this run's
    kept.write_text(json.dumps({"run_id": "another", "pending": [[{"reward": 7.0}, 1, 0]]}))
    tracking.MlflowTrackingCallback(run_id=rid, output_dir=tdir.parent, log_checkpoint=False).on_train_begin(
        args, _state(3), ctl)
    assert history() == [(1, 1.0), (1, 9.0), (2, 2.0), (3, 3.0)]


def test_a_locked_store_is_one_warning_per_refused_step_not_mlflows_traceback(store, tmp_path, capfd, caplog,
                                                                              monkeypatch):
    """A sqlite store locked by another writer (several flows or ranks on one mlflow.db) made MLflow log, for each
    write it refused, an ERROR with the whole chained traceback and the SQL (mlflow.store.db.utils,
    make_managed_session), flooding the training log though nothing was lost. Each refused step is one warning naming
    the store and where its metrics are kept, training's end the TrackingError alone; they reach the run once the
    lock goes."""
    monkeypatch.setenv(tracking.LOCK_RETRY_ENV, "0")  # one try at the end (its retries: the test below)
    tdir, rid, args, ctl, cb = _started_callback(tmp_path, RunSpec(max_steps=3), "t-locked")
    kept = tdir.parent / tracking.PENDING_FILE
    cb.on_log(args, _state(1), ctl, logs={"reward": 1.0})
    capfd.readouterr()
    with caplog.at_level("WARNING"), store_held(store):
        for step in (2, 3):
            pd.DataFrame({"step": [step], "prompt_id": ["p"]}).to_parquet(tdir / f"step_{step:06d}.parquet")
            cb.on_log(args, _state(step), ctl, logs={"reward": float(step)})
        assert [m for m, _, _ in json.loads(kept.read_text())["pending"]] == [{"reward": 2.0}, {"reward": 3.0}]
        with pytest.raises(tracking.TrackingError, match=r"refused the run's last logs \(MlflowException: "
                           r"\(sqlite3.OperationalError\) database is locked\); the model is trained"):
            cb.log_final_model(tdir.parent / "final", 3)  # training ended with the store still held
    err = capfd.readouterr().err
    assert "Traceback" not in err and "SQL" not in err and "mlflow.store.db" not in err, err
    warned = [r.getMessage() for r in caplog.records]
    assert [r.name for r in caplog.records] == ["sage_core.tracking"] * 2, warned
    for step, (message, n) in zip((2, 3), zip(warned, (1, 2))):
        assert message == (f"MLflow run {rid}: the store {tracking.shown_uri()} refused the logs of step {step} "
                           "(MlflowException: (sqlite3.OperationalError) database is locked); "
                           f"{n} metric batches (kept in {kept}) and the tracker files not uploaded yet are sent "
                           "again at the next step")
    # the lock gone, the run entered again (it trains nothing more) sends what was refused
    tracking.MlflowTrackingCallback(run_id=rid, output_dir=tdir.parent, log_checkpoint=False).log_final_model(
        tdir.parent / "final", 3)
    history = sorted((m.step, m.value) for m in tracking.client().get_metric_history(rid, "reward"))
    assert history == [(1, 1.0), (2, 2.0), (3, 3.0)] and not kept.exists()
    assert len(tracking.client().list_artifacts(rid, "tracker")) == 2


def _eval_rows(avg: float = 0.5) -> pd.DataFrame:
    return pd.DataFrame({"benchmark": ["synthetic"], "k": [4], "avg_at_k": [avg], "pass_at_k": [0.75],
                         "n_prompts": [8]})


def test_results_logged_once_wait_for_a_lock_released_during_their_retries(store, tmp_path, capfd, caplog,
                                                                           monkeypatch):
    """The writes made once, at the end or outside the callback's steps (a run's summary, its eval table, the prompts
    left out, the last logs, its end), met a sqlite store another writer held with MLflow's traceback and were lost:
    MLflow waits its 20 s busy timeout, then gives up, never trying again. Each is tried again, 5 to 40 s apart
    ($SAGE_MLFLOW_LOCK_RETRY_SECONDS in all, here 3 s), one warning a try: a lock gone meanwhile takes it."""
    monkeypatch.setenv(tracking.LOCK_RETRY_ENV, "3")
    tdir, rid, args, ctl, cb = _started_callback(tmp_path, RunSpec(max_steps=1), "t-lock-waited")
    (tdir.parent / tracking.DROPPED_PROMPTS).write_text(json.dumps({"dropped": [{"prompt_id": "a", "tokens": 9}]}))
    with store_held(store):  # a step's metrics, refused: kept for the last logs (the callback's own way)
        cb.on_log(args, _state(1), ctl, logs={"reward": 1.0})
    capfd.readouterr()
    writes = [lambda: cb.log_dropped_prompts(), lambda: tracking.log_summary({"reward": 0.5}, rid, step=1),
              lambda: tracking.log_eval(_eval_rows(), "after", rid),
              lambda: cb.log_final_model(tdir.parent / "final", 1), lambda: tracking.finish_run(rid)]
    with caplog.at_level("WARNING"):
        for write in writes:
            caplog.clear()
            with store_held(store, release_after=0.5):
                write()
            assert caplog.messages and all(re.fullmatch(
                rf"MLflow run {rid}: the store {re.escape(tracking.shown_uri())} is locked \(MlflowException: "
                r"\(sqlite3.OperationalError\) database is locked\): .+ is tried again in \d.*s", m)
                for m in caplog.messages), caplog.messages
    err = capfd.readouterr().err
    assert "Traceback" not in err and "SQL" not in err, err
    run = tracking.client().get_run(rid)
    assert run.info.status == "FINISHED" and run.data.tags[tracking.COMPLETE_TAG] == "true"
    assert run.data.metrics["summary/reward"] == 0.5 and run.data.tags["sage.prompts_dropped"] == "1"
    assert [m.step for m in tracking.client().get_metric_history(rid, "reward")] == [1]
    assert tracking.load_eval(rid)["avg_at_k"].tolist() == [0.5]
    assert not (tdir.parent / tracking.PENDING_FILE).exists() and not (store / tracking.UNLOGGED_DIR).exists()


def test_results_a_lock_outlasting_the_retries_refused_are_kept_saying_where(store, tmp_path, capfd, monkeypatch):
    """Still locked after the retries: an error naming the store, what was not logged and where it is kept (an eval
    table's rows, minutes of evaluation, under <SAGE_HOME>/unlogged/<run id>/, with the command that logs them; a
    summary there too), not MLflow's traceback; the command it gives logs the rows once the lock is gone."""
    monkeypatch.setenv(tracking.LOCK_RETRY_ENV, "0.3")
    rid = tracking.open_run(RunSpec(), "train", experiment="t-lock-outlasted")
    capfd.readouterr()
    refused = r"MLflow run {}: the store {} stayed locked through 5 tries in \d+ s \(MlflowException: " \
              r"\(sqlite3.OperationalError\) database is locked\): {} is not logged; "
    with store_held(store):
        with pytest.raises(tracking.TrackingError, match=refused.format(rid, re.escape(tracking.shown_uri()),
                           "its 'after' eval table") + r"its 1 rows are kept in (\S+); log them once the store is "
                           r"free: python -c \"(.+)\"$") as eval_error:
            tracking.log_eval(_eval_rows(0.625), "after", rid)
        with pytest.raises(tracking.TrackingError, match=refused.format(rid, ".*", "its summary") + r"it is kept "
                           r"in (\S+), and the same training run again \(it trains nothing more\) logs it$") as e:
            tracking.log_summary({"reward": 0.5, "note": "text"}, rid, step=3)
        with pytest.raises(tracking.TrackingError, match=refused.format(rid, ".*", r"its end \(FINISHED\)")
                           + "the run is left as it was: the same command run again reopens and ends it$"):
            tracking.finish_run(rid)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "SQL" not in err, err
    summary = Path(re.search(r"kept in (\S+),", str(e.value)).group(1))
    assert summary.parent == store / tracking.UNLOGGED_DIR / rid
    assert json.loads(summary.read_text()) == {"metrics": {"summary/reward": 0.5}, "step": 3}
    run = tracking.client().get_run(rid)
    assert run.info.status == "RUNNING" and "summary/reward" not in run.data.metrics
    assert tracking.load_eval(rid) is None
    kept, command = re.search(r"kept in (\S+); .* -c \"(.+)\"$", str(eval_error.value)).groups()
    assert pd.read_parquet(kept)[["benchmark", "when", "avg_at_k"]].values.tolist() == [["synthetic", "after", 0.625]]
    exec(command, {})  # the command the error gives, once the lock is gone
    assert tracking.load_eval(rid)["avg_at_k"].tolist() == [0.625]
    assert tracking.client().get_run(rid).data.metrics["eval/after/synthetic/avg_at_4"] == 0.625


def test_a_run_opened_while_the_store_is_locked_waits_for_it(store, capfd, caplog, monkeypatch):
    """Opening a run (its creation, params and opening tags; a reopening) met a sqlite store another writer held with
    MLflow's traceback, failing the command before it trained. It is tried again as the writes made once are: a lock
    gone meanwhile opens the run (once: no second run), and reopens it (counted once)."""
    monkeypatch.setenv(tracking.LOCK_RETRY_ENV, "3")
    said = r"MLflow run {}: the store {} is locked \(MlflowException: \(sqlite3.OperationalError\) database is " \
           r"locked\): its {} is tried again in \d.*s"
    uri = re.escape(tracking.shown_uri())
    rid = None
    for what in ("creation", "reopening"):
        run_id = rid
        caplog.clear()
        with caplog.at_level("WARNING"), store_held(store, release_after=1):
            rid = tracking.open_run(RunSpec(max_steps=2 if run_id else 1), "train", "t-open-locked", run_id=run_id)
        subject = re.escape(run_id or "(new, experiment 't-open-locked')")
        assert caplog.messages and all(re.fullmatch(said.format(subject, uri, what), m) for m in caplog.messages), \
            caplog.messages
    assert "Traceback" not in capfd.readouterr().err
    (run,) = tracking.find_runs("t-open-locked")
    assert run.info.run_id == rid and run.info.status == "RUNNING" and run.data.params["sage.max_steps"] == "1"
    assert run.data.tags["sage.resumed"] == "1" and run.data.tags["sage.resumed.max_steps"] == "2"
    assert run.data.tags[tracking.COMPLETE_TAG] == "false"


def _committed_then_locked(monkeypatch, owner, name: str) -> list:
    """`owner.name` does its work, then the first call raises a locked sqlite store's error all the same (a write
    that committed though its caller was told it was refused). Returns the list of its calls."""
    import sqlite3

    from mlflow.exceptions import MlflowException

    real, calls = getattr(owner, name), []

    def then_locked(*a, **k):
        out = real(*a, **k)
        calls.append(1)
        if len(calls) == 1:
            raise MlflowException("(sqlite3.OperationalError) database is locked") from sqlite3.OperationalError(
                "database is locked")
        return out

    monkeypatch.setattr(owner, name, then_locked)
    return calls


def test_a_try_of_opening_a_run_takes_up_where_the_refused_one_stopped(store, monkeypatch):
    """A try of open_run refused after some of its writes went through is not done again from the start: a run it
    created (committed, though refused) is found, not made twice, and a reopening is counted and timed once."""
    from mlflow import MlflowClient

    monkeypatch.setenv(tracking.LOCK_RETRY_ENV, "0.3")
    created = _committed_then_locked(monkeypatch, MlflowClient, "create_run")
    rid = tracking.open_run(RunSpec(max_steps=1), "train", "t-open-twice")
    assert len(created) == 1  # found by its token, not created again
    (run,) = tracking.find_runs("t-open-twice")
    assert run.info.run_id == rid and run.data.params["sage.max_steps"] == "1"
    tracking.client().set_tag(rid, tracking.LAST_STEP_TAG, "1")
    tracking.finish_run(rid)
    respecs = _committed_then_locked(monkeypatch, tracking, "_respec_run")  # after the reopening's tags, its delete
    assert tracking.open_run(RunSpec(max_steps=2), "train", "t-open-twice", run_id=rid) == rid
    run = tracking.client().get_run(rid)
    assert len(respecs) == 2 and run.info.status == "RUNNING" and run.data.tags["sage.resumed"] == "1"
    assert tracking.LAST_STEP_TAG not in run.data.tags and run.data.tags["sage.resumed.max_steps"] == "2"
    assert len(tracking.find_runs("t-open-twice")) == 1


def test_a_run_a_lock_outlasting_the_retries_refused_to_open_is_one_error_naming_the_store(store, capfd,
                                                                                           monkeypatch):
    """Still locked after the retries as the run opens: one error naming the store, that nothing is trained yet and
    what to do, not MLflow's traceback; no run is left made."""
    monkeypatch.setenv(tracking.LOCK_RETRY_ENV, "0.3")
    tracking.get_or_create_experiment("t-open-outlasted")
    with store_held(store), pytest.raises(tracking.TrackingError, match=(
            r"^MLflow run \(new, experiment 't-open-outlasted'\): the store " + re.escape(tracking.shown_uri())
            + r" stayed locked through 5 tries in \d+ s \(MlflowException: \(sqlite3.OperationalError\) database "
            r"is locked\): its creation is not logged; nothing is trained yet: run the same command again once the "
            r"store is free$")):
        tracking.open_run(RunSpec(), "train", "t-open-outlasted")
    assert "Traceback" not in capfd.readouterr().err
    assert tracking.find_runs("t-open-outlasted") == []


def test_only_lock_errors_are_tried_again(store, monkeypatch):
    """Any other error of a write is raised at once, as before: one try, no wait, no warning."""
    from mlflow.exceptions import MlflowException

    monkeypatch.setenv(tracking.LOCK_RETRY_ENV, "600")
    tries = []

    def write():
        tries.append(1)
        raise MlflowException("RESOURCE_DOES_NOT_EXIST: run 'x' not found")

    with pytest.raises(MlflowException, match="RESOURCE_DOES_NOT_EXIST"):
        tracking.retry_locked(write, "x", "its summary", lambda: "kept")
    assert tries == [1]


def test_only_our_threads_lock_errors_are_quieted(store):
    """The quieting drops MLflow's record of a locked store logged by the thread that installed it, nothing else:
    another error, and another thread's lock error, are MLflow's to print as before."""
    import sqlite3
    import threading

    import sqlalchemy

    mlflow_log = logging.getLogger("mlflow.store.db.utils")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(f"{record.exc_info[1].orig}")

    def log_error(message):
        try:
            raise sqlalchemy.exc.OperationalError("SELECT 1", {}, sqlite3.OperationalError(message))
        except sqlalchemy.exc.OperationalError as e:
            mlflow_log.exception("SQLAlchemy database error. The following exception is caught.\n%s", e)

    mlflow_log.addHandler(handler)
    try:
        with tracking._quiet_store_locked():
            log_error("database is locked")
            log_error("no such table: runs")
            other = threading.Thread(target=log_error, args=("database table is locked",))
            other.start()
            other.join()
        log_error("database is locked: after the block")
    finally:
        mlflow_log.removeHandler(handler)
    assert seen == ["no such table: runs", "database table is locked", "database is locked: after the block"]
    assert not mlflow_log.filters


def test_callback_logs_the_prompts_left_out_for_length(store, tmp_path):
    out = tmp_path / "train"
    out.mkdir()
    rid = tracking.open_run(RunSpec(max_steps=1), "train", experiment="t-cb-dropped")
    args, ctl = SimpleNamespace(output_dir=str(out)), TrainerControl()
    tracking.MlflowTrackingCallback(run_id=rid).on_train_begin(args, _state(0), ctl)
    assert "sage.prompts_dropped" not in tracking.client().get_run(rid).data.tags  # none left out: no tag
    (out / "dropped_prompts.json").write_text(json.dumps(
        {"max_prompt_length": 8, "dropped": [{"prompt_id": "a", "tokens": 9}, {"prompt_id": "b", "tokens": 12}]}))
    tracking.MlflowTrackingCallback(run_id=rid).on_train_begin(args, _state(0), ctl)
    c = tracking.client()
    assert c.get_run(rid).data.tags["sage.prompts_dropped"] == "2"
    got = Path(c.download_artifacts(rid, "dropped_prompts.json", str(tmp_path)))
    assert json.loads(got.read_text())["dropped"][1] == {"prompt_id": "b", "tokens": 12}


def test_callback_uses_active_run_and_env(store, tmp_path, monkeypatch):
    with tracking.start_run(RunSpec(), "train", experiment="t-cb2") as run:
        cb = tracking.MlflowTrackingCallback()
        cb.on_log(SimpleNamespace(output_dir=str(tmp_path)), _state(4), TrainerControl(), logs={"kl": 0.1})
    assert tracking.client().get_metric_history(run.info.run_id, "kl")[0].step == 4
    assert tracking.callback_from_env() is None
    monkeypatch.setenv("SAGE_MLFLOW_RUN_ID", run.info.run_id)
    assert tracking.callback_from_env().run_id == run.info.run_id


def test_log_eval_merges_and_logs_metrics(store, tmp_path):
    rid = tracking.open_run(RunSpec(), "train", experiment="t-eval")
    before = pd.DataFrame({"benchmark": ["synthetic"], "k": [4], "avg_at_k": [0.25], "pass_at_k": [0.5],
                           "n_prompts": [8]})
    tracking.log_eval(before, "before", run_id=rid)
    after = before.assign(avg_at_k=[0.5], pass_at_k=[0.75])
    tracking.log_eval(after, "after", run_id=rid)
    merged = tracking.log_eval(after.assign(avg_at_k=[0.625]), "after", run_id=rid)  # replaces, no duplicate
    assert list(merged.columns[:6]) == tracking.EVAL_COLUMNS
    got = tracking.load_eval(rid).set_index("when")
    assert len(got) == 2 and got.loc["before", "avg_at_k"] == 0.25 and got.loc["after", "avg_at_k"] == 0.625
    m = tracking.client().get_run(rid).data.metrics
    assert m["eval/before/synthetic/avg_at_4"] == 0.25 and m["eval/after/synthetic/pass_at_4"] == 0.75
    with pytest.raises(ValueError, match="when"):
        tracking.log_eval(before, "during", run_id=rid)


def test_eval_metrics_of_two_benchmarks_never_share_a_name(store):
    """Names were cleaned to [A-Za-z0-9_.-], so "math 500" and "math_500" logged the same MLflow metric, one
    overwriting the other while eval.parquet kept both. Characters MLflow takes (space, colon) are kept; names that
    still collide are refused before anything is logged, also against an earlier call's names."""
    rid = tracking.open_run(RunSpec(), "train", experiment="t-eval-names")
    table = pd.DataFrame({"benchmark": ["math 500", "gsm8k:main", "a/b", ".."], "k": [4] * 4,
                          "avg_at_k": [0.1, 0.2, 0.3, 0.4], "pass_at_k": [0.5] * 4, "n_prompts": [8] * 4})
    tracking.log_eval(table, "after", run_id=rid)
    m = tracking.client().get_run(rid).data.metrics
    assert {k: v for k, v in m.items() if k.endswith("avg_at_4")} == {
        "eval/after/math 500/avg_at_4": 0.1, "eval/after/gsm8k:main/avg_at_4": 0.2, "eval/after/a_b/avg_at_4": 0.3,
        "eval/after/__/avg_at_4": 0.4}
    other = table.iloc[:1].assign(benchmark="math_500", avg_at_k=0.9)  # a metric of its own now
    tracking.log_eval(other, "after", run_id=rid)
    m = tracking.client().get_run(rid).data.metrics
    assert m["eval/after/math 500/avg_at_4"] == 0.1 and m["eval/after/math_500/avg_at_4"] == 0.9
    clash = table.iloc[:1].assign(benchmark="a_b", avg_at_k=0.9)
    for bad in (clash, pd.concat([clash.assign(benchmark="x/y"), clash.assign(benchmark="x_y")])):
        with pytest.raises(ValueError, match=r"'a/b' and 'a_b' would log the same eval metrics \(eval/<when>/a_b/"
                                             r"...\): rename one|'x/y' and 'x_y'"):
            tracking.log_eval(bad, "after", run_id=rid)
    assert tracking.client().get_run(rid).data.metrics["eval/after/a_b/avg_at_4"] == 0.3
    assert sorted(tracking.load_eval(rid).benchmark) == ["..", "a/b", "gsm8k:main", "math 500", "math_500"]


def test_log_eval_never_writes_over_a_table_it_could_not_read(store, monkeypatch):
    """The eval table is read, merged and written back: a download that failed for a moment was taken for "no table
    yet", and the new rows were written over the earlier ones (the before-training eval, other benchmarks)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    rid = tracking.open_run(RunSpec(), "train", experiment="t-eval-down")
    before = pd.DataFrame({"benchmark": ["synthetic"], "k": [4], "avg_at_k": [0.25], "pass_at_k": [0.5],
                           "n_prompts": [8]})
    tracking.log_eval(before, "before", run_id=rid)

    def down(self, *a, **k):
        raise MlflowException("API request to endpoint /api/2.0/mlflow-artifacts failed")

    with monkeypatch.context() as m:
        m.setattr(MlflowClient, "download_artifacts", down)
        with pytest.raises(MlflowException):
            tracking.log_eval(before.assign(avg_at_k=[0.5]), "after", run_id=rid)
    got = tracking.load_eval(rid)
    assert got["when"].tolist() == ["before"] and got["avg_at_k"].tolist() == [0.25]
    assert tracking.log_eval(before.assign(avg_at_k=[0.5]), "after", run_id=rid)["when"].tolist() == ["before",
                                                                                                       "after"]


def test_log_table_and_markdown(store, tmp_path):
    rid = tracking.open_run(RunSpec(), "study", experiment="t-table")
    df = pd.DataFrame({"variant": ["grpo", "sage|x"], "avg": [0.5, float("nan")]})
    tracking.log_table(df, "study/comparison", run_id=rid)
    names = sorted(Path(a.path).name for a in tracking.client().list_artifacts(rid, "study"))
    assert names == ["comparison.csv", "comparison.md", "comparison.parquet"]
    md = tracking.to_markdown(df)
    assert md.splitlines()[2] == "| grpo | 0.500 |" and "sage\\|x |  |" in md
    assert tracking.has_artifact(rid, "study/comparison.parquet")
    assert tracking.compare_url(["a", "b"], "3").endswith(
        "#/compare-runs?runs=%5B%22a%22%2C%20%22b%22%5D&experiments=%5B%223%22%5D")
    assert os.environ["SAGE_HOME"] == str(store)


def test_make_callback_owns_a_run_for_sage_train_mlflow(store, tmp_path, monkeypatch):
    """`sage train --mlflow` without a flow: the callback opens the run on the output dir and finishes it."""
    monkeypatch.delenv("SAGE_MLFLOW_RUN_ID", raising=False)
    spec = RunSpec(max_steps=1, seed=7)
    out = tmp_path / "cli-run"
    args = SimpleNamespace(output_dir=str(out))
    cb = tracking.make_callback(spec, experiment="t-own")
    cb.on_train_begin(args, _state(0), TrainerControl())
    cb.on_log(args, _state(1), TrainerControl(), logs={"reward": 1.0})
    cb.on_train_end(args, _state(1), TrainerControl())
    assert not tracking.is_complete(tracking.client().get_run(cb.run_id))  # final/ is not saved yet
    (out / "final").mkdir()
    (out / "final" / "config.json").write_text("{}")
    cb.log_final_model(out / "final", 1)
    assert cb.owns_run and tracking.read_run_id(out) == cb.run_id
    run = tracking.client().get_run(cb.run_id)
    assert tracking.is_complete(run) and run.data.metrics["reward"] == 1.0
    # the history of a run whose ranks could not log live
    rid = tracking.open_run(spec, "train", experiment="t-own")
    n = tracking.log_history([{"step": 1, "reward": 0.5, "note": "x"}, {"step": 2, "reward": 0.7},
                              {"step": 2}], run_id=rid)
    assert n == 2 and [(m.step, m.value) for m in tracking.client().get_metric_history(rid, "reward")] == [
        (1, 0.5), (2, 0.7)]


def test_a_run_with_nothing_left_to_train_is_finished_by_the_callback_that_opens_it(store, tmp_path, monkeypatch):
    """train() on a folder whose checkpoint is at max_steps trains nothing and calls no Trainer hook: the first the
    callback of make_callback(spec) heard was log_final_model, which opened the run on output_dir None
    (TypeError): a finished run entered again crashed, and one killed before final/ was written could never be
    finished. It reopens the folder's run, uploads the tracker files it lacks and finishes it."""
    monkeypatch.delenv("SAGE_MLFLOW_RUN_ID", raising=False)
    monkeypatch.delenv("SAGE_OUTPUT_DIR", raising=False)
    spec = RunSpec(max_steps=1, seed=13)
    out = tmp_path / "done"
    (out / "tracker").mkdir(parents=True)
    rid, _ = tracking.resume_or_create_run(spec, "train", out, experiment="t-done")
    tracking.finish_run(rid, "KILLED")  # killed after its last checkpoint, before final/ was uploaded
    pd.DataFrame({"step": [1], "prompt_id": ["p"]}).to_parquet(out / "tracker" / "step_000001.parquet")
    (out / "final").mkdir()
    (out / "final" / "config.json").write_text("{}")
    cb = tracking.make_callback(spec, experiment="t-done")
    cb.log_final_model(out / "final", 1)
    run = tracking.client().get_run(rid)
    assert cb.run_id == rid and cb.owns_run and tracking.is_complete(run)
    assert run.data.tags["sage.checkpoint_step"] == "1" and run.data.tags[tracking.LAST_STEP_TAG] == "1"
    assert [a.path for a in tracking.client().list_artifacts(rid, "tracker")] == ["tracker/step_000001.parquet"]


def test_a_finished_run_entered_again_does_not_upload_its_model_again(store, tmp_path, monkeypatch):
    """`sage train --mlflow` run again on a finished run trains nothing (train's done path), and its callback copied
    final/ to the run's checkpoint/ once more each time (a whole model, to a remote store too). The run has that
    step's model already (sage.checkpoint_step): nothing is uploaded; a run trained now uploads its model."""
    monkeypatch.delenv("SAGE_MLFLOW_RUN_ID", raising=False)
    out = tmp_path / "again"
    (out / "final").mkdir(parents=True)
    (out / "final" / "config.json").write_text("{}")
    rid, _ = tracking.resume_or_create_run(RunSpec(max_steps=1, seed=17), "train", out, experiment="t-again")
    uploads = []
    real = tracking.log_checkpoint
    monkeypatch.setattr(tracking, "log_checkpoint", lambda path, run_id: uploads.append(run_id) or real(path, run_id))
    tracking.MlflowTrackingCallback(run_id=rid, output_dir=out).log_final_model(out / "final", 1)  # done path
    assert uploads == [rid] and tracking.has_artifact(rid, "checkpoint/config.json")
    again = tracking.MlflowTrackingCallback(run_id=rid, output_dir=out)
    again.log_final_model(out / "final", 1)
    assert uploads == [rid] and again.checkpoint_logged == out / "final"
    trained = tracking.MlflowTrackingCallback(run_id=rid, output_dir=out)
    trained.on_train_begin(SimpleNamespace(output_dir=str(out)), _state(1), TrainerControl())
    trained.log_final_model(out / "final", 1)
    assert uploads == [rid, rid]


@pytest.mark.parametrize("error, status", [(KeyboardInterrupt(), "KILLED"), (RuntimeError("boom"), "FAILED")])
def test_a_run_the_callback_opened_is_ended_when_training_stops_or_fails(store, tmp_path, monkeypatch, error, status):
    """The callback that opened its run (make_callback with a spec) finished it only once final/ was saved: a run
    stopped (Ctrl-C; SIGTERM, which sage train raises as a KeyboardInterrupt) or failed stayed RUNNING, with no end
    time. train() hands it the error: KILLED for a stop, FAILED otherwise; a run it was given is left alone."""
    monkeypatch.delenv("SAGE_MLFLOW_RUN_ID", raising=False)
    args = SimpleNamespace(output_dir=str(tmp_path / "own"))
    cb = tracking.make_callback(RunSpec(max_steps=1, seed=11), experiment="t-end")
    cb.on_train_begin(args, _state(0), TrainerControl())
    cb.end_run(error)
    run = tracking.client().get_run(cb.run_id)
    assert run.info.status == status and run.info.end_time is not None and not tracking.is_complete(run)
    given = tracking.open_run(RunSpec(), "train", experiment="t-end")
    tracking.MlflowTrackingCallback(run_id=given, output_dir=tmp_path / "given").end_run(error)
    assert tracking.client().get_run(given).info.status == "RUNNING"
    # a store that refuses the last-step tag: the run is still ended (and the store's error raised)
    from mlflow.exceptions import MlflowException

    cb = tracking.make_callback(RunSpec(max_steps=1, seed=12), experiment="t-end")
    cb.on_train_begin(SimpleNamespace(output_dir=str(tmp_path / "own2")), _state(0), TrainerControl())
    from mlflow import MlflowClient

    real = MlflowClient.set_tag

    def refuse(self, run_id, key, value, *a, **kw):
        if key == tracking.LAST_STEP_TAG:
            raise MlflowException("the store is down")
        return real(self, run_id, key, value, *a, **kw)

    monkeypatch.setattr(MlflowClient, "set_tag", refuse)
    with pytest.raises(MlflowException):
        cb.end_run(error)
    assert tracking.client().get_run(cb.run_id).info.status == status
