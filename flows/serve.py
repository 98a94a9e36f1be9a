"""Serve every SAGE deployment from one process (no work pool needed), at most `--limit` runs at a time.

    python -m flows.serve                     # all deployments, limit 1 (2-core machines)
    python -m flows.serve --only sage-train   # just the sage-train/<preset> deployments

Deployments (FLOW/NAME): sage-train/<preset> and hint-study/<preset> for every preset in sage_core.presets
(tiny-cpu, smollm2-cpu, and the GPU presets, which train through `accelerate launch`), sage-eval/default.
Each deployment's default parameters are just `{"preset": <name>}`; override any RunSpec field per run with
`--param field=value`. Needs PREFECT_API_URL pointing at a running `prefect server start` (`make up` does both).
"""

from __future__ import annotations

import argparse
import sys

from prefect import serve
from prefect.deployments.runner import EntrypointType

from sage_core.presets import PRESETS

FLOW_NAMES = ("sage-train", "sage-eval", "hint-study")


def is_gpu_preset(name: str) -> bool:
    return bool(PRESETS[name].get("use_vllm"))


def deployments(only: set[str] | None = None, presets: list[str] | None = None) -> list:
    from flows.eval_flow import sage_eval
    from flows.study_flow import hint_study
    from flows.train_flow import sage_train

    chosen = list(presets or PRESETS)
    unknown = [p for p in chosen if p not in PRESETS]
    if unknown:
        raise SystemExit(f"unknown presets {unknown}; choose from {sorted(PRESETS)}")
    want = set(only or FLOW_NAMES)
    kw = dict(entrypoint_type=EntrypointType.MODULE_PATH)
    out = []
    if "sage-train" in want:
        for p in chosen:
            out.append(sage_train.to_deployment(
                name=p, parameters={"preset": p}, tags=["sage", "gpu" if is_gpu_preset(p) else "cpu"],
                description=f"One SAGE/GRPO training run from preset {p!r} (override fields with --param).", **kw))
    if "sage-eval" in want:
        out.append(sage_eval.to_deployment(name="default", tags=["sage", "eval"],
                                           description="No-hint avg@k / pass@k of a model or checkpoint.", **kw))
    if "hint-study" in want:
        for p in chosen:
            out.append(hint_study.to_deployment(
                name=p, parameters={"preset": p}, tags=["sage", "study", "gpu" if is_gpu_preset(p) else "cpu"],
                description=f"GRPO vs SAGE-LIGHT vs SAGE (online/fixed/teacher hints) on preset {p!r}.", **kw))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flows.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", choices=FLOW_NAMES, help="serve only these flows (repeatable)")
    ap.add_argument("--preset", action="append", help="only these presets (repeatable; default all)")
    ap.add_argument("--limit", type=int, default=1, help="flow runs executed at once (default 1)")
    args = ap.parse_args(argv)
    deps = deployments(set(args.only) if args.only else None, args.preset)
    print("serving: " + ", ".join(f"{d.flow_name}/{d.name}" for d in deps), flush=True)
    serve(*deps, limit=args.limit, print_starting_message=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
