"""Raw Triton kernels of flashlite and their autotuning configurations.

Nothing here checks its inputs: the launchers in ``flashlite.attention`` (and the other op modules) validate
shapes, dtypes and devices, allocate outputs and compute the grid. Import ``flashlite`` (which imports
``flashlite._runtime``) before these modules so that Triton's interpreter switch is set on CPU-only machines.
"""
