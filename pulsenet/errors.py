"""The whole pulsenet error hierarchy, in one place.

Dual inheritance lets callers catch either the pulsenet type or the builtin it refines
(``PatchError`` is a ``ValueError``; ``StoreTimeout`` is a ``TimeoutError``).
"""


class PulsenetError(Exception):
    """Base of every error pulsenet raises on purpose."""


class ConfigError(PulsenetError, ValueError):
    """A config file, URL or CLI argument is invalid."""


# --- codec -----------------------------------------------------------------


class PatchError(PulsenetError, ValueError):
    """A patch cannot be encoded, parsed or applied."""


class PatchFormatError(PatchError):
    """The bytes are not a well-formed patch: bad magic, version, header or section bounds."""


class PatchCorruptError(PatchError):
    """The patch is well formed but its content is inconsistent (indices, sizes, decompression)."""


class PatchSizeLimitError(PatchCorruptError):
    """A section would decompress past its declared or allowed size (zstd bomb guard)."""


class BaseMismatchError(PatchError):
    """The patch was made against a different base (names, dtypes, shapes or digest differ)."""


class DigestMismatchError(PatchError):
    """The rebuilt weights do not hash to the digest the patch promises."""


class PayloadError(PulsenetError, ValueError):
    """A PULSELoCo sparse payload is malformed or fails validation."""


# --- store -----------------------------------------------------------------


class StoreError(PulsenetError):
    """An object-store operation failed."""


class ObjectNotFound(StoreError, KeyError):
    """The key does not exist."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else "object not found"


class AccessDenied(StoreError, PermissionError):
    """The credentials may not perform this operation here (HTTP 403)."""


class BucketNotFound(StoreError):
    """The bucket named in the store URL does not exist."""


class ConditionFailed(StoreError):
    """A conditional request failed (If-None-Match on an existing key, If-Match mismatch; 412 or 404)."""


class ObjectTooLarge(StoreError):
    """An object is larger than the caller allows (``max_bytes``): refused before it is read whole."""


class StoreTimeout(StoreError, TimeoutError):
    """An object-store operation ran past its timeout."""


class StoreUnavailable(StoreError, ConnectionError):
    """The object store could not be reached after retries."""


# --- protocols -------------------------------------------------------------


class ManifestError(PulsenetError, ValueError):
    """A manifest is malformed, unsigned, signed by an untrusted key, or inconsistent."""


class DocumentTooLarge(ManifestError):
    """A signed document is over the reader's size limit (listed or read): refused unread."""


class SignatureError(ManifestError):
    """A signature does not verify against any trusted key."""


class ReplayError(ManifestError):
    """A manifest would move a version backwards."""


class VerificationError(PulsenetError):
    """Rebuilt weights or a fetched payload failed verification; nothing was swapped in."""


class SizeMismatch(VerificationError):
    """An object is not the size its signed reference gives (a larger one is refused unread)."""


class RoundError(PulsenetError):
    """A PULSELoCo round could not complete (no quorum, divergence that cannot be repaired)."""


class RoundTimeout(RoundError, TimeoutError):
    """A PULSELoCo round formed no quorum within ``round_timeout_s`` while the store answered: peers
    are missing, not the store's content at fault (retried without counting as a failure)."""


class PolicyError(PulsenetError):
    """A policy the node made or received is unusable (non-finite weights): never published or applied."""


class RolloutError(PulsenetError, ValueError):
    """A rollout batch (Parquet payload or its manifest) is malformed, inconsistent or over a limit."""


class RolloutRowError(RolloutError):
    """A well-formed rollout batch breaks the trainer's row limits (``rollouts.rows.RowLimits``);
    ``reason`` names which, as the intake counts it."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# --- engines ---------------------------------------------------------------


class EngineError(PulsenetError):
    """An inference engine cannot serve: a bad update, a missing backend (vLLM, CUDA), or weights
    that no longer hash to the digest it claims (it then refuses to generate until repaired)."""
