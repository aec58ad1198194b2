"""The model's weights: reading and writing tensors, the trainer's weight-update group, CUDA IPC handles,
checksums, sleep's levels, and the operations callers make on the weights and memory (`operations`)."""
