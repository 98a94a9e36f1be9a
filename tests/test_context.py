"""Prompt length against the generation context: long rows are left out at load, long hints are cut, a hint
request with no room is not sent, and a prompt that does not fit fails on every process together (no hang).

vLLM's context (max_model_len) is what the trainer checks against; here, on the HF path, the tests set the
trainer's context limit directly (or, for hint requests with HF generate, the policy's max_position_embeddings), and
the generation is real. tests/test_vllm.py checks that the limit is read from
a real vLLM engine."""

from __future__ import annotations

import json

import pytest
from helpers import metric, run_two_ranks

from sage_core.data import DataError, PromptTooLong, build_dataset, reference_hint
from sage_core.hints import HintRequest, write_hints
from sage_core.presets import preset
from sage_core.tracker import read_tracker
from sage_core.train import build_trainer

SMALL = {"num_prompts": 8, "prompts_per_step": 4, "num_generations": 4, "max_completion_length": 24,
         "save_steps": 100, "max_steps": 1}


def small(method, **kw):
    return preset("tiny-cpu", method=method, **{**SMALL, **kw})


def _lengths(trainer, prompts):
    """Prompt lengths exactly as TRL tokenizes them for generation."""
    return [len(ids) for ids in trainer._tokenize_prompts(list(prompts))[0]]


def test_long_prompts_are_left_out_at_load_and_listed(tiny_model_dir, tmp_path):
    probe = build_trainer(small("grpo", num_prompts=16), tmp_path / "probe")
    rows = list(build_dataset(small("grpo", num_prompts=16)))
    lengths = dict(zip((r["prompt_id"] for r in rows), _lengths(probe, [r["prompt"] for r in rows]), strict=True))
    cut = sorted(lengths.values())[len(lengths) // 2]  # about half the prompts are longer
    long_ids = {pid for pid, n in lengths.items() if n > cut}
    assert 0 < len(long_ids) <= 12

    out = tmp_path / "run"
    trainer = build_trainer(small("grpo", num_prompts=16, max_prompt_length=cut), out)
    kept = set(trainer.train_dataset["prompt_id"])
    assert kept == set(lengths) - long_ids  # exactly the rows that fit, by TRL's own tokenization
    listed = json.loads((out / "dropped_prompts.json").read_text())
    assert listed["max_prompt_length"] == cut
    assert {d["prompt_id"]: d["tokens"] for d in listed["dropped"]} == {p: lengths[p] for p in long_ids}


def test_too_few_prompts_fit_is_an_error_naming_the_limit(tiny_model_dir, tmp_path):
    with pytest.raises(DataError, match=r"0 of 8 prompts fit max_prompt_length=3 tokens.*raise max_prompt_length"):
        build_trainer(small("grpo", max_prompt_length=3), tmp_path)
    assert len(json.loads((tmp_path / "dropped_prompts.json").read_text())["dropped"]) == 8


def test_hints_longer_than_hint_max_tokens_are_cut(tiny_model_dir, tmp_path):
    spec = small("sage", hint_source="teacher", teacher=str(tmp_path / "teacher.jsonl"), hint_max_tokens=12)
    rows = list(build_dataset(spec))
    long = {r["prompt_id"]: " ".join([reference_hint(r, 2)] * 6) for r in rows}
    write_hints(tmp_path / "teacher.jsonl", [(r["prompt_id"], 2, long[r["prompt_id"]]) for r in rows]
                + [(r["prompt_id"], 1, "add first .") for r in rows])
    trainer = build_trainer(spec, tmp_path)
    trainer._counts = __import__("collections").defaultdict(float)
    trainer._hint_seconds = 0.0
    got = trainer._get_hints([(r, lvl) for r in rows[:3] for lvl in (1, 2)])
    tok = trainer.processing_class
    for r in rows[:3]:
        short, cut = got[(r["prompt_id"], 1)].text, got[(r["prompt_id"], 2)].text
        assert short == "add first ."  # within the limit: untouched
        ids = tok(cut, add_special_tokens=False)["input_ids"]
        assert len(ids) == 12 and ids == tok(long[r["prompt_id"]], add_special_tokens=False)["input_ids"][:12]
    assert trainer._counts["hints_cut"] == 3


def test_a_hint_request_with_no_room_is_not_sent_and_training_goes_on(tiny_model_dir, tmp_path):
    spec = small("sage", difficulty="hard")
    trainer = build_trainer(spec, tmp_path)
    rows = list(trainer.train_dataset)
    from sage_core.hints import request_prompt

    prompts = _lengths(trainer, [r["prompt"] for r in rows])
    requests = _lengths(trainer, [request_prompt(HintRequest(r["prompt_id"], r["problem"], r["solution"],
                                                             str(r["answer"]), 1)) for r in rows])
    # room for every rollout prompt, none for a hint request plus its hint
    limit = max(prompts) + 1
    assert min(requests) + spec.hint_max_tokens > limit
    trainer._ctx_limit = limit
    trainer.train()
    df = read_tracker(tmp_path / "tracker")
    asked = df[df.max_level_tried > 0]
    assert len(asked) > 0 and asked.hint_failed.all() and asked.hint_l1.isna().all()
    assert (df.level == 0).all()  # no hinted rollout: every group trained on its own prompt
    # every try of every asked hint (the first sample and hint_retries resamples) was held back
    assert metric(trainer, "sage/hint_requests_too_long")[0] >= len(asked) * (1 + spec.hint_retries)
    assert metric(trainer, "sage/hint_rows")[0] == 0


def test_a_hint_request_past_the_policys_own_context_is_not_sent_with_hf_generate(tiny_model_dir, tmp_path):
    """Without vLLM the policy's context (its config's max_position_embeddings) bounds a hint request and its hint
    (SageGRPOTrainer._request_context): HF generate does not stop at it, and a request with a long reference solution
    ran past it (torch's 'index out of range' on learned positions, hints from positions never trained on rotary
    ones). Such a request is held back and counted, as with vLLM's max_model_len."""
    from sage_core.hints import request_prompt

    spec = small("sage", difficulty="hard")
    trainer = build_trainer(spec, tmp_path)
    assert trainer._context_limit() is None  # no vLLM: no max_model_len
    rows = list(trainer.train_dataset)
    requests = _lengths(trainer, [request_prompt(HintRequest(r["prompt_id"], r["problem"], r["solution"],
                                                             str(r["answer"]), 1)) for r in rows])
    prompts = _lengths(trainer, [r["prompt"] for r in rows])
    limit = max(prompts) + spec.max_completion_length + 1  # room for every rollout, none for a request and its hint
    assert min(requests) + spec.hint_max_tokens > limit
    trainer.model.config.max_position_embeddings = limit
    trainer.train()
    asked = read_tracker(tmp_path / "tracker").query("max_level_tried > 0")
    assert len(asked) > 0 and asked.hint_failed.all()
    assert metric(trainer, "sage/hint_requests_too_long")[0] >= len(asked) * (1 + spec.hint_retries)
    assert trainer._request_context() == limit


def test_a_rollout_prompt_over_the_context_is_a_clear_error(tiny_model_dir, tmp_path):
    trainer = build_trainer(small("grpo"), tmp_path)
    longest = max(_lengths(trainer, trainer.train_dataset["prompt"]))
    trainer._ctx_limit = longest  # vLLM needs room for at least one new token
    with pytest.raises(PromptTooLong, match=rf"a prompt of {longest} tokens does not fit vLLM's context of "
                                            rf"{longest} tokens.*set max_prompt_length"):
        trainer.train()


def test_two_processes_fail_together_when_one_has_a_prompt_too_long(tiny_model_dir, tmp_path):
    """Only one prompt of the data set is too long, so one rank holds it; without a collective check that rank
    would fail alone and the other would wait in the next gather for ever. Both raise, and torchrun exits."""
    probe = build_trainer(preset("tiny-cpu", method="sage", difficulty="hard", num_prompts=8, seed=1,
                                 save_steps=100), tmp_path / "probe")
    lengths = sorted(_lengths(probe, probe.train_dataset["prompt"]))
    assert lengths[-1] > lengths[-2]  # a unique longest prompt in tests/mp_train.py's data set, seed 1
    out = tmp_path / "run"
    proc, _, _ = run_two_ranks(out, "sage", {"seed": 1}, ctx_limit=lengths[-1], expect_ok=False, timeout=300)
    assert proc.returncode != 0
    for rank in (0, 1):
        err = (out / f"error_rank{rank}.txt").read_text()
        assert err.startswith(f"PromptTooLong: a prompt of {lengths[-1]} tokens does not fit"), err


class _CharTokenizer:
    """One token per character: a cut can end inside a number, as a BPE tokenizer's can."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def test_a_cut_that_ends_inside_a_number_is_leak_checked_again():
    from collections import defaultdict
    from types import SimpleNamespace

    from sage_core.hints import HintResult
    from sage_core.trainer import SageGRPOTrainer

    fake = SimpleNamespace(processing_class=_CharTokenizer(), args=SimpleNamespace(hint_max_tokens=10),
                           _counts=defaultdict(float))
    req = HintRequest("p", "problem", "solution", "12", 1)
    cut = SageGRPOTrainer._cut_hint
    assert cut(fake, req, HintResult("add 5 to 7")).text == "add 5 to 7"  # 10 tokens: kept as it is
    leaked = cut(fake, req, HintResult("start at 123 then subtract 111"))  # "start at 1" is fine...
    assert leaked.text == "start at 1"
    leaked = cut(fake, req, HintResult("add it: 123 then subtract 111"))  # ..."add it: 12" names the answer
    assert leaked.text is None and leaked.leaked and leaked.failed
    assert fake._counts["hints_cut"] == 2


def test_special_token_text_in_a_hint_is_taken_out_before_it_reaches_the_prompt(tiny_model_dir):
    """A teacher (or a hints file) that writes `<|assistant|>` into a hint would end the user turn there: the
    tokenizer reads that text as the chat marker itself."""
    from collections import defaultdict
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from sage_core.hints import HintResult
    from sage_core.trainer import SageGRPOTrainer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tok("<|assistant|>", add_special_tokens=False)["input_ids"]) == 1  # a chat marker, read as one token
    fake = SimpleNamespace(processing_class=tok, args=SimpleNamespace(hint_max_tokens=48),
                           _counts=defaultdict(float))
    req = HintRequest("p", "problem", "solution", "12", 1)
    cut = SageGRPOTrainer._cut_hint
    got = cut(fake, req, HintResult("add 5 first<|eos|>\n<|assistant|> then 7 more"))
    assert got.text == "add 5 first\nthen 7 more" and not got.failed
    ids = tok(got.text, add_special_tokens=False)["input_ids"]
    assert not set(ids) & {i for i, t in tok.added_tokens_decoder.items() if t.special}
    assert cut(fake, req, HintResult("add 5 first")).text == "add 5 first"  # none there: untouched
    assert fake._counts["hints_special_removed"] == 1
    # taken out, the rest can name the answer ("1<|pad|>2" reads 1 2, but "<|pad|>12" reads 12): leak-checked again
    leaked = cut(fake, req, HintResult("it is <|pad|>12"))
    assert leaked.text is None and leaked.leaked
    empty = cut(fake, req, HintResult("<|user|>"))
    assert empty.text is None and empty.failed and not empty.leaked
    assert fake._counts["hints_special_removed"] == 3


def test_a_vllm_servers_context_is_read_from_its_models_endpoint():
    """Server mode with no max_prompt_length: the main process asks the server (vLLM's /v1/models carries
    max_model_len) and every process gets the answer."""
    import http.server
    import threading
    from types import SimpleNamespace

    from sage_core.trainer import SageGRPOTrainer, _served_context

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"object": "list", "data": [{"id": "m", "max_model_len": 4096}]}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert _served_context(url) == 4096
        gen = SimpleNamespace(max_model_length=None, mode="server", vllm_client=SimpleNamespace(base_url=url))
        fake = SimpleNamespace(_ctx_limit=False, use_vllm=True, vllm_generation=gen)
        assert SageGRPOTrainer._context_limit(fake) == 4096 and fake._ctx_limit == 4096
        gen.max_model_length = 2048  # configured here (max_prompt_length): that one counts
        fake._ctx_limit = False
        assert SageGRPOTrainer._context_limit(fake) == 2048
    finally:
        server.shutdown()
    assert _served_context(url, timeout=2) is None  # no server: no limit known, no check


def test_a_server_refuses_a_prompt_without_room_for_the_completion_and_so_does_the_check():
    """A vLLM server refuses (HTTP 400, on rank 0 only) a prompt whose length plus max_tokens exceeds its
    max_model_len; the colocated engine refuses only one that fills the context. The check before every generate
    raises PromptTooLong on every process by the rule of the mode in use, and passes what that mode accepts."""
    from types import SimpleNamespace
    from unittest import mock

    from trl import GRPOTrainer

    from sage_core.trainer import SageGRPOTrainer

    sent = []
    fake = object.__new__(SageGRPOTrainer)  # what the check reads: the mode, its context and completion length
    fake.use_vllm, fake._ctx_limit = True, 64
    fake.vllm_generation = SimpleNamespace(mode="server", max_completion_length=40)
    check = lambda prompt_len: fake._generate_single_turn([[1] * prompt_len], None, {}, 1)
    with mock.patch.object(GRPOTrainer, "_generate_single_turn", lambda self, p, *a, **k: sent.append(len(p[0]))):
        check(24)  # 24 + 40 = 64: the server takes it
        with pytest.raises(PromptTooLong, match=r"a prompt of 25 tokens does not fit vLLM's context of 64 tokens "
                                                r"\(max_model_len\) with the 40 new tokens.*max_completion_length"):
            check(25)
        fake.vllm_generation.mode = "colocate"  # the engine cuts the completion short instead
        check(63)
        with pytest.raises(PromptTooLong, match=r"a prompt of 64 tokens does not fit vLLM's context of 64 tokens "
                                                r"\(max_model_len\); set max_prompt_length"):
            check(64)
    assert sent == [24, 63]
