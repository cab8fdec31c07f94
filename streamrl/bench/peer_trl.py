"""The race's peer side: TRL's ``GRPOTrainer`` on the StreamRL config's model, prompts and reward.

``python -m streamrl.bench.peer_trl --config C --out DIR --budget-s S --t0 EPOCH [overrides]``
trains until the budget (counted from ``--t0``, the parent's spawn time, so model load counts as
it does for StreamRL) and saves the HF model at 25/50/75/100 % of it (a ``TrainerCallback``),
writing ``DIR/peer-points.json`` like the StreamRL side's list.

Matched to the config: the model folder (``model.path``, dtype), the prompts (the task's
training stream, shard 0 of 1, in order: what one StreamRL rollout worker draws), the chat
template, the reward (``rollout.rewards`` through :func:`streamrl.rewards.build_reward`, with
the task's truncation rule), ``rollout.group_size`` as ``num_generations``,
``learner.groups_per_step x group_size`` completions per optimizer step, ``learner.lr`` (constant),
``rollout.temperature`` (no top-k / top-p), ``rollout.max_new_tokens``, ``learner.grad_clip``,
no KL term, one optimizer step per generation batch (TRL's on-policy default), and on a GPU
``learner.mixed_precision`` as TRL's ``bf16`` (bf16 autocast over the float32 weights, as StreamRL's
learner computes; StreamRL's worker also decodes in ``rollout.dtype``, which TRL's ``generate`` has
no separate setting for).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from streamrl.config import load_config
from streamrl.models.factory import load_model_and_tokenizer
from streamrl.rewards import build_reward
from streamrl.rollout.prompts import uses_chat_template
from streamrl.tasks import build_task
from streamrl.tasks.registry import problem_stream
from streamrl.tasks.truncation import apply_truncation_rule, stop_ids, zeroes_truncated

MARKS = (0.25, 0.5, 0.75, 1.0)


def make_reward_fn(cfg, task, problems, tok):
    """A TRL reward function scoring like StreamRL's rollout worker (``index``: the dataset row)."""
    reward = build_reward(cfg.rollout.rewards, task)
    eos, limit, zero = stop_ids(tok), cfg.rollout.max_new_tokens, zeroes_truncated(task)

    def streamrl_reward(prompts, completions, completion_ids, index, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = reward.score([problems[i] for i in index], texts)[0]
        return apply_truncation_rule(scores, completion_ids, eos, limit, zero)[0]

    return streamrl_reward


def make_dataset(cfg, task, count: int, chat: bool):
    """The first ``count`` training problems as a ``datasets.Dataset`` (prompt + row index)."""
    from datasets import Dataset  # noqa: PLC0415 (TRL's dependency; only the peer side needs it)

    stream = problem_stream(task, cfg.run.seed, 0, 1)
    problems = [next(stream) for _ in range(count)]
    prompts = [[{"role": "user", "content": p.prompt}] if chat else p.prompt for p in problems]
    return problems, Dataset.from_dict({"prompt": prompts, "index": list(range(count))})


def make_callback(out: Path, t0: float, budget_s: float, per_step: int, points: list):
    """Saves the model at each budget mark; stops before a step would overrun the budget."""
    from transformers import TrainerCallback  # noqa: PLC0415

    class TimedExports(TrainerCallback):
        last_end = None

        def on_step_end(self, args, state, control, model=None, processing_class=None, **_):
            now = time.time() - t0
            step_s = now - (self.last_end if self.last_end is not None else now)
            self.last_end = now
            done = [p["fraction"] for p in points]
            final = now + step_s > budget_s
            for mark in MARKS:
                if mark not in done and (now >= mark * budget_s or (final and mark == 1.0)):
                    folder = out / f"peer-{int(mark * 100):03d}"
                    model.save_pretrained(folder)
                    processing_class.save_pretrained(folder)
                    points.append({"fraction": mark, "time_s": round(now, 2), "step": state.global_step,
                                   "samples": state.global_step * per_step, "folder": str(folder)})
                    break  # one save per step end: a missed mark is taken at the next step
            if final and 1.0 in [p["fraction"] for p in points]:
                control.should_training_stop = True
            return control

    return TimedExports()


def train(cfg, out: Path, budget_s: float, t0: float, device: str) -> list[dict]:
    """One budgeted GRPOTrainer run; returns the export points."""
    from trl import GRPOConfig, GRPOTrainer  # noqa: PLC0415 (the optional `peer` dependency group)

    rc, lc = cfg.rollout, cfg.learner
    model, tok = load_model_and_tokenizer(cfg.model, seed=cfg.run.seed)
    task = build_task(cfg.task)
    chat = uses_chat_template(tok, rc.chat_template)
    per_step = lc.groups_per_step * rc.group_size
    problems, dataset = make_dataset(cfg, task, count=lc.groups_per_step * 500, chat=chat)
    args = GRPOConfig(output_dir=str(out / "peer-trainer"), per_device_train_batch_size=per_step,
                      num_generations=rc.group_size, max_completion_length=rc.max_new_tokens,
                      learning_rate=lc.lr, lr_scheduler_type="constant", warmup_steps=0, temperature=rc.temperature,
                      top_p=1.0, top_k=0, beta=0.0, num_iterations=1, max_grad_norm=lc.grad_clip,
                      max_steps=10**6, logging_steps=1, report_to=[], save_strategy="no", seed=cfg.run.seed,
                      shuffle_dataset=False, use_cpu=device == "cpu", bf16=device != "cpu" and lc.mixed_precision, fp16=False,
                      dataloader_num_workers=0, disable_tqdm=True)
    points: list[dict] = []
    trainer = GRPOTrainer(model=model, reward_funcs=make_reward_fn(cfg, task, problems, tok), args=args,
                          train_dataset=dataset, processing_class=tok,
                          callbacks=[make_callback(out, t0, budget_s, per_step, points)])
    trainer.train()
    return points


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m streamrl.bench.peer_trl", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, required=True)
    p.add_argument("--t0", type=float, default=None, help="epoch seconds the budget counts from (default: now)")
    p.add_argument("--device", default="cpu")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    t0 = args.t0 if args.t0 is not None else time.time()
    cfg = load_config(args.config, args.overrides)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    points = train(cfg, out, args.budget_s, t0, args.device)
    (out / "peer-points.json").write_text(json.dumps(points, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
