"""``pulsenet chaos``: a seeded fault schedule against a local network, and a checker that audits the
run from its own records (docs/reliability.md).

- ``faults.py``: ``ChaosConfig`` and the schedule, injected through the launcher's ``Injector`` hook
  (the network and its supervision are ``pulsenet up``'s own);
- ``link.py``: one node's link to the store as a relay that can be throttled or cut;
- ``check.py``: the audit (verified serving, forks, monotonic versions, convergence, recoveries,
  orphans, store retention, RSS and descriptors);
- ``run.py``: the command: run, audit, verdict, JSON.
"""
