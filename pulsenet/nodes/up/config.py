"""``pulsenet up``'s settings: the network (``nodes/config.NetworkSettings``) plus where and how it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pulsenet.nodes.config import NetworkSettings
from pulsenet.nodes.supervisor import SuperviseConfig


@dataclass(kw_only=True)
class UpConfig(NetworkSettings):
    """A local network on one machine. Settings: the [up] table of --config FILE, then PULSENET_<FIELD>, then --field."""

    workdir: Path = Path(".pulsenet-up")
    """Keys and the warm-up cache (kept), this run's node states, configs, logs and store (wiped per run)."""
    s3_endpoint: str = ""
    """An S3 endpoint to use instead of the embedded SeaweedFS (credentials from AWS_*; the
    buckets <bucket-prefix><site> are created if missing)."""
    bucket_prefix: str = "pulsenet-"
    """Bucket names are this plus the site (t0, i0, ...)."""
    report: Path | None = None
    """Write summary.json and reward.png, bytes.png, sparsity.png here."""
    live: bool = True
    """Show the live table (off: one line per new version, or change of a node's health or restarts)."""
    poll_s: float = 0.5
    """Interval of /status polls (display, end detection)."""
    timeout_s: float = 1800.0
    """Give up (and stop every node) if the trainers have not finished by then."""
    serve_timeout_s: float = 120.0
    """After the trainers finish, how long inference nodes get to serve the final version."""
    stop_grace_s: float = 30.0
    """After SIGTERM, how long a node gets to exit before SIGKILL."""
    node_threads: int = 0
    """Torch threads per node process (its OMP_NUM_THREADS). 0: this machine's cores shared among
    the nodes, at least 1 each (or OMP_NUM_THREADS, if set here). Every node on every core makes
    their threads spin-wait on one another (measured with two busy processes on two cores: a tiny
    GRPO step took 44 ms with two threads, 19 ms with one, 11 ms on the quiet machine)."""
    memory_check: bool = True
    """Refuse at start a network whose nodes' peak memory budgets (nodes/memory.py: a trainer 24
    bytes per parameter + 2 GiB, an inference node 6 + 1.5 GiB with the torch engine, 2 + 1.5 GiB
    with vLLM) add up to more than this machine's available memory, naming the flag to change."""
    supervise: SuperviseConfig = field(default_factory=SuperviseConfig)
    """Restarts (backoff, crash loop), the round deadline of a stuck network, liveness restarts."""
