"""Chat messages -> prompt text, through the model's own chat template.

Invariant owned here: the template sees the request's messages and add_generation_prompt and the
model's special tokens, which ``chat_template_kwargs`` cannot override (a clash is a 400, not a
500); every refusal of the template is a ValueError (-> HTTP 400).
"""
from __future__ import annotations

from typing import Any

ROLES = ("system", "user", "assistant", "tool", "developer")


def _text_content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for p in content:
        if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
            raise ValueError(f"only text content parts are supported, got {p!r:.80}")
        parts.append(p["text"])
    return "".join(parts)


def reserved_kwargs(tok: Any) -> set[str]:
    return {"messages", "add_generation_prompt"} | set(getattr(tok, "special", {}) or {})


def render_chat(tok: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The rendered prompt text; ValueError when the messages or kwargs are refused."""
    kwargs = dict(template_kwargs or {})
    clash = sorted(set(kwargs) & reserved_kwargs(tok))
    if clash:
        raise ValueError(f"chat_template_kwargs: {', '.join(clash)} cannot be set there (the request's own "
                         f"fields and the model's special tokens are); pass other template variables only")
    msgs = [{**m, "content": _text_content(m.get("content"))} for m in messages]
    for m in msgs:
        if m.get("role") not in ROLES:
            raise ValueError(f"messages: unknown role {m.get('role')!r:.40}; allowed: {', '.join(ROLES)}")
    if tok is None or not hasattr(tok, "apply_chat_template"):
        raise ValueError("messages: this engine has no chat template: use /v1/completions")
    try:
        return tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **kwargs)
    except Exception as e:  # jinja2 TemplateError (raise_exception in the template), no template, ...
        raise ValueError(f"messages: the chat template refused these messages: {str(e)[:300]}") from None
