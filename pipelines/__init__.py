"""kb's stage logic: plain Python, no Dagster. The Dagster layer lives in `assets/`."""
