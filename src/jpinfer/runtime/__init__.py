"""Generation runtime: engine loop, sampling, sparse FFN strategies."""
