"""``client_context``: the TLS client context of every source that speaks TLS (the data
service's client, the Cassandra store), made and checked one way."""

from __future__ import annotations

import ssl

from .._errors import ConfigError

__all__ = ["client_context"]


def client_context(ca_file: str | None, *, verify: bool, what: str, cert: str | None = None,
                   key: str | None = None) -> ssl.SSLContext:
    """Verify peers with ``ca_file`` (None: the system's CAs), present ``cert``/``key`` when given;
    ``verify=False`` checks neither certificate nor host name (testing only). A file that does
    not load is a ConfigError starting with ``what``."""
    try:
        ctx = ssl.create_default_context(cafile=ca_file)
        if cert:
            ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{what}: {exc}") from exc
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx
