"""Prompt datasets: JSONL, Parquet and datasets folders, field mapping, extra fields to rewards."""
from __future__ import annotations

import itertools
import json

import pytest

from streamrl.config import load_config
from streamrl.rewards import build_reward
from streamrl.tasks import build_task
from streamrl.tasks.datasets import load_problems
from streamrl.tasks.sources import build_prompt_source

ROWS = [{"question": f"What is {i} + {i}?", "solution": 2 * i, "unit": "apples", "level": i % 3} for i in range(6)]


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_hf(path, rows, split=None):
    import datasets

    ds = datasets.Dataset.from_list(rows)
    (datasets.DatasetDict({split: ds}) if split else ds).save_to_disk(str(path))
    return path


WRITERS = {"jsonl": ("d.jsonl", write_jsonl), "parquet": ("d.parquet", write_parquet), "hf": ("d_hf", write_hf)}


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_each_format_maps_fields_and_keeps_the_other_columns(tmp_path, fmt):
    name, write = WRITERS[fmt]
    path = write(tmp_path / name, ROWS)
    problems = load_problems(path, prompt_key="question", answer_key="solution")
    assert [p.prompt for p in problems] == [r["question"] for r in ROWS]
    assert problems[3].answer == "6"  # a number answer, written as text
    assert dict(problems[4].fields) == {"unit": "apples", "level": 1}


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_missing_key_names_the_file_and_the_key(tmp_path, fmt):
    name, write = WRITERS[fmt]
    path = write(tmp_path / name, ROWS)
    with pytest.raises(ValueError, match=rf"{name}.*row 0|{name}:1") as e:
        load_problems(path, prompt_key="prompt", answer_key="solution")
    assert "'prompt' (data.prompt_key)" in str(e.value) and "question" in str(e.value)
    with pytest.raises(ValueError, match="'answer' .data.answer_key."):
        load_problems(path, prompt_key="question")


def test_chat_messages_keep_the_conversation(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
             "answer": "4"}]
    (p,) = load_problems(write_jsonl(tmp_path / "c.jsonl", rows), prompt_key="messages")
    assert p.prompt == "2+2?" and [m["role"] for m in p.messages] == ["system", "user"]
    with pytest.raises(ValueError, match="chat messages"):
        load_problems(write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": 1}], "answer": "4"}]),
                      prompt_key="messages")


def test_datasetdict_folder_takes_the_split(tmp_path):
    path = write_hf(tmp_path / "dd", ROWS, split="test")
    assert len(load_problems(path, "question", "solution", split="test")) == 6
    with pytest.raises(ValueError, match=r"splits \['test'\], not data.split = 'train'"):
        load_problems(path, "question", "solution")


def test_missing_path_and_empty_file_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="data.path = '/nonexistent.parquet' does not exist"):
        load_problems("/nonexistent.parquet")
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no problems"):
        load_problems(tmp_path / "e.jsonl")


def test_extra_fields_reach_a_reward_plugin(tmp_path, monkeypatch):
    (tmp_path / "unit_reward.py").write_text(
        "def mentions_unit(problem, response):\n"
        "    return float(problem.fields['unit'] in response)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write_parquet(tmp_path / "d.parquet", ROWS)
    cfg = load_config(None, [f"data.path={path}", "data.prompt_key=question", "data.answer_key=solution",
                             "rollout.rewards=exact_answer=1.0,unit_reward:mentions_unit=0.5"])
    task = build_task(cfg.task)
    stream = build_prompt_source(cfg, task, seed=0, shard=0, num_shards=1)
    problems = list(itertools.islice(stream, 6))
    reward = build_reward(cfg.rollout.rewards, task)
    totals, comps = reward.score(problems, [f"{p.answer} apples" for p in problems])
    assert totals == [1.5] * 6 and comps[0] == [1.0, 1.0]
    assert reward.score(problems[:1], [problems[0].answer])[0] == [1.0]
