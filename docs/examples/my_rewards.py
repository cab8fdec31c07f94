"""A reward plug-in: ``rollout.rewards: "exact_answer=1.0,my_rewards:brevity=0.2"``.

Run it: ``PYTHONPATH=docs/examples python docs/examples/my_rewards.py``.
"""
from streamrl.config import load_config
from streamrl.preflight import check_reward_plugins
from streamrl.rewards import build_reward
from streamrl.tasks import Problem


def brevity(problem: Problem, response: str) -> float:
    """1.0 for a response no longer than the reference answer, falling to 0 at 4x its length."""
    extra = max(0, len(response.strip()) - len(problem.answer))
    return max(0.0, 1.0 - extra / (3 * max(1, len(problem.answer))))


def unit_named(problem: Problem, response: str) -> float:
    """Uses another column of the dataset row: ``problem.fields`` holds every column except prompt and answer."""
    unit = problem.fields.get("unit", "")
    return float(bool(unit) and unit in response)


if __name__ == "__main__":
    spec = "exact_answer=1.0,my_rewards:brevity=0.2,my_rewards:unit_named=0.1"
    cfg = load_config("configs/tiny.yaml", [f"rollout.rewards={spec}"])
    assert check_reward_plugins(cfg) == [], check_reward_plugins(cfg)   # what --dry-run checks
    reward = build_reward(cfg.rollout.rewards)
    problems = [Problem("How far is it?", "12", fields={"unit": "km"})] * 2
    totals, parts = reward.score(problems, ["12", "It is about 12 km, I think."])
    print("components:", reward.names)
    for total, row in zip(totals, parts):
        print(f"total {total:.3f}  parts {[round(x, 3) for x in row]}")
    assert totals[0] > totals[1]
