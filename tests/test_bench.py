"""benchmarks/overhead.py and learning.py, run for real on a small setting: their numbers are the ones the tables
claim."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_overhead_bench_ratios_work_and_signal(tiny_model_dir):
    ob = _bench("overhead")
    rows = ob.run("tiny-cpu", 2, ["grpo", ob.TRL_GRPO, "sage", "sage:lookahead=false"],
                  dict(num_prompts=8, prompts_per_step=4, measure_activations=True), repeats=1)
    by = {r["method"]: r for r in rows}
    # the tiny-cpu preset rolls SAGE's later levels ahead; the variant searches one level per pass
    grpo, trl, sage, seq = by["grpo"], by[ob.TRL_GRPO], by["sage"], by["sage:lookahead=false"]
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
    assert "s/open x" in lines[0] and "x TRL" in lines[0] and len(lines) == 6
    target = ob.TARGETS["sage"]  # the verdicts against this trainer's GRPO, then TRL's
    for line, r in ((lines[4], sage), (lines[5], seq)):  # a variant is judged by its method's target
        verdicts = "/".join("MISS" if x > target else "ok" for x in (r["ratio"], r["vs_trl"]))
        assert line.startswith(r["method"] + " ") and f" <={target} {verdicts} " in line
    assert not math.isnan(sage["gen_share"])
    # the variant ran with its own setting: the same search, one level per pass (the same seed and first rollout;
    # with lookahead the later levels roll in fewer passes, and the ones it rolled ahead and did not need count as
    # spent)
    assert sage["passes"][0] < seq["passes"][0] and sage["rollouts"] >= seq["rollouts"]


def test_overhead_bench_method_variants():
    ob = _bench("overhead")
    assert ob.split_variant("sage") == ("sage", {})
    assert ob.split_variant("sage:lookahead=true:hint-retries=0") == ("sage", {"lookahead": "true",
                                                                             "hint_retries": "0"})
    with pytest.raises(SystemExit):  # an unknown field is refused before anything trains
        ob.main(["--methods", "grpo,sage:lookahed=true"])
    with pytest.raises(SystemExit):
        ob.main(["--methods", "grpo", "--warmup-steps", "0"])


def test_overhead_bench_warms_up_every_step_on_cuda_and_one_on_cpu(monkeypatch):
    import torch

    ob = _bench("overhead")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ob.warmup_steps(8) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ob.warmup_steps(8) == 8


def test_learning_bench_compares_paired_no_hint_scores(tiny_model_dir, capsys):
    """benchmarks/learning.py: each method's no-hint scores after training, paired with the starting model's and
    GRPO's on the same prompts and sampling seed (the evaluation is deterministic, so a change is the training's)."""
    from sage_core.data import build_dataset, eval_rows
    from sage_core.evaluate import evaluate_rows
    from sage_core.models import load_policy
    from sage_core.presets import preset

    lb = _bench("learning")
    over = {"max_steps": 2, "num_prompts": 8, "prompts_per_step": 4, "eval_num_prompts": 8, "eval_k": 2}
    recs = lb.run("tiny-cpu", ["grpo", "sage"], [0], over)
    by = {r["method"]: r for r in recs}
    assert list(by) == [lb.BASE, "grpo", "sage"]
    spec = preset("tiny-cpu", **over)
    held, train = [dict(r) for r in eval_rows(spec)], [dict(r) for r in build_dataset(spec)]
    assert by["sage"]["n_held"] == len(held) == 8
    assert by["sage"]["n_hard"] == sum(r["difficulty"] >= lb.HARD for r in held)
    again = lb._scores(*load_policy("tiny"), (held, train), spec)  # the start, scored again: the same numbers
    assert again == pytest.approx({k: by[lb.BASE][k] for k in again}, abs=0, nan_ok=True)
    # the hard subset's avg@k comes from the held-out samples of its prompts
    res = evaluate_rows(*load_policy("tiny"), held, k=2, temperature=spec.eval_temperature, top_p=spec.eval_top_p,
                        max_new_tokens=spec.max_completion_length, seed=spec.seed)
    assert res["avg_at_k"] == by[lb.BASE]["held_avg"]
    hard = [res["per_prompt"][r["prompt_id"]] for r in held if r["difficulty"] >= lb.HARD]
    assert by[lb.BASE]["hard_avg"] == pytest.approx(sum(hard) / len(hard) if hard else math.nan, nan_ok=True)
    # never solved during training counts hinted successes too: no higher than without hints
    assert by["sage"]["never_solved"] <= by["sage"]["never_solved_no_hint"]
    rows = {r["method"]: r for r in lb.summarize(recs)}
    sage, grpo = rows["sage"], rows["grpo"]
    d = by["sage"]["held_avg"] - by["grpo"]["held_avg"]
    assert sage["held_avg_vs_grpo"] == (d, d, d) and grpo["held_avg_vs_grpo"] is None
    d = by["sage"]["train_avg"] - by[lb.BASE]["train_avg"]
    assert sage["train_avg_vs_start"] == (d, d, d) and rows[lb.BASE]["held_avg_vs_start"] is None
    assert sage["time_x_grpo"] == by["sage"]["train_seconds"] / by["grpo"]["train_seconds"]
    lines = lb.report(list(rows.values()), 2).splitlines()
    assert "held avg@2" in lines[0] and "vs GRPO" in lines[0] and len(lines) == 5
    assert lines[4].startswith("sage") and f"{100 * by['sage']['held_avg']:.1f}" in lines[4]
    with pytest.raises(SystemExit) as e:  # a seed or method given through --set would be silently overridden
        lb.main(["--set", "seed=3"])
    assert e.value.code == 2 and "--seeds" in capsys.readouterr().err
