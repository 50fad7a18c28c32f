"""The RL loop: rollout, aggregation, evaluation, training and serving, phase by phase.

Layers, bottom to top (tests/project/test_layers.py keeps the rule):
coordinator/ (the protocol and phase machine) < rollout/ (engines, tasks,
rewards, trajectories, aggregation) < trainer/ (GRPO under torchrun,
checkpoints) < rl/ (this package: what each phase does, the RL config, the
demo) < coordinator_cli/ (the `coordinator` command line).  The phase machine finds this
package through the `coordinator.actions` entry point (`rl.actions:KIND`).

Each phase's work is one function; the master's decision, where a phase has
one, another (rl/actions.py `PHASE_WORK`; tests/rl/test_rl_phase_table.py
compares this table with it):

<!-- rl-phases:start -->
| phase | work (every rank) | decision (master) |
|---|---|---|
| 0 sync | `plan.publish_shard_plans` | `plan.choose_policy` |
| 1 rollout | `rollouts.roll_out_train` | `rollouts.same_agent` |
| 2 rollout_done | `rollouts.finish_train_rollout` | - |
| 3 trajectories | `rollouts.report_trajectories` | `aggregation.pin_manifests` |
| 4 aggregate | `aggregation.aggregate_train` | - |
| 5 eval_decision | `evaluation.await_eval_decision` | `evaluation.decide_eval` |
| 6 eval | `evaluation.roll_out_eval` | `evaluation.merge_eval` |
| 7 stop_engine | `engines.stop_engine` | - |
| 8 prepare_training | `training.write_train_job` | - |
| 9 ready_to_train | `training.report_trainer` | `training.choose_trainer_group` |
| 10 train | `training.train` | - |
| 11 publish_checkpoint | `training.verify_new_checkpoint` | `training.announce_checkpoint` |
| 12 restart_engine | `engines.serve_new_policy` | - |
| 13 final_sync | `reporting.end_iteration` | - |
<!-- rl-phases:end -->

With a disaggregated placement (`run.train_nodes`, rl/placement.py)
phases 9-10 train on the training nodes only, and in an asynchronous run
(`run.max_off_policy_steps` >= 1) `training.train` on a rollout node rolls out
the next iteration instead (`rollouts.roll_out_next`), and on a split node
(some of its GPUs train, others roll out) does both at once (`ahead.train_alongside`).
"""
