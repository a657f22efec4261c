"""Environment switches are parsed in one place, strictly."""

import pytest

from moe_grouped_decode.env import (COSERVE_ENV, GLUON_W13_ENV, GROUPED_DECODE_ENV, LEGACY_ENV_NAMES, SWITCH_ENVS,
                                    TUNE_ENV, GroupedDecodeMode, coserve_enabled, gluon_w13_enabled,
                                    grouped_decode_mode, legacy_names_in_use, switch_setting, tune_enabled,
                                    without_switches)


@pytest.fixture(autouse=True)
def no_switches_set(monkeypatch):
    """Each test starts from an environment without any switch, under either name."""
    for name in (*SWITCH_ENVS, *LEGACY_ENV_NAMES.values(), "MOE_GROUPED_DECODE_FORCE"):
        monkeypatch.delenv(name, raising=False)


def set_or_unset(monkeypatch, name, value):
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize(
    "value,mode",
    [
        (None, GroupedDecodeMode.AUTO),  # unset: on where possible
        ("", GroupedDecodeMode.AUTO),  # empty counts as unset (shell `VAR= cmd`)
        ("1", GroupedDecodeMode.REQUIRED),  # explicit on: fail closed
        ("true", GroupedDecodeMode.REQUIRED),
        ("0", GroupedDecodeMode.OFF),  # rollback
        (" off ", GroupedDecodeMode.OFF),
    ],
)
def test_grouped_decode_mode(monkeypatch, value, mode):
    set_or_unset(monkeypatch, GROUPED_DECODE_ENV, value)
    assert grouped_decode_mode() is mode
    assert mode.enabled is (mode is not GroupedDecodeMode.OFF)


def test_unknown_value_is_an_error_not_a_guess(monkeypatch):
    monkeypatch.setenv(GROUPED_DECODE_ENV, "2")
    with pytest.raises(ValueError, match=GROUPED_DECODE_ENV):
        grouped_decode_mode()


@pytest.mark.parametrize("value,enabled", [(None, False), ("0", False), ("1", True)])
def test_tune_default_off(monkeypatch, value, enabled):
    set_or_unset(monkeypatch, TUNE_ENV, value)
    assert tune_enabled() is enabled


@pytest.mark.parametrize("value,enabled", [
    (None, True),  # unset: the Gluon W13 where it runs
    ("1", True),  # explicit on: the same (Gluon missing is not an error: the tl W13 runs)
    ("0", False),  # rollback to the tl W13
])
def test_gluon_w13_default_on(monkeypatch, value, enabled):
    set_or_unset(monkeypatch, GLUON_W13_ENV, value)
    assert gluon_w13_enabled() is enabled


@pytest.mark.parametrize("value,enabled", [(None, True), ("1", True), ("0", False)])
def test_co_serving_default_on(monkeypatch, value, enabled):
    set_or_unset(monkeypatch, COSERVE_ENV, value)
    assert coserve_enabled() is enabled


def test_gluon_switch_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv(GLUON_W13_ENV, "tl")
    with pytest.raises(ValueError, match=GLUON_W13_ENV):
        gluon_w13_enabled()


def test_names():
    # no VLLM_ prefix (vLLM warns about VLLM_* names it does not know); the old names stay read
    assert (GROUPED_DECODE_ENV, TUNE_ENV, GLUON_W13_ENV) == ("MOE_GROUPED_DECODE", "MOE_GROUPED_DECODE_TUNE", "MOE_GROUPED_DECODE_GLUON")
    assert LEGACY_ENV_NAMES == {
        "MOE_GROUPED_DECODE": "VLLM_AWQ_MOE_GROUPED_DECODE",
        "MOE_GROUPED_DECODE_TUNE": "VLLM_AWQ_MOE_GROUPED_DECODE_TUNE",
        "MOE_GROUPED_DECODE_GLUON": "VLLM_AWQ_MOE_GROUPED_DECODE_GLUON",
    }


@pytest.mark.parametrize("value,mode", [("1", GroupedDecodeMode.REQUIRED), ("0", GroupedDecodeMode.OFF), ("", GroupedDecodeMode.AUTO)])
def test_old_name_alone_still_works(monkeypatch, value, mode):
    monkeypatch.setenv("VLLM_AWQ_MOE_GROUPED_DECODE", value)
    assert grouped_decode_mode() is mode
    assert switch_setting(GROUPED_DECODE_ENV) == (("VLLM_AWQ_MOE_GROUPED_DECODE", mode is GroupedDecodeMode.REQUIRED)
                                                 if value else (None, None))


@pytest.mark.parametrize("new,old", [("1", "1"), ("0", "off"), ("true", "yes")])
def test_both_names_agreeing_is_fine(monkeypatch, new, old):
    monkeypatch.setenv(GROUPED_DECODE_ENV, new)
    monkeypatch.setenv("VLLM_AWQ_MOE_GROUPED_DECODE", old)
    assert switch_setting(GROUPED_DECODE_ENV)[0] == GROUPED_DECODE_ENV  # the new name is the one reported
    assert grouped_decode_mode() is (GroupedDecodeMode.REQUIRED if new != "0" else GroupedDecodeMode.OFF)


@pytest.mark.parametrize("switch", SWITCH_ENVS)
def test_both_names_disagreeing_is_an_error_naming_both(monkeypatch, switch):
    monkeypatch.setenv(switch, "1")
    monkeypatch.setenv(LEGACY_ENV_NAMES[switch], "0")
    read = {GROUPED_DECODE_ENV: grouped_decode_mode, TUNE_ENV: tune_enabled, GLUON_W13_ENV: gluon_w13_enabled}[switch]
    with pytest.raises(ValueError, match=f"{switch}='1' and its old name {LEGACY_ENV_NAMES[switch]}='0' disagree"):
        read()


def test_a_bad_old_value_names_the_old_variable(monkeypatch):
    monkeypatch.setenv("VLLM_AWQ_MOE_GROUPED_DECODE_GLUON", "tl")
    with pytest.raises(ValueError, match="VLLM_AWQ_MOE_GROUPED_DECODE_GLUON='tl'"):
        gluon_w13_enabled()


@pytest.mark.parametrize("legacy,read,expected", [
    ("VLLM_AWQ_MOE_GROUPED_DECODE_TUNE", tune_enabled, True),
    ("VLLM_AWQ_MOE_GROUPED_DECODE_GLUON", gluon_w13_enabled, True),
])
def test_old_names_of_tune_and_gluon(monkeypatch, legacy, read, expected):
    monkeypatch.setenv(legacy, "1" if expected else "0")
    assert read() is expected
    monkeypatch.setenv(legacy, "0" if expected else "1")
    assert read() is not expected


def test_legacy_names_in_use_and_child_environments(monkeypatch):
    assert legacy_names_in_use() == ()
    monkeypatch.setenv("VLLM_AWQ_MOE_GROUPED_DECODE", "0")
    monkeypatch.setenv(TUNE_ENV, "1")
    assert legacy_names_in_use() == ("VLLM_AWQ_MOE_GROUPED_DECODE",)
    environ = {"PATH": "/bin", "VLLM_AWQ_MOE_GROUPED_DECODE": "0", GROUPED_DECODE_ENV: "0", TUNE_ENV: "1"}
    assert without_switches(environ, (GROUPED_DECODE_ENV,)) == {"PATH": "/bin", TUNE_ENV: "1"}
    assert without_switches(environ) == {"PATH": "/bin"}


@pytest.mark.parametrize("value, enabled", [(None, False), ("", False), ("0", False), ("1", True), ("on", True)])
def test_ids_debug_mode_default_off(monkeypatch, value, enabled):
    from moe_grouped_decode.env import CHECK_IDS_ENV, check_ids

    if value is None:
        monkeypatch.delenv(CHECK_IDS_ENV, raising=False)
    else:
        monkeypatch.setenv(CHECK_IDS_ENV, value)
    assert check_ids() is enabled


def test_ids_debug_mode_rejects_unknown_values(monkeypatch):
    from moe_grouped_decode.env import CHECK_IDS_ENV, check_ids

    monkeypatch.setenv(CHECK_IDS_ENV, "maybe")
    with pytest.raises(ValueError, match=CHECK_IDS_ENV):
        check_ids()


@pytest.mark.parametrize("value, forced", [(None, False), ("", False), ("0", False), ("1", True), ("yes", True)])
def test_force_default_off(monkeypatch, value, forced):
    from moe_grouped_decode.env import FORCE_ENV, force_plugin

    set_or_unset(monkeypatch, FORCE_ENV, value)
    assert force_plugin() is forced


@pytest.mark.parametrize("switch", ["1", None])
def test_force_goes_with_the_switch_on_or_unset(monkeypatch, switch):
    from moe_grouped_decode.env import FORCE_ENV, force_plugin

    monkeypatch.setenv(FORCE_ENV, "1")
    set_or_unset(monkeypatch, GROUPED_DECODE_ENV, switch)
    assert force_plugin()


@pytest.mark.parametrize("name", [GROUPED_DECODE_ENV, LEGACY_ENV_NAMES[GROUPED_DECODE_ENV]])
def test_force_and_rollback_contradict(monkeypatch, name):
    from moe_grouped_decode.env import FORCE_ENV, force_plugin

    monkeypatch.setenv(FORCE_ENV, "1")
    monkeypatch.setenv(name, "0")
    with pytest.raises(ValueError, match=f"MOE_GROUPED_DECODE_FORCE=1 and {name}=0 contradict"):
        force_plugin()


def test_force_rejects_unknown_values(monkeypatch):
    from moe_grouped_decode.env import FORCE_ENV, force_plugin

    monkeypatch.setenv(FORCE_ENV, "always")
    with pytest.raises(ValueError, match="MOE_GROUPED_DECODE_FORCE='always'"):
        force_plugin()
