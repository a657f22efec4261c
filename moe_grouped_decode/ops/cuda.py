"""CUDA implementations of the ops, launching the Triton kernels in ``..kernels``."""
