"""``pulsenet up``: a whole network on one machine, every node its own process.

What it does, in order:

1. a work directory (``--workdir``, ``up/workdir.py``): signing keys (kept across runs), the tiny
   warm-up cache (kept), and this run's ``state/``, ``config/``, ``logs/`` and ``s3/`` (wiped at the
   start of each run);
2. the store (``up/sites.py``): an embedded SeaweedFS with one bucket per site and one identity per site that may
   write only its own bucket (``writer-<site>``; with several trainers, also their shared PULSELoCo
   bucket), or ``--s3-endpoint`` with the credentials of the
   environment (AWS_*) and buckets ``<bucket-prefix><site>``; every run uses its own prefix;
3. N trainers and K inference nodes (2 and 2 by default), planned by ``nodes/plan.py`` (the model's
   preset under this command's settings; ``up/sites.py`` writes each config with
   ``settings.write_toml``), each ``python -m pulsenet --log-format json -v <role>
   --config <workdir>/config/<node>.toml`` with its site's credentials in AWS_*, its own status port
   and its log in ``<workdir>/logs/<node>.log``. The tiny model is warmed up once, here, with the
   planned trainers' settings, into the cache they all load it from. Children are tied to this process
   (``runtime.spawn_tied``: PR_SET_PDEATHSIG), so none outlives it, even if it is SIGKILLed;
4. the ``Supervisor`` (``up/supervisor.py``): a live table (``up/console.py``) polling each node's
   ``/status`` (its health and reasons in it);
   a node that exits unexpectedly is started again with the same command, config and credentials
   after an exponential backoff, and so is the embedded store (same directory, ports and keys); a
   node whose own ``/healthz`` says stuck is restarted; a network that makes no new version within
   the round deadline is reported STUCK with the trainer that holds it up. The run fails only on a
   crash loop (``--supervise.max-restarts`` restarts within ``--supervise.window-s``), naming the
   node, how often it exited and its last error (``nodes/supervisor.py`` holds these decisions,
   the end of the run, ``end_of_run``, among them;
   ``state/supervisor.jsonl`` records each of them);
5. when the trainers have published ``--rounds`` versions (and exited), the inference nodes get
   SIGTERM once they serve the final version (or after ``serve_timeout_s``); Ctrl-C or SIGTERM
   stops every node the same way at any time (SIGTERM, wait, SIGKILL fallback);
6. the end summary (``up/console.py``; restarts per node included) and, with ``--report DIR``, ``summary.json`` and
   PNG plots (``nodes/report.py``).

Where the per-round history comes from: the nodes' own version events (``nodes/events.py``), one
JSON line per version in ``<workdir>/state/<node>/events.jsonl``: a trainer's ``published``, an
inference node's ``served`` and ``stopped``. They survive the process (a trainer exits after its
last version, before a poller could be sure to see it) and hold every version, where ``/status``
holds only the latest; ``nodes/summary.py`` turns them into the report. No log text is parsed,
except an exited node's last error (``supervisor.last_error``: an ERROR record, a typed
``pulsenet: error``, a traceback; never merely its last line) for the reason.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from typing import TYPE_CHECKING, Any

from pulsenet.errors import ConfigError
from pulsenet.nodes.supervisor import JOURNAL_FILE, Journal
from pulsenet.nodes.up.config import UpConfig
from pulsenet.nodes.up.console import report_outcome, summarize_up
from pulsenet.nodes.up.node import Outcome
from pulsenet.nodes.up.sites import open_store, plan_nodes
from pulsenet.nodes.up.supervisor import Injector, Supervisor
from pulsenet.nodes.up.workdir import ensure_keys, fresh_run_dirs

if TYPE_CHECKING:
    from pulsenet.nodes.config import TrainerConfig

__all__ = ["UpConfig", "run_network", "run_up"]


def run_up(config: UpConfig) -> int:
    """``pulsenet up``: the whole run, from a fresh store to the summary; returns the exit code."""
    from rich.console import Console

    out = Console()
    outcome, summary = run_network(config)
    report_outcome(out, config, outcome, summary)
    return outcome.code


def run_network(config: UpConfig, injector: Injector | None = None) -> tuple[Outcome, dict[str, Any]]:
    """Fresh run directories, keys, the store, the nodes under the ``Supervisor`` until the run is
    over, then the summary (``summarize_up``). ``injector``: ``pulsenet chaos``'s faults."""
    _check(config)
    from rich.console import Console

    err = Console(stderr=True)
    workdir = config.workdir.absolute()
    fresh_run_dirs(workdir)
    sites = [f"t{k}" for k in range(config.trainers)] + [f"i{k}" for k in range(config.inference)]
    ensure_keys(workdir / "keys", sites)
    run_id = f"up-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"
    with open_store(config, workdir, sites) as (creds, server):
        plan = plan_nodes(config, workdir, run_id, creds, injector)
        if config.model == "tiny":
            warm_up_once(plan.trainers[0], err, threads=plan.threads)
        nodes, deadline = plan.nodes, plan.round_deadline_s
        err.print(
            f"[bold]pulsenet up[/]: {config.trainers} trainer(s), {config.inference} inference node(s), {config.model}, "
            f"{config.rounds} rounds, run {run_id}; logs in {workdir / 'logs'}; round deadline {deadline:g} s; "
            f"{plan.threads} torch thread(s) per node"
        )
        journal = Journal(workdir / "state" / JOURNAL_FILE)
        journal.write("start", run=run_id, nodes=[n.name for n in nodes], round_deadline_s=deadline)
        sup = Supervisor(config, nodes, err, server=server, journal=journal, injector=injector, round_deadline_s=deadline)
        outcome = asyncio.run(sup.run())
    return outcome, summarize_up(config, outcome)


def warm_up_once(trainer: TrainerConfig, console: Any, *, threads: int) -> None:
    """Warm the tiny model up here, once, into the cache every trainer loads it from (``trainer``:
    a planned trainer's settings: its model, cache directory, seed and warm-up steps), with a
    node's share of torch threads (``threads``).

    Trainers warming it up at the same time oversubscribe a small machine's cores (measured: two
    250-step warm-ups with 2 torch threads each on 2 cores took 50 s each, one alone 3.5 s), and
    one cached copy is one genesis for all of them. The share, not every core: with two busy
    processes on the two cores a warm-up took 14.4 s with 2 threads and 5.6 s with 1 (quiet: 2.7 s
    and 3.6 s)."""
    import torch

    from pulsenet.nodes.common import initial_model

    torch.set_num_threads(threads)

    t0 = time.perf_counter()
    initial_model(trainer.model, trainer.cache_dir, seed=trainer.seed, warmup_steps=trainer.warmup_steps)
    console.print(f"tiny model warmed up ({time.perf_counter() - t0:.1f} s, cached in {trainer.cache_dir})")


def _check(c: UpConfig) -> None:
    """Settings no network can run with stop here, before anything is started."""
    if c.trainers < 1 or c.inference < 1 or c.rounds < 1:
        raise ConfigError("pulsenet up: --trainers, --inference and --rounds must be >= 1")
    from pulsenet.rl.models import resolve_model

    ref = resolve_model(c.model)  # a model that is not there stops here, with how to get it
    if c.memory_check and c.model != "tiny":  # the tiny model's nodes take ~0.5 GiB each, far below any budget
        _check_memory(c, ref)
    if c.max_staleness < 0:
        raise ConfigError("pulsenet up: --max-staleness must be >= 0")
    if c.node_threads < 0:
        raise ConfigError("pulsenet up: --node-threads must be >= 0 (0: the cores shared among the nodes)")


def _check_memory(c: UpConfig, ref: Any) -> None:
    """The nodes' peak memory budgets against this machine's available memory (nodes/memory.py);
    a model whose architecture cannot be read without weights here (SmolLM2 before its
    conversion) is not checked."""
    from pulsenet.nodes.memory import available_memory, network_refusal
    from pulsenet.rl.models import model_hf_config, served_layout

    available = available_memory()
    try:
        layout = served_layout(model_hf_config(ref))
    except (ConfigError, OSError):
        return
    if available is None:
        return
    params = sum(math.prod(shape) for shape, _ in layout.values())
    why = network_refusal(params, c.trainers, c.inference, c.engine, available)
    if why is not None:
        raise ConfigError(f"pulsenet up: {why}")
