"""The control plane: observe, decide (pure), act through a runtime, keep the ledger.

- the loop: ``commander`` (``Commander``), run by ``__main__``; ``settings``;
- leadership and records: ``leadership`` (the lease), ``ledger_writer``, ``presence``,
  ``decide_states``;
- observe: ``observe`` (reports, registry, signals), ``evaluator``, ``outages``,
  ``decide_inputs`` (what ``decide`` sees), ``tier_policies``;
- decide (pure): ``decide`` with ``signals``, ``scaleup``, ``scalein``, ``capacity``, ``limits``,
  ``bounds``, ``holdtime``, over ``snapshot`` and ``tierstate``;
- act: ``actor``, ``runtime_watch``, ``dead_workers`` (takeover), ``failover``, ``runtime/``;
- features: ``rollouts/`` (groups), ``rq/`` (rq tiers); publish: ``publish``, ``metrics``,
  ``turn_metrics``, ``monitor/``.
"""
