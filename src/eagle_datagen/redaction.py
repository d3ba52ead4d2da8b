"""Secrets never reach the manifest, a log or the terminal.

One rule decides what a secret is (:func:`is_secret_flag`), and every place that shows or saves
options or a command line goes through :func:`redact` (argument lists) or :func:`redact_options`
(the option dict saved in ``manifest.json``). :func:`check_api_key` refuses a key that cannot travel
in an HTTP header, without printing it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from eagle_datagen.errors import UsageError

#: What a hidden value is replaced with.
MASK = "***"
#: SGLang's own secret flags; argparse also accepts an unambiguous prefix of them (``--admin-api``).
SECRET_FLAGS = ("--api-key", "--admin-api-key")
#: A flag or option is secret when one of its words is, or ends in, one of these
#: (``--hf-token``, ``--apikey``, ``secret_key``; not ``--max-total-tokens`` or ``--tokenizer-path``).
SECRET_WORDS = ("key", "token", "secret", "password", "passwd")
_WORD = re.compile(r"[-_.]+")


def is_secret_name(name: str) -> bool:
    """True for an option or flag name (``api_key``, ``--admin-api-key``) whose value is a secret."""
    words = _WORD.split(name.lower().lstrip("-"))
    return any(word.endswith(SECRET_WORDS) for word in words)


def is_secret_flag(arg: str) -> bool:
    """True when ``arg`` (``--flag`` or ``--flag=value``) is a flag whose value is a secret."""
    name = arg.split("=", 1)[0]
    if not name.startswith("--") or len(name) < 3:
        return False
    if len(name) > 4 and any(flag.startswith(name) for flag in SECRET_FLAGS):
        return True
    return is_secret_name(name)


def redact(command: Sequence[str]) -> list[str]:
    """The argument list with every secret value hidden: ``--flag=***``, or ``--flag ***``."""
    out = list(command)
    for i, arg in enumerate(out):
        name, eq, _ = arg.partition("=")
        if eq and is_secret_flag(name):
            out[i] = f"{name}={MASK}"
        elif i > 0 and not eq and is_secret_flag(out[i - 1]) and "=" not in out[i - 1] and not arg.startswith("--"):
            out[i] = MASK
    return out


def redacted_args(command: Sequence[str]) -> list[str]:
    """The secret flags of an argument list whose value :func:`redact` hid (``--admin-api-key``)."""
    return [
        a.partition("=")[0] if "=" in a else command[i - 1] for i, a in enumerate(command) if _masked(a, i, command)
    ]


def _masked(arg: str, i: int, command: Sequence[str]) -> bool:
    if "=" in arg:
        name, _, value = arg.partition("=")
        return value == MASK and is_secret_flag(name)
    return arg == MASK and i > 0 and is_secret_flag(command[i - 1])


def redact_options(options: dict[str, Any]) -> dict[str, Any]:
    """Options without secret-named keys, and with secret values inside ``server_arg`` hidden."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        if is_secret_name(key):
            continue
        if key == "server_arg" and isinstance(value, (list, tuple)):
            value = type(value)(redact([str(v) for v in value]))
        out[key] = value
    return out


def check_api_key(key: str, source: str) -> str:
    """The key, refused (without showing it) when it holds whitespace, control or non-ASCII characters."""
    for position, char in enumerate(key, start=1):
        if not ("!" <= char <= "~"):
            what = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", " ": "a space"}.get(char)
            what = what or (f"the control character U+{ord(char):04X}" if ord(char) < 0x80 else "a non-ASCII character")
            end = " at its end" if position == len(key) else f" at character {position} of {len(key)}"
            raise UsageError(
                f"the API key from {source} contains {what}{end}; an HTTP header cannot carry it. Remove it "
                "(a key file written with `echo` ends in a newline: write it with `printf %s`, or create the "
                "Kubernetes secret with --from-literal)"
            )
    return key
