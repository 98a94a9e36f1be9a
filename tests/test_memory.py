"""sage_core.memory.saved_bytes against tensors whose saved sizes are known by construction."""

from __future__ import annotations

import torch
from torch import nn

from sage_core.memory import saved_bytes


def test_counts_saved_activations_once_and_not_parameters():
    lin = nn.Linear(16, 32, bias=False)
    x = torch.randn(4, 16, requires_grad=True)
    with saved_bytes(lin) as total:
        y = lin(x)  # saves x (4x16 floats) for the weight's gradient; the weight itself is not counted
    assert total[0] == 4 * 16 * 4
    with saved_bytes(lin) as total:
        h = torch.tanh(lin(x))  # + tanh's output (4x32)
        z = (h * h).sum()  # h saved twice by mul: one storage, counted once
    assert total[0] == 4 * 16 * 4 + 4 * 32 * 4
    z.backward()
    assert x.grad is not None and y.shape == (4, 32)


def test_no_graph_saves_nothing():
    lin = nn.Linear(16, 32)
    with saved_bytes(lin) as total, torch.no_grad():
        lin(torch.randn(8, 16)).relu()
    assert total[0] == 0


def test_measured_logs_training_forwards_only():
    from collections import defaultdict

    from sage_core.memory import measured

    lin, metrics = nn.Linear(16, 32, bias=False), defaultdict(list)
    loss = measured(lambda model, x: model(x).square().sum(), metrics)
    x = torch.randn(4, 16)
    loss(lin, x).backward()  # saves x (not a parameter) and the linear's output for square
    assert metrics["sage/activation_mb"] == [(4 * 16 + 4 * 32) * 4 / 2**20]
    lin.eval()
    loss(lin, x)
    assert len(metrics["sage/activation_mb"]) == 1  # evaluation forwards are not training memory
