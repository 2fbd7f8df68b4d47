"""This machine: its usable cores and memory, its accelerator, its state directory (node id and
cluster token), the settings file `swarm join` reads, and how its processes use malloc."""
