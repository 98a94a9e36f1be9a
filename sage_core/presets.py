"""Named RunSpec presets: `tiny-cpu` (offline, minutes on 2 cores), `smollm2-cpu` (a real 135M instruct model
from a PyPI wheel, slow) and the paper's GPU settings for three instruct models (vLLM, 128 prompts x 8 rollouts,
4 for qwen3-4b, lr 1e-6, response 8192, clip 0.2/0.28, no KL)."""

from __future__ import annotations

from typing import Any

from .spec import RunSpec

_PAPER_GPU: dict[str, Any] = dict(
    data="baohao/sage_train",  # or a local Parquet with prompt/answer/solution columns
    num_prompts=15000,
    num_generations=8,
    prompts_per_step=128,
    max_steps=500,
    updates_per_generation=2,
    micro_batch_size=4,
    learning_rate=1e-6,
    max_prompt_length=2048,
    max_completion_length=8192,
    temperature=1.0,
    epsilon=0.2,
    epsilon_high=0.28,
    beta=0.0,
    loss_type="dapo",
    save_steps=50,
    gradient_checkpointing=True,
    bf16=True,
    use_vllm=True,
    vllm_mode="colocate",
    vllm_gpu_memory_utilization=0.3,
    hint_max_tokens=1024,
    eval_k=16,
    eval_num_prompts=500,
)

PRESETS: dict[str, dict[str, Any]] = {
    # lookahead: on CPU with HF generate (the generation cache makes rows cheap) SAGE's late levels rolled together
    # cost 13-15% less time (2.45x GRPO against 2.88x, and 2.52x against 2.90x, in two 5-round runs of
    # benchmarks/overhead.py); the GPU presets keep the sequential passes until it is measured there
    "tiny-cpu": dict(model="tiny", data="synthetic", num_prompts=64, num_generations=8, prompts_per_step=8,
                     max_steps=12, learning_rate=1e-4, max_completion_length=40, lookahead=True),
    "smollm2-cpu": dict(model="smollm2", data="synthetic", num_prompts=16, num_generations=4, prompts_per_step=2,
                        max_steps=4, learning_rate=1e-6, max_completion_length=64, hint_max_tokens=64,
                        eval_k=2, eval_num_prompts=8),
    "qwen2.5-7b": dict(_PAPER_GPU, model="Qwen/Qwen2.5-7B-Instruct"),
    "llama-3.2-3b": dict(_PAPER_GPU, model="meta-llama/Llama-3.2-3B-Instruct"),
    "qwen3-4b": dict(_PAPER_GPU, model="Qwen/Qwen3-4B-Instruct-2507", num_generations=4),
}


def preset(name: str, **overrides: Any) -> RunSpec:
    """The RunSpec of a named preset with `overrides` applied (validated)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return RunSpec(**{**PRESETS[name], **overrides})
