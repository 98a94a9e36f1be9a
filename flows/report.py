"""Print the report card of the latest hint-study (for `make demo`): a table per variant plus the URLs.

    python -m flows.report [--experiment hint-study-tiny-cpu]

Reads MLflow only (`study/comparison.parquet` of the study run last active in the experiment).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import pandas as pd

from sage_core import tracking


def latest_study(experiment: str):
    """The study run last active (tracking.last_active: started, reopened or ended latest; an earlier study run again
    reopens its own MLflow run, which keeps its start time and, while RUNNING, its earlier attempt's end) that has a
    comparison table."""
    runs = sorted(tracking.find_runs(experiment, kind="study"), key=tracking.last_active, reverse=True)
    for run in runs:
        if tracking.has_artifact(run.info.run_id, "study/comparison.parquet"):
            return run
    return None


def load_comparison(run_id: str) -> pd.DataFrame:
    with tempfile.TemporaryDirectory() as tmp:
        p = tracking.client().download_artifacts(run_id, "study/comparison.parquet", tmp)
        return pd.read_parquet(p)


def dashboard_url() -> str:
    return f"http://127.0.0.1:{os.environ.get('DASHBOARD_PORT', '8501')}"


def main(argv: list[str] | None = None) -> int:
    from flows.study_flow import report_card

    ap = argparse.ArgumentParser(prog="python -m flows.report")
    ap.add_argument("--experiment", default="hint-study-tiny-cpu")
    args = ap.parse_args(argv)
    run = latest_study(args.experiment)
    if run is None:
        print(f"no finished hint-study with a comparison table in experiment {args.experiment!r} "
              f"({tracking.shown_uri()})", file=sys.stderr)
        return 1
    df = load_comparison(run.info.run_id)
    exp_id = run.info.experiment_id
    children = [r for r in df["run_id"].dropna().tolist() if r]
    print()
    print(report_card(df, f"SAGE report card: {args.experiment}"))
    print()
    print(f"MLflow study run : {tracking.run_url(run.info.run_id, exp_id)}")
    if children:
        print(f"MLflow comparison: {tracking.compare_url(children, exp_id)}")
    print(f"MLflow store     : {tracking.shown_uri()}")
    print(f"Dashboard        : make dashboard   ->  {dashboard_url()}")
    print(f"Prefect UI       : http://127.0.0.1:{os.environ.get('PREFECT_PORT', '4200')}   (make down stops the "
          "services)")
    if "seed" not in df.columns or df["seed"].nunique() < 2:
        print("No-hint accuracy: one seed of short runs; `make bench-learning` compares the methods over 3 seeds "
              "(about 15 min), a hint-study with --params '{\"seeds\": [0, 1, 2]}' does it in Prefect")
    return 0


if __name__ == "__main__":
    sys.exit(main())
