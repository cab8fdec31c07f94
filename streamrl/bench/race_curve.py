"""Scoring the race's checkpoints with one evaluator, and comparing the two accuracy curves.

Every checkpoint of both sides (and the base model, at time 0) goes through
:class:`FolderScorer`: the same held-out problems, the same greedy decode, the same token limit
and the same reward (:func:`streamrl.evaluate.evaluate_config`), so a gap between the curves is
the training's and not the scorer's.

A *curve* is a list of points ``{"fraction", "time_s", "samples", "accuracy", "stderr", ...}``
in time order, the first being the base model (``time_s`` 0). ``time_to_accuracy`` reads the
first time a curve reaches an accuracy, linearly interpolated between points.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import statistics
from pathlib import Path

import torch
import transformers

from streamrl.evaluate import eval_decoder, evaluate_config, eval_set
from streamrl.models.factory import load_model_and_tokenizer
from streamrl.tasks import build_task

# curve keys copied from an evaluation row (eval/accuracy/<set> are added per set)
ROW_KEYS = ("eval/accuracy", "eval/reward_mean", "eval/truncated", "eval/response_tokens_median", "eval/n")


def stderr(p: float, n: int) -> float:
    """Binomial standard error of an accuracy ``p`` over ``n`` problems."""
    return math.sqrt(max(p * (1 - p), 0.0) / max(n, 1))


class FolderScorer:
    """Greedy held-out evaluation of HF folders (checkpoints of one model) under ``cfg``'s task and ``eval.*``.

    The held-out set is built once, and so is the decoder (:func:`streamrl.evaluate.eval_decoder`):
    each later folder's weights are copied into it, so with ``eval.engine: hf_fast`` the engine's
    compiled, graph-captured decode step is built once, not once a folder.
    ``scorer(folder)`` returns the curve fields: ``accuracy``, ``stderr``, ``truncated``,
    ``response_tokens_median``, ``n`` and ``sets`` (``{set: {"accuracy", "stderr", "n"}}`` per
    held-out set of a task mix).
    """

    def __init__(self, cfg, device: str):
        self.cfg, self.device = cfg, device
        self.task = build_task(cfg.task)
        self.problems = eval_set(cfg, self.task)
        self.decoder = self.tok = None

    def __call__(self, folder: str | Path) -> dict:
        model, tok = load_model_and_tokenizer(dataclasses.replace(self.cfg.model, path=str(folder)),
                                              seed=self.cfg.run.seed)
        if self.decoder is None:
            self.decoder, self.tok = eval_decoder(self.cfg, model.to(self.device), tok), tok
        else:  # checkpoints of one model: same names and shapes, cast to the decoder's dtype as copied
            self.decoder.load_weights(model.named_parameters())
        del model
        return curve_fields(evaluate_config(self.decoder, self.tok, self.cfg, self.task, self.problems))

    def setup(self) -> dict:
        """What must be equal for two sides' curves to be compared (:func:`check_same_setup`):
        the base model folder's bytes, the tokenizer's special tokens and chat template, the
        held-out problems, the torch and transformers releases and the device. Call after the
        first folder is scored (the tokenizer is the decoder's)."""
        tok = self.tok
        template = getattr(tok, "chat_template", None)
        problems = json.dumps([[p.prompt, p.answer] for p in self.problems]).encode()
        path = Path(self.cfg.model.path)
        return {"model": folder_digest(path) if path.is_dir() else str(path),
                "tokenizer": {"bos": tok.bos_token, "eos": tok.eos_token, "pad": tok.pad_token,
                              "chat_template": hashlib.sha256(template.encode()).hexdigest()[:16] if template else None},
                "held_out": hashlib.sha256(problems).hexdigest()[:16],
                "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
                "device": torch.cuda.get_device_name(self.device) if self.device.startswith("cuda") else "cpu"}

    def close(self) -> None:
        """Free the decoder's model (and a fast engine's KV cache and captured graphs) on the device."""
        if self.decoder is not None:
            self.decoder.close()
        self.decoder = None
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()


def folder_digest(folder: Path) -> str:
    """sha256 (16 hex digits) of every file of an HF folder, names and bytes, in name order."""
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(folder)).encode() + b"\0")
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:16]


def check_same_setup(setups: dict[str, dict | None]) -> list[str]:
    """Raise ``ValueError`` naming the first field in which the sides' :meth:`FolderScorer.setup`
    differ: their curves are not comparable (another tokenizer, transformers release or GPU
    changes the base model's score and the time axis). Returns the sides recorded without one
    (older JSONs), which cannot be checked."""
    missing = [side for side, setup in setups.items() if setup is None]
    known = {side: setup for side, setup in setups.items() if setup is not None}
    if len(known) == 2:
        (a, sa), (b, sb) = known.items()
        for key in sa.keys() | sb.keys():
            if sa.get(key) != sb.get(key):
                raise ValueError(f"the sides ran on different setups: {key} {sa.get(key)!r} ({a}) vs "
                                 f"{sb.get(key)!r} ({b}); run both sides on one setup")
    return missing


def curve_fields(row: dict) -> dict:
    """An evaluation row (``eval/*`` keys) -> the fields of one curve point."""
    n = int(row["eval/n"])
    acc = float(row["eval/accuracy"])
    sets = {}
    for key, value in row.items():
        if key.startswith("eval/accuracy/"):
            name = key[len("eval/accuracy/"):]
            size = int(row.get(f"eval/n/{name}", 0)) or None
            sets[name] = {"accuracy": float(value), "stderr": stderr(float(value), size) if size else None, "n": size}
    return {"accuracy": acc, "stderr": stderr(acc, n), "n": n, "truncated": float(row.get("eval/truncated", 0.0)),
            "response_tokens_median": row.get("eval/response_tokens_median"), "sets": sets}


def time_to_accuracy(points: list[dict], target: float) -> float | None:
    """First time (s) the curve reaches ``target``, linear between points; None if it never does."""
    prev = None
    for pt in points:
        if pt["accuracy"] >= target:
            if prev is None or prev["accuracy"] >= target:
                return float(pt["time_s"])
            share = (target - prev["accuracy"]) / (pt["accuracy"] - prev["accuracy"])
            return float(prev["time_s"] + share * (pt["time_s"] - prev["time_s"]))
        prev = pt
    return None


def compare(streamrl: list[dict], peer: list[dict]) -> dict:
    """The race's figures from the two curves (each starting with the base model's point).

    ``time_to_peer_final_accuracy_ratio`` = (peer's first time at its final accuracy) /
    (StreamRL's first time at that accuracy). Rules: when StreamRL never reaches it, the ratio is
    None and ``streamrl_reached_peer_final`` False; when the peer's final accuracy is not above the
    base model's (nothing learned to race for), the ratio is None and ``peer_improved`` False.
    """
    target = peer[-1]["accuracy"]
    base = peer[0]["accuracy"]
    peer_t = time_to_accuracy(peer, target)
    ours_t = time_to_accuracy(streamrl, target)
    improved = target > base
    ratio = peer_t / ours_t if improved and ours_t and peer_t is not None else None
    final_gap = streamrl[-1]["accuracy"] - target
    gap_se = math.hypot(streamrl[-1]["stderr"], peer[-1]["stderr"])
    gains = {f"{name}_held_out_families": family_gain(curve) for name, curve in (("streamrl", streamrl), ("peer", peer))}
    return {**{k: v for k, v in gains.items() if v is not None}, "peer_final_accuracy": target,
            "peer_time_to_final_s": peer_t, "streamrl_time_to_peer_final_s": ours_t,
            "time_to_peer_final_accuracy_ratio": ratio, "streamrl_reached_peer_final": ours_t is not None,
            "peer_improved": improved, "final_accuracy_gap": final_gap, "final_accuracy_gap_stderr": gap_se,
            "streamrl_ends_above_peer": final_gap > gap_se}


def summarize(races: dict[str, dict]) -> dict:
    """The figures over several pairs (``{name: race.json's dict}``, one seed each): per pair its
    ratio, final gap, the gap's stderr and whether StreamRL ends above the peer by more than it;
    then the median and spread (min, max) of the ratio and of the gap. A pair without a ratio
    (StreamRL never reached the peer's final accuracy, or the peer learned nothing) counts as
    ratio 0 in the median: the pessimistic reading, said in ``pairs_without_ratio``."""
    if not races:
        raise ValueError("no pairs to summarize")
    budgets = {name: r["budget_s"] for name, r in races.items()}
    if len(set(budgets.values())) > 1:
        raise ValueError(f"the pairs ran different budgets: {budgets}")
    pairs = {name: {"ratio": r["time_to_peer_final_accuracy_ratio"], "final_gap": r["final_accuracy_gap"],
                    "final_gap_stderr": r["final_accuracy_gap_stderr"], "ends_above": r["streamrl_ends_above_peer"],
                    "peer_final_accuracy": r["peer_final_accuracy"]} for name, r in races.items()}
    ratios = [p["ratio"] if p["ratio"] is not None else 0.0 for p in pairs.values()]
    gaps = [p["final_gap"] for p in pairs.values()]
    return {"pairs": pairs, "budget_s": next(iter(budgets.values())),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "final_gap_median": statistics.median(gaps), "final_gap_min": min(gaps), "final_gap_max": max(gaps),
            "pairs_ending_above": sum(p["ends_above"] for p in pairs.values()),
            "pairs_without_ratio": [name for name, p in pairs.items() if p["ratio"] is None]}


def family_gain(curve: list[dict]) -> dict | None:
    """Base vs final accuracy (with stderrs) on the families training never saw; None without any."""
    first, last = (p.get("sets", {}).get("held_out_families") for p in (curve[0], curve[-1]))
    if first is None or last is None:
        return None
    return {"base": first["accuracy"], "base_stderr": first["stderr"], "final": last["accuracy"],
            "final_stderr": last["stderr"], "gain": last["accuracy"] - first["accuracy"]}


def plot(curves: dict[str, list[dict]], path: Path, title: str) -> None:
    """Held-out accuracy (+- stderr) vs wall time, one line per side; a PNG at ``path``. A second
    panel shows the held-out families alone when the task mix has some (the skill's transfer)."""
    import matplotlib  # noqa: PLC0415 (plotting only when a PNG is asked for)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    panels = [("all held-out items", lambda p: p)]
    if all("held_out_families" in p.get("sets", {}) for pts in curves.values() for p in pts):
        panels.append(("task families never trained on", lambda p: p["sets"]["held_out_families"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.2), squeeze=False)
    for ax, (name, pick) in zip(axes[0], panels):
        for side, pts in curves.items():
            ax.errorbar([p["time_s"] for p in pts], [pick(p)["accuracy"] for p in pts],
                        yerr=[pick(p)["stderr"] or 0.0 for p in pts], marker="o", capsize=3, label=side)
        ax.set(xlabel="wall time (s)", ylabel="greedy accuracy", title=name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
