"""The measured tables (tables.py): the verdict at every edge, the file format, the user's cache
keyed by versions, the shipped tables, and the README's supported-models block generated from them."""

import dataclasses
import json
from pathlib import Path

import pytest

from moe_grouped_decode import tables
from moe_grouped_decode.benchmarking import supported

README = Path(__file__).resolve().parents[1] / "README.md"
SHAPE = (128, 8, 2048, 768, 128)


def table(speedups, tokens=(1, 2, 8, 64, 1024, 16384), humming=None, gpu="Test GPU", dtype="fp16", window=(1, 8)):
    """vLLM's Marlin is speedups[i] x the plugin's time at tokens[i]; Humming 2x slower, or ``humming``."""
    plugin = tuple(10.0 + m for m in tokens)
    marlin = tuple(us * s for us, s in zip(plugin, speedups))
    return tables.MeasuredTable(
        gpu=gpu, shape=SHAPE, dtype=dtype, name="test", generator="tests/test_tables.py", versions={"torch": "x"},
        routes=tables.RouteTable(tokens=tuple(tokens), routes=tuple("grouped" if m <= 8 else "prefill" for m in tokens),
                                 plugin_us=plugin, vllm_us={"marlin": marlin,
                                                            "humming": humming or tuple(2 * us for us in marlin)},
                                 grouped_tokens=window))


def test_faster_at_every_count_is_admitted_with_the_closest_call():
    v = tables.verdict(table((3.0, 2.0, 1.5, 1.01, 1.2, 1.1)))
    assert v.admitted and v.closest == (64, pytest.approx(1.01))
    assert "at least 1.01x, at M=64" in v.reason


@pytest.mark.parametrize("speedups, where", [((3.0, 2.0, 1.5, 1.0, 1.2, 1.1), "M=64"),  # a tie is not faster
                                             ((0.9, 2.0, 1.5, 1.1, 1.2, 1.1), "M=1"),
                                             ((3.0, 2.0, 1.5, 1.1, 1.2, 0.99), "M=16384")])
def test_a_loss_or_a_tie_anywhere_is_not_admitted(speedups, where):
    v = tables.verdict(table(speedups))
    assert not v.admitted and f"vLLM is as fast or faster at {where}" in v.reason
    assert f"the plugin down to {min(speedups):.2f}x" in v.reason


def test_the_faster_of_vllms_backends_is_the_bar():
    tokens = (1, 2, 8, 64, 1024, 16384)
    plugin = [10.0 + m for m in tokens]
    humming = tuple(us * (0.9 if m == 1024 else 3.0) for m, us in zip(tokens, plugin))  # Humming wins at 1024
    v = tables.verdict(table((2.0,) * 6, humming=humming))
    assert not v.admitted and "M=1024" in v.reason


def test_the_grid_must_start_at_one_and_reach_the_engines_step():
    assert "not measured at 1 token" in tables.verdict(table((2.0,) * 5, tokens=(2, 8, 64, 1024, 16384))).reason
    short = table((2.0,) * 5, tokens=(1, 2, 8, 64, 1024))
    assert tables.verdict(short, 1024).admitted and tables.verdict(short, 1000).admitted
    assert "measured up to 1024 tokens, the engine's steps reach 2048" in tables.verdict(short, 2048).reason
    # a loss beyond the engine's step does not count against it
    assert tables.verdict(table((2.0, 2.0, 2.0, 2.0, 2.0, 0.5)), 1024).admitted


def test_both_vllm_backends_must_be_measured():
    t = table((2.0,) * 6)
    no_humming = dataclasses.replace(t, routes=dataclasses.replace(t.routes, vllm_us={"marlin": t.routes.vllm_us["marlin"]}))
    assert "vLLM's humming backend not measured at M=1" in tables.verdict(no_humming).reason
    gap = list(t.routes.vllm_us["humming"])
    gap[3] = None
    holed = dataclasses.replace(t, routes=dataclasses.replace(t.routes, vllm_us={**t.routes.vllm_us, "humming": tuple(gap)}))
    assert "not measured at M=64" in tables.verdict(holed).reason


def test_a_table_round_trips_through_its_file(tmp_path):
    t = table((3.0, 2.0, 1.5, 1.1, 1.2, 1.1))
    path = tables.write_table(t, tmp_path)
    assert path.name == "Test-GPU_128-8-2048-768-128_fp16.json"
    back = tables.read_dir(tmp_path)[0]
    assert back == t and back.path == path


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(format=99), "format 99"),
    (lambda d: d["route_table"].update(tokens=[2, 1, 8, 64, 1024, 16384]), "ascending"),
    (lambda d: d["route_table"]["plugin_us"].pop(), "one value per token count"),
    (lambda d: d["route_table"]["route"].__setitem__(0, "fast"), "'fast'"),
    (lambda d: d.update(shape=[1, 2, 3]), "shape must be"),
    (lambda d: d.pop("gpu"), "'gpu'"),
])
def test_a_broken_table_file_is_an_error_naming_it(tmp_path, change, message):
    data = tables.table_to_json(table((2.0,) * 6))
    change(data)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as error:
        tables.read_dir(tmp_path)
    assert str(path) in str(error.value)


def test_a_users_tables_are_keyed_by_versions_and_read_over_the_shipped(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_GROUPED_DECODE_CACHE", str(tmp_path))
    versions = {"torch": "2.11.0+cu130", "triton": "3.6.0", "vllm": "0.32.0"}
    directory = tables.cache_dir(versions)
    assert directory.is_relative_to(tmp_path) and "vllm0.32.0" in directory.name and "torch2.11.0-cu130" in directory.name
    assert tables.cache_dir({**versions, "vllm": "0.33.0"}) != directory
    shipped = tables.shipped_tables()[0]
    mine = dataclasses.replace(shipped, generator="mine")
    tables.write_table(mine, directory)
    try:
        assert tables.use_cached_tables({**versions, "vllm": "0.33.0"}) == []  # other versions: not read
        assert tables.find_table(*shipped.key).generator == shipped.generator
        assert [t.generator for t in tables.use_cached_tables(versions)] == ["mine"]
        assert tables.find_table(*shipped.key).generator == "mine"
    finally:
        tables._extra.clear()
    assert tables.find_table(*shipped.key) == shipped


def test_launch_configs_of_a_gpu_without_a_table_come_from_the_preferred_gpus():
    shipped = {t.key: t for t in tables.shipped_tables()}
    qwen = (512, 10, 2560, 160, 32)
    assert tables.config_table("NVIDIA A100-SXM4-80GB", qwen, "fp16") is shipped[("NVIDIA H200", qwen, "fp16")]
    assert tables.config_table("NVIDIA A100-SXM4-80GB", (1, 1, 32, 32, 32), "fp16") is None


def test_every_shipped_table_names_its_command_and_has_both_vllm_backends():
    for t in tables.shipped_tables():
        assert "moe_grouped_decode" in t.generator and t.versions.get("torch"), t.path
        assert set(t.routes.vllm_us) == set(tables.VLLM_BACKENDS), t.path
        assert t.routes.tokens[0] == 1, t.path


def test_the_readme_supported_models_block_is_generated_from_the_tables():
    text = README.read_text()
    start, end = text.index(supported.BEGIN), text.index(supported.END) + len(supported.END)
    assert text[start:end] == supported.readme_block(), "run `python -m moe_grouped_decode tables --readme`"
