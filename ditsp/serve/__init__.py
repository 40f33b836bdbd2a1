"""`ditsp serve`: a restoration server in front of a persistent, elastic SP group (see docs/serve.md).

- :mod:`.store`: jobs in SQLite, inputs and results as files under the data dir;
- :mod:`.workers`: persistent worker processes that re-form process groups and share weights;
- :mod:`.controller`: the pull-based scheduler and the group's rebuilds;
- :mod:`.app`: the HTTP API; :mod:`.metrics`: Prometheus metrics.
"""

from .app import Settings, create_app

__all__ = ["Settings", "create_app"]
