"""Numbers given on the command line or in the ini file: read in ASCII only, each refusal naming the option.

Python's ``int()`` and ``float()`` read more than an option should take: ``"٣"`` (an Arabic-Indic three) and
``"１"`` (a full-width one) as numbers, ``"1_0"`` as ten; ``str.isdigit()`` is true of ``"³"``, which ``int()``
refuses; and ``int()`` refuses more than 4300 digits with its own error. Each of these once reached the user as a
number they never wrote, or as an INTERNALERROR. Here a count is ASCII digits alone, a decimal the usual
ASCII notation (``0.05``, ``2``, ``1e-3``), and anything else a :class:`OptionValueError` saying what is accepted.

>>> parse_count("5", "--kernel-ab-history", minimum=0)
5
>>> parse_count("٣", "--kernel-ab-history", minimum=0)
Traceback (most recent call last):
...
pytest_kernelcheck.option_values.OptionValueError: --kernel-ab-history: not a count: '٣'; accepted: a whole number \
from 0 to 2147483647, in ASCII digits
"""
from __future__ import annotations

import math
import re
from typing import Any

MAX_COUNT = 2**31 - 1  # what a C int holds (torch.set_num_threads takes one); far above any count a run needs
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,4})?")
_MAX_DIGITS = 40  # a decimal's digits: more than any value an option takes, few enough that float() reads them fast


def shown(raw: Any) -> str:
    """``raw`` as a message shows it: its repr, shortened past 60 characters (a value can be thousands long).

    >>> shown("9" * 100)
    "'99999999999999999999999999999999999999999999999999999999...' (100 characters)"
    """
    text = repr(raw)
    return text if len(text) <= 60 else f"{text[:57]}...' ({len(str(raw))} characters)"


class OptionValueError(ValueError):
    """An option's value that is not a number it accepts; the message names the option and what it accepts."""


def count_text(text: str) -> int | None:
    """The whole number ``text`` writes in ASCII digits (leading zeros allowed: ``0003``), or None: another
    script's digits, a sign, a point, spaces inside, nothing, or more than 18 digits (no count or run number here
    comes near that, and ``int()`` stays fast and within its limits).

    >>> count_text("0003"), count_text("³"), count_text("+3"), count_text("9" * 5000)
    (3, None, None, None)
    """
    if not (text.isascii() and text.isdigit()):
        return None
    digits = text.lstrip("0") or "0"
    return int(digits) if len(digits) <= 18 else None


def parse_count(raw: Any, option: str, *, minimum: int, maximum: int = MAX_COUNT, problem: str = "not a count"
                ) -> int:
    """The count ``raw`` (an option's or ini key's text) gives, from ``minimum`` to ``maximum``;
    ``OptionValueError`` naming ``option`` and the accepted range otherwise (``problem`` starts the message)."""
    value = count_text(str(raw).strip())
    if value is None or not minimum <= value <= maximum:
        raise OptionValueError(f"{option}: {problem}: {shown(raw)}; accepted: a whole number from {minimum} to "
                               f"{maximum}, in ASCII digits")
    return value


def parse_decimal(raw: Any, option: str) -> float:
    """The finite number ``raw`` writes in ASCII decimal notation (``0.05``, ``2``, ``1e-3``, a sign allowed);
    ``OptionValueError`` naming ``option`` otherwise. Its range is the caller's to check.

    >>> parse_decimal(" 0.05 ", "--kernel-ab-alpha")
    0.05
    >>> parse_decimal("1_0", "--kernel-ab-max-time")
    Traceback (most recent call last):
    ...
    pytest_kernelcheck.option_values.OptionValueError: --kernel-ab-max-time: not a number: '1_0'; accepted: a \
finite number in ASCII decimal notation, such as 0.05, 2 or 1e-3
    """
    text = str(raw).strip()
    value = float(text) if _DECIMAL.fullmatch(text) and len(text) <= _MAX_DIGITS else math.nan
    if not math.isfinite(value):
        raise OptionValueError(f"{option}: not a number: {shown(raw)}; accepted: a finite number in ASCII decimal "
                               f"notation, such as 0.05, 2 or 1e-3")
    return value
