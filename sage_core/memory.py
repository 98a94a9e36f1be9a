"""Activation memory of the loss's forward: the bytes autograd keeps for the backward.

A saved-tensor hook sees every tensor the forward saves for its backward; each storage is counted once however many
tensors view it, and the parameters' own storages are left out (they are held anyway). The count is exact for what
the graph keeps and the same on any machine; temporaries freed during the forward and allocator overhead are not in
it. Rows run without a graph (zero-advantage rows, see SageGRPOTrainer._compute_loss) save nothing, and under
gradient checkpointing only what the checkpoints keep is counted: the memory those features save shows up here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def saved_bytes(model: nn.Module) -> Iterator[list[int]]:
    """Count the bytes saved for backward inside the block; yields a one-element list holding the running total."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


def measured(compute_loss: Callable, metrics: dict[str, list]) -> Callable:
    """Wrap a trainer's `_compute_loss(model, inputs)`: in training, append the forward's saved bytes in MB to
    metrics["sage/activation_mb"] (a TRL metrics dict, averaged over a step's micro-batches when logged)."""

    def wrapped(model, inputs):
        if not model.training:
            return compute_loss(model, inputs)
        with saved_bytes(model) as saved:
            loss = compute_loss(model, inputs)
        metrics["sage/activation_mb"].append(saved[0] / 2**20)
        return loss

    return wrapped
