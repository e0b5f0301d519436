"""The dense decoder matches transformers' PyTorch models built from the same weights."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jpinfer.models import hf_loader, params, transformer

from hf_reference import make_model
from tolerances import DECODER_ATOL

ARCHS = ["llama", "llama_relu", "llama_drelu", "mistral", "qwen2", "qwen2_window", "qwen3", "phi3", "gemma2", "gemma3",
         "falcon_new", "falcon_7b", "falcon_sequential", "falcon_gelu", "opt", "llama3_rope", "linear_rope",
         "yarn_rope", "mixtral", "qwen3_moe", "qwen3_moe_norm", "olmoe", "qwen2_moe",
         "granitemoe"]
FFN_KIND = {"llama_drelu": "drelu"}


def _load(arch, tmp_path):
    ref = make_model(arch, tmp_path)
    cfg, tensors = hf_loader.load_hf(tmp_path, ffn_kind=FFN_KIND.get(arch))
    return ref, cfg, params.build_weights(cfg, tensors)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_logits_match_transformers(arch, tmp_path):
    ref, cfg, weights = _load(arch, tmp_path)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, size=(2, 12))
    with torch.no_grad():  # transformers in float64: the tolerance covers only our float32 rounding
        expected = ref.double()(torch.tensor(tokens)).logits.numpy()

    full = np.asarray(transformer.score(weights, jnp.asarray(tokens), cfg))
    np.testing.assert_allclose(full, expected, atol=DECODER_ATOL, rtol=0)

    # Prefill 5 (right-padded to 8), then decode the rest one token at a time.
    cache = transformer.KVCache.create(cfg, batch=2, capacity=16)
    padded = np.zeros((2, 8), np.int64)
    padded[:, :5] = tokens[:, :5]
    step_logits, cache = transformer.prefill(weights, jnp.asarray(padded), jnp.int32(5), cache, cfg)
    got = [np.asarray(step_logits)]
    for t in range(5, 12):
        step_logits, cache = transformer.decode_step(weights, jnp.asarray(tokens[:, t]), cache, cfg)
        got.append(np.asarray(step_logits))
    np.testing.assert_allclose(np.stack(got[:-1], axis=1), expected[:, 4:11], atol=DECODER_ATOL, rtol=0)
    assert int(cache.length) == 12


@pytest.mark.parametrize("arch", ["llama", "opt", "phi3", "gemma2", "gemma3", "falcon_new", "mixtral", "qwen3_moe",
                                  "olmoe", "qwen2_moe", "granitemoe"])
def test_greedy_generation_matches_transformers(arch, tmp_path):
    ref, cfg, weights = _load(arch, tmp_path)
    prompt = [[5, 17, 3, 88]]
    with torch.no_grad():
        out = ref.generate(torch.tensor(prompt), max_new_tokens=10, do_sample=False, pad_token_id=0)
    expected = out[0, 4:].tolist()
    cache = transformer.KVCache.create(cfg, batch=1, capacity=16)
    step_logits, cache = transformer.prefill(weights, jnp.asarray(prompt), jnp.int32(4), cache, cfg)
    got, gaps = [], []
    for _ in range(10):
        token = int(jnp.argmax(step_logits[0]))
        got.append(token)
        gaps.append(float(np.diff(np.sort(np.asarray(step_logits[0]))[-2:])[0]))
        step_logits, cache = transformer.decode_step(weights, jnp.asarray([token]), cache, cfg)
    # well posed: logits within DECODER_ATOL of transformers' whose top two lie more than twice that apart
    # (>= 0.02 here) pick the same token, on any machine
    assert min(gaps) > 2 * DECODER_ATOL
    assert got == expected


def test_bfloat16_weights_stay_close_to_float32(tmp_path):
    ref, cfg, weights = _load("llama", tmp_path)
    tokens = jnp.asarray(np.arange(10)[None] % cfg.vocab_size)
    f32 = np.asarray(transformer.score(weights, tokens, cfg))
    bf16 = np.asarray(transformer.score(params.cast(weights, jnp.bfloat16), tokens, cfg))
    # bfloat16 (u = 2^-8 = 3.9e-3) rounds the weights and ~30 stored activations along each logit's path; as a
    # random walk with |terms| ~ 2x |values| that is ~sqrt(30) u * 2 ~ 4% of the logit scale: 0.05 is that
    # estimate (measured 3.1%; bfloat16 rounding is exact arithmetic, the same on every CPU).
    assert np.abs(bf16 - f32).max() < 0.05 * np.abs(f32).max()
    # argmax flips only where the top two float32 logits are closer than that error: at most 1 of 10 (measured 0)
    assert (bf16.argmax(-1) == f32.argmax(-1)).mean() > 0.8


@pytest.mark.parametrize("arch, kind", [("llama3_rope", "llama3"), ("linear_rope", "linear"), ("yarn_rope", "yarn")])
def test_rope_scaling_is_read_and_matters(arch, kind, tmp_path):
    """The scaled checkpoints above are not passed by plain RoPE: without the scaling the logits move far
    past the tolerance the parity test holds them to."""
    ref, cfg, weights = _load(arch, tmp_path)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.kind == kind
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, size=(1, 12)))
    scaled = np.asarray(transformer.score(weights, tokens, cfg))
    plain = np.asarray(transformer.score(weights, tokens, dataclasses.replace(cfg, rope_scaling=None)))
    assert np.abs(scaled - plain).max() > 100 * DECODER_ATOL


@pytest.mark.parametrize("feature", ["attn_softcap", "logit_softcap", "window_layers", "attn_scale", "embed_scale"])
def test_gemma2_features_are_read_and_matter(feature, tmp_path):
    """Each Gemma 2 feature the parity test passes is read from the checkpoint and binds there: without it
    (caps off, the window in every layer, the default scales) the logits move far past the tolerance."""
    ref, cfg, weights = _load("gemma2", tmp_path)
    assert (cfg.ffn_kind, cfg.sandwich_norms, cfg.window_layers, cfg.attn_softcap, cfg.logit_softcap) == (
        "geglu", True, (0, 2), 3.0, 4.0)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, size=(1, 12)))
    default = {"attn_softcap": None, "logit_softcap": None, "window_layers": None, "attn_scale": None,
               "embed_scale": 1.0}[feature]
    read = np.asarray(transformer.score(weights, tokens, cfg))
    without = np.asarray(transformer.score(weights, tokens, dataclasses.replace(cfg, **{feature: default})))
    assert np.abs(read - without).max() > 100 * DECODER_ATOL


def test_gemma3_reads_its_layer_types_and_both_rope_bases(tmp_path):
    """Gemma 3: the sliding layers rotate with their own base, the global ones with the scaled one: either
    base given to every layer moves the logits far past the tolerance the parity test holds them to."""
    ref, cfg, weights = _load("gemma3", tmp_path)
    assert (cfg.window_layers, cfg.local_rope_theta, cfg.rope_theta, cfg.qk_norm) == ((0, 1, 3), 50.0, 2000.0, True)
    assert cfg.rope_scaling.kind == "linear" and cfg.attn_softcap is None and cfg.logit_softcap is None
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, size=(1, 12)))
    read = np.asarray(transformer.score(weights, tokens, cfg))
    for other in (dict(local_rope_theta=None), dict(local_rope_theta=2000.0), dict(rope_scaling=None)):
        moved = np.asarray(transformer.score(weights, tokens, dataclasses.replace(cfg, **other)))
        assert np.abs(read - moved).max() > 100 * DECODER_ATOL, other


@pytest.mark.parametrize("arch, kind, prompt_length, total", [
    ("dynamic_rope", "dynamic", 4, 14), ("dynamic_rope", "dynamic", 10, 14),
    ("phi3_longrope", "longrope", 4, 8), ("phi3_longrope", "longrope", 10, 14)])
def test_length_dependent_rope_follows_transformers_step_by_step(arch, kind, prompt_length, total, tmp_path):
    """Scalings that depend on the length a call reaches past the original context (8): dynamic NTK stretches the
    base, LongRoPE switches from its short to its long factors. A generation (a prompt of 4 or 10 tokens,
    right-padded to 16 but reaching only its length, then new tokens to ``total`` positions, each step's new
    positions rotated for the length that step reaches, the cached keys kept as they were) gives transformers'
    generate logits at every step, and a whole 12-token sequence scores like transformers' forward (one length for
    every position). Both sides float32: DECODER_ATOL. LongRoPE generations stay on one side of the original
    context: where one crosses it, transformers' Phi-3 re-encodes the whole sequence with the long factors
    (README: not done here)."""
    ref, cfg, weights = _load(arch, tmp_path)
    assert cfg.rope_scaling.kind == kind and cfg.rope_scaling.original_max_position == 8
    prompt = [[5, 17, 3, 88, 41, 9, 60, 2, 33, 71][:prompt_length]]
    with torch.no_grad():  # a fresh module: transformers' dynamic rotary module keeps the longest length seen
        out = ref.generate(torch.tensor(prompt), max_new_tokens=total - prompt_length, do_sample=False, pad_token_id=0,
                           output_logits=True, return_dict_in_generate=True)
    expected = np.stack([step[0].numpy() for step in out.logits])
    cache = transformer.KVCache.create(cfg, batch=1, capacity=16)
    padded = np.zeros((1, 16), np.int64)  # right-padded: the step reaches the prompt's length, not 16
    padded[0, :prompt_length] = prompt[0]
    step_logits, cache = transformer.prefill(weights, jnp.asarray(padded), jnp.int32(prompt_length), cache, cfg)
    got = []
    for token in out.sequences[0, prompt_length:].tolist():
        got.append(np.asarray(step_logits[0]))
        step_logits, cache = transformer.decode_step(weights, jnp.asarray([token]), cache, cfg)
    np.testing.assert_allclose(np.stack(got), expected, atol=DECODER_ATOL, rtol=0)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 12))
    fresh = make_model(arch, tmp_path / "fresh")  # the same seed: the same weights, nothing seen yet
    with torch.no_grad():
        whole = fresh(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(transformer.score(weights, jnp.asarray(tokens), cfg)), whole,
                               atol=DECODER_ATOL, rtol=0)
    plain = dataclasses.replace(cfg, rope_scaling=None)
    assert np.abs(np.asarray(transformer.score(weights, jnp.asarray(tokens), plain)) - whole).max() > 100 * DECODER_ATOL


@pytest.mark.parametrize("feature", ["embed_scale", "attn_scale", "residual_scale", "logit_divisor"])
def test_granitemoe_multipliers_are_read_and_matter(feature, tmp_path):
    """Each GraniteMoE multiplier the parity test passes is read from the checkpoint and binds there: at its default
    the logits move far past the tolerance."""
    ref, cfg, weights = _load("granitemoe", tmp_path)
    assert (cfg.embed_scale, cfg.attn_scale, cfg.residual_scale, cfg.logit_divisor) == (3.0, 0.2, 0.5, 2.5)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, size=(1, 12)))
    default = {"embed_scale": 1.0, "attn_scale": None, "residual_scale": 1.0, "logit_divisor": 1.0}[feature]
    read = np.asarray(transformer.score(weights, tokens, cfg))
    without = np.asarray(transformer.score(weights, tokens, dataclasses.replace(cfg, **{feature: default})))
    assert np.abs(read - without).max() > 100 * DECODER_ATOL
