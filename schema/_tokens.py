"""The data service's bearer-token file, read the same way by both sides.

One token per line; blank lines and ``#`` comments are ignored. The server
accepts every token in the file (that is how a rotation goes without a failed
request: old and new, then new alone); the client sends the first. Both read
the file with :func:`read_token_file`, so the file an operator writes for the
server works unchanged for a client.

Errors are a :class:`~dataferry.schema.ConfigError` of one line naming the file
(and the line at fault), never showing a token.
"""

from __future__ import annotations

from ._errors import ConfigError

__all__ = ["read_token_file", "valid_token"]


def valid_token(token: object) -> bool:
    """Whether ``token`` can go in an ``Authorization: Bearer`` header:
    non-empty printable ASCII without spaces."""
    return isinstance(token, str) and bool(token) and token.isascii() and token.isprintable() and " " not in token


def read_token_file(path: str) -> tuple[str, ...]:
    """The tokens in ``path``, in file order (at least one).

    ConfigError names the file, and the line for a malformed token, never its contents.
    """
    try:
        # utf-8-sig: a byte-order mark left by an editor is not part of the first token
        with open(path, encoding="utf-8-sig") as fh:
            lines = [line.strip() for line in fh]
    except (OSError, UnicodeDecodeError) as exc:
        # the reason alone: a UnicodeDecodeError's message would quote bytes of the token
        reason = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else exc.strerror or type(exc).__name__
        raise ConfigError(f"cannot read token file {path!r}: {reason}") from exc
    tokens = []
    for number, line in enumerate(lines, 1):
        if not line or line.startswith("#"):
            continue
        if not valid_token(line):
            raise ConfigError(f"token file {path!r}, line {number}: a token is printable ASCII without spaces")
        tokens.append(line)
    if not tokens:
        raise ConfigError(f"token file {path!r} is empty (one token per line; blank lines and # comments ignored)")
    return tuple(tokens)
