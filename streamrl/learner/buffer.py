"""Staleness-aware trajectory buffer: complete groups, bounded version lag, counted drops."""
from __future__ import annotations

from collections import Counter, OrderedDict

from tensordict import TensorDict

from streamrl.trajectory import concat_trajectories, min_version, split_trajectories


class StalenessBuffer:
    """Collects trajectories into complete prompt groups and hands out training batches.

    A group is admitted to a batch when all ``group_size`` trajectories arrived and its
    oldest token version lags the learner by at most ``max_staleness``; older groups are
    dropped and counted (``dropped_stale`` trajectories), never trained on.
    """

    def __init__(self, group_size: int, max_staleness: int):
        self.group_size = group_size
        self.max_staleness = max_staleness
        self._groups: OrderedDict[int, list[TensorDict]] = OrderedDict()
        self.dropped_stale = 0
        self.dropped_stale_groups = 0
        self.dropped_overflow = 0  # trajectories beyond group_size in a group (never trained; counted)
        self.lag_histogram: Counter[int] = Counter()
        # Version rebase rules after a resume that skipped version numbers (see :meth:`rebase`).
        self.rebases: list[tuple[int, int, int]] = []

    def rebase(self, newest_old: int, ancestor: int, new_version: int) -> None:
        """After a resume: the model is checkpoint version ``ancestor``, versions up to
        ``newest_old`` were published by the lost lineage, and the learner continues at
        ``new_version`` (version numbers never go back). For staleness, a token version
        ``v <= newest_old`` counts as ``min(v, ancestor) + (new_version - ancestor)``: data older
        than the checkpoint keeps its true lag, data of the lost branch counts as fresh."""
        if new_version != ancestor:
            self.rebases.append((int(newest_old), int(ancestor), int(new_version)))

    def effective_version(self, td: TensorDict) -> int:
        v = min_version(td)
        for newest_old, ancestor, new in self.rebases:
            if v <= newest_old:
                v = min(v, ancestor) + (new - ancestor)
        return v

    def add(self, td: TensorDict) -> None:
        for item in split_trajectories(td):
            self._groups.setdefault(int(item["group_id"][0]), []).append(item)

    def complete_groups(self) -> int:
        return sum(len(g) >= self.group_size for g in self._groups.values())

    def pending_groups(self) -> int:
        """Groups waiting in the buffer, complete or not."""
        return len(self._groups)

    def pending_trajectories(self) -> int:
        return sum(len(g) for g in self._groups.values())

    def drop_stale(self, version: int) -> int:
        """Drop groups too old for ``version``; returns how many groups were dropped."""
        dropped = 0
        for gid in list(self._groups):
            items = self._groups[gid]
            if version - min(self.effective_version(t) for t in items) > self.max_staleness:
                self.dropped_stale += len(items)
                self.dropped_stale_groups += 1
                del self._groups[gid]
                dropped += 1
        return dropped

    def take(self, n_groups: int, version: int) -> TensorDict | None:
        """Pop ``n_groups`` complete, fresh groups (oldest first) as one packed batch, or None."""
        ready = [gid for gid, g in self._groups.items() if len(g) >= self.group_size]
        if len(ready) < n_groups:
            return None
        items = []
        for gid in ready[:n_groups]:
            whole = self._groups.pop(gid)
            group = whole[: self.group_size]
            self.dropped_overflow += len(whole) - len(group)
            self.lag_histogram[version - min(self.effective_version(t) for t in group)] += len(group)
            items.extend(group)
        return concat_trajectories(items)

    def pending(self) -> list[TensorDict]:
        """Everything buffered (for checkpoints)."""
        return [t for g in self._groups.values() for t in g]

    def export_state(self) -> tuple[TensorDict | None, dict]:
        """(pending trajectories packed in arrival order or None, JSON-able counters) for checkpoints."""
        items = self.pending()
        if items:
            common = set.intersection(*(set(t.keys()) for t in items))
            items = [t.select(*common) for t in items]  # optional keys only when every item has them
        meta = {"dropped_stale": self.dropped_stale, "dropped_stale_groups": self.dropped_stale_groups,
                "lag_histogram": {str(k): v for k, v in self.lag_histogram.items()},
                "dropped_overflow": self.dropped_overflow, "rebases": [list(r) for r in self.rebases]}
        return (concat_trajectories(items) if items else None), meta

    def load_state(self, items: TensorDict | None, meta: dict) -> None:
        """Restore what :meth:`export_state` returned (groups re-form from the items)."""
        self._groups.clear()
        if items is not None:
            self.add(items)
        self.dropped_stale = int(meta.get("dropped_stale", 0))
        self.dropped_stale_groups = int(meta.get("dropped_stale_groups", 0))
        self.lag_histogram = Counter({int(k): int(v) for k, v in meta.get("lag_histogram", {}).items()})
        self.dropped_overflow = int(meta.get("dropped_overflow", 0))
        self.rebases = [tuple(map(int, r)) for r in meta.get("rebases", [])]
