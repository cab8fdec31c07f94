"""streamrl-launch flags: --dry-run plans, multi-node commands and one-line errors (no process started)."""
from __future__ import annotations

import json

import pytest

from streamrl.launcher import launch, plan


def dry(capsys, *argv) -> dict:
    assert launch.main([*argv, "--dry-run"]) == 0
    return json.loads(capsys.readouterr().out)


def error(capsys, *argv) -> str:
    assert launch.main([*argv, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("streamrl-launch: ") and "\n" not in err, err
    return err


def torchrun_args(cmd: list[str]) -> list[str]:
    i = cmd.index("torch.distributed.run")
    return cmd[i + 1:cmd.index("streamrl.workers.learner") - 1]


def test_single_node_dry_run_commands_parse_with_the_real_entry_points(capsys, repo):
    from streamrl.workers import learner, rollout

    out = dry(capsys, "--config", str(repo / "configs/tiny.yaml"), "--learners", "4", "--rollers", "4")
    names = [p["name"] for p in out["processes"]]
    assert names == ["learner", "rollout-0", "rollout-1", "rollout-2", "rollout-3"]
    lcmd = out["processes"][0]["cmd"]
    assert torchrun_args(lcmd) == ["--standalone", "--nproc-per-node=4"]
    largs = learner.parse_args(lcmd[lcmd.index("streamrl.workers.learner") + 1:])
    assert largs.run_id == out["run_id"] and largs.bind_host == "127.0.0.1"
    for p in out["processes"][1:]:
        rargs = rollout.parse_args(p["cmd"][p["cmd"].index("streamrl.workers.rollout") + 1:])
        assert rargs.num_workers == 4 and "--device" not in p["cmd"]  # config's rollout.device fits
        assert p["env"]["CUDA_VISIBLE_DEVICES"] == ""
    assert out["endpoints"]["learner_rendezvous"] == "standalone (local)"


def test_multinode_head_and_rollout_hosts(capsys):
    common = ["--nnodes", "3", "--run-id", "mn1", "--master-addr", "10.9.0.1", "--learners", "2"]
    head = dry(capsys, *common, "--node-rank", "0", "--role", "learner", "--redis-host", "10.9.0.1",
               "--redis-password", "pw", "--redis-port", "6390")
    assert head["head"] and [p["name"] for p in head["processes"]] == ["learner"]
    cmd = head["processes"][0]["cmd"]
    assert torchrun_args(cmd) == ["--nnodes=1", "--node-rank=0", "--nproc-per-node=2", "--master-addr=10.9.0.1",
                                  "--master-port=29500"]
    assert cmd[cmd.index("--bind-host") + 1] == "0.0.0.0" and cmd[cmd.index("--advertise-host") + 1] == "10.9.0.1"
    assert "pw" not in json.dumps(head) and head["redis"].startswith("redis://:***@10.9.0.1:6390")
    worker = dry(capsys, *common, "--node-rank", "1", "--role", "rollout", "--rollers", "2",
                 "--redis-url", "redis://:pw@10.9.0.1:6390/0")
    assert not worker["head"] and len(worker["processes"]) == 2
    assert all("learner" not in p["name"] for p in worker["processes"])


def test_learner_spanning_nodes_uses_static_rendezvous(capsys):
    out = dry(capsys, "--nnodes", "2", "--node-rank", "1", "--role", "learner", "--run-id", "r2",
              "--master-addr", "10.0.0.1", "--redis-url", "redis://:pw@10.0.0.1:6379/0",
              "--place", "learner=node0-1:cpu")
    assert not out["head"]
    assert torchrun_args(out["processes"][0]["cmd"]) == [
        "--nnodes=2", "--node-rank=1", "--nproc-per-node=1", "--master-addr=10.0.0.1", "--master-port=29500"]


@pytest.mark.parametrize("argv, needle", [
    (["--place", "judge=cuda:0"], "unknown role 'judge'"),
    (["--place", "learner=gpu:0"], "bad device string 'gpu:0'"),
    (["--place", "learner"], "expected ROLE=DEVICES"),
    (["--place", "learner=cuda:0-7"], "this host has 0"),
    (["--colocate", "learner,oracle"], "unknown role 'oracle'"),
    (["--learners", "0"], "--learners = 0"),
    (["--role", "rollout", "--run-id", "x"], "needs --redis-url"),
    (["--role", "learner"], "--run-id is required"),
    (["--role", "learner", "--run-id", "x"], "embedded Redis binds 127.0.0.1"),
    (["--role", "rollout", "--run-id", "x", "--redis-url", "redis://10.0.0.5:6379/0"], "must require a password"),
    (["--redis-host", "0.0.0.0"], "needs --redis-password"),
    (["--role", "learner", "--run-id", "x", "--rollers", "2"], "starts no rollout workers"),
    (["--nnodes", "2", "--node-rank", "2", "--run-id", "x"], "--node-rank 2 with --nnodes 2"),
    (["--run-id", "a:b"], "--run-id 'a:b'"),
    (["learner.lr=-1"], "learner.lr"),
    (["rollout.dtype=float16"], "rollout.dtype"),
])
def test_one_line_errors(capsys, argv, needle):
    assert needle in error(capsys, *argv)


def test_placement_in_config_file_is_checked(capsys, tmp_path, repo):
    cfg = tmp_path / "c.yaml"
    cfg.write_text((repo / "configs/tiny.yaml").read_text() + "placement:\n  learner: [cuda:0, cuda:1]\n")
    err = error(capsys, "--config", str(cfg))
    # this CPU machine has no GPU: the error names the device and the count
    assert "placement.learner: cuda:0 needs 1 GPU(s), but this host has 0" in err


def test_gpu_placement_reaches_processes_through_env_and_flags(capsys, monkeypatch):
    """On a (pretend) 4-GPU host: learner ranks on GPUs 0-1, workers on 2 and 3 and one on CPU."""
    monkeypatch.setattr(plan, "_gpu_info", lambda cfg: (4, ["4", "5", "6", "7"]))
    out = dry(capsys, "--place", "learner=cuda:0-1", "--place", "rollout=cuda:2,cuda:3,cpu", "--rollers", "3")
    lrn, *rolls = out["processes"]
    assert torchrun_args(lrn["cmd"]) == ["--standalone", "--nproc-per-node=2"]
    assert lrn["env"]["CUDA_VISIBLE_DEVICES"] == "4,5" and "STREAMRL_BACKEND" not in lrn["env"]
    assert [r["env"]["CUDA_VISIBLE_DEVICES"] for r in rolls] == ["6", "7", ""]
    # --device only where the stored rollout.device ('cpu' here: the devices are mixed) does not fit
    assert [r["cmd"][r["cmd"].index("--device") + 1] if "--device" in r["cmd"] else "cpu" for r in rolls] == [
        "cuda:0", "cuda:0", "cpu"]
    assert "--device" not in rolls[2]["cmd"]
    err = error(capsys, "--place", "learner=cuda:0-1", "--place", "rollout=cuda:1")
    assert "cuda:1 on node 0 is used by learner and rollout" in err
    out = dry(capsys, "--place", "learner=cuda:0-1", "--place", "rollout=cuda:1", "--colocate", "learner,rollout")
    assert out["placement"]["colocate"] == [["learner", "rollout"]]


def test_launch_notes_a_staleness_too_small_to_keep_workers_decoding(capsys, repo):
    """Batches of 2 steps' groups with max_staleness 2: the one worker would wait for admission
    between batches (``admission_wait_note``), and the launch says so, naming the fields; the
    config's own setting prints nothing."""
    config = ["--config", str(repo / "configs/tiny.yaml"), "--rollers", "1", "--dry-run"]
    assert launch.main([*config, "learner.groups_per_step=8", "rollout.prompts_per_batch=16",
                        "learner.max_staleness=2"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("streamrl-launch: note: learner.max_staleness = 2") and "max_staleness >= 3" in err, err
    assert launch.main(config) == 0
    assert capsys.readouterr().err == ""
