"""The real single-machine SLURM cluster the SLURM tests run on (cluster.sh) and its Python driver (cluster.py)."""
