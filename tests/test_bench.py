"""benchmarks/overhead.py, run for real on a small setting: its ratios are the ones the table claims."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _overhead():
    spec = importlib.util.spec_from_file_location("overhead", ROOT / "benchmarks" / "overhead.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_overhead_bench_ratios_work_and_signal(tiny_model_dir):
    ob = _overhead()
    rows = ob.run("tiny-cpu", 2, ["grpo", ob.TRL_GRPO, "sage"],
                  dict(num_prompts=8, prompts_per_step=4, measure_activations=True), repeats=1)
    by = {r["method"]: r for r in rows}
    grpo, trl, sage = by["grpo"], by[ob.TRL_GRPO], by["sage"]
    assert grpo["ratio"] == grpo["gen_x"] == grpo["train_x"] == trl["vs_trl"] == 1.0
    # stock TRL GRPO rolls out and trains the same rows as method=grpo (counted from TRL's own metrics)
    assert trl["rollouts"] == grpo["rollouts"] and trl["gen_x"] == pytest.approx(1.0)
    assert trl["train_x"] == 1.0 and trl["open_groups"] == pytest.approx(grpo["open_groups"])
    assert sage["vs_trl"] == pytest.approx(sage["seconds"] / trl["seconds"])
    # activation memory: TRL keeps every row's activations for the backward; method=grpo only the rows with a
    # non-zero advantage, and SAGE (more open groups, longer hinted prompts) more than that GRPO
    assert 0 < grpo["activation_mb"] < trl["activation_mb"] and grpo["activation_mb"] < sage["activation_mb"]
    assert sage["ratio"] == pytest.approx(sage["seconds"] / grpo["seconds"])
    # SAGE re-rolls collapsed groups: more rollouts and more tokens generated than GRPO, on the same prompts
    assert sage["rollouts"] > grpo["rollouts"] == 2 * 4 * 8
    assert sage["gen_x"] > 1.0 and sage["gen_x"] == pytest.approx(sage["gen_tokens"] / grpo["gen_tokens"])
    # learning signal: open groups (mixed rewards) as a ratio to GRPO, and the time per open group
    assert 0 <= grpo["open_groups"] <= 8 and sage["open_groups"] >= grpo["open_groups"]
    if grpo["open_groups"]:
        assert grpo["open_x"] == 1.0 and sage["open_x"] == sage["open_groups"] / grpo["open_groups"]
        assert sage["per_open_x"] == pytest.approx(sage["ratio"] / sage["open_x"])
    # sequential generate calls per step: GRPO (both) one rollout pass; SAGE one per level round, plus hint passes
    assert grpo["passes"] == trl["passes"] == (1.0, 0.0)
    assert sage["passes"][0] > 1 and sage["passes"][1] >= 1
    # the time split covers rolling out and writing hints (GRPO writes none)
    assert grpo["hint_share"] == 0 and 0 < grpo["gen_share"] < 1
    assert 0 < sage["hint_share"] and sage["gen_share"] + sage["hint_share"] < 1
    table = ob.report(rows)
    lines = table.splitlines()
    assert "s/open x" in lines[0] and "x TRL" in lines[0] and len(lines) == 5
    target = ob.TARGETS["sage"]  # the verdicts against this trainer's GRPO, then TRL's
    verdicts = "/".join("MISS" if x > target else "ok" for x in (sage["ratio"], sage["vs_trl"]))
    assert lines[4].startswith("sage") and f" <={target} {verdicts} " in lines[4]
    assert not math.isnan(sage["gen_share"])
