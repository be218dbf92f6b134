"""Pieces both apps use: the run configuration, the message protocol and the round record."""
