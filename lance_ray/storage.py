"""Every file lance_ray writes or reads, on a local disk or an object store.

One place turns "a path or a URI" into ``(pyarrow filesystem, path)`` and does the atomic
JSON write and the read over it:

* a string without ``://`` (or a ``PathLike``) is a local path; ``file://`` is local too;
* ``s3://``, ``gs://`` / ``gcs://`` and ``az://`` / ``abfs://`` go to pyarrow's S3, GCS and
  Azure filesystems;
* any other ``scheme://`` is an error, never a local directory named ``scheme:``.

Credentials come only from the environment (``AWS_ACCESS_KEY_ID``, ...) or from a
zero-argument ``storage_options`` factory (the same Lance-style options a dataset takes, e.g.
``aws_access_key_id``, ``aws_endpoint``), called where the file is opened. Filesystems built
here are never pickled or logged. Remote operations retry with bounded exponential backoff
(:class:`RetryPolicy`) and then fail with :class:`StorageUnavailable`, never silently.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pyarrow.fs as pafs

logger = logging.getLogger(__name__)

StorageOptionsFactory = Callable[[], dict[str, str]]
T = TypeVar("T")

REMOTE_SCHEMES = {"s3": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure",
                  "abfss": "azure"}
RETRY_TIMEOUT_ENV = "LANCE_RAY_STORAGE_RETRY_TIMEOUT_S"
DEFAULT_RETRY_TIMEOUT_S = 60.0
# Per-request limits, so that a server that accepts connections but never answers cannot
# hang a call: the retry loop, not the socket, decides how long to wait.
CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 20.0
TORN_READ_ATTEMPTS = 3
_MANGLED_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/")  # two letters or more: not C:/
_ENV_KEYS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT", "AWS_REGION",
             "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID", "AZURE_STORAGE_ACCOUNT_NAME")


class StorageUnavailable(OSError):
    """An object store stayed unreachable for longer than the retry policy allows."""


@dataclass(frozen=True)
class RetryPolicy:
    """How long remote storage calls keep retrying transient errors.

    No retry starts after ``timeout_s`` (default: the environment variable
    ``LANCE_RAY_STORAGE_RETRY_TIMEOUT_S``, else 60 s); each attempt is itself bounded by the
    connect and request timeouts, so a call returns or raises within about
    ``timeout_s + REQUEST_TIMEOUT_S``. Waits start at ``first_backoff_s`` and double up to
    ``max_backoff_s``.
    """

    timeout_s: float | None = None
    first_backoff_s: float = 0.1
    max_backoff_s: float = 4.0

    def deadline_s(self) -> float:
        if self.timeout_s is not None:
            return self.timeout_s
        return float(os.environ.get(RETRY_TIMEOUT_ENV, DEFAULT_RETRY_TIMEOUT_S))


def is_uri(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a scheme (``s3://...``, ``file://...``)."""
    return isinstance(path, str) and "://" in path


def is_remote(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` lives on an object store (not on a local or mounted disk)."""
    return is_uri(path) and not str(path).startswith("file://")


def join(base: str | os.PathLike[str], *parts: str) -> str:
    """``base/part/...`` for a local path or a URI (URIs always use ``/``)."""
    if not is_uri(base):
        return os.path.join(os.fspath(base), *parts)
    return "/".join([str(base).rstrip("/"), *(p.strip("/") for p in parts)])


def basename(path: str | os.PathLike[str]) -> str:
    """The last component of a local path or a URI."""
    return str(path).rstrip("/").rsplit("/", 1)[-1] if is_uri(path) else os.path.basename(path)


def absolute(path: str | os.PathLike[str]) -> str:
    """A URI unchanged; a local path made absolute (jobs run in a copy of the working dir)."""
    return str(path) if is_uri(path) else os.path.abspath(os.fspath(path))


def resolve(path: str | os.PathLike[str],
            storage_options: StorageOptionsFactory | None = None,
            filesystem: pafs.FileSystem | None = None) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem that holds ``path`` and the path inside it; with
    ``filesystem``, ``path`` is already a path inside that filesystem (as Ray Train's
    ``Checkpoint.filesystem`` and ``Checkpoint.path`` give it)."""
    if filesystem is not None:
        return filesystem, os.fspath(path)
    if not is_uri(path):
        local = os.fspath(path)
        if _MANGLED_URI.match(local):
            raise ValueError(
                f"{local!r} looks like a URI that lost a slash (pathlib.Path('s3://b/x') "
                "becomes 's3:/b/x'); pass the URI as a string, e.g. 's3://bucket/path'"
            )
        return pafs.LocalFileSystem(), os.path.abspath(local)
    text = str(path)
    scheme, rest = text.split("://", 1)
    scheme = scheme.lower()
    if scheme == "file":
        return pafs.LocalFileSystem(), os.path.abspath(rest)
    kind = REMOTE_SCHEMES.get(scheme)
    if kind is None:
        raise ValueError(
            f"unsupported storage scheme {scheme!r} in {text!r}: use a local path, file://, "
            f"or one of {', '.join(s + '://' for s in REMOTE_SCHEMES)}"
        )
    if not rest.split("/", 1)[0]:
        raise ValueError(f"{text!r} names no bucket or container: write {scheme}://bucket/path")
    account = None
    if kind == "azure" and "@" in rest.split("/", 1)[0]:
        # abfss://container@account.dfs.core.windows.net/path: the account is in the URI.
        where, _, path = rest.partition("/")
        container, _, host = where.partition("@")
        account, rest = host.split(".", 1)[0], f"{container}/{path}"
    env = tuple(os.environ.get(k) for k in _ENV_KEYS)
    if not hashable(storage_options):  # a factory that cannot key the cache
        return _remote_filesystem.__wrapped__(kind, storage_options, env, account), \
            rest.rstrip("/")
    return _remote_filesystem(kind, storage_options, env, account), rest.rstrip("/")


@functools.lru_cache(maxsize=16)
def _remote_filesystem(kind: str, storage_options: StorageOptionsFactory | None,
                       env: tuple[str | None, ...], account: str | None) -> pafs.FileSystem:
    # ``env`` is part of the cache key only: a changed environment gets a new filesystem.
    opts = {k.lower(): v for k, v in (storage_options() if storage_options else {}).items()}
    if kind == "s3":
        return _s3(opts, own_retries=False)
    if kind == "gcs":
        return pafs.GcsFileSystem(**_pick(opts, {"google_endpoint": "endpoint_override"}))
    account = account or opts.get("azure_storage_account_name") or os.environ.get(
        "AZURE_STORAGE_ACCOUNT_NAME")
    if not account:
        raise ValueError("az:// paths need the account name: set AZURE_STORAGE_ACCOUNT_NAME or "
                         "azure_storage_account_name in the storage options")
    return pafs.AzureFileSystem(account, **_pick(opts, {"azure_storage_account_key":
                                                        "account_key"}))


def _pick(opts: dict[str, str], names: dict[str, str]) -> dict[str, str]:
    return {ours: opts[theirs] for theirs, ours in names.items() if opts.get(theirs)}


def _s3(opts: dict[str, str], *, own_retries: bool) -> pafs.FileSystem:
    """pyarrow S3 from Lance-style options, else the environment (the same variables that
    Lance reads, so one setting serves tables and run storage). Without ``own_retries`` one
    request is one attempt: :func:`with_retries` alone decides how long to keep trying."""
    kwargs: dict[str, Any] = _pick(opts, {"aws_access_key_id": "access_key",
                                          "aws_secret_access_key": "secret_key",
                                          "aws_session_token": "session_token"})
    endpoint = (opts.get("aws_endpoint") or opts.get("aws_endpoint_url")
                or opts.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT"))
    if endpoint:
        kwargs["endpoint_override"] = endpoint  # "http://host:port" also sets the scheme
    region = (opts.get("aws_region") or opts.get("region") or os.environ.get("AWS_REGION")
              or os.environ.get("AWS_DEFAULT_REGION"))
    if region:
        kwargs["region"] = region
    if not own_retries:
        kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=1)
    return pafs.S3FileSystem(connect_timeout=CONNECT_TIMEOUT_S,
                             request_timeout=REQUEST_TIMEOUT_S, **kwargs)


def s3_filesystem_from_env() -> pafs.FileSystem:
    """An S3 filesystem configured only from the environment, safe to pickle (it holds no
    keys: each process reads its own credentials), e.g. for ``RunConfig(storage_filesystem=)``
    with an S3-compatible endpoint (``AWS_ENDPOINT_URL``). It keeps pyarrow's own request
    retries (Ray Train has no retry loop around its uploads)."""
    return _s3({}, own_retries=True)


# ----------------------------------------------------------------------- retries

_PERMANENT = ("ACCESS_DENIED", "INVALID_ACCESS_KEY", "SIGNATURE_DOES_NOT_MATCH",
              "NO_SUCH_BUCKET", "AccessDenied", "InvalidAccessKeyId", "NoSuchBucket")


def _transient(e: BaseException) -> bool:
    if isinstance(e, FileNotFoundError | PermissionError | IsADirectoryError):
        return False
    return isinstance(e, OSError) and not any(m in str(e) for m in _PERMANENT)


def with_retries(op: Callable[[], T], *, what: str, remote: bool,
                 policy: RetryPolicy | None = None) -> T:
    """Run ``op``; on a remote store retry transient errors with bounded backoff.

    Raises :class:`StorageUnavailable` naming ``what`` once the policy's time is spent, so a
    store that is down fails the caller clearly instead of hanging or being skipped.
    """
    if not remote:
        return op()
    policy = policy or RetryPolicy()
    deadline = time.monotonic() + policy.deadline_s()
    backoff, attempts = policy.first_backoff_s, 0
    while True:
        attempts += 1
        try:
            return op()
        except Exception as e:
            if not _transient(e):
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise StorageUnavailable(
                    f"could not {what} after {attempts} attempts over "
                    f"{policy.deadline_s():.0f}s: {e}. The object store is unreachable; set "
                    f"{RETRY_TIMEOUT_ENV} to wait longer"
                ) from e
            logger.warning("storage: %s failed (attempt %d, retrying in %.1fs): %s", what,
                           attempts, min(backoff, left), e)
            time.sleep(min(backoff, left))
            backoff = min(backoff * 2, policy.max_backoff_s)


# ----------------------------------------------------------------------- bytes and JSON

def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, *, fsync: bool = True,
                       storage_options: StorageOptionsFactory | None = None,
                       retry: RetryPolicy | None = None) -> None:
    """Write ``data`` so that readers see the old content or the new one, never half.

    Local: a temp file in the same directory, fsync (unless ``fsync=False``, which still
    survives the writer dying; only a machine crash can then lose the newest file), rename.
    """
    fs, inner = resolve(path, storage_options)
    if isinstance(fs, pafs.LocalFileSystem):
        _write_local_atomic(Path(inner), data, fsync=fsync)
        return

    def put() -> None:
        # Why one upload is atomic: S3, GCS and Azure publish an object only when its upload
        # completes, and then replace the previous one whole. ``data`` is serialised in full
        # before the stream opens and written in one call, so the object goes up in one
        # piece, sent on close (pyarrow: a one-part upload, published by the single
        # CompleteMultipartUpload request). An upload that fails or is cut off publishes
        # nothing and the old object stays; a retry uploads the whole object again.
        with fs.open_output_stream(inner, metadata={"Content-Type": "application/json"}) as out:
            out.write(data)

    with_retries(put, what=f"write {path}", remote=True, policy=retry)


def _write_local_atomic(target: Path, data: bytes, *, fsync: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Opened with 0o666 so the umask sets its mode, as for any file the user writes
    # (mkstemp's 0600 would hide checkpoints from the other users of a shared disk).
    tmp = target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:  # the rename itself survives a crash only once its directory is on disk
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _on_object_store(fs: pafs.FileSystem) -> bool:
    return not isinstance(fs, pafs.LocalFileSystem)


def read_bytes(path: str | os.PathLike[str], *,
               storage_options: StorageOptionsFactory | None = None,
               retry: RetryPolicy | None = None,
               filesystem: pafs.FileSystem | None = None) -> bytes:
    """The whole content of ``path``; ``FileNotFoundError`` if there is none."""
    fs, inner = resolve(path, storage_options, filesystem)

    def get() -> bytes:
        # One ranged GET of the size the HEAD reported (a stream would issue many GETs, and
        # an overwrite between them could stitch two versions together).
        with fs.open_input_file(inner) as f:
            return f.read_at(f.size(), 0)

    return with_retries(get, what=f"read {path}", remote=_on_object_store(fs), policy=retry)


def exists(path: str | os.PathLike[str], *,
           storage_options: StorageOptionsFactory | None = None,
           retry: RetryPolicy | None = None) -> bool:
    """Whether a file (or object) exists at ``path``."""
    fs, inner = resolve(path, storage_options)
    info = with_retries(lambda: fs.get_file_info(inner), what=f"look up {path}",
                        remote=_on_object_store(fs), policy=retry)
    return info.type == pafs.FileType.File


def list_files(path: str | os.PathLike[str], *,
               storage_options: StorageOptionsFactory | None = None,
               retry: RetryPolicy | None = None,
               filesystem: pafs.FileSystem | None = None) -> list[str]:
    """Paths or URIs of the files directly under the directory (or prefix) ``path``, sorted;
    empty if it does not exist."""
    fs, inner = resolve(path, storage_options, filesystem)
    selector = pafs.FileSelector(inner, allow_not_found=True, recursive=False)
    infos = with_retries(lambda: fs.get_file_info(selector), what=f"list {path}",
                         remote=_on_object_store(fs), policy=retry)
    names = sorted(i.base_name for i in infos if i.type == pafs.FileType.File)
    return [join(path, n) for n in names]


def list_dirs(path: str | os.PathLike[str], *,
              storage_options: StorageOptionsFactory | None = None,
              retry: RetryPolicy | None = None) -> list[str]:
    """Paths or URIs of the directories (prefixes) directly under ``path``, sorted."""
    fs, inner = resolve(path, storage_options)
    selector = pafs.FileSelector(inner, allow_not_found=True, recursive=False)
    infos = with_retries(lambda: fs.get_file_info(selector), what=f"list {path}",
                         remote=_on_object_store(fs), policy=retry)
    return [join(path, n) for n in
            sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)]


def write_json_atomic(path: str | os.PathLike[str], obj: Any, *, fsync: bool = True,
                      storage_options: StorageOptionsFactory | None = None,
                      retry: RetryPolicy | None = None) -> None:
    """Write ``obj`` as JSON atomically (see :func:`write_bytes_atomic`)."""
    data = json.dumps(obj, sort_keys=True).encode("utf-8")
    write_bytes_atomic(path, data, fsync=fsync, storage_options=storage_options, retry=retry)


def read_json(path: str | os.PathLike[str], *,
              storage_options: StorageOptionsFactory | None = None,
              retry: RetryPolicy | None = None,
              filesystem: pafs.FileSystem | None = None) -> Any:
    """Parse a JSON file or object (never pickle), with an error that names it."""
    # An object replaced between the HEAD and the GET of a read comes back cut at the old
    # size; a cut JSON object never parses, so on an object store a parse error is read
    # again (the reader then sees the new object whole) before it counts as corruption.
    fs, _ = resolve(path, storage_options, filesystem)
    attempts = TORN_READ_ATTEMPTS if _on_object_store(fs) else 1
    for attempt in range(attempts):
        data = read_bytes(path, storage_options=storage_options, retry=retry,
                          filesystem=filesystem)
        try:
            return json.loads(data.decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            if attempt + 1 == attempts:
                # Never fall back to unpickling: loading a pickle can run arbitrary code.
                raise ValueError(f"{os.fspath(path)!r} is not valid JSON: {e}") from e
            logger.info("storage: %s did not parse (overwritten while read?); reading again",
                        path)
    raise AssertionError("unreachable")


def hashable(value: object) -> bool:
    """Whether ``value`` can key a cache (a ``storage_options`` factory need not be)."""
    try:
        hash(value)
    except TypeError:
        return False
    return True
