"""flashlite's attention, host side, one job per module; ``flashlite.attention`` is its public face.

Modules, each importing only those above it:

* ``validation``: validate a call into a ``Problem``; why the Triton kernel cannot run one; the constants;
* ``plans``: the plan cache, one ``Plan`` per call signature (its problem, decision, configs and recorded launches);
* ``launch_gluon`` (imports ``validation`` only): the Gluon forward on Hopper, what it supports, where a Triton
  plan's forward runs on it (``forward_kernel_for``, the measured rule) and its launch;
* ``launch``: launching a plan's kernels (grids, configs, recording and replay; split-KV and its merge; the Gluon
  forward where the plan chose it), and the public launchers ``attention_forward`` / ``attention_backward``;
* ``ops``: the custom ops ``flashlite::attention_forward`` / ``attention_backward``, fakes, autograd, and
  ``run_triton``, how a Triton plan runs a call;
* ``sdpa`` (imports ``validation`` only): the SDPA path, its masks and its agreement with the kernel;
* ``decide``: the backend decision and its logging, ``make_plan``, and ``traced_call_plan`` (a compiled call's
  plan, made outside dynamo's trace);
* ``api``: ``attention()`` and ``explain_dispatch()``;
* ``varlen``: ``attention_varlen()``, packed variable-length sequences, and its custom ops;
* ``kvcache_writes`` (imports nothing from the package): what writing new tokens into a KV cache needs (caches
  that do not overlap in memory, block tables whose written blocks are not shared);
* ``kvcache``: ``attention_with_kvcache()``, decoding against a contiguous or paged cache, and its custom op.

Each module-level setting (``_GRID_AXIS1_LIMIT`` in ``launch``; ``_PLANS``, ``MAX_PLANS`` and ``RECORD_LAUNCHES``
in ``plans``; ``GLUON_MIN_ROWS`` and ``GLUON_ENABLED`` in ``launch_gluon``) lives in the one module that reads it:
patch it there.
"""
