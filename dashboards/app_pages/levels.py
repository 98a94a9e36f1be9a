"""Per-prompt hint levels: a prompt x step heatmap of the level trained on (0 = no hint .. 3), sortable by
difficulty or pass rate, with never-solved prompts highlighted."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from dashboards import data as D

LEVEL_COLORS = ["#e8e8e8", "#fdd49e", "#fc8d59", "#b30000"]

ctx = D.context()
st.title("Per-prompt hint levels")
run_id, frame, n_files = D.pick_run_with_tracker(ctx, "levels_run")


# keyed as the frame (n_files, files: the files' sizes and mtimes): a live run's older keys never come back
@st.cache_data(show_spinner=False, max_entries=4)
def _summary(run_id: str, n_files: int, files: str, _frame: pd.DataFrame) -> pd.DataFrame:
    return D.prompt_summary(_frame)


@st.cache_data(show_spinner=False, max_entries=4)
def _level_share(run_id: str, n_files: int, files: str, _frame: pd.DataFrame) -> pd.DataFrame:
    share = _frame.groupby(["step", "level"], observed=True).size().rename("n").reset_index()
    share["share"] = share["n"] / share.groupby("step")["n"].transform("sum")
    return share


files = ctx.files_key(run_id)
summary = _summary(run_id, n_files, files, frame)
c1, c2, c3, c4, c5 = st.columns(5)
c1.metric("Prompts", len(summary))
c2.metric("Steps", int(frame["step"].nunique()))
c3.metric("Groups hinted", f"{(frame['level'] > 0).mean():.1%}", help="share of (step, prompt) groups with level > 0")
c4.metric("Never solved", int(summary["never_solved"].sum()),
          help="prompts with no correct completion in any group they were trained on (hinted or not)")
c5.metric("Never solved without a hint", int(summary["never_solved_no_hint"].sum()),
          help="prompts whose no-hint groups never had a correct completion")

share = _level_share(run_id, n_files, files, frame)
st.altair_chart(alt.Chart(share).mark_area().encode(
    x=D.step_x(), y=alt.Y("share:Q", stack="normalize", title="share of groups"),
    color=alt.Color("level:O", scale=alt.Scale(domain=[0, 1, 2, 3], range=LEVEL_COLORS), title="hint level"),
    tooltip=["step", "level", "n", alt.Tooltip("share:Q", format=".1%")]).properties(height=160), key="levels_share")

left, mid, right = st.columns([2, 1, 1])
how = left.selectbox("Sort prompts by", list(D.SORTS), key="levels_sort")
only_never = mid.toggle("Only never-solved prompts", key="levels_never")
per_page = right.select_slider("Prompts per page", [25, 50, 100, 200], value=50, key="levels_per_page")

ordered = D.sort_prompts(summary, how)
if only_never:
    ordered = ordered[ordered["never_solved"]]
if ordered.empty:
    st.success("No never-solved prompts in this run.")
    st.stop()
pages = max(1, -(-len(ordered) // per_page))
page = st.number_input(f"Page (of {pages})", 1, pages, 1, key="levels_page") if pages > 1 else 1
shown = ordered.iloc[(page - 1) * per_page: page * per_page]
ids = list(shown["prompt_id"])

n_steps = int(frame["step"].nunique())
cells, width = D.level_cells(frame, ids, max_cols=100)
never = set(shown.loc[shown["never_solved"], "prompt_id"])
cells["never_solved"] = cells["prompt_id"].isin(never)
never_list = sorted(never)
y = alt.Y("prompt_id:N", sort=ids, title=None, axis=alt.Axis(
    labelLimit=160, labelFontSize=10, labelOverlap=False,
    labelColor=alt.expr(f"indexof({never_list!r}, datum.value) >= 0 ? '#d62728' : '#31333f'"),
    labelFontWeight=alt.expr(f"indexof({never_list!r}, datum.value) >= 0 ? 'bold' : 'normal'")))
row_h = 16 if len(ids) <= 100 else 10
height = max(120, row_h * len(ids))
heat = alt.Chart(cells).mark_rect(stroke="white", strokeWidth=0.3 if len(ids) <= 100 else 0).encode(
    x=alt.X("step_lo:O", title="step" + (f" (bins of {width}, max level)" if width > 1 else ""),
            axis=alt.Axis(labelOverlap="parity", labelAngle=0)),
    y=y,
    color=alt.Color("level:O", scale=alt.Scale(domain=[0, 1, 2, 3], range=LEVEL_COLORS), title="hint level",
                    legend=alt.Legend(orient="top", direction="horizontal")),
    tooltip=["prompt_id", alt.Tooltip("step_lo:Q", title="step"), "level",
             alt.Tooltip("pass_rate:Q", format=".2f", title="pass rate"), alt.Tooltip("base_state:N", title="base")],
).properties(height=height, width=min(780, max(300, 12 * cells["step_lo"].nunique())))
flag = shown.assign(flag=shown["never_solved"].map({True: "never solved", False: "solved at least once"}))
strip = alt.Chart(flag).mark_rect().encode(
    y=alt.Y("prompt_id:N", sort=ids, axis=None),
    color=alt.Color("flag:N", scale=alt.Scale(domain=["never solved", "solved at least once"],
                                              range=["#d62728", "#f0f2f6"]), legend=None),
    tooltip=["prompt_id", "difficulty", alt.Tooltip("pass_rate:Q", format=".2f", title="mean pass rate"), "flag"],
).properties(width=14, height=height)
st.altair_chart(alt.hconcat(heat, strip, spacing=3).resolve_scale(color="independent"), key="levels_heatmap")
st.caption(f"Showing {len(ids)} of {len(ordered)} prompts, {n_steps} steps. Red prompt ids and red marks on the "
           "right: never solved. Empty cells: the prompt was not sampled at that step.")

st.dataframe(shown, hide_index=True, key="levels_table", column_config={
    "pass_rate": st.column_config.ProgressColumn("mean pass rate", min_value=0.0, max_value=1.0, format="%.2f"),
    "base_pass_rate": st.column_config.NumberColumn("mean no-hint pass rate", format="%.2f"),
    "mean_level": st.column_config.NumberColumn(format="%.2f"),
    "max_level": st.column_config.NumberColumn("max level trained"),
    "max_level_tried": st.column_config.NumberColumn("max level tried"),
    "never_solved": st.column_config.CheckboxColumn("never solved"),
    "never_solved_no_hint": st.column_config.CheckboxColumn("never solved w/o hint"),
})
