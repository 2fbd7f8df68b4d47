"""planner: the plan and everything that makes or changes one, as pure functions: model and device
descriptions, cost model, memory fit, simulator, the planners, re-planning, backups, routing."""
