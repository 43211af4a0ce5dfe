"""What the `jax-moe` commands share: joining a multi-process job (jax.distributed)."""

from __future__ import annotations

import sys


def join(args, command: str):
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


def add_distributed_arguments(parser) -> None:
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
