"""An environment plug-in: ``env.name: "my_env:guess_twice"``, called once per episode.

Run it: ``PYTHONPATH=docs/examples python docs/examples/my_env.py``.
"""
from streamrl.config import load_config
from streamrl.envs.base import FunctionEnv, StepResult
from streamrl.envs.factory import load_env_plugin, tool_runner
from streamrl.tasks import Problem


def guess_twice(cfg, tokenizer, runner):
    """The model answers; a wrong first answer gets a hint and one more turn.

    cfg: the run's Config; tokenizer: the worker's; runner: the worker's ToolRunner (calculator and
    python registered), for environments that call tools (see streamrl.envs.tool_env.ToolEnv).
    """

    def opening(problem: Problem):
        return [{"role": "user", "content": problem.prompt}]

    def step(problem: Problem, turns: list[str]) -> StepResult:
        right = turns[-1].strip() == problem.answer
        if right or len(turns) == cfg.env.max_turns:
            return StepResult([], float(right), True)
        return StepResult([{"role": "user", "content": "Not quite, try again."}], 0.0, False)

    return FunctionEnv(opening, step)


if __name__ == "__main__":
    cfg = load_config("configs/tiny.yaml", ["env.name=my_env:guess_twice", "env.max_turns=2"])
    make = load_env_plugin(cfg.env.name)        # what the rollout worker does at start
    runner = tool_runner(cfg)
    env = make(cfg, None, runner)
    print(env.reset(Problem("What is 2 + 2?", "4")))
    first = env.step("5")
    print("turn 1:", first)
    second = env.step("4")
    print("turn 2:", second)
    assert second.done and second.reward == 1.0
    runner.close()
