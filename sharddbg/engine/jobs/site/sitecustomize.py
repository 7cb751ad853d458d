# Put first on PYTHONPATH by `sharddbg record`: Python runs this file at the start of every process of the job.
# It starts sharddbg's recording where it belongs (sharddbg.engine.jobs), then runs the sitecustomize that this
# one hides, if there is one, so that the job's own start-up stays as it was.
import os as _os
import sys as _sys


def _start_recording():
    try:
        from sharddbg.engine.jobs.bootstrap import start_from_environment

        start_from_environment()
    except Exception as exc:  # the job runs as it would without sharddbg
        print(f"sharddbg: recording could not start in process {_os.getpid()}: {type(exc).__name__}: {exc} "
              f"(the job runs unrecorded)", file=_sys.stderr, flush=True)


def _run_hidden_sitecustomize():
    import importlib.machinery
    import importlib.util

    here = _os.path.dirname(_os.path.abspath(__file__))
    rest = [p for p in _sys.path if _os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_start_recording()
_run_hidden_sitecustomize()
