"""The `coordinator` command line: the top layer, above the RL loop (rl/).

    app.py          the commands (run, recover, status, doctor, timeline, export, config,
                    init-model, demo) and main(), the `coordinator` entry point
    args.py         the boundary helpers: the run directory's option (one declaration
                    for every command), rank weights, logging
    flags.py        the flags of `coordinator run` and `--set`, from the settings'
                    declarations
    local.py        the commands that work on this machine alone (init-model, demo)
    config_show.py  `coordinator config`: the resolved configuration, each value's origin
    config_doc.py   docs/CONFIG.md, generated from the declarations

`python -m coordinator_cli` is the same command as `coordinator`.  May import every
package below it (coordinator, rollout, trainer, rl); none of them imports it.
"""
