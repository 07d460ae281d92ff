"""Tests that need a real Ray: they share one cluster (conftest.py), torn down when the
last test of this package ends so later packages start without Ray."""
