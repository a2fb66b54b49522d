"""Tokenizer and chat template of a local HF directory, without `transformers`.

`tokenizer.json` is run by the `tokenizers` library (its post-processor adds BOS where the model
wants it); the chat template comes from `chat_template.jinja` or `tokenizer_config.json` and is
rendered with jinja2 in a sandbox, with the globals HF templates expect (`raise_exception`,
`strftime_now`, `tojson`), so rendered prompts equal `transformers`' `apply_chat_template`.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

from .config import ModelLoadError


def _token_text(v: Any) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class Tokenizer:
    """encode/decode text, render and encode chat messages; ids of BOS and of every EOS token."""

    def __init__(self, model_dir: str | Path):
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path} is missing: the engine needs a fast tokenizer file "
                                 "(tokenizer.json, as saved by `tokenizers` or transformers)")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot be loaded by `tokenizers` ({e})") from None
        tc = self._json(d / "tokenizer_config.json")
        gen = self._json(d / "generation_config.json")
        cfg = self._json(d / "config.json")
        self.special = {k: _token_text(tc[k]) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                        if tc.get(k) is not None}
        self.bos_token_id = self._id(self.special.get("bos_token"), path)
        if self.bos_token_id is None:
            self.bos_token_id = cfg.get("bos_token_id")
        eos: list[int] = []
        for src in (self._id(self.special.get("eos_token"), path), gen.get("eos_token_id"), cfg.get("eos_token_id")):
            for i in ([src] if isinstance(src, int) else src or []):
                if i not in eos:
                    eos.append(i)
        self.eos_token_ids = eos
        self.eos_token_id = eos[0] if eos else None
        template = tc.get("chat_template")
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        self.chat_template: str | None = template
        self._compiled = None

    @staticmethod
    def _json(path: Path) -> dict:
        if not path.is_file():
            return {}
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path} is not valid JSON: {e}") from None

    def _id(self, token: str | None, path: Path) -> int | None:
        if token is None:
            return None
        i = self._tok.token_to_id(token)
        if i is None:
            raise ModelLoadError(f"special token {token!r} from tokenizer_config.json is not in {path}")
        return i

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while tokenizing (encode does not): a long prompt on a
        # worker thread must not stall the event loop and the engine thread
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> DecodeStream:
        """Incremental detokenizer for streaming: `.step(tokenizer.tokenizer, token_id) -> str | None`."""
        return DecodeStream(skip_special_tokens=skip_special_tokens)

    @property
    def tokenizer(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (batch decode, id_to_token, DecodeStream)."""
        return self._tok

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The prompt text for `messages` (OpenAI-style dicts with role and content)."""
        if not self.chat_template:
            raise ModelLoadError("this model has no chat template (neither chat_template.jinja nor "
                                 "tokenizer_config.json's chat_template): use completions, not chat")
        if self._compiled is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._compiled = env.from_string(self.chat_template)
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self.special, **kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat (the template writes its own BOS, so none is added)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    return Tokenizer(model_dir)
