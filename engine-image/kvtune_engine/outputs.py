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


@dataclass
class RequestOutput:
    """What one step produced for one request (the server streams these; ``LLM`` returns the last)."""
    request_id: str
    prompt_token_ids: list[int]
    text: str                      # all output text released so far (stop string cut, hold-back kept)
    delta_text: str                # new text since the previous output of this request
    token_ids: list[int]           # all output token ids so far
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None        # stop | length | abort | rejected | error
    stop_reason: str | int | None = None    # the stop string or stop token id that ended it
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None       # all so far (when asked for)
    new_logprobs: list[TokenLogprob] | None = None
    text_offsets: list[int] = field(default_factory=list)   # per output token, into `text`
    error: str | None = None       # why it was rejected, or the internal error that failed it
    metrics: dict[str, float | None] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def new_text_offsets(self) -> list[int]:
        return self.text_offsets[len(self.text_offsets) - len(self.new_token_ids):]
