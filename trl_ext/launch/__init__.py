"""How the CLIs were launched: one process, or several (torchrun, ``accelerate launch``, mpirun)."""
