"""Tensor-parallel attention inside data-parallel groups: (dp, tp) meshes of the 8 CPU devices.

Both model families, f32 with the "exact" MoE wire, against one device and against
transformers: the logits of a full forward (within 1e-4 of the largest) and greedy
generation's tokens. The tiny configs have 8 query heads and, for Qwen3-MoE, 2 kv heads, so
tp = 4 and 8 exceed the kv heads (each rank projects the one kv head its query heads read)
while tp = 2 shards them; a dense layer, the shared expert and attention biases run
tensor-parallel too. Routed experts go over all 8 devices through the DP-group exchange.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from transformers import Qwen3MoeConfig

from support import hf_tiny
from jax_moe import cli, models
from jax_moe.models.sharding import ShardingRules
from support.hf_tiny import deepseek_v3_config, save_deepseek_v3

MESHES = ((8, 1), (4, 2), (2, 4), (1, 8))
PROMPT, NEW = 5, 3


def mesh_2d(dp, tp, names=models.TP_MESH_AXES):
  devices = jax.devices()
  if len(devices) < dp * tp:
    pytest.skip(f"needs {dp * tp} devices")
  return Mesh(np.array(devices[:dp * tp]).reshape(dp, tp), names)


def _save_qwen3(directory):
  config = Qwen3MoeConfig(**hf_tiny.qwen3_moe_kwargs(
      num_attention_heads=8, num_key_value_heads=2, head_dim=4, mlp_only_layers=[0],
      attention_bias=True, norm_topk_prob=True))
  return hf_tiny.save_tiny(config, directory, seed=3)


def _save_dsv3(directory):
  return save_deepseek_v3(directory, seed=4, num_attention_heads=8, num_key_value_heads=8,
                        attention_bias=True)


SAVERS = {"qwen3_moe": _save_qwen3, "deepseek_v3": _save_dsv3}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """family -> (checkpoint dir, prompt ids, transformers' logits and greedy tokens, one
  device's logits), computed once per module."""
  done = {}

  def get(family):
    if family not in done:
      hf_model, path = SAVERS[family](tmp_path_factory.mktemp(family))
      # No token 0: hf_greedy names 0 the pad token (test_deepseek_v3 says why).
      ids = 1 + hf_tiny.random_ids(np.random.default_rng(7), batch=8, seq=PROMPT,
                                   vocab=hf_model.config.vocab_size - 1)
      tokens, _ = hf_tiny.hf_greedy(hf_model, ids, max_new_tokens=NEW)
      with jax.default_matmul_precision("highest"):
        one = models.from_pretrained(path, mesh=mesh_2d(1, 1), backend="xla",
                                     dtype=jnp.float32, progress=False)
        one_logits = np.asarray(models.forward(one, ids))
      done[family] = (path, ids, hf_tiny.hf_logits(hf_model, ids), tokens, one_logits)
    return done[family]
  return get


def _rel(got, want):
  return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


def _load(path, dp, tp, backend="xla"):
  return models.from_pretrained(path, mesh=mesh_2d(dp, tp), backend=backend, dtype=jnp.float32,
                                progress=False)


@pytest.mark.parametrize("dp,tp", MESHES)
@pytest.mark.parametrize("family", sorted(SAVERS))
def test_dp_tp_logits_match_one_device_and_transformers(reference, family, dp, tp):
  path, ids, hf_logits, _, one_logits = reference(family)
  model = _load(path, dp, tp)
  assert model.rules.expert_axis == ("dp", "tp") and model.rules.tp_size == tp
  logits = np.asarray(models.forward(model, ids))
  vs_one, vs_hf = _rel(logits, one_logits), _rel(logits, hf_logits)
  print(f"{family} (dp, tp) = ({dp}, {tp}): vs one device {vs_one:.2e}, "
        f"vs transformers {vs_hf:.2e}")
  assert vs_one <= 1e-4 and vs_hf <= 1e-4


# Greedy decode (prefill + cached steps) on the two kv-head layouts: sharded (tp 2) and
# replicated (tp 8); test_host_backend_with_tp_groups decodes at tp 4. (Compiles dominate:
# the other meshes run the same code, their logits are checked above.)
@pytest.mark.parametrize("dp,tp", ((4, 2), (1, 8)))
@pytest.mark.parametrize("family", sorted(SAVERS))
def test_dp_tp_greedy_tokens_match_transformers(reference, family, dp, tp):
  path, ids, _, hf_tokens, _ = reference(family)
  np.testing.assert_array_equal(
      np.asarray(models.generate(_load(path, dp, tp), ids, max_new_tokens=NEW)), hf_tokens)


@pytest.mark.parametrize("family", sorted(SAVERS))
def test_host_backend_with_tp_groups(reference, family):
  """The host backend's DP-group exchange under tp attention, with a batch that does not
  split over dp (kept replicated) in the cached decode."""
  path, ids, hf_logits, hf_tokens, _ = reference(family)
  model = _load(path, 2, 4, backend="host")
  assert _rel(models.forward(model, ids), hf_logits) <= 1e-4
  np.testing.assert_array_equal(
      np.asarray(models.generate(model, ids[:1], max_new_tokens=NEW)), hf_tokens[:1])


def test_tp_layout_places_heads_kv_heads_mlp_and_experts():
  """Where the parameters and the cache sit: tp = 4 over 2 kv heads replicates k and v and
  gives every rank its own kv head in the cache; q and o split by whole heads."""
  # abstract parameters (no weights drawn): their ShapeDtypeStructs carry the shardings
  model = models._build(models.TINY_CONFIGS["tiny-qwen3-moe"], mesh_2d(2, 4), None, "xla",
                        jnp.bfloat16, None)
  attn = model.layers[0].attn
  assert not attn.kv_sharded and attn.cache_kv_heads == 4
  spec = lambda p: tuple(p.get_value().sharding.spec)
  assert spec(attn.q.w) == (None, "tp") and spec(attn.o.w) == ("tp", None)
  assert spec(attn.k.w) == (None, None)
  assert spec(model.layers[0].mlp.w_down_fd) == ("tp", None)
  assert spec(model.layers[1].mlp.experts.w_gate_up_ed2f) == (("dp", "tp"), None, None, None)
  cache_k, _ = model.init_cache(batch=2, max_len=4).layers[0]
  assert cache_k.shape[2] == 4 and tuple(cache_k.sharding.spec) == ("dp", None, "tp", None)
  assert "tensor-parallel over 'tp' (4 way" in model.layout()


def test_one_axis_mesh_is_the_expert_parallel_plan():
  rules = ShardingRules.of_mesh(Mesh(np.array(jax.devices()[:8]), ("ep",)))
  assert (rules.axis, rules.tp_axis, rules.expert_axis, rules.tp_size) == ("ep", None, "ep", 1)
  assert rules.spec_for((16, 8), ("heads", "mlp")) == jax.sharding.PartitionSpec(None, None)


@pytest.mark.parametrize("family,config,mesh,message", [
    ("qwen3", dict(num_attention_heads=4), (1, 8),
     r"num_attention_heads \(4\) must be divisible by tp \(8\)"),
    ("qwen3", dict(num_attention_heads=6, num_key_value_heads=3), (4, 2),
     r"num_key_value_heads \(3\) must divide or be divisible by tp \(2\)"),
    ("dsv3", dict(num_attention_heads=4), (1, 8),
     r"num_attention_heads \(4\) must be divisible by tp \(8\)"),
])
def test_tp_not_dividing_the_heads_is_refused(family, config, mesh, message):
  hf_config = (Qwen3MoeConfig(**hf_tiny.qwen3_moe_kwargs(**config)) if family == "qwen3"
               else deepseek_v3_config(**config))
  with pytest.raises(ValueError, match=message):
    models.from_config(hf_config.to_dict(), mesh=mesh_2d(*mesh), backend="xla")


def test_meshes_without_the_axes_are_refused():
  config = models.TINY_CONFIGS["tiny-qwen3-moe"]
  with pytest.raises(ValueError, match=r"name the data-parallel `axis` and the tensor-parallel "
                                       r"`tp_axis`"):
    models.from_config(config, mesh=mesh_2d(4, 2, ("data", "model")))
  with pytest.raises(ValueError, match=r"tp_axis 'tp' is not an axis of the mesh"):
    models.from_config(config, mesh=mesh_2d(4, 2, ("data", "model")), axis="data",
                       tp_axis="tp")
  with pytest.raises(ValueError, match=r"axis='data' and tp_axis=None must name every axis"):
    models.from_config(config, mesh=mesh_2d(4, 2, ("data", "model")), axis="data")
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
    models.from_config(config, mesh=("dp", "tp"))


def test_cli_tp_must_divide_the_devices(capsys):
  assert cli.main(["generate", "--tp", "3", "--max-new-tokens", "1"]) == 2
  assert "--tp 3 must be >= 1 and divide the 8 devices" in capsys.readouterr().err
