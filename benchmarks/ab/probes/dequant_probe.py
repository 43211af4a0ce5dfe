"""Probe (benchmarks/ab/probes): XLA's time for formulations of dequantize_fp8 at the decode
dispatch's 1024 rows, each in a 20-step loop inside one jit (b and c are checked bit-equal to
the library's a; d and e are the floor's shape and the f32 output). A probe, not a benchmark:
what it finds goes into jax_moe/quantization.py and is timed by bench_dispatch_combine.py.
  PYTHONPATH=<an install> python3 benchmarks/ab/probes/dequant_probe.py [ROWS]"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax, jax.numpy as jnp, numpy as np
import jax_moe as jm
from benchmarks import stage_profile

rows, H, bs = int(sys.argv[1]) if len(sys.argv) > 1 else 1024, 7168, 128
x = jnp.asarray(np.random.default_rng(0).standard_normal((rows, H)), jnp.float32)
q, s = jm.quantize_fp8(x, bs)

def a(q, s):
  return jm.dequantize_fp8(q, s, jnp.bfloat16)
def b(q, s):
  return (q.astype(jnp.float32) * jnp.repeat(s, bs, axis=-1)).astype(jnp.bfloat16)
def c(q, s):
  qb = q.astype(jnp.bfloat16).astype(jnp.float32).reshape(rows, H // bs, bs)
  return (qb * s[..., None]).reshape(rows, H).astype(jnp.bfloat16)
def d(q, s):  # bf16 copy only (the floor's shape: read fp8, write bf16)
  return q.astype(jnp.bfloat16)
def e(q, s):  # f32 out
  return jm.dequantize_fp8(q, s, jnp.float32)

ref = np.asarray(jax.jit(a)(q, s)).view(np.uint16)
for name, f in dict(a=a, b=b, c=c, d=d, e=e).items():
  if name in "bc":
    got = np.asarray(jax.jit(f)(q, s)).view(np.uint16)
    print(name, "bit-equal to a:", bool((got == ref).all()))
  def loop(q, s):
    def body(i, carry):
      y, s = carry
      y = jax.lax.optimization_barrier(f(q, s + 0 * y[0, 0].astype(jnp.float32)))
      return y, s
    return jax.lax.fori_loop(0, 20, body, (f(q, s), s))[0]
  run = jax.jit(loop)
  run(q, s).block_until_ready()
  data = stage_profile.traced(lambda: run(q, s))
  for plane, entry in stage_profile.kernel_table(data, 20).items():
    for k in entry["kernels"][:3]:
      print(f"{name} {k['mean_us']:8.1f} us x{k['count']:4d} {k['name'][:60]}")
