"""swarm: train convolutional networks across a swarm of small devices on one LAN."""

__version__ = "0.1.0"
