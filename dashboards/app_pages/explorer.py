"""Collapsed prompts explorer: prompts whose no-hint groups collapsed (all-0 / all-1), with their history; pick one to
read the problem, the hint at each level tried, the completions with rewards, and whether the leak guard fired."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from dashboards import data as D

ctx = D.context()
st.title("Collapsed prompts")
run_id, frame, n_files = D.pick_run_with_tracker(ctx, "explorer_run")
r = ctx.run(run_id)


# keyed as the frame (n_files, files: the files' sizes and mtimes): a live run's older keys never come back
@st.cache_data(show_spinner=False, max_entries=4)
def _collapsed_table(run_id: str, n_files: int, files: str, _frame: pd.DataFrame) -> pd.DataFrame:
    coll = D.collapsed_mask(_frame)
    ids = _frame.loc[coll, "prompt_id"].astype(str).unique()
    summ = D.prompt_summary(_frame)
    summ = summ[summ["prompt_id"].isin(ids)]
    f = _frame[_frame["prompt_id"].astype(str).isin(ids)].sort_values("step")
    g = f.groupby(f["prompt_id"].astype(str), observed=True)
    hist = pd.DataFrame({"pass rate history": g["pass_rate"].agg(lambda s: [float(v) for v in s.fillna(0)]),
                         "level history": g["level"].agg(list),
                         "last state": g["base_state"].agg(lambda s: str(s.iloc[-1]))})
    out = summ.merge(hist, left_on="prompt_id", right_index=True, how="left")
    # hinted collapses (all-0) first: those are the ones with hints to read
    return out.sort_values(["all0", "collapsed", "prompt_id"], ascending=[False, False, True]).reset_index(drop=True)


files = ctx.files_key(run_id)
table = _collapsed_table(run_id, n_files, files, frame)
texts = D.prompt_texts(ctx.uri, run_id, r["artifact_uri"], n_files, files)
table = table.merge(texts[["prompt_id", "problem"]], on="prompt_id", how="left")

c1, c2, c3, c4 = st.columns(4)
c1.metric("Prompts with a collapsed group", len(table))
c2.metric("of prompts", int(frame["prompt_id"].nunique()))
c3.metric("Collapsed groups", int(D.collapsed_mask(frame).sum()))
c4.metric("Rescued groups", int(frame["rescued"].sum()))
if table.empty:
    st.success("No group collapsed in this run: every no-hint group was mixed.")
    st.stop()

state = st.segmented_control("Show", ["all", "all-0 at least once", "all-1 at least once", "never rescued"],
                             default="all", key="explorer_filter")
view = table
if state == "all-0 at least once":
    view = table[table["all0"] > 0]
elif state == "all-1 at least once":
    view = table[table["all1"] > 0]
elif state == "never rescued":
    view = table[table["rescued"] == 0]
query = st.text_input("Filter by prompt id or problem text", key="explorer_query")
if query:
    q = query.lower()
    view = view[view["prompt_id"].str.lower().str.contains(q, regex=False)
                | view["problem"].fillna("").str.lower().str.contains(q, regex=False)]

st.dataframe(view[["prompt_id", "problem", "difficulty", "steps", "collapsed", "all0", "all1", "rescued",
                   "max_level", "max_level_tried", "hint_failed", "last state", "pass rate history",
                   "level history"]],
             hide_index=True, key="explorer_table", height=320, column_config={
                 "problem": st.column_config.TextColumn(width="large"),
                 "collapsed": st.column_config.NumberColumn("collapsed steps"),
                 "max_level": st.column_config.NumberColumn("max level trained"),
                 "max_level_tried": st.column_config.NumberColumn(
                     "max level tried", help="the highest hint level searched: tried, and none had mixed rewards, "
                     "where it is above the level trained"),
                 "hint_failed": st.column_config.NumberColumn(
                     "hint failed", help="steps where writing a hint failed (no usable hint), not hints that did not "
                     "rescue the group"),
                 "all0": st.column_config.NumberColumn("all-0"), "all1": st.column_config.NumberColumn("all-1"),
                 "pass rate history": st.column_config.LineChartColumn(y_min=0.0, y_max=1.0),
                 "level history": st.column_config.BarChartColumn(y_min=0, y_max=3)})
if view.empty:
    st.info("No prompt matches the filter.")
    st.stop()

st.divider()
pid = st.selectbox("Prompt", list(view["prompt_id"]), key="explorer_prompt")
row = table.set_index("prompt_id").loc[pid]
steps = tuple(int(s) for s in frame.loc[frame["prompt_id"] == pid, "step"])
detail = D.prompt_detail(ctx.uri, run_id, r["artifact_uri"], n_files, pid, steps, files)
if detail.empty:
    st.warning(f"No tracker rows for `{pid}`.")
    st.stop()
first = detail.iloc[0]
st.subheader(f"`{pid}`")
st.markdown("**Problem**")
st.text(str(first["problem"]))
c1, c2, c3, c4 = st.columns(4)
c1.metric("Answer", str(first["answer"]))
c2.metric("Difficulty", int(first["difficulty"]) if pd.notna(first["difficulty"]) else -1)
c3.metric("Collapsed steps", int(row["collapsed"]))
c4.metric("Rescued", int(row["rescued"]))

hist = detail[["step", "base_state", "base_pass_rate", "level", "max_level_tried", "pass_rate", "rescued",
               "hint_failed", "rollouts"]]
melt = hist.melt(id_vars=["step", "level"], value_vars=["base_pass_rate", "pass_rate"], var_name="group",
                 value_name="rate").dropna()
melt["group"] = melt["group"].map({"base_pass_rate": "no hint", "pass_rate": "trained group"})
st.altair_chart(alt.Chart(melt).mark_line(point=True).encode(
    x=D.step_x(), y=alt.Y("rate:Q", scale=alt.Scale(domain=[0, 1]), title="pass rate"),
    color=alt.Color("group:N", title=None), strokeDash=alt.StrokeDash("group:N", legend=None),
    shape=alt.Shape("group:N", legend=None), tooltip=["step", "group", alt.Tooltip("rate:Q", format=".2f"), "level"])
    .properties(height=200), key="explorer_history_chart")
st.dataframe(hist, hide_index=True, key="explorer_history")

collapsed_steps = [int(s) for s, st_, pr in zip(detail["step"], detail["base_state"], detail["pass_rate"])
                   if str(st_) in ("all0", "all1") or (str(st_) == "na" and pr in (0.0, 1.0))]
choices = [int(s) for s in detail["step"]]
default = collapsed_steps[-1] if collapsed_steps else choices[-1]
step = st.selectbox("Step", choices, index=choices.index(default), key=f"explorer_step::{pid}",
                    format_func=lambda s: f"{s}" + ("  (collapsed)" if s in collapsed_steps else ""))
d = detail[detail["step"] == step].iloc[0]

trained = d["trained"]  # None or NaN in rows written before the column: every row was trained then
if trained is not None and not pd.isna(trained) and not trained:
    st.markdown(f"**Step {step}** · no-hint group: `{d['base_state']}` · **swapped out** for a fresh prompt of the "
                f"train set (its slot's prompt: `{d['origin_id']}`), not trained · pass rate "
                f"{float(d['pass_rate']):.2f}")
else:
    st.markdown(f"**Step {step}** · no-hint group: `{d['base_state']}` · trained on level **{int(d['level'])}** "
                f"(tried up to {int(d['max_level_tried'])}) · final pass rate {float(d['pass_rate']):.2f}"
                + (" · rescued" if bool(d["rescued"]) else "") + (" · hint failed" if bool(d["hint_failed"]) else ""))
hint_rows = []
for k in (1, 2, 3):
    h = d.get(f"hint_l{k}")
    tried = h is not None and not (isinstance(h, float) and pd.isna(h))
    acc = d.get(f"acc_l{k}")
    hint_rows.append({"level": k, "tried": tried, "hint": h if tried else None,
                      "accuracy": float(acc) if acc is not None and pd.notna(acc) else None,
                      "leak guard fired": bool(d.get(f"leak_l{k}")) if d.get(f"leak_l{k}") is not None else False,
                      "trained on": int(d["level"]) == k})
hints = pd.DataFrame(hint_rows)
st.dataframe(hints, hide_index=True, key="explorer_hints", column_config={
    "hint": st.column_config.TextColumn(width="large"),
    "accuracy": st.column_config.ProgressColumn(min_value=0.0, max_value=1.0, format="%.2f"),
    "leak guard fired": st.column_config.CheckboxColumn(help="the hint gave the answer away and was rejected"),
})
for hr in hint_rows:
    if hr["tried"]:
        flag = " · :red[leak guard fired]" if hr["leak guard fired"] else ""
        st.markdown(f"Level {hr['level']} hint{flag}" + (" · *trained on*" if hr["trained on"] else ""))
        st.text(str(hr["hint"]))
if not any(hr["tried"] for hr in hint_rows):
    st.caption("No hint was tried at this step.")

comps = d.get("completions")
rews = d.get("rewards")
comps = list(comps) if comps is not None else []
rews = list(rews) if rews is not None else []
n = max(len(comps), len(rews))
st.markdown(f"**Completions of the trained group** ({n})")
if n:
    st.dataframe(pd.DataFrame({"reward": (rews + [None] * n)[:n], "completion": (comps + [None] * n)[:n]}),
                 hide_index=True, key="explorer_completions", column_config={
                     "reward": st.column_config.NumberColumn(format="%.2f"),
                     "completion": st.column_config.TextColumn(width="large")})
else:
    st.caption("No completions stored for this step.")
