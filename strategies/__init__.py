"""Method code: each method's home (``strategies/<method>/``: settings and wire spec, server
rule, client rule; the baselines in ``baselines.py``), the engine every method's server side
runs on (``personalized/``), local training, and the method registry."""
