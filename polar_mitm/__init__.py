"""polar-mitm: train coding agents with RL through their real, unmodified harnesses."""

__version__ = "0.1.0"
