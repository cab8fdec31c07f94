"""rollout/versions_spanned_*: how many policy versions a response spans, from a packed batch."""
from __future__ import annotations

import copy

import pytest
import torch

from streamrl.config import load_config
from streamrl.engines.factory import build_engine
from streamrl.models.factory import build_model
from streamrl.rollout.factory import build_roller
from streamrl.rollout.metrics import versions_spanned
from streamrl.tasks import get_task
from streamrl.tasks.registry import problem_stream
from streamrl.trajectory import validate_trajectories
from tests.test_inflight_updates import TEMP, TOL, _new_head, _switch_at, _tf_logprobs


def test_versions_spanned_max_and_mean():
    lens = torch.tensor([3, 0, 2, 1])
    versions = torch.tensor([5, 5, 6, 7, 9, 4])  # spans 2, -, 3, 1
    assert versions_spanned(versions, lens) == {"rollout/versions_spanned_max": 3.0,
                                                "rollout/versions_spanned_mean": 2.0}
    assert versions_spanned(torch.zeros(0, dtype=torch.long), torch.zeros(2, dtype=torch.long)) == {
        "rollout/versions_spanned_max": 0.0, "rollout/versions_spanned_mean": 0.0}
    with pytest.raises(ValueError, match="response_lens"):
        versions_spanned(versions, torch.tensor([1, 2]))


@pytest.mark.timeout(300)
def test_long_batch_with_inflight_update_spans_two_versions(repo, monkeypatch):
    """A 2 x 3 batch of 48-token responses (paged hf_fast, shared prompts) with an update before
    decode step 20: every token carries the version that sampled it, its log-prob is that
    version's teacher forcing, and the batch reports versions_spanned 2 (max and mean)."""
    monkeypatch.chdir(repo)
    new, switch = 48, 20
    cfg = load_config("configs/tiny.yaml", ["rollout.engine=hf_fast", "rollout.group_size=3",
                                            "rollout.prompts_per_batch=2", f"rollout.max_new_tokens={new}",
                                            "rollout.max_model_len=96", "rollout.kv_cache=paged",
                                            "rollout.kv_block_size=8", f"rollout.temperature={TEMP}",
                                            "rollout.inflight_updates=true"])
    model, tok = build_model(cfg.model, seed=0)
    v0_model = copy.deepcopy(model).eval()
    update = _new_head(model)
    v1_model = copy.deepcopy(model).eval()
    v1_model.load_state_dict(dict(update))
    engine = build_engine(cfg, model, tok)
    engine.eos_id = -1  # every response runs to the cap, so each spans the switch
    task = get_task(cfg.task.name, num_digits=cfg.task.num_digits)
    roller = build_roller(cfg, engine, tok, problem_stream(task, 0, 0, 1), worker_id=0)
    cb, _ = _switch_at(switch, 4, update)
    torch.manual_seed(0)
    td = roller.rollout_batch(version=3, between_steps=cb)
    validate_trajectories(td)
    lens = td["response_lens"].tolist()
    assert lens == [new] * 6
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    pstarts = [0, *td["prompt_lens"].cumsum(0).tolist()]
    for i in range(6):
        vs = td["policy_version"][starts[i]: starts[i + 1]].tolist()
        assert vs == [3] * switch + [4] * (new - switch)
        prompt = td["prompt_tokens"][pstarts[i]: pstarts[i + 1]].tolist()
        resp = td["response_tokens"][starts[i]: starts[i + 1]].tolist()
        want = torch.cat([_tf_logprobs(v0_model, prompt, resp, TEMP)[:switch],
                          _tf_logprobs(v1_model, prompt, resp, TEMP)[switch:]])
        torch.testing.assert_close(td["behaviour_logprobs"][starts[i]: starts[i + 1]], want, atol=TOL, rtol=0)
    assert versions_spanned(td["policy_version"], td["response_lens"]) == {
        "rollout/versions_spanned_max": 2.0, "rollout/versions_spanned_mean": 2.0}
