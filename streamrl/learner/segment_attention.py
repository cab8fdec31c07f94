"""Attention over a packed row computed per segment: only the score tiles its mask can see (CPU).

Why: on the sdpa path a packed row (:mod:`streamrl.learner.packing`) gets a dense
``[1, 1, N, N]`` mask and the CPU kernel computes all ``N^2`` scores. A shared-prompt row of two
groups (2 x (52 + 8 x 25) tokens) needs about 1/8 of them: each sample's segment sees its unit's
prompt and itself, a prompt sees itself. On SmolLM2-135M at 2 x 8 samples the dense masked
attention costs ~13 % of the CPU learner step (FlexAttention, which skips empty tiles, has no
CPU backward).

Here the row is cut into small dense problems, batched, and run through sdpa:

* prompts: the ``U`` units' shared prompts, ``[U, Pmax]`` queries against themselves, causal;
* segments: the ``S`` samples, ``[S, Lmax]`` queries against ``[S, Pmax + Lmax]`` keys
  (their unit's prompt, then the segment itself, causal within the segment).

Queries and keys are gathered from the row by index (the backward scatters their gradients
back), padding is masked, and the outputs go back to row order by one gather. The rule is
exactly that of :func:`streamrl.learner.attention.dense_packed_mask`; only the order of the
additions in the softmax sums differs (float tolerance).

The model runs with the attention implementation :data:`SEGMENT_ATTENTION`; the trainer
passes a :class:`SegmentLayout` as the ``segment_layout`` keyword of the model's forward
(transformers hands extra keywords down to the attention function). Without one (padded
evaluation, the padded reference step) it is transformers' sdpa.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from streamrl.learner.attention import register_attention

SEGMENT_ATTENTION = "streamrl_segments"
"""Name under which :func:`segment_attention_forward` is registered with transformers."""


@dataclass
class SegmentLayout:
    """Index plan of one packed row (U units with a prompt, S segments, N row tokens).

    prompt_mask: [U, 1, P, P] bool, causal within each unit's prompt, padding hidden
    seg_mask: [S, 1, L, P + L] bool: a segment's queries see its unit's prompt, then itself causally
    q_index: [U * P + S * L] row index of the queries: the units' prompts ``[U, P]``, then the
        segments ``[S, L]``, flattened (padding: any valid index of the same unit or segment)
    k_index: [U * P + S * (P + L)] row index of the keys: the prompts (their own keys), then per
        segment its unit's prompt and itself ``[S, P + L]``, flattened
    order: [N] where each row token's output sits among the ``U * P + S * L`` (padded) outputs
    """

    prompt_mask: torch.Tensor
    seg_mask: torch.Tensor
    q_index: torch.Tensor
    k_index: torch.Tensor
    order: torch.Tensor

    @property
    def shapes(self) -> tuple[int, int, int, int]:
        """``(U, P, S, L)``."""
        u, _, p, _ = self.prompt_mask.shape
        s, _, l, _ = self.seg_mask.shape
        return u, p, s, l

    @classmethod
    def from_ids(cls, segment_ids: torch.Tensor, unit_ids: torch.Tensor) -> "SegmentLayout":
        """The plan of a row from its per-token ids (``[N]`` int64 each, see ``MicroBatch``):
        ``segment_ids`` -1 on a unit's shared prompt, else the sample; ``unit_ids`` the unit.
        A unit's prompt tokens come before its segments, each segment is contiguous."""
        seg, unit = segment_ids.tolist(), unit_ids.tolist()
        prompts: dict[int, list[int]] = {}
        segments: dict[int, list[int]] = {}
        seg_unit: dict[int, int] = {}
        for i, (s, u) in enumerate(zip(seg, unit)):
            if s < 0:
                prompts.setdefault(u, []).append(i)
            else:
                segments.setdefault(s, []).append(i)
                seg_unit[s] = u
        n = len(seg)
        p_max = max((len(v) for v in prompts.values()), default=0)
        l_max = max((len(v) for v in segments.values()), default=0)
        units = list(prompts)  # units with at least one prompt token
        prompt_q, prompt_ok = _pad_rows([prompts[u] for u in units], p_max)
        seg_q, seg_ok = _pad_rows(list(segments.values()), l_max)
        key_rows = [prompts.get(seg_unit[s], []) for s in segments]
        pk, pk_ok = _pad_rows(key_rows, p_max)
        seg_k = torch.cat([pk, seg_q], 1)
        causal_l = torch.ones(l_max, l_max, dtype=torch.bool).tril()
        seg_mask = torch.cat([pk_ok[:, None, :].expand(-1, l_max, -1),
                              causal_l[None] & seg_ok[:, None, :]], 2)
        prompt_mask = torch.ones(p_max, p_max, dtype=torch.bool).tril()[None] & prompt_ok[:, None, :]
        # A padding query sees what the first query sees: no all-masked softmax row (NaN in the
        # backward); its output is never read.
        seg_mask = torch.where(seg_ok[:, :, None], seg_mask, seg_mask[:, :1])
        prompt_mask = torch.where(prompt_ok[:, :, None], prompt_mask, prompt_mask[:, :1])
        q_index = torch.cat([prompt_q.reshape(-1), seg_q.reshape(-1)])
        valid = torch.cat([prompt_ok.reshape(-1), seg_ok.reshape(-1)])
        assert int(valid.sum()) == n, "every row token is a prompt or a segment query once"
        order = torch.empty(n, dtype=torch.int64)
        order[q_index[valid]] = valid.nonzero()[:, 0]
        return cls(prompt_mask[:, None], seg_mask[:, None], q_index,
                   torch.cat([prompt_q.reshape(-1), seg_k.reshape(-1)]), order)

    def to(self, device: torch.device) -> "SegmentLayout":
        if device.type == "cpu":
            return self
        return SegmentLayout(**{k: v.to(device, non_blocking=True) for k, v in self.__dict__.items()})


def _pad_rows(rows: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged index lists -> ``([R, width]`` int64 padded with the row's first index (0 when
    empty), ``[R, width]`` bool valid)."""
    idx = torch.zeros(len(rows), width, dtype=torch.int64)
    ok = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, row in enumerate(rows):
        if row:
            idx[r] = row[0]
            idx[r, : len(row)] = torch.tensor(row)
            ok[r, : len(row)] = True
    return idx, ok


def segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: SegmentLayout,
                      scaling: float | None) -> torch.Tensor:
    """Attention of one packed row by segments.

    One gather each for the queries, keys and values of both problems (their backward: one
    scatter each), one gather back to row order.

    Args:
        query: [1, Hq, N, D]; key, value: [1, Hkv, N, D] (grouped-query heads allowed).
    Returns:
        [1, N, Hq, D], as transformers' attention functions return it.
    """
    assert query.shape[0] == 1, "a packed micro-batch is one row"
    u, p, s, l = layout.shapes
    # squeeze, not [0]: a view whose backward is a view (indexing's backward zero-fills [H, N, D])
    q, k, v = (t.squeeze(0).transpose(0, 1) for t in (query, key, value))  # [N, H, D]
    gqa = q.shape[1] != k.shape[1]
    qp, qs = q[layout.q_index].split([u * p, s * l])
    kp, ks = k[layout.k_index].split([u * p, s * (p + l)])
    vp, vs = v[layout.k_index].split([u * p, s * (p + l)])
    outs = []
    for qq, kk, vv, rows, lq, lk, mask in ((qp, kp, vp, u, p, p, layout.prompt_mask),
                                         (qs, ks, vs, s, l, p + l, layout.seg_mask)):
        if rows * lq == 0:
            continue
        o = F.scaled_dot_product_attention(qq.unflatten(0, (rows, lq)).transpose(1, 2),
                                           kk.unflatten(0, (rows, lk)).transpose(1, 2),
                                           vv.unflatten(0, (rows, lk)).transpose(1, 2),
                                           attn_mask=mask, scale=scaling, enable_gqa=gqa)
        outs.append(o.transpose(1, 2).flatten(0, 1))  # [rows * lq, H, D]
    return torch.cat(outs)[layout.order][None]


def segment_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask, scaling: float | None = None, dropout: float = 0.0,
                              segment_layout: SegmentLayout | None = None, **kwargs):
    """transformers attention function: by segments with a ``segment_layout``, else sdpa."""
    if segment_layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout > 0 and module.training:
        raise ValueError("learner.attention = segments: the model has attention dropout; use learner.attention = sdpa")
    return segment_attention(query, key, value, segment_layout, scaling), None


def segment_mask(*, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """transformers' mask function for :data:`SEGMENT_ATTENTION`: no mask for a packed row (the
    trainer passes ``attention_mask=None`` with its ``segment_layout``; sdpa's builder would make a
    ``[1, 1, N, N]`` mask from the restarting position ids that the layout makes unneeded), sdpa's
    mask for padded inputs (their ``[B, T]`` attention mask)."""
    if attention_mask is None:
        return None
    return sdpa_mask(attention_mask=attention_mask, **kwargs)


def use_segment_attention(model: nn.Module) -> None:
    """Switch ``model`` (a transformers model) to :data:`SEGMENT_ATTENTION`."""
    model.set_attn_implementation(register_attention(SEGMENT_ATTENTION, segment_attention_forward, segment_mask))
