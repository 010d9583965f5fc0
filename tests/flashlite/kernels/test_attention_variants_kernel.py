"""Sliding windows, softcapping and ALiBi inside the Triton kernels, forward and backward, through the launchers.

Run through the interpreter on the CPU: every variant alone and combined, at small odd sizes (S_q = 37, S_k = 45,
grouped-query heads H = 4 over H_kv = 2) so that the blocks of the interpreter configs (32 x 16 forward and dQ,
16 x 32 dK/dV) end mid-tile and the window's edges cross blocks at every offset. The reference is written out here
in float64 (dense scores, torch.autograd for the gradients), independent of the kernels' block logic. Shapes are tiny
because the interpreter runs every tile op as Python; the cases are chosen so that each variant, each causal mode and
each key mask meets the window at least once.
"""
from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from flashlite.attention import attention_backward, attention_forward
from flashlite.kernels import attention_bwd, attention_fwd
from flashlite.kernels.attention_common import tanh
from tests.flashlite.sm90 import SM90_COMPILER

# On a GPU machine the same checks run on CUDA (the kernels compiled for real); the references stay on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, H, H_KV, S_Q, S_K = 2, 4, 2, 37, 45
SCALE = 0.3
# Absolute tolerances, relative to the largest reference value of each tensor. float32 with ieee dots: errors of a
# few float32 ulps summed over ~45 keys (measured near 1e-6). fp16: the inputs' own rounding (2**-11 relative) and
# fp16 operands of P V and dS K (measured near 2e-3); the bound leaves room for other seeds.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 1e-2}
PRECISION = {torch.float32: "ieee", torch.float16: "fp16"}


def random_inputs(dtype, seed, *, seq_q=S_Q, seq_k=S_K, heads=H, kv_heads=H_KV, head_dim=16):
    """Fresh seeded N(0, 1) q, k, v and a gradient of the output (never zeros, so no term vanishes by accident)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*size):
        return torch.randn(*size, generator=gen).to(device=DEVICE, dtype=dtype)

    return (rand(B, heads, seq_q, head_dim), rand(B, kv_heads, seq_k, head_dim), rand(B, kv_heads, seq_k, head_dim),
            rand(B, heads, seq_q, head_dim))


def visible(causal, window, seq_q, seq_k, key_lengths=None, key_mask=None):
    """[B, S_q, S_k] bool: which keys each query row sees, straight from the definitions."""
    shift = seq_k - seq_q if causal == 2 else 0
    i = torch.arange(seq_q)[:, None] + shift  # i': the row aligned to the causal diagonal
    j = torch.arange(seq_k)[None, :]
    seen = torch.ones(seq_q, seq_k, dtype=torch.bool)
    if causal:
        seen &= j <= i
    left, right = window
    if left >= 0:
        seen &= j >= i - left
    if right >= 0:
        seen &= j <= i + right
    seen = seen.expand(B, seq_q, seq_k).clone()
    if key_lengths is not None:
        seen &= j[None] < key_lengths.view(B, 1, 1)
    if key_mask is not None:
        seen &= key_mask.view(B, 1, seq_k)
    return seen


def reference(q, k, v, grad_out, *, causal=0, window=(-1, -1), softcap=0.0, slopes=None, key_lengths=None,
              key_mask=None):
    """float64 (out, base-2 lse, dq, dk, dv) of the semantics: scores scale * q.k, then c * tanh(s / c), then
    - slope * |i' - j|, then every mask; rows that see no key give zeros (and lse -inf)."""
    q, k, v = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    grad_out, slopes, key_lengths, key_mask = (None if t is None else t.cpu()
                                               for t in (grad_out, slopes, key_lengths, key_mask))
    seq_q, seq_k = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = SCALE * q @ kk.transpose(-1, -2)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if slopes is not None:
        shift = seq_k - seq_q if causal == 2 else 0
        distance = (torch.arange(seq_q)[:, None] + shift - torch.arange(seq_k)[None, :]).abs().double()
        per_head = slopes.double().view(-1, q.shape[1], 1, 1)  # [1 or B, H, 1, 1]
        scores = scores - per_head * distance
    seen = visible(causal, window, seq_q, seq_k, key_lengths, key_mask)[:, None]
    scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.where(seen, torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None]), 0.0)
    out = probs @ vv
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out.double())
    return out.detach(), lse.detach() / math.log(2.0), dq, dk, dv


def run_kernels(q, k, v, grad_out, *, causal=0, window=(-1, -1), softcap=0.0, slopes=None, key_lengths=None,
                key_mask=None):
    key_mask, key_lengths, slopes = (None if t is None else t.to(q.device) for t in (key_mask, key_lengths, slopes))
    args = (key_mask, key_lengths, causal, SCALE, PRECISION[q.dtype], *window, softcap, slopes)
    out, lse = attention_forward(q, k, v, *args)
    dq, dk, dv = attention_backward(grad_out, q, k, v, out, lse, *args)
    return out, lse, dq, dk, dv


def assert_matches(got, expected, dtype):
    names = ("out", "lse", "dq", "dk", "dv")
    for name, g, e in zip(names, got, expected):
        g = g.double().cpu()
        if name == "lse":  # rows that see no key: -inf in both; the rest compared as values
            assert torch.equal(torch.isinf(g), torch.isinf(e)), "rows with no key differ"
            g, e = g[~torch.isinf(e)], e[~torch.isinf(e)]
        assert torch.isfinite(g).all(), f"{name} is not finite"
        bound = TOLERANCE[dtype] * max(1.0, e.abs().max().item())
        err = (g - e).abs().max().item()
        assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


def _lengths():
    return torch.tensor([30, 45])  # batch 0 padded, batch 1 full: the window meets the key length in one of them


def _padding():
    gen = torch.Generator().manual_seed(7)
    mask = torch.rand(B, S_K, generator=gen) > 0.3
    mask[:, 0] = True
    return mask


def _slopes(per_batch):
    gen = torch.Generator().manual_seed(11)
    return (torch.rand(B, H, generator=gen) if per_batch else torch.rand(H, generator=gen)) * 0.25 + 0.05


# (dtype, variant arguments): each variant alone, the window with each causal mode, and combinations with the key
# masks. Window sides are chosen to end inside blocks (neither multiple of 16 nor of 32).
CASES = {
    "window-noncausal": (torch.float32, dict(causal=0, window=(5, 3))),
    "window-topleft": (torch.float16, dict(causal=1, window=(6, -1))),
    "window-lowerright": (torch.float32, dict(causal=2, window=(9, 2))),
    "window-right-only": (torch.float16, dict(causal=0, window=(-1, 4))),
    "softcap": (torch.float32, dict(causal=0, softcap=1.5)),
    "alibi-heads": (torch.float16, dict(causal=1, slopes=_slopes(False))),
    "softcap-alibi-batch-heads-lengths": (torch.float32, dict(causal=2, softcap=2.0, slopes=_slopes(True),
                                                              key_lengths=_lengths())),
    "all-bool-mask": (torch.float16, dict(causal=0, window=(8, 7), softcap=3.0, slopes=_slopes(True),
                                          key_mask=_padding())),
    "window-alibi-lengths": (torch.float32, dict(causal=1, window=(20, -1), slopes=_slopes(False),
                                                 key_lengths=_lengths())),
}


@pytest.mark.parametrize("case", list(CASES))
def test_variant_matches_float64_reference(case):
    dtype, variant = CASES[case]
    q, k, v, grad_out = random_inputs(dtype, seed=sum(map(ord, case)))
    assert_matches(run_kernels(q, k, v, grad_out, **variant), reference(q, k, v, grad_out, **variant), dtype)


def test_rows_whose_window_holds_no_key_give_zeros_and_zero_gradients():
    # Batch 0 has 20 keys; with a window of (2, 0) rows 23.. see none of them: zeros, lse -inf, dq = 0. S_q > S_k
    # under lower-right causal would do the same through negative i'; this covers the key-length side.
    q, k, v, grad_out = random_inputs(torch.float32, seed=5)
    variant = dict(causal=0, window=(2, 0), key_lengths=torch.tensor([20, 45]))
    got = run_kernels(q, k, v, grad_out, **variant)
    assert_matches(got, reference(q, k, v, grad_out, **variant), torch.float32)
    out, lse, dq, dk, dv = got
    assert torch.equal(out[0, :, 23:], torch.zeros_like(out[0, :, 23:]))
    assert torch.isinf(lse[0, :, 23:]).all() and (lse[0, :, 23:] < 0).all()
    assert torch.equal(dq[0, :, 23:], torch.zeros_like(dq[0, :, 23:]))
    assert torch.equal(dk[0, :, 20:], torch.zeros_like(dk[0, :, 20:]))


@pytest.mark.parametrize("causal, window, hidden", [
    (2, (3, -1), slice(0, 5)),  # i' = i + 8: keys 0..4 lie left of every row's window, inside the first block
    (0, (3, 1), slice(38, 45)),  # the last row (36) reaches key 37: keys 38..44 lie right of every window
])
def test_nan_in_keys_hidden_by_the_window_never_reaches_the_outputs(causal, window, hidden):
    q, k, v, grad_out = random_inputs(torch.float16, seed=9)
    expected = reference(q, k, v, grad_out, causal=causal, window=window)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[:, :, hidden] = float("nan")
    poisoned_v[:, :, hidden] = float("inf")
    got = run_kernels(q, poisoned_k, poisoned_v, grad_out, causal=causal, window=window)
    assert_matches(got, expected, torch.float16)


def _visited_block_pairs(seen, block_rows, block_cols):
    """(row block, column block) pairs of a [S_q, S_k] visibility holding at least one visible entry: what a kernel
    that skips every block wholly outside the window visits, no more."""
    rows, cols = seen.shape
    return sum(bool(seen[r:r + block_rows, c:c + block_cols].any())
               for r in range(0, rows, block_rows) for c in range(0, cols, block_cols))


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts the interpreter's calls of the tile-product helper; "
                                                   "compiled kernels inline it")
def test_the_window_skips_key_blocks_wholly_outside_it(monkeypatch):
    # Count the tile products the kernels run (their `mma` helper, replaced by a counting one): the forward does
    # two per (query block, key block) it visits, dK/dV four per (key block, query block), dQ three. With a window
    # they must visit exactly the block pairs the window touches: at S = 192 already about half of what causal
    # attention visits (42 forward block pairs), a share that shrinks as S grows, since the band's pairs grow as S.
    seq, head_dim = 192, 16
    gen = torch.Generator().manual_seed(3)
    q, k, v, grad_out = (torch.randn(1, 1, seq, head_dim, generator=gen) for _ in range(4))
    counts = {}

    def counting(module, name):
        original = module.mma

        def mma(a, b, acc, DOT):
            counts[name] += 1
            return original.fn(a, b, acc, DOT)
        monkeypatch.setattr(module, "mma", mma)

    counting(attention_fwd, "fwd")
    counting(attention_bwd, "bwd")
    (fm, fn_), (km, kn), (qm, qn) = (attention_fwd.FWD_INTERPRETER_BLOCKS[0][:2],
                                     attention_bwd.DKDV_INTERPRETER_BLOCKS[0][:2],
                                     attention_bwd.DQ_INTERPRETER_BLOCKS[0][:2])
    for causal, window in ((1, (-1, -1)), (1, (21, -1)), (0, (13, 6))):
        counts.update(fwd=0, bwd=0)
        args = (None, None, causal, SCALE, "ieee", *window, 0.0, None)
        out, lse = attention_forward(q, k, v, *args)
        attention_backward(grad_out, q, k, v, out, lse, *args)
        seen = visible(causal, window, seq, seq)[0]
        assert counts["fwd"] == 2 * _visited_block_pairs(seen, fm, fn_)
        assert counts["bwd"] == 4 * _visited_block_pairs(seen.T, kn, km) + 3 * _visited_block_pairs(seen, qm, qn)
        if window == (-1, -1):
            dense = counts["fwd"]
        else:
            assert counts["fwd"] < 0.6 * dense


# ----------------------------------------------------------------------------------------------------------------
# With every variant off, the kernels compile to what they compiled to before the variants existed.

# The last commit that changed flashlite/kernels before the variants were added.
DENSE_KERNELS_COMMIT = "e4eeb70591f56e393cbe85ee7a76da62821e9af8"
# The reference of each kernel's dense code: the forward's and dK/dV's are those of DENSE_KERNELS_COMMIT. The dQ
# kernel has since changed on purpose (it computes delta itself): its reference is set to that commit, which only
# inserted the delta computation into the code this test had checked against DENSE_KERNELS_COMMIT.
DQ_COMPUTES_DELTA_COMMIT = "7ea953c0942e2415718cddd67860583b89017b56"
REFERENCE_COMMITS = {"fwd": DENSE_KERNELS_COMMIT, "dkdv": DENSE_KERNELS_COMMIT, "dq": DQ_COMPUTES_DELTA_COMMIT}
# Arguments the variants added: unused when they are off, so present in the function's signature only.
VARIANT_ARGUMENTS = ["Alibi", "stride_alibi_b", "stride_alibi_h", "window_left", "window_right", "softcap",
                     "CuSeqQ", "CuSeqK"]  # packed sequences (VARLEN)
FORWARD_ARGUMENTS = ["BlockTable", "stride_table_b"]  # paged KV caches (PAGE_SIZE), a forward-only feature
# The first visible key of each entry of a boolean key mask, where the forward's and dQ's key loops start: read only
# when KEY_MASK == "bool", so present in the signature only here.
KEY_START_ARGUMENTS = {"fwd": {"KeyStart"}, "dq": {"KeyStart"}}

_DENSE_TTGIR = SM90_COMPILER + r'''
import json, re
# Dense launches as the launcher makes them: several causal modes, key masks and forward tilings, bf16, D=64. (The
# kernels of a boolean key mask have since changed on purpose: they skip the key blocks the mask hides whole,
# attention_common.skip_hidden_prefix; key lengths stand in for key masks here.)
JOBS = [("fwd", attention_fwd._attn_fwd, dict(BLOCK_M=128, BLOCK_N=64), 1, "none"),
        ("fwd", attention_fwd._attn_fwd, dict(BLOCK_M=64, BLOCK_N=64, BH_PER_PROGRAM=2), 2, "lengths"),
        ("dkdv", attention_bwd._attn_bwd_dkdv, dict(BLOCK_M=32, BLOCK_N=128), 1, "none"),
        ("dkdv", attention_bwd._attn_bwd_dkdv, dict(BLOCK_M=32, BLOCK_N=128), 2, "lengths"),
        ("dq", attention_bwd._attn_bwd_dq, dict(BLOCK_M=128, BLOCK_N=32), 1, "none"),
        ("dq", attention_bwd._attn_bwd_dq, dict(BLOCK_M=128, BLOCK_N=32), 0, "lengths")]

def renumbered(lines, keep):
    # Values are named by definition, in order: a name the printer reuses in sibling regions (it derives names
    # from Python variables) gets a fresh number at each definition, and each use the number of the latest one.
    current, out = {}, []
    for line in lines:
        block_args = line.lstrip().startswith("^")

        def rename(m):
            token, rest = m.group(0), line[m.end():]
            if token[1:] in keep:
                return token
            if re.match(r"(:\d+)?\s*=(?!=)", rest) or (block_args and rest.startswith(":")) or token not in current:
                current[token] = f"%v{len(current)}_{sum(1 for _ in out)}"
            return current[token]
        out.append(re.sub(r"%[\w$.\-]+", rename, line))
    # The numbers above carry the line of definition; make them plain counters of first appearance.
    order = {}
    return [re.sub(r"%v\d+_\d+", lambda m: order.setdefault(m.group(0), f"%v{len(order)}"), line) for line in out]

def by_value(lines):
    # Constants have no order of their own: Triton 3.9 hoists them in another order than 3.6 did, so a use names
    # a constant by its value and type, and the definitions become one sorted list.
    named, values, out = {}, set(), []
    for line in lines:
        defined = re.match(r"\s*(%[\w$.\-]+) = arith\.constant (.*)$", line)
        if defined:  # a name the printer reuses in a sibling region is defined again: the latest value holds
            named[defined.group(1)] = "const(" + defined.group(2) + ")"
            values.add(defined.group(2))
            continue
        for name, value in named.items():
            line = re.sub(re.escape(name) + r"(?![\w$.\-])", value, line)
        out.append(line)
    return out, ["arith.constant " + value for value in sorted(values)]

def normalised(ttgir):
    # The function's arguments keep their parameter names in the IR; every other value's name is a hint from the
    # Python variable it came from, or a counter (block arguments are numbered on after the function's, so inserted
    # parameters renumber them): they are renumbered, so that a renamed variable or an inserted parameter changes
    # no line. Locations go too.
    ttgir = re.sub(r"\s*loc\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)", "", ttgir)
    lines = [line for line in ttgir.splitlines() if not line.startswith("#loc")]
    start = next(i for i, line in enumerate(lines) if "tt.func public" in line)
    params = re.findall(r"%([\w$.\-]+): ([^,{)]+)", lines[start])
    lines, constants = by_value(lines[:start] + lines[start + 1:])
    body = constants + renumbered(lines, {name for name, _ in params})
    return {"params": [[name, kind.strip()] for name, kind in params], "body": body}

KINDS = set(os.environ["DENSE_KINDS"].split(","))
print(json.dumps([normalised(ttgir_for_sm90(fn, blocks, head_dim=64, block_d=64, causal=causal, key_mask=mask))
                  for kind, fn, blocks, causal, mask in JOBS if kind in KINDS]))
'''


def _dense_ttgir(tree, cache, kinds) -> list:
    import json
    import os
    import subprocess
    import sys
    # cwd = the tree: python -c puts the working directory first on sys.path, so `import flashlite` finds its copy.
    # A fresh Triton cache: a cached kernel skips the compile stages, and with them the TTGIR this stops at.
    done = subprocess.run([sys.executable, "-c", _DENSE_TTGIR], capture_output=True, text=True, timeout=600,
                          cwd=tree, env={**os.environ, "TRITON_CACHE_DIR": str(cache),
                                         "DENSE_KINDS": ",".join(kinds)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _drop_page_size_from_backward_keys(path) -> None:
    # A reference's backward autotuners name PAGE_SIZE, not a backward argument: Triton 3.7 and later refuse that
    # when the module is imported (3.6 skipped the name), as the package itself did until 410a1f0. Dropping it, as
    # that commit did, leaves the raw kernels this test compiles as they were.
    source = path.read_text()
    path.write_text(source.replace("key=AUTOTUNE_KEY,", 'key=[n for n in AUTOTUNE_KEY if n != "PAGE_SIZE"],'))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU suite compiles the kernels for real")
def test_dense_kernels_compile_to_the_same_ttgir_as_before_the_variants(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    import pathlib
    import shutil
    import subprocess
    import tarfile
    root = pathlib.Path(__file__).resolve().parents[3]
    for commit in sorted(set(REFERENCE_COMMITS.values())):
        if shutil.which("git") is None or subprocess.run(
                ["git", "cat-file", "-e", commit], cwd=root, capture_output=True).returncode != 0:
            pytest.skip(f"needs the repository's history (commit {commit[:9]}), e.g. not a shallow clone")
    for commit in sorted(set(REFERENCE_COMMITS.values())):
        kinds = [kind for kind in ("fwd", "dkdv", "dq") if REFERENCE_COMMITS.get(kind) == commit]
        # The package as it was at that commit, exported (not checked out) beside this tree.
        archive = tmp_path / f"{commit}.tar"
        subprocess.run(["git", "archive", "-o", str(archive), commit, "flashlite"], cwd=root, check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(tmp_path / commit, filter="data")
        _drop_page_size_from_backward_keys(tmp_path / commit / "flashlite" / "kernels" / "attention_bwd.py")
        before = _dense_ttgir(tmp_path / commit, tmp_path / f"cache-{commit}", kinds)
        now = _dense_ttgir(root, tmp_path / f"cache-now-{commit}", kinds)
        jobs = [kind for kind in ("fwd", "fwd", "dkdv", "dkdv", "dq", "dq") if kind in kinds]  # JOBS, in order
        for kind, old, new in zip(jobs, before, now):
            assert new["body"] == old["body"], kind
            # The signature: the old parameters, in order and of the same types, plus the variants' unused ones
            # where the reference predates them, and the key start.
            added = set(KEY_START_ARGUMENTS.get(kind, ()))
            if commit == DENSE_KERNELS_COMMIT:
                added |= set(VARIANT_ARGUMENTS) | (set(FORWARD_ARGUMENTS) if kind == "fwd" else set())
            assert [p for p in new["params"] if p[0] not in added] == old["params"], kind
            assert {p[0] for p in new["params"]} - {p[0] for p in old["params"]} == added, kind
        assert len(before) == len(now) == len(jobs)


@triton.jit
def _tanh_kernel(X, Y, n, BLOCK: tl.constexpr):  # X, Y: [n] float32
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tanh(tl.load(X + offs, mask=offs < n, other=0.0)), mask=offs < n)


def test_the_kernels_tanh_is_accurate_near_zero_and_far_from_it():
    # Softcapping computes c * tanh(s / c): with a large cap s / c is tiny, where the exp2 form's 1 - t cancels
    # (2.6e-3 error in the scores at softcap 1e5, float32). Relative error against float64 over 12 decades.
    magnitudes = torch.logspace(-9, 1.5, 400, dtype=torch.float64)
    x = torch.cat([magnitudes, -magnitudes, torch.tensor([0.0, 0.125, -0.125, 0.12499, 30.0], dtype=torch.float64)])
    x32 = x.to(torch.float32).to(DEVICE)
    y = torch.empty_like(x32)
    _tanh_kernel[(triton.cdiv(x.numel(), 128),)](x32, y, x.numel(), BLOCK=128)
    expected = torch.tanh(x32.double().cpu())
    relative = ((y.double().cpu() - expected).abs() / expected.abs().clamp_min(1e-300)).max().item()
    assert relative < 6e-7, relative  # a few float32 ulps
    assert y[x32 == 0].eq(0).all()


@pytest.mark.parametrize("softcap", [1e3, 1e5, 1e7])
def test_a_large_softcap_matches_the_float64_reference(softcap):
    q, k, v, _ = random_inputs(torch.float32, seed=11)
    out, _ = attention_forward(q, k, v, None, None, 1, 0.25, "ieee", softcap=softcap)
    scores = (q.double() @ k.double().repeat_interleave(H // H_KV, dim=1).transpose(-1, -2)) * 0.25
    scores = softcap * torch.tanh(scores / softcap)
    causal = torch.ones(S_Q, S_K, dtype=torch.bool, device=DEVICE).tril()
    expected = scores.masked_fill(~causal, -math.inf).softmax(-1) @ v.double().repeat_interleave(H // H_KV, dim=1)
    assert (out.double() - expected).abs().max().item() < 2e-5
