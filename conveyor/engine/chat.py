"""Chat prompts: a conversation through the model's chat template to prompt token ids (``LLM.chat``,
``conveyor chat`` and the server's ``/v1/chat/completions`` share this)."""

from __future__ import annotations

from collections.abc import Sequence

Conversation = Sequence[dict]  # [{"role": "system" | "user" | "assistant", "content": str}, ...]


def chat_prompt(tokenizer, messages: Conversation, add_generation_prompt: bool = True,
                chat_template: str | None = None, tools: list[dict] | None = None) -> str:
    """A conversation as prompt text through the chat template (``tools``: for templates that render them).
    ValueError when the template refuses the messages."""
    if not messages:
        raise ValueError("a conversation needs at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"message {i} must be a dict with a 'role' and a 'content', got {m!r}")
    try:
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, tools=tools)
    except Exception as exc:  # jinja errors (raise_exception in templates, bad roles) are the caller's
        raise ValueError(f"messages could not be rendered with the chat template: {exc}") from exc


def render_chat(tokenizer, messages: Conversation, add_generation_prompt: bool = True,
                chat_template: str | None = None, add_special_tokens: bool = False) -> list[int]:
    """Token ids of a conversation. The template writes the special tokens (BOS, turn markers) itself, so the
    text is encoded without adding any (unless ``add_special_tokens``)."""
    text = chat_prompt(tokenizer, messages, add_generation_prompt, chat_template)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def as_conversations(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    """One conversation (a list of message dicts) or a batch of them -> a list of conversations."""
    messages = list(messages)
    if messages and isinstance(messages[0], dict):
        return [messages]
    return [list(conv) for conv in messages]
