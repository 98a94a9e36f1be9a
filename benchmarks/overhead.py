"""Wall-clock overhead of hinting and curation methods against GRPO, on the same setting and the same steps.

    python benchmarks/overhead.py [--preset tiny-cpu] [--steps 8] [--methods grpo,sage-light,sage]

Every method trains from the same warm-started tiny model on the same prompts with the same seed; the table
prints training time (model loading excluded) as a ratio to GRPO, rollouts spent, and the fraction of prompts that
never got a correct rollout. Targets (issue 2): SAGE-LIGHT <= 1.15x GRPO, SAGE <= 1.8x (paper: 1.2x and 2.3x),
and a lower never-solved fraction with SAGE than with GRPO.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGETS = {"sage-light": 1.15, "sage": 1.8}


def run(preset_name: str, steps: int, methods: list[str], overrides: dict) -> list[dict]:
    from sage_core.presets import preset
    from sage_core.train import train

    rows = []
    for method in methods:
        spec = preset(preset_name, method=method, max_steps=steps, **overrides)
        with tempfile.TemporaryDirectory() as out:
            res = train(spec, Path(out), resume=False)
        runtime = next(h["train_runtime"] for h in res.log_history if "train_runtime" in h)
        rows.append(dict(method=method, seconds=runtime, rollouts=res.summary["rollouts"],
                         never_solved=res.summary["never_solved"],
                         never_solved_no_hint=res.summary["never_solved_no_hint"],
                         collapsed=res.summary["frac_collapsed"], rescued=res.summary["rescued"]))
        print(f"  {method}: {runtime:.1f}s", flush=True)
    base = next((r["seconds"] for r in rows if r["method"] == "grpo"), None)
    for r in rows:
        r["ratio"] = r["seconds"] / base if base else float("nan")
    return rows


def report(rows: list[dict]) -> str:
    head = f"{'method':<20}{'train s':>9}{'x GRPO':>8}{'target':>8}{'rollouts':>10}{'never solved':>14}" \
           f"{'(no hint)':>11}{'collapsed':>11}{'rescued':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        target = TARGETS.get(r["method"])
        mark = "" if target is None else (f"<={target}" + (" ok" if r["ratio"] <= target else " MISS"))
        lines.append(f"{r['method']:<20}{r['seconds']:>9.1f}{r['ratio']:>8.2f}{mark:>8}{r['rollouts']:>10.0f}"
                     f"{r['never_solved']:>14.3f}{r['never_solved_no_hint']:>11.3f}{r['collapsed']:>11.3f}"
                     f"{r['rescued']:>9.0f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-cpu")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--methods", default="grpo,sage-light,sage,dapo-filter,ada-seq,ada-est,sage-light+ada-seq")
    ap.add_argument("--prompts", type=int, default=None, help="num_prompts override")
    args = ap.parse_args(argv)
    overrides = {"num_prompts": args.prompts} if args.prompts else {}
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if "grpo" not in methods:
        methods.insert(0, "grpo")
    rows = run(args.preset, args.steps, methods, overrides)
    print(report(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
