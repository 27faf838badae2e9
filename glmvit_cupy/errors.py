"""The one exception type users see.

Every refusal the package makes on bad input (a config it cannot read, a tensor of the
wrong dtype, an image that does not decode, a geometry the kernels were not written for)
raises `GlmVitError` with one sentence that names the file, tensor or number at fault.
The CLI prints that sentence and exits non-zero; nothing else reaches the user as a
traceback. Bugs stay ordinary exceptions, so they do show one.
"""


class GlmVitError(Exception):
    """A user-facing refusal: one line naming the culprit."""


class InternalError(RuntimeError):
    """A broken invariant of the package itself (a bug, not the caller's input): checked with
    `if`, not `assert`, where breaking it would read or write out of bounds, so `python -O`
    keeps the check."""


class InputError(GlmVitError):
    """One input cannot be encoded (it does not decode, exceeds the token budget, or its
    embedding holds NaN/Inf); every other input of the same call or batch can."""


class Overloaded(GlmVitError):
    """A batcher's queue is full: the request was refused at once, not queued."""


class RequestTimeout(GlmVitError):
    """A batcher's request was not answered within its timeout_s."""
