"""The same chat turn run by Fleet's peers (RQ, Celery), for ``scripts/bench_peers.py``."""
