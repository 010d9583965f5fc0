"""flashlite's on/off switches from the environment (FLASHLITE_GLUON, FLASHLITE_AUTOTUNE, ...), all read one way.

A switch is on for "1", "true", "yes" or "on" and off for "0", "false", "no", "off" or an empty value (any case,
surrounding spaces ignored); unset, it takes its default. Any other value is refused with an error that names the
variable and what it accepts: read as "on" (what a test for "not 0" would do), FLASHLITE_GLUON=false would turn the
Gluon kernel on.
"""
from __future__ import annotations

import os

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off", "")


def flag(name: str, default: bool) -> bool:
    """The value of the switch ``name`` in the environment, ``default`` where it is unset.

    Example:
        >>> os.environ["FLASHLITE_EXAMPLE_SWITCH"] = " Off"
        >>> flag("FLASHLITE_EXAMPLE_SWITCH", True)
        False
        >>> del os.environ["FLASHLITE_EXAMPLE_SWITCH"]
        >>> flag("FLASHLITE_EXAMPLE_SWITCH", True)
        True
    """
    value = os.environ.get(name)
    if value is None:
        return default
    word = value.strip().lower()
    if word in _ON:
        return True
    if word in _OFF:
        return False
    raise ValueError(f"{name}={value!r} is not an on/off value: use one of {', '.join(_ON)} to turn it on, or one "
                     f"of {', '.join(repr(w) if not w else w for w in _OFF)} to turn it off (any case)")
