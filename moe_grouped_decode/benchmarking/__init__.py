"""What the benchmarks share and the op does not run: the CUDA-graph replay timer (also the
opt-in autotune's clock), the read-floor kernels, the host side of the timeline's stamps,
and the ``bench`` command (``python -m moe_grouped_decode bench``).

Imports nothing at package level, so ``ops.autotune`` can take the timer without the rest.
"""
