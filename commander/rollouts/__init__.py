"""A tier's groups, seen from the commander: each group's pool ``<tier>.<group>`` is observed,
decided and acted on like a tier, with its group's policy (``protocol.groups``).

- ``pools``: which pools a pass judges, and the policy each one runs;
- ``weights``: a change of the groups' weights is a ``rollout`` in the ledger, and the rollout
  guard aborts a failing canary (its weight to 0), judged by ``canary`` (pure);
- ``rejection``: a group whose interpreter cannot run its handler is rejected (weight 0 for
  assignment) and accepted again once it can;
- ``removed``: the workers of a pool no group names any more are drained, and the users still
  queued on it are handed to their groups.
"""
