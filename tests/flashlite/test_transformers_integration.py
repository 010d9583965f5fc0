"""flashlite inside Hugging Face transformers models, against each model's own eager attention.

Tiny random-weight models from configs (no downloads), float32 on the CPU: logits, greedy generation and gradients
must match the model's eager implementation, on padded batches, with sliding windows and logit softcapping.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashlite.transformers as flite  # noqa: E402  (registers "flite")
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, MistralConfig  # noqa: E402

VOCAB = 101


def llama_config(**extra):
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                       **extra)


def mistral_config():
    # A window shorter than the prompt, so the window hides keys in prefill and in generation.
    return MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                         sliding_window=7)


def gemma2_config():
    # Softcap small enough that tanh bends the scores of these random weights (a large cap would be the identity).
    return Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                        sliding_window=6, attn_logit_softcapping=0.5, final_logit_softcapping=None,
                        query_pre_attn_scalar=24)


CONFIGS = {"llama": llama_config, "mistral": mistral_config, "gemma2": gemma2_config}


def twin_models(make_config, implementation="flite", seed=0):
    """The same random weights under eager attention and under ``implementation``."""
    torch.manual_seed(seed)
    eager = AutoModelForCausalLM.from_config(make_config(), attn_implementation="eager").eval()
    other = AutoModelForCausalLM.from_config(make_config(), attn_implementation=implementation).eval()
    other.load_state_dict(eager.state_dict())
    return eager, other


def left_padded_batch(lengths, total, seed=1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), total), generator=generator)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, total - length:] = 1
    return ids, mask


@pytest.fixture
def spy(monkeypatch):
    """Records the keyword arguments of every flashlite.attention call the integration makes, with the number of
    keys it attends to under "keys" and of queries under "queries"."""
    calls = []
    real = flite.attention

    def recording(q, k, v, **arguments):
        calls.append({**arguments, "keys": k.shape[2], "queries": q.shape[2]})
        return real(q, k, v, **arguments)

    monkeypatch.setattr(flite, "attention", recording)
    return calls


@pytest.fixture
def varlen_spy(monkeypatch):
    """Records the offsets of every flashlite.attention_varlen call the integration makes."""
    calls = []
    real = flite.attention_varlen

    def recording(q, k, v, cu_q, cu_k, max_q, max_k, **arguments):
        calls.append({**arguments, "cu_seqlens": cu_q.tolist(), "max_seqlen": max_q})
        return real(q, k, v, cu_q, cu_k, max_q, max_k, **arguments)

    monkeypatch.setattr(flite, "attention_varlen", recording)
    return calls


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_padded_prefill_logits_match_eager(family, spy):
    eager, fl = twin_models(CONFIGS[family])
    ids, mask = left_padded_batch([13, 9, 5], 13)
    with torch.no_grad():
        expected = eager(ids, attention_mask=mask).logits
        actual = fl(ids, attention_mask=mask).logits
    real = mask.bool()  # padded query positions hold no token: nothing reads their output
    torch.testing.assert_close(actual[real], expected[real], rtol=2e-5, atol=2e-5)
    assert spy and all(call.get("key_padding_mask") is not None for call in spy), "padding must reach the kernel"
    assert all("attn_mask" not in call for call in spy)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_unpadded_prefill_runs_without_a_mask(family, spy):
    eager, fl = twin_models(CONFIGS[family])
    ids = torch.randint(1, VOCAB, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(fl(ids).logits, eager(ids).logits, rtol=2e-5, atol=2e-5)
    assert all(call.get("causal") == "lower_right" and "key_padding_mask" not in call for call in spy)
    if family != "llama":
        assert any(call.get("window") is not None for call in spy), "the sliding window must reach the kernel"


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_greedy_generation_gives_eager_tokens(family, spy):
    eager, fl = twin_models(CONFIGS[family])
    ids, mask = left_padded_batch([10, 6], 10, seed=3)
    settings = dict(attention_mask=mask, max_new_tokens=64, do_sample=False, pad_token_id=0)
    assert torch.equal(fl.generate(ids, **settings), eager.generate(ids, **settings))
    # The left padding reaches the kernel as key padding, decoding steps included (one query against the cache);
    # a sliding-window layer's cache drops the padded positions once they fall out of the window (Mistral's window
    # of 7 has left them behind at the first decoding step), and its calls then need none.
    decoding = [call for call in spy if call["queries"] == 1]
    assert len(decoding) >= 63 * fl.config.num_hidden_layers and all("attn_mask" not in call for call in spy)
    assert all(call.get("key_padding_mask") is not None for call in spy if call["queries"] > 1)
    if family == "llama":
        assert all(call.get("key_padding_mask") is not None for call in decoding)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_training_gradients_match_eager(family):
    eager, fl = twin_models(CONFIGS[family])
    eager.train(), fl.train()
    ids, mask = left_padded_batch([12, 8], 12, seed=5)
    # The loss predicts token t from position t - 1; a padded position holds no token, and what attention returns
    # there differs between implementations (eager averages every key, SDPA and flashlite return zeros), so the
    # first real token of each row, predicted from padding, is left out of the loss.
    first_real = mask.cumsum(1) == 1
    labels = ids.masked_fill((mask == 0) | first_real, -100)
    eager(ids, attention_mask=mask, labels=labels).loss.backward()
    fl(ids, attention_mask=mask, labels=labels).loss.backward()
    for (name, p_e), (_, p_f) in zip(eager.named_parameters(), fl.named_parameters()):
        torch.testing.assert_close(p_f.grad, p_e.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton kernel on CPU tensors runs only in the interpreter; "
                    "on a GPU the bf16 test below runs it")
def test_triton_backend_in_a_model_matches_eager(spy):
    name = flite.register("flite_triton_test", backend="triton")
    eager, fl = twin_models(llama_config, implementation=name)
    ids, mask = left_padded_batch([9, 5], 9, seed=7)
    with torch.no_grad():
        expected = eager(ids, attention_mask=mask).logits
        actual = fl(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(actual[real], expected[real], rtol=1e-4, atol=1e-4)
    assert spy and all(call["backend"] == "triton" for call in spy)


def test_set_attn_implementation_switches_to_and_from_flite(spy):
    eager, fl = twin_models(llama_config, implementation="sdpa")
    fl.set_attn_implementation("flite")
    assert fl.config._attn_implementation == "flite"
    ids = torch.randint(1, VOCAB, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(fl(ids).logits, eager(ids).logits, rtol=2e-5, atol=2e-5)
    assert spy
    fl.set_attn_implementation("sdpa")
    spy.clear()
    with torch.no_grad():
        fl(ids)
    assert not spy


def packed_documents_batch(lengths_per_row, seed=13):
    """Token ids [B, S] with several documents per row, their position ids (restarting at 0 in each document)
    and the documents themselves, row after row."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths_per_row[0])
    assert all(sum(row) == total for row in lengths_per_row)
    ids = torch.randint(1, VOCAB, (len(lengths_per_row), total), generator=generator)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths_per_row])
    documents = [piece for r, row in enumerate(lengths_per_row) for piece in ids[r].split(row)]
    return ids, positions, documents


# Documents longer than the Mistral and Gemma-2 windows (7 and 6), so the window acts inside a document.
PACKED_ROWS = [[5, 11, 1, 4], [13, 8]]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_packed_documents_run_varlen_and_match_each_document_alone(family, spy, varlen_spy):
    eager, fl = twin_models(CONFIGS[family])
    ids, positions, documents = packed_documents_batch(PACKED_ROWS)
    with torch.no_grad():
        actual = fl(ids, position_ids=positions, use_cache=False).logits
        expected = torch.cat([eager(doc[None]).logits[0] for doc in documents])
    torch.testing.assert_close(actual.flatten(0, 1), expected, rtol=2e-5, atol=2e-5)
    assert not spy, "packed documents must not reach flashlite.attention (one sequence per row)"
    assert varlen_spy and all(call["cu_seqlens"] == [0, 5, 16, 17, 21, 34, 42] and call["max_seqlen"] == 13
                              for call in varlen_spy)
    if family != "llama":
        assert any(call.get("window") is not None for call in varlen_spy)


def test_flash_attention_offsets_run_varlen_with_a_cache_too(varlen_spy):
    # DataCollatorWithFlattening(return_flash_attn_kwargs=True) hands the offsets over as keyword arguments; they
    # are honoured as transformers' flash-attention implementations honour them, even where the model made a cache
    # (eval mode, use_cache on by default), where transformers itself does not look for packing.
    eager, fl = twin_models(mistral_config)
    ids, positions, documents = packed_documents_batch([[6, 9, 3]], seed=17)
    offsets = torch.tensor([0, 6, 15, 18], dtype=torch.int32)
    with torch.no_grad():
        actual = fl(ids, position_ids=positions, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=9,
                    max_length_k=9).logits
        expected = torch.cat([eager(doc[None]).logits[0] for doc in documents])
    torch.testing.assert_close(actual[0], expected, rtol=2e-5, atol=2e-5)
    assert varlen_spy and all(call["cu_seqlens"] == [0, 6, 15, 18] for call in varlen_spy)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_packed_training_gradients_match_eager(family, spy, varlen_spy):
    eager, fl = twin_models(CONFIGS[family])
    eager.train(), fl.train()
    ids, positions, _ = packed_documents_batch(PACKED_ROWS, seed=19)
    eager(ids, position_ids=positions, labels=ids, use_cache=False).loss.backward()
    fl(ids, position_ids=positions, labels=ids, use_cache=False).loss.backward()
    assert varlen_spy and not spy
    for (name, p_e), (_, p_f) in zip(eager.named_parameters(), fl.named_parameters()):
        torch.testing.assert_close(p_f.grad, p_e.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_packed_documents_offsets_count_each_rows_documents():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1]])
    packed = flite.packed_documents(ids)
    assert packed.cu_seqlens.tolist() == [0, 2, 5, 6, 10, 12] and packed.max_seqlen == 4
    assert packed.cu_seqlens.dtype == torch.int32
    with pytest.raises(ValueError, match="document_ids: expected integer"):
        flite.packed_documents(ids.bool())


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_static_cache_generation_gives_eager_tokens_without_a_dense_mask(family, spy):
    eager, fl = twin_models(CONFIGS[family])
    ids, mask = left_padded_batch([10, 6], 10, seed=23)
    settings = dict(attention_mask=mask, max_new_tokens=64, do_sample=False, pad_token_id=0)
    expected = eager.generate(ids, **settings)
    actual = fl.generate(ids, cache_implementation="static", **settings)
    assert torch.equal(actual, expected)
    assert spy and all("attn_mask" not in call for call in spy), "a static cache must not build a dense mask"
    # The static cache's tensors hold 10 + 64 positions; each call attends only to those filled so far.
    assert max(call["keys"] for call in spy) <= 73 and min(call["keys"] for call in spy) <= 11


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_chunked_prefill_against_the_cache_matches_one_pass(family, cache_kind, spy):
    from transformers import DynamicCache, StaticCache

    eager, fl = twin_models(CONFIGS[family])
    ids = torch.randint(1, VOCAB, (2, 23))
    config = fl.config
    cache = StaticCache(config=config, max_cache_len=40) if cache_kind == "static" else DynamicCache(config=config)
    with torch.no_grad():
        expected = eager(ids, use_cache=False).logits
        pieces = [fl(chunk, past_key_values=cache, use_cache=True).logits for chunk in ids.split([9, 5, 8, 1], 1)]
    torch.testing.assert_close(torch.cat(pieces, 1), expected, rtol=2e-5, atol=2e-5)
    assert spy and all("attn_mask" not in call for call in spy)
    assert all(call.get("causal") == "lower_right" for call in spy if call["queries"] > 1)


def test_attention_dropout_in_training_is_refused():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(attention_dropout=0.1), attn_implementation="flite")
    model.train()
    with pytest.raises(ValueError, match="dropout=0.1"):
        model(torch.randint(1, VOCAB, (1, 6)))
    model.eval()  # the model passes dropout 0 in eval mode
    model(torch.randint(1, VOCAB, (1, 6)))


@pytest.mark.parametrize("name, message", [("flashlite", "contains 'flash'"), ("my-attn", "identifier"),
                                           ("sdpa", "transformers' own"), ("", "identifier")])
def test_register_refuses_names_transformers_would_misread(name, message):
    with pytest.raises(ValueError, match=message):
        flite.register(name)


def test_register_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match="backend: expected one of"):
        flite.register("flite_bad", backend="cuda")


def test_explain_call_names_the_route_and_the_reason_for_sdpa():
    q = torch.randn(2, 4, 5, 16)
    k = v = torch.randn(2, 2, 5, 16)
    module = torch.nn.Module()
    route, decision = flite.explain_call(module, q, k, v, torch.ones(2, 5, dtype=torch.bool), scaling=0.25)
    assert route.served_by == "flashlite" and route.mask == "key padding [B, S_k]"
    assert route.arguments["causal"] == "lower_right" and decision.backend in ("sdpa", "triton")
    route, decision = flite.explain_call(module, q, k, v, None, position_bias=torch.zeros(1, 4, 5, 5))
    assert route.served_by == "transformers-sdpa" and "position_bias" in route.reason and decision is None
    # A static cache of 5 positions holding 3 tokens: the first 3 keys, bottom-right aligned to them.
    route, decision = flite.explain_call(module, q[:, :, :2], k, v, torch.ones(2, 3, dtype=torch.bool))
    assert route.key_length == 3 and route.mask.startswith("static cache") and decision is not None
    route, decision = flite.explain_call(module, q, k, v, torch.tensor([[0, 0, 1, 1, 1]] * 2))
    assert route.served_by == "flashlite-varlen" and route.arguments["max_seqlen"] == 3 and decision is None


def test_a_mask_of_the_wrong_shape_is_refused_by_name():
    q = torch.randn(2, 4, 5, 16)
    k = v = torch.randn(2, 2, 5, 16)
    with pytest.raises(ValueError, match="attention_mask: expected the 2-D key padding"):
        flite.explain_call(torch.nn.Module(), q, k, v, torch.ones(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention_mask: expected the 2-D key padding"):
        flite.explain_call(torch.nn.Module(), q, k, v, torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="pass all four or none"):
        flite.explain_call(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=torch.tensor([0, 5]))


def gpu_config(family):
    """Small models that still exercise the kernels as real ones do: head dims 64 (Llama, Mistral) and 128
    (Gemma-2), GQA, a 64-token window under prompts of 200, a softcap that bends these weights' scores."""
    common = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=64)
    return Gemma2Config(**{**common, "head_dim": 128}, sliding_window=64, attn_logit_softcapping=1.0,
                        final_logit_softcapping=None, query_pre_attn_scalar=128)


def gpu_models(family, backend):
    """The float32 eager reference, flashlite in bf16 on ``backend`` and the model's own bf16 implementation (SDPA;
    eager for Gemma-2, whose softcap SDPA refuses), same weights, on the GPU."""
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(gpu_config(family), attn_implementation="eager").cuda().eval()
    name = flite.register(f"flite_{backend}_gpu", backend=backend)
    own = "eager" if family == "gemma2" else "sdpa"
    bf16 = {}
    for implementation in (name, own):
        model = AutoModelForCausalLM.from_config(gpu_config(family), attn_implementation=implementation)
        model.load_state_dict(reference.state_dict())
        bf16[implementation] = model.to("cuda", torch.bfloat16).eval()
    return reference, bf16[name], bf16[own]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernels in a model need a CUDA GPU")
@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_bf16_model_on_the_gpu_is_as_close_to_float32_as_its_own_baseline(family, backend):
    """The model in bf16 on flashlite against the same weights in float32 eager attention, judged by the error of
    the model's own bf16 implementation: a left-padded batch (key padding) and packed documents (varlen)."""
    from pytest_kernelcheck import assert_close

    reference, fl, own = gpu_models(family, backend)
    ids, mask = left_padded_batch([200, 150, 77], 200, seed=11)
    ids, mask = ids.cuda(), mask.cuda()
    real = mask.bool()
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask).logits[real]
        actual = fl(ids, attention_mask=mask).logits[real]
        baseline = own(ids, attention_mask=mask).logits[real]
    assert_close(actual, expected, baseline=baseline)
    packed, positions, _ = packed_documents_batch([[90, 13, 120, 77]], seed=29)
    packed, positions = packed.cuda(), positions.cuda()
    with torch.no_grad():
        expected = reference(packed, position_ids=positions, use_cache=False).logits
        actual = fl(packed, position_ids=positions, use_cache=False).logits
        baseline = own(packed, position_ids=positions, use_cache=False).logits
    assert_close(actual, expected, baseline=baseline)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernels in a model need a CUDA GPU")
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_bf16_greedy_tokens_on_the_gpu_are_float32_choices(family, cache):
    """bf16 greedy tokens are not the float32 model's bit for bit (a near-tie goes either way), so each of flashlite's
    64 tokens must be one the float32 eager model ranks within bf16 noise of its best: its float32 logit (teacher
    forced on flashlite's sequence) at most 4 times the own bf16 implementation's largest logit error below the
    float32 maximum. The own bf16 implementation's tokens are held to the same rule, so the rule is not vacuous."""
    reference, fl, own = gpu_models(family, "auto")
    ids, mask = left_padded_batch([40, 25], 40, seed=31)
    ids, mask = ids.cuda(), mask.cuda()
    settings = dict(attention_mask=mask, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0,
                    cache_implementation=None if cache == "dynamic" else "static", disable_compile=True)
    with torch.no_grad():
        own_error = (own(ids, attention_mask=mask).logits.float()
                     - reference(ids, attention_mask=mask).logits)[mask.bool()].abs().max().item()
        for model in (fl, own):
            generated = model.generate(ids, **settings)
            full_mask = torch.cat([mask, torch.ones_like(generated[:, 40:])], 1)
            logits = reference(generated, attention_mask=full_mask).logits[:, 39:-1]
            chosen = logits.gather(-1, generated[:, 40:, None])[..., 0]
            shortfall = (logits.max(-1).values - chosen).max().item()
            assert shortfall <= 4 * own_error + 1e-6, (
                f"{model.config._attn_implementation}: a generated token's float32 logit is {shortfall:.3g} below the "
                f"best, more than 4x the own bf16 logit error {own_error:.3g}")
