"""The launch plans of both routes: which kernels one call runs, with their grids and constexprs.

A plan is built once per (layer shape, M, dtype, config, GPU capability, the switches below)
and cached (which config a call runs is the lookup's, ``lookup.py``); the op's CUDA
implementation is ``launch_plan``, a loop over it, and the tools that compile or time the
kernels (``benchmarks/sass_stats.py``, ``benchmarks/timeline.py``, the benchmark's per-stage
breakdown) read the same plan. ``grouped_plan`` is the one place that picks the kernel variants::

    topk_ids, x ──> [W13]  w13_gluon (loads staged in shared memory) or w13_tl
                    │      program 0 zeroes the combine counters; program (row, split, tile):
                    ▼      float32 partials[split, row, 64 columns] of W13[topk_ids[row]]
                  [W2]     w2_gluon (weights staged in shared memory) or w2_tl
                           program (row, tile): W2 weights first (PDL: while W13 finishes),
                           act = silu(gate) * up of the partials, mma -> row_outputs[row, tile];
                           the last of a token's k programs on a tile writes
                           out[t, tile] = sum_j topk_weights[t, j] * row_outputs[t * k + j, tile]
                  [combine] only without ``fused_combine``: a launch of its own (combine.py)

Variant selection: the Gluon kernels run where Triton has Gluon, the kernels are compiled (not
under the interpreter) and ``MOE_GROUPED_DECODE_GLUON`` is not 0 (``gluon_runs``);
the config (table, tuned or given) names each launch's kernel, and a launch falls back to its
``tl`` kernel where Gluon does not run or the shape does not fit the Gluon W2's tiles or its shared
memory.

Lab switches, all fields of the plan that compile out when off: ``stages`` (a subset of the
launches, for the per-stage breakdown), ``timeline`` (per-program timestamps, kernels/timeline.py)
and ``w2_rn_scale`` (the tl W2 with the Gluon W2's scale rounding, for the test that compares
their bits).

The prefill route's plan (``prefill_plan``, ``launch_prefill``): the sort's four launches
(``expert_sort.py``), W13 + SiLU and W2 over the sorted groups (``prefill_wgmma.py`` on a Hopper,
``prefill.py`` or ``prefill_dot.py`` elsewhere, by the config) and the combine,
with the scratch they share laid out as named regions of one int32 buffer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import triton

from .. import env
from . import (MIN_CUDA_CAPABILITY, DeviceFacts, device_facts, expert_sort, gluon_helpers, launcher, prefill,
               prefill_dot, prefill_wgmma, w13_gluon, w13_tl, w2_gluon, w2_tl)
from .awq_mma import CHUNK_ROWS, TILE_WORDS
from .carveout import prefer_max_shared_carveout
from .combine import COMBINE_BLOCK, COMBINE_WARPS, combine_kernel, combine_valid_kernel
from .config import GroupedConfig, PrefillConfig
from .pdl import launch_options, pdl_supported
from .timeline import W2_STAMPS, W13_STAMPS

STAGES = ("sort", "w13", "w2", "combine")  # "sort": only a config with w13_over_groups sorts
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}

# The runtime arguments a launch names (``Launch.args``), with their Triton types: "act" is the
# activation dtype, "ids" topk_ids' own. ``launch_plan`` resolves the names per call.
ARGUMENT_TYPES = {
    "x": "act", "x_stride": "i32", "topk_ids": "ids", "topk_weights": "*fp32", "out": "act", "out_stride": "i32",
    "w13_qweight": "*i32", "w13_scales": "act", "w13_qzeros": "*i32",
    "w2_qweight": "*i32", "w2_scales": "act", "w2_qzeros": "*i32",
    "partials": "*fp32", "activations": "*fp32", "row_outputs": "*fp32", "arrivals": "*i32",
    "rows": "i32", "num_arrivals": "i32", "num_experts": "i32", "w13_stamps": "*i64", "w2_stamps": "*i64",
    # the prefill route's scratch (PREFILL_REGIONS) and sizes
    "ranks": "*i32", "block_counts": "*i32", "expert_totals": "*i32", "expert_offsets": "*i32", "group_first": "*i32",
    "group_expert": "*i32", "group_start": "*i32", "group_count": "*i32", "num_groups": "*i32", "sorted_rows": "*i32",
    "act16": "act", "row_out16": "act", "num_blocks": "i32", "max_groups": "i32",
    "id_flag": "*i32",  # the debug mode's device flag (env.check_ids); None, a constexpr, when off
}
# the sort's outputs the W13 programs over groups read (None, a constexpr, in a plan without them)
GROUP_ARGS = ("sorted_rows", "group_expert", "group_start", "group_count", "num_groups")
W13_ARGS = ("x", "x_stride", "topk_ids", "num_experts", "w13_qweight", "w13_scales", "w13_qzeros", "partials", "rows",
            "arrivals", "num_arrivals", "w13_stamps") + GROUP_ARGS + ("id_flag",)
W2_TL_ARGS = ("topk_ids", "num_experts", "partials", "w2_qweight", "w2_scales", "w2_qzeros", "activations", "row_outputs", "rows",
              "topk_weights", "out", "out_stride", "arrivals", "w2_stamps", "x", "x_stride", "w13_qweight", "w13_scales",
              "w13_qzeros")
W2_GLUON_ARGS = ("topk_ids", "num_experts", "partials", "w2_qweight", "w2_scales", "w2_qzeros", "row_outputs", "rows",
                 "topk_weights", "out", "out_stride", "arrivals", "w2_stamps", "x", "x_stride", "w13_qweight",
                 "w13_scales", "w13_qzeros")
# W2 (its fused combine) and the combine launches also read what their float64 recompute of an
# overflowed token needs (overflow.py)
COMBINE_ARGS = ("row_outputs", "topk_weights", "out", "out_stride", "x", "x_stride", "topk_ids", "num_experts",
                "w13_qweight", "w13_scales", "w13_qzeros", "w2_qweight", "w2_scales", "w2_qzeros")
COMBINE_VALID_ARGS = ("topk_weights", "topk_ids", "out", "out_stride", "x", "x_stride",
                      "w13_qweight", "w13_scales", "w13_qzeros", "w2_qweight", "w2_scales", "w2_qzeros")


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a plan."""

    name: str  # the kernel: "w13_gluon", "w13_tl", "w2_gluon", "w2_tl", "combine"; the prefill route's below
    stage: str  # "w13", "w2" or "combine"; the prefill route's sort: "sort"
    kernel: Any  # the JIT function launched
    grid: Tuple[int, ...]
    args: Tuple[str, ...]  # runtime arguments by name (ARGUMENT_TYPES), in the kernel's order
    constexprs: Tuple[Tuple[str, Any], ...]
    options: Tuple[Tuple[str, Any], ...]  # num_warps, launch_pdl, maxnreg
    max_shared_carveout: bool  # give the compiled kernel the largest carveout (carveout.py)

    @property
    def num_warps(self) -> int:
        return dict(self.options)["num_warps"]

    @property
    def programs(self) -> int:
        return math.prod(self.grid)


@dataclass(frozen=True)
class CallShape:
    """The sizes of one call that a plan is built for."""

    num_tokens: int  # M
    top_k: int  # k
    hidden_size: int  # K
    intermediate_size: int  # N
    group_size: int  # G
    dtype: torch.dtype

    @property
    def rows(self) -> int:
        return self.num_tokens * self.top_k


@dataclass(frozen=True)
class GroupedPlan(CallShape):
    """Every launch of one grouped call, and what the caller must provide for it."""

    capability: Tuple[int, int]
    config: GroupedConfig
    timeline: bool
    launches: Tuple[Launch, ...]
    num_arrivals: int  # combine counters the W2 launch uses (0 without the fused combine)
    # the sort's scratch, for a config with w13_over_groups (else empty): regions as PrefillPlan's
    sort_regions: Tuple[Tuple[str, int, Tuple[int, ...], bool], ...] = ()
    sort_numel: int = 0
    max_groups: int = 0
    check_ids: bool = False  # a launch flags ids outside [0, E) (the debug mode): it needs the flag

    def launch_for(self, stage: str) -> Optional[Launch]:
        return next((launch for launch in self.launches if launch.stage == stage), None)

    @property
    def timeline_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """The int64 stamp buffers a timeline plan takes: W13 [programs, stamps], W2 [rows, tiles, stamps]."""
        w13 = self.launch_for("w13")
        w2 = self.launch_for("w2")
        shapes = {}
        if w13 is not None:
            shapes["w13_stamps"] = (w13.programs, len(W13_STAMPS))
        if w2 is not None:
            shapes["w2_stamps"] = (*w2.grid, len(W2_STAMPS))
        return shapes


def gluon_runs(capability: Tuple[int, int]) -> bool:
    """Whether the Gluon kernels run: Triton has Gluon, the kernels compile for a GPU of
    ``capability`` (not the interpreter's (0, 0)), and MOE_GROUPED_DECODE_GLUON is not 0."""
    return gluon_helpers.AVAILABLE and capability != (0, 0) and env.gluon_w13_enabled()


def kernel_family(device) -> str:
    """The launch tables' kernel family on ``device`` (a torch device or its ``DeviceFacts``):
    "gluon" where the Gluon kernels run, else "tl"."""
    facts = device if isinstance(device, DeviceFacts) else device_facts(device)
    return "gluon" if gluon_runs(facts.capability) else "tl"


def _check_capability(route: str, capability: Tuple[int, int]) -> None:
    if capability != (0, 0) and capability < MIN_CUDA_CAPABILITY:
        raise RuntimeError(f"{route}: the kernels need compute capability {MIN_CUDA_CAPABILITY[0]}."
                           f"{MIN_CUDA_CAPABILITY[1]} or newer (tensor-core mma.sync); this GPU is "
                           f"{capability[0]}.{capability[1]}")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _items(mapping: dict) -> Tuple[Tuple[str, Any], ...]:
    return tuple(mapping.items())


def grouped_plan(num_tokens: int, top_k: int, hidden_size: int, intermediate_size: int, group_size: int,
                 dtype: torch.dtype, capability: Tuple[int, int], config: GroupedConfig,
                 stages: Sequence[str] = STAGES, timeline: bool = False, w2_rn_scale: bool = False,
                 num_experts: int = 0, check_ids: bool = False) -> GroupedPlan:
    """The plan of one grouped call (cached). ``config`` must be ``fitted`` to K; ``capability``
    is (0, 0) under the interpreter; ``num_experts`` (E) sizes the sort of a config with
    ``w13_over_groups``; ``check_ids``: the debug mode's kernels, which flag ids outside [0, E)."""
    return _grouped_plan(num_tokens, top_k, hidden_size, intermediate_size, group_size, dtype, tuple(capability),
                         config, tuple(stages), timeline, w2_rn_scale, gluon_runs(tuple(capability)), num_experts,
                         check_ids)


@functools.lru_cache(maxsize=1024)
def _grouped_plan(M, top_k, K, N, G, dtype, capability, config: GroupedConfig, stages, timeline, w2_rn_scale,
                  gluon: bool, E: int, check_ids: bool) -> GroupedPlan:
    _check_capability("grouped_decode", capability)
    if config.w13_over_groups and timeline:
        raise ValueError("grouped_decode: the timeline stamps the per-row kernels; a config with w13_over_groups "
                         "has none")
    if config.w13_over_groups and E < 1:
        raise ValueError("grouped_decode: a config with w13_over_groups needs the expert count (num_experts) to "
                         "size its sort")
    if G % CHUNK_ROWS.value or N % CHUNK_ROWS.value:
        raise ValueError(f"grouped_decode: group size {G} and intermediate size {N} must be multiples of "
                         f"{CHUNK_ROWS.value} (the tensor-core chunk)")
    if config.w13_block_k != config.w13_chunks * CHUNK_ROWS.value * config.w13_warps:
        raise ValueError(f"grouped_decode: {config} is not fitted (GroupedConfig.fitted)")
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise ValueError(f"grouped_decode: unknown stages {sorted(unknown)}; the stages are {STAGES}")
    if timeline and capability == (0, 0):
        raise ValueError("grouped_decode: the timeline reads the GPU's clock (inline PTX); it needs a GPU")
    rows = M * top_k
    splits = config.w13_splits(K)
    use_pdl = config.pdl and pdl_supported(capability)
    is_bf16 = dtype == torch.bfloat16
    carveout = config.max_shared_carveout and capability != (0, 0)
    w2_tiles = triton.cdiv(K, config.w2_block_k)
    num_arrivals = M * w2_tiles if config.fused_combine else 0
    arrivals_pad = _next_pow2(num_arrivals) if num_arrivals else 0
    w13_on_gluon = config.w13_kernel == "gluon" and gluon
    w2_on_gluon = (config.w2_kernel == "gluon" and gluon
                   and (K // 8) % (TILE_WORDS.value * config.w2_warps) == 0
                   # all N / 32 chunks of a tile's weights in shared memory, unrolled: not at an N in the thousands
                   and w2_gluon.shared_memory_fits(N, config.w2_warps, config.w2_act_split, capability))
    pdl_options = launch_options(use_pdl)
    launches = []
    sort_regions, sort_numel, groups = (), 0, 0
    if config.w13_over_groups:
        sort_launches, sort_regions, sort_numel, groups = _sort_stage(M, top_k, E, GROUP_ROWS * config.group_blocks,
                                                                      check_ids, use_pdl)
        if "sort" in stages:
            launches.extend(sort_launches)
        num_arrivals = arrivals_pad = 0
    if "w13" in stages:
        programs = groups if config.w13_over_groups else rows
        grid = (1 + programs * splits * (2 * N // 8 // TILE_WORDS.value),)
        common = dict(TOP_K=top_k, K=K, TWO_N=2 * N, G=G, CHUNKS=config.w13_chunks, SPLITS=splits,
                      ARRIVALS_PAD=arrivals_pad, IS_BF16=is_bf16, USE_PDL=use_pdl, TIMELINE=timeline,
                      OVER_GROUPS=config.w13_over_groups, GROUP_BLOCKS=config.group_blocks,
                      CHECK_IDS=check_ids and not config.w13_over_groups)  # over groups the sort flags
        if w13_on_gluon:
            kernel = w13_gluon.w13_gluon_kernel_max_carveout if carveout else w13_gluon.w13_gluon_kernel
            launches.append(Launch("w13_gluon", "w13", kernel, grid, W13_ARGS, _items(dict(
                common, CHUNKS_PAD=_next_pow2(config.w13_chunks), STAGES=config.w13_ring_stages)),
                _items({"num_warps": 1}), carveout))
        else:
            kernel = w13_tl.w13_tl_kernel_max_carveout if carveout else w13_tl.w13_tl_kernel
            launches.append(Launch("w13_tl", "w13", kernel, grid, W13_ARGS, _items(dict(common, WARPS=config.w13_warps)),
                                   _items({"num_warps": config.w13_warps}), carveout))
    if config.w13_over_groups:
        # the groups' activations once per row, then W2 and the combine over the same groups
        if "w2" in stages:
            launches.append(Launch("activations", "w2", w2_tl.activations_kernel, (rows,),
                                   ("partials", "act16", "rows"),
                                   _items(dict(N=N, SPLITS=splits, N_PAD=_next_pow2(N))), _items({"num_warps": 2}),
                                   False))
            launches.append(Launch("w2_prefill", "w2", prefill.w2_prefill_kernel, (groups, triton.cdiv(K, 64 * 4)),
                                   PREFILL_W2_ARGS[:-1] + ("row_outputs", "rows"),
                                   _items(dict(K=K, N=N, G=G, WARPS=4, TOKEN_BLOCKS=config.group_blocks,
                                               IS_BF16=is_bf16)),
                                   _items({"num_warps": 4}), False))
        if "combine" in stages:
            launches.append(Launch("combine_valid", "combine", combine_valid_kernel, (M, triton.cdiv(K, COMBINE_BLOCK)),
                                   ("row_outputs",) + COMBINE_VALID_ARGS,
                                   _items(dict(TOP_K=top_k, K=K, N=N, G=G, E=E, BLOCK_K=COMBINE_BLOCK, USE_PDL=False)),
                                   _items({"num_warps": COMBINE_WARPS.value}), False))
        stages = ()  # nothing more
    if "w2" in stages:
        grid = (rows, w2_tiles)
        options = {"num_warps": config.w2_warps, **pdl_options, **config.w2_compile_options(capability)}
        common = dict(K=K, N=N, G=G, SPLITS=splits, WARPS=config.w2_warps, TOP_K=top_k, IS_BF16=is_bf16,
                      USE_PDL=use_pdl, ACT_SPLIT=config.w2_act_split, TIMELINE=timeline)
        if w2_on_gluon:
            chunks = N // CHUNK_ROWS.value
            kernel = w2_gluon.w2_gluon_kernel_max_carveout if carveout else w2_gluon.w2_gluon_kernel
            launches.append(Launch("w2_gluon", "w2", kernel, grid, W2_GLUON_ARGS, _items(dict(
                common, CHUNKS_PAD=_next_pow2(chunks), AHEAD=min(config.w2_copy_ahead, chunks))),
                _items(options), carveout))
        else:
            kernel = w2_tl.w2_tl_kernel_max_carveout if carveout else w2_tl.w2_tl_kernel
            launches.append(Launch("w2_tl", "w2", kernel, grid, W2_TL_ARGS, _items(dict(
                common, N_PAD=_next_pow2(N), FUSED_COMBINE=config.fused_combine, RN_SCALE=w2_rn_scale)),
                _items(options), carveout))
    if "combine" in stages and not config.fused_combine:
        launches.append(Launch("combine", "combine", combine_kernel, (M, triton.cdiv(K, COMBINE_BLOCK)), COMBINE_ARGS,
                               _items(dict(TOP_K=top_k, K=K, N=N, G=G, BLOCK_K=COMBINE_BLOCK, USE_PDL=use_pdl)),
                               _items({"num_warps": COMBINE_WARPS.value, **pdl_options}), False))
    return GroupedPlan(M, top_k, K, N, G, dtype, capability, config, timeline, tuple(launches), num_arrivals,
                       tuple(sort_regions), sort_numel, groups, _checks_ids(launches))


def launch_plan(plan: GroupedPlan, hidden_states, topk_weights, topk_ids, weights, scratch, out,
                stamps: Optional[Dict[str, torch.Tensor]] = None, sort_scratch: Optional[torch.Tensor] = None,
                id_flag: Optional[torch.Tensor] = None) -> list:
    """Run ``plan`` into ``out`` [M, K]; return what each launch returned (its compiled kernel on a GPU).

    ``weights`` is an ``awq.AwqMoeWeights``; ``scratch`` holds the workspace regions as
    attributes (``ops.workspace_views``): int32 ``combine_arrivals`` (>= plan.num_arrivals),
    float32 ``gate_up_partials`` (>= splits * M * k * 2N, flat), ``activations`` [M * k, N] and
    ``row_outputs`` [M * k, K]. topk_ids and topk_weights contiguous [M, k]. ``stamps``: the
    int64 buffers of a timeline plan, named and shaped as ``plan.timeline_shapes``. ``sort_scratch``:
    int32, at least ``plan.sort_numel`` (allocated here when the plan sorts and none is given).
    ``id_flag``: the debug mode's int32 device flag, for a plan built with ``check_ids``.
    """
    if plan.num_arrivals > scratch.combine_arrivals.numel():
        raise ValueError(f"grouped_decode: {plan.num_arrivals} combine counters needed, the workspace holds "
                         f"{scratch.combine_arrivals.numel()}")
    if stamps is not None and not plan.timeline:
        raise ValueError("grouped_decode: stamps were given to a plan built without the timeline")
    if plan.timeline:
        stamps = stamps or {}
        for name, shape in plan.timeline_shapes.items():
            buffer = stamps.get(name)
            if buffer is None or tuple(buffer.shape) != shape:
                raise ValueError(f"grouped_decode: the timeline's {name} is not sized for this plan ({shape})")
            if buffer.dtype != torch.int64 or not buffer.is_contiguous() or buffer.device != hidden_states.device:
                raise ValueError(f"grouped_decode: timeline stamps must be contiguous int64 on {hidden_states.device}")
    values = {
        "x": hidden_states, "x_stride": hidden_states.stride(0), "topk_ids": topk_ids, "topk_weights": topk_weights,
        "out": out, "out_stride": out.stride(0),
        "w13_qweight": weights.w13_qweight, "w13_scales": weights.w13_scales, "w13_qzeros": weights.w13_qzeros,
        "w2_qweight": weights.w2_qweight, "w2_scales": weights.w2_scales, "w2_qzeros": weights.w2_qzeros,
        "partials": scratch.gate_up_partials, "activations": scratch.activations, "row_outputs": scratch.row_outputs,
        "arrivals": scratch.combine_arrivals, "rows": plan.rows, "num_arrivals": plan.num_arrivals,
        "num_experts": weights.num_experts,
        "w13_stamps": (stamps or {}).get("w13_stamps") if plan.timeline else None,
        "w2_stamps": (stamps or {}).get("w2_stamps") if plan.timeline else None,
        **{name: None for name in GROUP_ARGS},
        "id_flag": _checked_flag(id_flag, plan.check_ids),
    }
    if plan.sort_numel:
        if sort_scratch is None:
            sort_scratch = torch.empty(plan.sort_numel, dtype=torch.int32, device=hidden_states.device)
        elif sort_scratch.numel() < plan.sort_numel or sort_scratch.dtype != torch.int32:
            raise ValueError(f"grouped_decode: the sort's scratch must be int32 of at least {plan.sort_numel} elements")
        values.update(rows=plan.rows, num_blocks=triton.cdiv(plan.rows, expert_sort.BLOCK_ROWS),
                      max_groups=plan.max_groups, **_launch_views(plan.sort_regions, sort_scratch, plan.dtype))
        # W2 over groups reads 16-bit activations: the fp32 activations region's first half
        values["act16"] = scratch.activations.view(-1)[: plan.rows * plan.intermediate_size // 2].view(
            plan.dtype).view(plan.rows, plan.intermediate_size)
    return _run(plan.launches, values)


def _checks_ids(launches) -> bool:
    return any(dict(launch.constexprs).get("CHECK_IDS") for launch in launches)


def _checked_flag(id_flag: Optional[torch.Tensor], needed: bool) -> Optional[torch.Tensor]:
    if needed and (id_flag is None or id_flag.dtype != torch.int32 or id_flag.numel() < 1):
        raise ValueError("a plan built with check_ids needs its int32 device flag (id_flag)")
    return id_flag if needed else None


def _run(launches, values) -> list:
    launched, call = [], launcher.Call()
    for launch in launches:
        compiled = launcher.run(launch, [values[name] for name in launch.args], call)
        if launch.max_shared_carveout:
            prefer_max_shared_carveout(compiled)
        launched.append(compiled)
    return launched


# --------------------------------------------------------------------------- the prefill route


@dataclass(frozen=True)
class PrefillPlan(CallShape):
    """Every launch of one prefill-route call, and the scratch it needs (one int32 buffer)."""

    num_experts: int  # E
    config: PrefillConfig
    launches: Tuple[Launch, ...]
    regions: Tuple[Tuple[str, int, Tuple[int, ...], bool], ...]  # (name, int32 offset, shape, 16-bit)
    scratch_numel: int  # int32 elements
    check_ids: bool = False  # the sort flags ids outside [0, E) (the debug mode): it needs the flag

    def scratch_views(self, scratch: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The named regions of a ``scratch_numel`` int32 tensor (16-bit ones in the activation dtype)."""
        return _region_views(self.regions, scratch, self.dtype)


def _region_views(regions, scratch: torch.Tensor, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    views = {}
    for name, offset, shape, half in regions:
        numel = math.prod(shape)
        if half:
            views[name] = scratch[offset: offset + (numel + 1) // 2].view(dtype)[:numel].view(shape)
        else:
            views[name] = scratch[offset: offset + numel].view(shape)
    return views


def _launch_views(regions, scratch: torch.Tensor, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """The regions as the kernels read them: each from its offset to the next region's, flat.
    A kernel reads only a region's address, and one split makes them all in a few times less host
    time than a sliced and shaped view per region: a prefill step that vLLM runs outside its CUDA
    graphs is bound by the host's time."""
    offsets = [offset for _, offset, _, _ in regions]
    pieces = scratch.split_with_sizes([offsets[0]] + [b - a for a, b in zip(offsets, offsets[1:])]
                                      + [scratch.numel() - offsets[-1]])[1:]
    return {name: piece.view(dtype) if half else piece for (name, _, _, half), piece in zip(regions, pieces)}


def _layout(regions_spec, offset: int = 0):
    """(name, offset, shape, 16-bit) of each region laid out from ``offset``, 64-byte aligned, and the end."""
    regions = []
    for name, shape, half in regions_spec:
        numel = math.prod(shape)
        regions.append((name, offset, shape, half))
        offset += -(-((numel + 1) // 2 if half else numel) // 16) * 16
    return regions, offset


# rows per mma B operand of the grouped route over groups (groups of GROUP_ROWS * group_blocks)
GROUP_ROWS = 8


def _sort_stage(M: int, top_k: int, E: int, group_rows: int, check_ids: bool = False, use_pdl: bool = False):
    """The sort's four launches (expert_sort.py) for M tokens into groups of ``group_rows``, with
    their scratch regions: (launches, regions, int32 elements, max groups); ``check_ids``: its
    first launch flags ids outside [0, E) (the debug mode); ``use_pdl``: each launched to start
    while the one before finishes."""
    rows = M * top_k
    block = expert_sort.BLOCK_ROWS
    num_blocks = triton.cdiv(rows, block)
    e_pad = _next_pow2(max(E, expert_sort.EXPERT_BLOCK))
    max_groups = expert_sort.max_groups(rows, E, group_rows)
    # the sort's tiles sized for the next power of two of M: one binary serves a whole bucket
    bucket_rows = _next_pow2(M) * top_k
    prefix_chunk = min(_next_pow2(triton.cdiv(bucket_rows, block)), expert_sort.PREFIX_CHUNK)
    g_pad = _next_pow2(expert_sort.max_groups(bucket_rows, E, group_rows))
    regions, numel = _layout((
        ("ranks", (rows,), False), ("block_counts", (num_blocks, e_pad), False), ("expert_totals", (e_pad,), False),
        ("expert_offsets", (e_pad,), False), ("group_first", (e_pad,), False), ("group_expert", (max_groups,), False),
        ("group_start", (max_groups,), False), ("group_count", (max_groups,), False), ("num_groups", (1,), False),
        ("sorted_rows", (rows,), False),
    ))
    options = launch_options(use_pdl)
    launches = (
        Launch("sort_ranks", "sort", expert_sort.ranks_kernel, (num_blocks,),
               ("topk_ids", "rows", "ranks", "block_counts", "id_flag"),
               _items(dict(E=E, E_PAD=e_pad, BLOCK=block, CHECK_IDS=check_ids, USE_PDL=use_pdl)),
               _items({"num_warps": 4, **options}), False),
        Launch("sort_prefix", "sort", expert_sort.prefix_kernel, (e_pad // expert_sort.EXPERT_BLOCK,),
               ("block_counts", "num_blocks", "expert_totals"),
               _items(dict(E_PAD=e_pad, CHUNK=prefix_chunk, EXPERTS=expert_sort.EXPERT_BLOCK, USE_PDL=use_pdl)),
               _items({"num_warps": 4, **options}), False),
        Launch("sort_groups", "sort", expert_sort.groups_kernel, (1,),
               ("expert_totals", "expert_offsets", "group_first", "group_expert", "group_start", "group_count",
                "num_groups", "max_groups"),
               _items(dict(E_PAD=e_pad, G_PAD=g_pad, T=group_rows, USE_PDL=use_pdl)), _items({"num_warps": 16, **options}),
               False),
        Launch("sort_scatter", "sort", expert_sort.scatter_kernel, (num_blocks,),
               ("topk_ids", "rows", "ranks", "block_counts", "expert_offsets", "sorted_rows"),
               _items(dict(E=E, E_PAD=e_pad, BLOCK=block, USE_PDL=use_pdl)), _items({"num_warps": 4, **options}), False),
    )
    return launches, regions, numel, max_groups


def prefill_plan(num_tokens: int, top_k: int, num_experts: int, hidden_size: int, intermediate_size: int,
                 group_size: int, dtype: torch.dtype, capability: Tuple[int, int], config: PrefillConfig,
                 check_ids: bool = False) -> PrefillPlan:
    """The plan of one prefill-route call (cached); ``check_ids``: the sort flags ids outside [0, E)."""
    # whether the Gluon kernels run is in the key: it decides which kernels a wgmma config runs
    return _prefill_plan(num_tokens, top_k, num_experts, hidden_size, intermediate_size, group_size, dtype,
                         tuple(capability), config, check_ids, gluon_runs(tuple(capability)))


@functools.lru_cache(maxsize=1024)
def _prefill_plan(M, top_k, E, K, N, G, dtype, capability, config: PrefillConfig, check_ids: bool,
                  gluon: bool) -> PrefillPlan:
    _check_capability("prefill", capability)
    if G % CHUNK_ROWS.value or N % CHUNK_ROWS.value or K % CHUNK_ROWS.value:
        raise ValueError(f"prefill: group size {G}, intermediate size {N} and hidden size {K} must be multiples of "
                         f"{CHUNK_ROWS.value} (the tensor-core chunk)")
    rows = M * top_k
    is_bf16 = dtype == torch.bfloat16
    config = prefill_config_run(config, capability, K, N, G)
    use_pdl = config.pdl and pdl_supported(capability)
    sort_launches, sort_regions, sort_numel, max_groups = _sort_stage(M, top_k, E, config.group_rows, check_ids,
                                                                      use_pdl)
    gemm_regions, offset = _layout((("act16", (rows, N), True), ("row_out16", (rows, K), True)), sort_numel)
    regions = sort_regions + gemm_regions
    gemms = _prefill_gemms(top_k, K, N, G, is_bf16, max_groups, config, use_pdl)
    # the combine may start early only behind a launch that waits for its own predecessor
    combine_pdl = use_pdl and config.kernel == "wgmma"
    launches = (
        *sort_launches,
        *gemms,
        Launch("combine_valid", "combine", combine_valid_kernel, (M, triton.cdiv(K, COMBINE_BLOCK)),
               ("row_out16",) + COMBINE_VALID_ARGS,
               _items(dict(TOP_K=top_k, K=K, N=N, G=G, E=E, BLOCK_K=COMBINE_BLOCK, USE_PDL=combine_pdl)),
               _items({"num_warps": COMBINE_WARPS.value, **launch_options(combine_pdl)}), False),
    )
    return PrefillPlan(M, top_k, K, N, G, dtype, E, config, launches, tuple(regions), offset, check_ids)


PREFILL_W13_ARGS = ("x", "x_stride", "sorted_rows", "group_expert", "group_start", "group_count", "num_groups",
                    "w13_qweight", "w13_scales", "w13_qzeros", "act16")
PREFILL_W2_ARGS = ("act16", "sorted_rows", "group_expert", "group_start", "group_count", "num_groups",
                   "w2_qweight", "w2_scales", "w2_qzeros", "row_out16")


def wgmma_runs(capability: Tuple[int, int], K: int, N: int, G: int, block_rows: int = 64) -> bool:
    """Whether the wgmma prefill kernels serve this shape here: Gluon with its Hopper API runs, the
    GPU is a Hopper (wgmma is sm_90's), the shape tiles (W2 in 128-column tiles, 32-row pieces)
    and W2's copy of a group's act rows, [block_rows, N] in 16 bits, leaves room in shared memory
    for its ring (at most 96 KiB)."""
    return (gluon_runs(capability) and prefill_wgmma.HOPPER_AVAILABLE and capability[0] == 9
            and K % prefill_wgmma.TILE_COLUMNS == 0 and N % prefill_wgmma.STEP_ROWS == 0
            and G % prefill_wgmma.STEP_ROWS == 0 and N * block_rows * 2 <= 96 * 1024)


def prefill_config_run(config: PrefillConfig, capability: Tuple[int, int], K: int, N: int, G: int) -> PrefillConfig:
    """The config the prefill route runs for ``config`` here: itself, but for a wgmma config where
    those kernels do not run (``wgmma_runs``) the faster of the other kernels at those group sizes
    on the H200 (measured side by side, docs/notebook): the mma kernels over 8-row groups for groups of up to 32 rows,
    else the dot kernels over the same groups. The sort groups the rows by the config this returns."""
    if config.kernel == "wgmma" and K % config.w13_block_k:  # W13's steps must tile K (64 does where wgmma runs)
        config = dataclasses.replace(config, w13_block_k=64)
    if config.kernel != "wgmma" or wgmma_runs(capability, K, N, G, config.block_rows):
        return config
    if config.block_rows <= 32:
        return PrefillConfig(token_blocks=1)
    return dataclasses.replace(config, kernel="dot", w13_block_n=64, w13_block_k=64, w13_warps=4, w13_stages=4,
                               w2_block_n=128, w2_warps=4, w2_stages=3)


def _prefill_gemms(top_k, K, N, G, is_bf16, max_groups, config: PrefillConfig,
                   use_pdl: bool = False) -> Tuple[Launch, Launch]:
    """The prefill route's W13 + SiLU and W2 launches of ``config.kernel``'s family (a config
    ``prefill_config_run`` returned); ``use_pdl``: the wgmma ones launched to start early (the
    others wait for the launch before them to finish)."""
    if config.kernel == "wgmma":
        options = {"num_warps": 4, **launch_options(use_pdl)}
        w2_programs = triton.cdiv(K // prefill_wgmma.TILE_COLUMNS, config.w2_tiles_per_program)
        return (
            Launch("w13_prefill_wgmma", "w13", prefill_wgmma.w13_wgmma_kernel,
                   (max_groups * prefill_wgmma.w13_programs_per_group(config.w13_tiles, N),),
                   PREFILL_W13_ARGS,
                   _items(dict(TOP_K=top_k, K=K, N=N, G=G, BLOCK_ROWS=config.block_rows, STAGES=config.w13_stages,
                               IS_BF16=is_bf16, SUB=config.w13_block_k // prefill_wgmma.STEP_ROWS,
                               SCALES_AHEAD=config.w13_scales_ahead, TILES=config.w13_tiles, USE_PDL=use_pdl)),
                   _items(options), False),
            Launch("w2_prefill_wgmma", "w2", prefill_wgmma.w2_wgmma_kernel, (max_groups * w2_programs,),
                   PREFILL_W2_ARGS,
                   _items(dict(K=K, N=N, G=G, BLOCK_ROWS=config.block_rows,
                               TILES_PER_PROGRAM=config.w2_tiles_per_program, STAGES=config.w2_stages,
                               IS_BF16=is_bf16, USE_PDL=use_pdl, UNROLL_UP_TO=config.w2_unrolled_pieces)),
                   _items(options), False),
        )
    if config.kernel == "dot":
        block_k = config.w13_block_k
        if K % block_k or (block_k % G and G % block_k):
            raise ValueError(f"prefill: w13_block_k {block_k} must divide the hidden size {K} and divide or be a "
                             f"multiple of the group size {G}")
        w13_tiles = triton.cdiv(N, config.w13_block_n)
        return (
            Launch("w13_prefill_dot", "w13", prefill_dot.w13_dot_kernel, (max_groups * w13_tiles,), PREFILL_W13_ARGS,
                   _items(dict(TOP_K=top_k, K=K, N=N, G=G, BLOCK_ROWS=config.block_rows,
                               BLOCK_N=config.w13_block_n, BLOCK_K=block_k, STAGES=config.w13_stages)),
                   _items({"num_warps": config.w13_warps}), False),
            Launch("w2_prefill_dot", "w2", prefill_dot.w2_dot_kernel, (max_groups, triton.cdiv(K, config.w2_block_n)),
                   PREFILL_W2_ARGS,
                   _items(dict(K=K, N=N, G=G, BLOCK_ROWS=config.block_rows, BLOCK_N=config.w2_block_n,
                               STAGES=config.w2_stages)),
                   _items({"num_warps": config.w2_warps}), False),
        )
    return (
        Launch("w13_prefill", "w13", prefill.w13_prefill_kernel, (max_groups * (N // 32),), PREFILL_W13_ARGS + ("rows",),
               _items(dict(TOP_K=top_k, K=K, N=N, G=G, WARPS=config.w13_warps, TOKEN_BLOCKS=config.token_blocks,
                           IS_BF16=is_bf16)),
               _items({"num_warps": config.w13_warps}), False),
        Launch("w2_prefill", "w2", prefill.w2_prefill_kernel, (max_groups, triton.cdiv(K, 64 * config.w2_warps)),
               PREFILL_W2_ARGS + ("rows",),
               _items(dict(K=K, N=N, G=G, WARPS=config.w2_warps, TOKEN_BLOCKS=config.token_blocks, IS_BF16=is_bf16)),
               _items({"num_warps": config.w2_warps}), False),
    )


def launch_prefill(plan: PrefillPlan, hidden_states, topk_weights, topk_ids, weights, scratch: torch.Tensor,
                   out, id_flag: Optional[torch.Tensor] = None) -> list:
    """Run a prefill ``plan`` into ``out`` [M, K] with ``scratch`` (int32, >= plan.scratch_numel);
    topk_ids and topk_weights contiguous [M, k]; ``id_flag`` as launch_plan's."""
    if scratch.numel() < plan.scratch_numel or scratch.dtype != torch.int32:
        raise ValueError(f"prefill: the scratch must be int32 of at least {plan.scratch_numel} elements")
    rows = plan.rows
    values = {
        "x": hidden_states, "x_stride": hidden_states.stride(0), "topk_ids": topk_ids, "topk_weights": topk_weights,
        "out": out, "out_stride": out.stride(0), "rows": rows, "num_blocks": triton.cdiv(rows, expert_sort.BLOCK_ROWS),
        "max_groups": expert_sort.max_groups(rows, plan.num_experts, plan.config.group_rows),
        "w13_qweight": weights.w13_qweight, "w13_scales": weights.w13_scales, "w13_qzeros": weights.w13_qzeros,
        "w2_qweight": weights.w2_qweight, "w2_scales": weights.w2_scales, "w2_qzeros": weights.w2_qzeros,
        **_launch_views(plan.regions, scratch, plan.dtype),
        "id_flag": _checked_flag(id_flag, plan.check_ids),
    }
    return _run(plan.launches, values)
