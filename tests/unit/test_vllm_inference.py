"""What vLLM does not export, inferred from synthetic scrape sequences (vllm_inference): the cap from a
running plateau while requests wait, the budget from chunked prompts, the model length from
cache_config_info; thin or conflicting evidence gives "not enough evidence", never a guessed cause,
and the --assume values override. The real-vLLM case is tests/vllm/test_diagnose_vllm.py."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvtune_operator.tuner.observation import MetricFigures
from kvtune_operator.tuner.vllm_inference import check, infer_max_num_seqs, infer_token_budget
from kvtune_operator.tuner.vllm_observation import (VllmAssumptions, diagnose_reading, read_vllm,
                                                    samples_of_scrapes)

STEP_EDGES = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, float("inf"))
PROMPT_EDGES = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, float("inf"))
CACHE_INFO = {"block_size": "16", "num_gpu_blocks": "4096", "kv_cache_size_tokens": "65536",
              "kv_cache_max_concurrency": "32.0", "enable_prefix_caching": "True", "gpu_memory_utilization": "0.9"}


@dataclass
class Moment:
    """One scrape of a simulated vLLM: the gauges, and the steps / finished prompts since the last."""
    running: float
    waiting: float
    kv: float = 0.05
    steps: list[int] = field(default_factory=lambda: [2] * 20)
    prompts: list[int] = field(default_factory=list)
    preempted: int = 0


def scrapes_of(moments: list[Moment]) -> list[MetricFigures]:
    """Cumulative counters and histograms as vLLM's /metrics shows them, one MetricFigures a moment."""
    step_c = dict.fromkeys(STEP_EDGES, 0.0)
    prompt_c = dict.fromkeys(PROMPT_EDGES, 0.0)
    n_steps = s_steps = pre = 0.0
    out = []
    for m in moments:
        f = MetricFigures()
        for t in m.steps:
            for e in STEP_EDGES:
                step_c[e] += t <= e
        for p in m.prompts:
            for e in PROMPT_EDGES:
                prompt_c[e] += p <= e
        n_steps += len(m.steps)
        s_steps += sum(m.steps)
        pre += m.preempted
        for e in STEP_EDGES:
            f.set("vllm:iteration_tokens_total_bucket", step_c[e], le="+Inf" if e == float("inf") else f"{e:.1f}")
        for e in PROMPT_EDGES:
            f.set("vllm:request_prompt_tokens_bucket", prompt_c[e], le="+Inf" if e == float("inf") else f"{e:.1f}")
        f.set("vllm:iteration_tokens_total_count", n_steps)
        f.set("vllm:iteration_tokens_total_sum", s_steps)
        f.set("vllm:request_prompt_tokens_count", prompt_c[float("inf")])
        f.set("vllm:request_prompt_tokens_sum", prompt_c[float("inf")] * 100)
        f.set("vllm:num_requests_running", m.running)
        f.set("vllm:num_requests_waiting", m.waiting)
        f.set("vllm:num_requests_waiting_by_reason", m.waiting, reason="capacity")
        f.set("vllm:kv_cache_usage_perc", m.kv)
        f.set("vllm:num_preemptions_total", pre)
        f.set("vllm:cache_config_info", 1.0, **CACHE_INFO)
        f.maxima = {k: v for k, v in f.values.items() if not k[0].endswith(("_total", "_bucket", "_count", "_sum"))}
        out.append(f)
    return out


def read(moments: list[Moment], assume: VllmAssumptions = VllmAssumptions(given_by="--assume flag")):
    """As `kvtune diagnose --url` reads a window: the window's figures, one sample per interval."""
    scrapes = scrapes_of(moments)
    samples = samples_of_scrapes(scrapes)[1:]
    reading = read_vllm(MetricFigures.over_scrapes(scrapes), samples, window_s=float(len(moments) - 1), assume=assume)
    return reading, samples, diagnose_reading(reading)


def cap_two_window(n: int = 16) -> list[Moment]:
    """max_num_seqs 2, 16 clients: 2 running, 14 waiting; once a finished request leaves a gap."""
    ms = [Moment(2, 14) for _ in range(n)]
    ms[7] = Moment(1, 14, steps=[1] * 20 + [49])
    return ms


def test_a_running_plateau_while_requests_wait_is_the_cap():
    reading, samples, d = read(cap_two_window())
    assert reading.observation.config.max_num_seqs == 2
    assert reading.assumed["max_num_seqs"] == ("2 (inferred: running stayed at 2 over 14 of 15 samples while 14 "
                                               "waited, KV free)")
    assert "max_num_seqs" not in reading.unknown
    assert d.cause == "SequenceCap" and d.figures["max_num_seqs"] == 2 and d.suggestion["max_num_seqs"] > 2
    # the budget: no prompt was longer than a step, so the steps give only a lower bound
    assert "max_num_batched_tokens" in reading.unknown and "at least 32" in reading.unknown["max_num_batched_tokens"]
    check(samples, infer_max_num_seqs(samples), infer_token_budget([], []))


def test_the_model_length_comes_from_cache_config_info():
    reading, _, _ = read(cap_two_window())
    assert reading.observation.config.max_model_len == 65536 // 32
    assert reading.assumed["max_model_len"].startswith("2048 (inferred: cache_config_info's kv_cache_size_tokens")
    assert reading.observation.num_blocks == 4096 and reading.observation.config.block_size == 16


def test_nothing_waiting_infers_no_cap_and_names_no_wait_cause():
    reading, _, d = read([Moment(3, 0) for _ in range(12)])
    assert "max_num_seqs" in reading.unknown and "no sample had requests waiting" in reading.unknown["max_num_seqs"]
    assert "pass --assume-max-num-seqs" in reading.assumed["max_num_seqs"]
    assert d.cause == "Healthy", d   # nothing waits: the unknown cap does not matter


def test_too_few_samples_with_waiting_is_not_enough_evidence():
    reading, _, d = read([Moment(2, 14) for _ in range(4)])
    assert "only 3 of 3 samples had requests waiting" in reading.unknown["max_num_seqs"]
    assert d.cause == "NotEnoughEvidence", d
    assert "--assume-max-num-seqs" in d.message and "TokenBudget" not in d.message


def test_a_plateau_that_running_leaves_is_no_cap():
    # running at 2 while requests wait, but at 5 in other samples: 2 is not the cap
    ms = [Moment(2, 6) for _ in range(10)] + [Moment(5, 0), Moment(5, 0)]
    reading, _, d = read(ms)
    assert "reached 5" in reading.unknown["max_num_seqs"]
    assert d.cause == "NotEnoughEvidence"


def test_conflicting_levels_while_waiting_are_not_enough_evidence():
    ms = [Moment(2 + (i % 3), 6) for i in range(13)]
    reading, _, d = read(ms)
    assert "running varied while requests waited" in reading.unknown["max_num_seqs"]
    assert d.cause == "NotEnoughEvidence" and "--assume-max-num-seqs" in d.figures["flags"]


def test_the_assumed_cap_overrides_the_inference():
    reading, _, d = read(cap_two_window(), VllmAssumptions(max_num_seqs=2, given_by="--assume flag"))
    assert reading.assumed["max_num_seqs"] == "2 (--assume flag)"
    assert d.cause == "SequenceCap"


def test_no_token_budget_against_the_steps_evidence():
    """The issue's case read with vLLM's defaults (cap 256, budget 8192) named TokenBudget while the
    steps took 2 tokens: given those values, the waits fit no limit, and the diagnosis says so."""
    reading, _, d = read(cap_two_window(), VllmAssumptions(max_num_seqs=256, max_num_batched_tokens=8192))
    assert reading.observation.waiting_cause_share["token_budget"] == 0.0
    assert reading.unexplained_share > 0.9
    assert d.cause == "NotEnoughEvidence" and "no given limit" in d.message and "check the given" in d.message


def test_waits_whose_steps_spend_the_budget_are_the_budget():
    # a cap of 8 given, 3 running, steps of the full 512-token budget: the budget holds the queue head
    ms = [Moment(3, 5, steps=[512] * 10, prompts=[3000]) for _ in range(10)]
    reading, _, d = read(ms, VllmAssumptions(max_num_seqs=8))
    assert reading.observation.config.max_num_batched_tokens == 512
    assert reading.assumed["max_num_batched_tokens"].startswith("512 (inferred: the largest steps took 256-512 tokens")
    assert reading.observation.waiting_cause_share["token_budget"] == 1.0
    assert d.cause in ("TokenBudget", "LongPromptHeadOfLine"), d


def test_a_budget_plateau_is_not_read_as_a_cap():
    # one long prompt running at a time, its chunks spending the 512-token budget each step
    ms = [Moment(1, 5, steps=[512] * 10, prompts=[3000]) for _ in range(10)]
    reading, _, d = read(ms)
    assert reading.observation.config.max_num_batched_tokens == 512
    assert "the steps spent the token budget" in reading.unknown["max_num_seqs"]
    assert d.cause != "SequenceCap"


def test_prefix_cache_hits_leave_the_budget_unknown():
    steps = [(8.0, 0.0), (512.0, 10.0), (float("inf"), 10.0)]
    prompts = [(1000.0, 0.0), (5000.0, 4.0), (float("inf"), 4.0)]
    assert infer_token_budget(steps, prompts).value == 512
    got = infer_token_budget(steps, prompts, cached_tokens=900)
    assert got.value is None and "prefix-cache hits" in got.evidence


def test_steps_cut_by_a_full_or_preempting_kv_cache_infer_no_budget():
    """Real vLLM under a 15-block cache (tests/vllm, too little KV memory): steps of at most 8 tokens
    while 100-token prompts were served read as a budget of 8, below one 128-token block, and
    `kvtune diagnose` died on it. Steps the KV cache cut say nothing of the budget."""
    ms = [Moment(5, 19, kv=0.97, steps=[5, 8, 3] * 5, prompts=[100], preempted=1) for _ in range(10)]
    reading, samples, d = read(ms, VllmAssumptions(max_num_seqs=16, given_by="--assume flag"))
    budget = reading.unknown["max_num_batched_tokens"]
    assert "KV cache was full or preempting" in budget and "at least 1" in budget, budget
    assert reading.observation.config.max_num_batched_tokens >= reading.observation.config.block_size
    assert d.cause == "LowKVMemory", d
    steps = [(1.0, 0.0), (8.0, 10.0), (float("inf"), 10.0)]
    prompts = [(50.0, 0.0), (100.0, 4.0), (float("inf"), 4.0)]
    assert infer_token_budget(steps, prompts).value == 8                      # the same steps, KV free
    assert infer_token_budget(steps, prompts, kv_pressed=True).value is None
    fewer = infer_token_budget(steps, prompts, least=16)                      # steps below the known cap
    assert fewer.value is None and "fewer than the 16 sequences" in fewer.evidence
    check(samples, infer_max_num_seqs(samples), infer_token_budget(steps, prompts, kv_pressed=True))


def test_a_budget_below_one_block_is_read_as_one_block_and_said():
    ms = [Moment(3, 5, steps=[8] * 10, prompts=[100]) for _ in range(10)]
    reading, _, _ = read(ms, VllmAssumptions(max_num_seqs=4, max_num_batched_tokens=8, given_by="--assume flag"))
    assert reading.observation.config.max_num_batched_tokens == 16                 # CACHE_INFO's block size
    assert reading.assumed["max_num_batched_tokens"].startswith("16 (vLLM's 8 is below one 16-token block")
