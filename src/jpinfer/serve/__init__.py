"""``jpinfer serve``: an OpenAI-compatible server (``app``: HTTP; ``openai_api``: the API's requests and
answers; ``scheduler``: the engine thread over a batch decoder; ``cli``: the command)."""
