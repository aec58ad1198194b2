"""The model's weights: reading and writing tensors, the trainer's weight-update group, CUDA IPC handles,
checksums, and sleep (releasing and restoring device memory)."""
