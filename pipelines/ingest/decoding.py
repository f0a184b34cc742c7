"""The bytes of a text-format file (.txt, .md, .csv, .html, .eml) read as text, or refused as not text.

A file's name says what it should hold, not what it holds: random bytes, a gzip or zip archive, a PNG or an
executable named notes.txt were indexed as pages of garbage that ranked first for many queries. So the bytes are
decoded, and the text judged, before any parser sees them:

1. A byte-order mark names the encoding (UTF-8, UTF-16, UTF-32); bytes that are not valid in it are not text.
2. Otherwise strict UTF-8: valid UTF-8 that is not text is rare (any high byte out of place breaks it).
3. Otherwise (or when the UTF-8 is mostly NULs: UTF-16 or UTF-32 without a mark) the encoding charset_normalizer
   finds least messy (Windows-1252, Latin-1, Windows-1251, Shift JIS, UTF-16LE, ...); among equally clean ones,
   the one with the best language evidence, then Windows-1252 (the most common, and what HTML reads Latin-1 as).
   When it finds none plausible, the bytes are not text: that is where gzip, zip, PNG, ELF, DOCX, SQLite and
   random bytes end (every one of 100 random files of 128 bytes or more; under 32 bytes, 40 to 70% pass as
   UTF-16). A short legacy file can still be decoded wrongly (one accented word says little about its
   encoding); UTF-8 never is.
4. The text must be mostly characters. Terminal colour codes (logs) are removed; then control characters other
   than tabs, line and page breaks, and U+FFFD (what a lost character became), are counted. Over MAX_CONTROL_SHARE
   of the text and the file is refused; under it they are dropped from the text, as stray NULs always were.

Why 10%, measured on the decoded text: real text stays well below it (prose with a bell, two NULs and a form feed
0.2%; one short line with two stray NULs 3.3%; a log coloured on every line 0%, 3.7% with its colour codes, and
`ls --color` output 0%, 13.8% with them: hence their removal), and binary that decodes at all lands well above
it (7-bit noise 22%, a tar archive of a text file 43%, a file of NULs or of the bytes 0, 1, 2, 0 repeated 100%).
There is no rule on words: a CSV of numbers, a hex dump, a base64 key and Japanese without spaces are all text
with few or no "words".
"""

from __future__ import annotations

import codecs
import re

MAX_CONTROL_SHARE = 0.10
GUESS_SAMPLE_BYTES = 1 << 20  # an encoding is guessed from the first MB (the guess costs about 0.1 s a MB)
# UTF-32's little-endian mark starts with UTF-16's: it is tried first.
BYTE_ORDER_MARKS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
                    (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
_TERMINAL_CODES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")  # ANSI colour and cursor sequences (ECMA-48 CSI)
_CONTROLS = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f]")  # C0 and C1 controls but \t \n \v \f \r


class NotText(ValueError):
    """A text-format file whose bytes are not text (binary data under a text name)."""


def without_controls(text: str) -> str:
    """The text without terminal codes (ANSI colour and cursor sequences) and control characters but whitespace: as
    a text file is read, and a query too (a question pasted from a terminal)."""
    return _CONTROLS.sub("", _without_terminal_codes(text))


def _without_terminal_codes(text: str) -> str:
    return _TERMINAL_CODES.sub("", text) if "\x1b" in text else text


def decode_text(data: bytes, name: str) -> str:
    """The file's text, without control characters; raises NotText with one line naming why (`name`: its file name).
    Terminal codes are dropped without counting against it (a coloured log is text)."""
    text = _without_terminal_codes(_decode(data, name))
    kept = _CONTROLS.sub("", text)
    share = (len(text) - len(kept) + kept.count("\ufffd")) / max(len(text), 1)
    if share > MAX_CONTROL_SHARE:
        raise NotText(_refusal(name, f"{share:.0%} of its characters are control characters or U+FFFD"))
    return kept


def _decode(data: bytes, name: str) -> str:
    for mark, encoding in BYTE_ORDER_MARKS:
        if data.startswith(mark):
            try:
                return data.decode(encoding)
            except UnicodeDecodeError:
                raise NotText(_refusal(name, f"it starts with a {encoding.upper()} byte-order mark but is not"
                                             f" {encoding.upper()}")) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and text.count("\x00") <= MAX_CONTROL_SHARE * len(text):
        return text
    encoding = _guess_encoding(data)  # a legacy encoding, or UTF-16/32 without a mark (valid UTF-8, full of NULs)
    if encoding is not None:
        return data.decode(encoding, "replace")  # guessed from a sample: a byte it did not see may be U+FFFD (counted)
    if text is not None:
        return text  # NULs that are not UTF-16 either: decode_text counts them
    raise NotText(_refusal(name, "its bytes are neither UTF-8 nor a legacy text encoding"))


def _guess_encoding(data: bytes) -> str | None:
    """The encoding the first MB of `data` reads best in (cut at a line end: a multi-byte character stays whole),
    or None when no encoding makes text of it."""
    import charset_normalizer

    sample = data[:GUESS_SAMPLE_BYTES]
    if len(data) > GUESS_SAMPLE_BYTES and b"\n" in sample:
        sample = sample[:sample.rindex(b"\n") + 1]
    matches = list(charset_normalizer.from_bytes(sample, enable_fallback=False))
    if not matches:
        return None
    return min(matches, key=lambda m: (m.chaos, -m.coherence, m.encoding != "cp1252")).encoding


def _refusal(name: str, why: str) -> str:
    suffix = name.rsplit(".", 1)[-1] if "." in name else "text"
    return f"not a text file: {why}; is it a binary file with a .{suffix} name?"
