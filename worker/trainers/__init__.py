"""The task-side trainers, one per strategy that trains (``strata.strategies`` names each by
``Strategy.runners``): ``data_parallel`` (multi_worker_mirrored), ``gpipe`` (pipeline and
hybrid: the chief's GPipe driver), ``ps_chief`` (parameter_server's chief). Each is a
``strata.worker.runner.TrainingRunner``; the plain server tasks run ``strata.worker.server``."""
