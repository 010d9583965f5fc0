"""Names as every output can show them: invisible and layout-changing characters escaped, long names cut apart.

Comparison names, variant names and shapes are the user's text, and an output must show each one readably and
tell any two apart. Some characters cannot be shown as they are: control characters (a line break splits a table
row, an ESC sequence recolours the terminal, NUL ends a C string), format characters (U+202E reverses the text
after it, zero-width characters make two names look alike), line and paragraph separators, and lone surrogates
(which no UTF-8 output can encode and which matplotlib refuses to draw). :func:`visible` writes each of those as
the escape Python would (``\\n``, ``\\x1b``, ``\\u202e``, ``\\udcff``) and leaves every other character, accents and
scripts of any language included, as it is.

>>> visible("fused\\u202e kernel\\x1b[31m"), visible("注意力 attention")
('fused\\\\u202e kernel\\\\x1b[31m', '注意力 attention')
"""
from __future__ import annotations

import hashlib
import unicodedata

# Control, format, surrogate, line separator, paragraph separator.
_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def _escape(character: str) -> str:
    code = ord(character)
    if character in "\n\r\t":
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}[character]
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def visible(text: object) -> str:
    """``text`` (made a string) with every hidden or layout-changing character escaped; see the module text.

    >>> visible("two\\nlines"), visible("bad \\udcff name"), visible(128)
    ('two\\\\nlines', 'bad \\\\udcff name', '128')
    """
    value = str(text)
    if value.isprintable():  # the common case, and a fast one: nothing to escape
        return value
    return "".join(_escape(c) if unicodedata.category(c) in _HIDDEN_CATEGORIES else c for c in value)


def shortened(text: str, width: int) -> str:
    """``text`` cut to at most ``width`` characters; a cut one ends with ``...`` and a digest of the whole text, so
    two names that differ only after the cut stay apart.

    >>> shortened("attention " * 8 + "ONE", 40) != shortened("attention " * 8 + "TWO", 40)
    True
    >>> shortened("short", 40), len(shortened("x" * 100, 40))
    ('short', 40)
    """
    if len(text) <= width:
        return text
    digest = hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:6]
    tail = f"...#{digest}"
    return text[: max(0, width - len(tail))] + tail
