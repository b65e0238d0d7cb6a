//! The trainer side of the NCCL data plane on cudarc (issue 5; being written).
