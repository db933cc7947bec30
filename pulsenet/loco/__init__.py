"""PULSELoCo: sparse DiLoCo between trainers through object storage (PULSE, arXiv 2602.03839).

- ``algorithm``: pseudo-gradient, visibility gate, error feedback, aggregation, outer Nesterov step.
- ``state``: global state and per-trainer resume points, written atomically.
- ``layout``: the run's key layout and signing context.
- ``documents``: the round's signed documents (payload manifests, round records, digests, states).
- ``config``: the run's settings and per-round reports.
- ``update``: this trainer's own update through a round (encode, publish, settle the error feedback).
- ``collect``: the collect phase (fetch, judge, first-writer-wins round record).
- ``recovery``: digest verdicts and repair, joining the run, catching up from the store.
- ``persist``: resume points, checkpoints, published states, retention, background uploads.
- ``overlap``: the inner phase of round r+1 run while round r is exchanged, then re-based.
- ``progress``: what a trainer is doing now and what it counted (plain records for a node), the
  one retry rule for uploads that must land, and attempts at a round.
- ``inner``: the inner-loop protocol the round drives (adapters: ``pulsenet.rl.inner``).
- ``trainer``: the round driver, top to bottom (train, encode and publish, collect, apply, agree,
  persist), each step a call into the modules above.

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
