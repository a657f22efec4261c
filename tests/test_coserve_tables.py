"""The co-serving table and verdict (tables.CoserveTable, tables.coserve_verdict): the window at
every edge, vLLM's own pick past it, the file format; and who serves a layer once co-serving is
on (contract.choose_method), on any machine: the tables and vLLM's answer are arguments here."""

import dataclasses
import json

import pytest
import torch

from moe_grouped_decode import tables
from moe_grouped_decode.contract import LayerShape, choose_method

SHAPE = (128, 8, 2048, 768, 128)
LAYER = LayerShape(*SHAPE, torch.float16)
GPU = "Test GPU"
ROUTE_TOKENS = (1, 2, 8, 64, 1024, 16384)
COSERVE_TOKENS = (1, 2, 3, 4, 6, 8)


def coserve(speedups, tokens=COSERVE_TOKENS, humming_factor=2.0, launch=()):
    """vLLM's Marlin is speedups[i] x the co-served kernel's time at tokens[i]; Humming ``humming_factor`` x Marlin."""
    shared = tuple(5.0 + m for m in tokens)
    marlin = tuple(us * s for us, s in zip(shared, speedups))
    return tables.CoserveTable(tokens=tuple(tokens), coserved_us=shared,
                               vllm_us={"marlin": marlin, "humming": tuple(humming_factor * us for us in marlin)},
                               launch=launch, generator="tests/test_coserve_tables.py")


def table(coserved, marlin_over_humming=(0.5,) * 6, plugin_speedups=(2.0, 1.5, 0.8, 0.7, 0.7, 0.7)):
    """A table the plugin whole does not win (``plugin_speedups``: vLLM's best over it), whose route
    table has Marlin at ``marlin_over_humming[i]`` x Humming's time."""
    plugin = tuple(10.0 + m for m in ROUTE_TOKENS)
    marlin = tuple(us * s for us, s in zip(plugin, plugin_speedups))
    humming = tuple(us / r for us, r in zip(marlin, marlin_over_humming))
    return tables.MeasuredTable(
        gpu=GPU, shape=SHAPE, dtype="fp16", name="test", generator="tests", versions={},
        routes=tables.RouteTable(tokens=ROUTE_TOKENS, routes=("grouped",) * 2 + ("prefill",) * 4, plugin_us=plugin,
                                 vllm_us={"marlin": marlin, "humming": humming}, grouped_tokens=(1, 2)),
        coserve=coserved)


def test_the_window_runs_from_one_token_to_the_last_count_before_the_first_loss():
    v = tables.coserve_verdict(table(coserve((2.0, 1.8, 1.5, 1.2, 1.0, 1.3))), "MARLIN")
    assert v.window == (1, 4)  # a tie at 6 ends it; 8's win is past the first loss
    assert "at 1..4 tokens (at least 1.20x)" in v.reason


def test_a_gain_inside_the_margin_ends_the_window():
    assert tables.COSERVE_MARGIN == 1.05
    assert tables.coserve_verdict(table(coserve((1.5, 1.06, 1.04, 2.0, 2.0, 2.0))), "MARLIN").window == (1, 2)
    v = tables.coserve_verdict(table(coserve((1.03,) + (2.0,) * 5)), "MARLIN")
    assert v.window is None and "not 1.05x as fast as vLLM at 1 token" in v.reason


def test_no_window_where_the_kernel_loses_at_one_token_or_nothing_was_measured():
    assert tables.coserve_verdict(table(coserve((0.9, 2.0, 2.0, 2.0, 2.0, 2.0))), "MARLIN").window is None
    assert tables.coserve_verdict(table(None), "MARLIN").window is None
    late = coserve((2.0,) * 5, tokens=(2, 3, 4, 6, 8))
    assert "not measured" in tables.coserve_verdict(table(late), "MARLIN").reason


def test_the_faster_of_vllms_backends_is_the_bar_inside_the_window():
    # Humming at 0.6 x Marlin: the kernel must beat 0.6 x 1.5 = 0.9 of its time at M = 3
    v = tables.coserve_verdict(table(coserve((2.0, 1.8, 1.5, 1.5, 1.5, 1.5), humming_factor=0.6)), "MARLIN")
    assert v.window == (1, 2)


def test_an_unmeasured_backend_ends_the_window():
    c = coserve((2.0,) * 6)
    holes = list(c.vllm_us["humming"])
    holes[2] = None
    v = tables.coserve_verdict(table(dataclasses.replace(c, vllm_us={**c.vllm_us, "humming": tuple(holes)})), "MARLIN")
    assert v.window == (1, 2)


def test_a_backend_unmeasured_at_one_token_is_said():
    c = coserve((2.0,) * 6)
    c = dataclasses.replace(c, vllm_us={**c.vllm_us, "humming": (None,) * 6})
    v = tables.coserve_verdict(table(c), "MARLIN")
    assert v.window is None and "vLLM's humming not measured at 1 token" in v.reason


def test_where_vllm_would_pick_humming_marlin_must_keep_up_past_the_window():
    wins = coserve((2.0,) * 6)
    # Marlin faster than Humming everywhere: co-serving (Marlin past the window) loses nothing
    assert tables.coserve_verdict(table(wins), "HUMMING").window == (1, 8)
    # Humming faster at 64 tokens: forcing Marlin would make those steps slower than stock vLLM
    slower = table(wins, marlin_over_humming=(0.5, 0.5, 0.5, 1.2, 0.5, 0.5))
    v = tables.coserve_verdict(slower, "HUMMING")
    assert v.window is None and "faster than Marlin" in v.reason and "M=64" in v.reason
    # inside the window the route table's Marlin/Humming order does not matter
    assert tables.coserve_verdict(table(wins, marlin_over_humming=(1.2, 1.2, 0.5, 0.5, 0.5, 0.5)),
                                  "HUMMING").window == (1, 8)
    # and the engine's step bounds how far it must keep up
    assert tables.coserve_verdict(slower, "HUMMING", max_tokens=8).window == (1, 8)
    # where vLLM picks Marlin itself, co-serving runs exactly its kernel past the window
    assert tables.coserve_verdict(slower, "MARLIN").window == (1, 8)


def test_where_vllm_picks_humming_the_kernel_over_hummings_tensors_serves_with_humming_past_it():
    # Humming faster than Marlin past every window: forcing Marlin is refused, keeping Humming is not
    slower = table(coserve((2.0,) * 6), marlin_over_humming=(0.5, 0.5, 0.5, 1.2, 1.2, 1.2))
    assert tables.coserve_verdict(slower, "HUMMING").window is None
    over_humming = dataclasses.replace(slower, coserve_humming=coserve((2.0, 1.9, 1.1, 1.04, 2.0, 2.0)))
    v = tables.coserve_verdict(over_humming, "HUMMING")
    assert v.window == (1, 3) and v.layout == "humming"  # 1.04x at 4 tokens is inside the margin
    assert "on vLLM's Humming tensors at 1..3 tokens (at least 1.10x), vLLM's Humming above" in v.reason
    # where vLLM picks Marlin the Marlin table decides, whatever the Humming one says
    v = tables.coserve_verdict(over_humming, "MARLIN")
    assert v.window == (1, 8) and v.layout == "marlin"


def test_where_the_kernel_over_hummings_tensors_loses_the_marlin_rule_still_applies():
    losing = coserve((1.0,) * 6)
    keeps_up = dataclasses.replace(table(coserve((2.0,) * 6)), coserve_humming=losing)
    v = tables.coserve_verdict(keeps_up, "HUMMING")  # Marlin faster than Humming everywhere in the route table
    assert v.window == (1, 8) and v.layout == "marlin"
    neither = dataclasses.replace(keeps_up, routes=table(None, marlin_over_humming=(0.5, 0.5, 0.5, 1.2, 1.2, 1.2)).routes)
    v = tables.coserve_verdict(neither, "HUMMING")
    assert v.window is None
    assert "the co-served kernel over Humming's tensors is not 1.05x as fast" in v.reason
    assert "over Marlin's: vLLM would run humming, faster than Marlin" in v.reason


def test_a_co_serving_table_over_hummings_tensors_round_trips_and_is_checked_by_its_name(tmp_path):
    launch = ({"M": 4, "config": {"w13_warps": 1, "w13_chunks": 8, "w2_warps": 2, "fused_combine": True,
                                  "w2_n_splits": 2}},)
    t = dataclasses.replace(table(coserve((2.0,) * 6)), coserve_humming=coserve((1.5,) * 6, launch=launch))
    path = tables.write_table(t, tmp_path)
    assert tables.read_dir(tmp_path)[0] == t
    data = json.loads(path.read_text())
    data["coserve_humming"]["coserved_us"].pop()
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="every coserve_humming column must have one value per token count"):
        tables.read_dir(tmp_path)


def test_a_layer_where_vllm_picks_humming_is_co_served_over_hummings_tensors():
    over_humming = dataclasses.replace(table(coserve((2.0,) * 6), marlin_over_humming=(0.5, 0.5, 0.5, 1.2, 1.2, 1.2)),
                                       coserve_humming=coserve((2.0, 2.0, 0.9, 2.0, 2.0, 2.0)))
    with tables.table_registered(over_humming):
        choice = choose(vllm_backend="HUMMING")
        assert choice.route == "coserved" and choice.coserve_window == (1, 2) and choice.coserve_layout == "humming"
        choice = choose(vllm_backend="MARLIN")
        assert choice.coserve_window == (1, 8) and choice.coserve_layout == "marlin"


@pytest.mark.parametrize("backend", ["CPU", None, "TRITON"])
def test_no_co_serving_where_vllm_would_run_neither_marlin_nor_humming(backend):
    v = tables.coserve_verdict(table(coserve((2.0,) * 6)), backend)
    assert v.window is None and "not one co-serving is measured against" in v.reason


def test_a_co_serving_table_round_trips_through_its_file(tmp_path):
    launch = ({"M": 4, "config": {"w13_warps": 4, "w13_chunks": 2, "w2_warps": 1, "fused_combine": True}},
              {"M": 8, "config": {"w13_warps": 8, "w13_chunks": 2, "w2_warps": 2, "fused_combine": False,
                                  "w2_row_warps": 4}})
    t = table(coserve((2.0,) * 6, launch=launch))
    path = tables.write_table(t, tmp_path)
    assert tables.read_dir(tmp_path)[0] == t
    plain = table(None)
    tables.write_table(plain, tmp_path)
    assert "coserve" not in json.loads(path.read_text()) and tables.read_dir(tmp_path)[0].coserve is None


def test_a_launch_entry_without_the_act_launch_field_reads_as_the_default(tmp_path):
    """An entry without the field gets the config's default (W2 reduces the activations); one
    that sets it, its value."""
    from moe_grouped_decode.kernels.marlin_grouped import config_from_entry

    launch = ({"M": 4, "config": {"w13_warps": 1, "w13_chunks": 8, "w2_warps": 2, "fused_combine": True,
                                  "w2_n_splits": 4}},
              {"M": 8, "config": {"w13_warps": 1, "w13_chunks": 8, "w2_warps": 2, "fused_combine": True,
                                  "w2_n_splits": 4, "act_launch": True}})
    tables.write_table(table(coserve((2.0,) * 6, launch=launch)), tmp_path)
    back = tables.read_dir(tmp_path)[0].coserve.launch
    assert [config_from_entry(e).act_launch for e in back] == [False, True]


def test_every_launch_config_the_tune_can_pick_round_trips_through_its_table(tmp_path):
    """The tune writes each winner's every field (``dataclasses.asdict``): the table's format must
    take every field the launch config has, and give the same config back."""
    from moe_grouped_decode.benchmarking.coserve import COSERVE_CANDIDATES, launch_entries, parse_config
    from moe_grouped_decode.kernels.marlin_grouped import config_from_entry

    best = {m: dataclasses.asdict(parse_config(text)) for m, text in enumerate(COSERVE_CANDIDATES, start=1)}
    t = table(coserve((2.0,) * 6, launch=launch_entries(best)))
    tables.write_table(t, tmp_path)
    back = tables.read_dir(tmp_path)[0]
    assert back == t
    assert [config_from_entry(e) for e in back.coserve.launch] == [parse_config(x) for x in COSERVE_CANDIDATES]


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(tokens=[2, 1, 3, 4, 6, 8]), "ascending"),
    (lambda c: c["coserved_us"].pop(), "one value per token count"),
    (lambda c: c["vllm_us"]["marlin"].pop(), "one value per token count"),
    (lambda c: c.update(launch=[{"M": 4}]), "launch entries"),
    (lambda c: c.update(launch=[{"M": 0, "config": {"w13_warps": 4, "w13_chunks": 2, "w2_warps": 1,
                                                      "fused_combine": True}}]), "launch entries"),
    (lambda c: c.update(launch=[{"M": 4, "config": {"w13_warps": 4}}]), "launch entries"),
    (lambda c: c.update(launch=[{"M": 4, "config": {"w13_warps": 4, "w13_chunks": 2, "w2_warps": 1,
                                                      "fused_combine": True, "w2_cols": 2}}]), "launch entries"),
    (lambda c: c.update(launch=[{"M": 4, "config": {"w13_warps": 4, "w13_chunks": 2, "w2_warps": 1,
                                                      "fused_combine": True, "w2_row_warps": "4"}}]), "launch entries"),
    (lambda c: c.update(launch=[{"M": 4, "config": {"w13_warps": 0, "w13_chunks": 2, "w2_warps": 1,
                                                      "fused_combine": True}}]), "launch entries"),
    (lambda c: c.update(launch=[{"M": 4, "config": {"w13_warps": 4, "w13_chunks": 2, "w2_warps": 1,
                                                      "fused_combine": 1}}]), "launch entries"),
    (lambda c: c.update(launch=[{"M": 4, "config": {"w13_warps": 4, "w13_chunks": 2, "w2_warps": 1,
                                                      "fused_combine": True, "act_launch": 1}}]), "launch entries"),
    (lambda c: c.update(launch=[{"M": True, "config": {"w13_warps": 4, "w13_chunks": 2, "w2_warps": 1,
                                                         "fused_combine": True}}]), "launch entries"),
    (lambda c: c["coserved_us"].__setitem__(0, 0.0), "positive"),
    (lambda c: c["vllm_us"]["marlin"].__setitem__(1, -1.0), "positive"),
    (lambda c: c.pop("tokens"), "'tokens'"),
])
def test_a_broken_co_serving_table_is_an_error_naming_the_file(tmp_path, change, message):
    data = tables.table_to_json(table(coserve((2.0,) * 6)))
    change(data["coserve"])
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as error:
        tables.read_dir(tmp_path)
    assert str(path) in str(error.value)


def choose(device=GPU, vllm_backend="MARLIN", coserve=True, plugin_on=True, force=False):
    return choose_method(LAYER, device, plugin_on=plugin_on, force=force, vllm_backend=vllm_backend, coserve=coserve)


def test_a_declined_layer_is_co_served_in_its_window_on_its_gpu():
    with tables.table_registered(table(coserve((2.0, 1.8, 1.5, 0.9, 1.2, 1.2)))):
        choice = choose()
        assert choice.route == "coserved" and choice.coserve_window == (1, 3)
        assert not choice.served_by_plugin and not choice.admission and choice.reason.startswith("co-served")
        assert choose(device="Another GPU").route == "vllm"  # the table is this GPU's
        assert choose(coserve=False).route == "vllm"  # not on a CUDA device, or the switch off
        assert choose(plugin_on=False).route == "vllm"
        assert choose(force=True).served_by_plugin  # forcing takes the whole layer


def test_batch_invariant_mode_is_not_co_served(monkeypatch):
    """A token's bits must not depend on M: co-serving would switch kernels at the window's end."""
    monkeypatch.setenv("MOE_GROUPED_DECODE_BATCH_INVARIANT", "1")
    with tables.table_registered(table(coserve((2.0,) * 6))):
        assert choose().route == "vllm"


def test_a_table_that_admits_the_plugin_whole_is_not_co_served():
    wins_whole = dataclasses.replace(table(coserve((2.0,) * 6)), routes=table(None, plugin_speedups=(2.0,) * 6).routes)
    with tables.table_registered(wins_whole):
        assert choose().route == "grouped" and choose().served_by_plugin  # its grouped window, the plugin whole


def test_a_layer_co_serving_cannot_help_stays_with_vllm_and_says_why():
    with tables.table_registered(table(coserve((0.8,) * 6))):
        choice = choose()
    assert choice.route == "vllm" and choice.coserve_window is None and "not admitted" in choice.reason


def test_where_vllm_runs_humming_and_only_marlins_tensors_were_measured_the_reason_says_how_to_measure():
    with tables.table_registered(table(coserve((2.0,) * 6), marlin_over_humming=(0.5, 0.5, 0.5, 1.2, 1.2, 1.2))):
        choice = choose(vllm_backend="HUMMING")
        assert choice.route == "vllm" and "not admitted" in choice.reason
        assert ("not co-served where vLLM runs Humming: not measured over its tensors (`python -m moe_grouped_decode "
                "tune --shape 128,8,2048,768,128 --dtype fp16 --coserve-only` measures it)") in choice.reason
        assert "Humming" not in choose(vllm_backend="MARLIN", coserve=False).reason


def test_the_supported_models_row_says_where_a_shape_is_co_served():
    from moe_grouped_decode.benchmarking import supported

    row = supported.row("a model", table(coserve((2.0, 1.8, 1.5, 0.9, 1.2, 1.2))))
    assert "no: stays with vLLM, **co-served at 1..3 tokens** (the plugin's kernel on vLLM's Marlin tensors), vLLM's Marlin above" in row
    assert row.count("no: stays with vLLM") == 1 and "1.50-2.00x at 1..3" in row
    assert "whole: vLLM is as fast or faster at M=8" in row
    humming_faster = table(coserve((2.0,) * 6), marlin_over_humming=(0.5, 0.5, 0.5, 1.2, 0.5, 0.5))
    assert "(not where vLLM picks Humming)" in supported.row("a model", humming_faster)
    assert "co-served" not in supported.row("a model", table(coserve((0.5,) * 6)))
    one = supported.row("a model", table(coserve((1.5, 1.0, 2.0, 2.0, 2.0, 2.0))))
    assert "**co-served at 1 token**" in one and "1.50x at 1 |" in one
    # a longer window over Humming's tensors: the speedup span names the counts it covers, both windows'
    longer = dataclasses.replace(table(coserve((2.0, 1.5, 1.0, 2.0, 2.0, 2.0))),
                                 coserve_humming=coserve((2.0, 1.5, 1.2, 1.1, 0.9, 2.0), humming_factor=3.0))
    wider = supported.row("a model", longer)
    assert "**co-served at 1..2 tokens**" in wider and "(1..4 over Humming's tensors where vLLM picks Humming)" in wider
    assert "1.10-2.00x at 1..4 |" in wider


def launch_fields(w13_warps, w13_chunks, w2_warps, fused_combine=True, w2_row_warps=1, w2_n_splits=1,
                  act_launch=False) -> dict:
    """Every field of a co-served launch config, spelled out (``dataclasses.asdict`` must give these)."""
    return dict(w13_warps=w13_warps, w13_chunks=w13_chunks, w2_warps=w2_warps, fused_combine=fused_combine,
                w2_row_warps=w2_row_warps, w2_n_splits=w2_n_splits, act_launch=act_launch)


@pytest.mark.parametrize("text, fields", [
    ("2x4x2", launch_fields(2, 4, 2)),
    ("4x2x1s", launch_fields(4, 2, 1, fused_combine=False)),
    ("2x4x1r4", launch_fields(2, 4, 1, w2_row_warps=4)),
    ("8x2x2r2s", launch_fields(8, 2, 2, fused_combine=False, w2_row_warps=2)),
    ("1x8x2n4", launch_fields(1, 8, 2, w2_n_splits=4)),
    ("2x4x1r2n2s", launch_fields(2, 4, 1, fused_combine=False, w2_row_warps=2, w2_n_splits=2)),
    ("1x8x2n4a", launch_fields(1, 8, 2, w2_n_splits=4, act_launch=True)),
    ("4x4x2a", launch_fields(4, 4, 2, act_launch=True)),
    ("2x4x1r2n2as", launch_fields(2, 4, 1, fused_combine=False, w2_row_warps=2, w2_n_splits=2, act_launch=True)),
])
def test_a_co_serving_candidate_reads_and_prints_the_same(text, fields):
    from moe_grouped_decode.benchmarking.coserve import config_text, parse_config

    config = parse_config(text)
    assert dataclasses.asdict(config) == fields
    assert config_text(fields) == text


@pytest.mark.parametrize("text", ["2x4", "2x4x2r", "2x4x2sr2", "a2x4x2", "2x4x2 ", "1x8x2n", "1x8x2n2r2",
                                  "1x8x2n4sa", "1x8x2an4", "1x8x2aa"])
def test_a_malformed_co_serving_candidate_is_an_error(text):
    from moe_grouped_decode.benchmarking.coserve import parse_config

    with pytest.raises(ValueError, match="expected W13WARPS"):
        parse_config(text)


@pytest.mark.parametrize("config, K, N, message", [
    ((2, 4, 2), 2048 + 128, 512, "does not tile K"),  # a K split of 256 rows
    ((2, 4, 2, True, 4), 2048, 160, "does not tile N"),  # 5 chunks of N over 4 row warps
    ((2, 4, 2, True, 3), 2048, 192, "power of 2"),  # 6 chunks, yet 96 lanes are no arange
    ((2, 4, 2, True, 0), 2048, 512, "power of 2"),
    ((1, 8, 2, True, 1, 8), 4096, 1408, "does not tile N"),  # 44 chunks over 8 N splits
    ((1, 8, 2, True, 2, 4), 2048, 128, "does not tile N"),  # 4 chunks: 2 row warps in each of 4 splits
    ((1, 8, 2, True, 1, 3), 2048, 768, "power of 2"),  # 24 chunks would divide, a split is no arange
])
def test_a_launch_config_that_does_not_tile_the_layer_is_refused(config, K, N, message):
    from moe_grouped_decode.kernels.marlin_grouped import MarlinGroupedConfig

    with pytest.raises(ValueError, match=message):
        MarlinGroupedConfig(*config).splits(K, N)


def test_a_launch_config_splits_k_into_its_w13_programs_rows():
    from moe_grouped_decode.kernels.marlin_grouped import MarlinGroupedConfig

    assert MarlinGroupedConfig(2, 4, 2, True, 2).splits(2048, 512) == 8  # 2 warps x 4 chunks x 32 rows a split
    assert MarlinGroupedConfig(4, 4, 1, True, 4).splits(4096, 384) == 8
