"""Padding-free micro-batches: trajectories packed into token-budget rows.

Why: a padded ``[B, T]`` batch spends compute on padding and, worse, makes every later step
(LM head, log-softmax) run on every position. A micro-batch here is ONE row of concatenated
sequences, at most ``learner.max_tokens_per_microbatch`` tokens, with position ids that
restart for each sequence. Attention never crosses sequences:

* plain packing: no attention mask; transformers (5.x) sees the restarting position ids and
  builds the block-diagonal causal mask itself (``masking_utils.find_packed_sequence_indices``,
  for sdpa and eager);
* shared prompts (``learner.shared_prompt``): the G samples of a group share their prompt, so
  the row holds the prompt once and then each sample's segment; an explicit ``[1, 1, N, N]``
  boolean mask lets every segment see the prompt and itself only (transformers passes a 4-D
  mask through unchanged);
* ``learner.attention = flex``: no dense mask at all; the trainer builds a FlexAttention
  ``BlockMask`` from the per-token ``segment_ids`` / ``unit_ids`` of the micro-batch
  (:mod:`streamrl.learner.attention`), whose masked tiles are skipped, for both cases above.

Layout of one *unit* (a sequence, or a group sharing a prompt of ``p`` tokens)::

    prompt[:p-1]  |  prompt[p-1] resp_0[0 .. r0-1]  |  prompt[p-1] resp_1[...]  | ...
    positions 0..p-2 |  p-1 .. p-1+r0             |  p-1 .. p-1+r1            |

Each sample repeats the last prompt token: the position that predicts its first response
token then belongs to the sample alone, so routing replay (R3) ids, which the rollout records
per sample, stay exact. Without sharing a unit is simply prompt + response.

A sample's last response token predicts nothing, so a dense model's rows leave it out
(``feed_last=False``: ~3 % fewer tokens at 24-token responses; every log-prob, and so the
loss and its gradient, is unchanged). An MoE keeps it: the router losses and metrics count
every token, as the padded step does.

Log-probs are computed only at the selected positions (those predicting response tokens) and
laid out on a response grid ``[b, R]`` (row = trajectory, column = response token), which is
what the loss functions take.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import torch
from tensordict import TensorDict

from streamrl.learner.attention import dense_packed_mask
from streamrl.learner.h2d import h2d_grouped


@dataclass
class MicroBatch:
    """One packed row and where its response tokens go.

    Shapes (N tokens in the row, n response tokens, b trajectories, L MoE layers, k experts):
        input_ids, position_ids: [1, N] int64
        attention_mask: [1, 1, N, N] bool (shared prompts on the sdpa path) or None (transformers
            builds it from the position ids, or the trainer builds a BlockMask from the ids below)
        segment_ids: [N] int64 the sample (grid row) of each token, -1 on a unit's shared prompt
        unit_ids: [N] int64 the unit (sequence, or group sharing a prompt) of each token
        select: [n] row positions whose logits predict a response token
        targets: [n] the response tokens predicted there
        grid_row, grid_col: [n] (trajectory among ``rows``, response index) of each selected token
        token_weight: [N] float32 how many padded-layout tokens each row token stands for
            (a shared prompt token counts once per sample); 0 in a dummy micro-batch
        replay: [N, L, k] int64 rollout expert ids (-1 = route normally), or None
        rows: trajectory indices (into the batch) in grid-row order
        dummy: True for a zero-weight micro-batch that only keeps ranks in lockstep
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    select: torch.Tensor
    targets: torch.Tensor
    grid_row: torch.Tensor
    grid_col: torch.Tensor
    token_weight: torch.Tensor
    replay: torch.Tensor | None
    rows: list[int]
    segment_ids: torch.Tensor
    unit_ids: torch.Tensor
    dummy: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def row_slice(self) -> slice | list[int]:
        """``rows`` as a slice when consecutive (the packer keeps trajectory order), so indexing
        the response grid with it is a view, not a gather from a host-built index."""
        lo, hi = self.rows[0], self.rows[-1] + 1
        return slice(lo, hi) if self.rows == list(range(lo, hi)) else self.rows

    def to(self, device: torch.device) -> "MicroBatch":
        """A copy with every tensor on ``device``; on CUDA through pinned memory without
        blocking the host (the step moves all its micro-batches up front)."""
        if device.type == "cpu":
            return self
        present = {f: t for f in _TENSOR_FIELDS if (t := getattr(self, f)) is not None}
        # a micro-batch moved before (a second pass over the same batch) is already there
        moved = {f: t.to(device, non_blocking=True) for f, t in present.items() if not t.is_cpu}
        moved.update(h2d_grouped({f: t for f, t in present.items() if t.is_cpu}, device))
        return replace(self, **moved)

    def to_grid(self, values: torch.Tensor, width: int) -> torch.Tensor:
        """Scatter per-selected-token ``values`` [n] onto the ``[b, width]`` response grid (0 elsewhere).

        Differentiable (``index_put`` out of place), so log-probs keep their gradient.
        """
        grid = values.new_zeros(len(self.rows), width)
        return grid.index_put((self.grid_row.to(values.device), self.grid_col.to(values.device)), values)


_TENSOR_FIELDS = ("input_ids", "position_ids", "attention_mask", "select", "targets", "grid_row", "grid_col",
                  "token_weight", "replay", "segment_ids", "unit_ids")


@dataclass
class ResponseGrid:
    """Per-response-token training inputs of a whole batch on the ``[B, R]`` response grid.

    loss_mask: [B, R] float32 (1 = token in the loss); behav: [B, R] behaviour log-probs;
    positions: [B, R] bool response tokens; token_rewards: [B, R] or None; the critic's
    per-token MDP (see :func:`streamrl.learner.critic.response_mdp`): tok_reward, tok_done, resp.
    """

    loss_mask: torch.Tensor
    behav: torch.Tensor
    positions: torch.Tensor
    token_rewards: torch.Tensor | None = None
    tok_reward: torch.Tensor | None = None
    tok_done: torch.Tensor | None = None
    resp: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return int(self.loss_mask.shape[1])


class TrajectoryView:
    """Per-trajectory token lists of a packed batch (offsets computed once)."""

    def __init__(self, batch: TensorDict):
        self.p_lens = batch["prompt_lens"].tolist()
        self.r_lens = batch["response_lens"].tolist()
        self.prompt_tokens = batch["prompt_tokens"]
        self.response_tokens = batch["response_tokens"]
        self.tokens = torch.cat([self.prompt_tokens, self.response_tokens])  # a row's tokens are slices of it
        self.group_id = batch["group_id"].tolist()
        self.routed = batch.get("routed_experts", None) if "routed_experts" in batch.keys() else None
        self.p_off = _offsets(self.p_lens)
        self.r_off = _offsets(self.r_lens)

    def prompt(self, i: int) -> torch.Tensor:
        return self.prompt_tokens[self.p_off[i] : self.p_off[i] + self.p_lens[i]]


def _offsets(lens: list[int]) -> list[int]:
    out, acc = [], 0
    for n in lens:
        out.append(acc)
        acc += n
    return out


def response_grid(batch: TensorDict, key: str, fill: float = 0.0, dtype=torch.float32) -> torch.Tensor:
    """A per-response-token field of the batch laid out as ``[B, R]`` (R = longest response).

    Column j of row i is response token j of trajectory i; ``fill`` past each response.
    """
    positions = response_positions(batch)
    out = torch.full(positions.shape, fill, dtype=dtype)
    # row-major, trajectory after trajectory as the batch holds them (masked_scatter_: ~4x faster
    # than a boolean-index assignment, and than a copy per row at 512 x 192 tokens)
    out.masked_scatter_(positions, batch[key].to(dtype))
    return out


def response_positions(batch: TensorDict) -> torch.Tensor:
    """[B, R] bool: True on each trajectory's response tokens of the response grid."""
    r_lens = batch["response_lens"]
    width = max(int(r_lens.max()) if len(r_lens) else 0, 1)
    return torch.arange(width)[None, :] < r_lens[:, None]


def _units(view: TrajectoryView, rows: list[int], shared: bool, budget: int) -> list[list[int]]:
    """Rows grouped into units: runs of consecutive rows with one prompt (when ``shared``),
    split so that prefix + segments fit ``budget`` where a single sample allows it."""
    units: list[list[int]] = []
    for i in rows:
        u = units[-1] if units else None
        if (shared and u and view.group_id[u[0]] == view.group_id[i]
                and torch.equal(view.prompt(u[0]), view.prompt(i))
                and _unit_tokens(view, u + [i]) <= budget):
            u.append(i)
        else:
            units.append([i])
    return units


def _unit_tokens(view: TrajectoryView, unit: list[int]) -> int:
    return view.p_lens[unit[0]] - 1 + sum(view.r_lens[i] + 1 for i in unit)


def plan_microbatches(batch: TensorDict, rows: list[int], budget: int, shared: bool,
                      view: TrajectoryView | None = None) -> list[list[list[int]]]:
    """Greedy, order-preserving packing of ``rows`` into micro-batches of units.

    Returns a list of micro-batches, each a list of units (lists of trajectory indices). A unit
    longer than ``budget`` gets a micro-batch of its own (a sequence is never split).
    """
    view = view or TrajectoryView(batch)
    plan: list[list[list[int]]] = []
    used = budget + 1
    for unit in _units(view, rows, shared, budget):
        n = _unit_tokens(view, unit)
        if plan and used + n <= budget:
            plan[-1].append(unit)
            used += n
        else:
            plan.append([unit])
            used = n
    return plan


@dataclass
class _RowRuns:
    """A micro-batch row as runs of tokens: one run per shared prompt (``seg`` -1) and per
    sample, each with its unit, token weight, length in the row and first position id; the
    row's tokens as slices (``piece_src``, ``piece_len``) of the concatenated token arrays;
    each sample's response tokens (``resp_src``, ``r_lens``) and start in the row."""

    seg: list[int] = field(default_factory=list)
    unit_of: list[int] = field(default_factory=list)
    weight: list[float] = field(default_factory=list)
    run_len: list[int] = field(default_factory=list)
    run_pos: list[int] = field(default_factory=list)
    piece_src: list[int] = field(default_factory=list)
    piece_len: list[int] = field(default_factory=list)
    resp_src: list[int] = field(default_factory=list)
    r_lens: list[int] = field(default_factory=list)
    sample_start: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    n: int = 0

    def add_run(self, seg: int, unit: int, weight: float, length: int, pos: int) -> None:
        self.seg.append(seg)
        self.unit_of.append(unit)
        self.weight.append(weight)
        self.run_len.append(length)
        self.run_pos.append(pos)


def _row_runs(view: TrajectoryView, units: list[list[int]], feed_last: bool) -> _RowRuns:
    """The runs of the row that packs ``units`` (Python ints only; no tensor per sequence)."""
    runs = _RowRuns()
    n_prompt_tokens = int(view.prompt_tokens.shape[0])
    for u_idx, unit in enumerate(units):
        p = view.p_lens[unit[0]]
        runs.add_run(-1, u_idx, float(len(unit)), p - 1, 0)
        runs.piece_src.append(view.p_off[unit[0]])
        runs.piece_len.append(p - 1)
        runs.n += p - 1
        for i in unit:
            r = view.r_lens[i]
            fed = r + 1 if feed_last or r == 0 else r  # the segment's tokens in the row
            runs.add_run(len(runs.rows), u_idx, 1.0, fed, p - 1)
            # the sample's own last prompt token, then its response but (unless fed) the last
            runs.piece_src += [view.p_off[i] + p - 1, n_prompt_tokens + view.r_off[i]]
            runs.piece_len += [1, fed - 1]
            runs.resp_src.append(view.r_off[i])
            runs.r_lens.append(r)
            runs.sample_start.append(runs.n)
            runs.rows.append(i)
            runs.n += fed
    return runs


def _replay_ids(view: TrajectoryView, runs: _RowRuns, num_layers: int) -> torch.Tensor | None:
    """[N, L, k] routed-expert ids of the row's positions (-1 where none), or None without R3."""
    if view.routed is None or not num_layers:
        return None
    k = view.routed.shape[-1]
    if view.routed.shape[1] != num_layers:
        raise ValueError(f"routed_experts has {view.routed.shape[1]} layers, the model has {num_layers} MoE layers")
    replay = torch.full((runs.n, num_layers, k), -1, dtype=torch.int64)
    for start, src, r in zip(runs.sample_start, runs.resp_src, runs.r_lens):  # memcpy per sample: L x k ids
        replay[start : start + r] = view.routed[src : src + r]
    return replay


def build_microbatch(view: TrajectoryView, units: list[list[int]], shared: bool, num_layers: int = 0,
                     dummy: bool = False, dense_mask: bool = True, feed_last: bool = True) -> MicroBatch:
    """Materialise one planned micro-batch (see the module docstring for the layout).

    ``dense_mask``: build the ``[1, 1, N, N]`` shared-prompt mask (the sdpa path); the flex
    path leaves it out and masks from ``segment_ids`` / ``unit_ids``.
    ``feed_last``: keep each sample's last response token in the row (it predicts nothing).

    Why so few tensor ops per sequence: :func:`_row_runs` only lists each *run* (a unit's
    shared prompt, a sample's segment) as Python ints; the token arrays are then one ``cat`` of
    slices (memcpy) and the index arrays one :func:`_ragged_arange` each, several times faster
    than building each sequence's tensors on its own (2-3 ms per 32k row of 256-token sequences).
    """
    runs = _row_runs(view, units, feed_last)
    input_ids = _slices(view.tokens, runs.piece_src, runs.piece_len).long()[None]
    run_of_token = torch.repeat_interleave(torch.tensor(runs.run_len, dtype=torch.int64))  # [N]
    position_ids = _ragged_arange(runs.run_pos, runs.run_len)[None]
    seg_ids = torch.tensor(runs.seg, dtype=torch.int64)[run_of_token]
    unit_ids = torch.tensor(runs.unit_of, dtype=torch.int64)[run_of_token]
    select = _ragged_arange(runs.sample_start, runs.r_lens)
    targets = _slices(view.response_tokens, runs.resp_src, runs.r_lens).long()
    g_row = torch.repeat_interleave(torch.arange(len(runs.rows)), torch.tensor(runs.r_lens, dtype=torch.int64))
    g_col = _ragged_arange([0] * len(runs.rows), runs.r_lens)
    mask = None
    if dense_mask and shared and any(len(u) > 1 for u in units):
        mask = dense_packed_mask(seg_ids, unit_ids)
    tw = torch.tensor(runs.weight, dtype=torch.float32)[run_of_token] * (0.0 if dummy else 1.0)
    return MicroBatch(input_ids, position_ids, mask, select, targets, g_row, g_col, tw,
                      _replay_ids(view, runs, num_layers), runs.rows, seg_ids, unit_ids, dummy)


def _slices(src: torch.Tensor, starts: list[int], lens: list[int]) -> torch.Tensor:
    """``src[s : s + l]`` for each run, concatenated (``[sum(lens), ...]``)."""
    if not lens:
        return src[:0]
    return torch.cat([src[s : s + n] for s, n in zip(starts, lens)])


def _ragged_arange(starts: list[int], lens: list[int]) -> torch.Tensor:
    """``cat([arange(s, s + l) for s, l in zip(starts, lens)])`` ([sum(lens)] int64) in a few ops."""
    if not lens:
        return torch.zeros(0, dtype=torch.int64)
    ln = torch.tensor(lens, dtype=torch.int64)
    base = torch.tensor(starts, dtype=torch.int64) - (torch.cumsum(ln, 0) - ln)  # start minus the run's offset
    return torch.arange(int(ln.sum())) + torch.repeat_interleave(base, ln)


class LazyMicroBatches(Sequence):
    """A rank's micro-batches, each built on its first access (then ``finish``-ed) and kept.

    Why: the trainer touches micro-batch i+1 right after launching micro-batch i's forward and
    backward, so the host work of i+1 (packing, pinned copies, its block mask) overlaps the
    device's work on i instead of all of it preceding the first kernel. The micro-batches and
    their order are those of building them all up front; a second pass (the proximal pre-pass,
    the critic's) reuses what the first built.
    """

    def __init__(self, builders: list[Callable[[], MicroBatch]],
                 finish: Callable[[MicroBatch], MicroBatch] | None = None):
        self._builders = builders
        self._finish = finish
        self._built: list[MicroBatch | None] = [None] * len(builders)

    def __len__(self) -> int:
        return len(self._builders)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if self._built[i] is None:
            mb = self._builders[i]()
            self._built[i] = mb if self._finish is None else self._finish(mb)
        return self._built[i]

    def prefetch(self, i: int) -> None:
        """Build micro-batch ``i`` now when there is one (the host's work while the device runs)."""
        if 0 <= i < len(self):
            self[i]


def rank_microbatches(batch: TensorDict, rank_rows: list[list[int]], rank: int, budget: int, shared: bool,
                      num_layers: int = 0, dense_mask: bool = True, feed_last: bool = True,
                      finish: Callable[[MicroBatch], MicroBatch] | None = None
                      ) -> tuple[LazyMicroBatches, list[float]]:
    """This rank's micro-batches, padded with zero-weight dummies to the largest count of any rank.

    Every rank must run the same number of forward/backward passes (FSDP all-gathers and
    reduce-scatters, expert all-to-alls are collectives). All ranks hold the whole batch, so
    each computes every rank's plan locally: no communication is needed to agree.

    Args:
        rank_rows: trajectory indices of every rank (``rank_rows[r]``; may be empty).
        finish: applied to each micro-batch once it is built (the trainer's device copy).
    Returns:
        (this rank's micro-batches, built when first indexed (:class:`LazyMicroBatches`), the
        global token weight of each micro-batch index: the sum over ranks of their padded-layout
        token counts, prompt + response, at that index).
    """
    view = TrajectoryView(batch)
    plans = [plan_microbatches(batch, rows, budget, shared, view) for rows in rank_rows]
    count = max(max(len(p) for p in plans), 1)
    tokens = [p + r for p, r in zip(view.p_lens, view.r_lens)]
    weights = [sum(tokens[i] for p in plans if j < len(p) for u in p[j] for i in u) for j in range(count)]
    build = partial(build_microbatch, view, shared=shared, num_layers=num_layers, dense_mask=dense_mask,
                    feed_last=feed_last)
    mine = [partial(build, units) for units in plans[rank]]
    # The batch's first trajectory with zero weights: same collectives, no contribution.
    mine += [partial(build, [[0]], dummy=True)] * (count - len(mine))
    return LazyMicroBatches(mine, finish), [float(w) for w in weights]
