"""The evidence matrix, by concern: ``protocol`` (scenarios, rows, grids, what a cell keeps),
``cells`` (running and storing cells), ``stats`` (over seeds), ``claims`` (the papers' claims
judged), ``report`` (report.md and its plots). ``bench/matrix.py`` is the command."""
