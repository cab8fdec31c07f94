"""Mixed precision in one learner process: FSDP2 on a 1-rank mesh, as at world > 1.

The decision (:func:`~streamrl.parallel.expert_parallel.shard_policy`) is pure and tested for
every case. CUDA is what turns the wrapping on, and this box has none, so the wrapped path is
forced on a 1-rank gloo process: with a cast-free policy it must train, checkpoint, resume and
publish exactly what the unwrapped learner does; with the bf16 policy the layers compute in bf16
while parameters, gradients and AdamW state stay float32.
"""
from __future__ import annotations

import pathlib

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from streamrl.config import load_config
from streamrl.learner.run_checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from streamrl.learner.trainer import Trainer
from streamrl.parallel.expert_parallel import full_parameter, shard_policy
from streamrl.weights.layout import ResidentTensors

from tests.dist_helpers import spawn_gloo

from test_checkpoint import REPO, make_batch

BF16 = (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("world, device, mixed, want", [
    (1, "cuda", True, BF16),   # the case this exists for: one GPU, fp32 masters, bf16 compute
    (2, "cuda", True, BF16),
    (1, "cuda", False, None),  # pure fp32 (or pure bf16 with model.dtype = bfloat16), unwrapped
    (1, "cpu", True, None),    # CPU: mixed precision is CUDA-only, one process stays as it was
    (2, "cpu", True, (None, None)),
    (2, "cuda", False, (None, None)),
])
def test_shard_policy(world, device, mixed, want):
    mp = shard_policy(world, device, mixed)
    assert (None if mp is None else (mp.param_dtype, mp.reduce_dtype)) == want


# The learner features that wrap or read the model: LoRA (adapters gathered from their shards),
# the in-learner reference model (wrapped like the policy), activation checkpointing.
VARIANTS = {
    "lora": ["model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,v_proj]"],
    "reference": ["learner.kl_coef=0.1"],
    "activation_checkpointing": ["learner.activation_checkpointing=true"],
}
# Several micro-batches and optimizer steps per step: one rank keeps the layers gathered across a
# minibatch's micro-batches (streamrl.parallel.micro_batch_gathering).
MICRO_BATCHES = ["learner.max_tokens_per_microbatch=24", "learner.minibatches=2"]


def _cfg(tmp: pathlib.Path, extra=()):
    return load_config(f"{REPO}/configs/tiny.yaml", [f"run.run_dir={tmp}", "learner.lr=1e-2", *extra])


def _params(tr) -> dict[str, torch.Tensor]:
    """What the learner publishes, by spec name (an adapter pack's pieces concatenated)."""
    return {name: (torch.cat(t) if isinstance(t, list) else t).clone()
            for (name, _, _), t in zip(tr.param_specs, tr.full_tensors())}


def _force_wrapping() -> None:
    """Make the one-process learner FSDP-wrap its model on CPU (a cast-free policy: same math)."""
    import streamrl.learner.trainer as trainer_mod
    import streamrl.parallel.expert_parallel as ep_mod

    cast_free = lambda world, device_type, mixed_precision: MixedPrecisionPolicy()  # noqa: E731
    trainer_mod.shard_policy = ep_mod.shard_policy = cast_free


def _variant_steps(tmp: pathlib.Path, extra) -> dict:
    torch.manual_seed(0)
    tr = Trainer(_cfg(tmp, extra))
    losses = [tr.step(make_batch(100 + s))["learner/loss"] for s in range(2)]
    wrapped = any(isinstance(p, DTensor) for p in tr.model.parameters())
    return {"wrapped": wrapped, "losses": losses, "params": _params(tr)}


def _train(tmp: pathlib.Path, steps: int, save_at: int | None = None, resume: bool = False):
    """(losses, published params, trainer, whether the resident tensors stayed live) after
    ``steps`` steps, from the latest checkpoint when ``resume``."""
    torch.manual_seed(0)
    tr = Trainer(_cfg(tmp))
    resident = tr.full_tensors()  # taken before the first step (FSDP's lazy init) and the resume
    start = load_checkpoint(latest_checkpoint(tmp / "ck"), tr)[0]["step"] if resume else 0
    losses = []
    for s in range(start, steps):
        losses.append(tr.step(make_batch(100 + s))["learner/loss"])
        if save_at == s + 1:
            save_checkpoint(tmp / "ck", s + 1, tr, {"version": s + 1})
    return losses, _params(tr), tr, _resident_live(tr, resident)


def _resident_live(tr, resident) -> bool:
    """Whether ``resident`` (an earlier ``full_tensors()``) is still what a publish hands out and
    still holds the parameters as they are now: one process publishes the parameters' own
    storage, which training and checkpoint loads must update in place, never re-point."""
    now = [full_parameter(n, p, tr.mesh) for n, p in tr.model.named_parameters()]
    return (isinstance(resident, ResidentTensors) and tr.full_tensors() is resident
            and len(now) == len(resident) and all(torch.equal(r, t) for r, t in zip(resident, now)))


def _wrapped_one_rank(rank, world, tmp):
    """On a 1-rank gloo group: the trainer with its model FSDP-wrapped (forced: no CUDA here)."""
    assert world == 1
    _force_wrapping()
    tmp = pathlib.Path(tmp)
    losses, params, tr, live = _train(tmp / "w", 4, save_at=2)
    wrapped = all(isinstance(p, DTensor) for p in tr.model.parameters())
    resumed = _train(tmp / "w", 4, resume=True)
    return {"wrapped": wrapped, "losses": losses, "params": params, "resident_live": [live, resumed[3]],
            "resumed_losses": resumed[0], "resumed_params": resumed[1]}


def _bf16_compute_one_rank(rank, world):
    """The bf16 policy on a 1-rank mesh: what dtypes the layers, gradients and AdamW see."""
    from streamrl.models.factory import build_model
    from streamrl.parallel.expert_parallel import full_parameter, parallelize, shard_model
    from streamrl.parallel.mesh import build_mesh

    model, _ = build_model(load_config(f"{REPO}/configs/tiny.yaml", []).model, seed=0)
    mesh = build_mesh(1, "cpu", 4, single_rank=True)
    blocks = parallelize(model, mesh, torch.device("cpu"), mixed_precision=False)  # CPU: left unwrapped
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    shard_model(model, blocks, mesh, shard_policy(1, "cuda", True))
    seen = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append((i[0].dtype, o.dtype)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 5, 6, 7]])).logits.float().sum().backward()
    opt.step()
    # the publisher's and exporter's full tensors on one rank: the local shards themselves, no copies
    full = [full_parameter(n, p, mesh) for n, p in model.named_parameters()]
    return {"full_is_local": all(f.data_ptr() == p.to_local().data_ptr() and f.shape == p.shape
                                 for f, p in zip(full, model.parameters())),
            "layer": [str(d) for d in seen[0]],
            "params": sorted({str(p.dtype) for p in model.parameters()}),
            "grads": sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}),
            "adam": sorted({str(v.dtype) for s in opt.state.values() for v in s.values() if v.dim() > 0})}


@pytest.mark.timeout(300)
def test_wrapped_one_rank_trains_resumes_and_publishes_like_unwrapped(tmp_path):
    ref_losses, ref_params, tr, ref_live = _train(tmp_path / "ref", 4)
    assert not any(isinstance(p, DTensor) for p in tr.model.parameters())  # CPU: unwrapped by default
    out = spawn_gloo(_wrapped_one_rank, 1, str(tmp_path), timeout_s=240)[0]
    assert out["wrapped"]
    # the publisher replays its copies of these tensors: they must follow training and the resume
    assert ref_live and out["resident_live"] == [True, True]
    assert out["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert out["params"].keys() == ref_params.keys()
    for k, v in ref_params.items():
        assert out["params"][k].dtype == v.dtype and torch.allclose(out["params"][k], v, atol=1e-6, rtol=0), k
    # DCP checkpoint of the wrapped model: the resumed run is the uninterrupted one, bit for bit
    assert out["resumed_losses"] == out["losses"][2:]
    for k, v in out["params"].items():
        assert torch.equal(out["resumed_params"][k], v), k


def _wrapped_variants(rank, world, tmp):
    _force_wrapping()
    return {k: _variant_steps(pathlib.Path(tmp) / k, extra) for k, extra in VARIANTS.items()}


@pytest.mark.timeout(300)
def test_wrapped_one_rank_lora_reference_and_checkpointing_match_unwrapped(tmp_path):
    out = spawn_gloo(_wrapped_variants, 1, str(tmp_path / "w"), timeout_s=240)[0]
    for k, extra in VARIANTS.items():
        ref = _variant_steps(tmp_path / "ref" / k, extra)
        assert out[k]["wrapped"] and not ref["wrapped"], k
        assert out[k]["losses"] == pytest.approx(ref["losses"], rel=1e-5), k
        assert out[k]["params"].keys() == ref["params"].keys(), k
        for n, v in ref["params"].items():
            assert torch.allclose(out[k]["params"][n], v, atol=1e-6, rtol=0), (k, n)


@pytest.mark.timeout(120)
def test_bf16_policy_on_one_rank_computes_bf16_over_fp32_masters():
    out = spawn_gloo(_bf16_compute_one_rank, 1, timeout_s=100)[0]
    assert out["layer"] == ["torch.bfloat16", "torch.bfloat16"]
    assert out["params"] == out["grads"] == out["adam"] == ["torch.float32"]
    assert out["full_is_local"]


def _gathering_on_and_off(rank, world, tmp):
    """The micro-batches variant with the gathering on, then off; each with the number of gathers
    FSDP2 ran (on one rank a gather is the copy made in ``wait_for_unshard`` after an unshard)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from streamrl.parallel.micro_batch_gathering import MicroBatchGathering

    gathers = [0]
    wait_for_unshard = FSDPParamGroup.wait_for_unshard

    def counted(group):
        gathers[0] += group._all_gather_result is not None
        return wait_for_unshard(group)

    FSDPParamGroup.wait_for_unshard = counted
    _force_wrapping()
    on = {**_variant_steps(pathlib.Path(tmp) / "on", MICRO_BATCHES), "gathers": gathers[0]}
    gathers[0] = 0
    init = MicroBatchGathering.__init__

    def inactive(self, model, world):
        init(self, model, world)
        self.active = False

    MicroBatchGathering.__init__ = inactive
    off = {**_variant_steps(pathlib.Path(tmp) / "off", MICRO_BATCHES), "gathers": gathers[0]}
    return {"on": on, "off": off}


@pytest.mark.timeout(300)
def test_one_gather_per_minibatch_trains_exactly_like_fsdp_defaults(tmp_path):
    """4 micro-batches in each of 2 minibatches a step, 2 steps: the layers stay gathered within a
    minibatch and every optimizer step is read by the next forward, bit for bit as with FSDP's
    defaults (a stale gathered copy would change the second minibatch's losses and updates)."""
    out = spawn_gloo(_gathering_on_and_off, 1, str(tmp_path / "w"), timeout_s=240)[0]
    on, off = out["on"], out["off"]
    assert on["wrapped"] and off["wrapped"]
    assert 0 < on["gathers"] < off["gathers"], (on["gathers"], off["gathers"])  # the gathering did something
    assert on["losses"] == off["losses"]
    for n, v in off["params"].items():
        assert torch.equal(on["params"][n], v), n
    # and like the unwrapped learner, up to the order FSDP sums the micro-batches' gradients in
    # (AdamW at lr 1e-2 turns those last-bit differences into ~5e-6 on weights of ~0.1)
    ref = _variant_steps(tmp_path / "ref", MICRO_BATCHES)
    assert on["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    for n, v in ref["params"].items():
        assert torch.allclose(on["params"][n], v, atol=2e-5, rtol=0), n
