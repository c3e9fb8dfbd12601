"""Running evaluations: the quality sweep, fidelity measurements, and Ray."""
