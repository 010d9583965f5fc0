"""The Gluon attention forward on an sm_90 GPU against float64: outputs, base-2 log-sum-exp, and the backward fed
with them.

Every test is skipped without a CUDA device of compute capability 9.0. The reference is computed here in float64
from the same (bf16/fp16) inputs: softmax(q k^T * scale, masked) v with the key/value heads repeated for GQA, and
log2(e) * logsumexp of the scaled, masked scores (-inf where a row sees no key). Outputs are judged by the
plugin's baseline rule (no worse than twice SDPA's own error in the input precision, plus the dtype's floor).
"""
import math

import pytest
import torch

from flashlite.attn import gluon as launch_gluon
from flashlite.attention import attention_backward
from flashlite.attn.gluon import GluonConfig, gluon_attention_forward, gluon_supported
from flashlite import explain_dispatch
from flashlite.attention import attention
from pytest_kernelcheck import assert_close, policy_for

from .test_attention_backward import reference_attention
from .test_attention_gpu import cuda_qkv as qkv

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                                reason="needs a CUDA GPU of compute capability 9.0 (Hopper)")

LOG2E = math.log2(math.e)
# The lse is float32 arithmetic on scores the reference computes from the same inputs: its error is that of the
# float32 dot products, exp2/log2 and the running sum (about 1e-5 measured by hand on ideal data; 1e-3 leaves room
# for 4k-key sums of approximate exp2).
LSE_POLICY = policy_for("fp32").replace(atol=1e-3, rtol=1e-4, name="lse (float32, base 2)")
CAUSAL = [False, True, "lower_right"]
# (variant, overlap): steps 1 and 3, each with and without a block's softmax overlapping the previous P V.
SCHEDULES = [(variant, overlap) for overlap in (False, True) for variant in launch_gluon.VARIANTS
             if any(c.overlap == overlap for c in launch_gluon.configs_for(64, variant))]
SCHEDULE_IDS = [variant + ("+overlap" if overlap else "") for variant, overlap in SCHEDULES]
schedules = pytest.mark.parametrize("schedule", SCHEDULES, ids=SCHEDULE_IDS)


def schedule_config(head_dim, schedule):
    """The first config listed for the schedule's variant and overlap at this head dim."""
    variant, overlap = schedule
    return next(c for c in launch_gluon.configs_for(head_dim, variant) if c.overlap == overlap)


def visible_keys(seq_q, seq_k, causal, device, window_left=None):
    """bool [S_q, S_k]: which keys each query row sees (with ``window_left``, a causal window: keys from
    i' - window_left, i' the row on the diagonal ``causal`` names)."""
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=device)
    shift = 0 if causal is True else seq_k - seq_q
    if causal:
        visible = visible.tril(shift)
    if window_left is not None:
        visible &= ~torch.ones_like(visible).tril(shift - window_left - 1)
    return visible


def reference(q, k, v, causal, scale=None, window_left=None):
    """(out, lse) in float64: softmax(q k^T * scale) v, rows without keys 0; lse = log2(e) logsumexp, -inf there."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    visible = visible_keys(q.shape[2], k.shape[2], causal, q.device, window_left)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # -inf for a row of -inf
    weights = torch.exp(scores - torch.where(lse.isinf(), 0.0, lse)[..., None])
    return weights @ v, lse * LOG2E


def sdpa_baseline(q, k, v, causal, scale=None, window=None):
    """flashlite's SDPA path in the input precision (GQA, bottom-right causal, windows, rows without keys as 0):
    the baseline's error."""
    return attention(q, k, v, causal=causal, scale=scale, window=window, backend="sdpa")


def check_forward(q, k, v, causal, schedule=("pipelined", False), scale=None, config=None, window=None):
    """Run the kernel in ``schedule`` (or ``config``) and check out and lse against float64."""
    assert gluon_supported(q, k, v, causal, scale, window=window) is None
    config = config or schedule_config(q.shape[-1], schedule)
    out, lse = gluon_attention_forward(q, k, v, causal=causal, scale=scale, variant=config.variant, config=config,
                                       window=window)
    torch.cuda.synchronize()
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    ref_out, ref_lse = reference(q, k, v, causal, scale, None if window is None else window[0])
    notes = (str(config), f"window {window}")
    assert_close(out, ref_out, baseline=sdpa_baseline(q, k, v, causal, scale, window), notes=notes)
    assert_close(lse, ref_lse, policy=LSE_POLICY, notes=notes)
    return out, lse


@schedules
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, H, S", [(2, 4, 1), (2, 4, 77), (1, 4, 1000), (1, 2, 4097), (1, 2, 256)])
def test_forward_odd_lengths(B, H, S, D, dtype, causal, schedule):
    check_forward(*qkv(B, H, S, D, dtype), causal, schedule)


@schedules
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("S_q, S_k", [(300, 1000), (1000, 300), (1, 4097), (129, 128), (127, 1)])
def test_forward_unequal_lengths(S_q, S_k, D, causal, schedule):
    # lower_right with S_q > S_k leaves the first S_q - S_k rows without keys (out 0, lse -inf), and whole query
    # blocks without a key block to visit.
    check_forward(*qkv(2, 4, S_q, D, torch.bfloat16, S_k=S_k), causal, schedule)


@schedules
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("H, H_kv, D", [(8, 2, 64), (8, 1, 128), (16, 4, 128)])
def test_forward_gqa(H, H_kv, D, causal, schedule):
    check_forward(*qkv(2, H, 700, D, torch.float16, H_kv=H_kv, S_k=900), causal, schedule)


# The causal window in steps 1 and 2 (the ping-pong kernel has none): widths below, at and above one key block
# (BLOCK_N 64 or 128) and across many, so that a query block's keys start inside a block, on a block boundary and
# past block 0; bottom-right with S_q < S_k and S_q > S_k (rows without keys); GQA.
WINDOW_SCHEDULES = [s for s in SCHEDULES if s[0] != "pingpong"]


@pytest.mark.parametrize("schedule", WINDOW_SCHEDULES, ids=[i for s, i in zip(SCHEDULES, SCHEDULE_IDS)
                                                            if s[0] != "pingpong"])
@pytest.mark.parametrize("left", [0, 1, 63, 64, 100, 128, 1000])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal, S_q, S_k", [(True, 1100, 1100), ("lower_right", 300, 1000),
                                              ("lower_right", 1000, 300), (True, 77, 77)])
def test_forward_causal_window(causal, S_q, S_k, D, left, schedule):
    check_forward(*qkv(2, 4, S_q, D, torch.bfloat16, H_kv=2, S_k=S_k), causal, schedule, window=(left, 0))


@pytest.mark.parametrize("D", [64, 128])
def test_window_configs_and_refusals(D):
    for config in launch_gluon.configs_for(D, "pipelined"):
        check_forward(*qkv(1, 4, 2500, D, torch.float16), True, config=config, window=(700, -1))
    q, k, v = qkv(1, 2, 256, D, torch.bfloat16)
    assert "causal and bounded on the left" in gluon_supported(q, k, v, False, window=(10, 10))
    assert "causal and bounded on the left" in gluon_supported(q, k, v, True, window=(-1, 0))
    with pytest.raises(ValueError, match="ping-pong kernel"):
        gluon_attention_forward(q, k, v, causal=True, variant="pingpong", window=(10, 0))


@pytest.mark.parametrize("D, config", [(d, c) for v in launch_gluon.VARIANTS for d in (64, 128)
                                       for c in launch_gluon.configs_for(d, v)], ids=str)
def test_every_listed_config(D, config):
    for causal in CAUSAL:
        check_forward(*qkv(2, 4, 1111, D, torch.bfloat16, S_k=1234), causal, config=config)


@schedules
def test_strided_layouts_and_scale(schedule):
    # [B, S, H, D] storage seen as [B, H, S, D]: the descriptors take the strides as they are, no copy.
    q, k, v = (t.transpose(1, 2) for t in qkv(2, 1500, 8, 128, torch.bfloat16))
    assert not q.is_contiguous()
    check_forward(q, k, v, True, schedule, scale=0.3)


@schedules
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype, D, S_q, S_k, H, H_kv", [(torch.bfloat16, 64, 1000, 1000, 8, 2),
                                                           (torch.float16, 128, 777, 1200, 4, 4),
                                                           (torch.bfloat16, 128, 900, 500, 4, 2)])
def test_backward_takes_gluon_out_and_lse(dtype, D, S_q, S_k, H, H_kv, causal, schedule):
    # The pointer kernels' backward, fed with the Gluon forward's out and lse, against float64 autograd; baseline:
    # SDPA's gradients in the input precision.
    q, k, v = qkv(2, H, S_q, D, dtype, H_kv=H_kv, S_k=S_k)
    grad_out = torch.randn_like(q)
    scale = D ** -0.5
    config = schedule_config(D, schedule)
    out, lse = gluon_attention_forward(q, k, v, causal=causal, variant=config.variant, config=config)
    mode = {False: 0, True: 1, "lower_right": 2}[causal]
    precision = "bf16" if dtype == torch.bfloat16 else "fp16"
    got = attention_backward(grad_out, q, k, v, out, lse, None, None, mode, scale, precision)

    def grads(fn, *tensors):
        leaves = [t.detach().requires_grad_() for t in tensors]
        fn(*leaves).backward(grad_out.to(leaves[0].dtype))
        return [t.grad for t in leaves]

    ref = grads(lambda *t: reference_attention(*t, causal=causal), q.double(), k.double(), v.double())
    base = grads(lambda *t: sdpa_baseline(*t, causal), q, k, v)
    for name, g, r, b in zip(("dq", "dk", "dv"), got, ref, base):
        assert not g.isnan().any(), name
        assert_close(g, r, baseline=b, notes=(name, str(config)))


@pytest.mark.parametrize("config", launch_gluon.configs_for(64, "pingpong") + launch_gluon.configs_for(128, "pingpong"),
                         ids=str)
@pytest.mark.parametrize("S_q, S_k", [
    (64, 64),  # one program whose second consumer has no rows at all (it reads nothing, waits for no Q)
    (65, 65),  # the second consumer has one real row
    (320, 320),  # the last program's second consumer lies past S_q (2 x 64 rows per program) or is partial
    (1000, 300),  # bottom-right: the first consumer of some programs sees no key while the second sees some
    (300, 1000),  # bottom-right: the two consumers end on different key blocks
    (2049, 2049),  # long enough for every slot of the ring to be refilled many times
])
def test_pingpong_consumers_with_unequal_work(config, S_q, S_k):
    # The two consumers of a program read different numbers of key blocks (or none): the turns and the slot
    # hand-back must neither deadlock nor refill a slot one of them still reads.
    D = 64 if config in launch_gluon.configs_for(64, "pingpong") else 128
    for causal in CAUSAL:
        check_forward(*qkv(2, 4, S_q, D, torch.bfloat16, H_kv=2, S_k=S_k), causal, config=config)


def test_refuses_a_config_of_the_other_variant():
    q, k, v = qkv(1, 2, 64, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="is for variant 'pingpong'"):
        gluon_attention_forward(q, k, v, variant="pipelined", config=GluonConfig("pingpong", 64, 128, 3, 4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
def test_dispatched_gluon_forward_end_to_end(D, dtype):
    # The call the measured rule routes to the Gluon kernel (dense causal, B*H*S_q = GLUON_MIN_ROWS, from the
    # dtype's length floor): explain_dispatch says so, and attention() itself (plan, launch, autograd through the
    # backward the rule picks for the shape) is right in float64 on batch 0, heads 0 and 1, whose outputs
    # and gradients depend on no other batch or head.
    floor = launch_gluon.GLUON_MIN_SEQ[D] if dtype == torch.bfloat16 else launch_gluon.GLUON_FP16_MIN_SEQ
    S = max(launch_gluon.GLUON_MIN_ROWS // (2 * 16), floor)
    B, H = max(1, launch_gluon.GLUON_MIN_ROWS // (16 * S)), 16
    q, k, v = (t.requires_grad_() for t in qkv(B, H, S, D, dtype))
    decision = explain_dispatch(q, k, v, causal=True, backend="triton")
    assert decision.backend == "triton" and "Gluon kernel" in decision.reason, decision.reason
    _check_causal_part_and_gradients(q, k, v, attention(q, k, v, causal=True, backend="triton"), "dispatched Gluon")


@pytest.mark.parametrize("D, window", [(64, None), (128, None), (64, (1000, 0))])
def test_a_replayed_gluon_launch_matches_the_ordinary_one_bit_for_bit(monkeypatch, D, window):
    # A recording plan's first call records its Gluon launch and a later call with
    # fresh tensors replays it with its own descriptors and lse. The replay must run (not fall back), give the
    # ordinary launch's out and lse bit for bit, and be right in float64 on batch 0, heads 0 and 1.
    from flashlite.attn.plan import Plan
    from flashlite.attn.problem import validate
    S = launch_gluon.GLUON_WINDOW_MIN_SEQ if window else max(launch_gluon.GLUON_MIN_SEQ[D], 1024)
    B, H = max(1, launch_gluon.GLUON_MIN_ROWS // (16 * S)), 16
    problem = validate(*qkv(B, H, S, D, torch.bfloat16), True, None, None, None, "triton", None, window)
    plan = Plan(problem, None, record=True)  # as a kept plan on CUDA
    # The recorded call's tensors (other values) stay alive, so the replay's tensors live at other addresses: a
    # replay that ran with the recorded descriptors or lse would give the recorded call's output, not this one's.
    first = qkv(B, H, S, D, torch.bfloat16, seed=1)
    first_out, first_lse = launch_gluon.launch_planned(*first, problem, plan)  # recorded
    (site, recorded), = plan.recorded.items()
    assert recorded is not None, "the Gluon launch could not be recorded"
    replays = []
    real_replay = recorded.launch
    recorded.launch = lambda *leading: replays.append(real_replay(*leading)) or replays[-1]
    q, k, v = qkv(B, H, S, D, torch.bfloat16, seed=2)
    out, lse = launch_gluon.launch_planned(q, k, v, problem, plan)
    assert replays == [True], "the replay fell back to the ordinary launch"
    assert out.data_ptr() != first_out.data_ptr() and lse.data_ptr() != first_lse.data_ptr()
    assert not torch.equal(out, first_out)
    ordinary_out, ordinary_lse = launch_gluon.launch_planned(q, k, v, problem)  # no plan: the ordinary launch
    assert torch.equal(out, ordinary_out) and torch.equal(lse, ordinary_lse)
    part = (slice(0, 1), slice(0, 2))
    ref_out, _ = reference(*(t[part].double() for t in (q, k, v)), True, None, None if window is None else window[0])
    assert_close(out[part], ref_out, baseline=sdpa_baseline(*(t[part] for t in (q, k, v)), True, window=window),
                 notes=("replayed Gluon launch", f"D={D}", f"window {window}"))


def test_dispatched_gluon_window_end_to_end(monkeypatch):
    # A causal sliding window at D=64 of the length the rule starts from: explain_dispatch names the Gluon kernel
    # and the window, and attention() (plan, the windowed Gluon launch, the pointer kernel's windowed backward) is
    # right in float64 on batch 0, heads 0 and 1.
    S = launch_gluon.GLUON_WINDOW_MIN_SEQ
    H = max(2, launch_gluon.GLUON_MIN_ROWS // S)
    window = (1000, 0)  # not a multiple of the key block: the window's edge cuts through a block
    q, k, v = (t.requires_grad_() for t in qkv(1, H, S, 64, torch.bfloat16))
    decision = explain_dispatch(q, k, v, causal=True, window=window, backend="triton")
    assert decision.backend == "triton" and "causal windows of 1000 keys" in decision.reason, decision.reason
    launches = []
    real_launch = launch_gluon._launch
    monkeypatch.setattr(launch_gluon, "_launch", lambda *a, **kw: launches.append(a[5:7]) or real_launch(*a, **kw))
    out = attention(q, k, v, causal=True, window=window, backend="triton")
    # (config, window_left) of the one forward launch: the windowed config with the window's left bound.
    assert launches == [(launch_gluon.dispatched_config(64, windowed=True), 1000)], "the Gluon forward did not run"
    _check_causal_part_and_gradients(q, k, v, out, "dispatched Gluon window", window)


def _check_causal_part_and_gradients(q, k, v, out, note, window=None):
    """Backward of causal ``out`` (with ``window``, a causal sliding window) with a random gradient, then out, dq,
    dk and dv of batch 0, heads 0 and 1 (which depend on no other batch or head) against float64, SDPA's own error
    as the baseline."""
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    part = (slice(0, 1), slice(0, 2))
    leaves = [t.detach()[part].double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference(*leaves, True, None, None if window is None else window[0])
    ref_out.backward(grad_out[part].double())
    base_leaves = [t.detach()[part].clone().requires_grad_() for t in (q, k, v)]
    base_out = sdpa_baseline(*base_leaves, True, window=window)
    base_out.backward(grad_out[part])
    assert_close(out.detach()[part], ref_out.detach(), baseline=base_out.detach(), notes=(note,))
    for name, got, ref, base in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), leaves, base_leaves):
        assert not got.isnan().any(), name
        assert_close(got[part], ref.grad, baseline=base.grad, notes=(name, note))


@pytest.mark.parametrize("D", [64, 128])
def test_dispatched_gluon_forward_under_torch_compile(D, monkeypatch):
    # torch.compile traces the plan's decision on fake tensors (fullgraph: no break allowed), then the custom op
    # runs the Gluon kernel on the real ones: the compiled call launches it, and its output and gradients are right
    # in float64 on batch 0, heads 0 and 1.
    import torch._dynamo
    torch._dynamo.reset()
    launches = []
    real_launch = launch_gluon._launch
    monkeypatch.setattr(launch_gluon, "_launch", lambda *a, **kw: launches.append(1) or real_launch(*a, **kw))
    B, H, S = 2, 16, max(launch_gluon.GLUON_MIN_ROWS // (2 * 16), launch_gluon.GLUON_MIN_SEQ[D])
    q, k, v = (t.requires_grad_() for t in qkv(B, H, S, D, torch.bfloat16))
    compiled = torch.compile(lambda q, k, v: attention(q, k, v, causal=True, backend="triton"), fullgraph=True)
    out = compiled(q, k, v)
    assert launches, "the compiled call did not run the Gluon forward"
    _check_causal_part_and_gradients(q, k, v, out, "compiled Gluon")
