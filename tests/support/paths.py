"""Where the checkout and its shipped data are, for tests."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROFILES = REPO / "linkctl" / "data" / "profiles"  # the shipped profiles
