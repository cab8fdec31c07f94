"""Held-out evaluation: greedy accuracy of a model (or a learner checkpoint) on a task.

``streamrl-eval --config C [--checkpoint latest|PATH] [--json]`` builds the configured model,
optionally loads learner weights from a DCP checkpoint (single process), and decodes the
task's held-out problems greedily (``task.eval_size`` of them, disjoint in seed space from the
training streams). Accuracy is the share of problems whose task reward is 1 (exact answer);
``reward_mean`` keeps partial credit. Routing is deterministic in eval mode.

Examples:
    streamrl-eval --config configs/smol-moe.yaml --json                       # before training
    streamrl-eval --config configs/smol-moe.yaml --checkpoint latest --json   # after
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from streamrl.config import Config, load_config
from streamrl.rewards import response_text
from streamrl.tasks import get_task
from streamrl.tasks.registry import Problem, eval_problems
from streamrl.workers.rollout import PromptEncoder


@torch.no_grad()
def greedy_eval(model, tok, task, problems: list[Problem], *, chat_template: bool, max_new_tokens: int,
                batch_size: int = 32) -> dict[str, float]:
    """Greedy-decode every problem; returns ``accuracy`` (reward == 1), ``reward_mean`` and ``n``."""
    model.eval()
    encode = PromptEncoder(tok, chat_template)  # the worker's encoding: eval prompts match training's
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rewards = []
    for lo in range(0, len(problems), batch_size):
        chunk = problems[lo: lo + batch_size]
        ids = [encode(p.prompt) for p in chunk]
        width = max(map(len, ids))
        inp = torch.full((len(ids), width), pad, dtype=torch.long)
        attn = torch.zeros_like(inp)
        for i, row in enumerate(ids):  # left padding
            inp[i, width - len(row):] = torch.tensor(row)
            attn[i, width - len(row):] = 1
        dev = next(model.parameters()).device
        out = model.generate(input_ids=inp.to(dev), attention_mask=attn.to(dev), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=tok.eos_token_id)
        for p, seq in zip(chunk, out[:, width:].cpu().tolist()):
            rewards.append(float(task.reward(p, response_text(tok, seq))))
    return {"accuracy": sum(r >= 1.0 for r in rewards) / max(len(rewards), 1),
            "reward_mean": sum(rewards) / max(len(rewards), 1), "n": len(rewards)}


def load_for_eval(cfg: Config, checkpoint: str | None, device: str = "cpu"):
    """(model, tokenizer): the configured model on ``device``, or the learner checkpoint's weights
    (then on the learner's device, ``learner.device``)."""
    if not checkpoint:
        from streamrl.models.factory import load_model_and_tokenizer

        model, tok = load_model_and_tokenizer(cfg.model, seed=cfg.run.seed)
        return model.to(device), tok
    from streamrl.learner.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint
    from streamrl.learner.trainer import Trainer

    path = latest_checkpoint(checkpoint_dir(cfg)) if checkpoint == "latest" else Path(checkpoint)
    if path is None:
        raise ValueError(f"--checkpoint latest: no checkpoint under {checkpoint_dir(cfg)}")
    trainer = Trainer(cfg)
    load_checkpoint(path, trainer)
    return trainer.model, trainer.tokenizer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="streamrl-eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--checkpoint", default=None, help="'latest' (in the run's checkpoint dir) or a checkpoint path")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: rollout.max_new_tokens")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--device", default=None, help="default: rollout.device")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cfg = load_config(args.config, args.overrides)
    t0 = time.time()
    model, tok = load_for_eval(cfg, args.checkpoint, args.device or cfg.rollout.device)
    task = get_task(cfg.task.name, num_digits=cfg.task.num_digits)
    problems = eval_problems(task, cfg.run.seed, cfg.task.eval_size)
    res = greedy_eval(model, tok, task, problems, chat_template=getattr(cfg.rollout, "chat_template", False),
                      max_new_tokens=args.max_new_tokens or cfg.rollout.max_new_tokens, batch_size=args.batch_size)
    res.update({"checkpoint": args.checkpoint, "task": cfg.task.name, "seconds": time.time() - t0})
    print(json.dumps(res) if args.json else
          f"accuracy {res['accuracy']:.3f}  reward {res['reward_mean']:.3f}  n {res['n']}  ({res['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
