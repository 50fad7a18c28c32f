"""coordinator: the protocol the nodes keep through nothing but a shared filesystem.

    coordinator/
      errors.py, routing.py   the base: exceptions and their exit codes; where a path
                              of the run directory lives (a filesystem or a bucket)
      records/                what the daemons exchange, and where it lies
      storage/                the shared filesystem or bucket under the protocol
      config/                 a run's configuration, before anything is shared
      machine/                the per-node daemon and its phase machine
      ops/                    operator tools: doctor, status, timeline, recover

Each wing imports only the base and the wings below it: records < storage, config
< machine < ops (storage and config side by side); each wing's docstring says which.
tests/project/test_layers.py checks it, beside the packages' own order
(coordinator < rollout < trainer < rl).
"""
