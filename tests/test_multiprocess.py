"""Two processes (torchrun, gloo on CPU): collapse decided per prompt group, equal work on every rank, and
scheduler state identical on both ranks afterwards."""

import pandas as pd
import pytest
from helpers import global_metrics, run_two_ranks


@pytest.mark.parametrize("method", ["sage-light+ada-seq", "sage"])
def test_two_processes_agree(tiny_model_dir, tmp_path, method):
    _, r0, r1 = run_two_ranks(tmp_path, method)
    assert r0["scheduler"] == r1["scheduler"]  # SAGE-LIGHT levels replayed from every rank's groups
    assert r0["seen"] == r1["seen"] and len(r0["seen"]) >= 4
    assert global_metrics(r0["history"]) == global_metrics(r1["history"])
    assert sum("sage/frac_collapsed" in h for h in r0["history"]) == 2
    files = sorted((tmp_path / "tracker").glob("step_*.parquet"))
    assert len(files) == 2  # written once, by rank 0
    for f in files:
        df = pd.read_parquet(f)
        assert len(df) == 4 and df.prompt_id.is_unique  # all 4 groups of both ranks, each once
    if method.startswith("sage-light"):
        second = pd.read_parquet(files[1]).set_index("prompt_id")
        levels = r0["scheduler"]["levels"]
        assert all(0 <= levels[p] <= 3 for p in second.index)
