"""Per-prompt tracker files: leftovers of a killed write, and the dtypes of the float columns."""

from __future__ import annotations

import math

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

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
