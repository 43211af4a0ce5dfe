"""When the cuda backend goes through its host proxies (backends/cuda_proxy.py): the setting
and the host check (backends/hosts.py), without a GPU; the stage-clock switch (ffi/protocol/stage_clock.h).
The path itself runs on GPUs in gpu/test_cuda_backend.py (one process) and
gpu/test_multiprocess.py (across processes)."""

import re
import types

import numpy as np
import pytest

from jax_moe import settings
from jax_moe.backends import cuda_proxy, cuda_ranks, hosts


SWITCHES = [("JAX_MOE_FORCE_REMOTE", settings.force_remote),
            ("JAX_MOE_STAGE_CLOCKS", settings.stage_clocks)]


@pytest.mark.parametrize("name, read", SWITCHES)
@pytest.mark.parametrize("value, expected", [(None, False), ("0", False), ("1", True)])
def test_switches_read_the_environment(monkeypatch, name, read, value, expected):
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    assert read() is expected


@pytest.mark.parametrize("name, read", SWITCHES)
@pytest.mark.parametrize("bad", ["yes", "2", "", " 1"])
def test_switches_refuse_other_values(monkeypatch, name, read, bad):
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=f"{name} must be 0 or 1"):
        read()


# The proxies' choices: (variable, reader, its values with the default first).
CHOICES = [("JAX_MOE_PROXY_WAIT", settings.proxy_wait, ("stream", "kernel")),
           ("JAX_MOE_PROXY_NEAR_ROWS", settings.proxy_near_rows, ("host", "device"))]


@pytest.mark.parametrize("name, read, values", CHOICES)
def test_proxy_choices_read_the_environment(monkeypatch, name, read, values):
    monkeypatch.delenv(name, raising=False)
    assert read() == values[0]
    for value in values:
        monkeypatch.setenv(name, value)
        assert read() == value


@pytest.mark.parametrize("name, read, values", CHOICES)
@pytest.mark.parametrize("bad", ["", "spin", "upper", " padded"])
def test_proxy_choices_refuse_other_values(monkeypatch, name, read, values, bad):
    bad = {"upper": values[0].capitalize(), "padded": " " + values[0]}.get(bad.strip(), bad)
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=f"{name} must be '{values[0]}' or '{values[1]}'"):
        read()


@pytest.mark.parametrize("hmem, provider, registers, expected", [
    (None, "efa", True, False), ("off", "efa", True, False), ("on", "efa", False, True),
    ("on", "verbs;ofi_rxm", False, True), ("auto", "shm", True, False),
    ("auto", "tcp;ofi_rxm", True, False), ("auto", "efa", True, True),
    ("auto", "verbs;ofi_rxm", True, True), ("auto", "efa", False, False)])
def test_remote_rows_land_in_device_memory_when_hmem_asks(monkeypatch, hmem, provider,
                                                          registers, expected):
    # Off by default (until the path has run on a GPU cluster); auto: the RDMA providers, where
    # libfabric registers CUDA memory (asked only then); on: required (registration errors).
    if hmem is None:
        monkeypatch.delenv("JAX_MOE_PROXY_HMEM", raising=False)
    else:
        monkeypatch.setenv("JAX_MOE_PROXY_HMEM", hmem)
    monkeypatch.setenv("JAX_MOE_HOST_PROVIDER", provider)
    monkeypatch.setenv("JAX_MOE_HOST_NODE", "10.0.0.7")
    asked = []

    def probe(provider, node):
        asked.append((provider, node))
        return registers

    assert settings.proxy_rows_device_from_remote(probe) is expected
    probed = hmem == "auto" and provider.split(";")[0] in ("efa", "verbs")
    assert asked == ([(provider, "10.0.0.7")] if probed else [])


@pytest.mark.parametrize("provider", ["shm", "tcp;ofi_rxm", "tcp", ""])
def test_hmem_on_refuses_providers_that_copy_device_memory_with_cuda(monkeypatch, provider):
    # shm and tcp move FI_HMEM buffers with blocking CUDA copies on their progress thread: on a
    # GPU they hung behind the streams waiting for those rows (session 20). auto stays off.
    monkeypatch.setenv("JAX_MOE_HOST_PROVIDER", provider)
    monkeypatch.setenv("JAX_MOE_PROXY_HMEM", "on")
    expected = (r"JAX_MOE_PROXY_HMEM=on needs JAX_MOE_HOST_PROVIDER to be one of \('efa', "
                rf"'verbs'\) \(GPUDirect RDMA\), got '{re.escape(provider)}'.*PROXY_HMEM=off")
    with pytest.raises(ValueError, match=expected):
        settings.proxy_rows_device_from_remote(lambda provider, node: True)
    monkeypatch.setenv("JAX_MOE_PROXY_HMEM", "auto")
    assert settings.proxy_rows_device_from_remote(lambda provider, node: True) is False


@pytest.mark.parametrize("bad", ["", "1", "On", "device"])
def test_hmem_refuses_other_values(monkeypatch, bad):
    monkeypatch.setenv("JAX_MOE_PROXY_HMEM", bad)
    with pytest.raises(ValueError, match=r"JAX_MOE_PROXY_HMEM must be one of \('off', 'on'"):
        settings.proxy_rows_device_from_remote(lambda provider, node: True)


def fake_devices(processes):
    return np.array([[types.SimpleNamespace(process_index=p) for p in processes]])


class FakeStore:
    """The key-value store of jax.distributed, with the other processes' names in it."""

    def __init__(self, names):
        self.values = {}
        self.names = names

    def key_value_set(self, key, value):
        self.values[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        assert timeout_ms > 0
        if key in self.values:
            return self.values[key]
        return self.names[int(key.rsplit("/", 1)[1])]


def test_one_process_never_asks_the_store(monkeypatch):
    def no_store(owner):
        raise AssertionError("a mesh of one process needs no key-value store")

    monkeypatch.setattr(hosts, "distributed_client", no_store)
    assert not cuda_proxy.spans_hosts(fake_devices([0, 0]), "test")


@pytest.mark.parametrize("group", [None, "rack7-a"])
@pytest.mark.parametrize("other_same", [True, False])
def test_processes_on_other_hosts_are_found_by_group(monkeypatch, group, other_same):
    """JAX_MOE_HOST_GROUP names this process's host (tests stand several hosts on one
    machine); unset, the host name does."""
    mine = group or "this-host"
    store = FakeStore({1: mine if other_same else "other"})
    monkeypatch.setattr(hosts, "distributed_client", lambda owner: store)
    monkeypatch.setattr(settings.socket, "gethostname", lambda: "this-host")
    if group is None:
        monkeypatch.delenv("JAX_MOE_HOST_GROUP", raising=False)
    else:
        monkeypatch.setenv("JAX_MOE_HOST_GROUP", group)
    assert cuda_proxy.spans_hosts(fake_devices([0, 1]), "test") is not other_same
    assert mine in store.values.values()  # this process published its group


def test_stage_clocks_are_empty_without_the_cuda_kernels(monkeypatch):
    """Only the NVLink kernels record them; other backends give {} even when asked."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import jax_moe as jm

    monkeypatch.setenv("JAX_MOE_STAGE_CLOCKS", "1")
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
    cfg = jm.MoEConfig(num_experts=4, experts_per_token=2, hidden=128, max_tokens=8,
                       dispatch_dtype=jnp.bfloat16)
    comm = jm.Communicator(cfg, mesh, axis="ep", backend="xla")
    assert comm.stage_clocks() == {}
    comm.close()


class FakeModule:
    """The native module's IPC handle of a local rank: its ordinal, repeated."""

    @staticmethod
    def cuda_ipc_handle(comm_id, ordinal):
        return bytes([ordinal]) * 64


def test_ipc_handles_are_fetched_only_for_the_wanted_ranks(monkeypatch):
    """A proxy communicator maps only the device buffers of its host's ranks: ranks on other
    hosts get no handle (b""), and nothing is asked of the store when none is wanted."""
    published = {}
    store = FakeStore({})
    store.values.update({f"jax_moe/cuda/7/0/{rank}": (bytes([rank]) * 64).hex()
                         for rank in (2, 3)})
    store.key_value_set = lambda key, value: published.__setitem__(key, value)
    monkeypatch.setattr(cuda_ranks, "distributed_client", lambda owner: store)
    local = [0, 1, -1, -1, -1]  # ranks 0, 1 here; 2, 3 near; 4 on another host
    handles = cuda_ranks.exchange_ipc_handles(FakeModule, 7, 0, local, [2, 3], "test")
    assert handles == [b"", b"", bytes([2]) * 64, bytes([3]) * 64, b""]
    assert published == {f"jax_moe/cuda/7/0/{r}": (bytes([r]) * 64).hex() for r in (0, 1)}
    monkeypatch.setattr(cuda_ranks, "distributed_client", None)  # not called
    assert cuda_ranks.exchange_ipc_handles(FakeModule, 7, 0, local, [], "test") == [b""] * 5
