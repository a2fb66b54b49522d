"""What the engine hands back for a request: one ``RequestOutput`` per step that changed it.

Invariant owned here: an output's ``text`` is exactly what the client has been sent so far
(stop string cut, held-back characters excluded), and ``text_offsets[i]`` is where output token i's
text starts in it, so offsets always index the text the client sees.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    """The sampled token's logprob and the top-N alternatives, best first (raw model distribution)."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob)


@dataclass(frozen=True, slots=True)
class SoFar:
    """A request's whole output as of one step, without copying it: its append-only lists (output
    token ids, text offsets, logprobs) and its text (an immutable str) with the lengths they had
    then. A stream's output per step is O(1) in its length (it was O(n): a request of n tokens
    copied n^2/2 ids); what reads the whole of it (a final response) materialises it once."""
    ids: list[int]
    num_ids: int
    text: str
    num_chars: int
    offsets: list[int]
    logprobs: list[TokenLogprob] | None = None
    num_logprobs: int = 0


@dataclass
class RequestOutput:
    """What one step produced for one request (the server streams these; ``LLM`` returns the last).
    ``text``, ``token_ids``, ``text_offsets`` and ``logprobs`` (all so far) are read from ``so_far``."""
    request_id: str
    prompt_token_ids: list[int]
    delta_text: str                # new text since the previous output of this request
    new_token_ids: list[int]
    finished: bool
    so_far: SoFar
    finish_reason: str | None = None        # stop | length | abort | rejected | error
    stop_reason: str | int | None = None    # the stop string or stop token id that ended it
    num_cached_tokens: int = 0
    new_logprobs: list[TokenLogprob] | None = None
    error: str | None = None       # why it was rejected, or the internal error that failed it
    metrics: dict[str, float | None] = field(default_factory=dict)

    @property
    def text(self) -> str:
        """All output text released so far (stop string cut, hold-back kept)."""
        return self.so_far.text[:self.so_far.num_chars]

    @property
    def token_ids(self) -> list[int]:
        """All output token ids so far."""
        return self.so_far.ids[:self.so_far.num_ids]

    @property
    def text_offsets(self) -> list[int]:
        """Per output token, where its text starts in ``text``."""
        return self.so_far.offsets[:self.so_far.num_ids]

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """All logprobs so far (when asked for)."""
        lp = self.so_far.logprobs
        return None if lp is None else lp[:self.so_far.num_logprobs]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.so_far.num_ids

    @property
    def new_text_offsets(self) -> list[int]:
        n = self.so_far.num_ids
        return self.so_far.offsets[max(0, n - len(self.new_token_ids)):n]
