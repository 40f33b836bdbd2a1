"""Window geometry, plans, planners, schedules and the row exchange for window-aligned SP."""
