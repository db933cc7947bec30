"""The rollout channel (inference -> trainer): signed Parquet batches in each inference node's own
store. See docs/rollouts.md; key layout in layout.py, manifests in manifest.py."""

from pulsenet.rollouts.demand import (
    Demand,
    DemandConfig,
    DemandReader,
    DemandSource,
    DemandWriter,
    batches_to_generate,
)
from pulsenet.rollouts.intake import REASONS, RolloutIntake
from pulsenet.rollouts.intake_types import IntakeStats, RolloutBatch, RolloutIntakeConfig
from pulsenet.rollouts.layout import RolloutLayout
from pulsenet.rollouts.manifest import BatchManifest
from pulsenet.rollouts.partition import owner
from pulsenet.rollouts.rows import ROW_REASONS, RowLimits, check_rows
from pulsenet.rollouts.sources import RolloutSource
from pulsenet.rollouts.writer import RolloutWriter, RolloutWriterConfig, WriterStats

__all__ = [
    "REASONS",
    "ROW_REASONS",
    "BatchManifest",
    "Demand",
    "DemandConfig",
    "DemandReader",
    "DemandSource",
    "DemandWriter",
    "IntakeStats",
    "RolloutBatch",
    "RolloutIntake",
    "RolloutIntakeConfig",
    "RolloutLayout",
    "RolloutSource",
    "RolloutWriter",
    "RolloutWriterConfig",
    "RowLimits",
    "WriterStats",
    "batches_to_generate",
    "check_rows",
    "owner",
]
