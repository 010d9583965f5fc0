"""flashlite.attention under torch.compile: one opaque custom op, no graph breaks, same results as eager."""
import importlib

import pytest
import torch

import flashlite
from flashlite.attention import attention, explain_dispatch
from pytest_kernelcheck import assert_close
from tests.flashlite.tables import use_table

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def leaves(*shapes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen).to(device=DEVICE, dtype=dtype).requires_grad_() for s in shapes]


def run(fn, tensors, grad_seed=1):
    """fn's output and the gradients of a fixed random projection of it with respect to ``tensors``."""
    for t in tensors:
        t.grad = None
    out = fn(*tensors)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out)
    (out * weight).sum().backward()
    return out.detach(), [t.grad.clone() for t in tensors]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_kernel_matches_eager_forward_and_backward():
    q, k, v = leaves((2, 4, 24, 32), (2, 2, 30, 32), (2, 2, 30, 32))
    lengths = torch.tensor([30, 11], device=DEVICE)

    def block(q, k, v):
        # Work around the op on both sides, so the graph has something to fuse and must pass gradients through.
        out = attention(q * 0.5, k, v, causal="lower_right", key_lengths=lengths, backend="triton",
                        precision="ieee")
        return torch.tanh(out) + q

    eager_out, eager_grads = run(block, [q, k, v])
    compiled_out, compiled_grads = run(torch.compile(block, fullgraph=True, backend="aot_eager"), [q, k, v])
    assert torch.equal(compiled_out, eager_out)
    for compiled, eager in zip(compiled_grads, eager_grads):
        assert torch.equal(compiled, eager)


def test_compiled_graph_holds_the_custom_op_not_the_kernel():
    q, k, v = leaves((1, 2, 20, 16), (1, 2, 20, 16), (1, 2, 20, 16))
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda q, k, v: attention(q, k, v, causal=True, backend="triton"), fullgraph=True,
                             backend=recording_backend)
    out = compiled(q, k, v)
    code = "\n".join(gm.code for gm in graphs)
    assert len(graphs) == 1 and "flashlite.attention_forward" in code
    assert "triton" not in code.replace("flashlite", "")  # nothing of the kernel itself was traced
    assert torch.equal(out, attention(q, k, v, causal=True, backend="triton"))


def test_compiled_auto_dispatch_with_masks_matches_eager():
    # backend="auto" decides in Python at trace time; on a CPU-only machine it picks SDPA and its mask handling.
    q, k, v = leaves((2, 2, 18, 16), (2, 2, 25, 16), (2, 2, 25, 16))
    mask = torch.rand(2, 25, generator=torch.Generator().manual_seed(2)).to(DEVICE) > 0.5
    mask[1] = False

    def block(q, k, v):
        return attention(q, k, v, causal="lower_right", key_padding_mask=mask)

    eager_out, eager_grads = run(block, [q, k, v])
    compiled_out, compiled_grads = run(torch.compile(block, fullgraph=True, backend="aot_eager"), [q, k, v])
    assert not compiled_out.isnan().any()
    assert_close(compiled_out, eager_out.double())
    for compiled, eager in zip(compiled_grads, eager_grads):
        assert not compiled.isnan().any()
        assert_close(compiled, eager.double())


def test_dynamic_sequence_length_recompiles_nothing_wrong():
    def block(q, k, v):
        return attention(q, k, v, causal=True, backend="triton", precision="ieee")

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager", dynamic=True)
    for seq in (20, 37):
        q, k, v = leaves((1, 2, seq, 16), (1, 2, seq, 16), (1, 2, seq, 16), seed=seq)
        compiled_out, compiled_grads = run(compiled, [q, k, v])
        eager_out, eager_grads = run(block, [q, k, v])
        assert torch.equal(compiled_out, eager_out)
        for compiled_grad, eager_grad in zip(compiled_grads, eager_grads):
            assert torch.equal(compiled_grad, eager_grad)


def test_custom_ops_pass_opcheck():
    # Schema, fake (meta) implementation, autograd registration and AOT dispatch, as torch.library checks them.
    q, k, v = leaves((1, 2, 17, 16), (1, 1, 21, 16), (1, 1, 21, 16))
    lengths = torch.tensor([15], device=DEVICE)
    torch.library.opcheck(torch.ops.flashlite.attention_forward.default,
                          (q, k, v, None, lengths, 2, 0.25, "ieee"),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
    out, lse = torch.ops.flashlite.attention_forward(q.detach(), k.detach(), v.detach(), None, lengths, 2, 0.25,
                                                     "ieee")
    grad_out = torch.randn_like(out)
    torch.library.opcheck(torch.ops.flashlite.attention_backward.default,
                          (grad_out, q.detach(), k.detach(), v.detach(), out, lse, None, lengths, 2, 0.25, "ieee"),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_the_inference_op_passes_opcheck_and_matches_the_autograd_ops_output():
    q, k, v = (t.detach() for t in leaves((1, 2, 17, 16), (1, 1, 21, 16), (1, 1, 21, 16), seed=3))
    lengths = torch.tensor([15], device=DEVICE)
    arguments = (q, k, v, None, lengths, 2, 0.25, "ieee")
    torch.library.opcheck(torch.ops.flashlite.attention_inference.default, arguments,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    out = torch.ops.flashlite.attention_inference(*arguments)
    assert torch.equal(out, torch.ops.flashlite.attention_forward(*arguments)[0])


def _graph_ops(fn, *tensors) -> tuple[list[str], torch.Tensor]:
    """The flashlite ops in the graph torch.compile makes of fn, and fn's output."""
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm

    out = torch.compile(fn, backend=keep_graph, fullgraph=True)(*tensors)
    names = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    return [name for name in names if name.startswith("flashlite.")], out


def test_compiled_calls_take_the_inference_op_only_where_no_gradient_can_flow():
    q, k, v = leaves((2, 4, 24, 16), (2, 2, 30, 16), (2, 2, 30, 16), seed=5)
    fn = lambda q, k, v: attention(q, k, v, causal="lower_right", backend="triton", precision="ieee")  # noqa: E731
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(t.detach().double() for t in (q, k, v)),
        attn_mask=torch.ones(24, 30, dtype=torch.bool, device=DEVICE).tril(6), enable_gqa=True)
    with torch.no_grad():
        ops, out = _graph_ops(fn, q, k, v)
    assert ops == ["flashlite.attention_inference.default"]
    assert_close(out, expected, policy="fp32")
    torch._dynamo.reset()
    ops, out = _graph_ops(fn, *(t.detach() for t in (q, k, v)))  # grad mode on, nothing requires grad
    assert ops == ["flashlite.attention_inference.default"]
    torch._dynamo.reset()
    ops, out = _graph_ops(fn, q, k, v)
    assert ops == ["flashlite.attention_forward.default"]
    assert_close(out.detach(), expected, policy="fp32")
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_static_compiled_call_is_decided_outside_the_trace(monkeypatch):
    # Validated and decided while torch.compile traces but outside its trace (decide.traced_call_plan): the
    # dispatch table, which sends this call to the kernel, and the validation leave no guard on the graph. Traced,
    # they left about 160 on a compiled TransformerLayer, each checked before every call.
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from flashlite import dispatch
    q, k, v = (t.detach() for t in leaves((2, 4, 24, 16), (2, 2, 24, 16), (2, 2, 24, 16), seed=7))
    entry = {"backend": "triton", "why": "made up"}
    use_table(monkeypatch, {dispatch.table_key(torch.float32, 16, True, 2, 24): entry})
    fn = lambda q, k, v: attention(q, k, v, causal=True, precision="ieee")  # noqa: E731
    ops, out = _graph_ops(fn, q, k, v)
    assert ops == ["flashlite.attention_inference.default"]
    expected = torch.nn.functional.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), is_causal=True,
                                                                enable_gqa=True)
    assert_close(out, expected, policy="fp32")
    guards = "\n".join(str(entry.guard_manager) for entry in _debug_get_cache_entry_list(fn.__code__))
    assert "check_tensor(L['q']" in guards  # the tree was read
    for name in ("flashlite_dot_dispatch", "flashlite_dot__attention_dot_validation", "launch_gluon", "_TABLES"):
        assert name not in guards, name


def test_static_compiled_training_call_logs_the_decision_it_runs_by(monkeypatch, caplog):
    # FLASHLITE_DEBUG_DISPATCH under torch.compile: the plan is made on fake tensors outside the trace, and the log
    # must name the forward+backward decision for a call whose gradient flows (the made-up table sends the forward
    # to the kernel and forward+backward to SDPA).
    import logging

    from flashlite import dispatch
    monkeypatch.setenv("FLASHLITE_DEBUG_DISPATCH", "1")
    use_table(monkeypatch, {dispatch.table_key(torch.float32, 16, True, 1, 16): {"backend": "triton", "why": "fwd"},
                            dispatch.table_key(torch.float32, 16, True, 1, 16, backward=True):
                                {"backend": "sdpa", "why": "fwd+bwd"}})
    q = torch.randn(1, 2, 16, 16, device=DEVICE, requires_grad=True)
    fn = lambda q: attention(q, q, q, causal=True, precision="ieee")  # noqa: E731
    with caplog.at_level(logging.DEBUG, logger="flashlite.attention"):
        ops, out = _graph_ops(fn, q)
    assert ops == []  # SDPA, no flashlite op
    decisions = [r.getMessage() for r in caplog.records if r.name == "flashlite.attention"]
    assert len(decisions) == 1 and "-> sdpa" in decisions[0] and "fwd+bwd" in decisions[0], decisions


@pytest.mark.parametrize("fullgraph", [False, True])
def test_static_compiled_call_refuses_what_eager_refuses(fullgraph):
    # traced_call_plan hands validation's error back and the traced code raises it: without fullgraph the frame
    # falls back to eager, which raises it by its own type; with fullgraph torch.compile raises, naming it.
    q = torch.randn(1, 2, 8, 16)
    compiled = torch.compile(lambda q: attention(q, q, q, scale=float("nan")), backend="aot_eager",
                             fullgraph=fullgraph)
    with torch.no_grad(), pytest.raises(TypeError if not fullgraph else Exception, match="scale must be a finite"):
        compiled(q)


@pytest.mark.parametrize("argument, match", [("key_padding_mask", "key_padding_mask must be a bool tensor"),
                                             ("key_lengths", "key_lengths must be an int32 or int64 tensor"),
                                             ("alibi_slopes", "alibi_slopes must be a float32 tensor")])
@pytest.mark.parametrize("fullgraph", [False, True])
def test_static_compiled_call_names_a_list_where_a_tensor_belongs(argument, match, fullgraph):
    # A list for a tensor argument: the eager call's TypeError names it. Compiled, reading the list's layout for
    # traced_call_plan failed inside dynamo ("does not know how to trace method `stride` of class `list`") under
    # fullgraph; validation's error must come instead (with fullgraph, as dynamo reports a raised error).
    q = torch.randn(1, 2, 8, 16)
    value = [[True] * 8] if argument == "key_padding_mask" else [8] if argument == "key_lengths" else [0.5, 0.25]
    with torch.no_grad(), pytest.raises(TypeError, match=match):
        attention(q, q, q, **{argument: value})
    compiled = torch.compile(lambda q: attention(q, q, q, **{argument: value}), backend="aot_eager",
                             fullgraph=fullgraph)
    with torch.no_grad(), pytest.raises(TypeError if not fullgraph else Exception, match=match):
        compiled(q)


def test_fake_tensors_give_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(3, 8, 100, 80, dtype=torch.bfloat16)
        k = torch.empty(3, 2, 130, 80, dtype=torch.bfloat16)
        out, lse = torch.ops.flashlite.attention_forward(q, k, k, None, None, 1, 0.1, "bf16")
        dq, dk, dv = torch.ops.flashlite.attention_backward(out, q, k, k, out, lse, None, None, 1, 0.1, "bf16")
        inferred = torch.ops.flashlite.attention_inference(q, k, k, None, None, 1, 0.1, "bf16")
    assert (inferred.shape, inferred.dtype) == (q.shape, torch.bfloat16)
    assert (out.shape, out.dtype) == (q.shape, torch.bfloat16)
    assert (lse.shape, lse.dtype) == ((3, 8, 100), torch.float32)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)


def test_package_attribute_stays_callable():
    # Importing the flashlite.attention module rebinds the package attribute; calls must still reach attention().
    q, k, v = (t.detach() for t in leaves((1, 2, 16, 16), (1, 2, 16, 16), (1, 2, 16, 16)))
    assert torch.equal(flashlite.attention(q, k, v, causal=True, backend="triton"),
                       attention(q, k, v, causal=True, backend="triton"))


# A made-up table whose entries send some sizes to SDPA (the rest take the kernel by the float32 rule), so that one
# graph must run both; odd lengths on purpose. Batch sizes of 2 or more: dynamo specializes sizes 0 and 1, so a
# batch of 1 is a graph of its own. The order makes automatic dynamic shapes vary batch first, then length.
DYNAMIC_SIZES = ((4, 40), (8, 40), (8, 70), (3, 300), (2, 33), (5, 129), (4, 60))
DYNAMIC_TABLE = {"float32/D16/causal/B4/S64": {"backend": "sdpa", "why": "made up"},
                 "float32/D16/causal/B8/S64": {"backend": "sdpa", "why": "made up"},
                 "float32/D16/causal/B3/S512": {"backend": "sdpa", "why": "made up"}}


def _made_up_table(monkeypatch):
    use_table(monkeypatch, DYNAMIC_TABLE)


def _tensor_calls(gm) -> set:
    # A graph's calls, less the integer arithmetic on symbolic sizes (the shape checks traced from validation).
    return {str(node.target) for node in gm.graph.nodes
            if node.op == "call_function" and getattr(node.target, "__module__", None) != "_operator"}


def _compiled_with_graphs(fn, dynamic):
    """``fn`` compiled (fullgraph) after a dynamo reset, and the list each new graph's calls are appended to."""
    graphs = []

    def record_graph(gm, example_inputs):
        graphs.append(_tensor_calls(gm))
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=record_graph, dynamic=dynamic), graphs


def _dynamic_inference_graphs(monkeypatch, dynamic):
    """Run ``attention(backend="auto")`` compiled with ``dynamic`` at every size of DYNAMIC_SIZES without grad,
    against float64; returns the graphs' call targets and the backends the eager calls of those sizes choose."""
    _made_up_table(monkeypatch)
    # precision="ieee": on a GPU the Triton choice would otherwise take tf32 dots (the float32 default).
    compiled, graphs = _compiled_with_graphs(lambda q, k, v: attention(q, k, v, causal=True, precision="ieee"),
                                             dynamic)
    backends = set()
    with torch.no_grad():
        for batch, seq in DYNAMIC_SIZES:
            q, k, v = (t.detach() for t in leaves(*[(batch, 2, seq, 16)] * 3, seed=batch + seq))
            expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                                        is_causal=True)
            out = compiled(q, k, v)
            if dynamic is None and (batch, seq) == DYNAMIC_SIZES[0]:
                # The first graph is static and traced the eager call's choice, so it keeps that call's layout (on a
                # GPU, SDPA's float32 kernel returns a transposed view).
                assert out.stride() == attention(q, k, v, causal=True, precision="ieee").stride()
            else:
                assert out.stride() == torch.empty_like(q).stride()  # what flashlite::attention_auto declares
            assert_close(out, expected, policy="fp32")
            backends.add(explain_dispatch(q, k, v, causal=True, precision="ieee").backend)
    return graphs, backends


def test_inference_with_auto_is_one_graph_for_every_batch_and_length(monkeypatch):
    # What compiled users need: one graph for every batch size and length. With dynamic sizes the choice is made
    # per call inside flashlite::attention_auto, so the graph does not specialize on the table's buckets.
    graphs, backends = _dynamic_inference_graphs(monkeypatch, dynamic=True)
    assert backends == {"triton", "sdpa"}  # the one graph ran both
    assert len(graphs) == 1, graphs
    assert graphs[0] == {"flashlite.attention_auto.default"}


def test_automatic_dynamic_sizes_stop_recompiling_once_batch_and_length_vary(monkeypatch):
    # Without dynamic=True dynamo compiles the first sizes statically (the choice made at trace time, as for any
    # static graph), then marks each dimension that changed as dynamic: batch at the second size, length at the
    # third. From then on one graph serves every size.
    graphs, backends = _dynamic_inference_graphs(monkeypatch, dynamic=None)
    assert backends == {"triton", "sdpa"}
    assert len(graphs) == 3, graphs
    assert "flashlite.attention_auto.default" not in graphs[0]
    assert graphs[1] == graphs[2] == {"flashlite.attention_auto.default"}


# Variant calls through the run-time op, against the float64 reference of the variant tests (batch 2, H=4 over
# H_kv=2, lengths varied): key masks, both causal alignments, windows, softcap, ALiBi and an explicit scale.
DYNAMIC_VARIANTS = {
    "lengths-lower-right": dict(causal="lower_right", key_lengths=torch.tensor([30, 45])),
    "padding-window-softcap": dict(causal=False, key_padding_mask=True, window=(8, 7), softcap=3.0),
    "alibi-top-left": dict(causal=True, alibi_slopes=torch.tensor([0.3, 0.1, 0.05, 0.2])),
}


@pytest.mark.parametrize("name", list(DYNAMIC_VARIANTS))
def test_dynamic_graph_runs_variants_and_masks_per_call(name, monkeypatch):
    from tests.flashlite.kernels import test_attention_variants_kernel as variants
    _made_up_table(monkeypatch)
    arguments = dict(DYNAMIC_VARIANTS[name])
    compiled, graphs = _compiled_with_graphs(
        lambda q, k, v, kw: attention(q, k, v, scale=variants.SCALE, precision="ieee", **kw), dynamic=True)
    # Grad mode on, no input requiring grad: no gradient can flow (the reference computes its own).
    for seq_q, seq_k in ((37, 45), (20, 45), (45, 45)):
        q, k, v, _ = variants.random_inputs(torch.float32, seed=seq_q, seq_q=seq_q, seq_k=seq_k)
        kw = dict(arguments)
        if kw.get("key_padding_mask") is True:
            mask = torch.rand(2, seq_k, generator=torch.Generator().manual_seed(seq_q)) > 0.3
            mask[:, 0] = True
            kw["key_padding_mask"] = mask.to(q.device)
        for tensor_argument in ("key_lengths", "alibi_slopes"):
            if tensor_argument in kw:
                kw[tensor_argument] = kw[tensor_argument].to(q.device)
        causal = {False: 0, True: 1, "lower_right": 2}[kw["causal"]]
        expected = variants.reference(q, k, v, torch.ones_like(q), causal=causal,
                                      window=kw.get("window", (-1, -1)), softcap=kw.get("softcap", 0.0),
                                      slopes=kw.get("alibi_slopes"), key_lengths=kw.get("key_lengths"),
                                      key_mask=kw.get("key_padding_mask"))[0]
        assert_close(compiled(q, k, v, kw).cpu(), expected, policy="fp32")
    assert all(graph == {"flashlite.attention_auto.default"} for graph in graphs), graphs
    assert len(graphs) <= 2, graphs  # the first size, then one graph for the rest (no size specialized)


def test_dynamic_graph_checks_the_call_at_trace_time():
    q = torch.randn(2, 2, 24, 16)
    compiled = torch.compile(lambda q, k, v: attention(q, k, v, causal="upper"), fullgraph=True,
                             backend="aot_eager", dynamic=True)
    with torch.no_grad(), pytest.raises(Exception, match="causal must be"):
        compiled(q, q, q)


def test_the_inference_op_keeps_validation_at_trace_time():
    q = torch.randn(1, 2, 8, 16)
    compiled = torch.compile(lambda q, k, v: attention(q, k, v, causal=1), fullgraph=True, backend="aot_eager")
    with torch.no_grad(), pytest.raises(Exception, match="causal must be"):
        compiled(q, q, q)


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_dynamic_compile_takes_float_scale_and_softcap(backend):
    # With dynamic=True dynamo passes float arguments as symbols, which math.isfinite (the checks' old test) cannot
    # take: the compile failed before reaching the kernel.
    from tests.flashlite.kernels import test_attention_variants_kernel as variants
    q, k, v, _ = variants.random_inputs(torch.float32, seed=3)
    compiled = torch.compile(lambda q, k, v, scale, softcap: attention(q, k, v, causal=True, scale=scale,
                                                                       softcap=softcap, backend=backend,
                                                                       precision="ieee"),
                             fullgraph=True, backend="aot_eager", dynamic=True)
    with torch.no_grad():
        out = compiled(q, k, v, variants.SCALE, 2.0)
    expected = variants.reference(q, k, v, torch.ones_like(q), causal=1, softcap=2.0)[0]
    assert_close(out.cpu(), expected, policy="fp32")


def test_dynamic_training_graph_is_decided_by_the_rule_in_one_graph(monkeypatch):
    # A call whose gradient flows cannot take the run-time op (it has no autograd formula): with symbolic sizes the
    # table is not read (its key would specialize the graph) and the rule decides, here float32 -> the kernel's
    # custom op, although the made-up table sends some of these sizes to SDPA. One graph for every size, each
    # output and gradient against float64.
    _made_up_table(monkeypatch)
    compiled, graphs = _compiled_with_graphs(lambda q, k, v: attention(q, k, v, causal=True, precision="ieee"),
                                             dynamic=True)
    for batch, seq in DYNAMIC_SIZES:
        q, k, v = leaves(*[(batch, 2, seq, 16)] * 3, seed=batch * seq)
        out = compiled(q, k, v)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seq)).to(out)
        out.backward(grad_out)
        reference = [t.detach().double().requires_grad_() for t in (q, k, v)]
        expected = torch.nn.functional.scaled_dot_product_attention(*reference, is_causal=True)
        expected.backward(grad_out.double())
        assert_close(out.detach(), expected.detach(), policy="fp32")
        for leaf, ref in zip((q, k, v), reference):
            assert_close(leaf.grad, ref.grad, policy="fp32")
    assert len(graphs) == 1, graphs
    assert "flashlite.attention_forward.default" in graphs[0], graphs[0]


def test_a_dynamic_graph_is_not_guarded_on_the_plan_cache_where_launches_are_recorded(monkeypatch):
    # On a GPU a plan made while tracing asked whether the plan cache had room to keep it (its launches are recorded
    # only then): Dynamo guarded on the cache's size, and the compiled op, which keeps the plan of each new size at
    # run time, grew the cache, so every size recompiled the graph (7 graphs for 7 sizes on an H100). The CPU took
    # no such path (no recording there); here the plans are made as on a GPU.
    import flashlite.attn.plan as plans_module
    monkeypatch.setattr(plans_module, "launches_on_gpu", lambda q: True)
    monkeypatch.setattr(plans_module, "_PLANS", {})  # a cache with room, as in a fresh process
    test_dynamic_training_graph_is_decided_by_the_rule_in_one_graph(monkeypatch)


def test_symbolic_sizes_skip_the_table(monkeypatch):
    from flashlite import dispatch
    use_table(monkeypatch, {"bfloat16/D64/causal/B2/S128/fwd+bwd": {"backend": "triton", "why": "made up"}})
    q = torch.empty(2, 4, 100, 64, dtype=torch.bfloat16)
    assert dispatch.choose_backend(q, causal=True, seq_k=100, backward=True).backend == "triton"
    decision = dispatch.choose_backend(q, causal=True, seq_k=100, backward=True, symbolic_sizes=True)
    assert decision.backend == "sdpa"
    assert "sizes symbolic under torch.compile" in decision.reason and "rule" in decision.reason


def _merged_heads_block(backend):
    """A layer's attention: q, k, v as [B, H, S, D] views of [B, S, H, D] projections, the output's heads merged
    back into [B, S, H * D] and used by a pointwise op, which Inductor compiles to read the op's output through the
    strides its fake declares."""
    def block(x_q, x_k, x_v):
        batch, seq, heads, head_dim = x_q.shape
        q, k, v = (t.transpose(1, 2) for t in (x_q, x_k, x_v))
        out = attention(q, k, v, causal=True, backend=backend, precision="ieee")
        return out.transpose(1, 2).reshape(batch, seq, heads * head_dim) * 2.0 + 1.0
    return block


def _merged_heads_reference(x_q, x_k, x_v):
    """The block in float64 through SDPA (differentiable: give it float64 leaves)."""
    q, k, v = (t.double().transpose(1, 2) for t in (x_q, x_k, x_v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(*x_q.shape[:2], -1) * 2.0 + 1.0


@pytest.mark.parametrize("with_grad", [False, True])
def test_inductor_reads_the_kernel_output_through_the_layout_its_op_declares(with_grad):
    # The heads of the kernel's output, laid out like q, merged and read by Inductor's generated code, against
    # float64: through flashlite::attention_inference without a gradient, flashlite::attention_forward with one.
    # (On the CPU a fake declaring another layout still gave right values here; that the fakes and the kernels
    # agree is test_each_op_fake_declares_the_strides_its_kernel_returns's check.)
    x_q, x_k, x_v = leaves((2, 24, 3, 16), (2, 24, 3, 16), (2, 24, 3, 16), seed=3)
    compiled = torch.compile(_merged_heads_block("triton"), fullgraph=True, backend="inductor")
    with torch.set_grad_enabled(with_grad):
        got = compiled(*(t if with_grad else t.detach() for t in (x_q, x_k, x_v)))
    x64 = [t.detach().double().requires_grad_() for t in (x_q, x_k, x_v)]
    expected = _merged_heads_reference(*x64)
    assert_close(got.detach(), expected.detach(), policy="fp32")
    if with_grad:
        got.sum().backward()
        expected.sum().backward()
        for leaf, reference in zip((x_q, x_k, x_v), x64):
            assert_close(leaf.grad, reference.grad, policy="fp32")


def test_dynamic_graph_of_merged_heads_declares_the_layout_each_backend_returns(monkeypatch):
    # With dynamic sizes the choice is made per call inside flashlite::attention_auto: merged heads through Inductor
    # against float64 whichever backend ran (the kernel writes the declared layout, SDPA's output is copied where it
    # differs; the layout itself is test_each_op_fake_declares_the_strides_its_kernel_returns's check).
    _made_up_table(monkeypatch)
    compiled = torch.compile(_merged_heads_block("auto"), fullgraph=True, backend="inductor", dynamic=True)
    backends = set()
    with torch.no_grad():
        for batch, seq in DYNAMIC_SIZES[:4]:
            x_q, x_k, x_v = (t.detach() for t in leaves(*[(batch, seq, 2, 16)] * 3, seed=batch + seq))
            assert_close(compiled(x_q, x_k, x_v), _merged_heads_reference(x_q, x_k, x_v), policy="fp32")
            q, k, v = (t.transpose(1, 2) for t in (x_q, x_k, x_v))
            backends.add(explain_dispatch(q, k, v, causal=True, precision="ieee").backend)
    assert backends == {"triton", "sdpa"}


@pytest.mark.parametrize("layout", ["contiguous", "heads of [B, S, H, D]"])
def test_each_op_fake_declares_the_strides_its_kernel_returns(layout, monkeypatch):
    # A compiled graph plans the memory after an opaque op from its fake: the strides declared must be the ones the
    # kernel returns. The kernel writes out laid out like q (so a layer's heads merge without a copy), and so must
    # the fakes declare it. attention_auto runs at two batch sizes that a made-up table sends to each backend.
    from torch._subclasses.fake_tensor import FakeTensorMode
    use_table(monkeypatch, {"float32/D16/causal/B3/S64": {"backend": "sdpa", "why": "made up"}})  # B=2: the rule's
    calls = {"attention_inference": lambda op, q: op(q, q, q, None, None, 1, 0.25, "ieee"),
             "attention_forward": lambda op, q: op(q, q, q, None, None, 1, 0.25, "ieee")[0],
             "attention_auto": lambda op, q: op(q, q, q, None, None, 1, None, "ieee", None, None, None)}
    backends = set()
    for batch in (2, 3):
        x = leaves((batch, 20, 3, 16), seed=batch)[0].detach()
        q = x.transpose(1, 2) if layout != "contiguous" else x.transpose(1, 2).contiguous()
        backends.add(explain_dispatch(q, q, q, causal=True, precision="ieee").backend)
        for name, call in calls.items():
            real = call(getattr(torch.ops.flashlite, name).default, q)
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                fake = call(getattr(torch.ops.flashlite, name).default, mode.from_tensor(q))
            assert fake.stride() == real.stride() == torch.empty_like(q).stride(), (name, batch)
    assert backends == {"triton", "sdpa"}  # attention_auto returned each backend's output
