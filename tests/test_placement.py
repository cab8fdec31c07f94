"""Placement: device strings, machine checks, colocation, CUDA_VISIBLE_DEVICES, multi-node plans."""
from __future__ import annotations

import pytest

from streamrl.config import ConfigError, PlacementConfig, load_config
from streamrl.placement import Device, PlacementError, assign_threads, parse_devices, plan_node


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg
    return msg


def test_parse_devices_forms():
    assert parse_devices("cpu", "x") == [Device("cpu")]
    assert parse_devices(["cuda:1"], "x") == [Device("cuda", 1)]
    assert [str(d) for d in parse_devices("cuda:0-2", "x")] == ["cuda:0", "cuda:1", "cuda:2"]
    assert [str(d) for d in parse_devices("node0-1:cuda:0-1", "x")] == [
        "node0:cuda:0", "node0:cuda:1", "node1:cuda:0", "node1:cuda:1"]
    assert parse_devices(None, "x") == []


@pytest.mark.parametrize("bad", ["gpu0", "cuda:", "cpu:0", "cuda:a", "node:cuda:0", "cuda:3-1", "", 7])
def test_bad_device_string_is_one_line(bad):
    with pytest.raises(PlacementError) as e:
        parse_devices(["cpu", bad], "placement.rollout")
    assert "placement.rollout" in one_line(e)


def test_mixed_qualified_and_plain_rejected():
    with pytest.raises(PlacementError, match="mixes node-qualified"):
        parse_devices(["node0:cuda:0", "cuda:1"], "placement.learner")


def test_config_rejects_bad_placement_at_load():
    with pytest.raises(ConfigError, match="placement.learner: bad device string 'tpu:0'"):
        load_config("configs/tiny.yaml", ["placement.learner=tpu:0"])
    with pytest.raises(ConfigError, match="unknown role 'judge'"):
        load_config("configs/tiny.yaml", ["placement.colocate=[[learner, judge]]"])
    with pytest.raises(ConfigError, match=r"placement.foo' is unknown"):
        load_config("configs/tiny.yaml", ["placement.foo=cpu"])
    cfg = load_config("configs/tiny.yaml", ["placement.learner=[cuda:0, cuda:1]", "placement.rollout=cuda:2"])
    assert cfg.placement.learner == ["cuda:0", "cuda:1"]


def test_more_gpus_than_exist():
    with pytest.raises(PlacementError) as e:
        plan_node(PlacementConfig(learner=["cuda:0-3"]), learners=None, rollers=0, gpu_count=2)
    msg = one_line(e)
    assert "cuda:2" in msg and "has 2" in msg
    with pytest.raises(PlacementError, match="needs 4 GPUs, but this host has 1"):
        plan_node(PlacementConfig(learner=["cuda"]), learners=4, rollers=0, gpu_count=1)
    with pytest.raises(PlacementError, match="no GPU"):
        plan_node(PlacementConfig(rollout=["cuda"]), learners=1, rollers=1, gpu_count=0)


def test_learner_rules():
    with pytest.raises(PlacementError, match="--learners 4 but placement.learner lists 2"):
        plan_node(PlacementConfig(learner=["cuda:0", "cuda:1"]), learners=4, rollers=1, gpu_count=8)
    with pytest.raises(PlacementError, match="listed twice"):
        plan_node(PlacementConfig(learner=["cuda:0", "cuda:0"]), learners=None, rollers=1, gpu_count=8)
    with pytest.raises(PlacementError, match="mixes cpu and cuda"):
        plan_node(PlacementConfig(learner=["cpu", "cuda:0"]), learners=None, rollers=1, gpu_count=8)


def test_cpu_default_plan():
    plan = plan_node(PlacementConfig(), learners=4, rollers=4)
    assert plan.learner_world == 4 and plan.learner_nodes == [0]
    assert plan.learner.device_arg == "cpu" and plan.learner.env == {"CUDA_VISIBLE_DEVICES": "", "STREAMRL_BACKEND": "gloo"}
    assert [r.device_arg for r in plan.rollouts] == ["cpu"] * 4


def test_gpu_plan_visible_devices_and_round_robin():
    pc = PlacementConfig(learner=["cuda:0", "cuda:1"], rollout=["cuda:2", "cuda:3"])
    plan = plan_node(pc, learners=None, rollers=4, gpu_count=4, visible=["4", "5", "6", "7"])
    assert plan.learner.env["CUDA_VISIBLE_DEVICES"] == "4,5" and plan.learner.device_arg == "cuda"
    assert "STREAMRL_BACKEND" not in plan.learner.env
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in plan.rollouts] == ["6", "7", "6", "7"]
    assert {r.device_arg for r in plan.rollouts} == {"cuda:0"}
    # default --rollers: one per listed device
    assert len(plan_node(pc, learners=None, rollers=None, gpu_count=4).rollouts) == 2
    with pytest.raises(PlacementError, match="--rollers 1 but placement.rollout lists 2"):
        plan_node(pc, learners=None, rollers=1, gpu_count=4)


def test_colocation_must_be_declared():
    pc = PlacementConfig(learner=["cuda:0"], rollout=["cuda:0"])
    with pytest.raises(PlacementError) as e:
        plan_node(pc, learners=None, rollers=1, gpu_count=1)
    assert "cuda:0 on node 0 is used by learner and rollout" in one_line(e)
    pc.colocate = [["learner", "rollout"]]
    plan = plan_node(pc, learners=None, rollers=2, gpu_count=1)
    assert plan.learner.env["CUDA_VISIBLE_DEVICES"] == "0" and plan.rollouts[1].env["CUDA_VISIBLE_DEVICES"] == "0"


def test_optional_roles_are_hosted_with_their_devices():
    pc = PlacementConfig(learner=["cuda:0", "cuda:1"], reference=["cuda:0", "cuda:1"], critic=["cuda:2"],
                         rollout=["cuda:3"], reward=["cuda:3"], colocate=[["actor", "ref"], ["rollout", "reward"]])
    plan = plan_node(pc, learners=None, rollers=1, gpu_count=4)
    assert plan.learner.env["CUDA_VISIBLE_DEVICES"] == "0,1,2"
    assert plan.learner.env["STREAMRL_DEVICE_REFERENCE"] == "cuda:0,cuda:1"
    assert plan.learner.env["STREAMRL_DEVICE_CRITIC"] == "cuda:2"
    assert plan.rollouts[0].env == {"CUDA_VISIBLE_DEVICES": "3", "STREAMRL_DEVICE_REWARD": "cuda:0"}
    pc.colocate = []
    with pytest.raises(PlacementError, match="used by learner and reference"):
        plan_node(pc, learners=None, rollers=1, gpu_count=4)
    with pytest.raises(PlacementError, match="name GPUs"):
        plan_node(PlacementConfig(reward=["cuda"]), learners=1, rollers=1, gpu_count=4)


def test_multinode_plans():
    pc = PlacementConfig(learner=["node0-1:cuda:0-1"], rollout=["node2:cuda:0-3"])
    p0 = plan_node(pc, learners=4, rollers=None, nnodes=3, node_rank=0, role="learner", gpu_count=2)
    assert (p0.learner_nnodes, p0.learner_node_rank, len(p0.learner.devices)) == (2, 0, 2)
    p1 = plan_node(pc, learners=None, rollers=None, nnodes=3, node_rank=1, role="all", gpu_count=2)
    assert p1.learner_node_rank == 1 and p1.rollouts == []
    p2 = plan_node(pc, learners=None, rollers=None, nnodes=3, node_rank=2, role="rollout", gpu_count=4)
    assert p2.learner is None and len(p2.rollouts) == 4
    with pytest.raises(PlacementError, match="--role learner on node 2"):
        plan_node(pc, learners=None, rollers=None, nnodes=3, node_rank=2, role="learner", gpu_count=4)
    with pytest.raises(PlacementError, match="--role rollout on node 1, but placement.rollout places no"):
        plan_node(pc, learners=None, rollers=None, nnodes=3, node_rank=1, role="rollout", gpu_count=4)
    with pytest.raises(PlacementError, match="names node 2, but --nnodes is 2"):
        plan_node(pc, learners=None, rollers=None, nnodes=2, node_rank=0, role="all", gpu_count=4)
    with pytest.raises(PlacementError, match="node-rank 3"):
        plan_node(PlacementConfig(), learners=1, rollers=1, nnodes=3, node_rank=3)
    # plain (unqualified) learner lives on node 0; rollout workers run wherever --role rollout runs
    p = plan_node(PlacementConfig(), learners=2, rollers=2, nnodes=3, node_rank=1, role="rollout")
    assert p.learner is None and len(p.rollouts) == 2 and p.learner_nodes == [0]


@pytest.mark.parametrize("learners,rollers,cores,want", [
    (1, 1, 2, {"learner": 1, "rollout-0": 1}),                      # smol-dense: one core each, no oversubscription
    (2, 2, 2, {"learner": 1, "rollout-0": 1, "rollout-1": 1}),      # make demo: one each
    (2, 2, 16, {"learner": 4, "rollout-0": 4, "rollout-1": 4}),
    (1, 1, 16, {"learner": 8, "rollout-0": 8}),
    (1, 2, 16, {"learner": 6, "rollout-0": 5, "rollout-1": 5}),     # the learner gets the rounding's cores
    (4, 1, 4, {"learner": 1, "rollout-0": 1}),
])
def test_threads_follow_cores_and_placement(learners, rollers, cores, want):
    plan = plan_node(PlacementConfig(), learners=learners, rollers=rollers)
    assert assign_threads(plan, cores) == want
    procs = [plan.learner] + plan.rollouts
    for p in procs:
        assert p.env["STREAMRL_THREADS"] == p.env["OMP_NUM_THREADS"] == str(want[p.name])
    oversubscribed = want["learner"] * learners + sum(want[r.name] for r in plan.rollouts) > cores
    assert all(("OMP_WAIT_POLICY" in p.env) == oversubscribed for p in procs)


def test_fixed_threads_from_config_and_rollout_only_host():
    cfg = load_config("configs/tiny.yaml", ["placement.learner_threads=3", "placement.rollout_threads=2"])
    plan = plan_node(cfg.placement, learners=1, rollers=2)
    assert assign_threads(plan, 8, cfg.placement.learner_threads, cfg.placement.rollout_threads) == {
        "learner": 3, "rollout-0": 2, "rollout-1": 2}
    rollout_host = plan_node(PlacementConfig(), learners=1, rollers=2, nnodes=2, node_rank=1, role="rollout")
    assert assign_threads(rollout_host, 8) == {"rollout-0": 4, "rollout-1": 4}
    with pytest.raises(ConfigError, match="placement.learner_threads"):
        load_config("configs/tiny.yaml", ["placement.learner_threads=-1"])


def test_cpu_learner_is_told_the_worker_threads_it_may_borrow():
    plan = plan_node(PlacementConfig(), learners=1, rollers=2)
    assign_threads(plan, 8)
    assert plan.learner.env["STREAMRL_LENDABLE_THREADS"] == "4"  # rollout-0 + rollout-1, 2 threads each
    # the other way: the learner's 4 threads split over the two CPU workers while it waits
    assert [r.env["STREAMRL_BORROWABLE_THREADS"] for r in plan.rollouts] == ["2", "2"]
    gpu_workers = plan_node(PlacementConfig(rollout=["cuda:0"]), learners=1, rollers=1, gpu_count=1)
    assign_threads(gpu_workers, 8)
    assert gpu_workers.learner.env["STREAMRL_LENDABLE_THREADS"] == "0"  # a GPU worker's threads feed its GPU
    gpu_learner = plan_node(PlacementConfig(learner=["cuda:0"]), learners=1, rollers=1, gpu_count=1)
    assign_threads(gpu_learner, 8)
    assert "STREAMRL_LENDABLE_THREADS" not in gpu_learner.learner.env
    assert "STREAMRL_BORROWABLE_THREADS" not in gpu_learner.rollouts[0].env  # a GPU learner lends no cores
