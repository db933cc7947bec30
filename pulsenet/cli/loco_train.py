"""``pulsenet loco train``'s settings (one dataclass: the trainer's own fields, the inner loop and the
run's ``LocoConfig``) and the trainer they describe. Imported when the command runs (it imports torch)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import tyro

from pulsenet.cli import command_settings
from pulsenet.loco.config import LocoConfig
from pulsenet.rl.inner import SupervisedSettings, data_seed
from pulsenet.settings import require

if TYPE_CHECKING:
    from pulsenet.loco import LocoTrainer, RoundReport


@dataclass(kw_only=True)
class LocoTrainSettings:
    """Run one PULSELoCo trainer: H local AdamW steps per round, a gated sparse FP32 payload
    through the store, the round's deterministic average and outer Nesterov step, digest checks
    with repair from the store. Resumes from --state-dir (or its store checkpoint) after a crash.

    Older spellings accepted: --H (--inner-steps), --deadline, --join-wait, --poll, --digest-wait,
    --round-timeout (each: the same name with -s), --store-timeout (--timeouts.small-s),
    --transfer-timeout (--timeouts.transfer-s)."""

    store: str = ""
    """Run URL: s3://bucket/prefix or file:///abs/path (required)."""
    id: str = ""
    """This trainer's id: lowercase letters, digits, '-', '_' (required)."""
    key: Path | None = None
    """This trainer's Ed25519 private key (pulsenet keygen) (required)."""
    allow_open_key: bool = False
    """Accept a private key file that group or others may read (refused otherwise: chmod 600 it)."""
    trust: list[str] = field(default_factory=list)
    """Every trainer's public key: ID=PATH, or PATH whose file name up to the first '.' is the id
    (required)."""
    rounds: int = 10
    """Stop once the run reaches this round."""
    state_dir: Path | None = None
    """Local resume point (None: ./loco-state/ID)."""
    report: Path | None = None
    """Write the per-round reports here as JSON."""
    inner: Annotated[SupervisedSettings, tyro.conf.arg(name="")] = field(default_factory=SupervisedSettings)
    loco: Annotated[LocoConfig, tyro.conf.arg(name="")] = field(default_factory=LocoConfig)
    """The run's algorithm and protocol settings (every trainer of the run uses the same)."""


def load_train_settings(ns: argparse.Namespace) -> LocoTrainSettings:
    s = command_settings(ns, LocoTrainSettings)
    require(s, "store", "id", "key", "trust", table="loco.train")
    return s


async def run_trainer(s: LocoTrainSettings, factory: Any = None) -> list[RoundReport]:
    """Build the trainer the settings describe and run it; ``factory`` (a LocoTrainer subclass) for tests."""
    import torch

    from pulsenet.loco import LocoTrainer
    from pulsenet.loco.documents import trainer_keys
    from pulsenet.rl import ArithmeticTask, LocalTrainer, LocalTrainerConfig
    from pulsenet.rl.inner import SupervisedInner
    from pulsenet.signing import load_private_key
    from pulsenet.store import S3Config, open_store

    inner = s.inner
    if inner.threads:
        torch.set_num_threads(inner.threads)
    model, tokenizer, default_lr = _model(inner.model, inner.seed)
    local = LocalTrainer(
        model,
        LocalTrainerConfig(
            lr=inner.lr if inner.lr is not None else default_lr,
            batch_size=inner.batch,
            seq_len=inner.seq,
            seed=data_seed(inner.seed, s.id),
            forward=inner.forward,
        ),
    )
    task = ArithmeticTask(data_seed(inner.seed, s.id), tokenizer)
    state_dir = s.state_dir if s.state_dir is not None else Path("loco-state") / s.id
    timeouts = s.loco.timeouts  # one deadline per kind of call, for the store and the protocol
    s3 = S3Config.from_env(timeout_s=timeouts.small_s, transfer_timeout_s=timeouts.transfer_s)
    cls: type[LocoTrainer] = factory or LocoTrainer
    async with open_store(s.store, s3) as store:
        trainer = cls(
            s.id,
            store,
            load_private_key(s.key, allow_open=s.allow_open_key),
            trainer_keys(s.trust),
            SupervisedInner(local, task),
            s.loco,
            state_dir=state_dir,
        )
        reports = await trainer.run(s.rounds)
    if s.report is not None:
        from dataclasses import asdict

        s.report.parent.mkdir(parents=True, exist_ok=True)
        s.report.write_text(json.dumps([asdict(r) for r in reports], indent=1))
    return reports


def _model(name: str, seed: int) -> tuple[Any, Any, float]:
    from pulsenet.rl import build_tiny_model, load_model, load_tokenizer, smollm2_checkpoint

    if name == "tiny":
        return build_tiny_model(seed), None, 1e-3
    path = smollm2_checkpoint()
    return load_model(path), load_tokenizer(path), 3e-6
