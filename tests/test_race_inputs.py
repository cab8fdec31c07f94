"""Bad input for a run: a dataset without its answer column and an unknown task stop --dry-run
with one line (exit 2); a reward plug-in that raises scores 0 and is counted, the run goes on."""
from __future__ import annotations

import logging

from streamrl.launcher import launch
from streamrl.rewards import build_reward
from streamrl.tasks.registry import Problem


def dry_run_lines(capsys, *argv) -> list[str]:
    assert launch.main([*argv, "--dry-run"]) == 2
    return capsys.readouterr().err.strip().splitlines()


def test_dataset_without_the_answer_column_stops_dry_run(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "1+1=", "solution": "2"}\n')
    (line,) = dry_run_lines(capsys, f"data.path={path}")
    assert line == (f"streamrl-launch: config field 'data.path' = '{path}': {path}:1: no 'answer' "
                    "(data.answer_key); the row has ['prompt', 'solution']")
    (line,) = dry_run_lines(capsys, f"eval.dataset={path}", "data.answer_key=answer")
    assert "config field 'eval.dataset'" in line and "no 'answer'" in line


def test_unknown_task_stops_dry_run(capsys):
    (line,) = dry_run_lines(capsys, "task.name=no_such_task")
    assert "'task.name' = 'no_such_task': unknown task; known:" in line and "reasoning_gym" in line


def boom(problem, response):
    raise KeyError("metadata")


def test_raising_reward_plugin_scores_zero_is_counted_and_logged_once(caplog):
    reward = build_reward("exact_answer=1.0,test_race_inputs:boom")
    problems = [Problem("1+1=", "2")] * 3
    with caplog.at_level(logging.WARNING, logger="streamrl.rewards"):
        totals, comps = reward.score(problems, ["2", "3", "2"])
        reward.score(problems, ["2", "2", "2"])
    assert totals == [1.0, 0.0, 1.0] and [c[1] for c in comps] == [0.0, 0.0, 0.0]
    assert reward.errors == {"test_race_inputs:boom": 6}
    assert len([r for r in caplog.records if "raised KeyError" in r.getMessage()]) == 1
