"""The ingest flow: its stage registry, the run that executes it, and each stage (extract, parse, chunk, enrich, embed, publish, cards)."""
