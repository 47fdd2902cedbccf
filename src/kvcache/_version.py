"""The package version, in a leaf module that the CLI, show_config and the build can read."""

__version__ = "0.2.0"
