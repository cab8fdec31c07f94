"""Core lending (streamrl.core_lending): the learner borrows the threads of colocated
workers while their heartbeats say they wait, and gives them back when one generates.

Real Redis and the real rollout worker (its admission loop, heartbeat thread and states); the
worker's batch is held open by a gate so the "generating" phase lasts as long as the test
needs. Every check waits on state (the lender's offer), never on a fixed sleep."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from streamrl.config import ConfigError, load_config
from streamrl.coord.coordinator import Coordinator
from streamrl.core_lending import IDLE_STATES, LENDABLE_ENV, CoreLender, make_core_lender

from tests.test_worker_heartbeat import gated_worker


def _wait_offer(lender: CoreLender, want: int, coord: Coordinator, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while lender.offer != want:
        assert time.monotonic() < deadline, (want, lender.offer, coord.workers())
        time.sleep(0.02)


@pytest.mark.timeout(120)
def test_lender_follows_worker_states(repo, tmp_path, redis_url, run_id):
    from streamrl.workers import rollout  # noqa: PLC0415 (installed layout of workers/)

    # the batch's trajectories go to an endpoint nobody listens on: it ends in backpressure
    coord, worker, gate = gated_worker(repo, tmp_path, redis_url, run_id, gate_s=60)
    coord.r.set(coord.keys.reserved, 10**6)  # the staleness budget is spent: the worker waits for admission
    # a worker on another host, idle with 4 threads: not this host's cores, never lent
    coord.heartbeat(7, {"host": "elsewhere", "state": "waiting_admission", "threads": 4})
    base = torch.get_num_threads()
    lender = CoreLender(Coordinator(redis_url, run_id), base, lendable=worker.threads, poll_s=0.02).start()
    runner = threading.Thread(target=worker.run, daemon=True)
    try:
        assert lender.apply() == base  # nobody registered on this host yet: nothing lent
        runner.start()
        _wait_offer(lender, worker.threads, coord)  # waiting_admission: its threads are lent
        assert lender.apply() == base + worker.threads == torch.get_num_threads()

        coord.r.set(coord.keys.reserved, 0)  # admission opens: the worker reserves and generates
        _wait_offer(lender, 0, coord)
        assert worker.state == rollout.GENERATING
        assert lender.apply() == base == torch.get_num_threads()  # given back

        coord.r.set(coord.keys.reserved, 10**6)  # no admission for a next batch
        gate.set()  # the batch finishes: sending it (nobody receives) and waiting are both idle states
        _wait_offer(lender, worker.threads, coord)
        assert worker.state in IDLE_STATES
        assert lender.apply() == base + worker.threads
        m = lender.metrics()
        assert m["learner/lend_switches"] == 3 and 0 < m["learner/lent_frac"] < 1
        assert 0 < m["learner/workers_idle_frac"] < 1
    finally:
        worker.stopping = True
        gate.set()
        runner.join(30)
        lender.close()
    assert not runner.is_alive() and torch.get_num_threads() == base


def test_hooks_apply_before_each_layer_forward_and_backward(redis_url, run_id):
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    base = torch.get_num_threads()
    lender = CoreLender(Coordinator(redis_url, run_id), base, lendable=1)  # not started: offers set by hand
    assert lender.attach(model) == 2
    try:
        lender.offer = 1  # as the poller would write it: the forward borrows
        out = model(input_ids=torch.randint(0, 64, (2, 8))).logits
        assert torch.get_num_threads() == base + 1
        lender.offer = 0  # a worker started generating mid-step: the backward gives the thread back
        out.sum().backward()
        assert torch.get_num_threads() == base and lender.switches == 2
    finally:
        lender.close()
    assert not model.model.layers[0]._forward_pre_hooks  # close removes its hooks


def test_make_core_lender_only_where_cores_can_be_lent(redis_url, run_id, monkeypatch):
    coord = Coordinator(redis_url, run_id)
    cfg = load_config("configs/smol-dense.yaml")
    monkeypatch.setenv(LENDABLE_ENV, "2")
    lender = make_core_lender(cfg, coord, local_ranks=2)
    try:
        assert lender is not None and lender.lendable == 1  # the host's worker threads split over its ranks
    finally:
        lender.close()
    off = load_config("configs/smol-dense.yaml", ["placement.lend_idle_cores=false"])
    assert make_core_lender(off, coord, 1) is None
    assert make_core_lender(cfg, coord, local_ranks=3) is None  # less than one thread per rank
    monkeypatch.delenv(LENDABLE_ENV)
    assert make_core_lender(cfg, coord, 1) is None  # the placement left nothing to lend (GPU or no workers)
    with pytest.raises(ConfigError, match="placement.lend_idle_cores"):
        load_config("configs/smol-dense.yaml", ["placement.lend_idle_cores=3"])


@pytest.mark.timeout(60)
def test_no_lending_while_other_processes_keep_the_cores_busy(redis_url, run_id):
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from streamrl.core_lending import HostLoad  # noqa: PLC0415

    coord = Coordinator(redis_url, run_id)
    coord.heartbeat(0, {"host": socket.gethostname(), "state": "waiting_admission", "threads": 1})
    load = HostLoad.open()
    assert load is not None  # Linux: /proc/stat
    lender = CoreLender(coord, 1, lendable=1, host_load=load)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:  # another tenant on every core: the waiting worker's core is not free, nothing is lent
        deadline = time.monotonic() + 30
        while lender.others_busy < load.cpus - 0.5:
            assert time.monotonic() < deadline, lender.others_busy
            lender.poll()
            time.sleep(0.05)
        assert lender.offer == 0
    finally:
        for p in spinners:
            p.kill()
            p.wait()
