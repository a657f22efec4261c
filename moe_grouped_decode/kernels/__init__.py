"""@triton.jit kernels and their launch configurations. No torch.library here."""

# The grouped kernels multiply on tensor cores with mma.sync m16n8k16 (awq_mma.py): Ampere and newer.
MIN_CUDA_CAPABILITY = (8, 0)
