"""The commander's monitor: a web page and its JSON API, served by the leader.

``board`` is what the commander publishes each pass (no web framework); ``views`` turns it and
the stores' reads into the JSON the page shows (pure); ``api`` holds the endpoints and
``server`` the aiohttp application, with ``/metrics`` and ``/healthz``, served from its own
thread. Importing this package imports no web framework.
"""
