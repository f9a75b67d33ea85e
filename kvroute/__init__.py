"""kvroute: the distribution's own namespace — version and the ``kvroute`` command line.

Owns nothing but the CLI entry point; each subcommand imports its package lazily so that
``kvroute serve`` never loads the replay harness or the simulator.
"""

__version__ = "0.1.0"
