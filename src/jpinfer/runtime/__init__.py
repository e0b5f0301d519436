"""Generation runtime: the engine loop (prompts, steps, stops, timing), sampling, and the FFN
strategy seam (``FfnStrategy``; the strategies themselves live in ``jpinfer.ffn``)."""
