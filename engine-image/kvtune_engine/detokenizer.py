"""Incremental detokenization and stop strings, batched over the requests of one step.

Invariant owned here: a request's ``text`` is the decode of its output tokens (special tokens
skipped), grown only by whole characters (a multi-byte character split over tokens waits for its
last token), cut at the earliest stop string; ``offsets[i]`` is where output token i's text
starts in ``text``. While running, the last ``hold_back`` characters are withheld from the client
(a stop string may be forming); at the end everything kept is released.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .tokenizer_adapter import TokenizerAdapter

DETOK_CONTEXT = 6  # prompt tokens decoded with the output so that the first word's spacing is right


@dataclass(eq=False)
class DetokState:
    """One request's detokenization state."""
    ctx: list[int]                 # prompt tail used as decoding context
    stops: list[str]
    min_tokens: int = 0            # stop strings count only from this many output tokens on
    prefix_offset: int = 0         # into ctx + outputs
    read_offset: int = 0
    text: str = ""                 # detokenized output (cut at a stop string once one is found)
    offsets: list[int] = field(default_factory=list)
    released: int = 0              # characters of `text` handed out
    num_seen: int = 0              # output tokens already detokenized
    stop_string: str | None = None

    hold_back: int = 0             # characters withheld while running: the longest stop string's, less one

    @classmethod
    def for_prompt(cls, prompt_ids: list[int], stops: list[str], min_tokens: int = 0) -> "DetokState":
        st = cls(ctx=prompt_ids[-DETOK_CONTEXT:], stops=list(stops), min_tokens=min_tokens,
                 hold_back=max((len(s) for s in stops), default=1) - 1)
        st.read_offset = len(st.ctx)
        return st

    def release(self, finished: bool) -> str:
        """The text newly handed to the client."""
        if finished:
            end = len(self.text)
        else:
            end = len(self.text) - self.hold_back
            if end < self.released:
                end = self.released
        if end == self.released:
            return ""
        delta = self.text[self.released:end]
        self.released = end
        return delta


def _window(ctx: list[int], outs: list[int], a: int, b: int | None) -> list[int]:
    """(ctx + outs)[a:b] without building ctx + outs (the output grows every step)."""
    n = len(ctx)
    if b is None:
        b = n + len(outs)
    if a >= n:
        return outs[a - n:b - n]
    return ctx[a:b] + (outs[:b - n] if b > n else [])


class Detokenizer:
    def __init__(self, tokenizer: TokenizerAdapter | None):
        self.tokenizer = tokenizer

    def step(self, states: list[DetokState], outputs: list[list[int]]) -> list[list[int]]:
        """Append each request's new text (one batched decode); return each one's new token ids."""
        news: list[list[int]] = []
        seqs: list[list[int]] = []
        for st, outs in zip(states, outputs):
            new = outs[st.num_seen:]
            st.num_seen = len(outs)
            news.append(new)
            seqs.append(_window(st.ctx, outs, st.prefix_offset, st.read_offset))
        for st, outs in zip(states, outputs):
            seqs.append(_window(st.ctx, outs, st.prefix_offset, None))
        if self.tokenizer is None:
            for st, new in zip(states, news):
                st.offsets.extend([len(st.text)] * len(new))
            return news
        texts = self.tokenizer.decode_many(seqs)
        n = len(states)
        for i, st in enumerate(states):
            if not news[i]:
                continue
            st.offsets.extend([len(st.text)] * len(news[i]))
            if st.stop_string is not None:
                continue
            prefix_text, full_text = texts[i], texts[n + i]
            if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
                st.text += full_text[len(prefix_text):]
                st.prefix_offset = st.read_offset
                st.read_offset = len(st.ctx) + st.num_seen
        return news

    def flush(self, st: DetokState, outputs: list[int]) -> None:
        """At the end, take the text still held back waiting for a multi-byte character to complete."""
        if self.tokenizer is None or st.stop_string is not None:
            return
        ids = st.ctx + outputs
        if st.read_offset >= len(ids):
            return
        prefix_text, full_text = self.tokenizer.decode_many([ids[st.prefix_offset:st.read_offset],
                                                             ids[st.prefix_offset:]])
        if len(full_text) > len(prefix_text):
            st.text += full_text[len(prefix_text):]
        st.prefix_offset = st.read_offset = len(ids)

    @staticmethod
    def check_stop(st: DetokState) -> str | None:
        """Cut the text at the earliest stop string that appeared; return it (None: none yet)."""
        if not st.stops or st.stop_string is not None or st.num_seen < st.min_tokens:
            return None
        text = st.text
        start = max(0, st.released - max(len(s) for s in st.stops))
        best: tuple[int, str] | None = None
        for s in st.stops:
            i = text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        st.text = text[:best[0]]
        st.offsets = [min(o, best[0]) for o in st.offsets]
        st.stop_string = best[1]
        return best[1]
