"""LoRA: train low-rank adapters on the policy's linear layers instead of all its weights (`RunSpec.lora_r`).

The trainer gets a `peft.LoraConfig` (TRL wraps the policy; with vLLM, TRL merges the adapters into the weights it
syncs each step). Checkpoints hold the adapters; the run's `final/` is the merged full model, so evaluation, vLLM
serving and the next run load it like any model. The merge happens on the main process, from the base model and
the saved adapters, so it does not depend on how training was sharded (DDP, ZeRO-3).
"""

from __future__ import annotations

import logging
from pathlib import Path

from .spec import RunSpec

log = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"  # <output_dir>/adapter: the trained adapters (peft's adapter_config.json + weights)


def peft_config(spec: RunSpec):
    """A `peft.LoraConfig` for the spec, or None for full fine-tuning (lora_r unset)."""
    if spec.lora_r is None:
        return None
    from peft import LoraConfig

    targets = spec.lora_target_modules
    return LoraConfig(r=spec.lora_r, lora_alpha=spec.lora_alpha, lora_dropout=spec.lora_dropout, bias="none",
                      task_type="CAUSAL_LM",
                      target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",")])


def merge_adapter(spec: RunSpec, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """Load the base model of `spec`, apply the adapters in `adapter_dir`, merge them and save the full model to
    `out_dir` in the base checkpoint's dtype. Returns `out_dir`."""
    from peft import PeftModel

    from .models import load_policy

    base, _ = load_policy(spec.model, spec.gguf_file)  # in the checkpoint's dtype (loading as float32 forgets it)
    dtype = next(base.parameters()).dtype
    merged = PeftModel.from_pretrained(base.float(), str(adapter_dir)).merge_and_unload()  # float32, as trained
    merged = merged.to(dtype)
    out = Path(out_dir)
    merged.save_pretrained(str(out))
    log.info("merged the LoRA adapters of %s into %s", adapter_dir, out)
    return out
