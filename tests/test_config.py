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
