"""Hugging Face checkpoint loading: sharded files, bfloat16, and every error a user can hit."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import jpinfer
from jpinfer.models.hf_config import parse_config
from jpinfer.models.hf_loader import CheckpointError, load_hf
from jpinfer.models.loading import load_model

from hf_reference import make_model, tiny_config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2")
    model = make_model("qwen2", directory)
    return directory, model


def _copy(checkpoint, tmp_path):
    directory, _ = checkpoint
    target = tmp_path / "ckpt"
    shutil.copytree(directory, target)
    return target


def _weights_file(directory):
    return next(directory.glob("*.safetensors"))


def test_tensors_are_the_hf_weights(checkpoint):
    directory, model = checkpoint
    cfg, tensors = load_hf(directory)
    layer = model.model.layers[1]
    np.testing.assert_array_equal(tensors["layers.1.wq"], layer.self_attn.q_proj.weight.detach().numpy())
    np.testing.assert_array_equal(tensors["layers.1.bk"], layer.self_attn.k_proj.bias.detach().numpy())
    np.testing.assert_array_equal(tensors["layers.1.w_down"], layer.mlp.down_proj.weight.detach().numpy())
    assert cfg.qkv_bias and cfg.tie_embeddings and "lm_head" not in tensors


def test_sharded_and_bfloat16_checkpoints_load(checkpoint, tmp_path):
    _, model = checkpoint
    model.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    model.float()
    assert (tmp_path / "model.safetensors.index.json").exists()
    _, tensors = load_hf(tmp_path)
    expected = model.model.layers[0].mlp.up_proj.weight.detach().to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(tensors["layers.0.w_up"], expected)


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_hf(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="config.json"):
        load_hf(tmp_path)
    with pytest.raises(ValueError, match="no such checkpoint"):
        jpinfer.load(tmp_path / "nope")


def test_no_safetensors_files(checkpoint, tmp_path):
    target = _copy(checkpoint, tmp_path)
    _weights_file(target).unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_hf(target)


def _edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"rope_scaling": {"rope_type": "mrope", "factor": 4.0}}, "RoPE scaling type 'mrope' is not supported"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs the original context length"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "factor must be positive"),
        ({"rope_scaling": {"rope_type": "yarn", "mscale": 1.0, "mscale_all_dim": 1.0}}, "RoPE scaling 'yarn'"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 4, "original_max_position_embeddings": 8}},
         "RoPE scaling 'longrope': KeyError\\('long_factor'"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": None},
         "needs the original context length"),
        ({"partial_rotary_factor": 0.5}, "partial rotary embedding"),
        ({"use_bidirectional_attention": True}, "bidirectional attention"),
        ({"architectures": ["Gemma3ForCausalLM"], "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
         "RoPE scaling in the sliding-window layers"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}},
         "partial rotary embedding"),
        ({"architectures": ["DeepseekV2ForCausalLM"]}, "'DeepseekV2ForCausalLM' is not supported yet: it needs "
                                                        "multi-head latent attention"),
        ({"architectures": ["DeepseekV3ForCausalLM"]}, "'DeepseekV3ForCausalLM' is not supported yet: it needs "
                                                        "multi-head latent attention"),
        ({"architectures": ["Qwen3MoeForCausalLM"], "mlp_only_layers": [1]}, r"dense FFN layers .*mlp_only_layers"),
        ({"architectures": ["Qwen2MoeForCausalLM"], "decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ({"architectures": ["Qwen3MoeForCausalLM"], "use_sliding_window": True}, "use_sliding_window"),
        ({"architectures": ["OlmoeForCausalLM"], "clip_qkv": 8.0}, "clip_qkv"),
        ({"architectures": ["Qwen2MoeForCausalLM"], "moe_intermediate_size": 16, "shared_expert_intermediate_size": 40},
         "shared expert of 40 neurons is not a multiple"),
    ],
)
def test_unsupported_configs(checkpoint, tmp_path, changes, message):
    target = _copy(checkpoint, tmp_path)
    _edit_config(target, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_hf(target)


@pytest.mark.parametrize("changes, window", [
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}, 8),
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}, None),  # layers 2.. slide: none
    ({"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 0}, None),
    ({"use_sliding_window": True, "sliding_window": 8, "layer_types": ["sliding_attention"] * 2}, 8),
])
def test_qwen_sliding_window_layers(checkpoint, tmp_path, changes, window):
    """layer_types (written by transformers 5) wins over max_window_layers, as in transformers' config."""
    changes = {"layer_types": None} | changes
    target = _copy(checkpoint, tmp_path)
    _edit_config(target, **changes)
    assert load_hf(target)[0].sliding_window == window


def test_a_sliding_window_in_some_layers_only_slides_those(checkpoint, tmp_path):
    """transformers slides only the layers from max_window_layers on (test_transformer_parity's qwen2_window
    runs such a model against transformers); a layer_types list of another length or kind is refused."""
    target = _copy(checkpoint, tmp_path)
    _edit_config(target, use_sliding_window=True, sliding_window=8, max_window_layers=1, layer_types=None)
    cfg = load_hf(target)[0]
    assert (cfg.sliding_window, cfg.window_layers, cfg.layer_window(0), cfg.layer_window(1)) == (8, (1,), None, 8)
    _edit_config(target, layer_types=["sliding_attention"])
    with pytest.raises(CheckpointError, match="layer_types must name 2 layers"):
        load_hf(target)


def test_missing_config_field(checkpoint, tmp_path):
    target = _copy(checkpoint, tmp_path)
    config = json.loads((target / "config.json").read_text())
    del config["hidden_size"]
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_hf(target)


def test_missing_tensor_is_named(checkpoint, tmp_path):
    target = _copy(checkpoint, tmp_path)
    tensors = load_file(_weights_file(target))
    del tensors["model.layers.1.mlp.gate_proj.weight"]
    save_file(tensors, _weights_file(target))
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.gate_proj.weight"):
        load_hf(target)


def test_shape_disagreeing_with_config(checkpoint, tmp_path):
    target = _copy(checkpoint, tmp_path)
    _edit_config(target, intermediate_size=44)
    with pytest.raises(CheckpointError, match=r"layers.0.w_up.*shape \(40, 32\).*\(44, 32\)"):
        load_model(target)


def test_truncated_file(checkpoint, tmp_path):
    target = _copy(checkpoint, tmp_path)
    f = _weights_file(target)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_hf(target)


def test_missing_shard(checkpoint, tmp_path):
    _, model = checkpoint
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    next(tmp_path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="shard file\\(s\\) missing: model-00002"):
        load_hf(tmp_path)


@pytest.mark.parametrize("changes, message", [
    ({"activation": "silu"}, "Falcon activation 'silu' is not supported"),
    ({"alibi": True}, "ALiBi positions"),
    ({"new_decoder_architecture": True, "parallel_attn": False, "num_ln_in_parallel_attn": 1}, "needs parallel_attn"),
])
def test_falcon_features_still_missing_are_named(changes, message, tmp_path):
    config = tiny_config("falcon_new").to_dict() | {"architectures": ["FalconForCausalLM"]} | changes
    with pytest.raises(CheckpointError, match=message):
        parse_config(config, tmp_path)
