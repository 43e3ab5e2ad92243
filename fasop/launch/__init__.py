"""`fasop emit`: Slurm and Megatron-LM launch scripts for one plan (see fasop.launch.write for the files)."""
