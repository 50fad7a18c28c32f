"""What the daemons exchange, and where it lies in the run directory.

The records (frozen dataclasses written as strict JSON: records, codec), the
bounds of the numbers and names they carry (bounds), the layout of the run
directory (layout), the fourteen phases and their rules (phases).  The run's record carries each rank's weight as a number; what a
weight means is the action kind's (rollout/rank_weights.py).  Pure: no I/O.

May import: the base (coordinator.errors, coordinator.routing).
"""
