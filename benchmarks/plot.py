"""PNGs of result files: dispatch/combine (median time per method with its p10-p90 spread)
and all-reduce (time and speedup over psum against message size)."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.patches

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

FAMILY_COLORS = {"jax_moe": "tab:blue", "peer": "tab:orange", "probe": "tab:gray"}


def plot_results(payload: dict, path: Path) -> bool:
  """Horizontal bars (log scale) of every timed method; False when nothing was timed."""
  rows = [r for r in payload["results"] if r["status"] == "ok" and r.get("time")]
  if not rows:
    return False
  labels = [r["label"] for r in rows]
  medians = [r["time"]["median_us"] for r in rows]
  low = [max(m - r["time"]["p10_us"], 0.0) for m, r in zip(medians, rows)]
  high = [max(r["time"]["p90_us"] - m, 0.0) for m, r in zip(medians, rows)]
  colors = [FAMILY_COLORS.get(r["family"], "tab:green") for r in rows]

  fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1.6))
  y = range(len(rows))
  ax.barh(y, medians, xerr=[low, high], color=colors, capsize=2)
  ax.set_yticks(list(y), labels, fontsize=8)
  ax.invert_yaxis()
  if min(medians) > 0 and max(medians) / min(medians) > 20:
    ax.set_xscale("log")
  ax.set_xlabel("microseconds per iteration (median, p10-p90)")
  env, cfg = payload["environment"], payload["config"]
  ax.set_title(f"{payload['phase']}: {cfg['tokens_per_rank']} tokens/rank, hidden {cfg['hidden']}, "
               f"top-{cfg['topk']} of {cfg['experts']}, {cfg['routing']} routing\n"
               f"{env['device_count']} x {env['device_kind']}, jax {env['jax_version']}",
               fontsize=9)
  for i, (m, r) in enumerate(zip(medians, rows)):
    ax.text(max(m, r["time"]["p90_us"]), i, f" {m:.1f}", va="center", fontsize=7)
  ax.legend(handles=[matplotlib.patches.Patch(color=c, label=f) for f, c in FAMILY_COLORS.items()],
            loc="lower right", fontsize=8)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def plot_time_bars(rows: list[dict], path: Path, *, colors: list[str], notes: list[str],
                   xlabel: str, title: str) -> bool:
  """Horizontal bars of each row's time (median with its p10-p90 spread), labelled by
  row["label"], `notes[i]` written after row i's bar; False when there is no row."""
  if not rows:
    return False
  medians = [r["time"]["median_us"] for r in rows]
  low = [max(m - r["time"]["p10_us"], 0.0) for m, r in zip(medians, rows)]
  high = [max(r["time"]["p90_us"] - m, 0.0) for m, r in zip(medians, rows)]
  fig, ax = plt.subplots(figsize=(9, 0.4 * len(rows) + 1.6))
  ax.barh(range(len(rows)), medians, xerr=[low, high], color=colors, capsize=2)
  ax.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=8)
  ax.invert_yaxis()
  ax.set_xlabel(xlabel)
  ax.set_title(title, fontsize=9)
  for i, (r, note) in enumerate(zip(rows, notes)):
    ax.text(r["time"]["p90_us"], i, f" {note}", va="center", fontsize=7)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


ALL_REDUCE_STYLES = {"one_shot": "tab:blue", "two_shot": "tab:green", "auto": "tab:purple",
                     "psum": "tab:orange"}


def plot_all_reduce(payload: dict, path: Path) -> bool:
  """Median time per call against message size (log-log) and the speedup over psum, one line
  per method; solid lines for the fori_loop mode, dashed for the chained mode."""
  rows = [r for r in payload["results"] if r["status"] == "ok" and r.get("time")]
  if not rows:
    return False
  fig, (ax_time, ax_speed) = plt.subplots(1, 2, figsize=(13, 5))
  for mode, style in (("loop", "-"), ("chain", "--")):
    psum = {r["size_bytes"]: r["time"]["median_us"] for r in rows
            if r["mode"] == mode and r["method"] == "psum"}
    for method, color in ALL_REDUCE_STYLES.items():
      mine = sorted((r["size_bytes"], r["time"]["median_us"]) for r in rows
                    if r["mode"] == mode and r["method"] == method)
      if not mine:
        continue
      sizes, medians = zip(*mine)
      ax_time.plot(sizes, medians, style, marker="o", ms=3, color=color, label=f"{method} ({mode})")
      if method != "psum" and psum:
        pairs = [(s, psum[s] / m) for s, m in mine if s in psum and m > 0]
        if pairs:
          ax_speed.plot(*zip(*pairs), style, marker="o", ms=3, color=color,
                        label=f"{method} ({mode})")
  for ax in (ax_time, ax_speed):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per rank")
    ax.grid(True, which="both", alpha=0.3)
  ax_time.set_yscale("log")
  ax_time.set_ylabel("microseconds per call (median)")
  ax_speed.set_ylabel("psum time / method time")
  ax_speed.axhline(1.0, color="black", lw=0.8)
  ax_speed.axhline(3.0, color="gray", lw=0.8, ls=":")
  ax_time.legend(fontsize=7)
  ax_speed.legend(fontsize=7)
  env, cfg = payload["environment"], payload["config"]
  fig.suptitle(f"all-reduce, {cfg['dtype']}, {env['device_count']} x {env['device_kind']}, "
               f"jax {env['jax_version']}, commit {str(env['git_commit'])[:10]}", fontsize=10)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True
