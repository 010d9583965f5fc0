import sys, re
sys.path.insert(0, sys.argv[1])
src = open(sys.argv[1] + "/tests/flashlite/" + ("sm90.py" if len(sys.argv) > 3 else "test_attention.py")).read()
start = src.index("SM90_COMPILER = r'''") + len("SM90_COMPILER = r'''")
exec(src[start:src.index("'''", start)])
which = sys.argv[2]
fn = {"fwd": attention_fwd._attn_fwd, "dkdv": attention_bwd._attn_bwd_dkdv, "dq": attention_bwd._attn_bwd_dq}[which]
blocks = {"fwd": dict(BLOCK_M=128, BLOCK_N=64, BH_PER_PROGRAM=1), "dkdv": dict(BLOCK_M=32, BLOCK_N=128), "dq": dict(BLOCK_M=128, BLOCK_N=32)}[which]
k = compile_for_sm90(fn, blocks, head_dim=64, block_d=64, causal=1, key_mask="none", warps=4, stages=3)
ttgir = k.asm["ttgir"]
ttgir = re.sub(r"loc\([^)]*\)", "", ttgir)
ttgir = "\n".join(l for l in ttgir.splitlines() if not l.startswith("#loc"))
open(f"/tmp/ttgir_{which}_{'new' if len(sys.argv) > 3 else 'old'}.txt", "w").write(ttgir)
print(which, len(ttgir.splitlines()), k.metadata.shared)
