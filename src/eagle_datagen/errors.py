"""The exceptions eagle-datagen raises, split by who must act.

DatagenError                      fatal: the run stops (exit 1), what is durable stays durable
├── UsageError                    bad arguments or configuration, found before any work (exit 2)
├── BadInputError                 a prompt row that cannot be used; names file:line and the fix (exit 2)
├── ManifestMismatch              resume asked for a plan that differs from the pinned one (exit 2)
├── ServerError                   the server cannot be started, reached or trusted
│   └── PreflightFailed           the first checked request failed: nothing real was sent
├── OutputWriteError              a shard, manifest or log could not be written (disk full, ...)
└── InternalError                 an unexpected exception (a bug) stopped the run; its cause is chained

RequestFailed                     one request failed; recorded in failures.jsonl, maybe retried
                                  (not a DatagenError: it never stops the run by itself)
"""

from __future__ import annotations


class DatagenError(Exception):
    """A fatal error; the message says what happened and what to do."""

    exit_code = 1
    #: The command that continues the run, once its directory holds a manifest (the CLI prints it).
    continue_with: str | None = None


class UsageError(DatagenError):
    """Bad arguments or configuration, detected before any work starts."""

    exit_code = 2


class BadInputError(DatagenError):
    """A prompt row that cannot be used.

    ``kind`` is a short machine-readable reason (``invalid_json``, ``unknown_role``, ...), used for
    rejects.jsonl and for counting.
    """

    exit_code = 2

    def __init__(self, path: str, line: int, kind: str, detail: str, fix: str) -> None:
        self.path = path
        self.line = line
        self.kind = kind
        self.detail = detail
        self.fix = fix
        super().__init__(f"{path}:{line}: {detail}; {fix}")


class ManifestMismatch(DatagenError):
    """``resume`` found a plan that differs from the pinned manifest."""

    exit_code = 2


class ServerError(DatagenError):
    """The SGLang server cannot be started, reached, or trusted."""


class PreflightFailed(ServerError):
    """The preflight request failed its checks; no real request was sent."""


class OutputWriteError(DatagenError):
    """Something could not be written to the output directory."""


class InternalError(DatagenError):
    """An unexpected exception (a bug) stopped the run; ``__cause__`` holds it, with its traceback."""


class RequestFailed(Exception):
    """One request failed.

    ``retryable`` marks transient failures (connection errors, timeouts, 5xx, aborts);
    ``kind`` is a short reason for failures.jsonl (``http_400``, ``check_completion_tokens``, ...).
    """

    def __init__(
        self, kind: str, message: str, *, retryable: bool, status: int | None = None, retry_after_s: float | None = None
    ) -> None:
        self.kind = kind
        self.message = message
        self.retryable = retryable
        self.status = status
        #: The server's ``Retry-After`` (a 429 or 503), in seconds.
        self.retry_after_s = retry_after_s
        super().__init__(f"{kind}: {message}")
