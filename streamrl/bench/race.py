"""``streamrl-bench race``: StreamRL vs TRL's GRPOTrainer, held-out accuracy against wall time.

Both sides train the config's model on the same prompts (the task's training stream), group
size, learning rate, temperature, token limit and reward for the same wall-clock budget
(``--budget-s``, counted from each side's process start: model load and warm-up included).
Each exports HF folders at 25/50/75/100 % of the budget (StreamRL: the learner's in-run
exports, :mod:`streamrl.bench.race_streamrl`; TRL: a callback, :mod:`streamrl.bench.peer_trl`),
and every folder, with the base model at time 0, is scored by one evaluator
(:class:`streamrl.bench.race_curve.FolderScorer`: greedy, the config's held-out set and
``eval.max_new_tokens``).

One side per invocation (a GPU call fits one side; ``--phase train`` then ``--phase score`` split
a side that does not fit one call) and a combine step, or both at once::

    streamrl-bench race --config configs/gpu-reasoning.yaml --side streamrl --out runs/race --budget-s 360
    streamrl-bench race --config configs/gpu-reasoning.yaml --side peer --out runs/race --budget-s 360
    streamrl-bench race --combine runs/race --json
    streamrl-bench race --summarize runs/race-s0 runs/race-s1 runs/race-s2 --json   # median of pairs
    streamrl-bench race --config configs/race-tiny.yaml --budget-s 60 --device cpu --json   # both sides

Training writes ``OUT/<side>-exports.json`` (the exports and their times), scoring
``OUT/<side>.json`` (its scored curve and its ``setup``: the base model's bytes, the tokenizer's
special tokens and template, the held-out set, the torch and transformers releases, the device).
Sides run in separate calls may land on different machines, so ``--combine`` refuses two sides
whose setups differ, naming the field. ``--combine`` (and a both-sides run) writes
``OUT/race.json`` and ``OUT/race.png``. The JSON holds both curves (points ``{"fraction",
"time_s", "samples", "step", "accuracy", "stderr", "sets", ...}``) and the figures of
:func:`streamrl.bench.race_curve.compare`, ``time_to_peer_final_accuracy_ratio`` among them.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from streamrl.bench.race_curve import FolderScorer, check_same_setup, compare, plot, summarize
from streamrl.bench.race_streamrl import run_streamrl_side
from streamrl.config import load_config

SIDES = ("streamrl", "peer")
PHASES = ("all", "train", "score")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="streamrl-bench race", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/gpu-reasoning.yaml")
    p.add_argument("--side", choices=(*SIDES, "both"), default="both")
    p.add_argument("--out", default="runs/race", help="folder for the runs, the side JSONs, race.json and race.png")
    p.add_argument("--budget-s", type=float, default=360.0, help="wall-clock training budget of each side")
    p.add_argument("--rollers", type=int, default=1, help="StreamRL rollout workers")
    p.add_argument("--export-every", type=int, default=5,
                   help="StreamRL learner steps between HF exports (the marks take the newest before them)")
    p.add_argument("--device", default=None, help="device of TRL's model and of the scoring (default: eval.device)")
    p.add_argument("--phase", choices=PHASES, default="all",
                   help="train: train and list the exports (OUT/<side>-exports.json); score: score a trained "
                        "side's exports; all: both (a side whose training and scoring do not fit one GPU call "
                        "runs them as two)")
    p.add_argument("--combine", metavar="DIR", default=None,
                   help="instead of training: combine DIR/streamrl.json and DIR/peer.json into DIR/race.json")
    p.add_argument("--summarize", metavar="DIR", nargs="+", default=None,
                   help="instead of training: the median and spread over pairs, each DIR holding one pair's race.json")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*", help="config overrides for both sides, e.g. learner.lr=1e-6")
    return p.parse_args(argv)


def check_model_folder(cfg) -> None:
    """Refuse, before either side starts, a model folder whose tokenizer would make the race
    unfair or broken: no end-of-sequence token (no response stops; TRL cannot pad), or no chat
    template where ``rollout.chat_template`` asks for one (the sides would format prompts in
    ways the model was not tuned for). Both are what a GGUF conversion can lose."""
    from transformers import AutoTokenizer  # noqa: PLC0415 (a --combine needs no model)

    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    where = f"model.path = {cfg.model.path!r}"
    if tok.eos_token is None:
        raise ValueError(f"{where}: its tokenizer has no end-of-sequence token (no response could stop, TRL cannot "
                         f"pad); prepare the folder again (streamrl-prepare-model)")
    if cfg.rollout.chat_template and not tok.chat_template:
        raise ValueError(f"{where}: rollout.chat_template = true but its tokenizer has no chat template; prepare "
                         f"the folder again, or race on plain prompts with rollout.chat_template=false")


def scored_curve(cfg, points: list[dict], base: dict, score: FolderScorer, budget_s: float) -> list[dict]:
    """The base model's point then each export's, scored by the one evaluator."""
    curve = [{"fraction": 0.0, "time_s": 0.0, "step": 0, "samples": 0, **base}]
    scores = {str(cfg.model.path): base}  # a folder scored once (the base model may stand at several marks)
    for pt in points:
        fields = {k: v for k, v in pt.items() if k != "folder"}
        if fields["time_s"] is None:  # a mark reached before the first export: the base model then
            fields["time_s"] = pt["fraction"] * budget_s
        if str(pt["folder"]) not in scores:
            scores[str(pt["folder"])] = score(pt["folder"])
        curve.append({**fields, **scores[str(pt["folder"])]})
    return curve


def train_side(args, side: str, out: Path, device: str, per_step: int) -> dict:
    """Train one side under the budget; writes and returns ``OUT/<side>-exports.json``
    (``{"train_wall_s", "points": [{"fraction", "time_s", "step", "samples", "folder"}]}``)."""
    t0 = time.time()
    if side == "streamrl":
        points = run_streamrl_side(args.config, out, args.budget_s, args.rollers, args.export_every,
                                   args.overrides, per_step)
    else:
        cmd = [sys.executable, "-m", "streamrl.bench.peer_trl", "--config", args.config, "--out", str(out),
               "--budget-s", str(args.budget_s), "--t0", str(t0), "--device", device, *args.overrides]
        with (out / "peer-train.log").open("w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            raise RuntimeError(f"the TRL side exited with {rc} (see {out / 'peer-train.log'})")
        points = json.loads((out / "peer-points.json").read_text())
    trained = {"side": side, "budget_s": args.budget_s, "train_wall_s": round(time.time() - t0, 1),
               "points": points}
    (out / f"{side}-exports.json").write_text(json.dumps(trained, indent=2))
    return trained


def score_side(args, side: str, cfg, out: Path, device: str) -> dict:
    """Score a trained side's exports (and the base model); writes and returns ``OUT/<side>.json``."""
    path = out / f"{side}-exports.json"
    if not path.is_file():
        raise ValueError(f"--phase score: no {path} (run --side {side} --phase train --out {out} first)")
    trained = json.loads(path.read_text())
    t0 = time.time()
    score = FolderScorer(cfg, device)
    base = score(cfg.model.path)
    curve = scored_curve(cfg, trained["points"], base, score, trained["budget_s"])
    setup = score.setup()
    score.close()
    result = {"side": side, "budget_s": trained["budget_s"], "train_wall_s": trained["train_wall_s"], "curve": curve,
              "config": args.config, "overrides": args.overrides, "setup": setup,
              "scoring_s": round(time.time() - t0, 1)}
    (out / f"{side}.json").write_text(json.dumps(result, indent=2))
    return result


def combine(out: Path) -> dict:
    """``OUT/race.json`` and ``OUT/race.png`` from the two side JSONs in ``out``."""
    sides = {}
    for side in SIDES:
        path = out / f"{side}.json"
        if not path.is_file():
            raise ValueError(f"--combine {out}: no {path.name} (run --side {side} --out {out} first)")
        sides[side] = json.loads(path.read_text())
    if sides["streamrl"]["budget_s"] != sides["peer"]["budget_s"]:
        raise ValueError(f"--combine {out}: the sides ran different budgets "
                         f"({sides['streamrl']['budget_s']} vs {sides['peer']['budget_s']} s)")
    try:
        missing = check_same_setup({side: sides[side].get("setup") for side in SIDES})
    except ValueError as e:
        raise ValueError(f"--combine {out}: {e}") from None
    for side in missing:
        print(f"streamrl-bench race: --combine {out}: {side}.json records no setup; the sides' model, tokenizer, "
              f"held-out set and releases are not checked", file=sys.stderr)
    curves = {side: sides[side]["curve"] for side in SIDES}
    result = {"budget_s": sides["peer"]["budget_s"], "config": sides["peer"]["config"],
              **compare(curves["streamrl"], curves["peer"]), "streamrl": curves["streamrl"], "peer": curves["peer"],
              "train_wall_s": {s: sides[s]["train_wall_s"] for s in SIDES}, "setup": sides["peer"].get("setup")}
    png = out / "race.png"
    plot({"StreamRL": curves["streamrl"], "TRL GRPOTrainer": curves["peer"]}, png,
         f"{Path(result['config']).stem}: held-out accuracy vs wall time ({result['budget_s']:.0f} s each)")
    result["png"] = str(png)
    (out / "race.json").write_text(json.dumps(result, indent=2))
    return result


def _print(result: dict) -> None:
    for side in SIDES:
        pts = "  ".join(f"{p['time_s']:.0f}s:{p['accuracy']:.3f}" for p in result[side])
        print(f"{side:<9} {pts}")
    ratio = result["time_to_peer_final_accuracy_ratio"]
    print(f"time_to_peer_final_accuracy_ratio {ratio if ratio is None else round(ratio, 2)}  "
          f"final gap {result['final_accuracy_gap']:+.3f} (stderr {result['final_accuracy_gap_stderr']:.3f})")


def read_pairs(dirs: list[str]) -> dict[str, dict]:
    """``{DIR: DIR/race.json}`` for ``--summarize``."""
    races = {}
    for d in dirs:
        path = Path(d) / "race.json"
        if not path.is_file():
            raise ValueError(f"--summarize: no {path} (run --combine {d} first)")
        races[d] = json.loads(path.read_text())
    return races


def _print_summary(summary: dict) -> None:
    for name, p in summary["pairs"].items():
        ratio = "-" if p["ratio"] is None else f"{p['ratio']:.2f}"
        print(f"{name}: ratio {ratio}  final gap {p['final_gap']:+.3f} (stderr {p['final_gap_stderr']:.3f})")
    n = len(summary["pairs"])
    print(f"median of {n} pairs: ratio {summary['ratio_median']:.2f} ({summary['ratio_min']:.2f}-"
          f"{summary['ratio_max']:.2f}), final gap {summary['final_gap_median']:+.3f} ({summary['final_gap_min']:+.3f}"
          f" to {summary['final_gap_max']:+.3f}); {summary['pairs_ending_above']} of {n} end above by more "
          f"than their stderr")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.summarize:
            summary = summarize(read_pairs(args.summarize))
            _print_summary(summary)
            if args.json:
                print(json.dumps(summary))
            return 0
        if args.combine:
            result = combine(Path(args.combine))
        else:
            cfg = load_config(args.config, args.overrides)  # a config error stops here, before any run
            if not cfg.model.path:
                raise ValueError("model.path: the race needs an HF model folder (TRL loads it too)")
            if args.phase in ("all", "train"):
                check_model_folder(cfg)
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            device = args.device or cfg.eval.device
            per_step = cfg.learner.groups_per_step * cfg.rollout.group_size
            for side in SIDES if args.side == "both" else (args.side,):
                if args.phase in ("all", "train"):
                    train_side(args, side, out, device, per_step)
                if args.phase in ("all", "score"):
                    score_side(args, side, cfg, out, device)
            if args.phase == "train":
                print(f"trained: {', '.join(str(out / (s + '-exports.json')) for s in SIDES if args.side in (s, 'both'))}")
                return 0
            if args.side != "both":
                print(json.dumps(json.loads((out / f"{args.side}.json").read_text())) if args.json else
                      f"wrote {out / (args.side + '.json')}")
                return 0
            result = combine(out)
    except ValueError as e:
        print(f"streamrl-bench race: {e}", file=sys.stderr)
        return 2
    _print(result)
    if args.json:
        print(json.dumps(result))
    return 0
