"""Window geometry, planners and schedules for window-aligned sequence parallelism."""

# Importing the package registers every built-in planner ("lpt" lives in planner.py;
# "locality" registers itself on import), so any `import ditsp.windows.planner` sees both.
from . import locality  # noqa: F401
