"""Typed run configuration: one dataclass per component, YAML files, ``key=value`` overrides.

Why dataclasses and not a dict: every field has a type, a default and a one-line doc, and
:func:`load_config` validates the whole tree at load time so a typo or a bad value fails
before any process starts, with an error that names the dotted field and the value.

Examples:
    >>> cfg = load_config("configs/tiny.yaml", ["learner.lr=3e-3", "rollout.group_size=4"])
    >>> cfg.learner.lr
    0.003
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from streamrl.errors import ConfigError
from streamrl.placement import validate_placement_config
from streamrl.rewards import RewardSpecError, parse_reward_spec
from streamrl.tasks import available_tasks
from streamrl.tasks.reasoning import ANSWER_FORMATS, parse_datasets
from streamrl.weights.planes import ipc_obstacle

EVAL_ENGINES = ("hf", "hf_fast")
"""eval.engine: the engines evaluation can decode with (vllm is a server of its own; evaluation scores in-process)."""


def _check(cond: bool, name: str, value: Any, why: str) -> None:
    if not cond:
        raise ConfigError(f"config field '{name}' = {value!r}: {why}")


@dataclass
class RunConfig:
    name: str = "tiny"
    """Run name; namespaces every Redis key of the run."""
    seed: int = 0
    """Global seed: model init, prompt streams and sampling derive from it."""
    steps: int = 40
    """Number of learner optimizer steps before the run stops."""
    run_dir: str = "runs/latest"
    """Directory for metrics.jsonl, summary.json, logs and checkpoints."""
    wandb: bool = False
    """Also log the learner's metrics to Weights & Biases (pip extra 'wandb'; WANDB_MODE=offline needs no network)."""
    wandb_project: str = "streamrl"
    """Weights & Biases project of the run (with run.wandb)."""

    def validate(self, p: str) -> None:
        _check(self.steps > 0, f"{p}.steps", self.steps, "must be > 0")
        _check(bool(self.name) and ":" not in self.name, f"{p}.name", self.name,
               "must be non-empty and contain no ':'")


@dataclass
class LoraConfig:
    enabled: bool = False
    """Train low-rank adapters (PEFT LoRA) on a frozen base instead of every parameter."""
    r: int = 8
    """Adapter rank; 0 turns LoRA off like enabled = false."""
    alpha: float = 16.0
    """Adapter scale numerator: the update is (alpha / r) * B @ A."""
    dropout: float = 0.0
    """Dropout on the adapter input while training (0 keeps the learner's log-probs equal to the engine's)."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Linear modules that get adapters, matched by name suffix (PEFT's rule); MoE experts and routers are refused."""

    @property
    def active(self) -> bool:
        """LoRA is on: enabled with a rank > 0."""
        return self.enabled and self.r != 0

    def validate(self, p: str) -> None:
        if not self.enabled:
            return
        _check(self.r >= 0, f"{p}.r", self.r, "must be > 0 (0 turns LoRA off)")
        _check(self.alpha > 0, f"{p}.alpha", self.alpha, "must be > 0")
        _check(0.0 <= self.dropout < 1.0, f"{p}.dropout", self.dropout, "must be in [0, 1)")
        _check(bool(self.target_modules) and all(isinstance(t, str) and t for t in self.target_modules),
               f"{p}.target_modules", self.target_modules, "must be a non-empty list of module names")


@dataclass
class ModelConfig:
    path: str = ""
    """HF model folder to load; empty builds the tiny random MoE below."""
    hidden_size: int = 64
    """Model width (divisible by 32 so vLLM's CPU MoE kernel can run it)."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 2
    """Attention heads."""
    num_kv_heads: int = 1
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 32
    """Per-head width (>= 32 for vLLM CPU attention)."""
    num_experts: int = 4
    """Routed experts per MoE layer."""
    experts_per_token: int = 2
    """Top-k experts each token is routed to."""
    expert_size: int = 64
    """Expert MLP intermediate width (divisible by 32)."""
    max_positions: int = 128
    """Maximum sequence length."""
    dtype: str = "float32"
    """Parameter dtype: float32 or bfloat16."""
    load: str = "sharded"
    """Learner start from model.path: sharded (meta device, each rank reads only its shards) or full (every rank loads all, then shards)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters on a frozen base (docs/lora.md)."""

    def validate(self, p: str) -> None:
        self.lora.validate(f"{p}.lora")
        _check(self.load in ("sharded", "full"), f"{p}.load", self.load, "must be sharded or full")
        for name in ("hidden_size", "expert_size"):
            v = getattr(self, name)
            _check(v > 0 and v % 32 == 0, f"{p}.{name}", v, "must be a positive multiple of 32")
        _check(self.head_dim >= 32, f"{p}.head_dim", self.head_dim, "must be >= 32")
        _check(self.num_layers > 0, f"{p}.num_layers", self.num_layers, "must be > 0")
        _check(self.num_heads > 0 and self.num_heads % max(self.num_kv_heads, 1) == 0,
               f"{p}.num_heads", self.num_heads, "must be a positive multiple of num_kv_heads")
        _check(self.num_experts > 0, f"{p}.num_experts", self.num_experts, "must be > 0")
        _check(0 < self.experts_per_token <= self.num_experts, f"{p}.experts_per_token",
               self.experts_per_token, f"must be in [1, num_experts={self.num_experts}]")
        _check(self.dtype in ("float32", "bfloat16"), f"{p}.dtype", self.dtype,
               "must be float32 or bfloat16")


@dataclass
class TaskConfig:
    name: str = "copy_digits"
    """Registered task name (see streamrl.tasks.registry)."""
    num_digits: int = 4
    """Digits per prompt for digit tasks; operand digits for arithmetic; digits of long_sequence's first number."""
    datasets: dict[str, Any] | None = None
    """reasoning_gym: {dataset: weight | {weight, **dataset options}}; null = basic_arithmetic, chain_sum, products."""
    answer_format: str = "final"
    """reasoning_gym: instruction after each question: final (only the answer), tag (<answer></answer>), none."""
    partial_credit: bool = False
    """reasoning_gym: keep the scorers' partial credit (e.g. 0.8 for '63700' when '6370' is right); false = 0."""
    min_answer_tokens: int = 512
    """long_sequence: shortest answer in tokens (one per digit, word, punctuation mark and space before a number)."""
    max_answer_tokens: int = 1024
    """long_sequence: longest answer in tokens; at least min_answer_tokens + 32 (room for a whole term)."""

    def validate(self, p: str) -> None:
        _check(self.name in available_tasks(), f"{p}.name", self.name,
               f"unknown task; known: {sorted(available_tasks())}")
        _check(1 <= self.num_digits <= 12, f"{p}.num_digits", self.num_digits, "must be in [1, 12]")
        _check(self.min_answer_tokens >= 1, f"{p}.min_answer_tokens", self.min_answer_tokens, "must be >= 1")
        _check(self.max_answer_tokens >= self.min_answer_tokens + 32, f"{p}.max_answer_tokens",
               self.max_answer_tokens, f"must be >= task.min_answer_tokens + 32 = {self.min_answer_tokens + 32}")
        _check(self.answer_format in ANSWER_FORMATS, f"{p}.answer_format", self.answer_format,
               f"must be one of {sorted(ANSWER_FORMATS)}")
        if self.name != "reasoning_gym":
            _check(self.datasets is None, f"{p}.datasets", self.datasets, "only task.name = reasoning_gym uses it")
            _check(not self.partial_credit, f"{p}.partial_credit", self.partial_credit,
                   "only task.name = reasoning_gym uses it")
            return
        try:
            parse_datasets(self.datasets, f"{p}.datasets")
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass
class DataConfig:
    """Training prompts from a file (:mod:`streamrl.tasks.datasets`) instead of the task generator."""

    path: str = ""
    """JSONL file, Parquet file or datasets folder (save_to_disk) of training prompts; empty = the task generator."""
    prompt_key: str = "prompt"
    """Column holding the prompt: text, or chat messages [{role, content}, ...]."""
    answer_key: str = "answer"
    """Column holding the reference answer (text or a number); other columns reach rewards in Problem.fields."""
    split: str = "train"
    """Split taken from a DatasetDict folder (also for eval.dataset)."""

    def validate(self, p: str) -> None:
        _check(bool(self.prompt_key), f"{p}.prompt_key", self.prompt_key, "must be non-empty")
        _check(bool(self.answer_key), f"{p}.answer_key", self.answer_key, "must be non-empty")
        _check(self.prompt_key != self.answer_key, f"{p}.answer_key", self.answer_key,
               "must differ from data.prompt_key")


@dataclass
class EvalConfig:
    """Evaluation during training (the evaluator process) and for ``streamrl-eval``."""

    interval: int = 0
    """Evaluate every this many learner versions (0 = no evaluator process; streamrl-eval still works)."""
    dataset: str = ""
    """Held-out file or folder (data.prompt_key/answer_key mapping); empty = held-out seeds of the task generator."""
    size: int = 64
    """Problems evaluated: the first eval.size rows of eval.dataset, or that many held-out generator problems."""
    samples: int = 0
    """pass@k: sample this many responses per problem at eval.temperature (0 = greedy accuracy only)."""
    temperature: float = 1.0
    """Sampling temperature of the pass@k samples."""
    max_new_tokens: int = 0
    """Response length cap for evaluation; 0 = rollout.max_new_tokens."""
    batch_size: int = 32
    """Prompts decoded together."""
    reward: str = "task"
    """Reward spec scoring correctness (a response is correct when it scores >= 1): task, math_verify, ..."""
    device: str = "cpu"
    """Device of the evaluator's model."""
    engine: str = "hf"
    """How evaluation decodes: 'hf' (transformers generate, in model.dtype) or 'hf_fast' (the rollout engine: static
    KV cache, CUDA graphs, eval.batch_size slots refilled as answers end, in rollout.dtype); at 1,024-token answers on
    a GPU hf_fast scores a checkpoint in seconds instead of a minute."""

    def validate(self, p: str) -> None:
        _check(self.interval >= 0, f"{p}.interval", self.interval, "must be >= 0")
        _check(self.engine in EVAL_ENGINES, f"{p}.engine", self.engine, f"must be one of {EVAL_ENGINES}")
        _check(self.size >= 1, f"{p}.size", self.size, "must be >= 1")
        _check(self.samples >= 0, f"{p}.samples", self.samples, "must be >= 0")
        _check(self.temperature > 0, f"{p}.temperature", self.temperature, "must be > 0")
        _check(self.max_new_tokens >= 0, f"{p}.max_new_tokens", self.max_new_tokens, "must be >= 0")
        _check(self.batch_size >= 1, f"{p}.batch_size", self.batch_size, "must be >= 1")
        if self.reward != "task":
            try:
                parse_reward_spec(self.reward)
            except RewardSpecError as e:
                raise ConfigError(f"config field '{p}.reward' = {self.reward!r}: {e}") from None


@dataclass
class RolloutConfig:
    engine: str = "hf"
    """Generation engine: 'hf' (transformers generate), 'hf_fast' (static KV cache, refill, CUDA graphs) or 'vllm'."""
    group_size: int = 8
    """Completions sampled per prompt (one GRPO group)."""
    prompts_per_batch: int = 4
    """Prompts generated together; their groups are sent as one message."""
    max_new_tokens: int = 8
    """Response length cap."""
    temperature: float = 1.0
    """Sampling temperature (behaviour log-probs are of the tempered distribution)."""
    device: str = "cpu"
    """Device for the engine."""
    dtype: str = ""
    """Dtype the engine holds and computes in: '' (model.dtype), 'float32' or 'bfloat16'. Versions arrive in the
    learner's model.dtype and are cast on load; with bfloat16 the behaviour log-probs come from the bf16 sampler
    and the learner's importance weights (loss grpo_tis) correct the difference."""
    rewards: str = "task"
    """Reward spec 'name=weight,...': task, exact_answer, format or package.module:function."""
    reward_model: str = ""
    """Optional reward model: an HF folder (sequence-classification or causal LM) or a hook 'package.module:factory'."""
    reward_model_device: str = "cpu"
    """Device handed to the reward-model factory (its own device)."""
    chat_template: bool = False
    """Wrap prompts in the tokenizer's chat template (instruct models)."""
    kv_cache_mb: int = 256
    """vLLM KV-cache size in MiB (vLLM's default would take 90% of memory)."""
    kv_cache: str = "static"
    """hf_fast KV memory: 'static' (a slot of max_model_len per sequence) or 'paged' (blocks allocated as sequences grow)."""
    kv_block_size: int = 16
    """hf_fast paged: positions per KV block."""
    kv_pool_mb: int = 0
    """hf_fast paged: KV block pool in MiB (0 = as many positions as the static cache); a full pool preempts."""
    paged_attention: str = "gather"
    """hf_fast paged: 'gather' (copy each slot's blocks into a contiguous span per layer) or 'flex' (FlexAttention
    reads the pool in place through a block mask; always compiled; CPU only: it failed its CUDA parity test)."""
    decode_attention: str = "auto"
    """hf_fast static KV: decode attention 'sdpa' (each step attends the span bucket of its furthest row) or 'flex'
    (FlexAttention reads each row's own 128-position blocks, split over the GPU; one compiled graph for all spans);
    'auto' = flex on CUDA when max_model_len >= 512 (streamrl.engines.hf_fast.FLEX_MIN_LEN), else sdpa."""
    max_model_len: int = 512
    """vllm and hf_fast: longest prompt + response in tokens (hf_fast sizes its KV cache by it)."""
    gpu_memory_utilization: float = 0.5
    """vLLM on GPU: fraction of GPU memory for weights + KV (ignored on CPU)."""
    enable_prefix_caching: bool = True
    """Prefill a group's shared prompt once (vllm: prefix caching, reset on updates, also reusing earlier turns of env episodes; hf_fast: K/V fork)."""
    enforce_eager: bool = True
    """vLLM: run eagerly; false captures CUDA graphs (GPU only)."""
    tensor_parallel_size: int = 1
    """vLLM: GPUs one engine shards the model over (tensor parallel; > 1 needs CUDA)."""
    record_routing: bool = False
    """Record routed-expert ids per token (trajectory key routed_experts; all engines)."""
    parity_probes: int = 0
    """After each weight update score this many fixed probes in engine and HF model (0 = off)."""
    inflight_updates: bool = False
    """Load newer weights between decode steps of a batch (per-token versions); hf_fast, vllm only."""
    token_rewards: bool = False
    """Send per-token rewards (trajectory key token_rewards) from tasks' character credit; see learner.advantage."""
    streaming: bool = False
    """hf_fast, single-turn: one endless generation; a finished sample's slot takes a new group's sample, a finished
    group is scored and sent prompts_per_batch groups at a time (implies per-token versions via in-flight updates)."""

    def validate(self, p: str) -> None:
        _check(self.engine in ("hf", "hf_fast", "vllm"), f"{p}.engine", self.engine,
               "must be 'hf', 'hf_fast' or 'vllm'")
        _check(self.dtype in ("", "float32", "bfloat16"), f"{p}.dtype", self.dtype,
               "must be '' (model.dtype), 'float32' or 'bfloat16'")
        _check(self.kv_cache_mb >= 1, f"{p}.kv_cache_mb", self.kv_cache_mb, "must be >= 1")
        _check(self.kv_cache in ("static", "paged"), f"{p}.kv_cache", self.kv_cache, "must be 'static' or 'paged'")
        _check(self.kv_cache == "static" or self.engine == "hf_fast", f"{p}.kv_cache", self.kv_cache,
               "'paged' needs rollout.engine = 'hf_fast' (vllm pages its own cache)")
        _check(self.kv_block_size >= 1 and 128 % self.kv_block_size == 0, f"{p}.kv_block_size", self.kv_block_size,
               "must divide 128 (the CUDA-graph span bucket)")
        _check(self.kv_pool_mb >= 0, f"{p}.kv_pool_mb", self.kv_pool_mb, "must be >= 0")
        _check(self.paged_attention in ("gather", "flex"), f"{p}.paged_attention", self.paged_attention,
               "must be 'gather' or 'flex'")
        _check(self.paged_attention == "gather" or self.kv_cache == "paged", f"{p}.paged_attention",
               self.paged_attention, "'flex' reads the paged pool: needs rollout.kv_cache = 'paged'")
        _check(self.paged_attention == "gather" or not self.device.startswith("cuda"), f"{p}.paged_attention",
               self.paged_attention, "'flex' failed its CUDA parity test (tests/test_hf_fast_paged.py): use 'gather' on CUDA")
        _check(self.decode_attention in ("auto", "sdpa", "flex"), f"{p}.decode_attention", self.decode_attention,
               "must be 'auto', 'sdpa' or 'flex'")
        _check(self.decode_attention != "flex" or (self.engine == "hf_fast" and self.kv_cache == "static"),
               f"{p}.decode_attention", self.decode_attention,
               "'flex' is hf_fast's static-KV decode: needs rollout.engine = 'hf_fast' and rollout.kv_cache = 'static'")
        _check(self.max_model_len >= 2, f"{p}.max_model_len", self.max_model_len, "must be >= 2")
        _check(0 < self.gpu_memory_utilization <= 1, f"{p}.gpu_memory_utilization",
               self.gpu_memory_utilization, "must be in (0, 1]")
        _check(self.tensor_parallel_size >= 1, f"{p}.tensor_parallel_size", self.tensor_parallel_size, "must be >= 1")
        _check(self.tensor_parallel_size == 1 or (self.engine == "vllm" and self.device.startswith("cuda")),
               f"{p}.tensor_parallel_size", self.tensor_parallel_size,
               "> 1 needs rollout.engine = 'vllm' on a CUDA device")
        _check(self.enforce_eager or (self.engine == "vllm" and self.device.startswith("cuda")),
               f"{p}.enforce_eager", self.enforce_eager,
               "false (CUDA graphs) needs rollout.engine = 'vllm' on a CUDA device (hf_fast captures graphs on CUDA itself)")
        if self.engine in ("vllm", "hf_fast"):
            _check(self.max_new_tokens < self.max_model_len, f"{p}.max_new_tokens", self.max_new_tokens,
                   f"must be < rollout.max_model_len = {self.max_model_len} (prompt + response must fit)")
        _check(self.parity_probes >= 0, f"{p}.parity_probes", self.parity_probes, "must be >= 0")
        _check(not (self.inflight_updates and self.engine == "hf"), f"{p}.inflight_updates", self.inflight_updates,
               "in-flight weight updates need rollout.engine = 'hf_fast' or 'vllm' (hf uses model.generate)")
        _check(not self.streaming or self.engine == "hf_fast", f"{p}.streaming", self.streaming,
               "needs rollout.engine = 'hf_fast' (the engine that refills slots from a stream)")
        if self.rewards != "task":
            try:
                parse_reward_spec(self.rewards)
            except RewardSpecError as e:
                raise ConfigError(f"config field '{p}.rewards' = {self.rewards!r}: {e}") from None
        _check(self.group_size >= 2, f"{p}.group_size", self.group_size,
               "must be >= 2 (group-relative advantages need a group)")
        _check(self.prompts_per_batch >= 1, f"{p}.prompts_per_batch", self.prompts_per_batch, "must be >= 1")
        _check(self.max_new_tokens >= 1, f"{p}.max_new_tokens", self.max_new_tokens, "must be >= 1")
        _check(self.temperature > 0, f"{p}.temperature", self.temperature, "must be > 0")


@dataclass
class LearnerConfig:
    lr: float = 3e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    groups_per_step: int = 8
    """Prompt groups consumed by one optimizer step (global, across data-parallel ranks)."""
    max_staleness: int = 4
    """Largest accepted version lag (learner version - oldest token version); 0 = on-policy."""
    staleness: str = "fixed"
    """Admission bound: fixed (max_staleness) or adaptive (set each step in [staleness_min, max_staleness] from
    ESS, clip fraction, behaviour KL and idle time; see streamrl.learner.staleness_control)."""
    staleness_min: int = 1
    """staleness = adaptive: the lowest admission bound the controller may set."""
    staleness_ess_min: float = 0.9
    """staleness = adaptive: tighten while the importance weights' normalised ESS is below this."""
    staleness_clip_frac_max: float = 0.2
    """staleness = adaptive: tighten while the PPO clip fraction is above this."""
    staleness_kl_max: float = 0.05
    """staleness = adaptive: tighten while KL(behaviour || proximal) per token is above this (nats)."""
    staleness_idle_frac_max: float = 0.1
    """staleness = adaptive: loosen while the learner waits for data more than this share of a step."""
    staleness_ema: float = 0.8
    """staleness = adaptive: weight of the past in the moving average of each signal."""
    staleness_interval: int = 5
    """staleness = adaptive: learner steps between two changes of the bound (one version per change)."""
    loss: str = "grpo_tis"
    """Policy loss (see streamrl.learner.step_loss.LOSSES): grpo_tis, grpo_no_correction, grpo_mis,
    grpo_seq_tis, grpo_seq_mis, decoupled_ppo, ppo_coupled, gspo, vtrace (critic variant)."""
    clip_low: float = 0.2
    """PPO clip epsilon below 1."""
    clip_high: float = 0.28
    """PPO clip epsilon above 1 (clip-higher)."""
    tis_cap: float = 2.0
    """Truncation cap of the behaviour importance weight."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    aux_loss_coef: float = 0.01
    """MoE load-balancing loss coefficient."""
    publish_interval: int = 1
    """Publish weights every this many steps."""
    device: str = "cpu"
    """Learner device ('cpu' or 'cuda'; ranks use their local GPU)."""
    agg: str = "token-mean"
    """Loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm (Dr.GRPO)."""
    adv_std_norm: bool = True
    """Divide group advantages by the group std (GRPO); false = Dr.GRPO (centre only)."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 capping the loss of negative advantages at c|A|; 0 = off."""
    gspo_clip_low: float = 3e-4
    """GSPO clip epsilon below 1 (sequence ratios are geometric means: tiny epsilons)."""
    gspo_clip_high: float = 4e-4
    """GSPO clip epsilon above 1."""
    skip_no_signal: bool = True
    """Skip the optimizer step of a batch whose advantages are all 0 (every group's rewards alike)."""
    drop_zero_advantage: bool = True
    """Leave samples with advantage 0 on every loss token out of the forward/backward where that changes no gradient
    (no critic, KL, entropy bonus, MoE router loss); per-sample metrics then cover only the trained samples."""
    minibatches: int = 1
    """Optimizer steps per batch; > 1 makes the proximal policy differ from the current one."""
    kl_coef: float = 0.0
    """Coefficient of the KL penalty to a frozen copy of the initial policy; 0 = no reference model."""
    kl_estimator: str = "k3"
    """KL estimator: k1 or k3."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (subtracted from the loss)."""
    z_loss_coef: float = 0.0
    """MoE router z-loss coefficient."""
    ep: int = 1
    """Expert-parallel degree: experts split over this many ranks (must divide world size and experts)."""
    experts_impl: str = "auto"
    """Expert MLP kernel: auto (grouped_mm on CUDA, loop on CPU), grouped_mm (also on CPU: bf16 only there), loop."""
    mixed_precision: bool = True
    """On CUDA: bf16 parameters in forward/backward with fp32 gradient reduction and model.dtype master weights
    (FSDP2; one GPU too, on a 1-rank mesh). CPU learners always compute in model.dtype."""
    router_freeze_steps: int = 0
    """Keep MoE router weights frozen for this many steps (warm-up)."""
    router_unfreeze_min_entropy: float = 0.0
    """Unfreeze only once mean moe/router_entropy >= this (0 = no gate)."""
    router_unfreeze_max_usage_std: float = 0.0
    """Unfreeze only once mean moe/expert_usage_std <= this (0 = no gate)."""
    router_ema: float = 0.0
    """EMA decay of the router weights published to rollouts (0 = publish the raw router)."""
    routing_replay: bool = False
    """Replay the rollout's routed experts (R3) when trajectories carry routed_experts."""
    compile: bool = False
    """torch.compile each decoder layer, the final norm and the log-prob head's chunk kernels (1.37x learner-step
    tokens/s on an H200 before the head was compiled; slow to warm up on CPU)."""
    warm_up: bool = True
    """On CUDA or with ``compile``: before the first batch, one forward/backward of a synthetic batch of the
    configured shape (no optimizer step), so the first step's compiles and allocations overlap the workers'
    first rollouts (:mod:`streamrl.learner.warmup`). Eager CPU learners have nothing to warm up and skip it."""
    value_coef: float = 0.5
    """loss = vtrace: weight of the critic's value loss in the total loss."""
    gamma: float = 1.0
    """loss = vtrace: per-token discount of the V-trace return (1 = undiscounted sequence reward)."""
    vtrace_rho_bar: float = 1.0
    """loss = vtrace: truncation rho_bar of the importance weight in the TD errors and advantages."""
    vtrace_c_bar: float = 1.0
    """loss = vtrace: truncation c_bar of the trace-cutting coefficients."""
    vtrace_adv_norm: bool = True
    """loss = vtrace: whiten the per-token advantages over the batch (a baseline until the critic has one)."""
    advantage: str = "sequence"
    """Advantages: sequence (GRPO), token (reward-to-go; needs rollout.token_rewards) or gae (the critic role's values)."""
    max_tokens_per_microbatch: int = 2048
    """Token budget of one packed micro-batch (gradients accumulate over micro-batches; a longer sequence gets its own)."""
    shared_prompt: bool = True
    """Run a group's shared prompt once per micro-batch, every sample attending to it (same log-probs and gradients)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's forward in backward instead of keeping its activations (long sequences)."""
    logprob_chunk_tokens: int = 512
    """Response positions per chunk of the LM head + log-softmax (bounds the [chunk, vocab] fp32 temporary)."""
    attention: str = "auto"
    """Attention over packed rows: flex (FlexAttention block mask, skips masked tiles; backward needs CUDA),
    segments (sdpa per prompt and per sample segment, only what the mask sees), sdpa (dense [N, N] mask),
    auto (flex on CUDA, segments on CPU)."""

    def validate(self, p: str) -> None:
        _check(self.lr > 0, f"{p}.lr", self.lr, "must be > 0")
        _check(self.agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"), f"{p}.agg",
               self.agg, "must be token-mean, seq-mean-token-mean or seq-mean-token-sum-norm")
        _check(self.dual_clip == 0 or self.dual_clip > 1, f"{p}.dual_clip", self.dual_clip, "must be 0 (off) or > 1")
        _check(self.gspo_clip_low > 0 and self.gspo_clip_high > 0, f"{p}.gspo_clip_low/high",
               (self.gspo_clip_low, self.gspo_clip_high), "must be > 0")
        _check(self.minibatches >= 1, f"{p}.minibatches", self.minibatches, "must be >= 1")
        _check(self.kl_coef >= 0, f"{p}.kl_coef", self.kl_coef, "must be >= 0")
        _check(self.kl_estimator in ("k1", "k3"), f"{p}.kl_estimator", self.kl_estimator, "must be k1 or k3")
        _check(self.entropy_coef >= 0, f"{p}.entropy_coef", self.entropy_coef, "must be >= 0")
        _check(self.z_loss_coef >= 0, f"{p}.z_loss_coef", self.z_loss_coef, "must be >= 0")
        _check(self.aux_loss_coef >= 0, f"{p}.aux_loss_coef", self.aux_loss_coef, "must be >= 0")
        _check(self.ep >= 1, f"{p}.ep", self.ep, "must be >= 1")
        _check(self.experts_impl in ("auto", "grouped_mm", "loop"), f"{p}.experts_impl", self.experts_impl,
               "must be auto, grouped_mm or loop")
        _check(self.router_freeze_steps >= 0, f"{p}.router_freeze_steps", self.router_freeze_steps, "must be >= 0")
        _check(0 <= self.router_ema < 1, f"{p}.router_ema", self.router_ema, "must be in [0, 1)")
        _check(self.groups_per_step >= 1, f"{p}.groups_per_step", self.groups_per_step, "must be >= 1")
        _check(self.max_staleness >= 0, f"{p}.max_staleness", self.max_staleness, "must be >= 0")
        self._validate_staleness(p)
        losses = ("grpo_tis", "grpo_no_correction", "grpo_mis", "grpo_seq_tis", "grpo_seq_mis",
                  "decoupled_ppo", "ppo_coupled", "gspo", "vtrace")
        _check(self.loss in losses, f"{p}.loss", self.loss, f"must be one of {losses}")
        _check(0 < self.clip_low < 1, f"{p}.clip_low", self.clip_low, "must be in (0, 1)")
        _check(self.clip_high > 0, f"{p}.clip_high", self.clip_high, "must be > 0")
        _check(self.tis_cap >= 1, f"{p}.tis_cap", self.tis_cap, "must be >= 1")
        _check(self.publish_interval >= 1, f"{p}.publish_interval", self.publish_interval, "must be >= 1")
        _check(self.value_coef >= 0, f"{p}.value_coef", self.value_coef, "must be >= 0")
        _check(0 < self.gamma <= 1, f"{p}.gamma", self.gamma, "must be in (0, 1]")
        _check(self.vtrace_rho_bar > 0, f"{p}.vtrace_rho_bar", self.vtrace_rho_bar, "must be > 0")
        _check(self.vtrace_c_bar > 0, f"{p}.vtrace_c_bar", self.vtrace_c_bar, "must be > 0")
        _check(self.advantage in ("sequence", "token", "gae"), f"{p}.advantage", self.advantage,
               "must be sequence, token or gae")
        _check(self.max_tokens_per_microbatch >= 1, f"{p}.max_tokens_per_microbatch", self.max_tokens_per_microbatch,
               "must be >= 1")
        _check(self.logprob_chunk_tokens >= 1, f"{p}.logprob_chunk_tokens", self.logprob_chunk_tokens, "must be >= 1")
        _check(self.attention in ("auto", "sdpa", "flex", "segments"), f"{p}.attention", self.attention,
               "must be auto, sdpa, flex or segments")
        _check(self.advantage == "sequence" or self.loss not in ("gspo", "vtrace"), f"{p}.advantage",
               self.advantage, f"token advantages need a token-level loss, not learner.loss = {self.loss!r} "
               "(gspo weighs whole sequences; vtrace computes its own)")

    def _validate_staleness(self, p: str) -> None:
        _check(self.staleness in ("fixed", "adaptive"), f"{p}.staleness", self.staleness, "must be fixed or adaptive")
        if self.staleness == "fixed":
            return
        _check(0 <= self.staleness_min <= self.max_staleness, f"{p}.staleness_min", self.staleness_min,
               f"must be in [0, learner.max_staleness = {self.max_staleness}]")
        _check(0 < self.staleness_ess_min < 1, f"{p}.staleness_ess_min", self.staleness_ess_min, "must be in (0, 1)")
        _check(0 < self.staleness_clip_frac_max < 1, f"{p}.staleness_clip_frac_max", self.staleness_clip_frac_max,
               "must be in (0, 1)")
        _check(self.staleness_kl_max > 0, f"{p}.staleness_kl_max", self.staleness_kl_max, "must be > 0")
        _check(0 < self.staleness_idle_frac_max < 1, f"{p}.staleness_idle_frac_max", self.staleness_idle_frac_max,
               "must be in (0, 1)")
        _check(0 <= self.staleness_ema < 1, f"{p}.staleness_ema", self.staleness_ema, "must be in [0, 1)")
        _check(self.staleness_interval >= 1, f"{p}.staleness_interval", self.staleness_interval, "must be >= 1")


@dataclass
class CheckpointConfig:
    dir: str = ""
    """Checkpoint directory; empty = RUN_DIR/checkpoints."""
    save_interval: int = 0
    """Save a sharded DCP checkpoint every this many learner steps; 0 = only on a clean stop."""
    keep_last: int = 2
    """Keep the newest this many step checkpoints; older ones are deleted."""
    save_on_stop: bool = True
    """Also save when the run stops cleanly (steps done or stop requested), with an HF folder."""
    hf_interval: int = 0
    """Also write a Hugging Face folder (CKPT_DIR/hf/step_N) every this many steps; 0 = only on stop."""

    def validate(self, p: str) -> None:
        _check(self.save_interval >= 0, f"{p}.save_interval", self.save_interval, "must be >= 0")
        _check(self.hf_interval >= 0, f"{p}.hf_interval", self.hf_interval, "must be >= 0")
        _check(self.keep_last >= 1, f"{p}.keep_last", self.keep_last, "must be >= 1")


@dataclass
class TransportConfig:
    hwm: int = 8
    """ZeroMQ high-water mark (messages) on each trajectory socket: bounds queued memory."""
    max_message_bytes: int = 256 * 1024 * 1024
    """Largest accepted trajectory message; larger frames are rejected unread."""
    retain_bytes: int = 256 * 1024 * 1024
    """Bytes a worker keeps of sent, not yet durably acknowledged messages (resent after a learner restart); at the bound sends wait."""

    def validate(self, p: str) -> None:
        _check(self.hwm >= 1, f"{p}.hwm", self.hwm, "must be >= 1")
        _check(self.retain_bytes >= 1, f"{p}.retain_bytes", self.retain_bytes, "must be >= 1")


@dataclass
class PlacementConfig:
    """Where each role runs (the Hybrid model): roles are declared once and placed on devices.

    A device string is ``cpu``, ``cuda`` (every GPU of the host), ``cuda:N``, a range
    ``cuda:0-3``, optionally node-qualified for multi-node runs: ``node1:cuda:0``,
    ``node0-1:cuda:0-3``. A single string is read as a one-element list. Checked against
    the machine (GPU count, ``--learners``/``--rollers``) by :mod:`streamrl.placement`.
    """

    learner: list[str] | None = None
    """Learner (actor) ranks' devices: one per rank, or one ('cpu'/'cuda') for all; null = learner.device."""
    rollout: list[str] | None = None
    """Rollout workers' devices, dealt round-robin to a host's workers; null = rollout.device."""
    reference: list[str] | None = None
    """Reference-model devices: its own server process scoring each batch; null = in the learner ranks."""
    reward: list[str] | None = None
    """Reward-model devices (hosted by rollout workers); null = the task's verifiable reward only."""
    critic: list[str] | None = None
    """Critic devices: the critic role's own process (learner.advantage = gae); null = no separate critic."""
    colocate: list[list[str]] = field(default_factory=list)
    """Groups of roles allowed to share a GPU, e.g. [[learner, reference]]; other roles may not."""
    learner_threads: int = 0
    """Intra-op threads per learner rank; 0 = the cores the host's rollout workers leave / its learner ranks (see placement.assign_threads)."""
    rollout_threads: int = 0
    """Intra-op threads per rollout worker; 0 = the host's cores / all its processes (at least 1)."""
    lend_idle_cores: bool = True
    """CPU learner and workers of one host lend idle cores: the learner a waiting worker's threads, an hf_fast worker the waiting learner's."""

    def validate(self, p: str) -> None:
        validate_placement_config(self, p)
        for name in ("learner_threads", "rollout_threads"):
            _check(getattr(self, name) >= 0, f"{p}.{name}", getattr(self, name), "must be >= 0 (0 = auto)")


@dataclass
class ReferenceConfig:
    """The KL reference policy: colocated in the learner ranks (``placement.reference`` null) or
    served by its own process on ``placement.reference`` (see :mod:`streamrl.roles`)."""

    path: str = ""
    """HF folder of the reference model (same tokenizer as the policy); empty = the initial policy."""
    max_tokens: int = 8192
    """Reference server: padded tokens (rows x longest sequence) per forward."""

    def validate(self, p: str) -> None:
        _check(self.max_tokens >= 1, f"{p}.max_tokens", self.max_tokens, "must be >= 1")


@dataclass
class CriticConfig:
    """The critic role: a value model of its own, trained asynchronously by its own process on
    ``placement.critic`` (see :mod:`streamrl.roles.critic`); ``learner.advantage = gae`` reads its values."""

    path: str = ""
    """HF folder of the critic's trunk (may be smaller than the policy; same tokenizer); empty = the initial policy."""
    lr: float = 1e-4
    """Critic AdamW learning rate."""
    gamma: float = 1.0
    """Per-token discount of the critic's targets and the learner's GAE advantages."""
    lam: float = 0.95
    """GAE lambda of the critic's lambda-return targets and the learner's GAE advantages."""
    epochs: int = 1
    """Critic optimizer steps on each batch it scores (after replying)."""
    checkpoint_every: int = 10
    """Critic steps between checkpoints (model + optimizer + step; a restarted critic resumes from it)."""

    def validate(self, p: str) -> None:
        _check(self.lr > 0, f"{p}.lr", self.lr, "must be > 0")
        _check(0 < self.gamma <= 1, f"{p}.gamma", self.gamma, "must be in (0, 1]")
        _check(0 <= self.lam <= 1, f"{p}.lam", self.lam, "must be in [0, 1]")
        _check(self.epochs >= 1, f"{p}.epochs", self.epochs, "must be >= 1")
        _check(self.checkpoint_every >= 1, f"{p}.checkpoint_every", self.checkpoint_every, "must be >= 1")


@dataclass
class WeightsConfig:
    data_plane: str = "auto"
    """Weights data plane: auto (ipc when the learner and every worker are on CUDA on one host, else shm on the
    learner's host and zmq for others), shm, zmq, ipc (CUDA IPC of learner GPU buffers: ipc_buffers versions'
    bytes of extra GPU memory), nccl, gloo."""
    bucket_mb: int = 64
    """Bucket size in MiB: unit of gather, transfer, checksum and re-fetch (peak extra memory)."""
    keep_versions: int = 3
    """Published versions kept in Redis and in the store before garbage collection."""
    checksum: str = "sum64"
    """Bucket checksum: sum64 (memory speed) or crc32 (stronger, ~6x slower)."""
    target: str = "hf"
    """Engine naming/layout: hf (transformers names) or vllm (per-expert MoE weights)."""
    zmq_streams: int = 2
    """Parallel ZeroMQ streams (DEALER sockets) per subscriber."""
    collective_world: int = 0
    """nccl/gloo planes: publisher + subscribers in the fixed broadcast group."""
    verify_threads: int = 1
    """Torch intra-op threads a subscriber uses for bucket checksums (restored after each fetch)."""
    ipc_buffers: int = 1
    """ipc: learner GPU buffers a version is written into (extra GPU memory: this many versions). With 1 the next
    version waits while a worker still copies the last one out (its read lease: the copy and the GPU work queued
    before it, tens of ms); 2 lets a learner that publishes faster than that write into the other buffer."""

    def validate(self, p: str) -> None:
        _check(self.data_plane in ("auto", "shm", "zmq", "ipc", "nccl", "gloo"), f"{p}.data_plane", self.data_plane,
               "must be auto, shm, zmq, ipc, nccl or gloo")
        _check(self.bucket_mb >= 1, f"{p}.bucket_mb", self.bucket_mb, "must be >= 1")
        _check(self.keep_versions >= 1, f"{p}.keep_versions", self.keep_versions, "must be >= 1")
        _check(self.checksum in ("sum64", "crc32"), f"{p}.checksum", self.checksum, "must be sum64 or crc32")
        _check(self.target in ("hf", "vllm"), f"{p}.target", self.target, "must be hf or vllm")
        _check(self.zmq_streams >= 1, f"{p}.zmq_streams", self.zmq_streams, "must be >= 1")
        _check(self.data_plane not in ("nccl", "gloo") or self.collective_world >= 2, f"{p}.collective_world",
               self.collective_world, "must be >= 2 for the nccl/gloo planes")
        _check(self.verify_threads >= 1, f"{p}.verify_threads", self.verify_threads, "must be >= 1")
        _check(self.ipc_buffers in (1, 2), f"{p}.ipc_buffers", self.ipc_buffers, "must be 1 or 2")


ENV_BUILTINS = ("none", "calculator", "python")


@dataclass
class EnvConfig:
    """Multi-turn episodes with tools (streamrl.envs): the rollout worker plays one episode per
    sample, turn by turn, instead of one prompt -> one response."""

    name: str = "none"
    """none (single-turn), calculator, python, or a plug-in 'package.module:function' (cfg, tokenizer, runner) -> Environment."""
    max_turns: int = 4
    """Model turns per episode (a tool call and the answer are two turns)."""
    max_total_tokens: int = 256
    """Model + tool tokens after the prompt, per episode (each model turn is capped by rollout.max_new_tokens)."""
    max_tool_calls: int = 2
    """Tool calls run per model turn; further calls in the same turn get an error message instead."""
    tool_timeout_s: float = 5.0
    """Wall-clock limit per tool call; a call past it answers with an error and is counted (env/tool_timeouts)."""
    call_reward: float = 0.0
    """Reward for an episode's first turn whose tool calls all succeed (shaping while the answer is not yet learned; 0 = off)."""
    lanes: int = 1
    """Parts of a batch that take turns at the engine so one part's tools run while another generates (1 = no overlap)."""

    def validate(self, p: str) -> None:
        _check(self.name in ENV_BUILTINS or (":" in self.name and all(self.name.partition(":")[::2])),
               f"{p}.name", self.name, f"must be one of {list(ENV_BUILTINS)} or 'package.module:function'")
        _check(self.max_turns >= 1, f"{p}.max_turns", self.max_turns, "must be >= 1")
        _check(self.max_total_tokens >= 2, f"{p}.max_total_tokens", self.max_total_tokens, "must be >= 2")
        _check(self.max_tool_calls >= 1, f"{p}.max_tool_calls", self.max_tool_calls, "must be >= 1")
        _check(self.tool_timeout_s > 0, f"{p}.tool_timeout_s", self.tool_timeout_s, "must be > 0")
        _check(self.call_reward >= 0, f"{p}.call_reward", self.call_reward, "must be >= 0")
        _check(self.lanes >= 1, f"{p}.lanes", self.lanes, "must be >= 1")


@dataclass
class DeadlinesConfig:
    """How long each wait that can block a run may last; past it the process stops waiting with an
    error naming itself, what it waited for and for how long (docs/faults.md lists every fault)."""

    redis_outage_s: float = 60.0
    """A Redis call retries a lost connection this long (a Redis restart costs a pause), then raises."""
    heartbeat_s: float = 10.0
    """A rollout worker silent this long counts as gone: the learner refunds the prompt groups it held."""
    stuck_s: float = 60.0
    """A supervised worker whose heartbeat stopped this long (alive but frozen) is reported and restarted."""
    batch_s: float = 1800.0
    """A worker that stays generating (or loading weights) one batch this long is reported stuck and restarted."""
    admission_s: float = 1800.0
    """A worker refused admission (no prompt-group reservation) this long fails naming the learner's version."""
    deliver_s: float = 900.0
    """A worker blocked sending one batch (credits or retention full: the learner stopped reading) this long fails."""
    endpoint_s: float = 300.0
    """A process waits this long for an endpoint (the learner's trajectory socket, a role server) in Redis."""
    reward_s: float = 30.0
    """Each call of a reward plug-in ('module:function'); past it the sample scores 0 and counts in rollout/reward_timeouts."""
    collective_s: float = 1800.0
    """The learner's process-group timeout: a collective waiting this long on a missing rank fails the job."""
    data_s: float = 600.0
    """The learner waits this long for a complete batch (no worker delivers) before it stops the run as starved."""

    def validate(self, p: str) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _check(value > 0, f"{p}.{f.name}", value, "must be > 0")
        _check(self.stuck_s >= self.heartbeat_s, f"{p}.stuck_s", self.stuck_s,
               f"must be >= deadlines.heartbeat_s = {self.heartbeat_s} (a worker is gone before it is restarted)")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    deadlines: DeadlinesConfig = field(default_factory=DeadlinesConfig)

    def validate(self) -> "Config":
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate(f.name)
        _check(self.learner.advantage != "gae" or bool(self.placement.critic), "learner.advantage",
               self.learner.advantage, "gae needs the critic role: set placement.critic (e.g. [cpu])")
        stuck = _admission_deadlock(self.rollout.prompts_per_batch, self.learner.groups_per_step,
                                    self.learner.max_staleness)
        _check(stuck is None, "rollout.prompts_per_batch", self.rollout.prompts_per_batch,
               f"workers reserve whole batches, and with learner.groups_per_step = {self.learner.groups_per_step} "
               f"and learner.max_staleness = {self.learner.max_staleness} the learner would wait forever at "
               f"version {stuck}: use a batch that divides groups_per_step or a larger max_staleness")
        if self.learner.staleness == "adaptive":  # the controller may go down to staleness_min
            stuck = _admission_deadlock(self.rollout.prompts_per_batch, self.learner.groups_per_step,
                                        self.learner.staleness_min)
            _check(stuck is None, "learner.staleness_min", self.learner.staleness_min,
                   f"with rollout.prompts_per_batch = {self.rollout.prompts_per_batch} and learner.groups_per_step = "
                   f"{self.learner.groups_per_step} admission at this bound would stall at version {stuck}: raise it")
        obstacle = ipc_obstacle(self) if self.weights.data_plane == "ipc" else None
        if obstacle is not None:
            name, value, why = obstacle
            _check(False, name, value, f"{why} (weights.data_plane = ipc)")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _admission_deadlock(batch: int, groups_per_step: int, max_staleness: int) -> int | None:
    """First version at which admission control stalls the run, or None if none does.

    Workers reserve ``batch`` groups at a time while ``reserved + batch <= (version + max_staleness
    + 1) * groups_per_step`` (:meth:`Coordinator.try_reserve`); the learner at ``version`` needs
    ``(version + 1) * groups_per_step`` groups reserved in all. The reservable total is the largest
    multiple of ``batch`` under the limit, so the condition is periodic in the version with period
    ``batch / gcd(batch, groups_per_step)``: checking one period decides every version.
    """
    for version in range(batch // math.gcd(batch, groups_per_step) + 1):
        limit = (version + max_staleness + 1) * groups_per_step
        if limit // batch * batch < (version + 1) * groups_per_step:
            return version
    return None


def admission_wait_note(batch: int, groups_per_step: int, max_staleness: int, workers: int) -> str | None:
    """Why rollout workers would wait for admission between batches, or None.

    In a balanced pipeline a worker finishes batch ``k`` as the learner finishes training what came
    before it; to start its next batch at once, admission must cover that batch, the one just
    finished and the other workers' in flight: ``(workers + 1) * batch <= (max_staleness + 1) *
    groups_per_step``. Below that, every worker idles part of each batch and a rollout-bound run
    loses throughput (configs/gpu-long.yaml at staleness 4, batch 32, 8 groups a step, leaves
    the learner idle a fifth of the time). ``max_staleness = 0`` is the synchronous mode, where waiting is the point.
    """
    if max_staleness == 0:
        return None
    need = math.ceil((workers + 1) * batch / groups_per_step) - 1
    if max_staleness >= need:
        return None
    return (f"learner.max_staleness = {max_staleness}: with rollout.prompts_per_batch = {batch} "
            f"({batch / groups_per_step:g} steps' groups at learner.groups_per_step = {groups_per_step}) and "
            f"{workers} rollout worker(s), a worker may start its next batch only once the learner has trained "
            f"part of its last one, so workers wait between batches; max_staleness >= {need} keeps them decoding")


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Coerce a YAML/CLI value to the annotated field type, or raise naming the field."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        tp = args[0]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config field '{name}' = {value!r}: expected true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"config field '{name}' = {value!r}: expected an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads '1e-3' (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config field '{name}' = {value!r}: expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"config field '{name}' = {value!r}: expected a string")
        return str(value)
    return value


def _nearest(key: str, known: set[str], prefix: str) -> str:
    """``"; did you mean 'x.y'?"`` for the closest known name, or ``""`` if none is close.

    Closest: a difflib match in the same section, else a name of the same section that the key
    starts with (``lr_rate`` -> ``lr``), else the same name in another section
    (``learner.temperature`` -> ``rollout.temperature``).

    Examples:
        >>> _nearest("max_new_token", {"max_new_tokens", "group_size"}, "rollout")
        "; did you mean 'rollout.max_new_tokens'?"
        >>> _nearest("temperature", {"lr"}, "learner")
        "; did you mean 'rollout.temperature'?"
    """
    match = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    if match:
        return f"; did you mean '{prefix + '.' if prefix else ''}{match[0]}'?"
    starts = sorted((k for k in known if key.startswith(k)), key=len, reverse=True)
    if starts:
        return f"; did you mean '{prefix + '.' if prefix else ''}{starts[0]}'?"
    if prefix and "." not in prefix:
        sections = typing.get_type_hints(Config)
        elsewhere = [f"{name}.{key}" for name, tp in sections.items() if name != prefix and dataclasses.is_dataclass(tp)
                     and key in {f.name for f in dataclasses.fields(tp)}]
        if elsewhere:
            return f"; did you mean '{elsewhere[0]}'?"
    return ""


# Fields that moved: an old config gets the new name instead of "unknown field".
RENAMED = {"rollout.prompt_file": "data.path"}


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"config section '{prefix or 'root'}' = {data!r}: expected a mapping")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            where = f"{prefix}.{key}" if prefix else key
            if where in RENAMED:
                raise ConfigError(f"config field '{where}' was replaced by '{RENAMED[where]}'; use that instead")
            raise ConfigError(f"config field '{where}' is unknown{_nearest(str(key), known, prefix)}; "
                              f"known fields: {sorted(known)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        name = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, data[f.name] or {}, name)
        else:
            kwargs[f.name] = _coerce(data[f.name], tp, name)
    return cls(**kwargs)


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split ``a.b=value`` into (["a", "b"], parsed value); values are parsed as YAML scalars."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.field=value")
    key, raw = item.split("=", 1)
    path = [k for k in key.strip().split(".") if k]
    if not path:
        raise ConfigError(f"override {item!r} has an empty key")
    return path, yaml.safe_load(raw) if raw.strip() else ""


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or the defaults), apply ``key=value`` overrides, validate."""
    data: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        data = yaml.safe_load(p.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping at top level")
    for item in overrides or []:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: '{k}' is not a section")
        node[keys[-1]] = value
    return _build(Config, data, "").validate()


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a validated Config from :meth:`Config.to_dict` output (e.g. read back from Redis)."""
    return _build(Config, data, "").validate()
