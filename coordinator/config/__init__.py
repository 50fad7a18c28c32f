"""A run's configuration: what the user declares, before anything is shared.

Settings declared once, with their type, default, bounds and help (settings);
the coordinator's sections and the file they load from (run_config), an action
kind adding [run] keys of its own (the rl kind's placement: rl/placement.py);
what the survivors of a failure do (on_failure).

May import: the base and records (never storage: a configuration comes from the
user's file and command line, not from the run directory).
"""
