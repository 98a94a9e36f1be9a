"""Per-prompt tracker files: leftovers of a killed write, the dtypes of the float columns, what a replay reads."""

from __future__ import annotations

import math

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sage_core.tracker import COLUMNS, FLOAT_COLUMNS, PromptTracker, read_tracker


def _rec(pid: str, **kw) -> dict:
    rec = {c: None for c in COLUMNS}
    rec.update(prompt_id=pid, problem="q", answer="3", difficulty=1, base_pass_rate=0.0, base_state="all0", level=0,
               max_level_tried=0, pass_rate=0.0, rescued=False, leak_l1=False, leak_l2=False, leak_l3=False,
               hint_failed=False, rollouts=4, completions=["x"] * 4, rewards=[0.0] * 4, pilot_rewards=[0.0] * 4,
               method="sage", origin_id=pid, trained=True)
    return rec | kw


def test_resume_removes_the_tmp_files_of_a_killed_write_and_keeps_the_step_files(tmp_path):
    """`record` writes step_N.parquet.tmp, then renames it: a process killed in between left the .tmp for good.
    The resume's discard (and a fresh start's, discard_after(0)) removes every such leftover, whatever its step,
    and only the step files after the checkpoint; a reading tracker deletes nothing."""
    tracker = PromptTracker(tmp_path)
    for step in (1, 2, 3):
        tracker.record(step, [_rec("a")])
    for step in (2, 4):  # killed while writing step 4 (after the checkpoint) and, say, an old one at step 2
        (tmp_path / f"step_{step:06d}.parquet.tmp").write_bytes(b"half a parquet")
    (tmp_path / "notes.tmp").write_text("not the tracker's")

    assert PromptTracker(tmp_path, write=False).discard_after(2) == [tmp_path / "step_000003.parquet"]
    assert len(list(tmp_path.glob("*.parquet.tmp"))) == 2 and (tmp_path / "step_000003.parquet").exists()

    stale = PromptTracker(tmp_path).discard_after(2)
    assert stale == [tmp_path / "step_000003.parquet"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.tmp", "step_000001.parquet", "step_000002.parquet"]
    assert read_tracker(tmp_path)["step"].tolist() == [1, 2]


def test_float_columns_are_float_with_nan_where_a_step_has_no_value(tmp_path):
    """A step where no prompt tried level 3 (or every row's value is None) still writes acc_l3 as float64 NaN, not a
    null-typed column that pandas reads back as objects holding None (and that turned the whole column of
    read_tracker into objects)."""
    tracker = PromptTracker(tmp_path)
    tracker.record(1, [_rec("a", acc_l1=0.25), _rec("b")])
    tracker.record(2, [_rec("a", base_pass_rate=None, pass_rate=0.5)])
    schema = pq.read_schema(tmp_path / "step_000002.parquet")
    assert all(schema.field(c).type == pa.float64() for c in FLOAT_COLUMNS)
    df = read_tracker(tmp_path)
    assert all(df[c].dtype == "float64" for c in FLOAT_COLUMNS)
    assert df["acc_l1"].iloc[0] == 0.25 and df["acc_l1"].iloc[1:].isna().all()
    assert df[["acc_l2", "acc_l3"]].isna().all().all() and math.isnan(df["base_pass_rate"].iloc[2])
    assert (df["acc_l1"] > 0.1).tolist() == [True, False, False]  # numeric comparison, as the dashboard does


def test_old_files_with_object_float_columns_read_as_float(tmp_path):
    """Files written before the fix hold a null-typed acc_l* column (objects, None) where a step had no value;
    read_tracker gives float64 with NaN over old and new files together, and a replay still reads them."""
    old = pd.DataFrame([{c: v for c, v in (_rec("a") | {"step": 1}).items()}], columns=COLUMNS)
    old.to_parquet(tmp_path / "step_000001.parquet", index=False)
    assert pd.read_parquet(tmp_path / "step_000001.parquet")["acc_l2"].dtype == object
    PromptTracker(tmp_path).record(2, [_rec("a", acc_l2=0.75)])
    df = read_tracker(tmp_path)
    assert df["acc_l2"].dtype == "float64" and math.isnan(df["acc_l2"].iloc[0]) and df["acc_l2"].iloc[1] == 0.75
    assert read_tracker(tmp_path, columns=["step", "acc_l3"])["acc_l3"].dtype == "float64"
    replay = PromptTracker(tmp_path, write=False)
    assert [r["step"] for r in replay.reload()] == [1, 2] and replay.solved == {"a"}


def _full_read_replay(directory, scheduler):
    """What a resume did before the replay read only its columns: every column through pandas, records from
    to_dict, then restore_state's loop (the reference the column-pruned replay is checked against)."""
    tracker = PromptTracker(directory, write=False)
    for f in tracker.files():
        for rec in pd.read_parquet(f).to_dict("records"):
            tracker._absorb(rec)
            if rec.get("trained") is not None and not rec["trained"]:
                continue
            scheduler.observe(rec["prompt_id"], int(rec["level"]), [float(x) for x in rec["rewards"]],
                              [float(x) for x in rec["pilot_rewards"]])
    return tracker


def _simulated_run(directory, method: str, steps: int = 12, seed: int = 0):
    """A run's tracker written by PromptTracker.record from records as the trainer makes them (hint levels from a
    live scheduler, NaN/None where a level was not tried, hints and completions, swapped-out rows with trained
    False), after an older file without the `trained` and `origin_id` columns whose float columns are null-typed.
    Returns the live scheduler and tracker (the state a resume must rebuild)."""
    import random

    from sage_core import gate
    from sage_core.schedulers import make_scheduler

    rng = random.Random(seed)
    live, tracker = make_scheduler(method, num_generations=4), PromptTracker(directory)
    old = [_rec(f"p{i}", acc_l1=None, acc_l2=None, acc_l3=None, rewards=[1.0, 0.0, 0.0, 0.0],
                pilot_rewards=[1.0, 0.0, 0.0, 0.0], pass_rate=0.25, base_pass_rate=0.25) for i in range(3)]
    pd.DataFrame([r | {"step": 1} for r in old], columns=[c for c in COLUMNS if c not in ("trained", "origin_id")]
                 ).to_parquet(directory / "step_000001.parquet", index=False)
    for r in old:
        tracker._absorb(r)
        live.observe(r["prompt_id"], 0, r["rewards"], r["pilot_rewards"])
    for step in range(2, steps + 1):
        recs = []
        for pid in rng.sample([f"p{i}" for i in range(20)], 6):
            level = live.level_before(pid)
            pilot = [float(rng.random() < 0.3 + 0.2 * level) for _ in range(4)]
            rewards = pilot if rng.random() < 0.7 else [float(rng.random() < 0.5) for _ in range(4)]
            acc = {lvl: gate.pass_rate(rewards) if lvl == level else None for lvl in (1, 2, 3)}
            hint = f"hint {pid} {level}" if level else None
            swapped = rng.random() < 0.15  # dapo-filter rolled it, then trained a fresh prompt in its slot
            recs.append(_rec(pid, level=level, max_level_tried=level, base_pass_rate=gate.pass_rate(pilot)
                             if level == 0 else float("nan"), base_state="na" if level else gate.group_state(pilot),
                             pass_rate=gate.pass_rate(rewards), hint=hint,
                             **({f"hint_l{level}": hint} if level else {}),
                             acc_l1=acc[1], acc_l2=acc[2], acc_l3=acc[3], rewards=rewards, pilot_rewards=pilot,
                             completions=[f"step {step} {pid} \\boxed{{{j}}}" for j in range(4)], method=method,
                             trained=not swapped, origin_id="slot" if swapped else pid))
            if not swapped:
                live.observe(pid, level, rewards, pilot)
        tracker.record(step, recs)
    return live, tracker


@pytest.mark.parametrize("method", ["sage-light", "ada-est", "sage-light+ada-seq", "sage-light-log"])
def test_replay_reads_only_its_columns_and_rebuilds_the_full_reads_state(tmp_path, method):
    """A resume replays every tracker file; reading all columns (completions, hints) through pandas made it take a
    minute on a long run. The replay reads only REPLAY_COLUMNS, with pyarrow, and rebuilds exactly the state the
    full read rebuilt (and the live run had): SAGE-LIGHT levels, ada-est's pilot history, the solved sets, over
    an older file lacking columns too. Its values are those the replay saw before (lists for arrays, NaN)."""
    from types import SimpleNamespace

    from sage_core.schedulers import make_scheduler
    from sage_core.tracker import REPLAY_COLUMNS
    from sage_core.trainer import SageGRPOTrainer

    name, weighting = (method[:-4], "log") if method.endswith("-log") else (method, "none")
    live, live_tracker = _simulated_run(tmp_path, name)
    before = make_scheduler(name, weighting=weighting)
    full = _full_read_replay(tmp_path, before)
    now = SimpleNamespace(tracker=PromptTracker(tmp_path, write=False), _pool_pos=0,  # a trainer's parts it uses
                          scheduler=make_scheduler(name, weighting=weighting),
                          _saved_by_process=lambda *a: None, _saved_state=lambda *a: None)
    count = SageGRPOTrainer.restore_state(now, 12)
    assert count == sum(bool(r.get("trained", True)) for f in now.tracker.files()
                        for r in pd.read_parquet(f).to_dict("records"))  # swapped-out rows are not observed
    assert now.scheduler.state() == before.state() == live.state() and live.state()
    for t in (full, live_tracker):
        assert (now.tracker.seen, now.tracker.solved, now.tracker.solved_no_hint) == (t.seen, t.solved,
                                                                                       t.solved_no_hint)
    assert now.tracker.solved and (name == "ada-est" or now.tracker.solved_no_hint != now.tracker.solved)  # hinted
    got = list(PromptTracker(tmp_path, write=False).reload())
    want = [r for f in sorted(tmp_path.glob("step_*.parquet")) for r in pd.read_parquet(f).to_dict("records")]
    assert len(got) == len(want) and "trained" not in got[0] and "trained" in got[-1]  # the old file lacks it
    for g, w in zip(got, want, strict=True):
        assert set(g) == set(REPLAY_COLUMNS) & set(w)  # no completions, hints or other columns read
        for c, v in g.items():
            ref = w[c]
            if c in FLOAT_COLUMNS:
                assert isinstance(v, float) and (v == ref or math.isnan(v) and (ref is None or math.isnan(ref)))
            elif c in ("rewards", "pilot_rewards"):
                assert type(v) is list and v == [float(x) for x in ref] and all(type(x) is float for x in v)
            else:
                assert v == ref and type(v) in (int, str, bool), (c, v, ref)


def test_other_files_beside_the_step_files_are_no_steps(tmp_path):
    """A file the step glob matches but whose name is no step's (a user's copy, `step_000002 (copy).parquet`) made
    files(), discard_after() and reload() fail with a TypeError (None <= int): a resume (check_tracker_files) died
    with a traceback. It is no step's file: never read, counted or deleted; read_tracker leaves it out too."""
    import shutil

    from sage_core.tracker import read_tracker

    tracker = PromptTracker(tmp_path)
    for step in (1, 2, 3):
        tracker.record(step, [{"prompt_id": "a", "level": 0, "pass_rate": 0.5, "rewards": [1.0, 0.0],
                               "pilot_rewards": []}])
    copy = tmp_path / "step_000002 (copy).parquet"
    shutil.copy(tmp_path / "step_000002.parquet", copy)
    assert [f.name for f in tracker.files(2)] == ["step_000001.parquet", "step_000002.parquet"]
    assert [r["step"] for r in PromptTracker(tmp_path, write=False).reload(3)] == [1, 2, 3]
    assert [f.name for f in tracker.discard_after(2)] == ["step_000003.parquet"]
    assert copy.exists() and sorted(read_tracker(tmp_path)["step"]) == [1, 2]
