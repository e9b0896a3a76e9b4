"""ringrun's flags for job settings, derived from ``common.config.SETTINGS``.

Each setting is described once (variable, field, parser, flag, unit, default, help); this
module turns those with a flag into argparse options whose help shows the default and whose
values are checked by the variable's own parser, and turns the flags given back into the
``RINGMASTER_*`` variables the ranks read.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Mapping

from ringmaster.common.config import SETTINGS, Setting

#: The settings that ringrun offers as flags, by the flag's attribute name.
FLAG_SETTINGS: Dict[str, Setting] = {setting.dest: setting for setting in SETTINGS if setting.flag is not None}


def add_setting_flags(groups: Mapping[str, argparse._ArgumentGroup]) -> None:
    """Add the flag of every setting that has one to its group of ``groups`` (by name)."""
    for setting in FLAG_SETTINGS.values():
        group = groups[setting.group]
        help_text = _with_default(setting.help, default_text(setting))
        if setting.switch:
            group.add_argument(setting.flag, action="store_true", help=f"{help_text}; sets {setting.variable}=1")
        elif setting.choices:
            group.add_argument(setting.flag, choices=setting.choices, help=help_text)
        else:
            group.add_argument(setting.flag, type=_checked(setting), metavar=setting.metavar, help=help_text)


def default_text(setting: Setting) -> str | None:
    """The setting's default as its flag's help says it (in the flag's units); ``None``
    where there is none."""
    if setting.default_text is not None:
        return setting.default_text
    default = setting.default
    if default is None:
        return None
    if setting.unit != 1:
        default = default / setting.unit
    if isinstance(default, float) and default == int(default):
        default = int(default)
    return str(default)


def _with_default(help_text: str, default: str | None) -> str:
    """``help_text`` with ``(default X)``, or ``(...; default X)`` where it ends in parentheses."""
    if default is None:
        return help_text
    if help_text.endswith(")"):
        return f"{help_text[:-1]}; default {default})"
    return f"{help_text} (default {default})"


def setting_environment(given: Mapping[str, Any]) -> Dict[str, str]:
    """The ``RINGMASTER_*`` variables of the setting flags in ``given`` (flag attribute name
    -> value in the flag's units; ``None`` or a switch's ``False``: not given)."""
    unknown = sorted(set(given) - set(FLAG_SETTINGS))
    if unknown:
        raise TypeError(f"not ringrun setting flags: {', '.join(unknown)}")
    env = {}
    for dest, value in given.items():
        setting = FLAG_SETTINGS[dest]
        if value is None or (setting.switch and not value):
            continue
        env[setting.variable] = setting.environment_value(value)
    return env


def _checked(setting: Setting):
    """argparse's ``type`` for the flag: the value the variable's parser makes of it (for a
    flag in other units than its variable, the number given), refused with that parser's
    reason."""
    def parse(text: str):
        value: Any = text
        if setting.unit != 1:
            try:
                value = float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        try:
            setting.environment_value(value)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: {error}") from None
        return value if setting.unit != 1 else setting.parse(text)
    return parse
