"""The model runner: executes the scheduler's Batch on a real model over the paged KV cache.

It owns the device KV cache (K and V tensors `[layers, kv_heads, num_blocks, block_size, head_dim]`,
zero-filled so that padded reads stay finite), the host swap pool of the same layout (pinned on CUDA),
and the sampler. Each step: swap out, swap in; flatten the batch (decodes first, then
prefill chunks) into token ids, positions and slot mapping; run the model; sample one token for
every sequence that ends its prompt or decodes.

Sizing: on CUDA, weights and the activation peak of a dummy forward of `max_num_batched_tokens`
tokens are measured and `kv/sizing.py` turns them (with gpu_memory_utilization) into blocks, the same
formula the simulator uses; on CPU `kv_cache_memory` GiB sizes the cache, or `device_memory_gib`
makes the CPU stand in for a device of that size so that gpu_memory_utilization sizes it as on a GPU.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..attention import AttentionMetadata, PrefillChunk, cpu_paged, flashinfer_decode, triton_decode
from ..config import EngineConfig
from ..core.batch import Batch, ScheduledSeq, SeqStep, Step, StepOutput
from ..kv.sizing import ActivationProfile, KVCacheSize, kv_bytes_per_token, kv_cache_size
from ..model import CausalLM, ModelLoadError, load_model, ops
from .huge_pages import advise_huge_pages
from .sampler import Sampler

log = logging.getLogger("kvtune.runner")

CPU_DEFAULT_KV_GIB = 2.0  # CPU runs without kv_cache_memory
#: Prefill chunks whose context (cached prefix + chunk) is at most this long are attended by the CPU
#: decode kernel, one row per token: it reads their K/V where they are in the cache, and a chunk's
#: context stays in cache across its rows. Measured on the benchmark model's shapes (8/4 heads, d 64,
#: 2 threads): 1.6-2.5x faster than PyTorch's causal SDPA for one chunk of 16-512 tokens, 1.2x at 1024,
#: about even at 2048.
FOLDED_PREFILL_MAX_CONTEXT = 1024


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")



def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights on CPU: its parameters and the oneDNN-packed copies that replaced
    some of them (`model.linear.Linear.packed` is no parameter; without it the KV cache is sized into
    memory the weights hold)."""
    seen = {id(t): t for t in model.parameters()}
    for m in model.modules():
        packed = getattr(m, "packed", None)
        if isinstance(packed, torch.Tensor):
            seen[id(packed)] = packed
    return sum(t.numel() * t.element_size() for t in seen.values())

class ModelRunner:
    """Runner protocol implementation: `execute(batch) -> StepOutput`.

    `num_blocks` / `num_swap_blocks` are what the scheduler must be built with. `memory` is the
    memory picture in bytes: weights, activations_peak (None on CPU: not measured), kv_cache, swap,
    device_total. `activation_profile` is the step shape the memory left beside the KV cache was
    sized for (CUDA, and a CPU standing in for a device); None where host memory bounds the run.
    """

    def __init__(self, model: str | Path | CausalLM, config: EngineConfig, *, device: str | torch.device = "cpu",
                 dtype: str | torch.dtype | None = "auto", seed: int | None = None, use_triton: bool | None = None,
                 num_blocks: int | None = None, num_swap_blocks: int | None = None,
                 device_memory_gib: float | None = None):
        self.config = config
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device) if cuda else 0
        self.model = model if isinstance(model, CausalLM) else load_model(model, dtype, self.device)
        self.model_config = mc = self.model.cfg
        if mc.sliding_window is not None and config.max_model_len > mc.sliding_window:
            raise ModelLoadError(
                f"config.json: sliding_window {mc.sliding_window} is smaller than max_model_len "
                f"{config.max_model_len}; sliding-window attention is not implemented: set "
                f"--max-model-len <= {mc.sliding_window}")
        self.dtype = self.model.dtype
        self.block_size = config.block_size
        self.sampler = Sampler(self.device, seed)
        # decode attention: FlashInfer (checked on the device) or Triton on CUDA; on CPU the
        # compiled kernel of attention/cpu_paged.py; the PyTorch reference when none is there
        cpu_kernels = not cuda and cpu_paged.enabled()
        if cuda and use_triton is not False:
            if flashinfer_decode.available():
                self.model.decode_fn = self._flashinfer_or_none()
            if self.model.decode_fn is None and triton_decode.available():
                self.model.decode_fn = triton_decode.paged_decode_triton
            if self.model.decode_fn is None:
                log.warning("neither flashinfer nor triton is usable: decode attention uses the PyTorch path")
        elif use_triton:  # Triton on CPU: its interpreter (tests)
            self.model.decode_fn = triton_decode.paged_decode_triton
        elif cpu_kernels:
            self.model.decode_fn = cpu_paged.paged_decode_cpu
        if cpu_kernels:
            self.model.write_fn = cpu_paged.write_kv_cpu
        #: prefill chunks go through the decode kernel too (see FOLDED_PREFILL_MAX_CONTEXT); in float32
        #: only: in bf16 the kernel's float32 softmax and sums put prompt logits up to 0.11 from
        #: transformers' bf16 SDPA (tests/unit/test_model_vs_hf.py allows 0.1), so bf16 prefills keep SDPA
        self.fold_prefills = self.model.decode_fn is cpu_paged.paged_decode_cpu and self.dtype == torch.float32
        if not cuda:
            # build or load the fused ops now, not in the first request's step (a cold build is
            # 30-60 s: the engine is not ready before it, and no step's timing carries it)
            ops.fused_module()

        weights = (torch.cuda.memory_allocated(self.device) - before) if cuda else weights_bytes(self.model)
        per_token = kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype.itemsize)
        activations = None
        self.activation_profile: ActivationProfile | None = None
        if cuda or device_memory_gib is not None:
            self.activation_profile = ActivationProfile.of(config.profiled_batched_tokens, config.max_num_seqs)
        if cuda:
            total = torch.cuda.get_device_properties(self.device).total_memory
            activations = self._profile_activations(weights)
        elif device_memory_gib is not None:
            # CPU standing in for a device of this size: gpu_memory_utilization sizes the KV cache
            # exactly as on a GPU (demos and tests of memory tuning without a GPU).
            total = int(device_memory_gib * 2**30)
        else:
            total = host_memory_bytes()
        kv_gib = config.kv_cache_memory
        if not cuda and kv_gib is None and device_memory_gib is None:
            kv_gib = CPU_DEFAULT_KV_GIB
            log.info("CPU run without kv_cache_memory: using %.1f GiB for the KV cache", kv_gib)
        self.sizing: KVCacheSize = kv_cache_size(
            device_total_bytes=total, gpu_memory_utilization=config.gpu_memory_utilization,
            weights_bytes=weights, activation_peak_bytes=activations or 0, block_size=self.block_size,
            kv_bytes_per_token=per_token, swap_space_gib=config.swap_space, kv_cache_memory_gib=kv_gib)
        self.num_blocks = num_blocks if num_blocks is not None else self.sizing.num_blocks
        self.num_swap_blocks = num_swap_blocks if num_swap_blocks is not None else self.sizing.num_swap_blocks
        shape = (mc.num_layers, mc.num_kv_heads, self.num_blocks, self.block_size, mc.head_dim)
        self.k_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        for cache in (self.k_cache, self.v_cache):
            advise_huge_pages(cache)  # before the first write (huge_pages.py); a no-op off Linux CPU
            cache.zero_()
        self.kv_caches = list(zip(self.k_cache.unbind(0), self.v_cache.unbind(0)))  # per layer (K, V)
        hshape = shape[:2] + (self.num_swap_blocks,) + shape[3:]
        self.swap_k = torch.empty(hshape, dtype=self.dtype, device="cpu", pin_memory=cuda)
        self.swap_v = torch.empty(hshape, dtype=self.dtype, device="cpu", pin_memory=cuda)
        block_bytes = per_token * self.block_size
        self.memory: dict[str, int | None] = {
            "weights": int(weights), "activations_peak": activations,
            "kv_cache": self.num_blocks * block_bytes, "swap": self.num_swap_blocks * block_bytes,
            "device_total": int(total),
        }

    def _flashinfer_or_none(self):
        """FlashInfer's decode kernel if it agrees with the reference on this device, else None
        (the Triton kernel then runs): the FlashInfer path cannot be tested where this is developed."""
        try:
            fn = flashinfer_decode.FlashInferDecode(self.device)
            flashinfer_decode.check(fn, self.device)
            return fn
        except Exception as e:  # an API change, an unsupported shape or dtype, a mismatch
            log.warning("FlashInfer decode unusable here (%s: %s); using the Triton kernel", type(e).__name__, e)
            return None

    # ------------------------------------------------------------------ memory profile
    @torch.inference_mode()
    def _profile_activations(self, weights: int) -> int:
        """Peak bytes beyond the weights during a forward of the profiled budget's tokens (prefill
        chunks of at most max_model_len) plus sampling of the profile's rows, including memory that
        torch does not allocate itself (CUDA context, library workspaces)."""
        c, dev = self.config, self.device
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        n = c.profiled_batched_tokens
        chunks, start = [], 0
        while start < n:
            m = min(c.max_model_len, n - start)
            chunks.append(PrefillChunk(start, m, 0, None))
            start += m
        ids = torch.zeros(n, dtype=torch.int64, device=dev)
        pos = torch.cat([torch.arange(ch.num_tokens, device=dev) for ch in chunks])
        h = self.model(ids, pos, None, AttentionMetadata(self.block_size, None, prefills=chunks))
        rows = torch.arange(self.activation_profile.rows, device=dev) * 0 + (n - 1)  # with its headroom
        logits = self.model.compute_logits(h[rows])
        torch.softmax(logits, -1).sort(dim=-1, descending=True)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        free, total = torch.cuda.mem_get_info(dev)
        non_torch = max(0, (total - free) - torch.cuda.memory_reserved(dev))
        del h, logits
        torch.cuda.empty_cache()
        return int(peak - weights + non_torch)

    # ------------------------------------------------------------------ block moves
    def _swap(self, batch: Step) -> None:
        """Whole blocks, all layers, K and V: out to the host pool, then back in."""
        dev = self.device
        pairs = ((self.k_cache, self.swap_k), (self.v_cache, self.swap_v))
        if batch.swap_out:
            src = torch.tensor([a for a, _ in batch.swap_out], device=dev)
            dst = torch.tensor([b for _, b in batch.swap_out])
            for d, h in pairs:
                h.index_copy_(2, dst, d.index_select(2, src).to("cpu"))
        if batch.swap_in:
            src = torch.tensor([a for a, _ in batch.swap_in])
            dst = torch.tensor([b for _, b in batch.swap_in], device=dev)
            for d, h in pairs:
                d.index_copy_(2, dst, h.index_select(2, src).to(dev))

    # ------------------------------------------------------------------ inputs
    def prepare(self, seqs: list[ScheduledSeq] | tuple[SeqStep, ...]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[int]]:
        """Flat inputs: (token ids, positions, attention metadata, order, sample rows).

        Flat order: the decodes, then the prefill chunks the decode kernel attends row by row
        (``fold_prefills``), then the other chunks. `order[j]` is the batch index of the j-th
        sequence in flat order; `sample rows` are the flat rows whose logits are sampled, in batch
        order of the sampled sequences."""
        bs, dev = self.block_size, self.device
        dec = [i for i, s in enumerate(seqs) if s.num_tokens == 1]
        pre = [i for i, s in enumerate(seqs) if s.num_tokens != 1]
        folded = [i for i in pre if self.fold_prefills
                  and seqs[i].start_pos + seqs[i].num_tokens <= FOLDED_PREFILL_MAX_CONTEXT]
        rest = [i for i in pre if i not in folded]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        lens: list[int] = []
        tables: list[list[int]] = []
        for i in dec:
            s = seqs[i]
            p = s.start_pos
            ids.append(s.token_ids[0])
            pos.append(p)
            slots.append(s.block_table[p // bs] * bs + p % bs)
            lens.append(p + 1)
            tables.append(s.block_table)
        nd = len(dec)
        last_row: dict[int, int] = {i: j for j, i in enumerate(dec)}
        slot_parts = [torch.tensor(slots, dtype=torch.int64)]
        width = max((len(t) for t in tables), default=0)
        row_tables = [torch.tensor([[*t, *([0] * (width - len(t)))] for t in tables],
                                   dtype=torch.int64)] if nd else []
        prefill_chunks: list[PrefillChunk] = []
        off = nd
        for i in folded + rest:
            s = seqs[i]
            n = s.num_tokens
            ids.extend(s.token_ids)
            p = torch.arange(s.start_pos, s.start_pos + n)
            bt = torch.tensor(s.block_table, dtype=torch.int64)
            slot_parts.append(bt[p // bs] * bs + p % bs)
            pos.extend(range(s.start_pos, s.start_pos + n))
            if i in folded:  # n rows, each one query over its prefix of the sequence's cached context
                lens.extend(range(s.start_pos + 1, s.start_pos + n + 1))
                row_tables.append(bt.expand(n, -1))
            else:
                prefill_chunks.append(PrefillChunk(off, n, s.start_pos, bt.to(dev)))
            off += n
            last_row[i] = off - 1
        rows = len(lens)
        meta = AttentionMetadata(bs, torch.cat(slot_parts).to(dev), num_decodes=rows,
                                 prefills=prefill_chunks, decode_context_lens_list=lens)
        if rows:
            width = max(t.shape[1] for t in row_tables)
            meta.decode_block_tables = torch.cat([F.pad(t, (0, width - t.shape[1])) for t in row_tables]).to(dev)
            meta.decode_context_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        sample_rows = [last_row[i] for i, s in enumerate(seqs) if s.sample]
        return (torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(pos, dtype=torch.int64, device=dev),
                meta, dec + folded + rest, sample_rows)

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def execute(self, batch: Batch | Step) -> StepOutput:
        """Run one step; a Batch is frozen first (the engine hands over a frozen Step)."""
        t0 = time.perf_counter()
        if isinstance(batch, Batch):
            batch = batch.freeze()
        self._swap(batch)
        seqs = batch.seqs
        tokens: list[int | None] = [None] * len(seqs)
        logprobs = None
        failed: dict[int, str] = {}
        if seqs:
            ids, pos, meta, _, rows = self.prepare(seqs)
            hidden = self.model(ids, pos, self.kv_caches, meta)
            sampled = [i for i, s in enumerate(seqs) if s.sample]
            if sampled:
                logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
                ids_out, lps, bad = self.sampler(logits, [seqs[i].request for i in sampled])
                for i, t in zip(sampled, ids_out):
                    tokens[i] = t
                failed = {sampled[j]: why for j, why in bad.items()}
                if lps is not None:
                    logprobs = [None] * len(seqs)
                    for i, lp in zip(sampled, lps):
                        logprobs[i] = lp
        elif self.device.type == "cuda" and (batch.swap_out or batch.swap_in):
            torch.cuda.synchronize(self.device)
        return StepOutput(tokens=tokens, duration_s=time.perf_counter() - t0, logprobs=logprobs, failed=failed)
