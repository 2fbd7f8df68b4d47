"""The TCP port an agent listens on unless told otherwise: here, apart from the agent, so that
the command line can name it in its help without importing the agent (trio, the wire)."""
DEFAULT_PORT = 4750
