"""The simulated engine in real time (`kvtune serve --simulate PROFILE`): a Runner that sleeps each
step's cost instead of computing it, behind the real ``LLMEngine`` and the real server.

Nothing but the runner is simulated: the engine loop, scheduler, block pool, prefix cache, swap,
metrics, admin API and live config are the engine's own. The block pool is sized from the profile's
memory picture (``Profile.kv_cache_size``: the profile's device memory, weights, activation peak and
K/V bytes per token) for ``--gpu-memory-utilization``, ``--swap-space`` etc., exactly as
``kvtune sim --profile`` sizes it. A step costs what it costs in the virtual-time simulator
(``stepper.charge``: the profile's step time times its machine speed) and the runner sleeps that long,
so the process uses almost no CPU. No torch is imported.

Tokens: a trivial built-in tokenizer (``ByteTokenizer``): a text is its UTF-8 bytes, one token per
byte (ids 0..255, no special tokens, no end-of-sequence id). The runner samples from that fixed
vocabulary, the bytes of ``OUTPUT_TEXT`` in a cycle by output position, so a request generates exactly
``max_tokens`` tokens (there is no eos to stop it early; stop strings still apply). Chat messages
render as ``role: content`` lines followed by ``assistant:``.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from ..config import EngineConfig
from ..core.batch import Step, StepOutput
from ..core.scheduler import Scheduler
from ..engine import LLMEngine
from ..kv.sizing import ActivationProfile
from .profile import Profile
from .runner import SimulatedRunner
from .stepper import charge

#: what a simulated request generates, byte by byte, over and over
OUTPUT_TEXT = b"the quick brown fox jumps over the lazy dog "


_DTYPES = {1: "fp8", 2: "bfloat16", 4: "float32"}  # the profile's K/V element size, named


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary of 256; undecodable sequences decode to U+FFFD)."""
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[Any]:
        return [SimpleNamespace(ids=self.encode(t)) for t in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def decode_batch(self, seqs: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(s) for s in seqs]

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self.vocab_size

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        text = "".join(f"{m.get('role')}: {m.get('content', '')}\n" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "")


class RealtimeRunner:
    """The Runner protocol: ``execute(step)`` sleeps the profile's cost of the step, then returns one
    vocabulary token per sampled sequence. ``simulated`` names the profile (the state API shows it)."""

    def __init__(self, profile: Profile, config: EngineConfig, block_bytes: int, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.profile = profile
        self.simulated = profile.name
        self.cost = SimulatedRunner(profile, block_bytes)
        self.clock, self.sleep = clock, sleep
        self.start_s = clock()
        # the step shape the profile's activation peak was sized for, as the real runner profiles it
        self.activation_profile = ActivationProfile.of(config.profiled_batched_tokens, config.max_num_seqs)

    def execute(self, step: Step) -> StepOutput:
        t0 = self.clock()
        speed = self.profile.speed
        at = speed.start_s + (t0 - self.start_s) if speed is not None else 0.0
        out = charge(self.cost, speed, step, at)
        n = len(OUTPUT_TEXT)
        out.tokens = [OUTPUT_TEXT[len(s.request.output_token_ids) % n] if s.sample else None for s in step.seqs]
        left = t0 + out.duration_s - self.clock()
        if left > 0:
            self.sleep(left)
        return out


def build_simulated_engine(profile: Profile, config: EngineConfig, *, served_model_name: str | None = None,
                           clock: Callable[[], float] = time.monotonic) -> LLMEngine:
    """The real engine over a ``RealtimeRunner``: blocks sized by the profile's memory picture
    (ConfigError when none fit or swap exceeds the profile's host memory)."""
    size = profile.kv_cache_size(config)
    runner = RealtimeRunner(profile, config, size.block_bytes, clock=clock)
    sched = Scheduler(config, size.num_blocks, size.num_swap_blocks)
    memory = {"weights": profile.weights_bytes, "activations_peak": profile.activation_peak_bytes(
        config.max_num_batched_tokens), "kv_cache": size.kv_cache_bytes, "swap": size.swap_bytes,
        "device_total": profile.device_total_bytes}
    return LLMEngine(config, sched, runner, ByteTokenizer(), model_name=served_model_name or profile.name,
                     vocab_size=ByteTokenizer.vocab_size, memory=memory, clock=clock,
                     kv_cache_dtype=_DTYPES.get(profile.kv_dtype_bytes, "auto"), device=f"simulated:{profile.name}")
