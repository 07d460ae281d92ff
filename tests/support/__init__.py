"""Helpers shared by several test folders (importable because pytest's ``pythonpath``
includes ``tests/``)."""
