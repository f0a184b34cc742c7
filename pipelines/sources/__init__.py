"""Sources: declarations (kb.toml, `kb source ...`) with their audit trail, and staleness sweeps."""
