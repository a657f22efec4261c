"""Launch configs (kernels/configs.py): the qwen3.8-tp4 table, the autotune cache, and which
compile options a config turns into on which GPU. CPU only: no kernel runs here."""

import dataclasses
import json

import pytest

from moe_grouped_decode.kernels import configs
from moe_grouped_decode.kernels.configs import MAX_SPLIT_K, QWEN38_TP4_SHAPE, GroupedConfig

K = QWEN38_TP4_SHAPE[2]


@pytest.mark.parametrize("tokens", sorted(configs._QWEN38_TP4_GROUPED))  # every table entry
def test_table_entries_are_used_as_written(tokens):
    entry = configs._QWEN38_TP4_GROUPED[tokens]
    # grouped_config fits what it returns; an entry that needed fitting would run with other
    # splits than the ones measured
    assert entry == entry.fitted(K)
    assert configs.grouped_config(QWEN38_TP4_SHAPE, "fp16", tokens) == entry
    assert 1 <= entry.w13_splits(K) <= MAX_SPLIT_K  # the workspace's partials region holds them
    # the table was measured with the Gluon W13 (1-warp programs, a ring) on splits that tile K
    assert entry.w13_ring_stages > 0 and entry.w13_warps == 1 and K % entry.w13_block_k == 0


@pytest.mark.parametrize("tokens", sorted(configs._QWEN38_TP4_GROUPED_TL))  # every entry of the tl W13's table
def test_without_the_gluon_w13_the_tl_table_is_used(tokens):
    entry = configs._QWEN38_TP4_GROUPED_TL[tokens]
    assert entry == entry.fitted(K) and entry.w13_ring_stages == 0
    assert configs.grouped_config(QWEN38_TP4_SHAPE, "fp16", tokens, ring=False) == entry
    assert configs.shape_key(QWEN38_TP4_SHAPE, "fp16", tokens, ring=False) != configs.shape_key(
        QWEN38_TP4_SHAPE, "fp16", tokens)  # tuned with and without the ring: kept apart


def test_unlisted_shape_gets_the_fitted_default():
    shape = (64, 4, 1024, 96, 32)
    assert configs.grouped_config(shape, "fp16", 3) == GroupedConfig().fitted(shape[2])


@pytest.mark.parametrize("capability, expected", [
    ((9, 0), {"maxnreg": 128}),  # Hopper: measured there, compiles without spills
    ((10, 0), {"maxnreg": 128}),  # newer
    ((8, 0), {}),  # Ampere: sm_80's schedule spills at 128 (tests/test_sass_stats.py compiles both)
    ((0, 0), {}),  # the interpreter
])
def test_w2_register_cap_applies_from_hopper_on(capability, expected):
    assert GroupedConfig(w2_max_registers=128).w2_compile_options(capability) == expected
    assert GroupedConfig().w2_compile_options(capability) == {}  # no cap asked, none given


@pytest.mark.parametrize("ring", [True, False])  # the Gluon W13 available (a GPU with Gluon) or not
def test_candidates_hold_the_register_cap_only_where_it_applies(ring):
    hopper, ampere = configs.grouped_candidates((9, 0), ring), configs.grouped_candidates((8, 0), ring)
    tl_w2 = [c for c in hopper if not c.w2_ring]
    assert len(set(hopper)) == len(hopper) and len(tl_w2) == 2 * len([c for c in ampere if not c.w2_ring])
    assert {c.w2_max_registers for c in ampere} == {0}  # the cap is a no-op there: no duplicate timings
    assert set(ampere) < set(hopper)


@pytest.mark.parametrize("ring", [True, False])  # the Gluon W13 available (a GPU with Gluon) or not
def test_autotune_can_find_the_table_configs(ring):
    """Every qwen3.8-tp4 table entry is one of the autotune's candidates on Hopper (where the table
    was measured), so a search never loses to the table for want of trying it."""
    candidates = set(configs.grouped_candidates((9, 0), ring))
    for M in (2, 4, 8):
        assert configs.grouped_config(configs.QWEN38_TP4_SHAPE, "fp16", M, ring) in candidates, M


def test_candidates_ask_for_the_ring_only_where_it_runs():
    with_ring, without = configs.grouped_candidates((9, 0), True), configs.grouped_candidates((9, 0), False)
    # without Gluon a ring depth would silently time the tl kernel twice
    assert {c.w13_ring_stages for c in without} == {0}
    assert {c.w13_ring_stages for c in with_ring} == {2, 3, 4}
    assert {c.w2_ring for c in without} == {False}  # nor the Gluon W2
    gluon_w2 = {(c.w2_warps, c.w2_max_registers, c.w2_copy_ahead, c.max_shared_carveout)
                for c in with_ring if c.w2_ring}
    # (warps, register cap, chunks copied ahead, the largest carveout: the 4-warp W2 runs beside W13)
    assert gluon_w2 == {(4, 0, 3, True), (4, 128, 3, True), (8, 0, 2, False)}
    assert not any(c.max_shared_carveout for c in with_ring + without if not c.w2_ring)
    # the ring candidates' splits tile K = 2560 (no masked chunks) and need no fitting
    assert all(K % c.w13_block_k == 0 and c == c.fitted(K) for c in with_ring)


def test_tuned_cache_round_trip_and_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_GROUPED_DECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(configs, "_tuned", {})
    monkeypatch.setattr(configs, "_loaded_files", set())
    path = configs.cache_path("NVIDIA H200 (test)", "3.6.0")
    assert path.parent == tmp_path and " " not in path.name
    assert configs.KERNELS_VERSION in path.name  # configs tuned for other kernels are not read back
    tuned = GroupedConfig(w13_block_k=256, w2_warps=8, w2_max_registers=128, w2_ring=True, w2_copy_ahead=3)
    key = configs.shape_key(QWEN38_TP4_SHAPE, "fp16", 4)
    configs.store_tuned(path, key, tuned)
    # a tuned entry wins over the table
    assert configs.grouped_config(QWEN38_TP4_SHAPE, "fp16", 4) == tuned.fitted(K)
    assert configs.grouped_config(QWEN38_TP4_SHAPE, "bf16", 4) == configs._QWEN38_TP4_GROUPED[4].fitted(K)
    # a fresh process reads it back; entries of another version of GroupedConfig are skipped
    entries = json.loads(path.read_text())
    entries["E1_k1_K32_N32_G32_fp16_M1"] = dict(dataclasses.asdict(tuned), field_of_the_future=1)
    older = dataclasses.asdict(tuned)
    del older["max_shared_carveout"]  # as v12's files before 3fbe300 hold them
    entries["E1_k1_K32_N32_G32_fp16_M2"] = older
    path.write_text(json.dumps(entries))
    monkeypatch.setattr(configs, "_tuned", {})
    monkeypatch.setattr(configs, "_loaded_files", set())
    configs.load_tuned(path)
    assert configs.tuned_config(QWEN38_TP4_SHAPE, "fp16", 4) == tuned
    assert configs.tuned_config((1, 1, 32, 32, 32), "fp16", 1) is None
    assert configs.tuned_config((1, 1, 32, 32, 32), "fp16", 2) is None


def test_corrupt_cache_file_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setattr(configs, "_tuned", {})
    monkeypatch.setattr(configs, "_loaded_files", set())
    path = tmp_path / "grouped_x.json"
    path.write_text("{not json")
    configs.load_tuned(path)
    assert configs._tuned == {}


@pytest.mark.parametrize("capability, warps, stages, switch, expected", [
    ((9, 0), 1, 4, None, True),  # a Hopper GPU, the default config: the Gluon W13
    ((8, 0), 1, 2, None, True),  # Ampere as well (cp.async is sm_80; CI compiles it for sm_80)
    ((0, 0), 1, 4, None, False),  # the interpreter (CPU CI): Gluon cannot run there
    ((9, 0), 2, 4, None, False),  # 2-warp W13 programs: only the tl kernel has them
    ((9, 0), 1, 0, None, False),  # a config without a ring
    ((9, 0), 1, 4, "0", False),  # the rollback switch
])
def test_which_w13_kernel_runs(monkeypatch, capability, warps, stages, switch, expected):
    from moe_grouped_decode.env import GLUON_W13_ENV
    from moe_grouped_decode.kernels import grouped, w13_ring

    assert w13_ring.AVAILABLE  # CI's Triton has Gluon: otherwise every case below would say False
    if switch is None:
        monkeypatch.delenv(GLUON_W13_ENV, raising=False)
    else:
        monkeypatch.setenv(GLUON_W13_ENV, switch)
    assert grouped.uses_w13_ring(GroupedConfig(w13_warps=warps, w13_ring_stages=stages), capability) is expected


@pytest.mark.parametrize("ahead", [0, -1])  # 0: the edge; -1: would index before the first chunk
def test_a_gluon_w2_without_a_chunk_copied_ahead_is_refused(ahead):
    """The Gluon W2 was measured and tested with 1 or more chunks copied ahead of its mma (and a
    negative count would index before its first chunk): a config (from a hand-edited tuning
    cache, say) below that is refused before anything launches."""
    import torch

    from moe_grouped_decode.awq import synthetic_moe_weights
    from moe_grouped_decode.kernels import grouped
    from moe_grouped_decode.ops import alloc_workspace, workspace_views

    E, hidden, N, G, M, k = 8, 64, 32, 32, 2, 3
    gen = torch.Generator().manual_seed(0)
    weights = synthetic_moe_weights(E, hidden, N, G, dtype=torch.float16, seed=0)
    x = torch.randn(M, hidden, generator=gen).half()
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).int()
    topk_weights = torch.rand(M, k, generator=gen)
    views = workspace_views(alloc_workspace(M, k, hidden, N, "cpu"), M * k, hidden, N)
    config = dataclasses.replace(GroupedConfig(w2_ring=True), w2_copy_ahead=ahead).fitted(hidden)
    with pytest.raises(ValueError, match=rf"w2_copy_ahead \(the Gluon W2's .*\) must be at least 1, got {ahead}"):
        grouped.grouped_decode(x, topk_weights, ids, *weights.op_args(), views, torch.empty_like(x), config)
