"""One flag name per idea across every command: no synonyms, and a flag's short form is
the same wherever the flag is."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import typer

from linkctl.cli import app

# Names that have meant one idea in linkctl (or would): only one of each group may exist.
SYNONYMS = (
    {"--llama-bin-dir", "--bin-dir", "--llama-dir"},
    {"--split", "--tensor-split", "-ts"},
    {"--root", "--service-root"},
    {"--json", "--json-out"},
    {"--dry-run", "--plan", "-n"},
    {"--model", "--model-path"},
    {"--calibration", "--calibration-file"},
    {"--threads", "--jobs"},
)


def commands(cmd: Any = None, path: tuple[str, ...] = ()) -> list[tuple[str, Any]]:
    """Every leaf command of linkctl, by its full name ("service install")."""
    cmd = cmd or typer.main.get_command(app)
    subs = getattr(cmd, "commands", None)
    if subs is None:
        return [(" ".join(path), cmd)]
    return [leaf for name, sub in subs.items() for leaf in commands(sub, (*path, name))]


def options() -> dict[str, dict[str, frozenset[str]]]:
    """{flag: {command: every name of that option there}}."""
    out: dict[str, dict[str, frozenset[str]]] = defaultdict(dict)
    for name, cmd in commands():
        for p in cmd.params:
            if p.param_type_name != "option":
                continue
            names = frozenset(p.opts + p.secondary_opts)
            for flag in names:
                out[flag][name] = names
    return out


def test_the_walk_sees_every_command():
    names = {n for n, _ in commands()}
    assert {"estimate", "serve", "llama find", "service install", "lab demo", "doctor"} <= names


def test_one_name_per_idea():
    found = options()
    clashes = []
    for group in SYNONYMS:
        used = {flag: sorted(found[flag]) for flag in sorted(group) if flag in found}
        if len(used) > 1:
            clashes.append(" vs ".join(f"{f} ({', '.join(c)})" for f, c in used.items()))
    assert not clashes, "one idea, several flag names: " + "; ".join(clashes)


def test_a_flag_has_the_same_short_form_everywhere():
    differ = {
        flag: {c: sorted(names) for c, names in by_cmd.items()}
        for flag, by_cmd in options().items()
        if flag.startswith("--") and len(set(by_cmd.values())) > 1
    }
    assert not differ, f"a flag spelled differently across commands: {differ}"
