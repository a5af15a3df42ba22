"""The router: one OpenAI-compatible endpoint in front of several fdserve instances (issue 14, item 4).

A separate process (``python -m router --prefill URL... --decode URL... [--mixed URL...]``) that talks to its
backends over HTTP only. ``backends`` owns the backend pool (health, in-flight counts, the pick),
``proxy`` the forwarding of one request (plain to a mixed instance, prefill-then-decode for P/D),
``app`` the HTTP routes, ``metrics`` its Prometheus counters and ``cli`` the command line.
It imports nothing of the engine but two protocol-free helpers of the API server (uvicorn set-up, the
disconnect-aware streaming response) and ``config.log``.
"""
