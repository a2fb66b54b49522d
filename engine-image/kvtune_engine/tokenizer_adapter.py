"""The few tokenizer operations the engine needs, over the model's Tokenizer or a ``tokenizers.Tokenizer``.

Encoding goes through ``encode_batch``, which releases the GIL while the Rust tokenizer works: a
long prompt tokenized on a worker thread then never stalls the event loop or the engine thread.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TokenizerAdapter:
    def __init__(self, tok: Any):
        self.wrapped = tok
        inner = tok
        for name in ("tokenizer", "raw", "_tok"):
            cand = getattr(tok, name, None)
            if cand is not None and hasattr(cand, "decode_batch"):
                inner = cand
                break
        self.inner = inner  # a tokenizers.Tokenizer when available
        self._batch = getattr(inner, "decode_batch", None)
        self._max_token_chars: int | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.wrapped is not self.inner:
            return list(self.wrapped.encode(text, add_special_tokens=add_special_tokens))
        return list(self.inner.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode_many(self, seqs: list[list[int]]) -> list[str]:
        if not seqs:
            return []
        if self._batch is not None:
            return self._batch(seqs, skip_special_tokens=True)
        return [self.decode(s) for s in seqs]

    def decode(self, ids: Sequence[int]) -> str:
        return self.inner.decode(list(ids), skip_special_tokens=True)

    def token_str(self, token_id: int) -> str:
        f = getattr(self.wrapped, "token_text", None)
        if f is not None:
            return f(token_id)
        return self.inner.decode([token_id], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int | None:
        f = getattr(self.inner, "get_vocab_size", None)
        return f(with_added_tokens=True) if f else None

    @property
    def max_token_chars(self) -> int:
        """The most characters one token decodes to: a text longer than this many characters per
        allowed token can never fit, so it is refused without being tokenized."""
        if self._max_token_chars is None:
            n = self.vocab_size
            if n is None or self._batch is None:
                self._max_token_chars = 256
            else:
                texts = self._batch([[i] for i in range(n)], skip_special_tokens=False)
                self._max_token_chars = max(1, max(len(t) for t in texts))
        return self._max_token_chars
