"""torch.library custom ops (schemas, fake kernels, CPU implementations), references, workspace.

Importing this package registers ``torch.ops.moe_grouped_decode.awq_moe_dense``,
``.awq_moe_grouped_decode``, ``.awq_moe_routed`` (route chosen from M at run time) and
``.awq_marlin_grouped_decode`` and ``.awq_humming_grouped_decode`` (the grouped decode over vLLM's
Marlin or Humming tensors, for co-serving).
"""

from .cuda import (awq_moe_dense_cuda, awq_moe_grouped_decode_cuda, grouped_plan_for, ids_flag,  # registers the
                   launch_grouped, launch_prefill, prefill_plan_for, raise_on_flagged_ids, warmup)  # CUDA implementations
from .awq_moe import awq_moe_dense, awq_moe_grouped_decode, check_moe_args, compact_rows
from .routed import awq_moe_routed
from .marlin import awq_marlin_grouped_decode, awq_marlin_grouped_decode_cuda
from .humming import awq_humming_grouped_decode, awq_humming_grouped_decode_cuda
from .expert_parallel import local_expert_ids
from .reference import ErrorStats, Segments, error_stats, reference_moe, reference_segments
from .workspace import WorkspaceLayout, alloc_workspace, workspace_numel, workspace_views

__all__ = [
    "awq_moe_dense",
    "awq_moe_grouped_decode",
    "awq_moe_routed",
    "awq_marlin_grouped_decode",
    "awq_marlin_grouped_decode_cuda",
    "awq_humming_grouped_decode",
    "awq_humming_grouped_decode_cuda",
    "awq_moe_dense_cuda",
    "awq_moe_grouped_decode_cuda",
    "check_moe_args",
    "compact_rows",
    "local_expert_ids",
    "grouped_plan_for",
    "ids_flag",
    "raise_on_flagged_ids",
    "launch_grouped",
    "launch_prefill",
    "prefill_plan_for",
    "warmup",
    "alloc_workspace",
    "workspace_numel",
    "workspace_views",
    "WorkspaceLayout",
    "reference_moe",
    "reference_segments",
    "Segments",
    "error_stats",
    "ErrorStats",
]
