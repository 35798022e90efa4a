"""What a chat message may look like before it reaches a chat template: OpenAI's roles, and content that
is a string or a list of text parts. The HTTP server checks the same rules with pydantic (so its 400s
name the field, e.g. `messages.2.role`); the offline `LLM.chat` calls `check_messages`."""
from __future__ import annotations

from typing import Any

# OpenAI's roles. A template would happily render any other string as a turn header, so an unknown role
# ("wizard") is refused rather than silently becoming part of the prompt.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# Roles whose content may be null (an assistant turn that only made tool calls).
NULL_CONTENT_ROLES = ("assistant",)


def content_text(content: Any) -> str | None:
    """The text of a message's content: a string, or OpenAI's list of {"type": "text", "text": ...} parts.

    Raises ValueError saying what is wrong (the caller adds the field's location)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"must be a string or a list of content parts, got {type(content).__name__}")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise ValueError(f"part {j} must be an object, got {type(part).__name__}")
        if part.get("type") != "text":
            raise ValueError(f"part {j}: only text content parts are supported, got type {part.get('type')!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"part {j}: `text` must be a string")
        parts.append(part["text"])
    return "\n".join(parts)  # as vLLM joins a message's text parts (joined with "", words ran together)


def check_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validate a conversation; returns it with list contents joined into strings (what templates expect)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with `role` and `content`")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r}")
        try:
            text = content_text(m.get("content"))
        except ValueError as e:
            raise ValueError(f"messages[{i}].content {e}") from None
        if text is None and role not in NULL_CONTENT_ROLES:
            raise ValueError(f"messages[{i}].content is required for role {role!r}")
        out.append({**m, "content": text or ""})
    return out
