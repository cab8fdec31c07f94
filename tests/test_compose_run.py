"""The compose files for real: Docker builds the image offline and runs tiny training runs.

* ``docker/compose.yaml`` + ``tests/compose/host-network.yaml``: Redis, the learner, two rollout
  containers (``--scale rollout=2``) and the monitor; one rollout container is killed and a new
  one joins; the run completes with its ledger balanced; ``down`` leaves nothing behind.
* ``docker/compose.multinode.yaml``: the head, learner-node and rollout profiles as three compose
  projects on this machine (host networking, distinct ports), a stand-in for three hosts.

Opt-in (``pytest -m compose`` or ``make compose-test``): minutes on 2 cores, and a daemon of its
own. Every service uses the host network and loopback addresses only (``GLOO_SOCKET_IFNAME=lo``).
"""
from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import yaml

from streamrl.coord.coordinator import Coordinator
from tests.compose.harness import REPO, Daemon, Project, build_image, free_port, install_missing, run, wait_for

pytestmark = [pytest.mark.compose, pytest.mark.timeout(2400)]

DOCKER = REPO / "docker"
HOST_NETWORK = Path(__file__).resolve().parent / "compose" / "host-network.yaml"
IMAGE = "streamrl:cpu"
# Small steps (4 groups of 8) so that a run of a few dozen steps takes a minute or two.
GROUPS_PER_STEP, GROUP_SIZE = 4, 8


@pytest.fixture(scope="module")
def docker_image(request, tmp_path_factory):
    """The built image, with a daemon answering; skips (one line) where Docker cannot run."""
    if "compose" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("compose tier: run it with -m compose (make compose-test)")
    reason = install_missing()
    if reason:
        pytest.skip(reason)
    daemon = Daemon(tmp_path_factory.mktemp("dockerd"))
    reason = daemon.start()
    if reason:
        pytest.skip(reason)
    try:
        build_image(IMAGE)
        yield IMAGE
    finally:
        daemon.stop()


def write_config(runs_dir: Path, name: str, **placement) -> str:
    """configs/tiny.yaml with small steps (and ``placement``) in ``runs_dir``; the path the
    containers read it at (the runs folder is mounted at /opt/streamrl/runs, their WORKDIR's runs/)."""
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg["learner"]["groups_per_step"] = GROUPS_PER_STEP
    cfg["rollout"].update(group_size=GROUP_SIZE, prompts_per_batch=2)
    if placement:
        cfg["placement"] = placement
    (runs_dir / name).write_text(yaml.safe_dump(cfg))
    return f"runs/{name}"


def steps_done(run_dir: Path) -> int:
    f = run_dir / "metrics.jsonl"
    return sum(1 for _ in f.open()) if f.exists() else 0


def wait_exit(project: Project, container: str, timeout_s: float) -> int:
    wait_for(lambda: project.exit_code(container) is not None, timeout_s, f"{project.name} {container} to exit")
    return project.exit_code(container)


def check_ledger(run_dir: Path, steps: int) -> dict:
    """What a finished run must show, from its summary.json (the ledger is its "accounting")."""
    s = json.loads((run_dir / "summary.json").read_text())
    acc = s["accounting"]
    assert s["status"] == "completed" and s["steps"] == steps, s
    assert acc["balanced"], acc  # accepted == trained + pending + lost; produced >= that + rejected
    assert acc["duplicated"] == 0, acc
    assert acc["produced"] == acc["trained"] + acc["pending_at_end"] + acc["lost_total"] + acc["rejected_trajectories"]
    assert acc["trained"] == steps * GROUPS_PER_STEP * GROUP_SIZE, acc
    return s


def base_env(runs_dir: Path, run_id: str, image: str) -> dict[str, str]:
    return {"REDIS_PASSWORD": uuid.uuid4().hex, "RUN_ID": run_id, "REDIS_PORT": str(free_port()),
            "STREAMRL_IMAGE": image, "REDIS_IMAGE": image, "RUNS_DIR": str(runs_dir)}


def test_single_host_compose_run_survives_a_killed_rollout(docker_image, tmp_path):
    steps, runs = 20, tmp_path / "runs"
    runs.mkdir()
    run_id = f"compose-{uuid.uuid4().hex[:8]}"
    env = base_env(runs, run_id, docker_image)
    env.update(CONFIG=write_config(runs, "compose-test.yaml"), LEARNERS="1", STEPS=str(steps),
               REDIS_HOST="127.0.0.1", LEARNER_HOST="127.0.0.1", LEARNER_BIND="127.0.0.1")
    project = Project(f"srl-{uuid.uuid4().hex[:8]}", [DOCKER / "compose.yaml", HOST_NETWORK], env)
    coord = Coordinator(f"redis://:{env['REDIS_PASSWORD']}@127.0.0.1:{env['REDIS_PORT']}/0", run_id)
    run_dir = runs / run_id
    try:
        project("up", "-d", "--no-build", "--scale", "rollout=2")
        wait_for(lambda: steps_done(run_dir) >= 3 and len(coord.workers()) >= 2, 400,
                 "3 steps trained from 2 rollout containers")
        first = set(coord.workers())
        victim = project.ids("rollout")[0]
        run(["docker", "kill", victim])  # SIGKILL to the container: its launcher and worker die at once
        run(["docker", "rm", victim])
        project("up", "-d", "--no-build", "--no-deps", "--no-recreate", "--scale", "rollout=2", "rollout")
        assert len(project.ids("rollout")) == 2 and victim not in project.ids("rollout")
        joined = wait_for(lambda: set(coord.workers()) - first, 300, "a worker id from the new container")
        assert min(joined) > max(first), (first, joined)  # a fresh id from the counter, not a reused one
        learner = project.ids("learner")[0]
        assert wait_exit(project, learner, 600) == 0, project.logs()
        check_ledger(run_dir, steps)
    finally:
        print(project.logs())
        project.down()
    assert project.leftovers() == {}
    assert project.ids("rollout", running_only=False) == []


def test_multinode_profiles_as_three_projects(docker_image, tmp_path):
    steps, run_id = 8, f"mn-{uuid.uuid4().hex[:8]}"
    head_dir, rollout_dir = tmp_path / "head", tmp_path / "node2"
    head_dir.mkdir(), rollout_dir.mkdir()
    env = base_env(head_dir, run_id, docker_image)
    # Two learner ranks, one on the head and one on the learner node (placement names both nodes).
    config = write_config(head_dir, "mn.yaml", learner=["node0-1:cpu"])
    # NODE_RANK=0 on the head too: compose interpolates every service's variables, in any profile.
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), NNODES="3", NODE_RANK="0", CONFIG=config,
               LEARNERS="2", STEPS=str(steps), GLOO_SOCKET_IFNAME="lo")
    name = f"srl-{uuid.uuid4().hex[:8]}"
    files = [DOCKER / "compose.multinode.yaml"]
    head = Project(f"{name}-head", files, env, profiles=("head",))
    # Learner nodes share the run folder (every rank writes its part of a checkpoint there), as
    # hosts would share a file system; the rollout host has a folder of its own.
    learner_node = Project(f"{name}-node1", files, {**env, "NODE_RANK": "1"}, profiles=("learner-node",))
    rollout = Project(f"{name}-node2", files, {**env, "NODE_RANK": "2", "ROLLERS": "2", "RUNS_DIR": str(rollout_dir)},
                      profiles=("rollout",))
    projects = [head, learner_node, rollout]
    try:
        for p in projects:
            p("up", "-d", "--no-build")
        for p, service in ((head, "learner"), (learner_node, "learner-node")):
            container = p.ids(service, running_only=False)[0]
            assert wait_exit(p, container, 900) == 0, "\n".join(q.logs() for q in projects)
        check_ledger(head_dir / run_id, steps)
        # Both rollout workers ran on the rollout "host" and reached the head through Redis.
        logs = sorted((rollout_dir / run_id / "logs").glob("rollout-*.log"))
        assert len(logs) == 2, [p.logs() for p in projects]
    finally:
        for p in reversed(projects):
            print(p.logs())
            p.down()
    for p in projects:
        assert p.leftovers() == {}, p.name
