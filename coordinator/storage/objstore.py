"""The run directory in a bucket: the `Store` operations as object requests (obstore).

What the protocol needs from storage, and how a bucket gives it:

- a whole-record publish readers see old or new, never torn: a PUT;
- an exclusive create: a conditional PUT (`If-None-Match: *`), refused with
  AlreadyExistsError (or PreconditionError) when the object exists;
- reads that see the latest publish: every read is a GET to the server (S3,
  Azure Blob and GCS are strongly consistent for reads after writes).

No publish needs a rename: `rename` (a copy then a delete, not atomic) is
used only by the master's `--new-run` archive and a stale claim's set-aside,
never to publish.  A bucket run directory has a node-local root (`local_dir`):
coordinator/storage/fsio.py and trees.py send every path beneath it here
(`routing.mount`), so every reader and writer of the run directory (records,
documents, chunks, checkpoints) talks to the bucket, and a file opened for
reading is first fetched into that root.

Every request is counted in fsio.STATS under its verb (get, put, put_if_absent,
list, head, delete, copy), so benchmarks can bound the requests a waiting rank
makes.  obstore retries a failed request itself (RETRY); what fails after that
is an OSError(EIO) the readers retry, or a BucketError when it will not heal
(credentials, a missing container).
"""

from __future__ import annotations

import datetime
import errno
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import obstore
from obstore.exceptions import (
    AlreadyExistsError,
    BaseError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)
from obstore.store import AzureStore, S3Store

from coordinator import routing
from coordinator.errors import BucketError, UnsafeFileError
from coordinator.storage import beneath, bucket_url, fsio, private_dir
from coordinator.storage.bucket_url import BucketURL, Scheme
from coordinator.storage.private_dir import PrivateDir

log = logging.getLogger(__name__)
# obstore's own retries of a failed request stay well inside a lease (15 s by
# default): a heartbeat PUT that still fails after them costs one beat (an EIO the
# publisher logs and retries at the next beat), not the rank.
RETRY: Final[Any] = {"max_retries": 4, "retry_timeout": datetime.timedelta(seconds=8),
                "backoff": {"init_backoff": datetime.timedelta(milliseconds=100),
                            "max_backoff": datetime.timedelta(seconds=2), "base": 2}}
# One request's whole time, body included: room for a 5 MB part of a large upload
# on a slow link; a checkpoint's large GET streams (objstore.download).
CLIENT: Final[dict[str, Any]] = {"connect_timeout": "5s", "timeout": "120s"}
# That time bounds a GET's body too: an object larger than this is read in ranges of
# it, each its own request under the 120 s (0.6 MB/s at least), all of the version
# the first answer named (if-match its ETag), so a checkpoint's 10 GB file is not
# lost to the clock on every try.
RANGE_BYTES: Final = 64 << 20
_MISSING_CONTAINER: Final = ("ContainerNotFound", "NoSuchBucket")
# What a server answers to a wrong or missing credential (obstore reports a refused
# listing as a generic error: the status and the code say which).
_REFUSED: Final = ("401 Unauthorized", "403 Forbidden", "AuthorizationFailure",
                   "AuthenticationFailed", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                   "AccessDenied")
# The environment a process started by a daemon reads to reach the same bucket.
URL_ENV: Final = "COORDINATOR_BUCKET_URL"
ROOT_ENV: Final = "COORDINATOR_BUCKET_ROOT"


def _fix(url: BucketURL) -> str:
    if url.scheme is Scheme.AZURE:
        return ("set AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT_NAME and "
                "AZURE_STORAGE_ACCOUNT_KEY) to the account that holds the container")
    return ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for a "
            "server other than AWS) to credentials for the bucket")


class ObjectStore:
    """One bucket prefix as a `Store` (coordinator/storage/store.py) and a `routing.Backend`."""

    def __init__(self, url: BucketURL, env: Mapping[str, str] | None = None) -> None:
        self.url = url
        env = os.environ if env is None else env
        self._env = env
        config: dict[str, Any]
        try:
            if url.scheme is Scheme.AZURE:
                config = bucket_url.azure_config(env)
                allow_http = config.pop("allow_http")
                client: Any = {**CLIENT, "allow_http": allow_http}
                self._store: Any = AzureStore(url.container, prefix=url.prefix,
                                              client_options=client, retry_config=RETRY, **config)
            else:
                config = bucket_url.s3_config(env)
                allow_http = config.pop("allow_http")
                client = {**CLIENT, "allow_http": allow_http}
                self._store = S3Store(url.container, prefix=url.prefix, client_options=client,
                                      retry_config=RETRY, **config)
        except BaseError as exc:
            raise BucketError(f"--run-dir {url}: {self._words(exc)}: {_fix(url)}") from None

    def __repr__(self) -> str:
        return f"ObjectStore({self.url})"

    # -- errors ---------------------------------------------------------------
    def _words(self, exc: BaseException) -> str:
        first = str(exc).split("\n", 1)[0]
        return bucket_url.redact(first, self._env)[:400]

    def _fail(self, exc: BaseException, key: str) -> Exception:
        """What an obstore error means to the protocol."""
        text = str(exc)
        if isinstance(exc, (PermissionDeniedError, UnauthenticatedError)) or \
                any(code in text for code in _REFUSED):
            return BucketError(f"{self.url}: access refused ({self._words(exc)}): "
                               f"{_fix(self.url)}")
        if any(code in text for code in _MISSING_CONTAINER):
            what = "container" if self.url.scheme is Scheme.AZURE else "bucket"
            return BucketError(
                f"{self.url}: the {what} {self.url.container!r} does not exist: create it "
                f"(coordinator never creates one), or fix --run-dir")
        return OSError(errno.EIO, f"{self.url}/{key}".rstrip("/") + f": {self._words(exc)}")

    def _call(self, verb: str, key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        fsio.STATS.count(verb)
        try:
            return fn(self._store, *args, **kwargs)
        except FileNotFoundError as exc:
            if any(code in str(exc) for code in _MISSING_CONTAINER):
                raise self._fail(exc, key) from None
            raise FileNotFoundError(errno.ENOENT, "no such object", f"{self.url}/{key}") \
                from None
        except (AlreadyExistsError, PreconditionError):
            raise
        except BaseError as exc:
            raise self._fail(exc, key) from None

    @staticmethod
    def _key(key: str) -> str:
        parts = [p for p in key.split("/") if p not in ("", ".")]
        if any(p == ".." for p in parts):
            raise UnsafeFileError(Path(key), "climbs out of the run directory ('..')")
        return "/".join(parts)

    # -- the Store interface ----------------------------------------------------
    def check(self) -> None:
        """One listing at start: BucketError for credentials, a missing container or
        no network, before anything is written."""
        try:
            self._call("list", "", obstore.list_with_delimiter, None)
        except OSError as exc:
            raise BucketError(
                f"--run-dir {self.url}: the server cannot be reached ({exc.strerror}): check "
                "the network and the endpoint (AZURE_STORAGE_ENDPOINT or the connection "
                "string's BlobEndpoint; AWS_ENDPOINT_URL)") from None

    def publish(self, key: str, data: bytes) -> None:
        self._call("put", key, obstore.put, self._key(key), data, use_multipart=False
                   if len(data) <= 8 << 20 else None)

    def read(self, key: str, *, fresh: bool = False,
             max_bytes: int = fsio.MAX_RECORD_BYTES) -> bytes | None:
        try:
            return self.read_bytes(key, max_bytes=max_bytes)
        except FileNotFoundError:
            return None

    def read_bytes(self, key: str, *, max_bytes: int = fsio.MAX_RECORD_BYTES) -> bytes:
        """The object's bytes; FileNotFoundError when it does not exist."""
        result = self._call("get", key, obstore.get, self._key(key))
        size = int(result.meta["size"])
        if size > max_bytes:
            raise UnsafeFileError(Path(f"{self.url}/{key}"),
                                  f"is {size} bytes, over the {max_bytes}-byte limit")
        return bytes(result.bytes())

    def create_exclusive(self, key: str, data: bytes) -> bool:
        try:
            self._call("put_if_absent", key, obstore.put, self._key(key), data, mode="create",
                       use_multipart=False)
        except (AlreadyExistsError, PreconditionError):
            return False
        return True

    def remove(self, key: str) -> bool:
        try:
            self._call("head", key, obstore.head, self._key(key))
        except FileNotFoundError:
            return False
        self._call("delete", key, obstore.delete, self._key(key))
        return True

    def remove_prefix(self, key: str) -> bool:
        """Every object beneath `key`/ (and `key` itself); False when there was none.
        Never the whole run directory: an empty key is refused."""
        prefix = self._key(key)
        if not prefix:
            raise ValueError(f"refusing to remove every object of {self.url}")
        paths = [prefix] if self.read_meta(prefix) else []
        fsio.STATS.count("list")
        try:
            for batch in obstore.list(self._store, prefix + "/" if prefix else None):
                paths.extend(str(meta["path"]) for meta in batch)
        except BaseError as exc:
            raise self._fail(exc, key) from None
        for start in range(0, len(paths), 256):
            self._call("delete", key, obstore.delete, paths[start:start + 256])
        return bool(paths)

    def exists(self, key: str) -> bool:
        return self.read_meta(key) is not None

    def read_meta(self, key: str) -> dict[str, Any] | None:
        try:
            return dict(self._call("head", key, obstore.head, self._key(key)))
        except FileNotFoundError:
            return None

    def rename(self, src: str, dst: str) -> None:
        """Copy then delete: not atomic, never a publish (see the module's docstring)."""
        self._call("copy", src, obstore.copy, self._key(src), self._key(dst))
        self._call("delete", src, obstore.delete, self._key(src))

    def listdir(self, key: str) -> list[str]:
        """Names directly beneath `key`: a hint for humans and recovery, never for waits."""
        prefix = self._key(key)
        listing = self._call("list", key, obstore.list_with_delimiter,
                             prefix + "/" if prefix else None)
        names = {str(p).rstrip("/").rsplit("/", 1)[-1] for p in listing["common_prefixes"]}
        names.update(str(m["path"]).rsplit("/", 1)[-1] for m in listing["objects"])
        return sorted(names)

    def list_files(self, key: str) -> list[str]:
        """Every object beneath `key`/, as sorted names relative to it."""
        prefix = self._key(key) + "/" if self._key(key) else ""
        fsio.STATS.count("list")
        names: list[str] = []
        try:
            for batch in obstore.list(self._store, prefix or None):
                names.extend(str(meta["path"])[len(prefix):] for meta in batch)
        except BaseError as exc:
            raise self._fail(exc, key) from None
        return sorted(names)

    def upload(self, key: str, source: Path) -> None:
        """A local file as one object, in parts when large (a checkpoint's weights)."""
        with open(source, "rb") as handle:
            self._call("put", key, obstore.put, self._key(key), handle)

    def download(self, key: str, target: Path, *, max_bytes: int | None = None) -> None:
        """The object into a new local file, replaced by rename; FileNotFoundError
        when it does not exist."""
        result = self._call("get", key, obstore.get, self._key(key))
        size = int(result.meta["size"])
        if max_bytes is not None and size > max_bytes:
            raise UnsafeFileError(Path(f"{self.url}/{key}"),
                                  f"is {size} bytes, over the {max_bytes}-byte limit")
        etag = result.meta.get("e_tag")
        if size > RANGE_BYTES and etag:
            result = None  # its body is not read: dropped, the ranges below read it
        beneath.make_dirs(target.parent)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.",
                                   suffix=fsio.TMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as out:
                if result is not None:
                    self._stream(key, result, out)
                else:
                    for start in range(0, size, RANGE_BYTES):
                        end = min(size, start + RANGE_BYTES)
                        self._stream(key, self._range(key, start, end, etag), out)
                        if out.tell() != end:
                            raise OSError(errno.EIO, f"bytes {start}..{end} of {size} came "
                                          f"back as {out.tell() - start}", f"{self.url}/{key}")
            os.chmod(tmp, fsio.FILE_MODE)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


    def _range(self, key: str, start: int, end: int, etag: str) -> Any:
        """Bytes [start, end) of the object's version `etag`; ESTALE once it was replaced."""
        try:
            return self._call("get", key, obstore.get, self._key(key),
                              options={"range": (start, end), "if_match": etag})
        except PreconditionError:
            raise OSError(errno.ESTALE, "replaced while it was being read",
                          f"{self.url}/{key}") from None

    def _stream(self, key: str, result: Any, out: Any) -> None:
        """A GET's body into `out`: an error mid-body is the protocol's, as at its start."""
        try:
            for chunk in result:
                out.write(chunk)
        except BaseError as exc:
            raise self._fail(exc, key) from None


def local_dir(url: BucketURL) -> PrivateDir:
    """This node's directory for a bucket run: where fetched files are opened from,
    and what the code above fsio takes as the run directory's path.  This user's
    alone, mode 0700, like its parent (coordinator/storage/private_dir.py): the URL's hash
    is no secret, and another user of the node must not be able to make it theirs,
    or a symlink to a directory the run would then fill and empty."""
    return PrivateDir(Path(tempfile.gettempdir()), (f"coordinator-bucket-{os.getuid()}",
                                                    url.digest))


def attach(text: str, env: Mapping[str, str] | None = None) -> Path:
    """Open the bucket of a `--run-dir` URL, check it can be used, and mount it at its
    local root (routing.mount); the root, which stands for the run directory from here on.
    The processes this one starts inherit the mount through the environment
    (`attach_from_env`)."""
    url = bucket_url.parse(text)
    store = ObjectStore(url, env)
    store.check()
    root = private_dir.make(local_dir(url))  # PrivateDirError (exit 2) when not ours alone
    routing.mount(root, store, label=str(url))
    os.environ[URL_ENV], os.environ[ROOT_ENV] = str(url), str(root)
    return root


def attach_from_env() -> None:
    """In a process a daemon started (trainer ranks, engines): the daemon's mount."""
    url, root = os.environ.get(URL_ENV), os.environ.get(ROOT_ENV)
    if url and root:
        routing.mount(Path(root), ObjectStore(bucket_url.parse(url)), label=url)
