"""The job system: a persistent SQLite queue and one supervised worker process.

``queue.JobQueue`` (rows, ordering, recovery), ``worker`` (the process that owns the
PipelineManager), ``supervisor.Supervisor`` (starts/feeds/restarts the worker),
``adapters.AdapterResolver`` (which adapter file a request means, and the path rules).
"""
