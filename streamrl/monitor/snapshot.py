"""Turn a run's metric history and state into one JSON-able snapshot with rates.

Pure computation (no Redis): the input is ``history[process]`` — metric dicts in time order,
each with a ``time`` (unix s) as written by :meth:`Coordinator.put_metrics` — and a
:class:`~streamrl.monitor.source.State`. Rates come from cumulative counters
(``learner/samples``, ``learner/trained_tokens_total``, ``rollout/generated_tokens``, …) as
Δcount / Δtime over the last ``window_s``; a counter that goes down (a restarted worker)
counts from zero again. Learner-side numbers use exactly the points named in
``window``, so they can be checked against ``metrics.jsonl``.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from streamrl.coord.liveness import stall
from streamrl.monitor.learning import learning_section
from streamrl.roles.names import REWARD, ROLE_SERVERS

LAYER_RE = re.compile(r"^moe/router_entropy/layer(\d+)$")
HIST_PREFIX = "learner/staleness_hist/"
# V-trace critic metrics (streamrl.learner.trainer / critic), snapshot name -> learner key
CRITIC_KEYS = {"value_loss": "learner/value_loss", "value_mean": "learner/value_mean",
               "target_mean": "learner/vtrace_target_mean",
               "explained_variance": "learner/explained_variance",
               "advantage_abs_mean": "learner/vtrace_advantage_abs_mean"}
INFLIGHT_KEY = "rollout/inflight_loads"  # per-worker count of weight loads during a generate


@dataclass
class Thresholds:
    """MoE health limits: router entropy is normalised by log E (1 = uniform routing);
    expert-usage std is in units of the mean load (0 = balanced). Below/above → warn/bad."""

    entropy_warn: float = 0.5
    entropy_bad: float = 0.25
    usage_std_warn: float = 0.5
    usage_std_bad: float = 1.0
    stale_heartbeat_s: float = 3.0


def level(value: float | None, warn: float, bad: float, higher_is_worse: bool) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    if higher_is_worse:
        return "bad" if value > bad else "warn" if value > warn else "ok"
    return "bad" if value < bad else "warn" if value < warn else "ok"


def ts(entry: dict[str, float]) -> float:
    """When an entry's values were written: the sink's ``metrics/time`` (stamped at the
    newest write of a batch), else the push time; -1 if neither."""
    return entry.get("metrics/time", entry.get("time", -1.0))


def increments(entries: Iterable[dict[str, float]], key: str) -> list[tuple[float, float]]:
    """[(time, Δcount)] between consecutive entries that carry ``key``; resets count from 0."""
    out, prev = [], None
    for e in entries:
        if key not in e or ts(e) < 0:
            continue
        v = e[key]
        if prev is not None:
            out.append((ts(e), v - prev if v >= prev else v))
        prev = v
    return out


def counter_rate(entries: list[dict[str, float]], key: str, t_lo: float, t_hi: float) -> dict | None:
    """Rate of cumulative ``key`` over the entries in [t_lo, t_hi]: {rate, t0, t1, count}."""
    pts = [e for e in entries if key in e and t_lo <= ts(e) <= t_hi]
    if len(pts) < 2 or ts(pts[-1]) <= ts(pts[0]):
        return None
    total = sum(d for _, d in increments(pts, key))
    dt = ts(pts[-1]) - ts(pts[0])
    return {"rate": total / dt, "t0": ts(pts[0]), "t1": ts(pts[-1]), "count": total,
            "first": pts[0], "last": pts[-1]}


def _mean(vals: list[float]) -> float | None:
    vals = [v for v in vals if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def _first(*vals):
    return next((v for v in vals if v is not None), None)


def _window_mean(entries, key, t_lo, t_hi) -> float | None:
    return _mean([e[key] for e in entries if key in e and t_lo <= ts(e) <= t_hi])


@dataclass
class SnapshotBuilder:
    """Builds snapshots; remembers each worker's last seen incarnation between calls."""

    window_s: float = 10.0
    spark_bins: int = 30
    spark_bin_s: float = 2.0
    thresholds: Thresholds = field(default_factory=Thresholds)
    _seen_incarnation: dict[int, int] = field(default_factory=dict)

    def build(self, run_id: str, history: dict[str, list[dict[str, float]]], state,
              now: float | None = None) -> dict[str, Any]:
        """One snapshot of the run from ``history[process]`` (metric dicts in time order) and
        ``state`` (a :class:`~streamrl.monitor.source.State`) at ``now`` (default: ``state.time``)."""
        now = state.time if now is None else now
        learner = list(history.get("learner", []))
        latest_l = state.latest.get("learner") or (learner[-1] if learner else {})
        workers = {p: list(h) for p, h in history.items() if p.startswith("rollout-")}
        ended = state.stop is not None
        # A finished run: rates over its last window of activity, not over silence.
        t_hi = max([ts(e) for h in history.values() for e in h[-1:]], default=now) if ended else now
        t_lo = t_hi - self.window_s

        samples = counter_rate(learner, "learner/samples", t_lo, t_hi)
        return {
            "run_id": run_id,
            "time": now,
            "status": f"ended: {state.stop}" if ended else ("running" if learner else "waiting for data"),
            "window_s": self.window_s,
            # the learner reports that the rates span (their times and steps), for cross-checks
            "window": {"learner": [samples["t0"], samples["t1"]] if samples else None,
                       "learner_steps": [samples["first"].get("learner/step"), samples["last"].get("learner/step")]
                       if samples else None},
            "totals": self._totals(learner, latest_l, state, workers, samples, t_lo, t_hi),
            "staleness": self._staleness(learner, latest_l),
            "weights": self._weights(latest_l, state, workers),
            "moe": self._moe(latest_l),
            "workers": self._workers(state, workers, now, t_lo, t_hi),
            "transport": {k: v for k, v in latest_l.items() if k.startswith("transport/")},
            "history": self._history(learner, workers, t_hi),
            # optional sections: present only when a run reports their signals, so the --json
            # of a run without them carries no extra keys
            **self._critic(learner, latest_l, t_lo, t_hi),
            **self._credit(state),
            **self._env(state, workers),
            **self._roles(history, state, now, t_lo, t_hi),
            **learning_section(latest_l, lambda key: _first(_window_mean(learner, key, t_lo, t_hi), latest_l.get(key)),
                               [state.latest.get(p, {}) for p in workers]),
        }

    @staticmethod
    def _totals(learner, latest_l, state, workers, samples, t_lo, t_hi) -> dict[str, Any]:
        """Run-wide rates over the window (``samples``: the learner's trained-samples rate),
        window means of the learner's step figures, and the latest progress values."""
        trained_tok = counter_rate(learner, "learner/trained_tokens_total", t_lo, t_hi)
        steps = counter_rate(learner, "learner/step", t_lo, t_hi)
        gen_traj = [counter_rate(h, "rollout/trajectories", t_lo, t_hi) for h in workers.values()]
        gen_tok = [counter_rate(h, "rollout/generated_tokens", t_lo, t_hi) for h in workers.values()]
        recv = counter_rate(learner, "transport/trajectories", t_lo, t_hi)

        def total(rates):
            got = [r["rate"] for r in rates if r]
            return sum(got) if got else None

        def window_mean(key):
            return _first(_window_mean(learner, key, t_lo, t_hi), latest_l.get(key))

        kl_key, kl = _mismatch(latest_l, state, workers)
        return {
            "trajectories_per_s": total(gen_traj),
            "trained_trajectories_per_s": samples["rate"] if samples else None,
            "received_trajectories_per_s": recv["rate"] if recv else None,
            "generated_tokens_per_s": total(gen_tok),
            "trained_tokens_per_s": trained_tok["rate"] if trained_tok else None,
            "learner_steps_per_s": steps["rate"] if steps else None,
            "learner_step_s": window_mean("learner/step_s"),
            "learner_idle_frac": window_mean("learner/idle_frac"),
            "queue_depth": latest_l.get("learner/buffer_trajectories"),
            "version": state.version,
            "learner_step": latest_l.get("learner/step"),
            "samples": latest_l.get("learner/samples"),
            "reward_mean": window_mean("learner/reward_mean"),
            "rollout_reward_mean": _mean([state.latest.get(p, {}).get("rollout/reward_mean") for p in workers]),
            "mismatch_kl": kl,
            "mismatch_key": kl_key,
        }

    def _staleness(self, learner, latest) -> dict[str, Any]:
        hist = {k[len(HIST_PREFIX):]: v for k, v in latest.items() if k.startswith(HIST_PREFIX)}
        source = "learner"
        if not hist:  # older learners: per-step mean lag as sampled (approximate)
            source = "sampled staleness_mean"
            for e in learner:
                if "learner/staleness_mean" in e:
                    lag = str(int(round(e["learner/staleness_mean"])))
                    hist[lag] = hist.get(lag, 0) + 1
        hist = dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
        dropped = latest.get("learner/samples_dropped_stale", 0.0)
        samples = latest.get("learner/samples", 0.0)
        return {"histogram": hist, "histogram_source": source, "mean": latest.get("learner/staleness_mean"),
                "dropped_stale": dropped,
                "dropped_frac": dropped / (dropped + samples) if dropped + samples > 0 else 0.0}

    def _critic(self, learner, latest, t_lo, t_hi) -> dict[str, Any]:
        """``{"critic": {...}}`` for a V-trace learner (``learner.loss = vtrace``), else ``{}``.
        Window means like ``reward_mean``: one step's value loss is noisy."""
        if not any(k in latest for k in CRITIC_KEYS.values()):
            return {}
        return {"critic": {name: _first(_window_mean(learner, key, t_lo, t_hi), latest.get(key))
                           for name, key in CRITIC_KEYS.items()}}

    @staticmethod
    def _credit(state) -> dict[str, Any]:
        """``{"credit": {"advantage": mode}}`` when the run's config (``State.config``) selects a
        non-default advantage (``token``), else ``{}``: a default run's JSON keeps its keys."""
        learner_cfg = (getattr(state, "config", None) or {}).get("learner") or {}
        mode = learner_cfg.get("advantage", "sequence")
        return {"credit": {"advantage": mode}} if mode != "sequence" else {}

    @staticmethod
    def _env(state, workers) -> dict[str, Any]:
        """``{"env": {...}}`` for multi-turn runs (workers report ``env/...``, streamrl.envs), else ``{}``.

        Per batch, averaged over workers: turns per episode, the fraction of episodes that called
        a tool, the mean tool latency; summed over workers: tool calls and errors of the last
        batch, and calls, errors, timeouts since the start, tool calls still running (hung), and
        the last batch's prompt tokens prefilled vs taken from earlier turns' KV."""
        latest = [state.latest.get(p, {}) for p in workers]
        latest = [m for m in latest if "env/turns_mean" in m]
        if not latest:
            return {}

        def mean(key):
            return _mean([m.get(key) for m in latest])

        def total(key):
            vals = [m[key] for m in latest if key in m]
            return sum(vals) if vals else None
        return {"env": {"turns_mean": mean("env/turns_mean"), "tool_call_rate": mean("env/tool_call_rate"),
                        "tool_latency_s": mean("env/tool_latency_s"), "reward_mean": mean("env/reward_mean"),
                        "tool_calls": total("env/tool_calls"), "tool_errors": total("env/tool_errors"),
                        "tool_calls_total": total("env/tool_calls_total"),
                        "tool_errors_total": total("env/tool_errors_total"),
                        "tool_timeouts_total": total("env/tool_timeouts_total"), "tools_hung": total("env/tools_hung"),
                        "prefill_tokens": total("env/prefill_tokens"),
                        "prefill_tokens_saved": total("env/prefill_tokens_saved")}}

    @staticmethod
    def _roles(history, state, now, t_lo, t_hi) -> dict[str, Any]:
        """``{"roles": {name: {...}}}`` for the Hybrid role servers a run placed apart (reward,
        reference, critic: streamrl.roles), else ``{}``. Per role: trajectories scored per
        second, scoring seconds per batch, seconds since its last report (a stuck or restarting
        server shows here first), rejected requests and failed batches since its start; the
        critic adds its training step, value loss and explained variance."""
        out: dict[str, Any] = {}
        for role in ROLE_SERVERS:  # the Hybrid role servers write metrics under their names
            h = list(history.get(role, []))
            latest = state.latest.get(role) or (h[-1] if h else None)
            if not latest:
                continue
            scored = counter_rate(h, "reward/pairs" if role == REWARD else f"{role}/trajectories", t_lo, t_hi)
            batches = counter_rate(h, f"{role}/batches", t_lo, t_hi)
            busy = counter_rate(h, f"{role}/score_s", t_lo, t_hi)
            row = {"trajectories_per_s": scored["rate"] if scored else None,
                   "score_s_per_batch": busy["count"] / batches["count"] if busy and batches and batches["count"] else None,
                   "last_report_s": max(now - ts(latest), 0.0) if ts(latest) >= 0 else None,
                   "rejected": latest.get(f"{role}/rejected"), "errors": latest.get(f"{role}/errors")}
            if role == "critic":
                row.update({k: latest.get(f"critic/{k}") for k in ("step", "value_loss", "explained_variance")})
            out[role] = row
        return {"roles": out} if out else {}

    def _weights(self, latest, state, workers) -> dict[str, Any]:
        """Learner side: gather (full tensors from shards) and write into the data plane.
        Worker side (slowest worker's last fetch): transfer, verify, load into the engine."""
        nbytes = latest.get("weights/bytes")
        slowest: dict[str, float] = {}
        for t in state.weight_timings.values():
            if t.get("weights/transfer_s", 0.0) + t.get("weights/load_s", 0.0) >= \
                    slowest.get("weights/transfer_s", 0.0) + slowest.get("weights/load_s", 0.0):
                slowest = t
        load_s = slowest.get("weights/load_s")
        if load_s is None:  # workers without stage timings: their combined fetch+load time
            for h in workers.values():  # newest non-zero load (0 means "nothing new this batch")
                for e in reversed(h):
                    if e.get("rollout/weights_load_s", 0.0) > 0:
                        load_s = max(load_s or 0.0, e["rollout/weights_load_s"])
                        break
        write_s = latest.get("weights/write_s")
        transfer_s = slowest.get("weights/transfer_s")

        def gbps(s):
            return nbytes / s / 1e9 if nbytes and s else None
        out = {"version": state.version, "bytes": nbytes, "gather_s": latest.get("weights/gather_s"),
               "write_s": write_s, "publish_s": latest.get("weights/publish_s"),
               "transfer_s": transfer_s, "verify_s": slowest.get("weights/verify_s"), "load_s": load_s,
               "worker_version": slowest.get("weights/version"),
               "write_gbps": gbps(write_s), "transfer_gbps": gbps(transfer_s), "load_gbps": gbps(load_s)}
        if "weights/retained_versions" in latest:  # store files kept past `keep` for leased readers
            out["retained_versions"] = latest["weights/retained_versions"]
        loads = [state.latest.get(p, {}).get(INFLIGHT_KEY) for p in workers]
        if any(v is not None for v in loads):  # mid-generation weight swaps, summed over workers
            out["inflight_loads"] = sum(v for v in loads if v is not None)
        return out

    def _moe(self, latest) -> dict[str, Any]:
        th = self.thresholds
        layers = []
        for k in latest:
            m = LAYER_RE.match(k)
            if m:
                i = int(m.group(1))
                ent = latest[k]
                std = latest.get(f"moe/expert_usage_std/layer{i}")
                layers.append({"layer": i, "router_entropy": ent, "expert_usage_std": std,
                               "entropy_level": level(ent, th.entropy_warn, th.entropy_bad, False),
                               "usage_level": level(std, th.usage_std_warn, th.usage_std_bad, True)})
        layers.sort(key=lambda d: d["layer"])
        return {"layers": layers, "aux_loss": latest.get("moe/aux_loss"),
                "router_entropy": latest.get("moe/router_entropy"),
                "expert_usage_std": latest.get("moe/expert_usage_std"),
                "thresholds": {"entropy_warn": th.entropy_warn, "entropy_bad": th.entropy_bad,
                               "usage_std_warn": th.usage_std_warn, "usage_std_bad": th.usage_std_bad}}

    def _workers(self, state, workers, now, t_lo, t_hi) -> list[dict[str, Any]]:
        rows = []
        for wid in sorted(set(state.heartbeats) | {int(p.split("-", 1)[1]) for p in workers if p[8:].isdigit()}):
            hb = state.heartbeats.get(wid)
            inc = state.incarnations.get(wid, 0)
            h = workers.get(f"rollout-{wid}", [])
            rate = counter_rate(h, "rollout/generated_tokens", t_lo, t_hi)
            latest = state.latest.get(f"rollout-{wid}", {})
            if hb is not None:
                self._seen_incarnation[wid] = int(hb.get("incarnation", inc))
            seen = self._seen_incarnation.get(wid, inc)
            if inc > seen:
                status = "restarting"  # a new process registered and has not heartbeated yet
            elif hb is None:
                status = "exited" if state.stop is not None else "dead"
            elif self._stall(state, hb, now) is not None:
                status = "stuck"
            elif now - hb.get("time", 0.0) > self.thresholds.stale_heartbeat_s:
                status = "stale"
            else:
                status = "alive"
            version = hb.get("version") if hb else latest.get("rollout/version")
            rows.append({
                "id": wid, "host": hb.get("host") if hb else None, "device": hb.get("device") if hb else None,
                "pid": hb.get("pid") if hb else None, "state": hb.get("state") if hb else None,
                "version": version,
                "lag": state.version - version if version is not None and state.version >= 0 else None,
                "tokens_per_s": rate["rate"] if rate else (latest.get("rollout/tokens_per_s") if status == "alive" else 0.0),
                "heartbeat_age_s": now - hb["time"] if hb and "time" in hb else None,
                "status": status, "incarnation": inc, "restarts": max(inc - 1, 0),
                "phase": hb.get("phase") if hb else None,
                "phase_s": now - hb["phase_since"] if hb and "phase_since" in hb else None,
            })
            if f"rollout-{wid}" in state.stuck:  # the last stall a launcher acted on (it restarted it)
                rows[-1]["stuck"] = state.stuck[f"rollout-{wid}"]
            if INFLIGHT_KEY in latest:
                rows[-1]["inflight_loads"] = latest[INFLIGHT_KEY]
        return rows

    @staticmethod
    def _stall(state, hb: dict, now: float):
        """:func:`streamrl.coord.liveness.stall` with the run's deadlines (the launcher's rule)."""
        d = state.config.get("deadlines") or {}
        return stall(hb, now, float(d.get("stuck_s", 60.0)), float(d.get("batch_s", 1800.0)))

    def _history(self, learner, workers, t_hi) -> dict[str, list[float | None]]:
        """Sparkline series: ``spark_bins`` bins of ``spark_bin_s`` ending at ``t_hi``."""
        n, w = self.spark_bins, self.spark_bin_s
        start = t_hi - n * w

        def binned_rate(pairs):
            out = [0.0] * n
            for t, d in pairs:
                i = int((t - start) // w)
                if 0 <= i < n:
                    out[i] += d / w
            return out

        def binned_mean(entries, key):
            acc = [[] for _ in range(n)]
            for e in entries:
                i = int((ts(e) - start) // w)
                if key in e and 0 <= i < n:
                    acc[i].append(e[key])
            return [_mean(a) for a in acc]

        gen_tok = [p for h in workers.values() for p in increments(h, "rollout/generated_tokens")]
        gen_traj = [p for h in workers.values() for p in increments(h, "rollout/trajectories")]
        return {
            "bin_s": w,
            "generated_tokens_per_s": binned_rate(gen_tok),
            "trajectories_per_s": binned_rate(gen_traj),
            "trained_tokens_per_s": binned_rate(increments(learner, "learner/trained_tokens_total")),
            "trained_trajectories_per_s": binned_rate(increments(learner, "learner/samples")),
            "reward_mean": binned_mean(learner, "learner/reward_mean"),
            "learner_step_s": binned_mean(learner, "learner/step_s"),
        }


def _mismatch(latest_l, state, workers) -> tuple[str, float | None]:
    """Engine/learner mismatch as ``(metric key, value)``: the learner's KL if it reports one,
    else the workers' parity probe (rollout/mismatch_kl), else the learner's mean
    |logp - behaviour logp|."""
    worker_kl = _mean([state.latest.get(p, {}).get("rollout/mismatch_kl") for p in workers])
    if "learner/mismatch_kl" in latest_l:
        return "learner/mismatch_kl", latest_l["learner/mismatch_kl"]
    if worker_kl is not None:
        return "rollout/mismatch_kl", worker_kl
    return "learner/behaviour_logprob_abs_diff", latest_l.get("learner/behaviour_logprob_abs_diff")
