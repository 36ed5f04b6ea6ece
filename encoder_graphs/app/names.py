"""File names as text. A POSIX name is bytes; Python holds the bytes that are not UTF-8 as lone
surrogates (`os.fsdecode`), which no UTF-8 writer, tokenizer or JSON reader (pyarrow, `datasets`)
takes. Text we write shows each such byte as U+FFFD; a record keeps the exact path beside it,
percent-encoded (`escaped`), so a rerun still finds the file."""

import os
from urllib.parse import quote_from_bytes, unquote_to_bytes


def is_text(name: str) -> bool:
    """`name` holds no byte that was not UTF-8."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def as_text(name: str) -> str:
    """`name` with each byte that was not UTF-8 (a lone surrogate) as U+FFFD."""
    if is_text(name):
        return name
    return "".join("\ufffd" if "\ud800" <= char <= "\udfff" else char for char in name)


def escaped(path: str) -> str:
    """The path's bytes percent-encoded (RFC 3986, `/` kept): ASCII that `unescaped` turns back."""
    return quote_from_bytes(os.fsencode(path), safe="/")


def unescaped(text: str) -> str:
    return os.fsdecode(unquote_to_bytes(text))
