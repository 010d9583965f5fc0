"""The decoding kernels compile for sm_90 (Hopper) on the CPU, fit its shared memory and spill no registers.

Each config below is compiled in a fresh interpreter (the interpreter switch is read when kernels are defined) with
an empty Triton cache, so that ptxas runs and reports the registers and spills of each kernel. The configs are the
launcher's defaults (D = 128 and 256, contiguous and paged with pages shorter and longer than the tile), the most
rows a program holds (a group of 8 heads times 8 queries), the variants (softcap, window, lse, an fp8 cache, the
fused merge) and the CUDA-core path (no ``tl.dot``) at the tile where its [rows, keys, D] product still fits the
registers; and the merge at 64 shares.
A paged cache must get the same shared-memory buffers (pipelining) as a contiguous one.
"""
import json

from tests.flashlite.sm90 import run_script

HOPPER_SHARED_MEMORY = 232448  # bytes per thread block on an H100/H200, as Triton reports the limit

_COMPILE = r'''
import contextlib, io, json, os, re
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashlite.kernels import attention_decode

POINTERS = dict(KeyLens="*i32", BlockTable="*i32", Lse="*fp32", Parts="*fp32",
                KScale="*fp32", VScale="*fp32", Arrivals="*i32")

def compile_sm90(fn, meta, warps, stages, cache="*bf16"):
    # As a launch with bf16 tensors whose last dimension is contiguous: unit strides constant, the rest and the
    # pointers divisible by 16.
    signature, constants, attrs = {}, dict(meta), {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name.startswith("stride_") and name.endswith("d"):
            signature[name], constants[name] = "constexpr", 1
        elif name[0].isupper():
            signature[name] = cache if name in ("K", "V") else POINTERS.get(name, "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if "scale" in name or "softcap" in name else "i32"
            if name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": warps, "num_stages": stages})
    report = log.getvalue()
    return {"shared": kernel.metadata.shared,
            "registers": [int(n) for n in re.findall(r"Used (\d+) registers", report)],
            "spills": [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]}

BASE = dict(SEQ_Q=1, GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_R=16, BLOCK_N=64, PAGE_SIZE=0, SPLIT=True,
            USE_DOT=True, IEEE=False, SOFTCAP=False, WINDOW=False, STORE_LSE=False, DEQUANT=False,
            FUSED_MERGE=False)
CASES = [({}, 4, 3), (dict(PAGE_SIZE=16), 4, 3), (dict(PAGE_SIZE=256), 4, 3),
         (dict(GROUP=8, SEQ_Q=8, BLOCK_R=64), 4, 3), (dict(HEAD_DIM=256, BLOCK_D=256, BLOCK_N=32), 4, 2),
         (dict(SOFTCAP=True, WINDOW=True, STORE_LSE=True, SPLIT=False), 4, 3),
         (dict(USE_DOT=False, BLOCK_R=4, BLOCK_N=32), 4, 3), (dict(DEQUANT=True), 4, 3),
         (dict(FUSED_MERGE=True, STORE_LSE=True), 4, 3)]
for change, warps, stages in CASES:
    cache = "*fp8e4nv" if change.get("DEQUANT") else "*bf16"  # an fp8 cache, bf16 queries
    row = compile_sm90(attention_decode._decode_split, dict(BASE, **change), warps, stages, cache)
    print(json.dumps(dict(row, case=repr(change))))
MERGE = dict(SEQ_Q=1, GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_S=64, STORE_LSE=True)
print(json.dumps(dict(compile_sm90(attention_decode._decode_merge, MERGE, 4, 1), case="merge")))
'''


def test_decoding_kernels_fit_hopper_without_spills(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))  # empty: ptxas runs and reports
    rows = [json.loads(line) for line in run_script(_COMPILE).splitlines() if line.startswith("{")]
    assert len(rows) == 10
    for row in rows:
        assert row["shared"] <= HOPPER_SHARED_MEMORY, row
        assert row["registers"] and max(row["registers"]) <= 255, row
        assert row["spills"] and not any(row["spills"]), row
    # A paged cache keeps as many K and V buffers as a contiguous one (the table entries are loaded a tile ahead;
    # loaded in the tile's own iteration, they cost a pipeline stage: 39 KB here, one buffer, against 72 KB).
    shared = {row["case"]: row["shared"] for row in rows}
    for case in ("{'PAGE_SIZE': 16}", "{'PAGE_SIZE': 256}"):
        assert abs(shared[case] - shared["{}"]) <= 1024, shared
