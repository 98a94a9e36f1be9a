"""Gate statistics: collapsed groups before hints (all-0 / all-1), groups rescued (by hints, or by a curation
method's extra rollouts or swapped-in prompts), advantage energy per step, and the empirical gate-open rate per
pass-rate bin against u(p) = 1-(1-p)^G-p^G."""

from __future__ import annotations

import altair as alt
import numpy as np
import pandas as pd
import streamlit as st

from dashboards import data as D

ctx = D.context()
st.title("Gate statistics")
st.caption("A group of G rollouts with the same 0/1 reward has zero advantage: its gate is closed. SAGE re-rolls "
           "closed groups with a hint; *rescued* groups are collapsed before the hint and mixed after it.")

picked = ctx.selected or list(ctx.runs["run_id"][:1])
if not picked:
    st.info("Pick a run in the sidebar.")
    st.stop()

keys = D.GATE_METRICS + ["sage/frac_collapsed"]
parts = []
for r in picked:
    h = D.metric_history(ctx.uri, r, keys, ctx.run(r)["status"], ctx.run(r)["end_time"],
                          ctx.run(r)["last_step"])
    if not h.empty:
        parts.append(h.assign(run=ctx.label(r)))
hist = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["run_id", "key", "step", "value"])

if hist.empty:
    st.info("The selected runs have no `sage/*` gate metrics (yet). They are logged per step by SAGE training runs.")
else:
    # collapsed = all-0 + all-1 when a writer did not log sage/frac_collapsed itself
    summary = []
    for r in picked:
        h = hist[hist["run_id"] == r]
        means = h.groupby("key")["value"].mean()
        coll = means.get("sage/frac_collapsed")
        if coll is None and {"sage/frac_all_zero", "sage/frac_all_one"} <= set(means.index):
            coll = means["sage/frac_all_zero"] + means["sage/frac_all_one"]
        summary.append({"run": ctx.label(r), "steps": int(h["step"].nunique()),
                        "collapsed before hints": coll,
                        "all-0": means.get("sage/frac_all_zero"), "all-1": means.get("sage/frac_all_one"),
                        "rescued": means.get("sage/frac_rescued"), "open after hints": means.get("sage/frac_open"),
                        "adv energy": means.get("sage/adv_energy")})
    first = summary[0]
    st.subheader("Means over steps" + (f" · {first['run']}" if len(picked) > 1 else ""))
    cols = st.columns(6)
    fmt = lambda v: "n/a" if v is None or pd.isna(v) else f"{v:.3f}"
    cols[0].metric("Collapsed before hints", fmt(first["collapsed before hints"]),
                   help="mean over steps of sage/frac_collapsed (all-0 + all-1)")
    cols[1].metric("All-0 groups", fmt(first["all-0"]), help="mean of sage/frac_all_zero")
    cols[2].metric("All-1 groups", fmt(first["all-1"]), help="mean of sage/frac_all_one")
    cols[3].metric("Rescued", fmt(first["rescued"]),
                   help="mean of sage/frac_rescued: batch slots whose first rollout collapsed and that trained a group "
                   "with mixed rewards: by a hint (SAGE, SAGE-LIGHT), or by more rollouts or a fresh prompt in its "
                   "place (the curation methods, which use no hint)")
    cols[4].metric("Open after hints", fmt(first["open after hints"]),
                   help="mean of sage/frac_open: groups trained with mixed rewards, the ones that carry gradient")
    cols[5].metric("Advantage energy", fmt(first["adv energy"]), help="mean of sage/adv_energy")
    if len(picked) > 1:
        st.dataframe(pd.DataFrame(summary), hide_index=True, key="gate_summary")

    st.subheader("Per step")
    long = hist[hist["key"].isin(D.GATE_METRICS)].assign(metric=lambda d: d["key"].map(D.METRIC_LABELS))
    sel = alt.selection_point(fields=["run"], bind="legend")
    base = alt.Chart(long).mark_line(point=long["step"].nunique() <= 60).encode(
        x=D.step_x(),
        y=alt.Y("value:Q", title=None),
        color=alt.Color("run:N", legend=alt.Legend(orient="bottom", title=None, labelLimit=400)),
        opacity=alt.condition(sel, alt.value(1.0), alt.value(0.15)),
        tooltip=["run", "metric", "step", alt.Tooltip("value:Q", format=".3f")],
    ).properties(height=180).add_params(sel)
    chart = base.facet(facet=alt.Facet("metric:N", title=None, sort=[D.METRIC_LABELS[k] for k in D.GATE_METRICS]),
                       columns=2).resolve_scale(y="independent")
    st.altair_chart(chart, key="gate_steps")

    # the before-hint split for the first run: what closed the gates
    one = hist[(hist["run_id"] == picked[0]) & hist["key"].isin(["sage/frac_all_zero", "sage/frac_all_one"])]
    if not one.empty:
        area = alt.Chart(one.assign(state=one["key"].map({"sage/frac_all_zero": "all-0 (too hard)",
                                                          "sage/frac_all_one": "all-1 (too easy)"}))).mark_area(
            opacity=0.8).encode(
            x=D.step_x(), y=alt.Y("value:Q", stack=True, title="collapsed before hints"),
            color=alt.Color("state:N", scale=alt.Scale(range=["#d62728", "#1f77b4"]), title=None),
            tooltip=["state", "step", alt.Tooltip("value:Q", format=".3f")]).properties(height=220)
        resc = hist[(hist["run_id"] == picked[0]) & (hist["key"] == "sage/frac_rescued")]
        if not resc.empty:
            area = area + alt.Chart(resc).mark_line(color="black", strokeDash=[4, 2]).encode(
                x=D.step_x(), y="value:Q", tooltip=["step", alt.Tooltip("value:Q", format=".3f", title="rescued")])
        st.caption(f"Collapsed before hints, stacked, and rescued (dashed) · {ctx.label(picked[0])}")
        st.altair_chart(area, key="gate_split")

st.subheader("Gate-open rate vs pass rate")
run_id = D.pick_run(ctx, "gate_run", label="Run for the gate-open curve")
r = ctx.run(run_id)
G = r["num_generations"]  # NaN where other runs of the experiment have the param and this one has not
G = None if G is None or pd.isna(G) else int(G)
frame, n_files = D.tracker_for(ctx, run_id)
if frame.empty:
    st.info("This run has no per-prompt tracker files (`tracker/step_*.parquet`).")
    st.stop()
if G is None:
    G = st.number_input("Group size G (param sage.num_generations is missing)", 2, 1024, 8, key="gate_G")
n_bins = st.slider("Pass-rate bins", 4, 20, 10, key="gate_bins")


# keyed as the frame (run, files, their key): binning a 5000-step run's frame took 2.7 s at each rerun (a slider move)
@st.cache_data(show_spinner=False, max_entries=8)
def _bins(run_id: str, n_files: int, files: str, G: int, n_bins: int, _frame: pd.DataFrame) -> pd.DataFrame:
    return D.gate_open_bins(_frame, G, n_bins)


bins = _bins(run_id, n_files, ctx.files_key(run_id), int(G), n_bins, frame)
if bins.empty:
    st.info("No no-hint groups to bin: the method hinted before rolling out (sage-light, `base_state == 'na'`) "
            "or every prompt was seen only once.")
    st.stop()
opened = int(bins["open"].sum())
total = int(bins["groups"].sum())
c1, c2, c3 = st.columns(3)
c1.metric("Group size G", int(G))
c2.metric("Groups binned", total)
c3.metric("Empirical gate-open rate", f"{opened / total:.3f}", help="fraction of binned no-hint groups that were mixed")

p = np.linspace(0, 1, 201)
theory = pd.DataFrame({"p": p, "u": D.gate_open_prob(p, int(G))})
line = alt.Chart(theory).mark_line(color="gray").encode(
    x=alt.X("p:Q", title="pass rate p (prompt's other no-hint groups)", scale=alt.Scale(domain=[0, 1])),
    y=alt.Y("u:Q", title="P(gate open)", scale=alt.Scale(domain=[0, 1])),
    tooltip=[alt.Tooltip("p:Q", format=".2f"), alt.Tooltip("u:Q", format=".3f", title="u(p)")])
b = bins.assign(lo=(bins["open_rate"] - 1.96 * np.sqrt(bins["open_rate"] * (1 - bins["open_rate"]) / bins["groups"]))
                .clip(0, 1),
                hi=(bins["open_rate"] + 1.96 * np.sqrt(bins["open_rate"] * (1 - bins["open_rate"]) / bins["groups"]))
                .clip(0, 1))
err = alt.Chart(b).mark_rule(color="#d62728").encode(x="p_mean:Q", y="lo:Q", y2="hi:Q")
pts = alt.Chart(b).mark_circle(color="#d62728", opacity=0.9).encode(
    x="p_mean:Q", y="open_rate:Q", size=alt.Size("groups:Q", title="groups", scale=alt.Scale(range=[30, 400])),
    tooltip=[alt.Tooltip("p_lo:Q", format=".2f", title="bin from"), alt.Tooltip("p_hi:Q", format=".2f", title="to"),
             "groups", "open", alt.Tooltip("open_rate:Q", format=".3f"), alt.Tooltip("theory:Q", format=".3f")])
st.altair_chart((line + err + pts).properties(height=340), key="gate_curve")
st.caption(f"Gray: u(p) = 1-(1-p)^{int(G)} - p^{int(G)}. Red: fraction of no-hint groups that were mixed "
           "(`base_state == \"mixed\"`), binned by the prompt's pass rate estimated from its *other* no-hint "
           "groups (leave-one-out mean of `base_pass_rate`; prompts seen once are left out), with 95% intervals. "
           f"{n_files} tracker files, {len(frame)} groups.")
st.dataframe(bins, hide_index=True, key="gate_bins_table", column_config={
    c: st.column_config.NumberColumn(format="%.3f") for c in ("p_lo", "p_hi", "p_mean", "open_rate", "theory")})
