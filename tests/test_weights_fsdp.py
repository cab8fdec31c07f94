"""Bit-exact publish from a 2-rank FSDP2 learner with expert-parallel experts (gloo), through
real Redis and real sockets (ZeroMQ and shared memory), into engine-named tensors."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket

import pytest
import torch

from streamrl.config import ModelConfig
from streamrl.coord.coordinator import Coordinator
from streamrl.models.factory import build_model
from streamrl.weights.adapter import adapt_tensor, unadapt
from streamrl.weights.subscriber import WeightSubscriber

SUBSCRIBERS = (1, 2)  # worker ids: 1 over ZeroMQ, 2 over shared memory


def _perturb(t: torch.Tensor) -> None:
    """Elementwise, so applying it to shards or to the full tensor gives identical bits."""
    t.mul_(1.5).add_(0.25)


def _learner_rank(rank: int, port: int, redis_url: str, run_id: str, q) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard, distribute_tensor

        from weights_gather import ExpertShard, full_parameters, global_specs
        from streamrl.weights.publisher import WeightPublisher

        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        model, _ = build_model(ModelConfig(), seed=3)
        ep_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        dp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        experts0 = model.model.layers[0].mlp.experts  # EP as DTensors over the ep mesh
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts0, name).data
            setattr(experts0, name, torch.nn.Parameter(distribute_tensor(full, ep_mesh, [Shard(0)])))
        experts1 = model.model.layers[1].mlp.experts  # EP as plain local slices + explicit all_gather
        shards = {}
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts1, name).data
            per = full.shape[0] // 2
            setattr(experts1, name, torch.nn.Parameter(full[rank * per:(rank + 1) * per].clone()))
            shards[f"model.layers.1.mlp.experts.{name}"] = ExpertShard(group=None, dim=0)
        ignored = {experts0.gate_up_proj, experts0.down_proj, experts1.gate_up_proj, experts1.down_proj}
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp_mesh, ignored_params=ignored)
        fully_shard(model, mesh=dp_mesh, ignored_params=ignored)
        with torch.no_grad():
            for p in model.parameters():
                _perturb(p.to_local() if hasattr(p, "to_local") else p.data)
        specs = global_specs(model, shards)
        pub = None
        coord = Coordinator(redis_url, run_id)
        if rank == 0:
            pub = WeightPublisher(coord, run_id, plane="auto", bucket_bytes=64 << 10, target="vllm")
            pub.publish(5, specs, full_parameters(model, shards))
        else:
            for _ in full_parameters(model, shards):
                pass
        if rank == 0:
            ok = coord.wait_acks(5, list(SUBSCRIBERS), timeout_s=60)
            pub.close()
            q.put(("acked", ok))
        dist.destroy_process_group()
    except BaseException as e:  # report, so the test fails with the cause instead of a timeout
        q.put(("error", f"rank {rank}: {e!r}"))
        raise


class DictEngine:
    """An engine that is a dict of preallocated tensors; load_weights copies all or nothing."""

    def __init__(self, named):
        self.params = {n: torch.zeros_like(t) for n, t in named.items()}

    def load_weights(self, named_tensors):
        items = list(named_tensors)
        if {n for n, _ in items} != set(self.params):
            raise KeyError("name mismatch")
        for n, t in items:
            self.params[n].copy_(t)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fsdp2_ep_publish_is_bit_exact(redis_url, run_id):
    ref_model, _ = build_model(ModelConfig(), seed=3)
    with torch.no_grad():
        for p in ref_model.parameters():
            _perturb(p.data)
    ref = dict(ref_model.named_parameters())
    engine_ref = {n: v.detach() for name, p in ref.items() for n, v in adapt_tensor(name, p, "vllm")}

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_learner_rank, args=(r, port, redis_url, run_id, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        coord = Coordinator(redis_url, run_id)
        for wid, plane in zip(SUBSCRIBERS, ("zmq", "shm")):
            sub = WeightSubscriber(coord, plane=plane)
            assert coord.wait_version(-1, timeout_s=90, pubsub=coord.subscribe_versions()) == 5
            engine = DictEngine(engine_ref)
            assert sub.load(engine, wid) == 5
            assert set(engine.params) == set(engine_ref)
            for n, t in engine_ref.items():
                assert torch.equal(engine.params[n], t), f"{plane}: {n} differs"
            back = unadapt(engine.params.items())
            for n, p in ref.items():
                assert torch.equal(back[n], p.detach()), f"{plane}: HF {n} differs after unadapt"
            sub.close()
        kind, value = q.get(timeout=60)
        assert kind == "acked" and value is True, value
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
