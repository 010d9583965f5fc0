"""flashlite's attention, host side: one path per call, one job per module; ``flashlite.attention`` is its public face.

(Named ``attn`` because ``flashlite.attention`` is the public function: a package of that name would be shadowed by
it, or would shadow it.) Modules, each importing only those listed before it:

* ``problem``: the one validator. ``validate`` (dense calls), ``validate_varlen`` (packed sequences) and the
  KV-cache argument checks turn a call into a frozen ``Problem``; ``kernel_unsupported`` says why the Triton kernel
  cannot run one; the constants (causal modes, head-dim range, precisions, backends);
* ``plan``: the plan cache, one ``Plan`` per call signature (its problem, decision, configs and recorded launches),
  for every entry; its one key builder ``key_of`` (with ``attention_key`` and ``any_length_key``, the latter without
  the key length so that a decoding loop finds its plan, packed in C++ where they can be) and ``replay``;
* ``sdpa``: the SDPA backend: its masks and its agreement with the kernel;
* ``gluon``: the Gluon forward backend on Hopper: what it supports, where a Triton plan's forward runs on it
  (``forward_kernel_for``, the measured rule) and its launch; ``gluon_bwd``: the Gluon dK/dV and dQ kernels, where the
  backward runs on them (``backward_on_gluon``) and their launches;
* ``triton``: the Triton (pointer kernel) backend's launch machinery (grids, configs, recording and replay) and the
  forward (split-KV and its merge; the Gluon forward where the plan chose it), and the public launcher
  ``attention_forward``; ``triton_bwd``: the backward launches and ``attention_backward``;
* ``run``: how a Triton plan runs a call: ``run_triton`` (eager, the autograd Function around the launches) and
  ``run_triton_compiled`` (the custom op a compiled graph keeps);
* ``decide``: the backend decision and its logging, ``make_plan`` (problem -> decision -> plan),
  ``traced_call_plan`` (a compiled call's plan, made outside dynamo's trace) and ``op_plan`` (the plan a custom op's
  call runs: that of the eager call it stands for, found or made in the one cache);
* ``ops``: the torch.library ops of ``attention()`` (``flashlite::attention_forward`` / ``attention_backward`` /
  ``attention_inference``), fakes and autograd;
* ``api``: ``attention()`` and ``explain_dispatch()``: replay a kept plan, or make and keep one, then run it;
* ``varlen``: ``attention_varlen()``, packed variable-length sequences, and its ops; its plans live in ``plan``'s cache
  under the "varlen" entry (the offsets' values and the token counts are data of each call);
* ``kvcache_writes`` (imports nothing from the package): what writing new tokens into a KV cache needs;
* ``kvcache``: ``attention_with_kvcache()``, decoding against a contiguous or paged cache, and its op. Its plans
  live in ``plan``'s cache under the "kvcache" entry (no lengths in it); it launches the decoding kernel (replayed by a
  recording plan) or ``triton.launch_forward`` with the plan's problem.

Each module-level setting (``_GRID_AXIS1_LIMIT`` in ``triton``; ``_PLANS`` and ``MAX_PLANS``
in ``plan``; ``GLUON_MIN_ROWS`` and ``GLUON_ENABLED`` in ``gluon``) lives in the one module that reads it: patch it
there.
"""
