"""The vLLM version shims (compile_plugin/vllm_compat.py), against the installed vLLM and against
what vLLM 0.26, 0.32, 0.33 and 0.34 spell, as recorded from their wheels in ``vllm_api_record.json``
(``tests/vllm_api_record.py`` writes it; see there how to add a release)."""

from __future__ import annotations

import inspect
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from moe_grouped_decode.compile_plugin import vllm_compat
from moe_grouped_decode.env import LEGACY_ENV_NAMES, SWITCH_ENVS

sys.path.insert(0, str(Path(__file__).parent))
import vllm_api_record  # noqa: E402

pytestmark = pytest.mark.vllm  # imports vllm (no engine is started)

RECORDED = json.loads(vllm_api_record.RECORD.read_text())
VERSIONS = sorted(RECORDED)
# Everything the plugin's env switches and contract variable are called, new names and old.
PLUGIN_ENV_NAMES = (*SWITCH_ENVS, "MOE_GROUPED_DECODE_CONTRACTS")


def installed_version() -> str:
    import vllm

    return vllm.__version__.split("+")[0]


def fake_function(parameter_names):
    """A function with exactly this signature: positional first, the rest keyword-only (as vLLM's)."""
    positional = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in parameter_names[:3]]
    keyword = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in parameter_names[3:]]
    calls = []

    def function(*args, **kwargs):
        calls.append(kwargs)
        return True

    function.__signature__ = inspect.Signature(positional + keyword)
    function.calls = calls
    return function


def test_the_record_covers_the_supported_releases_and_the_installed_one():
    assert {"0.26.0", "0.32.0", "0.33.0", "0.34.0"} <= set(VERSIONS)
    assert installed_version() in RECORDED


def test_recording_the_installed_vllm_gives_its_stored_entry():
    """The recorder reads what the shims depend on; on the installed vLLM it must agree with the record."""
    import vllm

    site = Path(vllm.__file__).parent.parent
    assert vllm_api_record.record(site) == RECORDED[installed_version()]


@pytest.mark.parametrize("version", VERSIONS)
def test_is_layer_skipped_keyword_for_each_release(version):
    names = RECORDED[version]["is_layer_skipped"]
    expected = {"0.26.0": {"skip_with_substr": True}}.get(version, {"match_mode": "substring"})
    function = fake_function(names)
    assert vllm_compat.substring_skip_kwargs_for(function) == expected
    function("model.layers.0.mlp.experts", ["self_attn"], **vllm_compat.substring_skip_kwargs_for(function))
    assert function.calls == [expected]


def test_is_layer_skipped_unknown_spelling_is_a_clear_error():
    with pytest.raises(TypeError, match="neither match_mode nor skip_with_substr"):
        vllm_compat.substring_skip_kwargs_for(fake_function(["prefix", "ignored_layers", "fused_mapping", "exact"]))


def test_is_layer_skipped_substring_on_the_installed_vllm():
    # the checkpoints' modules_to_not_convert: attention and the router stay unquantized, experts do not
    ignored = ["self_attn", "mlp.gate"]
    assert vllm_compat.is_layer_skipped_substring("model.layers.3.self_attn.qkv_proj", ignored)
    assert vllm_compat.is_layer_skipped_substring("model.layers.3.mlp.gate", ignored)
    assert not vllm_compat.is_layer_skipped_substring("model.layers.3.mlp.experts", ignored)
    # substring, not exact: an exact match would not skip the projection inside self_attn
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    assert not is_layer_skipped("model.layers.3.self_attn.qkv_proj", ignored)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("op_name", ["moe_forward", "moe_forward_shared"])
def test_replacement_op_tags_follow_vllms_op_for_each_release(version, op_name):
    tags = [getattr(torch.Tag, name) for name in RECORDED[version]["op_tags"][op_name]]
    packet = types.SimpleNamespace(default=types.SimpleNamespace(tags=tags))
    assert vllm_compat.op_tags_for(packet) == tuple(tags)


@pytest.mark.parametrize(
    "vllm_name,ours", [("moe_forward", "vllm_moe_forward_grouped"), ("moe_forward_shared", "vllm_moe_forward_shared_grouped")]
)
def test_replacement_ops_carry_the_installed_vllms_tags(vllm_name, ours):
    from moe_grouped_decode.compile_plugin import passes  # noqa: F401  (defines the replacement ops)

    theirs = getattr(torch.ops.vllm, vllm_name).default.tags
    assert [str(t) for t in theirs] == [f"Tag.{n}" for n in RECORDED[installed_version()]["op_tags"][vllm_name]]
    assert getattr(torch.ops.moe_grouped_decode, ours).default.tags == theirs


@pytest.mark.parametrize("version", VERSIONS)
def test_fused_moe_factory_for_each_release(version):
    (name,) = RECORDED[version]["fused_moe_factory"]
    factory = lambda **kwargs: None  # noqa: E731
    module = types.SimpleNamespace(__name__="vllm.model_executor.layers.fused_moe.layer", **{name: factory})
    assert vllm_compat.fused_moe_factory_for(module) is factory


def test_fused_moe_factory_on_the_installed_vllm():
    from vllm.model_executor.layers.fused_moe import layer

    (name,) = RECORDED[installed_version()]["fused_moe_factory"]
    assert vllm_compat.fused_moe_factory() is getattr(layer, name)
    with pytest.raises(AttributeError, match="neither FusedMoEFactory nor FusedMoE"):
        vllm_compat.fused_moe_factory_for(types.SimpleNamespace(__name__="vllm.fake"))


@pytest.mark.parametrize("version", VERSIONS)
def test_environ_validator_for_each_release(version):
    def validate(hard_fail):
        return hard_fail

    on_platform = RECORDED[version]["validate_environ"] == "Platform"
    platform = types.SimpleNamespace(**({"validate_environ": validate} if on_platform else {}))
    envs = types.SimpleNamespace(**({} if on_platform else {"validate_environ": validate}))
    assert vllm_compat.environ_validator_for(platform, envs) is validate


@pytest.mark.parametrize("version", VERSIONS)
def test_expert_parallel_spellings_for_each_release(version):
    """Expert parallelism needs no shim: every release's ``RoutedExperts.expert_map`` returns the
    -1/local map (``_expert_map``) or, under ROCm AITER only, the 0/1 ``expert_mask`` (which
    ``unservable_reason`` refuses), and declares every FusedMoEConfig field the method reads."""
    assert RECORDED[version]["expert_map"] == ["_expert_map", "expert_mask"]
    assert RECORDED[version]["moe_config_fields"] == list(vllm_api_record.MOE_CONFIG_FIELDS)


def test_unshimmed_spellings_are_the_same_in_every_release():
    """What the plugin calls or overrides without a shim; a new release that changes one fails here."""
    shimmed = {"is_layer_skipped", "op_tags", "fused_moe_factory", "validate_environ"}
    checked_as_subset = {"create_weights_reads"}  # test_plugin_method_sets_what_create_weights_reads
    first = RECORDED[VERSIONS[0]]
    for version in VERSIONS[1:]:
        assert RECORDED[version].keys() == first.keys(), version  # every release recorded by the same recorder
        for key, value in RECORDED[version].items():
            if key not in shimmed | checked_as_subset:
                assert value == first[key], (version, key)


@pytest.mark.parametrize("version", VERSIONS)
def test_plugin_method_sets_what_create_weights_reads(version):
    """The plugin's method skips AutoAWQMoEMethod.__init__ (it picks a kernel backend, or raises where there is
    none) and inherits create_weights: it must set every attribute that create_weights reads in each release
    (0.26-0.33 read ``input_dtype``, 0.34 no longer does)."""
    from moe_grouped_decode.compile_plugin.moe_method import AwqMoeGroupedDecodeMethod

    method = AwqMoeGroupedDecodeMethod(types.SimpleNamespace(), types.SimpleNamespace(), None, None)
    assert [name for name in RECORDED[version]["create_weights_reads"] if not hasattr(method, name)] == []


@pytest.mark.parametrize("version", VERSIONS)
def test_plugin_signatures_match_each_release(version):
    """Where the plugin mirrors or overrides a vLLM signature, it matches every release's."""
    from moe_grouped_decode.compile_plugin import moe_method, passes

    entry = RECORDED[version]
    # one implementation serves both replacement ops, declared with vLLM's op schemas
    grouped = list(inspect.signature(passes._forward_grouped).parameters)
    assert entry["moe_forward"] == entry["moe_forward_shared"] == grouped
    assert entry["runner_functions"] == list(vllm_api_record.RUNNER_FUNCTIONS)
    method = moe_method.AwqMoeGroupedDecodeMethod
    assert entry["method_apply"] == list(inspect.signature(method.apply).parameters)
    for name, parameters in entry["method_overrides"].items():
        assert parameters == list(inspect.signature(getattr(method, name)).parameters), name
    assert entry["routed_experts_attrs"] == list(vllm_api_record.ROUTED_EXPERTS_ATTRS)
    assert entry["compile_pass"]["pass_key"] == [passes.PASS_KEY]


# --------------------------------------------------------------------------- no vLLM warning from the switches


@pytest.mark.parametrize("version", VERSIONS)
def test_plugin_env_names_are_outside_each_releases_warning(version):
    # every release warns about os.environ names starting with this prefix that it does not know
    prefix = RECORDED[version]["unknown_env_prefix"]
    assert prefix == "VLLM_"
    assert [name for name in PLUGIN_ENV_NAMES if name.startswith(prefix)] == []
    assert all(legacy.startswith(prefix) for legacy in LEGACY_ENV_NAMES.values())  # why the rename


def _only_known_vllm_vars(monkeypatch):
    import os

    known = vllm_compat.known_vllm_env_names()
    for name in list(os.environ):
        if name.startswith("VLLM_") and name not in known:
            monkeypatch.delenv(name)


def test_installed_vllm_accepts_the_plugin_env_names(monkeypatch):
    """vLLM's own check, failing hard (--fail-on-environ-validation), with every plugin variable set."""
    _only_known_vllm_vars(monkeypatch)
    for name in SWITCH_ENVS:
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("MOE_GROUPED_DECODE_CONTRACTS", "[]")
    vllm_compat.validate_environ(hard_fail=True)


@pytest.mark.parametrize("legacy", sorted(LEGACY_ENV_NAMES.values()))
def test_installed_vllm_still_rejects_the_old_names(monkeypatch, legacy):
    # the check is live: the old VLLM_-prefixed names are what it warned about
    _only_known_vllm_vars(monkeypatch)
    monkeypatch.setenv(legacy, "1")
    with pytest.raises(ValueError, match=f"Unknown vLLM environment variable detected: {legacy}"):
        vllm_compat.validate_environ(hard_fail=True)
