"""Rq tiers: RQ workers on the queues a tier's policy names, judged by the same pure ``decide``
as a turns tier (``inputs``: what it sees of them; ``reader``: RQ's Redis read; ``tiers``: the
commander's part)."""
