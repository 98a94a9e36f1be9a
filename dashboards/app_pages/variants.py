"""Variant comparison: the hint study's table (``study/comparison.parquet`` on the study parent run) and learning
curves of no-hint accuracy / eval metrics for GRPO vs SAGE-LIGHT vs SAGE (online / fixed / teacher)."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from dashboards import data as D

NO_HINT = "no-hint accuracy (training groups)"

ctx = D.context()
st.title("Variant comparison")
runs = ctx.runs
# the study last active first (started, reopened or ended last), as `python -m flows.report` picks it
studies = runs[runs["kind"] == "study"].sort_values("last_active", ascending=False, kind="stable")
by_parent = runs[runs["parent_run_id"] != ""]
parents = list(studies["run_id"]) + [p for p in by_parent["parent_run_id"].unique()
                                     if p in set(runs["run_id"]) and p not in set(studies["run_id"])]

if parents:
    parent = st.selectbox("Study", parents, format_func=ctx.label, key="variants_study")
    prow = ctx.run(parent)
    children = runs[runs["parent_run_id"] == parent]
    st.caption(f"Study run `{parent}` · {len(children)} variant runs (tag `mlflow.parentRunId`).")
else:
    parent, prow = None, None
    children = runs[runs["run_id"].isin(ctx.selected)]
    st.info("No hint-study run in this experiment (`sage.kind = study`): comparing the runs picked in the sidebar.")
if children.empty:
    st.info("No variant runs to compare.")
    st.stop()

children = children.assign(variant=[D.variant_label(m, h) for m, h in zip(children["method"],
                                                                          children["hint_source"])])
dup = children["variant"].duplicated(keep=False)
children.loc[dup, "variant"] = children.loc[dup, "variant"] + " · " + children.loc[dup, "run_name"]
# runs of one name too (a variant trained again in its study: force=true, or sage-teacher with another teacher):
# their run ids tell them apart, or their curves and eval rows would be merged (averaged) as one run's
dup = children["variant"].duplicated(keep=False)
children.loc[dup, "variant"] = children.loc[dup, "variant"] + " (" + children.loc[dup, "run_id"].str[:8] + ")"
children = children.assign(_rank=children["variant"].map(D.variant_rank)).sort_values(["_rank", "variant"])
order = list(children["variant"])

# --- the study table --------------------------------------------------------------------------------------------
if parent is not None:
    st.subheader("Study table")
    comp = D.artifact_parquet(ctx.uri, parent, prow["artifact_uri"], "study/comparison.parquet")
    if comp is None or comp.empty:
        st.info("The study run has no `study/comparison.parquet` (yet).")
    else:
        st.dataframe(comp, hide_index=True, key="variants_comparison", column_config={
            c: st.column_config.NumberColumn(format="%.3f") for c in comp.columns
            if pd.api.types.is_float_dtype(comp[c])})
        comp = comp.copy()
        if {"method", "hint_source"} <= set(comp.columns):  # the same labels and colours as the curves below
            comp["label"] = [D.variant_label(m, h) for m, h in zip(comp["method"].astype(str),
                                                                   comp["hint_source"].astype(str))]
        else:
            comp["label"] = comp[next((c for c in ("variant", "name") if c in comp.columns), comp.columns[0])]
        comp["label"] = comp["label"].astype(str)
        seeds = comp["seed"].nunique() if "seed" in comp.columns else 0
        key = ["label", "seed"] if seeds > 1 else ["label"]  # several seeds: one bar per seed, side by side
        dup = comp.duplicated(key, keep=False)
        tail = comp["variant"].astype(str) if "variant" in comp.columns else pd.Series(comp.index.astype(str),
                                                                                      index=comp.index)
        comp.loc[dup, "label"] = comp.loc[dup, "label"] + " · " + tail[dup]
        numeric = [c for c in comp.columns if pd.api.types.is_numeric_dtype(comp[c])
                   and not pd.api.types.is_bool_dtype(comp[c]) and comp[c].notna().any()]
        if numeric:
            score = lambda c: ("after" in c.lower()) * 2 + any(t in c.lower() for t in ("avg", "acc", "pass"))
            pref = sorted(numeric, key=score, reverse=True)
            col = st.selectbox("Column", numeric, index=numeric.index(pref[0]), key="variants_column")
            labels = sorted(comp["label"].unique(), key=lambda v: (D.variant_rank(v), v))
            enc = {"x": alt.X("label:N", sort=labels, title=None, axis=alt.Axis(labelAngle=0, labelLimit=200)),
                   "y": alt.Y(f"{col}:Q"), "color": alt.Color("label:N", legend=None,
                                                              scale=D.variant_color(labels)),
                   "tooltip": list(comp.columns[:12])}
            if seeds > 1:
                enc["xOffset"] = alt.XOffset("seed:N")
            st.altair_chart(alt.Chart(comp).mark_bar().encode(**enc).properties(height=260), key="variants_bars")
        summary = D.artifact_parquet(ctx.uri, parent, prow["artifact_uri"], "study/summary.parquet")
        if seeds > 1 and summary is not None and not summary.empty:
            st.subheader(f"Over {seeds} seeds")
            st.caption("Per variant: mean over seeds, the range of no-hint avg@k after training, and `vs_grpo`, the "
                       "change against GRPO of the same seed (mean, min, max over the seeds both finished).")
            st.dataframe(summary, hide_index=True, key="variants_summary", column_config={
                c: st.column_config.NumberColumn(format="%.3f") for c in summary.columns
                if pd.api.types.is_float_dtype(summary[c])})

# --- learning curves ---------------------------------------------------------------------------------------------
st.subheader("Learning curves")
all_keys = sorted({k for m in children["metrics"] for k in m if not k.startswith("system/")})
# the no-hint eval while training (eval_every: eval/during/<set>/avg_at_<k>, pass_at_<k>) or TRL's own (eval_*);
# eval/before/... and eval/after/... are one point each, in the table below
eval_keys = [k for k in all_keys if k.startswith(("eval/during/", "eval_"))]
choices = [NO_HINT] + all_keys
default = [NO_HINT] + [k for k in ("reward",) if k in all_keys] + eval_keys[:2]
metrics = st.multiselect("Metrics", choices, default=default, key="variants_metrics")
smooth = st.slider("Smoothing (rolling mean over steps)", 1, 25, 1, key="variants_smooth")

parts = []
for _, c in children.iterrows():
    keys = {k for k in metrics if k != NO_HINT}
    if NO_HINT in metrics:
        keys |= {"sage/base_pass_rate", "reward"}
    h = D.metric_history(ctx.uri, c["run_id"], keys, c["status"], c["end_time"], c.get("last_step"))
    if h.empty:
        continue
    h = h.assign(variant=c["variant"])
    if NO_HINT in metrics:
        base = h[h["key"] == "sage/base_pass_rate"].dropna(subset=["value"])
        if base.empty and c["method"] == "grpo":  # plain GRPO never hints: its reward is the no-hint accuracy
            base = h[h["key"] == "reward"]
        parts.append(base.assign(key=NO_HINT))
    parts.append(h[h["key"].isin([k for k in metrics if k != NO_HINT])])
curves = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
if curves.empty:
    st.info("No step metrics for these variants (yet).")
else:
    if smooth > 1:
        curves = curves.sort_values("step")
        curves["value"] = curves.groupby(["variant", "key"])["value"].transform(
            lambda s: s.rolling(smooth, min_periods=1).mean())
    sel = alt.selection_point(fields=["variant"], bind="legend")
    chart = alt.Chart(curves).mark_line(point=curves["step"].nunique() <= 40).encode(
        x=D.step_x(), y=alt.Y("value:Q", title=None),
        color=alt.Color("variant:N", sort=order, scale=D.variant_color(order),
                        legend=alt.Legend(orient="bottom", title=None, labelLimit=300)),
        opacity=alt.condition(sel, alt.value(1.0), alt.value(0.15)),
        tooltip=["variant", "key", "step", alt.Tooltip("value:Q", format=".3f")],
    ).properties(height=240, width=420).add_params(sel)
    st.altair_chart(chart.facet(facet=alt.Facet("key:N", title=None), columns=2).resolve_scale(y="independent"),
                    key="variants_curves")
    st.caption(f"{NO_HINT}: `sage/base_pass_rate` (the no-hint group of each prompt), or `reward` for plain GRPO. "
               "SAGE-LIGHT hints before it rolls out, so it has no no-hint groups: compare it on `eval/during/*` "
               "(the held-out set without hints every `eval_every` steps, when the runs set it) or the eval below. "
               "A sampled eval's last point and the after-training eval differ by their draws.")

# --- no-hint evaluation ------------------------------------------------------------------------------------------
evals = []
for _, c in children.iterrows():
    e = D.artifact_parquet(ctx.uri, c["run_id"], c["artifact_uri"], "eval/eval.parquet")
    if e is not None and not e.empty:
        evals.append(e.assign(variant=c["variant"]))
if evals:
    st.subheader("No-hint evaluation (before / after training)")
    ev = pd.concat(evals, ignore_index=True)
    ev["when"] = pd.Categorical(ev["when"].astype(str), ["before", "after"], ordered=True)
    stat = st.radio("Statistic", ["avg_at_k", "pass_at_k"], horizontal=True, key="variants_eval_stat")
    ks = sorted(int(k) for k in ev["k"].dropna().unique()) if "k" in ev.columns else []
    bars = ev
    if len(ks) > 1:  # runs evaluated at several k (one bar each would be stacked): the chart shows one k
        pick = st.selectbox("k (samples per prompt)", ks, index=len(ks) - 1, key="variants_eval_k")
        bars = ev[ev["k"] == pick]
    st.altair_chart(alt.Chart(bars).mark_bar().encode(
        x=alt.X("when:N", sort=["before", "after"], title=None),
        y=alt.Y(f"{stat}:Q", scale=alt.Scale(domain=[0, 1])),
        color=alt.condition(alt.datum.when == "after", alt.Color("variant:N", scale=D.variant_color(order),
                                                                 legend=None), alt.value("#cccccc")),
        column=alt.Column("variant:N", sort=order, title=None, header=alt.Header(labelAngle=0, labelLimit=160)),
        row=alt.Row("benchmark:N", title=None),
        tooltip=["variant", "benchmark", "when", "k", alt.Tooltip(f"{stat}:Q", format=".3f"), "n_prompts"],
    ).properties(width=90, height=160), key="variants_eval")
    # one row per k: a run evaluated again with another eval_k has both, and their mean is no avg@k of either
    index = ["benchmark", "k", "variant"] if "k" in ev.columns else ["benchmark", "variant"]
    table = ev.pivot_table(index=index, columns="when", values=stat, observed=True).reset_index()
    table = table.sort_values(index, key=lambda c: c.map(D.variant_rank) if c.name == "variant" else c,
                              kind="stable")
    table.columns.name = None
    st.dataframe(table, hide_index=True, key="variants_eval_table")
