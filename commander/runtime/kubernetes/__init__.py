"""The ``kubernetes`` runtime: one worker Deployment per tier (``runtime.py`` says how).

Only ``api.py`` and ``runtime.py`` need the official client (the ``k8s`` extra); the pure
modules (``model.py``, ``clone.py``, ``reconcile.py``) import without it.
"""
