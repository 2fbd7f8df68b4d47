"""Measuring devices for the planner: this device's per-layer times and memory, the links
between agents, and the planner's picture of the whole live swarm."""
