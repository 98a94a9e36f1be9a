"""LoRA: train low-rank adapters on the policy's linear layers instead of all its weights (`RunSpec.lora_r`).

The trainer gets a `peft.LoraConfig` (TRL wraps the policy; with vLLM, TRL merges the adapters into the weights it
syncs each step). Checkpoints hold the adapters; the run's `final/` is the merged full model, so evaluation, vLLM
serving and the next run load it like any model. The merge happens on the main process, from the base model and
the saved adapters, so it does not depend on how training was sharded (DDP, ZeRO-3).
"""

from __future__ import annotations

import json
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


class LoraTargetsNotFound(ValueError):
    """lora_target_modules naming a module the policy does not have: peft would stop the run with a traceback
    (NoMatchingPeftModuleError) once the trainer is built; the message names the names it lacks and the ones it has."""


def check_targets(spec: RunSpec, model) -> None:
    """Raise LoraTargetsNotFound where a comma-separated name in spec.lora_target_modules matches no module of
    `model` (as peft matches a list: the module's full name, or its last dotted parts); 'all-linear' and full
    fine-tuning pass."""
    if spec.lora_r is None or spec.lora_target_modules == "all-linear":
        return
    names = [n for n, _ in model.named_modules()]
    wanted = [t.strip() for t in spec.lora_target_modules.split(",")]
    missing = [t for t in wanted if not t or not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        import torch

        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise LoraTargetsNotFound(
            f"lora_target_modules {spec.lora_target_modules!r}: {', '.join(repr(t) for t in missing)} names no "
            f"module of {spec.model}; its linear layers are {', '.join(linear) or 'none'} (or use 'all-linear')")


def merged_model(base: str, adapter_dir: str | Path, gguf_file: str | None = None, dtype=None):
    """The base model with the adapters in `adapter_dir` merged into its weights (a plain transformers model),
    merged in float32 (as trained), then in `dtype` (default: the base checkpoint's): a float32 run started from a
    bfloat16 base's adapters gets the unrounded merge."""
    from peft import PeftModel

    from .models import check_adapter_folder, load_policy

    model, _ = load_policy(base, gguf_file)  # in the checkpoint's dtype (loading as float32 forgets it)
    check_adapter_folder(Path(adapter_dir))  # weights cut short: named, not safetensors' traceback from peft
    dtype = dtype or next(model.parameters()).dtype
    return PeftModel.from_pretrained(model.float(), str(adapter_dir)).merge_and_unload().to(dtype)


def merge_adapter(spec: RunSpec, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """Merge the adapters in `adapter_dir` into the base model of `spec` and save the full model to `out_dir`.
    Returns `out_dir`."""
    out = Path(out_dir)
    merged_model(spec.model, adapter_dir, spec.gguf_file).save_pretrained(str(out))
    log.info("merged the LoRA adapters of %s into %s", adapter_dir, out)
    return out


def record_base(model, spec: RunSpec) -> None:
    """Name in this run's adapter_config.json a base that load_policy loads, where peft's default (the policy's
    name_or_path) would not:
    - `model` a LoRA run's adapter folder (checkpoint-N/, adapter/): load_policy gave the trainer that folder's base
      with its adapters merged, so peft would record the bare base, and this run's checkpoint-N/ and adapter/ would
      load (load_policy, sage eval) without the first run's adapters. Record the adapter folder: load_policy merges
      both.
    - a GGUF model ('smollm2', a .gguf path, a folder with gguf_file): its name_or_path is the folder holding the
      file, which has no config.json. Record 'smollm2' or the .gguf file's path."""
    if spec.lora_r is None:
        return
    if spec.model == "smollm2":
        base = spec.model
    elif spec.gguf_file is not None:
        base = str(Path(spec.model).expanduser().resolve() / spec.gguf_file)
    elif spec.model.lower().endswith(".gguf") or adapter_base(spec.model) is not None:
        base = str(Path(spec.model).expanduser().resolve())
    else:
        return
    for cfg in (getattr(model, "peft_config", None) or {}).values():
        cfg.base_model_name_or_path = base


def adapter_base(path: str | Path) -> str | None:
    """The base model a folder of LoRA adapters was trained on (a LoRA run's checkpoint-N/ or adapter/: peft's
    adapter_config.json, no config.json), or None for any other path."""
    folder = Path(path).expanduser()
    cfg = folder / "adapter_config.json"
    if not folder.is_dir() or (folder / "config.json").is_file() or not cfg.is_file():
        return None
    try:
        base = json.loads(cfg.read_text())["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{cfg} cannot be read as a LoRA adapter config ({e})") from e
    if not isinstance(base, str) or not base:
        raise ValueError(f"{cfg}: no base_model_name_or_path, so the base model these adapters apply to is unknown")
    return base
