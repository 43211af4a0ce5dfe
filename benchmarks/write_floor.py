"""The world-1 prefill dispatch's write floor on this GPU, from vendor kernels (torch).

The fp8 dispatch at prefill (4096 tokens, hidden 7168, top-8 of 256) writes every token's
7168-byte fp8 row to its 8 rows of the expert-sorted output: 235 MB of rows (plus 7 MB of
scales), from 59 MB of bf16 read. What does the GPU's memory system give for that pattern when
nothing is computed?
  fill       writing the 235 MB alone (no reads)
  copy       reading and writing 235 MB
  gather     index_select: every output row from its token's row (29 MB source, stays in L2),
             the output in order, as a gather-shaped dispatch would write it
  scatter    index_copy_ once per k: token t's row to the row of its slot (t, k), in the
             dispatch's own destination map (uniform routing, rows sorted by expert as
             docs/semantics.md lays them out): the dispatch's write pattern
  gather16, scatter16  the same two with the rows viewed as 16-byte elements (complex128):
             torch's index kernels move one element a thread, so the byte-wise cases measure
             its per-byte indexing as much as the memory system; these move what a vector
             store does
  gather_seq16  gather16 with the rows token-major (row r from token r // K): the same bytes,
             each source row read K times in a row and the output written in order; against
             gather16 it says whether the random sources or torch's gather itself sets the time
  rows_seq, rows_map, rows_map_bf16  (with triton) one program a token reads its row once and
             stores it to its K rows with 16-byte vectors: token-major rows (in order), the
             dispatch's destination map, and the map from bf16 tokens cast to fp8 on the way
             (the dispatch's own bytes, 59 MB read and 235 MB written, less its 7 MB of scales)
Each case is checked (a sample of rows against the source) before it is timed: CUDA events
around one call (scatter: its K calls), median of --reps. Writes JSON and a PNG.

  python3 benchmarks/write_floor.py [--tokens 4096] [--hidden 7168] [--topk 8] [--experts 256]
                                    [--out benchmarks/results/write_floor]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.environment import _git  # noqa: E402
from benchmarks.plot import plot_time_bars  # noqa: E402
from benchmarks.report import write_json  # noqa: E402
from benchmarks.timing import summarize  # noqa: E402


def slot_rows(tokens: int, topk: int, experts: int, gen: torch.Generator) -> torch.Tensor:
  """rows[t, k]: the output row of slot (t, k) for uniform top-k routing (distinct experts per
  token): slots sorted by expert, (t, k) order inside an expert (no padding)."""
  ids = torch.rand(tokens, experts, generator=gen, device="cuda").argsort(dim=1)[:, :topk]
  order = torch.sort(ids.flatten() * (tokens * topk) +
                     torch.arange(tokens * topk, device="cuda")).indices
  rows = torch.empty(tokens * topk, dtype=torch.long, device="cuda")
  rows[order] = torch.arange(tokens * topk, device="cuda")
  return rows.view(tokens, topk)


def triton_rows(num_warps: int, block: int):
  """rows(src, out, rows): out[rows[t, k]] = src[t] (cast to out's dtype), one program a token,
  its row loaded once, `block` elements a step over `num_warps` warps; None without triton."""
  try:
    import triton
    import triton.language as tl
  except ImportError:
    return None

  @triton.jit
  def kernel(src, out, rows, H: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    for c in tl.static_range(0, H, BLOCK):
      offs = c + tl.arange(0, BLOCK)
      mask = offs < H
      v = tl.load(src + t * H + offs, mask=mask).to(out.dtype.element_ty)
      for k in tl.static_range(K):
        r = tl.load(rows + t * K + k).to(tl.int64)
        tl.store(out + r * H + offs, v, mask=mask)

  def launch(src, out, rows):
    T, H = src.shape
    kernel[(T,)](src, out, rows, H=H, K=rows.shape[1], BLOCK=block, num_warps=num_warps)
  return launch


def time_us(fn, reps: int) -> list[float]:
  fn()
  torch.cuda.synchronize()
  events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(reps)]
  for start, end in events:
    start.record()
    fn()
    end.record()
  torch.cuda.synchronize()
  return [start.elapsed_time(end) * 1e3 for start, end in events]


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tokens", type=int, default=4096)
  p.add_argument("--hidden", type=int, default=7168)
  p.add_argument("--topk", type=int, default=8)
  p.add_argument("--experts", type=int, default=256)
  p.add_argument("--reps", type=int, default=30)
  p.add_argument("--triton-warps", type=int, default=8, help="warps a program (rows_* cases)")
  p.add_argument("--triton-block", type=int, default=4096,
                 help="elements a program moves a step (rows_* cases; a power of two)")
  p.add_argument("--git-commit", default=None, help="the code's commit (a copied tree)")
  p.add_argument("--out", type=Path, default=Path("benchmarks/results/write_floor"),
                 help="file stem: writes STEM.json and STEM.png")
  args = p.parse_args()
  if not torch.cuda.is_available():
    p.error("needs a CUDA GPU (torch.cuda.is_available() is False)")
  if not 1 <= args.topk <= args.experts:
    p.error(f"--topk must be in [1, --experts={args.experts}], got {args.topk}")
  if args.hidden % 16:
    p.error(f"--hidden must be a multiple of 16 (the 16-byte cases), got {args.hidden}")
  T, H, K = args.tokens, args.hidden, args.topk
  gen = torch.Generator(device="cuda").manual_seed(0)
  src = torch.randint(0, 256, (T, H), dtype=torch.uint8, device="cuda", generator=gen)
  out = torch.empty(T * K, H, dtype=torch.uint8, device="cuda")
  other = torch.empty_like(out)
  rows = slot_rows(T, K, args.experts, gen)
  token_of_row = torch.empty(T * K, dtype=torch.long, device="cuda")
  token_of_row[rows.flatten()] = torch.arange(T, device="cuda").repeat_interleave(K)
  token_seq = torch.arange(T * K, device="cuda") // K  # token-major rows: row r from r // K
  rows_k = [rows[:, k].contiguous() for k in range(K)]

  def scatter():
    for k in range(K):
      out.index_copy_(0, rows_k[k], src)

  src16, out16 = src.view(torch.complex128), out.view(torch.complex128)

  def scatter16():
    for k in range(K):
      out16.index_copy_(0, rows_k[k], src16)

  sample = torch.randint(0, T * K, (256,), device="cuda", generator=gen)

  def rows_from(source: torch.Tensor, token_of: torch.Tensor):
    """The check of a case: the sampled rows of out hold their tokens' rows of source."""
    return lambda: bool(torch.equal(out[sample], source[token_of[sample]]))

  mapped, in_order = rows_from(src, token_of_row), rows_from(src, token_seq)
  once = src.numel() + out.numel()  # the bytes of a case that reads src once and writes out
  checks = {  # name: (bytes moved, call, check after one call)
      "fill": (out.numel(), lambda: out.fill_(7), lambda: bool((out[sample] == 7).all())),
      "copy": (2 * out.numel(), lambda: other.copy_(out),
               lambda: bool(torch.equal(other[sample], out[sample]))),
      "gather": (once, lambda: torch.index_select(src, 0, token_of_row, out=out), mapped),
      "scatter": (once, scatter, mapped),
      "gather16": (once, lambda: torch.index_select(src16, 0, token_of_row, out=out16), mapped),
      "scatter16": (once, scatter16, mapped),
      "gather_seq16": (once, lambda: torch.index_select(src16, 0, token_seq, out=out16),
                       in_order),
  }
  rows_kernel = triton_rows(args.triton_warps, args.triton_block)
  if rows_kernel is None:
    print("triton: not installed, the rows_* cases are skipped", file=sys.stderr)
  else:
    src_bf16 = torch.randn(T, H, dtype=torch.bfloat16, device="cuda", generator=gen)
    want_f8 = src_bf16.to(torch.float8_e4m3fn).view(torch.uint8)
    out_f8 = out.view(torch.float8_e4m3fn)
    rows_seq = torch.arange(T * K, device="cuda").view(T, K)
    checks.update({
        "rows_seq": (once, lambda: rows_kernel(src, out, rows_seq), in_order),
        "rows_map": (once, lambda: rows_kernel(src, out, rows), mapped),
        "rows_map_bf16": (src_bf16.numel() * 2 + out.numel(),
                          lambda: rows_kernel(src_bf16, out_f8, rows),
                          rows_from(want_f8, token_of_row)),
    })
  results = []
  for name, (moved, call, check) in checks.items():
    out.zero_()
    call()
    torch.cuda.synchronize()
    if not check():
      print(f"{name}: WRONG output rows", file=sys.stderr)
      return 1
    timing = summarize(time_us(call, args.reps))
    tbps = moved / (timing["median_us"] * 1e-6) / 1e12
    results.append({"label": name, "bytes": moved, "tb_per_s": tbps, "time": timing})
    print(f"{name:8} {timing['median_us']:8.1f} us (p10-p90 {timing['p10_us']:.1f}-"
          f"{timing['p90_us']:.1f})  {moved / 1e6:7.1f} MB read + written  {tbps:5.2f} TB/s")
  payload = {
      "git_commit": args.git_commit or _git("rev-parse", "HEAD"),
      "device_kind": torch.cuda.get_device_name(),
      "torch_version": torch.__version__,
      "config": {"tokens": T, "hidden": H, "topk": K, "experts": args.experts,
                 "reps": args.reps, "triton_warps": args.triton_warps,
                 "triton_block": args.triton_block},
      "results": results,
  }
  write_json(args.out.with_suffix(".json"), payload)
  plot_time_bars(results, args.out.with_suffix(".png"), colors=["tab:gray"] * len(results),
                 notes=[f"{r['tb_per_s']:.2f} TB/s" for r in results], xlabel="us (median)",
                 title=f"write floor, {T} tokens x top-{K} rows of {H} B, "
                 f"{payload['device_kind']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
