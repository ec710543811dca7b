"""The package's version, written here alone: setup.cfg reads it (``attr:``) and ``memplan
--version`` prints it without asking the installed distribution's metadata, so a checkout run
without installing answers too."""

__version__ = "0.1.0"
