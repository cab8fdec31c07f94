"""Held-out evaluation: greedy accuracy and pass@k of a model (or a learner checkpoint).

``streamrl-eval --config C [--checkpoint latest|PATH] [--json]`` builds the configured model,
optionally loads learner weights from a DCP checkpoint (single process), and scores the
held-out set: the first ``eval.size`` rows of ``eval.dataset``, or ``eval.size`` problems the
task generator draws from seeds training never uses. The evaluator process
(``workers/evaluator.py``, ``eval.interval > 0``) runs the same :func:`evaluate` during training.

Figures (keys as written to metrics.jsonl):

* ``eval/accuracy``: share of problems whose greedy response is correct: it scores >= 1 under
  ``eval.reward`` (default ``task``: the task's own reward; ``math_verify`` for free-form math);
* ``eval/reward_mean``: mean greedy reward (keeps partial credit);
* ``eval/accuracy/<dataset>``: greedy accuracy per source dataset of a reasoning-gym mix, and
  ``eval/accuracy/trained_families`` / ``eval/accuracy/held_out_families`` when the mix holds
  families training never sees (``held_out: true``, see :mod:`streamrl.tasks.reasoning`);
* ``eval/truncated``: share of greedy responses cut at the token limit (they score 0 when the task
  says so, :mod:`streamrl.tasks.truncation`); ``eval/response_tokens_median`` / ``_p90``: their lengths;
* with ``eval.samples = k > 0``: ``eval/pass@k`` (share of problems with at least one correct
  of k samples at ``eval.temperature``) and ``eval/mean@k`` (share of correct samples, an
  estimate of pass@1 at that temperature).

Routing is deterministic in eval mode. Every caller (this CLI, the evaluator process, the race's
scorer) decodes through the :class:`EvalDecoder` that :func:`eval_decoder` builds for ``eval.engine``.

Examples:
    streamrl-eval --config configs/smol-reasoning.yaml --json                       # before training
    streamrl-eval --config configs/smol-reasoning.yaml --checkpoint latest --json   # after
    streamrl-eval --config configs/gpu-reasoning.yaml --model runs/x/hf --json     # an exported folder
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Iterable, Protocol

import torch

from streamrl.config import Config, load_config
from streamrl.rewards import CombinedReward, build_reward, response_texts
from streamrl.tasks import build_task
from streamrl.tasks.datasets import load_problems
from streamrl.rollout.prompts import PromptEncoder
from streamrl.tasks.registry import Problem, eval_problems
from streamrl.tasks.truncation import apply_truncation_rule, stop_ids, zeroes_truncated

CORRECT = 1.0 - 1e-6  # a response is correct when its eval reward reaches 1 (float slack)
EVAL_FILE = "eval.json"  # RUN_DIR/eval.json: the evaluator's latest and best rows


def eval_set(cfg: Config, task) -> list[Problem]:
    """The held-out problems: ``eval.dataset``'s first ``eval.size`` rows, else the task's held-out seeds."""
    if cfg.eval.dataset:
        d = cfg.data
        rows = load_problems(cfg.eval.dataset, d.prompt_key, d.answer_key, d.split, field="eval.dataset")
        return rows[:cfg.eval.size]
    return eval_problems(task, cfg.run.seed, cfg.eval.size)


class EvalDecoder(Protocol):
    """What evaluation decodes with (``eval.engine``): batches of prompt ids in, response ids out.

    Built by :func:`eval_decoder`; :func:`evaluate` only generates with it, and whoever keeps it
    across versions (the evaluator process, the race's scorer) copies new weights in.
    """

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float | None = None,
                 samples: int = 1) -> list[list[list[int]]]:
        """Response token ids to ``prompts`` (token ids, any lengths): ``[len(prompts)][samples]`` lists.

        ``temperature=None`` decodes greedily (one response each); otherwise ``samples`` responses
        are drawn from the plain tempered softmax (no top-k / top-p). A response ends with its EOS
        when it stopped, and holds at most ``max_new_tokens`` tokens.
        """

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a version (full weights or adapters, HF names) into the decoder's parameters in place."""

    def close(self) -> None:
        """Release the model (and an engine's KV cache and captured graphs)."""


class GenerateDecoder:
    """``eval.engine: hf``: transformers ``generate`` on the rollout's
    :class:`~streamrl.engines.hf.HFEngine` model, in ``model.dtype``, all prompts in one batch.

    The engine switches the folder's ``generation_config.json`` off: ``generate()`` would apply its
    repetition penalty, top-k, minimum lengths etc. even to greedy decoding, which the fast engine
    never does; it also copies (or merges) published versions in place. Its own ``generate`` only
    samples, so decoding is here.
    """

    def __init__(self, model, tok):
        from streamrl.engines.hf import HFEngine  # noqa: PLC0415 (transformers: only this path needs it)

        self.engine = HFEngine(model, tok, str(next(model.parameters()).device))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float | None = None,
                 samples: int = 1) -> list[list[list[int]]]:
        from streamrl.engines.hf import left_padded, through_eos  # noqa: PLC0415

        e = self.engine
        inp, attn = left_padded(prompts, e.pad_id)  # [B, width] each
        k = 1 if temperature is None else samples
        kw = (dict(do_sample=False) if temperature is None else
              dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0))
        out = e.model.generate(input_ids=inp.to(e.device), attention_mask=attn.to(e.device),
                               max_new_tokens=max_new_tokens, num_return_sequences=k, pad_token_id=e.pad_id,
                               eos_token_id=e.eos_id, **kw)
        rows = [r[: through_eos(r, e.eos_id)] for r in out[:, inp.shape[1]:].cpu().tolist()]  # [B * k] rows
        return [rows[i * k:(i + 1) * k] for i in range(len(prompts))]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.engine.load_weights(named_tensors)

    def close(self) -> None:
        self.engine.close()


class FastDecoder:
    """``eval.engine: hf_fast``: the rollout's :class:`~streamrl.engines.hf_fast.FastHFEngine`,
    its slots refilled as answers end; a prompt's ``samples`` copies are rows of one call."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float | None = None,
                 samples: int = 1) -> list[list[list[int]]]:
        k = 1 if temperature is None else samples
        rows = [p for p in prompts for _ in range(k)]
        out = self.engine.generate(rows, max_new_tokens, temperature=0.0 if temperature is None else temperature)
        return [out.tokens[i * k:(i + 1) * k] for i in range(len(prompts))]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.engine.load_weights(named_tensors)  # cast to the engine's dtype, into the storage its graphs read

    def close(self) -> None:
        self.engine.close()


def eval_decoder(cfg: Config, model, tok, max_new_tokens: int | None = None) -> EvalDecoder:
    """The decoder of ``eval.engine`` over ``model`` (already on ``eval.device``), which it takes over.

    ``hf``: a :class:`GenerateDecoder` (transformers ``generate`` in ``model.dtype``). ``hf_fast``:
    a :class:`FastDecoder` over a :class:`~streamrl.engines.hf_fast.FastHFEngine`, ``model`` cast in
    place to the rollout's dtype (``rollout.dtype``, the dtype the policy is sampled in), with
    ``eval.batch_size`` slots refilled as answers end and room for the longest prompt the rollout
    admits plus ``max_new_tokens`` (default: the eval's). Greedy answers of the two engines agree
    where the logits have no near-ties; both sides of a comparison should be scored by the same one.
    """
    if cfg.eval.engine == "hf":
        return GenerateDecoder(model, tok)
    from streamrl.engines.hf_fast import FastHFEngine  # noqa: PLC0415 (only the fast path needs the engine)
    from streamrl.engines.hf_fast_config import FastHFConfig  # noqa: PLC0415
    from streamrl.engines.precision import DTYPES, engine_dtype_name  # noqa: PLC0415

    rc = cfg.rollout
    new = max_new_tokens or cfg.eval.max_new_tokens or rc.max_new_tokens
    model.to(DTYPES[engine_dtype_name(cfg)])
    device = str(next(model.parameters()).device)
    return FastDecoder(FastHFEngine(model, tok, FastHFConfig(
        device=device, batch_size=cfg.eval.batch_size, max_seq_len=rc.max_model_len + max(0, new - rc.max_new_tokens))))


def _scored(tok, reward: CombinedReward, problems: list[Problem], ids: list[list[int]], max_new_tokens: int,
            truncated_scores_zero: bool) -> tuple[list[float], list[bool]]:
    """Rewards of one response per problem, the truncation rule applied, and the truncation flags."""
    rewards = reward.score(problems, response_texts(tok, ids))[0]
    return apply_truncation_rule(rewards, ids, stop_ids(tok), max_new_tokens, truncated_scores_zero)


def evaluate(decoder: EvalDecoder, tok, problems: list[Problem], reward: CombinedReward, *, chat_template: bool,
             max_new_tokens: int, batch_size: int = 32, samples: int = 0, temperature: float = 1.0,
             seed: int = 0, truncated_scores_zero: bool = False) -> dict[str, float]:
    """Greedy accuracy (and pass@k with ``samples = k > 0``) of ``decoder``'s model on ``problems``.

    ``decoder``: what :func:`eval_decoder` returns (the model in eval mode).
    ``truncated_scores_zero``: a response cut at ``max_new_tokens`` scores 0 (the task's rule,
    :mod:`streamrl.tasks.truncation`). Returns ``{"eval/accuracy", "eval/reward_mean",
    "eval/truncated", "eval/n"}`` plus per-set accuracies and ``"eval/pass@k"`` /
    ``"eval/mean@k"`` when sampling (see the module doc).
    """
    encode = PromptEncoder(tok, chat_template)  # the worker's encoding: eval prompts match training's
    greedy, lengths, cut, solved, sample_hits = [], [], 0, 0, 0
    gen = torch.Generator().manual_seed(seed)
    for lo in range(0, len(problems), batch_size):
        chunk = problems[lo: lo + batch_size]
        ids = [encode.problem(p) for p in chunk]
        first = [g[0] for g in decoder.generate(ids, max_new_tokens)]
        rewards, flags = _scored(tok, reward, chunk, first, max_new_tokens, truncated_scores_zero)
        greedy += rewards
        lengths += [len(r) for r in first]
        cut += sum(flags)
        if samples > 0:
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))  # reproducible samples
            drawn = decoder.generate(ids, max_new_tokens, temperature=temperature, samples=samples)
            for p, group in zip(chunk, drawn):
                scores = _scored(tok, reward, [p] * len(group), group, max_new_tokens, truncated_scores_zero)[0]
                hits = sum(r >= CORRECT for r in scores)
                solved += hits > 0
                sample_hits += hits
    n = max(len(problems), 1)
    out = {"eval/accuracy": sum(r >= CORRECT for r in greedy) / n, "eval/reward_mean": sum(greedy) / n,
           "eval/truncated": cut / n, "eval/n": len(problems), **length_stats(lengths),
           **set_accuracies(problems, greedy)}
    if samples > 0:
        out[f"eval/pass@{samples}"] = solved / n
        out[f"eval/mean@{samples}"] = sample_hits / (n * samples)
    return out


def length_stats(lengths: list[int]) -> dict[str, float]:
    """``eval/response_tokens_median`` and ``eval/response_tokens_p90`` of the greedy responses."""
    if not lengths:
        return {}
    ordered = sorted(lengths)
    return {"eval/response_tokens_median": float(ordered[len(ordered) // 2]),
            "eval/response_tokens_p90": float(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))])}


def set_accuracies(problems: list[Problem], rewards: list[float]) -> dict[str, float]:
    """``eval/accuracy/<dataset>`` per source dataset of a task mix, and, when the mix holds
    families training never sees (``held_out: true``), ``eval/accuracy/trained_families`` and
    ``eval/accuracy/held_out_families`` with their sizes (``eval/n/<set>``)."""
    sets: dict[str, list[float]] = {}
    for p, r in zip(problems, rewards):
        if "source_dataset" in p.fields:  # a task mix (reasoning-gym): which skill moved
            sets.setdefault(p.fields["source_dataset"], []).append(r)
        if p.fields.get("held_out_family") is not None:
            family = "held_out_families" if p.fields["held_out_family"] else "trained_families"
            sets.setdefault(family, []).append(r)
    if "held_out_families" not in sets:  # every family trained: the split says nothing
        sets.pop("trained_families", None)
    out = {}
    for name, rs in sorted(sets.items()):
        out[f"eval/accuracy/{name}"] = sum(r >= CORRECT for r in rs) / len(rs)
        if name.endswith("_families"):
            out[f"eval/n/{name}"] = len(rs)
    return out


def evaluate_config(decoder: EvalDecoder, tok, cfg: Config, task=None, problems: list[Problem] | None = None,
                    max_new_tokens: int | None = None, batch_size: int | None = None) -> dict[str, float]:
    """:func:`evaluate` with everything taken from ``cfg`` (``eval.*``, ``rollout.chat_template``)."""
    task = task if task is not None else build_task(cfg.task)
    problems = problems if problems is not None else eval_set(cfg, task)
    e = cfg.eval
    return evaluate(decoder, tok, problems, build_reward(e.reward, task), chat_template=cfg.rollout.chat_template,
                    max_new_tokens=max_new_tokens or e.max_new_tokens or cfg.rollout.max_new_tokens,
                    batch_size=batch_size or e.batch_size, samples=e.samples, temperature=e.temperature,
                    seed=cfg.run.seed, truncated_scores_zero=zeroes_truncated(task))


def read_eval_summary(run_dir: str | Path) -> dict | None:
    """``{"latest": row, "best": row, "evaluations": n}`` from ``RUN_DIR/eval.json`` (written by
    the evaluator process), or None when the run has no evaluations; for ``summary.json``."""
    path = Path(run_dir) / EVAL_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:  # written atomically, so only a foreign file gets here
        raise ValueError(f"{path}: not JSON ({e.msg})") from None


def load_for_eval(cfg: Config, checkpoint: str | None, device: str = "cpu"):
    """(model, tokenizer) on ``device``: the configured model, or a learner checkpoint's weights
    (read in this one process whatever the learner's world size and ``ep``)."""
    if not checkpoint:
        from streamrl.models.factory import load_model_and_tokenizer

        model, tok = load_model_and_tokenizer(cfg.model, seed=cfg.run.seed)
        return model.to(device), tok
    from streamrl.export import load_checkpoint_model
    from streamrl.learner.run_checkpoint import checkpoint_dir, latest_checkpoint

    path = latest_checkpoint(checkpoint_dir(cfg)) if checkpoint == "latest" else Path(checkpoint)
    if path is None:
        raise ValueError(f"--checkpoint latest: no checkpoint under {checkpoint_dir(cfg)}")
    # one process, any learner world size and ep: DCP reads the checkpoint's global tensors
    model, tok, _ = load_checkpoint_model(path, cfg)
    return model.to(device), tok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="streamrl-eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--checkpoint", default=None, help="'latest' (in the run's checkpoint dir) or a checkpoint path")
    p.add_argument("--model", default=None, help="an HF folder to score instead of model.path "
                   "(e.g. one streamrl-export wrote); the config still gives the task and eval.*")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: eval.max_new_tokens")
    p.add_argument("--batch-size", type=int, default=None, help="default: eval.batch_size")
    p.add_argument("--device", default=None, help="default: eval.device")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. eval.size=200 eval.samples=8")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    try:
        if args.model and args.checkpoint:
            raise ValueError("--model and --checkpoint: give one of them")
        cfg = load_config(args.config, [*args.overrides, *([f"model.path={args.model}"] if args.model else [])])
        task = build_task(cfg.task)
        problems = eval_set(cfg, task)
    except ValueError as e:  # ConfigError is one; bad eval.dataset files too
        print(f"streamrl-eval: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    model, tok = load_for_eval(cfg, args.checkpoint, args.device or cfg.eval.device)
    decoder = eval_decoder(cfg, model, tok, args.max_new_tokens)
    res = evaluate_config(decoder, tok, cfg, task, problems, args.max_new_tokens, args.batch_size)
    res.update({"checkpoint": args.checkpoint, "model": args.model, "task": cfg.task.name, "seconds": time.time() - t0})
    if args.json:
        print(json.dumps(res))
    else:
        extra = "".join(f"  {k[5:]} {v:.3f}" for k, v in res.items() if k.startswith(("eval/pass@", "eval/mean@")))
        print(f"accuracy {res['eval/accuracy']:.3f}  reward {res['eval/reward_mean']:.3f}{extra}  "
              f"n {res['eval/n']}  ({res['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
