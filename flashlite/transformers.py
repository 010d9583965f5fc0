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
  (bottom-right aligned, so decoding and chunked prefill against the model's KV cache are exact). Any other mask
  (packed sequences, image-token overlays, chunked attention, a static cache longer than the tokens seen) is built
  densely as for SDPA and passed as ``attn_mask``, which flashlite runs on SDPA: correct, not fast.
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

from flashlite.attention import attention, explain_dispatch

DEFAULT_NAME = "flite"
BACKENDS = ("auto", "triton", "sdpa")
# Keyword arguments a model may pass that flashlite does not implement: such calls run on transformers' SDPA
# implementation, which handles (or refuses) them as it does for every model.
UNSERVED_ARGUMENTS = ("position_bias", "s_aux", "sinks")


@dataclasses.dataclass(frozen=True)
class Route:
    """How one attention call of a model is served.

    ``served_by`` is "flashlite" or "transformers-sdpa"; ``arguments`` are the keyword arguments of the
    ``flashlite.attention`` call (empty for SDPA); ``mask`` says what the model's mask became; ``reason`` says why
    a call went to SDPA.
    """
    served_by: str
    mask: str
    arguments: dict
    reason: str = ""


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
    closure = getattr(mask_function, "__closure__", None) or ()
    if getattr(mask_function, "__name__", "") != "and_mask" or len(closure) != 1:
        return None
    parts = closure[0].cell_contents
    if not isinstance(parts, tuple) or len(parts) != 2 or parts[1] is not masking_utils.causal_mask_function:
        return None
    overlay = parts[0]
    overlay_code = masking_utils.sliding_window_overlay(1).__code__
    return "sliding" if getattr(overlay, "__code__", None) is overlay_code else None


def flashlite_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function: Callable = masking_utils.causal_mask_function,
                   attention_mask: Optional[torch.Tensor] = None, **kwargs: Any) -> Optional[torch.Tensor]:
    """The mask a model hands to flashlite: the 2-D key padding (or nothing) for plain patterns, else SDPA's mask.

    Example:
        >>> flashlite_mask(1, 4, 4, attention_mask=torch.ones(1, 4, dtype=torch.bool)) is None  # doctest: +SKIP
        True
    """
    pattern = _plain_pattern(mask_function)
    if pattern is not None:
        if attention_mask is None:
            return None
        padding = attention_mask[:, -kv_length:]
        if padding.shape[1] == kv_length:
            # One host read per forward pass (not per layer), as transformers' flash-attention mask does.
            return None if bool(padding.all()) else padding
        # A static cache longer than the tokens seen: its unwritten tail needs the dense mask.
    return masking_utils.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                                   q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                                   attention_mask=attention_mask, **kwargs)


def _route(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask: Optional[torch.Tensor],
           dropout: float, scaling: Optional[float], is_causal: Optional[bool], backend: str,
           kwargs: dict) -> Route:
    """Translate a model's attention call into a ``flashlite.attention`` call (or say why it cannot be)."""
    if dropout:
        raise ValueError(f"flashlite attention has no dropout: got dropout={dropout} (the model's attention dropout "
                         "in training mode); set the config's attention_dropout to 0.0, or use another "
                         "attn_implementation for training with attention dropout")
    for name in UNSERVED_ARGUMENTS:
        if kwargs.get(name) is not None:
            return Route("transformers-sdpa", "as given", {}, f"flashlite does not implement {name!r}")
    if kwargs.get("output_attentions"):
        return Route("transformers-sdpa", "as given", {}, "flashlite does not return attention weights "
                     "(output_attentions=True)")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    arguments: dict = dict(scale=scaling, backend=backend)
    if kwargs.get("softcap") is not None:
        arguments["softcap"] = float(kwargs["softcap"])
    s_q, s_k = query.shape[2], key.shape[2]
    if attention_mask is not None and attention_mask.dim() == 4:
        # A dense mask already holds causality and the window.
        arguments["attn_mask"] = attention_mask
        return Route("flashlite", "dense 4-D mask, run on SDPA inside flashlite", arguments)
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape != (query.shape[0], s_k):
            raise ValueError(f"attention_mask: expected the 2-D key padding [B={query.shape[0]}, S_k={s_k}] that "
                             f"flashlite's mask function hands over, or a 4-D mask; got {tuple(attention_mask.shape)}")
        arguments["key_padding_mask"] = attention_mask.to(torch.bool)
    # One query against the keys it follows sees all of them: no mask at all.
    if causal and s_q > 1:
        arguments["causal"] = "lower_right"
    window = kwargs.get("sliding_window")
    if window is not None and causal and window < s_k:
        arguments["window"] = (int(window) - 1, 0)
    mask_note = "key padding [B, S_k]" if attention_mask is not None else "none"
    return Route("flashlite", mask_note, arguments)


def _make_forward(backend: str) -> Callable:
    def flashlite_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                    value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                                    dropout: float = 0.0, scaling: Optional[float] = None,
                                    is_causal: Optional[bool] = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        route = _route(module, query, key, attention_mask, dropout, scaling, is_causal, backend, kwargs)
        if route.served_by != "flashlite":
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, is_causal=is_causal, **kwargs)
        output = attention(query, key, value, **route.arguments)
        # transformers' implementations return [B, S_q, H, D].
        return output.transpose(1, 2).contiguous(), None

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
    (None when the call goes to transformers' SDPA).

    Example:
        >>> route, decision = explain_call(layer.self_attn, q, k, v, None)   # doctest: +SKIP
        >>> route.arguments["causal"], decision.reason                       # doctest: +SKIP
    """
    route = _route(module, query, key, attention_mask, dropout, scaling, is_causal, backend, kwargs)
    if route.served_by != "flashlite":
        return route, None
    return route, explain_dispatch(query, key, value, **route.arguments)


register()
