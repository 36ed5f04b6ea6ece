"""The caption run's prompts: one unnamed instruction (`--prompt TEXT`), or several named ones
(`--prompt NAME=TEXT`, repeatable, or a `--prompt-file` of JSON mapping names to prompts), each
caption stored under its name. Plain Python: checked before a model loads."""

import codecs
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from encoder_graphs.app.config import MAX_PROMPT_BYTES
from encoder_graphs.app.errors import UsageError, printable

# A prompt's name: a record's key, so a short word. `--prompt WORD=TEXT` names its prompt when
# WORD is one; any other text before a "=" leaves the whole value a prompt ("Describe: style=photo").
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
Named = tuple[tuple[str, str], ...]


def read_prompts(prompt: "str | Sequence[str] | None", prompt_file: Path | None) -> tuple[str | None, Named]:
    """(the unnamed prompt, or None: the model's, the named prompts): of `--prompt` (one value or
    several) or `--prompt-file`; a UsageError naming the flag for a bad name, a duplicate, an
    empty prompt, a mix of named and unnamed, or a JSON prompt file that is no mapping."""
    if prompt_file is not None:
        return read_prompt_file(prompt_file)
    if prompt is None:
        return None, ()
    values = [prompt] if isinstance(prompt, str) else list(prompt)
    parsed = [split_named(value) for value in values]
    if len(values) == 1 and parsed[0][0] is None:
        return values[0], ()
    if len(values) == 1:  # once a prompt of its own: say how it is read now
        print(f"encoder-graphs: --prompt {printable(values[0])[:60]!r} is read as the prompt named {parsed[0][0]!r} "
              "(captions under that name); for a prompt that starts NAME=, use --prompt-file", file=sys.stderr)
    if any(name is None for name, _ in parsed):
        raise UsageError("--prompt given several times: name each one, --prompt NAME=TEXT")
    return None, checked(parsed, "--prompt")


def split_named(value: str) -> tuple[str | None, str]:
    """(name, text) of a `--prompt NAME=TEXT`; (None, value) where the value is a prompt itself."""
    head, equals, text = value.partition("=")
    if not equals or (head and not NAME.fullmatch(head)):
        return None, value
    if not head:
        raise UsageError(f"--prompt {value!r}: no name before the '='; give NAME=TEXT (a name is 1-64 letters, "
                         "digits, '_', '-' or '.')")
    return head, text


def checked(named: Sequence[tuple[str | None, str]], flag: str) -> Named:
    """The named prompts, each name a word (`NAME`) given once, each prompt text and not empty."""
    seen: set[str] = set()
    for name, text in named:
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise UsageError(f"{flag}: the prompt name {name!r} is not 1-64 letters, digits, '_', '-' or '.'")
        if not isinstance(text, str):
            raise UsageError(f"{flag}: the prompt {name!r} is {type(text).__name__}, not text")
        if name in seen:
            raise UsageError(f"{flag}: the prompt name {name!r} is given twice")
        if not text.strip():
            raise UsageError(f"{flag}: the prompt {name!r} is empty")
        seen.add(name)
    return tuple((name, text.strip()) for name, text in named)


def read_prompt_file(path: Path) -> tuple[str | None, Named]:
    """A prompt file's text without its byte-order mark, read no further than a prompt may be
    long: one prompt; a `.json` file: an object of names to prompts."""
    flag = f"--prompt-file {path}"
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_PROMPT_BYTES + len(codecs.BOM_UTF8) + 1).removeprefix(codecs.BOM_UTF8)
        if len(data) > MAX_PROMPT_BYTES:
            raise UsageError(f"{flag}: more than the {MAX_PROMPT_BYTES} bytes a prompt may have")
        text = data.decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read {flag}: {error}") from error
    if path.suffix.lower() != ".json":
        return text, ()
    try:  # pairs, not a dict: a name given twice is an error, not the last one silently
        mapping = json.loads(text, object_pairs_hook=_Pairs)
    except ValueError as error:
        raise UsageError(f"{flag}: not JSON ({error}); a .json prompt file maps names to prompts") from error
    if not isinstance(mapping, _Pairs) or not mapping or not all(isinstance(v, str) for _, v in mapping):
        raise UsageError(f"{flag}: a .json prompt file is an object mapping names to prompts, e.g. "
                         '{"short": "One sentence.", "tags": "Comma-separated tags."}')
    return None, checked(mapping, flag)


class _Pairs(list):
    """A JSON object's (key, value) pairs in order."""
