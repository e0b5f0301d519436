"""The engine's FFN strategy: a sparse strategy plugs into generate/stream unchanged."""

import pytest

from jpinfer import Engine, FfnStrategy, GenerationConfig, LoadedModel
from jpinfer.ffn import oracle_strategy

from profiler_fixtures import CharTokenizer, tiny_engine


@pytest.mark.parametrize("arch", [{}, dict(n_experts=4, experts_per_token=2)], ids=["swiglu", "mixtral-like"])
def test_oracle_strategy_with_every_neuron_generates_what_dense_generates(arch):
    """mixtral-like: the oracle's neuron-major layout weights each listed activation by its expert's routing."""
    dense = tiny_engine("swiglu", **arch)
    oracle = dense.with_ffn(oracle_strategy(dense.model, thresholds=float("-inf")))
    assert oracle.model is dense.model and oracle.ffn.name == "oracle" and "ffn=oracle" in repr(oracle)
    config = GenerationConfig(max_new_tokens=12)
    prompt = [1, 5, 9, 2, 7]
    assert oracle.generate(prompt, config).token_ids == dense.generate(prompt, config).token_ids
    assert "".join(oracle.stream("abc", config)) == "".join(dense.stream("abc", config))


def test_a_strategy_that_drops_every_neuron_changes_the_output():
    """The strategy is really used: thresholds above every activation remove the FFNs."""
    dense = tiny_engine("swiglu")
    nothing = dense.with_ffn(oracle_strategy(dense.model, thresholds=1e9, capacity=4))
    config = GenerationConfig(max_new_tokens=8)
    prompt = [1, 5, 9, 2, 7]
    first = lambda engine: engine.generate(prompt, config).token_ids
    assert first(nothing) != first(dense)


def test_engine_defaults_to_the_dense_strategy():
    engine = tiny_engine("relu")
    assert engine.ffn == FfnStrategy() and engine.ffn.impl is None
    rebuilt = Engine(LoadedModel(engine.cfg, engine.weights, CharTokenizer(), "tiny"))
    ids = rebuilt.generate([1, 2, 3], max_new_tokens=4).token_ids
    assert ids == engine.generate([1, 2, 3], max_new_tokens=4).token_ids
