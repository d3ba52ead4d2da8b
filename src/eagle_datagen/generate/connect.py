"""How every connection to a server is made: one TLS trust store, and never through a proxy.

:func:`ssl_context` builds the one :class:`ssl.SSLContext` of a run; the ``/generate`` transport
and the httpx client (health, server info) both use it, so a server either verifies for both or
for neither. :func:`refuse_proxies` stops a run whose environment would send a server's traffic
through ``HTTP(S)_PROXY``/``ALL_PROXY``: eagle-datagen connects directly, and says how to exempt
the server (``NO_PROXY``) instead of ignoring the variable in silence. docs/security.md says why.
"""

from __future__ import annotations

import ipaddress
import os
import shlex
import ssl
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import urlsplit

from eagle_datagen.errors import UsageError


def ssl_context(ca_bundle: Path | None = None) -> ssl.SSLContext:
    """The run's trust store: ``--ca-bundle FILE`` alone, else the system store (which honours
    ``SSL_CERT_FILE``/``SSL_CERT_DIR``); certifi's bundle (what httpx trusted alone before) when the
    system store holds no CA certificate file (a Python whose OpenSSL directory is empty)."""
    if ca_bundle is not None:
        try:
            return ssl.create_default_context(cafile=str(ca_bundle))
        except FileNotFoundError:
            raise UsageError(f"--ca-bundle {ca_bundle}: no such file") from None
        except (OSError, ssl.SSLError) as exc:
            raise UsageError(
                f"--ca-bundle {ca_bundle} is not a readable PEM file of CA certificates ({exc}); give the "
                "PEM bundle of the CA that signed the server's certificate"
            ) from None
    context = ssl.create_default_context()
    if context.cert_store_stats()["x509_ca"] == 0:
        try:
            import certifi
        except ImportError:  # pragma: no cover - httpx depends on certifi
            return context
        context.load_verify_locations(cafile=certifi.where())
    return context


def refuse_proxies(urls: Iterable[str]) -> None:
    """A :class:`UsageError` when the environment's proxy settings (read as urllib reads them) would
    apply to one of ``urls``. Loopback hosts never go through a proxy (as Go's net/http decides)."""
    env = os.environ
    proxies = urllib.request.getproxies_environment()
    if not proxies:
        return
    for url in urls:
        parts = urlsplit(url)
        host = parts.hostname or ""
        proxy = proxies.get(parts.scheme) or proxies.get("all")
        if not proxy or _loopback(host) or _bypassed(parts.netloc.rsplit("@", 1)[-1], host, proxies):
            continue
        variable = _variable(env, parts.scheme)
        no_proxy_var = "no_proxy" if "no_proxy" in env else "NO_PROXY"
        current = env.get(no_proxy_var, "")
        value = f"{host},{current}" if current else host
        raise UsageError(
            f"{variable}={_without_userinfo(proxy)} is set and would route {url} through a proxy, but "
            f"eagle-datagen connects to SGLang servers directly, never through a proxy. Exempt the server: "
            f"export {no_proxy_var}={shlex.quote(value)}   (or unset {variable} for this command)"
        )


def _bypassed(netloc: str, host: str, proxies: dict[str, str]) -> bool:
    """NO_PROXY matches, by urllib's rules (suffixes, ``*``, with or without the port)."""
    bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]  # public, not in typeshed
    return bool(bypass(netloc, proxies)) or bool(bypass(host, proxies))


def _loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _variable(env: Mapping[str, str], scheme: str) -> str:
    """The environment variable that set the proxy for ``scheme`` (the lower-case one wins, as in urllib)."""
    for name in (f"{scheme}_proxy", f"{scheme.upper()}_PROXY", "all_proxy", "ALL_PROXY"):
        if env.get(name):
            return name
    return f"{scheme.upper()}_PROXY"


def _without_userinfo(proxy: str) -> str:
    parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    if "@" not in parts.netloc:
        return proxy
    return parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]).geturl()
