"""Shared by tests and benchmarks (never by the product): start and stop a real server, read the reference.

``harness.server``: ``launch.py`` as a subprocess in its own process group with a unique instance id, stopped
and swept on every path. ``harness.reference``: the greedy reference outputs.
"""
