"""Which task failures are worth retrying: transient I/O only, never bad input or a bug."""

from __future__ import annotations

from prefect.states import State

PERMANENT_IO_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


def retry_on_transient_io(task: object, task_run: object, state: State) -> bool:
    """Prefect `retry_condition_fn`: retry an OSError (a full disk, a flaky mount), not a missing file."""
    try:
        state.result()
    except PERMANENT_IO_ERRORS:
        return False
    except OSError:
        return True
    except Exception:
        return False
    return False
