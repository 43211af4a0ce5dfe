"""Process setup of the multi-process test workers (mp_worker.py, all_reduce_worker.py), done
before jax is imported: this module imports no jax."""

import os

CPU_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def devices_per_process(args):
    """Devices (ranks) of each process: --devices-per-process where the worker has it, else 1."""
    return getattr(args, "devices_per_process", 1)


def configure_environment(args):
    """Before jax is imported: one GPU or args.devices_per_process CPU devices per process,
    memory taken as needed (GPUs are shared)."""
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    os.environ.setdefault("JAX_MOE_TIMEOUT_S", "20")
    if args.platform == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(args.gpu)
    else:
        os.environ["JAX_PLATFORMS"] = "cpu"
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if not f.startswith(CPU_DEVICE_COUNT_FLAG)]  # tests/conftest.py asks for 8
        count = devices_per_process(args)
        os.environ["XLA_FLAGS"] = " ".join(flags + [f"{CPU_DEVICE_COUNT_FLAG}={count}"])
