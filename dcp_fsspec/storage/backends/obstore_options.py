"""The storage options users pass for s3fs and adlfs, turned into obstore's configuration.

Users keep writing the options of the fsspec driver they know (s3fs's ``key``, ``secret``,
``endpoint_url``, ``anon``…; adlfs's ``connection_string``, ``account_name``…). This module maps those that obstore can honour, and refuses every
other one with a line naming the option, so none is silently ignored.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from dcp_fsspec.errors import InvalidURLError

# The option that picks the transport; it never reaches a driver.
TRANSPORT_OPTION = "transport"
# The transport of the URLs whose options do not say (every rank and process of a job reads it).
TRANSPORT_VARIABLE = "DCP_FSSPEC_TRANSPORT"
TRANSPORTS = ("fsspec", "obstore")
# URL schemes the obstore transport serves.
S3_SCHEMES = ("s3", "s3a")
AZURE_SCHEMES = ("az", "abfs", "abfss")
OBSTORE_SCHEMES = (*S3_SCHEMES, *AZURE_SCHEMES)

# s3fs's top-level options → obstore's S3 configuration keys.
_S3_CONFIG = {
    "key": "access_key_id",
    "secret": "secret_access_key",
    "token": "session_token",
    "endpoint_url": "endpoint",
    "region_name": "region",
}
# s3fs's client_kwargs (botocore's client arguments) → obstore's S3 configuration keys.
_S3_CLIENT_KWARGS = {"endpoint_url": "endpoint", "region_name": "region"}
# botocore's Config (s3fs's config_kwargs) → obstore's client options.
_S3_CONFIG_KWARGS = {"read_timeout": "timeout", "connect_timeout": "connect_timeout"}
# botocore's Config(s3={...}): the keys that have an obstore counterpart.
_S3_SECTION = {name: name for name in ("payload_signing_enabled", "addressing_style")}
# botocore's choice of request checksums (s3fs's config_kwargs, or the environment): with
# "when_required", bodies go without a checksum header, for stores that refuse them.
_CHECKSUM_CHOICE = "request_checksum_calculation"
_CHECKSUM_VARIABLE = "AWS_REQUEST_CHECKSUM_CALCULATION"
_CHECKSUM_CHOICES = ("when_supported", "when_required")
# The checksum a signed request body carries (x-amz-checksum-sha256), checked by the server. The
# signature hashes the body with SHA-256 already, and obstore reuses that digest for it.
BODY_CHECKSUM = "sha256"
# adlfs's options → obstore's Azure configuration keys.
_AZURE_CONFIG = {
    "account_name": "account_name",
    "account_key": "account_key",
    "sas_token": "sas_key",
    "tenant_id": "tenant_id",
    "client_id": "client_id",
    "client_secret": "client_secret",
}
# The parts of an Azure connection string → obstore's Azure configuration keys.
_CONNECTION_STRING = {"AccountName": "account_name", "AccountKey": "account_key", "BlobEndpoint": "endpoint"}
_CONNECTION_STRING_IGNORED = {"DefaultEndpointsProtocol", "EndpointSuffix"}
# Options that change nothing on this transport (fsspec's own instance caching).
_IGNORED = {"skip_instance_cache", "use_listings_cache", "listings_expiry_time"}


def transport_of(url: str, storage_options: dict[str, Any]) -> str:
    """The transport for ``url``: ``storage_options["transport"]``, else
    ``$DCP_FSSPEC_TRANSPORT`` where obstore serves the scheme, else ``fsspec``.

    Raises:
        InvalidURLError: an unknown transport, or an option asking obstore for a scheme it does
            not serve.
    """
    scheme = url.split("://", 1)[0] if "://" in url and "::" not in url else None
    asked = TRANSPORT_OPTION in storage_options
    default = os.environ.get(TRANSPORT_VARIABLE, "fsspec") if scheme in OBSTORE_SCHEMES else "fsspec"
    transport = storage_options.get(TRANSPORT_OPTION, default)
    if transport not in TRANSPORTS:
        where = f"storage option {TRANSPORT_OPTION}" if asked else f"${TRANSPORT_VARIABLE}"
        raise InvalidURLError(
            f"cannot open {url!r}: {where}={transport!r} is unknown; use one of {list(TRANSPORTS)}"
        )
    if transport == "obstore" and scheme not in OBSTORE_SCHEMES:
        raise InvalidURLError(
            f"cannot open {url!r} with transport='obstore': it serves only "
            f"{', '.join(s + '://' for s in OBSTORE_SCHEMES)} URLs; drop the transport option"
        )
    return str(transport)


def s3_options(url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """obstore's ``config`` and ``client_options`` for s3fs's ``storage_options``.

    Raises:
        InvalidURLError: an option obstore cannot honour, named with what to do instead.
    """
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    botocore: dict[str, Any] = {}
    for name, value in storage_options.items():
        if name in _S3_CONFIG:
            config[_S3_CONFIG[name]] = value
        elif name == "anon":
            config["skip_signature"] = bool(value)
        elif name == "client_kwargs":
            config.update(_mapped(url, name, value, _S3_CLIENT_KWARGS))
        elif name == "config_kwargs":
            botocore = _dict(url, name, value)
        elif name not in _IGNORED and name != TRANSPORT_OPTION:
            raise _refused(url, name, _S3_KNOWN, "s3fs")
    over_http = str(config.get("endpoint", "")).startswith("http://")
    if over_http:
        client["allow_http"] = True
    _apply_botocore_config(url, botocore, over_http, config, client)
    return {"config": config, "client_options": client}


def _apply_botocore_config(
    url: str, botocore: dict[str, Any], over_http: bool, config: dict[str, Any], client: dict[str, Any]
) -> None:
    """botocore's ``Config`` (s3fs's ``config_kwargs``): timeouts, addressing, payload signing
    and request checksums, as botocore applies them.

    Bodies are signed with their SHA-256 over ``http://`` only, as botocore signs them; over
    ``https://`` TLS guards them and the hash would cost a pass over every byte. A signed body
    also carries that digest as its checksum for the server to check.
    """
    botocore = dict(botocore)
    checksums = botocore.pop(_CHECKSUM_CHOICE, os.environ.get(_CHECKSUM_VARIABLE, "when_supported"))
    s3 = _mapped(url, "config_kwargs['s3']", botocore.pop("s3", {}), _S3_SECTION)
    timeouts = _mapped(url, "config_kwargs", botocore, _S3_CONFIG_KWARGS)
    client.update({k: timedelta(seconds=float(v)) for k, v in timeouts.items()})
    if "addressing_style" in s3:
        config["virtual_hosted_style_request"] = s3["addressing_style"] == "virtual"
    checksummed = _checksums_wanted(url, checksums)
    signed = bool(s3.get("payload_signing_enabled", over_http))
    config["unsigned_payload"] = not signed
    if signed and checksummed:
        config["checksum_algorithm"] = BODY_CHECKSUM


def _checksums_wanted(url: str, choice: Any) -> bool:
    """Whether request bodies carry :data:`BODY_CHECKSUM`: unless botocore's
    ``request_checksum_calculation`` (option or environment) says ``when_required``."""
    choice = str(choice).lower()
    if choice not in _CHECKSUM_CHOICES:
        raise InvalidURLError(
            f"cannot open {url!r}: {_CHECKSUM_CHOICE}={choice!r} is unknown; use one of {list(_CHECKSUM_CHOICES)}"
        )
    return choice == "when_supported"


def azure_options(url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """obstore's ``config`` and ``client_options`` for adlfs's ``storage_options``.

    Raises:
        InvalidURLError: an option obstore cannot honour, named with what to do instead.
    """
    config: dict[str, Any] = {}
    for name, value in storage_options.items():
        if name in _AZURE_CONFIG:
            config[_AZURE_CONFIG[name]] = value
        elif name == "anon":
            config["skip_signature"] = bool(value)
        elif name == "connection_string":
            config.update(_connection_string(url, str(value)))
        elif name not in _IGNORED and name != TRANSPORT_OPTION:
            raise _refused(url, name, [*_AZURE_CONFIG, "anon", "connection_string"], "adlfs")
    client = {"allow_http": True} if str(config.get("endpoint", "")).startswith("http://") else {}
    return {"config": config, "client_options": client}


def _connection_string(url: str, text: str) -> dict[str, str]:
    """An Azure connection string's parts (``Name=value;…``) as obstore's keys."""
    config = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, value = part.partition("=")
        if name in _CONNECTION_STRING:
            config[_CONNECTION_STRING[name]] = value
        elif name not in _CONNECTION_STRING_IGNORED:
            raise _refused(url, f"connection_string's {name}", list(_CONNECTION_STRING), "adlfs")
    return config


def _dict(url: str, option: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidURLError(f"cannot open {url!r}: storage option {option!r} must be a dict")
    return value


def _mapped(url: str, option: str, value: Any, table: dict[str, str]) -> dict[str, Any]:
    value = _dict(url, option, value)
    unknown = sorted(set(value) - set(table))
    if unknown:
        raise _refused(url, f"{option}[{unknown[0]!r}]", _S3_KNOWN, "s3fs")
    return {table[k]: v for k, v in value.items()}


_S3_KNOWN = [*_S3_CONFIG, "anon", "client_kwargs", "config_kwargs"]


def _refused(url: str, option: str, known: list[str], driver: str) -> InvalidURLError:
    return InvalidURLError(
        f"cannot open {url!r} with transport='obstore': storage option {option} has no obstore "
        f"equivalent; pass only {sorted(known)}, or drop transport='obstore' to use {driver}"
    )
