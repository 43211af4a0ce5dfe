"""Device time per stage of a compiled program, from a JAX profiler trace.

The models run each stage of a decoder layer under a named scope (models/stages.py),
so the op_name metadata of every HLO instruction names its stage. A trace's device events
(GPU kernels on the stream lines; XLA:CPU thunks on a CPU mesh) carry the instruction they
ran as their `hlo_op` stat: each event's time goes to its instruction's stage. A fusion goes
to the stage of its root (its metadata) or, when the root has none (a residual add that
absorbed a stage's last ops), to the stage most of its fused ops carry; control-flow thunks
(while, conditional, call) are left out, their bodies' events are counted instead.
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile

import jax

from jax_moe.models import stages

# "%name = <type> opcode(... metadata={op_name="..." ...}": the name, opcode and op_name;
# a computation's header line "[ENTRY ]%name (params) -> type {".
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*? ([a-z][a-z0-9\-]*)\(')
_COMPUTATION = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+) .*\{\s*$')
_OP_NAME = re.compile(r'metadata=\{[^}]*op_name="([^"]*)"')
_CALLS = re.compile(r'calls=%?([\w.\-]+)')
_CONTROL_FLOW = {"while", "conditional", "call"}


def instruction_stages(hlo_text: str) -> dict[str, str | None]:
  """{instruction name: its stage} over every computation of a compiled module's text; None
  for control flow (its time is its body's)."""
  out, fusions = {}, {}
  inside = collections.defaultdict(collections.Counter)  # computation -> stages of its ops
  computation = None
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if not match:
      header = _COMPUTATION.match(line)
      if header:
        computation = header.group(1)
      continue
    name, opcode = match.groups()
    if opcode in _CONTROL_FLOW:
      out[name] = None
      continue
    op_name = _OP_NAME.search(line)
    out[name] = stages.stage_of(op_name.group(1)) if op_name else stages.OTHER
    if out[name] != stages.OTHER:
      inside[computation][out[name]] += 1
    calls = _CALLS.search(line)
    if opcode == "fusion" and calls:
      fusions[name] = calls.group(1)
  for name, fused in fusions.items():
    if out[name] == stages.OTHER and inside[fused]:
      out[name] = inside[fused].most_common(1)[0][0]
  return out


def instruction_notes(hlo_text: str) -> dict[str, str]:
  """{instruction name: "<result type> <op_name's last three parts>"}: what a kernel named in
  a trace computes (e.g. "bf16[128,1,24576]{2,1,0} layers/attention/dot_general")."""
  out = {}
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    result_type = line.split(" = ", 1)[1].split(f" {match.group(2)}(", 1)[0]
    op_name = _OP_NAME.search(line)
    where = "/".join(op_name.group(1).split("/")[-3:]) if op_name else ""
    out[match.group(1)] = f"{result_type[:80]} {where}".strip()
  return out


def traced(run):
  """The jax.profiler ProfileData of one `run()`, after an untraced one (so nothing left
  over from earlier work lands in the trace)."""
  jax.block_until_ready(run())
  folder = tempfile.mkdtemp(prefix="jax_moe_trace_")
  with jax.profiler.trace(folder):
    jax.block_until_ready(run())
  (path,) = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
  return jax.profiler.ProfileData.from_file(path)


def gpu_planes(data):
  return [p for p in data.planes if p.name.startswith("/device:GPU:")]


def stream_events(plane):
  """The events of a GPU plane's stream lines: its kernels and copies."""
  for line in plane.lines:
    if "stream" in line.name.lower():
      yield from line.events


def kernel_table(data, steps: int) -> dict:
  """{GPU plane: {"span_us_per_step", "kernels": [{name, count, mean_us, total_us}]}} of a
  trace of `steps` steps: every stream event (kernels, copies) by name, largest total first;
  the busy span is first start -> last end over `steps`."""
  table = {}
  for plane in gpu_planes(data):
    kernels = collections.defaultdict(list)
    first, last = None, None
    for ev in stream_events(plane):
      kernels[ev.name].append(ev.duration_ns / 1e3)
      first = ev.start_ns if first is None else min(first, ev.start_ns)
      last = max(last or 0, ev.start_ns + ev.duration_ns)
    if not kernels:
      continue
    rows = sorted(((name, len(v), sum(v) / len(v), sum(v)) for name, v in kernels.items()),
                  key=lambda r: -r[3])
    table[plane.name] = {"span_us_per_step": (last - first) / 1e3 / steps,
                         "kernels": [dict(name=n, count=c, mean_us=m, total_us=t)
                                     for n, c, m, t in rows]}
  return table


def _device_events(data, module: str):
  """[(device, instruction, duration ns)] of the events of `module`: GPU stream lines when
  the trace has GPU planes (a device per plane), else the CPU thunks (events with an hlo_op
  stat; their device_ordinal stat tells the devices apart). A GPU kernel without an hlo_op
  stat is named by its kernel name (event_instruction)."""
  gpu = gpu_planes(data)
  events = []
  for plane in gpu or [p for p in data.planes if p.name == "/host:CPU"]:
    for ev in (stream_events(plane) if gpu else (e for line in plane.lines for e in line.events)):
      stats = dict(ev.stats)
      op = stats.get("hlo_op") or (gpu and ev.name)
      if not op or stats.get("hlo_module", module) != module:
        continue
      events.append(((plane.name, stats.get("device_ordinal")), op, ev.duration_ns))
  return events


# Kernels of this project's custom calls, by kernel name: their stage is their op's.
_KERNEL_STAGES = (("dispatch_local_kernel", "dispatch"), ("dispatch_kernel", "dispatch"),
                  ("combine_local_kernel", "combine"), ("combine_kernel", "combine"))


def kernel_names(by_name: dict[str, str | None]) -> dict[str, str | None]:
  """{kernel name: stage}: XLA names a fusion's kernel after its instruction, with '.' and '-'
  as '_'."""
  return {re.sub(r"[.\-]", "_", name): stage for name, stage in by_name.items()}


def event_stage(op: str, by_name: dict, by_kernel: dict) -> tuple[bool, str | None]:
  """(matched, stage) of an event named `op`: the instruction of that name, else the
  instruction whose kernel has that name, else one of this project's kernels by name, else
  (False, OTHER)."""
  if op in by_name:
    return True, by_name[op]
  if op in by_kernel:
    return True, by_kernel[op]
  for kernel, stage in _KERNEL_STAGES:
    if kernel in op:
      return True, stage
  return False, stages.OTHER


# Compiler options of a program to profile by stage. On GPUs XLA runs fusions, custom calls
# and loops from command buffers (CUDA graphs) by default, and the kernels a graph launches
# may not carry the instruction they ran; with command buffers off every kernel does. The
# kernels are the same either way (only the launch gaps differ: the caller measures the step
# itself with the defaults).
PROFILE_OPTIONS = {"xla_gpu_enable_command_buffer": ""}


def jit_for_profile(jitted):
  """The function of `jitted` jitted again as profile_stages wants it (PROFILE_OPTIONS on
  GPUs). Call the result, not its Compiled: a Compiled called directly drops the ordered-effect
  token the host backend threads (jax 0.10.2: "supplied 61 arguments but compiled program
  expected 62", then a segfault)."""
  options = PROFILE_OPTIONS if jax.default_backend() == "gpu" else None
  return jax.jit(jitted.__wrapped__, compiler_options=options)


def profile_stages(run, compiled, steps: int, top_n: int = 24) -> dict:
  """Traces `run()` (which must run `compiled`, `steps` steps) and returns the device time
  per step by stage, averaged over the devices: {"stages_us": {stage: us}, "total_us",
  "unmatched_us" (events whose instruction the module's text does not name), "unmatched_top"
  (the largest of those: [instruction, us per step]), "top_by_stage" (each stage's largest
  events, [instruction, us per step, events per step, what it is (instruction_notes)]: what
  limits the stage), "devices"}."""
  text = compiled.as_text()
  module = re.search(r"^HloModule ([\w.\-]+)", text, re.M).group(1)
  by_name = instruction_stages(text)
  by_kernel = kernel_names(by_name)
  events = _device_events(traced(run), module)
  devices = max(1, len({device for device, _, _ in events}))
  unmatched = collections.Counter()
  by_op = collections.defaultdict(collections.Counter)  # stage -> instruction -> ns
  count = collections.Counter()  # (stage, instruction) -> events
  for _, op, ns in events:
    matched, stage = event_stage(op, by_name, by_kernel)
    if not matched:
      unmatched[op] += ns
    if stage is not None:
      by_op[stage][op] += ns
      count[stage, op] += 1
  scale = 1e-3 / (steps * devices)
  per_stage = {s: sum(by_op[s].values()) * scale for s in (*stages.STAGES, stages.OTHER)}
  notes = instruction_notes(text)
  top = {s: [[op, ns * scale, count[s, op] / (steps * devices), notes.get(op, "")]
             for op, ns in by_op[s].most_common(top_n)] for s in per_stage if by_op[s]}
  return {"stages_us": per_stage, "total_us": sum(per_stage.values()),
          "unmatched_us": sum(unmatched.values()) * scale,
          "unmatched_top": [[op, ns * scale] for op, ns in unmatched.most_common(8)],
          "top_by_stage": top, "devices": devices, "module": module}
