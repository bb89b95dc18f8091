"""Autoscaling offline: the trace model, a discrete-event simulator of one tier, baseline policies.

``trace`` turns the Azure LLM conversation trace into users' turns; ``simulate`` runs the
commander's ``decide()`` (or another policy) over them; ``policies`` holds Fleet's and the
baselines (static, HPA-like, KEDA-like, oracle). Used by ``scripts/bench_trace.py`` and its
tests, not by the control plane. Nothing here imports the data-plane explorer (``sim.store``
and its fakeredis).
"""
