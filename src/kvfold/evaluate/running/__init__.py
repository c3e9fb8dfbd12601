"""Running evaluations: the quality sweep, fidelity measurements, Ray, and finished runs read back.

:mod:`~kvfold.evaluate.running.sweep` holds what every sweep shares (work items, runners, resuming);
:mod:`~kvfold.evaluate.running.runner` the quality sweep, :mod:`~kvfold.evaluate.running.fidelity`
the fidelity sweep (its continuations and measures in :mod:`~kvfold.evaluate.running.fidelity_measures`),
:mod:`~kvfold.evaluate.running.distributed` the Ray runner, :mod:`~kvfold.evaluate.running.results`
the run folders read back (``kvfold report``).
"""
