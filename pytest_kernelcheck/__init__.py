"""pytest-kernelcheck: correctness and speed assertions for GPU kernels."""
