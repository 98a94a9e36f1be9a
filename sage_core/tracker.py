"""Per-prompt tracker: what happened to every prompt id at every step, one Parquet file per step.

Files are written once (`tracker/step_000012.parquet`) and never rewritten, so a long run costs O(batch) I/O per
step (a resumed run first discards the files of steps after its checkpoint, which it trains again). Reloading
them rebuilds the run's memory: which prompts were ever solved, and (by replaying
`scheduler.observe`) the SAGE-LIGHT levels, so a resumed run continues where it stopped. A replay reads only the
columns it needs (REPLAY_COLUMNS), not the completions and hints that make up most of a file; a checkpoint that
holds the state itself (SageGRPOTrainer._save_checkpoint) is resumed without replaying at all.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from .data import DataError

_FILE = re.compile(r"step_(\d+)\.parquet")  # one file per step: tracker/step_000012.parquet

COLUMNS = [
    "step", "prompt_id", "problem", "answer", "difficulty", "base_pass_rate", "base_state", "level",
    "max_level_tried", "pass_rate", "rescued", "hint", "hint_l1", "hint_l2", "hint_l3", "acc_l1", "acc_l2",
    "acc_l3", "leak_l1", "leak_l2", "leak_l3", "hint_failed", "rollouts", "completions", "rewards", "pilot_rewards",
    "method", "origin_id", "trained",
]
# float columns, NaN where a step has no value (a level not tried): float64 in every file, never a column of None
FLOAT_COLUMNS = ["base_pass_rate", "pass_rate", "acc_l1", "acc_l2", "acc_l3"]
# what a resume's replay reads of a record: `_absorb` (prompt_id, level and the pass rates), the trainer's
# restore_state (trained, then prompt_id, level, rewards and pilot_rewards, all that any scheduler's observe gets)
# and `step` (for order and messages). A file written before a column existed (`trained`) is read without it.
REPLAY_COLUMNS = ["step", "prompt_id", "level", "pass_rate", "base_pass_rate", "acc_l1", "acc_l2", "acc_l3",
                  "trained", "rewards", "pilot_rewards"]


class PromptTracker:
    def __init__(self, directory: str | Path, write: bool = True):
        self.dir = Path(directory)
        self.write = write
        self.seen: set[str] = set()
        self.solved: set[str] = set()  # any correct rollout so far, hinted or not
        self.solved_no_hint: set[str] = set()  # a correct rollout with no hint

    # -- bookkeeping ----------------------------------------------------------------------------------------
    def _absorb(self, rec: dict) -> None:
        pid = rec["prompt_id"]
        self.seen.add(pid)
        accs = [rec.get("acc_l1"), rec.get("acc_l2"), rec.get("acc_l3"), rec.get("pass_rate")]
        if any(a is not None and not _isnan(a) and a > 0 for a in accs):
            self.solved.add(pid)
        base = rec.get("base_pass_rate")
        if base is not None and not _isnan(base) and base > 0:
            self.solved.add(pid)
            self.solved_no_hint.add(pid)
        if rec.get("level", 0) == 0 and rec.get("pass_rate", 0) > 0:
            self.solved_no_hint.add(pid)

    def state(self) -> dict:
        """The prompts seen and solved so far, as JSON (a checkpoint keeps them: a resume need not replay)."""
        return {"seen": sorted(self.seen), "solved": sorted(self.solved), "solved_no_hint": sorted(self.solved_no_hint)}

    def load_state(self, state: dict) -> None:
        self.seen, self.solved = set(state["seen"]), set(state["solved"])
        self.solved_no_hint = set(state["solved_no_hint"])

    def never_solved(self) -> float:
        """Fraction of prompts seen so far with no correct rollout at all (the paper's Table 2 statistic)."""
        return 1.0 - len(self.solved) / len(self.seen) if self.seen else float("nan")

    def never_solved_no_hint(self) -> float:
        return 1.0 - len(self.solved_no_hint) / len(self.seen) if self.seen else float("nan")

    # -- files ----------------------------------------------------------------------------------------------
    def record(self, step: int, records: list[dict]) -> Path | None:
        for rec in records:
            self._absorb(rec)
        if not self.write or not records:
            return None
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"step_{step:06d}.parquet"
        df = pd.DataFrame([{c: rec.get(c) for c in COLUMNS} | {"step": step} for rec in records], columns=COLUMNS)
        df[FLOAT_COLUMNS] = df[FLOAT_COLUMNS].astype("float64")  # all None (no prompt tried level 3): NaN, not null
        tmp = path.with_suffix(".parquet.tmp")
        df.to_parquet(tmp, index=False)
        tmp.replace(path)
        return path

    def files(self, up_to_step: int | None = None) -> list[Path]:
        """The step files (`step_000012.parquet`), in step order; other names the glob matches (a user's copy,
        `step_000012 (copy).parquet`) are no step's file: never read, counted or deleted."""
        files = step_files(self.dir)
        if up_to_step is not None:
            files = [f for f in files if step_of(f.name) <= up_to_step]
        return files

    def discard_after(self, step: int) -> list[Path]:
        """Delete the files of steps after `step` (a run resuming from that step's checkpoint, or 0 for a fresh
        start): they belong to a trajectory the run does not follow, e.g. steps a killed run wrote after its last
        checkpoint. Returns them; only the writing process deletes. It also deletes the `step_*.parquet.tmp` files
        of any step (not returned): `record` writes one and renames it at once, so one that is there was left by
        a process killed in between (the step's file, if the rename happened, is whole)."""
        stale = [f for f in self.files() if step_of(f.name) > step]
        if self.write:
            for f in stale:
                f.unlink(missing_ok=True)
            for f in self.dir.glob("step_*.parquet.tmp"):
                f.unlink(missing_ok=True)
        return stale

    def reload(self, up_to_step: int | None = None, columns: list[str] = REPLAY_COLUMNS) -> Iterable[dict]:
        """Absorb the files of steps <= up_to_step and yield their records in step order (for scheduler replay),
        each with the `columns` its file has."""
        for f in self.files(up_to_step):
            try:
                records = _read_records(f, columns)
            except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
                raise _unreadable(f, e) from e
            for rec in records:
                self._absorb(rec)
                yield rec

    def check_files(self, up_to_step: int | None = None) -> None:
        """Open the files of steps <= up_to_step as a replay would, reading only their footers: a resume refuses,
        naming it, a file cut short (its footer is the file's end) before the policy loads, also where it then takes
        its state from the checkpoint and reads no file (train.check_tracker_files)."""
        for f in self.files(up_to_step):
            try:
                with pq.ParquetFile(f):
                    pass
            except (OSError, ValueError) as e:
                raise _unreadable(f, e) from e


def _unreadable(path: Path, e: Exception) -> DataError:
    return DataError(f"tracker file {path} cannot be read ({type(e).__name__}: {e}); the run's per-prompt state is "
                     "replayed from it on resume and it is the run's record: restore it, or start over (--no-resume)")


def read_tracker(directory: str | Path, columns: list[str] | None = None) -> pd.DataFrame:
    """All tracker files of a run as one frame (pyarrow reads only the requested columns)."""
    files = step_files(directory)
    if not files:
        df = pd.DataFrame(columns=columns or COLUMNS)
    else:
        df = pd.concat([pd.read_parquet(f, columns=columns) for f in files], ignore_index=True)
    for c in FLOAT_COLUMNS:  # files written before these were float64 hold None in an object column where a step
        if c in df.columns:  # had no value at all
            df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    return df


def _read_records(path: Path, columns: list[str]) -> list[dict]:
    """The rows of one tracker file as dicts of the `columns` it has, read with pyarrow alone: a replay of a long run
    reads thousands of files, and pandas' frame and its to_dict took most of the time (3000 steps of 256: 43 s -> 9 s).
    The values are Python's (lists of floats where pandas gave numpy arrays); a float column's null (how pyarrow
    stores a NaN pandas wrote, or an older file's None) is NaN, as pandas gives it for float64 columns."""
    with pq.ParquetFile(path) as pf:
        names = set(pf.schema_arrow.names)
        cols = pf.read(columns=[c for c in columns if c in names], use_threads=False).to_pydict()
    for c in FLOAT_COLUMNS:
        if c in cols:
            cols[c] = [math.nan if v is None else v for v in cols[c]]
    keys = list(cols)
    return [dict(zip(keys, row, strict=True)) for row in zip(*cols.values(), strict=True)]


def _isnan(x) -> bool:
    try:
        return math.isnan(x)
    except TypeError:
        return False


def step_files(directory: str | Path) -> list[Path]:
    """The tracker files of `directory` (names step_of reads), in step order."""
    return sorted((f for f in Path(directory).glob("step_*.parquet") if step_of(f.name) is not None),
                  key=lambda f: step_of(f.name))


def step_of(name: str) -> int | None:
    """The step of a tracker file name, `step_000012.parquet` -> 12; None for any other name."""
    m = _FILE.fullmatch(name)
    return int(m.group(1)) if m else None
