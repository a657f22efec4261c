"""Environment switches are parsed in one place, strictly."""

import pytest

from moe_grouped_decode.env import (GLUON_W13_ENV, GROUPED_DECODE_ENV, TUNE_ENV, GroupedDecodeMode, gluon_w13_enabled,
                                    grouped_decode_mode, tune_enabled)


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


def test_gluon_switch_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv(GLUON_W13_ENV, "tl")
    with pytest.raises(ValueError, match=GLUON_W13_ENV):
        gluon_w13_enabled()
