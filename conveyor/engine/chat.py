"""Chat prompts: a conversation through the model's chat template to prompt token ids (``LLM.chat``,
``conveyor chat`` and the server's ``/v1/chat/completions`` share this)."""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.engine.prompts import encode_text

Conversation = Sequence[dict]  # [{"role": "system" | "user" | "assistant", "content": str}, ...]


class FinalMessageError(ValueError):
    """``continue_final_message`` asked for a conversation whose final message cannot be left open."""


def chat_prompt(tokenizer, messages: Conversation, add_generation_prompt: bool = True,
                chat_template: str | None = None, continue_final_message: bool = False,
                tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
    """A conversation as prompt text through the chat template. ValueError when the template refuses the
    messages. ``continue_final_message``: the final message is left open (no end-of-turn after it, no generation
    prompt), so that the model continues it, e.g. an assistant answer prefilled by the client (vLLM's and
    transformers' option; FinalMessageError when it cannot be). ``tools``: for templates that render them;
    ``template_kwargs``: more variables for the template (vLLM's ``chat_template_kwargs``, e.g. Qwen3's
    ``enable_thinking``)."""
    if not messages:
        raise ValueError("a conversation needs at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"message {i} must be a dict with a 'role' and a 'content', got {m!r}")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    try:
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, tools=tools, **(template_kwargs or {}))
    except Exception as exc:  # jinja errors (raise_exception in templates, bad roles) are the caller's
        raise ValueError(f"messages could not be rendered with the chat template: {exc}") from exc
    return open_final_message(text, messages[-1].get("content")) if continue_final_message else text


def open_final_message(rendered: str, content) -> str:
    """``rendered`` cut right after the final message's ``content``, as transformers' ``apply_chat_template``
    (which vLLM calls) does: templates are free-form jinja, so the one thing known about the text is that the
    message's content is in it, and the last occurrence is the final message's. The content's own trailing
    whitespace stays when the template kept it; a template that trims it is followed."""
    if not isinstance(content, str) or not content.strip():
        raise FinalMessageError("continue_final_message needs a final message with text to continue, got "
                                f"{content!r}")
    stripped = content.strip()
    at = rendered.rfind(stripped)
    if at < 0:
        raise FinalMessageError("continue_final_message: the final message's text is not in the chat template's "
                                "output (the template rewrites it), so there is no place to continue it from")
    kept = content.lstrip()  # the leading whitespace is before `at` either way
    end = at + len(kept) if rendered.startswith(kept, at) else at + len(stripped)
    return rendered[:end]


def render_chat(tokenizer, messages: Conversation, add_generation_prompt: bool = True,
                chat_template: str | None = None, add_special_tokens: bool = False,
                continue_final_message: bool = False, tools: list[dict] | None = None) -> list[int]:
    """Token ids of a conversation (``chat_prompt``'s text). The template writes the special tokens (BOS, turn
    markers) itself, so the text is encoded without adding any (unless ``add_special_tokens``). ValueError as
    ``chat_prompt`` raises it, or (naming "messages") for text that is not valid Unicode (``encode_text``)."""
    text = chat_prompt(tokenizer, messages, add_generation_prompt, chat_template, continue_final_message, tools)
    return encode_text(tokenizer, text, add_special_tokens, field="messages")


def as_conversations(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    """One conversation (a list of message dicts) or a batch of them -> a list of conversations."""
    messages = list(messages)
    if messages and isinstance(messages[0], dict):
        return [messages]
    return [list(conv) for conv in messages]
