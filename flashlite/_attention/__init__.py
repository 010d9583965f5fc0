"""flashlite's attention, host side, one job per module; ``flashlite.attention`` is its public face.

Modules, each importing only those above it:

* ``validation``: validate a call into the ``_Call`` record; why the Triton kernel cannot run one; the constants;
* ``launch``: the launchers ``attention_forward`` / ``attention_backward``, tuned configs and the launch cache;
* ``ops``: the custom ops ``flashlite::attention_forward`` / ``attention_backward``, fakes, autograd, and the
  eager Triton path ``_triton_attention``;
* ``sdpa`` (imports ``validation`` only): the SDPA path, its masks and its agreement with the kernel;
* ``plans``: the backend decision and its logging, and ``_TritonPlan``, the replay of a decided Triton call;
* ``api``: ``attention()`` and ``explain_dispatch()``, and ``_PLANS``, the decided calls ``attention()`` replays.

Each module-level setting (``_GRID_AXIS1_LIMIT``, ``_TUNED_CONFIGS``, ``_USE_LAUNCH_CACHE``, ``_LAUNCHES`` in
``launch``; ``_PLANS`` in ``api``) lives in the one module that reads it: patch it there.
"""
