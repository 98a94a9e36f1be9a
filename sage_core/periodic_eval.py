"""Evaluation while training: the policy without a hint, as at deployment, every `eval_every` steps.

    periodic_eval_rows(spec, tokenizer)  the rows: data.eval_set_rows (the held-out rows of `data`, or `eval_data`),
                                         those longer than max_prompt_length left out as training's are
    NoHintEval                           the SageGRPOTrainer part that rolls them out on the trainer's own back-end
                                         (HF generate or vLLM, every process its share) and logs
                                         eval/during/<set>/avg_at_<k>, pass_at_<k> in the step's log

The eval's sampling runs on a forked RNG seeded by the step: training draws what it would have drawn without it.
Its seconds (trainer.eval_seconds) are left out of the training time (sage_core.train).
"""

from __future__ import annotations

import logging
import time

import torch
from accelerate.utils import gather_object

from .evaluate import at_k
from .reward import score

log = logging.getLogger(__name__)


def periodic_eval_rows(spec, tokenizer) -> list[dict]:
    """The rows evaluated every spec.eval_every steps (none without it)."""
    if not spec.eval_every:
        return []
    from .data import DataError, drop_long_prompts, eval_set_name, eval_set_rows

    name, rows = eval_set_name(spec), eval_set_rows(spec)
    if spec.max_prompt_length:
        rows, dropped = drop_long_prompts(rows, tokenizer, spec.max_prompt_length)
        if dropped:
            log.warning("%s: %d of its prompts are longer than max_prompt_length=%d tokens and are not evaluated",
                        name, len(dropped), spec.max_prompt_length)
    if not len(rows):
        raise DataError(f"eval_every={spec.eval_every}: {name} has no rows to evaluate")
    return rows.to_list() if hasattr(rows, "to_list") else list(rows)


class NoHintEval:
    """Mixed into SageGRPOTrainer (before GRPOTrainer), whose __init__ calls `_init_no_hint_eval` and which holds
    the generate helpers `_roll` and `_sampling`."""

    def _init_no_hint_eval(self, eval_rows: list[dict] | None) -> None:
        self._eval_rows = list(eval_rows or [])  # the rows evaluated every sage_eval_every steps
        if self.args.sage_eval_every and not self._eval_rows:
            log.warning("sage_eval_every=%d but no eval_rows were given: nothing is evaluated while training",
                        self.args.sage_eval_every)
        self._evaluated_at = -1  # the step last evaluated
        self.eval_seconds = 0.0  # this session's, not training time (sage_core.train leaves it out)

    def _maybe_log_save_evaluate(self, *args, **kwargs):
        """Every sage_eval_every steps and at the last one: the no-hint eval, whose metrics go out in this step's
        log; then HF logs the step and saves its checkpoint."""
        step, every = self.state.global_step, self.args.sage_eval_every
        if every and self._eval_rows and step > self._evaluated_at and (step % every == 0 or self._last_step()):
            self._evaluated_at = step
            self.evaluate_no_hint()
            # in this step's log, whatever logging_steps says: TRL's log() averages the metrics gathered since the
            # last log, so two evals between logs came out as one mean at the later step
            self.control.should_log = True
        return super()._maybe_log_save_evaluate(*args, **kwargs)

    def _last_step(self) -> bool:
        """Whether training ends with the step now ending: max_steps, a callback's stop, or a callback that will stop
        it when this step's metrics are logged (a rollout budget: sage_core.train.RolloutBudget.stops_at)."""
        if self.state.global_step >= self.state.max_steps or self.control.should_training_stop:
            return True
        logged = self._metrics["train"].get("sage/rollouts") or []
        rollouts = sum(logged) / len(logged) if logged else 0.0  # as TRL's log() will report it
        return any(cb.stops_at(self.args, self.state, rollouts) for cb in self.callback_handler.callbacks
                   if hasattr(cb, "stops_at"))

    def evaluate_no_hint(self) -> dict[str, float]:
        """avg@k and pass@k of the current policy (in eval mode) on the eval rows with h empty: every process rolls
        out its share (k samples a prompt at the eval's temperature and top-p; greedy: one, which is all k), on HF
        generate in calls as wide as a step's rollouts, on vLLM in one call, the same number of calls everywhere."""
        a, t0, training = self.args, time.perf_counter(), self.model.training
        rank, world, k = self.accelerator.process_index, self.accelerator.num_processes, a.sage_eval_k
        mine = self._eval_rows[rank::world]
        draws = 1 if a.sage_eval_temperature == 0 else k
        prompts = [r["prompt"] for r in mine for _ in range(draws)]
        width = max(1, len(prompts) if self.use_vllm else a.per_device_train_batch_size * a.steps_per_generation)
        calls = max(gather_object([-(-len(prompts) // width)]))
        cuda = self.accelerator.device.type == "cuda"
        comp_ids = []
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=[self.accelerator.device] if cuda else []), \
                    self._sampling(a.max_completion_length, a.sage_eval_temperature, a.sage_eval_top_p):
                torch.default_generator.manual_seed(a.seed + self.state.global_step)
                if cuda:  # this process's device only: the one fork_rng gives back
                    torch.cuda.manual_seed(a.seed + self.state.global_step)
                for c in range(calls):
                    comp_ids += self._roll(prompts[c * width:(c + 1) * width], kind="eval")[1]
        finally:
            self.model.train(training)
        texts = self.processing_class.batch_decode(comp_ids, skip_special_tokens=True)
        scores = gather_object([[score(t, str(r["answer"])) for t in texts[i * draws:(i + 1) * draws]] * (k // draws)
                                for i, r in enumerate(mine)])
        avg, passed = at_k(scores)
        at = f"eval/during/{a.sage_eval_name}"  # as the before/after evals' eval/<when>/<set>/avg_at_<k>
        result = {f"{at}/avg_at_{k}": avg, f"{at}/pass_at_{k}": passed}
        spent = max(gather_object([time.perf_counter() - t0]))
        self.eval_seconds += spent
        for key, value in {**result, "sage/eval_seconds": spent}.items():
            self._metrics["train"][key].append(value)
        return result
