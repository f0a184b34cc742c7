"""kb's Dagster layer: thin assets over the stage functions in `pipelines/`. Definitions: assets.definitions."""
