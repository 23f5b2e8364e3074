"""Sync algorithms: one file, one class, one YAML in conf/sync/ each."""
