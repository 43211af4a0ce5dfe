"""Helpers the tests share (importable as `support` through pytest's `pythonpath`, set in
pyproject.toml; worker scripts put tests/ on sys.path themselves):

  meshes             1-D meshes over the first n devices (skips where fewer exist)
  reference          the dense numpy reference of dispatch, combine and fp8 quantization
  routing_cases      routings (skewed, empty ranks, -1 slots, partial tokens) and inputs
  moe_runner         one communicator's dispatch/combine over given inputs, as numpy
  checks             dispatch-layout and combine comparisons with their stated tolerances
  all_reduce_checks  the AllReduce tests' inputs and reference sums
  hf_tiny            tiny transformers Qwen3-MoE / DeepSeek-V3 checkpoints, logits, greedy
  jobs               processes a test starts: a loopback port, bounded waits, a job of many
"""
