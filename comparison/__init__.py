"""Comparing methods over seeds, for the compare command (``launch/compare.py``) and the
evidence matrix (``bench/evidence``): ``runs`` reuses a stored run or runs it (one staleness
rule), ``stats`` summarises runs and compares methods (unstable seeds included),
``multiplicity`` judges a primary family with Holm's correction, ``table``, ``report`` and
``plots`` write what a comparison found."""
