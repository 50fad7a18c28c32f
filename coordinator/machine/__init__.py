"""The per-node daemon and the phase machine it runs.

Joining the group (claims, membership, netaddr, group, refusal), liveness
(liveness, runtime, lifetime), waiting with a deadline (polling), one phase on
one rank (decisions, stepper, barrier, journal, actions), recovery without a
person (regroup, finished), the run's resolution at start (runplan), the daemon
itself and its log (daemon, daemon_log), and the interface of the actions a
kind registers (actions: the rl kind and the ML-free scripted one, rl/scripted.py,
live above).

May import: the base, records, storage and config; of ops, only runplan asks
status whether daemons still heartbeat before --new-run archives a run.
"""
