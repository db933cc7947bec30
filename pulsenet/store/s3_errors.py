"""What an S3 error means: transient (retry it) or an answer, and which typed store error it is.

botocore raises ``ClientError`` for every HTTP answer (with the status and the service's error
code) and its own ``BotoCoreError`` subclasses for what never got an answer (refused or dropped
connections, timeouts, truncated bodies, missing credentials). ``S3Store`` retries what
:func:`is_transient` calls transient and turns everything else, or the last transient failure, into
one of ``errors.py``'s store errors with :func:`typed_error`; callers catch those, never botocore's.
"""

from __future__ import annotations

import botocore.exceptions as bex

from pulsenet.errors import (
    AccessDenied,
    BucketNotFound,
    ConditionFailed,
    ObjectNotFound,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
)

# Error codes worth retrying even though some come with a 4xx status.
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
        "ConditionalRequestConflict",  # AWS 409: a racing conditional write; retry resolves it to 200 or 412
    }
)


def http_status(e: bex.ClientError) -> int:
    """The HTTP status of the answer behind ``e`` (0 if botocore recorded none)."""
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def is_transient(e: Exception) -> bool:
    """Whether a retry may succeed: 5xx (but 501), 429, throttling codes, dropped connections."""
    if isinstance(e, bex.ClientError):
        status = http_status(e)
        # 501 NotImplemented is a missing feature, not a passing fault.
        return (
            (status >= 500 and status != 501)
            or status == 429
            or e.response.get("Error", {}).get("Code") in _TRANSIENT_CODES
        )
    # Connection refused/reset/closed, connect and read timeouts, truncated bodies.
    return isinstance(e, bex.ConnectionError | bex.HTTPClientError | bex.IncompleteReadError)


def typed_error(
    e: Exception,
    *,
    where: str,
    op: str,
    bucket: str,
    conditional: bool,
    attempts: int,
    read_timeout_s: float,
) -> StoreError:
    """The store error a caller sees for ``e``, raised by ``op`` (``where``: the call, key, store
    and endpoint, leading the message). ``conditional``: the request carried a condition, so a 404
    may mean the condition failed (moto and some gateways answer so)."""
    if isinstance(e, bex.ClientError):
        status, code = http_status(e), e.response.get("Error", {}).get("Code", "")
        msg = e.response.get("Error", {}).get("Message", "")
        if status == 412 or code == "PreconditionFailed":
            return ConditionFailed(f"{where}: precondition failed ({code or status})")
        if code == "NoSuchBucket":
            return BucketNotFound(f"{where}: bucket {bucket!r} does not exist; create it or fix the URL")
        if status == 404 and conditional:
            # moto (and some gateways) answer a failed condition with 404 rather than 412.
            return ConditionFailed(f"{where}: precondition failed ({code or status})")
        if status == 404 or code in ("NoSuchKey", "NotFound"):
            return ObjectNotFound(f"{where}: no such key")
        if is_transient(e):
            return StoreUnavailable(f"{where}: {code} (HTTP {status}) after {attempts} attempts")
        if status == 403:
            return AccessDenied(
                f"{where}: {code or 'AccessDenied'} (HTTP 403): these credentials may not {op} here"
            )
        return StoreError(f"{where}: {code} (HTTP {status}): {msg}")
    if isinstance(e, bex.ReadTimeoutError):
        return StoreTimeout(f"{where}: no response within {read_timeout_s:g} s, {attempts} attempts")
    if is_transient(e):
        return StoreUnavailable(f"{where}: {e} ({attempts} attempts)")
    if isinstance(e, bex.NoCredentialsError):
        return StoreError(
            f"{where}: no credentials; set S3Config keys (or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
        )
    return StoreError(f"{where}: {e}")
