"""Chat templates: the tokenizer's own, or a plain built-in one for models without one."""

from __future__ import annotations

from typing import Any

# For base models (such as the embedded story model): the conversation as plain text, one
# message per line, generation continuing right after the last message.
BUILTIN_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% if not loop.last %}\n{% endif %}{% endfor %}"
)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def apply_chat_template(
    tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of the conversation (and its tools, where the template renders them), followed
    by the assistant's generation prompt unless told not to."""
    template = None if has_chat_template(tokenizer) else BUILTIN_CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False, tools=tools
    )
    # The template writes special tokens (BOS) itself.
    return list(tokenizer(text, add_special_tokens=False).input_ids)
