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
