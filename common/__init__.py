"""Pieces both apps use: the run configuration and the local-federation launcher."""
