"""PNG of one result file: median time per method with its p10-p90 spread."""

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
