"""The reference role: the KL reference served by its own process gives the learner the same
``learner/kl_ref`` as the reference colocated in the learner ranks, on the same batch.

Real parts: a real ``streamrl.workers.reference_server`` process, real Redis (the session
fixture), real DEALER/ROUTER sockets, the real learner :class:`Trainer` (one rank, CPU), the
trajectory codec the learner receives batches through.
"""
from __future__ import annotations

import subprocess
import threading
import time

import pytest
import torch

from streamrl.bench.padded_reference import packed_gradients
from streamrl.config import load_config
from streamrl.coord.coordinator import Coordinator
from streamrl.launcher.process import ManagedProcess
from streamrl.learner.trainer import Trainer
from streamrl.models.factory import build_model, save_model
from streamrl.roles.annotate import trajectory_roles
from streamrl.roles.reference import ROLE
from streamrl.roles.serve import parse_role_args
from streamrl.roles.token_client import RoleServerError, RoleServerTimeout, TokenRoleClient
from streamrl.roles.token_server import TokenRoleServer
from streamrl.roles.token_wire import TOKEN_KEYS
from streamrl.trajectory import pack_trajectories, validate_trajectories
from streamrl.transport.codec import decode, encode

from test_checkpoint import REPO


def batch(seed: int = 0, groups: int = 3, g: int = 4):
    """``groups`` x ``g`` trajectories of random tokens; a group's samples share one prompt."""
    gen = torch.Generator().manual_seed(seed)
    prompts, resp = [], []
    for _ in range(groups):
        prompt = [1] + torch.randint(3, 20, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(g):
            prompts.append(prompt)
            resp.append(torch.randint(3, 20, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist())
    n = len(prompts)
    lps = [(-torch.rand(len(r), generator=gen) * 2).tolist() for r in resp]
    return pack_trajectories(prompts, resp, lps, [[0] * len(r) for r in resp], torch.rand(n, generator=gen).tolist(),
                             [i // g for i in range(n)], list(range(n)), 0, 0.0)


@pytest.fixture(scope="module")
def ref_folder(tmp_path_factory) -> str:
    """A reference model other than the initial policy (another seed), so the KL is not 0."""
    cfg = load_config(f"{REPO}/configs/tiny.yaml")
    folder = tmp_path_factory.mktemp("ref")
    save_model(*build_model(cfg.model, seed=1), folder)
    return str(folder)


def _overrides(ref_folder: str, estimator: str, separate: bool) -> list[str]:
    out = ["learner.kl_coef=0.1", f"learner.kl_estimator={estimator}", f"reference.path={ref_folder}",
           "learner.max_tokens_per_microbatch=24"]  # several micro-batches: rows map through m.rows
    return out + (["placement.reference=[cpu]"] if separate else [])


def wait_published(proc: subprocess.Popen, coord: Coordinator, role: str, log_path, timeout_s: float = 300.0) -> str:
    """The role server's endpoint once published; fails at once if the process died (a loaded
    2-core host needs minutes to import torch + transformers, hence the long bound)."""
    deadline = time.monotonic() + timeout_s
    while (ep := coord.get_endpoint(role)) is None:
        assert proc.poll() is None, open(log_path).read()[-3000:]
        assert time.monotonic() < deadline, f"{role} endpoint not published in {timeout_s} s"
        time.sleep(0.2)
    return ep


@pytest.fixture
def reference_process(redis_url, run_id, ref_folder, python, tmp_path):
    """A real reference-server process for this run, its config in Redis."""
    cfg = load_config(f"{REPO}/configs/tiny.yaml", _overrides(ref_folder, "k3", separate=True))
    coord = Coordinator(redis_url, run_id)
    coord.put_config(cfg.to_dict())
    server = ManagedProcess("reference", [python, "-m", "streamrl.workers.reference_server", "--redis-url",
                                          redis_url, "--run-id", run_id], tmp_path / "reference.log",
                            env={"STREAMRL_THREADS": "1"})
    server.start()
    try:
        wait_published(server.proc, coord, ROLE, tmp_path / "reference.log")
        yield server.proc, coord, cfg
    finally:
        server.stop(grace_s=10)
        coord.close()


def test_reference_process_gives_the_colocated_kl(reference_process, ref_folder):
    """The issue's test: the same batch, KL k1 and k3 (the low-variance one), reference colocated
    vs served: the same ``learner/kl_ref`` (float tolerance), and it is not trivially 0. A
    request with token ids outside the vocabulary is rejected (no reply, counted), not a crash."""
    proc, coord, cfg = reference_process
    td = batch()
    roles = trajectory_roles(cfg, coord)
    try:
        served = roles(td.clone())
    finally:
        roles.close()
    assert served["ref_logprobs"].shape == served["response_tokens"].shape
    # what the learner receives: the trajectory codec round trip and the receiver's validation
    _, _, tensors = decode(encode(dict(served.items()), "trajectories", {}))
    validate_trajectories(tensors)
    assert torch.equal(tensors["ref_logprobs"], served["ref_logprobs"])
    colocated = Trainer(load_config(f"{REPO}/configs/tiny.yaml", _overrides(ref_folder, "k3", False)))
    separate = Trainer(load_config(f"{REPO}/configs/tiny.yaml", _overrides(ref_folder, "k3", True)))
    assert colocated.ref_model is not None and separate.ref_model is None
    for estimator in ("k1", "k3"):  # read at every step: the same trainers serve both
        colocated.cfg.learner.kl_estimator = separate.cfg.learner.kl_estimator = estimator
        want = packed_gradients(colocated, td)["learner/kl_ref"]
        got = packed_gradients(separate, served)["learner/kl_ref"]
        assert abs(want) > 1e-3, want
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), estimator
    with pytest.raises(ValueError, match="no ref_logprobs"):
        packed_gradients(separate, td)

    resolve = lambda: coord.get_endpoint(ROLE)  # noqa: E731
    fields = {k: td[k] for k in TOKEN_KEYS}
    client = TokenRoleClient(ROLE, resolve, timeout_s=1.0, attempts=1)
    try:
        with pytest.raises(RoleServerTimeout):
            client(dict(fields, response_tokens=fields["response_tokens"] + 10_000))
        deadline = time.monotonic() + 30
        while coord.latest_metrics().get(ROLE, {}).get("reference/rejected_bad_tokens") != 1:
            assert time.monotonic() < deadline, coord.latest_metrics().get(ROLE)
            time.sleep(0.2)
    finally:
        client.close()
    assert proc.poll() is None
    coord.request_stop("test done")
    assert proc.wait(30) == 0


def test_server_answers_a_failing_batch_with_an_error_and_goes_on():
    """A scorer that raises: each request of the batch gets an error reply, the next one is served."""
    calls = []

    def score(fields):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return -torch.ones(fields["response_tokens"].numel()), 7

    server = TokenRoleServer(ROLE, score, vocab_size=32)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop.is_set,))
    thread.start()
    client = TokenRoleClient(ROLE, server.endpoint, timeout_s=30)
    fields = {k: batch(seed=2, groups=1, g=2)[k] for k in TOKEN_KEYS}
    try:
        with pytest.raises(RoleServerError, match="boom"):
            client(fields)
        values, version = client(fields)
        assert version == 7 and torch.equal(values, -torch.ones(fields["response_tokens"].numel()))
    finally:
        client.close()
        stop.set()
        thread.join(10)
        server.close()
    assert server.metrics()["reference/errors"] == 1


def test_dry_run_lists_one_process_per_role(capsys, repo, tmp_path):
    """``streamrl-launch --dry-run --place reference=cpu --place critic=cpu --place reward=cpu``:
    one server process per role, each command parsed by its real entry point, each on cpu."""
    import json

    from streamrl.launcher import launch
    from streamrl.workers import critic_server, reference_server, reward_server
    from test_reward_role import _make_folder

    rm = _make_folder(tmp_path / "rm", causal=False)
    argv = ["--config", str(repo / "configs/tiny.yaml"), "--place", "reference=cpu", "--place", "critic=cpu",
            "--place", "reward=cpu", "learner.kl_coef=0.05", "learner.advantage=gae", f"rollout.reward_model={rm}"]
    assert launch.main([*argv, "--dry-run"]) == 0
    procs = {p["name"]: p for p in json.loads(capsys.readouterr().out)["processes"]}
    assert [n for n in procs if n in ("reward", "reference", "critic")] == ["reward", "reference", "critic"]
    for name, entry in (("reward", reward_server), ("reference", reference_server), ("critic", critic_server)):
        cmd = procs[name]["cmd"]
        module = f"streamrl.workers.{name}_server"
        args = (entry.parse_args if name == "reward" else lambda a, n=name: parse_role_args(n, a))(
            cmd[cmd.index(module) + 1:])
        assert args.device == "cpu" and procs[name]["devices"] == ["cpu"] and procs[name]["log"].endswith(f"{name}.log")
    # without the placements (or without kl_coef / gae) the learner keeps them: no server processes
    assert launch.main(["--config", str(repo / "configs/tiny.yaml"), "learner.kl_coef=0.05", "--dry-run"]) == 0
    names = [p["name"] for p in json.loads(capsys.readouterr().out)["processes"]]
    assert not {"reward", "reference", "critic"} & set(names)
