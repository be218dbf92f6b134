"""Launchers: what starts Flower's processes on this machine for the demo, the tests and the
benchmarks (a private simulation SuperLink, a loopback deployment) and checks a run config
before the run starts. Not part of the app: the bundle that ships to every site (the FAB,
``fab-include``) leaves this package out."""
