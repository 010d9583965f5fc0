"""flashlite's attention: the public ``attention()``, its dispatch, launchers and torch.library ops.

This module re-exports the public names; the code lives in ``flashlite.attn``, one job per module (its
docstring lists them).

Layers, bottom up:

* kernels (``flashlite.kernels.attention_fwd`` / ``attention_bwd``): raw Triton code;
* launchers ``attention_forward`` / ``attention_backward``: check what the kernels assume, allocate, compute
  the grid, launch (autotuned, or with a forced config for tests);
* custom ops ``flashlite::attention_forward`` -> (out, lse) and ``flashlite::attention_backward`` ->
  (dq, dk, dv), with fake implementations, and autograd registered on the forward op, so ``torch.compile``
  treats the kernel as one opaque node instead of tracing into it;
* ``attention()``: validates the call, picks Triton or SDPA (``backend="auto"`` asks ``flashlite.dispatch``)
  and makes both paths agree, including zeros for rows that see no key.

Precision: float16/bfloat16 inputs multiply in their own precision. Float32 inputs take ``precision``:
"tf32" (the default: tensor cores, relative error near 3e-4), "ieee" (true float32, several times slower)
or "bf16" (operands rounded to bfloat16). Accumulation and softmax are always float32. ``precision`` shapes the
Triton kernel only; the SDPA path computes float32 in SDPA's own way.

The log-sum-exp saved for the backward pass is in base 2 of the scaled scores (natural lse * log2(e)), float32,
shape [B, H, S_q]; -inf for rows that see no key.
"""
from flashlite.attn.api import attention, explain_dispatch
from flashlite.attn.triton import attention_forward
from flashlite.attn.triton_bwd import attention_backward
from flashlite.attn.problem import CAUSAL_MODES
from flashlite.attn.kvcache import attention_with_kvcache
from flashlite.attn.varlen import attention_varlen

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "explain_dispatch", "attention_forward",
           "attention_backward", "CAUSAL_MODES"]
