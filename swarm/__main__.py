"""`python -m swarm` runs the command line."""
import sys

from swarm.cli import main

sys.exit(main())
