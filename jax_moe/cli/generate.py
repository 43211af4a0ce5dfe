"""`jax-moe generate`: expert-parallel text generation with a Qwen3-MoE or DeepSeek-V3 model,
on one process or a jax.distributed job (docs/multi-node.md)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

from jax_moe.cli import common


def add_parser(commands) -> None:
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
  generate.add_argument("--overlap-shared-experts", action="store_true",
                        help="run the shared experts (DeepSeek-V3's) between the halves of "
                             "each MoE layer's dispatch, while the routed rows travel; the "
                             "same tokens. Off by default: the gain is not measured yet")
  generate.add_argument("--fuse-shared-experts", action="store_true",
                        help="run DeepSeek-V3's shared expert as one more expert slot of every "
                             "token, in the routed experts' grouped GEMMs (bf16 or fp8 wire, "
                             "--tp 1)")
  generate.add_argument("--two-batch-overlap", action="store_true",
                        help="run the batch as two micro-batches, one's layers while the "
                             "other's dispatch travels (needs an even number of sequences per "
                             "shard, else one batch). Off by default: the gain is not "
                             "measured yet")
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
  generate.add_argument("--steps-per-call", type=int, default=None,
                        help="decode steps each device call runs, a loop on the device; tokens "
                             "stream in groups of this many (None: "
                             "jax_moe.models.generation.STEPS_PER_CALL)")
  generate.add_argument("--ignore-eos", action="store_true",
                        help="do not stop a sequence at an end-of-sequence id")
  generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
  generate.add_argument("--top-p", type=float, default=1.0)
  generate.add_argument("--seed", type=int, default=0, help="weights, prompt and sampling")
  generate.add_argument("--json", action="store_true",
                        help="end with one line of JSON: tokens, text, prefill_ms, "
                             "decode_tokens_per_s, backend, mesh")
  common.add_distributed_arguments(generate)
  generate.set_defaults(run=run)


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
                overlap_shared_experts=args.overlap_shared_experts,
                two_batch_overlap=args.two_batch_overlap,
                fuse_shared_experts=args.fuse_shared_experts,
                dtype={"bf16": jnp.bfloat16, "f32": jnp.float32}[args.dtype])
  if reader is None:
    return (models.tiny(args.model, seed=args.seed, **kwargs),
            f"{args.model} (embedded config, random weights, seed {args.seed})")
  model = models._build(reader.config, kwargs.pop("mesh"), None, kwargs["backend"],
                        kwargs["dtype"], kwargs["wire"], kwargs["expert_weights"],
                        overlap_shared_experts=kwargs["overlap_shared_experts"],
                        two_batch_overlap=kwargs["two_batch_overlap"],
                        fuse_shared_experts=kwargs["fuse_shared_experts"])
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


def _timeout_peer_process(e, mesh):
  """The process holding the peer rank a TIMEOUT CommError names, else None."""
  import jax_moe as jm

  devices = list(mesh.devices.flat)
  if isinstance(e, jm.CommError) and e.code == jm.ErrorCode.TIMEOUT and \
      0 <= e.detail < len(devices):
    return devices[e.detail].process_index
  return None


def _comm_failure(e, mesh) -> str:
  """A CommError, with the process that holds the peer rank it names."""
  message = f"{type(e).__name__}: {e}"
  process = _timeout_peer_process(e, mesh)
  if process is not None:
    message += (f"; rank {e.detail} (process {process}) did not answer within "
                f"JAX_MOE_TIMEOUT_S: that process died or is stuck")
  return message


def _root_cause(e, pool, mesh, wait_s: float):
  """`e`, or the error it is a consequence of. A TIMEOUT on a rank of this process means that
  rank was itself waiting, on a peer it will name when its own wait ends: checked mid-step
  (the watch thread), that record may not exist yet, so wait up to wait_s + 1 s for it."""
  import jax
  import jax_moe as jm

  deadline = time.monotonic() + wait_s + 1
  while (_timeout_peer_process(e, mesh) == jax.process_index()
         and time.monotonic() < deadline):
    time.sleep(0.1)
    try:
      pool.check()
    except jm.CommError as later:
      e = later
  return e


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
        fail(_comm_failure(_root_cause(e, pool, mesh, after_s), mesh))
      except Exception as e:  # noqa: BLE001 - the coordinator itself gone
        if not stop.is_set():
          fail(f"lost the job's coordinator: {type(e).__name__}: {e}")

  if liveness is not None:
    liveness.beat()
  threading.Thread(target=watch, name="jax-moe-peer-watch", daemon=True).start()
  return stop


def run(args) -> int:
  code = common.join(args, "generate")
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
                                args.top_p, **({} if args.steps_per_call is None else
                                               {"steps_per_call": args.steps_per_call}))
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
