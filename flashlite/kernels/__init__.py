"""Raw Triton kernels of flashlite, with their autotuning configurations and pruning.

* ``attention_common``: ``@triton.jit`` helpers shared by the attention kernels (tile loads, dot products in each
  precision mode, casts, program ids, the key range of a query block) and the conventions of their parameters;
* ``attention_fwd``: the forward attention kernel, its config lists and pruning;
* ``attention_bwd``: the backward attention kernels (delta, dK/dV, dQ), their config lists and pruning;
* ``attention_fwd_gluon``: the Hopper (sm_90) attention forward in Gluon (TMA, mbarrier ring, async wgmma; one
  partition, a warp-specialized TMA producer, or a producer and two consumer warpgroups in ping-pong) and its
  configs;
* ``tuning``: config construction, shared-memory estimate and pruning, the autotuning key and its size buckets;
* ``layer_norm``: LayerNorm (optionally with a residual add) and bias + exact GELU kernels.

These modules import only Triton, each other and the leaf helpers ``flashlite._runtime``, ``flashlite._intmath``
and ``flashlite._triton_version`` (importing this package warns once under a Triton outside the tested range).
Nothing here checks its inputs: the launchers in ``flashlite.attention`` and ``flashlite.norm`` validate shapes,
dtypes and devices, allocate outputs and compute the grid. Import
``flashlite`` (which imports ``flashlite._runtime``) before these modules so that Triton's interpreter switch is
set on CPU-only machines.
"""
from flashlite._triton_version import warn_if_untested

warn_if_untested()
