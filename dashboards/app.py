"""SAGE Studio dashboard: `streamlit run dashboards/app.py`.

Reads the same MLflow store as the flows (``MLFLOW_TRACKING_URI``, else ``sqlite:///<SAGE_HOME>/mlflow.db``) and the
per-prompt tracker artifacts. The sidebar picks the experiment and runs; the pages read them from the context.
`?experiment=<name>&run=<run id>` in the URL preselects them.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # `streamlit run dashboards/app.py` puts dashboards/ on the path, not the repo
    sys.path.insert(0, str(_ROOT))

import streamlit as st

from dashboards import data as D

st.set_page_config(page_title="SAGE Studio", page_icon=":material/school:", layout="wide")

PAGES = Path(__file__).resolve().parent / "app_pages"
pg = st.navigation({
    "Runs": [st.Page(PAGES / "runs.py", title="Runs", icon=":material/table:", url_path="runs", default=True)],
    "Analysis": [
        st.Page(PAGES / "gate.py", title="Gate statistics", icon=":material/door_open:", url_path="gate"),
        st.Page(PAGES / "levels.py", title="Per-prompt hint levels", icon=":material/grid_on:", url_path="levels"),
        st.Page(PAGES / "explorer.py", title="Collapsed prompts", icon=":material/search:", url_path="collapsed"),
        st.Page(PAGES / "variants.py", title="Variant comparison", icon=":material/compare:", url_path="variants"),
    ],
})


def _stop(kind: str, message: str) -> None:
    st.title(pg.title)
    getattr(st, kind)(message)
    st.session_state.pop(D.CTX_KEY, None)
    st.stop()


# Streamlit drops a widget's value when a run does not draw it (another page): re-assigning keeps the pages' picks
# (run, sort, filters) when the user comes back. Not the page number or per-prompt step: their ranges change. (A
# widget given a default logs a warning about its value set this way: `make dashboard` and the images turn it off.)
for _k in ("runs_kinds", "gate_run", "gate_G", "gate_bins", "levels_run", "levels_sort", "levels_never",
           "levels_per_page", "explorer_run", "explorer_filter", "explorer_query", "explorer_prompt", "variants_study",
           "variants_column", "variants_metrics", "variants_smooth", "variants_eval_stat", "variants_eval_k"):
    if _k in st.session_state:
        st.session_state[_k] = st.session_state[_k]

uri = D.tracking_uri()
st.sidebar.caption(f"Tracking store: `{D.shown_uri(uri)}`")

problem = D.store_problem(uri)
if problem:
    _stop("warning", problem)

try:
    exps = D.experiments(uri)
except Exception as exc:  # noqa: BLE001 - unreachable server, unreadable DB, a file store MLflow refuses to open, ...
    _stop("error", f"Cannot read the MLflow tracking store `{D.shown_uri(uri)}`: {type(exc).__name__}: "
                   f"{str(exc)[:500]}")

if exps.empty:
    _stop("info", "The tracking store has no experiments yet. Train something first (`make demo`).")

names = list(exps["name"])
qp_exp = st.query_params.get("experiment")
if qp_exp in names:  # ?experiment=<name> in the URL
    default_exp = qp_exp
else:  # the newest experiment other than MLflow's empty "Default" (the demo's hint-study, or `sage`)
    own = exps[exps["experiment_id"] != "0"] if len(exps) > 1 else exps
    default_exp = own.sort_values("last_update_time", ascending=False)["name"].iloc[0]
if st.session_state.get("experiment") not in names:
    st.session_state["experiment"] = default_exp
exp_name = st.sidebar.selectbox("Experiment", names, key="experiment")
exp_id = str(exps.loc[exps["name"] == exp_name, "experiment_id"].iloc[0])

try:
    runs = D.runs(uri, exp_id)
except Exception as exc:  # noqa: BLE001 - shown to the user instead of a traceback
    _stop("error", f"Cannot search runs in `{exp_name}`: {type(exc).__name__}: {str(exc)[:500]}")

if runs.empty:
    _stop("info", f"Experiment `{exp_name}` has no runs yet."
          + (" Train something first (`make demo`, or `sage train --mlflow`)." if len(names) == 1 else
             " Pick another experiment in the sidebar."))

ids = list(runs["run_id"])
labels = dict(zip(ids, [f"{n} · {m or '?'}{('/' + h) if h else ''} · {s.lower()} ({i[:8]})" for i, n, m, h, s in
                        zip(ids, runs["run_name"], runs["method"], runs["hint_source"], runs["status"])]))
sel_key = f"runs::{exp_id}"
if sel_key not in st.session_state or not set(st.session_state[sel_key]) <= set(ids):
    qp_run = st.query_params.get("run")
    top = [i for i, k, p in zip(ids, runs["kind"], runs["parent_run_id"]) if k in ("train", "") and not p]
    trains = top or [i for i, k in zip(ids, runs["kind"]) if k in ("train", "")]
    st.session_state[sel_key] = [qp_run] if qp_run in ids else (trains or ids)[:1]
selected = st.sidebar.multiselect("Runs", ids, format_func=labels.get, key=sel_key,
                                  help="Runs shown by the Runs and Gate pages; the first one is the default "
                                       "of the per-run pages.")
st.sidebar.caption(f"{len(ids)} runs in `{exp_name}`")

st.session_state[D.CTX_KEY] = D.Context(uri=uri, experiment_id=exp_id, experiment_name=exp_name, runs=runs,
                                        selected=list(selected))
pg.run()
