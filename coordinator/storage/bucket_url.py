"""A run directory in a bucket: its URL, its credentials, and how to keep them secret.

`--run-dir az://CONTAINER/PREFIX` or `s3://BUCKET/PREFIX` names a run directory
in Azure Blob Storage or S3 (or a server that speaks S3: MinIO, moto, Ceph).
Credentials come from the environment, as each cloud's own tools take them:

- Azure: AZURE_STORAGE_CONNECTION_STRING (its `UseDevelopmentStorage=true` form
  and Azurite's documented development string included), or
  AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY (or _SAS_KEY),
  AZURE_STORAGE_ENDPOINT for a server other than Azure's.
- S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION,
  AWS_ENDPOINT_URL for a server other than AWS.

They never reach run.json, a record, a log line or an error message: every
message that may quote a server's answer goes through `redact`.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import os
import re
from collections.abc import Mapping
from typing import Any, Final

from coordinator.errors import UsageError


class Scheme(enum.Enum):
    AZURE = "az"
    S3 = "s3"


# Azure container names: 3-63 of lowercase letters, digits and single hyphens;
# S3 bucket names: 3-63 of lowercase letters, digits, dots and hyphens.
_NAME: Final = {Scheme.AZURE: re.compile(r"^[a-z0-9](?!.*--)[a-z0-9-]{1,61}[a-z0-9]$"),
                Scheme.S3: re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")}
_PREFIX_PART: Final = re.compile(r"^[A-Za-z0-9._=@+-]+$")
# Azurite's documented development account (public, the same on every machine).
AZURITE_ACCOUNT: Final = "devstoreaccount1"
AZURITE_KEY: Final = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/"
                      "K1SZFPTOtr/KBHBeksoGMGw==")
AZURITE_ENDPOINT: Final = "http://127.0.0.1:10000/devstoreaccount1"
_SECRET_ENV: Final = ("AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_KEY",
                      "AZURE_STORAGE_CONNECTION_STRING", "AWS_SECRET_ACCESS_KEY",
                      "AWS_SESSION_TOKEN")


@dataclasses.dataclass(frozen=True)
class BucketURL:
    """scheme://container/prefix, checked; the prefix has no leading or trailing '/'."""

    scheme: Scheme
    container: str
    prefix: str

    def __str__(self) -> str:
        return f"{self.scheme.value}://{self.container}/{self.prefix}"

    @property
    def digest(self) -> str:
        """A short name for this run directory in node-local paths."""
        return hashlib.sha256(str(self).encode()).hexdigest()[:16]


def is_bucket_url(text: str) -> bool:
    return "://" in text


def parse(text: str) -> BucketURL:
    """The --run-dir URL, or UsageError naming what is wrong and the form to use."""
    form = "az://CONTAINER/PREFIX or s3://BUCKET/PREFIX"
    scheme_text, _, rest = text.partition("://")
    try:
        scheme = Scheme(scheme_text.lower())
    except ValueError:
        raise UsageError(
            f"--run-dir {text!r}: {scheme_text}:// is not a run directory this version "
            f"takes: give {form}, or a directory on a shared POSIX filesystem") from None
    container, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not _NAME[scheme].match(container):
        what = "container" if scheme is Scheme.AZURE else "bucket"
        raise UsageError(
            f"--run-dir {text!r}: {container!r} is not a valid {what} name (3-63 lowercase "
            f"letters, digits and hyphens): give {form}")
    parts = prefix.split("/") if prefix else []
    if not parts:
        raise UsageError(
            f"--run-dir {text!r} names no prefix: give the run its own prefix inside the "
            f"{container!r}, e.g. {scheme.value}://{container}/runs/exp1")
    for part in parts:
        if part in (".", "..") or not _PREFIX_PART.match(part):
            raise UsageError(
                f"--run-dir {text!r}: prefix part {part!r} is not allowed (letters, digits "
                f"and ._=@+- only, no '.' or '..'): e.g. {scheme.value}://{container}/runs/exp1")
    return BucketURL(scheme, container, "/".join(parts))


def _connection_string(text: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for item in text.split(";"):
        if item.strip():
            key, sep, value = item.partition("=")
            if not sep:
                raise UsageError(
                    "AZURE_STORAGE_CONNECTION_STRING is not a list of key=value pairs "
                    "separated by ';' (its value is not shown): copy it again from the "
                    "storage account's Access keys page")
            fields[key.strip()] = value.strip()
    return fields


def azure_config(env: Mapping[str, str]) -> dict[str, Any]:
    """obstore's AzureStore settings from the environment (obstore reads the
    AZURE_STORAGE_* variables itself, but not the connection string)."""
    text = env.get("AZURE_STORAGE_CONNECTION_STRING")
    if not text:
        named = {"account_name": "AZURE_STORAGE_ACCOUNT_NAME",
                 "account_key": "AZURE_STORAGE_ACCOUNT_KEY",
                 "sas_key": "AZURE_STORAGE_SAS_KEY", "endpoint": "AZURE_STORAGE_ENDPOINT"}
        config: dict[str, Any] = {k: env[v] for k, v in named.items() if env.get(v)}
        config["allow_http"] = str(config.get("endpoint", "")).startswith("http://")
        return config
    fields = _connection_string(text)
    if fields.get("UseDevelopmentStorage", "").lower() == "true":
        return {"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY,
                "endpoint": AZURITE_ENDPOINT, "allow_http": True}
    config = {}
    if "AccountName" in fields:
        config["account_name"] = fields["AccountName"]
    if "AccountKey" in fields:
        config["account_key"] = fields["AccountKey"]
    if "SharedAccessSignature" in fields:
        config["sas_key"] = fields["SharedAccessSignature"]
    if "BlobEndpoint" in fields:
        config["endpoint"] = fields["BlobEndpoint"].rstrip("/")
    elif "AccountName" in fields and "EndpointSuffix" in fields:
        protocol = fields.get("DefaultEndpointsProtocol", "https")
        config["endpoint"] = (f"{protocol}://{fields['AccountName']}.blob."
                              f"{fields['EndpointSuffix']}")
    if "account_name" not in config:
        raise UsageError(
            "AZURE_STORAGE_CONNECTION_STRING names no AccountName (its value is not shown): "
            "copy it again from the storage account's Access keys page")
    config["allow_http"] = str(config.get("endpoint", "")).startswith("http://")
    return config


def s3_config(env: Mapping[str, str]) -> dict[str, Any]:
    """obstore's S3Store settings from the AWS_* variables of `env` (obstore reads the
    process's own environment too; `env` is what this store is asked to use)."""
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or ""
    config: dict[str, Any] = {"allow_http": endpoint.startswith("http://")}
    if endpoint:
        config["endpoint"] = endpoint
    named = {"access_key_id": "AWS_ACCESS_KEY_ID", "secret_access_key": "AWS_SECRET_ACCESS_KEY",
             "session_token": "AWS_SESSION_TOKEN"}
    config.update({k: env[v] for k, v in named.items() if env.get(v)})
    # What the AWS tools assume when no region is set.
    config["region"] = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
    return config


def secrets_in(env: Mapping[str, str] | None = None) -> list[str]:
    """Every credential value in the environment, for `redact`."""
    env = os.environ if env is None else env
    found = [env[name] for name in _SECRET_ENV if env.get(name)]
    text = env.get("AZURE_STORAGE_CONNECTION_STRING")
    if text:
        found.extend(v for k, v in (p.partition("=")[::2] for p in text.split(";"))
                     if k.strip() in ("AccountKey", "SharedAccessSignature") and v)
    return [s for s in found if len(s) >= 4]


_SIGNATURES: Final = re.compile(r"((?:sig|Signature|X-Amz-Signature|X-Amz-Credential|"
                                r"X-Amz-Security-Token|AccountKey)=)[^&;\s\"']+")


def redact(message: str, env: Mapping[str, str] | None = None) -> str:
    """`message` without any credential: known values and signed-URL parameters."""
    for secret in secrets_in(env):
        message = message.replace(secret, "<redacted>")
    return _SIGNATURES.sub(r"\1<redacted>", message)
