"""Where kb's definitions live in a Dagster deployment, so that they never collide with a user's own: asset keys
under a prefix (`kb/published_chunks`), jobs, sensors and the source partitions named with it (`kb_ingest`,
`kb_sources`), and kb's assets in kb's groups (ingestion, embeddings, maintenance) or in one group the user names.

kb's own code location uses DEFAULT; a user who loads kb into an existing code location picks another
(assets/definitions.py `kb_definitions`). kb's commands (`kb ingest`, `kb dagster ...`, `kb source ...`) address
DEFAULT's names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

import dagster as dg

# Letters and digits: with no "_" of its own, a prefix ends at the first "_" of a name, so two prefixes never make
# the same name (kb + refresh_x vs kb_refresh + x would).
PREFIX = re.compile(r"[A-Za-z][A-Za-z0-9]*")


@dataclass(frozen=True)
class Namespace:
    prefix: str = "kb"
    group: str | None = None  # None: kb's own groups

    def __post_init__(self) -> None:
        if not PREFIX.fullmatch(self.prefix):
            raise ValueError(f"kb's prefix {self.prefix!r} must be letters and digits, starting with a letter: it"
                             " begins kb's asset keys and the names of its jobs, schedules, sensors and partitions")

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
