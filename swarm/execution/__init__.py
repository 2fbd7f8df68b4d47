"""Running a Plan: launching it on the swarm, the coordinator and the workers, their job channels,
moving blocks and halos, collectives, and replay after a lost device."""
