"""Execution engines behind the job queue: the local worker (default) and Ray Serve
(``ray_engine``), which scales the same PipelineManager out over many devices and machines."""
