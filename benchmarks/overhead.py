"""Wall-clock overhead of hinting and curation methods against GRPO, on the same setting and the same steps.

    python benchmarks/overhead.py [--preset tiny-cpu] [--steps 8] [--methods grpo,sage-light,sage] [--repeats 3]
    python benchmarks/overhead.py --methods grpo,sage,sage:lookahead=true --set use_vllm=true   # a variant

A method may carry settings of its own after colons (`sage:lookahead=true:hint_retries=0`, RunSpec fields as in
--set): a variant of a method, timed in the same rounds as the others and named by that string in the table.

Every method trains from the same warm-started tiny model on the same prompts with the same seed. The table prints
training time (model loading excluded) as a ratio to GRPO (this trainer's, method=grpo) and to TRL's own
GRPOTrainer on the same config (`trl-grpo`, what a user would otherwise run: it trains the same rollouts to the
same weights, but every row, zero-advantage ones included, through one padded backward); the work behind the time
as ratios to GRPO that do not depend on the machine (completion tokens generated, re-rolls and hints included;
tokens trained, prompt + completion); the learning signal (groups trained with mixed rewards, an open gate) as a
ratio to GRPO and the time per such group as a ratio to GRPO's (`s/open x` below 1: cheaper signal than GRPO's);
the split of each method's time between rolling out, writing hints and the update; the activation memory of the
loss's forward (`act MB`: bytes saved for backward per micro-batch, largest step; sage_core/memory.py); the
sequential generate calls per step (`passes`, rollout + hint: on vLLM a pass costs about its longest completion
whatever its width); rollouts spent, and the fraction of prompts that never got a correct rollout. Runs of a
few seconds are noisy on a shared machine, so each repeat runs every method once (in a rotated order), each
method's ratio is taken against the GRPO run of the same repeat, and the table shows the median ratio with its
range. A warm-up run of every method comes first and is not timed: one step on CPU, all --steps on CUDA, where a
method's first full run was much slower than its later ones behind a one-step warm-up (H200, tiny-cpu: SAGE 17-21 s,
then 6-9 s; presumably kernels prepared for the shapes its later steps bring; not profiled).
Targets (issue 2): SAGE-LIGHT <= 1.15x GRPO, SAGE <= 1.8x (paper: 1.2x and 2.3x), and a lower never-solved
fraction with SAGE than with GRPO. The `target` column gives the verdict against this trainer's GRPO, then against
TRL's GRPOTrainer (`ok/MISS`): the paper's GRPO trains every row as TRL's does, while this trainer's skips the
backward of the collapsed groups that SAGE opens.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGETS = {"sage-light": 1.15, "sage": 1.8}


TRL_GRPO = "trl-grpo"  # TRL's own GRPOTrainer on the same config, data, model and reward
FLAG_FIELDS = {"method": "--methods", "max_steps": "--steps"}  # RunSpec fields a flag sets, not --set or a variant


@contextlib.contextmanager
def _quiet():
    """The trainers' per-step log lines, away from the table: into a real file, as vLLM needs stdout's descriptor."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield


def run_trl_grpo(spec) -> dict:
    """Stock trl.GRPOTrainer: its time, and the same work and signal counts from TRL's own metrics."""
    from transformers import set_seed

    from sage_core.train import build_trl_grpo_trainer, release_vllm

    with tempfile.TemporaryDirectory() as out, _quiet():
        set_seed(spec.seed)
        trainer = build_trl_grpo_trainer(spec, Path(out))
        trainer.train()
        release_vllm(trainer)  # with use_vllm: free the engine for the next method's
    history = trainer.state.log_history
    steps = [h for h in history if "frac_reward_zero_std" in h]
    rows, nan = spec.prompts_per_step * spec.num_generations, math.nan
    return dict(method=TRL_GRPO, seconds=next(h["train_runtime"] for h in history if "train_runtime" in h),
                rollouts=rows * len(steps), gen_tokens=sum(h["completions/mean_length"] * rows for h in steps),
                train_tokens=max(h["num_tokens"] for h in steps),
                open_groups=sum((1 - h["frac_reward_zero_std"]) * spec.prompts_per_step for h in steps),
                activation_mb=max((h["sage/activation_mb"] for h in history if "sage/activation_mb" in h),
                                  default=nan),
                gen_seconds=nan, hint_seconds=nan, never_solved=nan, never_solved_no_hint=nan, passes=(1.0, 0.0),
                collapsed=sum(h["frac_reward_zero_std"] for h in steps) / len(steps), rescued=0)


def split_variant(name: str) -> tuple[str, dict]:
    """`sage:lookahead=true:hint_retries=0` -> ("sage", {"lookahead": "true", "hint_retries": "0"}): a method and
    the RunSpec fields its variant sets (checked as --set's are: an unknown field is named)."""
    from sage_core.cli import parse_sets

    method, *pairs = name.split(":")
    return method.strip(), parse_sets(pairs)


def run_once(preset_name: str, steps: int, method: str, overrides: dict) -> dict:
    from sage_core.presets import preset
    from sage_core.train import train

    name, (method, own) = method, split_variant(method)
    overrides = {**overrides, **own}
    spec = preset(preset_name, method="grpo" if method == TRL_GRPO else method, max_steps=steps, **overrides)
    if method == TRL_GRPO:
        return {**run_trl_grpo(spec), "method": name}
    with tempfile.TemporaryDirectory() as out, _quiet():
        res = train(spec, Path(out), resume=False)
    return dict(method=name, seconds=res.summary["train_seconds"], rollouts=res.summary["rollouts"],
                gen_tokens=res.summary["gen_tokens"], train_tokens=res.summary["train_tokens"],
                open_groups=res.summary["open_groups"], gen_seconds=res.summary["gen_seconds"],
                hint_seconds=res.summary["hint_seconds"], activation_mb=res.summary["activation_mb"],
                passes=(res.summary["rollout_passes"] / steps, res.summary["hint_passes"] / steps),
                never_solved=res.summary["never_solved"], never_solved_no_hint=res.summary["never_solved_no_hint"],
                collapsed=res.summary["frac_collapsed"], rescued=res.summary["rescued"])


def warmup_steps(steps: int) -> int:
    """Steps of the untimed warm-up run: all of them on CUDA (a first full run is slow there), else one."""
    import torch

    return steps if torch.cuda.is_available() else 1


def run(preset_name: str, steps: int, methods: list[str], overrides: dict, repeats: int = 1,
        warmup: int = 1) -> list[dict]:
    """`repeats` rounds of every method (order rotated each round); per method: the median time, the median of
    the per-round ratios to GRPO and their range, and the first round's training outcomes (same seed each round)."""
    for method in methods:  # warm-up, not timed: imports, first calls, allocations, compiled kernels
        run_once(preset_name, warmup, method, overrides)
    rounds = []
    for k in range(repeats):
        order = methods[k % len(methods):] + methods[:k % len(methods)]
        got = {}
        for method in order:
            got[method] = run_once(preset_name, steps, method, overrides)
            print(f"  round {k + 1}/{repeats} {method}: {got[method]['seconds']:.1f}s", flush=True)
        rounds.append(got)
    rows = []
    base = rounds[0].get("grpo")
    for method in methods:
        runs = [r[method] for r in rounds]
        work = {k: runs[0][k] / base[k] if base and base[k] else math.nan
                for k in ("gen_tokens", "train_tokens", "open_groups")}
        ratios = [r[method]["seconds"] / r["grpo"]["seconds"] for r in rounds] if "grpo" in methods else [math.nan]
        ratio = statistics.median(ratios)
        vs_trl = statistics.median(r[method]["seconds"] / r[TRL_GRPO]["seconds"] for r in rounds) if (
            TRL_GRPO in methods) else math.nan
        rows.append({**runs[0], "gen_x": work["gen_tokens"], "train_x": work["train_tokens"],
                     "open_x": work["open_groups"], "per_open_x": ratio / work["open_groups"] if work["open_groups"]
                     else math.nan, "seconds": statistics.median(x["seconds"] for x in runs),
                     "gen_share": statistics.median(x["gen_seconds"] / x["seconds"] for x in runs),
                     "hint_share": statistics.median(x["hint_seconds"] / x["seconds"] for x in runs),
                     "ratio": ratio, "ratio_min": min(ratios), "ratio_max": max(ratios), "vs_trl": vs_trl})
    return rows


def _num(v: float, width: int, fmt: str = ".3f") -> str:
    return f"{'-':>{width}}" if math.isnan(v) else f"{v:>{width}{fmt}}"


def _verdict(ratio: float, target: float) -> str:
    return "-" if math.isnan(ratio) else ("ok" if ratio <= target else "MISS")


def report(rows: list[dict]) -> str:
    head = (f"{'method':<20}{'train s':>9}{'x GRPO':>8}{'range':>12}{'target GRPO/TRL':>18}{'x TRL':>7}"
            f"{'gen/hint/upd %':>16}{'gen tok x':>10}{'train tok x':>12}{'open x':>8}{'s/open x':>9}{'act MB':>8}"
            f"{'passes':>10}{'rollouts':>10}{'never solved':>14}{'(no hint)':>11}{'collapsed':>11}{'rescued':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        target = TARGETS.get(r["method"].split(":")[0])
        mark = "" if target is None else f"<={target} {_verdict(r['ratio'], target)}/" + _verdict(
            r.get("vs_trl", math.nan), target)
        spread = f"{r.get('ratio_min', r['ratio']):.2f}-{r.get('ratio_max', r['ratio']):.2f}"
        g, h = r.get("gen_share", math.nan), r.get("hint_share", math.nan)
        split = "-" if math.isnan(g) or math.isnan(h) else f"{100 * g:.0f}/{100 * h:.0f}/{100 * (1 - g - h):.0f}"
        passes = "{:.1f}+{:.1f}".format(*r["passes"]) if "passes" in r else "-"
        lines.append(f"{r['method']:<20}{r['seconds']:>9.1f}{r['ratio']:>8.2f}{spread:>12}{mark:>18}"
                     f"{r.get('vs_trl', math.nan):>7.2f}{split:>16}"
                     f"{r.get('gen_x', math.nan):>10.2f}{r.get('train_x', math.nan):>12.2f}"
                     f"{r.get('open_x', math.nan):>8.2f}{r.get('per_open_x', math.nan):>9.2f}"
                     f"{_num(r.get('activation_mb', math.nan), 8, '.2f')}{passes:>10}{r['rollouts']:>10.0f}"
                     f"{_num(r['never_solved'], 14)}{_num(r['never_solved_no_hint'], 11)}{r['collapsed']:>11.3f}"
                     f"{r['rescued']:>9.0f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-cpu")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--methods", default=f"grpo,{TRL_GRPO},sage-light,sage,dapo-filter,ada-seq,ada-est,"
                                         "sage-light+ada-seq")
    ap.add_argument("--prompts", type=int, default=None, help="num_prompts override")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a RunSpec field for every method (repeatable), e.g. --set hint_temperature=1.0")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every method; ratios are medians over rounds")
    ap.add_argument("--warmup-steps", type=int, default=None,
                    help="steps of each method's untimed warm-up run (default: 1 on CPU, --steps on CUDA)")
    args = ap.parse_args(argv)
    from sage_core.cli import SpecError, parse_sets

    try:  # the CLI's own parser: unknown fields are named, values are coerced by RunSpec
        overrides = parse_sets(args.set)
    except SpecError as e:
        ap.error(str(e))
    if taken := sorted(FLAG_FIELDS.keys() & overrides.keys()):  # preset() would get the field twice
        ap.error(f"--set {taken[0]}: use {FLAG_FIELDS[taken[0]]}")
    if args.prompts:
        overrides["num_prompts"] = args.prompts
    overrides.setdefault("measure_activations", True)  # the act MB column (a saved-tensor hook: cheap)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        for m in methods:
            if taken := sorted(FLAG_FIELDS.keys() & split_variant(m)[1].keys()):
                ap.error(f"--methods {m}: a variant sets no {taken[0]} (use {FLAG_FIELDS[taken[0]]})")
    except SpecError as e:
        ap.error(f"--methods: {e}")
    if "grpo" not in methods:
        methods.insert(0, "grpo")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    warmup = warmup_steps(args.steps) if args.warmup_steps is None else args.warmup_steps
    if warmup < 1:
        ap.error("--warmup-steps must be at least 1")
    rows = run(args.preset, args.steps, methods, overrides, args.repeats, warmup)
    print(report(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
