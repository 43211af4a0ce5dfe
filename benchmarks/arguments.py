"""Command-line value parsers shared by the benchmark scripts (argparse `type=` callables)."""

from __future__ import annotations

import argparse


def csv_list(choices=None, convert=str):
  """A parser of "a,b,c" into [convert(a), ...], each in `choices` when given; "none" is []."""
  def parse(text: str):
    if text.strip() == "none":
      return []
    items = [convert(v.strip()) for v in text.split(",") if v.strip()]
    bad = [v for v in items if choices is not None and v not in choices]
    if bad:
      raise argparse.ArgumentTypeError(f"{bad} not in {list(choices)}")
    return items
  return parse


def phases(text: str) -> list[tuple[str, int]]:
  """"decode=128,prefill=4096" -> [("decode", 128), ("prefill", 4096)]."""
  found = []
  for item in text.split(","):
    name, sep, tokens = item.partition("=")
    if not sep or not name.strip().isidentifier() or not tokens.strip().isdigit() \
        or int(tokens) < 1:
      raise argparse.ArgumentTypeError(f"phase {item!r} must look like NAME=TOKENS_PER_RANK "
                                       "with TOKENS_PER_RANK >= 1")
    found.append((name.strip(), int(tokens)))
  return found
