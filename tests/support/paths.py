"""Where the checkout, the tests and their recorded fixtures are."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
FIXTURES = TESTS / "fixtures"  # recorded real outputs (macOS commands, ping, probe reports)
SUPPORT = TESTS / "support"
PROFILES = REPO / "linkctl" / "data" / "profiles"  # the shipped profiles
