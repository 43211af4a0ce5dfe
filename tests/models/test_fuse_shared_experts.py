"""DeepSeek-V3 with `fuse_shared_experts`: the shared expert sits in front of each shard's routed
experts (checkpoint.SharedSlots) and every token goes to its shard's copy with weight 1 as one
more slot (models/moe.py, RoutedExperts.shared_expert).

Against transformers' f32 logits and against the same checkpoint loaded with the option off
(same wire), on one device, two and eight (8, 4 and 1 experts per shard), full forward and a
cached step, and with the two-batch overlap; the loaded slots hold the shared expert where the
layout says, in the model dtype and as block-fp8 codes and scales as stored; SharedSlots reads
any slice (a device's share) of that layout; the cases the fused layout cannot hold are refused
with the reason; the flags of `jax-moe generate` and bench_decode reach the model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import torch
from safetensors.torch import load_file

from support import hf_tiny
from support.hf_tiny import save_deepseek_v3
from jax_moe import models
from jax_moe.grouped_gemm import BlockFp8Weights
from jax_moe.models.checkpoint import (GATE_UP_PAIR, SharedSlots, StackedExperts, Tensor,
                                       TensorPair, routed_expert_sources)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_deepseek_v3(tmp_path_factory.mktemp("fused"), seed=11)


def _load(path, mesh, backend, fuse, dtype=jnp.float32):
  # the "exact" wire (the f32 default) sends each slot apart: the bf16 wire for both
  return models.from_pretrained(path, mesh=mesh, backend=backend, dtype=dtype, wire="bf16",
                                fuse_shared_experts=fuse, progress=False)


def _rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_fused_logits_match_transformers_and_the_separate_shared_expert(saved, rng, mesh_of,
                                                                        backend, devices):
  hf_model, path = saved
  mesh = mesh_of(devices)
  ids = hf_tiny.random_ids(rng, batch=2, seq=6, vocab=hf_model.config.vocab_size)
  want = hf_tiny.hf_logits(hf_model, ids)
  got = {}
  for fuse in (False, True):
    model = _load(path, mesh, backend, fuse)
    assert model.cfg.fuse_shared_experts is fuse
    assert (model.layers[1].mlp.shared_experts is None) is fuse
    got[fuse] = hf_tiny.prefill_and_step(model, ids)
    model.pool.check()
    model.pool.close()
  # the bf16 wire rounds each routed row (both) and the shared expert's input (fused only)
  errs = [_rel(fused, separate) for separate, fused in zip(got[False], got[True])]
  print(f"fused vs transformers {_rel(got[True][0], want):.1e}, vs separate {errs}")
  assert _rel(got[True][0], want) < 1e-2
  for separate, fused in zip(got[False], got[True]):
    assert np.isfinite(fused).all()
    assert _rel(fused, separate) < 6e-3
  # the shared expert weighs: leaving it out moves the logits far past that tolerance
  model = _load(path, mesh, backend, False)
  for layer in model.layers:
    if layer.is_moe:
      layer.mlp.shared_experts = None
  assert _rel(models.forward(model, ids), want) > 5e-2
  model.pool.close()


def test_slots_hold_the_shared_expert_in_front_of_each_shard(saved, mesh_of):
  _, path = saved
  mesh = mesh_of(4)
  separate = _load(path, mesh, "xla", False).layers[1].mlp
  fused = _load(path, mesh, "xla", True).layers[1].mlp.experts
  L = fused.experts_per_shard
  E = separate.experts.num_experts
  assert L == E // 4
  pair = np.asarray(getattr(fused, GATE_UP_PAIR)[...])
  down = np.asarray(fused.w_down_efd[...])
  assert pair.shape[0] == down.shape[0] == E + 4
  shared = separate.shared_experts
  routed_pair = np.asarray(getattr(separate.experts, GATE_UP_PAIR)[...])
  routed_down = np.asarray(separate.experts.w_down_efd[...])
  for s in range(4):
    np.testing.assert_array_equal(pair[s * (L + 1), :, 0], shared.w_gate_df[...])
    np.testing.assert_array_equal(pair[s * (L + 1), :, 1], shared.w_up_df[...])
    np.testing.assert_array_equal(down[s * (L + 1)], shared.w_down_fd[...])
    np.testing.assert_array_equal(pair[s * (L + 1) + 1:(s + 1) * (L + 1)],
                                  routed_pair[s * L:(s + 1) * L])
    np.testing.assert_array_equal(down[s * (L + 1) + 1:(s + 1) * (L + 1)],
                                  routed_down[s * L:(s + 1) * L])


FP8_BLOCK = (16, 16)  # partial edge blocks at the tiny dims


@pytest.fixture(scope="module")
def fp8_dir(saved, tmp_path_factory):
  return hf_tiny.save_block_fp8_copy(saved[1], tmp_path_factory.mktemp("fused_fp8"), FP8_BLOCK)


def test_fp8_experts_hold_the_shared_expert_as_stored(saved, fp8_dir, rng, mesh_of):
  """Block-fp8 experts (expert_weights="fp8") with the shared expert in their slots: its codes
  and scales as the checkpoint stores them; on CPU (where the GEMM dequantizes them as the
  loader does) the logits of the fused model holding bf16 copies, bit for bit; near the
  separate shared expert's."""
  mesh = mesh_of(4)
  ids = hf_tiny.random_ids(rng, batch=4, seq=3, vocab=saved[0].config.vocab_size)
  load = lambda fuse, weights: models.from_pretrained(  # noqa: E731
      fp8_dir, mesh=mesh, backend="xla", dtype=jnp.bfloat16, wire="bf16",
      fuse_shared_experts=fuse, expert_weights=weights, progress=False)
  kept, copy, separate = load(True, "fp8"), load(True, "dtype"), load(False, "dtype")
  experts = kept.layers[1].mlp.experts
  L = experts.experts_per_shard
  stored = load_file(f"{fp8_dir}/model.safetensors")
  prefix = "model.layers.1.mlp"
  for name, proj in (("w_gate_edf", "gate_proj"), ("w_up_edf", "up_proj"),
                     ("w_down_efd", "down_proj")):
    w8 = getattr(experts, name).get_value()
    assert isinstance(w8, BlockFp8Weights) and w8.block == FP8_BLOCK
    assert w8.codes.shape[0] == w8.scales.shape[0] == experts.num_experts + 4
    for slot, source in ((2 * (L + 1), f"{prefix}.shared_experts.{proj}.weight"),
                         (2 * (L + 1) + 1, f"{prefix}.experts.{2 * L}.{proj}.weight")):
      np.testing.assert_array_equal(np.asarray(w8.codes[slot]).view(np.uint8),
                                    stored[source].view(torch.uint8).numpy())
      np.testing.assert_array_equal(np.asarray(w8.scales[slot]),
                                    stored[source + "_scale_inv"].numpy())
  got = {name: np.asarray(models.forward(model, ids), np.float32)
         for name, model in (("kept", kept), ("copy", copy), ("separate", separate))}
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(got["kept"], got["copy"])
  else:  # a GPU's fp8 kernel multiplies the codes itself (grouped_gemm's fp8 tolerance)
    assert _rel(got["kept"], got["copy"]) < 2e-2
  assert _rel(got["kept"], got["separate"]) < 6e-3


class _ArrayReader:
  def __init__(self, arrays):
    self.arrays = arrays

  def has(self, name):
    return name in self.arrays

  def shape(self, name):
    return self.arrays[name].shape

  def read(self, name, index):
    return self.arrays[name][index]


def test_shared_slots_read_any_slice(rng):
  E, L, D, F = 6, 2, 5, 4
  arrays = {f"m.experts.{e}.down_proj.weight": rng.normal(size=(D, F)) for e in range(E)}
  arrays["m.shared.down_proj.weight"] = rng.normal(size=(D, F))
  arrays.update({f"m.shared.{p}.weight": rng.normal(size=(F, D)) for p in ("gate_proj", "up_proj")})
  arrays.update({f"m.experts.{e}.{p}.weight": rng.normal(size=(F, D))
                 for e in range(E) for p in ("gate_proj", "up_proj")})
  reader = _ArrayReader(arrays)
  slots = SharedSlots(StackedExperts("m.experts.{e}.down_proj.weight", E),
                      Tensor("m.shared.down_proj.weight", transpose=True), L)
  assert slots.shape(reader) == (E + E // L, F, D)
  whole = slots.read(reader, (slice(None),) * 3)
  for j in range(E + E // L):
    shard, slot = divmod(j, L + 1)
    name = ("m.shared.down_proj.weight" if slot == 0
            else f"m.experts.{shard * L + slot - 1}.down_proj.weight")
    np.testing.assert_array_equal(whole[j], arrays[name].T)
  for part in [(slice(2, 7), slice(1, 3), slice(0, 5)), (slice(3, 4),) + (slice(None),) * 2,
               (slice(1, 3), slice(0, 4), slice(2, 3))]:  # across shards, one shared slot
    np.testing.assert_array_equal(slots.read(reader, part), whole[part])
  sources = routed_expert_sources(("x",), "m.experts", E, gate_up_paired=True,
                                  shared=("m.shared", L))
  pair = sources[("x", GATE_UP_PAIR)]
  assert isinstance(pair.shared, TensorPair)
  assert pair.shape(reader) == (E + E // L, D, 2, F)
  part = (slice(2, 6), slice(1, 4), slice(1, 2), slice(0, 3))
  np.testing.assert_array_equal(pair.read(reader, part),
                                pair.read(reader, (slice(None),) * 4)[part])
  np.testing.assert_array_equal(pair.read(reader, (slice(0, 1),) + (slice(None),) * 3)[0, :, 1],
                                arrays["m.shared.up_proj.weight"].T)
  apart = routed_expert_sources(("x",), "m.experts", E, gate_up_paired=False,
                                shared=("m.shared", L))  # block-fp8 experts: three parameters
  assert set(apart) == {("x", n) for n in ("w_gate_edf", "w_up_edf", "w_down_efd")}
  gate = apart[("x", "w_gate_edf")]
  assert gate.shape(reader) == (E + E // L, D, F)
  np.testing.assert_array_equal(gate.read(reader, (slice(3, 4), slice(None), slice(None)))[0],
                                arrays["m.shared.gate_proj.weight"].T)
  arrays["m.shared.down_proj.weight"] = rng.normal(size=(D, F + 1))
  with pytest.raises(ValueError, match="one shape for both"):
    slots.shape(reader)


@pytest.mark.parametrize("overrides, kwargs, message", [
    ({"n_shared_experts": 2}, {}, "n_shared_experts == 1"),
    ({}, {"overlap_shared_experts": True}, "exclude each other"),
    ({}, {"dtype": jnp.float32}, "'exact' wire"),
    ({}, {"tp": True}, "tensor-parallel"),
])
def test_what_the_fused_layout_cannot_hold_is_refused(mesh_of, overrides, kwargs, message):
  config = dict(models.TINY_CONFIGS["tiny-deepseek-v3"], **overrides)
  kwargs = dict(kwargs)
  mesh = _tp_mesh() if kwargs.pop("tp", False) else mesh_of(1)
  with pytest.raises(ValueError, match=message):
    models.from_config(config, mesh=mesh, backend="xla", **{"dtype": jnp.bfloat16, **kwargs},
                       fuse_shared_experts=True)


def _tp_mesh():
  devices = jax.devices()
  if len(devices) < 2:
    pytest.skip("needs 2 devices")
  return Mesh(np.array(devices[:2]).reshape(1, 2), models.TP_MESH_AXES)


def test_models_without_shared_experts_ignore_the_option(mesh_of):
  qwen = models.tiny("tiny-qwen3-moe", mesh=mesh_of(1), backend="xla",
                     fuse_shared_experts=True)
  assert not hasattr(qwen.cfg, "fuse_shared_experts")
  config = dict(models.TINY_CONFIGS["tiny-deepseek-v3"], n_shared_experts=0)
  model = models.from_config(config, mesh=mesh_of(1), backend="xla", fuse_shared_experts=True)
  assert not model.cfg.fuse_shared_experts


def test_fused_with_two_batches_gives_the_one_batch_logits(saved, rng, mesh_of, backend):
  """The two-batch overlap's halves (RoutedExperts.steps) take the shared slot too."""
  hf_model, path = saved
  ids = hf_tiny.random_ids(rng, batch=4, seq=5, vocab=hf_model.config.vocab_size)
  got = []
  for two in (False, True):
    model = models.from_pretrained(path, mesh=mesh_of(2), backend=backend, dtype=jnp.float32,
                                   wire="bf16", fuse_shared_experts=True, two_batch_overlap=two,
                                   progress=False)
    got.append(hf_tiny.prefill_and_step(model, ids))
    model.pool.check()
    model.pool.close()
  for one, two in zip(*got):
    np.testing.assert_allclose(two, one, rtol=0, atol=1e-5 * np.abs(one).max())


def test_generate_and_bench_decode_flags_reach_the_model(mesh_of):
  from benchmarks import bench_decode
  from jax_moe import cli
  from jax_moe.cli import generate

  mesh = mesh_of(2)
  for flags, want in (([], False), (["--fuse-shared-experts"], True)):
    args = cli._parser().parse_args(["generate", "--model", "tiny-deepseek-v3", "--backend",
                                     "xla", *flags])
    model, _ = generate._build_model(args, None, mesh)
    assert model.cfg.fuse_shared_experts is want
    assert model.layout().endswith("in the routed experts' GEMMs") is want
    bench_args = bench_decode.parse_args(flags)
    assert bench_args.fuse_shared_experts is want
    model = bench_decode._build("tiny-deepseek-v3", mesh, "xla", jnp.bfloat16, "bf16", 0,
                                fuse_shared_experts=bench_args.fuse_shared_experts)
    assert model.cfg.fuse_shared_experts is want
