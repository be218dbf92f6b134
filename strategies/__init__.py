"""Method code: each method's home (``strategies/<method>/``: settings and wire spec, server
rule, client rule; the baselines in ``baselines.py``), the round engine every method's server
side runs on (``engine/``), local training, and the method registry."""
