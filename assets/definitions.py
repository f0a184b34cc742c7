"""The single place that builds kb's Dagster Definitions (loaded by workspace.yaml and `dagster dev`)."""

import dagster as dg

from assets.ingestion import ASSETS, CHECKS
from assets.resources import KnowledgeBase

ingest_job = dg.define_asset_job("ingest", selection=dg.AssetSelection.assets(*ASSETS),
                                 description="Crawl every source and bring the knowledge base up to date.")

defs = dg.Definitions(
    assets=ASSETS,
    asset_checks=CHECKS,
    jobs=[ingest_job],
    resources={"kb": KnowledgeBase()},
)
