"""Autotuning of the attention kernels: configs from block tuples, shared-memory pruning, the tuning key and buckets.

Host-side arithmetic only, no kernels: ``attention_fwd`` and ``attention_bwd`` hold their config lists and prune
functions and build them from these pieces; the launchers in ``flashlite.attention`` compute the key's size buckets
with ``tuning_buckets``.
"""
from __future__ import annotations

import triton

from flashlite._intmath import next_power_of_2, seq_bucket

# Shared memory per thread block on H100/H200: 227 KB (232,448 bytes, the limit Triton reports). The pruning keeps
# the configs whose estimate (``shared_memory_estimate``, fitted to what the compiler allocates) fits it; with
# autotuning off the first config of the list that fits is used, so a wrong estimate there is a crash.
SHARED_MEMORY_BUDGET = 227 * 1024
# Beside the tiles, the compiled kernels keep up to 1 KB of barriers and cross-warp reduction scratch (512 bytes
# measured for a 128-row block; the estimate keeps twice that).
SCRATCH_BYTES = 1024


def make_configs(blocks: list[tuple[int, ...]]) -> list[triton.Config]:
    """Triton configs from (BLOCK_M, BLOCK_N, num_warps, num_stages[, BH_PER_PROGRAM]) tuples.

    Example:
        >>> make_configs([(32, 16, 4, 1)])[0].kwargs, make_configs([(64, 64, 4, 3, 2)])[0].kwargs
        ({'BLOCK_M': 32, 'BLOCK_N': 16}, {'BLOCK_M': 64, 'BLOCK_N': 64, 'BH_PER_PROGRAM': 2})
    """
    configs = []
    for bm, bn, warps, stages, *pairs in blocks:
        meta = {"BLOCK_M": bm, "BLOCK_N": bn, **({"BH_PER_PROGRAM": pairs[0]} if pairs else {})}
        configs.append(triton.Config(meta, num_warps=warps, num_stages=stages))
    return configs


def _operand_bytes(args: dict) -> int:
    # Operands are staged in shared memory in their input dtype (float32 inputs stay 4 bytes even with tf32).
    return args["Q"].element_size()


def shared_memory_estimate(config: triton.Config, block_d: int, elem: int, *, streamed: str, resident: str,
                           resident_tiles: int = 1, transposed_fp32_tiles: int = 0, scratch: int = 0) -> int:
    """Bytes of shared memory a kernel of ``config`` asks for: ``num_stages`` buffers of the two pipelined tiles of
    ``streamed`` rows, ``resident_tiles`` tiles of ``resident`` rows held for the whole program, for 4-byte
    operands ``transposed_fp32_tiles`` more tiles of ``streamed`` rows (tf32 tensor-core products read both
    operands in one major order, so a transposed float32 operand is copied), and ``scratch``.

    Fitted to what Triton 3.6 allocates when it compiles the kernels for sm_90 (every config of the lists, head dims 16
    to 256, bf16 and float32; tests/flashlite/kernels/test_attention_shared_memory.py compiles each kept config and
    checks): the tiles account for all of it but ``SCRATCH_BYTES``; the backward kernels keep two resident tiles (k and
    v, or q and dO), and dQ's float32 product dS K^T one transposed copy of the key tile. Float32 operands with
    ``precision="ieee"`` (FMA dots, no tensor cores) ask for more at 16- and 32-wide tiles, layout-conversion scratch
    (about twice the estimate for the forward's 128 x 128 tiles at D=16), still far below the budget; from 64-wide tiles
    the estimate covers them too (every kept config compiled for sm_90 on the CPU with bf16, fp16, tf32, ieee and
    fp32-operand bf16 dots, head dims 16 to 256, decoding tiles included).

    Example:
        >>> shared_memory_estimate(make_configs([(128, 64, 4, 3)])[0], 128, 2, streamed="BLOCK_N", resident="BLOCK_M")
        131072
    """
    meta = config.kwargs
    streamed_tiles = config.num_stages * 2 + (transposed_fp32_tiles if elem == 4 else 0)
    return (streamed_tiles * meta[streamed] + resident_tiles * meta[resident]) * block_d * elem + scratch


def prune_by_resources(configs: list[triton.Config], named_args: dict, *, streamed: tuple[str, str],
                       resident: str, resident_tiles: int = 1, transposed_fp32_tiles: int = 0, scratch: int = 0,
                       budget: int = SHARED_MEMORY_BUDGET, **kwargs) -> list[triton.Config]:
    """Drop configs whose shared memory (``shared_memory_estimate``) passes ``budget`` or whose accumulators cannot
    fit registers.

    ``streamed`` names the two block sizes of the tiles that are pipelined (two tiles of ``streamed[0]`` rows per
    stage), ``resident`` the block size of the tiles that stay on chip; ``resident_tiles``,
    ``transposed_fp32_tiles`` and ``scratch`` as in ``shared_memory_estimate``. Always keeps at least the smallest
    config.
    """
    args = {**named_args, **kwargs}
    block_d = args["BLOCK_D"]
    elem = _operand_bytes(args)
    kept = []
    for config in configs:
        smem = shared_memory_estimate(config, block_d, elem, streamed=streamed[0], resident=resident,
                                      resident_tiles=resident_tiles, transposed_fp32_tiles=transposed_fp32_tiles,
                                      scratch=scratch)
        # Rough register bound: a float32 [resident, BLOCK_D] accumulator over num_warps * 32 threads.
        acc_regs = config.kwargs[resident] * block_d // (config.num_warps * 32)
        if smem <= budget and acc_regs <= 128:
            kept.append(config)
    if not kept:
        kept = [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.num_stages)]
    return kept


# Sequence lengths enter the autotuning key as powers of two, capped here: past it the best tiles no longer change,
# and the longest cases (S=100,000 takes over a second per call) reuse the tuning of a shorter one.
MAX_SEQ_BUCKET = 16384
# Batch * heads joins the key as a power of two (capped): it sets how many programs share the GPU, so a config tuned
# at B=1 (a fraction of one wave) is not reused at B=16 (many waves) of the same sequence length.
MAX_BATCH_HEADS_BUCKET = 4096
# The query bucket of decoding-sized calls (at most this many query rows).
MIN_SEQ_Q_BUCKET = 16
# The variant flags join too: a windowed kernel visits a band of blocks, so its best tiles differ from dense ones.
AUTOTUNE_KEY = ["SEQ_Q_BUCKET", "SEQ_K_BUCKET", "BATCH_HEADS_BUCKET", "HEAD_DIM", "CAUSAL", "KEY_MASK", "DOT",
                "WINDOW", "SOFTCAP", "ALIBI", "VARLEN", "PAGE_SIZE"]
# The backward kernels take no paged cache (decoding is forward only): a key name that is not a kernel argument is
# refused by newer Triton when the autotuner is built (3.9 does; 3.6 skipped it).
AUTOTUNE_KEY_BACKWARD = [name for name in AUTOTUNE_KEY if name != "PAGE_SIZE"]


def tuning_buckets(seq_q: int, seq_k: int, batch_heads: int) -> tuple[int, int, int]:
    """The autotuning key's size buckets (SEQ_Q_BUCKET, SEQ_K_BUCKET, BATCH_HEADS_BUCKET): powers of two, capped.

    Example:
        >>> tuning_buckets(1000, 77, 3 * 5), tuning_buckets(100_000, 100_000, 32 * 16), tuning_buckets(4, 8192, 256)
        ((1024, 128, 16), (16384, 16384, 512), (16, 8192, 256))
    """
    # Queries of at most 16 rows (decoding) are a bucket of their own: they take other tiles (attention_fwd).
    q_bucket = MIN_SEQ_Q_BUCKET if seq_q <= MIN_SEQ_Q_BUCKET else min(seq_bucket(seq_q), MAX_SEQ_BUCKET)
    return (q_bucket, min(seq_bucket(seq_k), MAX_SEQ_BUCKET), min(next_power_of_2(batch_heads), MAX_BATCH_HEADS_BUCKET))


# EVEN_M derived from the block size: the query rows divide evenly into BLOCK_M blocks, so row masks can be skipped.
# Never for packed sequences: seq_q is then the longest one, and the others end inside their blocks.
even_m = triton.heuristics({"EVEN_M": lambda a: a["seq_q"] % a["BLOCK_M"] == 0
                            and not a.get("VARLEN", False)})
