"""swarm as a systemd service: the unit files (text only) and the notify protocol the agent speaks."""
