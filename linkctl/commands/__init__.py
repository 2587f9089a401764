"""CLI command groups; each module registers its commands on the root typer app."""
