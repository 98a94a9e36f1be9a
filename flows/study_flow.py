"""`hint-study`: the SAGE variants side by side, each a child MLflow run of one study run, then a comparison.

    prefect deployment run hint-study/tiny-cpu --watch
    prefect deployment run hint-study/tiny-cpu --param max_steps=4 --params '{"methods": ["grpo", "sage-light"]}'
    prefect deployment run hint-study/tiny-cpu --params '{"seeds": [0, 1, 2]}'

Variants (`methods`): grpo, sage-light (online self-hints), sage-online, sage-fixed (hints from the initial
policy), sage-teacher (a teacher's hints: `teacher`, or for data with reference solutions a hints file written
from them), and the curation baselines dapo-filter, ada-seq, ada-est, sage-light+ada-seq.

Each variant runs as a `sage-train` subflow (evaluate before/after without hints, train); the shared "before"
evaluation is computed once and reused through Prefect's cache. Re-running the study skips the variants that
already finished (MLflow: same spec key, `sage.complete=true`, under the same study run) and resumes crashed ones.
`method` and `hint_source` are set per variant (`methods` picks them; given to the study they are refused), and
`teacher`/`teacher_model` reach the sage-teacher variant only: the study run's key leaves all four out, so a study
re-run with another teacher is the same study, where sage-teacher (its spec changed) trains as a new child run and
the other variants are found finished.
The comparison table (one row per variant and seed) is published as the Prefect table artifact
`<experiment>-comparison` and as `study/comparison.{parquet,csv,md}` on the study run.

`seeds` repeats the whole study per seed (the seed picks the synthetic training prompts, the held-out set and the
sampling): every variant of a seed trains and is evaluated on that seed's prompts, so differences between variants
are paired by seed. `study/summary.{parquet,csv,md}` (and the table artifact `<experiment>-summary`) gives per
variant the mean over seeds, the per-seed range of no-hint avg@k after training, and the paired change against GRPO
of the same seed (mean, min, max). The study run is the same for any list of seeds (the seed is left out of its
key, as are the fields set per variant; `match_budget` and `benchmarks` are in it): a later call trains only the
variants and seeds not finished before, and its tables cover every variant and seed the study holds (what earlier
calls finished too; the newest complete run of each), ordered by seed.

A study of other `benchmarks` is another study with children of its own: its variants train again in folders of
its own (train_flow.folder_label) and are scored in runs of their own, never in the other study's runs (children
of the other study run).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal

import pandas as pd
from prefect import flow, get_run_logger
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from pydantic import Field, ValidationError

from flows.common import end_run, experiment_dir, experiment_folder, resolve_benchmarks, row_from_run, slug
from flows.params import PresetName, SpecPatch, resolve_spec, with_spec_overrides
from flows.train_flow import Launcher, sage_train
from sage_core import tracking
from sage_core.data import heldout_name
from sage_core.spec import RunSpec

# variant name -> RunSpec fields it sets (on top of the study's base spec)
VARIANTS: dict[str, dict[str, Any]] = {
    "grpo": {"method": "grpo"},
    "sage-light": {"method": "sage-light", "hint_source": "online"},
    "sage-online": {"method": "sage", "hint_source": "online"},
    "sage-fixed": {"method": "sage", "hint_source": "fixed"},
    "sage-teacher": {"method": "sage", "hint_source": "teacher"},
    "dapo-filter": {"method": "dapo-filter"},
    "ada-seq": {"method": "ada-seq"},
    "ada-est": {"method": "ada-est"},
    "sage-light+ada-seq": {"method": "sage-light+ada-seq", "hint_source": "online"},
}
DEFAULT_METHODS = ["grpo", "sage-light", "sage-online", "sage-fixed", "sage-teacher"]
VariantName = Literal[tuple(VARIANTS)]  # type: ignore[valid-type]

COMPARISON_COLUMNS = ["variant", "method", "hint_source", "seed", "k", "avg_at_k_before", "avg_at_k_after",
                      "delta_avg_at_k", "pass_at_k_after", "never_solved", "never_solved_no_hint",
                      "frac_collapsed", "rollouts", "rescued", "wall_seconds", "train_seconds", "train_vs_grpo",
                      "gen_tokens", "gen_vs_grpo", "train_tokens", "open_groups", "open_vs_grpo", "global_step",
                      "status", "run_id"]
# per variant over seeds: means, the range of avg@k after, and the change against GRPO of the same seed
SUMMARY_MEANS = ["avg_at_k_after", "delta_avg_at_k", "pass_at_k_after", "never_solved", "never_solved_no_hint",
                 "frac_collapsed", "train_vs_grpo", "gen_vs_grpo", "open_vs_grpo"]
SUMMARY_COLUMNS = ["variant", "method", "hint_source", "k", "seeds", "failed", "avg_at_k_after", "avg_at_k_after_min",
                   "avg_at_k_after_max", "vs_grpo", "vs_grpo_min", "vs_grpo_max", "vs_grpo_seeds",
                   *SUMMARY_MEANS[1:]]


# the fields variant_specs sets per variant: not the study's (it holds every variant, and every teacher tried)
PER_VARIANT = {"method": "grpo", "hint_source": "online", "teacher": None, "teacher_model": None}


def study_base(base: RunSpec) -> RunSpec:
    """The spec common to a study's variants: the base with the fields each variant sets (PER_VARIANT) at fixed
    values. The study run records it, and its key hashes it."""
    return RunSpec(**{**base.model_dump(), **PER_VARIANT})


def study_key(base: RunSpec, experiment: str, match_budget: bool = False,
              benchmarks: dict[str, str] | None = None) -> str:
    """The study run's key: the experiment, the base spec without its seed (a study holds any seeds) nor the fields
    each variant sets (method, hint source, teacher: a study re-run with a corrected teacher is the same study, its
    finished variants found finished and the teacher variant trained again in it), and what else makes its rows
    comparable (budget matching, the benchmark files): a budget-matched study and one of equal steps are two
    studies, so neither's table takes in the other's variants."""
    text = f"{experiment}\n{with_seed(study_base(base), 0).key()}"
    if match_budget:
        text += "\nmatch_budget"
    if benchmarks:
        text += "\n" + json.dumps(sorted(benchmarks.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def study_seeds(seeds: list[int] | None, base: RunSpec, seed_given: bool = False) -> list[int]:
    """The seeds to run: `seeds` as given (none twice, at least one), or the base spec's own seed. A `seed` the
    caller gave as well (`seed_given`) must be one of `seeds`: a seed that would be ignored is an error."""
    if seeds is None:
        return [base.seed]
    seeds = [int(s) for s in seeds]
    if seed_given and base.seed not in seeds:
        raise ValueError(f"seed={base.seed} and seeds={seeds} both given: a study runs the seeds in `seeds`; "
                         "leave `seed` out or list it in `seeds`")
    if not seeds:
        raise ValueError("seeds is empty: give at least one seed, or leave `seeds` out to use the spec's seed")
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:
        raise ValueError(f"seeds lists {twice} more than once: {seeds}")
    negative = [s for s in seeds if s < 0]
    if negative:
        raise ValueError(f"seeds must be >= 0, got {negative}")
    return seeds


def with_seed(base: RunSpec, seed: int) -> RunSpec:
    return RunSpec(**{**base.model_dump(), "seed": seed})


def teacher_hints_file(base: RunSpec, experiment: str) -> Path:
    """Reference-solution hints for the training rows (sage_core.hints.write_reference_hints), written once. Raises
    ValueError, before any variant trains, for data without reference solutions: there are no hints to write (as
    variant_specs does for a teacher variant without a teacher)."""
    from sage_core.data import build_dataset
    from sage_core.hints import write_reference_hints

    rows = build_dataset(base)
    rows = rows.to_list() if hasattr(rows, "to_list") else list(rows)
    if rows and not any(str(r.get("solution") or "").strip() for r in rows):
        raise ValueError(f"variant 'sage-teacher': the data {base.data} has no reference solutions (no `solution` "
                         "column, or every row's is blank), so there are no reference hints to act as a teacher; "
                         "give `teacher` (a hints file, a model path or an endpoint URL), or leave sage-teacher out "
                         "of `methods`")
    data_spec = {k: v for k, v in base.model_dump().items()
                 if k in ("data", "data_split", "num_prompts", "difficulty", "seed", "model")}
    h = hashlib.sha256(repr(sorted(data_spec.items())).encode()).hexdigest()[:12]
    path = experiment_dir(experiment) / f"teacher-hints-{h}.jsonl"
    if not path.is_file():  # written whole (write_hints): another flow run sees it or not, never half of it
        write_reference_hints(rows, path)
    return path


def variant_specs(base: RunSpec, methods: list[str], teacher: str | None = None,
                  match_budget: bool = False) -> dict[str, RunSpec]:
    """One RunSpec per variant. Only the teacher variant carries `teacher`, so the other variants' spec keys
    do not depend on it. With `match_budget` every variant stops at the first step boundary where it has rolled
    out GRPO's rollout count for the base spec (max_steps x prompts_per_step x G) or more (a step's rollouts are
    known only once it ran: it spends up to one step of its own more) and may take up to max_rounds x more steps
    to spend it: methods that re-roll or resample then train on fewer steps. Raises ValueError naming an unknown
    variant, none, or a teacher variant without a teacher."""
    if not methods:
        raise ValueError(f"methods is empty: give one or more variants of {list(VARIANTS)}")
    unknown = [m for m in methods if m not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {list(VARIANTS)}")
    if len(set(methods)) != len(methods):
        raise ValueError(f"methods lists a variant twice: {methods}")
    out: dict[str, RunSpec] = {}
    for name in methods:
        values = {**base.model_dump(), "teacher": None, "teacher_model": None, **VARIANTS[name]}
        if VARIANTS[name].get("hint_source") == "teacher":
            if not teacher:
                raise ValueError("variant 'sage-teacher' needs a teacher (model path, endpoint URL or hints file)")
            values["teacher"] = teacher
            values["teacher_model"] = base.teacher_model
        if "hint_source" not in VARIANTS[name]:
            values["hint_source"] = "online"  # no hints used: keep the key independent of the base's source
        if match_budget:
            values["rollout_budget"] = base.max_steps * base.prompts_per_step * base.num_generations
            values["max_steps"] = base.max_steps * max(base.max_rounds, 4)
        out[name] = RunSpec(**values)
    return out


def refuse_per_variant_fields(spec: SpecPatch | None, overrides: dict[str, Any]) -> None:  # type: ignore[valid-type]
    """Raise ValueError, before anything runs, for `method` or `hint_source` given to the study (a field parameter,
    or in `spec`): every variant sets its own (VARIANTS), so the value would be ignored."""
    given = {f: overrides[f] for f in ("method", "hint_source") if overrides.get(f) is not None}
    if spec is not None:
        given |= {f: getattr(spec, f) for f in ("method", "hint_source")
                  if f in spec.model_fields_set and getattr(spec, f) is not None and f not in given}
    if given:
        shown = ", ".join(f"{f}={v!r}" for f, v in given.items())
        raise ValueError(f"hint-study sets method/hint_source per variant; use `methods` (choose from "
                         f"{list(VARIANTS)}) instead of {shown}")


def failed_row(experiment: str, parent_id: str, name: str, seed: int, vspec: RunSpec,
               benchmarks: dict[str, str] | None) -> dict[str, Any]:
    """The result row of a variant whose subflow failed: its child run's (the newest run of its spec in the study),
    so that the table links to the run and keeps what it did before failing (the evaluation before training); a
    row of its names alone where it failed before it had a run."""
    runs = tracking.find_runs(experiment, spec_key=vspec.key(), kind="train", parent_run_id=parent_id)
    if runs:
        return {**row_from_run(runs[0].info.run_id, study_benchmarks(vspec, benchmarks)), "variant": name,
                "status": "FAILED"}
    return {"variant": name, "method": vspec.method, "seed": seed,
            "hint_source": vspec.hint_source if vspec.uses_hints else "none", "status": "FAILED"}


def study_benchmarks(spec: RunSpec, benchmarks: dict[str, str] | None) -> list[str]:
    """The names of the benchmarks a study's rows average over: its benchmark files, else the held-out set (a
    child's eval table may hold others too: a `sage-eval` logged into it with log_to_run)."""
    return list(benchmarks) if benchmarks else [heldout_name(spec)]


def earlier_rows(experiment: str, parent_id: str, planned: set[tuple[str, int]],
                 benchmarks: list[str] | None = None) -> list[dict[str, Any]]:
    """Result rows of the study run's complete children that this call did not plan: variants and seeds an earlier
    call finished (the newest run of each variant and seed), so that the study's tables cover all it holds; their
    evals averaged over `benchmarks` (names), as this call's rows are."""
    newest: list[str] = []
    seen = set(planned)
    for run in tracking.find_runs(experiment, kind="train", parent_run_id=parent_id, complete=True):  # newest first
        seed = run.data.params.get("sage.seed", "")
        key = (run.data.tags.get("sage.variant"), int(seed) if seed.isdigit() else None)
        if key not in seen:
            seen.add(key)
            newest.append(run.info.run_id)
    return [{**row_from_run(rid, benchmarks), "skipped": True} for rid in reversed(newest)]  # in the order they trained


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def comparison_table(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per variant and seed, in the order given: accuracy before/after, never-solved, collapsed fraction,
    rollouts, wall-clock (loading, training, saving) and the training loop's time as a ratio to GRPO's of the same
    seed (the loop alone, so that the one-time costs of whichever variant runs first do not skew the ratios), and the
    completion tokens generated as a ratio to GRPO's (the work behind the time, the same on any machine), and the
    groups trained with mixed rewards (an open gate: the learning signal) as a ratio to GRPO's."""
    df = pd.DataFrame(rows)
    for c in COMPARISON_COLUMNS:
        if c not in df.columns:
            df[c] = float("nan") if c not in ("variant", "method", "hint_source", "status", "run_id") else None
    for c in ("seed", "avg_at_k_before", "avg_at_k_after", "pass_at_k_after", "never_solved", "never_solved_no_hint",
              "frac_collapsed", "rollouts", "rescued", "wall_seconds", "train_seconds", "gen_tokens", "train_tokens",
              "open_groups", "global_step"):
        df[c] = df[c].map(_num)
    if df["seed"].notna().all():
        df["seed"] = df["seed"].astype(int)
    df["delta_avg_at_k"] = df["avg_at_k_after"] - df["avg_at_k_before"]
    for col, ratio in (("train_seconds", "train_vs_grpo"), ("gen_tokens", "gen_vs_grpo"),
                       ("open_groups", "open_vs_grpo")):
        base = _grpo_same_seed(df, col)
        df[ratio] = df[col] / base.where(base > 0)
    return df[COMPARISON_COLUMNS].reset_index(drop=True)


def _grpo_same_seed(df: pd.DataFrame, col: str) -> pd.Series:
    """Each row's reference: `col` of the GRPO row of its seed (NaN where that seed has no GRPO value)."""
    seed = df["seed"].fillna(-1)
    grpo = df["method"] == "grpo"
    return seed.map(df.loc[grpo, col].groupby(seed[grpo]).first())  # first() skips NaN (a failed GRPO run)


def seed_summary(table: pd.DataFrame) -> pd.DataFrame:
    """One row per variant (in the table's order) over its seeds: how many finished (`seeds`, with a no-hint score
    after training) and failed, the mean of SUMMARY_MEANS, the min..max of avg@k after training, and `vs_grpo`: the
    paired change of avg@k after against GRPO of the same seed (mean, min, max over the `vs_grpo_seeds` seeds both
    finished; NaN for GRPO itself and where no seed pairs)."""
    grpo_after = _grpo_same_seed(table, "avg_at_k_after")
    out = []
    for variant in table["variant"].drop_duplicates():
        d = table[table["variant"] == variant]
        done = d[d["avg_at_k_after"].notna()]
        row: dict[str, Any] = {"variant": variant, "method": d["method"].iloc[0],
                               "hint_source": d["hint_source"].iloc[0], "k": d["k"].dropna().max(),
                               "seeds": len(done), "failed": int((d["status"] == "FAILED").sum())}
        ok = d[d["status"] != "FAILED"]  # a failed run's row keeps what it recorded; its numbers are no result
        row.update({c: ok[c].mean() for c in SUMMARY_MEANS})
        row["avg_at_k_after_min"], row["avg_at_k_after_max"] = done["avg_at_k_after"].min(), done[
            "avg_at_k_after"].max()
        diffs = ((done["avg_at_k_after"] - grpo_after[done.index]).dropna() if row["method"] != "grpo"
                 else pd.Series(dtype=float))
        row.update(vs_grpo=diffs.mean(), vs_grpo_min=diffs.min(), vs_grpo_max=diffs.max(), vs_grpo_seeds=len(diffs))
        out.append(row)
    return pd.DataFrame(out, columns=SUMMARY_COLUMNS)


def _jsonable_records(df: pd.DataFrame) -> list[dict[str, Any]]:
    recs = df.to_dict(orient="records")
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in recs]


def report_card(df: pd.DataFrame, title: str = "hint-study") -> str:
    """A compact markdown report card (nanochat style): one row per variant (and seed, where the study has several),
    the numbers that matter; with several seeds the summary over seeds comes first."""
    seeds = df["seed"].dropna().unique() if "seed" in df.columns else []
    k = df["k"].dropna()
    at_k = f"k={int(k.iloc[0])}" if len(k) else ""
    if len(seeds) > 1:
        return (summary_card(seed_summary(df), f"{title} (no-hint eval{', ' + at_k if at_k else ''}, "
                                               f"{len(seeds)} seeds)")
                + "\n\n" + _per_run_card(df, "per seed", per_seed=True))
    return _per_run_card(df, title + (f" (no-hint eval, {at_k})" if at_k else ""), per_seed=False)


def _fmt_range(mean: float, lo: float, hi: float, signed: bool) -> str:
    if isinstance(mean, float) and math.isnan(mean):
        return ""
    f = "{:+.3f}" if signed else "{:.3f}"
    return f"{f.format(mean)} ({f.format(lo)}..{f.format(hi)})"


def summary_card(summary: pd.DataFrame, title: str) -> str:
    """The summary over seeds as markdown: mean (min..max) of avg@k after and of the paired change vs GRPO."""
    show = pd.DataFrame({
        "variant": summary["variant"], "seeds": summary["seeds"],
        "avg@k after": [_fmt_range(m, lo, hi, False) for m, lo, hi in
                        zip(summary["avg_at_k_after"], summary["avg_at_k_after_min"], summary["avg_at_k_after_max"])],
        "vs GRPO": [_fmt_range(m, lo, hi, True) + (f" {n:.0f} seed{'s' * (n != 1)}" if n == n and n else "")
                    for m, lo, hi, n in zip(summary["vs_grpo"], summary["vs_grpo_min"], summary["vs_grpo_max"],
                                            summary["vs_grpo_seeds"])],
        "pass@k after": summary["pass_at_k_after"], "never solved": summary["never_solved"],
        "collapsed": summary["frac_collapsed"], "train/GRPO": summary["train_vs_grpo"],
        "gen tok/GRPO": summary["gen_vs_grpo"], "open/GRPO": summary["open_vs_grpo"],
        "failed": summary["failed"]})
    return (f"## {title}\n\nmean over each variant's finished seeds (min..max); vs GRPO: the change against GRPO of "
            "the same seed, over the seeds both finished (their count after it): where the seeds differ, compare "
            "that column, not the means\n\n" + tracking.to_markdown(show))


def _per_run_card(df: pd.DataFrame, title: str, per_seed: bool) -> str:
    show = df[["variant", *(["seed"] if per_seed else []), "avg_at_k_before", "avg_at_k_after", "pass_at_k_after",
               "never_solved", "frac_collapsed", "rollouts", "wall_seconds", "train_seconds", "train_vs_grpo",
               "gen_vs_grpo", "open_vs_grpo", "status"]].rename(
                   columns={"avg_at_k_before": "avg@k before", "avg_at_k_after": "avg@k after",
                            "pass_at_k_after": "pass@k after", "never_solved": "never solved",
                            "frac_collapsed": "collapsed", "wall_seconds": "wall s", "train_seconds": "train s",
                            "train_vs_grpo": "train/GRPO", "gen_vs_grpo": "gen tok/GRPO",
                            "open_vs_grpo": "open/GRPO"})
    if per_seed:
        show["seed"] = show["seed"].astype(str)
    return f"## {title}\n\n" + tracking.to_markdown(show)


def _log_parent_metrics(df: pd.DataFrame, summary: pd.DataFrame, parent_id: str) -> None:
    """`study/<variant>/<col>` at step = seed (a variant's history runs over its seeds) and, with several seeds,
    `study/<variant>/mean/<col>` (step 0) from the summary."""
    by_seed: dict[int, dict[str, float]] = {}
    for r in df.itertuples(index=False):
        step = int(r.seed) if isinstance(r.seed, (int, float)) and not math.isnan(r.seed) else 0
        for col in ("avg_at_k_after", "pass_at_k_after", "never_solved", "frac_collapsed", "wall_seconds",
                    "train_seconds"):
            v = getattr(r, col)
            if isinstance(v, float) and not math.isnan(v):
                by_seed.setdefault(step, {})[f"study/{r.variant}/{col}"] = v
    if df["seed"].nunique() > 1:
        for r in summary.itertuples(index=False):
            for col in ("avg_at_k_after", "vs_grpo", "pass_at_k_after", "never_solved"):
                v = getattr(r, col)
                if isinstance(v, float) and not math.isnan(v):
                    by_seed.setdefault(0, {})[f"study/{r.variant}/mean/{col}"] = v
    for step, metrics in sorted(by_seed.items()):
        tracking.log_metrics(metrics, step=step, run_id=parent_id)


def hint_study(*, preset: PresetName | None = "tiny-cpu", spec: SpecPatch | None = None,
               methods: list[VariantName] = DEFAULT_METHODS, experiment: str | None = None,  # type: ignore[valid-type]
               seeds: list[Annotated[int, Field(ge=0)]] | None = None,
               benchmarks: dict[str, str] | None = None, force: bool = False, match_budget: bool = False,
               launcher: Launcher = "auto", **overrides: Any) -> list[dict[str, Any]]:
    """Run the hint variants side by side and compare them without hints at test time.

    Args:
        preset: RunSpec preset every variant starts from.
        spec: a (partial) RunSpec on top of the preset.
        methods: variants to run, in order.
        experiment: MLflow experiment (default hint-study-<preset>).
        seeds: run every variant once per seed (paired by seed; summary over seeds); default: the spec's seed.
        benchmarks: no-hint eval files {name: path}; default: the held-out set of the spec.
        force: re-train variants that already finished.
        match_budget: every variant stops once it has rolled out GRPO's total rollout count (about equal
            sampling cost: at the end of the step that reaches it, so up to one step more) instead of training
            the same number of steps; the card's `rollouts` column says what each spent.
        launcher: auto, local or accelerate (see sage-train).
    """
    logger = get_run_logger()
    refuse_per_variant_fields(spec, overrides)
    try:
        base = resolve_spec(preset, spec, overrides)
    except ValidationError as e:
        raise ValueError(f"invalid run spec: {e}") from None
    experiment = experiment or f"hint-study-{preset or 'custom'}"
    methods = list(methods)
    seed_given = overrides.get("seed") is not None or (spec is not None and "seed" in spec.model_fields_set)
    seed_list = study_seeds(seeds, base, seed_given)
    if benchmarks:  # a path that is not there fails now, not in each variant's run after it was made
        resolve_benchmarks(base, benchmarks)
    plan: list[tuple[str, int, RunSpec]] = []  # (variant, seed, spec), seed by seed
    for seed in seed_list:
        seed_base = with_seed(base, seed)
        teacher = base.teacher  # the `teacher` field: for sage-teacher only; default: reference-solution hints
        if "sage-teacher" in methods and not teacher:
            teacher = str(teacher_hints_file(seed_base, experiment))
            logger.info("sage-teacher, seed %d: reference-solution hints %s", seed, teacher)
        plan += [(name, seed, vspec) for name, vspec in
                 variant_specs(seed_base, methods, teacher, match_budget).items()]

    skey = study_key(base, experiment, match_budget, benchmarks)
    out = experiment_folder(experiment, f"study-{skey}")
    parent_id, resumed = tracking.resume_or_create_run(
        study_base(base), "study", out, experiment, run_name=f"hint-study-{preset or 'custom'}",
        tags={"sage.study_key": skey, "sage.methods": ",".join(methods), "sage.preset": preset})

    def opening() -> None:
        tracking.client().set_tag(parent_id, "sage.methods", ",".join(methods))
        tracking.client().set_tag(parent_id, "sage.seeds", ",".join(map(str, seed_list)))

    tracking.retry_locked(opening, parent_id, "its methods and seeds", lambda: "nothing is trained yet: run the same "
                          "study again once the store is free")
    exp_id = tracking.client().get_run(parent_id).info.experiment_id
    logger.info("%s study run %s: %s", "resuming" if resumed else "started", parent_id,
                tracking.run_url(parent_id, exp_id))

    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    try:
        for name, seed, vspec in plan:
            run_name = name if seeds is None else f"{name}-s{seed}"
            logger.info("variant %s: method=%s hint_source=%s seed=%d", name, vspec.method, vspec.hint_source, seed)
            state = sage_train(preset=None, spec=vspec, experiment=experiment, run_name=run_name, variant=name,
                               parent_run_id=parent_id, benchmarks=benchmarks, force=force, launcher=launcher,
                               return_state=True)
            if state.is_completed():
                row = state.result()
                rows.append(row)
                logger.info("variant %s %s: avg@k %.3f -> %.3f", run_name,
                            "skipped (finished before)" if row.get("skipped") else "done",
                            row.get("avg_at_k_before", float("nan")), row.get("avg_at_k_after", float("nan")))
            else:
                failed.append(run_name)
                logger.error("variant %s failed: %s", run_name, state.message)
                rows.append(failed_row(experiment, parent_id, name, seed, vspec, benchmarks))
        rows += earlier_rows(experiment, parent_id, {(name, seed) for name, seed, _ in plan},
                             study_benchmarks(base, benchmarks))
        # by seed; within a seed, this call's variants in their order, then the earlier ones
        rows.sort(key=lambda r: -1 if r.get("seed") is None else r["seed"])
        table = comparison_table(rows)
        summary = seed_summary(table)
        covered = sorted({int(x) for x in table["seed"].dropna()})

        def log() -> None:
            tracking.client().set_tag(parent_id, "sage.seeds", ",".join(map(str, covered)))
            tracking.client().set_tag(parent_id, "sage.methods", ",".join(table["variant"].drop_duplicates()))
            tracking.log_table(table, "study/comparison", run_id=parent_id)
            tracking.log_table(summary, "study/summary", run_id=parent_id)
            _log_parent_metrics(table, summary, parent_id)

        tracking.retry_locked(log, parent_id, "the study's comparison", lambda: "its variants' runs have it, and the "
                              "same study run again (it trains no finished variant again) logs it")
        card = report_card(table, f"hint-study {preset or 'custom'}")
        child_ids = [r for r in table["run_id"].dropna().tolist() if r]
        compare = tracking.compare_url(child_ids, exp_id) if child_ids else tracking.run_url(parent_id, exp_id)
        create_table_artifact(_jsonable_records(table), key=f"{slug(experiment)}-comparison",
                              description=f"hint-study comparison ({experiment}); MLflow: {compare}")
        create_table_artifact(_jsonable_records(summary), key=f"{slug(experiment)}-summary",
                              description=f"hint-study summary over seeds {covered} ({experiment})")
        create_markdown_artifact(card + f"\n\n[Compare in MLflow]({compare})", key=f"{slug(experiment)}-report",
                                 description="hint-study report card")
        create_link_artifact(link=compare, link_text="MLflow comparison", key="mlflow-comparison")
        logger.info("comparison:\n%s", card)
        logger.info("MLflow comparison: %s", compare)
    except BaseException as e:
        end_run(parent_id, e, logger)
        raise
    tracking.finish_run(parent_id, "FAILED" if failed else "FINISHED")
    if failed:
        raise RuntimeError(f"hint-study: variants {failed} failed (the others are in the comparison table)")
    return _jsonable_records(table)


hint_study = flow(name="hint-study", flow_run_name="study-{preset}")(
    with_spec_overrides(hint_study))
