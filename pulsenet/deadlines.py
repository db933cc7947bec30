"""Default deadlines, in one place: every config's default timeout refers to these.

Each store and protocol call still takes an explicit ``timeout`` (``None`` picks the config's);
these are only the defaults a config starts from. Seconds, retries included.
"""

SMALL_CALL_S = 30.0
"""One small store call: put, get, head, list or delete of a manifest, head, record or status
object (kilobytes). Also what ``pulsenet publish|pull|ls --timeout`` starts from."""

TRANSFER_S = 600.0
"""One large transfer: a patch, an anchor, a PULSELoCo payload or state, a checkpoint (up to
gigabytes over a slow link)."""

ROLLOUT_TRANSFER_S = 300.0
"""One rollout batch (a Parquet file of a few megabytes at most): upload or download."""
