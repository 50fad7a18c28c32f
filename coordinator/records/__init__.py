"""What the daemons exchange, and where it lies in the run directory.

The records (frozen dataclasses written as strict JSON: records, codec), the
layout of the run directory (layout), the fourteen phases and their rules
(phases), and the rank weights a run's record carries (weights).  Pure: no I/O.

May import: the base (coordinator.errors, coordinator.routing).
"""
