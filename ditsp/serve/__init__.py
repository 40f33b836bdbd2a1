"""`ditsp serve`: a restoration server in front of a persistent, elastic SP group (see docs/serve.md).

- :mod:`.store`: jobs in SQLite, inputs and results as files under the data dir;
- :mod:`.workers`: persistent worker processes that re-form process groups and share weights
  (:mod:`.boot`: a worker's first, light steps);
- :mod:`.controller`: the pull-based scheduler and the group's rebuilds;
- :mod:`.app`: the HTTP API (its parts: :mod:`.settings`, :mod:`.guard`, :mod:`.inputs`,
  :mod:`.jobs_routes`, :mod:`.health_routes`); :mod:`.metrics`: Prometheus metrics.

``Settings`` and ``create_app`` are loaded on first use: a worker process imports this package
before anything else and must not pay for the web stack (or live on after its server died meanwhile).
"""

__all__ = ["Settings", "create_app"]


def __getattr__(name):
    if name == "Settings":
        from .settings import Settings

        return Settings
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
