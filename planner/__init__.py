"""planner: model cost description, device profiles, cost model, simulator, plan search (pure functions)."""
