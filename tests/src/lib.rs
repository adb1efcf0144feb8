//! Integration tests: real SPs and real mpirun jobs.
