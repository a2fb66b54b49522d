"""Chat messages -> prompt token ids, through the model's own chat template."""
from __future__ import annotations

from typing import Any


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


def render_chat(engine: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                **kwargs: Any) -> list[int]:
    """Token ids of the rendered chat; ValueError (-> HTTP 400) when the template refuses the messages."""
    tok = engine.raw_tokenizer
    msgs = [{**m, "content": _text_content(m.get("content"))} for m in messages]
    for m in msgs:
        if m.get("role") not in ("system", "user", "assistant", "tool", "developer"):
            raise ValueError(f"unknown role {m.get('role')!r}")
    if tok is None or not hasattr(tok, "encode_chat"):
        raise ValueError("this engine has no chat template: use /v1/completions")
    try:
        return list(tok.encode_chat(msgs, add_generation_prompt=add_generation_prompt, **kwargs))
    except ValueError:
        raise
    except Exception as e:  # jinja2 TemplateError (raise_exception in the template) and the like
        raise ValueError(f"the chat template refused these messages: {e}") from None
