"""Prefect flows: parameters, variants, the comparison table (pure), and the flows themselves run in this process
against the session's real Prefect server (`prefect_harness`) with the real tiny model, trainer and evaluation
(small settings)."""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import re
import time
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
import pytest
from prefect.exceptions import ParameterTypeError

from flows import common, params
from flows.study_flow import (
    COMPARISON_COLUMNS,
    DEFAULT_METHODS,
    SUMMARY_COLUMNS,
    comparison_table,
    hint_study,
    report_card,
    seed_summary,
    study_key,
    study_seeds,
    variant_specs,
)
from flows.train_flow import sage_train
from sage_core import tracking
from sage_core.presets import PRESETS
from sage_core.spec import RunSpec

SMALL = dict(max_steps=2, num_prompts=4, num_generations=4, prompts_per_step=2, eval_num_prompts=4, eval_k=2,
             save_steps=1)


# ----------------------------------------------------------------------------------------------- pure parts
def test_resolve_spec_precedence():
    s = params.resolve_spec("tiny-cpu", None, {"max_steps": None})
    assert s == RunSpec(**PRESETS["tiny-cpu"])
    partial = RunSpec.model_validate({"max_steps": 3, "method": "grpo"})
    s = params.resolve_spec("smollm2-cpu", partial, {"max_steps": 2, "seed": None})
    assert (s.model, s.method, s.max_steps, s.num_generations) == ("smollm2", "grpo", 2, 4)
    assert params.resolve_spec(None, {"seed": 5}, {}) == RunSpec(seed=5)
    with pytest.raises(ValueError, match="unknown preset"):
        params.resolve_spec("nope")
    with pytest.raises(ValueError, match="light_min"):
        params.resolve_spec("tiny-cpu", None, {"light_min": 0.9, "light_max": 0.2})


def test_flow_signatures_follow_runspec():
    for f in (sage_train, hint_study):
        sig = inspect.signature(f.fn)
        assert set(RunSpec.model_fields) <= set(sig.parameters)
        assert all(sig.parameters[n].default is None for n in RunSpec.model_fields)

    def clash(*, seed: int = 0, **overrides):
        return None

    with pytest.raises(ValueError, match="clash"):
        params.with_spec_overrides(clash)


def test_bad_parameters_are_rejected_naming_the_field():
    ok = sage_train.validate_parameters({"preset": "tiny-cpu", "max_steps": "2", "spec": {"method": "grpo"}})
    assert ok["max_steps"] == 2 and ok["spec"].method == "grpo"
    for bad, field in [({"method": "bogus"}, "method"), ({"num_generations": 1}, "num_generations"),
                       ({"preset": "gpu-xl"}, "preset"), ({"spec": {"max_stepz": 2}}, "max_stepz")]:
        with pytest.raises(ParameterTypeError, match=field):
            sage_train.validate_parameters(bad)
    with pytest.raises(ParameterTypeError, match="methods"):
        hint_study.validate_parameters({"methods": ["grpo", "sage-magic"]})
    # a partial spec is judged by the run it makes (preset + spec + fields), not by RunSpec's defaults
    for ps in ({"preset": "qwen2.5-7b", "spec": {"micro_batch_size": 128}},
               {"spec": {"hint_source": "teacher"}, "teacher": "hints.jsonl"}):
        got = sage_train.validate_parameters(ps)
        assert params.resolve_spec(got.get("preset", "tiny-cpu"), got["spec"],
                                   {k: v for k, v in got.items() if k in params.SPEC_FIELDS})
    ok = hint_study.validate_parameters({"spec": RunSpec(method="grpo", max_steps=3)})
    assert ok["spec"].model_fields_set == {"method", "max_steps"}
    # sage-eval takes what RunSpec's eval fields take: temperature 0 is greedy, below 0 is refused
    from flows.eval_flow import sage_eval

    assert sage_eval.validate_parameters({"temperature": 0})["temperature"] == 0
    with pytest.raises(ParameterTypeError, match="temperature"):
        sage_eval.validate_parameters({"temperature": -0.1})


def test_variant_specs(tmp_path):
    base = params.resolve_spec("tiny-cpu", None, {"max_steps": 2})
    hints = str(tmp_path / "hints.jsonl")
    v = variant_specs(base, DEFAULT_METHODS + ["ada-seq"], teacher=hints)
    assert list(v) == DEFAULT_METHODS + ["ada-seq"]
    assert [(s.method, s.hint_source) for s in v.values()] == [
        ("grpo", "online"), ("sage-light", "online"), ("sage", "online"), ("sage", "fixed"), ("sage", "teacher"),
        ("ada-seq", "online")]
    assert v["sage-teacher"].teacher == hints and all(s.teacher is None for n, s in v.items() if n != "sage-teacher")
    assert all(s.max_steps == 2 for s in v.values()) and len({s.key() for s in v.values()}) == len(v)
    # the other variants' keys do not depend on the teacher file (so re-runs find them)
    assert variant_specs(base, ["grpo"], teacher="/elsewhere.jsonl")["grpo"].key() == v["grpo"].key()
    with pytest.raises(ValueError, match="teacher"):
        variant_specs(base, ["sage-teacher"])
    with pytest.raises(ValueError, match="unknown methods"):
        variant_specs(base, ["grpo", "magic"])


def test_comparison_table_and_report_card():
    rows = [
        dict(variant="grpo", method="grpo", hint_source="none", k=2, avg_at_k_before=0.2, avg_at_k_after=0.3,
             pass_at_k_after=0.5, never_solved=0.4, never_solved_no_hint=0.4, frac_collapsed=0.6, rollouts=64.0,
             rescued=0.0, wall_seconds=10.0, train_seconds=8.0, gen_tokens=1000.0, open_groups=4.0, global_step=2,
             status="FINISHED",
             run_id="a"),
        dict(variant="sage-online", method="sage", hint_source="online", k=2, avg_at_k_before=0.2,
             avg_at_k_after=0.4, pass_at_k_after=0.625, never_solved=0.1, never_solved_no_hint=0.3,
             frac_collapsed=0.5, rollouts=96.0, rescued=3.0, wall_seconds=25.0, train_seconds=20.0, gen_tokens=2300.0,
             open_groups=10.0, global_step=2,
             status="FINISHED", run_id="b", extra="ignored"),
        dict(variant="sage-fixed", method="sage", hint_source="fixed", status="FAILED"),
    ]
    df = comparison_table(rows)
    assert list(df.columns) == COMPARISON_COLUMNS and list(df["variant"]) == ["grpo", "sage-online", "sage-fixed"]
    assert df.loc[1, "train_vs_grpo"] == 2.5 and df.loc[0, "train_vs_grpo"] == 1.0  # the loop's time, not wall
    assert df.loc[1, "gen_vs_grpo"] == 2.3 and math.isnan(df.loc[2, "gen_vs_grpo"])  # the work behind it
    assert df.loc[1, "open_vs_grpo"] == 2.5 and df.loc[0, "open_vs_grpo"] == 1.0  # the learning signal it bought
    assert math.isclose(df.loc[1, "delta_avg_at_k"], 0.2)
    assert math.isnan(df.loc[2, "avg_at_k_after"]) and df.loc[2, "status"] == "FAILED"
    card = report_card(df, "t")
    assert "k=2" in card and "| sage-online | 0.200 | 0.400 | 0.625 |" in card
    # no GRPO row: the ratio is undefined, not an error
    assert comparison_table(rows[1:2])["train_vs_grpo"].isna().all()


def _seed_row(variant: str, method: str, seed: int, after: float, train_s: float, **kw) -> dict:
    return {"variant": variant, "method": method, "hint_source": "none" if method == "grpo" else "online",
            "seed": seed, "k": 4, "avg_at_k_before": 0.2, "avg_at_k_after": after, "pass_at_k_after": after + 0.2,
            "never_solved": 0.5, "frac_collapsed": 0.7, "train_seconds": train_s, "gen_tokens": 100.0 * train_s,
            "open_groups": train_s, "status": "FINISHED", "run_id": f"{variant}{seed}", **kw}


def test_multi_seed_table_pairs_by_seed():
    # seed 0: GRPO 0.30 (8 s), SAGE-LIGHT 0.35 (12 s); seed 1: GRPO 0.20 (10 s), SAGE-LIGHT 0.26 (11 s);
    # seed 2: GRPO 0.40, SAGE-LIGHT failed
    rows = [_seed_row("grpo", "grpo", 0, 0.30, 8.0), _seed_row("sage-light", "sage-light", 0, 0.35, 12.0),
            _seed_row("grpo", "grpo", 1, 0.20, 10.0), _seed_row("sage-light", "sage-light", 1, 0.26, 11.0),
            _seed_row("grpo", "grpo", 2, 0.40, 9.0),
            # a failed variant's row keeps what its run recorded before it failed (flows.study_flow.failed_row): in
            # the table, not in the means over seeds
            {"variant": "sage-light", "method": "sage-light", "hint_source": "online", "seed": 2, "status": "FAILED",
             "run_id": "sage-light2", "avg_at_k_before": 0.2, "never_solved": 0.9, "frac_collapsed": 0.1,
             "train_seconds": 30.0}]
    df = comparison_table(rows)
    assert list(df["seed"]) == [0, 0, 1, 1, 2, 2] and df["seed"].dtype.kind == "i"
    # the time ratio is against GRPO of the same seed, not the first GRPO row
    assert list(df["train_vs_grpo"].round(6))[:4] == [1.0, 1.5, 1.0, 1.1]
    assert df.loc[5, "status"] == "FAILED" and df.loc[5, "train_vs_grpo"] == pytest.approx(30 / 9)  # as recorded
    s = seed_summary(df).set_index("variant")
    assert list(s.index) == ["grpo", "sage-light"] and list(s.columns) == SUMMARY_COLUMNS[1:]
    light, grpo = s.loc["sage-light"], s.loc["grpo"]
    assert (light["seeds"], light["failed"], grpo["seeds"], grpo["failed"]) == (2, 1, 3, 0)
    assert math.isclose(light["avg_at_k_after"], 0.305) and math.isclose(grpo["avg_at_k_after"], 0.30)
    assert (light["avg_at_k_after_min"], light["avg_at_k_after_max"]) == (0.26, 0.35)
    # paired: +0.05 (seed 0) and +0.06 (seed 1); seed 2 has no SAGE-LIGHT score
    assert math.isclose(light["vs_grpo"], 0.055) and light["vs_grpo_seeds"] == 2
    assert math.isclose(light["vs_grpo_min"], 0.05) and math.isclose(light["vs_grpo_max"], 0.06)
    assert math.isnan(grpo["vs_grpo"]) and grpo["vs_grpo_seeds"] == 0
    assert math.isclose(light["train_vs_grpo"], 1.3)  # mean of 1.5 and 1.1
    assert (light["never_solved"], light["frac_collapsed"]) == (0.5, 0.7)  # the finished seeds' only
    card = report_card(df, "t")
    # the paired change says over how many seeds it is taken (GRPO's mean is over 3, SAGE-LIGHT's over 2)
    assert "3 seeds" in card and "| sage-light | 2 | 0.305 (0.260..0.350) | +0.055 (+0.050..+0.060) 2 seeds |" in card
    assert "| sage-light | 1 | 0.200 | 0.260 |" in card  # the per-seed rows follow
    # one seed: the card is the per-variant table, without a seed column
    one = comparison_table(rows[:2])
    assert "seeds" not in report_card(one, "t") and "| sage-light | 0.200 | 0.350 |" in report_card(one, "t")
    assert seed_summary(one).set_index("variant").loc["sage-light", "vs_grpo"] == pytest.approx(0.05)


def test_report_prints_the_study_run_last_active(tmp_path, monkeypatch):
    """An earlier study run again reopens its MLflow run, which keeps its start time: the report card is the one
    that ended last, not the one started last."""
    from flows import report

    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ids = _ended_studies(tmp_path, (("first", 1_000, 9_000), ("second", 2_000, 3_000)))  # first: run again, ended last
    assert report.latest_study("studies").info.run_id == ids[0]


def _ended_studies(tmp_path, times) -> list[str]:
    """Study runs in experiment 'studies', one per (name, start, end), each with a comparison table: their ids."""
    c = tracking.client()
    exp = c.create_experiment("studies")
    ids = []
    for name, start, end in times:
        rid = c.create_run(exp, start_time=start, tags={"sage.kind": "study"}, run_name=name).info.run_id
        table = tmp_path / name / "comparison.parquet"
        table.parent.mkdir()
        pd.DataFrame({"variant": [name]}).to_parquet(table)
        c.log_artifact(rid, str(table), "study")
        c.set_terminated(rid, "FINISHED", end_time=end)
        ids.append(rid)
    return ids


def test_a_study_run_again_is_the_report_of_its_reopening_while_it_runs(tmp_path, monkeypatch):
    """A study run again reopens its MLflow run, which keeps its start and, while RUNNING, the end of its earlier
    attempt (MLflow cannot clear it): ranked by those, a study that ended between that end and the reopening was
    taken for the latest. The reopening counts (tracking.last_active); a run killed outright, RUNNING for good, is not
    taken for 'now' over the studies after it."""
    from flows import report

    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ids = _ended_studies(tmp_path, (("first", 1_000, 3_000), ("second", 2_000, 5_000)))
    assert report.latest_study("studies").info.run_id == ids[1]
    before = int(time.time() * 1000)
    tracking.open_run(RunSpec(), "study", "studies", run_id=ids[0])  # the first study run again
    c, exp = tracking.client(), tracking.client().get_experiment_by_name("studies").experiment_id
    run = c.get_run(ids[0])
    assert run.info.status == "RUNNING" and run.info.end_time == 3_000  # its earlier attempt's end, still there
    assert tracking.last_active(run) >= before
    assert report.latest_study("studies").info.run_id == ids[0]
    # a third study started and ended after the reopening (the first one killed outright, RUNNING for good)
    rid = c.create_run(exp, start_time=int(time.time() * 1000) + 1_000, tags={"sage.kind": "study"}).info.run_id
    c.log_artifact(rid, str(tmp_path / "second" / "comparison.parquet"), "study")
    c.set_terminated(rid, "FINISHED", end_time=int(time.time() * 1000) + 2_000)
    assert report.latest_study("studies").info.run_id == rid


def test_study_seeds_and_key():
    base = params.resolve_spec("tiny-cpu", None, {"seed": 3})
    assert study_seeds(None, base) == [3] and study_seeds([2, 0, 1], base) == [2, 0, 1]
    for bad, match in (([], "empty"), ([1, 2, 1], r"\[1\] more than once"), ([-1], ">= 0")):
        with pytest.raises(ValueError, match=match):
            study_seeds(bad, base)
    with pytest.raises(ValueError, match=r"seed=3 and seeds=\[0, 1\] both given"):
        study_seeds([0, 1], base, seed_given=True)  # the seed the caller set would be ignored
    assert study_seeds([1, 3], base, seed_given=True) == [1, 3]
    with pytest.raises(ParameterTypeError, match="seeds"):
        hint_study.validate_parameters({"seeds": [0, -2]})
    with pytest.raises(ParameterTypeError, match="seed"):
        sage_train.validate_parameters({"seed": -1})
    # the study run holds any seeds; any other field makes another study
    assert study_key(base, "e") == study_key(params.resolve_spec("tiny-cpu"), "e")
    assert study_key(base, "e") != study_key(params.resolve_spec("tiny-cpu", None, {"max_steps": 3}), "e")
    assert study_key(base, "e") != study_key(base, "f")
    # budget-matched or on other benchmark files: another study (its table must not take in the other's variants)
    keys = {study_key(base, "e"), study_key(base, "e", match_budget=True), study_key(base, "e", benchmarks={"a": "x"}),
            study_key(base, "e", benchmarks={"a": "y"})}
    assert len(keys) == 4 and study_key(base, "e", False, {}) == study_key(base, "e")


def test_benchmark_rows_take_the_trained_models_format(tmp_path, monkeypatch):
    """Benchmark files are read into rows formatted as training formats them: no system turn for the tiny model
    (nor for a checkpoint of it, found by the spec.json beside it or its MLflow run), the paper's for real ones."""
    import json

    from flows.eval_flow import base_model
    from sage_core.prompts import SYSTEM_PROMPT

    bench = tmp_path / "b.jsonl"
    bench.write_text(json.dumps({"problem": "What is 2 + 3?", "answer": "5"}) + "\n")
    tiny = params.resolve_spec("tiny-cpu")
    (rows,) = common.resolve_benchmarks(tiny, {"b": str(bench)}).values()
    assert [m["role"] for m in rows[0]["prompt"]] == ["user"] and rows[0]["answer"] == "5"
    (rows,) = common.resolve_benchmarks(tiny.model_copy(update={"model": "org/real"}), {"b": str(bench)}).values()
    assert rows[0]["prompt"][0] == {"role": "system", "content": SYSTEM_PROMPT}

    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / "spec.json").write_text(tiny.model_dump_json())
    assert base_model(str(out / "final"), str(out / "final"), None) == "tiny"
    assert base_model(str(tmp_path), str(tmp_path), None) == str(tmp_path)  # no spec.json: the model as given
    assert base_model("org/real", "org/real", None) == "org/real"
    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with tracking.start_run(tiny, "train", "t-base") as run:
        pass
    assert base_model(f"runs:/{run.info.run_id}", "/downloads/checkpoint", run.info.run_id) == "tiny"


def test_an_eval_run_is_tagged_with_the_method_that_trained_its_model(tmp_path, monkeypatch):
    """sage-eval's run carries the method and hint source of the model it evaluated (its MLflow run's, or the
    spec.json beside a checkpoint folder), not its preset's; a model no run trained is `base`."""
    import json

    from flows.eval_flow import provenance

    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    light = params.resolve_spec("tiny-cpu", {"method": "sage-light", "hint_source": "fixed"})
    with tracking.start_run(light, "train", "t-prov") as run:
        pass
    rid = run.info.run_id
    assert provenance(f"runs:/{rid}", "/downloads/checkpoint", rid) == {
        "model": "tiny", "method": "sage-light", "hint_source": "fixed"}
    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / "spec.json").write_text(light.model_copy(update={"method": "grpo"}).model_dump_json())
    assert provenance(str(out / "final"), str(out / "final"), None) == {
        "model": "tiny", "method": "grpo", "hint_source": "none"}  # GRPO writes no hints, whatever the field says
    assert provenance("org/real", "org/real", None) == {"model": "org/real", "method": "base", "hint_source": "none"}
    # a spec.json this RunSpec refuses (an older version's field): its own method and hint source, as written
    (out / "spec.json").write_text(json.dumps({"model": "tiny", "method": "sage", "hint_source": "fixed",
                                               "retired_field": 1}))
    assert provenance(str(out / "final"), str(out / "final"), None) == {
        "model": "tiny", "method": "sage", "hint_source": "fixed"}


def test_an_evals_default_held_out_set_is_that_of_the_run_that_trained_the_model(tmp_path, monkeypatch):
    """sage-eval of a run's checkpoint (spec.json beside it, or runs:/<id>) with no benchmarks evaluates the held-out
    set of that run (its data file's rows after its training rows), not the preset's (synthetic problems of another
    task, or a file's rows after the preset's num_prompts: the run's training rows)."""
    import json
    import logging

    import flows.eval_flow as ef

    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    data = tmp_path / "task.jsonl"
    data.write_text("".join(json.dumps({"prompt_id": f"q{i}", "problem": f"What is {i} + 1 ?", "answer": str(i + 1)})
                            + "\n" for i in range(100)))
    seen = []
    monkeypatch.setattr(ef, "get_run_logger", lambda: logging.getLogger("test-flow"))
    monkeypatch.setattr(ef, "run_eval", lambda ref, benches, spec, **kw: seen.append(benches) or [])
    monkeypatch.setattr(ef, "eval_table", lambda rows, spec, benches: pd.DataFrame(columns=tracking.EVAL_COLUMNS))
    monkeypatch.setattr(ef, "create_table_artifact", lambda *a, **kw: None)
    trained = params.resolve_spec("tiny-cpu", {"data": str(data), "num_prompts": 90})
    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / "spec.json").write_text(trained.model_dump_json())
    with tracking.start_run(trained, "train", "t-held") as run:
        pass
    for model in (str(out / "final"), f"runs:/{run.info.run_id}"):
        if model.startswith("runs:/"):
            monkeypatch.setattr(ef, "resolve_model", lambda m: (str(out / "final"), run.info.run_id))
        ef.sage_eval.fn(model=model)
        (rows,) = seen.pop().values()
        assert [r["prompt_id"] for r in rows] == [f"q{i}" for i in range(90, 100)], model


def test_an_eval_into_a_run_that_is_not_there_fails_before_evaluating(tmp_path, monkeypatch):
    """sage-eval's `log_to_run` names a run of the store: a wrong id is refused, naming the parameter, before the
    evaluation (hours on a large model), not when its results are logged."""
    import logging

    import flows.eval_flow as ef

    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    evals = []
    monkeypatch.setattr(ef, "get_run_logger", lambda: logging.getLogger("test-flow"))
    monkeypatch.setattr(ef, "run_eval", lambda *a, **kw: evals.append(a) or [])
    with pytest.raises(ValueError, match="log_to_run"):
        ef.sage_eval.fn(model="tiny", log_to_run="0123456789abcdef")
    assert evals == []


def test_runs_model_is_downloaded_again_when_a_resumed_run_uploads_a_newer_checkpoint(tmp_path, monkeypatch):
    """`runs:/<id>` caches its download per `sage.checkpoint_step`: a resumed run keeps its id and uploads the model
    of a later step, which is what is evaluated then (not the cached earlier one); untagged, the cache is kept."""
    from flows.eval_flow import resolve_model

    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with tracking.start_run(RunSpec(), "train", "t-resume") as run:
        pass
    rid, model = run.info.run_id, tmp_path / "final"
    model.mkdir()

    def upload(text: str, step: int | None = None) -> str:  # what runs:/<id> then evaluates
        (model / "config.json").write_text(text)
        tracking.log_checkpoint(model, rid)
        if step is not None:
            tracking.client().set_tag(rid, "sage.checkpoint_step", str(step))
        ref, source = resolve_model(f"runs:/{rid}")
        assert source == rid
        return (Path(ref) / "config.json").read_text()

    assert upload("a") == "a" and upload("b") == "a"  # untagged: the first download is kept
    assert upload("step 2", 2) == "step 2"
    assert upload("step 4", 4) == "step 4"  # the resumed run's newer model, not step 2's download
    assert upload("step 4 again", 4) == "step 4"  # the same step: the download is reused


def test_slug_and_run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SAGE_HOME", str(tmp_path))
    assert common.slug("Hint Study/Tiny_CPU") == "hint-study-tiny-cpu"
    s = RunSpec()
    assert common.run_dir("my-exp", "sage-online", s) == tmp_path / "runs" / "my-exp" / f"sage-online-{s.key()}"
    d = common.run_dir("My Exp", "sage-online", s)  # another experiment of that slug: a folder of its own
    assert d.parent.name.startswith("my-exp-") and d.name == f"sage-online-{s.key()}"
    assert common.run_dir("My Exp", "sage-online", s, fresh=True) != d
    # the folder a flow trains in: run_dir's, unless a run there was resumed by hand with another spec
    assert common.folder_for("My Exp", "sage-online", s) == d
    d.mkdir(parents=True)
    (d / "spec.json").write_text(s.model_dump_json())
    assert common.folder_for("My Exp", "sage-online", s) == d
    (d / "spec.json").write_text(s.model_copy(update={"max_steps": s.max_steps + 1}).model_dump_json())
    other = common.folder_for("My Exp", "sage-online", s)
    assert other != d and other.name.startswith(d.name + "-") and not other.exists()
    (d / "spec.json").write_text("{not json")  # unreadable: sage train's own folder check decides
    assert common.folder_for("My Exp", "sage-online", s) == d


def test_experiments_of_one_slug_do_not_share_a_run(stubbed_train):
    """"sage_v2" and "sage-v2" are two MLflow experiments with one slug: a flow run in the second trains its own run
    there, not reopening the first's through a shared run folder's mlflow_run_id."""
    import flows.train_flow as tf

    spec = RunSpec(method="grpo", max_steps=1, eval_k=2)
    kw = dict(label="grpo", benchmarks=None, evaluate_before=True, evaluate_after=True, force=False,
              launcher="local", parent_run_id=None, variant=None, preset=None)
    a = tf.run_training(spec, experiment="sage-v2", **kw)
    b = tf.run_training(spec, experiment="sage_v2", **kw)
    assert b["run_id"] != a["run_id"] and [r.info.run_id for r in tracking.find_runs("sage_v2")] == [b["run_id"]]
    assert tracking.client().get_run(a["run_id"]).data.tags.get("sage.resumed") is None  # left as it finished


def test_a_run_started_before_experiment_folders_had_a_hash_resumes_in_its_folder(stubbed_train):
    """A run of experiment "sage_v2" started (and stopped) before experiment_dir hashed names that are not their own
    slug lies in runs/sage-v2/: the flow resumes it there, not starting the run over in runs/sage-v2-<hash>/; a
    folder there whose run is another experiment's ("sage-v2") is not taken."""
    import flows.train_flow as tf
    from sage_core.data import slug

    spec = RunSpec(method="grpo", max_steps=1, eval_k=2)
    name = common.run_dir("sage_v2", "grpo", spec).name
    legacy = common.runs_root() / slug("sage_v2") / name
    legacy.mkdir(parents=True)
    rid, _ = tracking.resume_or_create_run(spec, "train", legacy, "sage_v2")
    assert common.run_dir("sage_v2", "grpo", spec) == legacy
    assert common.run_dir("sage_v2", "grpo", spec, fresh=True).parent == common.experiment_dir("sage_v2")
    kw = dict(label="grpo", benchmarks=None, evaluate_before=True, evaluate_after=True, force=False,
              launcher="local", parent_run_id=None, variant=None, preset=None)
    assert tf.run_training(spec, experiment="sage_v2", **kw)["run_id"] == rid
    tracking.write_run_id(legacy, tracking.resume_or_create_run(spec, "train", legacy / "x", "sage-v2")[0])
    assert common.run_dir("sage_v2", "grpo", spec) == common.experiment_dir("sage_v2") / name


def test_a_benchmark_file_that_is_not_there_is_refused_before_a_run_is_made(stubbed_train, tmp_path, monkeypatch):
    """sage-train with a benchmark path that does not exist made an MLflow run and failed it (a FAILED run in the
    experiment for a typo); it is refused first, and the experiment holds no run."""
    import flows.train_flow as tf

    monkeypatch.setattr(tf, "resolve_benchmarks", common.resolve_benchmarks)  # the real one: files are read

    kw = dict(label="grpo", evaluate_before=True, evaluate_after=True, force=False, launcher="local",
              parent_run_id=None, variant=None, preset=None)
    with pytest.raises(FileNotFoundError, match=r"benchmark 'mine': .*nope.jsonl does not exist"):
        tf.run_training(RunSpec(method="grpo", max_steps=1, eval_k=2), experiment="typo",
                        benchmarks={"mine": str(tmp_path / "nope.jsonl")}, **kw)
    assert tracking.find_runs("typo") == []


def test_folder_for_reads_spec_json_as_sage_core_does(tmp_path, monkeypatch):
    """folder_for reads the folder's spec.json with sage_core.spec.recorded_spec, as sage train's folder check
    does: a spec.json recording only some fields (the rest at their defaults) is the spec it describes; one this
    RunSpec refuses is unreadable (sage train's own check decides)."""
    from sage_core import spec as spec_mod

    monkeypatch.setenv("SAGE_HOME", str(tmp_path))
    s = RunSpec()
    d = common.run_dir("e", "l", s)
    d.mkdir(parents=True)
    (d / "spec.json").write_text('{"model": "tiny"}')  # every other field at its default: this spec
    assert spec_mod.recorded_spec(d) == s and common.folder_for("e", "l", s) == d
    (d / "spec.json").write_text('{"max_steps": 7}')
    assert common.folder_for("e", "l", s) != d
    (d / "spec.json").write_text('{"max_steps": 0}')  # refused by RunSpec (ge=1)
    assert spec_mod.recorded_spec(d) is None and common.folder_for("e", "l", s) == d
    # a launch in vLLM server mode records the URL of the server it started: the same spec, resumed there
    (d / "spec.json").write_text(s.model_copy(update={"vllm_server_base_url": "http://127.0.0.1:8000"})
                                 .model_dump_json())
    assert common.folder_for("e", "l", s) == d
    seen = []
    monkeypatch.setattr(common, "recorded_spec", lambda out: seen.append(out) or s)
    assert common.folder_for("e", "l", s) == d and seen == [d]


# the same no-hint accuracy for any model: training changes nothing, so a fair before/after pair shows no change
_ACC = {"a": 0.2, "b": 0.6, "held": 0.2}


@pytest.fixture
def stubbed_train(tmp_path, monkeypatch):
    """run_training against a real MLflow store, with training and evaluation stubbed: `train["crash"]` kills the
    next attempt, `train["fail_if"](spec)` true fails the attempts of that spec; `train["evals"]` records each
    evaluation's (model kind, benchmarks, k)."""
    import logging

    import flows.train_flow as tf

    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    state: dict = {"crash": False, "evals": []}

    def fake_eval(model_ref, benches, spec, label, cache, gguf_file=None):
        state["evals"].append((label.rsplit("-", 1)[1], sorted(benches), spec.eval_k))
        k = spec.eval_k
        return [{"benchmark": b, "k": k, "avg_at_k": _ACC[b], "pass_at_k": 1 - (1 - _ACC[b]) ** k,
                 "n_prompts": len(benches[b])} for b in benches]

    class FakeTrain:
        def with_options(self, **kw):
            return self

        def __call__(self, spec, out, run_id, label, launcher, code):
            if state["crash"]:
                raise state["crash"] if isinstance(state["crash"], BaseException) else RuntimeError("killed")
            if state.get("fail_if") and state["fail_if"](spec):
                raise ValueError(f"teacher {spec.teacher} is not there")
            if state.get("slow"):  # long enough for another flow run of the spec to come
                time.sleep(state["slow"])
            state["trained"] = state.get("trained", 0) + 1
            upload_final(Path(out), run_id)
            return {"checkpoint_dir": str(Path(out) / "final")}

    def upload_final(out: Path, run_id: str) -> None:
        (out / "final").mkdir(parents=True, exist_ok=True)
        (out / "final" / "config.json").write_text("{}")
        tracking.log_checkpoint(out / "final", run_id)

    monkeypatch.setattr(tf, "get_run_logger", lambda: logging.getLogger("test-flow"))
    monkeypatch.setattr(tf, "run_eval", fake_eval)
    monkeypatch.setattr(tf, "train_task", FakeTrain())
    monkeypatch.setattr(tf, "resolve_benchmarks",  # a file's 4 rows; the held-out set's eval_num_prompts
                        lambda spec, b: {n: [{}] * (4 if b else spec.eval_num_prompts) for n in (b or {"held": ""})})
    monkeypatch.setattr(tf, "_link", lambda *a: None)
    monkeypatch.setattr(tf, "_report", lambda *a: None)

    def train(spec: RunSpec, benchmarks: dict[str, str] | None) -> dict:
        return tf.run_training(spec, experiment="t-pair", label="grpo", benchmarks=benchmarks, evaluate_before=True,
                               evaluate_after=True, force=False, launcher="local", parent_run_id=None, variant=None,
                               preset=None)

    state["train"], state["upload_final"] = train, upload_final
    return state


def _pairs(run_id: str) -> list[tuple[str, str, int]]:
    ev = tracking.load_eval(run_id)
    return sorted(zip(ev["when"], ev["benchmark"], ev["k"].astype(int), strict=True))


def _unchanged(row: dict) -> None:
    """The stub's models all score the same: a before/after pair over the same benchmarks at the same k is equal."""
    assert row["avg_at_k_before"] == pytest.approx(row["avg_at_k_after"])
    assert row["pass_at_k_before"] == pytest.approx(row["pass_at_k_after"])


def test_a_rerun_evaluates_before_on_the_benchmarks_its_killed_attempt_did_not(stubbed_train):
    """Benchmarks are not part of the spec: a re-run with more of them resumes the killed attempt's run, and scores
    the starting model on the new ones too (not 'after' on {a, b} against 'before' on {a} only)."""
    spec = RunSpec(method="grpo", max_steps=1, eval_k=2)
    stubbed_train["crash"] = True
    with pytest.raises(RuntimeError, match="killed"):
        stubbed_train["train"](spec, {"a": "a.jsonl"})
    stubbed_train["crash"] = False
    row = stubbed_train["train"](spec, {"a": "a.jsonl", "b": "b.jsonl"})
    assert stubbed_train["evals"] == [("before", ["a"], 2), ("before", ["b"], 2), ("after", ["a", "b"], 2)]
    assert _pairs(row["run_id"]) == [(w, b, 2) for w in ("after", "before") for b in ("a", "b")]
    assert row["avg_at_k_after"] == pytest.approx((_ACC["a"] + _ACC["b"]) / 2)
    _unchanged(row)


def test_a_finished_run_resumed_by_hand_at_another_eval_k_is_scored_before_at_that_k(stubbed_train):
    """`sage train --output-dir <the flow's folder> --mlflow --set eval_k=8` finishes the flow's run at k=8; the
    flow then evaluates the starting model at k=8 too, and its row pairs k=8 with k=8 (not the k=2 'before')."""
    spec = RunSpec(method="grpo", max_steps=1, eval_k=2)
    stubbed_train["crash"] = True
    with pytest.raises(RuntimeError, match="killed"):
        stubbed_train["train"](spec, None)
    out = common.run_dir("t-pair", "grpo", spec)
    at8 = spec.model_copy(update={"eval_k": 8})
    rid, resumed = tracking.resume_or_create_run(at8, "train", out, experiment="t-pair")  # what `sage train` does
    assert resumed
    stubbed_train["upload_final"](out, rid)
    tracking.finish_run(rid)
    stubbed_train["crash"] = False
    row = stubbed_train["train"](at8, None)
    assert row["run_id"] == rid and row["skipped"] and row["k"] == 8
    assert stubbed_train["evals"] == [("before", ["held"], 2), ("before", ["held"], 8), ("after", ["held"], 8)]
    assert _pairs(rid) == [("after", "held", 8), ("before", "held", 2), ("before", "held", 8)]
    assert row["pass_at_k_after"] == pytest.approx(1 - 0.8 ** 8)
    _unchanged(row)


def test_a_finished_run_asked_for_other_benchmarks_is_evaluated_on_them(stubbed_train):
    """A finished run called again with other benchmarks is not trained again but evaluated on them, before and
    after (not reported with the earlier benchmarks' numbers only)."""
    spec = RunSpec(method="grpo", max_steps=1, eval_k=2)
    first = stubbed_train["train"](spec, {"a": "a.jsonl"})
    again = stubbed_train["train"](spec, {"b": "b.jsonl"})
    assert again["skipped"] and again["run_id"] == first["run_id"]
    assert stubbed_train["evals"][2:] == [("before", ["b"], 2), ("after", ["b"], 2)]
    assert _pairs(first["run_id"]) == [(w, b, 2) for w in ("after", "before") for b in ("a", "b")]
    _unchanged(again)
    assert again["avg_at_k_after"] == pytest.approx(_ACC["b"])  # this call's benchmark, not a and b averaged
    assert stubbed_train["train"](spec, {"b": "b.jsonl"})["skipped"] and len(stubbed_train["evals"]) == 4


def test_a_benchmark_file_changed_under_its_name_is_scored_again(stubbed_train, tmp_path, monkeypatch):
    """The eval table named a benchmark by its name and number of rows only: a finished run called again with a
    benchmark file of the same name and size but other rows (written again, or another file under that name) took
    its 'before' and 'after' as scored. Its rows' hash (benchmark_hash) is in the table; a row logged before the table
    had it counts as another file's."""
    import json

    import flows.train_flow as tf

    monkeypatch.setattr(tf, "resolve_benchmarks", lambda spec, b: {  # a file's rows, as read
        n: [json.loads(line) for line in Path(p).read_text().splitlines()] for n, p in b.items()})
    bench = tmp_path / "a.jsonl"
    bench.write_text("".join(json.dumps({"prompt": f"{i} + 1 ?", "answer": str(i + 1)}) + "\n" for i in range(4)))
    spec = RunSpec(method="grpo", max_steps=1, eval_k=2)
    first = stubbed_train["train"](spec, {"a": str(bench)})
    assert stubbed_train["train"](spec, {"a": str(bench)})["skipped"] and len(stubbed_train["evals"]) == 2
    size = bench.stat().st_size
    bench.write_text("".join(json.dumps({"prompt": f"{i} + 2 ?", "answer": str(i + 2)}) + "\n" for i in range(4)))
    assert bench.stat().st_size == size  # the same name, size and number of rows: other problems
    again = stubbed_train["train"](spec, {"a": str(bench)})
    assert again["skipped"] and again["run_id"] == first["run_id"]
    assert stubbed_train["evals"][2:] == [("before", ["a"], 2), ("after", ["a"], 2)]
    ev = tracking.load_eval(first["run_id"])
    rows = tf.resolve_benchmarks(spec, {"a": str(bench)})
    assert len(ev) == 2 and set(ev["benchmark_hash"]) == {common.benchmark_hash(rows["a"])}
    assert stubbed_train["train"](spec, {"a": str(bench)})["skipped"] and len(stubbed_train["evals"]) == 4
    # a table logged before the hash was recorded: its rows are taken as another file's (scored again)
    assert tf.missing_evals(ev.drop(columns="benchmark_hash"), "before", rows, spec) == rows
    assert tf.missing_evals(ev, "before", rows, spec) == {}


def test_unhashed_after_rows_of_a_run_without_a_checkpoint_are_kept_saying_so_once(stubbed_train, caplog):
    """A finished run whose eval rows were logged before the table had a benchmark_hash, and which uploaded no
    checkpoint/ (its model cannot be scored again): its 'before' is scored again, its old 'after' rows are kept,
    and the warning that says so names the run on the first flow call only (it came again on every call)."""
    spec = RunSpec(method="grpo", max_steps=1, eval_k=2)
    rid, _ = tracking.resume_or_create_run(spec, "train", common.run_dir("t-pair", "grpo", spec), experiment="t-pair")
    old = pd.DataFrame([{"benchmark": "held", "k": 2, "avg_at_k": 0.9, "pass_at_k": 0.95, "n_prompts": 4}])
    for when in ("before", "after"):
        tracking.log_eval(old, when, rid)  # as an older version logged them: no benchmark_hash
    tracking.finish_run(rid)
    assert not tracking.has_artifact(rid, "checkpoint")
    for call in range(2):
        caplog.clear()
        with caplog.at_level("WARNING", logger="test-flow"):
            row = stubbed_train["train"](spec, None)
        assert row["run_id"] == rid and row["skipped"]
        said = [r.getMessage() for r in caplog.records if "checkpoint/" in r.getMessage()]
        assert (len(said), rid in "".join(said)) == ((1, True) if call == 0 else (0, False)), said
    assert stubbed_train["evals"] == [("before", ["held"], 2)]  # the old 'before' once; no 'after' to score
    ev = tracking.load_eval(rid).set_index("when")
    assert ev.loc["after", "avg_at_k"] == 0.9 and pd.isna(ev.loc["after", "benchmark_hash"])  # the old row, kept
    assert ev.loc["before", "avg_at_k"] == _ACC["held"] and not pd.isna(ev.loc["before", "benchmark_hash"])


def test_two_flow_runs_of_one_spec_at_once_train_it_once(stubbed_train, caplog):
    """serve --limit 2 (or two workers on one SAGE_HOME) runs two flow runs of one spec at once: the second waits for
    the first's run folder, then finds the spec finished (they trained into one folder and MLflow run together)."""
    spec = RunSpec(method="grpo", max_steps=1, eval_k=2)
    with caplog.at_level("WARNING", logger="test-flow"):
        rows = _two_at_once(stubbed_train, spec)
    assert stubbed_train["trained"] == 1 and sorted(r["skipped"] for r in rows) == [False, True]
    assert rows[0]["run_id"] == rows[1]["run_id"] and "is being trained by another flow run" in caplog.text


def _two_at_once(stubbed_train, spec: RunSpec) -> list[dict]:
    """Two flow runs of `spec`, the second started 0.3 s after the first, while the first trains (1.5 s)."""
    import threading

    stubbed_train["slow"] = 1.5
    rows: list[dict] = []
    threads = [threading.Thread(target=lambda: rows.append(stubbed_train["train"](spec, None))) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.3)
    for t in threads:
        t.join(60)
    return rows


def test_two_flow_runs_given_fresh_folders_wait_for_each_other_too(stubbed_train, monkeypatch):
    """The spec's folder holds a run resumed there by hand with another spec, so each flow run of the spec is given
    a fresh folder of its own (timestamp and pid): the lock is on the spec's folder, taken before that choice, so
    the second still waits and finds the spec finished (each locked its own fresh folder and both trained)."""
    import threading

    spec = RunSpec(method="grpo", max_steps=1, eval_k=2)
    d = common.run_dir("t-pair", "grpo", spec)
    d.mkdir(parents=True)
    (d / "spec.json").write_text(spec.model_copy(update={"max_steps": 5}).model_dump_json())
    monkeypatch.setattr(os, "getpid", lambda: 40000 + threading.get_ident() % 1000)  # two workers' processes
    rows = _two_at_once(stubbed_train, spec)
    assert stubbed_train["trained"] == 1 and sorted(r["skipped"] for r in rows) == [False, True]


def test_a_flow_run_cancelled_in_prefect_leaves_its_mlflow_run_killed(stubbed_train):
    """Prefect stops a cancelled flow run with TerminationSignal: the MLflow run is KILLED, as Ctrl-C leaves a
    `sage train --mlflow` run (FAILED is for errors), and the next flow run resumes it."""
    from prefect.exceptions import TerminationSignal

    spec = RunSpec(method="grpo", max_steps=1, eval_k=2)
    stubbed_train["crash"] = TerminationSignal(15)
    with pytest.raises(TerminationSignal):
        stubbed_train["train"](spec, None)
    run = tracking.find_runs("t-pair", kind="train")[0]
    assert run.info.status == "KILLED"
    stubbed_train["crash"] = RuntimeError("out of memory")
    with pytest.raises(RuntimeError):
        stubbed_train["train"](spec, None)
    assert tracking.client().get_run(run.info.run_id).info.status == "FAILED"
    stubbed_train["crash"] = False
    assert stubbed_train["train"](spec, None)["run_id"] == run.info.run_id


def test_an_after_eval_a_locked_store_refused_is_kept_and_the_flow_run_fails_saying_where(stubbed_train,
                                                                                          monkeypatch, caplog):
    """The 'after' evaluation (minutes of work, not cached) logged into a sqlite store another writer held past the
    retries: the flow run fails with the error saying where its rows are kept and how they are logged (the run's
    end, refused by the same lock, a warning: not the error it fails with), and that command logs them."""
    from helpers import store_held

    import flows.train_flow as tf

    monkeypatch.setenv(tracking.LOCK_RETRY_ENV, "0.3")
    spec = RunSpec(method="grpo", max_steps=1, eval_k=2)
    evaluate = tf.run_eval
    with contextlib.ExitStack() as held:
        def then_held(model_ref, benches, spec, label, cache, gguf_file=None):
            rows = evaluate(model_ref, benches, spec, label, cache, gguf_file)
            if label.endswith("-after"):  # evaluated: another writer takes the store as the rows are logged
                held.enter_context(store_held(Path(os.environ["SAGE_HOME"])))
            return rows

        monkeypatch.setattr(tf, "run_eval", then_held)
        with caplog.at_level("WARNING", logger="test-flow"), pytest.raises(
                tracking.TrackingError, match=r"stayed locked through 5 tries .*: its 'after' eval table is not "
                r"logged; its 1 rows are kept in (\S+); log them once the store is free: python -c \"(.+)\"$") as e:
            stubbed_train["train"](spec, None)
    run = tracking.find_runs("t-pair", kind="train")[0]
    rid = run.info.run_id
    [warned] = [r.getMessage() for r in caplog.records if r.name == "test-flow"]
    assert re.search(rf"^MLflow run {rid}: .* its end \(FAILED\) is not logged; the run is left as it was", warned)
    assert run.info.status == "RUNNING" and tracking.load_eval(rid)["when"].tolist() == ["before"]
    kept, command = re.search(r"kept in (\S+); .* -c \"(.+)\"$", str(e.value)).groups()
    assert pd.read_parquet(kept)[["benchmark", "when"]].values.tolist() == [["held", "after"]]
    exec(command, {})
    assert sorted(tracking.load_eval(rid)["when"]) == ["after", "before"]


def test_a_run_resumed_with_other_eval_settings_is_scored_before_at_them_too(stubbed_train):
    """eval_temperature, eval_top_p and eval_num_prompts are resumable like eval_k: a run hand-resumed with another
    one is evaluated before and after again at it (its old 'before' taken otherwise is no pair for the new 'after'),
    and a flow call with the settings it has evaluates nothing."""
    spec = first_spec = RunSpec(method="grpo", max_steps=1, eval_k=2, eval_num_prompts=8)
    first = stubbed_train["train"](spec, None)
    assert stubbed_train["evals"] == [("before", ["held"], 2), ("after", ["held"], 2)]
    assert stubbed_train["train"](spec, None)["skipped"] and len(stubbed_train["evals"]) == 2
    for change in ({"eval_temperature": 1.0}, {"eval_top_p": 0.5}, {"eval_num_prompts": 16}):
        spec = spec.model_copy(update=change)
        rid, resumed = tracking.resume_or_create_run(spec, "train", common.run_dir("t-pair", "grpo", first_spec),
                                                     experiment="t-pair")  # what `sage train` does, by hand
        assert resumed and rid == first["run_id"]
        tracking.finish_run(rid)
        n = len(stubbed_train["evals"])
        again = stubbed_train["train"](spec, None)
        assert again["run_id"] == first["run_id"] and again["skipped"]
        assert stubbed_train["evals"][n:] == [("before", ["held"], 2), ("after", ["held"], 2)], change
        ev = tracking.load_eval(first["run_id"])
        assert len(ev) == 2 and set(ev["temperature"]) == {spec.eval_temperature}
        assert set(ev["top_p"]) == {spec.eval_top_p} and set(ev["n_prompts"]) == {spec.eval_num_prompts}


def test_eval_means_pair_the_same_benchmarks_at_the_same_k():
    """A run's table may hold rows of other k, or 'after' rows of benchmarks with no 'before' (or the reverse):
    each side's mean is taken at k, over the benchmarks that have both."""
    ev = pd.DataFrame([("before", "a", 2, 0.1, 0.2), ("before", "a", 8, 0.3, 0.4), ("after", "a", 8, 0.5, 0.6),
                       ("after", "b", 8, 0.9, 1.0)], columns=["when", "benchmark", "k", "avg_at_k", "pass_at_k"])
    assert common.eval_means(ev, "before", 8) == pytest.approx((0.3, 0.4))
    assert common.eval_means(ev, "after", 8) == pytest.approx((0.5, 0.6))
    only_after = ev[ev["when"] == "after"]  # nothing to pair with: every benchmark counts
    assert common.eval_means(only_after, "after", 8) == pytest.approx((0.7, 0.8))
    assert all(math.isnan(v) for v in common.eval_means(only_after, "before", 8))
    assert common.eval_means(ev, "after", 8, ["b"]) == pytest.approx((0.9, 1.0))  # the benchmarks asked for
    assert common.eval_means(ev, "after", 8, ["c"]) == pytest.approx((0.5, 0.6))  # none of them: all it has


# ----------------------------------------------------------------------------------------------- flows (harness)
@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory, prefect_server):
    """This process runs flows against the session's real Prefect server (tests/conftest.py), with its own
    PREFECT_HOME and result storage; the workers that ship logs and events are drained before the server stops."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, PREFECT_LOCAL_STORAGE_PATH, temporary_settings
    from prefect.utilities.asyncutils import run_coro_as_sync

    home = tmp_path_factory.mktemp("prefect-home")
    with temporary_settings({PREFECT_HOME: str(home), PREFECT_LOCAL_STORAGE_PATH: str(home / "storage"),
                             PREFECT_API_URL: prefect_server["api"]}):
        yield home

        async def drain():
            with contextlib.suppress(RuntimeError):  # a worker that never started
                res = APILogWorker.instance().drain()
                if inspect.isawaitable(res):
                    await res
            res = EventsWorker.drain_all()
            if inspect.isawaitable(res):
                await res

        run_coro_as_sync(drain())


@pytest.fixture
def store(tmp_path, monkeypatch, tiny_model_dir):
    """A fresh MLflow store per test (the model cache stays shared)."""
    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path / "home"


class CrashOnce(common.PrefectProgressCallback):
    """Progress callback that raises once, at the end of step 2 (after checkpoint-1 was saved)."""

    crashes = 0
    error: type[Exception] = RuntimeError

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2 and CrashOnce.crashes == 0:
            CrashOnce.crashes += 1
            raise CrashOnce.error("simulated crash at step 2")


def _metric_steps(run_id: str, key: str) -> list[int]:
    return sorted({m.step for m in tracking.client().get_metric_history(run_id, key)})


def test_crashed_training_resumes_same_run(prefect_harness, store, monkeypatch):
    # 1) a transient crash: the task retries, resumes from checkpoint-1, one MLflow run
    monkeypatch.setattr(common, "PrefectProgressCallback", CrashOnce)
    monkeypatch.setattr(CrashOnce, "crashes", 0)
    monkeypatch.setattr(CrashOnce, "error", RuntimeError)
    retry_fast = common.train_task.with_options(retry_delay_seconds=0)
    monkeypatch.setattr("flows.train_flow.train_task", retry_fast)
    row = sage_train(preset="tiny-cpu", experiment="t-retry", evaluate_before=False, evaluate_after=False,
                     method="grpo", **SMALL)
    assert CrashOnce.crashes == 1 and row["status"] == "FINISHED"
    assert _metric_steps(row["run_id"], "reward") == [1, 2]  # step 1 before the crash, step 2 after the retry
    assert len(tracking.find_runs("t-retry", kind="train")) == 1
    out = tracking.client().get_run(row["run_id"]).data.tags["sage.output_dir"]
    assert (common.Path(out) / "checkpoint-1").is_dir() or (common.Path(out) / "checkpoint-2").is_dir()

    # 2) a non-transient crash fails the flow; re-running it continues the same MLflow run from the checkpoint
    monkeypatch.setattr(CrashOnce, "crashes", 0)
    monkeypatch.setattr(CrashOnce, "error", ValueError)
    kw = dict(preset="tiny-cpu", experiment="t-crash", evaluate_before=False, evaluate_after=False,
              method="grpo", **SMALL)
    state = sage_train(**kw, return_state=True)
    assert state.is_failed()
    (failed,) = tracking.find_runs("t-crash", kind="train")
    assert failed.info.status == "FAILED" and not tracking.is_complete(failed)
    row = sage_train(**kw)
    assert row["run_id"] == failed.info.run_id and row["status"] == "FINISHED"
    run = tracking.client().get_run(row["run_id"])
    assert run.data.tags["sage.resumed"] == "1" and _metric_steps(row["run_id"], "reward")[-1] == 2

    # 3) the finished spec asked again with its evaluation on: not trained again, but evaluated (it was skipped
    # with no evaluation at all), on the checkpoint the run uploaded
    assert tracking.load_eval(row["run_id"]) is None
    again = sage_train(**{**kw, "evaluate_after": True})
    assert again["skipped"] and again["run_id"] == row["run_id"] and _metric_steps(row["run_id"], "reward") == [1, 2]
    ev = tracking.load_eval(row["run_id"])
    assert list(ev["when"]) == ["after"] and again["avg_at_k_after"] == pytest.approx(ev["avg_at_k"].iloc[0])
    assert len(tracking.find_runs("t-crash", kind="train")) == 1


def test_hint_study_children_table_and_rerun(prefect_harness, store):
    """Two variants over two seeds: each variant trains once per seed on that seed's prompts (the teacher's hints
    are that seed's reference solutions), the table pairs them by seed, the summary is the arithmetic of the table,
    and a re-run with a seed already run trains nothing."""
    from prefect.client.orchestration import get_client

    methods = ["grpo", "sage-teacher"]
    kw = dict(preset="tiny-cpu", methods=methods, experiment="t-study", **{**SMALL, "max_steps": 1})
    started = datetime.now(UTC)  # the session's Prefect server holds other tests' task runs too
    table = hint_study(**kw, seeds=[0, 1])
    assert [(r["variant"], r["seed"]) for r in table] == [(m, s) for s in (0, 1) for m in methods]
    c = tracking.client()
    (parent,) = tracking.find_runs("t-study", kind="study")
    assert parent.data.tags["sage.seeds"] == "0,1"
    kids = {r.info.run_id: r for r in tracking.find_runs("t-study", kind="train", parent_run_id=parent.info.run_id)}
    assert len(kids) == 4 and all(tracking.is_complete(r) for r in kids.values())
    assert tracking.is_complete(c.get_run(parent.info.run_id))
    for r in table:  # the child run is the variant at that seed, named for both
        run = kids[r["run_id"]]
        assert (run.data.params["sage.seed"], run.data.params["sage.method"]) == (str(r["seed"]), r["method"])
        assert run.data.tags["sage.variant"] == r["variant"] and run.info.run_name == f"{r['variant']}-s{r['seed']}"
    teachers = {r["seed"]: kids[r["run_id"]].data.params["sage.teacher"] for r in table
                if r["variant"] == "sage-teacher"}
    assert all(t.endswith(".jsonl") and os.path.isfile(t) for t in teachers.values())
    assert teachers[0] != teachers[1]  # each seed's own prompts
    names = {a.path for a in c.list_artifacts(parent.info.run_id, "study")}
    assert names == {f"study/{t}.{x}" for t in ("comparison", "summary") for x in ("parquet", "csv", "md")}
    df = pd.read_parquet(c.download_artifacts(parent.info.run_id, "study/comparison.parquet", str(store)))
    assert list(df["variant"]) == methods * 2 and list(df.columns) == COMPARISON_COLUMNS
    assert df["avg_at_k_before"].notna().all() and df["avg_at_k_after"].notna().all()
    assert (df.loc[df["variant"] == "grpo", "train_vs_grpo"] == 1.0).all()
    assert (df["train_seconds"] > 0).all() and (df["train_seconds"] < df["wall_seconds"]).all()
    assert (df.loc[df["variant"] == "grpo", "gen_vs_grpo"] == 1.0).all() and (df["gen_tokens"] > 0).all()
    for seed, d in df.groupby("seed"):
        grpo_row, teacher_row = d.iloc[0], d.iloc[1]
        assert grpo_row["train_tokens"] > grpo_row["gen_tokens"]  # GRPO trains what it generated, plus the prompts
        # the learning signal: SAGE trains at least as many open groups as GRPO (same first rollout; it only
        # re-rolls all-zero groups)
        assert grpo_row["open_groups"] <= teacher_row["open_groups"]
        # the starting model is scored once per seed, on that seed's held-out prompts
        assert grpo_row["avg_at_k_before"] == teacher_row["avg_at_k_before"]
        assert teacher_row["train_vs_grpo"] == pytest.approx(teacher_row["train_seconds"] / grpo_row["train_seconds"])
    summary = pd.read_parquet(c.download_artifacts(parent.info.run_id, "study/summary.parquet", str(store)))
    assert list(summary["variant"]) == methods and list(summary["seeds"]) == [2, 2]
    after = {(r["variant"], r["seed"]): r["avg_at_k_after"] for r in table}
    diffs = [after[("sage-teacher", s)] - after[("grpo", s)] for s in (0, 1)]
    teacher = summary.set_index("variant").loc["sage-teacher"]
    assert teacher["vs_grpo"] == pytest.approx(sum(diffs) / 2) and teacher["vs_grpo_seeds"] == 2
    assert (teacher["vs_grpo_min"], teacher["vs_grpo_max"]) == pytest.approx((min(diffs), max(diffs)))
    hist = sorted((m.step, m.value) for m in c.get_metric_history(parent.info.run_id, "study/grpo/avg_at_k_after"))
    assert [h[0] for h in hist] == [0, 1] and [h[1] for h in hist] == pytest.approx([after[("grpo", 0)],
                                                                                  after[("grpo", 1)]])

    with get_client(sync_client=True) as pc:
        arts = pc.read_artifacts()
        task_runs = [t for t in pc.read_task_runs() if t.created >= started]
    assert {"t-study-comparison", "t-study-summary"} <= {a.key for a in arts if a.type == "table"}
    # the initial model is evaluated once per seed: the second variant's "before" eval comes from Prefect's cache
    before = sorted(t.state.name for t in task_runs if t.name.startswith("evaluate-") and t.name.endswith("-before"))
    assert before == ["Cached", "Cached", "Completed", "Completed"], before

    # re-run GRPO at seed 1: nothing trains again, same parent, and the tables still cover every variant and seed
    # the study holds (the first call's runs), in the same order
    table2 = hint_study(**{**kw, "methods": ["grpo"]}, seeds=[1])
    assert [r["run_id"] for r in table2] == [r["run_id"] for r in table]
    assert len(tracking.find_runs("t-study", kind="train")) == 4
    assert len(tracking.find_runs("t-study", kind="study")) == 1
    parent = c.get_run(parent.info.run_id)
    assert (parent.data.tags["sage.seeds"], parent.data.tags["sage.methods"]) == ("0,1", "grpo,sage-teacher")
    (store / "2").mkdir()
    summary2 = pd.read_parquet(c.download_artifacts(parent.info.run_id, "study/summary.parquet", str(store / "2")))
    pd.testing.assert_frame_equal(summary2, summary)

    # sage-eval on a finished child's checkpoint (runs:/...) over a benchmark file, into a new eval run
    import json

    from flows.eval_flow import sage_eval
    from sage_core.data import eval_rows

    bench = store / "mini.jsonl"
    rows = eval_rows(params.resolve_spec("tiny-cpu", None, {"eval_num_prompts": 3})).to_list()
    bench.write_text("".join(json.dumps({k: r[k] for k in ("problem", "answer", "prompt_id")}) + "\n"
                             for r in rows))
    out = sage_eval(model=f"runs:/{table[0]['run_id']}", benchmarks={"mini": str(bench)}, k=1,
                    experiment="t-sage-eval")
    assert [(r["benchmark"], r["k"], r["n_prompts"]) for r in out] == [("mini", 1, 3)]
    (ev_run,) = tracking.find_runs("t-sage-eval", kind="eval")
    assert ev_run.data.tags["sage.eval_of"] == table[0]["run_id"] and tracking.is_complete(ev_run)
    assert list(tracking.load_eval(ev_run.info.run_id)["when"]) == ["after"]


def test_gpu_presets_train_through_accelerate_launch(tmp_path, monkeypatch):
    """GPU presets (use_vllm) go through sage_core.launch.launch with the flow's MLflow run; what the ranks did not
    log live (history, tracker files, checkpoint) is logged afterwards. No GPU: a clear error."""
    from types import SimpleNamespace

    from prefect.logging import disable_run_logger

    import sage_core.launch as L
    from sage_core.presets import preset

    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    calls = {}

    def fake_launch(spec, out, *, log, env, check, mlflow_run_id):
        out = common.Path(out)
        calls.update(spec=spec, env=env, run_id=mlflow_run_id)
        (out / "tracker").mkdir(parents=True)
        pd.DataFrame({"step": [1], "prompt_id": ["p"]}).to_parquet(out / "tracker" / "step_000001.parquet")
        (out / "final").mkdir()
        (out / "final" / "config.json").write_text("{}")
        return SimpleNamespace(result={"log_history": [{"step": 1, "reward": 0.5}], "global_step": 1,
                                       "checkpoint_dir": str(out / "final"), "wall_seconds": 3.0,
                                       "summary": {"never_solved": 0.25}})

    monkeypatch.setattr(L, "launch", fake_launch)
    monkeypatch.setattr(L, "visible_gpus", lambda: [0])
    gpu = preset("qwen2.5-7b")
    assert common.wants_accelerate(gpu, "auto") and not common.wants_accelerate(preset("tiny-cpu"), "auto")
    rid = tracking.open_run(gpu, "train", experiment="t-gpu")
    with disable_run_logger():
        res = common._train_accelerate(gpu, tmp_path / "out", rid)
    assert calls["run_id"] == rid and calls["env"]["SAGE_MLFLOW_RUN_ID"] == rid and calls["spec"] == gpu
    assert res["global_step"] == 1 and res["summary"] == {"never_solved": 0.25}
    c = tracking.client()
    assert [(m.step, m.value) for m in c.get_metric_history(rid, "reward")] == [(1, 0.5)]
    assert [a.path for a in c.list_artifacts(rid, "tracker")] == ["tracker/step_000001.parquet"]
    assert [a.path for a in c.list_artifacts(rid, "checkpoint")] == ["checkpoint/config.json"]
    monkeypatch.setattr(L, "visible_gpus", lambda: [])
    with disable_run_logger(), pytest.raises(RuntimeError, match="no GPU"):
        common._train_accelerate(gpu, tmp_path / "out2", rid)


def test_variant_specs_match_the_rollout_budget():
    from flows.study_flow import variant_specs
    from sage_core.presets import preset

    base = preset("tiny-cpu", max_steps=3)
    v = variant_specs(base, ["grpo", "ada-seq", "sage-online"], match_budget=True)
    budget = 3 * base.prompts_per_step * base.num_generations  # what GRPO spends in 3 steps
    assert {s.rollout_budget for s in v.values()} == {budget}
    assert all(s.max_steps >= 3 for s in v.values())
    assert all(s.rollout_budget is None for s in variant_specs(base, ["grpo", "ada-seq"]).values())


def test_the_default_teacher_variant_on_data_without_solutions_fails_early_saying_why(tmp_path, monkeypatch):
    """sage-teacher without a `teacher` takes reference-solution hints: on data without a `solution` column they
    were all blank, read back as missing, and the variant failed after loading its model with 'its hints cover none
    of the training prompts'. Now the study stops before training (as for a teacher variant without a teacher),
    naming the cause, and writes no hints file; data with solutions still gets its file."""
    import warnings

    from flows.study_flow import teacher_hints_file

    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    nosol = tmp_path / "nosol.jsonl"
    nosol.write_text("".join(f'{{"question": "What is {i} + 1 ?", "answer": "{i + 1}"}}\n' for i in range(8)))
    base = RunSpec(data=str(nosol), num_prompts=8, prompts_per_step=4, max_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the loader's own warning about rows without a solution
        with pytest.raises(ValueError, match=r"variant 'sage-teacher': the data .*nosol\.jsonl has no reference "
                                             r"solutions \(no `solution` column.*give `teacher`"):
            teacher_hints_file(base, "nosol-study")
    assert not list((tmp_path / "home").rglob("teacher-hints-*"))
    path = teacher_hints_file(RunSpec(num_prompts=8, prompts_per_step=4, max_steps=1), "syn-study")
    assert path.is_file() and len(path.read_text().splitlines()) == 8 * 3


# ----------------------------------------------------------------------------------------------- study identity
def test_the_study_key_leaves_out_what_each_variant_sets(tmp_path):
    """variant_specs sets method, hint_source, teacher and teacher_model per variant: the study key does not hash
    them (a re-run with a corrected teacher is the same study), and the other variants' specs do not depend on
    them either."""
    base = params.resolve_spec("tiny-cpu", None, {"max_steps": 2})
    other = base.model_copy(update={"method": "sage", "hint_source": "teacher", "teacher": str(tmp_path / "t.jsonl"),
                                    "teacher_model": "m"})
    assert study_key(other, "e") == study_key(base, "e")
    assert study_key(base.model_copy(update={"max_steps": 3}), "e") != study_key(base, "e")
    hints = {t: variant_specs(base, ["grpo", "sage-teacher"], teacher=t) for t in ("a.jsonl", "b.jsonl")}
    assert hints["a.jsonl"]["grpo"] == hints["b.jsonl"]["grpo"]
    assert hints["a.jsonl"]["sage-teacher"].key() != hints["b.jsonl"]["sage-teacher"].key()
    with pytest.raises(ValueError, match=r"methods is empty.*'grpo'.*'sage-teacher'"):
        variant_specs(base, [])


def test_earlier_rows_average_over_the_study_benchmarks_only(tmp_path, monkeypatch):
    """A child of an earlier call also scored on another set (`sage-eval` with log_to_run=<child>): its row in a
    later call's table averages over the study's benchmarks, as that call's own rows do, not over every set."""
    from flows.study_flow import earlier_rows, study_base, study_benchmarks

    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    base = RunSpec(method="grpo", max_steps=1, eval_k=2)
    parent = tracking.open_run(study_base(base), "study", "e", run_name="study")
    rid = tracking.open_run(base, "train", "e", run_name="grpo", parent_run_id=parent, tags={"sage.variant": "grpo"})
    names = study_benchmarks(base, None)
    for bench, acc in ((names[0], 0.3), ("math500", 0.05)):
        table = pd.DataFrame([{"benchmark": bench, "k": 2, "avg_at_k": acc, "pass_at_k": acc, "n_prompts": 8}])
        tracking.log_eval(table.assign(avg_at_k=0.2), "before", rid)
        tracking.log_eval(table, "after", rid)
    tracking.finish_run(rid)
    (row,) = earlier_rows("e", parent, planned={("grpo", 1)}, benchmarks=names)
    assert row["avg_at_k_after"] == pytest.approx(0.3) and row["avg_at_k_before"] == pytest.approx(0.2)


def _comparison(parent_id: str, dst: Path) -> pd.DataFrame:
    dst.mkdir(parents=True, exist_ok=True)
    return pd.read_parquet(tracking.client().download_artifacts(parent_id, "study/comparison.parquet", str(dst)))


def test_a_study_rerun_with_another_teacher_is_the_same_study(prefect_harness, stubbed_train, tmp_path):
    """A study whose teacher failed, run again with a corrected one: the same study run, where GRPO is found
    finished (not trained again, still its child) and sage-teacher (another spec) trains as a new child, which the
    tables show (not the failed one). The failed variant's row links to its run and keeps its 'before' score."""
    bad, good = str(tmp_path / "bad.jsonl"), str(tmp_path / "good.jsonl")
    stubbed_train["fail_if"] = lambda spec: spec.teacher == bad
    kw = {"preset": "tiny-cpu", "methods": ["grpo", "sage-teacher"], "experiment": "t-teacher", "max_steps": 1,
          "eval_k": 2}
    with pytest.raises(RuntimeError, match=r"variants \['sage-teacher'\] failed"):
        hint_study(**kw, teacher=bad)
    (parent,) = tracking.find_runs("t-teacher", kind="study")
    kids = {r.data.tags["sage.variant"]: r for r in tracking.find_runs("t-teacher", kind="train",
                                                                       parent_run_id=parent.info.run_id)}
    assert kids["sage-teacher"].info.status == "FAILED" and tracking.is_complete(kids["grpo"])
    first = _comparison(parent.info.run_id, tmp_path / "1").set_index("variant")
    assert first.loc["sage-teacher", "status"] == "FAILED"
    assert first.loc["sage-teacher", "run_id"] == kids["sage-teacher"].info.run_id  # the table links to it
    assert first.loc["sage-teacher", "avg_at_k_before"] == pytest.approx(_ACC["held"])  # it evaluated before
    assert stubbed_train["trained"] == 1

    rows = hint_study(**kw, teacher=good)
    assert stubbed_train["trained"] == 2  # sage-teacher only: GRPO was found finished in the same study
    (again,) = tracking.find_runs("t-teacher", kind="study")
    assert again.info.run_id == parent.info.run_id
    after = tracking.find_runs("t-teacher", kind="train", parent_run_id=parent.info.run_id)
    assert len(after) == 3 and len(tracking.find_runs("t-teacher", kind="train")) == 3
    new = next(r for r in after if r.data.params.get("sage.teacher") == good)
    assert new.info.run_id != kids["sage-teacher"].info.run_id and tracking.is_complete(new)
    assert [(r["variant"], r["run_id"], r["status"]) for r in rows] == [
        ("grpo", kids["grpo"].info.run_id, "FINISHED"), ("sage-teacher", new.info.run_id, "FINISHED")]
    table = _comparison(parent.info.run_id, tmp_path / "2")
    assert list(table["run_id"]) == [kids["grpo"].info.run_id, new.info.run_id]


def test_a_study_refuses_what_it_cannot_run_before_making_any_run(prefect_harness, stubbed_train, tmp_path):
    """method/hint_source given to the study (each variant sets its own: they were ignored), no variant at all, or a
    benchmark file that is not there (it failed in each variant's run, made first): an error naming the cause
    before any MLflow run is made or anything trains."""
    kw = {"preset": "tiny-cpu", "methods": ["grpo"], "experiment": "t-refuse", "max_steps": 1, "eval_k": 2}
    per_variant = "hint-study sets method/hint_source per variant; use `methods`"
    for bad, match in (({"method": "sage"}, per_variant + r".*method='sage'"),
                       ({"spec": {"hint_source": "fixed"}}, per_variant + r".*hint_source='fixed'"),
                       ({"methods": []}, r"methods is empty: give one or more variants of \['grpo', 'sage-light'")):
        with pytest.raises(ValueError, match=match):
            hint_study(**{**kw, **bad})
    with pytest.raises(FileNotFoundError, match=r"benchmark 'a': .*nowhere\.jsonl does not exist"):
        hint_study(**kw, benchmarks={"a": str(tmp_path / "nowhere.jsonl")})
    assert tracking.find_runs("t-refuse") == [] and "trained" not in stubbed_train



def test_a_study_whose_store_is_locked_as_it_opens_waits_for_it(prefect_harness, stubbed_train, monkeypatch, caplog):
    """The study run's opening tags (its methods and seeds), written once it is opened, met a sqlite store another
    writer held with MLflow's traceback, failing the study before any variant trained. They are tried again: a lock
    gone meanwhile takes them and the study goes on."""
    from helpers import store_held

    monkeypatch.setenv(tracking.LOCK_RETRY_ENV, "3")
    opened = tracking.resume_or_create_run
    with contextlib.ExitStack() as held:
        def then_held(spec, kind, *a, **k):
            rid = opened(spec, kind, *a, **k)
            if kind == "study":  # opened: another writer takes the store as its tags are written
                held.enter_context(store_held(Path(os.environ["SAGE_HOME"]), release_after=1))
            return rid

        monkeypatch.setattr(tracking, "resume_or_create_run", then_held)
        with caplog.at_level("WARNING", logger="sage_core.tracking"):
            rows = hint_study(preset="tiny-cpu", methods=["grpo"], experiment="t-study-locked", max_steps=1, eval_k=2)
    assert [r["status"] for r in rows] == ["FINISHED"] and stubbed_train["trained"] == 1
    (parent,) = tracking.find_runs("t-study-locked", kind="study")
    assert parent.data.tags["sage.methods"] == "grpo" and parent.data.tags["sage.seeds"]
    assert any(f"MLflow run {parent.info.run_id}: " in m and "its methods and seeds is tried again" in m
               for m in caplog.messages), caplog.messages


def test_studies_of_other_benchmarks_keep_their_own_children(prefect_harness, stubbed_train, monkeypatch):
    """Two studies that differ only in their benchmark files are two study runs, but their children's run folders
    were keyed by label and spec alone: the second study reopened the first's child through the folder (its MLflow
    parent stayed the first study), took the first study's 'before' score of a benchmark of the same name (another
    file) as its own, and found nothing finished under its own run on a re-run, so it trained and evaluated again
    every time. Each study's children are its own: trained and scored once, each study's scores in its own runs."""
    import flows.study_flow as sf

    monkeypatch.setattr(sf, "resolve_benchmarks", lambda spec, b: None)  # the files are the stub's
    kw = {"preset": "tiny-cpu", "methods": ["grpo"], "experiment": "t-two", "max_steps": 1, "eval_k": 2}
    first = hint_study(**kw, benchmarks={"a": "one.jsonl"})
    second = hint_study(**kw, benchmarks={"a": "two.jsonl"})
    assert stubbed_train["evals"] == [("before", ["a"], 2), ("after", ["a"], 2)] * 2  # B's own 'before' too
    studies = {r.data.tags["sage.study_key"]: r.info.run_id for r in tracking.find_runs("t-two", kind="study")}
    assert len(studies) == 2 and first[0]["run_id"] != second[0]["run_id"]
    for row in (first, second):
        (child,) = tracking.find_runs("t-two", kind="train", parent_run_id=tracking.client().get_run(
            row[0]["run_id"]).data.tags["mlflow.parentRunId"])
        assert child.info.run_id == row[0]["run_id"] and tracking.is_complete(child)
        assert _pairs(child.info.run_id) == [("after", "a", 2), ("before", "a", 2)]
    trained, evals = stubbed_train["trained"], len(stubbed_train["evals"])
    assert hint_study(**kw, benchmarks={"a": "two.jsonl"})[0]["run_id"] == second[0]["run_id"]
    assert hint_study(**kw, benchmarks={"a": "one.jsonl"})[0]["run_id"] == first[0]["run_id"]
    assert stubbed_train["trained"] == trained and len(stubbed_train["evals"]) == evals  # found finished, each


def test_the_cached_before_eval_is_taken_again_when_what_decides_it_changed(prefect_harness, tmp_path, monkeypatch):
    """The 'before' evaluation is cached through Prefect (one per starting model, shared by a study's variants):
    its key is every input that decides the score. Another k, temperature or benchmark file is scored again, and so
    is a model folder written again under its path (it was served the old folder's score for 7 days)."""
    from prefect import flow

    import sage_core.evaluate as ev

    calls = []

    def fake_evaluate(model_ref, benches, k, temperature, **kw):
        calls.append((k, temperature, sorted(benches)))
        return pd.DataFrame([{"benchmark": b, "k": k, "avg_at_k": 0.5, "pass_at_k": 0.5, "n_prompts": 1}
                             for b in benches])

    monkeypatch.setattr(ev, "evaluate", fake_evaluate)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    spec = RunSpec(model=str(model), eval_k=2)

    @flow
    def before(spec: RunSpec, benches: dict) -> None:
        common.run_eval(spec.model, benches, spec, label="before", cache=True)

    before(spec, {"a": [{"x": 1}]})
    before(spec, {"a": [{"x": 1}]})
    assert len(calls) == 1  # the same: cached
    before(spec.model_copy(update={"eval_k": 4}), {"a": [{"x": 1}]})
    before(spec.model_copy(update={"eval_temperature": 1.0}), {"a": [{"x": 1}]})
    before(spec, {"a": [{"x": 2}]})
    assert len(calls) == 4
    (model / "model.safetensors").write_bytes(b"other weights")  # the folder written again
    before(spec, {"a": [{"x": 1}]})
    before(spec, {"a": [{"x": 1}]})
    assert calls[4:] == [(2, spec.eval_temperature, ["a"])]


def test_a_flow_trains_unheld_on_a_file_system_without_locks(tmp_path, monkeypatch):
    """common.run_folder_lock on a file system that does not lock files (flock: ENOLCK on NFS without lockd,
    EOPNOTSUPP on Lustre mounted without flock) lets the flow train, with a warning naming the folder: it raised the
    OSError, and the flow failed before training."""
    import errno
    import fcntl
    import logging

    def no_locks(*_):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    warned = []

    class Logger(logging.Logger):
        def warning(self, msg, *args, **kwargs):
            warned.append(msg % args)

    ran = []
    with common.run_folder_lock(tmp_path / "runs" / "sage-x", "sage-x", Logger("flow")):
        ran.append(True)
    assert ran == [True]
    assert warned == [f"sage-x: {tmp_path / 'runs' / 'sage-x'} is not held against a second flow run: its file system "
                      "does not lock files (Operation not supported)"]
