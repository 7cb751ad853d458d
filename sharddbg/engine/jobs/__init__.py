"""Recording a job started from a terminal (``sharddbg record -- torchrun ... train.py``), in each of its
processes, unchanged.

The launcher (``sharddbg.cli``) puts ``site/`` first on ``PYTHONPATH`` and the job's settings in the
environment (``settings.ENV_SETTINGS``); Python then runs ``site/sitecustomize.py`` in every process of the
job, which calls ``bootstrap.start_from_environment()``:

- a torchrun worker (``RANK`` set) or the one process of a plain ``python train.py`` records: the same
  ``Recorder`` as the notebook's, with the job's ``RecordingOptions``, streaming to its own file in the job's
  folder (``stream.RankStreamWriter``; the format: ``sharddbg.job_files``); ``worker.JobRecording`` ties it
  to the process's life (optimizer steps for ``--steps``, the process group's start for the clock, hangs,
  exit, SIGTERM);
- torchrun's own agent process records nothing: it notes how each worker ended (``agent.py``);
- a process started by a recording process (a data-loader worker) records nothing.

No patch is registered and nothing the job computes changes; physicsnemo is hooked only if the job imports it.
"""
