"""PULSELoCo: sparse DiLoCo between trainers through object storage (PULSE, arXiv 2602.03839).

- ``algorithm``: pseudo-gradient, visibility gate, error feedback, aggregation, outer Nesterov step.
- ``state``: global state and per-trainer resume points, written atomically.
- ``layout``: the run's key layout and signing context.
- ``documents``: the round's signed documents (payload manifests, round records, digests, states).
- ``config``: the run's settings and per-round reports.
- ``collect``: the collect phase (fetch, judge, first-writer-wins round record).
- ``recovery``: digest verdicts, and rebuilding the agreed state from the store.
- ``progress``: what a trainer is doing now and what it counted (plain records for a node), and
  the one retry rule for uploads that must land.
- ``inner``: the inner-loop protocol the round drives (adapters: ``pulsenet.rl.inner``).
- ``trainer``: the round itself, top to bottom (train, encode and publish, collect, apply, agree, persist).

The payload wire format is ``pulsenet.codec.payload``. Spec and safety arguments: ``docs/loco.md``.
"""

from pulsenet.loco.algorithm import apply_round, gate, global_digest, make_update, pseudo_gradient
from pulsenet.loco.collect import DecodedPayloads
from pulsenet.loco.config import LocoConfig, RoundReport
from pulsenet.loco.documents import Record, RoundStore, Timeouts
from pulsenet.loco.inner import InnerLoop, SelfTraining
from pulsenet.loco.progress import LocoStats, Progress
from pulsenet.loco.state import GlobalState, TrainerState
from pulsenet.loco.trainer import LocoTrainer

__all__ = [
    "DecodedPayloads",
    "GlobalState",
    "InnerLoop",
    "LocoConfig",
    "LocoStats",
    "LocoTrainer",
    "Progress",
    "Record",
    "RoundReport",
    "RoundStore",
    "SelfTraining",
    "Timeouts",
    "TrainerState",
    "apply_round",
    "gate",
    "global_digest",
    "make_update",
    "pseudo_gradient",
]
