"""Hugging Face import/export (mopd_jax.io.hf) against the reference implementation.

Parity with `transformers` (logits, greedy generations, export -> reload) needs torch and
transformers (the `test` extra); those tests skip cleanly without them. Loading, sharded
loading on the 8 simulated devices, the error cases and the qwen3_mopd config run without.
"""
import inspect
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from mopd_jax import models
from mopd_jax.io import hf
from mopd_jax.io.hf import layout as hf_layout, load as hf_load
from mopd_jax.rollout import sampling
from mopd_jax.runtime import sharding
import suite_cli
from mopd_jax import configure

ATOL = 1e-4
NEW_TOKENS = 32
VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              # a wide init makes the random model's logits peaked, so greedy ties can't flip
              initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=16)
CASES = {
    # GQA 4:2 everywhere; llama: untied head + llama3 rope scaling; qwen2: tied + q/k/v bias;
    # qwen3: tied (as Qwen3-0.6B/1.7B) + QK-norm + head_dim != d_model / heads.
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=5e5,
                                  rope_scaling=LLAMA3_SCALING)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1e4)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=32, rope_theta=1e6)),
}
MAX_DIFF = {}  # family -> max |logit difference| (printed at the end with -s)


def _tokens(batch, length, seed=0):
  return np.random.RandomState(seed).randint(0, VOCAB, (batch, length))


def _save_pretrained(model, path, **kw):
  if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
    kw["safe_serialization"] = True  # transformers v4; v5 always writes safetensors
  model.save_pretrained(path, **kw)


@pytest.fixture(scope="module")
def ref():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.set_num_threads(1)
  return torch, transformers


@pytest.fixture(scope="module")
def hf_models(ref, tmp_path_factory):
  """family -> (torch model, checkpoint dir) of small random fp32 models, saved by HF."""
  torch, transformers = ref
  out = {}
  for family, (cls, kw) in CASES.items():
    torch.manual_seed(0)
    config = getattr(transformers, cls)(**COMMON, **kw)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # make every norm scale and bias matter
      for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
          p.normal_(1.0, 0.3)
        elif name.endswith(".bias"):
          p.normal_(0.0, 0.3)
    path = str(tmp_path_factory.mktemp(family))
    _save_pretrained(model, path)
    out[family] = (model, path)
  return out


def _ref_logits(ref, model, tokens):
  torch, _ = ref
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("family", list(CASES))
def test_parity_logits_generation_and_export(ref, hf_models, family, tmp_path):
  torch, transformers = ref
  model, path = hf_models[family]
  cfg, params = hf.load_checkpoint(path)
  assert cfg.family == family and cfg.num_kv_heads == 2 and cfg.param_dtype == "float32"
  assert cfg.tie_embeddings == CASES[family][1]["tie_word_embeddings"]
  assert cfg.qk_norm == (family == "qwen3") and cfg.attention_bias == (family == "qwen2")
  if family == "llama":
    assert dict(cfg.rope_scaling)["rope_type"] == "llama3" and cfg.norm_eps == 1e-5

  # Logits (positions past original_max_position_embeddings=16 exercise the llama3 scaling).
  tokens = _tokens(2, 24)
  ours = np.asarray(models.forward(cfg, params, tokens))
  theirs = _ref_logits(ref, model, tokens)
  diff = float(np.abs(ours - theirs).max())
  MAX_DIFF[family] = diff
  print(f"\n{family}: max |logit diff| = {diff:.3g}")
  assert diff < ATOL

  # Greedy generation: 32 new tokens, token for token.
  prompts = _tokens(2, 7, seed=1)
  with torch.no_grad():
    want = model.generate(torch.tensor(prompts), attention_mask=torch.ones(prompts.shape,
                                                                            dtype=torch.long),
                          do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          pad_token_id=0).numpy()[:, prompts.shape[1]:]
  sampler = sampling.Sampler(cfg, sampling.SamplingConfig(max_new_tokens=NEW_TOKENS, greedy=True))
  rollout = sampler(params, [list(r) for r in prompts], jax.random.PRNGKey(0))
  got = np.asarray(rollout.tokens)[:, -NEW_TOKENS:]
  assert (np.asarray(rollout.lengths) == NEW_TOKENS).all()
  np.testing.assert_array_equal(got, want)

  # Export -> the reference reloads it with the same logits; our loader gets the same params.
  out = str(tmp_path / "export")
  # the qwen2 export is split into several files + an index, as transformers writes them
  hf.save_checkpoint(cfg, params, out, max_shard_size=40_000 if family == "qwen2" else
                     hf.DEFAULT_MAX_SHARD_BYTES)
  written = json.load(open(os.path.join(out, "config.json")))
  assert written["architectures"] == [hf.FAMILY_ARCHITECTURE[family]]
  assert written["model_type"] == family
  assert os.path.exists(os.path.join(out, "model.safetensors.index.json")) == (family == "qwen2")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  assert type(reloaded).__name__ == hf.FAMILY_ARCHITECTURE[family]
  np.testing.assert_allclose(_ref_logits(ref, reloaded, tokens), ours, atol=ATOL, rtol=0)
  cfg2, params2 = hf.load_checkpoint(out)
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_torch_layout_on_disk(ref, hf_models):
  """Linear weights are [out, in] in the file, exactly as transformers wrote them."""
  _, path = hf_models["qwen2"]
  cfg, params = hf.load_checkpoint(path)
  theirs = load_file(os.path.join(path, "model.safetensors"))
  q = theirs["model.layers.0.self_attn.q_proj.weight"]
  assert q.shape == (cfg.num_heads * cfg.head_dim, cfg.d_model)
  np.testing.assert_array_equal(
      np.asarray(params["layers_0"]["attn"]["q_proj"]).reshape(cfg.d_model, -1).T, q)
  np.testing.assert_array_equal(np.asarray(params["layers_1"]["mlp"]["down_proj"]).T,
                                theirs["model.layers.1.mlp.down_proj.weight"])
  np.testing.assert_array_equal(np.asarray(params["layers_1"]["attn"]["k_bias"]).reshape(-1),
                                theirs["model.layers.1.self_attn.k_proj.bias"])


def test_sharded_index_from_transformers(ref, hf_models, tmp_path):
  model, path = hf_models["llama"]
  sharded = str(tmp_path / "sharded")
  _save_pretrained(model, sharded, max_shard_size="40KB")
  files = [f for f in os.listdir(sharded) if f.endswith(".safetensors")]
  assert len(files) > 1 and os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
  cfg_a, a = hf.load_checkpoint(path)
  cfg_b, b = hf.load_checkpoint(sharded)
  assert cfg_a == cfg_b
  jax.tree.map(np.testing.assert_array_equal, a, b)


# ----------------------------------------------------------------------------- no torch needed

TINY = models.ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                          head_dim=16, mlp_dim=64, max_seq_len=64, qk_norm=True,
                          tie_embeddings=False, family="qwen3")


def _random_params(cfg, seed=0):
  """Random params of `cfg` without compiling anything (shapes from eval_shape)."""
  rng = np.random.RandomState(seed)
  shapes = jax.eval_shape(lambda: models.init_params(cfg, jax.random.PRNGKey(0)))
  return jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), shapes)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
  params = _random_params(TINY, seed=3)
  path = str(tmp_path_factory.mktemp("tiny"))
  hf.save_checkpoint(TINY, params, path, max_shard_size=20_000)  # several files + index
  return path, params


# fsdp=2 x tensor=4 on the 8 simulated devices. The default rules split vocab / heads / MLP
# over `tensor` (kv_heads=2 does not divide by 4 and stays replicated) and embed over `fsdp`;
# the transposed rules split every other axis, head_dim and the norms included.
TRANSPOSED_RULES = (("vocab", "fsdp"), ("embed", "tensor"), ("heads", "fsdp"),
                    ("kv_heads", "fsdp"), ("mlp", "fsdp"), ("head_dim", "tensor"),
                    ("norm", "tensor"))


@pytest.fixture(scope="module")
def qwen2_ckpt(tmp_path_factory):
  """A tied Qwen2 with q/k/v biases (the `bias` layout), exported by us."""
  cfg = TINY.replace(family="qwen2", qk_norm=False, attention_bias=True, tie_embeddings=True)
  params = _random_params(cfg, seed=4)
  path = str(tmp_path_factory.mktemp("tiny_qwen2"))
  hf.save_checkpoint(cfg, params, path)
  return cfg, path, params


@pytest.mark.parametrize("rules", ["default", "transposed"])
@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_mesh_targeted_load_reads_only_shards(tiny_ckpt, qwen2_ckpt, family, rules, monkeypatch):
  cfg, (path, params) = (TINY, tiny_ckpt) if family == "qwen3" else (qwen2_ckpt[0],
                                                                     qwen2_ckpt[1:])
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
  want = (sharding.param_shardings(cfg, mesh) if rules == "default" else
          sharding.param_shardings(cfg, mesh, TRANSPOSED_RULES))
  reads = []
  real = hf_layout._read_slice

  def spy(handle, name, slices):
    block = real(handle, name, slices)
    reads.append((name, block.size))
    return block
  monkeypatch.setattr(hf_layout, "_read_slice", spy)
  got_cfg, loaded = hf.load_checkpoint(path, sharding=want)
  assert got_cfg == cfg
  jax.tree.map(np.testing.assert_array_equal, loaded, params)
  jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim) or pytest.fail(
      f"{x.sharding} != {s}"), loaded, want)
  # Every tensor whose sharding splits it was only ever read a shard at a time.
  specs = hf_layout._param_specs(cfg)
  full = {name: int(np.prod(hf_layout._hf_shape(kind, shape))) for _, name, kind, shape in specs}
  split = {name for ours, name, _, _ in specs
           if any(a is not None for a in hf_load._get(want, ours).spec)}
  assert len(split) > 10
  assert {name for name, _ in reads} == set(full)
  for name, size in reads:
    if name in split:
      assert size < full[name], f"{name} was read whole"


def test_mesh_argument_and_dtype(tiny_ckpt):
  path, params = tiny_ckpt
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
  cfg, loaded = hf.load_checkpoint(path, sharding=mesh, dtype="bfloat16")
  assert cfg.param_dtype == cfg.dtype == "bfloat16"
  q = loaded["layers_0"]["attn"]["q_proj"]
  assert q.dtype == jax.numpy.bfloat16 and q.sharding.spec == P("fsdp", "tensor", None)
  np.testing.assert_array_equal(np.asarray(q), np.asarray(params["layers_0"]["attn"]["q_proj"],
                                                          jax.numpy.bfloat16))
  # one Sharding for every param
  one = NamedSharding(mesh, P())
  cfg16, p16 = hf.load_checkpoint(path, sharding=one, dtype="bfloat16")
  assert p16["embed"].sharding == one


def test_bfloat16_round_trip(tiny_ckpt, tmp_path):
  path, _ = tiny_ckpt
  cfg, params = hf.load_checkpoint(path, dtype="bfloat16")
  hf.save_checkpoint(cfg, params, str(tmp_path), max_shard_size=10_000)
  assert len(list(tmp_path.glob("*.safetensors"))) > 1
  hf.save_checkpoint(cfg, params, str(tmp_path))  # replaces the sharded export
  assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
  assert json.load(open(tmp_path / "config.json"))["torch_dtype"] == "bfloat16"
  cfg2, params2 = hf.load_checkpoint(str(tmp_path))  # dtype from config.json
  assert cfg2 == cfg and params2["embed"].dtype == jax.numpy.bfloat16
  jax.tree.map(np.testing.assert_array_equal, params2, params)


# The public config.json of real checkpoints (transformers v4 spelling: top-level rope_theta).
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256}


def test_real_configs_match_presets():
  assert hf.config_from_hf(QWEN3_0_6B) == models.get_preset("qwen3-0.6b")
  assert hf.config_from_hf(dict(QWEN3_0_6B, hidden_size=2048, intermediate_size=6144)) == \
      models.get_preset("qwen3-1.7b")
  assert hf.config_from_hf(LLAMA_3_2_1B) == models.get_preset("llama-3.2-1b")
  for name, preset in models.PRESETS.items():  # config.json round trip of every preset
    cfg = models.get_preset(name)
    assert hf.config_from_hf(json.loads(json.dumps(hf.config_to_hf(cfg)))) == cfg, name


def _copy(src, dst):
  shutil.copytree(src, dst)
  return str(dst)


def test_rejects_pickle_checkpoints(tiny_ckpt, tmp_path):
  path, _ = tiny_ckpt
  shutil.copy(os.path.join(path, "config.json"), tmp_path)
  (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
  with pytest.raises(ValueError, match=r"pickle.*pytorch_model\.bin|pytorch_model\.bin.*pickle"):
    hf.load_checkpoint(str(tmp_path))


def test_unsupported_architecture(tiny_ckpt, tmp_path):
  path = _copy(tiny_ckpt[0], tmp_path / "m")
  c = json.load(open(os.path.join(path, "config.json")))
  c["architectures"], c["model_type"] = ["MistralForCausalLM"], "mistral"
  json.dump(c, open(os.path.join(path, "config.json"), "w"))
  with pytest.raises(ValueError, match="MistralForCausalLM"):
    hf.load_checkpoint(path)
  c["architectures"], c["model_type"] = ["Qwen3ForCausalLM"], "qwen3"
  c["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
  json.dump(c, open(os.path.join(path, "config.json"), "w"))
  with pytest.raises(ValueError, match="yarn"):
    hf.load_checkpoint(path)
  with pytest.raises(ValueError, match="qk_norm"):
    hf.save_checkpoint(TINY.replace(qk_norm=False), {}, str(tmp_path / "x"))
  with pytest.raises(ValueError, match="no config.json"):
    hf.load_checkpoint(str(tmp_path / "nowhere"))


@pytest.mark.parametrize("change, match", [
    (lambda c: [c], "config.json: expected a JSON object, got a list"),
    (lambda c: "{not json", "config.json: not valid JSON"),
    (lambda c: dict(c, num_attention_heads=0), "config.json: num_attention_heads=0 must be"),
    (lambda c: dict(c, hidden_size=-4), "config.json: hidden_size=-4 must be an int >= 1"),
    (lambda c: dict(c, num_hidden_layers="2"), "num_hidden_layers='2' must be an int"),
    (lambda c: dict(c, vocab_size=64.5), "vocab_size=64.5 must be an int"),
    (lambda c: dict(c, num_key_value_heads=0), "num_key_value_heads=0 must be"),
    (lambda c: dict(c, num_key_value_heads=3), "config.json: .*num_kv_heads"),
    (lambda c: dict(c, head_dim=0), "head_dim=0 must be"),
    (lambda c: dict(c, rms_norm_eps=-1.0), "rms_norm_eps=-1.0 must be a finite number > 0"),
    (lambda c: dict(c, rope_theta=0, rope_parameters=dict(c.get("rope_parameters") or {},
                                                          rope_theta=0)),
     "rope_theta=0 must be a finite number > 0"),
    (lambda c: dict(c, max_position_embeddings=0), "max_position_embeddings=0 must be"),
    (lambda c: {k: v for k, v in c.items() if k != "vocab_size"}, "lacks \\['vocab_size'\\]"),
])
def test_bad_config_json_names_the_file_and_field(tiny_ckpt, tmp_path, change, match):
  path = _copy(tiny_ckpt[0], tmp_path / "m")
  cfg_file = os.path.join(path, "config.json")
  new = change(json.load(open(cfg_file)))
  with open(cfg_file, "w") as f:
    f.write(new if isinstance(new, str) else json.dumps(new))
  with pytest.raises(ValueError, match=match):
    hf.load_checkpoint(path)


def test_bad_weight_files_name_the_file(tiny_ckpt, tmp_path):
  path = _copy(tiny_ckpt[0], tmp_path / "m")
  index_file = os.path.join(path, "model.safetensors.index.json")
  index = json.load(open(index_file))
  fname = os.path.join(path, sorted(set(index["weight_map"].values()))[0])
  data = open(fname, "rb").read()
  open(fname, "wb").write(data[:len(data) // 2])  # truncated mid-tensor
  with pytest.raises(ValueError, match=re.escape(os.path.basename(fname))):
    hf.load_checkpoint(path)
  open(fname, "wb").write(b"\x00" * 7)  # shorter than a header
  with pytest.raises(ValueError, match="not a readable safetensors file"):
    hf.load_checkpoint(path)
  open(fname, "wb").write(data)
  json.dump([index], open(index_file, "w"))
  with pytest.raises(ValueError, match="index.json: expected a JSON object, got a list"):
    hf.load_checkpoint(path)
  json.dump({"weight_map": {"x": "../elsewhere.safetensors"}}, open(index_file, "w"))
  with pytest.raises(ValueError, match="weight_map must map tensor names to file names"):
    hf.load_checkpoint(path)


def test_missing_and_misshapen_tensors(tiny_ckpt, tmp_path):
  path = _copy(tiny_ckpt[0], tmp_path / "m")
  index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
  victim = "model.layers.1.self_attn.k_norm.weight"
  fname = os.path.join(path, index["weight_map"][victim])
  tensors = load_file(fname)
  good = dict(tensors)
  del tensors[victim]
  save_file(tensors, fname)
  del index["weight_map"][victim]
  json.dump(index, open(os.path.join(path, "model.safetensors.index.json"), "w"))
  with pytest.raises(ValueError, match=victim.replace(".", r"\.")):
    hf.load_checkpoint(path)
  good[victim] = good[victim][:8]
  save_file(good, fname)
  index["weight_map"][victim] = os.path.basename(fname)
  json.dump(index, open(os.path.join(path, "model.safetensors.index.json"), "w"))
  with pytest.raises(ValueError, match=r"k_norm.*shape \[8\]"):
    hf.load_checkpoint(path)


# ----------------------------------------------------------------------------- configs


def test_qwen3_mopd_config(tiny_ckpt):
  import configs.qwen3_mopd as q
  from mopd_jax.io.tokenizer import CharTokenizer

  full = q.get_config()
  assert full.model.preset == "qwen3-0.6b" and full.teacher.preset == "qwen3-1.7b"
  assert full.model.hf_path == "" and full.model.tokenizer_path == ""
  assert full.teacher.hf_paths == ""
  with pytest.raises(ValueError, match="huge"):
    q.get_config("huge")
  for name in ("seed", "stages", "model", "mesh", "data", "effort", "sft", "rl", "mopd",
               "rollout", "eval", "smoke", "teacher"):
    assert name in full, name

  tiny = q.get_config("tiny")
  vocab = CharTokenizer().vocab_size
  configure.build(tiny, 1)
  # The model block minus its checkpoint/tokenizer paths is what config.model_config builds.
  view = tiny.copy_and_resolve_references()
  with view.unlocked():
    for key in hf.BLOCK_KEYS[1:]:
      if key in view.model:
        del view.model[key]
  cfg = configure.model_config(view, vocab)
  assert cfg == hf.resolve_model_config(tiny.model, vocab)
  assert (cfg.d_model, cfg.num_layers, cfg.vocab_size) == (64, 2, vocab)
  assert cfg.family == "qwen3" and cfg.qk_norm and cfg.param_dtype == "float32"
  logits = jax.eval_shape(lambda: models.forward(
      cfg, models.init_params(cfg, jax.random.PRNGKey(0)), np.ones((1, 5), np.int32)))
  assert logits.shape == (1, 5, vocab)
  teacher = hf.resolve_model_config(tiny.teacher, vocab)
  assert teacher.family == "qwen3" and teacher.num_layers == 4 and teacher.vocab_size == vocab
  full_teacher = hf.resolve_model_config(full.teacher, 151_936)
  assert full_teacher == models.get_preset("qwen3-1.7b")
  assert hf.resolve_model_config(full.model, 151_936).replace(quant="none") == \
      models.get_preset("qwen3-0.6b")

  # With a checkpoint, its config.json wins; overrides may not change its shape.
  path, _ = tiny_ckpt
  from_ckpt = hf.resolve_model_config({"preset": "toy", "quant": "int8"}, 60, hf_path=path)
  assert from_ckpt == TINY.replace(quant="int8")
  with pytest.raises(ValueError, match="d_model"):
    hf.resolve_model_config({"preset": "toy", "d_model": 48}, 60, hf_path=path)
  # A tokenizer with more tokens than the embedding has rows: the config grows to it.
  assert hf.resolve_model_config({"preset": "toy"}, 72, hf_path=path) == \
      TINY.replace(vocab_size=72)


@pytest.mark.parametrize("tie", [False, True])
def test_embedding_grows_for_added_tokens(tmp_path, tie):
  """A checkpoint with no spare rows and a tokenizer with 8 more tokens: the embedding (and
  an untied head) grow by 8 rows, each the mean of the stored rows; every stored row and the
  logits of the stored tokens are unchanged; sharded equals unsharded; an export records the
  new vocabulary."""
  cfg = TINY.replace(tie_embeddings=tie)
  params = _random_params(cfg, seed=5)
  path = str(tmp_path / "ckpt")
  hf.save_checkpoint(cfg, params, path)
  got_cfg, grown = hf.load_checkpoint(path, vocab_size=72)
  assert got_cfg == cfg.replace(vocab_size=72) and grown["embed"].shape == (72, 32)
  np.testing.assert_array_equal(np.asarray(grown["embed"][:64]), params["embed"])
  np.testing.assert_allclose(np.asarray(grown["embed"][64:]),
                             np.repeat(params["embed"].mean(0, keepdims=True), 8, 0), atol=1e-6)
  if not tie:
    assert grown["lm_head"].shape == (32, 72)
    np.testing.assert_allclose(np.asarray(grown["lm_head"][:, 64:]),
                               np.repeat(params["lm_head"].mean(1, keepdims=True), 8, 1),
                               atol=1e-6)
  tokens = np.array([[1, 5, 9, 63]], np.int32)
  before = models.forward(cfg, jax.tree.map(jnp.asarray, params), tokens)
  after = models.forward(got_cfg, grown, tokens)
  np.testing.assert_allclose(np.asarray(after[..., :64]), np.asarray(before), atol=1e-5)
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
  _, sharded = hf.load_checkpoint(path, sharding=mesh, vocab_size=72)
  for a, b in zip(jax.tree.leaves(grown), jax.tree.leaves(sharded)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  out = str(tmp_path / "export")
  hf.save_checkpoint(got_cfg, jax.device_get(grown), out)
  assert json.load(open(os.path.join(out, "config.json")))["vocab_size"] == 72
  assert hf.load_checkpoint(path, vocab_size=60)[0].vocab_size == 64  # never shrinks


# --- a run from Hugging Face checkpoints, through the command line --------------------------
ROOT = suite_cli.ROOT


def test_student_from_hugging_face_checkpoint(tmp_path):
  """`model.hf_path`: the run starts from a safetensors checkpoint written by our exporter,
  one whose embedding lacks rows for the tokenizer's last 3 tokens (the effort tokens): the
  run grows it."""
  import configs.qwen3_mopd as q
  from mopd_jax.io import hf
  from mopd_jax.io.tokenizer import CharTokenizer
  cfg = configure.model_config(q.get_config("tiny"), CharTokenizer().vocab_size - 3)
  ckpt = tmp_path / "student"
  hf.save_checkpoint(cfg, jax.device_get(__import__("mopd_jax").models.init_params(
      cfg, jax.random.PRNGKey(3))), str(ckpt))
  env = suite_cli.env()
  proc = subprocess.run([sys.executable, "-m", "experiments.run", "--config",
                         "configs/qwen3_mopd.py:tiny", "--workdir", str(tmp_path / "wd"),
                         "--config.stages=smoke", f"--config.model.hf_path={ckpt}"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.count("sample=") == 3


@pytest.mark.slow  # ~90 s; loading each piece is covered by tests/test_hf.py
def test_teachers_from_hugging_face_checkpoints(tmp_path):
  """`teacher.hf_paths`: nine exported checkpoints of a deeper shape than the student are
  registered instead of trained, and MOPD distils from them."""
  import configs.qwen3_mopd as q
  from mopd_jax import configure, models
  from mopd_jax.io import hf
  from mopd_jax.io.tokenizer import CharTokenizer
  cfg = q.get_config("tiny")
  vocab = CharTokenizer().vocab_size
  tcfg = hf.resolve_model_config(cfg.teacher, vocab)
  assert tcfg.num_layers != configure.model_config(cfg, vocab).num_layers
  paths = {}
  for i, cell in enumerate(f"{d}/{e}" for d in ("gen", "agt", "cod")
                           for e in ("low", "high", "max")):
    p = tmp_path / f"t{i}"
    hf.save_checkpoint(tcfg, jax.device_get(models.init_params(tcfg, jax.random.PRNGKey(i))),
                       str(p))
    paths[cell] = str(p)
  # Two devices, teachers disaggregated: the student on device 0, the bank on device 1
  # (placement.TeacherScorer moves trajectories and log-probs between them).
  env = suite_cli.env(devices=2)
  proc = subprocess.run([sys.executable, "-m", "experiments.run", "--config",
                         "configs/qwen3_mopd.py:tiny", "--workdir", str(tmp_path / "wd"),
                         "--config.stages=data,sft,rl,mopd",
                         "--config.placement.teachers=disaggregated",
                         "--config.teacher.hf_paths=" + ",".join(f"{c}={p}"
                                                                 for c, p in paths.items())],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  manifest = json.load(open(tmp_path / "wd" / "teachers.json"))
  assert all(t["format"] == "hf" for t in manifest["teachers"].values())
  assert os.path.exists(tmp_path / "wd" / "mopd" / "DONE.json")
