"""Runs: the experiment's runs (method, hint source, model, status) and a link to MLflow's compare page."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboards import data as D

ctx = D.context()
st.title("Runs")
st.caption(f"Experiment `{ctx.experiment_name}` (id {ctx.experiment_id}) · store `{D.shown_uri(ctx.uri)}`")

runs = ctx.runs
c1, c2, c3, c4 = st.columns(4)
c1.metric("Runs", len(runs))
c2.metric("Training runs", int((runs["kind"] == "train").sum()))
c3.metric("Studies", int((runs["kind"] == "study").sum()))
c4.metric("Running", int((runs["status"] == "RUNNING").sum()))

kinds = sorted(k for k in runs["kind"].unique() if k)
show = st.multiselect("Kinds", kinds, default=kinds, key="runs_kinds") if kinds else []
view = runs[runs["kind"].isin(show) | (runs["kind"] == "")] if kinds else runs


def _last(metrics: dict, key: str):
    v = metrics.get(key)
    return float(v) if v is not None else None


def _last_eval(metrics: dict, steps: dict):
    """The last no-hint avg@k of the eval while training (eval_every): of the key logged at the highest step (a run
    resumed with another eval_k or eval_data keeps the earlier keys, their last points older), the first set's where
    several were evaluated at that step; None without one."""
    keys = sorted(k for k in metrics if k.startswith("eval/during/") and "/avg_at_" in k)
    return _last(metrics, max(keys, key=lambda k: steps.get(k, -1))) if keys else None


base = D.mlflow_ui_url()
table = pd.DataFrame({
    "run": view["run_name"],
    "kind": view["kind"],
    "method": view["method"],
    "hint source": view["hint_source"].where(view["method"].isin(["sage", "sage-light", "sage-light+ada-seq"]), ""),
    "model": view["model"],
    "status": view["status"],
    "G": view["num_generations"],
    "started": view["start_time"].dt.tz_convert(None),
    "minutes": (view["ran_seconds"] / 60).round(1),
    "collapsed (last)": [_last(m, "sage/frac_collapsed") for m in view["metrics"]],
    "reward (last)": [_last(m, "reward") for m in view["metrics"]],
    "no-hint eval (last)": [_last_eval(m, s) for m, s in zip(view["metrics"], view["metric_steps"])],
    "parent": view["parent_run_id"].str[:8],
    "selected": view["run_id"].isin(ctx.selected),
    "mlflow": [D.run_url(r, e, base) for r, e in zip(view["run_id"], view["experiment_id"])],
    "run_id": view["run_id"],
})
st.dataframe(table, hide_index=True, key="runs_table", column_config={
    "collapsed (last)": st.column_config.ProgressColumn(min_value=0.0, max_value=1.0, format="%.2f"),
    "reward (last)": st.column_config.NumberColumn(format="%.3f"),
    "no-hint eval (last)": st.column_config.NumberColumn(format="%.3f", help="avg@k without hints, the last "
                                                          "eval while training (eval_every)"),
    "started": st.column_config.DatetimeColumn(format="YYYY-MM-DD HH:mm"),
    "minutes": st.column_config.NumberColumn(help="the time the run ran, once ended: its start to its end, or for a "
                                             "run stopped and resumed later its attempts summed (the time it was "
                                             "stopped left out; resumed by an older version: its training "
                                             "sessions' wall time, summary/wall_seconds, else start to end)"),
    "selected": st.column_config.CheckboxColumn(help="picked in the sidebar"),
    "mlflow": st.column_config.LinkColumn("MLflow", display_text="open"),
})

st.subheader("Compare in MLflow")
picked = [r for r in ctx.selected if r in set(runs["run_id"])]
if len(picked) < 1:
    st.info("Pick runs in the sidebar to compare them in MLflow.")
else:
    url = D.compare_url(picked, [ctx.run(r)["experiment_id"] for r in picked], base)
    st.link_button(f"Open MLflow's compare page for {len(picked)} run(s)", url, icon=":material/open_in_new:")
    st.code(url, language=None)
    st.caption(f"MLflow UI base URL: `{base}` (set `SAGE_MLFLOW_UI_URL` to change it; "
               "`make up` serves it on port 5000).")

    # a quick look at the picked runs' headline numbers
    rows = []
    for r in picked:
        m = ctx.run(r)["metrics"]
        rows.append({"run": ctx.label(r), **{k: m.get(k) for k in ("sage/frac_collapsed", "sage/frac_rescued",
                                                                     "sage/base_pass_rate", "reward")}})
    st.dataframe(pd.DataFrame(rows), hide_index=True, key="runs_picked")
