"""Secrets never reach the manifest, a log or the terminal.

One rule decides what a secret is (:func:`is_secret_flag`), and every place that shows or saves
options or a command line goes through :func:`redact` (argument lists) or :func:`redact_options`
(the option dict saved in ``manifest.json``). A launched server's own output is masked on its way to
its log with the values :func:`secret_values` and :func:`environment_secrets` find, in the forms
:func:`mask_forms` gives (``server/logmask.py``). :func:`check_api_key` refuses a key that cannot travel
in an HTTP header, without printing it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
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


def _secret_args(command: Sequence[str]) -> Iterator[tuple[int, str, str]]:
    """``(index, flag, value)`` of each secret value in an argument list (``--flag=value`` or ``--flag value``)."""
    for i, arg in enumerate(command):
        name, eq, value = arg.partition("=")
        if eq and is_secret_flag(name):
            yield i, name, value
        elif i > 0 and not eq and not arg.startswith("--") and _takes_secret(command[i - 1]):
            yield i, command[i - 1], arg


def _takes_secret(arg: str) -> bool:
    """A secret flag without ``=``: the next argument is its value."""
    return "=" not in arg and is_secret_flag(arg)


def redact(command: Sequence[str]) -> list[str]:
    """The argument list with every secret value hidden: ``--flag=***``, or ``--flag ***``."""
    out = list(command)
    for i, name, _ in _secret_args(command):
        out[i] = f"{name}={MASK}" if "=" in command[i] else MASK
    return out


def secret_values(command: Sequence[str]) -> list[str]:
    """The values :func:`redact` hides in an argument list (what a launched server's log must not show)."""
    return [value for _, _, value in _secret_args(command) if value]


#: An environment value shorter than this is not masked in a server's log (a ``USE_AUTH_TOKEN=true`` would
#: hide every ``true``); keys and tokens are far longer.
MIN_ENV_SECRET = 8


def environment_secrets(env: Mapping[str, str]) -> list[str]:
    """The values of secret-named environment variables (``HF_TOKEN``, ``EAGLE_DATAGEN_API_KEY``) that a
    launched server gets, at least :data:`MIN_ENV_SECRET` characters long."""
    return [value for name, value in env.items() if is_secret_name(name) and len(value) >= MIN_ENV_SECRET]


def mask_forms(secrets: Iterable[str]) -> list[bytes]:
    """Each secret as bytes the way a log may show it: as is, inside a Python repr (SGLang prints
    ``ServerArgs(api_key='…')``) and inside a JSON string; longest first."""
    forms: set[bytes] = set()
    for secret in secrets:
        if not secret:
            continue
        for text in (secret, repr(secret)[1:-1], json.dumps(secret)[1:-1]):
            try:
                forms.add(os.fsencode(text))  # undecodable argv bytes come back as they were given
            except UnicodeEncodeError:
                forms.add(text.encode("utf-8", "backslashreplace"))
    return sorted(forms, key=len, reverse=True)


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
