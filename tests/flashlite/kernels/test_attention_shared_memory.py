"""Every config the pruning keeps fits Hopper's shared memory: checked by compiling each one for sm_90.

With autotuning off (FLASHLITE_AUTOTUNE=0) a launch takes the first config the pruning keeps, so an estimate below
what Triton allocates is a crash on the GPU (OutOfResources), not a slower config. This test compiles, for the
forward, dK/dV and dQ kernels, every kept config at each tile width the head dims 16 to 256 use (BLOCK_D 16, 32,
64, 128, 256) with 2-byte (bf16) and 4-byte (float32) operands, in the variant with the most code (causal, boolean
key mask), and checks the compiled kernel's shared memory against the limit and against the estimate. The window,
softcap and ALiBi add no tiles (scalars and masks only), so the same estimate must hold with all three on: checked at
one tile width, the 256-wide one where the limit binds. The forward's decoding tiles (16 query rows, kept only for
queries of at most 16 rows) are compiled by a test of their own.
"""
import json

import pytest
import torch

from flashlite.kernels import attention_bwd, tuning
from tests.flashlite.sm90 import SM90_COMPILER, run_script

HOPPER_SHARED_MEMORY = 232448  # bytes per thread block on an H100/H200, as Triton reports the limit
# One head dim per tile width, not a power of two where one exists (160 pads to 256, like 192 and 224).
HEAD_DIMS = (16, 24, 48, 96, 160)
# Head dims compiled again with WINDOW, SOFTCAP and ALIBI on.
VARIANT_HEAD_DIMS = (160,)
VARIANT_FLAGS = {"WINDOW": True, "SOFTCAP": True, "ALIBI": True}

_COMPILE_KEPT = SM90_COMPILER + r'''
import json
from concurrent.futures import ProcessPoolExecutor
import torch
from flashlite.kernels import tuning

KERNELS = {"fwd": (attention_fwd._attn_fwd, attention_fwd.FWD_GPU_BLOCKS, attention_fwd.prune_fwd_configs),
           "dkdv": (attention_bwd._attn_bwd_dkdv, attention_bwd.DKDV_GPU_BLOCKS, attention_bwd.prune_dkdv_configs),
           "dq": (attention_bwd._attn_bwd_dq, attention_bwd.DQ_GPU_BLOCKS, attention_bwd.prune_dq_configs)}
OPERANDS = {2: (torch.bfloat16, "*bf16", "bf16"), 4: (torch.float32, "*fp32", "tf32")}

def block_d(head_dim):
    return max(16, 1 << (head_dim - 1).bit_length())

def jobs():
    for kernel, (fn, blocks, prune) in KERNELS.items():
        for variants, head_dims in ((False, HEAD_DIMS), (True, VARIANT_HEAD_DIMS)):
            for head_dim in head_dims:
                for elem, (dtype, _, _) in OPERANDS.items():
                    # A short sequence, so that the forward's several-pairs-per-program configs are candidates too.
                    named = {"Q": torch.empty(0, dtype=dtype), "SEQ_Q_BUCKET": 128}
                    for config in prune(tuning.make_configs(blocks), named, BLOCK_D=block_d(head_dim)):
                        yield (kernel, head_dim, elem, dict(config.kwargs), config.num_warps, config.num_stages,
                               variants)

def measure(job):
    kernel, head_dim, elem, meta, warps, stages, variants = job
    _, operand, dot = OPERANDS[elem]
    shared = shared_memory_for_sm90(KERNELS[kernel][0], meta, head_dim=head_dim, block_d=block_d(head_dim),
                                    causal=1, key_mask="bool", warps=warps, stages=stages, operand=operand, dot=dot,
                                    flags=VARIANT_FLAGS if variants else None)
    return {"kernel": kernel, "head_dim": head_dim, "elem": elem, "meta": meta, "warps": warps, "stages": stages,
            "shared": shared, "variants": variants}

if __name__ == "__main__":
    with ProcessPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        for row in pool.map(measure, list(jobs())):
            print(json.dumps(row))
'''


def _estimate(row):
    config = tuning.make_configs([(row["meta"]["BLOCK_M"], row["meta"]["BLOCK_N"], row["warps"],
                                   row["stages"])])[0]
    block_d = max(16, 1 << (row["head_dim"] - 1).bit_length())
    if row["kernel"] == "fwd":
        return tuning.shared_memory_estimate(config, block_d, row["elem"], streamed="BLOCK_N", resident="BLOCK_M",
                                             scratch=tuning.SCRATCH_BYTES)
    streamed, resident = ("BLOCK_M", "BLOCK_N") if row["kernel"] == "dkdv" else ("BLOCK_N", "BLOCK_M")
    return tuning.shared_memory_estimate(config, block_d, row["elem"], streamed=streamed, resident=resident,
                                         resident_tiles=attention_bwd.BACKWARD_RESIDENT_TILES,
                                         transposed_fp32_tiles=int(row["kernel"] == "dq"),
                                         scratch=tuning.SCRATCH_BYTES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU suite compiles the kernels for real")
def test_every_kept_config_fits_hopper_shared_memory_at_every_head_dim(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    script = tmp_path / "compile_kept.py"  # a file, so that the process pool's workers can import it
    script.write_text(f"HEAD_DIMS = {HEAD_DIMS!r}\nVARIANT_HEAD_DIMS = {VARIANT_HEAD_DIMS!r}\n"
                      f"VARIANT_FLAGS = {VARIANT_FLAGS!r}\n" + _COMPILE_KEPT)
    rows = [json.loads(line) for line in run_script(f"import runpy; runpy.run_path({str(script)!r}, "
                                                    f"run_name='__main__')").splitlines()]
    seen = {(row["kernel"], row["head_dim"], row["elem"], row["variants"]) for row in rows}
    assert seen == ({(k, d, e, False) for k in ("fwd", "dkdv", "dq") for d in HEAD_DIMS for e in (2, 4)}
                    | {(k, d, e, True) for k in ("fwd", "dkdv", "dq") for d in VARIANT_HEAD_DIMS for e in (2, 4)})
    over = [row for row in rows if not 0 < row["shared"] <= HOPPER_SHARED_MEMORY]
    assert not over, f"kept configs that ask for more than {HOPPER_SHARED_MEMORY} bytes: {over}"
    # The estimate the pruning uses never undercounts, so what it keeps is what fits.
    under = [(row, _estimate(row)) for row in rows if _estimate(row) < row["shared"]]
    assert not under, f"configs whose estimate is below what the compiler allocates: {under}"
    # At 256-wide tiles the limit binds: the 64 x 128 dK/dV tile of two stages (262,656 bytes compiled), which
    # autotuning-off launches used to pick at head dims 160 to 256, is no longer kept.
    assert not any(row["kernel"] == "dkdv" and row["head_dim"] == 160 and row["meta"] == {"BLOCK_M": 64,
                                                                                          "BLOCK_N": 128}
                   and row["stages"] == 2 for row in rows)


# Decoding tiles (16 query rows: FWD_DECODE_BLOCKS, the forward's only candidates where SEQ_Q_BUCKET <= 16) are
# kept by the same estimate; the test above passes a 128-row bucket, so they need a compile of their own. Head dims
# 96 and 160: where the 128- and 256-wide tiles leave fewest of them.
_COMPILE_DECODE = SM90_COMPILER + r'''
import json
import torch
from flashlite.kernels import tuning

for head_dim in (96, 160):
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    for elem, dtype, operand, dot in ((2, torch.bfloat16, "*bf16", "bf16"), (4, torch.float32, "*fp32", "tf32")):
        named = {"Q": torch.empty(0, dtype=dtype), "SEQ_Q_BUCKET": 16}
        for config in attention_fwd.prune_fwd_configs(tuning.make_configs(attention_fwd.FWD_DECODE_BLOCKS
                                                                          + attention_fwd.FWD_GPU_BLOCKS),
                                                      named, BLOCK_D=block_d):
            shared = shared_memory_for_sm90(attention_fwd._attn_fwd, dict(config.kwargs), head_dim=head_dim,
                                            block_d=block_d, causal=1, key_mask="bool", warps=config.num_warps,
                                            stages=config.num_stages, operand=operand, dot=dot)
            print(json.dumps({"kernel": "fwd", "head_dim": head_dim, "elem": elem, "meta": dict(config.kwargs),
                              "warps": config.num_warps, "stages": config.num_stages, "shared": shared}))
'''


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU suite compiles the kernels for real")
def test_decoding_tiles_fit_hopper_shared_memory_as_estimated(tmp_path, monkeypatch):
    pytest.importorskip("triton.backends.nvidia")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))  # a cached kernel skips the stages
    rows = [json.loads(line) for line in run_script(_COMPILE_DECODE).splitlines()]
    assert rows and all(row["meta"]["BLOCK_M"] == 16 for row in rows), rows
    assert {(row["head_dim"], row["elem"]) for row in rows} == {(d, e) for d in (96, 160) for e in (2, 4)}
    assert not [row for row in rows if not 0 < row["shared"] <= HOPPER_SHARED_MEMORY]
    assert not [(row, _estimate(row)) for row in rows if _estimate(row) < row["shared"]]
