"""One of the two processes of bench_host_remote.py (started by it, not meant to be run by hand).

  python benchmarks/host_remote_worker.py CONFIG.json PROCESS_ID PORT RESULT.json

Joins jax.distributed on 127.0.0.1:PORT with CONFIG's devices_per_process CPU devices (or, on
platform cuda, GPU PROCESS_ID), then per phase, dispatch dtype and combine mode: checks
CONFIG's backend's fused dispatch+combine against the dense reference (`host`, or on GPUs
`cuda-proxy`: the cuda backend through its host proxies), times its ops, times a bare
TransferEngine moving the same bytes to the other process (benchmarks/raw_exchange.py) and,
if asked, the xla backend and (on GPUs) the cuda backend over CUDA IPC / NVLink. Writes its
own timings to RESULT.json ({"ok", "error", "records"}); the parent merges both processes'.
The provider comes from JAX_MOE_HOST_PROVIDER / JAX_MOE_HOST_NODE (set by the parent).
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
import pickle
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `jax_moe` importable
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

INIT_TIMEOUT_S = 60
BARRIER_TIMEOUT_MS = 120_000


def configure(config: dict, process_id: int) -> None:
  """Before jax is imported: GPU `process_id` modulo the GPUs asked for, or CPU devices and
  this process on its own core when asked."""
  if config["platform"] == "cuda":
    os.environ["CUDA_VISIBLE_DEVICES"] = str(process_id % config.get("gpus", 2))
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return
  os.environ["JAX_PLATFORMS"] = "cpu"
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  count = config["devices_per_process"]
  os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={count}"])
  if config["pin"]:
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[process_id % len(cores)]})


class Meeting:
  """Barriers at the jax.distributed coordinator, and an exchange of bytes between the two
  workers through `folder` (the launcher's, on the one machine both run on)."""

  def __init__(self, folder: Path):
    from jax_moe.backends.ranks import distributed_client
    self.client = distributed_client("bench_host_remote")
    self.folder = folder
    self._count = 0

  def barrier(self, what: str) -> None:
    self._count += 1
    self.client.wait_at_barrier(f"bench_host_remote_{self._count}_{what}", BARRIER_TIMEOUT_MS)

  def exchange(self, key: str, mine: bytes, process_id: int, peer: int) -> bytes:
    """`mine` for the peer's bytes under `key`. The bytes go through a file (a gathered
    prefill output is hundreds of MB; through the key-value store, hex in 1 MB values, that
    took minutes), the store only says the file is complete."""
    path = self.folder / f"exchange_{key}_{process_id}"
    path.with_suffix(".part").write_bytes(mine)
    path.with_suffix(".part").rename(path)
    self.client.key_value_set(f"bench_host_remote/{key}/{process_id}", "written")
    self.client.blocking_key_value_get(f"bench_host_remote/{key}/{peer}", BARRIER_TIMEOUT_MS)
    theirs = self.folder / f"exchange_{key}_{peer}"
    data = theirs.read_bytes()
    # Both have read what they need once both say so; then the files go (they are large).
    self.client.key_value_set(f"bench_host_remote/{key}/{process_id}/read", "read")
    self.client.blocking_key_value_get(f"bench_host_remote/{key}/{peer}/read", BARRIER_TIMEOUT_MS)
    path.unlink()
    return data


def run(config: dict, process_id: int, port: int, folder: Path) -> list[dict]:
  import jax

  address = f"127.0.0.1:{port}"
  # Short timeouts where this jax takes them: a dead peer ends the run in seconds.
  options = dict(coordinator_bind_address=address, initialization_timeout=INIT_TIMEOUT_S,
                 heartbeat_timeout_seconds=30, shutdown_timeout_seconds=30)
  accepted = inspect.signature(jax.distributed.initialize).parameters
  jax.distributed.initialize(coordinator_address=address, num_processes=2, process_id=process_id,
                             local_device_ids=list(range(config["devices_per_process"])),
                             **{k: v for k, v in options.items() if k in accepted})
  records = _run(config, process_id, folder)
  jax.distributed.shutdown()  # not after an error: it would wait for the peer
  return records


def _run(config: dict, process_id: int, folder: Path) -> list[dict]:
  import dataclasses

  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding

  import jax_moe as jm
  from benchmarks import methods, raw_exchange, reference, remote_traffic, stage_profile
  from benchmarks.environment import AXIS, SHARDED
  from benchmarks.problem import Shape, make_inputs, traffic
  from benchmarks.timing import loop_program, per_step, summarize, wall_time
  from jax_moe import settings, transport

  peer = 1 - process_id
  meeting = Meeting(folder)
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = Mesh(np.array(devices), (AXIS,))
  R = mesh.devices.size
  sharding = NamedSharding(mesh, SHARDED)

  def global_array(host: np.ndarray) -> jax.Array:
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

  gathers = itertools.count()

  def gathered(tree):
    """Every process's shards of `tree`, as numpy arrays of the global shape, through the
    coordinator's key-value store: a collective (process_allgather) would take NCCL on GPUs,
    which refuses two processes on one GPU (--gpus 1)."""
    leaves, treedef = jax.tree.flatten(tree)
    call = next(gathers)
    full = []
    for i, leaf in enumerate(leaves):
      mine = [(shard.index, np.asarray(shard.data)) for shard in leaf.addressable_shards]
      theirs = pickle.loads(meeting.exchange(f"gather_{call}_{i}", pickle.dumps(mine),
                                             process_id, peer))
      array = np.empty(leaf.shape, leaf.dtype)
      for index, data in mine + theirs:
        array[index] = data
      full.append(array)
    return jax.tree.unflatten(treedef, full)

  def per_iteration(run, what: str, short: int, long_: int) -> dict:
    """Median and spread of (t(n_long) - t(n_short)) / (n_long - n_short) in microseconds;
    every run starts at a barrier so neither process waits for the other inside it."""
    samples = []
    for rep in range(config["reps"]):
      meeting.barrier(f"{what}_{rep}_short")
      t_short = run(short)
      meeting.barrier(f"{what}_{rep}_long")
      t_long = run(long_)
      samples.append((t_long - t_short) / (long_ - short) * 1e6)
    return {**summarize(samples), "n_short": short, "n_long": long_, "reps": config["reps"]}

  def raw_timer(run, what: str) -> dict:
    return per_iteration(run, what, config["raw_short_iters"], config["raw_iters"])

  def time_method(method, comm, tokens_in, ids, weights, what: str) -> dict:
    """Checks `method`'s single exchange against the reference, then times it."""
    record = method.record()
    steps = config["steps_per_iteration"]
    program = loop_program(mesh, method.init, method.body, method.final, steps)
    call = lambda n: program(tokens_in, ids, weights, np.int32(n))  # noqa: E731
    # Compile in both processes before either runs: a rank must not wait for a peer that is
    # still compiling (its waits time out).
    program.lower(tokens_in, ids, weights, np.int32(0)).compile()
    meeting.barrier(f"{what}_compiled")
    _, out = wall_time(call, 0)
    comm.check()
    with jax.default_device(jax.local_devices()[0]):
      record["correctness"] = method.check(gathered(out), 0)
    if not record["correctness"]["passed"]:
      record.update(status="failed", reason="differs from the reference; not timed")
      return record
    timing = per_iteration(lambda n: wall_time(call, n)[0], what, config["short_iters"],
                           config["iters"])
    record["time"] = {**per_step(timing, steps), "steps_per_iteration": steps}
    if config["trace_iters"] and method.op == "fused":
      # Both processes trace the same calls, so neither waits inside the other's trace.
      meeting.barrier(f"{what}_trace")
      loops = -(-config["trace_iters"] // steps)  # at least --trace-iters exchanges
      record["kernels"] = stage_profile.kernel_table(stage_profile.traced(lambda: call(loops)),
                                                     loops * steps)
    comm.check()
    record["status"] = "ok"
    return record

  # The raw engine: rank = process index, one destination region sized for the largest phase;
  # in device memory when the cuda proxies move their rows there (JAX_MOE_PROXY_HMEM), so both
  # move the same bytes between the same kinds of memory.
  raw_on_device = config["platform"] == "cuda" and settings.proxy_rows_device_from_remote(
      transport.registers_cuda_memory)
  engine = transport.TransferEngine(process_id, provider=settings.host_provider(),
                                    node=settings.host_node() or None,
                                    domains=settings.host_domains(), cuda_memory=raw_on_device)
  peer_card = meeting.exchange("card", engine.address, process_id, peer)
  engine.add_peer(peer_card)

  records = []
  for phase, tokens in config["phases"]:
    base = Shape(ranks=R, tokens=tokens, hidden=config["hidden"], experts=config["experts"],
                 topk=config["topk"], fp8=False, block_size=config["block_size"])
    inputs = make_inputs(base, config["routing"], config["seed"])  # the same in every process
    ids, weights = global_array(inputs.topk_ids), global_array(inputs.topk_weights)
    for dtype in config["dispatch_dtypes"]:
      shape = dataclasses.replace(base, fp8=dtype == "fp8")
      expected = reference.expected(shape, inputs)
      ctx = methods.Context(mesh=mesh, shape=shape, inputs=inputs, expected=expected,
                            traffic=traffic(shape, inputs), combined=expected.combined,
                            bound=expected.bound)
      tokens_in = (global_array(expected.rows), global_array(expected.scales)) if shape.fp8 \
          else global_array(inputs.x)
      for reduce in config["reduce"]:
        key = f"{phase}_{dtype}_{reduce}"
        found = {"phase": phase, "tokens_per_rank": tokens, "dispatch_dtype": dtype,
                 "reduce": reduce, "process": process_id}
        partial = methods.PARTIAL_DTYPES[config["partial_dtype"]]
        directions = remote_traffic.directions(
            inputs.topk_ids, R, config["devices_per_process"], config["experts"],
            config["hidden"], shape.fp8, config["block_size"], reduce,
            np.dtype(partial).itemsize)
        found["traffic"] = [d.record() for d in directions]

        backend = config["backend"]
        comm = methods.make_communicator(ctx, backend, reduce, config["partial_dtype"], 1)
        try:
          found["jax_moe"] = {}
          for method in methods.jax_moe_methods(ctx, comm, tuple(config["ops"]), name=backend):
            found["jax_moe"][method.op] = time_method(method, comm, tokens_in, ids, weights,
                                                      f"{key}_{backend}_{method.op}")
            _log(process_id, key, f"{backend} {method.op}", found["jax_moe"][method.op])
          if backend in methods.FORCED_REMOTE:
            found["proxy"] = proxy_summary(comm._backend._ranks.proxy_samples())
        finally:
          comm.close()

        found["raw"] = _time_raw(engine, meeting, process_id, peer, directions, raw_timer, key,
                                 raw_exchange, raw_on_device)
        for mode, record in found["raw"].items():
          _log(process_id, key, f"raw {mode} ({record['memory']} memory)", record)

        for other in config["others"]:  # fused only, for context
          comm = methods.make_communicator(ctx, other, reduce, config["partial_dtype"], 1)
          try:
            (method,) = methods.jax_moe_methods(ctx, comm, ("fused",), name=other)
            found[other] = time_method(method, comm, tokens_in, ids, weights, f"{key}_{other}")
            _log(process_id, key, f"{other} fused", found[other])
          except jm.CommError as e:
            found[other] = {"status": "failed", "reason": f"CommError: {e}"}
          finally:
            comm.close()
        records.append(found)
  meeting.barrier("finished")  # no peer still writes into this process's regions
  engine.close()
  return records


def proxy_summary(samples_by_ordinal: dict) -> dict:
  """Per request kind (the CPU phases a half's kernel sits between, ffi/cuda/host_proxy.cc:
  "begin" checks the call order and waits, "end" publishes and posts the writes or the
  acknowledgement), over every request this process's proxy served (compile and check runs
  included): medians of doorbell seen -> first remote write posted (`first_post_us`, over
  requests that posted one), doorbell seen -> done (`serve_us`), and the previous request's
  answer -> this doorbell seen (`since_answer_us`: the GPU's part before this request, its
  kernels and its wait for the GPU when processes share one)."""
  import numpy as np

  by_op = {}
  for samples in samples_by_ordinal.values():
    for op, first_post_ns, serve_ns, since_answer_ns in samples:
      entry = by_op.setdefault(op, {"first_post": [], "serve": [], "since_answer": []})
      if first_post_ns >= 0:
        entry["first_post"].append(first_post_ns / 1e3)
      if since_answer_ns >= 0:
        entry["since_answer"].append(since_answer_ns / 1e3)
      entry["serve"].append(serve_ns / 1e3)
  median = lambda v: float(np.median(v)) if v else None  # noqa: E731
  return {op: {"requests": len(v["serve"]), "first_post_us": median(v["first_post"]),
               "first_post_p90_us": float(np.percentile(v["first_post"], 90))
               if v["first_post"] else None,
               "serve_us": median(v["serve"]), "since_answer_us": median(v["since_answer"])}
          for op, v in by_op.items()}


def _time_raw(engine, meeting, process_id, peer, directions, per_iteration, key, raw_exchange,
              on_device: bool):
  """Both raw modes for one routing, between host buffers or (`on_device`) buffers on this
  process's GPU; checks that the one-write mode delivered the peer's bytes (a broken engine
  would otherwise time nothing useful)."""
  import jax
  import numpy as np

  mine = next(d for d in directions if d.source == process_id and d.dest == peer)
  theirs = next(d for d in directions if d.source == peer and d.dest == process_id)
  size = raw_exchange.region_bytes(directions)
  if on_device:
    device = jax.local_devices()[0]
    put = lambda a: jax.block_until_ready(jax.device_put(a, device))  # noqa: E731
    source = engine.register_device(put(raw_exchange.source_bytes(process_id, size)))
    dest = engine.register_device(put(np.zeros(size, np.uint8)))
  else:
    source = engine.register(raw_exchange.source_bytes(process_id, size))
    dest = engine.register(np.zeros(size, np.uint8))
  try:
    descriptor = meeting.exchange(f"{key}_dest", dest.descriptor, process_id, peer)
    exchange = raw_exchange.RawExchange(engine, peer, descriptor, source, mine, theirs)
    records = {}
    for mode in raw_exchange.MODES:
      meeting.barrier(f"{key}_raw_{mode}_warm")
      exchange.run(mode, 1)
      timing = per_iteration(lambda n, mode=mode: exchange.run(mode, n), f"{key}_raw_{mode}")
      records[mode] = {"status": "ok", "time": timing, "writes_per_exchange": exchange.writes(mode),
                       "bytes_per_exchange": mine.bytes,
                       "memory": "device" if on_device else "host"}
    # one_write ran last: its last combine write holds the peer's first combine bytes
    n = theirs.combine.bytes
    if not np.array_equal(np.asarray(dest.array)[:n], raw_exchange.source_bytes(peer, size)[:n]):
      raise RuntimeError(f"{key}: the raw exchange delivered other bytes than the peer's")
    meeting.barrier(f"{key}_raw_done")  # the peer wrote its last bytes into `dest`
  finally:
    engine.deregister(source)
    engine.deregister(dest)
  return records


def _log(process_id: int, key: str, what: str, record: dict) -> None:
  t = record.get("time")
  text = f"{t['median_us']:.1f} us (p10 {t['p10_us']:.1f}, p90 {t['p90_us']:.1f})" if t else ""
  print(f"[process {process_id}] {key} {what}: {record.get('status')} {text}"
        f"{' - ' + record['reason'] if record.get('reason') else ''}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
  config_path, process_id, port, result_path = argv
  config = json.loads(Path(config_path).read_text())
  process_id, port = int(process_id), int(port)
  configure(config, process_id)
  started = time.monotonic()
  result = {"process": process_id, "ok": False, "error": None, "records": []}
  try:
    result["records"] = run(config, process_id, port, Path(config_path).parent)
    result["ok"] = True
  except Exception as e:  # noqa: BLE001 - reported to the parent through the result file
    result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    print(result["error"], file=sys.stderr, flush=True)
  result["seconds"] = round(time.monotonic() - started, 1)
  Path(result_path).write_text(json.dumps(result, indent=1) + "\n")
  return 0 if result["ok"] else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
