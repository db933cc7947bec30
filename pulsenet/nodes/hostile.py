"""Hostile inference behaviours: what a compromised node with a valid key sends (issue 30, item 4).

For tests and ``pulsenet chaos --hostile i1=best-of-n``: an inference node whose
``InferenceConfig.hostile`` names a behaviour generates its batches through ``Hostile.generate``
and publishes them only when ``Hostile.publish`` says so. Everything else (problems, group ids,
signatures, the public draw keys it is given) is the honest node's; each behaviour is one way to
cheat what a row claims, and a trainer with replay on (rl/replay.py) must refuse every batch it
touches (docs/rollouts.md, "Adversaries and what catches them"):

- ``chosen``: completions the node chose (sampled with other randomness, not the public draw),
  with honest log-probs recomputed by teacher forcing: they look like samples;
- ``best-of-n``: ``n`` draws per row with other randomness, the best-rewarded kept;
- ``scaled-logprobs``: the public draw, its log-probs times ``scale`` (0.5: truncated IS gives
  the rows up to ``tis_cap`` times an honest row's weight);
- ``wrong-temperature``: the public uniforms at ``temperature`` (0.7: sharper, higher reward),
  log-probs recomputed at the task's temperature by teacher forcing;
- ``stale``: the weights of the version ``lag`` before the served one (the oldest seen, early
  on), labelled with the served version and digest;
- ``perturbed``: the served weights with tensor ``layer`` times ``factor`` (1.05), same label;
- ``copy``: the rows node ``victim`` draws for these problems (its public draw keys), presented
  as this node's (what a node that copies another's batch of the same problems sends);
- ``one-row``: the public draw for every row but one per batch (``row``; default: a different row
  each batch), whose completion the node chose (a draw with other randomness) with honest log-probs
  recomputed by teacher forcing: the sparse cheat that only the rows replay picks can catch
  (issue 38: it must be refused before it lands 2 batches in expectation);
- ``withhold``: honest batches, published only when their mean reward beats the mean of the
  batches generated before (the first is published; the others are a gap in its batch numbers:
  a replay cannot see a batch it never gets; counting gaps per node is the intake's, issue 30 item 2).

Behaviours that choose which honest rows the trainer sees (issue 38; ``Hostile.rework``, on the
scored rows of an honest draw; the trainer's ``rl.answers.BatchCheck`` must refuse each):

- ``better-half``: only the better-rewarded half of the batch's groups;
- ``aliases``: the batch, and its best ``n`` groups again under zero-padded spellings of their
  problem number (``p5`` as ``p05``, ``p005``): replay would start each copy at completion 0;
- ``copies``: one batch of ``copies`` copies of its best group, each under another spelling;
- ``cut-groups``: each group cut to its first rows up to where their mean reward peaks;
- ``prefix-cut``: each wrong completion cut to its shortest prefix that scores, stop token gone;
- ``repeat``: the batch, and the previous batch again (a new sequence number, the same batch id);
- ``reward-one``: every reward claimed as 1.0 (re-scoring replaces them: the feed's to count).

Lives in ``nodes`` (not ``chaos``): the inference node calls it, and nodes may not import chaos.
Runs on the torch engine (a stale or perturbed model is a second ``TorchEngine`` beside it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig

from pulsenet.codec.rollout import Rollout
from pulsenet.engines.base import Engine, Generation, SamplingParams
from pulsenet.engines.torch_engine import TorchEngine, TorchEngineConfig
from pulsenet.errors import ConfigError
from pulsenet.nodes.hostile_rows import REWORKS, RowScore, rework
from pulsenet.rl.draw import DrawId

log = logging.getLogger(__name__)

BEHAVIOURS = (
    "chosen", "best-of-n", "scaled-logprobs", "wrong-temperature", "stale", "perturbed", "copy", "withhold", "one-row",
    *REWORKS,
)  # fmt: skip
"""The hostile behaviours, one flag each (``InferenceConfig.hostile``, ``pulsenet chaos --hostile``)."""

Score = Callable[[Sequence[Generation]], list[float]]
"""The node's rewards for one generation per prompt of the call, in order (the task's scoring)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HostileConfig:
    """One behaviour and its knobs: ``NAME`` or ``NAME:KEY=VALUE,...`` (e.g. ``stale:lag=3``,
    ``perturbed:layer=model.layers.0.mlp.down_proj.weight,factor=1.05``, ``copy:victim=i0``)."""

    behaviour: str
    n: int = 4
    """best-of-n: draws per row."""
    scale: float = 0.5
    """scaled-logprobs: factor on every reported log-prob."""
    temperature: float = 0.7
    """wrong-temperature: the temperature sampled at."""
    lag: int = 3
    """stale: versions behind the served one."""
    layer: str = "model.norm.weight"
    """perturbed: the tensor scaled (the final norm scales every logit: a layer that matters)."""
    factor: float = 1.05
    """perturbed: its scale."""
    victim: str = "i0"
    """copy: the node whose draw is copied."""
    row: int = -1
    """one-row: the row of each batch changed (-1: the batch's number of batches generated,
    modulo its rows, so every position is hit in turn)."""
    copies: int = 32
    """copies: copies of the best group in the one batch sent."""

    def __post_init__(self) -> None:
        if self.behaviour not in BEHAVIOURS:
            raise ConfigError(f"hostile: unknown behaviour {self.behaviour!r}; known: {', '.join(BEHAVIOURS)}")
        if self.n < 1 or self.lag < 1 or self.copies < 1 or not self.temperature > 0:
            raise ConfigError("hostile: n >= 1, lag >= 1, copies >= 1 and temperature > 0")

    @classmethod
    def parse(cls, spec: str) -> HostileConfig:
        name, _, rest = spec.partition(":")
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {}  # field name -> its value, parsed to the field's declared type below
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq or key not in types or key == "behaviour":
                raise ConfigError(f"hostile: {item!r} in {spec!r} is not KEY=VALUE of {sorted(set(types) - {'behaviour'})}")
            kind = types[key]
            try:
                kw[key] = int(value) if kind == "int" else float(value) if kind == "float" else value
            except ValueError as e:
                raise ConfigError(f"hostile: {key}={value!r} is not a {kind}") from e
        return cls(behaviour=name.strip(), **kw)


@dataclass(slots=True)
class HostileStats:
    batches: int = 0
    """Batches generated."""
    touched: int = 0
    """Batches the behaviour changed (a stale node's first versions have no older weights to serve)."""
    withheld: int = 0
    """Batches generated and never published (withhold)."""
    rewards: list[float] = field(default_factory=list)
    """Mean reward of each batch generated (withhold's yardstick)."""


class Hostile:
    """One node's hostile behaviour: ``observe`` each verified update, ``generate`` each batch,
    ``publish`` (or not) what it scored."""

    def __init__(
        self, config: HostileConfig, hf_config: PretrainedConfig, decode: Callable[[Sequence[int]], str] | None = None
    ) -> None:
        self.config, self.hf_config, self.decode = config, hf_config, decode
        self.stats = HostileStats()
        self._states: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        """stale: copies of the last ``lag + 1`` verified states by version (a subscriber's state
        objects are its own to patch)."""
        self._shadow: TorchEngine | None = None
        """stale, perturbed: the engine that really samples, serving other weights under the label."""
        self._shadow_for: tuple[int, int] | None = None
        """(served version, version of the weights the shadow serves)."""
        self._previous: list[Rollout] | None = None
        """repeat: the batch sent before."""

    def observe(self, version: int, state: Mapping[str, torch.Tensor], digest: str) -> None:
        """A verified update (the honest engine takes it too)."""
        if self.config.behaviour in ("stale", "perturbed"):
            keep = self.config.lag + 1 if self.config.behaviour == "stale" else 1
            self._states[version] = {n: t.detach().clone() for n, t in state.items()}
            while len(self._states) > keep:
                self._states.popitem(last=False)

    # --- the batch ------------------------------------------------------------------------------

    def generate(
        self, engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams, ids: Sequence[DrawId], score: Score
    ) -> list[Generation]:
        """What the node sends for ``prompts`` (one per completion, public draw ids ``ids`` and their
        keys in ``params.draws``), labelled with ``engine``'s version and digest."""
        c, b = self.config, self.config.behaviour
        self.stats.batches += 1
        touched = True
        if b == "chosen":
            gens = self._teacher_forced(
                engine, engine.generate(prompts, dataclasses.replace(params, draws=_other(ids, 0))), params.temperature
            )
        elif b == "best-of-n":
            gens = self._best_of(engine, prompts, params, ids, score)
        elif b == "scaled-logprobs":
            gens = [
                dataclasses.replace(g, logprobs=tuple(x * c.scale for x in g.logprobs))
                for g in engine.generate(prompts, params)
            ]
        elif b == "wrong-temperature":
            hot = engine.generate(prompts, dataclasses.replace(params, temperature=c.temperature))
            gens = self._teacher_forced(engine, hot, params.temperature)
        elif b in ("stale", "perturbed"):
            gens, touched = self._shadowed(engine, prompts, params)
        elif b == "copy":
            gens = engine.generate(
                prompts, dataclasses.replace(params, draws=tuple(dataclasses.replace(d, node=c.victim).key() for d in ids))
            )
        elif b == "one-row":
            gens, touched = self._one_row(engine, prompts, params, ids)
        else:  # withhold and the reworks: honest rows; ``publish`` and ``rework`` decide
            gens, touched = engine.generate(prompts, params), False
        self.stats.touched += touched
        return gens

    def publish(self, rewards: Sequence[float]) -> bool:
        """Whether the node publishes a batch it scored ``rewards`` (withhold: only a batch whose mean
        reward beats the mean of the batches generated before it; the first is published)."""
        mean = sum(rewards) / max(len(rewards), 1)
        before, self.stats.rewards = self.stats.rewards, [*self.stats.rewards, mean]
        if self.config.behaviour != "withhold" or not before or mean > sum(before) / len(before):
            return True
        self.stats.withheld += 1
        self.stats.touched += 1
        return False

    def rework(self, rows: Sequence[Rollout], score: RowScore) -> list[list[Rollout]]:
        """The batches the node sends for the scored honest ``rows`` (``REWORKS``; else ``[rows]``)."""
        b = self.config.behaviour
        if b not in REWORKS:
            return [list(rows)]
        sends = rework(b, rows, score, previous=self._previous, n=self.config.n, copies=self.config.copies)
        self._previous = list(rows)
        self.stats.touched += sends != [list(rows)]
        return sends

    # --- the behaviours --------------------------------------------------------------------------

    def _best_of(
        self, engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams, ids: Sequence[DrawId], score: Score
    ) -> list[Generation]:
        """Per row, the best-rewarded of ``n`` draws with other randomness (the first on a tie)."""
        best: list[Generation] = []
        best_r: list[float] = []
        for j in range(self.config.n):
            gens = engine.generate(prompts, dataclasses.replace(params, draws=_other(ids, j)))
            for k, (g, r) in enumerate(zip(gens, score(gens), strict=True)):
                if j == 0:
                    best.append(g)
                    best_r.append(r)
                elif r > best_r[k]:
                    best[k], best_r[k] = g, r
        return best

    def _one_row(
        self, engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams, ids: Sequence[DrawId]
    ) -> tuple[list[Generation], bool]:
        """one-row: the public draw, one row replaced by a completion drawn with other randomness
        (the first of up to 8 that differs from the draw), its log-probs teacher-forced; not
        touched if every other draw was the public one (a peaked distribution)."""
        gens = list(engine.generate(prompts, params))
        if not gens:
            return gens, False
        j = (self.config.row if self.config.row >= 0 else self.stats.batches - 1) % len(gens)
        for k in range(8):
            other = engine.generate([prompts[j]], dataclasses.replace(params, draws=_other([ids[j]], k)))[0]
            if other.completion_ids != gens[j].completion_ids:
                gens[j] = self._teacher_forced(engine, [other], params.temperature)[0]
                return gens, True
        return gens, False

    def _teacher_forced(self, engine: Engine, gens: Sequence[Generation], temperature: float) -> list[Generation]:
        """``gens`` with each token's log-prob recomputed by teacher forcing at ``temperature`` (the
        task's): log-probs an honest sample would have."""
        scorer = _torch(engine)
        return [dataclasses.replace(g, logprobs=tuple(scorer.score(g.prompt_ids, g.completion_ids, temperature))) for g in gens]

    def _shadowed(
        self, engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> tuple[list[Generation], bool]:
        """stale / perturbed: sample with other weights under the served version and digest."""
        version, digest = engine.version, engine.digest
        assert version is not None
        if version not in self._states:  # not observed (weights from before this object): honest
            return engine.generate(prompts, params), False
        c = self.config
        if c.behaviour == "stale":
            source = max((v for v in self._states if v <= version - c.lag), default=min(self._states))
        else:
            source = version
        if source == version and c.behaviour == "stale":  # nothing older seen yet
            return engine.generate(prompts, params), False
        if self._shadow_for != (version, source):
            state = self._states[source]
            if c.behaviour == "perturbed":
                if c.layer not in state:
                    raise ConfigError(f"hostile perturbed: no tensor {c.layer!r} (e.g. {sorted(state)[-1]!r})")
                state = {**state, c.layer: (state[c.layer].float() * c.factor).to(state[c.layer].dtype)}
            if self._shadow is None:
                self._shadow = TorchEngine.from_state(
                    self.hf_config, state, digest, version=version,
                    config=TorchEngineConfig(verify_updates=False), decode=self.decode,
                )
            else:
                self._shadow.update(version, state, digest)  # verify off: the label is the served one's
            self._shadow_for = (version, source)
            log.warning(
                "hostile %s: serving v%d's weights%s as v%d",
                c.behaviour, source, " perturbed" * (c.behaviour == "perturbed"), version,
            )
        return self._shadow.generate(prompts, params), True


def _other(ids: Sequence[DrawId], j: int) -> tuple[bytes, ...]:
    """Draw keys nobody else uses: other randomness, still a pure function of the public ids."""
    return tuple(hashlib.sha256(b"pulsenet-hostile-other:%d:" % j + d.key()).digest() for d in ids)


def _torch(engine: Engine) -> TorchEngine:
    if not isinstance(engine, TorchEngine):
        raise ConfigError("hostile behaviours that recompute log-probs run on the torch engine")
    return engine
