"""A realistic MLflow store for the dashboard tests, written through the real MLflow API and following
docs/architecture.md (tags, ``sage.*`` params, per-step ``sage/*`` metrics, ``tracker/step_*.parquet``,
``eval/eval.parquet``, a hint-study parent with ``study/comparison.parquet`` and child runs).

The metrics are computed from the tracker rows, so a test can check a page's numbers against either.
``write_big_tracker`` makes the 2000 prompts x 200 steps set for the responsiveness test.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

OPS = [("+", "gets", "more"), ("-", "gives away", "")]


def _problem(rng: np.random.Generator, n_steps: int) -> tuple[str, str, str]:
    x = int(rng.integers(2, 20))
    words, sol, plan = [f"Ann has {x} coins ."], [], []
    for _ in range(n_steps):
        op = "+" if x < 5 or rng.random() < 0.5 else "-"
        y = int(rng.integers(1, 10 if op == "+" else max(2, x)))
        words.append(f"She gets {y} more ." if op == "+" else f"She gives away {y} .")
        z = x + y if op == "+" else x - y
        sol.append(f"{x} {op} {y} = {z} .")
        plan.append(op)
        x = z
    words.append("How many coins does Ann have now ?")
    return " ".join(words), " ".join(sol) + f" The answer is \\boxed{{{x}}} .", str(x)


def make_prompts(n: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        d = int(rng.integers(1, 5))
        problem, solution, answer = _problem(rng, d)
        rows.append({"prompt_id": f"syn-{i:05d}", "problem": problem, "solution": solution, "answer": answer,
                     "difficulty": d, "skill": float(rng.normal(1.5 - 0.9 * d, 1.0))})
    return pd.DataFrame(rows)


def _hint(solution: str, level: int) -> str:
    steps = [s.strip() + " ." for s in solution.split(" The answer")[0].split(" .") if s.strip()]
    ops = " then ".join(s.split()[1] for s in steps)
    if level == 1:
        return f"Use {ops} ."
    if level == 2:
        return f"First {steps[0]}"
    return " ".join(steps[:-1]) + f" Then {' '.join(steps[-1].split()[:3])} ."


def tracker_step(prompts: pd.DataFrame, step: int, G: int, method: str, rng: np.random.Generator,
                 hint_source: str = "online", steps_total: int = 10) -> pd.DataFrame:
    """One step's tracker rows (contract columns) for the given prompts."""
    logit = prompts["skill"].to_numpy() + 2.5 * step / max(1, steps_total)
    p = 1 / (1 + np.exp(-logit))
    base_k = rng.binomial(G, p)
    rows = []
    for i, pr in enumerate(prompts.itertuples(index=False)):
        row = {"step": step, "prompt_id": pr.prompt_id, "problem": pr.problem, "answer": pr.answer,
                   "difficulty": int(pr.difficulty), "hint": None, "hint_l1": None, "hint_l2": None, "hint_l3": None,
                   "acc_l1": np.nan, "acc_l2": np.nan, "acc_l3": np.nan, "leak_l1": False, "leak_l2": False,
                   "leak_l3": False,
                   "hint_failed": False, "rescued": False, "level": 0, "max_level_tried": 0, "method": method}
        k = int(base_k[i])
        rollouts = G
        if method == "sage-light":
            row["base_pass_rate"], row["base_state"] = np.nan, "na"
            level = int(min(3, max(0, round(3 * (1 - p[i]) - 0.5))))
            if level:
                row["hint"] = _hint(pr.solution, level)
                row[f"hint_l{level}"] = row["hint"]
                k = int(rng.binomial(G, min(0.97, p[i] + 0.2 * level)))
                row[f"acc_l{level}"] = k / G
            row.update(level=level, max_level_tried=level, pass_rate=k / G)
        else:
            row["base_pass_rate"] = k / G
            row["base_state"] = "all0" if k == 0 else ("all1" if k == G else "mixed")
            row["pass_rate"] = k / G
            if method == "sage" and k == 0:
                for lvl in (1, 2, 3):
                    h = _hint(pr.solution, lvl)
                    leak = bool(rng.random() < 0.25)
                    if leak:  # the guard fired: the hint said the answer; a re-sampled hint replaced it
                        row[f"leak_l{lvl}"] = True
                    row[f"hint_l{lvl}"] = h
                    kk = int(rng.binomial(G, min(0.95, p[i] + 0.18 * lvl)))
                    row[f"acc_l{lvl}"] = kk / G
                    rollouts += G
                    row.update(level=lvl, max_level_tried=lvl, hint=h, pass_rate=kk / G)
                    if 0 < kk < G:
                        row["rescued"] = True
                        break
                else:
                    row["hint_failed"] = True
                k = round(row["pass_rate"] * G)
        rewards = [1.0] * k + [0.0] * (G - k)
        rng.shuffle(rewards)
        comps = [f"{pr.solution.split(' The answer')[0]} The answer is \\boxed{{{pr.answer}}} ." if r else
                 f"{pr.problem.split(' .')[0]} . The answer is \\boxed{{{int(pr.answer) + 1}}} ." for r in rewards]
        row.update(rollouts=rollouts, completions=comps, rewards=rewards)
        rows.append(row)
    df = pd.DataFrame(rows)
    return df.astype({"step": "int64", "difficulty": "int64", "level": "int64", "max_level_tried": "int64",
                      "rollouts": "int64"})


def step_metrics(df: pd.DataFrame, G: int) -> dict[str, float]:
    """The per-step `sage/*` metrics (and TRL's `reward`) the tracking callback logs, from one step's rows."""
    state = df["base_state"]
    pr = df["pass_rate"].to_numpy(float)
    m = {
        "reward": float(pr.mean()),
        "frac_reward_zero_std": float(((pr == 0) | (pr == 1)).mean()),
        "sage/frac_all_zero": float((state == "all0").mean()),
        "sage/frac_all_one": float((state == "all1").mean()),
        "sage/frac_rescued": float(df["rescued"].mean()),
        "sage/frac_open": float(((pr > 0) & (pr < 1)).mean()),
        "sage/hint_failed": float(df["hint_failed"].mean()),
        "sage/hint_leaks": float(df[["leak_l1", "leak_l2", "leak_l3"]].sum().sum()),
        "sage/adv_energy": float((pr * (1 - pr)).mean()),
        "sage/rollouts": float(df["rollouts"].sum()),
        "sage/never_solved": float((pr == 0).mean()),
    }
    m["sage/frac_collapsed"] = m["sage/frac_all_zero"] + m["sage/frac_all_one"]
    n0 = (state == "all0").sum()
    m["sage/rescue_rate"] = float(df["rescued"].sum() / n0) if n0 else 0.0
    for lvl in range(4):
        m[f"sage/level_{lvl}_frac"] = float((df["level"] == lvl).mean())
    if df["base_pass_rate"].notna().any():
        m["sage/base_pass_rate"] = float(df["base_pass_rate"].mean())
        m["sage/never_solved_no_hint"] = float((df["base_pass_rate"] == 0).mean())
    return m


def _spec_params(**fields) -> dict[str, str]:
    try:
        from sage_core.spec import RunSpec

        spec = RunSpec(**fields).model_dump()
    except Exception:  # noqa: BLE001 - sage_core missing or a field it rejects: log the fields as given
        spec = dict(fields)
    return {f"sage.{k}": str(v)[:500] for k, v in spec.items()}


def _store(root: Path):
    from mlflow.tracking import MlflowClient

    root.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    return uri, MlflowClient(tracking_uri=uri)


def _experiment(client, root: Path, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    return client.create_experiment(name, artifact_location=(root / "mlartifacts" / name).as_uri())


EVAL_DURING = "eval/during/synthetic-heldout/avg_at_4"  # what SageGRPOTrainer logs with eval_every (and eval_k 4)


def log_run(client, exp_id: str, *, name: str, method: str, hint_source: str = "online", steps: int = 6,
            n_prompts: int = 12, per_step: int | None = None, G: int = 4, seed: int = 0, kind: str = "train",
            parent: str | None = None, tracker: bool = True, eval_after: float | None = None) -> dict:
    """One training run: tags, params, per-step metrics and tracker files. Returns ids and the tracker frame."""
    from mlflow.entities import Metric, Param

    rng = np.random.default_rng(seed)
    prompts = make_prompts(n_prompts, seed=seed)
    per_step = per_step or n_prompts
    hinting = method in ("sage", "sage-light", "sage-light+ada-seq")
    tags = {"sage.kind": kind, "sage.method": method, "sage.hint_source": hint_source if hinting else "none",
            "sage.model": "tiny",
            "sage.spec_key": f"{seed:016x}", "git.commit": "0" * 40, "prefect.flow_run_id": ""}
    if parent:
        tags["mlflow.parentRunId"] = parent
    run = client.create_run(exp_id, run_name=name, tags=tags)
    rid = run.info.run_id
    params = _spec_params(method=method, hint_source=hint_source if hint_source != "teacher" else "online",
                          num_generations=G, num_prompts=n_prompts, prompts_per_step=per_step, max_steps=steps)
    params["sage.hint_source"] = hint_source
    client.log_batch(rid, params=[Param(k, v) for k, v in params.items()])
    frames, metrics, ts = [], [], 1_700_000_000_000
    with tempfile.TemporaryDirectory() as tmp:
        tdir = Path(tmp) / "tracker"
        tdir.mkdir()
        for step in range(1, steps + 1):
            idx = rng.choice(n_prompts, size=per_step, replace=False) if per_step < n_prompts else np.arange(n_prompts)
            df = tracker_step(prompts.iloc[np.sort(idx)], step, G, method, rng, hint_source, steps)
            frames.append(df)
            for k, v in step_metrics(df, G).items():
                metrics.append(Metric(k, v, ts + step * 1000, step))
            if eval_after is not None and step % 2 == 0:  # the eval while training (eval_every=2), rising to after
                metrics.append(Metric(EVAL_DURING, 0.30 + (eval_after - 0.30) * step / steps, ts + step * 1000, step))
            if tracker:
                df.to_parquet(tdir / f"step_{step:06d}.parquet", index=False)
        for i in range(0, len(metrics), 900):
            client.log_batch(rid, metrics=metrics[i:i + 900])
        if tracker:
            client.log_artifacts(rid, str(tdir), "tracker")
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({k[5:]: v for k, v in params.items()}))
        client.log_artifact(rid, str(spec))
        if eval_after is not None:
            ev = pd.DataFrame({"benchmark": ["synthetic-test"] * 2, "when": ["before", "after"], "k": [4, 4],
                               "avg_at_k": [0.30, eval_after], "pass_at_k": [0.55, min(1.0, eval_after + 0.25)],
                               "n_prompts": [32, 32]})
            (Path(tmp) / "eval").mkdir()
            ev.to_parquet(Path(tmp) / "eval" / "eval.parquet", index=False)
            client.log_artifacts(rid, str(Path(tmp) / "eval"), "eval")
    client.set_terminated(rid, "FINISHED")
    return {"run_id": rid, "experiment_id": exp_id, "frame": pd.concat(frames, ignore_index=True), "G": G,
            "name": name}


VARIANTS = [("grpo", "online", 0.34), ("sage-light", "online", 0.41), ("sage", "online", 0.47),
            ("sage", "fixed", 0.44), ("sage", "teacher", 0.45)]


def build_store(root: Path, experiment: str = "sage") -> dict:
    """A store with two training runs (sage, grpo) and a hint study (parent + 5 variants). Returns what was written."""
    from mlflow.entities import RunTag  # noqa: F401

    uri, client = _store(root)
    exp_id = _experiment(client, root, experiment)
    out = {"uri": uri, "experiment_id": exp_id, "experiment": experiment}
    out["grpo"] = log_run(client, exp_id, name="grpo-tiny", method="grpo", seed=1, eval_after=0.36)
    out["sage"] = log_run(client, exp_id, name="sage-tiny", method="sage", seed=2, steps=8, n_prompts=16,
                          per_step=10, eval_after=0.46)
    # tagged as flows/study_flow.py tags it: the kind, and the base spec's method and hint source
    parent = client.create_run(exp_id, run_name="hint-study", tags={"sage.kind": "study", "sage.model": "tiny",
                                                                    "sage.method": "sage",
                                                                    "sage.hint_source": "online"}).info.run_id
    children = []
    for i, (method, source, acc) in enumerate(VARIANTS):
        children.append(log_run(client, exp_id, name=f"study-{method}-{source}", method=method, hint_source=source,
                                seed=10 + i, steps=5, n_prompts=8, kind="train", parent=parent, eval_after=acc))
    # the columns of flows/study_flow.py's COMPARISON_COLUMNS, one row per variant
    comp = pd.DataFrame({
        "variant": ["grpo", "sage-light", "sage-online", "sage-fixed", "sage-teacher"],
        "method": [v[0] for v in VARIANTS],
        "hint_source": [v[1] if v[0] != "grpo" else "none" for v in VARIANTS],
        "k": [4] * 5, "avg_at_k_before": [0.30] * 5, "avg_at_k_after": [v[2] for v in VARIANTS],
        "delta_avg_at_k": [v[2] - 0.30 for v in VARIANTS], "pass_at_k_after": [min(1.0, v[2] + 0.25) for v in VARIANTS],
        "never_solved": [float((c["frame"].groupby("prompt_id")["pass_rate"].max() == 0).mean()) for c in children],
        "never_solved_no_hint": [float("nan")] * 5,
        "frac_collapsed": [float((c["frame"]["base_state"] != "mixed").mean()) for c in children],
        "rollouts": [float(c["frame"]["rollouts"].sum()) for c in children],
        "rescued": [float(c["frame"]["rescued"].sum()) for c in children],
        "wall_seconds": [60.0, 75.0, 80.0, 78.0, 77.0], "train_seconds": [50.0, 62.5, 66.5, 65.0, 64.0],
        "train_vs_grpo": [1.0, 1.25, 1.33, 1.3, 1.28],
        "global_step": [5.0] * 5, "status": ["FINISHED"] * 5,
        "run_id": [c["run_id"] for c in children],
    })
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "study").mkdir()
        comp.to_parquet(Path(tmp) / "study" / "comparison.parquet", index=False)
        client.log_artifacts(parent, str(Path(tmp) / "study"), "study")
    client.set_terminated(parent, "FINISHED")
    out["study"] = {"run_id": parent, "children": children, "comparison": comp}
    return out


def build_seed_study(root: Path, experiment: str = "sage-seeds") -> dict:
    """A hint study over two seeds (GRPO and SAGE-LIGHT, one child run per variant and seed) whose
    `study/comparison` and `study/summary` come from flows/study_flow.py's own table functions."""
    from flows.study_flow import comparison_table, seed_summary

    uri, client = _store(root)
    exp_id = _experiment(client, root, experiment)
    parent = client.create_run(exp_id, run_name="hint-study", tags={"sage.kind": "study", "sage.model": "tiny",
                                                                    "sage.method": "sage-light",
                                                                    "sage.hint_source": "online"}).info.run_id
    after = {("grpo", 0): 0.30, ("sage-light", 0): 0.36, ("grpo", 1): 0.25, ("sage-light", 1): 0.27}
    rows = []
    for (method, seed), acc in after.items():
        kid = log_run(client, exp_id, name=f"{method}-s{seed}", method=method, seed=seed, steps=2, n_prompts=4,
                      parent=parent, tracker=False, eval_after=acc)
        rows.append({"variant": method, "method": method, "hint_source": "online" if method != "grpo" else "none",
                     "seed": seed, "k": 4, "avg_at_k_before": 0.30, "avg_at_k_after": acc,
                     "pass_at_k_after": acc + 0.2, "train_seconds": 10.0 + seed + (3.0 if method != "grpo" else 0.0),
                     "status": "FINISHED", "run_id": kid["run_id"]})
    comp = comparison_table(rows)
    summary = seed_summary(comp)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "study").mkdir()
        comp.to_parquet(Path(tmp) / "study" / "comparison.parquet", index=False)
        summary.to_parquet(Path(tmp) / "study" / "summary.parquet", index=False)
        client.log_artifacts(parent, str(Path(tmp) / "study"), "study")
    client.set_terminated(parent, "FINISHED")
    return {"uri": uri, "experiment_id": exp_id, "run_id": parent, "comparison": comp, "summary": summary}


def write_big_tracker(root: Path, n_prompts: int = 2000, steps: int = 200, G: int = 8,
                      experiment: str = "sage-big", seed: int = 0) -> dict:
    """A run with n_prompts x steps tracker rows (every prompt at every step), vectorised for speed."""
    from mlflow.entities import Metric, Param

    uri, client = _store(root)
    exp_id = _experiment(client, root, experiment)
    rng = np.random.default_rng(seed)
    ids = np.array([f"big-{i:05d}" for i in range(n_prompts)])
    diff = rng.integers(1, 6, n_prompts)
    skill = rng.normal(1.5 - 0.9 * diff, 1.2)
    problems = np.array([f"Ann has {i % 17 + 2} coins . She gets {i % 7 + 1} more . How many coins ?"
                         for i in range(n_prompts)])
    answers = np.array([str(i % 17 + 2 + i % 7 + 1) for i in range(n_prompts)])
    run = client.create_run(exp_id, run_name=f"sage-{n_prompts}x{steps}",
                            tags={"sage.kind": "train", "sage.method": "sage", "sage.hint_source": "online",
                                  "sage.model": "tiny"})
    rid = run.info.run_id
    client.log_batch(rid, params=[Param(k, v) for k, v in _spec_params(num_generations=G, num_prompts=n_prompts,
                                                                       max_steps=steps).items()])
    metrics = []
    ok = np.array(["7 + 1 = 8 . The answer is \\boxed{8} ."] * G, dtype=object)
    with tempfile.TemporaryDirectory() as tmp:
        tdir = Path(tmp) / "tracker"
        tdir.mkdir()
        for step in range(1, steps + 1):
            p = 1 / (1 + np.exp(-(skill + 3.0 * step / steps)))
            k = rng.binomial(G, p)
            state = np.where(k == 0, "all0", np.where(k == G, "all1", "mixed"))
            lvl = np.zeros(n_prompts, np.int64)
            acc = {1: np.full(n_prompts, np.nan), 2: np.full(n_prompts, np.nan), 3: np.full(n_prompts, np.nan)}
            final = k / G
            rescued = np.zeros(n_prompts, bool)
            todo = k == 0
            for level in (1, 2, 3):
                kk = rng.binomial(G, np.minimum(0.95, p + 0.15 * level))
                acc[level] = np.where(todo, kk / G, acc[level])
                lvl = np.where(todo, level, lvl)
                final = np.where(todo, kk / G, final)
                hit = todo & (kk > 0) & (kk < G)
                rescued |= hit
                todo = todo & ~hit
            hint_failed = (k == 0) & ~rescued
            n_ok = np.rint(final * G).astype(int)
            df = pd.DataFrame({
                "step": np.full(n_prompts, step, np.int64), "prompt_id": ids, "problem": problems,
                "answer": answers, "difficulty": diff.astype(np.int64), "base_pass_rate": k / G,
                "base_state": state, "level": lvl, "max_level_tried": lvl, "pass_rate": final, "rescued": rescued,
                "hint": np.where(lvl > 0, "First 7 + 1 = 8 .", None),
                "hint_l1": np.where(lvl >= 1, "Use + .", None), "hint_l2": np.where(lvl >= 2, "First 7 + 1 .", None),
                "hint_l3": np.where(lvl >= 3, "7 + 1 = 8 .", None),
                "acc_l1": acc[1], "acc_l2": acc[2], "acc_l3": acc[3],
                "leak_l1": np.zeros(n_prompts, bool), "leak_l2": np.zeros(n_prompts, bool),
                "leak_l3": np.zeros(n_prompts, bool), "hint_failed": hint_failed,
                "rollouts": (G * (1 + lvl)).astype(np.int64),
                "completions": [list(ok[:G]) for _ in range(n_prompts)],
                "rewards": [[1.0] * int(j) + [0.0] * (G - int(j)) for j in n_ok],
                "method": "sage",
            })
            df.to_parquet(tdir / f"step_{step:06d}.parquet", index=False)
            for key, v in step_metrics(df, G).items():
                metrics.append(Metric(key, v, 1_700_000_000_000 + step, step))
        for i in range(0, len(metrics), 900):
            client.log_batch(rid, metrics=metrics[i:i + 900])
        client.log_artifacts(rid, str(tdir), "tracker")
    client.set_terminated(rid, "FINISHED")
    return {"uri": uri, "experiment_id": exp_id, "experiment": experiment, "run_id": rid, "G": G,
            "n_prompts": n_prompts, "steps": steps}


REAL_SPEC = {"max_steps": 2, "num_prompts": 8, "num_generations": 4, "method": "sage", "eval_every": 1,
             "eval_num_prompts": 8}


def train_real_run(root: Path, experiment: str = "sage") -> dict:
    """A tiny real SAGE training run (tiny-cpu preset, 2 steps, 8 prompts, G=4) logged through
    sage_core.tracking into ``<root>/mlflow.db``, as the flows do: a run opened by ``tracking.start_run`` and the
    tracking callback uploading metrics and tracker files. Run it in a subprocess (``python
    tests/dashboard_fixtures.py --real ROOT``) to keep torch and MLflow's global state out of the caller."""
    import os

    root = Path(root).resolve()
    uri = f"sqlite:///{root / 'mlflow.db'}"
    os.environ["MLFLOW_TRACKING_URI"] = uri
    os.environ.setdefault("SAGE_HOME", str(root))
    from sage_core import tracking
    from sage_core.presets import preset
    from sage_core.train import train

    spec = preset("tiny-cpu", **REAL_SPEC)
    with tracking.start_run(spec, "train", experiment=experiment, run_name="tiny-sage") as run:
        cb = tracking.make_callback(run_id=run.info.run_id, log_checkpoint=False)
        result = train(spec, root / "out", callbacks=[cb])
    return {"uri": uri, "run_id": run.info.run_id, "experiment_id": run.info.experiment_id,
            "experiment": experiment, "global_step": result.global_step}


if __name__ == "__main__":
    # python tests/dashboard_fixtures.py DIR [--big]   a contract store to point the app at
    # python tests/dashboard_fixtures.py --real DIR    a tiny real training run's store (prints JSON)
    import sys

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    target = Path(args[0] if args else tempfile.mkdtemp(prefix="sage-dash-"))
    if "--real" in sys.argv:
        print("SAGE_REAL_STORE=" + json.dumps(train_real_run(target)))
    else:
        info = build_store(target)
        if "--big" in sys.argv:
            write_big_tracker(target)
        print(f"MLFLOW_TRACKING_URI={info['uri']}")


# ----------------------------------------------------------------------------------------------------------------
# pytest fixtures (imported by tests/test_dashboard*.py; built once per session even when both modules use them)

try:
    import pytest
except ImportError:  # pragma: no cover - the module is also a script
    pytest = None

_BUILT: dict[str, dict] = {}

if pytest is not None:

    @pytest.fixture(scope="session")
    def dashboard_store(tmp_path_factory) -> dict:
        """The synthetic contract store (sage + grpo training runs, a hint study with 5 variants)."""
        if "store" not in _BUILT:
            _BUILT["store"] = build_store(tmp_path_factory.mktemp("dash-store"))
        return _BUILT["store"]

    @pytest.fixture(scope="session")
    def real_store(tmp_path_factory, tiny_model_dir) -> dict:
        """The store of a tiny real training run (sage_core.train + the sage_core.tracking callback)."""
        if "real" not in _BUILT:
            import os
            import subprocess
            import sys

            root = tmp_path_factory.mktemp("dash-real-store")
            env = {**os.environ, "SAGE_HOME": str(root), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
            env.pop("MLFLOW_TRACKING_URI", None)
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--real", str(root)], env=env,
                                  cwd=str(Path(__file__).resolve().parents[1]), capture_output=True, text=True,
                                  timeout=900, check=False)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("SAGE_REAL_STORE=")]
            assert proc.returncode == 0 and line, f"tiny training failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
            _BUILT["real"] = json.loads(line[-1].split("=", 1)[1])
        return _BUILT["real"]
