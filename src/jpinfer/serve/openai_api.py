"""OpenAI's API as jpinfer reads and writes it: request bodies checked into a ``Completion`` to run,
answers and stream chunks in OpenAI's shapes, errors as OpenAI's error object. No HTTP here.

What a field asks for is done, or the request is refused with a 400 that names the field: a client that
sets ``n: 3``, tools or logprobs gets an error, never an answer that silently ignored them. Fields that
only describe the caller (``user``, ``metadata``) are accepted. Unknown fields are refused, as OpenAI
refuses them ("Unrecognized request argument supplied").
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from jpinfer.runtime.generation import GenerationConfig, GenerationResult

MAX_STOP_STRINGS = 4  # OpenAI's limit
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}

_SHARED = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
           "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "user", "metadata"}
CHAT_FIELDS = _SHARED | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                         "function_call", "parallel_tool_calls", "response_format", "store"}
COMPLETION_FIELDS = _SHARED | {"prompt", "echo", "suffix", "best_of"}


class ApiError(Exception):
    """An answer in OpenAI's error shape: HTTP ``status``, ``message``, ``type``, the ``param`` at fault, a ``code``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclasses.dataclass
class Completion:
    """A checked request: what to run and how to answer. ``prompt`` is text or ids (completions) or messages
    (chat); ``max_tokens`` None means the rest of the context."""

    chat: bool
    prompt: Any
    max_tokens: int | None
    config: GenerationConfig
    stream: bool
    include_usage: bool
    model: str


def _number(body: dict, name: str, default: float, low: float, high: float, *, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"'{name}' must be a number, got {type(value).__name__}", name)
    if not (low < value if low_open else low <= value) or value > high:
        raise bad(f"'{name}' must be in {'(' if low_open else '['}{low}, {high}], got {value}", name)
    return float(value)


def _integer(body: dict, name: str, low: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer, got {type(value).__name__}", name)
    if low is not None and value < low:
        raise bad(f"'{name}' must be at least {low}, got {value}", name)
    return value


def _refuse_unless(body: dict, name: str, allowed: tuple, why: str) -> None:
    if name in body and body[name] not in allowed:
        raise bad(f"'{name}' is not supported: {why}", name)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    return tuple(stops)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad(f"{where} must be an object with a string 'role'", where)
        extra = set(message) - {"role", "content"}
        if extra:
            raise bad(f"{where} has fields this server does not support: {sorted(extra)} (tools, names and "
                      "refusals are not supported)", where)
        content = message.get("content")
        if isinstance(content, list):  # text parts only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"{where}.content: only text parts are supported", f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string or a list of text parts", f"{where}.content")
        out.append({"role": message["role"], "content": content})
    return out


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("'prompt' is empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad("'prompt' as a list of several prompts is not supported: send one request per prompt", "prompt")
    raise bad("'prompt' must be a non-empty string or a list of token ids", "prompt")


def parse(body: Any, *, chat: bool, served: str) -> Completion:
    """A request body (parsed JSON) checked against what this server can honour; raises ``ApiError``."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(set(body) - (CHAT_FIELDS if chat else COMPLETION_FIELDS))
    if unknown:
        raise bad(f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0])
    model = body.get("model", served)
    if not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    if model != served:
        raise ApiError(404, f"The model '{model}' does not exist: this server serves '{served}'", param="model",
                       code="model_not_found")
    _refuse_unless(body, "n", (None, 1), "one choice per request (send several requests: they are decoded together)")
    _refuse_unless(body, "presence_penalty", (None, 0, 0.0), "no repetition penalties")
    _refuse_unless(body, "frequency_penalty", (None, 0, 0.0), "no repetition penalties")
    _refuse_unless(body, "logit_bias", (None, {}), "no logit bias")
    if chat:
        _refuse_unless(body, "logprobs", (None, False), "no log probabilities")
        _refuse_unless(body, "top_logprobs", (None, 0), "no log probabilities")
        for name in ("tools", "functions", "function_call"):
            _refuse_unless(body, name, (None, [], "none"), "no tool or function calling")
        _refuse_unless(body, "tool_choice", (None, "none"), "no tool or function calling")
        _refuse_unless(body, "parallel_tool_calls", (None, False, True), "no tool calling")
        _refuse_unless(body, "response_format", (None, {"type": "text"}), "text answers only")
        _refuse_unless(body, "store", (None, False), "nothing is stored")
    else:
        _refuse_unless(body, "logprobs", (None, 0), "no log probabilities")
        _refuse_unless(body, "echo", (None, False), "the prompt is not echoed")
        _refuse_unless(body, "suffix", (None, ""), "no insertion (suffix)")
        _refuse_unless(body, "best_of", (None, 1), "one candidate per request")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise bad("'stream_options' takes {\"include_usage\": true|false}, with 'stream': true", "stream_options")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, name, low=1)
    if max_tokens is None and not chat:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    seed = _integer(body, "seed")
    config = GenerationConfig(
        max_new_tokens=1, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True), top_k=_integer(body, "top_k", low=0) or 0,
        seed=(uuid.uuid4().int if seed is None else seed) % 2**32, stop=_stop(body))
    return Completion(chat, _messages(body) if chat else _prompt(body), max_tokens, config, stream,
                      bool((options or {}).get("include_usage")), model)


def budget(completion: Completion, n_prompt: int, context: int) -> int:
    """The tokens to generate for a prompt of ``n_prompt`` tokens in ``context`` slots; a 400 stating both counts
    when the prompt, or the prompt and ``max_tokens``, do not fit."""
    if n_prompt >= context:
        raise bad(f"This model's maximum context length is {context} tokens. However, your "
                  f"{'messages' if completion.chat else 'prompt'} resulted in {n_prompt} tokens. Please reduce "
                  "the length of the input.", "messages" if completion.chat else "prompt", "context_length_exceeded")
    if completion.max_tokens is None:
        return context - n_prompt
    if n_prompt + completion.max_tokens > context:
        raise bad(f"This model's maximum context length is {context} tokens. However, you requested "
                  f"{n_prompt + completion.max_tokens} tokens ({n_prompt} in the "
                  f"{'messages' if completion.chat else 'prompt'}, {completion.max_tokens} in the completion). "
                  "Please reduce the length of the input or of max_tokens.", "max_tokens", "context_length_exceeded")
    return completion.max_tokens


class Answer:
    """The answer to one completion in OpenAI's shapes: whole, or as stream chunks."""

    def __init__(self, completion: Completion) -> None:
        self.chat = completion.chat
        self.model = completion.model
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"

    def _head(self, chunk: bool) -> dict:
        return {"id": self.id, "object": self.object + (".chunk" if chunk and self.chat else ""),
                "created": self.created, "model": self.model}

    @staticmethod
    def usage(result: GenerationResult) -> dict:
        prompt, completion = len(result.prompt_token_ids), len(result.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def whole(self, result: GenerationResult) -> dict:
        finish = FINISH_REASONS[result.finish_reason]
        choice = ({"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None,
                   "finish_reason": finish} if self.chat else
                  {"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish})
        return self._head(False) | {"choices": [choice], "usage": self.usage(result)}

    def chunk(self, text: str | None = None, finish: str | None = None, *, first: bool = False) -> dict:
        """A stream chunk: the assistant's role first (chat), then text pieces, then the finish reason."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return self._head(True) | {"choices": [choice]}

    def finish_chunk(self, result: GenerationResult) -> dict:
        return self.chunk(finish=FINISH_REASONS[result.finish_reason])

    def usage_chunk(self, result: GenerationResult) -> dict:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        return self._head(True) | {"choices": [], "usage": self.usage(result)}
