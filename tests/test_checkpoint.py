"""model/checkpoint.py: save and load round trips (bit-exact, loaded by transformers too), and bad checkpoints
named (a wrong model type, missing or misshaped weights, NaN in its JSON files)."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model.checkpoint import load_model, save_checkpoint  # noqa: E402
from tiny import hf_logits, make_hf  # noqa: E402

TOL = 1e-4  # our logits against transformers'


@pytest.mark.parametrize("shard_bytes", [5 * 2**30, 40_000])
def test_save_load_round_trip_is_bit_exact_and_loads_in_transformers(pair, tmp_path, shard_bytes):
    hf, ours, src = pair
    out = save_checkpoint(ours.state_dict(), src, tmp_path / "ckpt", max_shard_bytes=shard_bytes)
    sharded = (out / "model.safetensors.index.json").exists()
    assert sharded == (shard_bytes < 2**20)
    again = load_model(out)
    for (k, a), (k2, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    ids = torch.randint(0, 97, (1, 20))
    with torch.no_grad():
        assert (hf_logits(hf2, ids) - ours(ids, torch.arange(20)[None])).abs().max() <= TOL
    assert not list(tmp_path.glob(".ckpt.tmp-*")), "temporary directory left behind"


def test_unknown_model_type_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match=r"config\.json.*model_type 'gpt2'"):
        load_model(tmp_path)


def test_missing_and_misshaped_weights_are_named(tmp_path):
    from safetensors.torch import load_file, save_file
    make_hf("llama", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    bad = dict(state)
    bad[name] = torch.zeros(3, 3)
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.safetensors.*model\.layers\.1\.mlp\.up_proj\.weight.*\(3, 3\)"):
        load_model(tmp_path)
    del bad[name]
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight.*missing"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(tmp_path)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool])
def test_weights_that_are_not_floating_point_are_named(tmp_path, dtype):
    """Integers or booleans would load as numbers (copied into fp32) and run: a damaged or foreign file."""
    from safetensors.torch import load_file, save_file
    make_hf("llama", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    state[name] = torch.ones_like(state[name], dtype=dtype)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"model\.safetensors: weight '{name}' is stored as (I64|I8|BOOL): a "
                                         r"model's weights are floating point \(F32, BF16, F16, F64\)"):
        load_model(tmp_path)


NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"]  # Python's JSON reader takes them all


@pytest.mark.parametrize("const", NON_FINITE)
def test_checkpoint_json_refuses_non_finite_numbers(tmp_path, const):
    """config.json, the safetensors index and the tokenizer's JSON files: a NaN or infinity anywhere in them is
    refused when parsed, naming the file and the constant."""
    from model.checkpoint import load_config, weight_files
    from model.tokenizer import _read_json
    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "rms_norm_eps": 1e-5}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_config(tmp_path).rms_norm_eps == 1e-5
    files = {"config.json": lambda: load_config(tmp_path),
             "model.safetensors.index.json": lambda: weight_files(tmp_path),
             "tokenizer_config.json": lambda: _read_json(tmp_path / "tokenizer_config.json")}
    for name, read in files.items():
        (tmp_path / name).write_text(json.dumps({**config, "weight_map": {}}).replace("1e-05", const))
        with pytest.raises(ValueError) as e:
            read()
        assert f"{tmp_path / name}: field 'rms_norm_eps': {const} is " in str(e.value), str(e.value)
