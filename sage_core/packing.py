"""Length buckets for the loss's forward pass: less padding, the same loss.

A micro-batch is one padded tensor: every row is as wide as its longest prompt plus its longest completion. Hinted
prompts are longer than bare ones and completions vary (a solved problem writes every step, a failed one may stop
early), so a single hinted group or one long completion widens all rows. The forward can run on buckets of rows of
similar length instead, each trimmed to its own width, and the per-token log-probs put back in row order: the loss
sees the same tensors. A bucket costs `overhead` token slots on top of its padded area (a forward's fixed cost), and
the split minimizes padded area + overhead x buckets over contiguous runs of rows sorted by length (exact DP).
"""

from __future__ import annotations

import numpy as np


def length_buckets(prompt_lens, completion_lens, overhead: int = 256) -> list[list[int]]:
    """Row indices grouped into buckets minimizing sum(rows x (max prompt + max completion) + overhead).

    Rows are sorted by total length (longest first) and cut into contiguous runs; ties keep row order: the DP of
    prompt_buckets with every row its own group and no shared layout."""
    p, c = np.asarray(prompt_lens, dtype=np.int64), np.asarray(completion_lens, dtype=np.int64)
    if p.shape != c.shape or p.ndim != 1:
        raise ValueError(f"prompt_lens and completion_lens must be 1-D of one length, got {p.shape} and {c.shape}")
    if len(p) == 0:
        return []
    return [rows for rows, _ in prompt_buckets(p, c, np.arange(len(p)), overhead, share=False)]


def padded_area(prompt_lens, completion_lens, buckets: list[list[int]] | None = None) -> int:
    """Token slots a forward computes: one padded tensor, or one per bucket."""
    p, c = np.asarray(prompt_lens), np.asarray(completion_lens)
    buckets = buckets if buckets is not None else [list(range(len(p)))]
    return int(sum(len(b) * (p[b].max() + c[b].max()) for b in buckets if b))


def prompt_buckets(prompt_lens, completion_lens, groups, overhead: int = 256, share: bool = True,
                   max_rows: int | None = None) -> list[tuple[list[int], bool]]:
    """Buckets of rows, each with whether its forward shares its prompts (sage_core.shared_prefix): rows of one group
    (`groups[i]`: row i's; a group's rows share one prompt) then compute that prompt once, and each row its
    completion against it: U x (prompt - 1) + R x (completion + 1) token slots for R rows of U groups, plus two
    forwards' overhead, where a plain forward computes R x (prompt + completion) plus one. A bucket takes the
    cheaper of the two (plain where no group repeats in it or `share` is False). The split minimizes the sum over
    contiguous runs of the rows sorted by total length, longest first (exact DP, as length_buckets), so a group's
    long completion can leave its short ones to a bucket of their own; `max_rows` caps a bucket's rows (a forward's
    memory cap: each bucket is then one forward)."""
    p, c = np.asarray(prompt_lens, dtype=np.int64), np.asarray(completion_lens, dtype=np.int64)
    g = np.asarray(groups)
    if p.shape != c.shape or p.shape != g.shape or p.ndim != 1:
        raise ValueError(f"prompt_lens, completion_lens and groups must be 1-D of one length, got {p.shape}, "
                         f"{c.shape} and {g.shape}")
    if overhead < 0:
        raise ValueError(f"overhead must be >= 0, got {overhead}")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    n = len(p)
    if n == 0:
        return []
    g = np.unique(g, return_inverse=True)[1]
    order = np.argsort(-(p + c), kind="stable")
    sp, sc, sg = p[order], c[order], g[order]
    best, cut, shared = np.full(n + 1, np.inf), np.zeros(n + 1, dtype=np.int64), np.zeros(n + 1, dtype=bool)
    best[0] = 0.0
    for i in range(n):  # buckets of sorted rows i..j-1, for every j > i (at most max_rows of them)
        end = n if max_rows is None else min(n, i + max_rows)
        wp, wc = np.maximum.accumulate(sp[i:end]), np.maximum.accumulate(sc[i:end])
        r = np.arange(1, end - i + 1)
        plain = r * (wp + wc) + overhead
        use = np.zeros(end - i, dtype=bool)
        if share:
            first = np.zeros(end - i, dtype=np.int64)  # 1 where a row's group first shows in the run
            first[np.unique(sg[i:end], return_index=True)[1]] = 1
            u = np.cumsum(first)
            share_cost = u * np.maximum(wp - 1, 0) + r * (wc + 1) + 2 * overhead
            use = (share_cost < plain) & (r > u) & (wp > 1)
            plain = np.where(use, share_cost, plain)
        cost = best[i] + plain
        better = cost < best[i + 1:end + 1]
        best[i + 1:end + 1][better] = cost[better]
        cut[i + 1:end + 1][better] = i
        shared[i + 1:end + 1][better] = use[better]
    buckets, j = [], n
    while j > 0:
        i = int(cut[j])
        buckets.append((order[i:j].tolist(), bool(shared[j])))
        j = i
    return buckets[::-1]
