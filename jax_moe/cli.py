"""The `jax-moe` command: `info` (what runs here), `demo` (one MoE layer, checked) and
`generate` (expert-parallel text generation with a Qwen3-MoE or DeepSeek-V3 model).

`demo` runs dispatch -> grouped GEMM (jax_moe.grouped_gemm.ragged_dot: tokamax on Hopper where
it applies, else jax.lax.ragged_dot) -> combine on every device of the default platform with
every available backend and both combine modes, compares the output with a dense f32
computation and exits non-zero when they disagree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

_CPU_DEVICES_FLAG = "--xla_force_host_platform_device_count"
# max |out - ref| / max |ref|: bf16 expert outputs and bf16 combine output each round once
# (about 2^-9 relative); an exchange that loses or misplaces a row is off by O(1).
_PARITY_TOLERANCE = 1e-2


def _simulate_cpu_devices(count: int = 8) -> None:
  """Gives the CPU platform `count` devices unless XLA_FLAGS already sets a count.

  XLA reads XLA_FLAGS when it creates its first client, so this must run before any jax
  call that touches devices. The flag only affects the CPU platform.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if _CPU_DEVICES_FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {_CPU_DEVICES_FLAG}={count}".strip()


# ------------------------------------------------------------------------------------ info
def _info(args) -> int:
  code = _join(args, "info")
  if code is not None:
    return code
  import jax
  import jax_moe as jm
  from jax_moe import distributed

  if not distributed.is_primary():
    return 0
  print(f"jax {jax.__version__}, default platform {jax.default_backend()}")
  print(distributed.processes_summary())
  for device in jax.devices():
    print(f"  {device.id}: {device.device_kind} ({device.platform}, process "
          f"{device.process_index})")
  mesh = distributed.global_mesh()
  print(f"global mesh: {dict(mesh.shape)} over {mesh.devices.size} device(s) of "
        f"{jax.process_count()} process(es)")
  print(f"backends available: {', '.join(jm.available_backends())}")
  print("build:")
  for key, value in jm.build_info().items():
    print(f"  {key}: {value}")
  return 0


def _join(args, command: str):
  """jax.distributed from --coordinator / --num-processes / --process-id, or from the
  environment jax detects (SLURM, JAX_COORDINATOR_ADDRESS); None when ready, else an exit code."""
  from jax_moe import distributed

  try:
    distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                           init_timeout_s=args.init_timeout,
                           heartbeat_timeout_s=args.heartbeat_timeout)
  except Exception as e:  # noqa: BLE001 - jax raises RuntimeError / ValueError / XlaRuntimeError
    print(f"jax-moe {command}: error: joining the job failed: {type(e).__name__}: {e}",
          file=sys.stderr)
    return 2
  return None


def _add_distributed_arguments(parser) -> None:
  group = parser.add_argument_group(
      "multi-process", "with none of these, jax.distributed starts only where it detects a job "
      "(SLURM, Open MPI, JAX_COORDINATOR_ADDRESS); see docs/multi-node.md")
  group.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                     help="address of process 0's coordinator (every process gives the same)")
  group.add_argument("--num-processes", type=int, default=None, help="processes in the job")
  group.add_argument("--process-id", type=int, default=None, help="this process, 0-based")
  group.add_argument("--init-timeout", type=int, default=300,
                     help="seconds to wait for every process to join")
  group.add_argument("--heartbeat-timeout", type=int, default=100,
                     help="seconds without a heartbeat after which jax.distributed ends every "
                          "process of the job (a process that died)")


# ------------------------------------------------------------------------------------ demo
def _make_inputs(args, num_ranks: int):
  """Random bf16 tokens, a softmax top-k router and per-expert weights, all global arrays."""
  import jax
  import jax.numpy as jnp

  n = num_ranks * args.tokens
  kx, kr, kw = jax.random.split(jax.random.key(args.seed), 3)
  x = jax.random.normal(kx, (n, args.hidden), jnp.float32).astype(jnp.bfloat16)
  logits = jax.random.normal(kr, (n, args.experts), jnp.float32)
  probs, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), args.topk)
  weights = probs / probs.sum(axis=-1, keepdims=True)
  w = (jax.random.normal(kw, (args.experts, args.hidden, args.hidden), jnp.float32)
       / jnp.sqrt(jnp.float32(args.hidden))).astype(jnp.bfloat16)
  return x, ids.astype(jnp.int32), weights, w


def _dense_reference(x, ids, weights, w, fp8: bool, block_size: int):
  """out[t] = sum_k weights[t, k] * (x[t] @ w[ids[t, k]]) in f32, expert by expert."""
  import numpy as np
  import jax
  import jax.numpy as jnp
  import jax_moe as jm

  if fp8:
    # The experts see what dispatch delivers: the tokens quantized as docs/semantics.md says.
    # Quantize on XLA:CPU, which follows it; XLA:GPU rounds a few fp8 codes differently.
    x_cpu = jax.device_put(x, jax.devices("cpu")[0])
    x = jm.dequantize_fp8(*jm.quantize_fp8(x_cpu, block_size), dtype=jnp.float32)
  x = np.asarray(x, np.float32)
  ids, weights, w = np.asarray(ids), np.asarray(weights), np.asarray(w)
  out = np.zeros_like(x)
  for expert in range(w.shape[0]):
    tokens, slots = np.nonzero(ids == expert)
    y = x[tokens] @ w[expert].astype(np.float32)
    np.add.at(out, tokens, weights[tokens, slots, None] * y)
  return out


def _config(args, combine_reduce: str, num_ranks: int):
  import jax.numpy as jnp
  import jax_moe as jm

  cfg = jm.MoEConfig(num_experts=args.experts, experts_per_token=args.topk,
                     hidden=args.hidden, max_tokens=args.tokens,
                     dispatch_dtype=jnp.float8_e4m3fn if args.dispatch_dtype == "fp8"
                     else jnp.bfloat16,
                     block_size=args.block_size, combine_reduce=combine_reduce)
  cfg.capacity(num_ranks)  # checks that the experts split evenly over the ranks
  return cfg


def _moe_layer(comm):
  """The per-shard MoE layer: dispatch, grouped GEMM on the local experts, combine."""
  import jax
  import jax.numpy as jnp
  import jax_moe as jm
  from jax_moe import grouped_gemm

  def layer(x, ids, weights, w_local):
    r = comm.dispatch(x, ids, weights)
    rows = jm.dequantize_fp8(r.x, r.scales, jnp.bfloat16) if comm.cfg.is_fp8 else r.x
    y = grouped_gemm.ragged_dot(rows, w_local, r.group_sizes, preferred_element_type=jnp.float32)
    return comm.combine(y.astype(jnp.bfloat16), r.handle)

  return layer


def _mean_seconds(fn, inputs, warmup: int, iters: int) -> float:
  for _ in range(warmup):
    fn(*inputs).block_until_ready()
  start = time.perf_counter()
  for _ in range(iters):
    out = fn(*inputs)
  out.block_until_ready()
  return (time.perf_counter() - start) / iters


def _demo(args) -> int:
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import jax_moe as jm
  from jax_moe.sharding import shard_map

  devices = jax.devices()
  mesh = Mesh(np.array(devices), ("ep",))
  print(f"{len(devices)} {jax.default_backend()} devices on axis 'ep'; {args.experts} experts, "
        f"top-{args.topk}, hidden {args.hidden}, {args.tokens} tokens per rank, "
        f"{args.dispatch_dtype} dispatch")
  try:  # the config checks the flags; report them without a traceback
    configs = [_config(args, reduce, len(devices)) for reduce in ("source", "expert")]
  except ValueError as e:
    print(f"jax-moe demo: error: {e}", file=sys.stderr)
    return 2

  x, ids, weights, w = _make_inputs(args, len(devices))
  ref = _dense_reference(x, ids, weights, w, configs[0].is_fp8, args.block_size)
  ref_scale = float(np.max(np.abs(ref)))
  sharded = NamedSharding(mesh, P("ep"))
  inputs = [jax.device_put(a, sharded) for a in (x, ids, weights, w)]

  failures = 0
  for backend in jm.available_backends():
    for cfg in configs:
      with jm.Communicator(cfg, mesh, axis="ep", backend=backend) as comm:
        step = jax.jit(shard_map(_moe_layer(comm), mesh, in_specs=(P("ep"),) * 4,
                                  out_specs=P("ep")))
        out = np.asarray(step(*inputs), np.float32)
        comm.check()
        seconds = _mean_seconds(step, inputs, args.warmup, args.iters)
        comm.check()
      error = float(np.max(np.abs(out - ref))) / ref_scale
      ok = error <= _PARITY_TOLERANCE
      failures += not ok
      print(f"  {backend:5s} combine_reduce={cfg.combine_reduce:6s}  "
            f"max|out-ref|/max|ref| = {error:.2e} {'ok' if ok else 'FAIL'}  "
            f"{seconds * 1e3:8.3f} ms per layer call")
  if failures:
    print(f"parity FAILED in {failures} run(s) (tolerance {_PARITY_TOLERANCE:.0e})",
          file=sys.stderr)
    return 1
  return 0


# ------------------------------------------------------------------------------------ generate
def _say(*args, **kwargs) -> None:
  """print on process 0 only (every process runs the same program)."""
  from jax_moe import distributed

  if distributed.is_primary():
    print(*args, **kwargs, flush=True)


def _error(message: str) -> None:
  import jax

  where = f" (process {jax.process_index()})" if jax.process_count() > 1 else ""
  print(f"jax-moe generate: error{where}: {message}", file=sys.stderr, flush=True)


def _prompts(args, tok):
  """(prompt id lists, whether they are text) from --prompt / --prompt-file / --prompt-ids;
  None when none is given (random prompts)."""
  texts = list(args.prompt or [])
  for path in args.prompt_file or []:
    with open(path) as f:
      texts += [line.rstrip("\n") for line in f if line.strip()]
  ids = []
  for spec in args.prompt_ids or []:
    try:
      ids.append([int(t) for t in spec.replace(" ", "").split(",") if t])
    except ValueError:
      raise ValueError(f"--prompt-ids takes comma-separated integers, got {spec!r}") from None
  if not texts and not ids:
    return None, False
  if texts and tok is None:
    raise ValueError(f"{args.model}: no tokenizer.json, so text prompts cannot be tokenized "
                     "(give --prompt-ids)")
  return [tok.encode(t, chat=args.chat) for t in texts] + ids, bool(texts)


def _prepare_inputs(args):
  """Everything a process reads from its own disk, before any process allocates: the
  checkpoint's config and tensor index, the tokenizer, the prompts. Returns a dict."""
  from jax_moe import models
  from jax_moe.models import loader, tokenizer

  if args.model in models.TINY_CONFIGS:
    config = models.TINY_CONFIGS[args.model]
    reader, tok = None, tokenizer.embedded(config["vocab_size"])
  else:
    reader = loader.CheckpointReader(args.model)
    config, tok = reader.config, tokenizer.from_checkpoint(args.model)
  prompts, is_text = _prompts(args, tok)
  return dict(config=config, reader=reader, tok=tok, prompts=prompts, is_text=is_text)


def _build_model(args, reader, mesh):
  """(model, description) of --model: an embedded tiny config or a checkpoint directory."""
  import jax.numpy as jnp
  from jax_moe import distributed, models
  from jax_moe.models import loader

  kwargs = dict(mesh=mesh, backend=args.backend, wire=args.wire,
                expert_weights=args.expert_weights,
                dtype={"bf16": jnp.bfloat16, "f32": jnp.float32}[args.dtype])
  if reader is None:
    return (models.tiny(args.model, seed=args.seed, **kwargs),
            f"{args.model} (embedded config, random weights, seed {args.seed})")
  model = models._build(reader.config, kwargs.pop("mesh"), None, kwargs["backend"],
                        kwargs["dtype"], kwargs["wire"], kwargs["expert_weights"])
  return loader.load_weights(model, reader, progress=distributed.is_primary()), args.model


class _Printer:
  """Streams sequence 0's text as it is generated; the other sequences print when done."""

  def __init__(self, tok, count: int, enabled: bool):
    self.tok, self.enabled = tok, enabled and tok is not None
    self.streams = [tok.stream() for _ in range(count)] if self.enabled else []
    if self.enabled:
      print("text 0: ", end="", flush=True)

  def __call__(self, sequence: int, token: int) -> None:
    if self.enabled and sequence == 0:
      piece = self.streams[0].add(token)
      if piece:
        print(piece, end="", flush=True)

  def finish(self, tokens) -> None:
    if not self.enabled:
      return
    print(self.streams[0].flush(), flush=True)
    for i, ids in enumerate(tokens[1:], 1):
      print(f"text {i}: {self.tok.decode(ids)}", flush=True)


def _comm_failure(e, mesh) -> str:
  """A CommError, with the process that holds the peer rank it names."""
  import jax_moe as jm

  message = f"{type(e).__name__}: {e}"
  if isinstance(e, jm.CommError) and e.code == jm.ErrorCode.TIMEOUT:
    devices = list(mesh.devices.flat)
    if 0 <= e.detail < len(devices):
      message += (f"; rank {e.detail} (process {devices[e.detail].process_index}) did not "
                  f"answer within JAX_MOE_TIMEOUT_S: that process died or is stuck")
  return message


def _watch_peers(pool, mesh, interval_s: float = 0.5):
  """A thread that, while generation runs, checks the communicators and (across processes)
  the other processes' heartbeats every `interval_s`.

  A peer that dies mid-step leaves this process either in an exchange that times out (a
  recorded CommError) or blocked in an XLA collective with it (gloo on CPU: no timeout); the
  main thread may never return, so the error is reported from here and the process ends with
  exit code 1: the recorded CommError, or the processes whose heartbeat stopped for
  JAX_MOE_TIMEOUT_S. Returns the Event that stops it.
  """
  import jax
  import jax_moe as jm
  from jax_moe import distributed, settings

  stop = threading.Event()
  liveness = distributed.Liveness() if jax.process_count() > 1 else None
  after_s = settings.timeout_s()

  def fail(message):
    print(file=sys.stderr)
    _error(message)
    distributed.exit_now(1)

  def watch():
    while not stop.wait(interval_s):
      try:
        pool.check()
        if liveness is not None:
          liveness.beat()
          dead = liveness.stale(after_s)
          if dead:
            time.sleep(interval_s)  # a CommError recorded meanwhile says more
            pool.check()
            ranks = {p: [r for r, d in enumerate(mesh.devices.flat) if d.process_index == p]
                     for p in dead}
            fail("; ".join(f"process {p} (ranks {ranks[p]}) stopped answering: no heartbeat "
                           f"for {after_s:g} s (JAX_MOE_TIMEOUT_S); it died or is frozen"
                           for p in dead))
      except jm.CommError as e:
        fail(_comm_failure(e, mesh))
      except Exception as e:  # noqa: BLE001 - the coordinator itself gone
        if not stop.is_set():
          fail(f"lost the job's coordinator: {type(e).__name__}: {e}")

  if liveness is not None:
    liveness.beat()
  threading.Thread(target=watch, name="jax-moe-peer-watch", daemon=True).start()
  return stop


def _generate(args) -> int:
  code = _join(args, "generate")
  if code is not None:
    return code
  import jax
  import numpy as np
  import jax_moe as jm
  from flax import nnx
  from jax_moe import distributed, models
  from jax_moe.models.generation import PromptGenerator

  start = time.perf_counter()
  primary = distributed.is_primary()
  # What each process reads from its own disk; every process hears of any failure, so none
  # is left waiting for the others.
  inputs, failure = None, ""
  try:
    inputs = _prepare_inputs(args)
  except (models.CheckpointError, NotImplementedError, ValueError, OSError) as e:
    failure = str(e)
  failures = distributed.agree(not failure, failure, "generate_inputs")
  if failures:
    for process, message in failures:
      _error(message if jax.process_count() == 1 else f"process {process}: {message}")
    return 2
  tok, prompts = inputs["tok"], inputs["prompts"]
  mesh = distributed.global_mesh()
  if args.tp < 1 or mesh.devices.size % args.tp:
    _error(f"--tp {args.tp} must be >= 1 and divide the {mesh.devices.size} devices")
    return 2
  if args.tp > 1:  # tp groups of consecutive devices (one process's, where they fit)
    mesh = jax.sharding.Mesh(mesh.devices.reshape(-1, args.tp), models.TP_MESH_AXES)
  random_prompts = prompts is None
  if random_prompts:  # the benchmark: random ids, every sequence runs max_new_tokens
    batch = args.batch or mesh.devices.size // args.tp
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, inputs["config"]["vocab_size"], (batch, args.prompt_len)).tolist()
  try:
    model, source = _build_model(args, inputs["reader"], mesh)
    generator = PromptGenerator(model, prompts, args.max_new_tokens, args.temperature,
                                args.top_p)
  except (models.CheckpointError, NotImplementedError, ValueError) as e:
    _error(str(e))
    return 2
  jax.block_until_ready(nnx.state(model, nnx.Param))
  _say(f"model: {source}, {type(model).__name__}, built in {time.perf_counter() - start:.1f} s")
  if jax.process_count() > 1:
    _say(f"processes: {distributed.processes_summary()}")
  _say(f"layout: {model.layout()}")
  eos = () if (args.ignore_eos or random_prompts or tok is None) else tok.eos_ids
  try:
    generator.warmup()  # compiles prefill and the decode step
    printer = _Printer(tok, len(prompts), primary and not random_prompts)
    watching = _watch_peers(model.pool, mesh)
    done = generator.run(seed=args.seed, eos_ids=eos, on_token=printer)
    watching.set()
  except jm.CommError as e:
    print(file=sys.stderr)
    _error(_comm_failure(e, mesh))
    distributed.exit_now(1)  # a dead peer: jax.distributed's shutdown would wait for it
  printer.finish(done.tokens)
  distributed.barrier("generate_done")  # no peer still writes into this process's buffers
  model.pool.close()
  n = len(prompts)
  lengths = [len(p) for p in prompts]
  sampling = ("greedy" if args.temperature == 0 else
              f"temperature {args.temperature}, top-p {args.top_p}")
  prompt_desc = (f"prompt {lengths[0]} tokens" if len(set(lengths)) == 1 else
                 f"prompts {min(lengths)}-{max(lengths)} tokens")
  _say(f"batch {n}, {prompt_desc}, up to {args.max_new_tokens} new tokens ({sampling})")
  prefill_tokens = n * min(lengths)
  _say(f"prefill: {done.prefill_s * 1e3:.2f} ms ({prefill_tokens / done.prefill_s:.0f} tokens/s)")
  decode_tps = n * done.decode_steps / done.decode_s if done.decode_steps else 0.0
  if done.decode_steps:
    _say(f"decode: {done.decode_s / done.decode_steps * 1e3:.2f} ms per step, "
         f"{decode_tps:.1f} tokens/s (batch {n})")
  if not printer.enabled:
    for i in range(n if not random_prompts else 1):
      _say(f"sequence {i}: {prompts[i] + done.tokens[i]}")
    if tok is not None and random_prompts:
      _say(f"text 0: {tok.decode(done.tokens[0])!r}")
  if args.json:
    _say(json.dumps({
        "tokens": done.tokens, "text": [tok.decode(t) for t in done.tokens] if tok else None,
        "prompt_tokens": prompts, "stopped": done.stopped,
        "prefill_ms": done.prefill_s * 1e3, "decode_tokens_per_s": decode_tps,
        "backend": model.pool.backend_name, "mesh": dict(mesh.shape),
        "devices": int(mesh.devices.size), "processes": jax.process_count()}))
  return 0


# ------------------------------------------------------------------------------------ main
def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="jax-moe", description=__doc__.splitlines()[0])
  commands = parser.add_subparsers(dest="command", required=True)
  info = commands.add_parser("info", help="jax version, processes, devices, global mesh, "
                                         "available backends, build info")
  _add_distributed_arguments(info)
  demo = commands.add_parser(
      "demo", help="dispatch -> ragged_dot experts -> combine, checked against a dense f32 layer",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  demo.add_argument("--experts", type=int, default=64, help="number of experts")
  demo.add_argument("--topk", type=int, default=4, help="experts per token")
  demo.add_argument("--hidden", type=int, default=1024, help="hidden size")
  demo.add_argument("--tokens", type=int, default=64, help="tokens per rank")
  demo.add_argument("--dispatch-dtype", choices=("fp8", "bf16"), default="fp8",
                    help="fp8: e4m3fn with block scales, quantized on the source rank")
  demo.add_argument("--block-size", type=int, default=128, help="fp8 scale block")
  demo.add_argument("--warmup", type=int, default=2, help="untimed calls after compiling")
  demo.add_argument("--iters", type=int, default=5, help="timed calls")
  demo.add_argument("--seed", type=int, default=0, help="random inputs and expert weights")
  generate = commands.add_parser(
      "generate", help="expert-parallel generation: prefill latency, decode tokens/s, layout",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  generate.add_argument("--model", default="tiny-qwen3-moe",
                        help="a Hugging Face model directory (config.json + safetensors), or "
                             "tiny-qwen3-moe / tiny-deepseek-v3 (embedded config, random weights)")
  generate.add_argument("--backend", default="auto", help="MoE exchange: auto, xla, cuda or host")
  generate.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
  generate.add_argument("--wire", choices=("bf16", "fp8", "exact"), default=None,
                        help="how MoE tokens travel (default: exact for f32, bf16 otherwise)")
  generate.add_argument("--expert-weights", choices=("dtype", "fp8"), default="dtype",
                        help="routed experts' weights: in --dtype (block-fp8 checkpoint weights "
                             "dequantized on load) or block-fp8 codes and scales fed to the "
                             "grouped GEMM (others quantized on load)")
  generate.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel group size: attention heads, dense MLPs and "
                             "shared experts split over N devices, devices / N data-parallel "
                             "groups, routed experts over all devices")
  generate.add_argument("--batch", type=int, default=0,
                        help="random prompts: sequences (default: one per data-parallel "
                             "group, i.e. per device without --tp)")
  generate.add_argument("--prompt-len", type=int, default=16,
                        help="random prompts: tokens each (when no prompt is given)")
  prompts = generate.add_argument_group(
      "prompts", "any number, of any lengths (one sequence each); without any, random ids "
      "(--batch, --prompt-len) and every sequence runs --max-new-tokens (a benchmark)")
  prompts.add_argument("--prompt", action="append", metavar="TEXT",
                       help="a text prompt, tokenized with the checkpoint's tokenizer.json "
                            "(the embedded models have their own); repeatable")
  prompts.add_argument("--prompt-file", action="append", metavar="FILE",
                       help="one text prompt per non-empty line; repeatable")
  prompts.add_argument("--prompt-ids", action="append", metavar="1,2,3",
                       help="a prompt of token ids; repeatable")
  prompts.add_argument("--chat", action="store_true",
                       help="wrap each text prompt in the chat template (tokenizer_config.json) "
                            "as one user message")
  generate.add_argument("--max-new-tokens", type=int, default=16)
  generate.add_argument("--ignore-eos", action="store_true",
                        help="do not stop a sequence at an end-of-sequence id")
  generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
  generate.add_argument("--top-p", type=float, default=1.0)
  generate.add_argument("--seed", type=int, default=0, help="weights, prompt and sampling")
  generate.add_argument("--json", action="store_true",
                        help="end with one line of JSON: tokens, text, prefill_ms, "
                             "decode_tokens_per_s, backend, mesh")
  _add_distributed_arguments(generate)
  return parser


def main(argv: list[str] | None = None) -> int:
  _simulate_cpu_devices()
  args = _parser().parse_args(argv)
  return {"info": _info, "demo": _demo, "generate": _generate}[args.command](args)


if __name__ == "__main__":
  sys.exit(main())
