"""@triton.jit kernels and their launch configurations. No torch.library here."""
