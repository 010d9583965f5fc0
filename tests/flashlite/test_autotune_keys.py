"""The autotuned kernels' keys name only their own arguments.

Triton 3.7 and later refuse, when the autotuner is built, a key name that is not an argument of the kernel; Triton
3.6 skipped such a name. A wrong name would make flashlite fail at import on a newer Triton, so the keys are checked
against the kernels' own argument lists, whichever Triton runs the tests.
"""
from __future__ import annotations

import pytest
import triton

from flashlite.kernels import attention_bwd, attention_fwd


@pytest.mark.parametrize("name, kernel", [("attn_fwd", attention_fwd.attn_fwd),
                                          ("attn_bwd_dkdv", attention_bwd.attn_bwd_dkdv),
                                          ("attn_bwd_dq", attention_bwd.attn_bwd_dq)])
def test_every_autotune_key_is_an_argument_of_its_kernel(name, kernel):
    assert isinstance(kernel, triton.runtime.Autotuner), name
    arguments = set(kernel.arg_names)  # the wrapped kernel's parameters, as the autotuner binds them
    assert set(kernel.keys) <= arguments, f"{name}: key names that are not arguments: {set(kernel.keys) - arguments}"
    # The size buckets and variant flags that decide the configs are all in each key (tuning.AUTOTUNE_KEY says why).
    assert {"SEQ_Q_BUCKET", "SEQ_K_BUCKET", "BATCH_HEADS_BUCKET", "HEAD_DIM", "CAUSAL", "WINDOW"} <= set(kernel.keys)
