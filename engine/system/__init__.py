"""What the engine reads from the machine it runs on: container CPU and memory limits, the thread budget
beside other processes, the cache directory, pinned host copies to the device, and host memory that
stays untouched until written."""
