"""The learner step's metric bookkeeping: device-side sums, one read of the device, mean over ranks.

A step's metrics stay on the device (0-dim tensors, summed over micro-batches) until every
optimizer step of the batch is queued; then all of them come to the host with a single copy.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# Token-weighted means: summed as ``value * tokens`` per micro-batch, divided by the tokens seen.
TOKEN_WEIGHTED = ("learner/clip_frac", "learner/is_weight_mean", "learner/is_truncated_frac")
# The MoE router losses: each rank's value is its share of the global loss, reduced by a sum.
SHARED_LOSSES = ("moe/aux_loss", "moe/z_loss")


class MetricSums:
    """Metrics of one minibatch summed over its micro-batches (device scalars or host floats),
    and the response tokens seen (``tokens``, a host float)."""

    def __init__(self):
        self.values: dict[str, torch.Tensor | float] = {}
        self.tokens = 0.0

    def add(self, key: str, value: torch.Tensor | float) -> None:
        self.values[key] = self.values.get(key, 0.0) + value

    def add_all(self, values: dict[str, torch.Tensor | float]) -> None:
        for k, v in values.items():
            self.add(k, v)


def host_metrics(acc: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Device scalars and floats -> floats, with a single device-to-host copy."""
    return host_metrics_many([acc])[0]


def host_metrics_many(accs: list[dict[str, torch.Tensor | float]]) -> list[dict[str, float]]:
    """:func:`host_metrics` of several dicts with ONE device-to-host copy for all of them."""
    keys = [(j, k) for j, acc in enumerate(accs) for k, v in acc.items() if isinstance(v, torch.Tensor)]
    dev = accs[keys[0][0]][keys[0][1]].device if keys else None
    vals = (torch.stack([accs[j][k].detach().to(dev, torch.float64).reshape(()) for j, k in keys]).tolist()
            if keys else [])
    out = [{k: float(v) for k, v in acc.items() if not isinstance(v, torch.Tensor)} for acc in accs]
    for (j, k), v in zip(keys, vals):
        out[j][k] = v
    return out


def token_weighted_means(metrics: dict[str, float], tokens: float) -> dict[str, float]:
    """The :data:`TOKEN_WEIGHTED` sums divided by ``tokens`` (without tokens: weight 1, fractions 0)."""
    for k in TOKEN_WEIGHTED:
        metrics[k] = metrics[k] / tokens if tokens else (1.0 if k == "learner/is_weight_mean" else 0.0)
    return metrics


def mean_over_ranks(metrics: dict[str, float], world: int, group=None) -> dict[str, float]:
    """Rank-local numbers (each rank saw its slice) -> the mean over ranks, same everywhere.
    The router losses' per-rank values are shares of the global loss -> their sum; the
    gradient norm is global already."""
    local = [k for k in metrics if k.startswith("learner/") and k != "learner/grad_norm"]
    shares = [k for k in SHARED_LOSSES if k in metrics]
    if world > 1:
        t = torch.tensor([metrics[k] for k in local + shares], dtype=torch.float64)
        dist.all_reduce(t, group=group)
        vals = t.tolist()
        metrics.update({k: v / world for k, v in zip(local, vals)})
        metrics.update(dict(zip(shares, vals[len(local):])))
    return metrics


def read_minibatch_metrics(pending: list[MetricSums], world: int, group=None) -> list[dict[str, float]]:
    """Each minibatch's sums as floats, means over its tokens and over the ranks: one wait for the device."""
    out = []
    for metrics, sums in zip(host_metrics_many([s.values for s in pending]), pending):
        out.append(mean_over_ranks(token_weighted_means(metrics, sums.tokens), world, group))
    return out
