"""Benchmarks of jax-moe against JAX collectives; run the scripts in this folder with --help."""
