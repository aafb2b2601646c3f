"""Op families: each family's CPU and GPU kernels and its lowering rules, one file per family."""
