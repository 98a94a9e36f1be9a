"""`sage-train`: one training run (evaluate before, train, evaluate after, no hints at evaluation), one MLflow run.

    prefect deployment run sage-train/tiny-cpu --watch
    prefect deployment run sage-train/tiny-cpu --param max_steps=2 --param method=grpo --watch

A spec already trained to completion in the experiment (MLflow tag `sage.complete=true` on a run with the same
`sage.spec_key`) is not trained again unless `force=true`; a crashed one continues from its last checkpoint in
the same MLflow run.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

import numpy as np
import pandas as pd
from prefect import flow, get_run_logger
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from pydantic import ValidationError

from flows.common import (
    benchmark_hash,
    code_version,
    end_run,
    eval_table,
    folder_for,
    resolve_benchmarks,
    row_from_run,
    run_dir,
    run_eval,
    run_folder_lock,
    train_task,
)
from flows.params import PresetName, SpecPatch, resolve_spec, with_spec_overrides
from sage_core import tracking
from sage_core.spec import RunSpec

Launcher = Literal["auto", "local", "accelerate"]


def default_label(spec: RunSpec) -> str:
    return f"{spec.method}-{spec.hint_source}" if spec.uses_hints else spec.method


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    p = flow_run.parameters or {}
    name = p.get("run_name") or p.get("variant") or p.get("preset") or "custom"
    method = p.get("method")
    return f"train-{name}" + (f"-{method}" if method and method not in str(name) else "")


def _link(run_id: str, experiment_id: str, what: str) -> None:
    try:
        create_link_artifact(link=tracking.run_url(run_id, experiment_id), link_text=f"MLflow {what} run",
                             key="mlflow-run", description=f"MLflow run {run_id} ({tracking.shown_uri()})")
    except Exception as e:  # noqa: BLE001 - an artifact must never fail a run
        get_run_logger().debug("link artifact not created: %s", e)


def run_training(spec: RunSpec, *, experiment: str, label: str, benchmarks: dict[str, str] | None,
                 evaluate_before: bool, evaluate_after: bool, force: bool, launcher: str,
                 parent_run_id: str | None, variant: str | None, preset: str | None) -> dict[str, Any]:
    """The body of `sage-train` (also the per-variant body of `hint-study`). Returns the run's result row."""
    # the lock is on the spec's own folder (a forced run's: its fresh one), taken before folder_for looks at it:
    # two flow runs that would each be given a fresh folder (run_dir holds another spec) wait for each other too
    name = folder_label(label, benchmarks, parent_run_id)
    base = run_dir(experiment, name, spec, fresh=force)
    with run_folder_lock(base, label, get_run_logger()):  # a second flow run of this spec waits, then finds it done
        out = base if force else folder_for(experiment, name, spec)
        return _run_training_locked(spec, out, experiment=experiment, label=label, benchmarks=benchmarks,
                                    evaluate_before=evaluate_before, evaluate_after=evaluate_after, force=force,
                                    launcher=launcher, parent_run_id=parent_run_id, variant=variant, preset=preset)


def folder_label(label: str, benchmarks: dict[str, str] | None, parent_run_id: str | None) -> str:
    """The name a run's folder is made of (run_dir: with the spec's key after it): the label, and for a study's child
    with benchmark files a hash of them, as the study's key has. The folder's `mlflow_run_id` is the run a flow
    reopens, and two studies that differ only in their benchmarks (two study runs) gave their variants one folder:
    the second study reopened the first's child, still the first study's, scored it in the first study's eval table
    (a benchmark of the same name, another file, was taken as scored) and never found it finished under its own
    study run. Each study's children are its own (a study of other files trains its variants again); a sage-train
    without a parent shares its folder across benchmarks, evaluating a finished run on the ones it lacks."""
    if parent_run_id is None or not benchmarks:
        return label
    return f"{label}-b{hashlib.sha256(json.dumps(sorted(benchmarks.items())).encode()).hexdigest()[:8]}"


def _run_training_locked(spec, out, *, experiment, label, benchmarks, evaluate_before, evaluate_after, force,
                         launcher, parent_run_id, variant, preset):
    logger = get_run_logger()
    key = spec.key()
    if not force:
        done = tracking.find_finished_run(key, experiment, kind="train", parent_run_id=parent_run_id)
        if done is not None:
            logger.info("%s: spec %s already finished in MLflow run %s; skipping its training (force=true trains "
                        "again)", label, key, done.info.run_id)
            _link(done.info.run_id, done.info.experiment_id, "training")
            names = _complete_evals(spec, done.info.run_id, label, benchmarks, evaluate_before, evaluate_after)
            return {**row_from_run(done.info.run_id, names), "skipped": True}
    if not force and out != run_dir(experiment, label, spec):
        logger.warning("%s holds a run resumed there by hand with another spec (its spec.json); training spec %s in "
                       "a new folder, %s", run_dir(experiment, label, spec), key, out)
    benches = resolve_benchmarks(spec, benchmarks)  # a missing file or a bad name: refused before a run is made
    tags = {"sage.variant": variant or label, "sage.preset": preset, "sage.output_dir": str(out)}
    run_id, resumed = tracking.resume_or_create_run(spec, "train", out, experiment, run_name=label,
                                                    parent_run_id=parent_run_id, tags=tags)
    exp_id = tracking.client().get_run(run_id).info.experiment_id
    logger.info("%s MLflow run %s (%s): %s", "resuming" if resumed else "started", run_id, tracking.shown_uri(),
                tracking.run_url(run_id, exp_id))
    _link(run_id, exp_id, "training")
    try:
        todo = missing_evals(tracking.load_eval(run_id), "before", benches, spec)
        if evaluate_before and todo:  # an attempt before this one may have evaluated other benchmarks, or another k
            before = run_eval(spec.model, todo, spec, label=f"{label}-before", cache=True,
                              gguf_file=spec.gguf_file)
            tracking.log_eval(eval_table(before, spec, todo), "before", run_id)
        train = train_task
        if not (out / "final").is_dir():  # never reuse a cached result whose model is gone
            train = train_task.with_options(refresh_cache=True)
        res = train(spec, str(out), run_id, label, launcher, code_version())
        if evaluate_after:
            after = run_eval(res["checkpoint_dir"], benches, spec, label=f"{label}-after", cache=False)
            tracking.log_eval(eval_table(after, spec, benches), "after", run_id)
    except BaseException as e:
        end_run(run_id, e, logger)
        raise
    tracking.finish_run(run_id)
    row = row_from_run(run_id, list(benches))
    row["skipped"] = False
    _report(row, label)
    return row


def _complete_evals(spec: RunSpec, run_id: str, label: str, benchmarks: dict[str, str] | None,
                    evaluate_before: bool, evaluate_after: bool) -> list[str]:
    """The evaluations this call asks for that a finished run lacks (one trained by `sage train --mlflow`, or by
    a flow run with evaluate_after=false, or evaluated on other benchmarks or other eval settings), run now and logged
    into it: 'before' on the spec's model, 'after' on the checkpoint the run uploaded. Returns the benchmarks'
    names (this call's, for its result row)."""
    previous = tracking.load_eval(run_id)
    benches = resolve_benchmarks(spec, benchmarks)
    kept = _unhashed_after_kept(run_id)
    wanted = {when: todo for when, on in (("before", evaluate_before), ("after", evaluate_after))
              if on and (todo := missing_evals(previous, when, benches, spec, unhashed_final=when == "after" and kept))}
    if not wanted:
        return list(benches)
    from flows.eval_flow import resolve_model

    get_run_logger().info("%s: MLflow run %s has no %s evaluation at k=%d, T=%g, top_p=%g of %s: evaluating now",
                          label, run_id, " or ".join(wanted), spec.eval_k, spec.eval_temperature, spec.eval_top_p,
                          sorted({b for t in wanted.values() for b in t}))
    for when, todo in wanted.items():
        if when == "before":
            rows = run_eval(spec.model, todo, spec, label=f"{label}-before", cache=True, gguf_file=spec.gguf_file)
        elif not tracking.has_artifact(run_id, "checkpoint"):
            _no_checkpoint_to_score(previous, todo, spec, label, run_id)
            continue
        else:
            rows = run_eval(resolve_model(f"runs:/{run_id}")[0], todo, spec, label=f"{label}-after", cache=False)
        tracking.log_eval(eval_table(rows, spec, todo), when, run_id)
    return list(benches)


# a finished run's 'after' rows logged before eval tables had a benchmark_hash, kept as they are: the run uploaded
# no checkpoint/ to score them again (said once, when the tag is set; honoured while it still has none)
UNHASHED_AFTER_KEPT_TAG = "sage.unhashed_after_kept"


def _unhashed_after_kept(run_id: str) -> bool:
    tags = tracking.client().get_run(run_id).data.tags
    return tags.get(UNHASHED_AFTER_KEPT_TAG) == "true" and not tracking.has_artifact(run_id, "checkpoint")


def _no_checkpoint_to_score(previous, todo: dict[str, Any], spec: RunSpec, label: str, run_id: str) -> None:
    """Warns that a finished run without a checkpoint/ cannot be evaluated after training on `todo`. Its 'after'
    rows there without a benchmark_hash are kept as final, said once: the run is tagged so later calls take them
    as scored (they warned again on each call, as they could never be scored again)."""
    logger = get_run_logger()
    unhashed = sorted(set(todo) - set(missing_evals(previous, "after", todo, spec, unhashed_final=True)))
    if unhashed:
        logger.warning("%s: MLflow run %s's 'after' rows of %s were logged before eval tables recorded the benchmark's "
                       "rows (benchmark_hash), and the run uploaded no checkpoint/ to score them again: kept as "
                       "they are, unchecked against the files now; not said again for this run (force=true trains it "
                       "again)", label, run_id, unhashed)
        tracking.client().set_tag(run_id, UNHASHED_AFTER_KEPT_TAG, "true")
    if rest := sorted(set(todo) - set(unhashed)):
        logger.warning("%s: MLflow run %s uploaded no checkpoint/ to evaluate after training on %s; force=true trains "
                       "it again", label, run_id, rest)


def missing_evals(previous, when: str, benches: dict[str, Any], spec: RunSpec,
                  unhashed_final: bool = False) -> dict[str, Any]:
    """The benchmarks of `benches` the run's eval table has no `when` row of taken as `spec` evaluates: at its
    eval_k, eval_temperature and eval_top_p (where the table records them: rows logged before it did count as
    taken so), on the rows the benchmark has now (its `benchmark_hash`, common.eval_table: a file of the same name
    and number of rows, written again or another file, was taken as scored; a row logged before the table recorded
    it counts as another file's, scored again, unless `unhashed_final`: a run that cannot score it again)."""
    if previous is None or len(previous) == 0:
        return benches
    rows = previous[(previous["when"] == when) & (previous["k"] == spec.eval_k)]
    for col, value in (("temperature", spec.eval_temperature), ("top_p", spec.eval_top_p)):
        if col in rows.columns:
            rows = rows[rows[col].isna() | np.isclose(rows[col].astype(float), value)]
    hashes = rows["benchmark_hash"] if "benchmark_hash" in rows.columns else [None] * len(rows)
    have = {str(b): h for b, h in zip(rows["benchmark"], hashes, strict=True)}
    return {b: r for b, r in benches.items()
            if not (b in have and (have[b] == benchmark_hash(r) or (unhashed_final and pd.isna(have[b]))))}


def _report(row: dict[str, Any], label: str) -> None:
    keys = ("avg_at_k_before", "avg_at_k_after", "pass_at_k_after", "never_solved", "frac_collapsed", "rollouts",
            "wall_seconds")
    lines = [f"# sage-train `{label}`", "", f"MLflow run [{row['run_id']}]"
             f"({tracking.run_url(row['run_id'], row['experiment_id'])})", "",
             "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {row.get(k, float('nan')):.4g} |" for k in keys]
    try:
        create_markdown_artifact("\n".join(lines), key="sage-train-report", description=f"sage-train {label}")
    except Exception:  # noqa: BLE001
        pass


def sage_train(*, preset: PresetName | None = "tiny-cpu", spec: SpecPatch | None = None, experiment: str = "sage",
               run_name: str | None = None, benchmarks: dict[str, str] | None = None,
               evaluate_before: bool = True, evaluate_after: bool = True, force: bool = False,
               launcher: Launcher = "auto", parent_run_id: str | None = None, variant: str | None = None,
               **overrides: Any) -> dict[str, Any]:
    """Train one SAGE/GRPO run and evaluate it without hints before and after.

    Args:
        preset: named RunSpec preset (sage_core.presets); None starts from RunSpec defaults.
        spec: a (partial) RunSpec applied on top of the preset; only the fields it sets count.
        experiment: MLflow experiment.
        run_name: MLflow run name (default: the variant, else method-hint_source).
        benchmarks: no-hint eval files {name: path} (.parquet/.jsonl); default: the spec's held-out set.
        evaluate_before: evaluate the initial model.
        evaluate_after: evaluate the trained model.
        force: train again even if this spec already finished in the experiment.
        launcher: auto (accelerate for vLLM/GPU presets), local (in process) or accelerate.
        parent_run_id: MLflow parent run (hint-study).
        variant: variant name (hint-study).
    """
    logger = get_run_logger()
    try:
        run_spec = resolve_spec(preset, spec, overrides)
    except ValidationError as e:
        raise ValueError(f"invalid run spec: {e}") from None
    label = run_name or variant or default_label(run_spec)
    logger.info("sage-train %s: preset=%s method=%s hint_source=%s model=%s steps=%d G=%d",
                label, preset, run_spec.method, run_spec.hint_source, run_spec.model, run_spec.max_steps,
                run_spec.num_generations)
    return run_training(run_spec, experiment=experiment, label=label, benchmarks=benchmarks,
                        evaluate_before=evaluate_before, evaluate_after=evaluate_after, force=force,
                        launcher=launcher, parent_run_id=parent_run_id, variant=variant, preset=preset)


sage_train = flow(name="sage-train", flow_run_name=_flow_run_name)(with_spec_overrides(sage_train))

__all__ = ["sage_train", "run_training", "default_label"]
