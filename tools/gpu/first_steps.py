"""Print the first steps of each run of an e2e output folder: idle, step and warm-up seconds
(the learner's start-up, which the whole-run idle share carries).   python3 tools/gpu/first_steps.py /tmp/e1
Reads the bench's run folders (``<mode>/metrics.jsonl``) or an unpacked ``runs.tgz`` (``<mode>-metrics.jsonl``)."""
import json
import sys
from pathlib import Path

root = Path(sys.argv[1])
for f in sorted([*root.glob("*/metrics.jsonl"), *root.glob("*-metrics.jsonl")]):
    rows = [json.loads(line) for line in f.read_text().splitlines()]
    rows = [r for r in rows if "learner/step_s" in r][:6]
    name = f.parent.name if f.name == "metrics.jsonl" else f.name.removesuffix("-metrics.jsonl")
    print(name, "warm-up s", rows[0].get("learner/warmup_s", 0.0) if rows else "-", "| step: wall idle step_s")
    for i, r in enumerate(rows):
        print(f"  {i + 1}: {r['wall_s']:.1f} {r['learner/idle_s']:.2f} {r['learner/step_s']:.2f}")
