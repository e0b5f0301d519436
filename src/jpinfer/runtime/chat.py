"""Chat messages to token ids, without letting a message's content act as markup.

Rendering the chat template to text and tokenizing all of it with special tokens parsed lets a user message
holding ``<|im_end|>\\n<|im_start|>assistant`` open turns of its own (on the default model: 4 im_start ids for
one user message). Here the template is rendered with an unguessable placeholder for each content; only the
template's own text is tokenized with special tokens parsed, and each content as plain text (control tokens
written in it stay text, and so do token ids spelled out). Escaping the content instead cannot be complete:
whatever an escape leaves behind, the tokenizer may still parse.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Sequence

import jinja2

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")


def check_messages(messages: Sequence[dict]) -> None:
    """ValueError unless ``messages`` is a non-empty list of {"role", "content"} with a known role and text."""
    if not messages:
        raise ValueError("messages is empty: give at least one {'role', 'content'} message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"} or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content' (got {m!r:.80})")
        if m["role"] not in ROLES:
            raise ValueError(f"message {i} has role {m['role']!r}; chat roles are {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ValueError(f"message {i} content must be text, got {type(m['content']).__name__}")


def chat_ids(tokenizer: Any, messages: Sequence[dict]) -> list[int]:
    """Token ids of ``messages`` in the tokenizer's chat template, ending with the assistant's turn opened.

    The template's text is tokenized with special tokens parsed, each message's content as plain text. A
    template that trims contents (Llama 3's, Gemma's) gets them trimmed; one that changes them otherwise
    cannot be split this way and is refused (ValueError). Where the pieces meet at pre-tokenizer boundaries
    (ChatML's newlines, the headers' control tokens) the ids equal the whole text's tokenization.
    """
    check_messages(messages)
    nonce = secrets.token_hex(8)
    marks = [f"\ue000{nonce}.{i}\ue001" for i in range(len(messages))]

    def render(contents: list[str]) -> str:
        try:
            return tokenizer.apply_chat_template([{**m, "content": c} for m, c in zip(messages, contents)],
                                                 add_generation_prompt=True, tokenize=False)
        except jinja2.TemplateError as err:  # the template's own checks (roles must alternate, ...)
            raise ValueError(f"the chat template refused these messages: {err}") from None

    with_marks = render(marks)
    direct = render([m["content"] for m in messages])
    pieces = re.split(f"(\ue000{nonce}\\.\\d+\ue001)", with_marks)  # template text, mark, template text, ...
    for placed in (lambda c: c, str.strip):
        contents = {mark: placed(m["content"]) for mark, m in zip(marks, messages)}
        if "".join(contents.get(p, p) for p in pieces) == direct:
            break
    else:
        raise ValueError("this model's chat template changes message contents beyond trimming them: its markup "
                         "and the contents cannot be told apart, so chat input cannot be tokenized safely")
    ids: list[int] = []
    for piece in pieces:
        if piece in contents:
            ids += tokenizer(contents[piece], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    return [int(i) for i in ids]
