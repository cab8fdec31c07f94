"""Model out: a plain Hugging Face folder from a learner checkpoint or from the live learner.

``streamrl-export --run-dir DIR [--checkpoint latest|PATH] --out HF_DIR [--dtype bf16] [--adapter]`` writes
safetensors shards, ``config.json``, ``generation_config.json`` and the tokenizer files, which
``AutoModelForCausalLM.from_pretrained(HF_DIR)`` (and vLLM) load. It runs in one process with no
``torch.distributed``, from a checkpoint of any world size and any ``ep``, dense or MoE; the
V-trace value head stays behind. A ``model.lora`` run's folder has the adapters merged
(:mod:`streamrl.models.lora_export`); ``--adapter`` writes its PEFT adapter folder instead.

How, and why this way: the checkpoint stores every tensor under its HF parameter name with its
global shape (experts included, see :mod:`streamrl.learner.run_checkpoint`), so DCP's
``FileSystemReader`` loads the parameters straight into an HF model of the run's architecture,
single-process, resharding as it reads. The folder is then written by transformers'
``save_pretrained``, not by DCP's ``HuggingFaceStorageWriter``: transformers 5 keeps fused
expert tensors in memory (``experts.gate_up_proj`` [E, 2I, H]) but writes some families in
their original on-disk layout (Mixtral as ``block_sparse_moe.experts.{e}.w1/w2/w3``), which is
what vLLM and older readers expect; only ``save_pretrained`` knows each family's reverse
mapping, tied embeddings and shard index. The cost is one copy of the model in host memory
(1.5 GB for the 373 M smol-moe in fp32).

:func:`write_hf_folder` is the in-run variant (``checkpoint.hf_interval``, ``save_on_stop``):
collective over the learner ranks, it gathers one full tensor at a time into rank 0's copy.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl.config import load_config

if TYPE_CHECKING:  # torch is imported where used: `streamrl-export --help` stays instant
    import torch

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}


def parse_dtype(name: str | None) -> "torch.dtype | None":
    """``bf16``/``fp16``/``fp32`` (or the long names) -> torch dtype; None keeps the trained dtype."""
    import torch

    if name is None:
        return None
    if name not in DTYPES:
        raise ValueError(f"--dtype {name!r}: expected one of {sorted(DTYPES)}")
    return getattr(torch, DTYPES[name])


def source_folder(model) -> str:
    """The HF folder (or hub id) the run's model was loaded from; "" for the built tiny MoE.

    Taken from the loaded model rather than ``model.path`` so a hub id resolved to a cache
    folder at load time is read from the same place."""
    return str(getattr(model.config, "_name_or_path", "") or "")


def save_tokenizer(source: str, out: Path) -> None:
    """The run's tokenizer files, as the source folder has them (the learner pads on the left
    with its own copy; users get the original)."""
    if source:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(source).save_pretrained(out)
    else:
        from streamrl.models.tokenizer import build_char_tokenizer

        build_char_tokenizer().save_pretrained(out)


def _finish(model, source: str, tmp: Path, out: Path, dtype: "torch.dtype | None") -> None:
    """Write ``model`` (+ the tokenizer of ``source``) to ``tmp``, then move it to ``out`` (never a
    half folder)."""
    from transformers import GenerationConfig

    if dtype is not None:
        model.to(dtype)
    if source:  # the source's sampling defaults, not ones derived from the model config
        try:
            model.generation_config = GenerationConfig.from_pretrained(source)
        except OSError:  # the source folder has no generation_config.json
            pass
    if getattr(model, "generation_config", None) is None:
        model.generation_config = GenerationConfig.from_model_config(model.config)
    model.save_pretrained(tmp, max_shard_size="2GB")
    save_tokenizer(source, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def _tmp_dir(out: Path) -> Path:
    tmp = out.parent / f".tmp_{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def load_checkpoint_model(ckpt: Path, cfg=None):
    """``(model, tokenizer, learner_state)``: the run's HF model with the checkpoint's weights, in
    this process (no ``torch.distributed``, any ep / world size of the checkpoint).

    Args:
        cfg: the run config; None reads the one stored in the checkpoint.
    """
    import torch.distributed.checkpoint as dcp

    from streamrl.learner.run_checkpoint import CheckpointError, read_learner_state, read_run_config
    from streamrl.learner.critic import is_critic_param
    from streamrl.models.factory import load_model_and_tokenizer

    ckpt = Path(ckpt)
    meta = read_learner_state(ckpt)
    cfg = cfg or read_run_config(ckpt)
    if cfg is None:
        raise CheckpointError(f"checkpoint {str(ckpt)!r} stores no config.json (an older checkpoint); pass --config")
    if cfg.model.lora.active:  # adapters only: the base comes from model.path
        from streamrl.models.lora_export import load_lora_checkpoint, merged_model

        peft_model, tok = load_lora_checkpoint(ckpt, cfg)
        return merged_model(peft_model, cfg), tok, {**meta, "config": cfg}
    # The source model (HF folder or the seeded tiny MoE) gives the architecture, config,
    # generation config and any persistent buffers; its parameters are overwritten below.
    model, tok = load_model_and_tokenizer(cfg.model, seed=cfg.run.seed)
    targets = {f"model.{n}": p.data for n, p in model.named_parameters()}
    reader = dcp.FileSystemReader(str(ckpt))
    saved = {k for k in reader.read_metadata().state_dict_metadata
             if k.startswith("model.") and not is_critic_param(k[len("model."):])}
    if saved != set(targets):
        missing, unexpected = sorted(set(targets) - saved), sorted(saved - set(targets))
        raise CheckpointError(f"checkpoint {str(ckpt)!r} does not match model {type(model).__name__}: "
                              f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    dcp.load(targets, storage_reader=reader, no_dist=True)
    return model, tok, {**meta, "config": cfg}


def export_adapter(ckpt: Path, out: Path, cfg=None) -> dict:
    """Write the PEFT adapter folder ``out`` from the LoRA checkpoint ``ckpt`` (``--adapter``)."""
    from streamrl.learner.run_checkpoint import read_learner_state, read_run_config
    from streamrl.models.lora_export import load_lora_checkpoint, save_adapter_folder

    t0 = time.perf_counter()
    cfg = cfg or read_run_config(Path(ckpt))
    if cfg is None or not cfg.model.lora.active:
        raise ValueError(f"--adapter: checkpoint {str(ckpt)!r} is not of a model.lora run")
    peft_model, _ = load_lora_checkpoint(Path(ckpt), cfg)
    save_adapter_folder(peft_model, Path(out))
    params = [p for n, p in peft_model.named_parameters() if ".lora_" in n]
    return {"step": read_learner_state(Path(ckpt))["step"], "tensors": len(params),
            "bytes": sum(p.numel() * p.element_size() for p in params), "seconds": time.perf_counter() - t0}


def export_checkpoint(ckpt: Path, out: Path, cfg=None, dtype: "torch.dtype | None" = None) -> dict:
    """Write the HF folder ``out`` from the DCP checkpoint ``ckpt`` in this process (a LoRA
    run's with the adapters merged).

    Args:
        cfg: the run config; None reads the one stored in the checkpoint.
        dtype: dtype of the written tensors; None keeps the trained dtype (``model.dtype``).
    Returns:
        ``{"step", "ep", "world", "tensors", "bytes", "seconds"}`` of the export.
    """
    t0 = time.perf_counter()
    model, _, meta = load_checkpoint_model(ckpt, cfg)
    _finish(model, source_folder(model), _tmp_dir(Path(out)), Path(out), dtype)
    params = list(model.parameters())
    return {"step": meta["step"], "ep": meta.get("ep", 1), "world": meta.get("world", 1), "tensors": len(params),
            "bytes": sum(p.numel() * p.element_size() for p in params), "seconds": time.perf_counter() - t0}


def write_hf_folder(trainer, out_dir: str | Path, dtype: "torch.dtype | None" = None) -> Path | None:
    """Write the learner's current weights as an HF folder (collective on every learner rank).

    Every rank joins the gathers (FSDP all-gather, then expert slices over ``ep``), one
    parameter at a time; rank 0 copies each into an HF model built on the meta device and
    materialised on the CPU, then writes the folder. Returns the folder on rank 0, None elsewhere.
    """
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from streamrl.engines.adapter_merge import EngineWeights
    from streamrl.learner.critic import is_critic_param
    from streamrl.models.lora import SCALING_NAME, engine_name
    from streamrl.models.lora_export import plain_name
    from streamrl.parallel.expert_parallel import full_parameter

    rank = dist.get_rank() if dist.is_initialized() else 0
    out = Path(out_dir)
    model = params = None
    if rank == 0:
        trained = next(trainer.model.parameters()).dtype
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(trainer.model.config, dtype=trained)
        model.to_empty(device="cpu")
        model.tie_weights()  # to_empty gives tied parameters separate storage
        params = dict(model.named_parameters())
        # persistent buffers (e.g. routing biases) are not trained: take the learner's
        keys = set(model.state_dict())
        for name, b in trainer.model.named_buffers():
            if name in keys:
                model.get_buffer(name).copy_(b.detach().cpu())
    lora = getattr(trainer, "lora", None)
    adapters = []  # a LoRA learner's (name, full adapter tensor), merged once the base is in
    for name, p in trainer.model.named_parameters():
        if is_critic_param(name):
            continue
        with torch.no_grad():
            full = full_parameter(name, p, trainer.mesh)
        if lora is not None:
            ename = engine_name(name)
            if ename is not None:
                adapters.append((ename, full.detach().cpu()))
                continue
            name = plain_name(name)
        if rank == 0:
            if name not in params:
                raise KeyError(f"write_hf_folder: learner parameter {name} has no place in {type(model).__name__}")
            params[name].data = full.detach().to("cpu", params[name].dtype, copy=True)
    if rank == 0:
        if lora is not None:
            EngineWeights(params).load(adapters + [(SCALING_NAME, torch.tensor([lora.scaling]))])
        model.tie_weights()
        _finish(model, source_folder(trainer.model), _tmp_dir(out), out, dtype)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return out if rank == 0 else None


def hf_export_dir(cfg, step: int) -> Path:
    """Where the in-run exports go: ``CKPT_DIR/hf/step_00000012``."""
    from streamrl.learner.run_checkpoint import checkpoint_dir

    return checkpoint_dir(cfg) / "hf" / f"step_{step:08d}"


def write_step_folder(trainer, step: int) -> Path | None:
    """:func:`write_hf_folder` to :func:`hf_export_dir` (collective); rank 0 then keeps only the
    newest ``checkpoint.keep_last`` step folders. Returns the folder on rank 0, None elsewhere."""
    out = write_hf_folder(trainer, hf_export_dir(trainer.cfg, step))
    if out is not None:
        done = sorted(d for d in out.parent.iterdir() if d.is_dir() and d.name.startswith("step_"))
        for old in done[:-trainer.cfg.checkpoint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return out


def _resolve_checkpoint(args) -> tuple[Path, object]:
    from streamrl.learner.run_checkpoint import checkpoint_dir, latest_checkpoint

    cfg = load_config(args.config, [f"run.run_dir={args.run_dir}"]) if args.config else None
    if args.checkpoint != "latest":
        return Path(args.checkpoint), cfg
    root = checkpoint_dir(cfg) if cfg else Path(args.run_dir) / "checkpoints"
    path = latest_checkpoint(root)
    if path is None:
        raise ValueError(f"--checkpoint latest: no complete checkpoint under {root}")
    return path, cfg


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="streamrl-export", description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True, help="the run directory (checkpoints under RUN_DIR/checkpoints)")
    p.add_argument("--checkpoint", default="latest", help="'latest' (default) or a checkpoint directory")
    p.add_argument("--out", required=True, help="the HF folder to write (replaced if it exists)")
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: the trained dtype)")
    p.add_argument("--config", default=None, help="the run's YAML config, for checkpoints that store none")
    p.add_argument("--adapter", action="store_true",
                   help="model.lora runs: write the PEFT adapter folder instead of the merged model")
    args = p.parse_args(argv)
    try:
        dtype = parse_dtype(args.dtype)
        ckpt, cfg = _resolve_checkpoint(args)
        info = (export_adapter(ckpt, Path(args.out), cfg) if args.adapter
                else export_checkpoint(ckpt, Path(args.out), cfg, dtype))
    except ValueError as e:  # ConfigError and CheckpointError are ValueErrors
        print(f"streamrl-export: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"checkpoint": str(ckpt), "out": args.out, **info}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
