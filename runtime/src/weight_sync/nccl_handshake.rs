//! The messages of the NCCL weight-sync handshake (issue 5; being written).
