"""kb as a Dagster component, for a `dg` project: a folder under the project's defs holding a defs.yaml

    type: assets.component.KnowledgeBaseComponent
    attributes:
      prefix: kb          # asset keys kb/..., jobs kb_ingest..., partitions kb_sources
      group: search       # optional: every kb asset in this group (default: kb's own groups)

loads kb's definitions beside the project's own (`dg check defs`, `dg dev`). Settings still come from the code
location's environment (DATABASE_URL, KB_HOME, KB_EMBEDDER...), as for every other way of loading kb.
"""

import dagster as dg

from assets.definitions import kb_definitions
from assets.namespace import DEFAULT


class KnowledgeBaseComponent(dg.Component, dg.Model, dg.Resolvable):
    """kb's assets, checks, jobs and sensors (assets/definitions.py `kb_definitions`)."""

    prefix: str = DEFAULT.prefix
    group: str | None = None

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        return kb_definitions(self.prefix, self.group)
