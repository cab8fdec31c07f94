"""Render a monitor snapshot (see :mod:`streamrl.monitor.snapshot`) with rich.

Plain box characters and no mouse or alternate-screen tricks, so it works over SSH and in
tmux; everything fits in ~120 columns. :func:`render` is pure: the same snapshot always
draws the same screen (tests render into a recorded ``Console``).
"""
from __future__ import annotations

import math
import time
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

BLOCKS = "▁▂▃▄▅▆▇█"
LEVEL_STYLE = {"ok": "green", "warn": "yellow", "bad": "bold red", "n/a": "dim"}
STATUS_STYLE = {"alive": "green", "stale": "yellow", "restarting": "cyan", "dead": "bold red", "exited": "dim",
                "stuck": "bold red"}


def fmt(v: Any, unit: str = "", digits: int = 3) -> str:
    """Compact number: 1234567 -> '1.23M'; None -> '-'."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, str):
        return v
    a = abs(v)
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= div:
            return f"{v / div:.{digits}g}{suffix}{unit}"
    if a != 0 and a < 1e-3:
        return f"{v:.1e}{unit}"
    return f"{v:.{digits}g}{unit}"


def fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.2f} s"


def sparkline(values: list[float | None], width: int | None = None) -> str:
    """Unicode block sparkline; None is a gap. Scaled to the series' own max."""
    vals = values[-width:] if width else values
    finite = [v for v in vals if v is not None and math.isfinite(v)]
    if not finite:
        return " " * len(vals)
    lo, hi = min(0.0, min(finite)), max(finite)
    span = hi - lo or 1.0
    return "".join(" " if v is None or not math.isfinite(v)
                   else BLOCKS[min(len(BLOCKS) - 1, int((v - lo) / span * (len(BLOCKS) - 1) + 0.5))]
                   for v in vals)


def _kv_table(rows: list[tuple[str, str]]) -> Table:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column(justify="right")
    for k, v in rows:
        t.add_row(k, v)
    return t


def totals_panel(s: dict) -> Panel:
    t = s["totals"]
    kl_label = {"learner/mismatch_kl": "mismatch KL", "rollout/mismatch_kl": "mismatch KL (probe)"}.get(
        t.get("mismatch_key"), "mismatch |Δlogp|")
    idle = t.get("learner_idle_frac")
    rows = [
        ("traj/s generated", fmt(t.get("trajectories_per_s"))),
        ("traj/s trained", fmt(t.get("trained_trajectories_per_s"))),
        ("generated tokens/s", fmt(t.get("generated_tokens_per_s"))),
        ("trained tokens/s", fmt(t.get("trained_tokens_per_s"))),
        ("learner step time", fmt_s(t.get("learner_step_s"))),
        ("learner idle (wait)", "-" if idle is None else f"{100 * idle:.0f} %"),
        ("queue depth (traj)", fmt(t.get("queue_depth"))),
        ("version / step", f"{fmt(t.get('version'))} / {fmt(t.get('learner_step'))}"),
        ("reward train / gen", f"{fmt(t.get('reward_mean'))} / {fmt(t.get('rollout_reward_mean'))}"),
        (kl_label, fmt(t.get("mismatch_kl"))),
    ]
    rows += learning_rows(s)
    rows += critic_rows(s)
    rows += env_rows(s)
    rows += role_rows(s)
    return Panel(_kv_table(rows), title=f"Totals (last {s['window_s']:.0f} s)", box=box.SQUARE)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f} %"


def learning_rows(s: dict) -> list[tuple[str, str]]:
    """Rows of the learning diagnostics (response length mean / p90 and the share cut at the
    limit; entropy; the importance weights' ESS, clip fraction and behaviour KL; staleness max
    against the admission bound; reward per task); none for learners that do not report them."""
    g = s.get("learning")
    if not g:
        return []
    rows = [
        ("response len mean / p90", f"{fmt(g.get('response_len_mean'))} / {fmt(g.get('response_len_p90'))}"),
        ("truncated at the limit", _pct(g.get("truncated_frac"))),
        ("entropy", fmt(g.get("entropy"))),
        ("IS ESS / clip frac", f"{fmt(g.get('is_ess'))} / {_pct(g.get('clip_frac'))}"),
        ("behaviour KL", fmt(g.get("kl_behaviour"))),
        ("staleness max / bound", f"{fmt(g.get('staleness_max'))} / {fmt(g.get('staleness_bound'))}"),
    ]
    rows += [(f"reward {task}", fmt(v)) for task, v in (g.get("task_reward") or {}).items()]
    return rows


def critic_rows(s: dict) -> list[tuple[str, str | Text]]:
    """Learner-panel rows for a V-trace critic and token credit; none for runs without them.
    EV = explained variance of the value targets (1 = V predicts them, <= 0 = no better than
    their mean); a negative EV is flagged in words (colour does not survive every log)."""
    rows: list[tuple[str, str | Text]] = []
    c = s.get("critic")
    if c:
        ev = c.get("explained_variance")
        ev_txt = Text(fmt(ev) + (" low" if ev is not None and ev < 0 else ""),
                      style="yellow" if ev is not None and ev < 0 else "")
        rows.append(("critic loss / EV", Text(f"{fmt(c.get('value_loss'))} / ") + ev_txt))
        rows.append(("critic V / |A| vtrace", f"{fmt(c.get('value_mean'))} / {fmt(c.get('advantage_abs_mean'))}"))
    mode = (s.get("credit") or {}).get("advantage")
    if mode and mode != "sequence":  # the default (group-relative per sequence) is not shown
        rows.append(("advantage credit", str(mode)))
    return rows


def env_rows(s: dict) -> list[tuple[str, str | Text]]:
    """Rows for multi-turn runs with tools (``env.name``); none for single-turn runs. Tool
    errors and timeouts (since the start) are flagged in words when there are any. The KV row is
    the share of the last batch's prompt tokens taken from earlier turns' KV (hf_fast sessions,
    vLLM's prefix cache) instead of prefilled again."""
    e = s.get("env")
    if not e:
        return []
    rate = e.get("tool_call_rate")
    errors, timeouts, hung = (e.get(k) or 0 for k in ("tool_errors_total", "tool_timeouts_total", "tools_hung"))
    bad = Text(f"{fmt(errors)} / {fmt(timeouts)} / {fmt(hung)}" + (" errors" if errors or timeouts else ""),
               style="yellow" if errors or timeouts or hung else "")
    return [
        ("turns / episode", fmt(e.get("turns_mean"))),
        ("tool-call rate", "-" if rate is None else f"{100 * rate:.0f} %"),
        ("tool calls (batch / all)", f"{fmt(e.get('tool_calls'))} / {fmt(e.get('tool_calls_total'))}"),
        ("tool err / timeout / hung", bad),
        ("tool latency", fmt_s(e.get("tool_latency_s"))),
        ("prompt KV reused", _reused(e.get("prefill_tokens"), e.get("prefill_tokens_saved"))),
    ]


def _reused(prefilled: float | None, saved: float | None) -> str:
    if prefilled is None or saved is None or prefilled + saved == 0:
        return "-"
    return f"{100 * saved / (prefilled + saved):.0f} % of {fmt(prefilled + saved)}"


def role_rows(s: dict) -> list[tuple[str, str | Text]]:
    """Rows per role server placed apart (reward, reference, critic): scored trajectories/s,
    time per batch, age of its last report; the critic's step and explained variance; rejected
    requests and failed batches, flagged in words, when there are any."""
    rows: list[tuple[str, str | Text]] = []
    for role, r in (s.get("roles") or {}).items():
        rows.append((f"{role} traj/s", fmt(r.get("trajectories_per_s"))))
        rows.append((f"{role} time / batch", fmt_s(r.get("score_s_per_batch"))))
        rows.append((f"{role} last report", f"{fmt_s(r.get('last_report_s'))} ago"))
        if role == "critic" and r.get("step") is not None:
            rows.append(("critic step / EV", f"{fmt(r.get('step'))} / {fmt(r.get('explained_variance'))}"))
        rejected, failed = r.get("rejected") or 0, r.get("errors") or 0
        if rejected or failed:
            rows.append((f"{role} rej / failed", Text(f"{fmt(rejected)} / {fmt(failed)} bad", style="yellow")))
    return rows


def history_panel(s: dict) -> Panel:
    h = s["history"]
    t = Table.grid(padding=(0, 1))
    t.add_column(style="bold")
    t.add_column()
    t.add_column(justify="right")
    for label, key in (("gen tok/s", "generated_tokens_per_s"), ("train tok/s", "trained_tokens_per_s"),
                       ("traj/s", "trajectories_per_s"), ("reward", "reward_mean"),
                       ("step time", "learner_step_s")):
        series = h.get(key, [])
        last = next((v for v in reversed(series) if v is not None), None)
        t.add_row(label, Text(sparkline(series), style="cyan"), fmt_s(last) if key == "learner_step_s" else fmt(last))
    span = h.get("bin_s", 0) * len(h.get("reward_mean", []))
    return Panel(t, title=f"History (last {span:.0f} s)", box=box.SQUARE)


def staleness_panel(s: dict) -> Panel:
    st = s["staleness"]
    hist = st["histogram"]
    t = Table.grid(padding=(0, 1))
    t.add_column(justify="right", style="bold")
    t.add_column()
    t.add_column(justify="right")
    peak = max(hist.values(), default=0) or 1
    for lag, n in hist.items():
        t.add_row(f"lag {lag}", Text("█" * max(1, round(20 * n / peak)) if n else "", style="magenta"), fmt(n))
    if not hist:
        t.add_row("", Text("no samples trained yet", style="dim"), "")
    t.add_row("dropped", Text(f"{fmt(st['dropped_stale'])} stale ({100 * st['dropped_frac']:.1f} %)"), "")
    t.add_row("mean lag", Text(fmt(st.get("mean"))), "")
    src = "" if st.get("histogram_source") == "learner" else " (approx.)"
    return Panel(t, title=f"Staleness{src}", box=box.SQUARE)


def weights_panel(s: dict) -> Panel:
    w = s["weights"]
    t = Table.grid(padding=(0, 1))
    t.add_column(style="bold", no_wrap=True)
    t.add_column(justify="right", no_wrap=True)
    t.add_column(justify="right", no_wrap=True)
    t.add_row("version", fmt(w.get("version")), fmt(w.get("bytes"), "B"))
    for label, key, rate in (("gather (learner)", "gather_s", None), ("write (learner)", "write_s", "write_gbps"),
                             ("transfer (worker)", "transfer_s", "transfer_gbps"),
                             ("load (worker)", "load_s", "load_gbps")):
        t.add_row(label, fmt_s(w.get(key)), f"{fmt(w.get(rate))} GB/s" if rate and w.get(rate) else "")
    if "retained_versions" in w:  # versions kept on the store because a reader still leases them
        t.add_row("retained (leased)", fmt(w["retained_versions"]), "versions")
    if w.get("inflight_loads"):  # 0 = in-flight updates off, or none happened yet
        t.add_row("in-flight loads", fmt(w["inflight_loads"]), "total")
    return Panel(t, title="Weights (last sync)", box=box.SQUARE)


def moe_panel(s: dict) -> Panel:
    m = s["moe"]
    th = m["thresholds"]
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False)
    t.add_column("layer", justify="right")
    t.add_column("router H", justify="right")
    t.add_column("usage std", justify="right")
    def cell(v, lvl):  # the level in words too: colour does not survive every terminal or log
        return Text(fmt(v) + {"warn": " warn", "bad": " BAD"}.get(lvl, ""), style=LEVEL_STYLE[lvl])
    for layer in m["layers"]:
        t.add_row(str(layer["layer"]), cell(layer["router_entropy"], layer["entropy_level"]),
                  cell(layer["expert_usage_std"], layer["usage_level"]))
    if not m["layers"]:
        t.add_row("-", "no MoE metrics", "")
    note = Text(f"warn/bad: H<{th['entropy_warn']:g}/{th['entropy_bad']:g} "
                f"std>{th['usage_std_warn']:g}/{th['usage_std_bad']:g}", style="dim")
    return Panel(Group(t, note), title="MoE router", box=box.SQUARE)


def workers_panel(s: dict) -> Panel:
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False, collapse_padding=True, pad_edge=False)
    # the in-flight loads column only while some worker swapped weights mid-generation
    inflight = any(w.get("inflight_loads") for w in s["workers"])
    cols = [("id", "right"), ("host", "left"), ("device", "left"), ("ver", "right"),
            ("lag", "right"), ("tok/s", "right"), ("hb age", "right"), ("status", "left"),
            *([("infl", "right")] if inflight else []), ("state", "left"), ("restarts", "right")]
    for col, just in cols:
        # the state column gives way first on narrow terminals
        t.add_column(col, justify=just, no_wrap=True, overflow="ellipsis")
    for w in s["workers"]:
        age = w.get("heartbeat_age_s")
        t.add_row(str(w["id"]), w.get("host") or "-", w.get("device") or "-", fmt(w.get("version")),
                  fmt(w.get("lag")), fmt(w.get("tokens_per_s")), "-" if age is None else f"{age:.1f}s",
                  Text(w["status"], style=STATUS_STYLE.get(w["status"], "")),
                  *([fmt(w.get("inflight_loads"))] if inflight else []), w.get("phase") or w.get("state") or "-",
                  str(w.get("restarts", 0)))
    if not s["workers"]:
        t.add_row("-", "no rollout workers registered", *[""] * 8)
    stuck = [Text(f"rollout-{w['id']} was stuck in phase {w['stuck'].get('phase')} since "
                  f"{time.strftime('%H:%M:%S', time.localtime(w['stuck'].get('since', 0)))}: {w['stuck'].get('why')}; "
                  f"restarted", style="red") for w in s["workers"] if w.get("stuck")]
    return Panel(Group(t, *stuck), title=f"Workers ({len(s['workers'])})", box=box.SQUARE)


def header(s: dict | None, url: str, error: str | None, now: float | None = None) -> Text:
    now = time.time() if now is None else now
    t = Text()
    t.append("StreamRL monitor", style="bold")
    if s is not None:
        style = "green" if s["status"] == "running" else "yellow"
        t.append(f"  run {s['run_id']}  ")
        t.append(s["status"], style=style)
    t.append(f"  redis {url}  {time.strftime('%H:%M:%S', time.localtime(now))}", style="dim")
    if error:
        t.append(f"\n{error}", style="bold red")
    return t


WIDE = 120  # below this many columns the panels stack (80-column SSH terminals, tmux splits)


class Screen:
    """The monitor screen; picks a side-by-side or a stacked layout from the console width."""

    def __init__(self, s: dict, url: str, error: str | None):
        self.s, self.url, self.error = s, url, error

    def __rich_console__(self, console, options):
        s = self.s
        yield header(s, self.url, self.error, s.get("time"))
        panels = [totals_panel(s), history_panel(s), staleness_panel(s), weights_panel(s), moe_panel(s)]
        if options.max_width < WIDE:  # two columns where they fit, sparklines full width
            for pair in ((panels[0], panels[2]), (panels[3], panels[4])):
                grid = Table.grid(expand=True, padding=(0, 1))
                grid.add_column(ratio=1)
                grid.add_column(ratio=1)
                grid.add_row(*pair)
                yield grid
            yield panels[1]
        else:
            top = Table.grid(expand=True, padding=(0, 1))
            top.add_column(ratio=1)
            top.add_column(ratio=1)
            top.add_row(*panels[:2])
            mid = Table.grid(expand=True, padding=(0, 1))
            for _ in range(3):
                mid.add_column(ratio=1)
            mid.add_row(*panels[2:])
            yield top
            yield mid
        yield workers_panel(s)


def render(s: dict | None, url: str, error: str | None = None) -> RenderableType:
    """The whole screen for snapshot ``s`` (None: nothing read yet) and an optional error line."""
    if s is None:
        return Group(header(None, url, error), Text("waiting for the first snapshot…", style="dim"))
    return Screen(s, url, error)
