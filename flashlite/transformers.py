"""flashlite as an attention implementation of Hugging Face transformers models.

Importing this module registers flashlite under the name ``"flite"`` in transformers' ``AttentionInterface`` (the
attention call) and ``AttentionMaskInterface`` (how the model builds the mask it hands over), so every model that
dispatches through ``AttentionInterface`` can run on it:

    >>> import flashlite.transformers                                # doctest: +SKIP
    >>> model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flite")   # doctest: +SKIP
    >>> model.set_attn_implementation("flite")                      # doctest: +SKIP

``register(name, backend=...)`` registers another name for a chosen flashlite backend. A name containing "flash"
is refused: transformers takes such a name for a flash-attention kernel to fetch from the hub, and
``set_attn_implementation`` then fails.

How a model's call is served (``explain_call`` answers it for one call):

- The mask. For plain causal, causal sliding-window and bidirectional layers the registered mask function hands
  over what flash-attention implementations get: nothing when no key is padded, else the 2-D padding mask
  ``[B, S_k]``, which becomes flashlite's ``key_padding_mask``; causality and the window are applied by the kernel
  (bottom-right aligned, so decoding and chunked prefill against the model's KV cache are exact).
- Static caches (``cache_implementation="static"``): the keys are the cache's fixed-size tensors, of which the
  first L positions hold tokens. The mask function hands over the 2-D mask of those L keys (``[B, L]``, L < S_k);
  the call attends to the first L keys only (a view, no copy), bottom-right aligned to them, with that padding.
  Under ``torch.compile`` (``generate`` compiles the decoding step for static caches on GPUs unless
  ``disable_compile=True``) the dense mask is built instead, so the graph does not change with L.
- Packed sequences (several documents in one row, told apart by position ids that restart, as
  ``DataCollatorWithFlattening`` produces; transformers detects them when there is no 2-D mask and no cache):
  the mask function hands over the integer document ids ``[B, S]`` and the call runs
  ``flashlite.attention_varlen``, each document attending only within itself. A call that receives
  ``cu_seq_lens_q/k`` and ``max_length_q/k`` (the flash-attention keyword arguments) with batch size 1 runs
  ``attention_varlen`` on them directly, as transformers' flash-attention implementations do.
- Any other mask (image-token overlays, chunked attention, block-wise masks) is built densely as for SDPA and
  passed as ``attn_mask``, which flashlite runs on SDPA: correct, not fast.
- ``scaling`` becomes ``scale``, ``softcap`` (attention-logit softcapping) ``softcap`` and ``sliding_window`` W
  (a query sees the W keys ending at itself) ``window=(W - 1, 0)``. Grouped-query heads are passed without copies.
- Attention dropout is refused with an error while it is non-zero (flashlite has none). A call with an argument
  flashlite does not implement (``position_bias``, attention sinks ``s_aux``, ``output_attentions``) runs on
  transformers' own SDPA implementation; ``explain_call`` names the argument.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

try:
    from transformers import AttentionInterface
    from transformers import masking_utils
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("flashlite.transformers needs Hugging Face transformers: pip install transformers") from error

from flashlite.attention import attention, attention_varlen, explain_dispatch

DEFAULT_NAME = "flite"
BACKENDS = ("auto", "triton", "sdpa")
# Keyword arguments a model may pass that flashlite does not implement: such calls run on transformers' SDPA
# implementation, which handles (or refuses) them as it does for every model.
UNSERVED_ARGUMENTS = ("position_bias", "s_aux", "sinks")
# The keyword arguments of transformers' flash-attention path for packed sequences.
VARLEN_ARGUMENTS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclasses.dataclass(frozen=True)
class Route:
    """How one attention call of a model is served.

    ``served_by`` is "flashlite" (``flashlite.attention``), "flashlite-varlen" (``flashlite.attention_varlen`` on
    the packed documents) or "transformers-sdpa"; ``arguments`` are the keyword arguments of the flashlite call
    (empty for SDPA); ``mask`` says what the model's mask became; ``key_length`` is the number of leading keys
    the call attends to when the cache holds fewer tokens than its size (a static cache), else None; ``reason``
    says why a call went to SDPA.
    """
    served_by: str
    mask: str
    arguments: dict
    key_length: Optional[int] = None
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class PackedDocuments:
    """The documents packed in a batch's rows, as ``attention_varlen`` takes them: ``cu_seqlens`` int32
    [documents + 1] offsets into the B * S flattened tokens, ``max_seqlen`` the longest document."""
    cu_seqlens: torch.Tensor
    max_seqlen: int


def _closure(function: Callable) -> dict:
    cells = getattr(function, "__closure__", None) or ()
    return dict(zip(function.__code__.co_freevars, (cell.cell_contents for cell in cells)))


def _and_parts(mask_function: Callable) -> Optional[tuple]:
    """The mask functions an ``and_masks(...)`` result combines, else None."""
    if getattr(mask_function, "__name__", "") != "and_mask":
        return None
    parts = _closure(mask_function).get("mask_functions")
    return parts if isinstance(parts, tuple) else None


def _plain_pattern(mask_function: Callable) -> Optional[str]:
    """"causal", "sliding" or "bidirectional" when the model's mask function is one of transformers' plain
    patterns, which the kernel applies itself; None for anything else (packing, overlays, chunked attention).

    Recognised by identity, and for the sliding window by the structure transformers builds it with
    (``and_masks(sliding_window_overlay(W), causal_mask_function)``); a version that builds it otherwise gets
    the dense mask, which is correct, only slower.
    """
    if mask_function is masking_utils.causal_mask_function:
        return "causal"
    if mask_function is masking_utils.bidirectional_mask_function:
        return "bidirectional"
    parts = _and_parts(mask_function)
    if parts is None or len(parts) != 2 or parts[1] is not masking_utils.causal_mask_function:
        return None
    overlay_code = masking_utils.sliding_window_overlay(1).__code__
    return "sliding" if getattr(parts[0], "__code__", None) is overlay_code else None


def _packed_documents_ids(mask_function: Callable) -> Optional[torch.Tensor]:
    """The document ids [B, S] when the mask is transformers' packed-sequence mask over a causal or sliding-window
    pattern (``and_masks(remap_positions_for_packed_sequence(plain, position_ids),
    packed_sequence_mask_function(ids))``), else None.

    Within a document the position ids rise by one per token (that is how transformers tells documents apart),
    so the plain pattern on the remapped positions is the same pattern on each document's own token indices.
    """
    parts = _and_parts(mask_function)
    if parts is None or len(parts) != 2:
        return None
    packed_code = masking_utils.packed_sequence_mask_function(None).__code__
    pattern, packed = parts
    if getattr(packed, "__code__", None) is not packed_code:
        return None
    # Newer transformers (5.2x) wrap the plain pattern in a position remap; 5.17 passes the plain pattern itself.
    # Both mean the same mask within a document: causal and window tests compare index differences, which the
    # remap (a shift per document) keeps.
    remap = getattr(masking_utils, "remap_positions_for_packed_sequence", None)
    if remap is not None and getattr(pattern, "__code__", None) is remap(masking_utils.causal_mask_function,
                                                                         None).__code__:
        pattern = _closure(pattern).get("mask_function")
    if _plain_pattern(pattern) not in ("causal", "sliding"):
        return None
    ids = _closure(packed).get("packed_sequence_mask")
    return ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None


def packed_documents(document_ids: torch.Tensor) -> PackedDocuments:
    """The packed documents of per-row document ids [B, S] (0, 0, 1, 1, 1, 2, ...: each row counts its own
    documents from 0), flattened row after row. Reads the longest document's length back to the host.

    Example:
        >>> packed_documents(torch.tensor([[0, 0, 1, 1, 1, 2]]))
        PackedDocuments(cu_seqlens=tensor([0, 2, 5, 6], dtype=torch.int32), max_seqlen=3)
    """
    if document_ids.dim() != 2 or document_ids.dtype.is_floating_point or document_ids.dtype == torch.bool:
        raise ValueError(f"document_ids: expected integer document ids [B, S], got {document_ids.dtype} "
                         f"{tuple(document_ids.shape)}")
    per_row = document_ids[:, -1] + 1
    first_of_row = torch.cumsum(per_row, 0) - per_row
    lengths = torch.bincount((document_ids + first_of_row[:, None]).flatten())
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=document_ids.device)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    return PackedDocuments(cu_seqlens, int(lengths.max()))


def flashlite_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function: Callable = masking_utils.causal_mask_function,
                   attention_mask: Optional[torch.Tensor] = None, **kwargs: Any) -> Optional[torch.Tensor]:
    """The mask a model hands to flashlite: for plain patterns nothing or the 2-D key padding (of the keys that
    hold tokens); for packed documents their integer ids [B, S]; else SDPA's dense mask.

    Example:
        >>> flashlite_mask(1, 4, 4, attention_mask=torch.ones(1, 4, dtype=torch.bool)) is None  # doctest: +SKIP
        True
    """
    pattern = _plain_pattern(mask_function)
    # Static caches give q_offset as a tensor so that a compiled decoding step (transformers compiles generate's
    # forward for static caches on GPUs) never reads it back: under torch.compile they keep the dense mask, whose
    # shapes do not change from step to step, where the filled length would recompile the graph at every step.
    if pattern is not None and not (isinstance(q_offset, torch.Tensor) and torch.compiler.is_compiling()):
        # Keys the cache holds tokens in: all of them, except in a static cache, whose tensors are longer than the
        # tokens seen (its positions fill from 0). q_offset is a tensor for static caches: one host read per mask.
        # (Bidirectional layers may attend to another sequence, an encoder's: all of its keys.)
        filled = kv_length if pattern == "bidirectional" else min(int(q_offset) + q_length - kv_offset, kv_length)
        if attention_mask is None:
            return None if filled == kv_length else torch.ones(batch_size, filled, dtype=torch.bool,
                                                               device=kwargs.get("device"))
        padding = attention_mask[:, -kv_length:].to(torch.bool)
        if padding.shape[1] == kv_length:
            # One host read per forward pass (not per layer), as transformers' flash-attention mask does.
            return None if bool(padding.all()) else padding
        return padding[:, :filled]
    document_ids = _packed_documents_ids(mask_function)
    if document_ids is not None and attention_mask is None and q_length == kv_length:
        # Computed once here and carried on a view of the ids (transformers' own tensor stays as it was), so that
        # no layer reads the offsets back again.
        handed_over = document_ids.view_as(document_ids)
        handed_over.flite_packed = packed_documents(document_ids)
        return handed_over
    return masking_utils.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                                   q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                                   attention_mask=attention_mask, **kwargs)


def _given_varlen(query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> Optional[PackedDocuments]:
    """The packed documents the flash-attention keyword arguments describe, when all four are given."""
    given = [kwargs.get(name) for name in VARLEN_ARGUMENTS]
    if all(value is None for value in given):
        return None
    if any(value is None for value in given):
        raise ValueError(f"{', '.join(VARLEN_ARGUMENTS)}: pass all four or none; got "
                         f"{[name for name, value in zip(VARLEN_ARGUMENTS, given) if value is not None]}")
    cu_q, cu_k, max_q, max_k = given
    if query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        raise ValueError(f"cu_seq_lens_q/k: packed documents need one row of queries and as many keys (no cache); "
                         f"got batch {query.shape[0]}, {query.shape[2]} queries, {key.shape[2]} keys")
    if cu_q is not cu_k and not torch.equal(cu_q, cu_k):
        raise ValueError("cu_seq_lens_q, cu_seq_lens_k: flashlite serves packed self-attention (equal offsets)")
    return PackedDocuments(cu_q.to(torch.int32), int(max(int(max_q), int(max_k))))


def _route(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask: Optional[torch.Tensor],
           dropout: float, scaling: Optional[float], is_causal: Optional[bool], backend: str,
           kwargs: dict) -> Route:
    """Translate a model's attention call into a flashlite call (or say why it cannot be)."""
    if dropout:
        raise ValueError(f"flashlite attention has no dropout: got dropout={dropout} (the model's attention dropout "
                         "in training mode); set the config's attention_dropout to 0.0, or use another "
                         "attn_implementation for training with attention dropout")
    for name in UNSERVED_ARGUMENTS:
        if kwargs.get(name) is not None:
            return Route("transformers-sdpa", "as given", {}, reason=f"flashlite does not implement {name!r}")
    if kwargs.get("output_attentions"):
        return Route("transformers-sdpa", "as given", {}, reason="flashlite does not return attention weights "
                     "(output_attentions=True)")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    arguments: dict = dict(scale=scaling, backend=backend)
    if kwargs.get("softcap") is not None:
        arguments["softcap"] = float(kwargs["softcap"])
    window = kwargs.get("sliding_window")
    s_q, s_k = query.shape[2], key.shape[2]
    packed = _given_varlen(query, key, kwargs)
    if attention_mask is not None and attention_mask.dim() == 2 and not attention_mask.dtype.is_floating_point \
            and attention_mask.dtype != torch.bool and packed is None:
        packed = getattr(attention_mask, "flite_packed", None) or packed_documents(attention_mask)
    if packed is not None:
        if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.dtype == torch.bool:
            raise ValueError("attention_mask: a padding mask together with packed documents (cu_seq_lens_q/k); "
                             "pack the documents without padding")
        # A 4-D mask given with the offsets describes the same documents (transformers' own packing detection
        # from position ids); the offsets serve them without it.
        arguments.update(causal=bool(causal), cu_seqlens=packed.cu_seqlens, max_seqlen=packed.max_seqlen)
        if window is not None and causal:
            arguments["window"] = (int(window) - 1, 0)
        return Route("flashlite-varlen", "packed documents (cu_seqlens)", arguments)
    if attention_mask is not None and attention_mask.dim() == 4:
        # A dense mask already holds causality and the window.
        arguments["attn_mask"] = attention_mask
        return Route("flashlite", "dense 4-D mask, run on SDPA inside flashlite", arguments)
    key_length = None
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[0] != query.shape[0] or attention_mask.shape[1] > s_k:
            raise ValueError(f"attention_mask: expected the 2-D key padding [B={query.shape[0]}, S_k<={s_k}] that "
                             f"flashlite's mask function hands over, or a 4-D mask; got {tuple(attention_mask.shape)}")
        if attention_mask.shape[1] < s_k:
            # A static cache: its first attention_mask.shape[1] positions hold the tokens seen.
            key_length = s_k = attention_mask.shape[1]
        arguments["key_padding_mask"] = attention_mask.to(torch.bool)
    # One query against the keys it follows sees all of them: no mask at all.
    if causal and s_q > 1:
        arguments["causal"] = "lower_right"
    if window is not None and causal and window < s_k:
        arguments["window"] = (int(window) - 1, 0)
    if key_length is not None:
        mask_note = f"static cache: the first {key_length} keys, with their padding"
    else:
        mask_note = "key padding [B, S_k]" if attention_mask is not None else "none"
    return Route("flashlite", mask_note, arguments, key_length=key_length)


def _run(route: Route, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The flashlite call of a route, returning [B, S_q, H, D] as transformers' implementations do."""
    if route.served_by == "flashlite-varlen":
        arguments = dict(route.arguments)
        cu_seqlens, max_seqlen = arguments.pop("cu_seqlens"), arguments.pop("max_seqlen")
        batch, heads, length, dim = query.shape
        flat = [t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value)]
        output = attention_varlen(*flat, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **arguments)
        return output.view(batch, length, heads, dim)
    if route.key_length is not None:
        key, value = key[:, :, :route.key_length], value[:, :, :route.key_length]
    return attention(query, key, value, **route.arguments).transpose(1, 2).contiguous()


def _make_forward(backend: str) -> Callable:
    def flashlite_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                    value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                                    dropout: float = 0.0, scaling: Optional[float] = None,
                                    is_causal: Optional[bool] = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        route = _route(module, query, key, attention_mask, dropout, scaling, is_causal, backend, kwargs)
        if route.served_by == "transformers-sdpa":
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, is_causal=is_causal, **kwargs)
        return _run(route, query, key, value), None

    flashlite_attention_forward.backend = backend
    return flashlite_attention_forward

def register(name: str = DEFAULT_NAME, backend: str = "auto") -> str:
    """Register flashlite in transformers under ``name``, running ``backend``; returns the name.

    Example:
        >>> register("flite_triton", backend="triton")               # doctest: +SKIP
        'flite_triton'
        >>> model.set_attn_implementation("flite_triton")            # doctest: +SKIP
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name: expected a non-empty identifier such as 'flite', got {name!r}")
    if "flash" in name.lower():
        raise ValueError(f"name: {name!r} contains 'flash', which transformers takes for a flash-attention kernel "
                         "to fetch from the hub (set_attn_implementation then fails); choose another, e.g. 'flite'")
    if name in ("eager", "sdpa", "flex_attention") or name.startswith("paged"):
        raise ValueError(f"name: {name!r} is one of transformers' own implementations; choose another")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    AttentionInterface.register(name, _make_forward(backend))
    masking_utils.AttentionMaskInterface.register(name, flashlite_mask)
    return name


def explain_call(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                 is_causal: Optional[bool] = None, backend: str = "auto", **kwargs: Any) -> tuple[Route, Any]:
    """How the registered function serves this call: its ``Route`` and flashlite's ``explain_dispatch`` decision
    (None when the call goes to transformers' SDPA or to ``attention_varlen``, which has no explain function).

    Example:
        >>> route, decision = explain_call(layer.self_attn, q, k, v, None)   # doctest: +SKIP
        >>> route.arguments["causal"], decision.reason                       # doctest: +SKIP
    """
    route = _route(module, query, key, attention_mask, dropout, scaling, is_causal, backend, kwargs)
    if route.served_by != "flashlite":
        return route, None
    if route.key_length is not None:
        key, value = key[:, :, :route.key_length], value[:, :, :route.key_length]
    return route, explain_dispatch(query, key, value, **route.arguments)

register()
