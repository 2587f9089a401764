"""Test-only code: what tests share (the CLI runner, lab handles, replay runners, fake
servers, GGUF shapes, the boot kit). Nothing in linkctl/ imports it."""
