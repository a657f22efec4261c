"""Launch configs (kernels/config.py), their tables (the measured tables' launch tables,
moe_grouped_decode/tables/*.json), the autotune cache, and which kernels a plan launches
(kernels/plan.py). CPU only: no kernel runs here."""

import dataclasses
import json

import pytest
import torch

from moe_grouped_decode import tables
from moe_grouped_decode.contract import QWEN38_TP4, registered_contracts
from moe_grouped_decode.env import GLUON_W13_ENV
from moe_grouped_decode.kernels import config, gluon_helpers, plan
from moe_grouped_decode.kernels.config import MAX_SPLIT_K, GroupedConfig

SHAPE = (QWEN38_TP4.num_experts, QWEN38_TP4.top_k, QWEN38_TP4.hidden_size, QWEN38_TP4.intermediate_size,
         QWEN38_TP4.group_size)
K = SHAPE[2]
H200 = "NVIDIA H200"


@pytest.fixture(autouse=True)
def _no_tuned_configs():
    """Every test sees the tables alone, and leaves no tuned config behind."""
    config.forget_tuned()
    yield
    config.forget_tuned()


def table_entries():
    return [((table.shape, table.gpu, e["kernels"], table.dtype, e["M"]), config.config_from_fields(e["config"]))
            for table in tables.shipped_tables() for e in table.grouped]


def test_every_launch_table_entry_is_a_valid_config_of_a_registered_shape():
    """Each grouped entry of every shipped table is a valid config (an entry the loader would
    skip is a typo in the data), and each prefill entry too; the table's shape has a measured
    contract and its file name says what it holds."""
    shapes = {c.shape for c in registered_contracts() if c.measured}
    for table in tables.shipped_tables():
        assert table.path.name == tables.file_name(*table.key) and table.generator
        assert table.shape in shapes
        assert all(config.config_from_fields(e["config"]) is not None for e in table.grouped), table.path
        assert all(e["kernels"] in config.KERNEL_FAMILIES for e in table.grouped), table.path
        for e in table.prefill:
            config.PrefillConfig(**e["config"])


def test_the_qwen38_tables_cover_both_families_at_every_decode_count():
    """On the H200 both dtypes have entries for the Gluon kernels (what runs there) and the tl
    kernels (the MOE_GROUPED_DECODE_GLUON=0 rollback) serving every decode count 1..8."""
    for dtype in ("fp16", "bf16"):
        for family in ("gluon", "tl"):
            counts = {key[4] for key, _ in table_entries() if key[:4] == (SHAPE, H200, family, dtype)}
            assert counts and min(counts) == 1 and max(counts) >= 8, (dtype, family, counts)


def test_an_entry_serves_every_count_up_to_its_own():
    """Between two entries the larger's config; above the last the default (so the default's
    switch to the sort's groups applies there)."""
    entries = sorted((key[4], entry) for key, entry in table_entries() if key[:4] == (SHAPE, H200, "gluon", "fp16"))
    counts = [M for M, _ in entries]
    for (low, _), (high, entry) in zip(entries, entries[1:]):
        for M in range(low + 1, high + 1):
            assert config.grouped_config(SHAPE, H200, "gluon", "fp16", M) == entry, M
    above = counts[-1] + 1
    assert config.grouped_config(SHAPE, H200, "gluon", "fp16", above) == GroupedConfig(
        w13_over_groups=above >= config.OVER_GROUPS_FROM_TOKENS).fitted(K)


@pytest.mark.parametrize("key,entry", table_entries(), ids=lambda v: "-".join(map(str, v[1:])) if isinstance(v, tuple) else "")
def test_table_entries_are_used_as_written(key, entry):
    shape, gpu, family, dtype, M = key
    # grouped_config fits what it returns; an entry that needed fitting would run other splits than measured
    assert entry == entry.fitted(shape[2])
    assert config.grouped_config(shape, gpu, family, dtype, M) == entry
    assert 1 <= entry.w13_splits(shape[2]) <= MAX_SPLIT_K  # the workspace's partials region holds them
    if family == "tl":  # where Gluon does not run, the entries name no Gluon kernel
        assert entry.w13_kernel == "tl" and entry.w2_kernel == "tl"
    elif entry.w13_kernel == "gluon":  # measured on splits that tile K
        assert shape[2] % entry.w13_block_k == 0


def test_another_gpu_takes_the_preferred_gpus_entries():
    assert tables.find_table("NVIDIA A100-SXM4-80GB", SHAPE, "fp16") is None
    for M in (2, 8):
        assert config.grouped_config(SHAPE, "NVIDIA A100-SXM4-80GB", "gluon", "fp16", M) == \
            config.grouped_config(SHAPE, H200, "gluon", "fp16", M)


def test_unlisted_shape_gets_the_fitted_default():
    shape = (64, 4, 1024, 96, 32)
    assert config.grouped_config(shape, H200, "gluon", "fp16", 3) == GroupedConfig().fitted(shape[2])
    assert config.grouped_config(shape, H200, "tl", "fp16", 3) == GroupedConfig().as_tl().fitted(shape[2])


@pytest.mark.parametrize("family", ["gluon", "tl"])
def test_untabled_counts_run_over_the_sorts_groups_from_the_threshold(family):
    """Token counts without a table entry take the default config, over the sort's groups from
    OVER_GROUPS_FROM_TOKENS on; the table's decode entries (M <= 8) run per routed row."""
    threshold = config.OVER_GROUPS_FROM_TOKENS
    untabled = (64, 4, 1024, 96, 32)
    assert not config.grouped_config(untabled, H200, family, "fp16", threshold - 1).w13_over_groups
    assert config.grouped_config(untabled, H200, family, "fp16", threshold).w13_over_groups
    assert config.grouped_config(SHAPE, H200, family, "bf16", 512).w13_over_groups
    assert not any(config.grouped_config(SHAPE, H200, family, "fp16", m).w13_over_groups for m in range(1, 9))


@pytest.mark.parametrize("fields, match", [
    (dict(w13_kernel="ring"), "w13_kernel must be one of"),
    (dict(w13_warps=2), "the Gluon W13 runs 1-warp programs"),
    (dict(w13_ring_stages=0), "ring of at least one stage"),
    (dict(w2_kernel="gluon", fused_combine=False), "the Gluon W2 fuses the combine"),
    (dict(w2_copy_ahead=0), "must be at least 1, got 0"),
    (dict(w2_copy_ahead=-1), "must be at least 1, got -1"),  # would index before the first chunk
    (dict(w13_over_groups=True, w2_act_split=True), "needs w2_act_split=False"),  # W2 over groups rounds once
    (dict(group_blocks=2), "2 only over the sort's groups"),  # per routed row there is one token
    (dict(w13_over_groups=True, group_blocks=3), "group_blocks must be 1 or 2"),
])
def test_contradictory_configs_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        GroupedConfig(**fields)


@pytest.mark.parametrize("capability, expected", [
    ((9, 0), {"maxnreg": 128}),  # Hopper: measured there, compiles without spills
    ((10, 0), {"maxnreg": 128}),  # newer
    ((8, 0), {}),  # Ampere: sm_80's schedule spills at 128 (tests/test_sass_stats.py compiles both)
    ((0, 0), {}),  # the interpreter
])
def test_w2_register_cap_applies_from_hopper_on(capability, expected):
    assert GroupedConfig(w2_max_registers=128).w2_compile_options(capability) == expected
    assert GroupedConfig().w2_compile_options(capability) == expected  # the default asks 128
    assert GroupedConfig(w2_max_registers=0).w2_compile_options(capability) == {}  # no cap asked, none given


@pytest.mark.parametrize("family", ["gluon", "tl"])
def test_candidates_hold_the_register_cap_only_where_it_applies(family):
    hopper, ampere = config.grouped_candidates((9, 0), family), config.grouped_candidates((8, 0), family)
    assert len(set(hopper)) == len(hopper)
    # the cap is a no-op there: no duplicate timings (over the sort's groups W2 is the prefill
    # route's, which takes no cap anywhere: one config a block count, as the tables hold it)
    assert {c.w2_max_registers for c in ampere if not c.w13_over_groups} == {0}
    assert set(ampere) < set(hopper) and {c.w2_max_registers for c in hopper} > {0, 128}


@pytest.mark.parametrize("family", ["gluon", "tl"])
def test_autotune_can_find_the_table_configs(family):
    """Every qwen3.8-tp4 table entry is one of the autotune's candidates on Hopper (where the table
    was measured), so a search never loses to the table for want of trying it."""
    candidates = set(config.grouped_candidates((9, 0), family))
    for (shape, gpu, fam, dtype, M), entry in table_entries():
        if fam == family and M <= 8:
            assert entry in candidates, (gpu, dtype, M)


def test_candidates_name_the_gluon_kernels_only_where_they_run():
    gluon, tl = config.grouped_candidates((9, 0), "gluon"), config.grouped_candidates((9, 0), "tl")
    # 9 W13 x 10 W2 and 5 x 6, and in each family the default over the sort's groups (1 and 2 blocks;
    # its W2, the prefill route's, takes no register cap: one config each, the cap as tables hold it)
    assert len(gluon) == 90 + 2 and len(tl) == 30 + 2
    assert sorted((c.group_blocks, c.w2_max_registers) for c in gluon + tl if c.w13_over_groups) == [
        (1, 128), (1, 128), (2, 128), (2, 128)]
    assert {(c.w13_kernel, c.w2_kernel) for c in tl} == {("tl", "tl")}
    assert {c.w13_kernel for c in gluon} == {"gluon"} and {c.w13_ring_stages for c in gluon} == {2, 3, 4}
    gluon_w2 = {(c.w2_warps, c.w2_max_registers, c.w2_copy_ahead, c.max_shared_carveout)
                for c in gluon if c.w2_kernel == "gluon"}
    # (warps, register cap, chunks copied ahead, the largest carveout: the 4-warp W2 runs beside W13)
    assert gluon_w2 == {(4, 0, 3, True), (4, 96, 3, True), (4, 128, 3, True), (8, 0, 2, False)}
    assert not any(c.max_shared_carveout for c in gluon + tl if c.w2_kernel == "tl")
    # the Gluon W13's splits tile K = 2560 (no masked chunks) and need no fitting
    assert all(K % c.w13_block_k == 0 and c == c.fitted(K) for c in gluon)


def test_tuned_cache_round_trip_and_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_GROUPED_DECODE_CACHE", str(tmp_path))
    path = config.cache_path("NVIDIA H200 (test)", "3.6.0")
    assert path.parent == tmp_path and " " not in path.name
    assert config.KERNELS_VERSION in path.name  # configs tuned for other kernels are not read back
    tuned = GroupedConfig(w13_block_k=256, w2_kernel="gluon", w2_warps=8, w2_max_registers=128, w2_copy_ahead=3)
    key = (SHAPE, H200, "gluon", "fp16", 4)
    config.store_tuned(path, key, tuned)
    # a tuned entry wins over the table, for its key only
    assert config.grouped_config(*key) == tuned.fitted(K)
    assert config.grouped_config(SHAPE, H200, "gluon", "bf16", 4) == config.table_config(SHAPE, H200, "gluon", "bf16", 4)
    assert config.grouped_config(SHAPE, H200, "tl", "fp16", 4) == config.table_config(SHAPE, H200, "tl", "fp16", 4)
    # a fresh process reads it back; entries of another version of GroupedConfig are skipped
    data = json.loads(path.read_text())
    future = config.make_entry(((1, 1, 32, 32, 32), H200, "gluon", "fp16", 1), tuned)
    future["config"]["field_of_the_future"] = 1
    older = config.make_entry(((1, 1, 32, 32, 32), H200, "gluon", "fp16", 2), tuned)
    del older["config"]["max_shared_carveout"]
    data["entries"] += [future, older, {"shape": "garbage"}]
    path.write_text(json.dumps(data))
    config.forget_tuned()  # as a fresh process
    config.load_tuned(path)
    assert config.tuned_config(key) == tuned
    assert config.tuned_config(((1, 1, 32, 32, 32), H200, "gluon", "fp16", 1)) is None
    assert config.tuned_config(((1, 1, 32, 32, 32), H200, "gluon", "fp16", 2)) is None


def test_corrupt_cache_file_is_ignored(tmp_path):
    path = tmp_path / "grouped_x.json"
    path.write_text("{not json")
    config.load_tuned(path)
    key = (SHAPE, H200, "gluon", "fp16", 2)
    assert config.tuned_config(key) is None
    assert config.grouped_config(*key) == config.table_config(*key)


def qwen_plan(M, cfg, capability=(9, 0), **options):
    return plan.grouped_plan(M, *SHAPE[1:], torch.float16, capability, cfg.fitted(K), **options)


@pytest.mark.parametrize("capability, cfg, switch, expected", [
    ((9, 0), GroupedConfig(), None, ("w13_gluon", "w2_tl")),  # a Hopper GPU, the default config
    ((8, 0), GroupedConfig(), None, ("w13_gluon", "w2_tl")),  # Ampere as well (cp.async is sm_80)
    ((0, 0), GroupedConfig(), None, ("w13_tl", "w2_tl")),  # the interpreter (CPU CI): Gluon cannot run
    ((9, 0), GroupedConfig(w13_kernel="tl", w13_warps=2), None, ("w13_tl", "w2_tl")),  # 2-warp tl W13 programs
    ((9, 0), GroupedConfig(w2_kernel="gluon", w2_warps=8), None, ("w13_gluon", "w2_gluon")),
    ((9, 0), GroupedConfig(w2_kernel="gluon", w2_warps=8), "0", ("w13_tl", "w2_tl")),  # the rollback switch
    # K // 8 = 320 int32 columns: 16-warp Gluon programs (1024 columns) do not tile them
    ((9, 0), GroupedConfig(w2_kernel="gluon", w2_warps=16), None, ("w13_gluon", "w2_tl")),
])
def test_which_kernels_a_plan_launches(monkeypatch, capability, cfg, switch, expected):
    assert gluon_helpers.AVAILABLE  # CI's Triton has Gluon: otherwise every case would be the tl kernels
    if switch is None:
        monkeypatch.delenv(GLUON_W13_ENV, raising=False)
    else:
        monkeypatch.setenv(GLUON_W13_ENV, switch)
    launches = qwen_plan(8, cfg, capability).launches
    assert tuple(launch.name for launch in launches) == expected


def test_plan_launch_arguments_match_the_kernels():
    """Every launch names as many runtime arguments as its kernel takes, and every constexpr the
    kernel declares (a constexpr the kernel never reads would be caught nowhere else)."""
    configs = (GroupedConfig(), GroupedConfig(w2_kernel="gluon", w2_warps=8),
               GroupedConfig(w13_kernel="tl", fused_combine=False))
    for cfg in configs:
        for launch in qwen_plan(4, cfg).launches:
            params = launch.kernel.params
            assert len(launch.args) == len([p for p in params if not p.is_constexpr]), launch.name
            assert set(dict(launch.constexprs)) == {p.name for p in params if p.is_constexpr}, launch.name
            assert all(name in plan.ARGUMENT_TYPES for name in launch.args)


def test_every_constexpr_a_kernel_declares_is_read():
    """No constexpr that its kernel never reads (each would only split binaries)."""
    import inspect
    import re

    from moe_grouped_decode.kernels import combine, expert_sort, prefill, w13_gluon, w13_tl, w2_gluon, w2_tl

    kernels = (w13_tl.w13_tl_kernel, w2_tl.w2_tl_kernel, w13_gluon.w13_gluon_kernel, w2_gluon.w2_gluon_kernel,
               combine.combine_kernel, combine.combine_valid_kernel, prefill.w13_prefill_kernel,
               prefill.w2_prefill_kernel, expert_sort.ranks_kernel, expert_sort.prefix_kernel,
               expert_sort.groups_kernel, expert_sort.scatter_kernel, w2_tl.activations_kernel)
    for fn in (kernel.fn for kernel in kernels):
        source = inspect.getsource(fn)
        signature, body = source.split("):\n", 1)
        for name in re.findall(r"(\w+): [tg]l\.constexpr", signature):
            assert re.search(rf"\b{name}\b", body), f"{fn.__name__}: {name} is never read"


def test_plan_grids_and_stages():
    cfg = GroupedConfig(w2_kernel="gluon", w2_warps=8, w13_block_k=512, w13_ring_stages=3)
    full = qwen_plan(8, cfg)
    w13, w2 = full.launches
    assert w13.grid == (1 + 80 * 5 * 5,)  # program 0 + (rows, splits, column tiles)
    assert w2.grid == (80, 5)  # (rows, 512-column tiles of K = 2560)
    assert full.num_arrivals == 8 * 5
    assert [launch.stage for launch in qwen_plan(8, cfg, stages=("w2",)).launches] == ["w2"]
    three = qwen_plan(8, GroupedConfig(fused_combine=False))
    assert [launch.name for launch in three.launches] == ["w13_gluon", "w2_tl", "combine"]
    assert three.num_arrivals == 0
    with pytest.raises(ValueError, match="unknown stages"):
        qwen_plan(8, cfg, stages=("w3",))
    with pytest.raises(ValueError, match="needs a GPU"):
        qwen_plan(8, cfg, capability=(0, 0), timeline=True)
    with pytest.raises(RuntimeError, match="compute capability 8.0 or newer"):
        qwen_plan(8, cfg, capability=(7, 0))


@pytest.mark.parametrize("capability, w13", [((9, 0), "w13_gluon"), ((0, 0), "w13_tl")])
def test_a_plan_over_the_sorts_groups(capability, w13):
    """The sort's four launches, W13 over at most R / 8 + min(E, R) groups, the activations once
    per row, W2 and the combine over the same groups; the sort's scratch sized by E."""
    cfg = GroupedConfig(w13_over_groups=True)
    M, E = 64, SHAPE[0]
    over = plan.grouped_plan(M, *SHAPE[1:], torch.float16, capability, cfg.fitted(K), num_experts=E)
    assert [launch.name for launch in over.launches] == [
        "sort_ranks", "sort_prefix", "sort_groups", "sort_scatter", w13, "activations", "w2_prefill", "combine_valid"]
    groups = 640 // 8 + E
    assert over.max_groups == groups
    w13_launch = over.launch_for("w13")
    assert w13_launch.grid == (1 + groups * 10 * 5,)  # program 0 + (groups, 256-row splits, column tiles)
    assert dict(w13_launch.constexprs)["OVER_GROUPS"] is True
    assert [launch.grid for launch in over.launches if launch.name == "w2_prefill"] == [(groups, 10)]
    assert over.num_arrivals == 0 and over.sort_numel > 0
    names = {name for name, *_ in over.sort_regions}
    assert set(plan.GROUP_ARGS) <= names
    for launch in over.launches:
        params = launch.kernel.params
        assert len(launch.args) == len([p for p in params if not p.is_constexpr]), launch.name
        assert all(name in plan.ARGUMENT_TYPES for name in launch.args), launch.name
    stages = [launch.stage for launch in plan.grouped_plan(M, *SHAPE[1:], torch.float16, capability, cfg.fitted(K),
                                                            stages=("w13",), num_experts=E).launches]
    assert stages == ["w13"]
    with pytest.raises(ValueError, match="needs the expert count"):
        plan.grouped_plan(M, *SHAPE[1:], torch.float16, capability, cfg.fitted(K))
    per_row = qwen_plan(M, GroupedConfig(), capability)
    assert per_row.sort_numel == 0 and not dict(per_row.launch_for("w13").constexprs)["OVER_GROUPS"]
    # 16-row groups: the sort's T, W13's two B operands and W2's two token blocks follow
    wide = plan.grouped_plan(M, *SHAPE[1:], torch.float16, capability,
                             GroupedConfig(w13_over_groups=True, group_blocks=2).fitted(K), num_experts=E)
    assert wide.max_groups == 640 // 16 + E
    assert dict(next(l for l in wide.launches if l.name == "sort_groups").constexprs)["T"] == 16
    assert dict(wide.launch_for("w13").constexprs)["GROUP_BLOCKS"] == 2
    assert dict(next(l for l in wide.launches if l.name == "w2_prefill").constexprs)["TOKEN_BLOCKS"] == 2


@pytest.mark.parametrize("over_groups", [False, True])
def test_the_ids_debug_mode_plans_flag_ids_once(over_groups):
    """check_ids: the per-row W13 flags ids outside [0, E), or over groups the sort's first launch
    (which sees every routed row); the flag is then a required argument, and nothing else changes."""
    cfg = GroupedConfig(w13_over_groups=over_groups).fitted(K)
    E = SHAPE[0]
    checked = plan.grouped_plan(64, *SHAPE[1:], torch.float16, (9, 0), cfg, num_experts=E, check_ids=True)
    plain = plan.grouped_plan(64, *SHAPE[1:], torch.float16, (9, 0), cfg, num_experts=E)
    flags = {launch.name: dict(launch.constexprs).get("CHECK_IDS") for launch in checked.launches}
    want = "sort_ranks" if over_groups else "w13_gluon"
    assert [name for name, on in flags.items() if on] == [want]
    assert not any(dict(launch.constexprs).get("CHECK_IDS") for launch in plain.launches)
    assert [launch.name for launch in checked.launches] == [launch.name for launch in plain.launches]
    assert all("id_flag" in launch.args for launch in checked.launches if launch.name == want)
    with pytest.raises(ValueError, match="needs its int32 device flag"):
        plan._checked_flag(None, True)
    assert plan._checked_flag(torch.zeros(1, dtype=torch.int32), False) is None
    prefill = plan.prefill_plan(64, *SHAPE[1:2], E, *SHAPE[2:], torch.float16, (9, 0), config.PrefillConfig(),
                                check_ids=True)
    assert [launch.name for launch in prefill.launches if dict(launch.constexprs).get("CHECK_IDS")] == ["sort_ranks"]


def test_raise_on_flagged_ids_names_the_problem_and_clears_the_flag():
    from moe_grouped_decode.ops import cuda

    flag = torch.zeros(1, dtype=torch.int32)
    cuda._ID_FLAGS[torch.device("cpu")] = flag
    try:
        cuda.raise_on_flagged_ids("cpu")  # clear: nothing to say
        flag[0] = 1
        with pytest.raises(ValueError, match=r"routed id outside \[0, num_experts\).*MOE_GROUPED_DECODE_CHECK_IDS"):
            cuda.raise_on_flagged_ids("cpu")
        assert int(flag[0]) == 0
        cuda.raise_on_flagged_ids()  # cleared by the error
    finally:
        del cuda._ID_FLAGS[torch.device("cpu")]


def test_largest_carveout_launches_binaries_of_their_own():
    """A config that prefers the largest carveout launches other JIT functions than the same config
    without it (carveout.py: the preference sticks to a compiled kernel)."""
    table = GroupedConfig(w2_kernel="gluon", max_shared_carveout=True)
    without = dataclasses.replace(table, max_shared_carveout=False)
    with_launches, without_launches = qwen_plan(2, table).launches, qwen_plan(2, without).launches
    assert [launch.max_shared_carveout for launch in with_launches] == [True, True]
    assert [launch.max_shared_carveout for launch in without_launches] == [False, False]
    for a, b in zip(with_launches, without_launches):
        assert a.name == b.name and a.kernel is not b.kernel and a.constexprs == b.constexprs
    # the interpreter runs no CUfunction: no preference to give
    assert not any(launch.max_shared_carveout for launch in qwen_plan(2, table, capability=(0, 0)).launches)


# --------------------------------------------------------------------------- the prefill route


def test_prefill_table_buckets_and_fallbacks():
    """An entry serves every M up to its own; above the last, the last; another GPU takes the
    default GPU's entries; a shape with no table the defaults."""
    from moe_grouped_decode.kernels.config import PrefillConfig, prefill_config

    entries = sorted(tables.find_table(H200, SHAPE, "fp16").prefill, key=lambda e: e["M"])
    bounds = [e["M"] for e in entries]
    for M in (1, bounds[0], bounds[0] + 1, bounds[-1], 4 * bounds[-1]):
        want = next((e for e in entries if e["M"] >= M), entries[-1])
        assert prefill_config(SHAPE, H200, "fp16", M) == PrefillConfig(**want["config"])
        assert prefill_config(SHAPE, "NVIDIA A100-SXM4-80GB", "fp16", M) == prefill_config(SHAPE, H200, "fp16", M)
    assert prefill_config((64, 4, 1024, 96, 32), H200, "fp16", 3) == PrefillConfig()
    with pytest.raises(ValueError, match="token_blocks must be 1, 2 or 4"):
        PrefillConfig(token_blocks=3)


@pytest.mark.parametrize("cfg", [plan.PrefillConfig(), plan.PrefillConfig(token_blocks=4, w13_warps=8, w2_warps=8)])
def test_prefill_plan_launches_match_the_kernels(cfg):
    """Every prefill launch names as many runtime arguments as its kernel takes, every constexpr
    it declares, and only scratch regions the plan lays out (aligned, inside the scratch)."""
    prefill = plan.prefill_plan(300, 10, 512, 2560, 160, 32, torch.bfloat16, (9, 0), cfg)
    assert [launch.stage for launch in prefill.launches] == ["sort"] * 4 + ["w13", "w2", "combine"]
    regions = {name for name, *_ in prefill.regions}
    for launch in prefill.launches:
        params = launch.kernel.params
        assert len(launch.args) == len([p for p in params if not p.is_constexpr]), launch.name
        assert set(dict(launch.constexprs)) == {p.name for p in params if p.is_constexpr}, launch.name
        assert all(name in plan.ARGUMENT_TYPES for name in launch.args)
    scratch = torch.zeros(prefill.scratch_numel, dtype=torch.int32)
    views = prefill.scratch_views(scratch)
    assert set(views) == regions
    assert views["row_out16"].shape == (3000, 2560) and views["row_out16"].dtype == torch.bfloat16
    assert views["act16"].shape == (3000, 160)
    for name, offset, shape, half in prefill.regions:
        assert offset % 16 == 0  # 64-byte aligned
    # the W13 grid covers the largest possible number of groups, five 32-column tiles each
    groups = -(-3000 // cfg.group_rows) + 512
    assert next(lu for lu in prefill.launches if lu.stage == "w13").grid == (groups * 5,)


@pytest.mark.parametrize("rows", [16, 64, 128])
def test_prefill_wgmma_plan_on_hopper_and_what_runs_elsewhere(rows):
    """A wgmma config plans the wgmma kernels on a Hopper where Gluon runs (every argument and
    constexpr its kernel takes; W13 over (group, 64 gate + 64 up columns), W2 over (group, 4 tiles
    of 128 columns)); on other GPUs and under the interpreter, the kernels that served those
    group sizes before: the mma kernels up to 32 rows, the dot kernels above."""
    cfg = plan.PrefillConfig(kernel="wgmma", block_rows=rows, w13_stages=4, w2_stages=4)
    hopper = plan.prefill_plan(300, 10, 512, 2560, 160, 32, torch.float16, (9, 0), cfg)
    groups = -(-3000 // rows) + 512
    names = {launch.stage: launch.name for launch in hopper.launches}
    if plan.gluon_runs((9, 0)):
        assert names["w13"] == "w13_prefill_wgmma" and names["w2"] == "w2_prefill_wgmma"
        for launch in hopper.launches:
            params = launch.kernel.params
            assert len(launch.args) == len([p for p in params if not p.is_constexpr]), launch.name
            assert set(dict(launch.constexprs)) == {p.name for p in params if p.is_constexpr}, launch.name
        grids = {launch.stage: launch.grid for launch in hopper.launches}
        assert grids["w13"] == (groups * 3,) and grids["w2"] == (groups * 5,)
        assert dict(next(lu for lu in hopper.launches if lu.stage == "w13").constexprs)["BLOCK_ROWS"] == rows
    for capability in ((8, 0), (10, 0), (0, 0)):
        other = plan.prefill_plan(300, 10, 512, 2560, 160, 32, torch.float16, capability, cfg)
        w13 = next(launch for launch in other.launches if launch.stage == "w13")
        assert w13.name == ("w13_prefill" if rows <= 32 else "w13_prefill_dot"), (capability, w13.name)
        # the sort groups the rows for the kernels that run: the plan carries their config
        assert other.config == plan.prefill_config_run(cfg, capability, 2560, 160, 32)
        assert other.config.group_rows == (8 if rows <= 32 else rows)
        sort_groups = next(launch for launch in other.launches if launch.name == "sort_groups")
        assert dict(sort_groups.constexprs)["T"] == other.config.group_rows
    # a group's act rows too large for W2's shared memory (N = 1024: over 96 KiB from 64 rows on):
    # the other kernels, on a Hopper too
    wide = plan.prefill_plan(300, 10, 512, 2560, 1024, 32, torch.float16, (9, 0), cfg)
    if plan.gluon_runs((9, 0)):
        assert any("wgmma" in launch.name for launch in wide.launches) == (rows == 16), rows
    with pytest.raises(ValueError, match="wgmma kernels take"):
        plan.PrefillConfig(kernel="wgmma", block_rows=256)
    with pytest.raises(ValueError, match="wgmma kernels take"):
        plan.PrefillConfig(kernel="wgmma", w13_block_k=512)
    # W13 steps longer than the hidden size divides (K = 2688 = 21 x 128): 64-row steps, none dropped
    long_steps = plan.PrefillConfig(kernel="wgmma", block_rows=rows, w13_block_k=256)
    if plan.gluon_runs((9, 0)):
        assert plan.prefill_config_run(long_steps, (9, 0), 2688, 160, 32).w13_block_k == 64
        assert plan.prefill_config_run(long_steps, (9, 0), 2560, 160, 32).w13_block_k == 256


@pytest.mark.parametrize("N,tiles,per_group", [(160, "wide", 3), (160, "narrow", 5), (128, "wide", 2), (128, "narrow", 4)])
def test_wgmma_w13_tilings_plan_one_program_per_column_block(N, tiles, per_group):
    """W13's grid: per sorted group one program per 64 columns (wide, the last padded where 64 does
    not divide N) or per 32 (narrow), over the largest possible number of groups; the kernel gets
    the tiling as a constexpr. An unknown tiling is refused."""
    with pytest.raises(ValueError, match="w13_tiles must be"):
        plan.PrefillConfig(kernel="wgmma", w13_tiles="tail")
    cfg = plan.PrefillConfig(kernel="wgmma", block_rows=16, w13_tiles=tiles)
    hopper = plan.prefill_plan(300, 10, 512, 2560, N, 32, torch.float16, (9, 0), cfg)
    if plan.gluon_runs((9, 0)):
        w13 = next(lu for lu in hopper.launches if lu.stage == "w13")
        assert w13.grid == ((-(-3000 // 16) + 512) * per_group,) and dict(w13.constexprs)["TILES"] == tiles


@pytest.mark.parametrize("tiles,unrolled", [(4, 8), (2, 8), (1, 16)])
def test_wgmma_w2_tiles_and_unrolled_pieces_reach_the_kernel(tiles, unrolled):
    """W2's grid: per sorted group one program per ``w2_tiles_per_program`` 128-column tiles (the
    last program's tiles past K masked), and the kernel gets the tiles and the unroll bound as
    constexprs. Values outside what the kernel takes are refused."""
    cfg = plan.PrefillConfig(kernel="wgmma", block_rows=16, w2_stages=12, w2_tiles_per_program=tiles,
                             w2_unrolled_pieces=unrolled)
    hopper = plan.prefill_plan(300, 8, 128, 2176, 384, 128, torch.float16, (9, 0), cfg)  # 17 tiles of W2
    if plan.gluon_runs((9, 0)):
        w2 = next(lu for lu in hopper.launches if lu.stage == "w2")
        assert w2.grid == ((-(-2400 // 16) + 128) * -(-17 // tiles),)
        constexprs = dict(w2.constexprs)
        assert constexprs["TILES_PER_PROGRAM"] == tiles and constexprs["UNROLL_UP_TO"] == unrolled
    for bad in ({"w2_tiles_per_program": 3}, {"w2_tiles_per_program": 8}, {"w2_unrolled_pieces": 0},
                {"w2_unrolled_pieces": 17}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            plan.PrefillConfig(kernel="wgmma", **bad)
    for kernel in ("mma", "dot"):  # the knobs of the wgmma kernels only: no two configs that run alike
        with pytest.raises(ValueError, match="wgmma kernels'"):
            plan.PrefillConfig(kernel=kernel, block_rows=32, w2_tiles_per_program=tiles, w2_unrolled_pieces=16)


def test_prefill_entries_this_version_cannot_read_are_skipped():
    """A prefill table entry with a field this version does not know (written by a newer tune) or
    values that make no valid config is skipped: the entries around it serve, or the default."""
    from moe_grouped_decode import tables
    from moe_grouped_decode.kernels.config import PrefillConfig, prefill_config, prefill_config_from_fields

    shape, gpu = (64, 4, 1024, 96, 32), "NVIDIA Test GPU"
    good = {"kernel": "wgmma", "block_rows": 32, "w13_stages": 3, "w2_stages": 4}
    table = tables.MeasuredTable(
        name="skip-test", gpu=gpu, shape=shape, dtype="fp16", versions={}, generator="test",
        routes=tables.RouteTable(tokens=(1,), routes=("prefill",), plugin_us=(1.0,), vllm_us={"marlin": (2.0,)},
                                 grouped_tokens=None),
        prefill=({"M": 64, "config": {**good, "w2_future_knob": 1}}, {"M": 256, "config": good},
                 {"M": 1024, "config": {"token_blocks": 3}}))
    assert prefill_config_from_fields({**good, "w2_future_knob": 1}) is None
    assert prefill_config_from_fields({"token_blocks": 3}) is None and prefill_config_from_fields(None) is None
    with tables.table_registered(table):
        for M in (1, 64, 256, 4096):  # the readable entry serves below it and, the last one, above
            assert prefill_config(shape, gpu, "fp16", M) == PrefillConfig(**good), M


def test_prefill_warmup_counts_compile_every_binary_a_count_launches():
    """Warming the prefill route at ``prefill_warmup_counts(N)`` compiles every (kernel,
    constexprs, options) any M up to N launches: nothing left to compile while serving."""
    from moe_grouped_decode.kernels.config import prefill_config
    from moe_grouped_decode.ops.cuda import prefill_warmup_counts

    def binaries(M):
        cfg = prefill_config(SHAPE, H200, "fp16", M)
        launches = plan.prefill_plan(M, 10, 512, 2560, 160, 32, torch.float16, (9, 0), cfg).launches
        return {(launch.name, launch.constexprs, launch.options) for launch in launches}

    N = 3000
    warmed = set().union(*(binaries(M) for M in prefill_warmup_counts(N)))
    for M in list(range(1, N + 1, 37)) + [2, 129, 160, 161, 191, 192, 193, 255, 256, 257, 511, 512, 513, 1025, N - 1, N]:
        assert binaries(M) <= warmed, M


def test_compiles_after_warmup_are_reported_once_and_chained(monkeypatch):
    """The vLLM plugin's guard that warmup covered every binary: a Triton compile of one of this
    package's kernels outside ``warmup`` is reported once per specialization; other packages'
    compiles and compiles inside warmup are not; any hook set before (vLLM's JIT monitor) still
    sees every compile."""
    import types

    import triton

    from moe_grouped_decode.ops import cuda

    chained, logged = [], []
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", lambda **kw: chained.append(kw["key"]))
    monkeypatch.setattr(cuda, "_compile_watch", {})
    assert cuda.watch_compiles_after_warmup(logged.append)
    hook = triton.knobs.runtime.jit_post_compile_hook
    ours = types.SimpleNamespace(module="moe_grouped_decode.kernels.w13_tl", name="_w13_tl")
    theirs = types.SimpleNamespace(module="vllm.model_executor.layers.fused_moe", name="fused_moe_kernel")
    hook(key="a", repr="_w13_tl[num_warps=1](...)", fn=ours)
    hook(key="a", repr="_w13_tl[num_warps=1](...)", fn=ours)  # the same binary: said once
    hook(key="b", repr="_w13_tl[num_warps=4](...)", fn=ours)
    hook(key="c", repr="fused_moe_kernel(...)", fn=theirs)  # not ours: vLLM's monitor speaks for it
    monkeypatch.setattr(cuda, "_warming", 1)
    hook(key="d", repr="_w13_tl[...]", fn=ours)  # inside warmup: what warmup is for
    assert len(logged) == 2 and all("_w13_tl" in line and "after the plugin's warmup" in line for line in logged)
    assert chained == ["a", "a", "b", "c", "d"]
    assert cuda.watch_compiles_after_warmup(logged.append)  # installed once: the hook is not wrapped again
    assert triton.knobs.runtime.jit_post_compile_hook is hook
