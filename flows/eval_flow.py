"""`sage-eval`: no-hint evaluation (avg@k, pass@k) of a model or checkpoint over benchmark files.

    prefect deployment run sage-eval/default --param model=/path/to/checkpoint --watch
    prefect deployment run sage-eval/default --param model=runs:/<mlflow run id> \
        --params '{"benchmarks": {"math500": "/data/math500.jsonl"}}' --watch

`model` is anything `sage_core.evaluate.evaluate` loads ('tiny', a local folder, an HF id) or `runs:/<run_id>`
(the `checkpoint/` artifacts of an MLflow training run). Results go to a new MLflow run (kind eval) or, with
`log_to_run`, into an existing run's `eval/eval.parquet` as `when`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from pydantic import Field

from flows.common import end_run, eval_table, resolve_benchmarks, run_eval, slug
from flows.params import PresetName, resolve_spec
from sage_core import tracking
from sage_core.spec import HINTING_METHODS, RunSpec, recorded_beside, spec_from_fields


def resolve_model(model: str) -> tuple[str, str | None]:
    """(loadable model ref, MLflow run id it came from). `runs:/<id>` downloads that run's `checkpoint/` once per
    `sage.checkpoint_step` tag (a resumed run keeps its id and uploads a later step's model); an untagged run's
    download is reused as it is."""
    if not model.startswith("runs:/"):
        return model, None
    run_id = model.removeprefix("runs:/").strip("/").split("/")[0]
    step = tracking.client().get_run(run_id).data.tags.get("sage.checkpoint_step")
    dst = tracking.sage_home() / "downloads" / run_id
    if step is not None:
        dst = dst / f"step-{step}"
    ckpt = dst / "checkpoint"
    if not (ckpt / "config.json").is_file():
        dst.mkdir(parents=True, exist_ok=True)
        tracking.client().download_artifacts(run_id, "checkpoint", str(dst))
    return str(ckpt), run_id


def provenance(model: str, ref: str, source_run: str | None) -> dict[str, str]:
    """What made the model evaluated: `model` (the base model it was trained from, which decides the prompts'
    format: the tiny model is trained without a system turn, real ones with the paper's system prompt), `method`
    and `hint_source` (the eval run's tags: the dashboard labels the run by them), from its MLflow run
    (runs:/<id>) or the `spec.json` that `sage train` writes beside `final/` and `checkpoint-N/`; a model no run
    here trained (or whose spec.json is unreadable) is itself, method `base`, no hint source."""
    if source_run is not None:
        run = tracking.client().get_run(source_run)
        return {"model": run.data.params.get("sage.model") or model,
                "method": run.data.tags.get("sage.method") or "base",
                "hint_source": run.data.tags.get("sage.hint_source") or "none"}
    if (fields := recorded_beside(ref)) is None:
        return {"model": model, "method": "base", "hint_source": "none"}
    spec = spec_from_fields(fields or None)
    hinted = spec.uses_hints if spec is not None else fields.get("method") in HINTING_METHODS
    source = spec.hint_source if spec is not None else fields.get("hint_source") or "online"
    return {"model": fields.get("model") or model, "method": fields.get("method") or "base",
            "hint_source": source if hinted else "none"}


HELDOUT_FIELDS = ("data", "data_split", "seed", "num_prompts", "difficulty")  # what eval_rows' held-out set is of


def heldout_fields(ref: str, source_run: str | None) -> dict[str, Any]:
    """The fields that decide the held-out set (sage_core.data.eval_rows) of the run that trained the model: its
    MLflow run's (runs:/<id>) or the spec.json beside the checkpoint; {} for a model no run here trained. The
    preset's would be another task's (a run trained on a data file), or hold training rows (a file's rows after the
    preset's num_prompts, where the run trained on more)."""
    if source_run is not None:
        values = tracking.spec_values(tracking.client().get_run(source_run))
        return {f: values[f"sage.{f}"] for f in HELDOUT_FIELDS if f"sage.{f}" in values}
    fields = recorded_beside(ref) or {}
    return {f: fields[f] for f in HELDOUT_FIELDS if f in fields}


def base_model(model: str, ref: str, source_run: str | None) -> str:
    """The model a checkpoint was trained from (see provenance)."""
    return provenance(model, ref, source_run)["model"]


@flow(name="sage-eval", flow_run_name="eval-{model}")
def sage_eval(model: str = "tiny", benchmarks: dict[str, str] | None = None, preset: PresetName = "tiny-cpu",
              k: Annotated[int, Field(ge=1)] | None = None, temperature: Annotated[float, Field(ge=0)] | None = None,
              top_p: Annotated[float, Field(gt=0, le=1)] | None = None,
              max_new_tokens: Annotated[int, Field(ge=1)] | None = None, use_vllm: bool | None = None,
              experiment: str = "sage-eval", log_to_run: str | None = None,
              when: Literal["before", "after"] = "after") -> list[dict[str, Any]]:
    """Evaluate `model` without hints.

    Args:
        model: 'tiny', a checkpoint folder, an HF model id, or runs:/<MLflow run id>.
        benchmarks: {name: .parquet/.jsonl file}; default: the held-out set of the run that trained the model
            (its data, seed, num_prompts, difficulty), else the preset's.
        preset: RunSpec preset giving the default eval settings and held-out set.
        k: samples per prompt (default: the preset's eval_k).
        temperature: sampling temperature, 0 = greedy (default: the preset's eval_temperature).
        top_p: nucleus sampling (default: the preset's eval_top_p).
        max_new_tokens: generation budget (default: the preset's max_completion_length).
        use_vllm: generate with vLLM (default: the preset's use_vllm).
        experiment: MLflow experiment of the eval run.
        log_to_run: log into this existing MLflow run instead of a new one.
        when: 'before' or 'after' (the label in eval/eval.parquet).
    """
    logger = get_run_logger()
    if log_to_run:  # a run id that is not there fails now, not after the evaluation it was to take
        from mlflow.exceptions import MlflowException

        try:
            tracking.client().get_run(log_to_run)
        except MlflowException as e:
            raise ValueError(f"log_to_run: no MLflow run {log_to_run!r} in {tracking.shown_uri()}: {e}") from None
    ref, source_run = resolve_model(model)
    overrides = {"eval_k": k, "eval_temperature": temperature, "eval_top_p": top_p,
                 "max_completion_length": max_new_tokens, "use_vllm": use_vllm}
    spec = resolve_spec(preset, {"model": model}, overrides)
    made = provenance(model, ref, source_run)
    # rows formatted as in training: a checkpoint of the tiny model gets no system turn; the default held-out set is
    # that of the run that trained the model (its data and seed), not the preset's
    held = spec.model_copy(update={"model": made["model"]})
    if not benchmarks and (fields := heldout_fields(ref, source_run)):
        try:
            held = RunSpec.model_validate({**held.model_dump(), **fields})
        except ValueError as e:  # an older version's value: the preset's held-out set, said so
            logger.warning("the held-out set of the run that trained %s (%s) is not readable here (%s); evaluating "
                           "the preset's", model, fields, str(e).splitlines()[0])
    benches = resolve_benchmarks(held, benchmarks)
    logger.info("sage-eval %s on %s (k=%d, T=%.2f, top_p=%.2f)", model, sorted(benches), spec.eval_k,
                spec.eval_temperature, spec.eval_top_p)
    rows = run_eval(ref, benches, spec, label=slug(Path(model).name or model), cache=False)
    df = eval_table(rows, spec, benches)
    if log_to_run:
        run_id = log_to_run
        tracking.log_eval(df, when, run_id)
    else:
        run_id = tracking.open_run(spec, "eval", experiment, run_name=f"eval-{Path(model).name or model}",
                                   tags={"sage.eval_of": source_run, "sage.method": made["method"],
                                         "sage.hint_source": made["hint_source"]})
        try:
            tracking.log_eval(df, when, run_id)
        except BaseException as e:  # its end, tried again on a locked store, is not what the flow run fails with
            end_run(run_id, e, logger)
            raise
        tracking.finish_run(run_id)
    logger.info("eval logged to MLflow run %s", tracking.run_url(run_id))
    table = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows]
    create_table_artifact(table, key="sage-eval-results", description=f"no-hint eval of {model}")
    return rows
