"""moe_grouped_decode: compact active-expert grouped decode for AWQ int4 MoE in vLLM.

Importing the package registers the custom ops (``torch.ops.moe_grouped_decode.*``).
It never imports vllm; only ``moe_grouped_decode.compile_plugin`` does.
"""

__version__ = "0.1.0"

from . import ops  # noqa: E402,F401  (registers the torch.library ops)
