"""The trajectory contract: packing, validation rules, split/concat, padding, optional fields."""
from __future__ import annotations

import pytest
import torch

from streamrl.trajectory import (
    ALL_FIELDS,
    FIELDS,
    OPTIONAL_FIELDS,
    TrajectoryError,
    concat_trajectories,
    make_id,
    min_version,
    pack_trajectories,
    split_trajectories,
    to_padded,
    validate_trajectories,
)


def batch(lens=((3, 2), (1, 4), (2, 1)), worker=7, routed=None, components=False, started=True):
    prompts = [[10 + i] * p for i, (p, _) in enumerate(lens)]
    responses = [[20 + i + j for j in range(r)] for i, (_, r) in enumerate(lens)]
    return pack_trajectories(
        prompts, responses,
        [[-0.5 - j for j in range(r)] for _, r in lens],
        [[i] * r for i, (_, r) in enumerate(lens)],
        [float(i) for i in range(len(lens))],
        [make_id(worker, 0)] * len(lens),
        [make_id(worker, i) for i in range(len(lens))],
        worker, 1000.0,
        started_at=999.0 if started else None,
        response_masks=[[j % 2 == 0 for j in range(r)] for _, r in lens],
        reward_components=[[1.0, float(i)] for i in range(len(lens))] if components else None,
        routed_experts=[torch.randint(0, 8, (r, routed[0], routed[1])) for _, r in lens] if routed else None,
    )


def test_schema_tables_are_consistent():
    assert not set(FIELDS) & set(OPTIONAL_FIELDS)
    assert ALL_FIELDS == {**FIELDS, **OPTIONAL_FIELDS}
    from streamrl.trajectory import __doc__ as doc
    for key in ALL_FIELDS:  # every key is documented in the module docstring table
        assert key in doc


def test_pack_validates_with_all_optional_fields():
    td = batch(routed=(3, 2), components=True)
    validate_trajectories(td)
    validate_trajectories(dict(td.items()), max_version=2)  # plain dicts are accepted too
    assert td["routed_experts"].shape == (7, 3, 2) and td["routed_experts"].dtype == torch.int16
    assert td["reward_components"].shape == (3, 2)
    assert td["response_mask"].tolist()[:3] == [True, False, True]
    assert min_version(td) == 0


@pytest.mark.parametrize("mutate,reason", [
    (lambda d: d.pop("reward"), "missing_key"),
    (lambda d: d.__setitem__("extra", torch.zeros(3)), "unknown_key"),
    (lambda d: d.__setitem__("reward", d["reward"].double()), "bad_dtype"),
    (lambda d: d.__setitem__("reward", torch.zeros(4)), "bad_shape"),
    (lambda d: d.__setitem__("prompt_lens", torch.tensor([3, 0, 2])), "bad_length"),
    (lambda d: d.__setitem__("response_lens", torch.tensor([2, 4, 2**40])), "bad_length"),
    (lambda d: d.__setitem__("response_lens", torch.tensor([2, 4])), "bad_shape"),
    (lambda d: d["behaviour_logprobs"].__setitem__(0, float("nan")), "non_finite"),
    (lambda d: d["behaviour_logprobs"].__setitem__(0, float("-inf")), "non_finite"),
    (lambda d: d["behaviour_logprobs"].__setitem__(0, 0.5), "bad_logprob"),
    (lambda d: d["created_at"].__setitem__(0, float("inf")), "non_finite"),
    (lambda d: d["policy_version"].__setitem__(0, -1), "bad_version"),
    (lambda d: d["policy_version"].__setitem__(0, 99), "future_version"),
    (lambda d: d["traj_id"].__setitem__(0, -5), "bad_id"),
    (lambda d: d["started_at"].__setitem__(0, 2000.0), "bad_timestamp"),
    (lambda d: d["routed_experts"].__setitem__(0, -1), "bad_expert"),
    (lambda d: d.__setitem__("routed_experts", torch.zeros(7, 0, 2, dtype=torch.int16)), "bad_shape"),
    (lambda d: d.__setitem__("reward_components", torch.zeros(3, dtype=torch.float32)), "bad_shape"),
])
def test_validation_names_the_broken_rule(mutate, reason):
    d = {k: v.clone() for k, v in batch(routed=(2, 2)).items()}
    mutate(d)
    with pytest.raises(TrajectoryError) as e:
        validate_trajectories(d, max_version=10)
    assert e.value.reason == reason
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("lens", [((1, 1),), ((5, 1), (1, 9)), ((2, 3),) * 17])
def test_split_concat_roundtrip(lens):
    td = batch(lens, routed=(2, 1), components=True)
    parts = split_trajectories(td)
    assert len(parts) == len(lens)
    for part, (p, r) in zip(parts, lens):
        validate_trajectories(part)
        assert part["prompt_tokens"].numel() == p and part["routed_experts"].shape[0] == r
    back = concat_trajectories(parts)
    assert set(back.keys()) == set(td.keys())
    for k in td.keys():
        assert torch.equal(back[k], td[k]), k


def test_concat_keeps_only_optional_keys_all_items_have():
    a, b = batch(routed=(2, 2)), batch(started=False)
    out = concat_trajectories([a, b])
    validate_trajectories(out)
    assert "routed_experts" not in out.keys() and "started_at" not in out.keys()
    with pytest.raises(ValueError, match="at least one"):
        concat_trajectories([])


def test_to_padded_aligns_routed_experts_with_predicting_position():
    td = batch(((2, 3), (1, 1)), routed=(2, 2))
    out = to_padded(td, pad_id=0)
    re_ = out["routed_experts"]
    assert re_.shape == (2, 4, 2, 2)
    # trajectory 0: prompt 2, response 3 -> response token j is predicted at position 1 + j
    assert torch.equal(re_[0, 1:4], td["routed_experts"][0:3].long())
    assert (re_[0, 0] == -1).all()
    assert torch.equal(re_[1, 0], td["routed_experts"][3].long()) and (re_[1, 1:] == -1).all()
    assert torch.equal(out["loss_mask"][0, 1:4], torch.tensor([1.0, 0.0, 1.0]))
