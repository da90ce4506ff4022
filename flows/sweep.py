"""sweep-flow: one pretrain-flow run per trial of a sweep (params/sweep.py), ranked by the sweep's metric.

    for each trial (at most sweep.max_concurrency at once, each in a process of its own when several):
    pretrain-flow as a subflow, which the smoke gate stops early when the trial cannot learn
    -> rank the finished trials -> tag the best -> log the comparison
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture
from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner, ThreadPoolTaskRunner

from flows.pretrain import pretrain_flow
from params.sweep import SweepParams, Trial, load_sweep
from tasks.sweep import (
    SweepRecord,
    TrialOutcome,
    attach_trial,
    close_sweep_run,
    open_sweep_run,
    pipeline_run_of,
    record_sweep,
)
from tasks.tracking import REPO_ROOT, Tracking
from tasks.train import SmokeTestFailed

EXAMPLE_SWEEP = REPO_ROOT / "params" / "sweeps" / "lr_tiny.yaml"


class SweepFailed(RuntimeError):
    """No trial finished with the sweep's metric: there is nothing to choose."""


@task(name="sweep-trial", cache_policy=NO_CACHE)
def run_trial(trial: Trial, run_name: str, tracking: Tracking) -> TrialOutcome:
    """One pipeline run; a trial that fails the smoke gate is stopped, any other failure is recorded as failed.
    Neither fails the sweep: the other trials still say which values work."""
    # Its params are validated already; re-validating them through the flow signature fails in a pool worker
    # process, where pydantic cannot resolve the annotations of the flow it unpickled.
    trial_flow = pretrain_flow.with_options(flow_run_name=run_name, validate_parameters=False)
    state = trial_flow(trial.params, return_state=True)
    status, reason = "finished", None
    if not state.is_completed():
        error = state.result(raise_on_failure=False)
        status = "stopped" if isinstance(error, SmokeTestFailed) else "failed"
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    outcome = TrialOutcome(
        number=trial.number, label=trial.label(), assignment=trial.assignment, status=status,
        run_id=pipeline_run_of(tracking, str(state.state_details.flow_run_id)), reason=reason,
    )
    attach_trial(tracking, outcome)
    return outcome


def trial_runner(max_concurrency: int) -> TaskRunner:
    """One trial at a time runs in the sweep's own process; several at once run each in a worker process of its
    own, because MindSpore's context and compiled graphs belong to a process and are not shared between threads."""
    if max_concurrency == 1:
        return ThreadPoolTaskRunner(max_workers=1)
    return ProcessPoolTaskRunner(max_workers=max_concurrency)


@flow(name="sweep-trials", log_prints=True)
def sweep_trials(trials: list[Trial], name: str, tracking: Tracking, max_concurrency: int) -> list[TrialOutcome]:
    """The trials in order, at most `max_concurrency` at once, on the task runner the caller chose for this flow
    run (`trial_runner`): a flow's runner is fixed by its decorator, so the trials get a flow run of their own."""
    running: list[PrefectFuture] = []
    outcomes: list[TrialOutcome] = []
    for trial in trials:
        if len(running) == max_concurrency:  # the oldest finishes before another starts
            outcomes.append(running.pop(0).result())
        running.append(run_trial.submit(trial, f"{name}/trial-{trial.number}", tracking))
    return outcomes + [future.result() for future in running]


@flow(name="sweep-flow", log_prints=True)
def sweep_flow(sweep: SweepParams = load_sweep(EXAMPLE_SWEEP)) -> SweepRecord:  # noqa: B008 (Prefect reads the default)
    from prefect.runtime import deployment, flow_run

    trials = sweep.trial_list()
    name = flow_run.name or sweep.name
    tracking = open_sweep_run(sweep, trials, name, flow_run.id or "none", deployment.name)
    succeeded = False
    try:
        print(f"sweep {sweep.name}: {len(trials)} trials, ranked by {sweep.metric} ({sweep.goal})")
        trial_runs = sweep_trials.with_options(task_runner=trial_runner(sweep.max_concurrency))
        outcomes = trial_runs(trials, name, tracking, sweep.max_concurrency)
        record = record_sweep(tracking, sweep, outcomes)
        print(record.table)
        for outcome in record.trials:
            print(outcome.describe(sweep.metric))
        if record.best is None:
            raise SweepFailed(f"sweep {sweep.name}: no trial finished with a {sweep.metric} to rank by")
        print(f"best: {record.best.describe(sweep.metric)}; tagged llmflow.best_trial=true on run {record.best.run_id}")
        succeeded = True
        return record
    finally:
        close_sweep_run(tracking, succeeded)
