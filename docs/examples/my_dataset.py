"""Prompts from a file: ``data.path``, with ``data.prompt_key`` / ``data.answer_key`` naming the columns.

Run it: ``python docs/examples/my_dataset.py``.
"""
import json
import tempfile
from pathlib import Path

from streamrl.config import load_config
from streamrl.tasks import build_task
from streamrl.tasks.sources import build_prompt_source

rows = [
    {"question": "What is 7 * 6?", "solution": 42, "unit": ""},
    {"question": [{"role": "system", "content": "Answer with a number."},
                  {"role": "user", "content": "How many legs do 3 spiders have?"}], "solution": "24", "unit": "legs"},
]

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = load_config("configs/tiny.yaml", [f"data.path={path}", "data.prompt_key=question",
                                                "data.answer_key=solution"])
        source = build_prompt_source(cfg, build_task(cfg.task), seed=0, shard=0, num_shards=1)
        for problem in (next(source) for _ in range(2)):
            print(repr(problem.prompt), "->", repr(problem.answer), dict(problem.fields),
                  "chat turns:", len(problem.messages or ()))
        bad = load_config("configs/tiny.yaml", [f"data.path={path}", "data.prompt_key=prompt"])
        try:
            next(build_prompt_source(bad, build_task(bad.task), 0, 0, 1))
        except ValueError as e:
            print("error:", e)
