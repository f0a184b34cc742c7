"""Where kb's definitions live in a Dagster deployment, so that they never collide with a user's own: asset keys
under a prefix (`kb/published_chunks`), jobs, sensors and the source partitions named with it (`kb_ingest`,
`kb_sources`), and kb's assets in kb's groups (ingestion, embeddings, maintenance) or in one group the user names.

kb's own code location uses DEFAULT; a user who loads kb into an existing code location picks another
(assets/definitions.py `kb_definitions`). kb's commands (`kb ingest`, `kb dagster ...`, `kb source ...`) address
DEFAULT's names.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import dagster as dg


@dataclass(frozen=True)
class Namespace:
    prefix: str = "kb"
    group: str | None = None  # None: kb's own groups

    def key(self, name: str) -> dg.AssetKey:
        return dg.AssetKey([self.prefix, name])

    def name(self, name: str) -> str:
        return f"{self.prefix}_{name}"

    def group_of(self, group: str) -> str:
        return self.group or group

    @cached_property
    def sources(self) -> dg.DynamicPartitionsDefinition:
        """One partition per declared source (assets/partitions.py keeps them in step with the declarations)."""
        return dg.DynamicPartitionsDefinition(name=self.name("sources"))


DEFAULT = Namespace()
