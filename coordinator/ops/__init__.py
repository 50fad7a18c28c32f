"""Operator tools: doctor, status, timeline, recover.

They read the run directory; the protocol never imports them, except runplan,
which asks status whether daemons still heartbeat before --new-run archives a run.

May import: every other wing (records, storage, config, machine) and the base.
"""
