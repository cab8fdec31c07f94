"""Adapter-only weight versions: a LoRA trainer publishes A, B and the scaling (bytes of the
adapter, not the model) through real Redis + shm; the hf and hf_fast engines merge them into
bit-identical weights (base + scaling * B @ A, each version from the base, never from the last)."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from streamrl.coord.coordinator import Coordinator
from streamrl.engines.factory import build_engine
from streamrl.learner.lora_policy import PackedGather
from streamrl.learner.trainer import Trainer
from streamrl.models.factory import build_model
from streamrl.models.lora import base_weight_name, merged_weight
from streamrl.weights.layout import Layout, PackedSpec
from streamrl.weights.publisher import WeightPublisher
from streamrl.weights.subscriber import WeightSubscriber

from test_checkpoint import make_batch
from test_lora_trainer import adapter_values, lora_cfg, published, set_adapters


def expected_engine_weights(cfg, tr: Trainer) -> dict[str, torch.Tensor]:
    """The plain HF model's parameters with the trainer's current adapters merged."""
    base, _ = build_model(cfg.model, seed=cfg.run.seed)
    params = {n: p.detach().clone() for n, p in base.named_parameters()}
    version = published(tr)
    scaling = float(version.pop("lora.scaling"))
    for name in [n for n in version if n.endswith(".lora_A.weight")]:
        w = base_weight_name(name)
        params[w] = merged_weight(params[w], version[name], version[name.replace("lora_A", "lora_B")], scaling)
    return params


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["hf", "hf_fast"])
def test_adapter_versions_merge_bit_identical(redis_url, run_id, engine):
    cfg = lora_cfg(f"rollout.engine={engine}")
    tr = Trainer(cfg)
    set_adapters(tr.model, adapter_values(cfg))
    eng = build_engine(cfg)
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", bucket_bytes=8192)
    sub = WeightSubscriber(coord, plane="auto")
    try:
        timings = pub.publish(0, tr.param_specs, tr.full_tensors())
        adapter_bytes = sum(p.numel() * p.element_size() for p in tr.lora.trainable())
        assert adapter_bytes <= timings["weights/bytes"] <= adapter_bytes + 4096  # + scaling, alignment
        full_bytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
        assert timings["weights/bytes"] < full_bytes / 10
        assert sub.load(eng, 0) == 0
        for v in (0, 1):
            if v == 1:  # a trained version merges from the base again, not on top of version 0
                tr.step(make_batch(7, n=8))
                pub.publish(1, tr.param_specs, tr.full_tensors())
                assert sub.load(eng, 1) == 1
            want = expected_engine_weights(cfg, tr)
            got = dict(eng.model.named_parameters())
            assert sorted(got) == sorted(want)
            for name, t in want.items():
                assert torch.equal(got[name], t), (v, name)
    finally:
        sub.close()
        pub.close()


def test_bad_adapter_version_loads_nothing():
    cfg = lora_cfg()
    eng = build_engine(cfg)
    before = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    name = "model.layers.0.self_attn.q_proj"
    bad = [(f"{name}.lora_A.weight", torch.ones(4, 64)), (f"{name}.lora_B.weight", torch.ones(63, 4)),
           ("lora.scaling", torch.tensor([2.0]))]
    with pytest.raises(ValueError, match="do not make"):
        eng.load_weights(bad)
    with pytest.raises(ValueError, match="has only"):
        eng.load_weights(bad[:1] + bad[2:])
    assert all(torch.equal(p, before[n]) for n, p in eng.model.named_parameters())


@pytest.mark.timeout(120)
def test_bench_lora_reports_both_versions(capsys):
    from streamrl.bench.lora import main

    assert main(["--layers", "1", "--repeat", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["lora"]["bytes"] < out["full"]["bytes"] / 10
    assert out["bytes_ratio"] == round(out["lora"]["bytes"] / out["full"]["bytes"], 5)
    assert out["merge"]["projections"] == 4 and out["merge"]["merge_s"] > 0
    assert out["learner_step"] is True


def test_bench_learner_step_reads_and_writes_but_moves_nothing():
    """The bench's stand-in for the learner's AdamW step before a publish leaves the values as they were."""
    from streamrl.bench.lora import LearnerStep

    p = torch.nn.Parameter(torch.randn(4, 3))
    before = p.detach().clone()
    step = LearnerStep([p])
    step()
    step()
    assert torch.equal(p.detach(), before) and step.optim.state[p]["exp_avg"].shape == p.shape
    step.close()
    assert p.grad is None and not step.optim.state


def test_packed_manifest_entry_round_trips_and_malformed_parts_are_refused():
    """A packed tensor is one manifest entry whose parts come back as views; a malformed ``parts``
    (from Redis: plain JSON) is refused by the subscriber's check, naming the field."""
    a, b = torch.arange(6.0).view(2, 3), torch.arange(4.0).view(4, 1)
    spec = PackedSpec("lora.adapters.float32", torch.float32, [("m.lora_A.weight", (2, 3)), ("m.lora_B.weight", (4, 1))])
    assert tuple(spec) == ("lora.adapters.float32", torch.float32, (10,)) and spec != PackedSpec(spec[0], spec[1], [("x", (10,))])
    layout = Layout.plan([spec], 1 << 20)
    manifest = json.loads(json.dumps({"tensors": layout.tensors, "buckets": layout.buckets,
                                      "total_bytes": layout.total_bytes}))
    got = Layout.from_manifest(manifest)
    got.check()
    buf = torch.zeros(got.total_bytes, dtype=torch.uint8)
    buf[:40].view(torch.float32).copy_(torch.cat([a.reshape(-1), b.reshape(-1)]))
    views = dict(got.views(0, buf))
    assert list(views) == ["m.lora_A.weight", "m.lora_B.weight"]
    assert torch.equal(views["m.lora_A.weight"], a) and torch.equal(views["m.lora_B.weight"], b)
    for bad in ([["m.lora_A.weight", [2, 3]]], {"names": ["x"], "shapes": [[2, 3], [4]]},
                {"names": [1], "shapes": [[10]]}, {"names": ["x"], "shapes": [[-1]]}, {"names": ["x"], "shapes": [[9]]}):
        entry = dict(manifest["tensors"][0], parts=bad)
        with pytest.raises(ValueError, match="field 'parts'"):
            Layout([entry], manifest["buckets"], manifest["total_bytes"]).check()


def test_plain_adapters_live_in_the_pack_and_a_replaced_storage_is_seen():
    """Unsharded adapters are moved into one buffer, the pack itself (one piece: the publisher
    copies it in one op); a step writes through the parameters into it, and a parameter whose
    storage was replaced (``p.data = ...``) is seen, its values in the next pack."""
    mods = [nn.Linear(3, 2, bias=False), nn.Linear(2, 4, bias=False)]
    params = [m.weight for m in mods]
    opt = torch.optim.AdamW(params, lr=0.1)
    gather, tail = PackedGather(mods), torch.tensor([2.0])

    def want():
        return torch.cat([m.weight.detach().reshape(-1) for m in mods] + [tail])

    before = want()
    (pack,) = gather([tail])
    assert torch.equal(pack, before) and all(m.weight is p for m, p in zip(mods, params))
    assert [p.data_ptr() for p in params] == [pack.data_ptr(), pack.data_ptr() + 6 * 4]
    sum((m.weight ** 2).sum() for m in mods).backward()
    opt.step()
    (again,) = gather([tail])
    assert again is pack and torch.equal(again, want()) and not torch.equal(again, before)
    mods[1].weight.data = torch.full((4, 2), 7.0)
    (rebuilt,) = gather([tail])
    assert torch.equal(rebuilt, want()) and bool(rebuilt[6:14].eq(7).all())
    assert gather([torch.tensor([5.0])])[0][-1].item() == 5.0


def test_plain_pack_check_reads_no_address_unless_the_pack_lost_a_reference(monkeypatch):
    """The per-version "still in the pack" check is O(1): after an optimizer step, a forward and
    a backward no parameter address is read; a parameter re-pointed (``p.data = ...``,
    ``torch.utils.swap_tensors``) is still seen, also while other views of the pack are alive
    (they make the check read the addresses)."""
    mods = [nn.Linear(3, 2, bias=False), nn.Linear(2, 4, bias=False), nn.Linear(4, 3, bias=False)]
    opt = torch.optim.AdamW([m.weight for m in mods], lr=0.1)
    gather, tail = PackedGather(mods), torch.tensor([2.0])
    reads = []
    data_ptr = torch.Tensor.data_ptr
    monkeypatch.setattr(torch.Tensor, "data_ptr", lambda t: reads.append(t) or data_ptr(t))

    def want():
        return torch.cat([m.weight.detach().reshape(-1) for m in mods] + [tail])

    (pack,) = gather([tail])
    loss = mods[2](mods[1](mods[0](torch.randn(5, 3)))).square().sum()
    loss.backward()
    opt.step()
    del loss
    reads.clear()
    (again,) = gather([tail])
    assert again is pack and torch.equal(again, want()) and not reads
    held = [mods[0].weight.detach(), mods[2].weight[:1]]  # two views alive elsewhere
    (again,) = gather([tail])
    assert again is pack and reads  # an unexpected count: the addresses were compared
    mods[1].weight.data = torch.full((4, 2), 7.0)  # one reference fewer, two more: still seen
    (rebuilt,) = gather([tail])
    assert rebuilt is not pack and torch.equal(rebuilt, want()) and bool(rebuilt[6:14].eq(7).all())
    del held
    reads.clear()
    (again,) = gather([tail])
    assert again is rebuilt and not reads
    torch.utils.swap_tensors(mods[2].weight, nn.Parameter(torch.full((3, 4), 5.0)))
    (swapped,) = gather([tail])
    assert swapped is not rebuilt and torch.equal(swapped, want()) and bool(swapped[14:26].eq(5).all())
    tail.fill_(3.0)  # the same tail tensor, written in place: written into the pack again
    assert gather([tail])[0][-1].item() == 3.0


@pytest.mark.timeout(60)
# the many-pieces path's wrong total: torch.cat resizes its out= (deprecated) before the check sees it
@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_packed_tensor_from_one_piece_or_many_and_a_wrong_total_is_refused(redis_url, run_id):
    """A packed tensor's pieces reach the store as one memmove (one piece: an unsharded learner's
    pack) or one concatenation (many: FSDP's gathered rows); the subscriber gets the parts, bit for
    bit, and the bucket's checksum is the store's. Pieces of the wrong total are refused before
    anything is written or announced, by either path."""
    from streamrl.weights.layout import checksum_region

    parts = [("m.lora_A.weight", (2, 3)), ("m.lora_B.weight", (4, 2)), ("lora.scaling", (1,))]
    spec = PackedSpec("lora.adapters.float32", torch.float32, parts)
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", keep=1)
    sub = WeightSubscriber(coord, plane="shm")
    try:
        for v, n_pieces in enumerate([1, 3, 1]):
            flat = torch.randn(15)
            pieces = [flat] if n_pieces == 1 else [flat[:6], flat[6:14], flat[14:]]
            pub.publish(v, [spec], iter([pieces]))
            m = coord.manifest(v)
            (b,) = m["buckets"]
            store = pub.store.files[v].buf
            assert checksum_region(store[b["offset"]: b["offset"] + b["nbytes"]], "sum64") == b["checksum"]
            got = dict(sub.fetch(v))
            assert torch.equal(got["m.lora_A.weight"], flat[:6].view(2, 3))
            assert torch.equal(got["m.lora_B.weight"], flat[6:14].view(4, 2)) and got["lora.scaling"].item() == flat[14]
            del got
        for wrong in ([torch.randn(14)], [torch.randn(16)], [torch.randn(6), torch.randn(10)]):
            with pytest.raises(ValueError, match="its pieces hold"):
                pub.publish(3, [spec], iter([wrong]))
            assert coord.current_version() == 2
    finally:
        sub.close()
        pub.close()
