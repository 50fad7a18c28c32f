"""--run-dir bucket URLs and credentials: checked at the boundary, never shown."""

from __future__ import annotations

import pytest

from coordinator.errors import UsageError
from coordinator.storage import bucket_url
from coordinator.storage.bucket_url import Scheme


def test_a_url_is_split_into_container_and_prefix() -> None:
    url = bucket_url.parse("az://runs/exp1/")
    assert (url.scheme, url.container, url.prefix) == (Scheme.AZURE, "runs", "exp1")
    assert str(url) == "az://runs/exp1"
    s3 = bucket_url.parse("s3://my.bucket-1/a/b")
    assert (s3.scheme, s3.container, s3.prefix) == (Scheme.S3, "my.bucket-1", "a/b")
    assert bucket_url.is_bucket_url("s3://x/y") and not bucket_url.is_bucket_url("/shared/x")


@pytest.mark.parametrize(("text", "words"), [
    ("gs://runs/exp1", "gs:// is not a run directory this version takes"),
    ("az://Runs/exp1", "'Runs' is not a valid container name"),
    ("s3://ab/exp1", "'ab' is not a valid bucket name"),
    ("az://runs", "names no prefix"),
    ("az://runs/../x", "prefix part '..' is not allowed"),
    ("s3://runs/a b", "prefix part 'a b' is not allowed"),
])
def test_a_bad_url_names_the_part_and_the_form(text: str, words: str) -> None:
    with pytest.raises(UsageError, match="--run-dir") as caught:
        bucket_url.parse(text)
    assert words in str(caught.value)


def test_azure_credentials_come_from_the_connection_string_or_the_account_variables() -> None:
    dev = bucket_url.azure_config({"AZURE_STORAGE_CONNECTION_STRING": "UseDevelopmentStorage=true"})
    assert dev["account_name"] == "devstoreaccount1" and dev["allow_http"] is True
    cloud = bucket_url.azure_config({"AZURE_STORAGE_CONNECTION_STRING": (
        "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=c2VjcmV0;"
        "EndpointSuffix=core.windows.net")})
    assert cloud == {"account_name": "acct", "account_key": "c2VjcmV0",
                     "endpoint": "https://acct.blob.core.windows.net", "allow_http": False}
    keyed = bucket_url.azure_config({"AZURE_STORAGE_ACCOUNT_NAME": "acct",
                                     "AZURE_STORAGE_ACCOUNT_KEY": "c2VjcmV0"})
    assert keyed == {"account_name": "acct", "account_key": "c2VjcmV0", "allow_http": False}
    with pytest.raises(UsageError, match="names no AccountName") as caught:
        bucket_url.azure_config({"AZURE_STORAGE_CONNECTION_STRING": "AccountKey=c2VjcmV0"})
    assert "c2VjcmV0" not in str(caught.value)


def test_s3_credentials_and_endpoint_come_from_the_aws_variables() -> None:
    config = bucket_url.s3_config({"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "sk",
                                   "AWS_ENDPOINT_URL": "http://127.0.0.1:9000"})
    assert config == {"allow_http": True, "endpoint": "http://127.0.0.1:9000",
                      "access_key_id": "id", "secret_access_key": "sk",
                      "region": "us-east-1"}


def test_redact_removes_every_credential_value_and_signed_url_parameters() -> None:
    env = {"AZURE_STORAGE_CONNECTION_STRING": "AccountName=a;AccountKey=topsecretkey==;",
           "AWS_SECRET_ACCESS_KEY": "awssecret123"}
    text = ("GET https://a.blob.core.windows.net/c/x?sv=1&sig=abc%2Fdef&se=2 failed; "
            "key topsecretkey== and awssecret123; X-Amz-Signature=ffff")
    clean = bucket_url.redact(text, env)
    for secret in ("topsecretkey==", "awssecret123", "abc%2Fdef", "ffff"):
        assert secret not in clean
    assert "sig=<redacted>" in clean and "sv=1" in clean
