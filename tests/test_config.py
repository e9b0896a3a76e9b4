"""RINGMASTER_* variables: parsed in one place, bad values refused with the variable's name."""

import pytest

from ringmaster.common.config import ConfigError, load_config


def test_defaults_without_any_variable():
    config = load_config({})
    assert config.fusion_threshold_bytes == 64 << 20 and config.cycle_time_ms == 1.0
    assert config.stall_warning_s == 60.0 and config.log_level == "WARNING" and config.timeline is None


@pytest.mark.parametrize("variable,value,words", [
    ("RINGMASTER_LOG_LEVEL", "chatty", ["RINGMASTER_LOG_LEVEL", "DEBUG, INFO"]),
    ("RINGMASTER_TIMELINE", "/no/such/directory/t.json", ["RINGMASTER_TIMELINE", "does not exist"]),
    ("RINGMASTER_CYCLE_TIME", "-1", ["RINGMASTER_CYCLE_TIME", ">= 0"]),
    ("RINGMASTER_ALLREDUCE", "tree", ["RINGMASTER_ALLREDUCE", "auto, ring, mpi"]),
    ("RINGMASTER_BACKGROUND_NICE", "25", ["RINGMASTER_BACKGROUND_NICE", "0 to 19"]),
    ("RINGMASTER_GRADIENT_PLAN", "maybe", ["RINGMASTER_GRADIENT_PLAN", "1 or 0"]),
])
def test_bad_values_name_the_variable(variable, value, words):
    with pytest.raises(ConfigError) as caught:
        load_config({variable: value})
    assert all(word in str(caught.value) for word in words), str(caught.value)


def test_log_level_and_timeline_are_accepted(tmp_path):
    config = load_config({"RINGMASTER_LOG_LEVEL": " info ", "RINGMASTER_TIMELINE": str(tmp_path / "t.{rank}.json")})
    assert config.log_level == "INFO" and config.timeline.endswith("t.{rank}.json")


@pytest.mark.parametrize("value,expected", [("0", False), (" off ", False), ("False", False), ("1", True),
                                            ("yes", True)])
def test_gradient_plan_switch(value, expected):
    assert load_config({}).gradient_plan is True
    assert load_config({"RINGMASTER_GRADIENT_PLAN": value}).gradient_plan is expected


def test_each_setting_is_described_once_by_its_help():
    """Every Config field has one setting, with a help; Config's docstring is made from them."""
    import dataclasses
    import re

    from ringmaster.common.config import SETTINGS, Config

    fields = [field.name for field in dataclasses.fields(Config)]
    assert sorted(setting.field for setting in SETTINGS) == sorted(fields)
    assert len({setting.variable for setting in SETTINGS}) == len(SETTINGS)
    flat = re.sub(r"\s+", " ", Config.__doc__)
    for setting in SETTINGS:
        assert setting.help, f"{setting.variable} has no help"
        assert f"{setting.field}: {setting.help.rstrip(')')}" in flat, setting.field
        assert setting.variable in flat, setting.variable


@pytest.mark.parametrize("variable,value,reason", [
    ("RINGMASTER_START_TIMEOUT", "0", "must be > 0"),
    ("RINGMASTER_STALL_SHUTDOWN_S", "-1", "must be >= 0"),
    ("RINGMASTER_AUTOTUNE_WARMUP_SAMPLES", "-1", "must be a whole number >= 0"),
    ("RINGMASTER_MAX_PENDING_REQUESTS", "0", "must be a whole number >= 1"),
    ("RINGMASTER_BACKGROUND_NICE", "-1", "must be a whole number from 0 to 19"),
    ("RINGMASTER_CACHE_CAPACITY", "65537", "must be a whole number from 0 (no cache) to 65536"),
    ("RINGMASTER_MAX_MESSAGE_BYTES", "1000", "must be a number of bytes from 65536 (64 KiB) to 1073741824 (1 GiB)"),
    ("RINGMASTER_GPU_TRANSPORT", "carrier-pigeon", "must be one of auto, nccl, ipc, mpi, staged"),
    ("RINGMASTER_PLAN_OVERLAP", "some", "must be one of auto, all, small"),
])
def test_ranges_and_choices_say_what_the_value_must_be(variable, value, reason):
    with pytest.raises(ConfigError) as caught:
        load_config({variable: value})
    assert f"{variable}={value!r} is invalid: {reason}" == str(caught.value)


def test_choices_are_taken_in_any_case_and_given_back_as_written():
    from ringmaster.common.config import SETTINGS

    config = load_config({"RINGMASTER_ALLREDUCE": " RING ", "RINGMASTER_GPU_TRANSPORT": "NCCL",
                          "RINGMASTER_PLAN_OVERLAP": "Small", "RINGMASTER_LOG_LEVEL": "debug"})
    assert (config.allreduce_algorithm, config.gpu_transport, config.plan_overlap, config.log_level) == (
        "ring", "nccl", "small", "DEBUG")
    choices = {setting.variable: setting.choices for setting in SETTINGS}
    assert choices["RINGMASTER_ALLREDUCE"] == ("auto", "ring", "mpi")
    assert choices["RINGMASTER_START_TIMEOUT"] == ()
